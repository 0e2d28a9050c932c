"""The local checkpoint file: ``CHECKPOINT-V2`` in each store dir.

It says which checkpoint the store's local files are, so a restore can skip the download when they already are the
checkpoint to restore. Contract (DESIGN section 6):

- it is written only after the checkpoint is durable in the checkpoint log, so it never claims a checkpoint that
  is not durable remotely;
- it is written atomically (temp file in the same dir, fsync, ``os.replace``, fsync of the dir): a reader sees the
  old file, the new one, or none, never a part;
- it is removed (durably: the dir is fsynced) before anything changes the store's files outside a commit (a restore
  in progress), so a crash then leaves no claim about half-changed files.

The content is the checkpoint's JSON (:func:`checkpoint.serde.encode_checkpoint`, version 2).
"""

from __future__ import annotations

import os
import tempfile
from pathlib import Path

from checkpoint.checkpoint import CheckpointV2
from checkpoint.serde import decode_checkpoint, encode_checkpoint
from statebackend.errors import CorruptDataError, NotFoundError
from statebackend.fsutil import fsync_dir

__all__ = ["LOCAL_CHECKPOINT_FILE", "read_local_checkpoint", "remove_local_checkpoint", "write_local_checkpoint"]

LOCAL_CHECKPOINT_FILE = "CHECKPOINT-V2"


def write_local_checkpoint(store_dir: str | os.PathLike[str], checkpoint: CheckpointV2) -> None:
    """Atomically and durably write ``checkpoint`` as the store dir's local checkpoint file."""
    if not isinstance(checkpoint, CheckpointV2):
        raise TypeError(f"the local checkpoint file holds a CheckpointV2, got {type(checkpoint).__name__}")
    directory = Path(store_dir)
    data = encode_checkpoint(checkpoint)
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
        try:
            os.unlink(tmp)
        except OSError:
            pass
        raise
    fsync_dir(directory)


def read_local_checkpoint(store_dir: str | os.PathLike[str]) -> CheckpointV2 | None:
    """The store dir's local checkpoint, or None when it has none. A damaged file is :class:`CorruptDataError`."""
    path = Path(store_dir) / LOCAL_CHECKPOINT_FILE
    try:
        data = path.read_bytes()
    except FileNotFoundError:
        return None
    checkpoint = decode_checkpoint(data, source=str(path))
    if not isinstance(checkpoint, CheckpointV2):
        raise CorruptDataError(
            f"local checkpoint file {path} holds a version {checkpoint.version} checkpoint; it must hold version 2. "
            f"Delete it to make the next restore download the state"
        )
    return checkpoint


def remove_local_checkpoint(store_dir: str | os.PathLike[str]) -> None:
    """Durably remove the store dir's local checkpoint file; an absent file (or dir) is success."""
    directory = Path(store_dir)
    try:
        os.unlink(directory / LOCAL_CHECKPOINT_FILE)
    except FileNotFoundError:
        return
    fsync_dir(directory)
