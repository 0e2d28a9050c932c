"""A run an index names is on the blob store before the index is written, whatever answer the blob store gives.

Seen in the fault matrix (Azurite, 10% faults), when blob-snapshot still cut whole environments into chunks:
acknowledged checkpoints named chunks that were never written, and every restore failed with "chunk ... that index
... lists is missing". The history of such a chunk: one
``head()``, answered "present, 0 bytes", and no put. The answer was another request's: the fault proxy, after
passing a reply whole because a ``cut_body`` fault had no body to cut (a 200/201/202 with Content-Length 0, or a
HEAD), kept that reply buffered and the fault armed, so every later reply on the connection came after it and the
connection answered each request with an earlier one's reply (here a Set Blob Metadata's ``200 OK``, with an ETag and
Content-Length 0, taken as a HEAD's answer). The backend took any ``head()`` success as "present".

Two things are tested: the proxy gives each request its own reply after such a pass-through (real servers, scripted
fault), and the backend takes a content-addressed run as present only on an answer about that run (a HEAD showing
its exact length), so an index never names a run that is not there (scripted wrapper stores: a lying head, a lying
"already exists"). A run found missing later (at cleanup) makes the next commit upload a base run, so the next
checkpoint never depends on it.
"""

from __future__ import annotations

import uuid
from collections.abc import Mapping
from pathlib import Path

import pytest
from statebackend.backends.blobsnapshot.blobs import read_marker

from statebackend.blobstores.azure import AzureBlobStore
from statebackend.blobstores.base import BlobInfo, BlobStore
from statebackend.blobstores.memory import MemoryBlobStore
from statebackend.errors import AlreadyExistsError, NotFoundError
from statebackend.task import TaskStorage
from tests.backend_helpers import PassThroughBlobStore
from tests.faults import CUT_BODY, FaultProxy, fault_requests
from tests.servers import ServerProcess, azurite_connection_string

DATA = bytes((i * 37 + 11) & 0xFF for i in range(3000))
RUNS = "job/task-0/counts/blobsnapshot/runs/"


# -- the proxy: a reply passed on whole leaves the connection answering each request with its own reply -----------


def _open_inner(port: int, url: str) -> AzureBlobStore:
    """The store without retries, so a wrong answer is seen as it comes."""
    return AzureBlobStore.open_inner(
        url, {"create.if.missing": True, "connection.string": azurite_connection_string(port)}
    )


@pytest.mark.azure
def test_a_cut_body_fault_with_no_body_to_cut_does_not_shift_later_replies(azurite: ServerProcess) -> None:
    """Azure only: moto's server closes the connection after every reply, so no later request can meet an earlier
    reply there."""
    url = f"az://t{uuid.uuid4().hex[:16]}/p"
    raw = _open_inner(azurite.port, url)
    raw.create_resources()
    raw.put("a", DATA)
    # Set Blob Metadata's reply (200, Content-Length 0) gets cut_body: nothing to cut, the reply is passed on whole
    match = rb"^PUT [^ ]*comp=metadata"
    with FaultProxy(azurite.host, azurite.port, schedule=fault_requests(CUT_BODY, match=match)) as proxy:
        inner = _open_inner(proxy.port, url)
        try:
            inner.set_metadata("a", {"k": "v"})
            assert proxy.stats["cut_body_not_applicable"] == 1  # the fault fired, in the pass-through case
            # the next requests on that connection get their own replies, not the write's 200
            with pytest.raises(NotFoundError):
                inner.head("absent")
            assert inner.head("a").size == len(DATA)
            assert inner.get("a") == DATA
            assert proxy.stats["requests"] == 4
        finally:
            inner.close()
            raw.close()


# -- the backend: "present" only on an answer about the run ----------------------------------------------------------


class LyingStore(PassThroughBlobStore):
    """Wraps ``inner``; the first ``head()`` of a run answers "present, 0 bytes" (another request's reply), or the
    first create-only put of a run is refused as "already exists" without anything written, per ``lie``. A run is
    put create-only with no ``head()`` first, so for the head's lie to be told the put is refused too (the head
    then decides)."""

    def __init__(self, inner: BlobStore, lie: str) -> None:
        super().__init__(inner)
        self.lie = lie
        self.lied_about: str | None = None

    def _lie_now(self, kind: str, name: str) -> bool:
        if self.lie == kind and self.lied_about is None and name.startswith(RUNS):
            self.lied_about = name
            return True
        return False

    def put(
        self, name: str, data: bytes, *, create_only: bool = False, metadata: Mapping[str, str] | None = None
    ) -> None:
        refused = self.lie == "head" and self.lied_about is None and name.startswith(RUNS)
        if create_only and (self._lie_now("put", name) or refused):
            raise AlreadyExistsError(f"blob {name!r} already exists (a reply about something else)")
        self.inner.put(name, data, create_only=create_only, metadata=metadata)

    def head(self, name: str) -> BlobInfo:
        if self._lie_now("head", name):
            return BlobInfo(name=name, size=0, metadata={})
        return self.inner.head(name)

    def set_metadata(self, name: str, metadata: Mapping[str, str]) -> None:
        self.inner.set_metadata(name, metadata)


def _config(tmp_path: Path, local: str) -> dict[str, object]:
    return {
        "job.name": "job",
        "state.local.dir": str(tmp_path / local),
        "blob.store.url": "memory://unused",
        "stores.counts.backup.factories": "blobsnapshot",
        "stores.counts.restore.factory": "blobsnapshot",
        "blobsnapshot.gc.on.init": "false",
    }


@pytest.mark.parametrize("lie", ["head", "put"])
def test_a_run_an_acknowledged_index_names_is_on_the_blob_store(tmp_path: Path, lie: str) -> None:
    blobs = MemoryBlobStore()
    lying = LyingStore(blobs, lie)
    model = {f"k{i:06d}".encode(): f"value-{i}-".encode() * 4 for i in range(3000)}
    with TaskStorage.open(_config(tmp_path, "writer"), "task-0", blob_store=lying) as task:
        store = task.store("counts")
        for key, value in model.items():
            store.put(key, value)
        checkpoint = task.commit_durably({"input": "0"})
    assert lying.lied_about is not None  # the lie was told
    marker = checkpoint.markers_for("blobsnapshot")["counts"]
    assert blobs.exists(lying.lied_about)  # the run it was about was written all the same
    index = read_marker(blobs, marker, job="job", task="task-0", store="counts")
    assert lying.lied_about in index.blob_names(RUNS.removesuffix("runs/"))
    assert blobs.head(lying.lied_about).size == index.runs[0].size
    # a new machine restores the acknowledged checkpoint straight from the blob store
    with TaskStorage.open(_config(tmp_path, "reader"), "task-0", blob_store=blobs) as restored:
        assert restored.restored is not None
        assert restored.restored.markers_for("blobsnapshot")["counts"] == marker
        assert dict(restored.store("counts").items()) == model


class LosingStore(LyingStore):
    """After the first checkpoint is written, the run its index names vanishes: the damage an index written before the
    fix above could carry, or a blob lost on the blob store's side."""

    def __init__(self, inner: BlobStore) -> None:
        super().__init__(inner, lie="none")

    def put(
        self, name: str, data: bytes, *, create_only: bool = False, metadata: Mapping[str, str] | None = None
    ) -> None:
        super().put(name, data, create_only=create_only, metadata=metadata)
        if self.lied_about is None and "/checkpoints/" in name:  # the first checkpoint, its index inline
            self.lied_about = next(iter(self.inner.list(RUNS)))  # the one run it names
            self.inner.delete(self.lied_about)


def test_a_run_found_missing_by_a_sweep_makes_the_next_commit_upload_a_base_run(tmp_path: Path) -> None:
    """The sweep's listing of the runs shows the chain's run gone (a cleanup no longer touches the runs: that was
    a metadata COPY per run per commit); the next commit then uploads a base run instead of naming the lost one."""
    blobs = MemoryBlobStore()
    losing = LosingStore(blobs)
    model = {f"k{i:06d}".encode(): f"value-{i}-".encode() * 4 for i in range(3000)}
    config = {**_config(tmp_path, "writer"), "blobsnapshot.gc.interval.commits": 1}
    with TaskStorage.open(config, "task-0", blob_store=losing) as task:
        store = task.store("counts")
        for key, value in model.items():
            store.put(key, value)
        task.commit_durably({"input": "0"})
        task.commit_manager.close()  # its cleanup, and the sweep after it, find the run missing
        assert losing.lied_about is not None and not blobs.exists(losing.lied_about)
        assert task.metrics.counter("blobsnapshot.runs.missing") == 1
        store.put(b"k000001", b"changed")
        model[b"k000001"] = b"changed"
        second = task.commit_durably({"input": "1"})  # cannot build on the lost run: a base run of the whole store
        assert task.metrics.counter("blobsnapshot.base.runs") == 1
    marker = second.markers_for("blobsnapshot")["counts"]
    index = read_marker(blobs, marker, job="job", task="task-0", store="counts")
    assert len(index.runs) == 1 and index.runs[0].base and index.runs[0].records == len(model)
    assert losing.lied_about not in index.blob_names(RUNS.removesuffix("runs/"))
    with TaskStorage.open(_config(tmp_path, "reader"), "task-0", blob_store=blobs) as restored:
        assert restored.restored is not None
        assert restored.restored.checkpoint_id == second.checkpoint_id
        assert dict(restored.store("counts").items()) == model
