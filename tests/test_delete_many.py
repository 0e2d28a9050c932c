"""``BlobStore.delete_many``: one request for many names where the service has one (S3 DeleteObjects, 1,000 keys a
request; Azure Blob Batch, 256), through the resilience layer, absent names success, partial failures reported
naming the names not deleted and retried for those names alone when transient, replies that do not account for every
name taken as cut (transient), SDK errors translated like every other call. The stores' fault behaviour under cut
and reset replies is in tests/test_sdk_faults.py (operation ``delete_many``); the contract suite checks the basic
semantics for every store. Names that need escaping (XML in DeleteObjects, a URL path in each Azure sub-request)
delete exactly themselves, and DeleteObjects carries a Content-MD5."""

from __future__ import annotations

import base64
import hashlib
import uuid
from collections.abc import Callable
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest

from statebackend.blobstores.azure import AzureBlobStore
from statebackend.blobstores.base import BlobStore, open_blob_store
from statebackend.blobstores.file import FileBlobStore
from statebackend.blobstores.memory import MemoryBlobStore
from statebackend.blobstores.resilience import ResilientBlobStore
from statebackend.blobstores.s3 import S3BlobStore
from statebackend.errors import ConfigError, StorageError, TransientStorageError
from statebackend.metrics import Metrics
from tests.servers import ServerProcess, azurite_connection_string


def requests(metrics: Metrics, operation: str) -> float:
    return metrics.counter("blob_store.requests", operation=operation)


def counted(inner: BlobStore) -> tuple[ResilientBlobStore, Metrics]:
    store = ResilientBlobStore(inner, base_delay_s=0, max_delay_s=0)
    metrics = Metrics()
    store.use_metrics(metrics)
    return store, metrics


@pytest.mark.parametrize(
    "make", [lambda tmp: MemoryBlobStore(), lambda tmp: FileBlobStore(tmp / "blobs")], ids=["memory", "file"]
)
def test_a_batch_is_one_request_and_absent_names_are_success(tmp_path: Path, make: Callable[[Path], BlobStore]) -> None:
    store, metrics = counted(make(tmp_path))
    for i in range(5):
        store.put(f"x/{i}", b"x")
    store.delete_many(["x/0", "x/2", "x/absent", "x/4", "x/0"])
    assert list(store.list("x/")) == ["x/1", "x/3"]
    assert requests(metrics, "delete_many") == 1 and requests(metrics, "delete") == 0
    store.delete_many([])
    assert requests(metrics, "delete_many") == 1, "no names: no request"


def test_a_bad_name_is_refused_before_anything_is_deleted() -> None:
    inner = MemoryBlobStore()
    inner.put("keep", b"x")
    with pytest.raises(ConfigError, match=r"\.\."):
        inner.delete_many(["keep", "../escape"])
    assert inner.exists("keep")


# -- S3: a scripted client, so partial failures are exact ------------------------------------------------------------


class ScriptedS3:
    """A boto3 client stand-in answering ``delete_objects`` from a script of reply makers (one per call)."""

    def __init__(self, *replies: Callable[[list[str]], Any]) -> None:
        self.meta = SimpleNamespace(endpoint_url="http://scripted")
        self.replies = list(replies)
        self.calls: list[list[str]] = []

    def delete_objects(self, *, Bucket: str, Delete: dict[str, Any]) -> dict[str, Any]:  # boto3 names them so
        keys = [item["Key"] for item in Delete["Objects"]]
        assert Delete["Quiet"] is False, "every key's result is needed to tell a cut reply"
        self.calls.append(keys)
        reply = self.replies.pop(0)(keys)
        if isinstance(reply, BaseException):
            raise reply
        return reply


def all_deleted(keys: list[str]) -> dict[str, Any]:
    return {"Deleted": [{"Key": key} for key in keys]}


def failing(code: str, *failed: str) -> Callable[[list[str]], dict[str, Any]]:
    def reply(keys: list[str]) -> dict[str, Any]:
        bad = [key for key in keys if key.rsplit("/", 1)[-1] in failed]
        return {
            "Deleted": [{"Key": key} for key in keys if key not in bad],
            "Errors": [{"Key": key, "Code": code, "Message": "scripted"} for key in bad],
        }

    return reply


def s3_store(client: ScriptedS3) -> tuple[ResilientBlobStore, Metrics]:
    return counted(S3BlobStore(client, "bucket", "root", url="s3://bucket/root"))


def test_s3_a_transient_partial_failure_is_retried_for_the_failed_names_only() -> None:
    client = ScriptedS3(failing("SlowDown", "b", "c"), all_deleted)
    store, metrics = s3_store(client)
    store.delete_many(["a", "b", "c", "d"])
    assert client.calls == [["root/a", "root/b", "root/c", "root/d"], ["root/b", "root/c"]]
    assert requests(metrics, "delete_many") == 1
    assert metrics.counter("blob_store.retries", operation="delete_many") == 1


def test_s3_a_refused_name_is_a_storage_error_naming_it_and_not_retried() -> None:
    client = ScriptedS3(failing("AccessDenied", "b"))
    store, _ = s3_store(client)
    with pytest.raises(StorageError, match=r"did not delete 1 of 3 blobs \('b'\): AccessDenied") as caught:
        store.delete_many(["a", "b", "c"])
    assert not isinstance(caught.value, TransientStorageError)
    assert len(client.calls) == 1


def test_s3_no_such_key_counts_as_deleted() -> None:
    client = ScriptedS3(failing("NoSuchKey", "b"))
    store, _ = s3_store(client)
    store.delete_many(["a", "b"])
    assert len(client.calls) == 1


def test_s3_a_reply_missing_a_key_is_cut_and_retried_whole() -> None:
    client = ScriptedS3(lambda keys: {"Deleted": [{"Key": keys[0]}]}, all_deleted)
    store, _ = s3_store(client)
    store.delete_many(["a", "b", "c"])
    assert client.calls[1] == ["root/a", "root/b", "root/c"], "nothing in a cut reply is taken as done"
    inner = S3BlobStore(ScriptedS3(lambda keys: {}), "bucket", url="s3://bucket")
    with pytest.raises(TransientStorageError, match="DeleteObjects reply .* lacks a result for each of its 2 keys"):
        inner.delete_many(["a", "b"])


def test_s3_sdk_errors_are_translated() -> None:
    from botocore.exceptions import ClientError

    denied = ClientError(
        {"Error": {"Code": "AccessDenied", "Message": "no"}, "ResponseMetadata": {"HTTPStatusCode": 403}},
        "DeleteObjects",
    )
    busy = ClientError(
        {"Error": {"Code": "InternalError", "Message": "busy"}, "ResponseMetadata": {"HTTPStatusCode": 500}},
        "DeleteObjects",
    )
    store = S3BlobStore(
        ScriptedS3(lambda keys: denied, lambda keys: busy, lambda keys: ValueError("cut")), "bucket", url="s3://bucket"
    )
    with pytest.raises(StorageError, match="refused the credentials") as refused:
        store.delete_many(["a"])
    assert not isinstance(refused.value, TransientStorageError)
    with pytest.raises(TransientStorageError, match="answered 500 InternalError"):
        store.delete_many(["a"])
    with pytest.raises(TransientStorageError, match="cut short or malformed"):
        store.delete_many(["a"])


def test_s3_batches_of_a_thousand() -> None:
    client = ScriptedS3(*[all_deleted] * 3)
    store, metrics = s3_store(client)
    store.delete_many([f"n/{i:05d}" for i in range(2500)])
    assert [len(call) for call in client.calls] == [1000, 1000, 500]
    assert requests(metrics, "delete_many") == 3


# -- Azure: a scripted container client --------------------------------------------------------------------------


class Answer:
    def __init__(self, status: int, code: str = "") -> None:
        self.status_code = status
        self.headers = {"x-ms-error-code": code} if code else {}


class ScriptedContainer:
    """A container client stand-in answering ``delete_blobs`` from a script of (path -> Answer) makers."""

    def __init__(self, *replies: Callable[[list[str]], Any]) -> None:
        self.replies = list(replies)
        self.calls: list[list[str]] = []

    def delete_blobs(self, *paths: str, raise_on_any_failure: bool) -> Any:
        assert raise_on_any_failure is False
        self.calls.append(list(paths))
        reply = self.replies.pop(0)(list(paths))
        if isinstance(reply, BaseException):
            raise reply
        return iter(reply)


def azure_store(container: ScriptedContainer) -> tuple[ResilientBlobStore, Metrics]:
    service = SimpleNamespace(get_container_client=lambda name: container, account_name="scripted")
    return counted(AzureBlobStore(service, "container", "root", url="az://container/root"))  # type: ignore[arg-type]


def answers(**by_name: Answer) -> Callable[[list[str]], list[Answer]]:
    return lambda paths: [by_name.get(path.rsplit("/", 1)[-1], Answer(202)) for path in paths]


def test_azure_absent_is_success_and_throttled_names_are_retried_alone() -> None:
    container = ScriptedContainer(answers(b=Answer(404, "BlobNotFound"), c=Answer(503, "ServerBusy")), answers())
    store, metrics = azure_store(container)
    store.delete_many(["a", "b", "c"])
    assert container.calls == [["root/a", "root/b", "root/c"], ["root/c"]]
    assert requests(metrics, "delete_many") == 1


def test_azure_refusals_and_a_missing_container_are_storage_errors() -> None:
    store, _ = azure_store(ScriptedContainer(answers(b=Answer(403, "AuthorizationPermissionMismatch"))))
    with pytest.raises(StorageError, match=r"did not delete 1 of 2 blobs \('b'\).*delete permission") as caught:
        store.delete_many(["a", "b"])
    assert not isinstance(caught.value, TransientStorageError)
    store, _ = azure_store(ScriptedContainer(answers(a=Answer(404, "ContainerNotFound"))))
    with pytest.raises(StorageError, match="container 'container' does not exist"):
        store.delete_many(["a"])


def test_azure_a_reply_short_of_answers_is_cut_and_retried_whole() -> None:
    container = ScriptedContainer(lambda paths: [Answer(202)], answers())
    store, _ = azure_store(container)
    store.delete_many(["a", "b"])
    assert container.calls == [["root/a", "root/b"], ["root/a", "root/b"]]


def test_azure_batches_of_256() -> None:
    container = ScriptedContainer(*[answers()] * 3)
    store, metrics = azure_store(container)
    store.delete_many([f"n/{i:04d}" for i in range(600)])
    assert [len(call) for call in container.calls] == [256, 256, 88]
    assert requests(metrics, "delete_many") == 3


# -- the real servers ----------------------------------------------------------------------------------------------


def server_store(cloud: str, server: ServerProcess, bucket: str | None = None, prefix: str = "p") -> BlobStore:
    """A store on the S3 server or Azurite, in ``bucket`` (a new one when None) under ``prefix``, created."""
    bucket = bucket or f"d{uuid.uuid4().hex[:12]}"
    if cloud == "s3":
        url, options = f"s3://{bucket}/{prefix}", {"endpoint.url": server.endpoint}
    else:
        url, options = f"az://{bucket}/{prefix}", {"connection.string": azurite_connection_string(server.port)}
    store = open_blob_store(url, {**options, "create.if.missing": True})
    store.create_resources()
    return store


@pytest.mark.parametrize(
    "cloud", [pytest.param("s3", marks=pytest.mark.s3), pytest.param("azure", marks=pytest.mark.azure)]
)
def test_on_the_server_many_names_go_in_few_requests(cloud: str, request: pytest.FixtureRequest) -> None:
    server = request.getfixturevalue("s3_server" if cloud == "s3" else "azurite")
    store = server_store(cloud, server)
    metrics = Metrics()
    store.use_metrics(metrics)
    names = [f"many/{i:04d}" for i in range(300)]
    try:
        for name in names:
            store.put(name, b"x")
        store.put("many/kept", b"x")
        store.delete_many([*names, "many/absent"])
        assert list(store.list("many/")) == ["many/kept"]
        assert requests(metrics, "delete_many") == (1 if cloud == "s3" else 2)
        assert requests(metrics, "delete") == 0
    finally:
        store.close()


_ODD = [
    "sp ace/a",
    "pct%20x",
    "plus+x",
    "hash#x",
    "q?x=1",
    "amp&x",
    "lt<x>",
    "quote'\"x",
    "é/ü",
    "semi;x",
    "tilde~x",
    "pct%2Fx",
    "colon:x",
    "at@x",
]
_DECOYS = ["pct x", "plus x", "hash", "q", "pct/x"]


@pytest.mark.parametrize(
    "cloud", [pytest.param("s3", marks=pytest.mark.s3), pytest.param("azure", marks=pytest.mark.azure)]
)
def test_delete_many_deletes_exactly_names_that_need_escaping(cloud: str, request: pytest.FixtureRequest) -> None:
    server = request.getfixturevalue("s3_server" if cloud == "s3" else "azurite")
    bucket = f"r{uuid.uuid4().hex[:12]}"
    store = server_store(cloud, server, bucket, "p")
    sibling = server_store(cloud, server, bucket, "p2")  # same names under another root: none of its business
    try:
        odd = [f"odd/{name}" for name in _ODD]
        for name in [*odd, *(f"odd/{decoy}" for decoy in _DECOYS)]:
            store.put(name, b"x")
            sibling.put(name, b"x")
        store.delete_many(odd)
        assert sorted(store.list("odd/")) == sorted(f"odd/{n}" for n in _DECOYS)
        assert sorted(sibling.list("odd/")) == sorted([*odd, *(f"odd/{n}" for n in _DECOYS)])
    finally:
        store.close()
        sibling.close()


@pytest.mark.s3
def test_s3_delete_objects_carries_a_content_md5(s3_server: ServerProcess) -> None:
    """DeleteObjects is the one S3 request that must carry a body checksum. botocore (1.36 on) sends only a CRC32
    header; S3-compatible servers that follow the older rule refuse it ("MissingContentMD5"), and there every delete
    of retention, the sweeps and a fenced write's clean-up would fail (a per-name DELETE needed none). The request
    carries the Content-MD5 of its body as well, which S3 itself accepts."""
    store = server_store("s3", s3_server, f"r{uuid.uuid4().hex[:12]}", "p")
    seen: list[tuple[Any, Any]] = []

    def capture(request: Any, **_: Any) -> None:
        seen.append((request.headers.get("Content-MD5"), request.body))

    inner = store.inner if hasattr(store, "inner") else store
    assert isinstance(inner, S3BlobStore)
    inner._client.meta.events.register("before-send.s3.DeleteObjects", capture)
    try:
        store.put("a", b"x")
        store.delete_many(["a", "b"])
        assert list(store.list("")) == []
        assert len(seen) == 1
        md5, body = seen[0]
        body = body if isinstance(body, bytes) else body.encode() if isinstance(body, str) else body.read()
        assert md5 is not None, "DeleteObjects sent without Content-MD5"
        md5 = md5.decode() if isinstance(md5, bytes) else md5
        assert md5 == base64.b64encode(hashlib.md5(body).digest()).decode()
    finally:
        store.close()
