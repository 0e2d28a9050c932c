"""Small file-system helpers shared by the local store, the file:// blob store, checkpoints and restores."""

from __future__ import annotations

import os

__all__ = ["fsync_dir"]


def fsync_dir(directory: str | os.PathLike[str]) -> None:
    """Make a rename, link or unlink in ``directory`` durable: its entry is on disk only once the directory is."""
    if os.name == "nt":  # directories cannot be opened for fsync there; renames are durable by other means
        return
    fd = os.open(directory, os.O_RDONLY | getattr(os, "O_DIRECTORY", 0))
    try:
        os.fsync(fd)
    finally:
        os.close(fd)
