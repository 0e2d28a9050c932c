"""The example store on another substrate (examples/sqlite_blobstore, ``sqlite://``), written on the base's raw
operations only, passes the shipped blob store contract as statebackend opens it, and holds what it promises."""

from __future__ import annotations

import sqlite3
from collections.abc import Iterator
from pathlib import Path

import pytest

from statebackend.blobstores.base import BlobStore, blob_store_class, open_blob_store
from statebackend.errors import ConfigError, StorageError, TransientStorageError
from statebackend.testing.blobstore_contract import BlobStoreContract

# examples/sqlite_blobstore is installed by ./dev test (an entry point, as a user's store would be); without it every
# test here fails naming the unknown scheme


def _path(store: BlobStore) -> str:
    assert type(store).__module__ == "sb_sqlite.store", type(store)
    path = getattr(store, "path")  # noqa: B009 - the example's attribute, not part of BlobStore
    assert isinstance(path, str)
    return path


class TestSqliteBlobStore(BlobStoreContract):
    @pytest.fixture
    def store(self, tmp_path: Path) -> Iterator[BlobStore]:
        with open_blob_store(f"sqlite://{tmp_path}/blobs.sqlite") as store:
            yield store

    def raw_get(self, store: BlobStore, name: str) -> bytes | None:
        with sqlite3.connect(_path(store)) as connection:
            row = connection.execute("SELECT data FROM blobs WHERE name = ?", (name,)).fetchone()
        return None if row is None else bytes(row[0])


def test_the_store_implements_raw_operations_only() -> None:
    """Every public operation is the base's template: the example holds no name check or error translation."""
    SqliteBlobStore = blob_store_class("sqlite")  # noqa: N806 - a class
    for public in ["put", "get", "delete", "list", "head", "set_metadata", "delete_many"]:
        assert public not in vars(SqliteBlobStore), public
    for raw in ["_put", "_get", "_delete", "_list", "_head", "_set_metadata", "_delete_many", "_translate_error"]:
        assert raw in vars(SqliteBlobStore), raw


def test_two_opens_of_one_database_share_blobs_and_options_are_used(tmp_path: Path) -> None:
    url = f"sqlite://{tmp_path}/shared.sqlite"
    with open_blob_store(url, {"busy.timeout.ms": "250ms"}) as first, open_blob_store(url) as second:
        first.put("a%b/c_d", b"x")
        assert second.get("a%b/c_d") == b"x"
        assert list(second.list("a%")) == ["a%b/c_d"]
        assert _path(first) == f"{tmp_path}/shared.sqlite"
        assert getattr(first, "busy_timeout_ms") == 250  # noqa: B009 - the example's attribute


@pytest.mark.parametrize("url", ["sqlite://host/x.db", "sqlite://relative.db", "sqlite:///dir/", "sqlite:///x?a=1"])
def test_a_url_without_an_absolute_file_path_is_a_config_error(url: str) -> None:
    with pytest.raises(ConfigError, match="sqlite:///<absolute path"):
        open_blob_store(url)


def test_a_missing_database_is_refused_when_it_may_not_be_created(tmp_path: Path) -> None:
    with pytest.raises(StorageError, match="create.if.missing"):
        open_blob_store(f"sqlite://{tmp_path}/missing.sqlite", {"create.if.missing": "false"})
    assert not (tmp_path / "missing.sqlite").exists()


def test_a_busy_database_is_a_transient_error_naming_the_store(tmp_path: Path) -> None:
    """The base's template maps SQLite's 'database is locked' through the store's ``_translate_error``."""
    path = tmp_path / "busy.sqlite"
    with open_blob_store(f"sqlite://{path}", {"busy.timeout.ms": "0ms"}) as store:
        store.put("blob", b"old")
        holder = sqlite3.connect(path, isolation_level=None)
        holder.execute("BEGIN IMMEDIATE")  # another writer holds the write lock
        try:
            with pytest.raises(TransientStorageError, match="busy") as caught:
                store.put("blob", b"new")
            assert str(path) in str(caught.value)
            assert type(caught.value.__cause__).__name__ == "RedactedError"
        finally:
            holder.execute("ROLLBACK")
            holder.close()
        assert store.get("blob") == b"old"
