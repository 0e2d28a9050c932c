"""Review of environment-file bases (statebackend/envbase.py): what a damaged or forged base can make a restore do
before its digest is checked at the end (a frame is decompressed as it arrives, so the memory a frame makes the
reader take, and the error it raises, must be bounded by what the reader checks, not by the digest); and a damaged
local copy of a base must not keep an intact blob from restoring."""

from __future__ import annotations

import hashlib
import shutil
import struct
import tracemalloc
from pathlib import Path

import pytest
import zstandard
from statebackend.backends.blobsnapshot.state import CACHE_DIR

from statebackend import envbase
from statebackend.blobstores.memory import MemoryBlobStore
from statebackend.envbase import (
    BlobSource,
    EnvBaseHeader,
    FileSource,
    load_env_base,
    restore_env_base,
    write_env_base,
)
from statebackend.errors import CorruptDataError
from statebackend.store import LocalStore, LocalVersion
from statebackend.task import TaskStorage
from tests.test_envbase import (
    V1,
    backend_config,
    check_binding,
    commit_rounds,
    filled_store,
    lineage,
    newest_base,
    write_base,
)

_FRAME = struct.Struct("<II")


def forged_base(frames: list[tuple[bytes, int]], *, records: int = 0) -> bytes:
    """A base of the given ``(stored bytes, declared raw length)`` frames, with a header, footer and digest that all
    match: what a writer with a broken compressor, or anyone who can write the blob, produces."""
    header = envbase._encode_header(EnvBaseHeader(lineage=lineage(), records=records, compression="zstd"))
    body = b"".join(_FRAME.pack(len(stored), raw) + stored for stored, raw in frames)
    covered = struct.pack("<QQQ", len(frames), sum(raw for _, raw in frames), len(body))
    digest = hashlib.blake2b(header + body + covered, digest_size=32).digest()
    return header + body + covered + digest + envbase.MAGIC_END


def zstd_zeros(size: int) -> bytes:
    """One zstd frame of ``size`` zero bytes, its content size in its header (a few KiB per hundred MiB)."""
    compressor = zstandard.ZstdCompressor(level=1, write_content_size=True).compressobj(size=size)
    chunk = bytes(1 << 20)
    parts = [compressor.compress(chunk) for _ in range(size // len(chunk))]
    return b"".join([*parts, compressor.flush()])


def test_a_frame_that_decompresses_to_more_than_it_declares_is_refused_before_it_is_decompressed(
    tmp_path: Path,
) -> None:
    """bounded memory: the frame declares 4 MiB (within every limit) but its zstd header says 256 MiB; the reader
    must refuse it from the header, not decompress all of it (python-zstandard ignores ``max_output_size`` when the
    frame records its content size) and compare the length afterwards."""
    declared = 4 << 20
    bomb = zstd_zeros(256 << 20)
    assert len(bomb) < 64 << 10
    (tmp_path / "base").write_bytes(forged_base([(bomb, declared)]))
    tracemalloc.start()
    try:
        with pytest.raises(CorruptDataError):
            restore_env_base(FileSource(tmp_path / "base", "base"), tmp_path / "target", check=check_binding())
        _, peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    assert peak < 4 * declared, f"a frame declaring {declared} bytes made the reader take {peak}"


def test_a_frame_whose_zstd_header_claims_an_absurd_size_is_corrupt_data_not_memory_error(tmp_path: Path) -> None:
    """damaged data loaded / fallback: a base whose first frame's zstd header is damaged so that its content size
    reads 1 PiB. Restore must raise CorruptDataError (what the fallback to another backend's marker catches), keep
    the store as it was, and leave nothing behind; it must not raise MemoryError from allocating that size."""
    with filled_store(tmp_path / "a", 20_000) as source:
        data = write_base(source, tmp_path / "base")
    start = 16 + struct.unpack_from("<I", data, 12)[0] + 4
    stored_length, raw_length = _FRAME.unpack_from(data, start)
    stored = data[start + 8 : start + 8 + stored_length]
    assert stored[4] == 0x80, "the writer's frame header is magic, descriptor (4-byte content size), window, size"
    # the frame header descriptor now says an 8-byte content size; those 8 bytes read 1 PiB (the digest is stale)
    damaged_frame = stored[:4] + bytes([0xC0]) + stored[5:6] + struct.pack("<Q", 1 << 50) + stored[10:]
    damaged = (
        data[:start] + _FRAME.pack(len(damaged_frame), raw_length) + damaged_frame + data[start + 8 + stored_length :]
    )
    footer = bytearray(damaged[-envbase.FOOTER_SIZE :])
    footer[16:24] = struct.pack("<Q", len(damaged) - envbase.FOOTER_SIZE - start)
    damaged = damaged[: -envbase.FOOTER_SIZE] + bytes(footer)
    blobs = MemoryBlobStore()
    blobs.put("b", damaged)
    old = LocalVersion("0-0", "cccc")
    with filled_store(tmp_path / "b", 10, old) as target:
        with pytest.raises(CorruptDataError, match="b"):
            load_env_base(target, BlobSource(blobs, "b", len(damaged)), V1, check=check_binding())
        assert target.version == old and target.count() == 10
        assert not list((tmp_path / "b").glob(".envbase-*"))


def test_a_cached_base_run_damaged_in_its_first_bytes_restores_from_the_blob_store(tmp_path: Path) -> None:
    """damaged local cache: the blob-snapshot run cache in the store dir holds the base run with its first bytes
    damaged (a file of the right size, e.g. torn by a machine crash: the cache is written without fsync). The blob
    store holds the base intact, and restore reads a damaged cached copy again from it; but the format is told from
    the cached copy's first bytes, so the base is taken for a record file and refused (after downloading it whole)."""
    config = backend_config(tmp_path, "blobsnapshot")
    blobs = MemoryBlobStore()
    model: dict[bytes, bytes] = {}
    with TaskStorage.open(config, "task-0", blob_store=blobs) as task:
        commit_rounds(task, model, 0, 8)
        base = newest_base(blobs, task, "blobsnapshot")
    assert base is not None and envbase.is_env_base(blobs.get(base, start=0, end=8))
    (cache,) = tmp_path.glob(f"local/**/{CACHE_DIR}")
    cached = cache / base.rsplit("/", 1)[-1]  # where the writer put it (kept or not since): the base's bytes
    data = blobs.get(base)
    cached.write_bytes(bytes(16) + data[16:])  # the right size, the first bytes gone
    shutil.rmtree(cached.parent.parent / "data")  # the LMDB environment: a full restore
    with TaskStorage.open(config, "task-0", blob_store=blobs) as task:
        assert dict(task.store("counts").items()) == model


class _Killed(BaseException):
    """Stands for SIGKILL at a point with no crashpoint: nothing after it runs (no ``except``, only ``finally``)."""


def test_a_base_whose_key_count_is_not_its_headers_never_leaves_its_version_claimed(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """damaged data loaded after a crash: the key count the header records is the check that the environment copy
    holds what the writer's view held (the digest only proves the bytes are the writer's). It ran after the swap,
    while the copied environment already claimed the base's version (its meta ``version`` record): a process killed
    between the swap and that check left a store claiming the version with other data, and the next restore trusts
    a local version (catch-up from it). The count must be checked before the swap."""
    with filled_store(tmp_path / "a", 1000) as source, source.read_view() as view:
        view.count = 1001  # the header says one key more than the environment file holds
        with open(tmp_path / "base", "wb") as out:
            write_env_base(view, out, lineage(), scratch=tmp_path)
    old = LocalVersion("0-0", "cccc")
    with filled_store(tmp_path / "b", 10, old) as target:

        def killed(*args: object, **kwargs: object) -> int:
            raise _Killed

        monkeypatch.setattr(LocalStore, "apply_changes", killed)  # the first thing after the swap
        with pytest.raises((CorruptDataError, _Killed)):
            load_env_base(target, FileSource(tmp_path / "base", "base"), V1, check=check_binding())
        monkeypatch.undo()
        claims = target.version
        count = target.count()
    assert not (claims == V1 and count != 1001), f"the store claims {claims} with {count} keys, the base's header 1001"


@pytest.mark.parametrize("backend", ["changelog", "blobsnapshot"])
def test_a_reusing_open_removes_what_a_killed_restore_left(tmp_path: Path, backend: str) -> None:
    """A restore killed while it loaded a base leaves a ``.envbase-*`` directory as big as the state; the next open
    removes it even when it loads no base (its local state is the checkpoint's: reuse)."""
    from statebackend.envbase import DOWNLOAD_PREFIX
    from statebackend.task import TaskStorage

    config = {
        "job.name": "job",
        "state.local.dir": str(tmp_path / "local"),
        "blob.store.url": (tmp_path / "blobs").as_uri(),
        "stores.counts.backup.factories": backend,
    }
    with TaskStorage.open(config, "task-0") as task:
        task.store("counts", typed=False).put(b"k", b"v")
        task.commit_durably({"input": "1"})
    leftovers = [path for path in (tmp_path / "local").rglob("*") if path.is_dir() and path.name == "counts"]
    assert len(leftovers) == 1, leftovers
    abandoned = leftovers[0] / f"{DOWNLOAD_PREFIX}killed" / "env"
    abandoned.mkdir(parents=True)
    (abandoned / "data.mdb").write_bytes(b"\0" * 4096)
    with TaskStorage.open(config, "task-0") as task:
        assert task.store("counts", typed=False).get(b"k") == b"v"
    assert not abandoned.parent.exists(), "the reusing open left what the killed restore wrote"
