"""The sorted record file: the self-describing on-blob format of sorted records that both backends write.

The changelog-delta backend writes DELTA files (one commit's change) and SNAPSHOT files (a whole store); the
blob-snapshot backend writes RUN files (the merged changes of a range of commits, tombstones included, or a whole store
as its base run). Any backend may use it.

Contract:

- A file is ``header | body | footer`` (byte layout and the reasons for it: docs/formats-changelog.md). The header
  carries the magic, the format version, the kind, the compression and the lineage (:class:`FileHeader`) under its
  own CRC-32, so :func:`read_header` can trust the first bytes alone. The body holds the records in strictly
  increasing key order, as one zstd stream when compressed: version 3 (written by default) as columnar blocks of up
  to 64Ki records that CPython decodes with a few C calls per block, a column whose records all have one length
  stored as byte planes under that length; version 2 (still read, and written when a header asks for it) as the
  same blocks with every length stored; version 1 (likewise) as one 9-byte prefix per record. The fixed-size footer
  holds the record count, the body's byte length and a BLAKE2b-128 digest of everything before the digest, then an
  end marker.
- :func:`write_file` streams: memory stays bounded whatever the record count, and ``out`` is never seeked. When the
  input is bad (keys not strictly increasing, a delete in a snapshot, a record bigger than :data:`MAX_BLOCK_BYTES`)
  it raises :class:`StateBackendError` before the footer is written, so what was written is never a valid file; the
  caller deletes it.
- :func:`verify` checks a whole file in memory; :func:`iter_records` reads records in key order (for version 2 as
  C-level iterators chained block by block, so a C consumer such as LMDB's ``putmulti`` runs no Python frame per
  record). For a ``bytes``
  source it verifies the whole file before yielding the first record, so a corrupt delta is never applied. For a
  stream source (a big snapshot read from disk) it verifies while yielding and raises :class:`CorruptDataError` at
  the end at the latest: the caller must apply the records inside one transaction that aborts on the error (the local
  store's ``replace_contents`` does).
- Every failure to read is a :class:`CorruptDataError` that names the blob and says what is wrong, or an
  :class:`IncompatibleFormatError` for a format version newer than this release reads.
- What a reader holds is bounded by what the file declares, and what it may declare is bounded (a block's keys and
  values by :data:`MAX_BLOCK_BYTES`, the zstd window by 128 MiB): the digest is no secret, so a forged body that
  decompresses to gigabytes is refused by the sizes it declares, before it is decompressed.
"""

from __future__ import annotations

import hashlib
import io
import json
import struct
import sys
import zlib
from array import array
from collections.abc import Callable, Generator, Iterable, Iterator, Sequence
from itertools import chain, islice
from operator import lt
from typing import Any, BinaryIO, cast

import attrs
import zstandard

from statebackend.errors import CorruptDataError, IncompatibleFormatError, StateBackendError

__all__ = [
    "BLOCK_MAX_RECORDS",
    "COMPRESSIONS",
    "FOOTER_SIZE",
    "FORMAT_VERSION",
    "HEADER_PREFIX_SIZE",
    "KIND_DELTA",
    "KIND_RUN",
    "KIND_SNAPSHOT",
    "MAGIC",
    "MAGIC_END",
    "MAX_BLOCK_BYTES",
    "MAX_HEADER_METADATA_BYTES",
    "PLANES_MAX_LENGTH",
    "SUPPORTED_FORMAT_VERSIONS",
    "FileHeader",
    "FileStats",
    "Record",
    "RecordColumns",
    "RecordReader",
    "encode",
    "header_size",
    "iter_records",
    "read_frame",
    "read_header",
    "verify",
    "write_file",
]

MAGIC = b"SBCHLOG\x00"
MAGIC_END = b"SBCHEND\x00"
#: the version this release writes by default (a header with ``format_version=1`` or ``2`` still gets that version)
FORMAT_VERSION = 3
#: every version this release reads and writes; a stored sample of each lives in tests/data/changelog/
SUPPORTED_FORMAT_VERSIONS = (1, 2, 3)

KIND_DELTA = "delta"
KIND_SNAPSHOT = "snapshot"
KIND_RUN = "run"
_KIND_CODES = {KIND_DELTA: 1, KIND_SNAPSHOT: 2, KIND_RUN: 3}
#: kinds whose records may be deletes (tombstones)
_DELETE_KINDS = frozenset({KIND_DELTA, KIND_RUN})
_KIND_NAMES = {code: kind for kind, code in _KIND_CODES.items()}

_COMPRESSION_CODES = {"none": 0, "zstd": 1}
_COMPRESSION_NAMES = {code: name for name, code in _COMPRESSION_CODES.items()}
COMPRESSIONS = tuple(_COMPRESSION_CODES)

_OP_PUT = 1
_OP_DELETE = 2

# Little-endian throughout: native on every machine this runs on, and what zstd and LMDB use.
#: magic, format version u16, kind u8, compression u8, header metadata length u32
_PREFIX = struct.Struct("<8sHBBI")
HEADER_PREFIX_SIZE = _PREFIX.size  # 16
_MAGIC_AND_VERSION = struct.Struct("<8sH")
_CRC32 = struct.Struct("<I")
#: record count u64, body byte length u64 (both under the digest), digest 16 bytes, end magic
_FOOTER = struct.Struct("<QQ16s8s")
FOOTER_SIZE = _FOOTER.size  # 40
_FOOTER_COVERED = 16  # count and body length are hashed too; only the digest itself and the end magic are not
_DIGEST_SIZE = 16
#: the header metadata is a few hundred bytes; the cap keeps a corrupt length from allocating gigabytes
MAX_HEADER_METADATA_BYTES = 64 * 1024

#: record prefix: op u8, key length u32, value length u32 (0 for a delete), then key, then value
_RECORD_PREFIX = struct.Struct("<BII")
_RECORD_PREFIX_SIZE = _RECORD_PREFIX.size  # 9
_pack_record_prefix = _RECORD_PREFIX.pack
_unpack_record_prefix = _RECORD_PREFIX.unpack_from

#: the writer joins records into blocks of about this many bytes before compressing; the reader decompresses and
#: reads the stream in blocks of this size: large enough to amortize per-call costs, small enough to stay in cache
_BLOCK_BYTES = 1 << 20
#: records up to this size are packed by one cached struct call; bigger ones skip the extra copy
_PACK_WHOLE_MAX = 4096
_PACK_CACHE_MAX = 1024

#: version 2 and 3 block header: record count u32, flags u8, key bytes u32, value bytes u32; then (flag _FLAG_OPS) n
#: op bytes, the key lengths (n u32; version 3 with _FLAG_KEYS_FIXED: one u32), the value lengths (n u32, 0 for a
#: delete; version 3 with _FLAG_VALUES_FIXED: one u32, the length of every put's value), the keys concatenated (with
#: _FLAG_KEYS_FIXED as byte planes), the values concatenated (with _FLAG_VALUES_FIXED the puts' values as byte planes)
_BLOCK_HEADER = struct.Struct("<IBII")
_BLOCK_HEADER_SIZE = _BLOCK_HEADER.size  # 13
_unpack_block_header = _BLOCK_HEADER.unpack_from
_FLAG_OPS = 1  # the block has an op byte per record (it holds a delete); without it every record is a put
_FLAG_KEYS_FIXED = 2  # version 3: every key has one length, stored once; the keys are stored as byte planes
_FLAG_VALUES_FIXED = 4  # version 3: every put's value has one length, stored once; their values as byte planes
#: the flags a block of each columnar version may carry
_VALID_FLAGS = {2: _FLAG_OPS, 3: _FLAG_OPS | _FLAG_KEYS_FIXED | _FLAG_VALUES_FIXED}
#: the version 3 writer stores a column of one length as byte planes up to this length: short fixed-size keys and
#: values (ids, counters, timestamps) are where bytes at one position repeat across records; a longer record's own
#: byte order is worth more to zstd than the alignment (any length is read)
PLANES_MAX_LENGTH = 64
#: the writer closes a block at this many records or once its keys and values reach _BLOCK_BYTES; the reader refuses
#: a bigger count, so a corrupt count cannot make it allocate more than a few MiB of lengths
BLOCK_MAX_RECORDS = 1 << 16
#: the writer takes records from its input at most this many at a time, fewer when the records seen so far were big:
#: it holds about one block plus one chunk, however big the records
_WRITE_CHUNK = 1024
_FIRST_RECORD_GUESS = 64 * 1024  # bytes per record assumed before any was seen: a first chunk of 16 records
#: the most key and value bytes one block (versions 2 and 3) or one record (version 1) may hold. A reader refuses a
#: block or record that declares more before it reads a byte of it: the digest is no secret, so a forged file whose
#: small zstd body decompresses to gigabytes passes every checksum, and this is what bounds the memory it can make a
#: reader take (about twice this: the block and its records). The writer never writes more: it closes a block
#: before, and refuses a record bigger than this, which also keeps a block's u32 byte counts and lengths in range.
#: 1025 MiB: at least every block an earlier release wrote of records up to _BLOCK_BYTES each (it closed a block
#: once it reached _BLOCK_BYTES, after a chunk of at most _WRITE_CHUNK records). Read when called, not bound at import
MAX_BLOCK_BYTES = (_WRITE_CHUNK + 1) * _BLOCK_BYTES
#: a reader asks its source for at most this many bytes per call, so a corrupt block size costs no big allocation
_READ_MAX = 16 << 20
#: the largest zstd window a reader accepts (a frame asking for more is corrupt): 128 MiB, what level 22, the highest
#: the backends allow, uses and libzstd's own default limit, stated here so what decompression may hold is explicit
_MAX_WINDOW_BYTES = 1 << 27
_PUT_OP_BYTES = b"\x01"
_U32 = "I" if array("I").itemsize == 4 else "L"
_BIG_ENDIAN = sys.byteorder == "big"

#: (key, value); value is None for a delete
Record = tuple[bytes, "bytes | None"]


def _check_kind(instance: Any, attribute: attrs.Attribute[Any], value: str) -> None:
    if value not in _KIND_CODES:
        raise StateBackendError(f"FileHeader.kind must be one of {sorted(_KIND_CODES)}, got {value!r}")


@attrs.frozen
class FileHeader:
    """The lineage a file carries in its header.

    A delta at ``seq`` applies on version ``base_seq = seq - 1`` (version 0 is the empty store, so the first delta
    has seq 1); a snapshot is version ``seq`` itself (``base_seq == seq``); a run holds the changes of versions
    ``base_seq + 1 .. seq`` and applies on version ``base_seq`` (a base run: ``base_seq == 0``, on the empty store).
    ``checkpoint_id`` and ``token`` are those of version ``seq``.
    """

    kind: str = attrs.field(validator=_check_kind)
    job: str = attrs.field(validator=attrs.validators.instance_of(str))
    task: str = attrs.field(validator=attrs.validators.instance_of(str))
    store: str = attrs.field(validator=attrs.validators.instance_of(str))
    checkpoint_id: str = attrs.field(validator=attrs.validators.instance_of(str))
    token: str = attrs.field(validator=attrs.validators.instance_of(str))
    seq: int = attrs.field(validator=attrs.validators.instance_of(int))
    base_seq: int = attrs.field(validator=attrs.validators.instance_of(int))
    format_version: int = attrs.field(default=FORMAT_VERSION, validator=attrs.validators.instance_of(int))

    def __attrs_post_init__(self) -> None:
        if self.kind == KIND_DELTA and (self.seq < 1 or self.base_seq != self.seq - 1):
            raise StateBackendError(
                f"a delta needs seq >= 1 and base_seq == seq - 1 (the version it applies on), "
                f"got seq={self.seq} base_seq={self.base_seq}"
            )
        if self.kind == KIND_RUN and not 0 <= self.base_seq < self.seq:
            raise StateBackendError(
                f"a run needs 0 <= base_seq < seq (it holds versions base_seq+1..seq), got seq={self.seq} "
                f"base_seq={self.base_seq}"
            )
        if self.kind == KIND_SNAPSHOT and (self.seq < 0 or self.base_seq != self.seq):
            raise StateBackendError(
                f"a snapshot needs seq >= 0 and base_seq == seq, got seq={self.seq} base_seq={self.base_seq}"
            )


@attrs.frozen
class FileStats:
    """What :func:`write_file` wrote: records, their key+value bytes, and the file's size in bytes."""

    record_count: int
    raw_bytes: int
    file_bytes: int


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


# ---------------------------------------------------------------------------------------------------------- writing


@attrs.frozen
class RecordColumns:
    """Records given as two columns: ``keys[i]`` with ``values[i]`` (None: a delete), the keys strictly increasing.
    :func:`write_file` takes them as they are, slice by slice, without a tuple per record (what a sorted write batch
    already holds: building 12,500 tuples and splitting them again took about a third of a delta's encoding)."""

    keys: Sequence[bytes]
    values: Sequence[bytes | None]

    def __attrs_post_init__(self) -> None:
        if len(self.keys) != len(self.values):
            raise StateBackendError(f"record columns of {len(self.keys)} keys and {len(self.values)} values")

    def __iter__(self) -> Iterator[tuple[bytes, bytes | None]]:
        return zip(self.keys, self.values)



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
    if compression not in _COMPRESSION_CODES:
        raise StateBackendError(f"compression must be one of {list(COMPRESSIONS)}, got {compression!r}")
    version = header.format_version
    if version not in SUPPORTED_FORMAT_VERSIONS:
        raise StateBackendError(
            f"this release writes format versions {list(SUPPORTED_FORMAT_VERSIONS)}, the header asks for {version}"
        )
    hasher = hashlib.blake2b(digest_size=_DIGEST_SIZE)
    written = 0

    def emit(data: bytes) -> None:
        nonlocal written
        if data:
            out.write(data)
            hasher.update(data)
            written += len(data)

    metadata = _encode_metadata(header)
    prefix = _PREFIX.pack(MAGIC, version, _KIND_CODES[header.kind], _COMPRESSION_CODES[compression], len(metadata))
    header_bytes = prefix + metadata
    emit(header_bytes + _CRC32.pack(zlib.crc32(header_bytes)))
    header_end = written

    emit_body = emit
    finish: Callable[[], bytes] | None = None
    if compression == "zstd":
        compressor = zstandard.ZstdCompressor(level=level).compressobj()
        compress = compressor.compress
        finish = compressor.flush

        def emit_body(data: bytes) -> None:
            emit(compress(data))

    allow_delete = header.kind in _DELETE_KINDS
    if version == 1:
        count, raw_bytes = _write_body_v1(iter(records), emit_body, allow_delete=allow_delete)
    else:
        count, raw_bytes = _write_body_columnar(records, emit_body, allow_delete=allow_delete, planes=version >= 3)
    if finish is not None:
        emit(finish())

    covered = _FOOTER.pack(count, written - header_end, b"", b"")[:_FOOTER_COVERED]
    hasher.update(covered)
    footer = covered + hasher.digest() + MAGIC_END
    out.write(footer)
    written += len(footer)
    return FileStats(record_count=count, raw_bytes=raw_bytes, file_bytes=written)


def encode(header: FileHeader, records: Iterable[tuple[bytes, bytes | None]], **kwargs: Any) -> bytes:
    """The whole file as bytes; keyword arguments as for :func:`write_file`."""
    out = io.BytesIO()
    write_file(out, header, records, **kwargs)
    return out.getvalue()


def _write_body_columnar(records: Iterable[tuple[bytes, bytes | None]] | RecordColumns,
                         emit: Callable[[bytes], None], *, allow_delete: bool, planes: bool) -> tuple[int, int]:
    """Version 2 and 3 body: columnar blocks. Returns (record count, key+value bytes).

    Records are taken from the input a chunk at a time and split into columns by C calls (``zip``, ``map(len)``),
    so the writer runs a few Python statements per chunk, not per record. With ``planes`` (version 3) a column whose
    records all have one length (at most PLANES_MAX_LENGTH) is written as that length once and its bytes as planes.
    """
    next_chunk = _column_chunks(records) if isinstance(records, RecordColumns) else _record_chunks(iter(records))
    count = 0
    raw_bytes = 0
    previous: bytes | None = None  # the last key of the previous block
    record_size = _FIRST_RECORD_GUESS  # bytes per record in the last chunk, to size the next one
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
        while len(keys) < BLOCK_MAX_RECORDS and size < _BLOCK_BYTES:
            fits = (_BLOCK_BYTES - size) // record_size + 1
            take = min(_WRITE_CHUNK, BLOCK_MAX_RECORDS - len(keys), fits)
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
        if size > MAX_BLOCK_BYTES:
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
        flags = _FLAG_OPS if has_delete else 0
        parts = [b""]  # the block header, once the flags are known
        if has_delete:
            parts.append(bytes(_OP_DELETE if value is None else _OP_PUT for value in values))
        # a delete has no value: the value column holds the puts' values only
        puts: list[bytes] = ([value for value in values if value is not None] if has_delete
                             else values)  # type: ignore[assignment]
        key_length = key_lengths[0]
        keys_fixed = planes and key_length <= PLANES_MAX_LENGTH and key_lengths.count(key_length) == n
        value_length = len(puts[0]) if puts else 0
        values_fixed = (planes and bool(puts) and value_length <= PLANES_MAX_LENGTH
                        and (list(map(len, puts)) if has_delete else value_lengths).count(value_length) == len(puts))
        if keys_fixed:
            flags |= _FLAG_KEYS_FIXED
            parts.append(_u32_bytes([key_length]))
        else:
            parts.append(_u32_bytes(key_lengths))
        if values_fixed:
            flags |= _FLAG_VALUES_FIXED
            parts.append(_u32_bytes([value_length]))
        else:
            parts.append(_u32_bytes(value_lengths))
        joined_keys = b"".join(keys)
        parts.append(_to_planes(joined_keys, n, key_length) if keys_fixed else joined_keys)
        joined_values = b"".join(puts)
        parts.append(_to_planes(joined_values, len(puts), value_length) if values_fixed else joined_values)
        parts[0] = _BLOCK_HEADER.pack(n, flags, key_bytes, size - key_bytes)
        emit(b"".join(parts))
        count += n
        raw_bytes += size
        previous = keys[-1]


def _record_chunks(source: Iterator[tuple[bytes, bytes | None]]
                   ) -> Callable[[int], tuple[Sequence[bytes], Sequence[bytes | None]]]:
    """The next (up to) ``take`` records of ``source`` as (keys, values): split by one ``zip`` in C."""

    def take_next(take: int) -> tuple[Sequence[bytes], Sequence[bytes | None]]:
        chunk = list(islice(source, take))
        if not chunk:
            return (), ()
        keys, values = zip(*chunk)
        return keys, values

    return take_next


def _column_chunks(columns: RecordColumns) -> Callable[[int], tuple[Sequence[bytes], Sequence[bytes | None]]]:
    """The next (up to) ``take`` records of ``columns``: two slices."""
    keys, values = columns.keys, columns.values
    position = 0

    def take_next(take: int) -> tuple[Sequence[bytes], Sequence[bytes | None]]:
        nonlocal position
        start, position = position, min(position + take, len(keys))
        return keys[start:position], values[start:position]

    return take_next


def _records_that_fit(keys: list[bytes], key_lengths: list[int], value_lengths: list[int], first_index: int) -> int:
    """How many of a block's first records fit in MAX_BLOCK_BYTES (at least one); a first record bigger than that is
    refused, naming it. Runs only for a block that would hold more (records of hundreds of MiB), never per record
    otherwise."""
    limit = MAX_BLOCK_BYTES
    total = 0
    for index, (key_length, value_length) in enumerate(zip(key_lengths, value_lengths)):
        total += key_length + value_length
        if total > limit:
            if index == 0:
                _raise_record_too_big(first_index, keys[0], key_length, value_length)
            return index
    return len(keys)


def _raise_record_too_big(index: int, key: bytes, key_length: int, value_length: int) -> None:
    raise StateBackendError(
        f"record {index} (key {key[:64]!r}) has {key_length} key and {value_length} value bytes, more than the "
        f"{MAX_BLOCK_BYTES} bytes a record file holds in one record or block (MAX_BLOCK_BYTES): no file can store "
        "it; nothing valid was written, delete the output"
    )


def _to_planes(data: bytes, n: int, length: int) -> bytes:
    """``n`` records of ``length`` bytes each (``data``, concatenated) as byte planes: the first byte of every record,
    then the second byte of every record, and so on. Records of one length in key order share bytes at the same
    position (a key's prefix, a small number's high bytes), which planes put next to each other for zstd.

    One C slice per plane, or per record when there are fewer records than bytes per record."""
    if n <= 1 or length <= 1:
        return data  # one record, or one plane: the planes are the data itself
    if length <= n:
        return b"".join([data[i::length] for i in range(length)])
    out = bytearray(len(data))
    for j in range(n):
        out[j::n] = data[j * length:(j + 1) * length]
    return bytes(out)


def _from_planes(data: bytes, start: int, n: int, length: int) -> Sequence[bytes]:
    """The ``n`` records of ``length`` bytes each stored as byte planes in ``data[start:start + n * length]``
    (the inverse of :func:`_to_planes`): one C slice assignment per plane, then one struct call cuts the records;
    one slice per record when there are fewer records than bytes per record."""
    view = memoryview(data)[start:start + n * length]
    if length <= n:
        out = bytearray(n * length)
        for i in range(length):
            out[i::length] = view[i * n:(i + 1) * n]
        return _fixed_struct(n, length).unpack_from(out)
    return [bytes(view[j::n]) for j in range(n)]


#: compiled structs cutting n records of one length, by (n, length): most blocks of a store share one
_FIXED_STRUCTS: dict[tuple[int, int], struct.Struct] = {}


def _fixed_struct(n: int, length: int) -> struct.Struct:
    compiled = _FIXED_STRUCTS.get((n, length))
    if compiled is None:
        if len(_FIXED_STRUCTS) >= 16:
            _FIXED_STRUCTS.clear()
        compiled = _FIXED_STRUCTS[(n, length)] = struct.Struct("<" + f"{length}s" * n)
    return compiled


def _check_block_input(keys: list[bytes], values: list[bytes | None], previous: bytes | None, first_index: int, *,
                       has_delete: bool, allow_delete: bool) -> None:
    """Raise StateBackendError, naming the first bad record, unless the block's keys strictly increase (after
    ``previous``) and it holds deletes only where allowed. The common case costs two C calls."""
    in_order = all(map(lt, keys, islice(keys, 1, None))) and (previous is None or previous < keys[0])
    if not in_order:
        before = previous
        for index, key in enumerate(keys):
            if before is not None and not before < key:
                raise StateBackendError(
                    f"records must be in strictly increasing key order: record {first_index + index} has key "
                    f"{key[:64]!r} after {before[:64]!r}; nothing valid was written, delete the output"
                )
            before = key
    if has_delete and not allow_delete:
        index = values.index(None)
        raise StateBackendError(
            f"a snapshot holds puts only, record {first_index + index} (key {keys[index][:64]!r}) is a delete; "
            "nothing valid was written, delete the output"
        )


def _u32_bytes(numbers: list[int]) -> bytes:
    packed = array(_U32, numbers)
    if _BIG_ENDIAN:
        packed.byteswap()
    return packed.tobytes()


def _write_body_v1(records: Iterable[tuple[bytes, bytes | None]], emit: Callable[[bytes], None], *,
                   allow_delete: bool) -> tuple[int, int]:
    """Version 1 body: a 9-byte prefix per record. Returns (record count, key+value bytes)."""
    count = 0
    body_raw = 0  # uncompressed body bytes
    parts: list[bytes] = []
    append = parts.append
    extend = parts.extend
    block = 0
    prev = b""
    pack_cache: dict[tuple[int, int], Callable[..., bytes]] = {}
    for key, value in records:
        # prev starts as b"": only an empty first key compares <= it, and count is 0 then
        if key <= prev and count:
            raise StateBackendError(
                f"records must be in strictly increasing key order: record {count} has key {key[:64]!r} "
                f"after {prev[:64]!r}; nothing valid was written, delete the output"
            )
        klen = len(key)
        if value is None:
            if not allow_delete:
                raise StateBackendError(
                    f"a snapshot holds puts only, record {count} (key {key[:64]!r}) is a delete; "
                    "nothing valid was written, delete the output"
                )
            if klen > MAX_BLOCK_BYTES:
                _raise_record_too_big(count, key, klen, 0)
            extend((_pack_record_prefix(_OP_DELETE, klen, 0), key))
            block += _RECORD_PREFIX_SIZE + klen
        else:
            vlen = len(value)
            pack = pack_cache.get((klen, vlen))
            if pack is not None:
                append(pack(_OP_PUT, klen, vlen, key, value))
            elif klen + vlen <= _PACK_WHOLE_MAX and len(pack_cache) < _PACK_CACHE_MAX:
                # one struct call per record instead of three list items: records of a store mostly share sizes
                pack = pack_cache[(klen, vlen)] = struct.Struct(f"<BII{klen}s{vlen}s").pack
                append(pack(_OP_PUT, klen, vlen, key, value))
            else:  # a cached shape is at most _PACK_WHOLE_MAX bytes: only a record packed here can be too big
                if klen + vlen > MAX_BLOCK_BYTES:
                    _raise_record_too_big(count, key, klen, vlen)
                extend((_pack_record_prefix(_OP_PUT, klen, vlen), key, value))
            block += _RECORD_PREFIX_SIZE + klen + vlen
        prev = key
        count += 1
        if block >= _BLOCK_BYTES:
            body_raw += block
            block = 0
            emit(b"".join(parts))
            parts.clear()
    if parts:
        body_raw += block
        emit(b"".join(parts))
    return count, body_raw - _RECORD_PREFIX_SIZE * count


# ---------------------------------------------------------------------------------------------------------- reading


def header_size(prefix: bytes, *, name: str) -> int:
    """How many leading bytes of a file :func:`read_header` needs, from its first HEADER_PREFIX_SIZE bytes."""
    _, _, _, metadata_length = _parse_prefix(prefix, name=name)
    return HEADER_PREFIX_SIZE + metadata_length + _CRC32.size


def read_header(data: bytes, *, name: str) -> FileHeader:
    """The header of the file whose first bytes are ``data`` (the whole file, or at least its header)."""
    header, _, _ = _parse_header(data, name=name)
    return header


def read_frame(head: bytes, tail: bytes, size: int, *, name: str) -> FileHeader:
    """The header of a file known by its first bytes ``head`` (at least :func:`header_size` of them), its last
    FOOTER_SIZE bytes ``tail`` and its ``size``, with the frame checked: header CRC, end marker, and a footer body
    length that matches ``size`` (a cut or half-written file fails). Not the digest: that needs the whole file. For a
    writer deciding by two ranged reads whether a blob is whole and is the one it wrote."""
    header, _, header_end = _parse_header(head, name=name)
    if size < header_end + FOOTER_SIZE or len(tail) != FOOTER_SIZE:
        raise CorruptDataError(f"{name}: truncated at byte {size}: the file ends before its {FOOTER_SIZE}-byte "
                               f"footer (header ends at byte {header_end})")
    _, body_length, _, magic_end = _FOOTER.unpack(tail)
    if magic_end != MAGIC_END:
        raise CorruptDataError(f"{name}: no end marker at byte {size - len(MAGIC_END)}: the file was cut short or "
                               f"not completely written (truncated at byte {size}?)")
    if body_length != size - FOOTER_SIZE - header_end:
        raise CorruptDataError(f"{name}: the footer says the body has {body_length} bytes, the file holds "
                               f"{size - FOOTER_SIZE - header_end}; the file is truncated or corrupt")
    return header


def verify(data: bytes, *, name: str) -> FileHeader:
    """Check a whole file: magic, version, header CRC, lengths, digest, every record and the record count."""
    header, compression, header_end, body_end, count = _open_bytes(data, name=name, check_digest=True)
    allow_delete = header.kind in _DELETE_KINDS
    if header.format_version == 1:
        found = _drain(_parse_records(_body_blocks(data, header_end, body_end, compression, name=name), name=name,
                                      allow_delete=allow_delete, emit=False))
    else:
        found = _drain(_parse_blocks(_body_reader(data, header_end, body_end, compression, name=name), name=name,
                                     allow_delete=allow_delete, version=header.format_version, emit=False))
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
        allow_delete = header.kind in _DELETE_KINDS

        def check_count(found: int) -> None:
            _check_count(found, count, name=name)

        if header.format_version == 1:
            blocks = _body_blocks(data, header_end, body_end, compression, name=name)
            return RecordReader(header, _then(_parse_records(blocks, name=name, allow_delete=allow_delete),
                                              check_count))
        read = _body_reader(data, header_end, body_end, compression, name=name)
        return RecordReader(header, chain.from_iterable(
            _then(_parse_blocks(read, name=name, allow_delete=allow_delete, version=header.format_version),
                  check_count)))
    return _open_stream(source, name=name)


# ---------------------------------------------------------------------------------------------------------- helpers


def _encode_metadata(header: FileHeader) -> bytes:
    return json.dumps(attrs.asdict(header), separators=(",", ":"), sort_keys=True, ensure_ascii=False).encode()


def _parse_prefix(data: bytes, *, name: str) -> tuple[int, int, int, int]:
    """(version, kind code, compression code, metadata length) from the fixed prefix, checked."""
    if len(data) < _MAGIC_AND_VERSION.size:
        if not MAGIC.startswith(bytes(data[: len(MAGIC)])):
            raise CorruptDataError(f"{name}: not a changelog file (bad magic {bytes(data[:8])!r}, want {MAGIC!r})")
        raise CorruptDataError(f"{name}: truncated at byte {len(data)}: the file header needs "
                               f"{HEADER_PREFIX_SIZE} bytes at least")
    magic, version = _MAGIC_AND_VERSION.unpack_from(data)
    if magic != MAGIC:
        raise CorruptDataError(f"{name}: not a changelog file (bad magic {magic!r}, want {MAGIC!r})")
    # The version is read before anything else so a newer file is reported as such, whatever its layout.
    if version not in SUPPORTED_FORMAT_VERSIONS:
        if version > max(SUPPORTED_FORMAT_VERSIONS):
            raise IncompatibleFormatError(
                f"{name}: changelog format version {version} is newer than this release reads "
                f"(supported: {list(SUPPORTED_FORMAT_VERSIONS)}); upgrade statebackend to read it"
            )
        raise CorruptDataError(f"{name}: changelog format version {version} was never written "
                               f"(supported: {list(SUPPORTED_FORMAT_VERSIONS)})")
    if len(data) < HEADER_PREFIX_SIZE:
        raise CorruptDataError(f"{name}: truncated at byte {len(data)}: the file header needs "
                               f"{HEADER_PREFIX_SIZE} bytes at least")
    _, _, kind_code, compression_code, metadata_length = _PREFIX.unpack_from(data)
    if metadata_length > MAX_HEADER_METADATA_BYTES:
        raise CorruptDataError(f"{name}: header metadata length {metadata_length} exceeds "
                               f"{MAX_HEADER_METADATA_BYTES}; the header is corrupt")
    return version, kind_code, compression_code, metadata_length


def _parse_header(data: bytes, *, name: str) -> tuple[FileHeader, str, int]:
    """(header, compression name, header end offset) from the first bytes of a file."""
    version, kind_code, compression_code, metadata_length = _parse_prefix(data, name=name)
    metadata_end = HEADER_PREFIX_SIZE + metadata_length
    header_end = metadata_end + _CRC32.size
    if len(data) < header_end:
        raise CorruptDataError(f"{name}: truncated at byte {len(data)}: the file header needs {header_end} bytes")
    (stored_crc,) = _CRC32.unpack_from(data, metadata_end)
    if zlib.crc32(data[:metadata_end]) != stored_crc:
        raise CorruptDataError(f"{name}: header checksum mismatch (CRC-32 over bytes 0..{metadata_end}); "
                               "the header is corrupt")
    kind = _KIND_NAMES.get(kind_code)
    compression = _COMPRESSION_NAMES.get(compression_code)
    if kind is None or compression is None:
        raise CorruptDataError(f"{name}: unknown kind code {kind_code} or compression code {compression_code}")
    try:
        fields = json.loads(bytes(data[HEADER_PREFIX_SIZE:metadata_end]))
        header = FileHeader(**fields)
    except (ValueError, TypeError, StateBackendError) as exc:
        raise CorruptDataError(f"{name}: header metadata is not a valid FileHeader: {exc}") from exc
    if header.kind != kind or header.format_version != version:
        raise CorruptDataError(f"{name}: header metadata ({header.kind}, version {header.format_version}) "
                               f"contradicts the fixed header ({kind}, version {version})")
    return header, compression, header_end


def _open_bytes(data: bytes, *, name: str, check_digest: bool) -> tuple[FileHeader, str, int, int, int]:
    """Check the frame of a whole file: (header, compression, header end, body end, footer's record count)."""
    header, compression, header_end = _parse_header(data, name=name)
    size = len(data)
    if size < header_end + FOOTER_SIZE:
        raise CorruptDataError(f"{name}: truncated at byte {size}: the file ends before its {FOOTER_SIZE}-byte "
                               f"footer (header ends at byte {header_end})")
    body_end = size - FOOTER_SIZE
    count, body_length, digest, magic_end = _FOOTER.unpack_from(data, body_end)
    if magic_end != MAGIC_END:
        raise CorruptDataError(f"{name}: no end marker at byte {size - len(MAGIC_END)}: the file was cut short or "
                               f"not completely written (truncated at byte {size}?)")
    if body_length != body_end - header_end:
        raise CorruptDataError(f"{name}: the footer says the body has {body_length} bytes, the file holds "
                               f"{body_end - header_end}; the file is truncated or corrupt")
    if check_digest:
        hasher = hashlib.blake2b(memoryview(data)[: body_end + _FOOTER_COVERED], digest_size=_DIGEST_SIZE)
        if hasher.digest() != digest:
            raise CorruptDataError(f"{name}: checksum mismatch (BLAKE2b-128 over bytes 0..{body_end}); "
                                   "the file is corrupt")
    return header, compression, header_end, body_end, count


def _body_blocks(data: bytes, start: int, end: int, compression: str, *, name: str) -> Iterator[bytes]:
    """The uncompressed body of an in-memory file, in blocks. An uncompressed one is one block: it is in memory
    already, so its records are cut from it whatever their size (MAX_BLOCK_BYTES bounds what a reader collects)."""
    if compression == "none":
        if end > start:
            yield data[start:end]
        return
    # read_across_frames: bytes after the first frame are decoded (and then fail) rather than silently ignored
    reader = _decompressor().stream_reader(memoryview(data)[start:end], read_size=_BLOCK_BYTES,
                                           read_across_frames=True)
    yield from _decompressed_blocks(reader, name=name)


def _decompressor() -> zstandard.ZstdDecompressor:
    """A decompressor whose window, the memory a frame makes it hold besides what it hands out, is bounded."""
    return zstandard.ZstdDecompressor(max_window_size=_MAX_WINDOW_BYTES)


def _decompressed_blocks(reader: Any, *, name: str) -> Iterator[bytes]:
    try:
        while True:
            block = reader.read(_BLOCK_BYTES)
            if not block:
                return
            yield block
    except zstandard.ZstdError as exc:
        raise CorruptDataError(f"{name}: the compressed body does not decompress: {exc}") from exc


def _parse_records(blocks: Iterable[bytes], *, name: str, allow_delete: bool,
                   emit: bool = True) -> Generator[Record, None, int]:
    """Records from uncompressed body blocks (a record may straddle blocks); returns the count when done.

    ``emit=False`` checks every record without yielding any (what verify needs): about a third cheaper.
    """
    unpack = _unpack_record_prefix
    prefix_size = _RECORD_PREFIX_SIZE
    limit = MAX_BLOCK_BYTES
    count = 0
    prev = b""
    base = 0  # body offset of buf[0], for messages
    tail = b""  # the unread end of the previous block
    big: bytearray | None = None  # collects a record much larger than a block, copying each byte once
    need = 0
    for chunk in blocks:
        if big is not None:
            big += chunk
            if len(big) < need:
                continue
            buf = bytes(big)
            big = None
        elif tail:
            buf = tail + chunk
        else:
            buf = chunk
        pos = 0
        end = len(buf)
        while pos + prefix_size <= end:
            op, klen, vlen = unpack(buf, pos)
            key_start = pos + prefix_size
            value_start = key_start + klen
            record_end = value_start + vlen
            if record_end > end:
                break
            key = buf[key_start:value_start]
            # prev starts as b"": only an empty first key compares <= it, and count is 0 then
            if key <= prev and count:
                raise CorruptDataError(f"{name}: record {count} at body byte {base + pos} has key {key[:64]!r}, "
                                       f"not after {prev[:64]!r}; keys must strictly increase")
            if op == _OP_PUT:
                if emit:
                    yield key, buf[value_start:record_end]
            elif op == _OP_DELETE and allow_delete and vlen == 0:
                if emit:
                    yield key, None
            else:
                raise CorruptDataError(f"{name}: record {count} at body byte {base + pos} has op {op} and value "
                                       f"length {vlen}, not a valid {'delta' if allow_delete else 'snapshot'} record")
            prev = key
            pos = record_end
            count += 1
        base += pos
        tail = buf[pos:]
        if len(tail) >= prefix_size:
            _, klen, vlen = unpack(tail, 0)
            if klen + vlen > limit:  # checked before the record is collected: its bytes are not read
                raise CorruptDataError(f"{name}: record {count} at body byte {base} declares {klen} key and {vlen} "
                                       f"value bytes, more than the {limit} a record may hold (MAX_BLOCK_BYTES); "
                                       "the file is corrupt")
            need = prefix_size + klen + vlen
            if need > 2 * _BLOCK_BYTES:
                big = bytearray(tail)
                tail = b""
    left = len(big) if big is not None else len(tail)
    if left:
        raise CorruptDataError(f"{name}: the body ends inside record {count} at body byte {base} "
                               f"({left} bytes left over); the file is truncated or corrupt")
    return count


def _body_reader(data: bytes, start: int, end: int, compression: str, *, name: str) -> Callable[[int], bytes]:
    """``read(size)`` over the uncompressed body of an in-memory file."""
    if compression == "none":
        return io.BytesIO(memoryview(data)[start:end]).read
    return _zstd_read(memoryview(data)[start:end], name=name)


def _zstd_read(source: Any, *, name: str) -> Callable[[int], bytes]:
    # read_across_frames: bytes after the first frame are decoded (and then fail) rather than silently ignored
    reader = _decompressor().stream_reader(source, read_size=_BLOCK_BYTES, read_across_frames=True, closefd=False)

    def read(size: int) -> bytes:
        try:
            return reader.read(size)
        except zstandard.ZstdError as exc:
            raise CorruptDataError(f"{name}: the compressed body does not decompress: {exc}") from exc

    return read


def _read_exactly(read: Callable[[int], bytes], size: int) -> bytes:
    """``size`` bytes from ``read``, fewer only at the end of the body; at most _READ_MAX bytes asked per call, so a
    corrupt size allocates no more than the body holds."""
    data = read(min(size, _READ_MAX))
    if len(data) >= size or not data:
        return data
    parts = [data]
    have = len(data)
    while have < size:
        chunk = read(min(size - have, _READ_MAX))
        if not chunk:
            break
        parts.append(chunk)
        have += len(chunk)
    return b"".join(parts)


def _parse_blocks(read: Callable[[int], bytes], *, name: str, allow_delete: bool, version: int,
                  emit: bool = True) -> Generator[Iterator[Record], None, int]:
    """Versions 2 and 3: one ``zip(keys, values)`` per block of the uncompressed body (read with ``read(size)``),
    every block checked before it is yielded; returns the record count when done.

    Per block, the lengths are read as u32 arrays, and the keys and values are cut by one ``struct`` call whose
    format (``"5s3s..."``) is built from the lengths: C does the per-record work. A version 3 column of one length
    is put back from its byte planes by one slice assignment per plane, then cut by one cached struct. ``emit=False``
    builds no values and yields nothing (what verify needs).
    """
    valid_flags = _VALID_FLAGS[version]
    limit = MAX_BLOCK_BYTES
    count = 0
    offset = 0  # body offset of the current block, for messages
    previous: bytes | None = None  # the last key of the previous block
    while True:
        head = _read_exactly(read, _BLOCK_HEADER_SIZE)
        if not head:
            return count
        if len(head) < _BLOCK_HEADER_SIZE:
            raise CorruptDataError(f"{name}: the body ends inside the header of the block at body byte {offset} "
                                   f"(record {count}); the file is truncated or corrupt")
        n, flags, key_bytes, value_bytes = _unpack_block_header(head)
        if not 0 < n <= BLOCK_MAX_RECORDS or flags & ~valid_flags:
            raise CorruptDataError(f"{name}: the block at body byte {offset} (record {count}) has record count {n} "
                                   f"and flags {flags}; a valid version {version} block has 1..{BLOCK_MAX_RECORDS} "
                                   f"records and flags within {valid_flags}; the file is corrupt")
        if key_bytes + value_bytes > limit:  # checked before any of the block is read (or decompressed)
            raise CorruptDataError(f"{name}: the block at body byte {offset} (record {count}) declares {key_bytes} "
                                   f"key and {value_bytes} value bytes, more than the {limit} a block may hold "
                                   "(MAX_BLOCK_BYTES); the file is corrupt")
        has_ops = flags & _FLAG_OPS
        if has_ops and not allow_delete:
            raise CorruptDataError(f"{name}: the block at body byte {offset} (record {count}) has op bytes, not a "
                                   "valid snapshot record block (a snapshot holds puts only)")
        keys_fixed = flags & _FLAG_KEYS_FIXED
        values_fixed = flags & _FLAG_VALUES_FIXED
        ops_size = n if has_ops else 0
        key_lengths_size = 4 if keys_fixed else 4 * n
        value_lengths_size = 4 if values_fixed else 4 * n
        data_start = ops_size + key_lengths_size + value_lengths_size
        size = data_start + key_bytes + value_bytes
        block = _read_exactly(read, size)
        if len(block) < size:
            raise CorruptDataError(f"{name}: the body ends inside the block at body byte {offset} (records {count} "
                                   f"to {count + n - 1}: {len(block)} of {size} bytes); the file is truncated or "
                                   "corrupt")
        deletes = _delete_positions(block[:ops_size], offset, count, name=name) if has_ops else []
        if not (keys_fixed or values_fixed):  # version 2's layout: one struct cuts keys and values
            key_lengths = _u32_array(block, ops_size, n)
            value_lengths = _u32_array(block, ops_size + 4 * n, n)
            cut = _block_struct(key_lengths, value_lengths, n, emit)
            # the struct's size is the sum of the lengths it cuts: compare it (free) rather than summing the arrays
            if cut.size != (key_bytes + value_bytes if emit else key_bytes) or (
                    not emit and sum(value_lengths) != value_bytes):
                _raise_bad_lengths(offset, count, key_bytes, value_bytes, name=name)
            _check_deletes_have_no_value(deletes, value_lengths, offset, count, name=name)
            unpacked = cut.unpack_from(block, data_start)
            keys: Sequence[bytes] = unpacked[:n] if emit else unpacked
            values: Sequence[bytes | None] = unpacked[n:]
        else:
            puts = n - len(deletes)
            if keys_fixed:
                (key_length,) = _u32_array(block, ops_size, 1)
                if key_length * n != key_bytes:
                    _raise_bad_lengths(offset, count, key_bytes, value_bytes, name=name,
                                       detail=f"{n} keys of length {key_length}")
                keys = _from_planes(block, data_start, n, key_length)
            else:
                key_cut = _column_struct(_u32_array(block, ops_size, n), n)
                if key_cut.size != key_bytes:
                    _raise_bad_lengths(offset, count, key_bytes, value_bytes, name=name)
                keys = key_cut.unpack_from(block, data_start)
            value_start = data_start + key_bytes
            if values_fixed:
                (value_length,) = _u32_array(block, ops_size + key_lengths_size, 1)
                if value_length * puts != value_bytes:
                    _raise_bad_lengths(offset, count, key_bytes, value_bytes, name=name,
                                       detail=f"{puts} values of length {value_length}")
                if emit:
                    values = _from_planes(block, value_start, puts, value_length)
                    if deletes:
                        values = _with_deletes(values, deletes)
            else:
                value_lengths = _u32_array(block, ops_size + key_lengths_size, n)
                _check_deletes_have_no_value(deletes, value_lengths, offset, count, name=name)
                if emit:
                    value_cut = _column_struct(value_lengths, n)
                    if value_cut.size != value_bytes:
                        _raise_bad_lengths(offset, count, key_bytes, value_bytes, name=name)
                    values = value_cut.unpack_from(block, value_start)
                elif sum(value_lengths) != value_bytes:
                    _raise_bad_lengths(offset, count, key_bytes, value_bytes, name=name)
            deletes = deletes if not values_fixed else []  # the Nones are in place already
        if not (all(map(lt, keys, islice(keys, 1, None))) and (previous is None or previous < keys[0])):
            _raise_out_of_order(keys, previous, offset, count, name=name)
        if emit:
            if deletes:
                values = list(values)
                for index in deletes:  # a Python step per delete only, never per put
                    values[index] = None
            yield zip(keys, values)
        previous = keys[-1]
        count += n
        offset += _BLOCK_HEADER_SIZE + size


def _u32_array(block: bytes, start: int, n: int) -> array[int]:
    numbers = array(_U32)
    numbers.frombytes(memoryview(block)[start:start + 4 * n])
    if _BIG_ENDIAN:
        numbers.byteswap()
    return numbers


def _with_deletes(puts: Sequence[bytes], deletes: list[int]) -> list[bytes | None]:
    """The values of a block whose column holds the puts' values only: ``None`` at each delete's position (in
    increasing order), the puts' values in order around them. A Python step per delete; runs of puts are copied
    by slices."""
    values: list[bytes | None] = []
    taken = 0  # puts' values placed so far
    position = 0  # the record the next value is for
    for index in deletes:
        run = index - position
        values += puts[taken:taken + run]
        values.append(None)
        taken += run
        position = index + 1
    values += puts[taken:]
    return values


def _raise_bad_lengths(offset: int, first_index: int, key_bytes: int, value_bytes: int, *, name: str,
                       detail: str = "key and value lengths") -> None:
    raise CorruptDataError(f"{name}: the block at body byte {offset} (record {first_index}) has {detail} that do "
                           f"not add up to its {key_bytes} key and {value_bytes} value bytes; the file is corrupt")


def _delete_positions(ops: bytes, offset: int, first_index: int, *, name: str) -> list[int]:
    """Check a block's op bytes (puts and deletes only); the positions of its deletes, in increasing order."""
    if ops.count(_OP_PUT) + ops.count(_OP_DELETE) != len(ops):
        index = next(i for i, op in enumerate(ops) if op not in (_OP_PUT, _OP_DELETE))
        raise CorruptDataError(f"{name}: record {first_index + index} in the block at body byte {offset} has op "
                               f"{ops[index]}, not a valid delta record")
    deletes = []
    find = ops.find
    index = find(_OP_DELETE)
    while index >= 0:  # bytes.find in C: a Python step per delete, none per put
        deletes.append(index)
        index = find(_OP_DELETE, index + 1)
    return deletes


def _check_deletes_have_no_value(deletes: list[int], value_lengths: array[int], offset: int, first_index: int, *,
                                 name: str) -> None:
    for index in deletes:
        if value_lengths[index]:
            raise CorruptDataError(f"{name}: record {first_index + index} in the block at body byte {offset} is a "
                                   f"delete with value length {value_lengths[index]}, not a valid delta record")


def _raise_out_of_order(keys: Sequence[bytes], previous: bytes | None, offset: int, first_index: int, *,
                        name: str) -> None:
    before = previous
    for index, key in enumerate(keys):
        if before is not None and not before < key:
            raise CorruptDataError(f"{name}: record {first_index + index} in the block at body byte {offset} has "
                                   f"key {key[:64]!r}, not after {before[:64]!r}; keys must strictly increase")
        before = key
    raise AssertionError("unreachable: the keys were out of order")  # pragma: no cover


class _LengthFormats(dict[int, str]):
    """length -> its struct code (``5 -> "5s"``), made on first use; lookups by ``map`` stay in C."""

    def __missing__(self, length: int) -> str:
        code = f"{length}s"
        if len(self) < 1 << 16:  # corrupt lengths must not grow it without bound
            self[length] = code
        return code


_LENGTH_FORMATS = _LengthFormats((length, f"{length}s") for length in range(1024))
#: compiled block structs of uniform lengths, by (n, key length, value length or -1): most blocks of a store share one
_UNIFORM_STRUCTS: dict[tuple[int, int, int], struct.Struct] = {}


def _block_struct(key_lengths: array[int], value_lengths: array[int], n: int, emit: bool) -> struct.Struct:
    """The struct that cuts a block's keys (and with ``emit`` its values, after them) from its data."""
    key_length = key_lengths[0]
    keys_uniform = key_lengths.count(key_length) == n
    value_length = value_lengths[0] if emit else -1
    values_uniform = not emit or value_lengths.count(value_length) == n
    uniform = keys_uniform and values_uniform
    if uniform:
        cached = _UNIFORM_STRUCTS.get((n, key_length, value_length))
        if cached is not None:
            return cached
    formats = _LENGTH_FORMATS.__getitem__
    # a column of one length is one string repetition; otherwise one dict lookup per record, in C
    layout = "<" + (f"{key_length}s" * n if keys_uniform else "".join(map(formats, key_lengths)))
    if emit:
        layout += f"{value_length}s" * n if values_uniform else "".join(map(formats, value_lengths))
    compiled = struct.Struct(layout)
    if uniform:
        if len(_UNIFORM_STRUCTS) >= 16:
            _UNIFORM_STRUCTS.clear()
        _UNIFORM_STRUCTS[(n, key_length, value_length)] = compiled
    return compiled


def _column_struct(lengths: array[int], n: int) -> struct.Struct:
    """The struct that cuts one column of ``n`` records of the given lengths (a version 3 block whose other column
    is stored as planes)."""
    length = lengths[0]
    if lengths.count(length) == n:
        return _fixed_struct(n, length)
    return struct.Struct("<" + "".join(map(_LENGTH_FORMATS.__getitem__, lengths)))


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
    """A file-like view of a stream's body: hashes what it hands out and holds back the last FOOTER_SIZE bytes.

    The body's length is in the footer at the end, so without seeking the only way to know where the body stops is
    to keep the last FOOTER_SIZE bytes read back until the stream ends; they are then the footer.
    """

    source: BinaryIO
    hasher: Any
    held: bytes = b""
    body_bytes: int = 0

    def read(self, size: int = -1) -> bytes:
        want = _BLOCK_BYTES if size is None or size < 0 else max(size, 1)
        while True:
            chunk = self.source.read(want)
            if not chunk:
                return b""
            data = self.held + chunk if self.held else chunk
            if len(data) <= FOOTER_SIZE:
                self.held = data
                continue
            self.held = data[-FOOTER_SIZE:]
            out = data[:-FOOTER_SIZE]
            self.hasher.update(out)
            self.body_bytes += len(out)
            return out

    def readable(self) -> bool:
        return True


def _open_stream(source: BinaryIO, *, name: str) -> RecordReader:
    head = _read_exact(source, HEADER_PREFIX_SIZE, b"", name=name)
    _, _, _, metadata_length = _parse_prefix(head, name=name)
    head = _read_exact(source, HEADER_PREFIX_SIZE + metadata_length + _CRC32.size, head, name=name)
    header, compression, header_end = _parse_header(head, name=name)
    hasher = hashlib.blake2b(head, digest_size=_DIGEST_SIZE)
    body = _StreamBody(source, hasher)
    return RecordReader(header, _stream_records(body, header, compression, header_end, name=name))


def _stream_records(body: _StreamBody, header: FileHeader, compression: str, header_end: int,
                    *, name: str) -> Iterator[Record]:
    allow_delete = header.kind in _DELETE_KINDS

    def finish(found: int) -> None:
        _finish_stream(body, header_end, found, name=name)

    if header.format_version != 1:
        read = _zstd_read(body, name=name) if compression == "zstd" else body.read
        return chain.from_iterable(_then(_parse_blocks(read, name=name, allow_delete=allow_delete,
                                                       version=header.format_version), finish))
    if compression == "zstd":
        # zstandard's stub asks for IO[bytes]; its reader only ever calls read(), which _StreamBody has
        reader: Any = _decompressor().stream_reader(body, read_size=_BLOCK_BYTES,  # type: ignore[arg-type]
                                                    read_across_frames=True, closefd=False)
        blocks: Iterator[bytes] = _decompressed_blocks(reader, name=name)
    else:
        blocks = iter(lambda: body.read(_BLOCK_BYTES), b"")
    return _then(_parse_records(blocks, name=name, allow_delete=allow_delete), finish)


def _finish_stream(body: _StreamBody, header_end: int, found: int, *, name: str) -> None:
    """Check a stream's footer, digest and record count once its records were read."""
    # Drain what the decompressor left unread (nothing, for a file write_file wrote) so the footer is what is held.
    while body.read(_BLOCK_BYTES):
        pass
    size = header_end + body.body_bytes + len(body.held)
    if len(body.held) < FOOTER_SIZE:
        raise CorruptDataError(f"{name}: truncated at byte {size}: the file ends before its {FOOTER_SIZE}-byte "
                               "footer")
    count, body_length, digest, magic_end = _FOOTER.unpack(body.held)
    if magic_end != MAGIC_END:
        raise CorruptDataError(f"{name}: no end marker at byte {size - len(MAGIC_END)}: the file was cut short or "
                               f"not completely written (truncated at byte {size}?)")
    if body_length != body.body_bytes:
        raise CorruptDataError(f"{name}: the footer says the body has {body_length} bytes, the file holds "
                               f"{body.body_bytes}; the file is truncated or corrupt")
    body.hasher.update(body.held[:_FOOTER_COVERED])
    if body.hasher.digest() != digest:
        raise CorruptDataError(f"{name}: checksum mismatch (BLAKE2b-128 over bytes 0..{size - FOOTER_SIZE}); "
                               "the file is corrupt")
    _check_count(found, count, name=name)
