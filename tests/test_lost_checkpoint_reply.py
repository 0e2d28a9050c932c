"""A commit whose checkpoint write was reported failed may have landed (the reply was lost). No backend may delete or
invalidate what such a checkpoint needs before a newer durable checkpoint no longer does: not through abort(), nor
cleanup, nor its mark-and-sweep (run here at every commit, with no grace period). Both backends.

The framework resolves the lost reply at the next commit by reading the checkpoint back and building on it; these
tests check the backends' side: the landed checkpoint restores exactly, right away (reopened from it) and while later
checkpoints of the same task still retain it.
"""

from __future__ import annotations

import shutil
import time
from pathlib import Path
from typing import Any

import pytest
from statebackend.backends.blobsnapshot.backup import EXPIRES_AT
from statebackend.backends.blobsnapshot.blobs import read_marker
from statebackend.checkpoint import CheckpointLog, CheckpointV2, LogEntry

from statebackend.blobstores.memory import MemoryBlobStore
from statebackend.errors import CommitError
from statebackend.task import TaskStorage
from statebackend.testing.backend_contract import contents, write_round
from statebackend.testing.conditional_put_contract import PerSeqMemoryBlobStore
from statebackend.testing.controlled import ControlledBlobStore
from tests import backend_helpers
from tests.backend_helpers import commit_round, sweep

BACKENDS: dict[str, dict[str, object]] = {
    "changelog": {
        "changelog.snapshot.interval.commits": 2,
        "changelog.gc.interval.commits": 1,
        "changelog.gc.grace.period.ms": 0,
    },
    "blobsnapshot": {
        # compactions at almost every commit: runs a landed checkpoint lists get merged away while it is retained
        "blobsnapshot.compaction.fanout": 2,
        "blobsnapshot.compaction.full.min.bytes": 0,
        "blobsnapshot.gc.interval.commits": 1,
        "blobsnapshot.gc.grace.period.ms": 0,
        "blobsnapshot.ttl.ms": 1,  # every blob not made durable is expired at once: a sweep may take it
    },
}


def make_config(backend: str, tmp_path: Path) -> dict[str, object]:
    return backend_helpers.make_config(backend, tmp_path, BACKENDS[backend])


def lose_the_checkpoint_reply(
    task: TaskStorage, blobs: ControlledBlobStore, round_no: int, model: dict[bytes, bytes]
) -> Any:
    """Commit ``round_no`` with its checkpoint write landing but reported failed; return the pending commit."""
    blobs.lose_reply, blobs.replies_to_lose = (lambda name: "/checkpoints/" in name), 1
    write_round(task, round_no, model)
    pending = task.commit({"input": str(round_no)})
    assert pending is not None
    with pytest.raises(CommitError, match="reply was lost"):
        pending.result(timeout=30)
    assert blobs.replies_to_lose == 0
    return pending


def blob_stores(backend: str, tmp_path: Path) -> tuple[PerSeqMemoryBlobStore, ControlledBlobStore, dict[str, object]]:
    """The store that keeps the blobs, the controlled store the task writes through (to lose a reply), the config."""
    inner = PerSeqMemoryBlobStore()
    return inner, ControlledBlobStore(inner), make_config(backend, tmp_path)


def commit_then_lose_a_reply(
    task: TaskStorage, blobs: ControlledBlobStore, model: dict[bytes, bytes], rounds: int = 4
) -> Any:
    """Commit rounds 0 to ``rounds - 1`` durably, then round ``rounds`` with its checkpoint write landing but reported
    failed; return the pending commit."""
    for round_no in range(rounds):
        commit_round(task, round_no, model)
    return lose_the_checkpoint_reply(task, blobs, rounds, model)


def latest(blobs: MemoryBlobStore) -> LogEntry:
    entry = CheckpointLog(blobs, "job", "task-0").latest()
    assert entry is not None
    return entry


@pytest.mark.parametrize("backend", list(BACKENDS))
def test_reopened_from_a_checkpoint_whose_reply_was_lost_it_restores_exactly(tmp_path: Path, backend: str) -> None:
    inner, blobs, config = blob_stores(backend, tmp_path)
    model: dict[bytes, bytes] = {}
    with TaskStorage.open(config, "task-0", blob_store=blobs) as task:
        pending = commit_then_lose_a_reply(task, blobs, model)
        landed = dict(model)
        # what a failed commit may meet before a newer checkpoint supersedes it: abort, a sweep, a late cleanup
        previous = task.commit_manager.last_checkpoint
        assert previous is not None and previous.input_offsets == {"input": "3"}
        for binding in task.commit_manager.backups:
            binding.manager.abort(pending.checkpoint_id)
            sweep(binding.manager)
            binding.manager.cleanup(previous.checkpoint_id, dict(previous.markers_for(binding.factory_name))).result(30)
            sweep(binding.manager)
    entry = latest(inner)
    assert entry.checkpoint.input_offsets == {"input": "4"}, "the checkpoint write did land"
    shutil.rmtree(tmp_path / "local")  # a full restore: every blob the landed checkpoint names must be there
    with TaskStorage.open(config, "task-0", blob_store=inner) as task:
        assert task.restored is not None and task.restored.input_offsets == {"input": "4"}
        assert contents(task) == landed


@pytest.mark.parametrize("backend", list(BACKENDS))
def test_a_landed_checkpoint_stays_restorable_and_durable_while_later_checkpoints_retain_it(
    tmp_path: Path, backend: str
) -> None:
    """The task goes on after the lost reply (the framework builds on the landed checkpoint). While the checkpoint
    log still holds it, it restores exactly, and no sweep takes its blobs, though every one of them is past its
    expiry (ttl.ms 1: the expiry stays on a durable checkpoint's blobs; a sweep deletes an expired blob only when no
    checkpoint in the log names it)."""
    inner, blobs, config = blob_stores(backend, tmp_path)
    model: dict[bytes, bytes] = {}
    with TaskStorage.open(config, "task-0", blob_store=blobs) as task:
        commit_then_lose_a_reply(task, blobs, model)
        landed = dict(model)
        write_round(task, 5, model)
        after = task.commit_durably({"input": "5"})
        assert task.metrics.counter("commit.landed.after.failure") == 1
        for binding in task.commit_manager.backups:
            sweep(binding.manager)
        task.commit_manager.close()  # cleanups done
    entries = CheckpointLog(inner, "job", "task-0").entries()
    assert [e.checkpoint.input_offsets["input"] for e in entries] == ["4", "5"]
    landed_entry = entries[0]
    assert isinstance(landed_entry.checkpoint, CheckpointV2)
    if backend == "blobsnapshot":
        marker = landed_entry.checkpoint.markers_for("blobsnapshot")["counts"]
        index = read_marker(inner, marker, job="job", task="task-0", store="counts")
        prefix = "job/task-0/counts/blobsnapshot/"
        for name in sorted(index.blob_names(prefix)):  # the index is inline in the marker: its runs
            assert EXPIRES_AT in inner.head(name).metadata, f"{name} was written without its expiry"
            assert float(inner.head(name).metadata[EXPIRES_AT]) < time.time(), f"{name} is not expired yet"
    shutil.rmtree(tmp_path / "local")
    with TaskStorage.open(config, "task-0", blob_store=inner, checkpoint=landed_entry) as task:
        assert contents(task) == landed
    shutil.rmtree(tmp_path / "local")
    with TaskStorage.open(config, "task-0", blob_store=inner) as task:
        assert task.restored == after
        assert contents(task) == model


def test_a_base_run_whose_checkpoint_reply_was_lost_is_listed_again_by_the_next_commit(tmp_path: Path) -> None:
    """The first blob-snapshot commit after a migration uploads a base run of the whole store; its checkpoint lands
    with the reply lost, so no cleanup makes the run durable. With no grace period every such run is too old to be
    named again without writing it anew: the next commit must still succeed (and the landed checkpoint and the next
    one restore exactly)."""
    inner = PerSeqMemoryBlobStore()
    blobs = ControlledBlobStore(inner)
    model: dict[bytes, bytes] = {}
    changelog = make_config("changelog", tmp_path)
    with TaskStorage.open(changelog, "task-0", blob_store=blobs) as task:
        write_round(task, 0, model)
        task.commit_durably({"input": "0"})
    config = dict(
        make_config("blobsnapshot", tmp_path), **{"stores.counts.restore.factories": "blobsnapshot,changelog"}
    )
    config.pop("stores.counts.restore.factory")
    with TaskStorage.open(config, "task-0", blob_store=blobs) as task:
        lose_the_checkpoint_reply(task, blobs, 1, model)  # uploads a base run: no blobsnapshot chain yet
        assert task.metrics.counter("blobsnapshot.base.runs") == 1
        landed = dict(model)
        write_round(task, 2, model)
        task.commit_durably({"input": "2"})
        assert task.metrics.counter("blobsnapshot.base.runs") == 1  # the landed base run is built on
    entries = CheckpointLog(inner, "job", "task-0").entries()
    assert [e.checkpoint.input_offsets["input"] for e in entries] == ["1", "2"]
    shutil.rmtree(tmp_path / "local")
    with TaskStorage.open(config, "task-0", blob_store=inner, checkpoint=entries[0]) as task:
        assert contents(task) == landed
    shutil.rmtree(tmp_path / "local")
    with TaskStorage.open(config, "task-0", blob_store=inner) as task:
        assert contents(task) == model
