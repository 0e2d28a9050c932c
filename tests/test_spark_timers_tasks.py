"""Timers on the executor side, run in this process without a SparkSession: registering, deleting and listing, which
timers a batch fires and in what order, exactly once under replays, retries and rescales, the watermark a task uses,
the timer store's records and configuration."""

from __future__ import annotations

import datetime
from pathlib import Path
from typing import Any

import pytest
from pyspark.sql import Row

from statebackend.errors import ConfigError
from statebackend.microbatch.batches import EVENT_MAX_OFFSET, WATERMARK_OFFSET
from statebackend.microbatch.keygroups import key_group, task_of_group
from statebackend.microbatch.timers import (
    decode_key,
    encode_key,
    key_text,
    normalize_key,
    stored_timers,
    timer_key_columns,
    with_timer_store,
)
from statebackend.microbatch.watermark import EventClock, next_watermark, parse_delay
from statebackend.spark import EVENT, PROCESSING, TIMERS_STORE, TaskRunner, Timer
from statebackend.spark.stats import TaskStats, is_output, is_stats
from statebackend.task import TaskStorage
from tests.spark_helpers import task_runner, task_stats, word_job
from tests.test_spark import make_config

pytestmark = [pytest.mark.spark_matrix]

KEY_GROUPS = 8


# -- job functions (module level: pickled by reference) ------------------------------------------------------------


def register(stores: Any, rows: Any) -> list[tuple[Any, ...]]:
    """Each row ``(word, at, kind, op)``: counts the word, then registers (op "add") or deletes (op "del") the timer."""
    counts = stores["counts"]
    for row in rows:
        counts.put(row.word, (counts.get(row.word) or 0) + 1)
        if row.op == "add":
            stores.timers.register(row.word, row.at, kind=row.kind)
        else:
            stores.timers.delete(row.word, row.at, kind=row.kind)
    return []


def fired(stores: Any, timers: list[Timer]) -> list[tuple[Any, ...]]:
    """The handler: one output row per due timer, with the batch's times; a fired key's count goes to -1."""
    counts = stores["counts"]
    for timer in timers:
        counts.put(timer.key, -1)
    return [(t.key, t.at_ms, t.kind, stores.batch_id, stores.now_ms, stores.watermark_ms) for t in timers]


class FailFirstCall:
    """The handler, failing at its first call (before the commit): the attempt's writes go with it."""

    def __init__(self, marker: Path) -> None:
        self.marker = marker

    def __call__(self, stores: Any, timers: list[Timer]) -> list[tuple[Any, ...]]:
        output = fired(stores, timers)
        if not self.marker.exists():
            self.marker.write_text("failed once")
            raise RuntimeError("injected failure in on_timers")
        return output


def rearm(stores: Any, timers: list[Timer]) -> list[tuple[Any, ...]]:
    """Registers each fired timer again at the same time: it is due at the next batch, not again in this one."""
    for timer in timers:
        stores.timers.register(timer.key, timer.at_ms, kind=timer.kind)
    return fired(stores, timers)


# -- helpers --------------------------------------------------------------------------------------------------------


def config_of(tmp_path: Path, **extra: object) -> dict[str, object]:
    return with_timer_store(make_config(tmp_path, **extra))


def runner(config: dict[str, object], batch_id: int, *, num_tasks: int = 1, **extra: Any) -> TaskRunner:
    options: dict[str, Any] = {
        "on_timers": fired,
        "key_groups": KEY_GROUPS,
        "key_types": ("string",),
        "on_replay": "redo",
    }
    options.update(extra)
    return TaskRunner.of(
        fn=register,
        config=config,
        batch_id=batch_id,
        num_tasks=num_tasks,
        input_columns=("word", "at", "kind", "op"),
        **options,
    )


def add(word: str, at: int, kind: str = PROCESSING) -> Row:
    return Row(word=word, at=at, kind=kind, op="add")


def drop(word: str, at: int, kind: str = PROCESSING) -> Row:
    return Row(word=word, at=at, kind=kind, op="del")


def run(
    config: dict[str, object], batch_id: int, rows: list[Row], *, task: int = 0, **extra: Any
) -> tuple[list[Any], TaskStats]:
    items = list(runner(config, batch_id, **extra).run_rows(task, iter(rows)))
    stats = [item.stats for item in items if is_stats(item)]
    return [item for item in items if is_output(item)], stats[0]


def timers_of(config: dict[str, object], task: str = "task-0") -> list[tuple[Any, int, str]]:
    with TaskStorage.open(config, task) as storage:
        return [(t.key, t.at_ms, t.kind) for t in stored_timers(storage.store(TIMERS_STORE, typed=False))]


def checkpoint_offsets(config: dict[str, object], task: str = "task-0") -> dict[str, str]:
    with TaskStorage.open(config, task) as storage:
        assert storage.restored is not None
        return dict(storage.restored.input_offsets)


def words_of_task(task: int, num_tasks: int, count: int) -> list[str]:
    found = [
        w
        for w in (f"k{i}" for i in range(500))
        if task_of_group(key_group([w], ["string"], KEY_GROUPS), num_tasks, KEY_GROUPS) == task
    ]
    return found[:count]


# -- tests ----------------------------------------------------------------------------------------------------------


def test_processing_time_timers_fire_once_at_the_first_batch_whose_clock_reaches_them(tmp_path: Path) -> None:
    config = config_of(tmp_path)
    output, stats = run(config, 0, [add("a", 1500), add("b", 3000), add("c", 500)], now_ms=1000)
    assert output == [("c", 500, PROCESSING, 0, 1000, None)]  # due already: fires in the batch that registered it
    assert stats.timers_fired == 1
    assert run(config, 1, [], now_ms=1499)[0] == []
    assert run(config, 2, [], now_ms=2000)[0] == [("a", 1500, PROCESSING, 2, 2000, None)]
    assert run(config, 3, [], now_ms=3000)[0] == [("b", 3000, PROCESSING, 3, 3000, None)]
    assert run(config, 4, [], now_ms=9000)[0] == []
    assert timers_of(config) == []
    with TaskStorage.open(config, "task-0") as storage:
        assert dict(storage.store("counts").items()) == {"a": -1, "b": -1, "c": -1}


def test_due_timers_come_in_time_order_then_kind_then_key(tmp_path: Path) -> None:
    config = config_of(tmp_path)
    run(
        config,
        0,
        [add("b", 700), add("a", 700), add("c", 300, EVENT), add("d", 700, EVENT), add("e", 100)],
        now_ms=50,
        watermark_ms=10,
        event_time="at",
        event_time_type="long",
    )
    output, stats = run(config, 1, [], now_ms=1000, watermark_ms=800, event_time="at", event_time_type="long")
    assert [(key, at, kind) for key, at, kind, *_ in output] == [
        ("e", 100, PROCESSING),
        ("c", 300, EVENT),
        ("d", 700, EVENT),
        ("a", 700, PROCESSING),
        ("b", 700, PROCESSING),
    ]
    assert stats.timers_fired == 5


def test_register_twice_keeps_one_delete_and_list_and_a_rearmed_timer_waits_for_the_next_batch(tmp_path: Path) -> None:
    config = config_of(tmp_path)
    run(config, 0, [add("a", 500), add("a", 500), add("a", 900), add("a", 400, EVENT), drop("a", 900)], now_ms=0)
    assert timers_of(config) == [("a", 400, EVENT), ("a", 500, PROCESSING)]
    output, _ = run(config, 1, [], now_ms=600, on_timers=rearm)
    assert [row[:3] for row in output] == [("a", 500, PROCESSING)]
    assert timers_of(config) == [("a", 400, EVENT), ("a", 500, PROCESSING)]  # registered again by the handler
    assert [row[:3] for row in run(config, 2, [], now_ms=600, on_timers=rearm)[0]] == [("a", 500, PROCESSING)]


def test_each_batch_counts_the_timers_registered_deleted_fired_and_pending(tmp_path: Path) -> None:
    config = config_of(tmp_path)

    def counts(stats: TaskStats) -> tuple[float, float, float, float, int | None]:
        assert stats.metrics is not None
        pending = stats.metrics.histogram("timers.pending")
        assert pending is not None and pending.count == 1  # one sample per task and batch
        return (
            stats.metrics.counter("timers.registered"),
            stats.metrics.counter("timers.deleted"),
            stats.metrics.counter("timers.fired"),
            pending.sum,
            stats.timers_pending,
        )

    # a duplicate is not registered again, a delete of a timer that is not there deletes nothing, "c" fires at once
    _, stats = run(
        config,
        0,
        [
            add("a", 500),
            add("a", 500),
            add("b", 900),
            add("c", 100),
            add("d", 700, EVENT),
            drop("b", 900),
            drop("b", 901),
        ],
        now_ms=200,
    )
    assert counts(stats) == (4, 1, 1, 2, 2)
    _, stats = run(config, 1, [add("e", 2000)], now_ms=600, on_timers=rearm)  # "a" fires and is registered again
    assert counts(stats) == (2, 0, 1, 3, 3)
    _, stats = run(config, 2, [], now_ms=5000)
    assert counts(stats) == (0, 0, 2, 1, 1) and timers_of(config) == [("d", 700, EVENT)]
    _, stats = run(config, 2, [], now_ms=5000)  # a replay counts what it does again: its commit lands once
    assert counts(stats) == (0, 0, 2, 1, 1) and timers_of(config) == [("d", 700, EVENT)]


def test_the_timers_api_lists_deletes_and_refuses_what_it_cannot_keep(tmp_path: Path) -> None:
    config = config_of(tmp_path)
    seen: dict[str, Any] = {}

    def use(stores: Any, rows: Any) -> list[Any]:
        timers = stores.timers
        for at in (300, 100, 200):
            timers.register("a", at)
        timers.register("a", datetime.datetime(1970, 1, 1, 0, 0, 1, tzinfo=datetime.UTC), kind=EVENT)
        timers.register("b", 50)
        seen["listed"] = [(t.key, t.at_ms, t.kind) for t in timers.list("a")]
        seen["events"] = [t.at_ms for t in timers.list("a", kind=EVENT)]
        seen["deleted"] = (timers.delete("a", 200), timers.delete("a", 200), timers.delete_all("a", kind=PROCESSING))
        seen["left"] = [(t.key, t.at_ms, t.kind) for t in timers.list("a")]
        for wrong in [
            lambda: timers.register("a", 1, kind="wall"),
            lambda: timers.register("a", "soon"),
            lambda: timers.register(7, 1),
            lambda: timers.register("x" * 600, 1),
        ]:
            with pytest.raises(ConfigError):
                wrong()
        seen["stores"] = sorted(stores)
        with pytest.raises(KeyError):
            stores[TIMERS_STORE]  # the timer store is no user store
        return []

    timers: dict[str, Any] = {"on_timers": fired, "key_groups": KEY_GROUPS, "now_ms": 0}  # TaskRunner options
    task_runner(config, use, key_types=("string",), **timers).run_rows(0, iter([]))
    assert seen["listed"] == [
        ("a", 100, PROCESSING),
        ("a", 200, PROCESSING),
        ("a", 300, PROCESSING),
        ("a", 1000, EVENT),
    ]
    assert seen["events"] == [1000]
    assert seen["deleted"] == (True, False, 2)
    assert seen["left"] == [("a", 1000, EVENT)]
    assert seen["stores"] == ["counts"]
    assert timers_of(config) == [("a", 1000, EVENT), ("b", 50, PROCESSING)]


def test_a_job_without_on_timers_cannot_register_and_does_not_open_the_timer_store(tmp_path: Path) -> None:
    config = make_config(tmp_path)
    with pytest.raises(ConfigError, match="on_timers"):
        run(config, 0, [add("a", 1)], on_timers=None)
    run(config, 0, [], on_timers=None)
    with TaskStorage.open(config, "task-0") as storage:
        assert TIMERS_STORE not in storage.stores
        assert storage.restored is not None and TIMERS_STORE not in storage.restored.serdes


def test_state_with_timers_is_refused_without_on_timers_rather_than_dropping_them(tmp_path: Path) -> None:
    config = config_of(tmp_path)
    run(config, 0, [add("a", 5000)], now_ms=0)
    with pytest.raises(ConfigError, match="would drop every pending timer"):
        run(make_config(tmp_path), 1, [], on_timers=None, now_ms=1)
    assert timers_of(config) == [("a", 5000, PROCESSING)]


def test_a_replayed_batch_fires_the_same_timers_at_the_same_clock_and_they_are_gone_once(tmp_path: Path) -> None:
    config = config_of(tmp_path)
    run(config, 0, [add("a", 1500), add("b", 2500)], now_ms=1000)
    first, _ = run(config, 1, [], now_ms=2000)
    assert [row[0] for row in first] == ["a"]
    replayed, stats = run(config, 1, [], now_ms=2600)  # a new driver's clock: the checkpoint's is used
    assert replayed == first and stats.base_seq == 1
    assert timers_of(config) == [("b", 2500, PROCESSING)]
    assert run(config, 2, [], now_ms=2600)[0] == [("b", 2500, PROCESSING, 2, 2600, None)]
    assert timers_of(config) == []


def test_a_handler_failing_before_the_commit_is_retried_and_its_timers_fire_once(tmp_path: Path) -> None:
    config = config_of(tmp_path)
    run(config, 0, [add("a", 100), add("b", 900)], now_ms=0)
    failing = FailFirstCall(tmp_path / "marker")
    with pytest.raises(RuntimeError, match="injected"):
        run(config, 1, [], now_ms=1000, on_timers=failing)
    assert timers_of(config) == [("a", 100, PROCESSING), ("b", 900, PROCESSING)]  # nothing committed
    output, stats = run(config, 1, [], now_ms=1000, on_timers=failing)
    assert [row[:2] for row in output] == [("a", 100), ("b", 900)] and stats.timers_fired == 2
    assert timers_of(config) == []


def test_event_time_timers_fire_at_the_watermark_and_a_replay_keeps_the_recorded_one(tmp_path: Path) -> None:
    config = config_of(tmp_path)
    options: dict[str, Any] = {"event_time": "at", "event_time_type": "long"}  # TaskRunner options
    _, stats = run(
        config,
        0,
        [add("a", 400, EVENT), add("b", 900, EVENT), add("c", 100)],
        now_ms=0,
        watermark_ms=None,
        event_max_ms=None,
        **options,
    )
    assert (stats.watermark_ms, stats.event_max_ms) == (None, 900)  # the largest event time of the input
    assert WATERMARK_OFFSET not in checkpoint_offsets(config)
    assert checkpoint_offsets(config)[EVENT_MAX_OFFSET] == "900"
    output, stats = run(config, 1, [], now_ms=0, watermark_ms=500, event_max_ms=900, **options)
    assert output == [("a", 400, EVENT, 1, 0, 500)] and stats.watermark_ms == 500
    assert checkpoint_offsets(config)[WATERMARK_OFFSET] == "500"
    replayed, stats = run(config, 1, [], now_ms=0, watermark_ms=950, event_max_ms=900, **options)
    assert replayed == output and stats.watermark_ms == 500
    # never below the base's watermark, whatever the driver says
    _, stats = run(config, 2, [], now_ms=0, watermark_ms=100, event_max_ms=None, **options)
    assert (stats.watermark_ms, stats.event_max_ms) == (500, 900)
    assert timers_of(config) == [("b", 900, EVENT), ("c", 100, PROCESSING)]


def test_a_timer_for_a_key_of_another_task_is_refused(tmp_path: Path) -> None:
    config = config_of(tmp_path)
    theirs = words_of_task(1, 2, 1)[0]
    mine = words_of_task(0, 2, 1)[0]
    run(config, 0, [add(mine, 10)], num_tasks=2, now_ms=0)
    with pytest.raises(ConfigError, match="owned by task-1, not task-0"):
        run(config, 1, [add(theirs, 10)], num_tasks=2, now_ms=0)


def test_timers_move_with_their_key_groups_when_num_tasks_changes_and_fire_once(tmp_path: Path) -> None:
    config = config_of(tmp_path)
    words = {task: words_of_task(task, 2, 6) for task in range(2)}
    for task in range(2):
        run(config, 0, [add(w, 1000 + i) for i, w in enumerate(words[task])], task=task, num_tasks=2, now_ms=0)
    every = sorted(w for ws in words.values() for w in ws)
    fired_keys: list[str] = []
    for task in range(3):  # the rescaled batch: each new task takes its key groups' timers, then fires the due ones
        output, _ = run(config, 1, [], task=task, num_tasks=3, now_ms=1002)
        fired_keys += [row[0] for row in output]
        assert all(task_of_group(key_group([row[0]], ["string"], KEY_GROUPS), 3, KEY_GROUPS) == task for row in output)
    pending = [key for task in range(3) for key, _, _ in timers_of(config, f"task-{task}")]
    assert sorted(fired_keys + pending) == every and not set(fired_keys) & set(pending)
    for task in range(3):
        assert all(
            task_of_group(key_group([k], ["string"], KEY_GROUPS), 3, KEY_GROUPS) == task
            for k, _, _ in timers_of(config, f"task-{task}")
        )
    for task in range(3):
        output, _ = run(config, 2, [], task=task, num_tasks=3, now_ms=5000)
        fired_keys += [row[0] for row in output]
    assert sorted(fired_keys) == every


@pytest.mark.parametrize(
    ("key", "types"),
    [
        ("alice", ("string",)),
        (7, ("long",)),
        ((1, "x"), ("integer", "string")),
        (2.5, ("double",)),
        (b"\x00\xff", ("binary",)),
        (True, ("boolean",)),
        (datetime.date(2024, 2, 29), ("date",)),
        (datetime.datetime(2024, 5, 1, 12, 30, 1, 5), ("timestamp",)),
        (datetime.datetime(2024, 5, 1, 12, 30, tzinfo=datetime.UTC), ("timestamp",)),
        (None, ("string",)),
    ],
)
def test_a_timer_key_reads_back_as_the_values_it_was_registered_with(key: Any, types: tuple[str, ...]) -> None:
    columns = normalize_key(key, types)
    assert decode_key(encode_key(columns)) == columns
    assert columns == (key if isinstance(key, tuple) else (key,))


def test_keys_normalize_by_their_column_types_and_records_name_their_key() -> None:
    import numpy as np

    assert encode_key(normalize_key(np.int64(3), ("long",))) == encode_key(normalize_key(3, ("long",)))
    assert encode_key(normalize_key(-0.0, ("double",))) == encode_key(normalize_key(0, ("double",)))
    with pytest.raises(ConfigError, match="not a value of a long key column"):
        normalize_key("3", ("long",))
    with pytest.raises(ConfigError, match="tuple of the 2 key column values"):
        normalize_key("a", ("string", "long"))
    assert timer_key_columns(b"D" + b"p" + bytes(8) + encode_key(("a", 1))) == ("a", 1)
    encoded = encode_key(("a",))
    assert timer_key_columns(b"K" + len(encoded).to_bytes(2, "big") + encoded + b"e" + bytes(8)) == ("a",)
    assert key_text("alice") == "alice"
    assert key_text((1, b"\x01", datetime.date(2024, 1, 2))) == '[1,"01","2024-01-02"]'


def test_the_timer_store_is_backed_up_by_the_jobs_backends_and_its_serdes_are_fixed(tmp_path: Path) -> None:
    config = make_config(
        tmp_path,
        **{"stores.other.backup.factories": "blobsnapshot,changelog", "stores.other.restore.factories": "blobsnapshot"},
    )
    declared = with_timer_store(config)
    prefix = f"stores.{TIMERS_STORE}."
    assert declared[prefix + "backup.factories"] == "changelog,blobsnapshot"  # counts' first, then other's
    assert declared[prefix + "restore.factories"] == "changelog,blobsnapshot"
    assert (declared[prefix + "key.serde"], declared[prefix + "msg.serde"]) == ("bytes", "bytes")
    assert with_timer_store(declared) == declared  # declaring it again changes nothing
    chosen = with_timer_store({**config, prefix + "backup.factories": "blobsnapshot"})
    assert chosen[prefix + "backup.factories"] == "blobsnapshot" and prefix + "restore.factories" not in chosen
    with pytest.raises(ConfigError, match="serdes and TTL are fixed"):
        with_timer_store({**config, prefix + "msg.serde": "json"})
    bare = {k: v for k, v in config.items() if not k.startswith("stores.")}
    with pytest.raises(ConfigError, match="declares no store"):
        with_timer_store(bare)


def test_the_watermark_is_the_largest_event_time_before_minus_the_delay_never_decreasing() -> None:
    assert next_watermark(None, None, 100) is None
    assert next_watermark(None, 1000, 100) == 900
    assert next_watermark(950, 1000, 100) == 950
    assert next_watermark(950, 2000, 100) == 1900
    assert parse_delay("10s") == 10_000 and parse_delay(datetime.timedelta(minutes=1)) == 60_000
    assert parse_delay(250) == 250
    clock = EventClock(100)

    def stats(task: int, watermark: int | None, event_max: int | None) -> TaskStats:
        return task_stats(task, batch_id=3, watermark_ms=watermark, event_max_ms=event_max)

    clock.completed(3, [stats(0, 500, 800), stats(1, 500, 1200)], 2)
    assert clock.for_batch(None, {}, 4) == (1100, 1200)  # known: no checkpoint read (no Spark session here)
    clock.completed(3, [stats(0, 500, 800)], 2)  # a task's stats missing: forgotten, read back next batch
    assert clock._known is None


def test_event_times_read_alike_from_rows_arrow_batches_and_pandas_frames() -> None:
    import pandas as pd
    import pyarrow as pa

    from statebackend.microbatch.watermark import EventTimes

    instants = [
        datetime.datetime(2024, 3, 31, 0, 30, tzinfo=datetime.UTC),
        datetime.datetime(2024, 3, 31, 1, 30, tzinfo=datetime.UTC),
    ]  # Paris changes to summer time at 1:00
    expected = int(instants[1].timestamp() * 1000)
    rows = EventTimes("ts", "timestamp")
    list(rows.rows(iter([Row(ts=i.astimezone().replace(tzinfo=None)) for i in instants] + [Row(ts=None)])))
    batches = EventTimes("ts", "timestamp")
    list(batches.batches(iter([pa.record_batch({"ts": pa.array(instants + [None], pa.timestamp("us", tz="UTC"))})])))
    frames = EventTimes("ts", "timestamp", "Europe/Paris")
    paris = [
        i.astimezone(datetime.timezone(datetime.timedelta(hours=h))).replace(tzinfo=None)
        for i, h in zip(instants, (1, 2), strict=True)
    ]
    frames.frame(pd.DataFrame({"ts": pd.to_datetime(paris)}))
    assert rows.max_ms == batches.max_ms == frames.max_ms == expected
    longs = EventTimes("ts", "long")
    list(longs.batches(iter([pa.record_batch({"ts": pa.array([5, None, 7], pa.int64())})])))
    longs.frame(pd.DataFrame({"ts": [9, 3]}))
    assert longs.max_ms == 9
    assert EventTimes(None).rows(iter([1])) is not None and EventTimes(None).max_ms is None


def test_the_driver_lists_the_tasks_that_ran_on_another_executor_than_before(tmp_path: Path) -> None:

    job = word_job(register, make_config(tmp_path), num_tasks=3, output_schema=None)

    def ran(*executors: str) -> list[int]:
        job._note_moves(
            0,
            [
                task_stats(task, base_seq=0, committed_seq=1, executor=executor)
                for task, executor in enumerate(executors)
            ],
        )
        return job.last_batch_moved

    assert ran("h1:/a", "h2:/b", "h1:/a") == []  # first sight: nothing moved
    assert ran("h1:/a", "h1:/a", "h1:/a") == [1]
    assert ran("h2:/b", "h1:/a", "h1:/a") == [0]
