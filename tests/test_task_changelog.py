"""End to end through TaskStorage, the commit protocol and the changelog-delta backend on real LMDB and an
in-memory blob store (the fake that passes the blob store contract suite)."""

from __future__ import annotations

import shutil
import uuid
from pathlib import Path

import pytest

from statebackend.blobstores.memory import MemoryBlobStore
from statebackend.errors import CommitError, CommitTimeoutError, ConfigError, CorruptDataError
from statebackend.task import TaskStorage
from tests.blobstore_faults import ControlledBlobStore


def make_config(tmp_path: Path, **extra: object) -> dict[str, object]:
    config: dict[str, object] = {
        "job.name": "job",
        "state.local.dir": str(tmp_path / "local"),
        "blob.store.url": f"memory://{uuid.uuid4().hex}",
        "stores.counts.backup.factories": "changelog",
        "changelog.snapshot.interval.commits": 3,
        "task.checkpoint.retained": 2,
    }
    config.update(extra)
    return config


def contents(task: TaskStorage, name: str = "counts") -> dict[bytes, bytes]:
    return dict(task.store(name).items())


def write_round(task: TaskStorage, round_no: int, model: dict[bytes, bytes], keys: int = 50) -> None:
    store = task.store("counts")
    for i in range(keys):
        key = f"k{(i * 7 + round_no * 13) % 200:04d}".encode()
        if (i + round_no) % 9 == 0:
            store.delete(key)
            model.pop(key, None)
        else:
            value = f"v{round_no}-{i}".encode()
            store.put(key, value)
            model[key] = value


def test_restart_reuses_local_state_without_download(tmp_path: Path) -> None:
    blobs = MemoryBlobStore()
    config = make_config(tmp_path)
    model: dict[bytes, bytes] = {}
    with TaskStorage.open(config, "task-0", blob_store=blobs) as task:
        for round_no in range(5):
            write_round(task, round_no, model)
            task.commit_durably({"input": str(round_no)})
    with TaskStorage.open(config, "task-0", blob_store=blobs) as task:
        assert contents(task) == model
        assert task.metrics.counter("restore.stores.reused") == 1
        assert task.metrics.counter("restore.stores.full") == 0
        assert task.restored is not None and task.restored.input_offsets == {"input": "4"}


def test_wiped_local_dir_restores_exactly_from_snapshot_and_deltas(tmp_path: Path) -> None:
    blobs = MemoryBlobStore()
    config = make_config(tmp_path)
    model: dict[bytes, bytes] = {}
    with TaskStorage.open(config, "task-0", blob_store=blobs) as task:
        for round_no in range(10):
            write_round(task, round_no, model)
            task.commit_durably({"input": str(round_no)})
        task.commit_manager.wait()
        assert task.metrics.counter("changelog.snapshot.adopted") >= 1
    shutil.rmtree(tmp_path / "local")
    with TaskStorage.open(config, "task-0", blob_store=blobs) as task:
        assert contents(task) == model
        assert task.metrics.counter("restore.stores.full") == 1


def test_older_local_copy_catches_up_by_applying_only_missing_deltas(tmp_path: Path) -> None:
    blobs = MemoryBlobStore()
    config = make_config(tmp_path, **{"changelog.snapshot.interval.commits": 100})
    model: dict[bytes, bytes] = {}
    with TaskStorage.open(config, "task-0", blob_store=blobs) as task:
        for round_no in range(3):
            write_round(task, round_no, model)
            task.commit_durably({"input": str(round_no)})
    shutil.copytree(tmp_path / "local", tmp_path / "older")
    with TaskStorage.open(config, "task-0", blob_store=blobs) as task:
        for round_no in range(3, 7):
            write_round(task, round_no, model)
            task.commit_durably({"input": str(round_no)})
    shutil.rmtree(tmp_path / "local")
    shutil.move(tmp_path / "older", tmp_path / "local")
    with TaskStorage.open(config, "task-0", blob_store=blobs) as task:
        assert contents(task) == model
        assert task.metrics.counter("restore.stores.caught.up") == 1
        assert task.metrics.counter("restore.deltas.replayed") == 4


def test_uncommitted_local_changes_are_discarded_on_restore(tmp_path: Path) -> None:
    blobs = MemoryBlobStore()
    config = make_config(tmp_path)
    model: dict[bytes, bytes] = {}
    task = TaskStorage.open(config, "task-0", blob_store=blobs)
    write_round(task, 0, model)
    task.commit_durably({"input": "0"})
    durable = dict(model)
    write_round(task, 1, model)
    # flushed to LMDB by a commit whose upload never lands: local data is ahead of every durable checkpoint
    controlled = ControlledBlobStore(blobs)
    task.commit_manager.checkpoint_log.blob_store = controlled
    controlled.fail, controlled.failures_left = (lambda name: "checkpoints" in name), 10
    pending = task.commit({"input": "1"})
    assert pending is not None
    with pytest.raises(CommitError):
        pending.result(timeout=30)
    task.close()
    with TaskStorage.open(config, "task-0", blob_store=blobs) as again:
        assert contents(again) == durable
        assert again.metrics.counter("restore.stores.reused") == 0


def test_failed_upload_surfaces_at_next_commit_and_does_not_poison_later_ones(tmp_path: Path) -> None:
    blobs = ControlledBlobStore(MemoryBlobStore())
    config = make_config(tmp_path)
    model: dict[bytes, bytes] = {}
    with TaskStorage.open(config, "task-0", blob_store=blobs) as task:
        write_round(task, 0, model)
        task.commit_durably({"input": "0"})
        blobs.fail, blobs.failures_left = (lambda name: name.endswith(".delta")), 1
        write_round(task, 1, model)
        failed = task.commit({"input": "1"})
        assert failed is not None
        with pytest.raises(CommitError):
            failed.result(timeout=30)
        with pytest.raises(CommitError, match="previous commit failed|injected"):
            task.commit({"input": "1b"})
        write_round(task, 2, model)
        checkpoint = task.commit_durably({"input": "2"})
        assert checkpoint.input_offsets == {"input": "2"}
        assert task.metrics.counter("changelog.delta.reuploads") == 1
        assert task.metrics.counter("commit.failures") == 1
    shutil.rmtree(tmp_path / "local")
    with TaskStorage.open(config, "task-0", blob_store=blobs) as task:
        assert contents(task) == model


def test_commit_is_skipped_while_upload_runs_within_max_delay(tmp_path: Path) -> None:
    blobs = ControlledBlobStore(MemoryBlobStore())
    config = make_config(tmp_path, **{"task.commit.max.delay.ms": 3_600_000})
    model: dict[bytes, bytes] = {}
    with TaskStorage.open(config, "task-0", blob_store=blobs) as task:
        blobs.hold = lambda name: name.endswith(".delta")
        write_round(task, 0, model)
        first = task.commit({"input": "0"})
        assert first is not None
        assert blobs.held.wait(30)
        write_round(task, 1, model)
        assert task.commit({"input": "1"}) is None
        assert task.metrics.counter("commit.skips") == 1
        blobs.release.set()
        assert first.result(timeout=30).input_offsets == {"input": "0"}
        # the skipped commit's changes ride with the next one
        task.commit_durably({"input": "2"})
    shutil.rmtree(tmp_path / "local")
    with TaskStorage.open(config, "task-0", blob_store=blobs) as task:
        assert contents(task) == model


def test_commit_blocks_past_max_delay_then_times_out(tmp_path: Path) -> None:
    blobs = ControlledBlobStore(MemoryBlobStore())
    config = make_config(tmp_path, **{"task.commit.max.delay.ms": 0, "task.commit.timeout.ms": 50})
    model: dict[bytes, bytes] = {}
    with TaskStorage.open(config, "task-0", blob_store=blobs) as task:
        blobs.hold = lambda name: name.endswith(".delta")
        write_round(task, 0, model)
        first = task.commit({"input": "0"})
        assert first is not None and blobs.held.wait(30)
        with pytest.raises(CommitTimeoutError, match="task.commit.timeout.ms"):
            task.commit({"input": "1"})
        assert task.metrics.counter("commit.blocks") == 1
        assert task.metrics.counter("commit.timeouts") == 1
        blobs.release.set()
        first.result(timeout=30)


def test_blocked_commit_proceeds_when_the_upload_ends(tmp_path: Path) -> None:
    blobs = ControlledBlobStore(MemoryBlobStore())
    config = make_config(tmp_path, **{"task.commit.max.delay.ms": 0, "task.commit.timeout.ms": 60_000})
    model: dict[bytes, bytes] = {}
    with TaskStorage.open(config, "task-0", blob_store=blobs) as task:
        calls = {"n": 0}

        def hold_first_delta(name: str) -> bool:
            if name.endswith(".delta"):
                calls["n"] += 1
                return calls["n"] == 1
            return False

        blobs.hold = hold_first_delta
        write_round(task, 0, model)
        first = task.commit({"input": "0"})
        assert first is not None and blobs.held.wait(30)
        # the manager's clock says the upload is past max delay; release it only once the commit is blocking
        import threading

        def release_when_blocked() -> None:
            while task.metrics.counter("commit.blocks") == 0:
                threading.Event().wait(0.005)
            blobs.release.set()

        releaser = threading.Thread(target=release_when_blocked)
        releaser.start()
        write_round(task, 1, model)
        second = task.commit({"input": "1"})
        releaser.join()
        assert second is not None
        assert second.result(timeout=30).input_offsets == {"input": "1"}
        assert task.metrics.counter("commit.blocks") == 1
        assert task.metrics.counter("commit.skips") == 0


def test_flipped_byte_in_a_delta_is_detected_and_never_applied(tmp_path: Path) -> None:
    blobs = MemoryBlobStore()
    config = make_config(tmp_path, **{"changelog.snapshot.interval.commits": 100})
    model: dict[bytes, bytes] = {}
    with TaskStorage.open(config, "task-0", blob_store=blobs) as task:
        for round_no in range(3):
            write_round(task, round_no, model)
            task.commit_durably({"input": str(round_no)})
    deltas = [name for name in blobs.list("job/task-0/counts/changelog/delta/")]
    victim = deltas[1]
    data = bytearray(blobs.get(victim))
    data[len(data) // 2] ^= 0x01
    blobs.put(victim, bytes(data))
    shutil.rmtree(tmp_path / "local")
    with pytest.raises(CorruptDataError) as excinfo:
        TaskStorage.open(config, "task-0", blob_store=blobs)
    assert victim in str(excinfo.value)
    blobs.put(victim, bytes(data[: len(data) // 3]))
    with pytest.raises(CorruptDataError) as excinfo:
        TaskStorage.open(config, "task-0", blob_store=blobs)
    assert victim in str(excinfo.value)


def test_second_attempt_committing_the_same_checkpoint_is_detected(tmp_path: Path) -> None:
    blobs = MemoryBlobStore()
    config_a = make_config(tmp_path / "a")
    config_b = dict(config_a, **{"state.local.dir": str(tmp_path / "b" / "local")})
    model: dict[bytes, bytes] = {}
    with TaskStorage.open(config_a, "task-0", blob_store=blobs) as task:
        write_round(task, 0, model)
        task.commit_durably({"input": "0"})
    attempt_a = TaskStorage.open(config_a, "task-0", blob_store=blobs)
    attempt_b = TaskStorage.open(config_b, "task-0", blob_store=blobs)
    try:
        write_round(attempt_a, 1, {})
        write_round(attempt_b, 2, {})
        attempt_a.commit_durably({"input": "1"})
        with pytest.raises(CommitError, match="another attempt"):
            attempt_b.commit_durably({"input": "1"})
    finally:
        attempt_a.close()
        attempt_b.close()


def test_unknown_backend_name_lists_known_ones(tmp_path: Path) -> None:
    config = make_config(tmp_path, **{"stores.counts.backup.factories": "changelgo"})
    with pytest.raises(ConfigError, match="changelog"):
        TaskStorage.open(config, "task-0")


def test_missing_blob_store_url_says_what_to_set(tmp_path: Path) -> None:
    config = make_config(tmp_path)
    del config["blob.store.url"]
    with pytest.raises(ConfigError, match="blob.store.url"):
        TaskStorage.open(config, "task-0")
