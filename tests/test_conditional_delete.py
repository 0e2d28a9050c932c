"""Conditional deletes (``BlobStore.delete_if_unchanged``) where they matter: a garbage collection sweep that judged
a blob by its ``head`` must not delete the same name written again since (a writer refreshing an old blob, same
bytes, to name it in a checkpoint). The per-store semantics are in the contract suite
(statebackend/testing/conditional_delete_contract.py); here: the sweep on every store, its fallback on a store
without the capability, the resilience layer's retries, and S3's fallback for a server that refuses DeleteObjects."""

from __future__ import annotations

import builtins
import os
import tempfile
import uuid
from collections.abc import Callable, Iterator, Mapping
from pathlib import Path
from typing import Any

import pytest
from botocore.awsrequest import AWSResponse

from statebackend.blobstores.base import BlobInfo, BlobStore
from statebackend.blobstores.file import FileBlobStore
from statebackend.blobstores.memory import MemoryBlobStore
from statebackend.blobstores.resilience import ResilientBlobStore
from statebackend.errors import StorageError, TransientStorageError
from statebackend.kit import GraceRule, Mark, created_at_metadata, sweep_unreferenced
from statebackend.metrics import Metrics
from statebackend.recordfile import FileHeader, content_of, encode, renew_nonce
from tests.backend_helpers import PassThroughBlobStore
from tests.test_delete_many import counted, requests, server_store

NOW = 1_800_000_000.0
OLD = created_at_metadata(NOW - 7_200)
FRESH = created_at_metadata(NOW)


class RewriteAfterHead(PassThroughBlobStore):
    """Wraps a store: the ``head`` of ``target`` is answered, then ``target`` is written again (same bytes, fresh
    age, or the bytes ``rewrite`` makes of them: a writer whose every write carries bytes of its own), as a writer
    refreshing it to name it would, between the sweep's judgment and its delete."""

    def __init__(self, inner: BlobStore, target: str, rewrite: Callable[[bytes], bytes] = lambda data: data) -> None:
        super().__init__(inner)
        self.target, self.rewrite = target, rewrite
        self.supports_conditional_delete = inner.supports_conditional_delete
        self.versions_follow_bytes = getattr(inner, "versions_follow_bytes", False)
        self.conditional_calls: list[dict[str, str]] = []
        self.plain_calls: list[list[str]] = []

    def head(self, name: str) -> BlobInfo:
        info = self.inner.head(name)
        if name == self.target:
            self.inner.put(name, self.rewrite(self.inner.get(name)), metadata=FRESH)
        return info

    def delete_if_unchanged(self, versions: Mapping[str, str]) -> frozenset[str]:
        self.conditional_calls.append(dict(versions))
        return self.inner.delete_if_unchanged(versions)

    def delete_many(self, names: builtins.list[str]) -> None:
        self.plain_calls.append(list(names))
        self.inner.delete_many(names)


def sweep_with_a_rewrite(
    store: BlobStore, rewrite: Callable[[bytes], bytes] = lambda data: data, **options: Any
) -> tuple[RewriteAfterHead, Any]:
    names = [f"g/run-{i:02d}" for i in range(6)]
    for name in names:
        store.put(name, b"run bytes", metadata=OLD)
    racing = RewriteAfterHead(store, names[2], rewrite)
    swept = sweep_unreferenced(
        racing, "g/", Mark(frozenset(), at=NOW), GraceRule(3_600_000), clock=lambda: NOW, now=NOW, **options
    )
    return racing, swept


def with_a_nonce(data: bytes) -> bytes:
    """The bytes a writer whose every write carries bytes of its own puts when it writes ``data`` again."""
    return data + b" nonce " + uuid.uuid4().hex.encode()


def renewed(data: bytes) -> bytes:
    """``data`` (a record file of this release) as the framework writes it again: its nonce renewed
    (``statebackend.recordfile.nonce``), the content the same."""
    with tempfile.TemporaryDirectory() as folder:
        path = Path(folder) / "blob"
        path.write_bytes(data)
        assert renew_nonce(path)
        return path.read_bytes()


def check_the_rewrite_survives(store: BlobStore, rewrite: Callable[[bytes], bytes] = lambda data: data) -> None:
    racing, swept = sweep_with_a_rewrite(store, rewrite)
    assert store.supports_conditional_delete
    assert list(store.list("g/")) == ["g/run-02"], "the rewritten blob was swept with the old ones"
    assert store.get("g/run-02").startswith(b"run bytes")
    assert dict(store.head("g/run-02").metadata) == FRESH
    assert swept.kept == ("g/run-02",) and "g/run-02" not in swept.deleted
    assert len(swept.deleted) == 5 and racing.plain_calls == []
    assert sorted(n for call in racing.conditional_calls for n in call) == [f"g/run-{i:02d}" for i in range(6)]
    # S3 too: a version that follows the bytes is no reason to wait, every rewrite carries bytes of its own
    assert len(racing.conditional_calls) == 1, "the six judged blobs went in one conditional batch"


@pytest.mark.parametrize(
    "make",
    [
        lambda tmp: MemoryBlobStore(),
        lambda tmp: FileBlobStore(tmp / "blobs"),
        lambda tmp: ResilientBlobStore(FileBlobStore(tmp / "blobs")),
    ],
    ids=["memory", "file", "resilient-file"],
)
def test_a_blob_written_again_after_its_judgment_survives_the_sweep(
    tmp_path: Path, make: Callable[[Path], BlobStore]
) -> None:
    check_the_rewrite_survives(make(tmp_path))


@pytest.mark.azure
def test_on_azurite_a_blob_written_again_after_its_judgment_survives_the_sweep(azurite: Any) -> None:
    store = server_store("azure", azurite)
    try:
        check_the_rewrite_survives(store)
    finally:
        store.close()


@pytest.mark.s3
def test_on_s3_a_blob_written_again_with_bytes_of_its_own_survives_the_sweep(s3_server: Any) -> None:
    """S3 deletes on condition of the ETag (DeleteObject ``If-Match``): a writer whose every write carries bytes of
    its own (a nonce) gets a new ETag, and the sweep keeps its rewrite, however late the delete goes."""
    store = server_store("s3", s3_server)
    try:
        assert store.supports_conditional_delete and store.versions_follow_bytes  # type: ignore[attr-defined]
        check_the_rewrite_survives(store, with_a_nonce)
    finally:
        store.close()


@pytest.mark.s3
def test_on_s3_a_rewrite_by_the_framework_has_a_new_etag_and_the_sweep_keeps_it(
    s3_server: Any,
) -> None:
    """An S3 ETag is the MD5 of the bytes: the same bytes written again keep it (moto shows it, metadata changed or
    not). The framework never writes them so: a record file written again has its nonce renewed, so a new ETag, and
    a rewrite racing the sweep is kept by the conditional delete however late its batch goes (the batch wait the
    sweep keeps on S3 is for writers that rewrite the same bytes; here it is 0: every blob goes alone)."""
    store = server_store("s3", s3_server)
    try:
        header = FileHeader(
            kind="run", job="j", task="t", store="s", checkpoint_id="1-1", token="tok", seq=2, base_seq=0
        )
        data = encode(header, [(b"a", b"1"), (b"b", b"2")])
        store.put("e/a", data, metadata=OLD)
        etag = store.head("e/a").etag
        store.put("e/a", data, metadata=FRESH)
        assert etag is not None and store.head("e/a").etag == etag, "S3's ETag follows the bytes"
        store.put("e/a", renewed(data), metadata=FRESH)
        assert store.head("e/a").etag != etag
        names = [f"g/run-{i:02d}" for i in range(6)]
        for name in names:
            store.put(name, data, metadata=OLD)
        racing = RewriteAfterHead(store, names[2], renewed)
        swept = sweep_unreferenced(
            racing, "g/", Mark(frozenset(), at=NOW), GraceRule(3_600_000), clock=lambda: NOW, now=NOW, batch_wait_s=0.0
        )
        assert racing.plain_calls == []
        assert sorted(name for call in racing.conditional_calls for name in call) == names
        assert swept.kept == ("g/run-02",) and list(store.list("g/")) == ["g/run-02"]
        assert bytes(content_of(store.get("g/run-02"))) == bytes(content_of(data))
    finally:
        store.close()


def test_a_store_without_the_capability_is_never_asked_for_a_conditional_delete() -> None:
    class Plain(MemoryBlobStore):
        supports_conditional_delete = False

        def delete_if_unchanged(self, versions: Mapping[str, str]) -> frozenset[str]:
            raise AssertionError("a store without the capability was asked for a conditional delete")

    store = Plain()
    for name in ["g/a", "g/b"]:
        store.put(name, b"x", metadata=OLD)
    wrapped = ResilientBlobStore(store)
    assert not wrapped.supports_conditional_delete
    swept = sweep_unreferenced(
        wrapped, "g/", Mark(frozenset(), at=NOW), GraceRule(3_600_000), clock=lambda: NOW, now=NOW
    )
    assert swept.deleted == ("g/a", "g/b") and list(store.list()) == []


def test_a_conditional_delete_retried_after_a_lost_reply_is_success() -> None:
    """The first attempt deletes, its reply is lost: the retry finds the blob absent, which is success (not kept);
    a blob written again between the attempts is kept whichever attempt saw it."""

    class LosesFirstReply(MemoryBlobStore):
        lost = 0

        def delete_if_unchanged(self, versions: Mapping[str, str]) -> frozenset[str]:
            kept = super().delete_if_unchanged(versions)
            if self.lost:
                self.lost -= 1
                self.put("g/rewritten", b"x", metadata=FRESH)  # written again while the reply was on its way
                raise TransientStorageError("injected: the reply was lost")
            return kept

    inner = LosesFirstReply()
    for name in ["g/gone", "g/rewritten"]:
        inner.put(name, b"x", metadata=OLD)
    store, metrics = counted(inner)
    versions = {name: store.head(name).etag or "" for name in ["g/gone", "g/rewritten"]}
    inner.lost = 1
    assert store.delete_if_unchanged(versions) == {"g/rewritten"}
    assert list(inner.list()) == ["g/rewritten"] and dict(inner.head("g/rewritten").metadata) == FRESH
    assert requests(metrics, "delete_if_unchanged") == 1
    assert metrics.counter("blob_store.retries", operation="delete_if_unchanged") == 1


# -- S3: a server that refuses DeleteObjects -----------------------------------------------------------------------


class _Body:
    def __init__(self, body: bytes) -> None:
        self.body = body

    def stream(self, **_: Any) -> Iterator[bytes]:
        yield self.body


def answer_delete_objects_with(store: BlobStore, status: int, code: str, *, times: int | None = None) -> list[int]:
    """Make the S3 server seem to answer the store's DeleteObjects requests with ``status`` and error ``code``
    (``times`` requests, ``None``: all of them; the others reach the server); returns a list that grows by one per
    request answered so."""
    inner: Any = store.inner  # type: ignore[attr-defined]
    answered: list[int] = []

    def answer(request: Any, **_: Any) -> AWSResponse | None:
        if times is not None and len(answered) >= times:
            return None
        answered.append(1)
        body = f"<Error><Code>{code}</Code><Message>injected</Message></Error>".encode()
        return AWSResponse(request.url, status, {"Content-Type": "application/xml"}, _Body(body))

    inner._client.meta.events.register("before-send.s3.DeleteObjects", answer)
    return answered


@pytest.mark.s3
@pytest.mark.parametrize(("status", "code"), [(501, "NotImplemented"), (405, "MethodNotAllowed")])
def test_s3_a_server_refusing_delete_objects_gets_one_delete_a_name_from_then_on(
    s3_server: Any, status: int, code: str
) -> None:
    store = server_store("s3", s3_server, f"r{uuid.uuid4().hex[:12]}")
    refused = answer_delete_objects_with(store, status, code)
    metrics = Metrics()
    store.use_metrics(metrics)
    try:
        for name in ["a", "b", "c"]:
            store.put(name, b"x")
        store.delete_many(["a", "b", "absent"])
        assert list(store.list("")) == ["c"]
        assert len(refused) == 1 and requests(metrics, "delete") == 3
        store.delete_many(["c"])  # remembered: no DeleteObjects tried again
        assert list(store.list("")) == [] and len(refused) == 1
        assert requests(metrics, "delete_many") == 1 and requests(metrics, "delete") == 4
    finally:
        store.close()


class RewritesWhatASweepDeletes(MemoryBlobStore):
    """A memory store on which every blob a conditional delete is asked for was written again just before (same
    bytes, same metadata: a writer refreshing it to name it), as a writer racing the sweep would."""

    def __init__(self) -> None:
        super().__init__()
        self.rewritten: list[str] = []

    def delete_if_unchanged(self, versions: Mapping[str, str]) -> frozenset[str]:
        for name in versions:
            self.put(name, self.get(name), metadata=dict(self.head(name).metadata))
            self.rewritten.append(name)
        return super().delete_if_unchanged(versions)


def test_backend_sweeps_keep_and_count_a_blob_written_again_before_its_delete(tmp_path: Path) -> None:
    """Both built-in backends: an old unreferenced blob that a writer writes again between the sweep's judgment and
    its delete is kept, and counted in ``<backend>.sweep.kept`` (not in the deleted ones)."""
    from statebackend.backends.changelog.backup import ChangelogBackupManager

    from statebackend.task import TaskStorage
    from tests.backend_helpers import blobsnapshot_config as make_config
    from tests.backend_helpers import blobsnapshot_manager as backup_manager
    from tests.backend_helpers import changelog_config as config_for

    for backend, config, orphan in (
        (
            "changelog",
            config_for(tmp_path / "c", **{"changelog.gc.grace.period.ms": 3_600_000}),
            "job/task-0/counts/changelog/delta/000000000001-00000000000000000000000000000000.delta",
        ),
        ("blobsnapshot", make_config(tmp_path / "b"), "job/task-0/counts/blobsnapshot/runs/" + "ab" * 32),
    ):
        blobs = RewritesWhatASweepDeletes()
        with TaskStorage.open(config, "task-0", blob_store=blobs) as task:
            task.store("counts").put(b"k", b"v")
            task.commit_durably({"input": "0"})
            changelog = task.commit_manager.backups[0].manager
            assert isinstance(changelog, ChangelogBackupManager) or backend != "changelog"
            manager = changelog if isinstance(changelog, ChangelogBackupManager) else backup_manager(task)
            blobs.put(
                orphan, b"garbage of an attempt long gone", metadata=created_at_metadata(manager.shared.clock() - 7_200)
            )
            deleted = manager.sweep() if isinstance(manager, ChangelogBackupManager) else manager.sweep().runs_deleted
            assert blobs.rewritten == [orphan], f"{backend}: the sweep never asked to delete the orphan"
            assert blobs.exists(orphan), f"{backend}: the sweep deleted a blob written again after its judgment"
            assert deleted == 0
            assert task.metrics.counter(f"{backend}.sweep.kept") == 1


def test_file_store_on_a_filesystem_that_keeps_whole_seconds_never_deletes_a_rewrite(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A ``file://`` version is device, inode, size and mtime. A filesystem that stores whole seconds (ext4 with
    128-byte inodes, ext3, HFS+, FAT) cuts the nanosecond stamp ``put`` sets, and it hands a freed inode out again:
    a name deleted (by another collector) and written again within the second, same bytes, repeats the version the
    sweep judged. Such a version must not be offered (``etag`` None: the sweep falls back to ``delete_many``)."""
    real_utime = os.utime

    def whole_seconds(target: Any, *args: Any, ns: tuple[int, int] | None = None, **kwargs: Any) -> None:
        if ns is None:
            real_utime(target, *args, **kwargs)
        else:
            real_utime(target, *args, ns=(ns[0] // 10**9 * 10**9, ns[1] // 10**9 * 10**9), **kwargs)

    monkeypatch.setattr(os, "utime", whole_seconds)
    store = FileBlobStore(tmp_path / "blobs")
    lost = []
    for round_no in range(200):
        store.put("g/run", b"run bytes")
        judged = store.head("g/run").etag
        store.delete("g/run")
        store.put("g/run", b"run bytes")  # the writer's refresh, the inode likely the freed one
        if judged is not None and store.delete_if_unchanged({"g/run": judged}) != {"g/run"}:
            lost.append(round_no)
        assert store.exists("g/run") or lost
    assert lost == [], f"rewrites deleted on a repeated version in rounds {lost[:10]}"
    assert store.head("g/run").etag is None, "a version the filesystem's clock cannot vouch for was offered"
    # the sweep then deletes plainly (bounded by its batch wait) and still deletes what is old
    store.put("g/old", b"x", metadata=OLD)
    swept = sweep_unreferenced(store, "g/", Mark(frozenset(), at=NOW), GraceRule(3_600_000), clock=lambda: NOW, now=NOW)
    assert swept.deleted == ("g/old",) and list(store.list("g/")) == ["g/run"]


@pytest.mark.s3
@pytest.mark.parametrize(
    ("status", "code"), [(503, "SlowDown"), (500, "InternalError"), (403, "AccessDenied"), (400, "MalformedXML")]
)
def test_s3_a_delete_objects_failing_otherwise_never_switches_to_one_delete_a_name(
    s3_server: Any, status: int, code: str
) -> None:
    """Only a refusal of DeleteObjects itself (501, 405) switches the store to one DeleteObject a name: a throttled
    or failing server is retried as before, a refused credential or request is an error, and the next batch is one
    DeleteObjects again."""
    store = server_store("s3", s3_server, f"f{uuid.uuid4().hex[:12]}")
    failed = answer_delete_objects_with(store, status, code, times=1)
    metrics = Metrics()
    store.use_metrics(metrics)
    try:
        for name in ["a", "b", "c"]:
            store.put(name, b"x")
        if status >= 500:
            store.delete_many(["a", "b"])  # retried (by botocore or the resilience layer)
        else:
            with pytest.raises(StorageError):
                store.delete_many(["a", "b"])
            store.delete_many(["a", "b"])
        assert failed == [1] and list(store.list("")) == ["c"] and not store.inner._batch_delete_refused  # type: ignore[attr-defined]
        store.delete_many(["c"])
        assert list(store.list("")) == [] and requests(metrics, "delete") == 0
    finally:
        store.close()


@pytest.mark.azure
def test_on_azurite_a_leased_blob_is_an_error_not_a_blob_written_again(azurite: Any) -> None:
    """Azure answers 412 to a conditional delete for two reasons: the ETag changed (``ConditionNotMet``: kept) and a
    lease held on the blob (``LeaseIdMissing``). The second is what ``delete_many`` reports as an error; it must not
    be counted as a blob written again (which a sweep then keeps silently, sweep after sweep)."""
    store = server_store("azure", azurite)
    inner: Any = store.inner  # type: ignore[attr-defined]
    try:
        for name in ["leased", "rewritten", "old"]:
            store.put(name, b"x")
        versions = {name: store.head(name).etag or "" for name in ["leased", "rewritten", "old"]}
        store.put("rewritten", b"x")
        lease = inner._container_client.get_blob_client(inner._root() + "leased").acquire_lease(lease_duration=-1)
        try:
            with pytest.raises(StorageError, match="LeaseIdMissing"):
                store.delete_if_unchanged(versions)
            assert sorted(store.list("")) == ["leased", "rewritten"]
        finally:
            lease.release()
        assert store.delete_if_unchanged(versions) == {"rewritten"}
        assert list(store.list("")) == ["rewritten"]
    finally:
        store.close()
