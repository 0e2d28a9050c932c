"""The in-memory blob store passes the blob store contract, checked against its dict."""

from __future__ import annotations

from collections.abc import Iterator

import pytest

from statebackend.blobstores.base import BlobStore
from statebackend.blobstores.memory import MemoryBlobStore
from statebackend.testing.blobstore_contract import BlobStoreContract


class TestMemoryBlobStore(BlobStoreContract):
    @pytest.fixture
    def store(self) -> Iterator[BlobStore]:
        with MemoryBlobStore() as store:
            yield store

    def raw_get(self, store: BlobStore, name: str) -> bytes | None:
        assert isinstance(store, MemoryBlobStore)
        entry = store._blobs.get(name)
        return None if entry is None else entry[0]


def test_two_opens_of_one_named_store_share_blobs() -> None:
    first = MemoryBlobStore("shared-for-test")
    second = MemoryBlobStore("shared-for-test")
    first.put("blob", b"x")
    assert second.get("blob") == b"x"
    assert list(MemoryBlobStore().list()) == []
    first.delete("blob")
