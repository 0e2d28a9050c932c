"""The sorted record file: the self-describing on-blob format of sorted records that both backends write.

The changelog-delta backend writes DELTA files (one commit's change) and SNAPSHOT files (a whole store); the
blob-snapshot backend writes RUN files (the merged changes of a range of commits, tombstones included, or a whole store
as its base run). Any backend may use it.

Contract:

- A file is ``header | body | footer`` (byte layout and the reasons for it: docs/formats-changelog.md). The header
  carries the magic, the format version, the kind, the compression and the lineage (:class:`FileHeader`) under its
  own CRC-32, so :func:`read_header` can trust the first bytes alone. The body holds the records in strictly
  increasing key order, as one zstd stream when compressed: versions 3 and 4 as columnar blocks of up
  to 64Ki records that CPython decodes with a few C calls per block, a column whose records all have one length
  stored as byte planes under that length; version 2 (still read, and written when a header asks for it) as the
  same blocks with every length stored; version 1 (likewise) as one 9-byte prefix per record. The fixed-size footer
  holds the record count, the body's byte length and a BLAKE2b-128 digest of everything before the digest, then an
  end marker. From version 4 (written by default) the file ends in the nonce trailer (:mod:`.nonce`): 16 random bytes
  of its own per write, under a checksum, ignored by readers, so a file written again under its name is new bytes
  (a blob store whose version is a digest of the bytes, S3's ETag, tells the rewrite apart). Version 4's body is
  version 3's.
- :func:`write_file` streams: memory stays bounded whatever the record count, and ``out`` is never seeked. When the
  input is bad (keys not strictly increasing, a delete in a snapshot, a record bigger than :data:`MAX_BLOCK_BYTES`)
  it raises :class:`StateBackendError` before the footer is written, so what was written is never a valid file; the
  caller deletes it.
- :func:`verify` checks a whole file in memory; :func:`iter_records` reads records in key order (for versions 2 and
  3 as C-level iterators chained block by block, so a C consumer such as LMDB's ``putmulti`` runs no Python frame
  per record). For a ``bytes`` source it verifies the whole file before yielding the first record, so a corrupt
  delta is never applied. For a stream source (a big snapshot read from disk) it verifies while yielding and raises
  :class:`CorruptDataError` at the end at the latest: the caller must apply the records inside one transaction that
  aborts on the error (the local store's ``replace_contents`` does).
- Every failure to read is a :class:`CorruptDataError` that names the blob and says what is wrong, or an
  :class:`IncompatibleFormatError` for a format version newer than this release reads.
- What a reader holds is bounded by what the file declares, and what it may declare is bounded (a block's keys and
  values by :data:`MAX_BLOCK_BYTES`, the zstd window by 128 MiB): the digest is no secret, so a forged body that
  decompresses to gigabytes is refused by the sizes it declares, before it is decompressed.

One job per module; none imports this package's ``__init__``, and the imports between them run one way (``reader``
and ``writer`` at the top, ``format`` and ``columns`` at the bottom):

- ``format``: the format itself: constants, byte layout, versions, bounds, ``FileHeader``, header and footer
- ``writer``: ``write_file`` and ``encode``, the body encoders of each version
- ``reader``: ``verify``, ``check_digest``, ``iter_records`` from bytes or a stream, ``RecordReader``
- ``decode``: the body decoders of each version, every record checked
- ``nonce``: the nonce trailer every write ends in (from version 4; the env base's too), renewed for a rewrite
- ``columns``: ``RecordColumns``, the writer's input chunks, the column codings (u32 lengths, byte planes, structs)
"""

from statebackend.recordfile.columns import RecordColumns
from statebackend.recordfile.format import (
    BLOCK_MAX_RECORDS,
    COMPRESSIONS,
    FOOTER_SIZE,
    FORMAT_VERSION,
    FRAME_TAIL_SIZE,
    HEADER_PREFIX_SIZE,
    KIND_DELTA,
    KIND_RUN,
    KIND_SNAPSHOT,
    MAGIC,
    MAGIC_END,
    MAX_BLOCK_BYTES,
    MAX_HEADER_METADATA_BYTES,
    PLANES_MAX_LENGTH,
    SUPPORTED_FORMAT_VERSIONS,
    FileHeader,
    Record,
    header_size,
    read_frame,
    read_header,
    trailer_size,
)
from statebackend.recordfile.nonce import TRAILER_SIZE, content_of, renew_nonce
from statebackend.recordfile.reader import RecordReader, check_digest, iter_records, verify
from statebackend.recordfile.writer import FileStats, encode, write_file

__all__ = [
    "BLOCK_MAX_RECORDS",
    "COMPRESSIONS",
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
    "PLANES_MAX_LENGTH",
    "SUPPORTED_FORMAT_VERSIONS",
    "TRAILER_SIZE",
    "FileHeader",
    "FileStats",
    "Record",
    "RecordColumns",
    "RecordReader",
    "check_digest",
    "content_of",
    "encode",
    "header_size",
    "iter_records",
    "read_frame",
    "read_header",
    "renew_nonce",
    "trailer_size",
    "verify",
    "write_file",
]
