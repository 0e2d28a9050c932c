"""Trust of rescaling and of the batch clock, run in this process without a SparkSession: a stored key's key group is
the one Spark routes its row to, a key held by the wrong task is an error (never a silent loss), a task never
restores its checkpoint of an abandoned attempt, and an expired key never comes back."""

from __future__ import annotations

import datetime
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from pyspark.sql import Row

from statebackend.config import Settings
from statebackend.errors import ConfigError, StateBackendError
from statebackend.microbatch.keygroups import hash_long, key_group, spark_hash, task_of_group
from statebackend.spark import TaskRunner
from statebackend.spark.stats import is_output
from statebackend.task import TaskStorage
from tests.test_spark import count_rows
from tests.test_spark import make_config as counts_config
from tests.test_ttl import count_words
from tests.test_ttl import make_config as ttl_config

K = 8


@pytest.fixture
def new_york(monkeypatch: pytest.MonkeyPatch) -> Iterator[None]:
    """The process runs in a time zone other than UTC, as a Spark executor may."""
    monkeypatch.setenv("TZ", "America/New_York")
    time.tzset()
    yield
    monkeypatch.undo()
    time.tzset()


@pytest.mark.usefixtures("new_york")
def test_a_timestamp_key_hashes_as_spark_hashes_its_row_in_any_time_zone() -> None:
    """Spark hashes a timestamp as its microseconds since the epoch; a task's Row holds it as a naive datetime in the
    process's local time (PySpark's TimestampType.fromInternal), a tz-aware one from Arrow."""
    import pandas as pd
    from pyspark.sql.types import TimestampNTZType, TimestampType

    july = 1_719_835_200_123_456  # 2024-07-01 12:00:00.123456 UTC (summer time in New York)
    ambiguous = 1_730_615_400_000_000  # 2024-11-03 06:30 UTC: 01:30 in New York, the second time (fold=1)
    for micros in (july, ambiguous, ambiguous - 3_600_000_000, -315_619_200_000_000, -1, 0):
        row_value = TimestampType().fromInternal(micros)
        assert row_value.tzinfo is None
        assert spark_hash([row_value], ["timestamp"]) == hash_long(micros), row_value
        assert spark_hash([pd.Timestamp(row_value)], ["timestamp"]) == hash_long(micros), row_value
        aware = datetime.datetime.fromtimestamp(micros // 1_000_000, datetime.UTC).replace(
            microsecond=micros % 1_000_000
        )
        assert spark_hash([aware.astimezone(_zone("Europe/Berlin"))], ["timestamp"]) == hash_long(micros)
        ntz = TimestampNTZType().fromInternal(micros)  # wall-clock time, hashed as if UTC
        assert spark_hash([ntz], ["timestamp_ntz"]) == hash_long(micros)


def _zone(name: str) -> datetime.tzinfo:
    from zoneinfo import ZoneInfo

    return ZoneInfo(name)


def route(words: list[str], num_tasks: int) -> dict[int, list[str]]:
    routed: dict[int, list[str]] = {t: [] for t in range(num_tasks)}
    for word in words:
        routed[task_of_group(key_group([word], ["string"], K), num_tasks, K)].append(word)
    return routed


def run_task(
    config: dict[str, object],
    fn: Any,
    batch_id: int,
    task: int,
    num_tasks: int,
    words: list[str],
    now: int | None = None,
) -> list[Any]:
    runner = TaskRunner.of(
        fn=fn,
        config=config,
        batch_id=batch_id,
        num_tasks=num_tasks,
        on_replay="redo",
        input_columns=("word",),
        now_ms=now,
        key_groups=K,
        key_types=("string",),
    )
    return [item for item in runner.run_rows(task, iter([Row(word=w) for w in words])) if is_output(item)]


def run_tasks(
    config: dict[str, object],
    fn: Any,
    batch_id: int,
    num_tasks: int,
    words: list[str],
    now: int | None = None,
    only: tuple[int, ...] | None = None,
) -> dict[str, int]:
    out: dict[str, int] = {}
    for task, task_words in route(words, num_tasks).items():
        if only is None or task in only:
            out.update(dict(run_task(config, fn, batch_id, task, num_tasks, task_words, now)))
    return out


def count_with_total(stores: Any, rows: Any) -> list[tuple[str, int]]:
    """Word count that also keeps a per-task total under a key no row has: the task's state is not keyed by its
    rows' key column alone."""
    rows = list(rows)
    out = count_rows(stores, iter(rows))
    counts = stores["counts"]
    counts.put("#total", (counts.get("#total") or 0) + len(rows))
    return out


WORDS = [f"w{i}" for i in range(40)]


@pytest.mark.parametrize("legacy", [False, True])
def test_a_key_held_by_a_task_not_owning_its_key_group_fails_the_rescale_instead_of_being_merged(
    tmp_path: Path, legacy: bool
) -> None:
    config = counts_config(tmp_path)
    if legacy:  # state written before key groups: rows hashed modulo num_tasks
        for task in range(2):
            words = [w for w in WORDS if spark_hash([w], ["string"]) % 2 == task]
            runner = TaskRunner.of(
                fn=count_with_total, config=config, batch_id=0, num_tasks=2, on_replay="redo", input_columns=("word",)
            )
            list(runner.run_rows(task, iter([Row(word=w) for w in words])))
    else:
        run_tasks(config, count_with_total, 0, 2, WORDS)
    # every old task holds "#total": taking them all into one new task would keep one and drop the other silently
    with pytest.raises(ConfigError, match=r"'#total'.*task-[01].*does not own"):
        run_tasks(config, count_with_total, 1, 3, WORDS)


def test_a_task_never_restores_its_checkpoint_of_an_abandoned_attempt_of_the_previous_batch(tmp_path: Path) -> None:
    """Batch 1 first runs with 3 tasks and only task-2 commits; the query is restarted with 2 tasks, which replay
    batch 1 (a new driver: a new clock); then batch 2 runs with 3 tasks again. Task-2's own newest checkpoint is batch
    1 with this very layout, but batch 1 is the 2-task replay's: task-2 takes its key groups from it."""
    config = ttl_config(tmp_path, **{"stores.last.ttl.ms": 10_000, "job.name": "sessions"})
    assert run_tasks(config, count_words, 0, 2, WORDS, now=0) == {w: 1 for w in WORDS}
    stale = run_tasks(config, count_words, 1, 3, WORDS, now=1_000, only=(2,))  # the others fail: batch 1 fails
    assert stale and set(stale.values()) == {2}
    # the restart replays batch 1 with 2 tasks much later: every key expired (at 10_000) and counts from 1
    assert run_tasks(config, count_words, 1, 2, WORDS, now=20_000) == {w: 1 for w in WORDS}
    # batch 2 with 3 tasks: every word was counted once since it expired, whatever task holds it now
    assert run_tasks(config, count_words, 2, 3, WORDS, now=21_000) == {w: 2 for w in WORDS}


def test_a_clock_that_goes_back_never_brings_an_expired_key_back(tmp_path: Path) -> None:
    """A driver whose wall clock is behind the previous batch's (a restart on another machine, a clock step): the
    batch runs at the clock its base checkpoint recorded, so a key expired at an earlier batch stays expired."""
    config = ttl_config(tmp_path, **{"stores.last.ttl.sweep.keys": 0})  # nothing swept: expired keys stay stored
    assert run_task(config, count_words, 0, 0, 1, ["a"], now=100_000) == [("a", 1)]  # lives until 100_100
    assert run_task(config, count_words, 1, 0, 1, ["b"], now=200_000) == [("b", 1)]  # a has expired
    assert run_task(config, count_words, 2, 0, 1, ["a"], now=100_050) == [("a", 1)]  # the clock went back
    with TaskStorage.open(config, "task-0") as storage:
        assert storage.restored is not None
        assert int(storage.restored.input_offsets["now.ms"]) == 200_000


def read_all(config: dict[str, object], num_tasks: int, checkpoint: str | int = "latest") -> list[tuple[str, Any]]:
    from statebackend.spark.read import _StateReader

    reader = _StateReader(Settings.from_config(config), "counts", checkpoint, num_tasks, None)
    return [(key, value) for _, key, value in reader.read(range(num_tasks))]


def test_read_state_refuses_a_rescale_committed_by_some_tasks_only(tmp_path: Path) -> None:
    """The batch that grows 2 -> 3 tasks is committed by task-0 and task-1, not task-2: the keys of task-2's key
    groups are only in the 2-task checkpoints. read_state(num_tasks=3) must not return the state without them."""
    config = counts_config(tmp_path)
    run_tasks(config, count_rows, 0, 2, WORDS)
    assert sorted(read_all(config, 2)) == sorted((w, 1) for w in WORDS)
    run_tasks(config, count_rows, 1, 3, WORDS, only=(0, 1))
    for checkpoint in ("latest", 1):
        with pytest.raises(StateBackendError, match="task-2"):
            read_all(config, 3, checkpoint)
    run_tasks(config, count_rows, 1, 3, WORDS, only=(2,))  # the replay completes the batch
    assert sorted(read_all(config, 3)) == sorted((w, 2) for w in WORDS)


def test_read_state_refuses_a_migration_to_key_groups_committed_by_some_tasks_only(tmp_path: Path) -> None:
    """State written before key groups (hash modulo num_tasks) moves to key groups with the same num_tasks; only
    task-0 committed that batch: task-1's keys are spread the old way, a read would give keys twice and miss others."""
    config = counts_config(tmp_path)
    for task in range(2):
        words = [w for w in WORDS if spark_hash([w], ["string"]) % 2 == task]
        runner = TaskRunner.of(
            fn=count_rows, config=config, batch_id=0, num_tasks=2, on_replay="redo", input_columns=("word",)
        )
        list(runner.run_rows(task, iter([Row(word=w) for w in words])))
    run_tasks(config, count_rows, 1, 2, WORDS, only=(0,))
    with pytest.raises(StateBackendError, match="key_groups"):
        read_all(config, 2)
