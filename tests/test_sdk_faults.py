"""Every blob store operation against real Azurite and moto, behind the fault proxy, under each fault kind the wire
can produce (reset after the server acted, reply cut inside its status line / after it / inside its headers / at a
random byte of its head, a 503 with a cut body, a cut body): the store without retries answers right or raises a
project error (never an SDK or stdlib exception, never a wrong answer such as an empty listing or short bytes, and
no raw exception in the error's chain); the store with retries answers right. Each fault is scripted onto exactly
one request (the first matching one after the test arms it), so every case is deterministic.

Also: the seen failures one by one, and the same availability on both clouds under 10% mixed faults."""

from __future__ import annotations

import re
import threading
import uuid
from collections.abc import Callable
from pathlib import Path
from typing import Any, cast

import attrs
import pytest

from statebackend.blobstores.azure import AzureBlobStore
from statebackend.blobstores.base import BlobStore, open_blob_store
from statebackend.blobstores.resilience import METRIC_RETRIES
from statebackend.blobstores.s3 import S3BlobStore
from statebackend.errors import AlreadyExistsError, StateBackendError, TransientStorageError
from statebackend.metrics import Metrics
from statebackend.redact import RedactedError
from tests.faults import (
    CUT_AFTER_STATUS_LINE,
    CUT_BODY,
    CUT_HEAD,
    CUT_HEADERS,
    CUT_STATUS_LINE,
    ERROR_5XX_PARTIAL,
    FAULT_KINDS,
    RESET_AFTER,
    FaultProxy,
)
from tests.servers import ServerProcess, azurite_connection_string

REPLY_FAULTS = [RESET_AFTER, CUT_STATUS_LINE, CUT_AFTER_STATUS_LINE, CUT_HEADERS, CUT_HEAD, ERROR_5XX_PARTIAL, CUT_BODY]
DATA = bytes((i * 37 + 11) & 0xFF for i in range(3000))
META = {"kind": "delta", "expiry": "1700000000"}
PART = 5 << 20
BIG = bytes((i * 131 + (i >> 9)) & 0xFF for i in range(PART + 4321))  # two parts


class OneShot:
    """A proxy schedule: once armed, the next ``times`` requests whose head matches ``match`` get ``kind``; then
    none until armed again."""

    def __init__(self, kind: str) -> None:
        self.kind = kind
        self.match: re.Pattern[bytes] | None = None
        self.left = 0
        self.fired = 0
        self._lock = threading.Lock()

    def arm(self, match: bytes = b"", times: int = 1, kind: str | None = None) -> None:
        with self._lock:
            self.match = re.compile(match)
            self.left = times
            self.kind = kind or self.kind

    def __call__(self, number: int, head: bytes) -> str | None:
        with self._lock:
            if self.match is None or self.left == 0 or self.match.search(head) is None:
                return None
            self.left -= 1
            self.fired += 1
            return self.kind


@attrs.define
class Stores:
    """One container/bucket seen three ways: through the proxy without retries (``inner``) and with them
    (``resilient``), and directly with retries (``raw``, to set up and check; see :func:`_direct`)."""

    cloud: str
    inner: BlobStore
    resilient: BlobStore
    raw: BlobStore

    def close(self) -> None:
        for store in (self.inner, self.resilient, self.raw):
            store.close()


#: every fault here closes or resets the connection, so no outcome waits on a timeout: the request timeout only
#: guards a hang, generous enough that a slow server on a loaded machine is never taken for a fault
REQUEST_TIMEOUT_MS = 120_000
#: tries of the store without retries before its fault must have fired (a try that fails earlier is retried)
FAULT_TRIES = 5


def _options(cloud: str, port: int) -> dict[str, object]:
    common: dict[str, object] = {
        "create.if.missing": True,
        "part.size.bytes": PART,
        "max.concurrency": 2,
        "request.timeout.ms": REQUEST_TIMEOUT_MS,
        "retry.max.attempts": 6,
        "retry.base.delay.ms": 1,
        "retry.max.delay.ms": 20,
    }
    if cloud == "s3":
        return {**common, "endpoint.url": f"http://127.0.0.1:{port}"}
    return {**common, "connection.string": azurite_connection_string(port)}


class DirectStoreError(Exception):
    """The direct store (set-up and checks) failed: no outcome of the store under test, so never taken for its
    project error."""


class _Direct:
    """The direct store with retries, for a test's set-up and checks. Its failures leave as
    :class:`DirectStoreError`, so an operation's ``except StateBackendError`` only ever sees the store under test;
    ``list`` returns a list (a lazy listing would fail later, outside this wrapper)."""

    def __init__(self, store: BlobStore) -> None:
        self._store = store

    def __getattr__(self, name: str) -> Any:
        method = getattr(self._store, name)
        if not callable(method):
            return method

        def call(*args: Any, **kwargs: Any) -> Any:
            try:
                result = method(*args, **kwargs)
                return list(result) if name == "list" else result
            except StateBackendError as exc:
                raise DirectStoreError(f"the direct store's {name}{args!r} failed: {exc!r}") from exc

        return call


def _direct(cloud: str, url: str, server: ServerProcess) -> BlobStore:
    """``url`` on the server itself (no proxy), with retries: set-up and checks are not under test, and on a loaded
    machine one slow request must not fail them."""
    options = {**_options(cloud, server.port), "retry.max.attempts": 10, "retry.max.delay.ms": 1000}
    return cast(BlobStore, _Direct(open_blob_store(url, options)))


def _fresh_url(cloud: str, server: ServerProcess) -> str:
    """A new container/bucket, created directly on the server (with retries: creation is idempotent)."""
    url = f"s3://t-{uuid.uuid4().hex[:16]}/p" if cloud == "s3" else f"az://t{uuid.uuid4().hex[:16]}/p"
    with open_blob_store(url, {**_options(cloud, server.port), "retry.max.attempts": 10}) as direct:
        direct.create_resources()  # type: ignore[attr-defined]
    return url


def _open(cloud: str, server: ServerProcess, proxy: FaultProxy) -> Stores:
    url = _fresh_url(cloud, server)
    opener = S3BlobStore if cloud == "s3" else AzureBlobStore
    inner: BlobStore = opener.open_inner(url, _options(cloud, proxy.port))
    return Stores(cloud, inner, open_blob_store(url, _options(cloud, proxy.port)), _direct(cloud, url, server))


@pytest.fixture(params=[pytest.param("s3", marks=pytest.mark.s3), pytest.param("azure", marks=pytest.mark.azure)])
def cloud(request: pytest.FixtureRequest) -> tuple[str, ServerProcess]:
    fixture = "s3_server" if request.param == "s3" else "azurite"
    return request.param, request.getfixturevalue(fixture)


# -- the operations: each does one thing through `store` and checks the answer against `raw` -------------------

Op = Callable[[BlobStore, BlobStore, str, Path], None]


def _put(store: BlobStore, raw: BlobStore, tag: str, tmp: Path) -> None:
    store.put(f"w/{tag}", DATA, metadata=META)
    assert raw.get(f"w/{tag}") == DATA
    assert dict(raw.head(f"w/{tag}").metadata) == META


def _put_create_only(store: BlobStore, raw: BlobStore, tag: str, tmp: Path) -> None:
    store.put(f"c/{tag}", DATA, create_only=True, metadata=META)
    assert raw.get(f"c/{tag}") == DATA
    assert dict(raw.head(f"c/{tag}").metadata) == META


def _get(store: BlobStore, raw: BlobStore, tag: str, tmp: Path) -> None:
    raw.put(f"r/{tag}", DATA)
    assert store.get(f"r/{tag}") == DATA


def _get_range(store: BlobStore, raw: BlobStore, tag: str, tmp: Path) -> None:
    raw.put(f"r/{tag}", DATA)
    assert store.get(f"r/{tag}", start=100, end=1100) == DATA[100:1100]


def _head(store: BlobStore, raw: BlobStore, tag: str, tmp: Path) -> None:
    raw.put(f"r/{tag}", DATA, metadata=META)
    info = store.head(f"r/{tag}")
    assert (info.size, dict(info.metadata)) == (len(DATA), META)


def _list(store: BlobStore, raw: BlobStore, tag: str, tmp: Path) -> None:
    names = [f"l/{tag}/{i}" for i in range(3)]
    for name in names:
        raw.put(name, b"x")
    assert list(store.list(f"l/{tag}/")) == names


def _delete(store: BlobStore, raw: BlobStore, tag: str, tmp: Path) -> None:
    raw.put(f"d/{tag}", b"x")
    store.delete(f"d/{tag}")
    assert not raw.exists(f"d/{tag}")


def _delete_many(store: BlobStore, raw: BlobStore, tag: str, tmp: Path) -> None:
    names = [f"dm/{tag}/{i}" for i in range(3)]
    for name in names:
        raw.put(name, b"x")
    raw.put(f"dm/{tag}/kept", b"x")
    store.delete_many([*names, f"dm/{tag}/absent"])
    assert list(raw.list(f"dm/{tag}/")) == [f"dm/{tag}/kept"]


def _delete_if_unchanged(store: BlobStore, raw: BlobStore, tag: str, tmp: Path) -> None:
    """Conditional deletes (Azure's Blob Batch with ``If-Match``, S3's DeleteObject with ``If-Match`` per name): a
    retry after a lost reply finds what the first attempt deleted absent (success) and the rewritten blob still
    kept."""
    assert store.supports_conditional_delete
    names = [f"dc/{tag}/{i}" for i in range(3)]
    for name in names:
        raw.put(name, b"x")
    versions = {name: raw.head(name).etag or "" for name in names}
    raw.put(names[1], b"x, written again")  # since its head; bytes of its own, so an S3 ETag (an MD5) changes too
    assert store.delete_if_unchanged({**versions, f"dc/{tag}/absent": versions[names[0]]}) == {names[1]}
    assert list(raw.list(f"dc/{tag}/")) == [names[1]]


def _set_metadata(store: BlobStore, raw: BlobStore, tag: str, tmp: Path) -> None:
    raw.put(f"m/{tag}", DATA, metadata={"kind": "old"})
    store.set_metadata(f"m/{tag}", META)
    assert dict(raw.head(f"m/{tag}").metadata) == META
    assert raw.get(f"m/{tag}") == DATA


def _put_file(create_only: bool) -> Op:
    def op(store: BlobStore, raw: BlobStore, tag: str, tmp: Path) -> None:
        source = tmp / f"big-{tag}"
        source.write_bytes(BIG)
        store.put_file(f"f/{tag}", source, create_only=create_only, metadata=META)
        assert raw.get(f"f/{tag}") == BIG
        assert dict(raw.head(f"f/{tag}").metadata) == META

    return op


def _get_file(store: BlobStore, raw: BlobStore, tag: str, tmp: Path) -> None:
    raw.put(f"g/{tag}", BIG)
    assert store.get_file(f"g/{tag}", tmp / f"back-{tag}") == len(BIG)
    assert (tmp / f"back-{tag}").read_bytes() == BIG


#: operation -> (function, regular expression per cloud for the request the fault hits; b"" = the first one)
OPS: dict[str, tuple[Op, dict[str, bytes]]] = {
    "put": (_put, {}),
    "put_create_only": (_put_create_only, {}),
    "get": (_get, {}),
    "get_range": (_get_range, {}),
    "head": (_head, {}),
    "list": (_list, {}),
    "delete": (_delete, {}),
    "delete_many": (_delete_many, {"s3": rb"^POST [^ ]*\?delete", "azure": rb"^POST [^ ]*comp=batch"}),
    "delete_if_unchanged": (_delete_if_unchanged, {"s3": rb"^DELETE ", "azure": rb"^POST [^ ]*comp=batch"}),
    "set_metadata": (_set_metadata, {}),
    "put_file_part": (_put_file(False), {"s3": rb"^PUT [^ ]*partNumber=", "azure": rb"^PUT [^ ]*comp=block&"}),
    "put_file_commit": (_put_file(False), {"s3": rb"^POST [^ ]*\?uploadId=", "azure": rb"^PUT [^ ]*comp=blocklist"}),
    "put_file_commit_create_only": (
        _put_file(True),
        {"s3": rb"^POST [^ ]*\?uploadId=", "azure": rb"^PUT [^ ]*comp=blocklist"},
    ),
    "get_file_range": (_get_file, {"s3": rb"^GET ", "azure": rb"^GET "}),
}


def _raw_links(error: BaseException) -> list[str]:
    """Exceptions in the chain that are neither ours nor sanitized stand-ins."""
    found, seen, pending = [], set(), [error]
    while pending:
        current = pending.pop()
        if id(current) in seen:
            continue
        seen.add(id(current))
        if not isinstance(current, (StateBackendError, RedactedError)):
            found.append(f"{type(current).__module__}.{type(current).__name__}")
        pending += [link for link in (current.__cause__, current.__context__) if link is not None]
    return found


@pytest.mark.parametrize("kind", REPLY_FAULTS)
@pytest.mark.parametrize("operation", list(OPS))
def test_one_fault_then_a_right_answer_or_a_project_error(
    cloud: tuple[str, ServerProcess], kind: str, operation: str, tmp_path: Path
) -> None:
    """The store without retries, its one request faulted: the right answer (checked by the operation) or a project
    error whose chain holds no raw SDK exception; either outcome passes, nothing else does. Then the store with
    retries, the same fault: the right answer."""
    name, server = cloud
    op, matches = OPS[operation]
    match = matches.get(name, b"")
    schedule = OneShot(kind)
    with FaultProxy(server.host, server.port, schedule=schedule, seed=5) as proxy:
        stores = _open(name, server, proxy)
        try:
            outcomes = []
            for attempt in range(FAULT_TRIES):
                schedule.arm(match)
                outcomes.append(_right_answer_or_project_error(op, stores, f"inner{attempt}", tmp_path))
                if schedule.fired:
                    break
                # no request met the fault: the operation must have failed earlier (a slow server on a loaded
                # machine), with a project error; it answered nothing about the fault, so it tries again
                assert outcomes[-1] != "returned", f"no request matched {match!r}; the operation returned"
            assert schedule.fired == 1, f"the fault never fired in {FAULT_TRIES} tries; outcomes: {outcomes}"
            # with retries: the right answer
            schedule.arm(match)
            op(stores.resilient, stores.raw, "resilient", tmp_path)
            assert schedule.fired == 2
        finally:
            stores.close()


def _right_answer_or_project_error(op: Op, stores: Stores, tag: str, tmp: Path) -> str:
    """Run ``op`` on the store without retries: "returned" (the operation checked its answer against the direct
    store), or the repr of the project error it raised, whose chain must hold no raw exception. Anything else (a
    wrong answer, an SDK or stdlib exception, a failure of the direct store) fails the test."""
    try:
        op(stores.inner, stores.raw, tag, tmp)
    except StateBackendError as exc:
        assert _raw_links(exc) == [], exc
        return f"raised {exc!r}"
    return "returned"


# -- the seen failures, one by one ------------------------------------------------------------------------------


@pytest.mark.azure
@pytest.mark.parametrize("kind", [CUT_BODY, ERROR_5XX_PARTIAL])
def test_azure_reply_cut_short_is_transient_and_retried(azurite: ServerProcess, kind: str, tmp_path: Path) -> None:
    """Seen: a truncated reply (IncompleteRead, no status code) became a permanent StorageError 'answered None'."""
    schedule = OneShot(kind)
    with FaultProxy(azurite.host, azurite.port, schedule=schedule) as proxy:
        stores = _open("azure", azurite, proxy)
        try:
            stores.raw.put("blob", DATA)
            schedule.arm(rb"^GET ", times=10)  # more than the SDK's own download retries
            with pytest.raises(TransientStorageError) as caught:
                stores.inner.get("blob")
            assert "answered None" not in str(caught.value)
            schedule.arm(rb"^GET ")
            assert stores.resilient.get("blob") == DATA
            # a put's reply has no body to cut: its 503 is cut short instead
            schedule.arm(rb"^PUT ", kind=ERROR_5XX_PARTIAL)
            with pytest.raises(TransientStorageError):
                stores.inner.put("other", DATA, create_only=True)
            schedule.arm(rb"^PUT ", kind=ERROR_5XX_PARTIAL)
            stores.resilient.put("checkpoint", DATA, create_only=True)  # the reply was lost after the write
            assert stores.raw.get("checkpoint") == DATA
        finally:
            stores.close()


@pytest.mark.azure
@pytest.mark.parametrize(
    ("kind", "operation"), [(CUT_HEAD, "put"), (CUT_HEAD, "head"), (CUT_HEADERS, "list"), (CUT_STATUS_LINE, "get")]
)
def test_azure_reply_cut_in_its_head_raises_no_sdk_exception(azurite: ServerProcess, kind: str, operation: str) -> None:
    """Seen: DeserializationError, TypeError, AttributeError, ValueError reached callers."""
    schedule = OneShot(kind)
    # seed 3: the cut of CUT_HEAD falls inside the Date header (put) / before Content-Length (head)
    with FaultProxy(azurite.host, azurite.port, schedule=schedule, seed=3) as proxy:
        stores = _open("azure", azurite, proxy)
        try:
            stores.raw.put("blob", DATA)
            schedule.arm(times=10)
            calls: dict[str, Callable[[BlobStore], object]] = {
                "put": lambda s: s.put("new", DATA),
                "head": lambda s: s.head("blob"),
                "list": lambda s: list(s.list()),
                "get": lambda s: s.get("blob"),
            }
            with pytest.raises(TransientStorageError):
                calls[operation](stores.inner)
        finally:
            stores.close()


@pytest.mark.s3
def test_s3_list_page_cut_in_its_head_is_retried_never_empty(s3_server: ServerProcess) -> None:
    """Seen: a ListObjectsV2 reply cut inside its header block parsed as an empty page and list returned []."""
    schedule = OneShot(CUT_HEADERS)
    with FaultProxy(s3_server.host, s3_server.port, schedule=schedule) as proxy:
        stores = _open("s3", s3_server, proxy)
        try:
            for name in ["cp/001", "cp/002"]:
                stores.raw.put(name, b"x")
            schedule.arm(rb"^GET [^ ]*list-type=2")
            with pytest.raises(TransientStorageError, match="ListObjectsV2"):
                list(stores.inner.list("cp/"))
            metrics = Metrics()
            stores.resilient.metrics = metrics  # type: ignore[attr-defined]
            schedule.arm(rb"^GET [^ ]*list-type=2")
            assert list(stores.resilient.list("cp/")) == ["cp/001", "cp/002"]
            assert metrics.counter(METRIC_RETRIES) == 1
        finally:
            stores.close()


@pytest.mark.s3
@pytest.mark.parametrize(
    ("kind", "operation"),
    [
        (CUT_AFTER_STATUS_LINE, "get"),
        (CUT_AFTER_STATUS_LINE, "head"),
        (CUT_HEADERS, "head"),
        (CUT_AFTER_STATUS_LINE, "create_multipart_upload"),
    ],
)
def test_s3_reply_without_mandatory_fields_is_transient(
    s3_server: ServerProcess, kind: str, operation: str, tmp_path: Path
) -> None:
    """Seen: GetObject cut in its head read as 0 bytes; KeyError 'ContentLength' / 'UploadId' reached callers."""
    schedule = OneShot(kind)
    with FaultProxy(s3_server.host, s3_server.port, schedule=schedule) as proxy:
        stores = _open("s3", s3_server, proxy)
        try:
            stores.raw.put("blob", DATA)
            source = tmp_path / "big"
            source.write_bytes(BIG)
            calls: dict[str, tuple[bytes, Callable[[BlobStore], object]]] = {
                "get": (rb"^GET ", lambda s: s.get("blob")),
                "head": (rb"^HEAD ", lambda s: s.head("blob")),
                "create_multipart_upload": (rb"^POST [^ ]*\?uploads", lambda s: s.put_file("big", source)),
            }
            match, call = calls[operation]
            schedule.arm(match)
            with pytest.raises(TransientStorageError, match="lacks"):
                call(stores.inner)
            schedule.arm(match)
            call(stores.resilient)  # retried to the right answer
            assert stores.resilient.get("blob") == DATA
        finally:
            stores.close()


# -- create-only writes whose reply was lost, on every path ------------------------------------------------------


@pytest.mark.parametrize("path", ["put", "put_file_small", "put_file_multipart"])
def test_create_only_write_whose_only_reply_was_lost_is_read_back(
    cloud: tuple[str, ServerProcess], path: str, tmp_path: Path
) -> None:
    """One attempt only (retry.max.attempts=1), its reply lost after the server wrote: reading back decides. Our
    bytes and metadata: success. Then a second writer with other bytes: AlreadyExistsError, not a transient error."""
    name, server = cloud
    schedule = OneShot(RESET_AFTER)
    commit = {"put": rb"^PUT ", "put_file_small": rb"^PUT "}.get(
        path, rb"^POST [^ ]*\?uploadId=" if name == "s3" else rb"^PUT [^ ]*comp=blocklist"
    )
    data = BIG if path == "put_file_multipart" else DATA
    with FaultProxy(server.host, server.port, schedule=schedule) as proxy:
        store = open_blob_store(_fresh_url(name, server), {**_options(name, proxy.port), "retry.max.attempts": 1})
        try:
            source = tmp_path / "source"
            source.write_bytes(data)
            write: Callable[[bytes], None] = (
                (lambda d: store.put("cp/1", d, create_only=True, metadata=META))
                if path == "put"
                else (lambda d: _write_and_put_file(store, source, d))
            )
            schedule.arm(commit)
            write(data)
            assert schedule.fired == 1
            assert store.get("cp/1") == data and dict(store.head("cp/1").metadata) == META
            schedule.arm(commit)
            with pytest.raises(AlreadyExistsError):
                write(data[::-1])
        finally:
            store.close()


def _write_and_put_file(store: BlobStore, source: Path, data: bytes) -> None:
    source.write_bytes(data)
    store.put_file("cp/1", source, create_only=True, metadata=META)


# -- availability: the same on both clouds under the same faults -------------------------------------------------


def test_same_availability_under_ten_percent_mixed_faults(cloud: tuple[str, ServerProcess]) -> None:
    """Seen: under 10% mixed faults Azure failed ~14% of create-only checkpoint writes where S3 failed none. Every
    'commit' here (a data put, a create-only checkpoint put, a listing that must show every checkpoint so far, a
    read back) must succeed with the right answer on both clouds."""
    name, server = cloud
    failures: list[str] = []
    with FaultProxy(server.host, server.port, failure_rate=0.10, kinds=FAULT_KINDS, seed=2024) as proxy:
        store = open_blob_store(_fresh_url(name, server), {**_options(name, proxy.port), "retry.max.attempts": 8})
        committed: list[str] = []
        for seq in range(60):
            checkpoint = f"checkpoints/{seq:06d}"
            payload = f"checkpoint {seq} ".encode() * 40
            try:
                store.put(f"data/{seq:06d}", payload * 3)
                store.put(checkpoint, payload, create_only=True, metadata={"seq": str(seq)})
                committed.append(checkpoint)
                assert list(store.list("checkpoints/")) == committed
                assert store.get(checkpoint) == payload
            except StateBackendError as exc:
                failures.append(f"{seq}: {type(exc).__name__}: {exc}")
        store.close()
    faults = sum(proxy.stats[k] for k in FAULT_KINDS)
    assert faults >= 15, proxy.stats  # the faults really happened
    assert failures == []


def test_fault_proxy_injects_every_kind_it_is_given(cloud: tuple[str, ServerProcess]) -> None:
    name, server = cloud
    with FaultProxy(server.host, server.port, failure_rate=0.5, kinds=FAULT_KINDS, seed=9) as proxy:
        store = open_blob_store(_fresh_url(name, server), {**_options(name, proxy.port), "retry.max.attempts": 20})
        for i in range(30):
            store.put(f"b/{i}", DATA)
            assert store.get(f"b/{i}") == DATA
        store.close()
    assert all(proxy.stats[kind] > 0 for kind in FAULT_KINDS), proxy.stats
