"""The sorted record file's format: its constants, its byte layout, its versions, its bounds, its header and footer.

Everything a byte of the file means is stated here once (the layout and the reasons for it:
docs/formats-changelog.md); the writer, the body decoders and the reader take it from here.

- A file is ``header | body | footer``. The header (:func:`encode_header`) carries the magic, the format version,
  the kind, the compression and the lineage (:class:`FileHeader`) under its own CRC-32, so :func:`read_header` can
  trust the first bytes alone. The fixed-size footer (:func:`encode_footer`) holds the record count, the body's byte
  length and a BLAKE2b-128 digest (:func:`new_hasher`) of everything before the digest, then an end marker. From
  version 4 the file ends in the nonce trailer after the footer (:mod:`statebackend.recordfile.nonce`: 16 random
  bytes of its own per write, checked, ignored by readers; :func:`trailer_size`), so a file written again under its
  name is written with bytes of its own.
- The body holds the records in strictly increasing key order, as one zstd stream when compressed: versions 3 and
  4 (4 written by default) as columnar blocks (:data:`BLOCK_HEADER`) whose column of one length may be stored as
  byte planes (:data:`FLAG_KEYS_FIXED`, :data:`FLAG_VALUES_FIXED`); version 2 as the same blocks with every length
  stored; version 1 as one :data:`RECORD_PREFIX` per record.
- What a file may declare is bounded: a block's keys and values by :data:`MAX_BLOCK_BYTES`, its record count by
  :data:`BLOCK_MAX_RECORDS`, the header metadata by :data:`MAX_HEADER_METADATA_BYTES`, the zstd window by
  :data:`MAX_WINDOW_BYTES`. The digest is no secret, so these bounds, not the checksums, are what bound the memory a
  forged file can make a reader take.
- :data:`BLOCK_BYTES` and :data:`MAX_BLOCK_BYTES` are read as attributes of this module when called, never bound at
  import, so lowering either here (tests do, to get many small blocks or a small limit) reaches writer and readers.
"""

from __future__ import annotations

import hashlib
import json
import struct
import zlib
from typing import Any

import attrs

from statebackend.errors import CorruptDataError, IncompatibleFormatError, UsageError
from statebackend.recordfile.nonce import TRAILER_SIZE, check_trailer

__all__ = [
    "BLOCK_BYTES",
    "BLOCK_HEADER",
    "BLOCK_HEADER_SIZE",
    "BLOCK_MAX_RECORDS",
    "COMPRESSIONS",
    "DELETE_KINDS",
    "FLAG_KEYS_FIXED",
    "FLAG_OPS",
    "FLAG_VALUES_FIXED",
    "FOOTER",
    "FOOTER_COVERED",
    "FOOTER_SIZE",
    "FORMAT_VERSION",
    "FRAME_TAIL_SIZE",
    "HEADER_PREFIX_SIZE",
    "KIND_DELTA",
    "KIND_RUN",
    "KIND_SNAPSHOT",
    "MAGIC",
    "MAGIC_END",
    "MAX_BLOCK_BYTES",
    "MAX_HEADER_METADATA_BYTES",
    "MAX_WINDOW_BYTES",
    "OP_DELETE",
    "OP_PUT",
    "PLANES_MAX_LENGTH",
    "RECORD_PREFIX",
    "RECORD_PREFIX_SIZE",
    "SUPPORTED_FORMAT_VERSIONS",
    "VALID_FLAGS",
    "WRITE_CHUNK",
    "FileHeader",
    "Record",
    "encode_footer",
    "encode_header",
    "header_size",
    "new_hasher",
    "parse_header",
    "parse_prefix",
    "read_frame",
    "read_header",
    "trailer_size",
]

MAGIC = b"SBCHLOG\x00"
MAGIC_END = b"SBCHEND\x00"
#: the version this release writes by default (a header with ``format_version`` 1 to 3 still gets that version)
FORMAT_VERSION = 4
#: every version this release reads and writes; a stored sample of each lives in tests/data/changelog/
SUPPORTED_FORMAT_VERSIONS = (1, 2, 3, 4)
#: the first version whose files end in the nonce trailer (its body is version 3's)
NONCE_VERSION = 4

KIND_DELTA = "delta"
KIND_SNAPSHOT = "snapshot"
KIND_RUN = "run"
_KIND_CODES = {KIND_DELTA: 1, KIND_SNAPSHOT: 2, KIND_RUN: 3}
#: kinds whose records may be deletes (tombstones)
DELETE_KINDS = frozenset({KIND_DELTA, KIND_RUN})
_KIND_NAMES = {code: kind for kind, code in _KIND_CODES.items()}

_COMPRESSION_CODES = {"none": 0, "zstd": 1}
_COMPRESSION_NAMES = {code: name for name, code in _COMPRESSION_CODES.items()}
COMPRESSIONS = tuple(_COMPRESSION_CODES)

OP_PUT = 1
OP_DELETE = 2

# Little-endian throughout: native on every machine this runs on, and what zstd and LMDB use.
#: magic, format version u16, kind u8, compression u8, header metadata length u32
_PREFIX = struct.Struct("<8sHBBI")
HEADER_PREFIX_SIZE = _PREFIX.size  # 16
_MAGIC_AND_VERSION = struct.Struct("<8sH")
_CRC32 = struct.Struct("<I")
#: record count u64, body byte length u64 (both under the digest), digest 16 bytes, end magic
FOOTER = struct.Struct("<QQ16s8s")
FOOTER_SIZE = FOOTER.size  # 40
FOOTER_COVERED = 16  # count and body length are hashed too; only the digest itself and the end magic are not
#: the most bytes at the end of a file :func:`read_frame` needs: the footer and, from version 4, the nonce trailer
FRAME_TAIL_SIZE = FOOTER_SIZE + TRAILER_SIZE
_DIGEST_SIZE = 16
#: the header metadata is a few hundred bytes; the cap keeps a corrupt length from allocating gigabytes
MAX_HEADER_METADATA_BYTES = 64 * 1024

#: version 1 record prefix: op u8, key length u32, value length u32 (0 for a delete), then key, then value
RECORD_PREFIX = struct.Struct("<BII")
RECORD_PREFIX_SIZE = RECORD_PREFIX.size  # 9

#: the writer joins records into blocks of about this many bytes before compressing; the reader decompresses and
#: reads the stream in blocks of this size: large enough to amortize per-call costs, small enough to stay in cache
BLOCK_BYTES = 1 << 20

#: version 2 and 3 block header: record count u32, flags u8, key bytes u32, value bytes u32; then (flag FLAG_OPS) n
#: op bytes, the key lengths (n u32; version 3 with FLAG_KEYS_FIXED: one u32), the value lengths (n u32, 0 for a
#: delete; version 3 with FLAG_VALUES_FIXED: one u32, the length of every put's value), the keys concatenated (with
#: FLAG_KEYS_FIXED as byte planes), the values concatenated (with FLAG_VALUES_FIXED the puts' values as byte planes)
BLOCK_HEADER = struct.Struct("<IBII")
BLOCK_HEADER_SIZE = BLOCK_HEADER.size  # 13
FLAG_OPS = 1  # the block has an op byte per record (it holds a delete); without it every record is a put
FLAG_KEYS_FIXED = 2  # version 3: every key has one length, stored once; the keys are stored as byte planes
FLAG_VALUES_FIXED = 4  # version 3: every put's value has one length, stored once; their values as byte planes
#: the flags a block of each columnar version may carry
VALID_FLAGS = {
    2: FLAG_OPS,
    3: FLAG_OPS | FLAG_KEYS_FIXED | FLAG_VALUES_FIXED,
    4: FLAG_OPS | FLAG_KEYS_FIXED | FLAG_VALUES_FIXED,
}
#: the version 3 writer stores a column of one length as byte planes up to this length: short fixed-size keys and
#: values (ids, counters, timestamps) are where bytes at one position repeat across records; a longer record's own
#: byte order is worth more to zstd than the alignment (any length is read)
PLANES_MAX_LENGTH = 64
#: the writer closes a block at this many records or once its keys and values reach BLOCK_BYTES; the reader refuses
#: a bigger count, so a corrupt count cannot make it allocate more than a few MiB of lengths
BLOCK_MAX_RECORDS = 1 << 16
#: the writer takes records from its input at most this many at a time, fewer when the records seen so far were big:
#: it holds about one block plus one chunk, however big the records
WRITE_CHUNK = 1024
#: the most key and value bytes one block (versions 2 and 3) or one record (version 1) may hold. A reader refuses a
#: block or record that declares more before it reads a byte of it: the digest is no secret, so a forged file whose
#: small zstd body decompresses to gigabytes passes every checksum, and this is what bounds the memory it can make a
#: reader take (about twice this: the block and its records). The writer never writes more: it closes a block
#: before, and refuses a record bigger than this, which also keeps a block's u32 byte counts and lengths in range.
#: 1025 MiB: at least every block an earlier release wrote of records up to BLOCK_BYTES each (it closed a block
#: once it reached BLOCK_BYTES, after a chunk of at most WRITE_CHUNK records). Read when called, not bound at import
MAX_BLOCK_BYTES = (WRITE_CHUNK + 1) * BLOCK_BYTES
#: the largest zstd window a reader accepts (a frame asking for more is corrupt): 128 MiB, what level 22, the highest
#: the backends allow, uses and libzstd's own default limit, stated here so what decompression may hold is explicit
MAX_WINDOW_BYTES = 1 << 27

#: (key, value); value is None for a delete
Record = tuple[bytes, "bytes | None"]


def _check_kind(instance: Any, attribute: attrs.Attribute[Any], value: str) -> None:
    if value not in _KIND_CODES:
        raise UsageError(f"FileHeader.kind must be one of {sorted(_KIND_CODES)}, got {value!r}")


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
            raise UsageError(
                f"a delta needs seq >= 1 and base_seq == seq - 1 (the version it applies on), "
                f"got seq={self.seq} base_seq={self.base_seq}"
            )
        if self.kind == KIND_RUN and not 0 <= self.base_seq < self.seq:
            raise UsageError(
                f"a run needs 0 <= base_seq < seq (it holds versions base_seq+1..seq), got seq={self.seq} "
                f"base_seq={self.base_seq}"
            )
        if self.kind == KIND_SNAPSHOT and (self.seq < 0 or self.base_seq != self.seq):
            raise UsageError(
                f"a snapshot needs seq >= 0 and base_seq == seq, got seq={self.seq} base_seq={self.base_seq}"
            )


# ---------------------------------------------------------------------------------------------------------- writing


def encode_header(header: FileHeader, compression: str) -> bytes:
    """The header's bytes: the fixed prefix, the lineage as compact JSON with sorted keys, their CRC-32.
    ``compression`` is one of :data:`COMPRESSIONS` (the writer checked it)."""
    metadata = _encode_metadata(header)
    prefix = _PREFIX.pack(
        MAGIC, header.format_version, _KIND_CODES[header.kind], _COMPRESSION_CODES[compression], len(metadata)
    )
    header_bytes = prefix + metadata
    return header_bytes + _CRC32.pack(zlib.crc32(header_bytes))


def encode_footer(count: int, body_length: int, hasher: hashlib.blake2b) -> bytes:
    """The footer's bytes; ``hasher`` (from :func:`new_hasher`) has seen everything before it, and sees the count and
    body length too before it gives the digest."""
    covered = FOOTER.pack(count, body_length, b"", b"")[:FOOTER_COVERED]
    hasher.update(covered)
    return covered + hasher.digest() + MAGIC_END


def new_hasher(data: bytes | memoryview = b"") -> hashlib.blake2b:
    """The file's digest, BLAKE2b-128, having seen ``data``."""
    return hashlib.blake2b(data, digest_size=_DIGEST_SIZE)


# ---------------------------------------------------------------------------------------------------------- reading


def trailer_size(version: int) -> int:
    """How many bytes after the footer a file of format ``version`` holds: the nonce trailer from version 4, else 0."""
    return TRAILER_SIZE if version >= NONCE_VERSION else 0


def check_footer_trailer(data: bytes | memoryview, footer_end: int, version: int, *, name: str) -> None:
    """Check the nonce trailer of a version 4 file that follows the footer ending at ``footer_end`` in ``data`` (the
    file's bytes from at least ``FOOTER_SIZE`` before the footer's end to its end); nothing for older versions. The
    trailer binds the 40 bytes before it (``nonce.BOUND_SIZE``): the whole footer."""
    if version >= NONCE_VERSION:
        check_trailer(data[footer_end - FOOTER_SIZE : footer_end], data[footer_end:], name=name)


def header_size(prefix: bytes, *, name: str) -> int:
    """How many leading bytes of a file :func:`read_header` needs, from its first HEADER_PREFIX_SIZE bytes."""
    _, _, _, metadata_length = parse_prefix(prefix, name=name)
    return HEADER_PREFIX_SIZE + metadata_length + _CRC32.size


def read_header(data: bytes, *, name: str) -> FileHeader:
    """The header of the file whose first bytes are ``data`` (the whole file, or at least its header)."""
    header, _, _ = parse_header(data, name=name)
    return header


def read_frame(head: bytes, tail: bytes, size: int, *, name: str) -> FileHeader:
    """The header of a file known by its first bytes ``head`` (at least :func:`header_size` of them), its last bytes
    ``tail`` (the footer and the trailer: ``FOOTER_SIZE + trailer_size(version)`` of them at least; the last
    :data:`FRAME_TAIL_SIZE` bytes always do) and its ``size``, with the frame checked: header CRC, end marker, a
    footer body length that matches ``size``, and the nonce trailer from version 4 (a cut or half-written file
    fails). Not the digest: that needs the whole file. For a writer deciding by two ranged reads whether a blob is
    whole and is the one it wrote."""
    header, _, header_end = parse_header(head, name=name)
    trailer = trailer_size(header.format_version)
    need = FOOTER_SIZE + trailer
    if size < header_end + need or len(tail) < need:
        raise CorruptDataError(
            f"{name}: truncated at byte {size}: the file ends before its {FOOTER_SIZE}-byte "
            f"footer{' and nonce trailer' if trailer else ''} (header ends at byte {header_end})"
        )
    check_footer_trailer(tail, len(tail) - trailer, header.format_version, name=name)
    size -= trailer
    tail = tail[len(tail) - need : len(tail) - trailer]
    _, body_length, _, magic_end = FOOTER.unpack(tail)
    if magic_end != MAGIC_END:
        raise CorruptDataError(
            f"{name}: no end marker at byte {size - len(MAGIC_END)}: the file was cut short or "
            f"not completely written (truncated at byte {size}?)"
        )
    if body_length != size - FOOTER_SIZE - header_end:
        raise CorruptDataError(
            f"{name}: the footer says the body has {body_length} bytes, the file holds "
            f"{size - FOOTER_SIZE - header_end}; the file is truncated or corrupt"
        )
    return header


def parse_prefix(data: bytes, *, name: str) -> tuple[int, int, int, int]:
    """(version, kind code, compression code, metadata length) from the fixed prefix, checked."""
    if len(data) < _MAGIC_AND_VERSION.size:
        if not MAGIC.startswith(bytes(data[: len(MAGIC)])):
            raise CorruptDataError(f"{name}: not a changelog file (bad magic {bytes(data[:8])!r}, want {MAGIC!r})")
        raise CorruptDataError(
            f"{name}: truncated at byte {len(data)}: the file header needs {HEADER_PREFIX_SIZE} bytes at least"
        )
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
        raise CorruptDataError(
            f"{name}: changelog format version {version} was never written "
            f"(supported: {list(SUPPORTED_FORMAT_VERSIONS)})"
        )
    if len(data) < HEADER_PREFIX_SIZE:
        raise CorruptDataError(
            f"{name}: truncated at byte {len(data)}: the file header needs {HEADER_PREFIX_SIZE} bytes at least"
        )
    _, _, kind_code, compression_code, metadata_length = _PREFIX.unpack_from(data)
    if metadata_length > MAX_HEADER_METADATA_BYTES:
        raise CorruptDataError(
            f"{name}: header metadata length {metadata_length} exceeds "
            f"{MAX_HEADER_METADATA_BYTES}; the header is corrupt"
        )
    return version, kind_code, compression_code, metadata_length


def parse_header(data: bytes, *, name: str) -> tuple[FileHeader, str, int]:
    """(header, compression name, header end offset) from the first bytes of a file."""
    version, kind_code, compression_code, metadata_length = parse_prefix(data, name=name)
    metadata_end = HEADER_PREFIX_SIZE + metadata_length
    header_end = metadata_end + _CRC32.size
    if len(data) < header_end:
        raise CorruptDataError(f"{name}: truncated at byte {len(data)}: the file header needs {header_end} bytes")
    (stored_crc,) = _CRC32.unpack_from(data, metadata_end)
    if zlib.crc32(data[:metadata_end]) != stored_crc:
        raise CorruptDataError(
            f"{name}: header checksum mismatch (CRC-32 over bytes 0..{metadata_end}); the header is corrupt"
        )
    kind = _KIND_NAMES.get(kind_code)
    compression = _COMPRESSION_NAMES.get(compression_code)
    if kind is None or compression is None:
        raise CorruptDataError(f"{name}: unknown kind code {kind_code} or compression code {compression_code}")
    try:
        fields = json.loads(bytes(data[HEADER_PREFIX_SIZE:metadata_end]))
        header = FileHeader(**fields)
    except (ValueError, TypeError, UsageError) as exc:
        raise CorruptDataError(f"{name}: header metadata is not a valid FileHeader: {exc}") from exc
    if header.kind != kind or header.format_version != version:
        raise CorruptDataError(
            f"{name}: header metadata ({header.kind}, version {header.format_version}) "
            f"contradicts the fixed header ({kind}, version {version})"
        )
    return header, compression, header_end


def _encode_metadata(header: FileHeader) -> bytes:
    return json.dumps(attrs.asdict(header), separators=(",", ":"), sort_keys=True, ensure_ascii=False).encode()
