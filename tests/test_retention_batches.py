"""Retention in batches (docs/cost.md): the checkpoint log deletes its old checkpoints once ``retention_interval`` of
them are past the newest ``task.checkpoint.retained``, in one request, and the built-in backends delete what their
own retention let go with it (``CheckpointLog.trims``), never a blob of a checkpoint the log still holds. A close
trims to exactly ``retained`` (a handover close leaves that to the next owner). A collector's mark does not read back
the checkpoints its own log object wrote."""

from __future__ import annotations

import shutil
from concurrent.futures import wait
from pathlib import Path
from typing import Any

import pytest
from statebackend.backends.blobsnapshot.blobs import read_marker
from statebackend.backends.changelog.marker import Recipe
from statebackend.checkpoint import CheckpointIdGenerator, CheckpointLog, CheckpointV2

from statebackend.blobstores.memory import MemoryBlobStore
from statebackend.blobstores.resilience import ResilientBlobStore
from statebackend.metrics import Metrics
from statebackend.task import TaskStorage
from statebackend.testing.backend_contract import contents
from statebackend.testing.conditional_put_contract import PerSeqMemoryBlobStore
from tests.backend_helpers import commit_round, make_config

RETAINED = 2
INTERVAL = 3
PREFIX = "job/task-0/counts/"


def config_for(tmp_path: Path, factories: str, **extra: Any) -> dict[str, Any]:
    garbage: dict[str, Any] = {
        "task.checkpoint.retained": RETAINED,
        "changelog.snapshot.interval.commits": 3,  # snapshots, so old deltas become garbage
        "changelog.snapshot.interval.ratio": 0,
        "blobsnapshot.compaction.fanout": 2,  # merges, so runs only old indexes list become garbage
        "blobsnapshot.compaction.full.min.bytes": 0,
        "blobsnapshot.gc.interval.commits": 0,
        "changelog.gc.interval.commits": 0,
    }
    config = make_config(factories, tmp_path, {**garbage, **extra})
    del config["stores.counts.restore.factory"]  # restored by the first of the factories
    return config


def blobs_named_by(blobs: MemoryBlobStore, entry: Any) -> set[str]:
    """Every blob a checkpoint's markers name, for both backends."""
    named: set[str] = set()
    for factory, by_store in entry.checkpoint.state_checkpoint_markers.items():
        marker = by_store["counts"]
        if factory == "changelog":
            named |= set(Recipe.decode(marker, prefix=PREFIX + "changelog/", source="test").blob_names())
        else:
            index = read_marker(blobs, marker, job="job", task="task-0", store="counts")
            named |= index.blob_names(PREFIX + "blobsnapshot/")  # the index itself is inline in the marker
    return named


def settle(task: TaskStorage) -> None:
    from statebackend.backends.blobsnapshot.compaction import _compaction_pools
    from statebackend.backends.changelog.snapshots import maintenance_pool

    for _ in range(2):
        wait(list(task.commit_manager._cleanups), timeout=60)
        maintenance_pool().submit(lambda: None).result(timeout=60)
        _compaction_pools.get(1).submit(lambda: None).result(timeout=60)


def store_for(layout: str) -> MemoryBlobStore:
    """A memory store whose checkpoint log keeps per-seq blobs ("per-seq") or one head blob ("head")."""
    return PerSeqMemoryBlobStore() if layout == "per-seq" else MemoryBlobStore()


@pytest.mark.parametrize("layout", ["per-seq", "head"])
@pytest.mark.parametrize("factories", ["changelog", "blobsnapshot", "changelog,blobsnapshot"])
def test_every_checkpoint_the_log_holds_keeps_its_blobs_while_retention_goes_in_batches(
    tmp_path: Path, factories: str, layout: str
) -> None:
    """Per-seq: the log itself deletes in batches. Head: the head keeps exactly the retained window at each write
    (no delete request of its own), and the backends still delete their garbage in batches."""
    inner = store_for(layout)
    blobs = ResilientBlobStore(inner)
    metrics = Metrics()
    blobs.use_metrics(metrics)
    config = config_for(tmp_path, factories)
    models: dict[str, dict[bytes, bytes]] = {}
    model: dict[bytes, bytes] = {}
    held: list[int] = []
    with TaskStorage.open(config, "task-0", blob_store=blobs, metrics=metrics) as task:
        task.checkpoint_log.retention_interval = INTERVAL
        for round_no in range(20):
            commit_round(task, round_no, model)
            models[str(round_no)] = dict(model)
            settle(task)
            seqs = CheckpointLog(inner, "job", "task-0").seqs()
            held.append(len(seqs))
            if layout == "head":
                assert len(seqs) == min(round_no + 1, RETAINED), seqs
            else:
                assert min(round_no + 1, RETAINED) <= len(seqs) <= RETAINED + INTERVAL - 1, seqs
            present = set(inner.list(PREFIX))
            for entry in CheckpointLog(inner, "job", "task-0").entries():
                missing = blobs_named_by(inner, entry) - present
                assert not missing, f"round {round_no}: checkpoint #{entry.seq} the log holds lost {missing}"
        trims = task.checkpoint_log.trims
        deletes = metrics.counter("blob_store.requests", operation="delete_many")
    assert trims == (20 - RETAINED) // INTERVAL
    if layout == "per-seq":
        assert RETAINED + INTERVAL - 1 in held and RETAINED in held  # it filled up and was trimmed
    # one request for the log (per-seq only) and at most one per backend at each trim, one more for each at close
    assert deletes <= (trims + 1) * ((layout == "per-seq") + len(factories.split(",")))
    assert metrics.counter("blob_store.requests", operation="delete") == 0
    assert metrics.counter("changelog.blobs.deleted") + metrics.counter("blobsnapshot.runs.deleted") > 0
    # closed: exactly the retained checkpoints, each restoring exactly, and no blob only older ones needed
    entries = CheckpointLog(inner, "job", "task-0").entries()
    assert [e.checkpoint.input_offsets["input"] for e in entries] == ["18", "19"]
    named = set().union(*(blobs_named_by(inner, entry) for entry in entries))
    if "blobsnapshot" in factories:
        indexes = {n for n in inner.list(PREFIX + "blobsnapshot/index/")}
        assert indexes <= named, f"indexes only dropped checkpoints named: {indexes - named}"
    for entry in entries:
        shutil.rmtree(tmp_path / "local")
        with TaskStorage.open(config, "task-0", blob_store=inner, checkpoint=entry) as task:
            assert contents(task) == models[entry.checkpoint.input_offsets["input"]]


@pytest.mark.parametrize("layout", ["per-seq", "head"])
def test_a_handover_close_leaves_retention_to_the_next_owner(tmp_path: Path, layout: str) -> None:
    """Per-seq: the log still lists all 6 checkpoints. Head: the head holds the retained window (it let the others
    go at its writes, without a request), and the close sends no delete request either."""
    inner = store_for(layout)
    expected = 6 if layout == "per-seq" else RETAINED
    blobs = ResilientBlobStore(inner)
    metrics = Metrics()
    blobs.use_metrics(metrics)
    config = config_for(tmp_path, "changelog")
    model: dict[bytes, bytes] = {}
    task = TaskStorage.open(config, "task-0", blob_store=blobs, metrics=metrics)
    task.checkpoint_log.retention_interval = 100
    for round_no in range(6):
        commit_round(task, round_no, model)
    settle(task)
    before = metrics.counter("blob_store.requests", operation="delete_many")
    task.close(handover=True)
    assert metrics.counter("blob_store.requests", operation="delete_many") == before, "a delete request at handover"
    assert len(CheckpointLog(inner, "job", "task-0").seqs()) == expected
    with TaskStorage.open(config, "task-0", blob_store=inner) as task:
        assert contents(task) == model
    assert len(CheckpointLog(inner, "job", "task-0").seqs()) == expected, "no commit since: nothing to trim on"


def test_a_collectors_mark_does_not_read_back_what_its_own_log_wrote(tmp_path: Path) -> None:
    """The per-seq layout (a store without conditional writes): a mark there would read each listed blob."""
    inner = PerSeqMemoryBlobStore()
    blobs = ResilientBlobStore(inner)
    metrics = Metrics()
    blobs.use_metrics(metrics)
    log = CheckpointLog(blobs, "job", "task-0", retained=5)
    ids = CheckpointIdGenerator()
    written = {}
    for seq in range(1, 6):
        written[seq] = CheckpointV2(
            checkpoint_id=ids.next(), input_offsets={"input": str(seq)}, state_checkpoint_markers={}
        )
        log.write(seq, written[seq])
    gets = metrics.counter("blob_store.requests", operation="get")
    assert [e.checkpoint for e in log.entries(cached=True)] == [written[s] for s in range(1, 6)]
    assert metrics.counter("blob_store.requests", operation="get") == gets, "its own checkpoints were read back"
    # choosing what to restore always reads (a restore decision must see what is there now)
    assert log.latest() is not None and [e.seq for e in log.entries()] == [1, 2, 3, 4, 5]
    assert metrics.counter("blob_store.requests", operation="get") == gets + 1 + 5
    # another writer's checkpoint, and one this writer's log object did not write, are read
    other = CheckpointLog(inner, "job", "task-0", retained=5)
    other.write(
        6, CheckpointV2(checkpoint_id=ids.next(), input_offsets={"input": "other"}, state_checkpoint_markers={})
    )
    gets = metrics.counter("blob_store.requests", operation="get")
    assert [e.checkpoint.input_offsets["input"] for e in log.entries(cached=True)][-1] == "other"
    assert metrics.counter("blob_store.requests", operation="get") == gets + 1
    # a checkpoint read by name (the driver's confirmation) is read even when this log object wrote it
    inner.delete(log.blob_name(5, 2))
    assert log.read_written(5) is None


def test_a_failed_retention_is_tried_again_at_the_next_commit(tmp_path: Path) -> None:
    """The backends let go of the blobs of the checkpoints a retention batch deletes: a batch whose delete failed is
    sent again at the next commit (its checkpoints are still listed, so it is still due), not a whole interval later,
    so the log lists checkpoints whose blobs are gone for one commit at most."""
    from statebackend.errors import TransientStorageError

    class FailingDeletes(PerSeqMemoryBlobStore):  # the per-seq layout: the log's own delete request fails
        fail = 0

        def delete_many(self, names: list[str]) -> None:
            if self.fail and any("/checkpoints/" in name for name in names):
                self.fail -= 1
                raise TransientStorageError("injected: the delete request failed")
            super().delete_many(names)

    inner = FailingDeletes()
    config = config_for(tmp_path, "changelog")
    model: dict[bytes, bytes] = {}
    with TaskStorage.open(config, "task-0", blob_store=inner) as task:
        task.checkpoint_log.retention_interval = INTERVAL
        inner.fail = 1
        for round_no in range(RETAINED + INTERVAL):  # the last commit's retention is due, and fails
            commit_round(task, round_no, model)
            settle(task)
        assert inner.fail == 0, "the retention batch was due"
        assert len(CheckpointLog(inner, "job", "task-0").seqs()) == RETAINED + INTERVAL
        commit_round(task, 99, model)
        settle(task)
        assert len(CheckpointLog(inner, "job", "task-0").seqs()) == RETAINED, "not retried at the next commit"
        assert task.metrics.counter("commit.cleanup.failures") == 1
