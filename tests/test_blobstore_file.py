"""The file:// blob store passes the blob store contract, checked against the files on disk, plus what only a
directory has: temp files, the metadata sidecar, the root, a blob and a directory of the same name."""

from __future__ import annotations

import os
from collections.abc import Iterator
from pathlib import Path

import attrs
import pytest

from statebackend import cli
from statebackend.blobstores.base import BlobStore, open_blob_store
from statebackend.blobstores.file import RESERVED_PREFIX, FileBlobStore
from statebackend.errors import ConfigError, NotFoundError, StorageError
from statebackend.task import TaskStorage
from statebackend.testing.blobstore_contract import BAD_NAMES, BlobStoreContract


class TestFileBlobStore(BlobStoreContract):
    @pytest.fixture
    def store(self, tmp_path: Path) -> Iterator[BlobStore]:
        with FileBlobStore(tmp_path / "root") as store:
            yield store

    def raw_get(self, store: BlobStore, name: str) -> bytes | None:
        assert isinstance(store, FileBlobStore)
        path = Path(store.root, *name.split("/"))
        return path.read_bytes() if path.is_file() else None


def _files_under(directory: Path) -> list[str]:
    return sorted(str(p.relative_to(directory)) for p in directory.rglob("*") if p.is_file())


def test_blob_is_a_plain_file_under_the_root(tmp_path: Path) -> None:
    store = FileBlobStore(tmp_path)
    store.put("a/b/c", b"bytes", metadata={"kind": "delta"})
    assert (tmp_path / "a" / "b" / "c").read_bytes() == b"bytes"
    assert [p for p in _files_under(tmp_path) if not p.startswith(RESERVED_PREFIX)] == ["a/b/c"]


def test_a_stray_temp_file_left_by_a_crash_is_never_listed_or_read(tmp_path: Path) -> None:
    store = FileBlobStore(tmp_path)
    store.put("dir/real", b"x")
    (tmp_path / "dir" / f"{RESERVED_PREFIX}tmp.deadbeef").write_bytes(b"half written")
    (tmp_path / f"{RESERVED_PREFIX}tmp.cafe").write_bytes(b"half written")
    (tmp_path / "crashed").mkdir()
    (tmp_path / "crashed" / f"{RESERVED_PREFIX}tmp.0123").write_bytes(b"half")
    assert list(store.list()) == ["dir/real"]
    assert list(store.list("dir/")) == ["dir/real"]
    assert list(store.list("dir/" + RESERVED_PREFIX)) == []
    store.delete("dir/real")
    assert list(store.list()) == []


def test_a_put_if_lock_file_is_never_listed_nor_an_abandoned_upload(tmp_path: Path) -> None:
    """``put_if`` locks ``<dir>/.statebackend~lock.<name>``, which stays (removing it would race with a waiter):
    like a temp file it is the store's own, skipped by every listing (a checkpoint log lists ``checkpoints/``)."""
    store = FileBlobStore(tmp_path)
    head = "job/task-0/checkpoints/HEAD.v3.json"
    version = store.put_if(head, b"1", version=None)
    store.put_if(head, b"2", version=version)
    store.put("job/task-0/checkpoints/000000000001.v2.json", b"marker")
    lock = tmp_path / "job" / "task-0" / "checkpoints" / f"{RESERVED_PREFIX}lock.HEAD.v3.json"
    assert lock.is_file()  # the case this test is about
    names = ["job/task-0/checkpoints/000000000001.v2.json", head]
    for prefix in ("", "job/", "job/task-0/checkpoints/", "job/task-0/checkpoints/0", "job/task-0/checkpoints/H"):
        assert list(store.list(prefix)) == [n for n in names if n.startswith(prefix)], prefix
    for prefix in ("job/task-0/checkpoints/.", f"job/task-0/checkpoints/{RESERVED_PREFIX}"):
        assert list(store.list(prefix)) == [], prefix
    assert store.abandoned_uploads("job/") == []
    assert store.get(head) == b"2"
    store.delete(head)
    assert list(store.list("job/task-0/checkpoints/")) == names[:1]


def test_metadata_files_are_never_listed(tmp_path: Path) -> None:
    store = FileBlobStore(tmp_path)
    store.put("x", b"1", metadata={"kind": "delta"})
    assert (tmp_path / f"{RESERVED_PREFIX}meta").is_dir()
    assert list(store.list()) == ["x"]
    assert list(store.list(".")) == []


def test_delete_removes_the_metadata_file_and_empty_directories(tmp_path: Path) -> None:
    store = FileBlobStore(tmp_path)
    store.put("deep/er/blob", b"1", metadata={"kind": "delta"})
    store.put("deep/keep", b"2")
    store.delete("deep/er/blob")
    assert _files_under(tmp_path) == ["deep/keep"]
    assert not (tmp_path / "deep" / "er").exists()


def test_overwrite_leaves_no_orphan_metadata_or_temp_files(tmp_path: Path) -> None:
    store = FileBlobStore(tmp_path)
    for i in range(5):
        store.put("blob", str(i).encode(), metadata={"version": str(i)})
    meta_files = [p for p in _files_under(tmp_path) if p.startswith(RESERVED_PREFIX)]
    assert len(meta_files) == 1
    assert dict(store.head("blob").metadata) == {"version": "4"}
    assert [p for p in _files_under(tmp_path) if not p.startswith(RESERVED_PREFIX)] == ["blob"]


def test_metadata_of_a_replaced_file_does_not_leak_to_the_new_blob(tmp_path: Path) -> None:
    """Metadata follows the file: a blob swapped in behind the store's back has none of the old metadata."""
    store = FileBlobStore(tmp_path)
    store.put("blob", b"old", metadata={"kind": "old"})
    replacement = tmp_path / "replacement"
    replacement.write_bytes(b"new")
    os.replace(replacement, tmp_path / "blob")
    assert dict(store.head("blob").metadata) == {}
    assert store.get("blob") == b"new"


def test_reserved_names_are_rejected(tmp_path: Path) -> None:
    store = FileBlobStore(tmp_path)
    for name in [f"{RESERVED_PREFIX}meta/x", f"a/{RESERVED_PREFIX}tmp.1", RESERVED_PREFIX]:
        with pytest.raises(ConfigError, match="reserves"):
            store.put(name, b"x")
    assert _files_under(tmp_path) == []


@pytest.mark.parametrize("name", [n for n in BAD_NAMES if n], ids=repr)
def test_bad_names_write_nothing_anywhere_near_the_root(tmp_path: Path, name: str) -> None:
    root = tmp_path / "inside" / "root"
    store = FileBlobStore(root)
    with pytest.raises(ConfigError):
        store.put(name, b"escaped")
    assert _files_under(tmp_path) == []
    assert not root.exists()


def test_missing_root_without_create_raises_storage_error_saying_how_to_fix(tmp_path: Path) -> None:
    store = FileBlobStore(tmp_path / "missing", create=False)
    for attempt in [lambda: store.put("x", b"1"), lambda: list(store.list()), lambda: store.get("x")]:
        with pytest.raises(StorageError, match="does not exist; create it"):
            attempt()
    assert not (tmp_path / "missing").exists()


def test_missing_root_is_created_on_first_use_by_default(tmp_path: Path) -> None:
    store = FileBlobStore(tmp_path / "made" / "here")
    assert not (tmp_path / "made").exists()  # no I/O when constructed
    store.put("x", b"1")
    assert (tmp_path / "made" / "here" / "x").read_bytes() == b"1"


def test_create_root_makes_the_directory_for_a_store_opened_without_create(tmp_path: Path) -> None:
    store = FileBlobStore(tmp_path / "later", create=False)
    store.create_root()
    store.create_root()
    store.put("x", b"1")
    assert store.get("x") == b"1"


def test_unwritable_root_raises_storage_error_naming_the_path(tmp_path: Path) -> None:
    root = tmp_path / "root"
    root.mkdir()
    (root / "blocker").write_bytes(b"a file where a directory should be")
    store = FileBlobStore(root / "blocker" / "inner")
    with pytest.raises(StorageError, match="blocker"):
        store.put("x", b"1")


def test_a_blob_and_names_under_it_cannot_coexist(tmp_path: Path) -> None:
    store = FileBlobStore(tmp_path)
    store.put("a", b"file")
    with pytest.raises(StorageError, match="cannot hold a blob and names under it"):
        store.put("a/b", b"child")
    store.put("c/d", b"child")
    with pytest.raises(StorageError, match="cannot hold a blob and names under it"):
        store.put("c", b"file")
    with pytest.raises(StorageError, match="cannot hold a blob and names under it"):
        store.put("c", b"file", create_only=True)
    assert list(store.list()) == ["a", "c/d"]
    assert store.get("a") == b"file"
    assert [p for p in os.listdir(tmp_path) if p.startswith(RESERVED_PREFIX + "tmp")] == []


def test_put_file_of_a_missing_local_file_raises_not_found_and_writes_nothing(tmp_path: Path) -> None:
    store = FileBlobStore(tmp_path / "root")
    with pytest.raises(NotFoundError, match="local file"):
        store.put_file("x", tmp_path / "no-such-file")
    assert list(store.list()) == []


def test_from_url_opens_an_absolute_path(tmp_path: Path) -> None:
    store = open_blob_store(f"file://{tmp_path}/blobs")
    assert isinstance(store, FileBlobStore)
    assert store.root == str(tmp_path / "blobs")
    assert store.url == f"file://{tmp_path}/blobs"
    assert store.create is True
    absent = open_blob_store(f"file://localhost{tmp_path}", {"create.if.missing": "false"})
    assert isinstance(absent, FileBlobStore) and absent.create is False


@pytest.mark.parametrize("url", ["file://relative/dir", "file:relative", "file://", "file:"])
def test_from_url_without_an_absolute_path_is_a_config_error(url: str) -> None:
    with pytest.raises(ConfigError, match="file:///"):
        open_blob_store(url)


def test_from_url_with_a_bad_create_option_is_a_config_error(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match="blob.store.create.if.missing='maybe' is not valid"):
        open_blob_store(f"file://{tmp_path}", {"create.if.missing": "maybe"})


def test_create_if_missing_false_fails_open_and_validate_on_a_missing_directory_and_creates_nothing(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    # seen: file:// ignored blob.store.create.if.missing (its own `create` option could not be set), so a missing
    # (unmounted) directory was created empty and `statebackend validate` said OK
    root = tmp_path / "mnt" / "share"
    config = {
        "blob.store.url": f"file://{root}",
        "blob.store.create.if.missing": "false",
        "state.local.dir": str(tmp_path / "local"),
        "stores.counts.backup.factories": "changelog",
    }
    with pytest.raises(StorageError) as opened:
        TaskStorage.open(config, "task-0")
    properties = tmp_path / "job.properties"
    properties.write_text("".join(f"{key}={value}\n" for key, value in config.items()))
    assert cli.main(["validate", str(properties)]) == 1
    validated = capsys.readouterr().err
    for message in (str(opened.value), validated):
        assert str(root) in message
        assert "does not exist" in message and "blob.store.create.if.missing=true" in message
    assert not (tmp_path / "mnt").exists()  # nothing of the blob store was created


def test_a_crashed_writer_s_temp_file_is_an_abandoned_upload_and_only_it_is_removed(tmp_path: Path) -> None:
    store = FileBlobStore(tmp_path)
    store.put("job/task/a", b"finished", metadata={"created_at": "1"})
    temp = tmp_path / "job" / "task" / f"{RESERVED_PREFIX}tmp.0123456789abcdef"
    temp.write_bytes(b"half")
    os.utime(temp, (1_000_000.0, 1_000_000.0))
    (found,) = store.abandoned_uploads("job/")
    assert found.kind == "temp file" and found.name == f"job/task/{RESERVED_PREFIX}tmp.0123456789abcdef"
    assert found.size == 4 and found.age_s is not None and found.age_s > 86400
    assert store.abandoned_uploads("other/") == []
    outside = tmp_path.parent / f"{RESERVED_PREFIX}tmp.outside"
    outside.write_bytes(b"not ours")
    with pytest.raises(StorageError, match="not a temp file"):
        store.remove_abandoned_upload(attrs.evolve(found, handle=str(outside)))
    with pytest.raises(StorageError, match="not a temp file"):
        store.remove_abandoned_upload(attrs.evolve(found, handle=str(tmp_path / "job" / "task" / "a")))
    store.remove_abandoned_upload(found)
    store.remove_abandoned_upload(found)  # idempotent
    assert not temp.exists() and outside.exists() and store.get("job/task/a") == b"finished"
    assert store.abandoned_uploads("") == []
