"""The timer and state hooks of issue 33 on the executor side, run in this process without a SparkSession: timers
registered and deleted many at a time, late rows dropped (or asked about) at Spark's boundary, the expiry callback of
TTL stores exactly once under replays, and the clock tests set."""

from __future__ import annotations

import datetime
from pathlib import Path
from typing import Any

import pandas as pd
import pyarrow as pa
import pytest
from pyspark.sql import Row

from statebackend.errors import ConfigError
from statebackend.microbatch.attempt import EXPIRY_FROM_OFFSET, Expired
from statebackend.microbatch.spec import BatchSpec, JobSpec
from statebackend.microbatch.timers import stored_timers, with_timer_store
from statebackend.microbatch.watermark import EventTimes
from statebackend.spark import EVENT, PROCESSING, TIMERS_STORE, TaskRunner
from statebackend.spark.stats import TaskStats, is_output, is_stats
from statebackend.task import TaskStorage
from statebackend.testing import ManualClock
from tests.test_spark import make_config

KEY_GROUPS = 8


# -- job functions (module level: pickled by reference) ------------------------------------------------------------


def register_in_bulk(stores: Any, rows: Any) -> list[tuple[Any, ...]]:
    """Rows ``(word, at, op)``: the words of op "add" registered at their times in one call, of op "del" deleted in
    one call; one output row with the counts."""
    rows = list(rows)
    added = [r for r in rows if r.op == "add"]
    dropped = [r for r in rows if r.op == "del"]
    registered = stores.timers.register_many([r.word for r in added], [r.at for r in added])
    deleted = stores.timers.delete_many([r.word for r in dropped], [r.at for r in dropped])
    return [("counts", registered, deleted)]


def no_timers_fired(stores: Any, timers: Any) -> list[Any]:
    return [("fired", t.key, t.at_ms) for t in timers]


def seen_rows(stores: Any, rows: Any) -> list[tuple[Any, ...]]:
    """Each row the function gets, with whether ``stores.is_late`` calls it late."""
    return [(row.word, row.ts, stores.is_late(row.ts)) for row in rows]


def put_last(stores: Any, rows: Any) -> list[Any]:
    """Rows ``(word, n)``: the word's last value is n."""
    last = stores["last"]
    for row in rows:
        last.put(row.word, row.n)
    return []


def expired_rows(stores: Any, expired: list[Expired]) -> list[tuple[Any, ...]]:
    """One output row per expired key; a key whose last value was 99 is written again (it lives on)."""
    for item in expired:
        if item.value == 99:
            stores[item.store].put(item.key, 100)
    return [(e.store, e.key, e.value, e.expired_at_ms, stores.batch_id) for e in expired]


# -- helpers --------------------------------------------------------------------------------------------------------


def run(
    config: dict[str, object], fn: Any, batch_id: int, rows: list[Row], *, batch: dict[str, Any], **job: Any
) -> tuple[list[Any], TaskStats]:
    spec = JobSpec.from_config(
        config,
        fn=fn,
        num_tasks=1,
        key_groups=KEY_GROUPS,
        key_types=("string",),
        key_columns=("word",),
        input_columns=tuple(rows[0].asDict()) if rows else ("word",),
        **job,
    )
    items = list(TaskRunner(spec, BatchSpec(batch_id=batch_id, **batch)).run_rows(0, iter(rows)))
    stats = [item.stats for item in items if is_stats(item)]
    return [tuple(item) for item in items if is_output(item)], stats[0]


def ttl_config(tmp_path: Path, sweep_keys: int = 2) -> dict[str, object]:
    return make_config(
        tmp_path,
        **{
            "stores.last.backup.factories": "changelog",
            "stores.last.key.serde": "string",
            "stores.last.msg.serde": "integer",
            "stores.last.ttl.ms": 100,
            "stores.last.ttl.sweep.keys": sweep_keys,
        },
    )


def offsets_of(config: dict[str, object]) -> dict[str, str]:
    with TaskStorage.open(config, "task-0") as storage:
        assert storage.restored is not None
        return dict(storage.restored.input_offsets)


# -- tests ----------------------------------------------------------------------------------------------------------


def test_register_many_and_delete_many_keep_each_timer_once_and_count_what_they_did(tmp_path: Path) -> None:
    config = with_timer_store(make_config(tmp_path))
    add = [Row(word=w, at=at, op="add") for w, at in [("a", 500), ("b", 700), ("a", 500), ("c", 900)]]
    output, stats = run(config, register_in_bulk, 0, add, batch={"now_ms": 0}, on_timers=no_timers_fired)
    assert output == [("counts", 3, 0)]  # "a" at 500 twice: one timer
    assert stats.metrics is not None and stats.metrics.counter("timers.registered") == 3
    again = [Row(word="a", at=500, op="add"), Row(word="b", at=700, op="del"), Row(word="z", at=1, op="del")]
    output, _ = run(config, register_in_bulk, 1, again, batch={"now_ms": 0}, on_timers=no_timers_fired)
    assert output == [("counts", 0, 1)]  # "a" exists already; "z" had no timer
    with TaskStorage.open(config, "task-0") as storage:
        left = [(t.key, t.at_ms, t.kind) for t in stored_timers(storage.store(TIMERS_STORE, typed=False))]
    assert left == [("a", 500, PROCESSING), ("c", 900, PROCESSING)]
    output, _ = run(config, register_in_bulk, 2, [], batch={"now_ms": 1000}, on_timers=no_timers_fired)
    assert output == [("counts", 0, 0), ("fired", "a", 500), ("fired", "c", 900)]


def test_register_many_refuses_a_time_per_key_that_does_not_match_the_keys(tmp_path: Path) -> None:
    def mismatched(stores: Any, rows: Any) -> None:
        stores.timers.register_many(["a", "b"], [1, 2, 3], kind=EVENT)

    config = with_timer_store(make_config(tmp_path))
    with pytest.raises(ConfigError, match="2 keys but 3 times"):
        run(config, mismatched, 0, [], batch={"now_ms": 0}, on_timers=no_timers_fired)


@pytest.mark.parametrize("drop_late", [True, False])
def test_late_rows_are_those_below_the_watermark_and_are_dropped_when_asked(tmp_path: Path, drop_late: bool) -> None:
    rows = [Row(word=w, ts=ts) for w, ts in [("a", 999), ("b", 1000), ("c", 1500), ("d", None)]]
    output, stats = run(
        make_config(tmp_path),
        seen_rows,
        0,
        rows,
        batch={"now_ms": 0, "watermark_ms": 1000},
        event_time="ts",
        event_time_type="long",
        drop_late=drop_late,
    )
    # a row at the watermark is on time, as in Spark; a null event time is never late
    on_time = [("b", 1000, False), ("c", 1500, False), ("d", None, False)]
    assert sorted(output, key=str) == sorted(on_time if drop_late else [("a", 999, True), *on_time], key=str)
    assert stats.event_max_ms == 1500


def test_is_late_needs_an_event_time_column(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match="is_late needs an event-time column"):
        run(make_config(tmp_path), seen_rows, 0, [Row(word="a", ts=1)], batch={"now_ms": 0})


def test_arrow_batches_and_pandas_frames_drop_the_same_late_rows_as_rows() -> None:
    stamps = [datetime.datetime(2024, 1, 1, tzinfo=datetime.UTC) + datetime.timedelta(milliseconds=m) for m in (0, 5)]
    bound = int(stamps[1].timestamp() * 1000)
    table = pa.table({"ts": pa.array(stamps + [None], pa.timestamp("us", tz="UTC")), "n": [1, 2, 3]})
    events = EventTimes("ts", "timestamp")
    events.drop_below = bound
    kept = pa.Table.from_batches(list(events.batches(iter(table.to_batches()))))
    assert kept.column("n").to_pylist() == [2, 3] and events.dropped == 1
    frames = EventTimes("ts", "timestamp", "UTC")
    frames.drop_below = bound
    frame = frames.frame(pd.DataFrame({"ts": pd.to_datetime(stamps + [None], utc=True), "n": [1, 2, 3]}))
    assert list(frame["n"]) == [2, 3] and frames.dropped == 1
    longs = EventTimes("ts", "long")
    longs.drop_below = 10
    assert list(longs.frame(pd.DataFrame({"ts": [9, 10, 11], "n": [1, 2, 3]}))["n"]) == [2, 3]


def test_the_expiry_callback_gets_each_expired_key_once_with_its_last_value_and_replays_alike(tmp_path: Path) -> None:
    config = ttl_config(tmp_path, sweep_keys=2)
    job = {"on_expiry": expired_rows}
    words = [Row(word=w, n=n) for w, n in [("a", 1), ("b", 2), ("c", 99), ("d", 4), ("e", 5)]]
    assert run(config, put_last, 0, words, batch={"now_ms": 0}, **job)[0] == []
    assert run(config, put_last, 1, [], batch={"now_ms": 99}, **job)[0] == []  # alive until 100
    first, _ = run(config, put_last, 2, [], batch={"now_ms": 150}, **job)
    # two keys examined per batch, from a cursor the checkpoint records: batches 0 and 1 examined a to d (alive)
    assert first == [("last", "e", 5, 100, 2), ("last", "a", 1, 100, 2)]
    assert offsets_of(config)[EXPIRY_FROM_OFFSET + "last"] == b"b".hex()
    # batch 2 again (a replay: its checkpoint's clock, its base's cursor): the same keys, the same values
    replayed, _ = run(config, put_last, 2, [], batch={"now_ms": 5000}, **job)
    assert replayed == first
    seen = list(first)
    for batch_id in range(3, 7):
        output, _ = run(config, put_last, batch_id, [], batch={"now_ms": 150}, **job)
        seen += output
    # every key once, with its last value; "c" was written again by the callback and lives on (until 250)
    assert sorted(row[1:3] for row in seen) == [("a", 1), ("b", 2), ("c", 99), ("d", 4), ("e", 5)]
    with TaskStorage.open(config, "task-0") as storage:
        storage.ttl_now_ms = 150
        assert dict(storage.store("last").items()) == {"c": 100}
    later, _ = run(config, put_last, 7, [], batch={"now_ms": 300}, **job)
    assert [row[1:3] for row in later] == [("c", 100)]


def test_without_the_callback_the_sweep_deletes_expired_keys_silently(tmp_path: Path) -> None:
    config = ttl_config(tmp_path, sweep_keys=10)
    run(config, put_last, 0, [Row(word="a", n=1)], batch={"now_ms": 0})
    run(config, put_last, 1, [], batch={"now_ms": 500})
    assert EXPIRY_FROM_OFFSET + "last" not in offsets_of(config)
    with TaskStorage.open(config, "task-0") as storage:
        assert list(storage.stores["last"].items()) == []  # swept at the commit: no callback asked for


def test_a_manual_clock_is_set_and_advanced_and_refuses_what_is_no_time() -> None:
    clock = ManualClock(1000)
    assert clock() == 1000
    clock.now_ms = 5000
    assert clock.advance(250) == 5250 and clock.advance(datetime.timedelta(seconds=1)) == 6250
    clock.now_ms = datetime.datetime(1970, 1, 1, 0, 0, 2, tzinfo=datetime.UTC)
    assert clock() == 2000
    with pytest.raises(ConfigError, match="ms >= 0"):
        clock.advance(-1)
    with pytest.raises(ConfigError, match="naive"):
        ManualClock(datetime.datetime(2024, 1, 1))
