"""TaskStorage's first invariant: a task gets back exactly the state of its last durable checkpoint, or a clear error.

One test per way it was seen to break (fencing at open, speculative and zombie attempts, checkpoint integrity, a
deleted newest checkpoint, short listings, a checkpoint write whose reply was lost, a stale failure re-raised, restore
fallback). Deterministic: concurrency is driven by events, never by sleeps.
"""

from __future__ import annotations

import logging
import re
import threading
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import pytest
from statebackend.backends.blobsnapshot.backup import BlobSnapshotBackupManager
from statebackend.backends.changelog.backup import ChangelogBackupManager

from statebackend.blobstores.memory import MemoryBlobStore
from statebackend.errors import (
    CommitError,
    ConfigError,
    CorruptDataError,
    StateBackendError,
    TransientStorageError,
)
from statebackend.task import TaskStorage
from statebackend.testing.backend_contract import contents, write_round
from statebackend.testing.conditional_put_contract import PerSeqMemoryBlobStore
from tests.backend_helpers import CHECKPOINTS, HookedBlobStore, commit_round, commit_rounds, task_config

pytestmark = pytest.mark.usefixtures("fast_rechecks")


# -- 1. fencing ---------------------------------------------------------------------------------------------------


def test_attempt_whose_restore_overlaps_another_attempts_commit_is_fenced(tmp_path: Path) -> None:
    """Seen: the new attempt took its seq from a listing after its restore and wrote n+2 on top of state n, so the
    other attempt's acknowledged n+1 silently dropped out of the history."""
    blobs = HookedBlobStore(MemoryBlobStore())
    config = task_config(tmp_path / "a")
    model: dict[bytes, bytes] = {}
    with TaskStorage.open(config, "task-0", blob_store=blobs) as task:
        commit_round(task, 0, model)

    restoring, release = threading.Event(), threading.Event()

    def hold_restore(name: str) -> None:
        if "/changelog/" in name and not release.is_set():
            restoring.set()
            assert release.wait(30)

    blobs.on_get = hold_restore
    with ThreadPoolExecutor(1) as pool:
        # attempt A: a fresh machine, so it downloads (and is held in the middle of its restore)
        opening = pool.submit(
            TaskStorage.open, task_config(tmp_path / "b", **_same_url(config)), "task-0", blob_store=blobs
        )
        assert restoring.wait(30)
        # attempt B commits n+1 while A restores
        other_model = dict(model)
        with TaskStorage.open(config, "task-0", blob_store=HookedBlobStore(blobs.inner)) as other:
            write_round(other, 1, other_model)
            acknowledged = other.commit_durably({"input": "B"})
        release.set()
        late = opening.result(timeout=30)
    with late:
        assert contents(late) == model  # A restored n
        write_round(late, 2, dict(model))
        with pytest.raises(CommitError, match="another attempt") as raised:
            late.commit_durably({"input": "A"})
        assert type(raised.value).__name__ == "CommitConflictError"
    # B's acknowledged commit is the newest checkpoint, and it restores exactly
    with TaskStorage.open(task_config(tmp_path / "c", **_same_url(config)), "task-0", blob_store=blobs.inner) as check:
        assert check.restored == acknowledged
        assert contents(check) == other_model


def _same_url(config: dict[str, Any]) -> dict[str, Any]:
    return {"blob.store.url": config["blob.store.url"]}


def test_two_speculative_attempts_one_wins_the_other_is_fenced(tmp_path: Path) -> None:
    blobs = MemoryBlobStore()
    config = task_config(tmp_path / "base")
    model: dict[bytes, bytes] = {}
    with TaskStorage.open(config, "task-0", blob_store=blobs) as task:
        commit_round(task, 0, model)
    first = TaskStorage.open(task_config(tmp_path / "1", **_same_url(config)), "task-0", blob_store=blobs)
    second = TaskStorage.open(task_config(tmp_path / "2", **_same_url(config)), "task-0", blob_store=blobs)
    with first, second:
        models = [dict(model), dict(model)]
        write_round(first, 1, models[0])
        write_round(second, 2, models[1])
        winner = first.commit_durably({"input": "first"})
        with pytest.raises(CommitError, match="another attempt"):
            second.commit_durably({"input": "second"})
        with pytest.raises(CommitError, match="another attempt"):  # and every later commit of the fenced attempt
            second.commit_durably({"input": "second-again"})
    with TaskStorage.open(task_config(tmp_path / "check", **_same_url(config)), "task-0", blob_store=blobs) as check:
        assert check.restored == winner
        assert contents(check) == models[0]


def test_zombie_committing_after_the_new_owner_moved_on_is_refused_and_leaves_nothing(tmp_path: Path) -> None:
    """Retention (keep 1) frees the zombie's seq after the new owner's commits: the create-only write alone would
    succeed there, below the head, and acknowledge a commit that is not in the history."""
    blobs = MemoryBlobStore()
    config = task_config(tmp_path / "owner", **{"task.checkpoint.retained": 1})
    model: dict[bytes, bytes] = {}
    with TaskStorage.open(config, "task-0", blob_store=blobs) as task:
        commit_round(task, 0, model)
    zombie = TaskStorage.open(
        task_config(tmp_path / "zombie", **_same_url(config), **{"task.checkpoint.retained": 1}),
        "task-0",
        blob_store=blobs,
    )
    with TaskStorage.open(config, "task-0", blob_store=blobs) as owner:
        for n in range(1, 5):
            last = commit_round(owner, n, model)
        owner.commit_manager.close()  # retention has run
    with zombie:
        write_round(zombie, 9, {})
        with pytest.raises(CommitError, match="another attempt"):
            zombie.commit_durably({"input": "zombie"})
    names = sorted(blobs.list(CHECKPOINTS))
    assert not any(name.startswith(f"{CHECKPOINTS}000000000002.") for name in names), names
    with TaskStorage.open(task_config(tmp_path / "check", **_same_url(config)), "task-0", blob_store=blobs) as check:
        assert check.restored == last
        assert contents(check) == model


# -- 2. checkpoint integrity ----------------------------------------------------------------------------------------


@pytest.mark.parametrize("layout", ["per-seq", "head"])
def test_changed_digit_in_a_checkpoints_offsets_is_refused(tmp_path: Path, layout: str) -> None:
    """Both layouts of the log: the per-seq blob, or the head blob on a store with conditional writes."""
    blobs = PerSeqMemoryBlobStore() if layout == "per-seq" else MemoryBlobStore()
    config = task_config(tmp_path)
    with TaskStorage.open(config, "task-0", blob_store=blobs) as task:
        write_round(task, 0, {})
        task.commit_durably({"input": "1234"})
    name = f"{CHECKPOINTS}000000000001.v2.json" if layout == "per-seq" else f"{CHECKPOINTS}HEAD.v3.json"
    blobs.put(name, blobs.get(name).replace(b'"1234"', b'"1284"'))
    with pytest.raises(CorruptDataError, match=re.escape(name)):
        TaskStorage.open(task_config(tmp_path / "fresh", **_same_url(config)), "task-0", blob_store=blobs)


@pytest.mark.parametrize("swap", ["older", "other_task"])
def test_checkpoint_blob_put_under_another_name_is_refused(tmp_path: Path, swap: str) -> None:
    """The per-seq layout (a store without conditional writes): each blob is bound to its own name."""
    blobs = PerSeqMemoryBlobStore()
    config = task_config(tmp_path)
    for task_name in ("task-0", "task-1"):
        with TaskStorage.open(config, task_name, blob_store=blobs) as task:
            for n in range(2):
                write_round(task, n, {})
                task.commit_durably({"input": str(n)})
    newest = f"{CHECKPOINTS}000000000002.v2.json"
    source = f"{CHECKPOINTS}000000000001.v2.json" if swap == "older" else "job/task-1/checkpoints/000000000002.v2.json"
    blobs.put(newest, blobs.get(source))
    with pytest.raises(CorruptDataError, match="not checkpoint #2 of task 'task-0'"):
        TaskStorage.open(task_config(tmp_path / "fresh", **_same_url(config)), "task-0", blob_store=blobs)


def test_deleted_newest_checkpoint_is_detected_from_local_knowledge_not_rolled_back(tmp_path: Path) -> None:
    """The per-seq layout (a store without conditional writes): its newest blob deleted."""
    blobs = PerSeqMemoryBlobStore()
    config = task_config(tmp_path)
    model: dict[bytes, bytes] = {}
    commit_rounds(config, blobs, model)
    newest = f"{CHECKPOINTS}000000000003.v2.json"
    kept = blobs.get(newest)
    blobs.delete(newest)
    with pytest.raises(StateBackendError, match="#3 of this task is known to be durable") as raised:
        TaskStorage.open(config, "task-0", blob_store=blobs)
    assert type(raised.value).__name__ == "InconsistentStateError"
    # nothing was cleared or rolled back: with the blob back, the same local state opens at checkpoint 3
    blobs.put(newest, kept)
    with TaskStorage.open(config, "task-0", blob_store=blobs) as task:
        assert task.restored is not None and task.restored.input_offsets == {"input": "2"}
        assert contents(task) == model


# -- 4. short listings ----------------------------------------------------------------------------------------------


def test_empty_listing_once_is_listed_again_and_restores_exactly(tmp_path: Path) -> None:
    blobs = HookedBlobStore(MemoryBlobStore())
    config = task_config(tmp_path)
    model: dict[bytes, bytes] = {}
    latest = commit_rounds(config, blobs, model)
    blobs.short_lists = 1
    with TaskStorage.open(config, "task-0", blob_store=blobs) as task:
        assert task.restored == latest
        assert contents(task) == model
        commit_round(task, 3, model)
    with TaskStorage.open(task_config(tmp_path / "fresh", **_same_url(config)), "task-0", blob_store=blobs) as check:
        assert contents(check) == model


def test_listing_that_stays_empty_never_starts_empty_nor_clears_local_data(tmp_path: Path) -> None:
    """Seen on s3://: one cut reply read as an empty page; the task restored nothing, cleared its local copy, and its
    next commit durably wrote a new newest checkpoint with almost no state."""
    blobs = HookedBlobStore(MemoryBlobStore())
    config = task_config(tmp_path)
    model: dict[bytes, bytes] = {}
    latest = commit_rounds(config, blobs, model)
    blobs.short_lists = 100
    with pytest.raises(StateBackendError, match="known to be durable") as raised:
        TaskStorage.open(config, "task-0", blob_store=blobs)
    assert type(raised.value).__name__ == "InconsistentStateError"
    assert max(blobs.inner.list(CHECKPOINTS)).startswith(f"{CHECKPOINTS}000000000003.")  # nothing written
    blobs.short_lists = 0
    reads: list[str] = []
    blobs.on_get = lambda name: reads.append(name) if "/changelog/" in name else None
    with TaskStorage.open(config, "task-0", blob_store=blobs) as task:
        assert task.restored == latest
        assert contents(task) == model
    assert reads == []  # the local copy was kept: nothing downloaded


# -- 5. a checkpoint write that landed but whose reply was lost -----------------------------------------------------


def test_checkpoint_put_that_landed_with_its_reply_lost_is_no_conflict(tmp_path: Path) -> None:
    """Seen: reported at the next commit as 'already committed by another attempt', and every commit after it
    refused until the task was reopened."""
    blobs = HookedBlobStore(MemoryBlobStore())
    config = task_config(tmp_path)
    model: dict[bytes, bytes] = {}
    lose = {"left": 0}

    def lose_reply(name: str, landed: bool) -> None:
        if landed and "/checkpoints/" in name and lose["left"] > 0:
            lose["left"] -= 1
            raise TransientStorageError(f"connection reset after the server stored {name}")

    blobs.on_put = lose_reply
    with TaskStorage.open(config, "task-0", blob_store=blobs) as task:
        commit_round(task, 0, model)
        write_round(task, 1, model)
        lose["left"] = 1
        with pytest.raises(CommitError, match="connection reset"):
            task.commit_durably({"input": "1"})
        latest = commit_round(task, 2, model)
        latest = commit_round(task, 3, model)
        assert task.metrics.counter("commit.conflicts") == 0
    with TaskStorage.open(task_config(tmp_path / "fresh", **_same_url(config)), "task-0", blob_store=blobs) as check:
        assert check.restored == latest
        assert contents(check) == model
        assert check.checkpoint_log.seqs()[-1] == 4  # seq 2 landed and was kept; 3 and 4 followed it


# -- 6. a failure is reported once ------------------------------------------------------------------------------------


def test_commit_durably_after_a_failure_commits_anew(tmp_path: Path) -> None:
    blobs = HookedBlobStore(MemoryBlobStore())
    config = task_config(tmp_path)
    model: dict[bytes, bytes] = {}
    outage = {"on": False}

    def fail_while_out(name: str, landed: bool) -> None:
        if outage["on"] and not landed:
            raise TransientStorageError(f"blob store unreachable writing {name}")

    blobs.on_put = fail_while_out
    with TaskStorage.open(config, "task-0", blob_store=blobs) as task:
        commit_round(task, 0, model)
        outage["on"] = True
        write_round(task, 1, model)
        with pytest.raises(CommitError, match="unreachable"):
            task.commit_durably({"input": "1"})
        outage["on"] = False
        durable = commit_round(task, 2, model)  # seen: raised the stale outage error instead
        assert durable.input_offsets == {"input": "2"}
    with TaskStorage.open(task_config(tmp_path / "fresh", **_same_url(config)), "task-0", blob_store=blobs) as check:
        assert check.restored == durable
        assert contents(check) == model


# -- 9. restore falls back through restore.factories ------------------------------------------------------------------


@pytest.mark.parametrize("damage", ["missing", "flipped"])
def test_restore_falls_back_to_the_next_backend_with_a_marker(
    tmp_path: Path, damage: str, caplog: pytest.LogCaptureFixture
) -> None:
    blobs = MemoryBlobStore()
    config = task_config(
        tmp_path, "changelog,blobsnapshot", **{"stores.counts.restore.factories": "changelog,blobsnapshot"}
    )
    model: dict[bytes, bytes] = {}
    latest = commit_rounds(config, blobs, model)
    deltas = sorted(name for name in blobs.list("job/task-0/counts/changelog/") if name.endswith(".delta"))
    assert deltas
    if damage == "missing":
        blobs.delete(deltas[0])
    else:
        data = bytearray(blobs.get(deltas[0]))
        data[len(data) // 2] ^= 0x40
        blobs.put(deltas[0], bytes(data))
    with (
        caplog.at_level(logging.ERROR, logger="statebackend.restore"),
        TaskStorage.open(
            task_config(tmp_path / "fresh", "changelog,blobsnapshot", **_same_url(config)), "task-0", blob_store=blobs
        ) as task,
    ):
        assert task.restored == latest
        assert contents(task) == model
    assert any("falling back to the blobsnapshot backend" in r.getMessage() for r in caplog.records)


def test_restore_fails_naming_each_backend_when_all_fail(tmp_path: Path) -> None:
    blobs = MemoryBlobStore()
    config = task_config(tmp_path, "changelog,blobsnapshot")
    with TaskStorage.open(config, "task-0", blob_store=blobs) as task:
        write_round(task, 0, {})
        task.commit_durably({"input": "0"})
    for name in list(blobs.list("job/task-0/counts/")):
        if name.endswith(".delta") or "/runs/" in name or "/index/" in name or "/indexes/" in name:
            blobs.delete(name)
    with pytest.raises(StateBackendError, match="changelog: .*blobsnapshot: "):
        TaskStorage.open(
            task_config(tmp_path / "fresh", "changelog,blobsnapshot", **_same_url(config)), "task-0", blob_store=blobs
        )


# -- serdes are recorded ----------------------------------------------------------------------------------------------


def test_a_changed_serde_is_a_clear_error_naming_the_store_and_both_serdes(tmp_path: Path) -> None:
    blobs = MemoryBlobStore()
    config = task_config(tmp_path, **{"stores.counts.key.serde": "string", "stores.counts.msg.serde": "integer"})
    with TaskStorage.open(config, "task-0", blob_store=blobs) as task:
        task.store("counts").put("ada", 3)
        task.commit_durably({"input": "1"})
    changed = dict(config, **{"stores.counts.msg.serde": "json"})
    with pytest.raises(
        ConfigError, match="stores.counts.msg.serde is 'json' but store 'counts' was written with 'integer'"
    ):
        TaskStorage.open(changed, "task-0", blob_store=blobs)
    with TaskStorage.open(config, "task-0", blob_store=blobs) as task:  # unchanged config still opens
        assert task.store("counts").get("ada") == 3


# -- a short listing never makes live blobs garbage -----------------------------------------------------------------


@pytest.mark.parametrize("factory", ["changelog", "blobsnapshot"])
def test_sweep_under_a_short_listing_deletes_nothing_a_checkpoint_needs(tmp_path: Path, factory: str) -> None:
    blobs = HookedBlobStore(MemoryBlobStore())
    config = task_config(tmp_path, factory, **{"task.checkpoint.retained": 3})
    if factory == "blobsnapshot":
        config["blobsnapshot.gc.grace.period.ms"] = 0
    models = []
    model: dict[bytes, bytes] = {}
    with TaskStorage.open(config, "task-0", blob_store=blobs) as task:
        for n in range(4):
            commit_round(task, n, model)
            models.append(dict(model))
        task.commit_manager.close()
        before = sorted(blobs.inner.list("job/task-0/counts/"))
        blobs.short_lists = 100
        manager = task.commit_manager.backups[0].manager
        assert isinstance(manager, (ChangelogBackupManager, BlobSnapshotBackupManager))
        with pytest.raises(StateBackendError, match="known to be durable"):
            manager.sweep()
        blobs.short_lists = 0
        assert sorted(blobs.inner.list("job/task-0/counts/")) == before
    # every retained checkpoint still restores exactly
    log = TaskStorage.open(task_config(tmp_path / "x", factory, **_same_url(config)), "task-0", blob_store=blobs.inner)
    with log:
        entries = log.checkpoint_log.entries()
    assert [e.checkpoint.input_offsets["input"] for e in entries] == ["1", "2", "3"]
    for entry in entries:
        with TaskStorage.open(
            task_config(tmp_path / f"r{entry.seq}", factory, **_same_url(config)),
            "task-0",
            blob_store=blobs.inner,
            checkpoint=entry,
        ) as check:
            assert contents(check) == models[int(entry.checkpoint.input_offsets["input"])]
