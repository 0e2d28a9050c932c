"""A restore hashes an environment-file base on a thread of its own (statebackend/envbase.py, issue 32): the digest
and a caller's content hash still see every byte in order, so an intact base restores with the blob's exact content
hash, and a base with one body byte changed is refused, with a pool (hashing threaded) as without one."""

from __future__ import annotations

import hashlib
import os
import struct
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest

from statebackend import envbase
from statebackend.blobstores.memory import MemoryBlobStore
from statebackend.envbase import BlobSource, restore_env_base
from statebackend.errors import CorruptDataError
from statebackend.recordfile import TRAILER_SIZE, FileHeader, content_of
from statebackend.store import LocalStore, LocalVersion

KEY = struct.Struct(">Q")
V1 = LocalVersion("1-1", "aaaa")


def lineage() -> FileHeader:
    return FileHeader(
        kind="snapshot", job="j", task="t", store="s", checkpoint_id="1-1", token="aaaa", seq=5, base_seq=5
    )


def filled_store(path: Path, keys: int, *, value: bytes = b"v") -> LocalStore:
    store = LocalStore.open(path, name="s")
    store.replace_contents(((KEY.pack(i), value + KEY.pack(i)) for i in range(keys)), V1)
    return store


def write_base(local: LocalStore, path: Path) -> bytes:
    with local.read_view() as view, open(path, "wb") as out:
        envbase.write_env_base(view, out, lineage(), scratch=path.parent)
    return path.read_bytes()


def check_binding(header: envbase.EnvBaseHeader) -> None:
    if (header.lineage.store, header.lineage.seq) != ("s", 5):
        raise CorruptDataError(f"base of {header.lineage.store}/{header.lineage.seq}, wanted s/5")


@pytest.fixture
def small_segments(monkeypatch: pytest.MonkeyPatch) -> None:
    """Many frames and segments from a small store: the hashing queue fills and drains many times."""
    monkeypatch.setattr(envbase, "FRAME_RAW_BYTES", 16 << 10)
    monkeypatch.setattr(envbase, "SEGMENT_BYTES", 8 << 10)


@pytest.mark.usefixtures("small_segments")
@pytest.mark.parametrize("threaded", [True, False])
def test_the_content_hash_covers_every_byte_in_order(tmp_path: Path, threaded: bool) -> None:
    with filled_store(tmp_path / "a", 20_000, value=os.urandom(16)) as source:
        data = write_base(source, tmp_path / "base")
    assert len(data) > 5 * envbase.SEGMENT_BYTES
    blobs = MemoryBlobStore()
    blobs.put("b", data)
    content = _SlowHasher()
    with ThreadPoolExecutor(2) as pool:
        restore_env_base(
            BlobSource(blobs, "b", len(data)),
            tmp_path / "env",
            check=check_binding,
            pool=pool if threaded else None,
            content_hasher=content,
        )
    # every byte of the content, that is all but the nonce trailer the base ends in (a name derived from it stays the
    # same whatever nonce a write carries)
    assert len(content_of(data)) == len(data) - TRAILER_SIZE
    assert content.hexdigest() == hashlib.blake2b(content_of(data), digest_size=32).hexdigest()


class _SlowHasher:
    """A content hasher that lags (as one on a loaded machine would): the digest hashed on the same thread lags
    with it, so a restore that checked its digest before the hashing thread caught up would refuse an intact base."""

    def __init__(self) -> None:
        self._hasher = hashlib.blake2b(digest_size=32)

    def update(self, data: bytes) -> None:
        time.sleep(0.005)
        self._hasher.update(data)

    def hexdigest(self) -> str:
        return self._hasher.hexdigest()


@pytest.mark.usefixtures("small_segments")
@pytest.mark.parametrize("threaded", [True, False])
def test_a_changed_body_byte_is_refused_by_the_digest(tmp_path: Path, threaded: bool) -> None:
    """An uncompressed base (a changed byte there still decodes: only the digest can tell) with one byte of the
    middle of its body flipped."""
    with (
        filled_store(tmp_path / "a", 20_000) as source,
        source.read_view() as view,
        open(tmp_path / "base", "wb") as out,
    ):
        envbase.write_env_base(view, out, lineage(), scratch=tmp_path, compression="none")
    data = bytearray((tmp_path / "base").read_bytes())
    data[len(data) // 2] ^= 0x01
    blobs = MemoryBlobStore()
    blobs.put("b", bytes(data))
    with ThreadPoolExecutor(2) as pool, pytest.raises(CorruptDataError, match="digest does not match"):
        restore_env_base(
            BlobSource(blobs, "b", len(data)), tmp_path / "env", check=check_binding, pool=pool if threaded else None
        )
