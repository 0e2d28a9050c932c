"""Timers that start with the state, on real local Spark: ``on_initial_state`` registers the loaded keys' timers in
the load's checkpoint (they fire once, also after a restart), ``read_state`` gives timer keys in the key column's
type, ``initial_state`` refuses duplicate keys and the timer store, and a heartbeat that advances the watermark fires
event-time timers without input."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
from pyspark.sql.types import LongType

from statebackend.errors import ConfigError
from statebackend.spark import EVENT, PROCESSING, TIMERS_STORE, StatefulForeachBatch, read_state
from statebackend.spark.heartbeat import HEARTBEAT_CLOCK_COLUMN
from statebackend.testing import ManualClock
from tests.spark_helpers import output_of, word_job
from tests.test_spark import make_config

pytest_plugins = ["tests.spark_fixtures"]
pytestmark = [pytest.mark.spark, pytest.mark.slow]

NUM_TASKS = 2
OUTPUT = "user long, value long, at_ms long"


# -- job functions (module level: pickled by reference) ------------------------------------------------------------


def count_rows(stores: Any, rows: Any) -> None:
    counts = stores["counts"]
    for row in rows:
        counts.put(row.user, (counts.get(row.user) or 0) + row.n)


def expire_at_1000(stores: Any, keys: list[Any]) -> None:
    """The loaded keys' timers: each key a processing-time timer at 1000, in one call."""
    assert all(stores["counts"].get(key) is not None for key in keys)  # the rows are loaded before the hook
    stores.timers.register_many(keys, 1000)


def report_fired(stores: Any, timers: Any) -> list[tuple[Any, ...]]:
    counts = stores["counts"]
    return [(t.key, counts.get(t.key), t.at_ms) for t in timers]


def register_event_timers(stores: Any, rows: Any) -> None:
    for row in rows:
        stores.timers.register(row.user, row.ts, kind=EVENT)


# -- helpers --------------------------------------------------------------------------------------------------------


def long_keys_config(tmp_path: Path) -> dict[str, object]:
    return make_config(tmp_path, **{"stores.counts.key.serde": "integer"})


def initial_job(config: dict[str, object], frame: Any, clock: ManualClock, **extra: Any) -> StatefulForeachBatch:
    return word_job(
        count_rows,
        config,
        num_tasks=NUM_TASKS,
        output_schema=OUTPUT,
        key="user",
        on_timers=report_fired,
        initial_state={"counts": frame},
        on_initial_state=expire_at_1000,
        clock=clock,
        **extra,
    )


def run(spark: Any, job: StatefulForeachBatch, batch_id: int, rows: list[tuple[Any, ...]]) -> list[tuple[Any, ...]]:
    return sorted(
        tuple(r) for r in output_of(job, spark.createDataFrame(rows, "user long, n long"), batch_id).collect()
    )


# -- tests ----------------------------------------------------------------------------------------------------------


def test_timers_registered_by_on_initial_state_fire_once_also_for_keys_without_rows(spark: Any, tmp_path: Path) -> None:
    config = long_keys_config(tmp_path)
    frame = spark.createDataFrame([(1, 10), (2, 20), (3, 30)], "user long, value long")
    clock = ManualClock(500)
    job = initial_job(config, frame, clock)
    assert run(spark, job, 0, [(1, 5)]) == []
    timers = read_state(spark, config, TIMERS_STORE, num_tasks=NUM_TASKS)
    assert timers.schema["key"].dataType == LongType()  # the key column's type, not text
    assert sorted((r.key, r.kind, r.at_ms) for r in timers.collect()) == [(k, PROCESSING, 1000) for k in (1, 2, 3)]
    clock.now_ms = 1000
    assert run(spark, job, 1, []) == [(1, 15, 1000), (2, 20, 1000), (3, 30, 1000)]
    # a restart with the same initial_state: nothing is loaded again, the hook is not called, nothing fires again
    restarted = initial_job(config, frame, clock)
    clock.now_ms = 5000
    assert run(spark, restarted, 2, [(2, 1)]) == []
    assert read_state(spark, config, TIMERS_STORE, num_tasks=NUM_TASKS).count() == 0


def test_duplicate_keys_in_an_initial_state_are_refused_naming_them(spark: Any, tmp_path: Path) -> None:
    frame = spark.createDataFrame([(1, 10), (7, 11), (1, 12), (2, 20), (7, 13)], "user long, value long")
    job = initial_job(long_keys_config(tmp_path), frame, ManualClock(0))
    with pytest.raises(Exception, match=r"key\(s\) given more than once") as raised:
        run(spark, job, 0, [])
    text = str(raised.value)
    assert "initial_state['counts']" in text and "dropDuplicates" in text
    assert ("1" in text.split("more than once:")[1]) and ("7" in text.split("more than once:")[1])


def test_the_timer_store_named_as_an_initial_state_store_is_refused(spark: Any, tmp_path: Path) -> None:
    frame = spark.createDataFrame([("a", b"x")], "key string, value binary")
    with pytest.raises(ConfigError, match="names the timer store .* on_initial_state"):  # when the job is built
        word_job(
            count_rows,
            long_keys_config(tmp_path),
            num_tasks=NUM_TASKS,
            output_schema=OUTPUT,
            key="user",
            on_timers=report_fired,
            initial_state={TIMERS_STORE: frame},
        )


def test_on_initial_state_needs_initial_state(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match="on_initial_state needs initial_state"):
        word_job(
            count_rows,
            long_keys_config(tmp_path),
            num_tasks=1,
            output_schema=None,
            key="user",
            on_initial_state=expire_at_1000,
            probe=False,
        )


@pytest.mark.parametrize("advance", [True, False])
def test_a_heartbeat_that_advances_the_watermark_fires_event_time_timers_without_input(
    spark: Any, tmp_path: Path, advance: bool
) -> None:
    clock = ManualClock(1000)
    job = word_job(
        register_event_timers,
        long_keys_config(tmp_path),
        num_tasks=NUM_TASKS,
        output_schema=OUTPUT,
        key="user",
        on_timers=report_fired,
        event_time="ts",
        watermark_delay=100,
        clock=clock,
    )
    schema = f"user long, ts long, {HEARTBEAT_CLOCK_COLUMN} boolean"

    def batch(batch_id: int, rows: list[tuple[Any, ...]]) -> list[tuple[Any, ...]]:
        frame = spark.createDataFrame([*rows, (None, None, True)], schema)  # one heartbeat row, as the rate source's
        if not advance:
            frame = frame.drop(HEARTBEAT_CLOCK_COLUMN).where("user is not null")
        return sorted(tuple(r) for r in output_of(job, frame, batch_id).collect())

    assert batch(0, [(1, 500, None)]) == []
    clock.now_ms = 2000
    # batch 1's watermark: the largest event time through batch 0 less the delay; with the heartbeat's clock that is
    # 1000 - 100 = 900 (the timer at 500 fires), without it 500 - 100 = 400 (it waits for data)
    assert batch(1, []) == ([(1, None, 500)] if advance else [])
    assert {s.watermark_ms for s in job.last_batch_stats} == {900 if advance else 400}


def test_a_heartbeat_that_advances_the_watermark_needs_event_time(spark: Any, tmp_path: Path) -> None:
    job = word_job(count_rows, long_keys_config(tmp_path), num_tasks=1, output_schema=OUTPUT, key="user")
    frame = spark.createDataFrame([(None, None, True)], f"user long, n long, {HEARTBEAT_CLOCK_COLUMN} boolean")
    with pytest.raises(ConfigError, match="advance_watermark=True.*no event_time"):
        job(frame, 0)
