"""Garbage of the blob-snapshot backend: cleanup keeps exactly what the retained checkpoints need, a durable
checkpoint's blobs are never rewritten nor swept once expired, a failed commit's run is listed by the next index, and
the sweep's age rules (grace period, metadata or first sighting, the stop a quarter of the grace period after its
mark)."""

from __future__ import annotations

import shutil
from pathlib import Path

from statebackend.backends.blobsnapshot.format import (
    is_inline_marker,
    run_name,
)
from statebackend.checkpoint import CheckpointV2

from statebackend.blobstores.memory import MemoryBlobStore
from statebackend.blobstores.resilience import ResilientBlobStore
from statebackend.metrics import Metrics
from statebackend.task import TaskStorage
from statebackend.testing.controlled import ControlledBlobStore
from tests.backend_helpers import BLOBSNAPSHOT_PREFIX as PREFIX
from tests.backend_helpers import (
    at_seq,
    commit_then_fail_next,
    fill,
    index_blobs,
    read_marker_index,
    restored_after_wipe,
    run_blobs,
)
from tests.backend_helpers import blobsnapshot_config as make_config
from tests.backend_helpers import blobsnapshot_manager as backup_manager
from tests.backend_helpers import drain_cleanup as _drain
from tests.backend_helpers import live_runs as _live_runs
from tests.backend_helpers import store_contents as contents

# -- garbage ---------------------------------------------------------------------------------------------------------


def test_cleanup_keeps_exactly_what_the_retained_checkpoints_need(tmp_path: Path) -> None:
    """With the checkpoint log's retention at every commit (``retention_interval`` 1), retention's deletes go with
    each cleanup, so after each the blob store holds exactly what the retained checkpoints need. The batches of the
    default interval: tests/test_request_budget.py."""
    blobs = MemoryBlobStore()
    config = make_config(tmp_path)
    model: dict[bytes, bytes] = {}
    with TaskStorage.open(config, "task-0", blob_store=blobs) as task:
        task.checkpoint_log.retention_interval = 1
        for round_no in range(6):
            fill(task, model, round_no * 3000, 3000, f"r{round_no}")
            fill(task, model, 0, 200, f"u{round_no}")
            task.commit_durably({"input": str(round_no)})
            task.commit_manager.wait()
        _drain(task)
        entries = task.checkpoint_log.entries()
        assert len(entries) == 2
        assert run_blobs(blobs) == _live_runs(blobs, task)
        assert index_blobs(blobs) == []  # each index is inline in its checkpoint's marker
        # cleanup again is a no-op (idempotent, absent blobs are success)
        manager = backup_manager(task)
        last = entries[-1].checkpoint
        assert isinstance(last, CheckpointV2)
        manager.cleanup(last.checkpoint_id, dict(last.markers_for("blobsnapshot"))).result(timeout=30)
        assert run_blobs(blobs) == _live_runs(blobs, task)
    # both retained checkpoints restore
    for entry in entries:
        shutil.rmtree(tmp_path / "local")
        with TaskStorage.open(config, "task-0", blob_store=blobs, checkpoint=entry) as task:
            assert task.metrics.counter("restore.stores.full") == 1
    assert contents_after_restore(config, blobs) == model


def contents_after_restore(config: dict[str, object], blobs: MemoryBlobStore) -> dict[bytes, bytes]:
    with TaskStorage.open(config, "task-0", blob_store=blobs) as task:
        return contents(task)


def test_a_durable_checkpoints_blobs_are_not_rewritten_and_no_sweep_takes_them_once_expired(tmp_path: Path) -> None:
    """The expiry written at upload stays (removing it cost a COPY per blob at every cleanup): a sweep deletes an
    expired blob only when no checkpoint names it, so a durable checkpoint's index and runs outlive their expiry."""
    inner = MemoryBlobStore()
    blobs = ResilientBlobStore(inner)
    requests = Metrics()
    blobs.use_metrics(requests)
    config = make_config(tmp_path, **{"blobsnapshot.ttl.ms": 1, "blobsnapshot.gc.grace.period.ms": 0})
    model: dict[bytes, bytes] = {}
    with TaskStorage.open(config, "task-0", blob_store=blobs) as task:
        task.checkpoint_log.retention_interval = 1  # the log keeps exactly the retained 2 at each commit
        for round_no in range(3):
            fill(task, model, round_no * 100, 2000, f"r{round_no}")
            task.commit_durably({"input": str(round_no)})
        _drain(task)
        entries = task.checkpoint_log.entries()
        assert len(entries) == 2
        markers = {e.checkpoint.markers_for("blobsnapshot")["counts"] for e in entries}  # type: ignore[union-attr]
        assert all(is_inline_marker(marker) for marker in markers)
        named = _live_runs(inner, task)
        assert all("expires_at" in inner.head(name).metadata for name in named)
        assert requests.counter("blob_store.requests", operation="set_metadata") == 0, "a cleanup rewrote metadata"
        backup_manager(task).sweep(now=backup_manager(task).shared.clock() + 3600)  # every blob long expired
        assert all(inner.exists(name) for name in named), "a sweep took a blob a retained checkpoint names"
        assert index_blobs(inner) == []
    shutil.rmtree(tmp_path / "local")
    with TaskStorage.open(config, "task-0", blob_store=inner) as task:
        assert contents(task) == model


def test_a_failed_commits_run_is_listed_by_the_next_index_not_uploaded_again(tmp_path: Path) -> None:
    """A commit whose run landed but whose checkpoint did not: its changes are in LMDB, so the next commit's index
    lists that run (already in the blob store) before its own."""
    blobs = ControlledBlobStore(MemoryBlobStore())
    config = make_config(tmp_path)
    model: dict[bytes, bytes] = {}
    with TaskStorage.open(config, "task-0", blob_store=blobs) as task:
        commit_then_fail_next(task, blobs, model, "/checkpoints/", keys=3000, failed_keys=300)
        carried = run_blobs(blobs.inner) - _live_runs(blobs.inner, task)
        assert len(carried) == 1
        fill(task, model, 5000, 10, "c")
        checkpoint = task.commit_durably({"input": "2"})
        index = read_marker_index(blobs.inner, checkpoint)
        assert len(index.runs) == 3 and run_name(PREFIX, index.runs[1].hash) in carried
        assert task.metrics.counter("blobsnapshot.runs.uploaded") == 3
    assert restored_after_wipe(config, blobs) == model


def test_sweep_deletes_blobs_of_an_abandoned_upload_after_the_grace_period(tmp_path: Path) -> None:
    blobs = ControlledBlobStore(MemoryBlobStore())
    config = make_config(tmp_path)
    durable: dict[bytes, bytes] = {}
    with TaskStorage.open(config, "task-0", blob_store=blobs) as task:
        # a commit whose run lands but whose checkpoint never does, and the task goes away: its run is garbage
        commit_then_fail_next(task, blobs, durable, "/checkpoints/", keys=3000, failed_keys=3000, failed_model={})
    with TaskStorage.open(config, "task-0", blob_store=blobs) as task:
        assert contents(task) == durable
        orphans = run_blobs(blobs.inner) - _live_runs(blobs.inner, task)
        assert len(orphans) == 1
        for name in orphans:
            assert "expires_at" in blobs.head(name).metadata
        manager = backup_manager(task)
        assert manager.sweep().runs_deleted == 0  # within the grace period: could be an upload in progress
        assert run_blobs(blobs.inner) >= orphans
        report = manager.sweep(now=manager.shared.clock() + 2 * 3600)
        assert report.runs_deleted == len(orphans)
        assert run_blobs(blobs.inner) == _live_runs(blobs.inner, task)
    shutil.rmtree(tmp_path / "local")
    with TaskStorage.open(config, "task-0", blob_store=blobs) as task:
        assert contents(task) == durable


def test_sweep_never_deletes_what_a_checkpoint_in_the_log_needs(tmp_path: Path) -> None:
    """Indexes restored from an older run are not in memory, but the checkpoint log still names them."""
    blobs = MemoryBlobStore()
    config = make_config(tmp_path, **{"task.checkpoint.retained": 3})
    model: dict[bytes, bytes] = {}
    with TaskStorage.open(config, "task-0", blob_store=blobs) as task:
        for round_no in range(3):
            fill(task, model, 0, 2000, f"r{round_no}")
            task.commit_durably({"input": str(round_no)})
        _drain(task)
    with TaskStorage.open(config, "task-0", blob_store=blobs) as task:
        before = run_blobs(blobs)
        report = backup_manager(task).sweep(now=10**12)
        assert report.runs_deleted == 0 and report.indexes_deleted == 0
        assert run_blobs(blobs) == before
    for seq in (1, 2, 3):
        shutil.rmtree(tmp_path / "local")
        with TaskStorage.open(config, "task-0", blob_store=blobs, checkpoint=at_seq(seq)):
            pass


def test_sweep_runs_at_init_and_on_a_store_without_metadata_uses_first_seen(tmp_path: Path) -> None:
    inner = MemoryBlobStore()
    inner.supports_metadata = False
    config = make_config(tmp_path, **{"blobsnapshot.gc.on.init": "true"})
    with TaskStorage.open(config, "task-0", blob_store=inner) as task:
        fill(task, {}, 0, 1000, "a")
        task.commit_durably({"input": "0"})
        _drain(task)
        inner.put(PREFIX + "runs/" + "0" * 64, b"orphan")
        inner.put(PREFIX + "chunks/" + "1" * 64, b"a chunk of a schema-1 snapshot no checkpoint names")
        manager = backup_manager(task)
        assert manager.sweep().runs_deleted == 0  # first seen now
        assert manager.sweep(now=manager.shared.clock() + 2 * 3600).runs_deleted == 2
        assert not list(inner.list(PREFIX + "chunks/"))
        assert run_blobs(inner) == _live_runs(inner, task)
        assert task.metrics.counter("blobsnapshot.sweeps") >= 3  # the one at init too


def test_sweep_counts_the_age_of_a_blob_without_metadata_from_first_seen(tmp_path: Path) -> None:
    """A head() whose metadata headers were cut shows no metadata: that is no proof of age (before, such a young
    unreferenced blob, e.g. another attempt's upload in progress, was deleted at once)."""
    blobs = MemoryBlobStore()
    config = make_config(tmp_path)
    with TaskStorage.open(config, "task-0", blob_store=blobs) as task:
        fill(task, {}, 0, 500, "a")
        task.commit_durably({"input": "0"})
        stray = next(iter(run_blobs(blobs))).rsplit("/", 1)[0] + "/" + "0" * 64
        blobs.put(stray, b"an upload in progress elsewhere")  # no metadata at all
        manager = backup_manager(task)
        assert manager.sweep().runs_deleted == 0
        assert stray in run_blobs(blobs)
        assert manager.sweep(now=manager.shared.clock() + 2 * 3600).runs_deleted == 1
        assert stray not in run_blobs(blobs)


def test_sweep_ages_a_blob_with_unreadable_age_metadata_from_its_first_sighting(tmp_path: Path) -> None:
    """The kit's age rule: an unreadable ``created_at`` is an unknown age, counted from the first sighting (before,
    such a blob was kept forever), and an expired blob goes whatever its age."""
    blobs = MemoryBlobStore()
    config = make_config(tmp_path)
    with TaskStorage.open(config, "task-0", blob_store=blobs) as task:
        fill(task, {}, 0, 500, "a")
        task.commit_durably({"input": "0"})
        manager = backup_manager(task)
        now = manager.shared.clock()
        unreadable, expired = PREFIX + "runs/" + "0" * 64, PREFIX + "runs/" + "1" * 64
        blobs.put(unreadable, b"stray", metadata={"created_at": "not a time"})
        blobs.put(expired, b"stray", metadata={"created_at": f"{now:.3f}", "expires_at": f"{now - 1:.3f}"})
        assert manager.sweep().runs_deleted == 1  # the expired one, though young
        assert unreadable in run_blobs(blobs) and expired not in run_blobs(blobs)
        assert manager.sweep(now=now + 3500).runs_deleted == 0  # younger than the grace period since first seen
        assert manager.sweep(now=now + 2 * 3600).runs_deleted == 1
        assert run_blobs(blobs) == _live_runs(blobs, task)


def test_sweep_stops_deleting_a_quarter_of_the_grace_period_after_its_mark(tmp_path: Path) -> None:
    """Its marks may be stale by then (a checkpoint written since may name a run that is old by now): the sweep
    stops, and the next one marks anew. Its deletes go in one request per prefix (indexes, then runs): a first sweep
    whose index request takes past the deadline deletes no run; the next one deletes them."""
    clock = [1_800_000_000.0]

    class SlowDeletes(MemoryBlobStore):
        supports_conditional_delete = False  # the sweep takes its delete_many path, which this test watches
        slow = False

        def delete_many(self, names: list[str]) -> None:
            super().delete_many(names)
            if self.slow:
                clock[0] += 1000  # past a quarter of the grace period (900 s) after one request

    blobs = SlowDeletes()
    config = make_config(tmp_path)
    with TaskStorage.open(config, "task-0", blob_store=blobs) as task:
        fill(task, {}, 0, 500, "a")
        task.commit_durably({"input": "0"})
        _drain(task)
        manager = backup_manager(task)
        manager.shared.clock = lambda: clock[0]
        orphans = {PREFIX + "runs/" + digit * 64 for digit in "012"}
        orphan_index = PREFIX + "index/000000000009-" + "0" * 16 + ".json"
        for name in [*orphans, orphan_index]:
            blobs.put(name, b"orphan", metadata={"created_at": f"{clock[0] - 7200:.3f}"})
        blobs.slow = True
        first = manager.sweep()
        assert (first.indexes_deleted, first.runs_deleted) == (1, 0)
        assert orphans <= run_blobs(blobs)
        assert manager.sweep().runs_deleted == 3
        assert run_blobs(blobs) == _live_runs(blobs, task)
