"""Evolving values and initial state under real Spark: a streaming query's record values gain and lose a field
between two runs, a migration runs once under a replayed batch, and stores start from DataFrames loaded once
before the first batch (not again after a restart, refused on state no load made)."""

from __future__ import annotations

import shutil
from collections import Counter
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest

from statebackend.config import Settings
from statebackend.errors import ConfigError
from statebackend.spark import StatefulForeachBatch, read_state
from statebackend.spark.initial import INITIAL_OFFSET
from statebackend.task import TaskStorage
from tests import record_values as rv
from tests.spark_helpers import output_of, stream_text_files, word_job
from tests.test_spark import batch_words, make_config

pytest_plugins = ["tests.spark_fixtures"]
pytestmark = [pytest.mark.spark, pytest.mark.slow]

NUM_TASKS = 2
OUTPUT = "word string, count double"
V1 = "record:tests.record_values:CountV1"
V2 = "record:tests.record_values:CountV2"


# -- job functions (module level: pickled by reference, imported on the executors) ------------------------------


def count_words(stores: Any, rows: Any, step: Callable[[Any, int, int], Any]) -> list[tuple[str, float]]:
    """Word count into store counts: each word's new value is ``step(old value or None, its count in the batch,
    batch id)``; the output is each word's new count."""
    counts = stores["counts"]
    output = []
    for word, n in sorted(Counter(row.word for row in rows).items()):
        new = step(counts.get(word), n, stores.batch_id)
        counts.put(word, new)
        output.append((word, float(new.count)))
    return output


def next_v1(old: rv.CountV1 | None, n: int, batch_id: int) -> rv.CountV1:
    return rv.CountV1(n + (old.count if old else 0), old.first if old else f"b{batch_id}")


def next_v2(old: Any, n: int, batch_id: int) -> rv.CountV2:
    assert old is None or isinstance(old, rv.CountV2), old
    return rv.CountV2((old.count if old else 0.0) + n, f"b{batch_id}")


def next_v3(old: rv.CountV3 | None, n: int, batch_id: int) -> rv.CountV3:
    return rv.CountV3(n + (old.count if old else 0), old.first if old else batch_id, old.tag if old else "")


def count_v1(stores: Any, rows: Any) -> list[tuple[str, float]]:
    """Word count into CountV1 values: the count, and the batch a word was first seen in."""
    return count_words(stores, rows, next_v1)


def count_v2(stores: Any, rows: Any) -> list[tuple[str, float]]:
    """The same count into CountV2 values (first dropped, last added, count a float); old values read as CountV2."""
    return count_words(stores, rows, next_v2)


def count_v3(stores: Any, rows: Any) -> list[tuple[str, float]]:
    """The same count into CountV3 values (the first batch as a number, and a tag), after the split-first migration."""
    return count_words(stores, rows, next_v3)


# -- helpers ------------------------------------------------------------------------------------------------------


def config_for(tmp_path: Path, msg_serde: str, **extra: object) -> dict[str, object]:
    return make_config(tmp_path, **{"job.name": "values", "stores.counts.msg.serde": msg_serde, **extra})


def state_of(config: dict[str, object], scratch: Path, num_tasks: int = NUM_TASKS) -> dict[str, Any]:
    """Every task's store, read typed from the blob store alone (each task restored into a scratch dir)."""
    state: dict[str, Any] = {}
    for index in range(num_tasks):
        local = scratch / f"read-{index}"
        with TaskStorage.open(dict(config, **{"state.local.dir": str(local)}), f"task-{index}") as task:
            state.update(task.store("counts").items())
        shutil.rmtree(local)
    return state


def run_batch(spark: Any, job: StatefulForeachBatch, batch_id: int) -> list[tuple[str, float]]:
    frame = spark.createDataFrame([(w,) for w in batch_words(batch_id)], "word string")
    return sorted((row.word, row["count"]) for row in output_of(job, frame, batch_id).collect())


def word_counts(batch_ids: list[int]) -> Counter[str]:
    return Counter(w for b in batch_ids for w in batch_words(b))


# -- tests --------------------------------------------------------------------------------------------------------


def test_a_streaming_querys_values_gain_and_lose_a_field_between_two_runs(spark: Any, tmp_path: Path) -> None:
    source = tmp_path / "input"
    source.mkdir()
    outputs: dict[int, dict[str, float]] = {}

    def sink(frame: Any, batch_id: int) -> None:
        outputs[batch_id] = {row.word: row["count"] for row in frame.collect()}

    def run_query(fn: Any, msg_serde: str, batches: range) -> None:
        for batch in batches:
            (source / f"part-{batch:03d}.txt").write_text("\n".join(batch_words(batch)) + "\n")
        job = word_job(fn, config_for(tmp_path, msg_serde), num_tasks=NUM_TASKS, output_schema=OUTPUT, sink=sink)
        stream_text_files(spark, job, source, tmp_path / "spark-checkpoint")

    run_query(count_v1, V1, range(2))
    # which file a batch read is Spark's choice: the batch ids a word was seen in come from the outputs
    first = {w: min(b for b in (0, 1) if w in outputs[b]) for w in word_counts([0, 1])}
    assert state_of(config_for(tmp_path, V1), tmp_path) == {
        w: rv.CountV1(n, f"b{first[w]}") for w, n in word_counts([0, 1]).items()
    }
    run_query(count_v2, V2, range(2, 4))  # the next deployment: the class changed, the state stays
    totals = word_counts([0, 1, 2, 3])
    last = {w: max(b for b in (2, 3) if w in outputs[b]) for w in word_counts([2, 3])}
    assert {w: outputs[b][w] for w, b in last.items()} == {w: float(totals[w]) for w in last}
    assert state_of(config_for(tmp_path, V2), tmp_path) == {
        w: rv.CountV2(float(n), f"b{last[w]}" if w in last else "") for w, n in totals.items()
    }
    # read_state gives the values as the current class's fields: V1 values (words not seen since) as V2 reads them
    frame = read_state(spark, config_for(tmp_path, V2), "counts", num_tasks=NUM_TASKS)
    assert frame.schema["value"].dataType.simpleString() == "struct<count:double,last:string>"
    assert {row.key: row.value.asDict() for row in frame.collect()} == {
        w: {"count": float(n), "last": f"b{last[w]}" if w in last else ""} for w, n in totals.items()
    }


def test_read_state_gives_a_record_store_as_a_struct_of_every_field_type(spark: Any, tmp_path: Path) -> None:
    config = make_config(
        tmp_path, **{"job.name": "every", "stores.counts.msg.serde": "record:tests.record_values:Every"}
    )
    values = {
        "full": rv.Every(1, 2.5, True, "s\u00e9", b"\x00\xff", [1, {"b": 2, "a": None}], "n", -3, {"k\u00e9": [1]}),
        "sparse": rv.Every(-(1 << 63), -0.0, False, "", b"", []),
    }
    with TaskStorage.open(config, "task-0") as task:
        for key, value in values.items():
            task.store("counts").put(key, value)
        task.commit_durably({"batch": "0", "tasks": "1"})
    frame = read_state(spark, config, "counts", num_tasks=1)
    assert frame.schema["value"].dataType.simpleString() == (
        "struct<i:bigint,f:double,b:boolean,s:string,raw:binary,items:string,note:string,n:bigint,props:string>"
    )
    rows = {row.key: row.value.asDict() for row in frame.collect()}
    assert {key: {**row, "raw": bytes(row["raw"])} for key, row in rows.items()} == {
        "full": {
            "i": 1,
            "f": 2.5,
            "b": True,
            "s": "s\u00e9",
            "raw": b"\x00\xff",
            "items": '[1,{"a":null,"b":2}]',
            "note": "n",
            "n": -3,
            "props": '{"k\u00e9":[1]}',
        },
        "sparse": {
            "i": -(1 << 63),
            "f": -0.0,
            "b": False,
            "s": "",
            "raw": b"",
            "items": "[]",
            "note": None,
            "n": None,
            "props": None,
        },
    }
    # a class that cannot be imported where read_state runs: refused on the driver, naming the class and the store
    gone = dict(config, **{"stores.counts.msg.serde": "record:tests.no_such_module:Every"})
    with pytest.raises(ConfigError, match="stores.counts.msg.serde.*tests.no_such_module"):
        read_state(spark, gone, "counts", num_tasks=1)


def test_a_rescaled_task_reads_the_record_values_it_copies_with_their_schemas(spark: Any, tmp_path: Path) -> None:
    """num_tasks 2 -> 3 in the run that also changes the class: each new task copies V1 values as stored from the
    old tasks, and its checkpoints record V1's schema beside V2's, so they read in this and every later batch."""
    job = word_job(count_v1, config_for(tmp_path, V1), num_tasks=2, output_schema=OUTPUT)
    run_batch(spark, job, 0)
    evolved = config_for(tmp_path, V2)
    job = word_job(count_v2, evolved, num_tasks=3, output_schema=OUTPUT)
    run_batch(spark, job, 1)
    run_batch(spark, job, 2)
    totals = word_counts([0, 1, 2])
    last = {w: max(b for b in (1, 2) if w in batch_words(b)) for w in word_counts([1, 2])}
    assert state_of(evolved, tmp_path, num_tasks=3) == {
        w: rv.CountV2(float(n), f"b{last[w]}" if w in last else "") for w, n in totals.items()
    }


def test_a_migration_runs_once_per_task_also_when_its_batch_is_replayed(spark: Any, tmp_path: Path) -> None:
    config = config_for(tmp_path, V1)
    job = word_job(count_v1, config, num_tasks=NUM_TASKS, output_schema=OUTPUT)
    run_batch(spark, job, 0)
    migrating = config_for(
        tmp_path,
        "record:tests.record_values:CountV3",
        **{
            "stores.counts.migration.id": "split-first",
            "stores.counts.migration.function": "tests.record_values:split_first",
        },
    )
    job = word_job(count_v3, migrating, num_tasks=NUM_TASKS, output_schema=OUTPUT)
    first = run_batch(spark, job, 1)
    assert run_batch(spark, job, 1) == first  # a replay migrates the state before batch 1 again, and lands once
    run_batch(spark, job, 2)
    expected = {
        w: rv.CountV3(n, 0, "b0")
        if w in batch_words(0)
        else rv.CountV3(n, min(b for b in (1, 2) if w in batch_words(b)))
        for w, n in word_counts([0, 1, 2]).items()
    }
    assert state_of(migrating, tmp_path) == expected
    for index in range(NUM_TASKS):  # the migration's name is in the newest checkpoint of every task
        with TaskStorage.open(dict(migrating, **{"state.local.dir": str(tmp_path / "peek")}), f"task-{index}") as t:
            assert t.restored is not None and t.restored.serdes["counts"]["msg.migration"] == "split-first"
        shutil.rmtree(tmp_path / "peek")


def test_stores_start_from_an_initial_state_loaded_once(spark: Any, tmp_path: Path) -> None:
    config = config_for(tmp_path, V1)
    initial = {f"w{i}": (100 + i, "seed") for i in range(0, 23, 2)} | {"only-initial": (7, "seed")}
    frame = spark.createDataFrame(
        [(w, {"count": c, "first": f}) for w, (c, f) in initial.items()],
        "key string, value struct<count: long, first: string>",
    )
    job = word_job(count_v1, config, num_tasks=NUM_TASKS, output_schema=OUTPUT, initial_state={"counts": frame})
    output = dict(run_batch(spark, job, 0))
    assert all(output[w] == initial.get(w, (0, ""))[0] + n for w, n in word_counts([0]).items())
    assert run_batch(spark, job, 0) == sorted(output.items())  # a replay of batch 0 starts from the load again
    run_batch(spark, job, 1)
    # a restart: a new driver object with the same initial_state loads nothing (its state records the load)
    restarted = word_job(
        count_v1, config, num_tasks=NUM_TASKS, output_schema=OUTPUT, initial_state={"counts": lambda session: frame}
    )
    run_batch(spark, restarted, 2)
    counts = word_counts([0, 1, 2])
    expected = {
        w: rv.CountV1(
            initial.get(w, (0, ""))[0] + counts[w],
            "seed" if w in initial else f"b{min(b for b in (0, 1, 2) if w in batch_words(b))}",
        )
        for w in set(counts) | set(initial)
    }
    assert state_of(config, tmp_path) == expected
    for index in range(NUM_TASKS):  # each task committed the load once, as the checkpoint before batch 0
        with TaskStorage.open(dict(config, **{"state.local.dir": str(tmp_path / "peek")}), f"task-{index}") as t:
            loads = [e for e in t.checkpoint_log.entries() if INITIAL_OFFSET in e.checkpoint.input_offsets]
            assert [(e.seq, e.checkpoint.input_offsets["batch"]) for e in loads] == [(1, "-1")]
            assert t.restored is not None and t.restored.serdes["counts"]["initial"] == "before batch 0"
        shutil.rmtree(tmp_path / "peek")


def test_a_load_run_again_before_the_first_batch_loads_no_task_twice(spark: Any, tmp_path: Path) -> None:
    config = make_config(tmp_path, **{"job.name": "seeded"})  # string keys, integer values
    frame = spark.createDataFrame([(f"w{i}", 10) for i in range(23)], "word string, value long")
    batch = spark.createDataFrame([(w,) for w in batch_words(0)], "word string")
    from tests.test_spark import count_rows

    def seeded_job() -> StatefulForeachBatch:
        """A new driver object of the job with the initial state, as each start of the driver makes."""
        schema = "word string, count long"
        return word_job(count_rows, config, num_tasks=NUM_TASKS, output_schema=schema, initial_state={"counts": frame})

    first = seeded_job()
    assert first.initial_state is not None
    first.initial_state.load_once(first, batch, Settings.from_config(config), 0)  # the driver stops after the load
    again = seeded_job()
    output = {row.word: row["count"] for row in output_of(again, batch, 0).collect()}
    assert all(output[w] == 10 + n for w, n in word_counts([0]).items() if w.startswith("w"))
    for index in range(NUM_TASKS):
        with TaskStorage.open(dict(config, **{"state.local.dir": str(tmp_path / "peek")}), f"task-{index}") as t:
            assert [e.checkpoint.input_offsets["batch"] for e in t.checkpoint_log.entries()] == ["-1", "0"]
        shutil.rmtree(tmp_path / "peek")


def test_an_initial_state_is_refused_on_state_no_load_made(spark: Any, tmp_path: Path) -> None:
    config = config_for(tmp_path, V1)
    job = word_job(count_v1, config, num_tasks=NUM_TASKS, output_schema=OUTPUT)
    run_batch(spark, job, 0)
    frame = spark.createDataFrame(
        [("w1", {"count": 1, "first": "x"})], "key string, value struct<count: long, first: string>"
    )
    late = word_job(count_v1, config, num_tasks=NUM_TASKS, output_schema=OUTPUT, initial_state={"counts": frame})
    with pytest.raises(
        ConfigError, match="job 'values' already has state .*that no initial load of store\\(s\\) 'counts' made"
    ):
        run_batch(spark, late, 1)
    with pytest.raises(ConfigError, match="no store 'nope' in the configuration"):
        run_batch(
            spark,
            word_job(count_v1, config, num_tasks=NUM_TASKS, output_schema=OUTPUT, initial_state={"nope": frame}),
            1,
        )
    wrong_type = spark.createDataFrame(
        [(1, {"count": 1, "first": "x"})], "key long, value struct<count: long, first: string>"
    )
    fresh = config_for(tmp_path / "fresh", V1)
    with pytest.raises(ConfigError, match="column 'key' is long but the key column 'word' of the stream is string"):
        run_batch(
            spark,
            word_job(count_v1, fresh, num_tasks=NUM_TASKS, output_schema=OUTPUT, initial_state={"counts": wrong_type}),
            0,
        )
    assert state_of(config, tmp_path) == {w: rv.CountV1(n, "b0") for w, n in word_counts([0]).items()}
