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
    if binding is not None:
        if not isinstance(binding, Binding):
            raise TypeError(f"binding must be a Binding, got {type(binding).__name__}")
        document.update(format=BLOB_FORMAT, job=binding.job, task=binding.task, seq=binding.seq)
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
    data: bytes, *, source: str = "<bytes>"
) -> tuple[CheckpointV1 | CheckpointV2, Binding | None]:
    """The checkpoint and its binding (``None`` for blob format 1), checksum checked."""
    document = _parse(data, source)
    binding = _binding(document, source)  # the checksum first: a damaged blob is reported as such
    return _checkpoint(document, source), binding


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
