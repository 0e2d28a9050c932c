"""Checkpoint JSON serde. Layout and rationale: docs/formats-checkpoint.md.

Encoding is UTF-8 JSON, keys sorted, no spaces, so one checkpoint has exactly one encoding (a replayed write of
the same checkpoint is byte-identical, which the checkpoint log uses to tell a retry from a competing writer)::

    {"input_offsets":{...},"version":1}
    {"checkpoint_id":"<millis>-<nanos>","input_offsets":{...},"state_checkpoint_markers":{factory:{store:marker}},
     "version":2}

Decoding is strict about what it knows and lenient about what it does not: a bad byte, bad JSON, a duplicate key, a
missing field or a wrong type is :class:`CorruptDataError` naming the source; an unknown ``version`` is
:class:`IncompatibleFormatError` naming the version, the source and :data:`READABLE_VERSIONS`; unknown extra
top-level fields of a known version are ignored, so a later release may add fields (SEP-28 asks for it).
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from typing import Any

from checkpoint.checkpoint import CheckpointV1, CheckpointV2
from checkpoint.id import CheckpointId
from statebackend.errors import ConfigError, CorruptDataError, IncompatibleFormatError

__all__ = ["READABLE_VERSIONS", "WRITABLE_VERSIONS", "decode_checkpoint", "encode_checkpoint"]

#: checkpoint format versions this release reads and writes
READABLE_VERSIONS: tuple[int, ...] = (1, 2)
WRITABLE_VERSIONS: tuple[int, ...] = (1, 2)


def encode_checkpoint(checkpoint: CheckpointV1 | CheckpointV2) -> bytes:
    """The canonical JSON bytes of ``checkpoint``."""
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
    elif isinstance(checkpoint, CheckpointV1):
        document = {"version": 1, "input_offsets": dict(checkpoint.input_offsets)}
    else:
        raise TypeError(f"cannot encode {type(checkpoint).__name__}; expected CheckpointV1 or CheckpointV2")
    return json.dumps(document, sort_keys=True, separators=(",", ":"), ensure_ascii=False).encode("utf-8")


def decode_checkpoint(data: bytes, *, source: str = "<bytes>") -> CheckpointV1 | CheckpointV2:
    """Read a checkpoint written by :func:`encode_checkpoint` (any version in :data:`READABLE_VERSIONS`)."""
    try:
        text = bytes(data).decode("utf-8")
        document = json.loads(text, object_pairs_hook=_reject_duplicate_keys, parse_constant=_reject_constant)
    except (UnicodeDecodeError, ValueError) as exc:
        raise CorruptDataError(f"checkpoint {source} is not valid UTF-8 JSON ({exc}); it cannot be read") from exc
    if not isinstance(document, dict):
        raise CorruptDataError(f"checkpoint {source} is a JSON {type(document).__name__}, expected an object")
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
    return CheckpointV2(checkpoint_id, offsets, markers)


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
