"""The az:// blob store against a real Azurite: the blob store contract, create-only and large blocks, validation
messages, and credentials kept out of messages and reprs."""

from __future__ import annotations

import base64
import logging
import uuid
from collections.abc import Iterator

import pytest
from azure.storage.blob import BlobServiceClient

from statebackend.blobstores.base import BlobStore, open_blob_store
from statebackend.blobstores.resilience import ResilientBlobStore
from statebackend.errors import AlreadyExistsError, ConfigError, StorageError
from statebackend.testing.blobstore_contract import BlobStoreContract
from tests.servers import AZURITE_ACCOUNT_KEY, ServerProcess, azurite_connection_string, free_port

pytestmark = pytest.mark.azure


def _container() -> str:
    return f"t{uuid.uuid4().hex[:20]}"


class TestAzureBlobStore(BlobStoreContract):
    state_machine_examples = 10
    state_machine_steps = 15
    listing_names = 250  # past two pages of the fixture's 100 names (the continuation is the same at 5,000)

    @pytest.fixture
    def store(self, azurite_connection: str) -> Iterator[BlobStore]:
        options = {"connection.string": azurite_connection, "create.if.missing": True, "part.size.bytes": 1 << 20}
        with open_blob_store(f"az://{_container()}/some/prefix", options) as store:
            store.create_resources()  # type: ignore[attr-defined]
            store.inner.list_page_size = 100  # type: ignore[attr-defined]  # every listing here crosses pages
            yield store

    def raw_get(self, store: BlobStore, name: str) -> bytes | None:
        assert isinstance(store, ResilientBlobStore)
        inner = store.inner
        client = BlobServiceClient.from_connection_string(
            azurite_connection_string(int(inner._service.url.split(":")[2].split("/")[0]))  # type: ignore[attr-defined]
        )
        blob = client.get_blob_client(inner.container, f"some/prefix/{name}")  # type: ignore[attr-defined]
        if not blob.exists():
            return None
        return bytes(blob.download_blob().readall())


@pytest.fixture
def options(azurite_connection: str) -> dict[str, object]:
    return {"connection.string": azurite_connection, "part.size.bytes": 1 << 20, "max.concurrency": 4}


def test_large_create_only_file_goes_up_in_blocks_and_a_second_one_is_refused(
    options: dict[str, object], tmp_path: pytest.TempPathFactory
) -> None:
    store = open_blob_store(f"az://{_container()}/p", {**options, "create.if.missing": True})
    data = bytes(range(256)) * (5 * 4096 + 7)  # > 5 parts of 1 MiB (the 5 MiB minimum part applies)
    source = tmp_path / "source"  # type: ignore[operator]
    source.write_bytes(data)
    store.put_file("big", source, create_only=True, metadata={"kind": "snapshot"})
    source.write_bytes(b"other")
    with pytest.raises(AlreadyExistsError):
        store.put_file("big", source, create_only=True)
    assert store.get_file("big", tmp_path / "back") == len(data)  # type: ignore[operator]
    assert (tmp_path / "back").read_bytes() == data  # type: ignore[operator]
    assert dict(store.head("big").metadata) == {"kind": "snapshot"}


def test_missing_container_is_a_storage_error_that_says_how_to_fix_it(options: dict[str, object]) -> None:
    name = _container()
    store = open_blob_store(f"az://{name}/p", options)
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


def test_wrong_account_key_is_reported_without_the_key(
    azurite: ServerProcess, caplog: pytest.LogCaptureFixture
) -> None:
    wrong_key = base64.b64encode(b"not the key" * 6).decode()
    connection = azurite_connection_string(azurite.port, account_key=wrong_key)
    caplog.set_level(logging.DEBUG)
    store = open_blob_store(f"az://{_container()}/p", {"connection.string": connection, "retry.max.attempts": 1})
    with pytest.raises(StorageError) as caught:
        store.validate()
    assert "credential" in str(caught.value) and "account key" in str(caught.value)
    with pytest.raises(StorageError) as caught_put:
        store.put("x", b"1")
    for text in [str(caught.value), str(caught_put.value), repr(store), store.describe(), caplog.text]:
        assert wrong_key not in text and wrong_key[:20] not in text
        assert AZURITE_ACCOUNT_KEY[:20] not in text


def test_unreachable_endpoint_is_reported_by_validate() -> None:
    store = open_blob_store(
        f"az://{_container()}/p",
        {"connection.string": azurite_connection_string(free_port()), "request.timeout.ms": 2000},
    )
    with pytest.raises(StorageError) as caught:
        store.validate()
    assert "cannot reach" in str(caught.value) and "endpoint" in str(caught.value)


def test_connection_string_comes_from_the_environment(azurite_connection: str, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("AZURE_STORAGE_CONNECTION_STRING", azurite_connection)
    store = open_blob_store(f"az://{_container()}/p", {"create.if.missing": True})
    store.put("from-env", b"ok")
    assert store.get("from-env") == b"ok"
    assert AZURITE_ACCOUNT_KEY not in repr(store)


def test_missing_credentials_and_unknown_options_are_config_errors(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("AZURE_STORAGE_CONNECTION_STRING", raising=False)
    with pytest.raises(ConfigError, match="AZURE_STORAGE_CONNECTION_STRING"):
        open_blob_store("az://container/p", {})
    with pytest.raises(ConfigError, match="blob.store.conection.string"):
        open_blob_store("az://container/p", {"conection.string": "x"})


def test_malformed_connection_string_error_does_not_echo_it() -> None:
    secret = "AccountKey=" + "s3cr3t" * 8
    with pytest.raises(ConfigError) as caught:
        open_blob_store("az://container/p", {"connection.string": f"garbage;{secret}"})
    assert "s3cr3t" not in str(caught.value)
