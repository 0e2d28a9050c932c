"""The content-addressed example backend (examples/dedup_backend, entry point ``dedup``) against the backend
contract suite: alone and in a dual commit with changelog, on the in-memory store, on ``file://`` and on the S3
server; and the sharing of its chunks across commits under the framework's blob lifetime."""

from __future__ import annotations

import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import ClassVar

import pytest
from sb_dedup.backup import referenced_blobs
from sb_dedup.suite import DedupSuite

from statebackend.blobstores.base import BlobStore, open_blob_store
from statebackend.blobstores.file import FileBlobStore
from statebackend.blobstores.memory import MemoryBlobStore
from statebackend.task import TaskStorage
from statebackend.testing.backend_support import contents
from tests.servers import ServerProcess


class TestDedupBackend(DedupSuite):
    pass


class TestDedupBackendDualWithChangelog(DedupSuite):
    dual_with: ClassVar[str | None] = "changelog"


class TestDedupBackendOnFiles(DedupSuite):
    @pytest.fixture
    def blobs(self, tmp_path: Path) -> Iterator[BlobStore]:
        with FileBlobStore(tmp_path / "blobs") as store:
            yield store


@pytest.mark.s3
@pytest.mark.slow
class TestDedupBackendOnS3Server(DedupSuite):
    @pytest.fixture
    def blobs(self, s3_server: ServerProcess) -> Iterator[BlobStore]:
        store = open_blob_store(
            f"s3://t-{uuid.uuid4().hex[:20]}/state", {"endpoint.url": s3_server.endpoint, "create.if.missing": True}
        )
        store.create_resources()  # type: ignore[attr-defined]
        with store:
            yield store


def _chunks(blobs: BlobStore, task: TaskStorage) -> set[str]:
    """The chunk blobs the newest checkpoint's manifest names."""
    entry = task.checkpoint_log.latest()
    assert entry is not None
    marker = entry.checkpoint.markers_for("dedup")["counts"]  # type: ignore[union-attr]
    context = _Context(blobs)
    return {name for name in referenced_blobs(context, "counts", marker) if "/chunks/" in name}  # type: ignore[arg-type]


class _Context:
    """What ``referenced_blobs`` reads of a backend context: the blob store, the names and the prefix."""

    job_name = "job"
    task_name = "task-0"

    def __init__(self, blob_store: BlobStore) -> None:
        self.blob_store = blob_store

    def blob_prefix(self, store: str) -> str:
        return f"job/task-0/{store}/dedup/"


def test_a_chunk_two_checkpoints_name_outlives_the_first_and_goes_after_the_second(tmp_path: Path) -> None:
    """Chunks are shared across commits: a chunk the first commit wrote and the second names again (its key range
    untouched) is written once; it survives the retirement of the first checkpoint (the second still names it) and
    is deleted by the framework's collector once the second retires too, while the chunks of the retained
    checkpoints all stay and restore exactly."""
    blobs = MemoryBlobStore()
    config: dict[str, object] = {
        "job.name": "job",
        "state.local.dir": str(tmp_path / "local"),
        "blob.store.url": f"memory://{uuid.uuid4().hex}",
        "stores.counts.backup.factories": "dedup",
        "dedup.chunk.records": 4,
        "task.checkpoint.retained": 1,
    }
    model: dict[bytes, bytes] = {}
    with TaskStorage.open(config, "task-0", blob_store=blobs) as task:
        store = task.store("counts", typed=False)
        for i in range(40):
            store.put(f"a{i:03d}".encode(), b"first")
            model[f"a{i:03d}".encode()] = b"first"
        task.commit_durably({"input": "1"})
        first = _chunks(blobs, task)
        store.put(b"z", b"late")  # only the last chunk's key range changes
        model[b"z"] = b"late"
        task.commit_durably({"input": "2"})
        second = _chunks(blobs, task)
        shared = first & second
        assert len(shared) >= len(first) - 1, "the chunks the second commit did not touch were not shared"
        assert set(blobs.list("job/task-0/counts/dedup/chunks/")) >= second
        # checkpoint 1 retired: its only own chunk may go, the shared ones stay
        task.wait_for_commit()
        assert shared <= set(blobs.list("job/task-0/counts/dedup/chunks/")), "a shared chunk went with the first"
        for i in range(40):  # every chunk's key range changes: the shared chunks are named by checkpoint 2 only
            store.put(f"a{i:03d}".encode(), b"second")
            model[f"a{i:03d}".encode()] = b"second"
        task.commit_durably({"input": "3"})
        third = _chunks(blobs, task)
        assert not shared & third
        task.commit_durably({"input": "4"})  # checkpoint 2 retires: what only it named goes at the log's trim
        task.wait_for_commit()
    left = set(blobs.list("job/task-0/counts/dedup/chunks/"))
    assert not shared & left, f"chunks no retained checkpoint names are still there: {sorted(shared & left)}"
    assert third <= left
    (tmp_path / "wiped").mkdir()
    fresh = dict(config, **{"state.local.dir": str(tmp_path / "wiped")})
    with TaskStorage.open(fresh, "task-0", blob_store=blobs) as task:
        assert contents(task) == model
