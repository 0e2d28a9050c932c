"""The environment-file base: a store's whole state as a compacted copy of its LMDB environment, framed for a blob.

A base is what a restore starts from: the changelog backend's snapshot, the blob-snapshot backend's base run. Written
as sorted records, a restore re-inserts every record (LMDB's bulk append: most of a cold restore's time). Written as
the environment file itself, a restore streams the file into the store dir, verifying it as it goes, and opens it:
no record is decoded or inserted. Both backends write their bases in this format and read it next to their older
record-file bases (:func:`is_env_base` tells them apart by the first bytes). Layout and reasons:
docs/formats-envbase.md.

Contract:

- A base is ``header | frames | footer``. The header (magic ``SBENVBS\\0``, format version, compression, the
  lineage as JSON under a CRC-32) can be trusted from the first bytes alone; the fixed 64-byte footer holds the frame
  count, the environment file's size, the body's length, a BLAKE2b-256 digest of every byte before the digest, and an
  end marker. From format version 2 (written by default; version 1 is still read) the base ends in the nonce trailer
  after the footer (:mod:`statebackend.recordfile.nonce`, the record file's own): 16 random bytes of its own per
  write, under a checksum, ignored by readers, so a base written again under its name is new bytes. Each frame is
  ``stored length | raw length | stored bytes``: one zstd frame (or the raw bytes) of at most
  :data:`FRAME_RAW_BYTES` of the file, so a reader decompresses frame by frame with bounded memory.
- :func:`write_env_base` copies exactly the version of a read view (``Environment.copy(compact=True, txn=...)`` of
  the view's own read transaction), refusing a view whose recorded version is not the one the header names.
- :func:`restore_env_base` reads a base from a :class:`BaseSource` in ranged reads (a few in flight at once), checks
  header, footer frame and the caller's binding (``check``) before writing a byte, then decompresses the frames (on
  a pool when one is given) into ``data.mdb`` of a fresh directory, and checks frame count, sizes and digest at the
  end. It never holds more than a few frames and reads; a truncated, corrupt or forged base raises
  :class:`CorruptDataError` (a missing one the source's :class:`NotFoundError`), and what it wrote is then deleted by
  the caller, never opened: the caller moves the directory into the store only once this returned.
"""

from __future__ import annotations

import collections
import hashlib
import json
import os
import shutil
import struct
import sys
import tempfile
import zlib
from collections.abc import Callable, Iterator
from concurrent.futures import Future, ThreadPoolExecutor
from pathlib import Path
from typing import TYPE_CHECKING, Any, BinaryIO, Protocol

import attrs
import zstandard

from statebackend.crashpoints import crashpoint
from statebackend.errors import CorruptDataError, IncompatibleFormatError, StorageError, UsageError
from statebackend.recordfile import FileHeader
from statebackend.recordfile.nonce import BOUND_SIZE, TRAILER_SIZE, check_trailer, new_trailer
from statebackend.store.env import open_env

if TYPE_CHECKING:
    from statebackend.blobstores.base import BlobStore
    from statebackend.store import LocalStore, LocalVersion, ReadView

__all__ = [
    "FOOTER_SIZE",
    "FORMAT_VERSION",
    "FRAME_TAIL_SIZE",
    "FRAME_RAW_BYTES",
    "HEAD_BYTES",
    "MAGIC",
    "SUPPORTED_FORMAT_VERSIONS",
    "BaseSource",
    "BlobSource",
    "EnvBaseHeader",
    "EnvBaseStats",
    "FileSource",
    "is_env_base",
    "load_env_base",
    "read_env_base_frame",
    "remove_abandoned",
    "restore_env_base",
    "write_env_base",
]

MAGIC = b"SBENVBS\x00"
MAGIC_END = b"SBENVEND"
#: the version this release writes: 2, version 1 and a nonce trailer after the footer
FORMAT_VERSION = 2
#: every version this release reads (a stored sample of each lives in tests/data/envbase/)
SUPPORTED_FORMAT_VERSIONS = (1, 2)
#: the first version whose bases end in the nonce trailer
NONCE_VERSION = 2
#: a frame holds at most this many bytes of the environment file (what the writer cuts, the reader's unit of work)
FRAME_RAW_BYTES = 4 << 20
#: a reader refuses a frame declaring more (bounds the memory a forged base can make it take)
MAX_FRAME_BYTES = 64 << 20
MAX_METADATA_BYTES = 64 << 10
#: the first ranged read of a base: enough for any header a writer produces
HEAD_BYTES = 64 << 10
#: the body is read in ranged reads of this size, at most ``READ_AHEAD`` of them in flight
SEGMENT_BYTES = 8 << 20
READ_AHEAD = 4
#: the prefix of the directories a restore writes a base into (in the store dir); removed when found abandoned
DOWNLOAD_PREFIX = ".envbase-"

_PREFIX = struct.Struct("<8sHBBI")  # magic, format version, compression code, reserved (0), metadata length
_CRC32 = struct.Struct("<I")
_FRAME = struct.Struct("<II")  # stored length, raw length
_FOOTER = struct.Struct("<QQQ32s8s")  # frames, raw bytes, body length, digest, end magic
FOOTER_SIZE = _FOOTER.size  # 64
_FOOTER_COVERED = 24  # frames, raw bytes, body length are hashed too
#: the most bytes at the end of a base :func:`read_env_base_frame` needs: the footer and, from version 2, the trailer
FRAME_TAIL_SIZE = FOOTER_SIZE + TRAILER_SIZE
_COMPRESSION_CODES = {"none": 0, "zstd": 1}
#: an LMDB file holds native integers and pointers: it is read back only where the byte order and word size are the
#: writer's
PLATFORM = f"{sys.byteorder}-{struct.calcsize('P') * 8}"
_COMPRESSION_NAMES = {code: name for name, code in _COMPRESSION_CODES.items()}


@attrs.frozen
class EnvBaseHeader:
    """What a base's header says: the lineage of the version it holds (a record file's :class:`FileHeader`, so the
    backends bind it to their markers exactly as they bind their record files), its key count and compression."""

    lineage: FileHeader
    records: int
    compression: str
    #: the byte order and word size of the machine that wrote it (an LMDB file is read only by the same kind)
    platform: str = attrs.field(factory=lambda: PLATFORM)
    #: the base's format version (from 2 it ends in a nonce trailer)
    format_version: int = FORMAT_VERSION

    @property
    def trailer_size(self) -> int:
        """How many bytes of nonce trailer follow the footer: :data:`TRAILER_SIZE` from version 2, else 0."""
        return TRAILER_SIZE if self.format_version >= NONCE_VERSION else 0


@attrs.frozen
class EnvBaseStats:
    """What :func:`write_env_base` wrote: the base's bytes, its key count, and the environment file's size."""

    file_bytes: int
    records: int
    raw_bytes: int


class BaseSource(Protocol):
    """Where a base is read from: its size and ranged reads of it (``start`` inclusive, ``end`` exclusive)."""

    name: str
    size: int

    def read(self, start: int, end: int) -> bytes: ...


@attrs.define
class BlobSource:
    """A base in a blob store, read by ranged gets (each retried by the store's resilience on its own)."""

    blob_store: BlobStore
    name: str
    size: int
    _head: bytes | None = attrs.field(default=None, init=False)

    def read(self, start: int, end: int) -> bytes:
        """A ranged get; the first :data:`HEAD_BYTES` are read once and kept (a caller that looked at the magic
        before the base is read pays no second request for the header)."""
        if start == 0 and end <= HEAD_BYTES:
            if self._head is None:
                self._head = self.blob_store.get(self.name, start=0, end=min(self.size, HEAD_BYTES))
            return self._head[:end]
        return self.blob_store.get(self.name, start=start, end=end)


@attrs.define
class FileSource:
    """A base in a local file (a run cached in the store dir), read by ``pread``."""

    path: Path
    name: str
    size: int = attrs.field(init=False)

    def __attrs_post_init__(self) -> None:
        self.size = self.path.stat().st_size

    def read(self, start: int, end: int) -> bytes:
        with open(self.path, "rb") as f:
            return os.pread(f.fileno(), end - start, start)


def is_env_base(prefix: bytes) -> bool:
    """Whether a blob whose first bytes are ``prefix`` (at least 8) is an environment-file base."""
    return bytes(prefix[: len(MAGIC)]) == MAGIC


# ---------------------------------------------------------------------------------------------------------- writing


def write_env_base(
    view: ReadView,
    out: BinaryIO,
    lineage: FileHeader,
    *,
    scratch: Path,
    compression: str = "zstd",
    level: int = 1,
    check: Callable[[], None] | None = None,
) -> EnvBaseStats:
    """Write the base of exactly ``view``'s version into ``out``: a compacted copy of the view's own read
    transaction (in a temporary directory under ``scratch``), framed. ``lineage`` must name the view's version (its
    checkpoint id and token): a view of any other version is refused (:class:`UsageError`), never copied. ``check``
    is called before each frame (a background writer's cancellation raises from it)."""
    if compression not in _COMPRESSION_CODES:
        raise UsageError(f"env base compression must be one of {sorted(_COMPRESSION_CODES)}, got {compression!r}")
    version = view.version
    if version is None or (version.checkpoint_id, version.token) != (lineage.checkpoint_id, lineage.token):
        raise UsageError(
            f"store {lineage.store}: a base of version ({lineage.checkpoint_id}, {lineage.token}) was asked from a "
            f"read view of {version}; a base is only ever the copy of the version it names"
        )
    header = _encode_header(EnvBaseHeader(lineage=lineage, records=view.count, compression=compression))
    hasher = hashlib.blake2b(header, digest_size=32)
    out.write(header)
    compressor = zstandard.ZstdCompressor(level=level, write_content_size=True) if compression == "zstd" else None
    frames = raw_bytes = body = 0
    with tempfile.TemporaryDirectory(dir=scratch, prefix=".envcopy-") as tmp:
        view.copy_to(tmp)  # LMDB's compacting copy of the view's read transaction: exactly its version
        for raw in _file_chunks(Path(tmp) / "data.mdb"):
            if check is not None:
                check()
            stored = compressor.compress(raw) if compressor is not None else raw
            frame = _FRAME.pack(len(stored), len(raw))
            for part in (frame, stored):
                hasher.update(part)
                out.write(part)
            frames += 1
            raw_bytes += len(raw)
            body += len(frame) + len(stored)
    covered = _FOOTER.pack(frames, raw_bytes, body, b"", b"")[:_FOOTER_COVERED]
    hasher.update(covered)
    footer = covered + hasher.digest() + MAGIC_END
    # bytes of its own for this write (the digest and end marker bound): a base written again is new bytes
    out.write(footer + new_trailer(footer[-BOUND_SIZE:]))
    return EnvBaseStats(
        file_bytes=len(header) + body + FOOTER_SIZE + TRAILER_SIZE, records=view.count, raw_bytes=raw_bytes
    )


# ---------------------------------------------------------------------------------------------------------- reading


def read_env_base_frame(head: bytes, tail: bytes, size: int, *, name: str) -> EnvBaseHeader:
    """The header of a base known by its first bytes ``head`` (its whole header), its last bytes ``tail`` (the footer
    and, from version 2, the nonce trailer: the last :data:`FRAME_TAIL_SIZE` bytes always do) and its ``size``, with
    the frame checked (header CRC, end marker, a body length that matches ``size``, the trailer): a cut or
    half-written base fails. Not the digest: that needs every byte."""
    header, header_end = _parse_header(head, name=name)
    need = FOOTER_SIZE + header.trailer_size
    if len(tail) < need:
        raise CorruptDataError(f"{name}: truncated at byte {size}: the base ends before its footer")
    footer = _split_tail(tail[len(tail) - need :], header, name=name)
    _parse_footer(footer, size - header.trailer_size, header_end, name=name)
    return header


def restore_env_base(
    source: BaseSource,
    target_dir: Path | None,
    *,
    check: Callable[[EnvBaseHeader], None],
    pool: ThreadPoolExecutor | None = None,
    content_hasher: Any = None,
) -> EnvBaseHeader:
    """Stream the base ``source`` holds into ``target_dir/data.mdb`` (created; ``None``: only verify), verified.

    ``check`` sees the header before anything is written and raises when the base is not the one wanted (its
    binding). Ranged reads and decompression run on ``pool`` when given (a few reads and frames in flight), the
    writes in this thread. ``content_hasher`` (a hashlib object) sees every byte of the base, in order, for callers
    that name a blob by its content. Raises :class:`CorruptDataError` for a damaged, cut or forged base; the caller
    deletes ``target_dir`` then. Returns the header."""
    size = source.size
    head = source.read(0, min(size, HEAD_BYTES))
    header, header_end = _parse_header(head, name=source.name)
    need = FOOTER_SIZE + header.trailer_size
    if size < header_end + need:
        raise CorruptDataError(f"{source.name}: truncated at byte {size}: the base ends before its footer")
    tail = source.read(size - need, size + 1)  # one byte more: a blob longer than its size is refused
    if len(tail) > need:
        raise CorruptDataError(
            f"{source.name}: the blob holds more than the {size} bytes it was written with; it "
            f"is not the base its name designates and was not used"
        )
    tail = _split_tail(tail, header, name=source.name)  # the footer, its trailer (ignored) checked
    frames, raw_bytes, body_length = _parse_footer(tail, size - header.trailer_size, header_end, name=source.name)
    check(header)
    hasher = hashlib.blake2b(head[:header_end], digest_size=32)
    if content_hasher is not None:
        content_hasher.update(head[:header_end])
    hashing = _OrderedHashing((hasher, content_hasher), threaded=pool is not None)  # its thread starts at first use
    out = None
    if target_dir is not None:
        target_dir.mkdir(parents=True, exist_ok=False)
        out = open(target_dir / "data.mdb", "wb")  # noqa: SIM115 - closed in the finally below
    try:
        segments = _segments(source, header_end, header_end + body_length, pool)
        written = count = 0
        decoded: collections.deque[Future[bytes] | bytes] = collections.deque()
        for stored, raw_length in _frames(segments, hashing, name=source.name):
            count += 1
            if count > frames:
                break
            if pool is not None:
                decoded.append(pool.submit(_decode, stored, raw_length, header.compression, source.name))
            else:
                decoded.append(_decode(stored, raw_length, header.compression, source.name))
            while len(decoded) > READ_AHEAD or (decoded and not isinstance(decoded[0], Future)):
                written += _write(out, decoded.popleft())
        while decoded:
            written += _write(out, decoded.popleft())
        crashpoint("envbase.restore.written")  # every frame written, the digest not checked yet
        hashing.finish()
        if count != frames or written != raw_bytes:
            raise CorruptDataError(
                f"{source.name}: the base holds {count} frames of {written} bytes where its footer "
                f"says {frames} frames of {raw_bytes} bytes; it is corrupt and was not used"
            )
        hasher.update(tail[:_FOOTER_COVERED])
        if content_hasher is not None:
            content_hasher.update(tail)
        if hasher.digest() != tail[_FOOTER_COVERED : _FOOTER_COVERED + 32]:
            raise CorruptDataError(
                f"{source.name}: the base's BLAKE2b digest does not match its bytes; it was damaged and was not used"
            )
    finally:
        hashing.close()
        if out is not None:
            out.close()
    return header


def load_env_base(
    store: LocalStore,
    source: BaseSource,
    version: LocalVersion,
    *,
    check: Callable[[EnvBaseHeader], None],
    pool: ThreadPoolExecutor | None = None,
    content_hasher: Any = None,
    after_read: Callable[[], None] | None = None,
) -> EnvBaseHeader:
    """Restore ``store`` from the base ``source`` holds: stream it into a fresh directory in the store dir
    (``.envbase-*``), verified (:func:`restore_env_base`; then ``after_read``, e.g. a content hash check), and only
    then, its key count checked against the header's (the copy claims the base's version from the moment it is in
    place), swap it in as the store's environment (``LocalStore.replace_environment``: two renames, repaired at the
    next open if cut) and record ``version``. Until the swap the store holds
    what it held; a base that fails a check is deleted, never opened. A killed restore's directory is deleted by the
    next one (:func:`remove_abandoned`)."""
    store_dir = Path(store.path)
    remove_abandoned(store_dir)
    work = Path(tempfile.mkdtemp(prefix=DOWNLOAD_PREFIX, dir=store_dir))
    try:
        header = restore_env_base(source, work / "env", check=check, pool=pool, content_hasher=content_hasher)
        if after_read is not None:
            after_read()
        # before the swap: from the moment it is swapped in, the copy claims the base's version (its meta record),
        # and a process killed before a later check would leave a store claiming a version it is not
        _check_key_count(work / "env", header, store.map_size, name=source.name)
        crashpoint("envbase.restore.verified")
        store.replace_environment(work / "env")
    finally:
        shutil.rmtree(work, ignore_errors=True)
    # the copy holds the version its view had (the base's own); the local-only meta is written anew all the same
    store.apply_changes([], version)
    return header


def remove_abandoned(store_dir: Path) -> None:
    """Delete the directories a restore killed mid-way (no ``finally`` ran) left in ``store_dir``: each is as big as
    the state, and they are never taken for data (a base is moved into the store only once verified). The caller
    holds the store's lock."""
    for leftover in store_dir.glob(f"{DOWNLOAD_PREFIX}*"):
        if leftover.is_dir() and not leftover.is_symlink():
            shutil.rmtree(leftover, ignore_errors=True)


# ---------------------------------------------------------------------------------------------------------- internals


def _encode_header(header: EnvBaseHeader) -> bytes:
    metadata = json.dumps(
        {"lineage": attrs.asdict(header.lineage), "platform": header.platform, "records": header.records},
        separators=(",", ":"),
        sort_keys=True,
        ensure_ascii=False,
    ).encode()
    prefix = _PREFIX.pack(MAGIC, FORMAT_VERSION, _COMPRESSION_CODES[header.compression], 0, len(metadata))
    return prefix + metadata + _CRC32.pack(zlib.crc32(prefix + metadata))


def _split_tail(tail: bytes, header: EnvBaseHeader, *, name: str) -> bytes:
    """The footer of a base whose last ``FOOTER_SIZE + header.trailer_size`` bytes are ``tail``, its nonce trailer
    (from version 2) checked and dropped: readers ignore the nonce."""
    if not header.trailer_size:
        return tail
    footer = tail[:FOOTER_SIZE]
    check_trailer(footer[-BOUND_SIZE:], tail[FOOTER_SIZE:], name=name)
    return footer


def _check_key_count(env_dir: Path, header: EnvBaseHeader, map_size: int, *, name: str) -> None:
    """The verified environment in ``env_dir`` must hold the key count its header records (the digest proves the
    bytes are the writer's; this, that the copy holds what the writer's view held)."""
    env, data_db, _ = open_env(env_dir, map_size, create=False)
    try:
        with env.begin(db=data_db) as txn:
            count = txn.stat(data_db)["entries"]
    finally:
        env.close()
    if count != header.records:
        raise CorruptDataError(
            f"{name}: the base holds {count} keys where its header says {header.records}; nothing was kept"
        )


def _parse_header(data: bytes, *, name: str) -> tuple[EnvBaseHeader, int]:
    if len(data) < _PREFIX.size:
        raise CorruptDataError(
            f"{name}: truncated at byte {len(data)}: an env base header needs {_PREFIX.size} bytes at least"
        )
    magic, version, compression_code, reserved, metadata_length = _PREFIX.unpack_from(data)
    if magic != MAGIC:
        raise CorruptDataError(f"{name}: not an env base (bad magic {magic!r}, want {MAGIC!r})")
    if version not in SUPPORTED_FORMAT_VERSIONS:
        if version > FORMAT_VERSION:
            raise IncompatibleFormatError(
                f"{name}: env base format version {version} is newer than this release "
                f"reads ({list(SUPPORTED_FORMAT_VERSIONS)}); upgrade statebackend to read it"
            )
        raise CorruptDataError(f"{name}: env base format version {version} was never written")
    if metadata_length > MAX_METADATA_BYTES:
        raise CorruptDataError(
            f"{name}: env base header metadata of {metadata_length} bytes exceeds "
            f"{MAX_METADATA_BYTES}; the header is corrupt"
        )
    metadata_end = _PREFIX.size + metadata_length
    header_end = metadata_end + _CRC32.size
    if len(data) < header_end:
        raise CorruptDataError(f"{name}: truncated at byte {len(data)}: the env base header needs {header_end} bytes")
    if zlib.crc32(data[:metadata_end]) != _CRC32.unpack_from(data, metadata_end)[0]:
        raise CorruptDataError(f"{name}: env base header checksum mismatch; the header is corrupt")
    compression = _COMPRESSION_NAMES.get(compression_code)
    if compression is None or reserved != 0:
        raise CorruptDataError(f"{name}: unknown env base compression code {compression_code} (or flags {reserved})")
    try:
        fields = json.loads(bytes(data[_PREFIX.size : metadata_end]))
        header = EnvBaseHeader(
            lineage=FileHeader(**fields["lineage"]),
            records=int(fields["records"]),
            compression=compression,
            platform=str(fields["platform"]),
            format_version=version,
        )
    except (ValueError, TypeError, KeyError, UsageError) as exc:
        raise CorruptDataError(f"{name}: env base header metadata is malformed: {exc}") from exc
    if header.platform != PLATFORM:
        raise IncompatibleFormatError(
            f"{name}: the base is an LMDB file written on a {header.platform}-bit machine; this one is "
            f"{PLATFORM}-bit and cannot read it. Restore on a machine of the writer's kind, or from another "
            f"backend's marker"
        )
    return header, header_end


def _parse_footer(tail: bytes, size: int, header_end: int, *, name: str) -> tuple[int, int, int]:
    if size < header_end + FOOTER_SIZE or len(tail) != FOOTER_SIZE:
        raise CorruptDataError(
            f"{name}: truncated at byte {size}: the base ends before its {FOOTER_SIZE}-byte "
            f"footer (header ends at byte {header_end})"
        )
    frames, raw_bytes, body_length, _, magic_end = _FOOTER.unpack(tail)
    if magic_end != MAGIC_END:
        raise CorruptDataError(
            f"{name}: no end marker at byte {size - len(MAGIC_END)}: the base was cut short or not "
            f"completely written (truncated at byte {size}?)"
        )
    if body_length != size - FOOTER_SIZE - header_end:
        raise CorruptDataError(
            f"{name}: the footer says the body has {body_length} bytes, the base holds "
            f"{size - FOOTER_SIZE - header_end}; it is truncated or corrupt"
        )
    return frames, raw_bytes, body_length


def _file_chunks(path: Path) -> Iterator[bytes]:
    """The environment file's bytes in frames of at most FRAME_RAW_BYTES (a name tests replace)."""
    with open(path, "rb") as source:
        while raw := source.read(FRAME_RAW_BYTES):
            yield raw


def _segments(source: BaseSource, start: int, end: int, pool: ThreadPoolExecutor | None) -> Iterator[bytes]:
    """The bytes of ``[start, end)`` in order, in ranged reads, a few in flight on ``pool``."""
    ranges = iter([(offset, min(end, offset + SEGMENT_BYTES)) for offset in range(start, end, SEGMENT_BYTES)])
    if pool is None:
        for first, last in ranges:
            yield _read_exactly(source, first, last)
        return
    pending: collections.deque[Future[bytes]] = collections.deque()
    try:
        for first, last in ranges:
            pending.append(pool.submit(_read_exactly, source, first, last))
            if len(pending) >= READ_AHEAD:
                yield pending.popleft().result()
        while pending:
            yield pending.popleft().result()
    finally:
        for future in pending:
            future.cancel()


def _read_exactly(source: BaseSource, start: int, end: int) -> bytes:
    data = source.read(start, end)
    if len(data) != end - start:
        raise CorruptDataError(f"{source.name}: truncated: a read of bytes {start}..{end} returned {len(data)} bytes")
    return data


class _OrderedHashing:
    """Feeds every segment of a base, in order, to its hashers (the base's digest; a caller's content hash): on a
    thread of its own when ``threaded`` (hashlib releases the GIL on large updates, so hashing runs beside the frame
    parsing and the writes of the restoring thread instead of before them: two BLAKE2b passes over the base were 0.11
    s of a 10M-key restore's thread), else at once. At most :data:`READ_AHEAD` segments wait for it."""

    def __init__(self, hashers: tuple[Any, ...], *, threaded: bool) -> None:
        self._hashers = tuple(hasher for hasher in hashers if hasher is not None)
        self._executor = ThreadPoolExecutor(1, thread_name_prefix="envbase-hash") if threaded else None
        self._pending: collections.deque[Future[None]] = collections.deque()

    def update(self, segment: bytes) -> None:
        if self._executor is None:
            self._hash(segment)
            return
        self._pending.append(self._executor.submit(self._hash, segment))
        while len(self._pending) > READ_AHEAD:
            self._pending.popleft().result()

    def finish(self) -> None:
        """Wait until every segment given is hashed (the hashers' digests are then complete)."""
        while self._pending:
            self._pending.popleft().result()

    def close(self) -> None:
        if self._executor is not None:
            self._executor.shutdown(wait=True, cancel_futures=True)

    def _hash(self, segment: bytes) -> None:
        for hasher in self._hashers:
            hasher.update(segment)


def _frames(segments: Iterator[bytes], hashing: _OrderedHashing, *, name: str) -> Iterator[tuple[bytes, int]]:
    """``(stored bytes, raw length)`` of each frame of the body, every body byte fed to ``hashing`` in order."""
    buffer = bytearray()
    position = 0
    for segment in segments:
        hashing.update(segment)
        del buffer[:position]
        buffer += segment
        position = 0
        while len(buffer) - position >= _FRAME.size:
            stored_length, raw_length = _FRAME.unpack_from(buffer, position)
            if stored_length > MAX_FRAME_BYTES or raw_length > MAX_FRAME_BYTES or raw_length == 0:
                raise CorruptDataError(
                    f"{name}: a frame declares {stored_length} stored and {raw_length} raw bytes "
                    f"(at most {MAX_FRAME_BYTES}, raw at least 1); the base is corrupt"
                )
            end = position + _FRAME.size + stored_length
            if end > len(buffer):
                break
            yield bytes(buffer[position + _FRAME.size : end]), raw_length
            position = end
    if position != len(buffer):
        raise CorruptDataError(f"{name}: the body ends inside a frame; the base is truncated or corrupt")


def _decode(stored: bytes, raw_length: int, compression: str, name: str) -> bytes:
    if compression == "none":
        raw = stored
    else:
        # python-zstandard allocates (and fills) the content size the frame's own header records, whatever
        # max_output_size says: a damaged or forged header could make it take any amount of memory (MemoryError, not
        # CorruptDataError) before the digest is checked. The writer always records the content size: it must be the
        # declared raw length, checked from the header before anything is decompressed
        try:
            content_size = zstandard.get_frame_parameters(stored).content_size
        except zstandard.ZstdError as exc:
            raise CorruptDataError(f"{name}: a frame has no valid zstd header ({exc}); the base is corrupt") from exc
        if content_size != raw_length:
            raise CorruptDataError(
                f"{name}: a frame's zstd header records {content_size} bytes where the frame "
                f"declares {raw_length}; the base is corrupt"
            )
        try:
            raw = zstandard.ZstdDecompressor().decompress(stored, max_output_size=raw_length)
        except zstandard.ZstdError as exc:
            raise CorruptDataError(f"{name}: a frame does not decompress ({exc}); the base is corrupt") from exc
    if len(raw) != raw_length:
        raise CorruptDataError(
            f"{name}: a frame holds {len(raw)} bytes where it declares {raw_length}; the base is corrupt"
        )
    return raw


def _write(out: BinaryIO | None, item: Future[bytes] | bytes) -> int:
    data = item.result() if isinstance(item, Future) else item
    if out is not None:
        try:
            out.write(data)
        except OSError as exc:
            raise StorageError(f"cannot write a restored base to {out.name}: {exc}; check the local disk") from exc
    return len(data)
