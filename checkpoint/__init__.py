"""Checkpoints: ids, CheckpointV1 / CheckpointV2 values, their JSON serde, the checkpoint log on a blob store, and
the local checkpoint file in each store dir (formats in docs/formats-checkpoint.md)."""

from __future__ import annotations

from statebackend.checkpoint.checkpoint import CheckpointV1, CheckpointV2, FrozenMap
from statebackend.checkpoint.id import NANOS_PER_MILLI, CheckpointId, CheckpointIdGenerator
from statebackend.checkpoint.local import (
    LOCAL_CHECKPOINT_FILE,
    read_local_checkpoint,
    read_local_checkpoint_binding,
    remove_local_checkpoint,
    write_local_checkpoint,
)
from statebackend.checkpoint.log import MAX_SEQ, CheckpointLog, LogEntry
from statebackend.checkpoint.serde import (
    BLOB_FORMAT,
    READABLE_VERSIONS,
    WRITABLE_VERSIONS,
    Binding,
    decode_bound_checkpoint,
    decode_checkpoint,
    encode_checkpoint,
)

__all__ = [
    "BLOB_FORMAT",
    "LOCAL_CHECKPOINT_FILE",
    "MAX_SEQ",
    "NANOS_PER_MILLI",
    "READABLE_VERSIONS",
    "WRITABLE_VERSIONS",
    "Binding",
    "CheckpointId",
    "CheckpointIdGenerator",
    "CheckpointLog",
    "CheckpointV1",
    "CheckpointV2",
    "FrozenMap",
    "LogEntry",
    "decode_bound_checkpoint",
    "decode_checkpoint",
    "encode_checkpoint",
    "read_local_checkpoint",
    "read_local_checkpoint_binding",
    "remove_local_checkpoint",
    "write_local_checkpoint",
]
