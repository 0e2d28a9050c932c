"""Small file-system helpers shared by the local store, the file:// blob store, checkpoints, backups and restores."""

from __future__ import annotations

import contextlib
import os
import secrets
from collections.abc import Iterator
from typing import BinaryIO

__all__ = ["atomic_write", "fsync_dir"]


def fsync_dir(directory: str | os.PathLike[str]) -> None:
    """Make a rename, link or unlink in ``directory`` durable: its entry is on disk only once the directory is."""
    if os.name == "nt":  # directories cannot be opened for fsync there; renames are durable by other means
        return
    fd = os.open(directory, os.O_RDONLY | getattr(os, "O_DIRECTORY", 0))
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


@contextlib.contextmanager
def atomic_write(
    path: str | os.PathLike[str],
    *,
    prefix: str = ".tmp-",
    temp_name: str | None = None,
    mode: int = 0o666,
    fsync: bool = True,
    sync_directory: bool = False,
) -> Iterator[BinaryIO]:
    """Write ``path`` whole or not at all: the block writes into a temp file next to it (``prefix`` plus a random
    part, or exactly ``temp_name``), which is flushed, fsynced (unless ``fsync=False``) and renamed over ``path`` when
    the block ends; with ``sync_directory`` the rename is made durable too. On any failure the temp file is removed
    and ``path`` is left as it was. ``mode`` is masked by the umask."""
    target = os.fspath(path)
    directory = os.path.dirname(target) or "."
    temp = os.path.join(directory, temp_name or f"{prefix}{secrets.token_hex(8)}")
    flags = os.O_WRONLY | os.O_CREAT | getattr(os, "O_CLOEXEC", 0) | getattr(os, "O_BINARY", 0)
    flags |= os.O_TRUNC if temp_name else os.O_EXCL
    fd = os.open(temp, flags, mode)
    try:
        with os.fdopen(fd, "wb") as out:
            yield out
            out.flush()
            if fsync:
                os.fsync(out.fileno())
        os.replace(temp, target)
    except BaseException:
        with contextlib.suppress(OSError):
            os.unlink(temp)
        raise
    if sync_directory:
        fsync_dir(directory)
