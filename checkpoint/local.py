"""The local checkpoint file: ``CHECKPOINT-V2`` in each store dir.

It records the newest checkpoint this machine saw become durable for the task: its sequence number in the
checkpoint log and the checkpoint. That is local knowledge the blob store cannot take back: a listing that shows
less (a short answer, a deleted newest checkpoint, a blob store URL pointing at an older copy) is an error, never a
reason to start empty or roll back (see :mod:`checkpoint.log`). Whether the store's *data* is that checkpoint is
recorded separately, in the store itself (its LMDB meta version, written in the same transaction as the data), which
is what restore managers compare; so the file needs no removal while a restore changes the data. Contract:

- it is written only after the checkpoint is durable in the checkpoint log, so it never claims a checkpoint that
  is not durable remotely;
- it is written atomically (temp file in the same dir, fsync, ``os.replace``, fsync of the dir): a reader sees the
  old file, the new one, or none, never a part.

The content is the checkpoint's JSON in blob format 2 (:func:`checkpoint.serde.encode_checkpoint` with its binding:
job, task, seq, checksum).
"""

from __future__ import annotations

import contextlib
import os
import tempfile
from pathlib import Path

from statebackend.checkpoint.checkpoint import CheckpointV2
from statebackend.checkpoint.serde import Binding, decode_bound_checkpoint, encode_checkpoint

from statebackend.errors import CorruptDataError, NotFoundError
from statebackend.fsutil import fsync_dir

__all__ = [
    "LOCAL_CHECKPOINT_FILE",
    "read_local_checkpoint",
    "read_local_checkpoint_binding",
    "remove_local_checkpoint",
    "write_local_checkpoint",
]

LOCAL_CHECKPOINT_FILE = "CHECKPOINT-V2"


def write_local_checkpoint(
    store_dir: str | os.PathLike[str], checkpoint: CheckpointV2, binding: Binding | None = None
) -> None:
    """Atomically and durably write ``checkpoint`` (durable as ``binding``) as the store dir's local checkpoint file."""
    if not isinstance(checkpoint, CheckpointV2):
        raise TypeError(f"the local checkpoint file holds a CheckpointV2, got {type(checkpoint).__name__}")
    directory = Path(store_dir)
    data = encode_checkpoint(checkpoint, binding)
    try:
        fd, tmp = tempfile.mkstemp(dir=directory, prefix=f".{LOCAL_CHECKPOINT_FILE}.", suffix=".tmp")
    except FileNotFoundError as exc:
        raise NotFoundError(
            f"store dir {directory} does not exist; the local checkpoint file is written into an existing store dir"
        ) from exc
    try:
        with os.fdopen(fd, "wb") as out:
            out.write(data)
            out.flush()
            os.fsync(out.fileno())
        os.replace(tmp, directory / LOCAL_CHECKPOINT_FILE)
    except BaseException:
        with contextlib.suppress(OSError):
            os.unlink(tmp)
        raise
    fsync_dir(directory)


def read_local_checkpoint(store_dir: str | os.PathLike[str]) -> CheckpointV2 | None:
    """The store dir's local checkpoint, or None when it has none. A damaged file is :class:`CorruptDataError`."""
    found = read_local_checkpoint_binding(store_dir)
    return None if found is None else found[0]


def read_local_checkpoint_binding(store_dir: str | os.PathLike[str]) -> tuple[CheckpointV2, Binding | None] | None:
    """The store dir's local checkpoint and where it is durable (``None`` for a file written before blob format 2),
    or None when there is no file. A damaged file is :class:`CorruptDataError`."""
    path = Path(store_dir) / LOCAL_CHECKPOINT_FILE
    try:
        data = path.read_bytes()
    except FileNotFoundError:
        return None
    checkpoint, binding = decode_bound_checkpoint(data, source=str(path))
    if not isinstance(checkpoint, CheckpointV2):
        raise CorruptDataError(
            f"local checkpoint file {path} holds a version {checkpoint.version} checkpoint; it must hold version 2. "
            f"Delete it to make the next restore download the state"
        )
    return checkpoint, binding


def remove_local_checkpoint(store_dir: str | os.PathLike[str]) -> None:
    """Durably remove the store dir's local checkpoint file; an absent file (or dir) is success."""
    directory = Path(store_dir)
    try:
        os.unlink(directory / LOCAL_CHECKPOINT_FILE)
    except FileNotFoundError:
        return
    fsync_dir(directory)
