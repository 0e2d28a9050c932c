"""The blob-snapshot formats: blob names, content hashing, and the index blob (schema version 1).

Layout under a store's prefix ``<job>/<task>/<store>/blobsnapshot/``::

    chunks/<hash>                      one chunk of a snapshot file; the name IS the blake2b-256 of its bytes
    index/<seq:012d>-<token>.json      one index per snapshot; the marker written into checkpoints is its name

Index blob: UTF-8 JSON, one object, keys sorted::

    {"schema": "statebackend.blobsnapshot.index", "schema_version": 1,
     "job": ..., "task": ..., "store": ..., "checkpoint_id": "<millis>-<nanos>", "token": "<flush token>", "seq": n,
     "hash_algorithm": "blake2b-256", "chunk_size": 4194304,
     "files": [{"name": "data.mdb", "size": n, "hash": "<hex>", "chunks": [{"hash": "<hex>", "size": n}, ...]}],
     "files_added": [...], "files_removed": [...],          file names against the previous index
     "chunks_added": [...], "chunks_removed": [...],        chunk hashes against the previous index (sorted)
     "previous_index": "<name>" | null,
     "checksum": "<blake2b-256 hex of the canonical body without this key>"}

``files`` is what a restore needs (necessary and sufficient, as in seed 002); the added/removed lists and the
previous index's name are for garbage collection, error recovery and people reading the history. A reader rejects a
wrong ``schema``, an unknown ``schema_version`` (:class:`IncompatibleFormatError`), a bad checksum, missing fields
or malformed values (:class:`CorruptDataError`), always naming the blob.

Binding: the checksum proves an index is intact, not that it is the index a marker names. The marker is the index's
name, which holds ``seq`` and the flush's random ``token``; :func:`check_index_binding` requires the body's
``(job, task, store, seq, token)`` to be the name's and the reader's, so an older index of the same store, or another
task's or store's index, copied over the name is refused. Chunks are bound by their names: a chunk's name is the hash
of its bytes, checked with its length when it is downloaded.
"""

from __future__ import annotations

import hashlib
import json
import re
from collections.abc import Iterable, Mapping
from typing import Any

import attrs

from statebackend.errors import CorruptDataError, IncompatibleFormatError
from statebackend.store import LocalVersion

__all__ = [
    "HASH_ALGORITHM",
    "SCHEMA",
    "SCHEMA_VERSION",
    "ChunkRef",
    "FileEntry",
    "SnapshotIndex",
    "check_index_binding",
    "chunk_hash",
    "chunk_name",
    "chunks_prefix",
    "index_name",
    "index_prefix",
    "new_hasher",
    "parse_index_name",
]

SCHEMA = "statebackend.blobsnapshot.index"
SCHEMA_VERSION = 1
HASH_ALGORITHM = "blake2b-256"
_HEX64 = re.compile(r"^[0-9a-f]{64}$")
_INDEX_NAME = re.compile(r"^(\d{12})-([A-Za-z0-9_-]+)\.json$")


def new_hasher() -> Any:
    """A fresh hasher of :data:`HASH_ALGORITHM` (blake2b: the fastest strong hash in hashlib on 64-bit CPUs)."""
    return hashlib.blake2b(digest_size=32)


def chunk_hash(data: bytes | memoryview) -> str:
    hasher = new_hasher()
    hasher.update(data)
    return str(hasher.hexdigest())


def chunks_prefix(store_prefix: str) -> str:
    return f"{store_prefix}chunks/"


def index_prefix(store_prefix: str) -> str:
    return f"{store_prefix}index/"


def chunk_name(store_prefix: str, digest: str) -> str:
    return f"{store_prefix}chunks/{digest}"


def index_name(store_prefix: str, seq: int, token: str) -> str:
    return f"{store_prefix}index/{seq:012d}-{token}.json"


def parse_index_name(name: str) -> tuple[int, str] | None:
    """``(seq, token)`` of an index blob name, or ``None`` when ``name`` is not one."""
    match = _INDEX_NAME.match(name.rsplit("/", 1)[-1])
    return (int(match.group(1)), match.group(2)) if match else None


def check_index_binding(index: SnapshotIndex, *, name: str, job: str, task: str, store: str) -> None:
    """Raise :class:`CorruptDataError` unless ``index`` is the index blob ``name`` designates for ``job``/``task``/
    ``store``: the same ``(job, task, store)`` and the ``(seq, token)`` its name holds."""
    parsed = parse_index_name(name)
    if parsed is None:
        raise CorruptDataError(
            f"index blob {name} does not have an index name (<seq:012d>-<token>.json); the checkpoint's marker is "
            f"damaged: restore an older checkpoint or from another backend's marker"
        )
    expected = (job, task, store, parsed[0], parsed[1])
    found = (index.job, index.task, index.store, index.seq, index.token)
    if expected != found:
        raise CorruptDataError(
            f"index blob {name} is intact but is not the index its name designates: expected (job, task, store, seq, "
            f"token)={expected}, found {found}; another index (an older one of this store, or another task's or "
            f"store's) was written over it. Nothing was loaded: restore an older checkpoint or from another "
            f"backend's marker"
        )


@attrs.frozen
class ChunkRef:
    """One chunk of a file: its content hash (also its blob name's last segment) and its byte count."""

    hash: str
    size: int


@attrs.frozen
class FileEntry:
    """One file of a snapshot: its name in the environment dir, size, whole-content hash and chunks in order."""

    name: str
    size: int
    hash: str
    chunks: tuple[ChunkRef, ...]

    def offsets(self) -> Iterable[tuple[int, ChunkRef]]:
        """``(offset, chunk)`` for every chunk, in file order."""
        offset = 0
        for chunk in self.chunks:
            yield offset, chunk
            offset += chunk.size


@attrs.frozen
class SnapshotIndex:
    """The index blob of one snapshot. See the module docstring for the JSON layout."""

    job: str
    task: str
    store: str
    checkpoint_id: str
    token: str
    seq: int
    chunk_size: int
    files: tuple[FileEntry, ...]
    files_added: tuple[str, ...] = ()
    files_removed: tuple[str, ...] = ()
    chunks_added: tuple[str, ...] = ()
    chunks_removed: tuple[str, ...] = ()
    previous_index: str | None = None
    hash_algorithm: str = HASH_ALGORITHM

    @property
    def version(self) -> LocalVersion:
        """The local store version this snapshot holds (the flush it was taken after)."""
        return LocalVersion(self.checkpoint_id, self.token)

    def chunk_hashes(self) -> set[str]:
        return {chunk.hash for entry in self.files for chunk in entry.chunks}

    def file(self, name: str) -> FileEntry | None:
        return next((entry for entry in self.files if entry.name == name), None)

    @classmethod
    def build(
        cls,
        *,
        job: str,
        task: str,
        store: str,
        version: LocalVersion,
        seq: int,
        chunk_size: int,
        files: Iterable[FileEntry],
        previous: SnapshotIndex | None,
        previous_name: str | None,
    ) -> SnapshotIndex:
        """An index with the added/removed lists computed against ``previous`` (``None``: everything is added)."""
        files = tuple(sorted(files, key=lambda entry: entry.name))
        names = {entry.name for entry in files}
        hashes = {chunk.hash for entry in files for chunk in entry.chunks}
        old_names = {entry.name for entry in previous.files} if previous is not None else set()
        old_hashes = previous.chunk_hashes() if previous is not None else set()
        return cls(
            job=job,
            task=task,
            store=store,
            checkpoint_id=version.checkpoint_id,
            token=version.token,
            seq=seq,
            chunk_size=chunk_size,
            files=files,
            files_added=tuple(sorted(names - old_names)),
            files_removed=tuple(sorted(old_names - names)),
            chunks_added=tuple(sorted(hashes - old_hashes)),
            chunks_removed=tuple(sorted(old_hashes - hashes)),
            previous_index=previous_name,
        )

    def encode(self) -> bytes:
        body = self._body()
        body["checksum"] = _checksum(body)
        return _canonical(body)

    @classmethod
    def decode(cls, data: bytes, *, name: str) -> SnapshotIndex:
        """Parse and verify an index blob; errors name ``name``."""
        try:
            document = json.loads(data)
        except (ValueError, UnicodeDecodeError) as exc:
            raise CorruptDataError(f"index blob {name} is not valid JSON ({exc}); it is damaged or not an index")
        if not isinstance(document, dict):
            raise CorruptDataError(f"index blob {name} is not a JSON object")
        if document.get("schema") != SCHEMA:
            raise CorruptDataError(f"index blob {name} has schema {document.get('schema')!r}, expected {SCHEMA!r}")
        version = document.get("schema_version")
        if version != SCHEMA_VERSION:
            raise IncompatibleFormatError(
                f"index blob {name} has schema_version {version!r}; this release reads {SCHEMA_VERSION}: upgrade "
                f"statebackend to restore it"
            )
        checksum = document.pop("checksum", None)
        if checksum != _checksum(document):
            raise CorruptDataError(f"index blob {name} failed its checksum; it was damaged after it was written")
        try:
            files = tuple(
                FileEntry(
                    name=_text(f["name"]),
                    size=_count(f["size"]),
                    hash=_digest(f["hash"]),
                    chunks=tuple(ChunkRef(_digest(c["hash"]), _count(c["size"])) for c in f["chunks"]),
                )
                for f in document["files"]
            )
            index = cls(
                job=_text(document["job"]),
                task=_text(document["task"]),
                store=_text(document["store"]),
                checkpoint_id=_text(document["checkpoint_id"]),
                token=_text(document["token"]),
                seq=_count(document["seq"]),
                chunk_size=_count(document["chunk_size"]),
                files=files,
                files_added=tuple(_text(n) for n in document["files_added"]),
                files_removed=tuple(_text(n) for n in document["files_removed"]),
                chunks_added=tuple(_digest(h) for h in document["chunks_added"]),
                chunks_removed=tuple(_digest(h) for h in document["chunks_removed"]),
                previous_index=None if document["previous_index"] is None else _text(document["previous_index"]),
                hash_algorithm=_text(document["hash_algorithm"]),
            )
        except (KeyError, TypeError, ValueError) as exc:
            raise CorruptDataError(f"index blob {name} is missing or has a malformed field: {exc!r}") from exc
        if index.hash_algorithm != HASH_ALGORITHM:
            raise IncompatibleFormatError(
                f"index blob {name} uses hash {index.hash_algorithm!r}; this release knows {HASH_ALGORITHM!r}"
            )
        for entry in index.files:
            if sum(chunk.size for chunk in entry.chunks) != entry.size:
                raise CorruptDataError(f"index blob {name}: the chunks of {entry.name} do not add up to its size")
        return index

    def _body(self) -> dict[str, Any]:
        return {
            "schema": SCHEMA,
            "schema_version": SCHEMA_VERSION,
            "job": self.job,
            "task": self.task,
            "store": self.store,
            "checkpoint_id": self.checkpoint_id,
            "token": self.token,
            "seq": self.seq,
            "hash_algorithm": self.hash_algorithm,
            "chunk_size": self.chunk_size,
            "files": [
                {
                    "name": entry.name,
                    "size": entry.size,
                    "hash": entry.hash,
                    "chunks": [{"hash": c.hash, "size": c.size} for c in entry.chunks],
                }
                for entry in self.files
            ],
            "files_added": list(self.files_added),
            "files_removed": list(self.files_removed),
            "chunks_added": list(self.chunks_added),
            "chunks_removed": list(self.chunks_removed),
            "previous_index": self.previous_index,
        }


def _canonical(document: Mapping[str, Any]) -> bytes:
    return json.dumps(document, sort_keys=True, separators=(",", ":"), ensure_ascii=True).encode("ascii")


def _checksum(body: Mapping[str, Any]) -> str:
    return chunk_hash(_canonical(body))


def _text(value: object) -> str:
    if not isinstance(value, str):
        raise TypeError(f"expected a string, got {value!r}")
    return value


def _count(value: object) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or value < 0:
        raise ValueError(f"expected a non-negative integer, got {value!r}")
    return value


def _digest(value: object) -> str:
    if not isinstance(value, str) or not _HEX64.match(value):
        raise ValueError(f"expected a 64-digit lowercase hex hash, got {value!r}")
    return value
