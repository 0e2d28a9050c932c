"""Checkpoint JSON serde. Layout and rationale: docs/formats-checkpoint.md.

Encoding is UTF-8 JSON, keys sorted, no spaces, so one checkpoint has exactly one encoding (a replayed write of
the same checkpoint is byte-identical, which the checkpoint log uses to tell a retry from a competing writer)::

    {"input_offsets":{...},"version":1}
    {"checkpoint_id":"<millis>-<nanos>","input_offsets":{...},"state_checkpoint_markers":{factory:{store:marker}},
     "version":2}

Blob format 2 (``"format":2``) binds a checkpoint to its name and makes it self-verifying: the document also carries
``job``, ``task`` and ``seq`` (the checkpoint log's sequence number) and ``sha256``, the SHA-256 of the canonical
encoding of every other field. A reader checks the checksum always, and the binding against the name it read (a
checkpoint copied, renamed or restored from an older backup under another name is refused). Documents without
``format`` are blob format 1 (written before this release): read as before, with no checksum to check.

Blob format 3 is the checkpoint log on a blob store with conditional writes (:mod:`statebackend.checkpoint.log`):

- the **head** (``checkpoints/HEAD.v3.json``), one blob per task holding its retained checkpoints, newest last::

    {"entries":[{"checkpoint":{<checkpoint document>},"nonce":"<hex>","seq":<n>},...],"format":3,
     "job":"<job>","kind":"checkpoint-head","moved_at":<seq>,"seq":<newest seq>,"sha256":"<hex>","task":"<task>"}

  checksummed like format 2 and bound to (job, task); ``seq`` is the newest entry's. ``nonce`` is fresh for every
  write that adds an entry, so two writers' identical checkpoints differ and an S3 ETag (the MD5 of the bytes)
  changes on every write. ``moved_at``: the seq of the per-seq blob that marked the move (below).
- the **move marker**, the per-seq blob ``<moved_at:012d>.v2.json`` written once, when a task's log moves to the
  head: blob format 3 and ``"version":3`` with the checkpoint of that seq nested (``"checkpoint"``) and the head's
  name (``"head"``). Releases that read blob format 2 refuse it (:class:`IncompatibleFormatError`, "blob format 3
  ... Upgrade statebackend"), older ones refuse its version 3 the same way: a rollback never restores the stale
  per-seq log in silence. This release reads it only through a log on a store with conditional writes.

Decoding is strict about what it knows and lenient about what it does not: a bad byte, bad JSON, a duplicate key, a
missing field or a wrong type is :class:`CorruptDataError` naming the source; an unknown ``version`` is
:class:`IncompatibleFormatError` naming the version, the source and :data:`READABLE_VERSIONS`; unknown extra
top-level fields of a known version are ignored, so a later release may add fields (SEP-28 asks for it).
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Mapping
from typing import Any

import attrs
from statebackend.checkpoint.checkpoint import CheckpointV1, CheckpointV2
from statebackend.checkpoint.id import CheckpointId

from statebackend.errors import ConfigError, CorruptDataError, IncompatibleFormatError

__all__ = [
    "BLOB_FORMAT",
    "HEAD_FORMAT",
    "CheckpointHead",
    "HeadEntry",
    "decode_head",
    "encode_head",
    "encode_moved_marker",
    "READABLE_VERSIONS",
    "WRITABLE_VERSIONS",
    "Binding",
    "decode_bound_checkpoint",
    "decode_checkpoint",
    "encode_checkpoint",
]

#: checkpoint format versions this release reads and writes
READABLE_VERSIONS: tuple[int, ...] = (1, 2)
WRITABLE_VERSIONS: tuple[int, ...] = (1, 2)
#: the blob format this release writes (the ``format`` field; absent means 1: unbound, no checksum)
BLOB_FORMAT = 2
_BOUND_FIELDS = ("job", "task", "seq", "sha256")
#: the blob format of the checkpoint head and of the per-seq marker of a log moved to it
HEAD_FORMAT = 3
_HEAD_KIND = "checkpoint-head"
_MOVED_KIND = "moved-to-head"


@attrs.frozen
class Binding:
    """Where a checkpoint blob belongs: the job, the task and the sequence number in the task's checkpoint log."""

    job: str
    task: str
    seq: int

    def describe(self) -> str:
        return f"checkpoint #{self.seq} of task {self.task!r} in job {self.job!r}"


def _canonical(document: Mapping[str, Any]) -> bytes:
    return json.dumps(document, sort_keys=True, separators=(",", ":"), ensure_ascii=False).encode("utf-8")


def _digest(document: Mapping[str, Any]) -> str:
    return hashlib.sha256(_canonical({k: v for k, v in document.items() if k != "sha256"})).hexdigest()


def encode_checkpoint(checkpoint: CheckpointV1 | CheckpointV2, binding: Binding | None = None) -> bytes:
    """The canonical JSON bytes of ``checkpoint``; with ``binding``, blob format 2 (bound to it, checksummed)."""
    document = _checkpoint_document(checkpoint)
    if binding is not None:
        if not isinstance(binding, Binding):
            raise TypeError(f"binding must be a Binding, got {type(binding).__name__}")
        document.update(format=BLOB_FORMAT, job=binding.job, task=binding.task, seq=binding.seq)
        document["sha256"] = _digest(document)
    return _canonical(document)


def _checkpoint_document(checkpoint: CheckpointV1 | CheckpointV2) -> dict[str, Any]:
    document: dict[str, Any]
    if isinstance(checkpoint, CheckpointV2):
        document = {
            "version": 2,
            "checkpoint_id": str(checkpoint.checkpoint_id),
            "input_offsets": dict(checkpoint.input_offsets),
            "state_checkpoint_markers": {
                factory: dict(stores) for factory, stores in checkpoint.state_checkpoint_markers.items()
            },
        }
        if checkpoint.serdes:
            document["serdes"] = {store: dict(names) for store, names in checkpoint.serdes.items()}
    elif isinstance(checkpoint, CheckpointV1):
        document = {"version": 1, "input_offsets": dict(checkpoint.input_offsets)}
    else:
        raise TypeError(f"cannot encode {type(checkpoint).__name__}; expected CheckpointV1 or CheckpointV2")
    return document


@attrs.frozen
class HeadEntry:
    """One checkpoint of the head: its seq, the nonce of the write that added it, the checkpoint."""

    seq: int
    nonce: str
    checkpoint: CheckpointV1 | CheckpointV2


@attrs.frozen
class CheckpointHead:
    """A task's retained checkpoints in one blob (blob format 3), ascending by seq, never empty."""

    job: str
    task: str
    entries: tuple[HeadEntry, ...]
    #: the seq whose per-seq blob marks the move of the log to the head
    moved_at: int

    @property
    def seq(self) -> int:
        """The newest seq: the head's position in the log's history (every write adds exactly the next one)."""
        return self.entries[-1].seq

    def entry(self, seq: int) -> HeadEntry | None:
        return next((e for e in self.entries if e.seq == seq), None)


def encode_head(head: CheckpointHead) -> bytes:
    """The canonical bytes of ``head``: blob format 3, bound to its job and task, checksummed."""
    if not head.entries:
        raise ValueError("a checkpoint head holds at least one checkpoint")
    document: dict[str, Any] = {
        "format": HEAD_FORMAT,
        "kind": _HEAD_KIND,
        "job": head.job,
        "task": head.task,
        "seq": head.seq,
        "moved_at": head.moved_at,
        "entries": [
            {"seq": e.seq, "nonce": e.nonce, "checkpoint": _checkpoint_document(e.checkpoint)} for e in head.entries
        ],
    }
    document["sha256"] = _digest(document)
    return _canonical(document)


def decode_head(data: bytes, *, source: str, job: str, task: str) -> CheckpointHead:
    """Read a head written by :func:`encode_head`: checksum, kind, binding to (``job``, ``task``), entries ascending
    and the ``seq`` field equal to the newest. Anything else is :class:`CorruptDataError` naming ``source``; another
    blob format is :class:`IncompatibleFormatError`."""
    document = _parse(data, source)
    blob_format = document.get("format")
    if blob_format != HEAD_FORMAT or document.get("kind") != _HEAD_KIND:
        if type(blob_format) is int and blob_format > HEAD_FORMAT:
            raise IncompatibleFormatError(
                f"checkpoint head {source} has blob format {blob_format}; this release reads format {HEAD_FORMAT}. "
                "Upgrade statebackend to read it"
            )
        raise CorruptDataError(f"checkpoint head {source} is not a checkpoint head (format {blob_format!r})")
    if not isinstance(document.get("sha256"), str) or _digest(document) != document["sha256"]:
        raise CorruptDataError(
            f"checkpoint head {source} fails its checksum (sha256 of its content differs from the one it carries): "
            "it was altered or damaged after it was written. It is not used"
        )
    if document.get("job") != job or document.get("task") != task:
        raise CorruptDataError(
            f"checkpoint head {source} belongs to task {document.get('task')!r} of job {document.get('job')!r}, not "
            f"task {task!r} of job {job!r}: it was copied from another place. It is not used"
        )
    raw_entries, newest, moved_at = document.get("entries"), document.get("seq"), document.get("moved_at")
    if not isinstance(raw_entries, list) or not raw_entries or type(newest) is not int or type(moved_at) is not int:
        raise CorruptDataError(f"checkpoint head {source}: needs a non-empty 'entries' list and integer 'seq'")
    entries: list[HeadEntry] = []
    for index, raw in enumerate(raw_entries):
        where = f"{source} entry {index}"
        if not isinstance(raw, dict) or type(raw.get("seq")) is not int or not isinstance(raw.get("nonce"), str):
            raise CorruptDataError(f"checkpoint head {where}: needs an integer 'seq' and a string 'nonce'")
        inner = raw.get("checkpoint")
        if not isinstance(inner, dict):
            raise CorruptDataError(f"checkpoint head {where}: 'checkpoint' must be an object")
        entries.append(HeadEntry(raw["seq"], raw["nonce"], _checkpoint(inner, where)))
    if any(a.seq >= b.seq for a, b in zip(entries, entries[1:], strict=False)) or entries[-1].seq != newest:
        raise CorruptDataError(f"checkpoint head {source}: entries are not ascending up to its seq {newest}")
    return CheckpointHead(job, task, tuple(entries), moved_at)


def encode_moved_marker(checkpoint: CheckpointV2, binding: Binding, head_name: str) -> bytes:
    """The per-seq blob that marks a log's move to its head (module docstring): blob format 3, version 3, bound to
    ``binding`` and checksummed, the checkpoint nested."""
    document: dict[str, Any] = {
        "format": HEAD_FORMAT,
        "version": 3,
        "kind": _MOVED_KIND,
        "head": head_name,
        "job": binding.job,
        "task": binding.task,
        "seq": binding.seq,
        "checkpoint": _checkpoint_document(checkpoint),
    }
    document["sha256"] = _digest(document)
    return _canonical(document)


def decode_checkpoint(
    data: bytes, *, source: str = "<bytes>", expect: Binding | None = None
) -> CheckpointV1 | CheckpointV2:
    """Read a checkpoint written by :func:`encode_checkpoint` (any version in :data:`READABLE_VERSIONS`).

    A bound blob's checksum is always checked; with ``expect``, its binding must be ``expect`` (the name it was read
    from), else :class:`CorruptDataError` naming both."""
    checkpoint, binding = decode_bound_checkpoint(data, source=source)
    if expect is not None and binding is not None and binding != expect:
        raise CorruptDataError(
            f"checkpoint {source} is {binding.describe()}, not {expect.describe()} as its name says: the blob was "
            f"copied, renamed or put back from another place or time. It is not used; restore the right blob or "
            f"delete this one (the task then restores the newest remaining checkpoint)"
        )
    return checkpoint


def decode_bound_checkpoint(
    data: bytes, *, source: str = "<bytes>", moved_ok: bool = False
) -> tuple[CheckpointV1 | CheckpointV2, Binding | None]:
    """The checkpoint and its binding (``None`` for blob format 1), checksum checked. ``moved_ok``: a move marker
    (blob format 3) is read as the checkpoint it holds (a log on a store with conditional writes); without it, it is
    :class:`IncompatibleFormatError` saying why."""
    document = _parse(data, source)
    if document.get("format") == HEAD_FORMAT and document.get("kind") == _MOVED_KIND:
        if not moved_ok:
            raise IncompatibleFormatError(
                f"checkpoint {source} marks the move of this task's checkpoint log to its head blob "
                f"({document.get('head')!r}), which needs a blob store with conditional writes "
                "(supports_conditional_put); open the log through such a store (s3://, az://, file://, memory://)"
            )
        moved = _moved_binding(document, source)
        inner = document.get("checkpoint")
        if not isinstance(inner, dict):
            raise CorruptDataError(f"checkpoint {source}: 'checkpoint' must be an object")
        return _checkpoint(inner, source), moved
    binding = _binding(document, source)  # the checksum first: a damaged blob is reported as such
    return _checkpoint(document, source), binding


def _moved_binding(document: dict[str, Any], source: str) -> Binding:
    job, task, seq, digest = (document.get(field) for field in _BOUND_FIELDS)
    if not isinstance(job, str) or not isinstance(task, str) or type(seq) is not int or not isinstance(digest, str):
        raise CorruptDataError(f"checkpoint {source}: a move marker needs 'job', 'task', 'seq' and 'sha256'")
    if _digest(document) != digest:
        raise CorruptDataError(
            f"checkpoint {source} fails its checksum (sha256 of its content differs from the one it carries): it "
            f"was altered or damaged after it was written. It is not used"
        )
    return Binding(job, task, seq)


def _parse(data: bytes, source: str) -> dict[str, Any]:
    try:
        text = bytes(data).decode("utf-8")
        document = json.loads(text, object_pairs_hook=_reject_duplicate_keys, parse_constant=_reject_constant)
    except (UnicodeDecodeError, ValueError) as exc:
        raise CorruptDataError(f"checkpoint {source} is not valid UTF-8 JSON ({exc}); it cannot be read") from exc
    if not isinstance(document, dict):
        raise CorruptDataError(f"checkpoint {source} is a JSON {type(document).__name__}, expected an object")
    return document


def _binding(document: dict[str, Any], source: str) -> Binding | None:
    blob_format = document.get("format", 1)
    if type(blob_format) is not int:
        raise CorruptDataError(f"checkpoint {source} has format {blob_format!r}; expected an integer")
    if blob_format == 1:
        if any(field in document for field in _BOUND_FIELDS):
            raise CorruptDataError(f"checkpoint {source} carries binding fields but no 'format': it was altered")
        return None
    if blob_format != BLOB_FORMAT:
        raise IncompatibleFormatError(
            f"checkpoint {source} has blob format {blob_format}; this release reads formats 1 and {BLOB_FORMAT}. "
            f"Upgrade statebackend to read it"
        )
    job, task, seq, digest = (document.get(field) for field in _BOUND_FIELDS)
    if not isinstance(job, str) or not isinstance(task, str) or type(seq) is not int or not isinstance(digest, str):
        raise CorruptDataError(
            f"checkpoint {source}: blob format 2 needs string 'job', 'task', 'sha256' and integer 'seq'; "
            f"got {job!r}, {task!r}, {digest!r}, {seq!r}"
        )
    if _digest(document) != digest:
        raise CorruptDataError(
            f"checkpoint {source} fails its checksum (sha256 of its content differs from the one it carries): it "
            f"was altered or damaged after it was written. It is not used"
        )
    return Binding(job, task, seq)


def _checkpoint(document: dict[str, Any], source: str) -> CheckpointV1 | CheckpointV2:
    if "version" not in document:
        raise CorruptDataError(f"checkpoint {source} has no 'version' field; it is not a checkpoint of this format")
    version = document["version"]
    if type(version) is not int:
        raise CorruptDataError(f"checkpoint {source} has version {version!r}; expected an integer")
    if version not in READABLE_VERSIONS:
        raise IncompatibleFormatError(
            f"checkpoint {source} has format version {version}; this release reads versions "
            f"{', '.join(map(str, READABLE_VERSIONS))}. Upgrade statebackend to read it, or set "
            f"task.checkpoint.write.versions on the writer to a version listed here"
        )
    offsets = _string_map(document, "input_offsets", source)
    if version == 1:
        return CheckpointV1(offsets)
    raw_id = document.get("checkpoint_id")
    if not isinstance(raw_id, str):
        raise CorruptDataError(f"checkpoint {source}: 'checkpoint_id' must be a string, got {raw_id!r}")
    try:
        checkpoint_id = CheckpointId.parse(raw_id)
    except ConfigError as exc:
        raise CorruptDataError(f"checkpoint {source}: {exc}") from exc
    raw_markers = document.get("state_checkpoint_markers")
    if not isinstance(raw_markers, dict):
        raise CorruptDataError(
            f"checkpoint {source}: 'state_checkpoint_markers' must be an object factory -> {{store: marker}}, "
            f"got {raw_markers!r}"
        )
    markers = {name: _string_map(raw_markers, name, source, "state_checkpoint_markers") for name in raw_markers}
    raw_serdes = document.get("serdes", {})
    if not isinstance(raw_serdes, dict):
        raise CorruptDataError(f"checkpoint {source}: 'serdes' must be an object store -> {{key, msg}}")
    serdes = {name: _string_map(raw_serdes, name, source, "serdes") for name in raw_serdes}
    return CheckpointV2(checkpoint_id, offsets, markers, serdes)


def _string_map(document: Mapping[str, Any], field: str, source: str, parent: str = "") -> dict[str, str]:
    where = f"{parent}.{field}" if parent else field
    value = document.get(field)
    if not isinstance(value, dict) or not all(isinstance(v, str) for v in value.values()):
        raise CorruptDataError(f"checkpoint {source}: {where!r} must be an object of strings, got {value!r}")
    return value


def _reject_duplicate_keys(pairs: list[tuple[str, Any]]) -> dict[str, Any]:
    # Two values for one key would make the checkpoint ambiguous; json.loads would silently keep the last.
    document: dict[str, Any] = {}
    for key, value in pairs:
        if key in document:
            raise ValueError(f"duplicate key {key!r}")
        document[key] = value
    return document


def _reject_constant(name: str) -> Any:
    raise ValueError(f"{name} is not valid JSON")
