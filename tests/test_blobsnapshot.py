"""The blob-snapshot backend end to end through TaskStorage and the commit protocol, on real LMDB and the in-memory
blob store (the fake that passes the blob store contract suite), plus its index format."""

from __future__ import annotations

import json
import shutil
import uuid
from pathlib import Path
from typing import Any, ClassVar

import pytest
from statebackend.backends.blobsnapshot.backup import BlobSnapshotBackupManager
from statebackend.backends.blobsnapshot.format import SCHEMA_VERSION, SnapshotIndex, chunk_name
from statebackend.backends.blobsnapshot.restore import BlobSnapshotRestoreManager

from statebackend.blobstores.file import FileBlobStore
from statebackend.blobstores.memory import MemoryBlobStore
from statebackend.errors import CommitError, CorruptDataError, IncompatibleFormatError, NotFoundError
from statebackend.task import TaskStorage
from statebackend.testing.backend_contract import BackendContract
from statebackend.testing.controlled import ControlledBlobStore

PREFIX = "job/task-0/counts/blobsnapshot/"


class TestBlobSnapshotBackend(BackendContract):
    """The backup/restore contract suite, unchanged, against this backend (with its sweep at init on)."""

    backup_factories: ClassVar[str] = "blobsnapshot"
    extra_config: ClassVar[dict[str, Any]] = {
        "stores.counts.restore.factory": "blobsnapshot",
        "blobsnapshot.chunk.size": "64KiB",
    }


def make_config(tmp_path: Path, **extra: object) -> dict[str, object]:
    config: dict[str, object] = {
        "job.name": "job",
        "state.local.dir": str(tmp_path / "local"),
        "blob.store.url": f"memory://{uuid.uuid4().hex}",
        "stores.counts.backup.factories": "blobsnapshot",
        "stores.counts.restore.factory": "blobsnapshot",
        "blobsnapshot.chunk.size": "64KiB",
        "blobsnapshot.gc.on.init": "false",
        "task.checkpoint.retained": 2,
    }
    config.update(extra)
    return config


def contents(task: TaskStorage, name: str = "counts") -> dict[bytes, bytes]:
    return dict(task.store(name).items())


def fill(task: TaskStorage, model: dict[bytes, bytes], start: int, count: int, tag: str, name: str = "counts") -> None:
    store = task.store(name)
    for i in range(start, start + count):
        key = f"k{i:07d}".encode()
        value = f"{tag}-{i}-".encode() * 3
        store.put(key, value)
        model[key] = value


def backup_manager(task: TaskStorage) -> BlobSnapshotBackupManager:
    manager = next(b.manager for b in task.commit_manager.backups if b.factory_name == "blobsnapshot")
    assert isinstance(manager, BlobSnapshotBackupManager)
    return manager


def chunk_blobs(blobs: MemoryBlobStore, prefix: str = PREFIX) -> set[str]:
    return set(blobs.list(prefix + "chunks/"))


def index_blobs(blobs: MemoryBlobStore, prefix: str = PREFIX) -> list[str]:
    return list(blobs.list(prefix + "index/"))


def uploaded_by(task: TaskStorage, offsets: dict[str, str]) -> float:
    before = task.metrics.counter("commit.bytes.uploaded")
    task.commit_durably(offsets)
    return task.metrics.counter("commit.bytes.uploaded") - before


# -- commit and restore ---------------------------------------------------------------------------------------------


def test_first_snapshot_uploads_every_chunk_and_an_index_naming_them(tmp_path: Path) -> None:
    blobs = MemoryBlobStore()
    model: dict[bytes, bytes] = {}
    with TaskStorage.open(make_config(tmp_path), "task-0", blob_store=blobs) as task:
        fill(task, model, 0, 5000, "a")
        checkpoint = task.commit_durably({"input": "0"})
    marker = checkpoint.markers_for("blobsnapshot")["counts"]
    index = SnapshotIndex.decode(blobs.get(marker), name=marker)
    assert [f.name for f in index.files] == ["data.mdb"]
    assert index.files_added == ("data.mdb",) and index.previous_index is None
    assert {chunk_name(PREFIX, h) for h in index.chunk_hashes()} == chunk_blobs(blobs)
    assert len(index.files[0].chunks) > 1
    assert index.version.checkpoint_id == str(checkpoint.checkpoint_id)


def test_restart_reuses_local_state_verified_by_content_hash(tmp_path: Path) -> None:
    blobs = MemoryBlobStore()
    config = make_config(tmp_path)
    model: dict[bytes, bytes] = {}
    with TaskStorage.open(config, "task-0", blob_store=blobs) as task:
        fill(task, model, 0, 3000, "a")
        task.commit_durably({"input": "0"})
    with TaskStorage.open(config, "task-0", blob_store=blobs) as task:
        assert contents(task) == model
        assert task.metrics.counter("restore.stores.reused") == 1
        assert task.metrics.counter("restore.bytes") == 0


def test_same_version_with_different_bytes_is_not_reused(tmp_path: Path) -> None:
    """The version alone is never trusted: local data changed behind the store's back is rebuilt."""
    blobs = MemoryBlobStore()
    config = make_config(tmp_path)
    model: dict[bytes, bytes] = {}
    with TaskStorage.open(config, "task-0", blob_store=blobs) as task:
        fill(task, model, 0, 3000, "a")
        task.commit_durably({"input": "0"})
        store = task.stores["counts"]
        version = store.version
        # same key count and version, different value bytes
        store.put(b"k0000001", b"tampered-value-of-the-same-len"[: len(model[b"k0000001"])])
        store.flush(version)
    with TaskStorage.open(config, "task-0", blob_store=blobs) as task:
        assert contents(task) == model
        assert task.metrics.counter("restore.stores.reused") == 0
        assert task.metrics.counter("restore.stores.full") == 1
        # all but the changed chunk(s) came from local disk
        assert task.metrics.counter("restore.bytes.reused") > task.metrics.counter("restore.bytes")


def test_wiped_local_dir_restores_exactly(tmp_path: Path) -> None:
    blobs = MemoryBlobStore()
    config = make_config(tmp_path)
    model: dict[bytes, bytes] = {}
    with TaskStorage.open(config, "task-0", blob_store=blobs) as task:
        for round_no in range(4):
            fill(task, model, round_no * 700, 1500, f"r{round_no}")
            for i in range(0, 400, 7):
                key = f"k{i + round_no:07d}".encode()
                task.store("counts").delete(key)
                model.pop(key, None)
            task.commit_durably({"input": str(round_no)})
    shutil.rmtree(tmp_path / "local")
    with TaskStorage.open(config, "task-0", blob_store=blobs) as task:
        assert contents(task) == model
        assert task.metrics.counter("restore.stores.full") == 1
        assert task.restored is not None and task.restored.input_offsets == {"input": "3"}
        # and it goes on committing from the restored state
        fill(task, model, 9000, 10, "after")
        task.commit_durably({"input": "4"})
    shutil.rmtree(tmp_path / "local")
    with TaskStorage.open(config, "task-0", blob_store=blobs) as task:
        assert contents(task) == model


def test_file_blob_store_round_trip(tmp_path: Path) -> None:
    blobs = FileBlobStore.from_url(f"file://{tmp_path / 'blobs'}", FileBlobStore.parse_options({}))
    config = make_config(tmp_path, **{"blob.store.url": f"file://{tmp_path / 'blobs'}"})
    model: dict[bytes, bytes] = {}
    with TaskStorage.open(config, "task-0", blob_store=blobs) as task:
        fill(task, model, 0, 2000, "a")
        task.commit_durably({"input": "0"})
        fill(task, model, 100, 50, "b")
        task.commit_durably({"input": "1"})
    shutil.rmtree(tmp_path / "local")
    with TaskStorage.open(config, "task-0", blob_store=blobs) as task:
        assert contents(task) == model


def test_no_change_commit_uploads_little_and_restores_the_same_state(tmp_path: Path) -> None:
    blobs = MemoryBlobStore()
    config = make_config(tmp_path)
    model: dict[bytes, bytes] = {}
    with TaskStorage.open(config, "task-0", blob_store=blobs) as task:
        fill(task, model, 0, 5000, "a")
        first = uploaded_by(task, {"input": "0"})
        second = uploaded_by(task, {"input": "1"})
        # only the chunk holding the meta page (new version token) plus the index
        assert second < first / 4
    shutil.rmtree(tmp_path / "local")
    with TaskStorage.open(config, "task-0", blob_store=blobs) as task:
        assert contents(task) == model


def test_small_change_reuses_chunks_and_uploads_fewer_bytes(tmp_path: Path) -> None:
    blobs = MemoryBlobStore()
    config = make_config(tmp_path)
    model: dict[bytes, bytes] = {}
    with TaskStorage.open(config, "task-0", blob_store=blobs) as task:
        fill(task, model, 0, 20_000, "a")
        first = uploaded_by(task, {"input": "0"})
        fill(task, model, 10_000, 5, "b")
        second = uploaded_by(task, {"input": "1"})
        assert second < first / 4
        assert task.metrics.counter("commit.bytes.reused") > 0
        latest = task.commit_manager.last_checkpoint
        assert latest is not None
        index = SnapshotIndex.decode(blobs.get(latest.markers_for("blobsnapshot")["counts"]), name="latest")
        assert index.previous_index is not None and 0 < len(index.chunks_added) < len(index.files[0].chunks)
        assert index.files_added == () and index.files_removed == ()
    shutil.rmtree(tmp_path / "local")
    with TaskStorage.open(config, "task-0", blob_store=blobs) as task:
        assert contents(task) == model


def test_everything_changed_uploads_a_whole_new_set_of_chunks(tmp_path: Path) -> None:
    blobs = MemoryBlobStore()
    config = make_config(tmp_path)
    model: dict[bytes, bytes] = {}
    with TaskStorage.open(config, "task-0", blob_store=blobs) as task:
        fill(task, model, 0, 5000, "a")
        task.commit_durably({"input": "0"})
        fill(task, model, 0, 5000, "B")
        checkpoint = task.commit_durably({"input": "1"})
    marker = checkpoint.markers_for("blobsnapshot")["counts"]
    index = SnapshotIndex.decode(blobs.get(marker), name=marker)
    assert set(index.chunks_added) == index.chunk_hashes()
    assert index.chunks_removed  # every chunk of the previous snapshot is gone from this one
    shutil.rmtree(tmp_path / "local")
    with TaskStorage.open(config, "task-0", blob_store=blobs) as task:
        assert contents(task) == model


def test_index_records_chunks_added_removed_and_retained(tmp_path: Path) -> None:
    blobs = MemoryBlobStore()
    config = make_config(tmp_path)
    model: dict[bytes, bytes] = {}
    with TaskStorage.open(config, "task-0", blob_store=blobs) as task:
        fill(task, model, 0, 20_000, "a")
        first = task.commit_durably({"input": "0"})
        fill(task, model, 15_000, 2, "b")
        second = task.commit_durably({"input": "1"})
    a_name = first.markers_for("blobsnapshot")["counts"]
    b_name = second.markers_for("blobsnapshot")["counts"]
    a = SnapshotIndex.decode(blobs.get(a_name), name=a_name)
    b = SnapshotIndex.decode(blobs.get(b_name), name=b_name)
    assert b.previous_index == a_name
    assert set(b.chunks_added) == b.chunk_hashes() - a.chunk_hashes()
    assert set(b.chunks_removed) == a.chunk_hashes() - b.chunk_hashes()
    retained = a.chunk_hashes() & b.chunk_hashes()
    assert retained and b.chunks_added and b.chunks_removed


def test_store_dropped_from_config_leaves_the_others_restorable(tmp_path: Path) -> None:
    blobs = MemoryBlobStore()
    config = make_config(tmp_path, **{
        "stores.other.backup.factories": "blobsnapshot", "stores.other.restore.factory": "blobsnapshot"})
    model: dict[bytes, bytes] = {}
    with TaskStorage.open(config, "task-0", blob_store=blobs) as task:
        fill(task, model, 0, 1000, "a")
        fill(task, {}, 0, 1000, "o", name="other")
        task.commit_durably({"input": "0"})
    dropped = {k: v for k, v in config.items() if not k.startswith("stores.other.")}
    shutil.rmtree(tmp_path / "local")
    with TaskStorage.open(dropped, "task-0", blob_store=blobs) as task:
        assert set(task.stores) == {"counts"}
        assert contents(task) == model
        fill(task, model, 2000, 10, "b")
        checkpoint = task.commit_durably({"input": "1"})
        assert set(checkpoint.markers_for("blobsnapshot")) == {"counts"}
    shutil.rmtree(tmp_path / "local")
    with TaskStorage.open(dropped, "task-0", blob_store=blobs) as task:
        assert contents(task) == model


# -- damage: detected, named, never loaded ----------------------------------------------------------------------------


def _committed_twice(tmp_path: Path, blobs: MemoryBlobStore) -> tuple[dict[str, object], dict[bytes, bytes], str]:
    config = make_config(tmp_path)
    model: dict[bytes, bytes] = {}
    with TaskStorage.open(config, "task-0", blob_store=blobs) as task:
        fill(task, model, 0, 3000, "a")
        task.commit_durably({"input": "0"})
        older = dict(model)
        fill(task, model, 0, 3000, "b")
        checkpoint = task.commit_durably({"input": "1"})
    # local state at the older checkpoint: a restore must leave it exactly so when it fails
    with TaskStorage.open(config, "task-0", blob_store=blobs, checkpoint=lambda e: e.seq == 1) as task:
        assert contents(task) == older
    return config, older, checkpoint.markers_for("blobsnapshot")["counts"]


def test_corrupt_chunk_is_named_never_loaded_and_previous_local_state_stays(tmp_path: Path) -> None:
    blobs = MemoryBlobStore()
    config, older, marker = _committed_twice(tmp_path, blobs)
    index = SnapshotIndex.decode(blobs.get(marker), name=marker)
    victim = chunk_name(PREFIX, next(iter(sorted(set(index.chunks_added)))))
    data = bytearray(blobs.get(victim))
    data[len(data) // 2] ^= 0x01
    blobs.put(victim, bytes(data))
    with pytest.raises(CorruptDataError) as excinfo:
        TaskStorage.open(config, "task-0", blob_store=blobs)
    assert victim in str(excinfo.value)
    with TaskStorage.open(config, "task-0", blob_store=blobs, checkpoint=lambda e: e.seq == 1) as task:
        assert contents(task) == older
        assert task.metrics.counter("restore.stores.reused") == 1


def test_missing_chunk_is_named_and_nothing_is_swapped_in(tmp_path: Path) -> None:
    blobs = MemoryBlobStore()
    config, older, marker = _committed_twice(tmp_path, blobs)
    index = SnapshotIndex.decode(blobs.get(marker), name=marker)
    victim = chunk_name(PREFIX, max(index.chunks_added))
    blobs.delete(victim)
    with pytest.raises(NotFoundError) as excinfo:
        TaskStorage.open(config, "task-0", blob_store=blobs)
    assert victim in str(excinfo.value)
    with TaskStorage.open(config, "task-0", blob_store=blobs, checkpoint=lambda e: e.seq == 1) as task:
        assert contents(task) == older
        assert task.metrics.counter("restore.stores.reused") == 1


def test_missing_index_is_named(tmp_path: Path) -> None:
    blobs = MemoryBlobStore()
    config, _, marker = _committed_twice(tmp_path, blobs)
    blobs.delete(marker)
    with pytest.raises(NotFoundError) as excinfo:
        TaskStorage.open(config, "task-0", blob_store=blobs)
    assert marker in str(excinfo.value)


def test_corrupt_or_truncated_index_is_named(tmp_path: Path) -> None:
    blobs = MemoryBlobStore()
    config, _, marker = _committed_twice(tmp_path, blobs)
    original = blobs.get(marker)
    document = json.loads(original)
    document["files"][0]["chunks"][0]["size"] += 1  # still valid JSON; the checksum no longer matches
    blobs.put(marker, json.dumps(document).encode())
    with pytest.raises(CorruptDataError, match="checksum") as excinfo:
        TaskStorage.open(config, "task-0", blob_store=blobs)
    assert marker in str(excinfo.value)
    blobs.put(marker, original[: len(original) // 2])
    with pytest.raises(CorruptDataError) as excinfo:
        TaskStorage.open(config, "task-0", blob_store=blobs)
    assert marker in str(excinfo.value)


def test_index_of_a_future_schema_version_is_rejected_as_incompatible() -> None:
    document = json.loads(_sample_index().encode())
    document["schema_version"] = SCHEMA_VERSION + 1
    with pytest.raises(IncompatibleFormatError, match="schema_version"):
        SnapshotIndex.decode(json.dumps(document).encode(), name="x/index/000000000001-t.json")


def test_index_round_trips_through_its_encoding() -> None:
    index = _sample_index()
    assert SnapshotIndex.decode(index.encode(), name="i") == index


def test_stored_v1_index_sample_still_reads() -> None:
    """A sample written by schema version 1 (tests/data/blobsnapshot/index-v1.json) stays readable."""
    path = Path(__file__).parent / "data" / "blobsnapshot" / "index-v1.json"
    index = SnapshotIndex.decode(path.read_bytes(), name=str(path))
    assert index == _sample_index()


def _sample_index() -> SnapshotIndex:
    from statebackend.backends.blobsnapshot.format import ChunkRef, FileEntry, chunk_hash

    from statebackend.store import LocalVersion

    chunks = (ChunkRef(chunk_hash(b"one"), 3), ChunkRef(chunk_hash(b"two!"), 4))
    return SnapshotIndex.build(
        job="job", task="task-0", store="counts", version=LocalVersion("1700000000000-123456", "00112233aabbccdd"),
        seq=7, chunk_size=65536, files=[FileEntry("data.mdb", 7, chunk_hash(b"onetwo!"), chunks)],
        previous=None, previous_name=None,
    )


# -- failures during commit ------------------------------------------------------------------------------------------


def test_failed_chunk_upload_fails_the_commit_and_the_next_one_recovers(tmp_path: Path) -> None:
    blobs = ControlledBlobStore(MemoryBlobStore())
    config = make_config(tmp_path)
    model: dict[bytes, bytes] = {}
    with TaskStorage.open(config, "task-0", blob_store=blobs) as task:
        fill(task, model, 0, 2000, "a")
        task.commit_durably({"input": "0"})
        blobs.fail, blobs.failures_left = (lambda name: "/chunks/" in name), 1
        fill(task, model, 0, 2000, "b")
        failed = task.commit({"input": "1"})
        assert failed is not None
        with pytest.raises(CommitError):
            failed.result(timeout=30)
        again = task.commit({"input": "1b"})  # the failure was reported through result(): not raised again
        assert again is not None
        again.result(timeout=30)
        fill(task, model, 50, 10, "c")
        checkpoint = task.commit_durably({"input": "2"})
        assert checkpoint.input_offsets == {"input": "2"}
    shutil.rmtree(tmp_path / "local")
    with TaskStorage.open(config, "task-0", blob_store=blobs) as task:
        assert contents(task) == model


def test_processing_goes_on_while_a_snapshot_uploads(tmp_path: Path) -> None:
    blobs = ControlledBlobStore(MemoryBlobStore())
    config = make_config(tmp_path, **{"task.commit.max.delay.ms": 3_600_000})
    model: dict[bytes, bytes] = {}
    with TaskStorage.open(config, "task-0", blob_store=blobs) as task:
        blobs.hold = lambda name: "/index/" in name
        fill(task, model, 0, 2000, "a")
        snapshot_state = dict(model)
        first = task.commit({"input": "0"})
        assert first is not None and blobs.held.wait(30)
        # the upload is stuck on its index write; the task keeps writing and even flushing
        fill(task, model, 0, 2000, "b")
        assert task.commit({"input": "1"}) is None
        blobs.release.set()
        first.result(timeout=30)
    shutil.rmtree(tmp_path / "local")
    with TaskStorage.open(config, "task-0", blob_store=blobs, checkpoint=lambda e: e.seq == 1) as task:
        assert contents(task) == snapshot_state


def test_interrupted_restore_leaves_previous_state(tmp_path: Path) -> None:
    blobs = MemoryBlobStore()
    config, older, _ = _committed_twice(tmp_path, blobs)
    with TaskStorage.open(config, "task-0", blob_store=blobs, checkpoint=lambda e: e.seq == 1) as task:
        from statebackend.contracts import BackendContext

        context = BackendContext(
            factory_name="blobsnapshot", job_name="job", task_name="task-0", stores=task.stores, blob_store=blobs,
            checkpoint_log=task.checkpoint_log, executor=task.commit_manager.executor, metrics=task.metrics,
        )
        manager = BlobSnapshotRestoreManager(context=context)
        manager.init(task.checkpoint_log.read(2).checkpoint)  # type: ignore[arg-type]
        manager.interrupt()
        with pytest.raises(InterruptedError):
            manager.restore()
        assert contents(task) == older


# -- garbage ---------------------------------------------------------------------------------------------------------


def _live_chunks(blobs: MemoryBlobStore, task: TaskStorage) -> set[str]:
    live: set[str] = set()
    for entry in task.checkpoint_log.entries():
        marker = entry.checkpoint.markers_for("blobsnapshot")["counts"]  # type: ignore[union-attr]
        live |= {chunk_name(PREFIX, h) for h in SnapshotIndex.decode(blobs.get(marker), name=marker).chunk_hashes()}
    return live


def test_cleanup_keeps_exactly_what_the_retained_checkpoints_need(tmp_path: Path) -> None:
    blobs = MemoryBlobStore()
    config = make_config(tmp_path)
    model: dict[bytes, bytes] = {}
    with TaskStorage.open(config, "task-0", blob_store=blobs) as task:
        for round_no in range(6):
            fill(task, model, round_no * 3000, 3000, f"r{round_no}")
            fill(task, model, 0, 200, f"u{round_no}")
            task.commit_durably({"input": str(round_no)})
            task.commit_manager.wait()
        _drain(task)
        entries = task.checkpoint_log.entries()
        assert len(entries) == 2
        assert chunk_blobs(blobs) == _live_chunks(blobs, task)
        assert set(index_blobs(blobs)) == {
            e.checkpoint.markers_for("blobsnapshot")["counts"] for e in entries  # type: ignore[union-attr]
        }
        # cleanup again is a no-op (idempotent, absent blobs are success)
        manager = backup_manager(task)
        last = entries[-1].checkpoint
        manager.cleanup(last.checkpoint_id, dict(last.markers_for("blobsnapshot"))).result(timeout=30)
        assert chunk_blobs(blobs) == _live_chunks(blobs, task)
    # both retained checkpoints restore
    for seq in (entries[0].seq, entries[1].seq):
        shutil.rmtree(tmp_path / "local")
        with TaskStorage.open(config, "task-0", blob_store=blobs, checkpoint=lambda e, s=seq: e.seq == s) as task:
            assert task.metrics.counter("restore.stores.full") == 1
    assert contents_after_restore(config, blobs) == model


def contents_after_restore(config: dict[str, object], blobs: MemoryBlobStore) -> dict[bytes, bytes]:
    with TaskStorage.open(config, "task-0", blob_store=blobs) as task:
        return contents(task)


def test_durable_checkpoint_removes_the_expiry_of_its_blobs(tmp_path: Path) -> None:
    blobs = MemoryBlobStore()
    config = make_config(tmp_path)
    with TaskStorage.open(config, "task-0", blob_store=blobs) as task:
        fill(task, {}, 0, 2000, "a")
        checkpoint = task.commit_durably({"input": "0"})
        _drain(task)
    marker = checkpoint.markers_for("blobsnapshot")["counts"]
    for name in [marker, *chunk_blobs(blobs)]:
        metadata = blobs.head(name).metadata
        assert "expires_at" not in metadata and "durable_at" in metadata, name


def test_sweep_deletes_blobs_of_an_abandoned_upload_after_the_grace_period(tmp_path: Path) -> None:
    blobs = ControlledBlobStore(MemoryBlobStore())
    config = make_config(tmp_path)
    model: dict[bytes, bytes] = {}
    with TaskStorage.open(config, "task-0", blob_store=blobs) as task:
        fill(task, model, 0, 3000, "a")
        task.commit_durably({"input": "0"})
        durable = dict(model)
        # a commit whose chunks land but whose index never does: its chunks are garbage
        blobs.fail, blobs.failures_left = (lambda name: "/index/" in name), 1
        fill(task, {}, 0, 3000, "lost")
        failed = task.commit({"input": "1"})
        assert failed is not None
        with pytest.raises(CommitError):
            failed.result(timeout=30)
        orphans = chunk_blobs(blobs.inner) - _live_chunks(blobs.inner, task)
        assert orphans
        for name in orphans:
            assert "expires_at" in blobs.head(name).metadata
        manager = backup_manager(task)
        assert manager.sweep().chunks_deleted == 0  # within the grace period: could be an upload in progress
        assert chunk_blobs(blobs.inner) >= orphans
        report = manager.sweep(now=manager.clock() + 2 * 3600)
        assert report.chunks_deleted == len(orphans)
        assert chunk_blobs(blobs.inner) == _live_chunks(blobs.inner, task)
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
        before = chunk_blobs(blobs)
        report = backup_manager(task).sweep(now=10**12)
        assert report.chunks_deleted == 0 and report.indexes_deleted == 0
        assert chunk_blobs(blobs) == before
    for seq in (1, 2, 3):
        shutil.rmtree(tmp_path / "local")
        with TaskStorage.open(config, "task-0", blob_store=blobs, checkpoint=lambda e, s=seq: e.seq == s):
            pass


def test_sweep_runs_at_init_and_on_a_store_without_metadata_uses_first_seen(tmp_path: Path) -> None:
    inner = MemoryBlobStore()
    inner.supports_metadata = False
    config = make_config(tmp_path, **{"blobsnapshot.gc.on.init": "true"})
    with TaskStorage.open(config, "task-0", blob_store=inner) as task:
        fill(task, {}, 0, 1000, "a")
        task.commit_durably({"input": "0"})
        _drain(task)
        inner.put(PREFIX + "chunks/" + "0" * 64, b"orphan")
        manager = backup_manager(task)
        assert manager.sweep().chunks_deleted == 0  # first seen now
        assert manager.sweep(now=manager.clock() + 2 * 3600).chunks_deleted == 1
        assert task.metrics.counter("blobsnapshot.sweeps") >= 3  # the one at init too


def _drain(task: TaskStorage) -> None:
    """Make the last commit's cleanup and the log's retention done now. Both are idempotent, so running them again
    while the commit manager's own queued ones run too is safe (which is itself part of the contract under test)."""
    last = task.commit_manager.last_checkpoint
    assert last is not None
    backup_manager(task).cleanup(last.checkpoint_id, dict(last.markers_for("blobsnapshot"))).result(timeout=30)
    task.checkpoint_log.retain()


def test_sweep_counts_the_age_of_a_blob_without_metadata_from_first_seen(tmp_path: Path) -> None:
    """A head() whose metadata headers were cut shows no metadata: that is no proof of age (before, such a young
    unreferenced blob, e.g. another attempt's upload in progress, was deleted at once)."""
    blobs = MemoryBlobStore()
    config = make_config(tmp_path)
    with TaskStorage.open(config, "task-0", blob_store=blobs) as task:
        fill(task, {}, 0, 500, "a")
        task.commit_durably({"input": "0"})
        stray = next(iter(chunk_blobs(blobs))).rsplit("/", 1)[0] + "/" + "0" * 64
        blobs.put(stray, b"an upload in progress elsewhere")  # no metadata at all
        manager = backup_manager(task)
        assert manager.sweep().chunks_deleted == 0
        assert stray in chunk_blobs(blobs)
        assert manager.sweep(now=manager.clock() + 2 * 3600).chunks_deleted == 1
        assert stray not in chunk_blobs(blobs)
