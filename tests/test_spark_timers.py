"""Timers end to end on real local Spark: processing-time and event-time timers fire once, at the right batch, also
for keys without new rows; exactly once under a replayed batch, failed and killed task attempts, a driver restart
on a wiped local directory and a change of num_tasks; ``read_state`` lists the pending timers."""

from __future__ import annotations

import datetime
import os
import shutil
import signal
from pathlib import Path
from typing import Any

import pytest

from statebackend.spark import EVENT, PROCESSING, TIMERS_STORE, StatefulForeachBatch, read_state
from statebackend.testing import ManualClock
from tests.spark_helpers import first_time, output_of, word_job
from tests.test_spark import make_config

pytest_plugins = ["tests.spark_fixtures"]
pytestmark = [pytest.mark.spark, pytest.mark.slow]

NUM_TASKS = 3
OUTPUT = "word string, at_ms long, kind string, batch long"
INPUT = "word string, ts long"


# -- job functions (module level: pickled by reference and imported on the executors) -----------------------------


def register_rows(stores: Any, rows: Any) -> None:
    """Rows ``(word, ts)``: count the word and register a processing-time timer at ``ts`` (no output)."""
    for row in rows:
        _register(stores, row.word, row.ts, PROCESSING)


def register_arrow(stores: Any, batches: Any) -> None:
    for batch in batches:
        for record in batch.to_pylist():
            _register(stores, record["word"], record["ts"], PROCESSING)


def register_pandas(stores: Any, frame: Any) -> None:
    for word, ts in zip(frame["word"], frame["ts"], strict=True):
        _register(stores, word, int(ts), PROCESSING)


def _register(stores: Any, word: str, at: Any, kind: str) -> None:
    counts = stores["counts"]
    counts.put(word, (counts.get(word) or 0) + 1)
    stores.timers.register(word, at, kind=kind)


def fired_rows(stores: Any, timers: Any) -> list[tuple[Any, ...]]:
    """The handler: a fired key's count is dropped; one row per timer."""
    stores["counts"].delete_many([t.key for t in timers])
    return [(t.key, t.at_ms, t.kind, stores.batch_id) for t in timers]


def fired_arrow(stores: Any, timers: Any) -> Any:
    import pyarrow as pa

    rows = fired_rows(stores, timers)
    return pa.table(
        {
            "word": pa.array([r[0] for r in rows], pa.string()),
            "at_ms": pa.array([r[1] for r in rows], pa.int64()),
            "kind": pa.array([r[2] for r in rows], pa.string()),
            "batch": pa.array([r[3] for r in rows], pa.int64()),
        }
    )


def fired_pandas(stores: Any, timers: Any) -> Any:
    import pandas as pd

    return pd.DataFrame(fired_rows(stores, timers), columns=["word", "at_ms", "kind", "batch"])


MODES = {
    "rows": (register_rows, fired_rows),
    "arrow": (register_arrow, fired_arrow),
    "pandas": (register_pandas, fired_pandas),
}


class EventTimers:
    """Rows ``(word, ts)``: an event-time timer at ``ts + 500`` ms (``ts`` a long of ms, or a timestamp)."""

    def __call__(self, stores: Any, rows: Any) -> None:
        for row in rows:
            at = row.ts + (datetime.timedelta(milliseconds=500) if isinstance(row.ts, datetime.datetime) else 500)
            _register(stores, row.word, at, EVENT)


class Failing:
    """The handler (rows mode), failing once in a chosen way in the first task of a chosen batch that has timers
    due: raising before the commit, an output row that fails to pickle after the commit, or its Python worker killed
    by SIGKILL before the commit."""

    def __init__(self, marker: Path, batch_id: int, how: str) -> None:
        self.marker = str(marker)
        self.batch_id = batch_id
        self.how = how

    def __call__(self, stores: Any, timers: Any) -> list[Any]:
        output: list[Any] = fired_rows(stores, timers)
        if stores.batch_id != self.batch_id or not first_time(self.marker):
            return output
        if self.how == "raise":
            raise RuntimeError("injected failure in on_timers")
        if self.how == "kill":
            os.kill(os.getpid(), signal.SIGKILL)
        return [*output, _ExplodesOnce(self.marker + ".pickle")]


class _ExplodesOnce:
    def __init__(self, marker: str) -> None:
        self.marker = marker

    def __reduce__(self) -> Any:
        if first_time(self.marker):
            raise RuntimeError("injected failure after the commit")
        return (tuple, (("sentinel", -1, "none", -1),))


# -- helpers ------------------------------------------------------------------------------------------------------


@pytest.fixture
def clock() -> ManualClock:
    """The driver's batch clock, set by the test (each job is given it: ``StatefulForeachBatch(clock=...)``)."""
    return ManualClock(0)


def run_batch(
    spark: Any, job: StatefulForeachBatch, batch_id: int, rows: list[tuple[Any, ...]], schema: str = INPUT
) -> list[tuple[Any, ...]]:
    output = output_of(job, spark.createDataFrame(rows, schema), batch_id)
    return sorted(tuple(row) for row in output.collect())


def pending(
    spark: Any, config: dict[str, object], num_tasks: int = NUM_TASKS, checkpoint: str | int = "latest"
) -> list[tuple[str, str, int]]:
    frame = read_state(spark, config, TIMERS_STORE, num_tasks=num_tasks, checkpoint=checkpoint)
    assert frame.columns == ["task", "key", "kind", "at_ms"]
    return sorted((row.key, row.kind, row.at_ms) for row in frame.collect())


def counts(spark: Any, config: dict[str, object], num_tasks: int = NUM_TASKS) -> dict[str, int]:
    return {row.key: row.value for row in read_state(spark, config, "counts", num_tasks=num_tasks).collect()}


# -- tests --------------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("mode", ["rows", "arrow", "pandas"])
def test_processing_time_timers_fire_once_at_the_right_batch_also_for_keys_without_rows(
    spark: Any, tmp_path: Path, clock: ManualClock, mode: str
) -> None:
    config = make_config(tmp_path)
    fn, handler = MODES[mode]
    job = word_job(fn, config, num_tasks=NUM_TASKS, output_schema=OUTPUT, mode=mode, on_timers=handler, clock=clock)
    clock.now_ms = 1000
    assert run_batch(spark, job, 0, [("a", 1500), ("b", 2500), ("c", 900)]) == [("c", 900, PROCESSING, 0)]
    assert pending(spark, config, checkpoint=0) == [("a", PROCESSING, 1500), ("b", PROCESSING, 2500)]
    # the driver's merged metrics of the batch: every task's counts, and the job's pending timers as the sum
    merged = job.last_batch_metrics
    held = merged.histogram("timers.pending")
    assert held is not None and (held.sum, held.count) == (2, NUM_TASKS)
    assert (merged.counter("timers.registered"), merged.counter("timers.fired")) == (3, 1)
    clock.now_ms = 2000
    assert run_batch(spark, job, 1, [("d", 2200)]) == [("a", 1500, PROCESSING, 1)]
    clock.now_ms = 3000  # no input at all: every task still runs, and the idle keys' timers fire
    assert run_batch(spark, job, 2, []) == [("b", 2500, PROCESSING, 2), ("d", 2200, PROCESSING, 2)]
    assert sorted(s.task_index for s in job.last_batch_stats) == list(range(NUM_TASKS))
    clock.now_ms = 4000
    assert run_batch(spark, job, 3, []) == []
    assert sum(s.timers_fired for s in job.history) == 4
    assert pending(spark, config) == []
    assert counts(spark, config) == {}  # the handler deleted each fired key's count, in the same commits


@pytest.mark.parametrize(("mode", "column"), [("arrow", "long"), ("rows", "timestamp")])
def test_event_time_timers_fire_when_the_watermark_of_earlier_batches_passes_them(
    spark: Any, tmp_path: Path, mode: str, column: str
) -> None:
    config = make_config(tmp_path)

    def at(ms: int) -> Any:
        return ms if column == "long" else datetime.datetime.fromtimestamp(ms / 1000)

    fn: Any = EventTimers()
    if mode == "arrow":
        fn = event_timers_arrow
    job = word_job(
        fn,
        config,
        num_tasks=NUM_TASKS,
        output_schema=OUTPUT,
        mode=mode,
        on_timers=fired_rows if mode == "rows" else fired_arrow,
        event_time="ts",
        watermark_delay=100,
    )
    schema = f"word string, ts {column}"
    batches = [[("a", at(1000)), ("b", at(1200))], [("c", at(2000))], [], [], [("d", at(5000))], []]
    outputs, watermarks = [], []
    for batch_id, rows in enumerate(batches):
        outputs.append(run_batch(spark, job, batch_id, rows, schema))
        watermarks.append({s.watermark_ms for s in job.last_batch_stats})
    assert watermarks == [{None}, {1100}, {1900}, {1900}, {1900}, {4900}]
    assert outputs == [[], [], [("a", 1500, EVENT, 2), ("b", 1700, EVENT, 2)], [], [], [("c", 2500, EVENT, 5)]]
    assert pending(spark, config) == [("d", EVENT, 5500)]


def event_timers_arrow(stores: Any, batches: Any) -> None:
    for batch in batches:
        for record in batch.to_pylist():
            _register(stores, record["word"], record["ts"] + 500, EVENT)


def both_timers(stores: Any, rows: Any) -> None:
    """Rows ``(word, ts)``: an event-time timer at ``ts + 500`` and a processing-time one at ``ts + 2000``."""
    for row in rows:
        _register(stores, row.word, row.ts + 500, EVENT)
        stores.timers.register(row.word, row.ts + 2000, kind=PROCESSING)


BATCHES = [[("a", 1000), ("b", 1100), ("c", 1200)], [("d", 2000), ("a", 2100)], [], [("e", 4000)], []]


def run_reference(spark: Any, tmp_path: Path, clock: ManualClock) -> tuple[list[Any], list[Any]]:
    """Every batch once, one driver, nothing failing: the outputs and the timers left."""
    config = make_config(tmp_path / "reference")
    job = both_job(config, clock=clock)
    outputs = []
    for batch_id, rows in enumerate(BATCHES):
        clock.now_ms = 1000 * (batch_id + 2)
        outputs.append(run_batch(spark, job, batch_id, rows))
    return outputs, pending(spark, config)


def both_job(config: dict[str, object], on_timers: Any = fired_rows, **extra: Any) -> StatefulForeachBatch:
    return word_job(
        both_timers,
        config,
        num_tasks=NUM_TASKS,
        output_schema=OUTPUT,
        on_timers=on_timers,
        event_time="ts",
        watermark_delay=0,
        **extra,
    )


def test_replays_and_a_driver_restarted_on_a_wiped_local_dir_fire_each_timer_once(
    spark: Any, tmp_path: Path, clock: ManualClock
) -> None:
    expected, left = run_reference(spark, tmp_path, clock)
    assert sum(len(o) for o in expected) >= 6  # timers of both kinds fired in several batches
    config = make_config(tmp_path / "run")
    job = both_job(config, clock=clock)
    outputs: dict[int, list[Any]] = {}
    for batch_id in range(3):
        clock.now_ms = 1000 * (batch_id + 2)
        outputs[batch_id] = run_batch(spark, job, batch_id, BATCHES[batch_id])
    watermark = {s.watermark_ms for s in job.last_batch_stats}
    clock.now_ms = 99_000  # Spark replays batch 2 after a driver crash: the tasks fire at the clock they recorded
    assert run_batch(spark, job, 2, BATCHES[2]) == outputs[2]
    # a new driver on a machine whose local state is gone: the watermark comes back from the checkpoints
    shutil.rmtree(tmp_path / "run" / "local")
    restarted = both_job(config, clock=clock)
    assert run_batch(spark, restarted, 2, BATCHES[2]) == outputs[2]
    assert {s.watermark_ms for s in restarted.last_batch_stats} == watermark
    for batch_id in range(3, len(BATCHES)):
        if batch_id == 4:  # and once more, now without a replay: the next batch after a restart
            restarted = both_job(config, clock=clock)
        clock.now_ms = 1000 * (batch_id + 2)
        outputs[batch_id] = run_batch(spark, restarted, batch_id, BATCHES[batch_id])
    assert [outputs[b] for b in range(len(BATCHES))] == expected
    assert pending(spark, config) == left


@pytest.mark.parametrize("how", ["raise", "pickle", "kill"])
def test_a_failed_or_killed_task_attempt_fires_its_timers_once(
    spark: Any, tmp_path: Path, clock: ManualClock, how: str
) -> None:
    expected, left = run_reference(spark, tmp_path, clock)
    config = make_config(tmp_path / "run")
    job = both_job(config, clock=clock, on_timers=Failing(tmp_path / "marker", 2, how))
    outputs = []
    for batch_id, rows in enumerate(BATCHES):
        clock.now_ms = 1000 * (batch_id + 2)
        outputs.append([row for row in run_batch(spark, job, batch_id, rows) if row[0] != "sentinel"])
    assert (tmp_path / "marker").exists()  # the failure happened
    assert any(s.batch_id == 2 and s.attempt == 1 for s in job.history)  # and its task was retried
    assert outputs == expected
    assert pending(spark, config) == left


def test_timers_move_with_their_key_groups_when_num_tasks_changes(
    spark: Any, tmp_path: Path, clock: ManualClock
) -> None:
    config = make_config(tmp_path)
    words = [f"w{i}" for i in range(20)]
    job = word_job(
        register_rows, config, num_tasks=3, output_schema=OUTPUT, clock=clock, on_timers=fired_rows, key_groups=16
    )
    clock.now_ms = 0
    assert run_batch(spark, job, 0, [(w, 1000 + 100 * i) for i, w in enumerate(words)]) == []
    assert [key for key, _, _ in pending(spark, config, 3)] == sorted(words)
    fewer = word_job(
        register_rows, config, num_tasks=2, output_schema=OUTPUT, clock=clock, on_timers=fired_rows, key_groups=16
    )
    clock.now_ms = 1950
    first = run_batch(spark, fewer, 1, [])
    assert [row[0] for row in first] == sorted(words[:10])
    assert [key for key, _, _ in pending(spark, config, 2)] == sorted(words[10:])
    clock.now_ms = 9000
    second = run_batch(spark, fewer, 2, [])
    assert sorted(row[0] for row in first + second) == sorted(words)  # each timer fired once, in its new task


@pytest.mark.parametrize("mode", ["arrow", "pandas"])
def test_input_spark_knows_to_be_empty_still_runs_every_task(
    spark: Any, tmp_path: Path, clock: ManualClock, mode: str
) -> None:
    """A filter on false is planned with no partition at all: the tasks still run, commit and fire their timers, and
    the next batch finds every task's checkpoint of it."""
    config = make_config(tmp_path)
    fn, handler = MODES[mode]
    job = word_job(fn, config, num_tasks=NUM_TASKS, output_schema=OUTPUT, mode=mode, on_timers=handler, clock=clock)
    clock.now_ms = 0
    run_batch(spark, job, 0, [("a", 500), ("b", 1500)])
    clock.now_ms = 1000
    nothing = spark.createDataFrame([("x", 0)], INPUT).where("false")
    assert sorted(tuple(row) for row in output_of(job, nothing, 1).collect()) == [("a", 500, PROCESSING, 1)]
    assert sorted(s.task_index for s in job.last_batch_stats) == list(range(NUM_TASKS))
    assert {s.committed_seq for s in job.last_batch_stats} == {2}
    clock.now_ms = 2000
    assert run_batch(spark, job, 2, [("c", 9000)]) == [("b", 1500, PROCESSING, 2)]


def register_a_second_later(stores: Any, rows: Any) -> None:
    """Rows ``(word, ts)``: count the word and register a processing-time timer a second after the batch clock."""
    for row in rows:
        _register(stores, row.word, stores.now_ms + 1000, PROCESSING)


def test_a_heartbeat_keeps_batches_and_processing_time_timers_coming_after_the_input_stops(
    spark: Any, tmp_path: Path
) -> None:
    """One file of input, then none: without the heartbeat Spark would run no batch and the timer would never fire.
    With it, batches keep coming, the timer fires once in a batch without input, and the function never sees a
    heartbeat row (its null word would fail the timer's registration)."""
    import json
    import time

    from statebackend.spark import with_heartbeat

    source = tmp_path / "input"
    source.mkdir()
    (source / "part-0.json").write_text(json.dumps({"word": "a", "ts": 0}) + "\n")
    outputs: list[tuple[int, list[tuple[Any, ...]], int]] = []

    def sink(frame: Any, batch_id: int) -> None:
        rows = [tuple(row) for row in frame.collect()]
        outputs.append((batch_id, rows, sum(s.input_rows for s in job.last_batch_stats)))

    config = make_config(tmp_path)
    job = word_job(
        register_a_second_later, config, num_tasks=NUM_TASKS, output_schema=OUTPUT, on_timers=fired_rows, sink=sink
    )
    stream = with_heartbeat(spark.readStream.schema(INPUT).json(str(source)))
    query = (
        stream.writeStream.foreachBatch(job)
        .option("checkpointLocation", str(tmp_path / "spark-checkpoint"))
        .trigger(processingTime="200 milliseconds")
        .start()
    )
    try:
        deadline = time.monotonic() + 120
        while not any(rows for _, rows, _ in outputs) and time.monotonic() < deadline and query.exception() is None:
            time.sleep(0.1)
        wait_for = len(outputs) + 1
        while len(outputs) < wait_for and time.monotonic() < deadline and query.exception() is None:
            time.sleep(0.1)  # one more batch: the fired timer does not fire again
    finally:
        query.stop()
    assert query.exception() is None
    fired = [(batch_id, rows) for batch_id, rows, _ in outputs if rows]
    assert len(fired) == 1 and [row[::2] for row in fired[0][1]] == [("a", PROCESSING)]
    assert fired[0][0] > 0 and fired[0][1][0][3] == fired[0][0]  # fired by a later batch than the one with input
    assert len(outputs) > fired[0][0] + 1  # and a batch came after it
    assert [rows for _, _, rows in outputs][:1] == [1] and sum(rows for _, _, rows in outputs) == 1  # no heartbeat
    assert pending(spark, config) == []
