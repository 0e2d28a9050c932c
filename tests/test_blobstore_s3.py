"""The s3:// blob store against moto's real S3 server: the blob store contract, create-only (412) and multipart
create-only, validation messages, and boto3's default credential and endpoint chain."""

from __future__ import annotations

import uuid
from collections.abc import Iterator
from pathlib import Path

import boto3
import pytest

from statebackend.blobstores.base import BlobStore, open_blob_store
from statebackend.blobstores.resilience import ResilientBlobStore
from statebackend.errors import AlreadyExistsError, ConfigError, StorageError
from statebackend.testing.blobstore_contract import BlobStoreContract
from tests.servers import ServerProcess, free_port

pytestmark = pytest.mark.s3


def _bucket() -> str:
    return f"t-{uuid.uuid4().hex[:20]}"


class TestS3BlobStore(BlobStoreContract):
    state_machine_examples = 10
    state_machine_steps = 15
    listing_names = 250  # past two pages of the fixture's 100 names (the continuation is the same at 1,000)

    @pytest.fixture
    def store(self, s3_server: ServerProcess) -> Iterator[BlobStore]:
        options = {"endpoint.url": s3_server.endpoint, "create.if.missing": True, "part.size.bytes": 5 << 20}
        with open_blob_store(f"s3://{_bucket()}/some/prefix", options) as store:
            store.create_resources()  # type: ignore[attr-defined]
            store.inner.list_page_size = 100  # type: ignore[attr-defined]  # every listing here crosses pages
            yield store

    def raw_get(self, store: BlobStore, name: str) -> bytes | None:
        assert isinstance(store, ResilientBlobStore)
        inner = store.inner
        client = boto3.client("s3", endpoint_url=inner._client.meta.endpoint_url)  # type: ignore[attr-defined]
        try:
            response = client.get_object(Bucket=inner.bucket, Key=f"some/prefix/{name}")  # type: ignore[attr-defined]
        except client.exceptions.NoSuchKey:
            return None
        return bytes(response["Body"].read())


@pytest.fixture
def options(s3_server: ServerProcess) -> dict[str, object]:
    return {"endpoint.url": s3_server.endpoint, "part.size.bytes": 5 << 20, "max.concurrency": 4}


def test_large_create_only_file_goes_up_in_parts_and_a_second_one_is_refused(
    options: dict[str, object], tmp_path: Path
) -> None:
    store = open_blob_store(f"s3://{_bucket()}/p", {**options, "create.if.missing": True})
    data = bytes(range(256)) * (12 * 4096 + 7)  # three parts of 5 MiB
    source = tmp_path / "source"
    source.write_bytes(data)
    store.put_file("big", source, create_only=True, metadata={"kind": "snapshot"})
    source.write_bytes(data[::-1])
    with pytest.raises(AlreadyExistsError):
        store.put_file("big", source, create_only=True)
    assert store.get_file("big", tmp_path / "back") == len(data)
    assert (tmp_path / "back").read_bytes() == data
    assert dict(store.head("big").metadata) == {"kind": "snapshot"}
    inner = store.inner  # type: ignore[attr-defined]
    uploads = inner._client.list_multipart_uploads(Bucket=inner.bucket).get("Uploads", [])
    assert uploads == []  # the refused upload was aborted, nothing left behind


def test_missing_bucket_is_a_storage_error_that_says_how_to_fix_it(options: dict[str, object]) -> None:
    name = _bucket()
    store = open_blob_store(f"s3://{name}/p", options)
    with pytest.raises(StorageError) as caught:
        store.validate()
    assert name in str(caught.value) and "blob.store.create.if.missing=true" in str(caught.value)
    with pytest.raises(StorageError) as caught:
        store.put("x", b"1")
    assert name in str(caught.value) and "create it" in str(caught.value)
    store.create_resources()
    store.create_resources()  # idempotent
    store.validate()
    store.put("x", b"1")
    assert store.get("x") == b"1"


def test_unreachable_endpoint_is_reported_by_validate(s3_server: ServerProcess) -> None:
    store = open_blob_store(
        f"s3://{_bucket()}/p", {"endpoint.url": f"http://127.0.0.1:{free_port()}", "request.timeout.ms": 2000}
    )
    with pytest.raises(StorageError) as caught:
        store.validate()
    assert "cannot reach" in str(caught.value) and "blob.store.endpoint.url" in str(caught.value)


def test_endpoint_and_credentials_come_from_the_environment(
    s3_server: ServerProcess, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    secret = "env-secret-" + uuid.uuid4().hex
    monkeypatch.setenv("AWS_ENDPOINT_URL", s3_server.endpoint)
    monkeypatch.setenv("AWS_ACCESS_KEY_ID", "env-key")
    monkeypatch.setenv("AWS_SECRET_ACCESS_KEY", secret)
    caplog.set_level("DEBUG", logger="statebackend")
    store = open_blob_store(f"s3://{_bucket()}/p", {"create.if.missing": True})
    store.put("from-env", b"ok")
    assert store.get("from-env") == b"ok"
    with pytest.raises(AlreadyExistsError) as caught:
        store.put("from-env", b"again", create_only=True)
    for text in [repr(store), store.describe(), str(caught.value), caplog.text]:
        assert secret not in text


def test_unknown_profile_and_unknown_options_are_config_errors(s3_server: ServerProcess) -> None:
    with pytest.raises(ConfigError, match="profile"):
        open_blob_store("s3://bucket/p", {"profile": f"no-such-profile-{uuid.uuid4().hex}"})
    with pytest.raises(ConfigError, match="blob.store.endpoint.uri"):
        open_blob_store("s3://bucket/p", {"endpoint.uri": "http://x"})
