"""Lost replies on S3 resolved by what is stored, never by the code of the retry's answer (issue 32).

A multipart completion or a conditional write whose reply is cut after the server acted is retried, and servers
answer that retry in many ways: ``NoSuchUpload``, a bare 400 or 404, a 500. Each is tried here on moto behind the
fault proxy (the first request's reply cut on the wire) with the retry's answer injected at botocore's send: the
write that landed is success (the stored size, metadata and parts' ETag, or bytes, are this write's); a write that
did not land, or a name holding other bytes, keeps the answer's error."""

from __future__ import annotations

import uuid
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import pytest
from botocore.awsrequest import AWSResponse

from statebackend.blobstores.base import BlobStore, open_blob_store
from statebackend.errors import NotFoundError, PreconditionFailedError, StorageError, TransientStorageError
from statebackend.metrics import Metrics
from tests.faults import RESET_AFTER, RESET_BEFORE, FaultProxy, fault_requests
from tests.servers import ServerProcess

pytestmark = pytest.mark.s3

PART = 5 << 20
BIG = bytes((i * 131 + (i >> 9)) & 0xFF for i in range(PART + 4321))  # two parts
META = {"kind": "run", "created_at": "1700000000.000"}
COMPLETION = rb"^POST [^ ]*\?uploadId="
PUT_OBJECT = rb"^PUT /[^ ?]*(\?x-id=PutObject)? HTTP"
#: (HTTP status, S3 error code) the retried request is answered with; "" is a bare status without a code
ANSWERS = {
    "400": (400, ""),
    "404": (404, ""),
    "no-such-upload": (404, "NoSuchUpload"),
    "500": (500, "InternalError"),
}


class _Body:
    def __init__(self, body: bytes) -> None:
        self.body = body

    def stream(self, **_: Any) -> Iterator[bytes]:
        yield self.body


class AnswerRetries:
    """A botocore ``before-send`` hook: the first request of an operation goes to the server; every later one is
    answered ``status`` (with ``code`` in an S3 error body, or none) without reaching it, as a server that answers a
    retry of a write that landed otherwise than the protocol says would."""

    def __init__(self, status: int, code: str) -> None:
        self.status, self.code = status, code
        self.calls = 0
        self.answered = 0

    def __call__(self, request: Any, **_: Any) -> AWSResponse | None:
        self.calls += 1
        if self.calls == 1:
            return None
        self.answered += 1
        body = f"<Error><Code>{self.code}</Code><Message>injected</Message></Error>".encode() if self.code else b""
        return AWSResponse(request.url, self.status, {"Content-Type": "application/xml"}, _Body(body))


def _open(server: ServerProcess, proxy: FaultProxy) -> BlobStore:
    url = f"s3://t-{uuid.uuid4().hex[:16]}/p"
    with open_blob_store(url, {"endpoint.url": server.endpoint, "create.if.missing": True}) as direct:
        direct.create_resources()  # type: ignore[attr-defined]
    options = {
        "endpoint.url": proxy.endpoint,
        "part.size.bytes": PART,
        "max.concurrency": 2,
        "request.timeout.ms": 120_000,  # every fault here closes the connection: no outcome waits on a timeout
        "retry.max.attempts": 4,
        "retry.base.delay.ms": 1,
        "retry.max.delay.ms": 5,
    }
    return open_blob_store(url, options)


def _direct(server: ServerProcess, store: BlobStore) -> Any:
    """A boto3 client on the server itself, to check what is stored without the proxy or the store."""
    import boto3

    return boto3.client("s3", endpoint_url=server.endpoint), store.inner.bucket  # type: ignore[attr-defined]


@contextmanager
def _retried_completion(
    server: ServerProcess, tmp_path: Path, reset: str, answer: str
) -> Iterator[tuple[BlobStore, AnswerRetries, Path]]:
    """A store whose first multipart completion has its connection reset (``reset``: after the server acted, or
    before it saw the request) and whose retries are answered ``ANSWERS[answer]``; the hook; a two-part source
    file."""
    source = tmp_path / "big"
    source.write_bytes(BIG)
    with FaultProxy(server.host, server.port, schedule=fault_requests(reset, match=COMPLETION)) as proxy:
        store = _open(server, proxy)
        retries = AnswerRetries(*ANSWERS[answer])
        store.inner._client.meta.events.register("before-send.s3.CompleteMultipartUpload", retries)  # type: ignore[attr-defined]
        try:
            yield store, retries, source
        finally:
            store.close()


def _uploads_left(client: Any, bucket: str) -> list[str]:
    return [upload["Key"] for upload in client.list_multipart_uploads(Bucket=bucket).get("Uploads") or []]


@pytest.mark.parametrize("answer", list(ANSWERS))
@pytest.mark.parametrize("create_only", [False, True], ids=["overwrite", "create-only"])
def test_a_completion_that_landed_is_success_whatever_the_retry_is_answered(
    s3_server: ServerProcess, tmp_path: Path, answer: str, create_only: bool
) -> None:
    """Seen: 1 of 1,188 ``put_file`` calls failed for good with ``answered 400 ... CompleteMultipartUpload`` although
    the first completion had landed."""
    with _retried_completion(s3_server, tmp_path, RESET_AFTER, answer) as (store, retries, source):
        metrics = Metrics()
        store.use_metrics(metrics)
        store.put_file("f/big", source, create_only=create_only, metadata=META)
        assert retries.calls >= 2 and retries.answered >= 1, "the completion was never retried"
        client, bucket = _direct(s3_server, store)
        stored = client.get_object(Bucket=bucket, Key="p/f/big")
        assert stored["Body"].read() == BIG and stored["Metadata"] == META
        assert _uploads_left(client, bucket) == []
        # decided by one HEAD (the parts' ETag), never by reading the blob's bytes back
        assert metrics.counter("blob_store.requests", operation="get_range", outcome="ok") == 0


@pytest.mark.parametrize("answer", ["400", "404", "no-such-upload"])
def test_a_completion_that_did_not_land_keeps_the_answer(s3_server: ServerProcess, tmp_path: Path, answer: str) -> None:
    """The first completion never reached the server; the retry is refused: nothing is stored, so the refusal is
    the outcome (read back, absent), and the upload is aborted."""
    with _retried_completion(s3_server, tmp_path, RESET_BEFORE, answer) as (store, retries, source):
        with pytest.raises((StorageError, NotFoundError)) as raised:
            store.put_file("f/big", source, metadata=META)
        assert not isinstance(raised.value, TransientStorageError)
        refusal = str(raised.value)
        assert str(retries.status) in refusal or "vanished" in refusal or "not found" in refusal
        client, bucket = _direct(s3_server, store)
        assert client.list_objects_v2(Bucket=bucket, Prefix="p/").get("KeyCount") == 0
        assert _uploads_left(client, bucket) == []


def test_a_completion_refused_over_other_bytes_keeps_the_answer(s3_server: ServerProcess, tmp_path: Path) -> None:
    """The first completion was lost before the server; meanwhile another writer put other bytes under the name; the
    retry is answered a bare 400: the stored blob is not this upload, so the 400 stands and the other bytes stay."""
    source = tmp_path / "big"
    source.write_bytes(BIG)
    with FaultProxy(s3_server.host, s3_server.port, schedule=fault_requests(RESET_BEFORE, match=COMPLETION)) as proxy:
        store = _open(s3_server, proxy)
        client, bucket = _direct(s3_server, store)
        other = BIG[::-1]
        retries = AnswerRetries(400, "")
        original_call = retries.__call__

        def other_writer_first(request: Any, **kwargs: Any) -> AWSResponse | None:
            if retries.calls == 1:  # between the lost completion and its retry
                client.put_object(Bucket=bucket, Key="p/f/big", Body=other, Metadata=META)
            return original_call(request, **kwargs)

        store.inner._client.meta.events.register("before-send.s3.CompleteMultipartUpload", other_writer_first)  # type: ignore[attr-defined]
        try:
            with pytest.raises(StorageError, match="400") as raised:
                store.put_file("f/big", source, metadata=META)
            assert not isinstance(raised.value, TransientStorageError)
            assert client.get_object(Bucket=bucket, Key="p/f/big")["Body"].read() == other
        finally:
            store.close()


@contextmanager
def _retried_swap(server: ServerProcess, reset: str, answer: str) -> Iterator[tuple[BlobStore, Any, AnswerRetries]]:
    """A store whose head ``h/HEAD`` holds a first write (its version returned) and whose next write has its
    connection reset (``reset``: after the server acted, or before it saw the request) and its retries answered
    ``ANSWERS[answer]`` (until ``_unhook``); the hook."""
    with FaultProxy(server.host, server.port, schedule=fault_requests(reset, match=rb"^PUT ", nth=(2,))) as proxy:
        store = _open(server, proxy)
        try:
            first = store.put_if("h/HEAD", b"seq 1, nonce a", version=None)
            retries = AnswerRetries(*ANSWERS[answer])
            store.inner._client.meta.events.register("before-send.s3.PutObject", retries)  # type: ignore[attr-defined]
            yield store, first, retries
        finally:
            store.close()


def _unhook(store: BlobStore, retries: AnswerRetries) -> None:
    store.inner._client.meta.events.unregister("before-send.s3.PutObject", retries)  # type: ignore[attr-defined]


@pytest.mark.parametrize("answer", ["400", "404"])
def test_a_conditional_write_that_landed_is_success_whatever_the_retry_is_answered(
    s3_server: ServerProcess, answer: str
) -> None:
    """``put_if`` (the checkpoint head's compare-and-swap): its first write landed and lost its reply, its retry is
    answered a bare 400 or 404: read back with its version, the head holds this write's bytes: success, and the
    version returned is the stored one (the next swap uses it)."""
    with _retried_swap(s3_server, RESET_AFTER, answer) as (store, first, retries):
        version = store.put_if("h/HEAD", b"seq 2, nonce b", version=first)
        assert retries.answered >= 1, "the conditional write was never retried"
        _unhook(store, retries)
        assert store.get_versioned("h/HEAD") == (b"seq 2, nonce b", version)
        assert store.put_if("h/HEAD", b"seq 3, nonce c", version=version) != version


def test_a_conditional_write_that_did_not_land_keeps_the_answer(s3_server: ServerProcess) -> None:
    """The first write never reached the server and the retry is answered a bare 400: the head is still at the
    version the write was conditional on, so the 400 stands, and the same swap goes through afterwards."""
    with _retried_swap(s3_server, RESET_BEFORE, "400") as (store, first, retries):
        with pytest.raises(StorageError, match="400") as raised:
            store.put_if("h/HEAD", b"seq 2, nonce b", version=first)
        assert not isinstance(raised.value, (TransientStorageError, PreconditionFailedError))
        _unhook(store, retries)
        assert store.get_versioned("h/HEAD") == (b"seq 1, nonce a", first)
        assert store.put_if("h/HEAD", b"seq 2, nonce b", version=first) != first
