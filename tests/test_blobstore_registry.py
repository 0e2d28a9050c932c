"""open_blob_store picks the implementation by URL scheme and says what to fix when it cannot."""

from __future__ import annotations

from pathlib import Path

import pytest

from statebackend.blobstores.base import known_blob_store_schemes, open_blob_store
from statebackend.blobstores.file import FileBlobStore
from statebackend.blobstores.memory import MemoryBlobStore
from statebackend.errors import ConfigError


def test_file_url_opens_a_file_blob_store_at_the_path(tmp_path: Path) -> None:
    with open_blob_store(f"file://{tmp_path}/blobs") as store:
        assert isinstance(store, FileBlobStore)
        store.put("a/b", b"x")
    assert (tmp_path / "blobs" / "a" / "b").read_bytes() == b"x"


def test_file_url_passes_the_create_if_missing_option(tmp_path: Path) -> None:
    store = open_blob_store(f"file://{tmp_path}/absent", {"create.if.missing": "false"})
    assert isinstance(store, FileBlobStore)
    assert store.create is False


def test_an_option_the_scheme_does_not_declare_is_a_config_error_with_did_you_mean(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match="blob.store.create: unknown key; known keys: blob.store.create.if.missing"):
        open_blob_store(f"file://{tmp_path}", {"create": "false"})
    with pytest.raises(ConfigError, match="create.if.mising: unknown key; did you mean blob.store.create.if.missing"):
        open_blob_store(f"file://{tmp_path}", {"create.if.mising": "false"})
    with pytest.raises(ConfigError, match="blob.store.region: unknown key"):
        open_blob_store("memory://x", {"region": "eu-west-1"})


def test_relative_file_url_is_a_config_error() -> None:
    with pytest.raises(ConfigError, match="absolute path"):
        open_blob_store("file://relative/dir")


def test_memory_url_opens_a_shared_named_store() -> None:
    first = open_blob_store("memory://registry-test")
    second = open_blob_store("memory://registry-test")
    assert isinstance(first, MemoryBlobStore)
    first.put("blob", b"shared")
    assert second.get("blob") == b"shared"
    first.delete("blob")


def test_unknown_scheme_error_lists_the_known_schemes() -> None:
    with pytest.raises(ConfigError) as caught:
        open_blob_store("ftp://host/path")
    message = str(caught.value)
    assert "'ftp'" in message
    for scheme in ("file://", "memory://", "az://", "s3://"):
        assert scheme in message
    assert set(known_blob_store_schemes()) >= {"file", "memory", "az", "s3"}


@pytest.mark.parametrize("url", ["", None])
def test_missing_url_error_says_to_set_blob_store_url(url: str | None) -> None:
    with pytest.raises(ConfigError, match=r"blob\.store\.url is missing: set it"):
        open_blob_store(url)  # type: ignore[arg-type]
