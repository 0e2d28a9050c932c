"""Faults inside the commit protocol: each leaves the task able to commit again and the durable state exact."""

from __future__ import annotations

import errno
import shutil
import threading
import uuid
from concurrent.futures import Future
from pathlib import Path
from typing import Any

import pytest
import statebackend.backends.changelog.backup as changelog_backup
import statebackend.backends.changelog.upload as changelog_upload
from statebackend.backends.blobsnapshot.backup import BlobSnapshotBackupManager
from statebackend.checkpoint import write_local_checkpoint

import statebackend.commit as commit_module
from statebackend.blobstores.memory import MemoryBlobStore
from statebackend.errors import CommitError, StateBackendError, StorageError
from statebackend.recordfile import write_file
from statebackend.store import LocalStore, LocalVersion
from statebackend.task import TaskStorage
from statebackend.testing.backend_contract import contents, write_round
from tests.backend_helpers import commit_round, restored_after_wipe
from tests.waiting import drain_appliers, scaled, wait_until


def config_for(tmp_path: Path, **extra: object) -> dict[str, object]:
    config: dict[str, object] = {
        "job.name": "job",
        "state.local.dir": str(tmp_path / "local"),
        "blob.store.url": f"memory://{uuid.uuid4().hex}",
        "stores.counts.backup.factories": "changelog",
        "task.checkpoint.retained": 3,
    }
    config.update(extra)
    return config


def test_delta_cut_short_while_staging_is_never_uploaded_as_a_whole_one(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    blobs = MemoryBlobStore()
    config = config_for(tmp_path, **{"task.commit.async.failures.tolerated": 1})
    real_write_file = write_file
    calls = {"n": 0}

    def disk_full_once(out: Any, header: Any, records: Any, **kwargs: Any) -> Any:
        calls["n"] += 1
        if calls["n"] == 2:
            out.write(b"SBCHLOG\x00 half a file")
            raise OSError(errno.ENOSPC, "No space left on device")
        return real_write_file(out, header, records, **kwargs)

    monkeypatch.setattr(changelog_upload, "write_file", disk_full_once)
    model: dict[bytes, bytes] = {}
    with TaskStorage.open(config, "task-0", blob_store=blobs) as task:
        commit_round(task, 0, model)
        write_round(task, 1, model)
        failed = task.commit({"input": "1"})
        assert failed is not None
        with pytest.raises(CommitError, match="No space"):
            failed.result(timeout=30)
        write_round(task, 2, model)
        task.commit_durably({"input": "2"})  # tolerated failure: this commit must carry round 1 as well
    assert restored_after_wipe(config, blobs) == model


def test_checkpoint_durable_but_local_file_failing_is_a_success_and_later_commits_go_on(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    blobs = MemoryBlobStore()
    real = write_local_checkpoint
    calls = {"n": 0}

    def flaky(path: Any, checkpoint: Any, binding: Any) -> None:
        calls["n"] += 1
        if calls["n"] == 2:
            raise OSError(errno.ENOSPC, "No space left on device")
        real(path, checkpoint, binding)

    monkeypatch.setattr(commit_module, "write_local_checkpoint", flaky)
    model: dict[bytes, bytes] = {}
    with TaskStorage.open(config_for(tmp_path), "task-0", blob_store=blobs) as task:
        for round_no in range(4):
            write_round(task, round_no, model)
            assert task.commit_durably({"input": str(round_no)}).input_offsets == {"input": str(round_no)}
        assert task.metrics.counter("commit.local.checkpoint.failures") == 1
        assert task.metrics.counter("commit.conflicts") == 0
        assert task.checkpoint_log.seqs()[-1] == 4


def test_a_conflict_is_never_tolerated_and_every_later_commit_refuses(tmp_path: Path) -> None:
    blobs = MemoryBlobStore()
    config_a = config_for(tmp_path / "a", **{"task.commit.async.failures.tolerated": 10})
    config_b = dict(config_a, **{"state.local.dir": str(tmp_path / "b")})
    attempt_a = TaskStorage.open(config_a, "task-0", blob_store=blobs)
    attempt_b = TaskStorage.open(config_b, "task-0", blob_store=blobs)
    try:
        write_round(attempt_a, 0, {})
        write_round(attempt_b, 1, {})
        attempt_a.commit_durably({"input": "a"})
        with pytest.raises(CommitError, match="another attempt"):
            attempt_b.commit_durably({"input": "b"})
        for _ in range(2):
            with pytest.raises(CommitError, match="another attempt"):
                attempt_b.commit({"input": "b-again"})
    finally:
        attempt_a.close()
        attempt_b.close()


def test_snapshot_failing_in_one_backend_of_a_dual_commit_does_not_fail_the_next_commit(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    blobs = MemoryBlobStore()
    config = config_for(tmp_path, **{"stores.counts.backup.factories": "changelog,blobsnapshot"})
    real = BlobSnapshotBackupManager.snapshot
    calls = {"n": 0}

    def fail_once(self: Any, checkpoint_id: Any, changes: Any) -> Any:
        calls["n"] += 1
        if calls["n"] == 2:
            raise StateBackendError("injected snapshot failure")
        return real(self, checkpoint_id, changes)

    monkeypatch.setattr(BlobSnapshotBackupManager, "snapshot", fail_once)
    model: dict[bytes, bytes] = {}
    with TaskStorage.open(config, "task-0", blob_store=blobs) as task:
        commit_round(task, 0, model)
        write_round(task, 1, model)
        with pytest.raises(StateBackendError, match="injected"):
            task.commit({"input": "1"})
        commit_round(task, 2, model)
        commit_round(task, 3, model)
    for restore_factory in ("changelog", "blobsnapshot"):
        shutil.rmtree(tmp_path / "local")
        restore_config = dict(config, **{"stores.counts.restore.factory": restore_factory})
        with TaskStorage.open(restore_config, "task-0", blob_store=blobs) as task:
            assert contents(task) == model


def test_a_failed_apply_fails_every_waiting_read_view_instead_of_hanging(tmp_path: Path) -> None:
    with LocalStore.open(tmp_path / "s", name="s", map_size=1 << 18) as store:
        with store._applier.lock:  # keep the background applier out until both batches wait
            store.put_all((b"k%04d" % i, b"x" * 1000) for i in range(1000))
            first = store.flush(LocalVersion("1-1", "aa")).read_view()
            store.put(b"small", b"1")
            second = store.flush(LocalVersion("1-2", "bb")).read_view()
        with pytest.raises(StorageError, match="map"):
            first.result(timeout=30)
        with pytest.raises(StorageError):
            second.result(timeout=30)
        with pytest.raises(StorageError):
            store.flush(LocalVersion("1-3", "cc"))


def test_an_upload_failing_to_start_fails_the_commit_after_the_started_uploads_end(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The failure is handed to the commit once the other backend's upload, still running then, ends."""
    blobs = MemoryBlobStore()
    config = config_for(tmp_path, **{"stores.counts.backup.factories": "changelog,blobsnapshot"})
    real_upload = changelog_backup.ChangelogBackupManager.upload
    gates: list[tuple[Future[Any], Future[Any]]] = []

    def held_upload(self: Any, checkpoint_id: Any, markers: Any) -> Future[Any]:
        held: Future[Any] = Future()
        gates.append((real_upload(self, checkpoint_id, markers), held))
        return held

    def refuse_to_start(self: Any, checkpoint_id: Any, markers: Any) -> Future[Any]:
        raise StateBackendError("injected upload start failure")

    monkeypatch.setattr(changelog_backup.ChangelogBackupManager, "upload", held_upload)
    monkeypatch.setattr(BlobSnapshotBackupManager, "upload", refuse_to_start)
    with TaskStorage.open(config, "task-0", blob_store=blobs) as task:
        write_round(task, 0, {})
        pending = task.commit({"input": "0"})
        assert pending is not None
        real, held = gates[0]
        held.set_result(real.result(timeout=30))  # the started upload ends after the commit's sync part returned
        with pytest.raises(CommitError, match="injected upload start failure"):
            pending.result(timeout=scaled(30))


class _GatedUploads(MemoryBlobStore):
    """Uploads of files (the deltas) wait for ``gate``, or fail when ``fail`` is set."""

    def __init__(self) -> None:
        super().__init__()
        self.gate = threading.Event()
        self.gate.set()
        self.fail = False

    def put_file(self, name: str, path: Any, **kwargs: Any) -> None:
        assert self.gate.wait(30)
        if self.fail:
            raise StorageError(f"upload of {name} refused by the test")
        super().put_file(name, path, **kwargs)


def test_a_commit_holds_its_flushed_batch_out_of_lmdb_until_its_uploads_end_and_reads_see_it_meanwhile(
    tmp_path: Path,
) -> None:
    blobs = _GatedUploads()
    config = config_for(tmp_path, **{"task.commit.async.failures.tolerated": 1})
    model: dict[bytes, bytes] = {}
    with TaskStorage.open(config, "task-0", blob_store=blobs) as task:
        local = task.stores["counts"]
        commit_round(task, 0, model)
        wait_until(lambda: not local._applier.pending)

        blobs.gate.clear()
        write_round(task, 1, model)
        pending = task.commit({"input": "1"})
        assert pending is not None
        drain_appliers()  # an apply submitted at the flush would have ended by now
        assert local._applier.pending, "the flushed batch reached LMDB while its upload was still going on"
        assert contents(task) == model  # the overlay serves it
        blobs.gate.set()
        pending.result(timeout=30)
        wait_until(lambda: not local._applier.pending)  # released once durable
        assert local.version is not None and local.version.checkpoint_id == str(pending.checkpoint_id)

        blobs.fail = True  # a failed commit releases its batch too
        write_round(task, 2, model)
        failed = task.commit({"input": "2"})
        assert failed is not None
        with pytest.raises(CommitError, match="refused by the test"):
            failed.result(timeout=30)
        wait_until(lambda: not local._applier.pending)
        assert contents(task) == model
        blobs.fail = False
        write_round(task, 3, model)
        task.commit_durably({"input": "3"})  # tolerated failure: carries round 2 as well
    assert restored_after_wipe(config, blobs) == model


def test_a_flush_failing_in_one_store_releases_the_batches_the_other_stores_held_back(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    config = config_for(tmp_path, **{"stores.other.backup.factories": "changelog"})
    with TaskStorage.open(config, "task-0", blob_store=MemoryBlobStore()) as task:
        first, second = list(task.stores.values())
        first.put(b"k", b"1")
        second.put(b"k", b"2")

        real_flush = LocalStore.flush

        def flush(store: LocalStore, *args: Any, **kwargs: Any) -> Any:
            if store is second:
                raise StorageError("flush refused by the test")
            return real_flush(store, *args, **kwargs)

        monkeypatch.setattr(LocalStore, "flush", flush)
        with pytest.raises(StorageError, match="refused by the test"):
            task.commit({"input": "0"})
        wait_until(lambda: not first._applier.pending)  # the held batch of the store flushed first reached LMDB
        assert first.version is not None and first.get(b"k") == b"1"


def test_a_durable_commit_records_its_upload_and_checkpoint_parts_within_its_total(tmp_path: Path) -> None:
    model: dict[bytes, bytes] = {}
    with TaskStorage.open(config_for(tmp_path), "task-0", blob_store=MemoryBlobStore()) as task:
        for round_no in range(3):
            write_round(task, round_no, model)
            task.commit_durably({"input": str(round_no)})
        uploads = task.metrics.samples("commit.upload.ms")
        checkpoints = task.metrics.samples("commit.checkpoint.ms")
        totals = task.metrics.samples("commit.total.ms")
    assert len(uploads) == len(checkpoints) == len(totals) == 3
    for upload, checkpoint, total in zip(uploads, checkpoints, totals, strict=True):
        assert upload >= 0 and checkpoint >= 0 and upload + checkpoint <= total + 1e-6  # in sequence, inside it
