"""The framework owns blob lifetime (statebackend.kit.lifetime): a backend states what its markers reference and what
its work holds, and the framework releases what retention let go, sweeps what no retained checkpoint names once it
is older than the grace period, and tells the backend when a checkpoint completed or was aborted. Shown on the
reference backend, which writes no cleanup of its own."""

from __future__ import annotations

import json
import shutil
import time
from pathlib import Path
from typing import Any

import pytest
from statebackend.checkpoint import CheckpointId, CheckpointV2

from statebackend.blobstores.memory import MemoryBlobStore
from statebackend.contracts import StoreMarkers
from statebackend.errors import CorruptDataError, StorageError
from statebackend.kit import CREATED_AT, collector_of
from statebackend.task import TaskStorage
from statebackend.testing.backend_support import contents, write_round
from statebackend.testing.reference import REFERENCE_BACKEND, ReferenceBackendFactory, ReferenceBackupManager
from tests.backend_helpers import make_config

NOTICES: list[tuple[str, str, StoreMarkers]] = []


class _Recording(ReferenceBackupManager):
    def checkpoint_completed(self, checkpoint_id: CheckpointId, markers: StoreMarkers) -> None:
        NOTICES.append(("completed", str(checkpoint_id), dict(markers)))

    def checkpoint_aborted(self, checkpoint_id: CheckpointId, markers: StoreMarkers) -> None:
        NOTICES.append(("aborted", str(checkpoint_id), dict(markers)))


class RecordingFactory(ReferenceBackendFactory):
    backup_class = _Recording


def config(tmp_path: Path, backend: str = REFERENCE_BACKEND, **extra: Any) -> dict[str, Any]:
    return make_config(backend, tmp_path, extra)


def prefix_of(task: TaskStorage) -> str:
    return manager_of(task).context.blob_prefix("counts")


def named_by_log(task: TaskStorage) -> set[str]:
    named: set[str] = set()
    for entry in task.checkpoint_log.entries():
        assert isinstance(entry.checkpoint, CheckpointV2)
        marker = entry.checkpoint.markers_for(manager_of(task).context.factory_name)["counts"]
        named.update(json.loads(marker))
    return named


def manager_of(task: TaskStorage) -> ReferenceBackupManager:
    manager = task.commit_manager.backups[0].manager
    assert isinstance(manager, ReferenceBackupManager)
    return manager


def test_retention_releases_every_blob_only_dropped_checkpoints_named(tmp_path: Path) -> None:
    blobs = MemoryBlobStore()
    model: dict[bytes, bytes] = {}
    with TaskStorage.open(config(tmp_path), "task-0", blob_store=blobs) as task:
        task.checkpoint_log.retention_interval = 2
        for round_no in range(12):  # past CHAIN_STEPS: a second chain starts at a full copy
            write_round(task, round_no, model)
            task.commit_durably({"input": str(round_no)})
        written = 12
    with TaskStorage.open(config(tmp_path), "task-0", blob_store=blobs) as task:
        left = set(blobs.list(prefix_of(task)))
        # the reference backend deletes nothing itself: every blob gone was released by the framework
        assert len(left) < written
        assert left == named_by_log(task)
        assert contents(task) == model


def test_a_sweep_deletes_old_unnamed_blobs_and_keeps_young_named_and_held_ones(tmp_path: Path) -> None:
    blobs = MemoryBlobStore()
    model: dict[bytes, bytes] = {}
    with TaskStorage.open(config(tmp_path), "task-0", blob_store=blobs) as task:
        for round_no in range(3):
            write_round(task, round_no, model)
            task.commit_durably({"input": str(round_no)})
        task.commit_manager.wait()
        prefix = prefix_of(task)
        old, young = prefix + "000000000000001-000001-aa.delta", prefix + "000000000000002-000001-bb.delta"
        blobs.put(old, b"x", metadata={CREATED_AT: f"{time.time() - 7200:.3f}"})
        blobs.put(young, b"y", metadata={CREATED_AT: f"{time.time():.3f}"})
        lifetime = manager_of(task).blob_lifetime()
        assert lifetime is not None
        held = set(lifetime.held_blobs("counts"))
        assert held, "the chain the next commit extends is held"
        result = collector_of(lifetime).sweep()["counts"]
        assert result.deleted == (old,)
        assert young in set(blobs.list(prefix))
        assert named_by_log(task) | held <= set(blobs.list(prefix))
    shutil.rmtree(tmp_path / "local")
    with TaskStorage.open(config(tmp_path), "task-0", blob_store=blobs) as task:
        assert contents(task) == model


def test_a_sweep_with_an_unreadable_marker_deletes_nothing(tmp_path: Path) -> None:
    blobs = MemoryBlobStore()
    model: dict[bytes, bytes] = {}
    with TaskStorage.open(config(tmp_path), "task-0", blob_store=blobs) as task:
        write_round(task, 0, model)
        task.commit_durably({"input": "0"})
        task.commit_manager.wait()
        old = prefix_of(task) + "000000000000001-000001-aa.delta"
        blobs.put(old, b"x", metadata={CREATED_AT: f"{time.time() - 7200:.3f}"})
        lifetime = manager_of(task).blob_lifetime()
        assert lifetime is not None

        def unreadable(store: str, marker: str) -> list[str]:
            raise CorruptDataError(f"marker of {store} does not decode")

        lifetime.referenced_blobs = unreadable  # type: ignore[method-assign]
        result = collector_of(lifetime).sweep()["counts"]
        assert not result.complete and result.deleted == ()
        assert old in set(blobs.list(prefix_of(task)))


@pytest.fixture
def recording(monkeypatch: pytest.MonkeyPatch) -> str:
    from statebackend import registry
    from statebackend.registry import register_factory

    monkeypatch.setattr(registry, "_REGISTRY", dict(registry._REGISTRY))
    register_factory("recording", f"{__name__}:RecordingFactory")
    NOTICES.clear()
    return "recording"


def test_the_backend_hears_of_completed_and_aborted_checkpoints(tmp_path: Path, recording: str) -> None:
    blobs = MemoryBlobStore()
    model: dict[bytes, bytes] = {}
    failing = [False]
    original_put = blobs.put

    def put(name: str, data: bytes, **kwargs: Any) -> None:
        if failing[0] and "/checkpoints/" in name:
            raise StorageError(f"{name}: the checkpoint write fails (test)")
        original_put(name, data, **kwargs)

    original_put_if = blobs.put_if

    def put_if(name: str, data: bytes, **kwargs: Any) -> str:
        if failing[0] and "/checkpoints/" in name:
            raise StorageError(f"{name}: the checkpoint write fails (test)")
        return original_put_if(name, data, **kwargs)

    blobs.put = put  # type: ignore[method-assign]
    blobs.put_if = put_if  # type: ignore[method-assign]
    with TaskStorage.open(config(tmp_path, recording), "task-0", blob_store=blobs) as task:
        write_round(task, 0, model)
        done = task.commit_durably({"input": "0"})
        task.commit_manager.wait()
        failing[0] = True
        write_round(task, 1, model)
        with pytest.raises(Exception, match="the checkpoint write fails"):
            task.commit_durably({"input": "1"})
        failing[0] = False
    completed = [n for n in NOTICES if n[0] == "completed"]
    aborted = [n for n in NOTICES if n[0] == "aborted"]
    assert completed and completed[0][1] == str(done.checkpoint_id)
    assert completed[0][2]["counts"] == done.markers_for(recording)["counts"]
    assert len(aborted) == 1 and aborted[0][1] != str(done.checkpoint_id)
    assert json.loads(aborted[0][2]["counts"])  # the markers the upload returned
