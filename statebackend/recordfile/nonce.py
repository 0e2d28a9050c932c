"""The nonce trailer: bytes of its own for every write of a blob that may be written again under the same name.

A blob store's version of a blob may be a digest of its bytes (an S3 ETag is their MD5): a writer that writes a blob
again with the same bytes (to give it a fresh age before it names it) keeps its version, and a sweep's conditional
delete judged before that rewrite would still take it. So every format the framework writes for such blobs (the
sorted record file from version 4, the environment-file base from version 2) ends in this trailer, written by the
format's one writer, and every rewrite renews it (:func:`renew_nonce`): a fresh random nonce, so fresh bytes and a new
version. Layout and reasons: docs/formats-changelog.md, "The nonce trailer".

Contract:

- The trailer is the last :data:`TRAILER_SIZE` (40) bytes: ``nonce (16 random bytes) | check (16) | end marker``
  (``SBNONCE\\0``). ``check`` is the BLAKE2b-128 of the :data:`BOUND_SIZE` (40) bytes before the trailer (the end
  of the format's own footer: its whole-file digest and end marker) followed by the nonce: the nonce is covered by an
  integrity check, and a trailer is bound to the file it ends, at the cost of hashing 56 bytes, so a rewrite renews
  it without reading the file again.
- Readers ignore the nonce: they check the trailer (:func:`check_trailer`) and read the format's bytes before it.
- A name derived from a blob's content (a blob-snapshot run's name) is derived from the bytes *without* the trailer
  (:func:`content_of`), so every write of a blob keeps its name.
"""

from __future__ import annotations

import hashlib
import os
import struct
import uuid
from pathlib import Path
from typing import BinaryIO

from statebackend.errors import CorruptDataError

__all__ = [
    "BOUND_SIZE",
    "NONCE_SIZE",
    "TRAILER_MAGIC",
    "TRAILER_SIZE",
    "check_trailer",
    "content_length",
    "content_of",
    "ends_in_trailer",
    "new_trailer",
    "renew_nonce",
]

TRAILER_MAGIC = b"SBNONCE\x00"
NONCE_SIZE = 16
#: nonce, check, end marker
_TRAILER = struct.Struct("<16s16s8s")
TRAILER_SIZE = _TRAILER.size  # 40
#: how many bytes before the trailer its check covers: every format that ends in a trailer ends its own frame with its
#: whole-file digest and end marker within these (the record file's whole footer; the env base's digest and marker)
BOUND_SIZE = 40


def _check(bound: bytes | memoryview, nonce: bytes) -> bytes:
    return hashlib.blake2b(bytes(bound) + nonce, digest_size=16).digest()


def new_trailer(bound: bytes) -> bytes:
    """A trailer with a fresh random nonce for a file whose last :data:`BOUND_SIZE` bytes before it are ``bound``."""
    if len(bound) != BOUND_SIZE:
        raise ValueError(f"a nonce trailer binds the {BOUND_SIZE} bytes before it, got {len(bound)}")
    nonce = os.urandom(NONCE_SIZE)
    return _TRAILER.pack(nonce, _check(bound, nonce), TRAILER_MAGIC)


def check_trailer(bound: bytes | memoryview, trailer: bytes | memoryview, *, name: str) -> None:
    """Raise :class:`CorruptDataError` naming ``name`` unless ``trailer`` is a whole trailer whose check covers its
    nonce and the ``bound`` bytes before it."""
    if len(trailer) != TRAILER_SIZE or len(bound) != BOUND_SIZE:
        raise CorruptDataError(
            f"{name}: truncated: the file ends before its {TRAILER_SIZE}-byte nonce trailer is whole"
        )
    nonce, check, magic = _TRAILER.unpack(bytes(trailer))
    if magic != TRAILER_MAGIC:
        raise CorruptDataError(
            f"{name}: no nonce trailer end marker ({TRAILER_MAGIC!r}) in the last bytes: the file was cut short or "
            "not completely written"
        )
    if _check(bound, nonce) != check:
        raise CorruptDataError(f"{name}: the nonce trailer fails its checksum; the file is corrupt")


def ends_in_trailer(data: bytes | memoryview) -> bool:
    """Whether the bytes ``data`` (a whole file, or at least its last 8 bytes) end with a trailer's end marker."""
    return bytes(data[-len(TRAILER_MAGIC) :]) == TRAILER_MAGIC


def content_length(data: bytes | memoryview) -> int:
    """How many of the bytes of a whole file ``data`` are its content: all but the trailer, when it ends in one."""
    return len(data) - TRAILER_SIZE if len(data) >= TRAILER_SIZE and ends_in_trailer(data) else len(data)


def content_of(data: bytes | memoryview) -> memoryview:
    """The content of a whole file ``data``: its bytes without the nonce trailer (all of them when it has none, as
    files of older format versions). What a name derived from a blob's bytes is derived from."""
    return memoryview(data)[: content_length(data)]


def renew_nonce(path: Path, *, aside: Path | None = None) -> bool:
    """Give the file at ``path`` a fresh nonce before it is written to a blob store again: a copy with a new trailer
    is written into ``aside`` (a directory on the same filesystem, default ``path``'s own; named ``*.partial``) and
    renamed over ``path``, so a reader of the old file (an open handle) never sees a half-written trailer. The old
    trailer is checked first (:class:`CorruptDataError` when damaged). ``False``, nothing changed: the file has no
    trailer (a format version older than the trailer), and a rewrite of it would carry the same bytes."""
    size = path.stat().st_size
    with open(path, "rb") as source:
        if size < BOUND_SIZE + TRAILER_SIZE:
            return False
        source.seek(size - BOUND_SIZE - TRAILER_SIZE)
        tail = source.read(BOUND_SIZE + TRAILER_SIZE)
        if not ends_in_trailer(tail):
            return False
        bound = tail[:BOUND_SIZE]
        check_trailer(bound, tail[BOUND_SIZE:], name=str(path))
        folder = aside if aside is not None else path.parent
        partial = folder / f"{path.name}.{uuid.uuid4().hex[:8]}.nonce.partial"
        try:
            with open(partial, "wb") as out:
                source.seek(0)
                _copy_exactly(source, out, size - TRAILER_SIZE, name=str(path))
                out.write(new_trailer(bound))
            os.replace(partial, path)
        except BaseException:
            partial.unlink(missing_ok=True)
            raise
    return True


def _copy_exactly(source: BinaryIO, out: BinaryIO, length: int, *, name: str) -> None:
    """The first ``length`` bytes of ``source`` into ``out`` (both binary files); a shorter source is corrupt."""
    left = length
    while left:
        chunk = source.read(min(left, 1 << 20))
        if not chunk:
            raise CorruptDataError(f"{name}: the file shrank while its nonce was renewed")
        out.write(chunk)
        left -= len(chunk)
