"""The executor side of the Spark driver, run in this process without a SparkSession: which checkpoint a task
restores, what it refuses, and two attempts of one task at once (one commit wins, the batch is applied once)."""

from __future__ import annotations

import shutil
import threading
from pathlib import Path
from typing import Any

import attrs
import pytest
from pyspark.sql import Row
from statebackend.checkpoint.log import HEAD_BLOB
from statebackend.checkpoint.serde import decode_head, encode_head

from statebackend.blobstores.file import FileBlobStore
from statebackend.errors import CommitConflictError, CommitError, ConfigError, StateBackendError
from statebackend.spark import ATTEMPTS_DIR, StatefulForeachBatch, TaskRunner
from statebackend.spark.stats import is_output
from statebackend.task import TaskStorage
from tests.spark_helpers import task_runner, word_job
from tests.test_spark import count_rows, make_config

pytestmark = [pytest.mark.spark_matrix]

NUM_TASKS = 2


def runner(config: dict[str, object], batch_id: int, fn: Any = count_rows, **extra: Any) -> TaskRunner:
    return task_runner(config, fn, batch_id, **{"num_tasks": NUM_TASKS, **extra})


def rows(*words: str) -> list[Row]:
    return [Row(word=w) for w in words]


def run(config: dict[str, object], batch_id: int, *words: str, **extra: Any) -> list[Any]:
    return [item for item in runner(config, batch_id, **extra).run_rows(0, iter(rows(*words))) if is_output(item)]


def task_state(config: dict[str, object]) -> tuple[dict[str, int], int]:
    with TaskStorage.open(config, "task-0") as task:
        assert task.restored is not None
        return dict(task.store("counts").items()), task.commit_manager.next_seq - 1


class WaitForEachOther:
    """Counts, then waits until the other attempt has counted too, so both commit the same batch at once."""

    def __init__(self, barrier: threading.Barrier) -> None:
        self.barrier = barrier

    def __call__(self, stores: Any, input_rows: Any) -> list[tuple[str, int]]:
        output = count_rows(stores, input_rows)
        self.barrier.wait(timeout=30)
        return output


def test_two_attempts_at_once_one_commit_wins_and_a_retry_redoes_the_batch_once(tmp_path: Path) -> None:
    config = make_config(tmp_path)
    run(config, 0, "a", "b")
    fn = WaitForEachOther(threading.Barrier(2))
    results: list[Any] = []

    def attempt() -> None:
        try:
            results.append(
                [item for item in runner(config, 1, fn).run_rows(0, iter(rows("a", "c"))) if is_output(item)]
            )
        except CommitError as exc:
            results.append(exc)

    threads = [threading.Thread(target=attempt) for _ in range(2)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(60)
    conflicts = [r for r in results if isinstance(r, CommitError)]
    assert len(results) == 2 and len(conflicts) == 1
    assert isinstance(conflicts[0], CommitConflictError)
    assert "another attempt of this task committed" in str(conflicts[0])
    assert [r for r in results if not isinstance(r, CommitError)] == [[("a", 2), ("c", 1)]]
    assert task_state(config) == ({"a": 2, "b": 1, "c": 1}, 2)
    assert list((tmp_path / "local" / ATTEMPTS_DIR).iterdir()) == []  # the private copy is gone
    # Spark retries the losing attempt: it restores batch 0's checkpoint and redoes batch 1, never applying it twice
    assert run(config, 1, "a", "c") == [("a", 2), ("c", 1)]
    assert task_state(config) == ({"a": 2, "b": 1, "c": 1}, 3)


def test_next_batch_after_a_replay_builds_on_the_redo(tmp_path: Path) -> None:
    config = make_config(tmp_path)
    run(config, 0, "a")
    run(config, 1, "a", "b")
    assert run(config, 1, "a", "b") == [("a", 2), ("b", 1)]
    assert run(config, 2, "b") == [("b", 2)]
    assert task_state(config) == ({"a": 2, "b": 2}, 4)


def test_batch_older_than_the_newest_committed_one_is_refused(tmp_path: Path) -> None:
    config = make_config(tmp_path)
    for batch_id in range(3):
        run(config, batch_id, "a")
    with pytest.raises(StateBackendError, match="checkpoint location was reset"):
        run(config, 1, "a")
    assert task_state(config) == ({"a": 3}, 3)


def test_batch_whose_previous_batchs_checkpoint_is_gone_is_refused_not_restored_from_older_state(
    tmp_path: Path,
) -> None:
    config = make_config(tmp_path)
    for batch_id in range(3):
        run(config, batch_id, "a")
    # batch 2's checkpoint disappears from the blob store, and the machine that knew of it is gone (local dir wiped):
    # only Spark's batch id can tell that batch 2 was acknowledged. The file store keeps the log in its head: the
    # head is put back from a copy taken before checkpoint #3 (batch 2)
    blobs = FileBlobStore(str(tmp_path / "blobs"))
    head_name = f"wordcount/task-0/checkpoints/{HEAD_BLOB}"
    data, version = blobs.get_versioned(head_name)
    head = decode_head(data, source=head_name, job="wordcount", task="task-0")
    assert [entry.seq for entry in head.entries] == [1, 2, 3]
    older = attrs.evolve(head, entries=head.entries[:-1])
    blobs.put_if(head_name, encode_head(older), version=version)
    shutil.rmtree(tmp_path / "local")
    with pytest.raises(StateBackendError, match=r"batches 2\.\.2 are missing"):
        run(config, 3, "a")
    with TaskStorage.open(config, "task-0") as task:  # nothing was committed on top of the older state
        assert task.commit_manager.next_seq - 1 == 2
        assert dict(task.store("counts").items()) == {"a": 2}


def route_words(words: list[str], num_tasks: int, key_groups: int | None) -> dict[int, list[str]]:
    """Which task each word goes to, as the driver routes rows (Spark's hash, in Python)."""
    from statebackend.microbatch.keygroups import key_group, spark_hash, task_of_group

    routed: dict[int, list[str]] = {t: [] for t in range(num_tasks)}
    for word in words:
        if key_groups is None:
            routed[spark_hash([word], ["string"]) % num_tasks].append(word)
        else:
            routed[task_of_group(key_group([word], ["string"], key_groups), num_tasks, key_groups)].append(word)
    return routed


def run_all(config: dict[str, object], batch_id: int, words: list[str], num_tasks: int, key_groups: int | None) -> None:
    for task, task_words in route_words(words, num_tasks, key_groups).items():
        runner = task_runner(
            config, count_rows, batch_id, num_tasks=num_tasks, key_groups=key_groups, key_types=("string",)
        )
        list(runner.run_rows(task, iter(rows(*task_words))))


def tasks_state(config: dict[str, object], num_tasks: int) -> dict[int, dict[str, int]]:
    state = {}
    for task in range(num_tasks):
        with TaskStorage.open(config, f"task-{task}") as storage:
            state[task] = dict(storage.store("counts").items())
    return state


WORDS = [f"w{i}" for i in range(60)]


@pytest.mark.parametrize("backend", ["changelog", "blobsnapshot"])
def test_rescaling_gives_each_task_exactly_the_keys_of_its_key_groups(tmp_path: Path, backend: str) -> None:
    config = make_config(tmp_path, **{"stores.counts.backup.factories": backend})
    if backend != "changelog":
        del config["changelog.snapshot.interval.commits"]
    expected: dict[str, int] = {}
    for batch_id, num_tasks in enumerate([2, 2, 3, 3, 1, 4]):
        words = WORDS[batch_id * 7 : batch_id * 7 + 30]
        run_all(config, batch_id, words, num_tasks, key_groups=8)
        for word in words:
            expected[word] = expected.get(word, 0) + 1
        state = tasks_state(config, num_tasks)
        routed = route_words(sorted(expected), num_tasks, 8)
        for task in range(num_tasks):  # each task holds exactly its key groups' keys, with every count right
            assert state[task] == {w: expected[w] for w in routed[task]}, (batch_id, num_tasks, task)


def test_changing_num_tasks_with_too_few_retained_checkpoints_is_refused_before_anything_changes(
    tmp_path: Path,
) -> None:
    config = make_config(tmp_path, **{"task.checkpoint.retained": 2})
    run_all(config, 0, WORDS[:20], 2, key_groups=8)
    before = tasks_state(config, 2)
    with pytest.raises(ConfigError, match=r"task.checkpoint.retained >= 3"):
        run_all(config, 1, WORDS[:20], 3, key_groups=8)
    assert tasks_state(config, 2) == before


def test_changing_the_number_of_key_groups_is_refused(tmp_path: Path) -> None:
    config = make_config(tmp_path)
    run_all(config, 0, ["a", "b"], 2, key_groups=8)
    with pytest.raises(ConfigError, match="key_groups=8"):
        run_all(config, 1, ["a"], 2, key_groups=16)


def test_state_written_before_key_groups_migrates_at_the_first_batch(tmp_path: Path) -> None:
    config = make_config(tmp_path)
    run_all(config, 0, WORDS[:40], 2, key_groups=None)  # hashed modulo num_tasks, no key_groups offset
    run_all(config, 1, WORDS[20:50], 2, key_groups=8)
    expected = {w: 1 for w in WORDS[:50]} | {w: 2 for w in WORDS[20:40]}
    routed = route_words(sorted(expected), 2, 8)
    state = tasks_state(config, 2)
    assert state == {t: {w: expected[w] for w in routed[t]} for t in range(2)}


def test_a_rescaled_batch_replayed_after_a_task_committed_it_is_redone_from_the_old_layout(tmp_path: Path) -> None:
    config = make_config(tmp_path)
    run_all(config, 0, WORDS[:30], 2, key_groups=8)
    run_all(config, 1, WORDS[10:40], 3, key_groups=8)  # rescaled: every task committed batch 1
    run_all(config, 1, WORDS[10:40], 3, key_groups=8)  # Spark re-runs it: redone from the 2-task batch 0
    expected = {w: 1 for w in WORDS[:40]} | {w: 2 for w in WORDS[10:30]}
    routed = route_words(sorted(expected), 3, 8)
    assert tasks_state(config, 3) == {t: {w: expected[w] for w in routed[t]} for t in range(3)}


def test_replay_whose_base_was_deleted_by_retention_is_refused(tmp_path: Path) -> None:
    config = make_config(tmp_path, **{"task.checkpoint.retained": 2})
    run(config, 0, "a")
    run(config, 1, "a")
    run(config, 1, "a")  # the redo of batch 1 is #3; retention keeps #2 and #3, both batch 1
    with pytest.raises(StateBackendError, match="task.checkpoint.retained"):
        run(config, 1, "a")


def test_on_replay_skip_leaves_a_committed_batch_alone(tmp_path: Path) -> None:
    config = make_config(tmp_path)
    run(config, 0, "a")
    assert run(config, 0, "a", on_replay="skip") == []
    assert task_state(config) == ({"a": 1}, 1)


def test_first_batch_replayed_starts_from_empty_state(tmp_path: Path) -> None:
    config = make_config(tmp_path)
    run(config, 0, "a")
    assert run(config, 0, "a") == [("a", 1)]
    assert task_state(config) == ({"a": 1}, 2)


@pytest.mark.parametrize(
    ("options", "message"),
    [
        ({"mode": "columns"}, "mode 'columns' is not one of rows, arrow, pandas"),
        ({"mode": "arrow"}, "needs output_schema"),
        ({"num_tasks": 0}, "num_tasks must be a positive int"),
        ({"key_columns": []}, "at least one key column"),
        ({"on_replay": "ignore"}, "on_replay 'ignore'"),
        ({"key_groups": 0}, "key_groups must be an int from 1 to 32768"),
        ({"num_tasks": 9, "key_groups": 8}, r"num_tasks \(9\) cannot exceed key_groups \(8\)"),
        ({"key_of": "word"}, "key_of must be a function"),
    ],
)
def test_wrong_arguments_are_refused_on_the_driver(tmp_path: Path, options: dict[str, Any], message: str) -> None:
    arguments: dict[str, Any] = {"key_columns": ["word"], "num_tasks": 2, "config": make_config(tmp_path)}
    arguments.update(options)
    with pytest.raises(ConfigError, match=message):
        StatefulForeachBatch(count_rows, **arguments)


def test_misspelled_config_key_is_refused_on_the_driver(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match="tsak.commit.ms"):
        word_job(count_rows, make_config(tmp_path, **{"tsak.commit.ms": 5}), num_tasks=2, output_schema=None)


class _Node:
    """An object that can sit in a reference cycle and be watched by a weak reference."""

    def __init__(self) -> None:
        self.other: object = None


def _garbage_cycle() -> Any:
    import weakref

    first, second = _Node(), _Node()
    first.other, second.other = second, first
    return weakref.ref(first)


def test_a_task_collects_then_freezes_the_survivors_unless_told_not_to(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    import gc

    from statebackend.microbatch import worker as executor

    config = make_config(tmp_path)
    monkeypatch.setattr(executor, "_gc_foreign", None)
    monkeypatch.setattr(executor, "_gc_tasks", 0)
    gc.disable()  # no automatic collection: only the task's may free the cycle below
    try:
        gc.unfreeze()
        run({**config, "task.gc.freeze": "false"}, 0, "a")
        assert gc.get_freeze_count() == 0
        garbage = _garbage_cycle()  # a cycle nothing refers to: only a collection frees it
        assert garbage() is not None
        run(config, 1, "b")
        assert garbage() is None  # collected before the freeze, not frozen with the survivors
        assert gc.get_freeze_count() > 0
    finally:
        gc.unfreeze()
        gc.enable()


def test_a_frozen_cycle_that_turns_to_garbage_is_collected_at_the_next_full_collection(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    import gc
    import weakref

    from statebackend.microbatch import worker as executor

    monkeypatch.setattr(executor, "GC_FULL_EVERY", 3)
    monkeypatch.setattr(executor, "_gc_tasks", 0)
    monkeypatch.setattr(executor, "_gc_foreign", None)
    gc.unfreeze()
    try:
        first = _Node()
        first.other = _Node()
        first.other.other = first  # type: ignore[attr-defined]
        watched = weakref.ref(first)
        executor.freeze_survivors()  # task 1: the cycle is alive, and frozen
        del first
        executor.freeze_survivors()  # task 2: frozen objects are not collected
        assert watched() is not None
        executor.freeze_survivors()  # task 3
        assert watched() is not None
        executor.freeze_survivors()  # task 4: after 3 tasks, everything is thawed and collected in full
        assert watched() is None
    finally:
        gc.unfreeze()


def test_a_process_that_froze_objects_itself_is_left_alone(monkeypatch: pytest.MonkeyPatch) -> None:
    import gc

    from statebackend.microbatch import worker as executor

    monkeypatch.setattr(executor, "_gc_tasks", 0)
    monkeypatch.setattr(executor, "_gc_foreign", None)
    gc.unfreeze()
    gc.disable()  # no automatic collection: the cycle below lives unless the task collects
    try:
        gc.freeze()  # the host's own freeze, before any task
        calls: list[str] = []
        for name in ("collect", "freeze", "unfreeze"):
            monkeypatch.setattr(gc, name, lambda *args, _name=name: calls.append(_name))  # the worker's gc
        garbage = _garbage_cycle()
        for _ in range(executor.GC_FULL_EVERY + 1):
            executor.freeze_survivors()
        monkeypatch.undo()
        assert calls == []  # neither thawed, collected nor frozen more
        assert garbage() is not None
    finally:
        gc.unfreeze()
        gc.enable()
