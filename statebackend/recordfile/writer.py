"""Writing a sorted record file: :func:`write_file` streams one to a binary output, :func:`encode` to bytes.

Contract:

- :func:`write_file` streams: memory stays bounded by about one block whatever the record count, and ``out`` is
  never seeked. It writes the header, the body in the layout of ``header.format_version`` (version 4 unless the
  header asks for 1 to 3; the layouts: :mod:`statebackend.recordfile.format`), then the footer with the count and
  the digest, and from version 4 the nonce trailer (a fresh random nonce: no two writes give the same bytes).
- When the input is bad (keys not strictly increasing, a delete in a snapshot, a record bigger than
  :data:`~statebackend.recordfile.format.MAX_BLOCK_BYTES`) it raises :class:`StateBackendError` before the footer is
  written, so what was written is never a valid file; the caller deletes it.
- The per-record work is done by C calls a chunk or a block at a time (``zip``, ``map(len)``, ``bytes.join``,
  ``struct``); version 1 packs records of the common sizes by one cached struct call each.
"""

from __future__ import annotations

import io
import struct
from collections.abc import Callable, Iterable, Sequence
from itertools import islice
from operator import lt
from typing import Any, BinaryIO, cast

import attrs
import zstandard

import statebackend.recordfile.format as fileformat
from statebackend.errors import ConfigError, IncompatibleFormatError, InvalidKeyError, UsageError
from statebackend.recordfile.columns import RecordColumns, column_chunks, record_chunks, to_planes, u32_bytes
from statebackend.recordfile.format import (
    BLOCK_HEADER,
    BLOCK_MAX_RECORDS,
    COMPRESSIONS,
    DELETE_KINDS,
    FLAG_KEYS_FIXED,
    FLAG_OPS,
    FLAG_VALUES_FIXED,
    NONCE_VERSION,
    OP_DELETE,
    OP_PUT,
    PLANES_MAX_LENGTH,
    RECORD_PREFIX,
    RECORD_PREFIX_SIZE,
    SUPPORTED_FORMAT_VERSIONS,
    WRITE_CHUNK,
    FileHeader,
    encode_footer,
    encode_header,
    new_hasher,
)
from statebackend.recordfile.nonce import new_trailer

__all__ = ["FileStats", "encode", "write_file"]

_pack_record_prefix = RECORD_PREFIX.pack
#: version 1: records up to this size are packed by one cached struct call; bigger ones skip the extra copy
_PACK_WHOLE_MAX = 4096
_PACK_CACHE_MAX = 1024
_FIRST_RECORD_GUESS = 64 * 1024  # bytes per record assumed before any was seen: a first chunk of 16 records


@attrs.frozen
class FileStats:
    """What :func:`write_file` wrote: records, their key+value bytes, and the file's size in bytes."""

    record_count: int
    raw_bytes: int
    file_bytes: int


def write_file(
    out: BinaryIO,
    header: FileHeader,
    records: Iterable[tuple[bytes, bytes | None]] | RecordColumns,
    *,
    compression: str = "zstd",
    level: int = 3,
) -> FileStats:
    """Write one file to ``out`` (never seeked) and return what was written.

    ``records`` are ``(key, value)`` in strictly increasing key order, or the same as :class:`RecordColumns`;
    ``value`` None is a delete (deltas only).
    Memory stays bounded by about one block (1 MiB) whatever the record count. The body layout is that of
    ``header.format_version`` (:data:`FORMAT_VERSION` unless the caller asks for an older one, e.g. while readers of
    an older release must read the files).
    """
    if compression not in COMPRESSIONS:
        raise ConfigError(f"compression must be one of {list(COMPRESSIONS)}, got {compression!r}")
    version = header.format_version
    if version not in SUPPORTED_FORMAT_VERSIONS:
        raise IncompatibleFormatError(
            f"this release writes format versions {list(SUPPORTED_FORMAT_VERSIONS)}, the header asks for {version}"
        )
    hasher = new_hasher()
    written = 0

    def emit(data: bytes) -> None:
        nonlocal written
        if data:
            out.write(data)
            hasher.update(data)
            written += len(data)

    emit(encode_header(header, compression))
    header_end = written

    emit_body = emit
    finish: Callable[[], bytes] | None = None
    if compression == "zstd":
        compressor = zstandard.ZstdCompressor(level=level).compressobj()
        compress = compressor.compress
        finish = compressor.flush

        def emit_body(data: bytes) -> None:
            emit(compress(data))

    allow_delete = header.kind in DELETE_KINDS
    if version == 1:
        count, raw_bytes = _write_body_v1(iter(records), emit_body, allow_delete=allow_delete)
    else:
        count, raw_bytes = _write_body_columnar(records, emit_body, allow_delete=allow_delete, planes=version >= 3)
    if finish is not None:
        emit(finish())

    footer = encode_footer(count, written - header_end, hasher)
    if version >= NONCE_VERSION:  # bytes of its own for this write: a file written again is new bytes (nonce.py)
        footer += new_trailer(footer)
    out.write(footer)
    written += len(footer)
    return FileStats(record_count=count, raw_bytes=raw_bytes, file_bytes=written)


def encode(header: FileHeader, records: Iterable[tuple[bytes, bytes | None]], **kwargs: Any) -> bytes:
    """The whole file as bytes; keyword arguments as for :func:`write_file`."""
    out = io.BytesIO()
    write_file(out, header, records, **kwargs)
    return out.getvalue()


def _write_body_columnar(
    records: Iterable[tuple[bytes, bytes | None]] | RecordColumns,
    emit: Callable[[bytes], None],
    *,
    allow_delete: bool,
    planes: bool,
) -> tuple[int, int]:
    """Version 2 and 3 body: columnar blocks. Returns (record count, key+value bytes).

    Records are taken from the input a chunk at a time and split into columns by C calls (``zip``, ``map(len)``),
    so the writer runs a few Python statements per chunk, not per record. With ``planes`` (version 3) a column whose
    records all have one length (at most PLANES_MAX_LENGTH) is written as that length once and its bytes as planes.
    """
    next_chunk = column_chunks(records) if isinstance(records, RecordColumns) else record_chunks(iter(records))
    count = 0
    raw_bytes = 0
    previous: bytes | None = None  # the last key of the previous block
    record_size = _FIRST_RECORD_GUESS  # bytes per record in the last chunk, to size the next one
    block_bytes = fileformat.BLOCK_BYTES
    # records taken for a block that would have held too much, as columns
    carried_keys: list[bytes] = []
    carried_values: list[bytes | None] = []
    while True:
        keys: list[bytes] = []
        values: list[bytes | None] = []
        key_lengths: list[int] = []
        value_lengths: list[int] = []
        size = 0
        has_delete = False
        while len(keys) < BLOCK_MAX_RECORDS and size < block_bytes:
            fits = (block_bytes - size) // record_size + 1
            take = min(WRITE_CHUNK, BLOCK_MAX_RECORDS - len(keys), fits)
            chunk_keys: Sequence[bytes]
            chunk_values: Sequence[bytes | None]
            if carried_keys:
                chunk_keys, chunk_values = carried_keys[:take], carried_values[:take]
                del carried_keys[:take], carried_values[:take]
            else:
                chunk_keys, chunk_values = next_chunk(take)
            if not chunk_keys:
                break
            chunk_key_lengths = list(map(len, chunk_keys))
            if None in chunk_values:
                has_delete = True
                chunk_value_lengths = [0 if value is None else len(value) for value in chunk_values]
            else:
                chunk_value_lengths = list(map(len, cast(Sequence[bytes], chunk_values)))
            keys += chunk_keys
            values += chunk_values
            key_lengths += chunk_key_lengths
            value_lengths += chunk_value_lengths
            chunk_size = sum(chunk_key_lengths) + sum(chunk_value_lengths)
            size += chunk_size
            record_size = chunk_size // len(chunk_keys) + 1
        if not keys:
            return count, raw_bytes
        if size > fileformat.MAX_BLOCK_BYTES:
            # records bigger than the chunk was sized for: the block keeps what fits, the rest starts the next one
            kept = _records_that_fit(keys, key_lengths, value_lengths, count)
            carried_keys[:0] = keys[kept:]
            carried_values[:0] = values[kept:]
            del keys[kept:], values[kept:], key_lengths[kept:], value_lengths[kept:]
            size = sum(key_lengths) + sum(value_lengths)
            has_delete = None in values
        _check_block_input(keys, values, previous, count, has_delete=has_delete, allow_delete=allow_delete)
        n = len(keys)
        key_bytes = sum(key_lengths)
        flags = FLAG_OPS if has_delete else 0
        parts = [b""]  # the block header, once the flags are known
        if has_delete:
            parts.append(bytes(OP_DELETE if value is None else OP_PUT for value in values))
        # a delete has no value: the value column holds the puts' values only (without a delete, values has no None:
        # the list is taken as it is, not copied)
        puts: list[bytes] = [value for value in values if value is not None] if has_delete else values  # type: ignore[assignment]
        key_length = key_lengths[0]
        keys_fixed = planes and key_length <= PLANES_MAX_LENGTH and key_lengths.count(key_length) == n
        value_length = len(puts[0]) if puts else 0
        values_fixed = (
            planes
            and bool(puts)
            and value_length <= PLANES_MAX_LENGTH
            and (list(map(len, puts)) if has_delete else value_lengths).count(value_length) == len(puts)
        )
        if keys_fixed:
            flags |= FLAG_KEYS_FIXED
            parts.append(u32_bytes([key_length]))
        else:
            parts.append(u32_bytes(key_lengths))
        if values_fixed:
            flags |= FLAG_VALUES_FIXED
            parts.append(u32_bytes([value_length]))
        else:
            parts.append(u32_bytes(value_lengths))
        joined_keys = b"".join(keys)
        parts.append(to_planes(joined_keys, n, key_length) if keys_fixed else joined_keys)
        joined_values = b"".join(puts)
        parts.append(to_planes(joined_values, len(puts), value_length) if values_fixed else joined_values)
        parts[0] = BLOCK_HEADER.pack(n, flags, key_bytes, size - key_bytes)
        emit(b"".join(parts))
        count += n
        raw_bytes += size
        previous = keys[-1]


def _records_that_fit(keys: list[bytes], key_lengths: list[int], value_lengths: list[int], first_index: int) -> int:
    """How many of a block's first records fit in MAX_BLOCK_BYTES (at least one); a first record bigger than that is
    refused, naming it. Runs only for a block that would hold more (records of hundreds of MiB), never per record
    otherwise."""
    limit = fileformat.MAX_BLOCK_BYTES
    total = 0
    for index, (key_length, value_length) in enumerate(zip(key_lengths, value_lengths, strict=True)):
        total += key_length + value_length
        if total > limit:
            if index == 0:
                _raise_record_too_big(first_index, keys[0], key_length, value_length)
            return index
    return len(keys)


def _raise_record_too_big(index: int, key: bytes, key_length: int, value_length: int) -> None:
    raise UsageError(
        f"record {index} (key {key[:64]!r}) has {key_length} key and {value_length} value bytes, more than the "
        f"{fileformat.MAX_BLOCK_BYTES} bytes a record file holds in one record or block (MAX_BLOCK_BYTES): "
        "no file can store it; nothing valid was written, delete the output"
    )


def _check_block_input(
    keys: list[bytes],
    values: list[bytes | None],
    previous: bytes | None,
    first_index: int,
    *,
    has_delete: bool,
    allow_delete: bool,
) -> None:
    """Raise StateBackendError, naming the first bad record, unless the block's keys strictly increase (after
    ``previous``) and it holds deletes only where allowed. The common case costs two C calls."""
    in_order = all(map(lt, keys, islice(keys, 1, None))) and (previous is None or previous < keys[0])
    if not in_order:
        before = previous
        for index, key in enumerate(keys):
            if before is not None and not before < key:
                raise InvalidKeyError(
                    f"records must be in strictly increasing key order: record {first_index + index} has key "
                    f"{key[:64]!r} after {before[:64]!r}; nothing valid was written, delete the output"
                )
            before = key
    if has_delete and not allow_delete:
        index = values.index(None)
        raise UsageError(
            f"a snapshot holds puts only, record {first_index + index} (key {keys[index][:64]!r}) is a delete; "
            "nothing valid was written, delete the output"
        )


def _write_body_v1(
    records: Iterable[tuple[bytes, bytes | None]], emit: Callable[[bytes], None], *, allow_delete: bool
) -> tuple[int, int]:
    """Version 1 body: a 9-byte prefix per record. Returns (record count, key+value bytes)."""
    count = 0
    body_raw = 0  # uncompressed body bytes
    parts: list[bytes] = []
    append = parts.append
    extend = parts.extend
    block = 0
    prev = b""
    pack_cache: dict[tuple[int, int], Callable[..., bytes]] = {}
    block_bytes = fileformat.BLOCK_BYTES
    limit = fileformat.MAX_BLOCK_BYTES
    for key, value in records:
        # prev starts as b"": only an empty first key compares <= it, and count is 0 then
        if key <= prev and count:
            raise InvalidKeyError(
                f"records must be in strictly increasing key order: record {count} has key {key[:64]!r} "
                f"after {prev[:64]!r}; nothing valid was written, delete the output"
            )
        klen = len(key)
        if value is None:
            if not allow_delete:
                raise UsageError(
                    f"a snapshot holds puts only, record {count} (key {key[:64]!r}) is a delete; "
                    "nothing valid was written, delete the output"
                )
            if klen > limit:
                _raise_record_too_big(count, key, klen, 0)
            extend((_pack_record_prefix(OP_DELETE, klen, 0), key))
            block += RECORD_PREFIX_SIZE + klen
        else:
            vlen = len(value)
            pack = pack_cache.get((klen, vlen))
            if pack is not None:
                append(pack(OP_PUT, klen, vlen, key, value))
            elif klen + vlen <= _PACK_WHOLE_MAX and len(pack_cache) < _PACK_CACHE_MAX:
                # one struct call per record instead of three list items: records of a store mostly share sizes
                pack = pack_cache[(klen, vlen)] = struct.Struct(f"<BII{klen}s{vlen}s").pack
                append(pack(OP_PUT, klen, vlen, key, value))
            else:  # a cached shape is at most _PACK_WHOLE_MAX bytes: only a record packed here can be too big
                if klen + vlen > limit:
                    _raise_record_too_big(count, key, klen, vlen)
                extend((_pack_record_prefix(OP_PUT, klen, vlen), key, value))
            block += RECORD_PREFIX_SIZE + klen + vlen
        prev = key
        count += 1
        if block >= block_bytes:
            body_raw += block
            block = 0
            emit(b"".join(parts))
            parts.clear()
    if parts:
        body_raw += block
        emit(b"".join(parts))
    return count, body_raw - RECORD_PREFIX_SIZE * count
