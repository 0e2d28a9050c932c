"""Retention in batches (docs/cost.md): the checkpoint log deletes its old checkpoints once ``retention_interval`` of
them are past the newest ``task.checkpoint.retained``, in one request, and the built-in backends delete what their
own retention let go with it (``CheckpointLog.trims``), never a blob of a checkpoint the log still holds. A close
trims to exactly ``retained`` (a handover close leaves that to the next owner). A collector's mark does not read back
the checkpoints its own log object wrote. Two attempts of one task: an older attempt's close, trim and sweeps keep
every blob of the new owner's checkpoints, also while they race its commits; a doomed blob waits in a sweep's batch no
longer than the batch wait."""

from __future__ import annotations

import shutil
import threading
import time
import uuid
from concurrent.futures import wait
from pathlib import Path
from typing import Any

import pytest
from statebackend.backends.blobsnapshot.backup import BlobSnapshotBackupManager
from statebackend.backends.blobsnapshot.blobs import read_marker
from statebackend.backends.changelog.backup import ChangelogBackupManager
from statebackend.backends.changelog.marker import Recipe
from statebackend.checkpoint import CheckpointIdGenerator, CheckpointLog, CheckpointV2

from statebackend.blobstores.memory import MemoryBlobStore
from statebackend.blobstores.resilience import ResilientBlobStore
from statebackend.errors import CommitError
from statebackend.metrics import Metrics
from statebackend.task import TaskStorage
from statebackend.testing.backend_contract import contents, write_round
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


# -- two attempts of one task: retention batches, the close's trim and sweeps from the older one --------------------


def _config(local: Path, url: str, factories: str) -> dict[str, Any]:
    return {
        "job.name": "job",
        "state.local.dir": str(local),
        "blob.store.url": url,
        "stores.counts.backup.factories": factories,
        "task.checkpoint.retained": RETAINED,
        "changelog.snapshot.interval.commits": 3,
        "changelog.snapshot.interval.ratio": 0,
        "blobsnapshot.compaction.fanout": 2,
        "blobsnapshot.compaction.full.min.bytes": 0,
        "blobsnapshot.gc.interval.commits": 0,
        "changelog.gc.interval.commits": 0,
        # the harshest sweeps: whatever a sweep does not mark goes at once
        "blobsnapshot.gc.grace.period.ms": 0,
        "changelog.gc.grace.period.ms": 0,
        "blobsnapshot.ttl.ms": 1,
    }


def _assert_log_keeps_its_blobs(inner: MemoryBlobStore, when: str) -> None:
    present = set(inner.list(PREFIX))
    for entry in CheckpointLog(inner, "job", "task-0").entries():
        missing = blobs_named_by(inner, entry) - present
        assert not missing, f"{when}: checkpoint #{entry.seq} the log holds lost {missing}"


@pytest.mark.parametrize("factories", ["changelog", "blobsnapshot"])
@pytest.mark.parametrize("older_commits_again", [False, True])
def test_an_older_attempts_close_and_sweep_keep_every_blob_of_the_new_owners_checkpoints(
    tmp_path: Path, factories: str, older_commits_again: bool
) -> None:
    inner = MemoryBlobStore()
    url = f"memory://{uuid.uuid4().hex}"
    model: dict[bytes, bytes] = {}
    older = TaskStorage.open(_config(tmp_path / "older", url, factories), "task-0", blob_store=inner)
    older.checkpoint_log.retention_interval = INTERVAL
    for round_no in range(8):  # a full window, garbage, and a retention batch or two
        write_round(older, round_no, model)
        older.commit_durably({"input": str(round_no)})
        settle(older)
    with TaskStorage.open(_config(tmp_path / "owner", url, factories), "task-0", blob_store=inner) as owner:
        owner.checkpoint_log.retention_interval = INTERVAL
        for round_no in range(8, 20):
            write_round(owner, round_no, model)
            owner.commit_durably({"input": str(round_no)})
            settle(owner)
            _assert_log_keeps_its_blobs(inner, f"owner round {round_no}")
        expected = dict(model)
        # the older attempt, unaware, sweeps (its mark reads the log) ...
        orphan = PREFIX + (
            "changelog/delta/000000000001-00000000deadbeef.delta"
            if factories == "changelog"
            else "blobsnapshot/runs/" + "ab" * 32
        )
        inner.put(orphan, b"x", metadata={"created_at": "1000.000"})
        for binding in older.commit_manager.backups:
            assert isinstance(binding.manager, (ChangelogBackupManager, BlobSnapshotBackupManager))
            binding.manager.sweep()
        assert not inner.exists(orphan), "the sweep ran: it took what nothing names"
        _assert_log_keeps_its_blobs(inner, "after the older attempt's sweep")
        if older_commits_again:
            write_round(older, 99, {})
            with pytest.raises(CommitError):
                older.commit_durably({"input": "older"})
        # ... and closes (not a handover: it trims on its last listing, now stale)
        older.close()
        _assert_log_keeps_its_blobs(inner, "after the older attempt's close")
        write_round(owner, 20, model)
        owner.commit_durably({"input": "20"})
        expected = dict(model)
        settle(owner)
        _assert_log_keeps_its_blobs(inner, "after the owner's next commit")
    _assert_log_keeps_its_blobs(inner, "after the owner's close")
    shutil.rmtree(tmp_path / "owner")
    with TaskStorage.open(_config(tmp_path / "check", url, factories), "task-0", blob_store=inner) as check:
        assert contents(check) == expected


# -- a sweep's batch and a writer's refresh ------------------------------------------------------------------------


def test_a_doomed_blob_waits_in_a_sweeps_batch_no_longer_than_the_batch_wait() -> None:
    """A writer names a blob no checkpoint names only after making it young (``GraceRule.may_name``; blob-snapshot
    writes an old run again, same bytes, fresh ``created_at``). The age rule is sound only if the age a sweep acts
    on is the blob's age when it deletes it: one by one, a delete followed its HEAD at once; batched, a doomed blob
    would wait for up to 999 more HEADs, and a refresh in between would be lost with it. So a batch goes once its
    first blob has waited ``SWEEP_BATCH_WAIT_S`` since its judgment: here each HEAD takes 30 ms, and a blob refreshed
    after 8 more HEADs (240 ms, past the wait) survives, while the blobs judged before it were deleted in time."""
    from statebackend.kit import GraceRule, Mark, created_at_metadata, sweep_unreferenced
    from statebackend.kit.gc import SWEEP_BATCH_WAIT_S

    assert SWEEP_BATCH_WAIT_S <= 0.1
    now = 10_000.0
    names = [f"g/run-{i:02d}" for i in range(12)]
    refreshed = names[0]
    deleted_at: dict[str, float] = {}
    judged_at: dict[str, float] = {}
    refreshed_at: list[float] = []

    class Store(MemoryBlobStore):
        supports_conditional_delete = False  # the sweep takes its delete_many path, which this test watches

        def head(self, name: str) -> Any:
            time.sleep(0.03)
            if name == names[9]:  # 8 HEADs after run-00's: the writer refreshes run-00 to name it
                self.put(refreshed, b"a", metadata=created_at_metadata(now))
                refreshed_at.append(time.monotonic())
            info = super().head(name)
            judged_at[name] = time.monotonic()
            return info

        def delete_many(self, batch: Any) -> Any:
            for name in batch:
                deleted_at[name] = time.monotonic()
            return super().delete_many(batch)

    store = Store()
    for name in names:
        store.put(name, b"x", metadata=created_at_metadata(now - 7_200))
    swept = sweep_unreferenced(store, "g/", Mark(frozenset(), at=now), GraceRule(3_600_000), clock=lambda: now, now=now)
    assert store.exists(refreshed), "a blob refreshed to be named was deleted on its old age"
    assert store.get(refreshed) == b"a"
    assert refreshed in swept.deleted and deleted_at[refreshed] < refreshed_at[0], (
        "the old blob's delete went before the writer wrote it again"
    )
    assert set(swept.deleted) == set(names), "every blob judged old was deleted"
    assert len({deleted_at[name] for name in names}) > 1, "the twelve blobs went in more than one batch"
    # each went within the wait, counted in the work done meanwhile rather than in seconds (a loaded machine stalls
    # any thread for longer than the wait): once its wait had passed, at most the HEAD that noticed it ended before
    # its delete, plus one that ended between the judgment's timestamp here and the sweep's own. A sweep that held
    # its batch to the end would see every later HEAD end first
    for name in swept.deleted:
        late = [head for head, at in judged_at.items() if judged_at[name] + SWEEP_BATCH_WAIT_S < at < deleted_at[name]]
        assert len(late) <= 2, f"{name} waited in its batch past the wait, through the HEADs of {late}"


@pytest.mark.parametrize("factories", ["changelog", "blobsnapshot"])
def test_an_older_attempts_close_racing_the_new_owners_commits_keeps_their_blobs(
    tmp_path: Path, factories: str
) -> None:
    """The older attempt's close (its trim on a stale listing, then its backends' garbage) runs while the new owner
    commits and trims: no checkpoint the log holds loses a blob, and the owner's last one restores exactly."""
    inner = MemoryBlobStore()
    url = f"memory://{uuid.uuid4().hex}"
    model: dict[bytes, bytes] = {}
    older = TaskStorage.open(_config(tmp_path / "older", url, factories), "task-0", blob_store=inner)
    older.checkpoint_log.retention_interval = INTERVAL
    for round_no in range(9):
        write_round(older, round_no, model)
        older.commit_durably({"input": str(round_no)})
    settle(older)
    assert older.commit_manager._last_listing is not None, "the close has a trim to make"
    with TaskStorage.open(_config(tmp_path / "owner", url, factories), "task-0", blob_store=inner) as owner:
        owner.checkpoint_log.retention_interval = INTERVAL
        closing = threading.Thread(target=older.close)
        for round_no in range(9, 21):
            if round_no == 10:
                closing.start()
            write_round(owner, round_no, model)
            owner.commit_durably({"input": str(round_no)})
        closing.join(timeout=60)
        settle(owner)
        _assert_log_keeps_its_blobs(inner, "after the race")
    shutil.rmtree(tmp_path / "owner")
    with TaskStorage.open(_config(tmp_path / "check", url, factories), "task-0", blob_store=inner) as check:
        assert contents(check) == model
