"""The dedup backend's two blobs and their names.

- **Chunk** ``<prefix>chunks/<content id>``: ``MAGIC_CHUNK``, then the records (4-byte key length, key, 4-byte value
  length, value; keys strictly ascending), then the SHA-256 of everything before it. Its content id is the SHA-256
  of its records' encoding (:func:`content_id`): a chunk is named by what it holds, so equal chunks of any commit
  share one blob, and a chunk whose bytes are not its name's is refused.
- **Manifest** ``<prefix>manifests/<sortable checkpoint id>-<token>``: ``MAGIC_MANIFEST``, a UTF-8 JSON body (job,
  task, store, checkpoint id, token, and per chunk in key order its first key in hex, its content id and its record
  count), then the SHA-256 of everything before it. A manifest is bound to its name: one whose body names another
  version, job, task or store is refused.
"""

from __future__ import annotations

import hashlib
import json
import re
import struct
from collections.abc import Iterable, Sequence

import attrs
from statebackend.checkpoint import CheckpointId

from statebackend.errors import CorruptDataError
from statebackend.store import LocalVersion

__all__ = [
    "ChunkRef",
    "Manifest",
    "chunk_name",
    "content_id",
    "decode_chunk",
    "decode_manifest",
    "encode_chunk",
    "encode_manifest",
    "manifest_name",
    "parse_manifest_name",
]

MAGIC_CHUNK = b"SBDDC001"
MAGIC_MANIFEST = b"SBDDM001"
_DIGEST = 32
_U32 = struct.Struct(">I")
_MANIFEST_RE = re.compile(r"manifests/(\d{15})-(\d{6})-([0-9a-f]+)")
_CHUNK_RE = re.compile(r"chunks/([0-9a-f]{64})")
#: a record of a chunk: ``(key, value)``
Item = tuple[bytes, bytes]


@attrs.frozen
class ChunkRef:
    """One chunk as a manifest lists it."""

    #: the chunk's first key (the key range it covers starts here; the first chunk covers every smaller key too)
    first: bytes
    #: its content id (the chunk blob's name under ``<prefix>chunks/``)
    cid: str
    records: int


@attrs.frozen
class Manifest:
    """One checkpoint's state of one store: its chunks, bound to the job, task, store and version."""

    job: str
    task: str
    store: str
    checkpoint_id: str
    token: str
    chunks: tuple[ChunkRef, ...]

    @property
    def version(self) -> LocalVersion:
        return LocalVersion(self.checkpoint_id, self.token)


def _body(items: Iterable[Item]) -> bytes:
    out = bytearray()
    for key, value in items:
        out += _U32.pack(len(key)) + key + _U32.pack(len(value)) + value
    return bytes(out)


def content_id(items: Sequence[Item]) -> str:
    """The content id of a chunk of ``items``: the SHA-256 of their encoding."""
    return hashlib.sha256(_body(items)).hexdigest()


def encode_chunk(items: Sequence[Item]) -> bytes:
    data = MAGIC_CHUNK + _body(items)
    return data + hashlib.sha256(data).digest()


def chunk_name(prefix: str, cid: str) -> str:
    return f"{prefix}chunks/{cid}"


def decode_chunk(data: bytes, *, name: str) -> list[Item]:
    """The records of chunk blob ``name``, verified whole (:class:`CorruptDataError` naming it otherwise)."""
    if len(data) < len(MAGIC_CHUNK) + _DIGEST or not data.startswith(MAGIC_CHUNK):
        raise CorruptDataError(f"chunk {name} is not a dedup chunk (bad magic or cut short)")
    payload = data[:-_DIGEST]
    if hashlib.sha256(payload).digest() != data[-_DIGEST:]:
        raise CorruptDataError(f"chunk {name} failed its SHA-256 check: damaged or cut short; nothing was loaded")
    items: list[Item] = []
    offset = len(MAGIC_CHUNK)
    try:
        while offset < len(payload):
            (size,) = _U32.unpack_from(payload, offset)
            key = payload[offset + 4 : offset + 4 + size]
            offset += 4 + size
            (size,) = _U32.unpack_from(payload, offset)
            value = payload[offset + 4 : offset + 4 + size]
            offset += 4 + size
            if offset > len(payload) or (items and key <= items[-1][0]):
                raise CorruptDataError(f"chunk {name}: a record is damaged or out of order")
            items.append((key, value))
    except struct.error as exc:
        raise CorruptDataError(f"chunk {name}: unreadable ({exc})") from exc
    return items


def manifest_name(prefix: str, version: LocalVersion) -> str:
    return f"{prefix}manifests/{CheckpointId.parse(version.checkpoint_id).sortable()}-{version.token}"


def parse_manifest_name(prefix: str, name: str) -> LocalVersion | None:
    """The version a manifest's name promises, or ``None`` when ``name`` is not a manifest under ``prefix``."""
    match = _MANIFEST_RE.fullmatch(name[len(prefix) :]) if name.startswith(prefix) else None
    if match is None:
        return None
    return LocalVersion(str(CheckpointId(int(match.group(1)), int(match.group(2)))), match.group(3))


def parse_chunk_name(prefix: str, name: str) -> str | None:
    """The content id of a chunk blob's name under ``prefix``, else ``None``."""
    match = _CHUNK_RE.fullmatch(name[len(prefix) :]) if name.startswith(prefix) else None
    return None if match is None else match.group(1)


def encode_manifest(manifest: Manifest) -> bytes:
    body = {
        "job": manifest.job,
        "task": manifest.task,
        "store": manifest.store,
        "checkpoint_id": manifest.checkpoint_id,
        "token": manifest.token,
        "chunks": [[ref.first.hex(), ref.cid, ref.records] for ref in manifest.chunks],
    }
    data = MAGIC_MANIFEST + json.dumps(body, separators=(",", ":"), sort_keys=True).encode()
    return data + hashlib.sha256(data).digest()


def decode_manifest(data: bytes, *, name: str, job: str, task: str, store: str, prefix: str) -> Manifest:
    """Manifest blob ``name`` (under ``prefix``), verified whole and bound to its name, ``job``, ``task`` and
    ``store``: :class:`CorruptDataError` naming it otherwise."""
    version = parse_manifest_name(prefix, name)
    if version is None:
        raise CorruptDataError(f"{name} is not the name of a dedup manifest under {prefix}")
    if len(data) < len(MAGIC_MANIFEST) + _DIGEST or not data.startswith(MAGIC_MANIFEST):
        raise CorruptDataError(f"manifest {name} is not a dedup manifest (bad magic or cut short)")
    payload = data[:-_DIGEST]
    if hashlib.sha256(payload).digest() != data[-_DIGEST:]:
        raise CorruptDataError(f"manifest {name} failed its SHA-256 check: damaged or cut short")
    try:
        body = json.loads(payload[len(MAGIC_MANIFEST) :])
        manifest = Manifest(
            body["job"],
            body["task"],
            body["store"],
            body["checkpoint_id"],
            body["token"],
            tuple(ChunkRef(bytes.fromhex(first), str(cid), int(records)) for first, cid, records in body["chunks"]),
        )
    except (ValueError, KeyError, TypeError) as exc:
        raise CorruptDataError(f"manifest {name}: unreadable ({exc})") from exc
    expected = (job, task, store, version)
    if (manifest.job, manifest.task, manifest.store, manifest.version) != expected:
        raise CorruptDataError(
            f"manifest {name} says it is {manifest.job}/{manifest.task}/{manifest.store} at {manifest.version}, not "
            f"{job}/{task}/{store} at {version}: copied or renamed; not loaded"
        )
    return manifest
