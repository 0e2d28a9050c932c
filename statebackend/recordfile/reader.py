"""Reading a sorted record file: :func:`verify`, :func:`check_digest` and :func:`iter_records`.

Contract:

- :func:`verify` checks a whole file in memory: frame, digest, every record and the count. :func:`check_digest`
  checks the frame and the digest only, for a caller that then reads with ``iter_records(data, verified=True)``
  (which still checks every record as it goes).
- :func:`iter_records` reads records in key order (for versions 2 and 3 as C-level iterators chained block by
  block, so a C consumer such as LMDB's ``putmulti`` runs no Python frame per record). For a ``bytes`` source it
  verifies the whole file before yielding the first record, so a corrupt delta is never applied. For a stream source
  (a big snapshot read from disk) it verifies while yielding and raises :class:`CorruptDataError` at the end at the
  latest: the caller must apply the records inside one transaction that aborts on the error (the local store's
  ``replace_contents`` does).
- Every failure to read is a :class:`CorruptDataError` that names the blob and says what is wrong, or an
  :class:`IncompatibleFormatError` for a format version newer than this release reads.
- What a reader holds is bounded by what the file declares, and what it may declare is bounded
  (:mod:`statebackend.recordfile.format`): decompression runs with a bounded window and is read in blocks, and the
  body decoders (:mod:`statebackend.recordfile.decode`) refuse a block by the sizes it declares.
"""

from __future__ import annotations

import io
from collections.abc import Callable, Generator, Iterator
from itertools import chain
from typing import Any, BinaryIO

import attrs
import zstandard

import statebackend.recordfile.format as fileformat
from statebackend.errors import CorruptDataError
from statebackend.recordfile.decode import parse_blocks, parse_records
from statebackend.recordfile.format import (
    DELETE_KINDS,
    FOOTER,
    FOOTER_COVERED,
    FOOTER_SIZE,
    HEADER_PREFIX_SIZE,
    MAGIC_END,
    MAX_WINDOW_BYTES,
    FileHeader,
    Record,
    check_footer_trailer,
    header_size,
    new_hasher,
    parse_header,
    trailer_size,
)

__all__ = ["RecordReader", "check_digest", "iter_records", "verify"]


@attrs.define
class RecordReader:
    """Records of one file in key order, as ``(key, value)`` with ``value`` None for a delete.

    Iterating hands out the underlying iterator itself, so a ``for`` loop (or ``putmulti``) pays no per-record
    method call; for version 2 that iterator is ``chain.from_iterable`` over one ``zip`` per block, all C.
    Single pass: a second iteration continues where the first stopped.
    """

    header: FileHeader
    _records: Iterator[Record]

    def __iter__(self) -> Iterator[Record]:
        return self._records

    def __next__(self) -> Record:
        return next(self._records)


def verify(data: bytes, *, name: str) -> FileHeader:
    """Check a whole file: magic, version, header CRC, lengths, digest, every record and the record count."""
    header, compression, header_end, body_end, count = _open_bytes(data, name=name, check_digest=True)
    allow_delete = header.kind in DELETE_KINDS
    if header.format_version == 1:
        found = _drain(
            parse_records(
                _body_blocks(data, header_end, body_end, compression, name=name),
                name=name,
                allow_delete=allow_delete,
                emit=False,
            )
        )
    else:
        found = _drain(
            parse_blocks(
                _body_reader(data, header_end, body_end, compression, name=name),
                name=name,
                allow_delete=allow_delete,
                version=header.format_version,
                emit=False,
            )
        )
    _check_count(found, count, name=name)
    return header


def check_digest(data: bytes, *, name: str) -> FileHeader:
    """Check magic, version, header CRC, lengths and the digest of the whole file, without parsing the records.
    Reading it afterwards with ``iter_records(data, verified=True)`` still checks every record, the key order and
    the count as it goes, so a caller applying the records inside one transaction that aborts on an error never
    applies a bad file, and parses it once instead of twice."""
    header, _, _, _, _ = _open_bytes(data, name=name, check_digest=True)
    return header


def iter_records(source: bytes | BinaryIO, *, name: str, verified: bool = False) -> RecordReader:
    """The records of a file in key order, from bytes or from a binary stream (read from its current position).

    ``bytes``: unless ``verified`` (the caller already ran :func:`verify` on these bytes), the whole file is verified
    before the first record is yielded. Stream: read in blocks, with the digest, key order and record count checked
    while yielding; a failure raises :class:`CorruptDataError` at the latest at the end, after records were yielded,
    so apply them inside one transaction that aborts on the error.
    """
    if isinstance(source, (bytes, bytearray, memoryview)):
        data = bytes(source)
        if not verified:
            verify(data, name=name)
        header, compression, header_end, body_end, count = _open_bytes(data, name=name, check_digest=False)
        allow_delete = header.kind in DELETE_KINDS

        def check_count(found: int) -> None:
            _check_count(found, count, name=name)

        if header.format_version == 1:
            blocks = _body_blocks(data, header_end, body_end, compression, name=name)
            return RecordReader(header, _then(parse_records(blocks, name=name, allow_delete=allow_delete), check_count))
        read = _body_reader(data, header_end, body_end, compression, name=name)
        return RecordReader(
            header,
            chain.from_iterable(
                _then(
                    parse_blocks(read, name=name, allow_delete=allow_delete, version=header.format_version), check_count
                )
            ),
        )
    return _open_stream(source, name=name)


# ---------------------------------------------------------------------------------------------------------- helpers


def _open_bytes(data: bytes, *, name: str, check_digest: bool) -> tuple[FileHeader, str, int, int, int]:
    """Check the frame of a whole file: (header, compression, header end, body end, footer's record count)."""
    header, compression, header_end = parse_header(data, name=name)
    trailer = trailer_size(header.format_version)
    size = len(data) - trailer
    if size < header_end + FOOTER_SIZE:
        raise CorruptDataError(
            f"{name}: truncated at byte {len(data)}: the file ends before its {FOOTER_SIZE}-byte "
            f"footer{' and nonce trailer' if trailer else ''} (header ends at byte {header_end})"
        )
    check_footer_trailer(data, size, header.format_version, name=name)
    body_end = size - FOOTER_SIZE
    count, body_length, digest, magic_end = FOOTER.unpack_from(data, body_end)
    if magic_end != MAGIC_END:
        raise CorruptDataError(
            f"{name}: no end marker at byte {size - len(MAGIC_END)}: the file was cut short or "
            f"not completely written (truncated at byte {size}?)"
        )
    if body_length != body_end - header_end:
        raise CorruptDataError(
            f"{name}: the footer says the body has {body_length} bytes, the file holds "
            f"{body_end - header_end}; the file is truncated or corrupt"
        )
    if check_digest:
        hasher = new_hasher(memoryview(data)[: body_end + FOOTER_COVERED])
        if hasher.digest() != digest:
            raise CorruptDataError(
                f"{name}: checksum mismatch (BLAKE2b-128 over bytes 0..{body_end}); the file is corrupt"
            )
    return header, compression, header_end, body_end, count


def _body_blocks(data: bytes, start: int, end: int, compression: str, *, name: str) -> Iterator[bytes]:
    """The uncompressed body of an in-memory file, in blocks. An uncompressed one is one block: it is in memory
    already, so its records are cut from it whatever their size (MAX_BLOCK_BYTES bounds what a reader collects)."""
    if compression == "none":
        if end > start:
            yield data[start:end]
        return
    # read_across_frames: bytes after the first frame are decoded (and then fail) rather than silently ignored
    reader = _decompressor().stream_reader(
        memoryview(data)[start:end], read_size=fileformat.BLOCK_BYTES, read_across_frames=True
    )
    yield from _decompressed_blocks(reader, name=name)


def _decompressor() -> zstandard.ZstdDecompressor:
    """A decompressor whose window, the memory a frame makes it hold besides what it hands out, is bounded."""
    return zstandard.ZstdDecompressor(max_window_size=MAX_WINDOW_BYTES)


def _decompressed_blocks(reader: Any, *, name: str) -> Iterator[bytes]:
    try:
        while True:
            block = reader.read(fileformat.BLOCK_BYTES)
            if not block:
                return
            yield block
    except zstandard.ZstdError as exc:
        raise CorruptDataError(f"{name}: the compressed body does not decompress: {exc}") from exc


def _body_reader(data: bytes, start: int, end: int, compression: str, *, name: str) -> Callable[[int], bytes]:
    """``read(size)`` over the uncompressed body of an in-memory file."""
    if compression == "none":
        return io.BytesIO(memoryview(data)[start:end]).read
    return _zstd_read(memoryview(data)[start:end], name=name)


def _zstd_read(source: Any, *, name: str) -> Callable[[int], bytes]:
    # read_across_frames: bytes after the first frame are decoded (and then fail) rather than silently ignored
    reader = _decompressor().stream_reader(
        source, read_size=fileformat.BLOCK_BYTES, read_across_frames=True, closefd=False
    )

    def read(size: int) -> bytes:
        try:
            return reader.read(size)
        except zstandard.ZstdError as exc:
            raise CorruptDataError(f"{name}: the compressed body does not decompress: {exc}") from exc

    return read


def _then(items: Generator[Any, None, int], done: Callable[[int], None]) -> Iterator[Any]:
    """What ``items`` yields, then ``done`` of the count it returns (which raises when the file is bad): the checks at
    the end run inside the consumer's loop, so they abort the consumer's transaction."""
    found = yield from items
    done(found)


def _check_count(found: int, expected: int, *, name: str) -> None:
    if found != expected:
        raise CorruptDataError(f"{name}: record count mismatch: the footer says {expected}, the body holds {found}")


def _drain(records: Generator[Any, None, int]) -> int:
    while True:
        try:
            next(records)
        except StopIteration as stop:
            return int(stop.value)


def _read_exact(source: BinaryIO, size: int, have: bytes, *, name: str) -> bytes:
    """``have`` extended to ``size`` bytes from ``source``; a short read is a truncation."""
    parts = [have]
    length = len(have)
    while length < size:
        chunk = source.read(size - length)
        if not chunk:
            raise CorruptDataError(f"{name}: truncated at byte {length}: the file header needs {size} bytes")
        parts.append(chunk)
        length += len(chunk)
    return b"".join(parts)


@attrs.define
class _StreamBody:
    """A file-like view of a stream's body: hashes what it hands out and holds back the last ``hold`` bytes.

    The body's length is in the footer at the end, so without seeking the only way to know where the body stops is
    to keep the last ``hold`` bytes (the footer, and from version 4 the nonce trailer) read back until the stream
    ends; they are then the footer and the trailer.
    """

    source: BinaryIO
    hasher: Any
    hold: int = FOOTER_SIZE
    held: bytes = b""
    body_bytes: int = 0

    def read(self, size: int = -1) -> bytes:
        want = fileformat.BLOCK_BYTES if size is None or size < 0 else max(size, 1)
        while True:
            chunk = self.source.read(want)
            if not chunk:
                return b""
            data = self.held + chunk if self.held else chunk
            if len(data) <= self.hold:
                self.held = data
                continue
            self.held = data[-self.hold :]
            out = data[: -self.hold]
            self.hasher.update(out)
            self.body_bytes += len(out)
            return out

    def readable(self) -> bool:
        return True


def _open_stream(source: BinaryIO, *, name: str) -> RecordReader:
    head = _read_exact(source, HEADER_PREFIX_SIZE, b"", name=name)
    head = _read_exact(source, header_size(head, name=name), head, name=name)
    header, compression, header_end = parse_header(head, name=name)
    hasher = new_hasher(head)
    body = _StreamBody(source, hasher, FOOTER_SIZE + trailer_size(header.format_version))
    return RecordReader(header, _stream_records(body, header, compression, header_end, name=name))


def _stream_records(
    body: _StreamBody, header: FileHeader, compression: str, header_end: int, *, name: str
) -> Iterator[Record]:
    allow_delete = header.kind in DELETE_KINDS

    def finish(found: int) -> None:
        _finish_stream(body, header, header_end, found, name=name)

    if header.format_version != 1:
        read = _zstd_read(body, name=name) if compression == "zstd" else body.read
        return chain.from_iterable(
            _then(parse_blocks(read, name=name, allow_delete=allow_delete, version=header.format_version), finish)
        )
    if compression == "zstd":
        # zstandard's stub asks for IO[bytes]; its reader only ever calls read(), which _StreamBody has
        reader: Any = _decompressor().stream_reader(
            body,  # type: ignore[arg-type]
            read_size=fileformat.BLOCK_BYTES,
            read_across_frames=True,
            closefd=False,
        )
        blocks: Iterator[bytes] = _decompressed_blocks(reader, name=name)
    else:
        blocks = iter(lambda: body.read(fileformat.BLOCK_BYTES), b"")
    return _then(parse_records(blocks, name=name, allow_delete=allow_delete), finish)


def _finish_stream(body: _StreamBody, header: FileHeader, header_end: int, found: int, *, name: str) -> None:
    """Check a stream's footer, digest and record count once its records were read."""
    # Drain what the decompressor left unread (nothing, for a file write_file wrote) so the footer is what is held.
    while body.read(fileformat.BLOCK_BYTES):
        pass
    size = header_end + body.body_bytes + len(body.held)
    if len(body.held) < body.hold:
        raise CorruptDataError(
            f"{name}: truncated at byte {size}: the file ends before its {FOOTER_SIZE}-byte footer"
            f"{' and nonce trailer' if body.hold > FOOTER_SIZE else ''}"
        )
    check_footer_trailer(body.held, FOOTER_SIZE, header.format_version, name=name)
    size -= body.hold - FOOTER_SIZE
    footer = body.held[:FOOTER_SIZE]
    count, body_length, digest, magic_end = FOOTER.unpack(footer)
    if magic_end != MAGIC_END:
        raise CorruptDataError(
            f"{name}: no end marker at byte {size - len(MAGIC_END)}: the file was cut short or "
            f"not completely written (truncated at byte {size}?)"
        )
    if body_length != body.body_bytes:
        raise CorruptDataError(
            f"{name}: the footer says the body has {body_length} bytes, the file holds "
            f"{body.body_bytes}; the file is truncated or corrupt"
        )
    body.hasher.update(footer[:FOOTER_COVERED])
    if body.hasher.digest() != digest:
        raise CorruptDataError(
            f"{name}: checksum mismatch (BLAKE2b-128 over bytes 0..{size - FOOTER_SIZE}); the file is corrupt"
        )
    _check_count(found, count, name=name)
