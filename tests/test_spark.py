"""End to end on real local Spark: after the query, the state equals a batch computation over all the input.

Most tests call the ``foreachBatch`` callable directly with a static DataFrame per batch id: that is exactly what
Spark does with each micro-batch, and it lets a test replay a batch, fail a task or wipe the local state at a chosen
point. One test runs a real streaming query over files, stopped and restarted from its Spark checkpoint.
"""

from __future__ import annotations

import shutil
from pathlib import Path
from typing import Any, Self

import pytest

from statebackend.spark import StatefulForeachBatch, read_state
from tests.backend_helpers import counts_config
from tests.spark_helpers import first_time, output_of, stream_text_files, task_stats, word_job

pytest_plugins = ["tests.spark_fixtures"]  # the session-wide ``spark`` fixture
pytestmark = [pytest.mark.spark, pytest.mark.slow]

NUM_TASKS = 3
OUTPUT = "word string, count long"


# -- job functions (module level: they are pickled by reference and imported on the executors) -----------------


def count_rows(stores: Any, rows: Any) -> list[tuple[str, int]]:
    """Word count, one row at a time; outputs each word's new total."""
    counts = stores["counts"]
    totals: dict[str, int] = {}
    for row in rows:
        total = (counts.get(row.word) or 0) + 1
        counts.put(row.word, total)
        totals[row.word] = total
    return sorted(totals.items())


def count_arrow(stores: Any, batches: Any) -> Any:
    import pyarrow as pa

    counts = stores["counts"]
    received = list(batches)
    words: list[str] = []
    totals: list[int] = []
    if received:
        table = pa.Table.from_batches(received)
        grouped = table.group_by("word").aggregate([("word", "count")])
        for word, n in zip(grouped.column("word").to_pylist(), grouped.column("word_count").to_pylist(), strict=True):
            total = (counts.get(word) or 0) + n
            counts.put(word, total)
            words.append(word)
            totals.append(total)
    return pa.table({"word": pa.array(words, pa.string()), "count": pa.array(totals, pa.int64())})


def count_pandas(stores: Any, frame: Any) -> Any:
    import pandas as pd

    counts = stores["counts"]
    words: list[str] = []
    totals: list[int] = []
    for word, n in frame["word"].value_counts().items():
        total = (counts.get(word) or 0) + int(n)
        counts.put(word, total)
        words.append(word)
        totals.append(total)
    return pd.DataFrame({"word": pd.Series(words, dtype=object), "count": pd.Series(totals, dtype="int64")})


COUNTERS = {"rows": count_rows, "arrow": count_arrow, "pandas": count_pandas}


class FailOnceAfterWriting:
    """Writes the batch, then raises on the first attempt of (batch, task) that sees the marker absent."""

    def __init__(self, marker: Path, batch_id: int, task_index: int) -> None:
        self.marker = str(marker)
        self.batch_id = batch_id
        self.task_index = task_index

    def __call__(self, stores: Any, rows: Any) -> list[tuple[str, int]]:
        output = count_rows(stores, rows)
        if stores.batch_id == self.batch_id and stores.task_index == self.task_index and first_time(self.marker):
            raise RuntimeError("injected failure before the commit")
        return output


class FailOnceAfterCommit:
    """Counts normally, but the task's output fails to serialize once, i.e. after the task committed its state."""

    def __init__(self, marker: Path, batch_id: int, task_index: int) -> None:
        self.marker = str(marker)
        self.batch_id = batch_id
        self.task_index = task_index

    def __call__(self, stores: Any, rows: Any) -> list[Any]:
        output: list[Any] = list(count_rows(stores, rows))
        if stores.batch_id == self.batch_id and stores.task_index == self.task_index:
            output.append(_ExplodesOnce(self.marker))
        return output


class _ExplodesOnce(tuple):  # type: ignore[type-arg]
    """An output row (a well-formed one: it passes the check against the output schema before the commit) that
    cannot be pickled the first time: the task fails after its commit was durable."""

    marker: str

    def __new__(cls, marker: str) -> Self:
        row = super().__new__(cls, ("sentinel", -1))
        row.marker = marker
        return row

    def __reduce__(self) -> Any:
        if first_time(self.marker):
            raise RuntimeError("injected failure after the commit")
        return (tuple, (("sentinel", -1),))


# -- helpers ------------------------------------------------------------------------------------------------------


def make_config(tmp_path: Path, **extra: object) -> dict[str, object]:
    """Job ``wordcount``: store ``counts`` (word -> count) on changelog, a snapshot every two commits."""
    return {**counts_config(tmp_path, job="wordcount"), "changelog.snapshot.interval.commits": 2, **extra}


def batch_words(batch_id: int) -> list[str]:
    """Deterministic input of a batch: a few words that repeat across batches, and some new ones."""
    return [f"w{(batch_id * 7 + i * i) % 23}" for i in range(40)] + [f"new{batch_id}-{i}" for i in range(3)]


def run_batch(spark: Any, job: StatefulForeachBatch, batch_id: int) -> list[tuple[str, int]]:
    frame = spark.createDataFrame([(w,) for w in batch_words(batch_id)], "word string")
    output = output_of(job, frame, batch_id)
    return sorted((row.word, row["count"]) for row in output.collect())


def state_of(spark: Any, config: dict[str, object], checkpoint: str | int = "latest") -> dict[str, int]:
    rows = read_state(spark, config, "counts", num_tasks=NUM_TASKS, checkpoint=checkpoint).collect()
    keys = [row.key for row in rows]
    assert len(keys) == len(set(keys)), "a key lives in exactly one task"
    return {row.key: row.value for row in rows}


def persistent_rdd_ids(spark: Any) -> set[int]:
    """The ids of the RDDs Spark holds persisted now. Compare the ids that appear, not the count: Spark's cleaner
    unpersists RDDs of earlier tests once the JVM collects them, at any time."""
    return {int(rdd_id) for rdd_id in spark.sparkContext._jsc.getPersistentRDDs()}


def batch_count(spark: Any, batch_ids: list[int]) -> dict[str, int]:
    """The reference: a plain Spark batch groupBy-count over the input of the given batches."""
    words = [(w,) for b in batch_ids for w in batch_words(b)]
    frame = spark.createDataFrame(words, "word string").groupBy("word").count()
    return {row.word: row["count"] for row in frame.collect()}


# -- tests --------------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("mode", ["rows", "arrow", "pandas"])
def test_normal_run_state_and_output_equal_a_batch_count(spark: Any, tmp_path: Path, mode: str) -> None:
    config = make_config(tmp_path)
    job = word_job(COUNTERS[mode], config, num_tasks=NUM_TASKS, output_schema=OUTPUT, mode=mode)
    for batch_id in range(3):
        output = run_batch(spark, job, batch_id)
        totals = batch_count(spark, list(range(batch_id + 1)))
        assert output == sorted((w, totals[w]) for w in set(batch_words(batch_id)))
    assert state_of(spark, config) == batch_count(spark, [0, 1, 2])
    assert state_of(spark, config, checkpoint=1) == batch_count(spark, [0, 1])
    assert all(stats.committed_seq == 3 and stats.base_seq == 2 for stats in job.last_batch_stats)


def test_replayed_batch_is_applied_once(spark: Any, tmp_path: Path) -> None:
    config = make_config(tmp_path)
    job = word_job(count_rows, config, num_tasks=NUM_TASKS, output_schema=OUTPUT)
    for batch_id in range(3):
        first_output = run_batch(spark, job, batch_id)
    replayed_output = run_batch(spark, job, 2)  # Spark re-runs its last batch after a driver crash
    assert replayed_output == first_output
    assert {s.base_seq for s in job.last_batch_stats} == {2} and {s.committed_seq for s in job.last_batch_stats} == {4}
    shutil.rmtree(tmp_path / "local")
    assert run_batch(spark, job, 2) == first_output  # replayed again, now from the blob store alone
    run_batch(spark, job, 3)
    assert state_of(spark, config) == batch_count(spark, [0, 1, 2, 3])


def test_task_attempt_failing_before_its_commit_is_retried_and_applied_once(spark: Any, tmp_path: Path) -> None:
    config = make_config(tmp_path)
    fail = FailOnceAfterWriting(tmp_path / "marker", batch_id=1, task_index=1)
    job = word_job(fail, config, num_tasks=NUM_TASKS, output_schema=OUTPUT)
    for batch_id in range(3):
        run_batch(spark, job, batch_id)
    assert (tmp_path / "marker").exists()
    retried = [s for s in job.history if s.batch_id == 1 and s.task_index == 1]
    assert [s.attempt for s in retried] == [1]
    assert state_of(spark, config) == batch_count(spark, [0, 1, 2])


def test_task_failing_after_its_commit_is_redone_from_the_previous_checkpoint(spark: Any, tmp_path: Path) -> None:
    config = make_config(tmp_path)
    fail = FailOnceAfterCommit(tmp_path / "marker", batch_id=1, task_index=0)
    job = word_job(fail, config, num_tasks=NUM_TASKS, output_schema=OUTPUT)
    run_batch(spark, job, 0)
    output = run_batch(spark, job, 1)
    assert ("sentinel", -1) in output
    retried = next(s for s in job.last_batch_stats if s.task_index == 0)
    # the failed attempt committed #2; the retry restored #1 (batch 0) and committed the redo as #3
    assert (retried.attempt, retried.base_seq, retried.committed_seq) == (1, 1, 3)
    run_batch(spark, job, 2)
    assert state_of(spark, config) == batch_count(spark, [0, 1, 2])


def test_local_state_wiped_between_batches_is_restored_from_the_blob_store(spark: Any, tmp_path: Path) -> None:
    config = make_config(tmp_path)
    job = word_job(count_rows, config, num_tasks=NUM_TASKS, output_schema=OUTPUT)
    for batch_id in range(5):
        if batch_id in (2, 4):
            shutil.rmtree(tmp_path / "local")
        run_batch(spark, job, batch_id)
    assert state_of(spark, config) == batch_count(spark, list(range(5)))


def test_streaming_query_over_files_stopped_and_restarted_from_its_checkpoint(spark: Any, tmp_path: Path) -> None:
    config = make_config(tmp_path)
    source = tmp_path / "input"
    source.mkdir()
    outputs: list[tuple[int, int]] = []

    def sink(frame: Any, batch_id: int) -> None:
        outputs.append((batch_id, frame.count()))

    def write_file(batch: int) -> None:
        (source / f"part-{batch:03d}.txt").write_text("\n".join(batch_words(batch)) + "\n")

    def run_query() -> StatefulForeachBatch:
        job = word_job(count_rows, config, num_tasks=NUM_TASKS, output_schema=OUTPUT, sink=sink)
        stream_text_files(spark, job, source, tmp_path / "spark-checkpoint")
        return job

    for batch in range(3):
        write_file(batch)
    first = run_query()
    for batch in range(3, 5):
        write_file(batch)
    second = run_query()
    assert sorted({s.batch_id for s in first.history}) == [0, 1, 2]
    assert sorted({s.batch_id for s in second.history}) == [3, 4]  # resumed from Spark's checkpoint, nothing redone
    assert [b for b, _ in outputs] == [0, 1, 2, 3, 4]
    assert state_of(spark, config) == batch_count(spark, list(range(5)))


def test_keys_from_the_spark_conf_are_read_again_when_the_conf_changes(spark: Any, monkeypatch: Any) -> None:
    """A classic session's conf is read again only when its text changed, also through a new Python wrapper of the
    same session (``foreachBatch`` hands each batch one); every change is seen."""
    from pyspark.sql import SparkSession

    from statebackend.spark import session
    from statebackend.spark.session import spark_conf_keys

    reads: list[int] = []
    read_keys = session._read_java_map_keys

    def counted(entries: Any) -> Any:
        reads.append(1)
        return read_keys(entries)

    monkeypatch.setattr(session, "_read_java_map_keys", counted)
    key = "spark.statebackend.task.checkpoint.retained"
    try:
        spark.conf.set(key, "7")
        assert spark_conf_keys(spark)["task.checkpoint.retained"] == "7"
        assert len(reads) == 1
        assert spark_conf_keys(spark)["task.checkpoint.retained"] == "7"  # from the cache
        wrapper = SparkSession(spark.sparkContext, spark._jsparkSession)
        assert wrapper is not spark
        assert spark_conf_keys(wrapper)["task.checkpoint.retained"] == "7"  # from the cache too
        assert len(reads) == 1
        spark.conf.set(key, "8")
        assert spark_conf_keys(spark)["task.checkpoint.retained"] == "8"
        spark.conf.set("spark.statebackend.job.name", "other")
        assert spark_conf_keys(spark) == {"task.checkpoint.retained": "8", "job.name": "other"}
    finally:
        spark.conf.unset(key)
        spark.conf.unset("spark.statebackend.job.name")
    assert spark_conf_keys(spark) == {}


def test_an_output_column_named_like_the_stats_column_is_refused(spark: Any, tmp_path: Path) -> None:
    from statebackend.errors import ConfigError
    from statebackend.spark.stats import STATS_COLUMN

    job = word_job(
        COUNTERS["arrow"],
        make_config(tmp_path),
        num_tasks=NUM_TASKS,
        output_schema=f"word string, {STATS_COLUMN} binary",
        mode="arrow",
    )
    with pytest.raises(ConfigError, match=STATS_COLUMN):
        job(spark.createDataFrame([("a",)], "word string"), 0)
    assert not (tmp_path / "blobs").exists() or not any((tmp_path / "blobs").rglob("*.json"))  # nothing committed


@pytest.mark.parametrize("mode", ["rows", "arrow"])
def test_tasks_report_their_stats_apart_from_the_output_and_each_batch_frees_the_output_it_held(
    spark: Any, tmp_path: Path, mode: str
) -> None:
    """Classic Spark: rows go through a persisted RDD, arrow through a local checkpoint of the mapped DataFrame
    (local mode); either way the stats come through the accumulator, not as a row or column of the output, and the
    output is freed once the sink has had it."""
    config = make_config(tmp_path)
    sunk: list[tuple[int, list[str], list[tuple[str, int]]]] = []

    def sink(frame: Any, batch_id: int) -> None:
        sunk.append((batch_id, frame.columns, sorted((row.word, row["count"]) for row in frame.collect())))

    job = word_job(COUNTERS[mode], config, num_tasks=NUM_TASKS, output_schema=OUTPUT, mode=mode, sink=sink)
    held_before = persistent_rdd_ids(spark)
    runs = set()
    for batch_id in range(3):
        job(spark.createDataFrame([(w,) for w in batch_words(batch_id)], "word string"), batch_id)
        assert sorted(s.task_index for s in job.last_batch_stats) == list(range(NUM_TASKS))
        assert {s.batch_id for s in job.last_batch_stats} == {batch_id}
        assert sum(s.input_rows for s in job.last_batch_stats) == len(batch_words(batch_id))
        run_ids = {s.run_id for s in job.last_batch_stats}
        assert len(run_ids) == 1 and "" not in run_ids
        runs |= run_ids
        assert job._stats_to is not None and job._stats_to[1].value == []  # the sink's read ran no task again
    assert len(runs) == 3  # each run of a batch has its own token
    for batch_id, columns, rows in sunk:
        totals = batch_count(spark, list(range(batch_id + 1)))
        assert columns == ["word", "count"]
        assert rows == sorted((w, totals[w]) for w in set(batch_words(batch_id)))
    # rows mode keeps an anchor RDD per task for affinity, reused batch after batch; nothing else stays held
    assert len(persistent_rdd_ids(spark) - held_before) == (NUM_TASKS if mode == "rows" else 0)
    assert job.metrics.export().counter("spark.task.stats.missing") == 0


def test_stats_of_another_run_are_not_taken_for_this_runs() -> None:
    from statebackend.spark.stats import TaskStats

    def stats(task: int, run_id: str) -> TaskStats:
        return task_stats(task, batch_id=4, input_rows=1, output_rows=1, run_id=run_id)

    class Accumulator:
        def __init__(self) -> None:
            self.value = [stats(0, "old"), stats(0, "new"), stats(1, "new"), stats(1, "old")]

    accumulator = Accumulator()
    taken = StatefulForeachBatch._reported(accumulator, "new")
    assert [(s.task_index, s.run_id) for s in taken] == [(0, "new"), (1, "new")]
    assert accumulator.value == []  # emptied: the next run does not see these


class LosesStatsOfTaskZeroOnce(StatefulForeachBatch):
    """As if Spark read task 0's output from a block a failed attempt stored: its stats never came back."""

    lost = 0

    def _reported(self, accumulator: Any, run_id: str) -> list[Any]:  # type: ignore[override]
        stats = StatefulForeachBatch._reported(accumulator, run_id)
        if type(self).lost == 0:
            type(self).lost += 1
            return [s for s in stats if s.task_index != 0]
        return stats


def test_a_task_without_stats_when_tasks_did_not_wait_for_their_checkpoints_runs_the_batch_again(
    spark: Any, tmp_path: Path
) -> None:
    config = make_config(tmp_path)
    sunk: list[tuple[int, list[tuple[str, int]]]] = []

    def sink(frame: Any, batch_id: int) -> None:
        sunk.append((batch_id, sorted((row.word, row["count"]) for row in frame.collect())))

    job = LosesStatsOfTaskZeroOnce(
        count_arrow,
        key_columns=["word"],
        num_tasks=NUM_TASKS,
        config=config,
        output_schema=OUTPUT,
        mode="arrow",
        sink=sink,
        confirm_on_driver=True,
    )
    for batch_id in range(3):
        job(spark.createDataFrame([(w,) for w in batch_words(batch_id)], "word string"), batch_id)
    counters = job.metrics.export()
    assert counters.counter("spark.task.stats.missing") == 1
    assert counters.counter("spark.batch.reruns") == 1
    assert [batch_id for batch_id, _ in sunk] == [0, 1, 2]  # the run without stats reached no sink
    for batch_id, rows in sunk:
        totals = batch_count(spark, list(range(batch_id + 1)))
        assert rows == sorted((w, totals[w]) for w in set(batch_words(batch_id)))
    assert state_of(spark, config) == batch_count(spark, [0, 1, 2])


@pytest.mark.parametrize("mode", ["rows", "arrow"])
def test_a_replay_skipped_by_every_task_reports_every_tasks_stats(spark: Any, tmp_path: Path, mode: str) -> None:
    """on_replay="skip": the tasks of a replayed batch skip it and say so in their stats, which reach the driver as
    this run's (not taken for missing ones)."""
    config = make_config(tmp_path)
    job = word_job(COUNTERS[mode], config, num_tasks=NUM_TASKS, output_schema=OUTPUT, mode=mode, on_replay="skip")
    for batch_id in range(2):
        run_batch(spark, job, batch_id)
    restarted = word_job(COUNTERS[mode], config, num_tasks=NUM_TASKS, output_schema=OUTPUT, mode=mode, on_replay="skip")
    assert run_batch(spark, restarted, 1) == []  # skipped: no output
    assert sorted(s.task_index for s in restarted.last_batch_stats) == list(range(NUM_TASKS))
    assert all(s.committed_seq == 0 for s in restarted.last_batch_stats)
    assert restarted.metrics.export().counter("spark.task.stats.missing") == 0
    assert state_of(spark, config) == batch_count(spark, [0, 1])


def count_arrow_failing_in_task_one(stores: Any, batches: Any) -> Any:
    from pyspark import TaskContext

    context = TaskContext.get()
    if context is not None and context.partitionId() == 1:
        raise RuntimeError("task 1 fails every attempt")
    return count_arrow(stores, batches)


def test_a_batch_whose_task_fails_holds_no_output_of_the_tasks_that_succeeded(spark: Any, tmp_path: Path) -> None:
    job = word_job(
        count_arrow_failing_in_task_one,
        make_config(tmp_path),
        num_tasks=NUM_TASKS,
        output_schema=OUTPUT,
        mode="arrow",
        sink=lambda frame, batch_id: None,
    )
    held_before = persistent_rdd_ids(spark)
    with pytest.raises(Exception, match="task 1 fails every attempt"):
        job(spark.createDataFrame([(w,) for w in batch_words(0)], "word string"), 0)
    assert persistent_rdd_ids(spark) - held_before == set()
