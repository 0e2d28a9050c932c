"""The blob-snapshot formats: blob names, run entries, the index (schema version 2) and the marker that carries it.

A store's remote snapshot is a set of immutable sorted runs (an LSM tree on the blob store); the index lists the
live runs and travels inside the marker written into checkpoints (an index blob, for markers of older releases). Layout
under ``<job>/<task>/<store>/blobsnapshot/``::

    runs/<hash>                        one run: a sorted record file (statebackend.recordfile, kind "run");
                                       the name IS the blake2b-256 of its content: its bytes
                                       without the nonce trailer a run of record file version 4 or
                                       env base version 2 ends in (statebackend.recordfile.nonce)
    index/<seq:012d>-<token>.json      the index of a commit, written by releases before inline markers; the
                                       marker was its name (still read, kept while a checkpoint names it)

A run holds the records of versions ``first_seq .. last_seq`` of the store in key order (puts, and tombstones for
deleted keys), newest value per key; a *base* run holds the whole store at ``last_seq`` (``first_seq == 1``, no
tombstones). The runs of an index, oldest first, are contiguous: the first starts at seq 1 (the empty store) and
each next one starts right after the one before; applying them in order gives the store at the index's version
(the last run may end before the index's ``seq``: commits that changed nothing add no run).

Index (an inline marker's payload once inflated, or an index blob's bytes): UTF-8 JSON, one object, keys sorted::

    {"schema": "statebackend.blobsnapshot.index", "schema_version": 2,
     "job": ..., "task": ..., "store": ..., "checkpoint_id": "<millis>-<nanos>", "token": "<flush token>", "seq": n,
     "hash_algorithm": "blake2b-256", "key_count": n,
     "runs": [{"hash": "<hex>", "size": n, "records": n, "level": n, "base": bool, "first_seq": n, "last_seq": n,
               "checkpoint_id": "<id of version last_seq>", "token": "<token of version last_seq>"}, ...],
     "previous_index": "<name>" | null,
     "checksum": "<blake2b-256 hex of the canonical body without this key>"}

Marker: the checkpoint's marker carries the index itself (no index blob is written), in the versioned form::

    inline-index:1:<seq:012d>-<token>:<base64url, unpadded, of the zlib-compressed canonical index JSON>

(:func:`inline_marker`, :func:`decode_inline_marker`). A marker of releases before it is the index blob's name; a
reader tells the two apart by the prefix (:func:`is_inline_marker`): a blob name starts with the job name and ends in
``.json``, an inline marker holds neither ``/`` nor ``.``. For an inline index, ``previous_index`` is the previous
marker's label (its blob name, or ``<seq:012d>-<token>`` of an inline one).

Binding: the checksum proves an index intact; :func:`check_index_binding` proves it is the index its name designates
(the body's ``(job, task, store, seq, token)`` against the name, or the inline marker's ``<seq>-<token>``, and the
reader). A run is bound by its name (the hash
of its content, checked with its size on every read) and its header's lineage (job, task, store, ``first_seq - 1``,
``last_seq``, checkpoint id and token) is checked against the index's entry (:func:`check_run_binding`).

Schema version 1 (whole-environment copies cut into chunks, written by releases before runs) is refused with
:class:`IncompatibleFormatError` naming the migration path (docs/formats-blobsnapshot.md).
"""

from __future__ import annotations

import base64
import hashlib
import json
import re
import zlib
from collections.abc import Iterable, Mapping, Sequence
from typing import Any

import attrs

from statebackend.errors import CorruptDataError, IncompatibleFormatError
from statebackend.recordfile import KIND_RUN, FileHeader
from statebackend.store import LocalVersion

__all__ = [
    "HASH_ALGORITHM",
    "SCHEMA",
    "SCHEMA_VERSION",
    "RunEntry",
    "RunIndex",
    "chain_problem",
    "check_index_binding",
    "check_run_binding",
    "content_hash",
    "decode_inline_marker",
    "index_name",
    "index_prefix",
    "inline_marker",
    "is_inline_marker",
    "legacy_chunks_prefix",
    "marker_label",
    "marker_seq",
    "new_hasher",
    "parse_index_name",
    "replace_runs",
    "run_name",
    "runs_prefix",
]

SCHEMA = "statebackend.blobsnapshot.index"
SCHEMA_VERSION = 2
HASH_ALGORITHM = "blake2b-256"
_HEX64 = re.compile(r"^[0-9a-f]{64}$")
_INDEX_NAME = re.compile(r"^(\d{12})-([A-Za-z0-9_-]+)\.json$")
#: the versioned prefix of a marker that carries its index (version 1 of that form: zlib, base64url)
INLINE_MARKER_PREFIX = "inline-index:1:"
_INLINE_MARKER = re.compile(r"^inline-index:1:(\d{12})-([A-Za-z0-9_-]+):([A-Za-z0-9_-]+)$")
#: the most bytes an inline marker's index may inflate to (a damaged or forged marker cannot exhaust memory); an
#: index of 10,000 runs takes about 2.5 MB
MAX_INLINE_INDEX_BYTES = 16 << 20

MIGRATION_V1 = (
    "schema version 1 (whole-environment chunks) is no longer read: restore the store from another backend's marker "
    "(a dual commit, stores.<name>.backup.factories=changelog,blobsnapshot, written by the release that wrote this "
    "index, gives one; restore falls back to it by itself), or let the release that wrote it restore the state and "
    "commit once with the changelog backend in the store's backup factories before upgrading; the first commit of "
    "this release then uploads a base run (docs/formats-blobsnapshot.md, 'Migrating from schema 1')"
)


def new_hasher() -> Any:
    """A fresh hasher of :data:`HASH_ALGORITHM` (blake2b: the fastest strong hash in hashlib on 64-bit CPUs)."""
    return hashlib.blake2b(digest_size=32)


def content_hash(data: bytes | memoryview) -> str:
    hasher = new_hasher()
    hasher.update(data)
    return str(hasher.hexdigest())


def runs_prefix(store_prefix: str) -> str:
    return f"{store_prefix}runs/"


def index_prefix(store_prefix: str) -> str:
    return f"{store_prefix}index/"


def legacy_chunks_prefix(store_prefix: str) -> str:
    """Where schema-1 snapshots kept their chunks (swept once no checkpoint needs them)."""
    return f"{store_prefix}chunks/"


def run_name(store_prefix: str, digest: str) -> str:
    return f"{store_prefix}runs/{digest}"


def index_name(store_prefix: str, seq: int, token: str) -> str:
    return f"{store_prefix}index/{seq:012d}-{token}.json"


def parse_index_name(name: str) -> tuple[int, str] | None:
    """``(seq, token)`` of an index blob name, or ``None`` when ``name`` is not one."""
    match = _INDEX_NAME.match(name.rsplit("/", 1)[-1])
    return (int(match.group(1)), match.group(2)) if match else None


def is_inline_marker(marker: str) -> bool:
    """Whether ``marker`` is of the inline form (carries its index) rather than an index blob's name."""
    return marker.startswith(INLINE_MARKER_PREFIX)


def marker_seq(marker: str) -> int | None:
    """The ``seq`` a marker of either form names, or ``None`` when it is neither (read without decoding)."""
    parsed = _parse_marker(marker)
    return parsed[0] if parsed is not None else None


def marker_label(marker: str) -> str:
    """How messages name a marker: the index blob's name, or ``inline index <seq:012d>-<token>``."""
    if is_inline_marker(marker):
        parsed = _parse_marker(marker)
        return f"inline index {parsed[0]:012d}-{parsed[1]}" if parsed is not None else "inline index (malformed)"
    return marker


def inline_marker(index: RunIndex) -> str:
    """The marker that carries ``index``: its canonical JSON (checksum included), zlib-compressed, base64url."""
    payload = base64.urlsafe_b64encode(zlib.compress(index.encode(), 9)).rstrip(b"=").decode("ascii")
    return f"{INLINE_MARKER_PREFIX}{index.seq:012d}-{index.token}:{payload}"


def decode_inline_marker(marker: str, *, job: str, task: str, store: str) -> RunIndex:
    """Decode and verify an inline marker: intact (the index's checksum) and bound to the marker's ``seq``/``token``
    and the reader's ``job``/``task``/``store`` (:func:`check_index_binding`). :class:`CorruptDataError` otherwise."""
    label = marker_label(marker)
    match = _INLINE_MARKER.match(marker)
    if match is None:
        raise CorruptDataError(
            f"{label}: the checkpoint's blobsnapshot marker is not of the form {INLINE_MARKER_PREFIX}<seq:012d>-"
            f"<token>:<payload>; it is damaged: restore an older checkpoint or from another backend's marker"
        )
    payload = match.group(3)
    try:
        compressed = base64.urlsafe_b64decode(payload + "=" * (-len(payload) % 4))
        inflater = zlib.decompressobj()
        data = inflater.decompress(compressed, MAX_INLINE_INDEX_BYTES)
        if inflater.unconsumed_tail or not inflater.eof:
            raise CorruptDataError(
                f"{label}: the index is cut or inflates past {MAX_INLINE_INDEX_BYTES} bytes; the marker is damaged: "
                f"restore an older checkpoint or from another backend's marker"
            )
    except (ValueError, zlib.error) as exc:
        raise CorruptDataError(
            f"{label}: the marker's index does not decode ({exc}); the marker is damaged: "
            f"restore an older checkpoint or from another backend's marker"
        ) from exc
    index = RunIndex.decode(data, name=label)
    check_index_binding(index, name=marker, job=job, task=task, store=store)
    return index


def check_index_binding(index: RunIndex, *, name: str, job: str, task: str, store: str) -> None:
    """Raise :class:`CorruptDataError` unless ``index`` is the index marker ``name`` designates for ``job``/``task``/
    ``store``: the same ``(job, task, store)`` and the ``(seq, token)`` the marker holds (an index blob's name, or
    the ``<seq>-<token>`` of an inline marker)."""
    parsed = _parse_marker(name)
    label = marker_label(name)
    if parsed is None:
        raise CorruptDataError(
            f"index marker {label} is not an index name (<seq:012d>-<token>.json); the checkpoint's marker is "
            f"damaged: restore an older checkpoint or from another backend's marker"
        )
    expected = (job, task, store, parsed[0], parsed[1])
    found = (index.job, index.task, index.store, index.seq, index.token)
    if expected != found:
        raise CorruptDataError(
            f"index {label} is intact but is not the index its marker designates: expected (job, task, store, seq, "
            f"token)={expected}, found {found}; another index (an older one of this store, or another task's or "
            f"store's) was written over it. Nothing was loaded: restore an older checkpoint or from another "
            f"backend's marker"
        )


def _parse_marker(marker: str) -> tuple[int, str] | None:
    if is_inline_marker(marker):
        match = _INLINE_MARKER.match(marker)
        return (int(match.group(1)), match.group(2)) if match else None
    return parse_index_name(marker)


def check_run_binding(
    header: FileHeader, entry: RunEntry, *, name: str, index: str, job: str, task: str, store: str
) -> None:
    """Raise :class:`CorruptDataError` unless the run file's header is the lineage ``entry`` of ``index`` names."""
    expected = (KIND_RUN, job, task, store, entry.first_seq - 1, entry.last_seq, entry.checkpoint_id, entry.token)
    found = (
        header.kind,
        header.job,
        header.task,
        header.store,
        header.base_seq,
        header.seq,
        header.checkpoint_id,
        header.token,
    )
    if expected != found:
        raise CorruptDataError(
            f"run {name} that index {index} lists is intact but holds another lineage: expected (kind, job, task, "
            f"store, base_seq, seq, checkpoint_id, token)={expected}, found {found}. Nothing was loaded: restore an "
            f"older checkpoint or from another backend's marker"
        )


@attrs.frozen
class RunEntry:
    """One run of an index: its content hash (its blob name's last segment), size in bytes, record count, level
    (0: one commit's change; n: a merge of level n-1 runs; base runs have the top level), and the versions it holds:
    ``first_seq .. last_seq``, ``checkpoint_id``/``token`` being those of version ``last_seq``."""

    hash: str
    size: int
    records: int
    level: int
    base: bool
    first_seq: int
    last_seq: int
    checkpoint_id: str
    token: str

    @property
    def version(self) -> LocalVersion:
        """The local store version once this run (and every run before it) is applied."""
        return LocalVersion(self.checkpoint_id, self.token)

    def to_json(self) -> dict[str, Any]:
        return {
            "hash": self.hash,
            "size": self.size,
            "records": self.records,
            "level": self.level,
            "base": self.base,
            "first_seq": self.first_seq,
            "last_seq": self.last_seq,
            "checkpoint_id": self.checkpoint_id,
            "token": self.token,
        }

    @classmethod
    def from_json(cls, item: Mapping[str, Any]) -> RunEntry:
        base = item["base"]
        if not isinstance(base, bool):
            raise TypeError(f"expected a boolean 'base', got {base!r}")
        return cls(
            hash=_digest(item["hash"]),
            size=_count(item["size"]),
            records=_count(item["records"]),
            level=_count(item["level"]),
            base=base,
            first_seq=_count(item["first_seq"]),
            last_seq=_count(item["last_seq"]),
            checkpoint_id=_text(item["checkpoint_id"]),
            token=_text(item["token"]),
        )


@attrs.frozen
class RunIndex:
    """The index blob of one commit: the live runs, oldest first. See the module docstring for the JSON layout."""

    job: str
    task: str
    store: str
    checkpoint_id: str
    token: str
    seq: int
    runs: tuple[RunEntry, ...]
    key_count: int
    previous_index: str | None = None
    hash_algorithm: str = HASH_ALGORITHM

    @property
    def version(self) -> LocalVersion:
        """The local store version this index holds (the flush of its commit)."""
        return LocalVersion(self.checkpoint_id, self.token)

    def run_hashes(self) -> set[str]:
        return {run.hash for run in self.runs}

    def blob_names(self, store_prefix: str) -> set[str]:
        """Every run blob this index needs."""
        return {run_name(store_prefix, run.hash) for run in self.runs}

    @property
    def total_bytes(self) -> int:
        return sum(run.size for run in self.runs)

    def encode(self) -> bytes:
        body = self._body()
        body["checksum"] = _checksum(body)
        return _canonical(body)

    @classmethod
    def decode(cls, data: bytes, *, name: str) -> RunIndex:
        """Parse and verify an index (a blob's bytes, or an inline marker's); errors name ``name`` (the blob's name
        or the marker's label)."""
        what = name if name.startswith("inline index") else f"index blob {name}"
        try:
            document = json.loads(data)
        except (ValueError, UnicodeDecodeError) as exc:
            raise CorruptDataError(f"{what} is not valid JSON ({exc}); it is damaged or not an index") from exc
        if not isinstance(document, dict):
            raise CorruptDataError(f"{what} is not a JSON object")
        if document.get("schema") != SCHEMA:
            raise CorruptDataError(f"{what} has schema {document.get('schema')!r}, expected {SCHEMA!r}")
        version = document.get("schema_version")
        if version == 1:
            raise IncompatibleFormatError(f"{what}: {MIGRATION_V1}")
        if version != SCHEMA_VERSION:
            raise IncompatibleFormatError(
                f"{what} has schema_version {version!r}; this release reads {SCHEMA_VERSION}: upgrade "
                f"statebackend to restore it"
            )
        checksum = document.pop("checksum", None)
        if checksum != _checksum(document):
            raise CorruptDataError(f"{what} failed its checksum; it was damaged after it was written")
        try:
            index = cls(
                job=_text(document["job"]),
                task=_text(document["task"]),
                store=_text(document["store"]),
                checkpoint_id=_text(document["checkpoint_id"]),
                token=_text(document["token"]),
                seq=_count(document["seq"]),
                runs=tuple(RunEntry.from_json(item) for item in document["runs"]),
                key_count=_count(document["key_count"]),
                previous_index=None if document["previous_index"] is None else _text(document["previous_index"]),
                hash_algorithm=_text(document["hash_algorithm"]),
            )
        except (KeyError, TypeError, ValueError, AttributeError) as exc:
            raise CorruptDataError(f"{what} is missing or has a malformed field: {exc!r}") from exc
        if index.hash_algorithm != HASH_ALGORITHM:
            raise IncompatibleFormatError(
                f"{what} uses hash {index.hash_algorithm!r}; this release knows {HASH_ALGORITHM!r}"
            )
        problem = chain_problem(index.runs, index.seq)
        if problem is not None:
            raise CorruptDataError(f"{what}: {problem}")
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
            "key_count": self.key_count,
            "runs": [run.to_json() for run in self.runs],
            "previous_index": self.previous_index,
        }


def chain_problem(runs: Sequence[RunEntry], seq: int) -> str | None:
    """Why ``runs`` (oldest first) are not a contiguous chain from the empty store up to at most ``seq``, or None."""
    expected_first = 1
    for position, run in enumerate(runs):
        if run.first_seq != expected_first or run.last_seq < run.first_seq:
            return (
                f"run {position} holds versions {run.first_seq}..{run.last_seq} where the chain needs it to start "
                f"at {expected_first}; the runs do not rebuild one history"
            )
        if run.base and (run.first_seq != 1 or position != 0):
            return f"run {position} is a base run but is not the first run of the chain"
        expected_first = run.last_seq + 1
    if expected_first - 1 > seq:
        return f"the runs reach version {expected_first - 1}, past the index's own seq {seq}"
    return None


def replace_runs(runs: Sequence[RunEntry], inputs: Iterable[RunEntry], output: RunEntry) -> tuple[RunEntry, ...] | None:
    """``runs`` with the contiguous ``inputs`` replaced by their merge ``output``; None when ``inputs`` are not a
    contiguous stretch of ``runs`` holding exactly the versions ``output`` holds."""
    inputs = list(inputs)
    if not inputs:
        return None
    try:
        start = runs.index(inputs[0])
    except ValueError:
        return None
    if list(runs[start : start + len(inputs)]) != inputs:
        return None
    if (inputs[0].first_seq, inputs[-1].last_seq) != (output.first_seq, output.last_seq):
        return None
    return (*runs[:start], output, *runs[start + len(inputs) :])


def _canonical(document: Mapping[str, Any]) -> bytes:
    return json.dumps(document, sort_keys=True, separators=(",", ":"), ensure_ascii=True).encode("ascii")


def _checksum(body: Mapping[str, Any]) -> str:
    return content_hash(_canonical(body))


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
