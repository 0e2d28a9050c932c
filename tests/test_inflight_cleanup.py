"""Work in flight is never deleted by cleanup or mark-and-sweep (both backends).

Uploads are held with :class:`ControlledBlobStore` (events, not sleeps); sweeps run with every grace period past
(blob-snapshot: ``now`` ten years ahead; changelog: every commit is a sweep commit), so only the in-flight protection
(a per-store lock, a registry of what is running, "newer than the newest checkpoint") can keep what they must keep.
The staged-file case of the changelog backend is in tests/test_backend_changelog.py.
"""

from __future__ import annotations

import shutil
import threading
from pathlib import Path

import pytest
from statebackend.backends.blobsnapshot.backup import BlobSnapshotBackupManager
from statebackend.backends.blobsnapshot.blobs import read_marker
from statebackend.backends.changelog.backup import ChangelogBackupManager

from statebackend.blobstores.memory import MemoryBlobStore
from statebackend.task import TaskStorage
from statebackend.testing.backend_contract import contents, write_round
from statebackend.testing.controlled import ControlledBlobStore
from tests import backend_helpers
from tests.backend_helpers import FAR_FUTURE, commit_round, restored_after_wipe, sweep

BACKENDS: dict[str, dict[str, object]] = {
    "changelog": {
        "changelog.snapshot.interval.commits": 2,
        "changelog.gc.interval.commits": 1,
        "changelog.gc.grace.period.ms": 0,
    },
    "blobsnapshot": {"blobsnapshot.gc.grace.period.ms": 0, "blobsnapshot.gc.interval.commits": 1},
}


def make_config(backend: str, tmp_path: Path) -> dict[str, object]:
    return backend_helpers.make_config(backend, tmp_path, BACKENDS[backend])


@pytest.mark.parametrize("backend", list(BACKENDS))
def test_sweep_and_cleanup_while_a_checkpoint_write_is_in_flight_keep_everything_it_names(
    tmp_path: Path, backend: str
) -> None:
    """The uploads of a commit are done and its checkpoint write is held: a sweep and a repeated cleanup of the
    previous checkpoint run meanwhile. Nothing the held checkpoint names may go."""
    inner = MemoryBlobStore()
    blobs = ControlledBlobStore(inner)
    config = make_config(backend, tmp_path)
    model: dict[bytes, bytes] = {}
    with TaskStorage.open(config, "task-0", blob_store=blobs) as task:
        for round_no in range(4):
            previous = commit_round(task, round_no, model)
        task.commit_manager.close()  # the cleanups of those commits are done
        blobs.hold = lambda name: "/checkpoints/" in name
        write_round(task, 4, model)
        pending = task.commit({"input": "4"})
        assert pending is not None
        try:
            assert blobs.held.wait(30), "the checkpoint write never started"
            for binding in task.commit_manager.backups:
                sweep(binding.manager)
                binding.manager.cleanup(previous.checkpoint_id, previous.markers_for(binding.factory_name)).result(
                    timeout=30
                )
                sweep(binding.manager)
        finally:
            blobs.release.set()
        assert pending.result(timeout=30).input_offsets == {"input": "4"}
    shutil.rmtree(tmp_path / "local")
    with TaskStorage.open(config, "task-0", blob_store=inner) as task:
        assert task.restored is not None and task.restored.input_offsets == {"input": "4"}
        assert contents(task) == model


def test_blobsnapshot_upload_holds_the_store_lock_while_it_writes_its_run(tmp_path: Path) -> None:
    """A blob-snapshot upload writes a run no index references yet: cleanup and sweep of the store are kept out
    by the store's lock for as long as it writes (checked at every held write), and a sweep started meanwhile,
    after every grace period, leaves the upload's commit restorable."""
    inner = MemoryBlobStore()
    blobs = ControlledBlobStore(inner)
    config = make_config("blobsnapshot", tmp_path)
    model: dict[bytes, bytes] = {}
    with TaskStorage.open(config, "task-0", blob_store=blobs) as task:
        manager = next(b.manager for b in task.commit_manager.backups)
        assert isinstance(manager, BlobSnapshotBackupManager)
        state = manager.shared.stores["counts"]  # white box: the lock the sweep and cleanup take
        commit_round(task, 0, model)
        locked_at_writes: list[bool] = []

        def hold(name: str) -> bool:
            if "/blobsnapshot/" not in name:
                return False
            locked_at_writes.append(state.io_lock.locked())
            return "/runs/" in name  # hold the run: written, and referenced by no checkpoint yet

        blobs.hold = hold
        for i in range(3000):  # a run of some size
            key, value = f"n{i:05d}".encode(), f"value-{i}".encode() * 8
            task.store("counts").put(key, value)
            model[key] = value
        pending = task.commit({"input": "1"})
        assert pending is not None
        sweeper = threading.Thread(target=manager.sweep, kwargs={"now": manager.shared.clock() + FAR_FUTURE})
        try:
            assert blobs.held.wait(30), "the run write never started"
            sweeper.start()
        finally:
            blobs.release.set()
        sweeper.join(60)  # a hang guard, not a timing: the sweep ends once the upload released the lock
        assert not sweeper.is_alive()
        assert pending.result(timeout=30).input_offsets == {"input": "1"}
        assert len(locked_at_writes) == 1 and all(locked_at_writes)  # the run (its index is inline in the marker)
    assert restored_after_wipe(config, inner) == model


def test_changelog_snapshot_uploaded_but_not_adopted_yet_survives_a_sweep(tmp_path: Path) -> None:
    """A background snapshot whose upload finished is referenced by no checkpoint until the next commit adopts it,
    and its seq is at or below the newest checkpoint's: a sweep in between must keep it."""
    inner = MemoryBlobStore()
    config = make_config("changelog", tmp_path)
    model: dict[bytes, bytes] = {}
    with TaskStorage.open(config, "task-0", blob_store=inner) as task:
        manager = next(b.manager for b in task.commit_manager.backups)
        assert isinstance(manager, ChangelogBackupManager)
        lineage = manager.shared.stores["counts"]  # the test waits on the backend's own background future
        for round_no in range(2):  # the second commit starts a background snapshot
            commit_round(task, round_no, model)
        background = lineage.background
        assert background is not None and background.exception(timeout=30) is None
        (snapshot,) = list(inner.list("job/task-0/counts/changelog/snapshot/"))
        manager.sweep()
        assert inner.exists(snapshot)
        commit_round(task, 2, model)
        assert task.metrics.counter("changelog.snapshot.adopted") == 1
    assert restored_after_wipe(config, inner) == model


def test_blobsnapshot_compaction_uploaded_but_not_adopted_yet_survives_a_sweep(tmp_path: Path) -> None:
    """A finished compaction's run is referenced by no index until the next commit adopts it: a sweep in between,
    after every grace period, must keep it, and the next commit lists it."""
    inner = MemoryBlobStore()
    config = make_config("blobsnapshot", tmp_path)
    config.update(
        {
            "blobsnapshot.compaction.fanout": 2,
            "blobsnapshot.compaction.full.min.bytes": 0,
            "blobsnapshot.gc.interval.commits": 0,
        }
    )
    model: dict[bytes, bytes] = {}
    with TaskStorage.open(config, "task-0", blob_store=inner) as task:
        manager = next(b.manager for b in task.commit_manager.backups)
        assert isinstance(manager, BlobSnapshotBackupManager)
        state = manager.shared.stores["counts"]  # white box: the test waits on the backend's own compaction future
        round_no = 0
        while state.compaction is None:  # two runs above the bottom one start a merge or a full compaction
            commit_round(task, round_no, model)
            round_no += 1
            assert round_no < 10, "no compaction started"
        compaction = state.compaction
        compacted = compaction.result(timeout=60)
        assert compacted is not None
        output = f"job/task-0/counts/blobsnapshot/runs/{compacted.output.hash}"
        assert inner.exists(output)
        sweep(manager)
        assert inner.exists(output), "the sweep deleted a compacted run before its adoption"
        checkpoint = commit_round(task, round_no, model)
        assert task.metrics.counter("blobsnapshot.compaction.adopted") == 1
    marker = checkpoint.markers_for("blobsnapshot")["counts"]
    assert compacted.output.hash in read_marker(inner, marker, job="job", task="task-0", store="counts").run_hashes()
    assert restored_after_wipe(config, inner) == model
