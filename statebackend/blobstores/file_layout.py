"""The on-disk layout of the ``file://`` store (:mod:`statebackend.blobstores.file`, whose docstring draws it): the
names reserved for its own temp, lock and metadata files, a blob file's version from its ``stat`` (and why a coarse
stored time gives none), and the small file helpers its operations share.
"""

from __future__ import annotations

import contextlib
import errno
import os
from typing import BinaryIO

from statebackend.errors import ConfigError

__all__ = [
    "COARSE_TIME_NS",
    "COPY_BUFFER",
    "LOCK_PREFIX",
    "MAX_DIRECTORY_RACES",
    "META_DIR",
    "NOT_FOUND_ERRNOS",
    "RESERVED_PREFIX",
    "TEMP_PREFIX",
    "absolute_path",
    "blob_version",
    "clamp_range",
    "copy_all",
    "is_reserved",
    "put_if_version",
    "same_file",
    "unlink_quietly",
]

#: segment prefix reserved for the store's own temp and metadata files; never a blob name, never listed
RESERVED_PREFIX = ".statebackend~"
#: a write in progress (or left by a crash): ``<dir>/.statebackend~tmp.<random>``
TEMP_PREFIX = RESERVED_PREFIX + "tmp."
#: the lock file of ``put_if`` on a name: ``<dir>/.statebackend~lock.<file name>``
LOCK_PREFIX = RESERVED_PREFIX + "lock."
#: the directory of the metadata files under the root
META_DIR = RESERVED_PREFIX + "meta"
#: bytes per read of a streamed copy
COPY_BUFFER = 1024 * 1024
# a concurrent delete may prune the directory a put just created; the put then recreates it and tries again
MAX_DIRECTORY_RACES = 100
NOT_FOUND_ERRNOS = {errno.ENOENT, errno.ENOTDIR, errno.EISDIR}
#: a stored mtime that is a multiple of this was cut by the filesystem (``put`` never stamps one): no version
COARSE_TIME_NS = 1_000_000


def absolute_path(root: str | os.PathLike[str]) -> str:
    """``root`` as an absolute path (the store's root and a download's target)."""
    return os.path.abspath(os.fspath(root))


def unlink_quietly(path: str) -> None:
    """Remove ``path`` if it can be removed (a temp file left behind): a failure is not the caller's error."""
    with contextlib.suppress(OSError):
        os.unlink(path)


def copy_all(source: BinaryIO, target: BinaryIO) -> int:
    """Copy ``source`` to its end into ``target`` in chunks; return the byte count."""
    total = 0
    while chunk := source.read(COPY_BUFFER):
        target.write(chunk)
        total += len(chunk)
    return total


def clamp_range(size: int, start: int | None, end: int | None) -> tuple[int, int]:
    """``[first, last)`` of a ranged read clamped to a blob of ``size`` bytes; a negative bound is a
    :class:`ConfigError`."""
    if (start is not None and start < 0) or (end is not None and end < 0):
        raise ConfigError(f"byte range [{start}, {end}) must not be negative")
    first = 0 if start is None else min(start, size)
    last = size if end is None else min(end, size)
    return first, max(first, last)


def same_file(a: os.stat_result, b: os.stat_result) -> bool:
    """Whether two ``stat`` results are of the same version of one file (device, inode, size and mtime)."""
    return (a.st_dev, a.st_ino, a.st_size, a.st_mtime_ns) == (b.st_dev, b.st_ino, b.st_size, b.st_mtime_ns)


def blob_version(info: os.stat_result) -> str | None:
    """A blob file's version (its etag): a put makes a new file with a new inode and a fresh nanosecond mtime; a
    rename keeps all four. ``None`` when the stored mtime is a whole millisecond, which ``put`` never stamps: the
    filesystem keeps coarse times (or the blob was written otherwise), and with a reused inode the four could repeat
    an earlier version of the name."""
    if info.st_mtime_ns % COARSE_TIME_NS == 0:
        return None
    return f"{info.st_dev}:{info.st_ino}:{info.st_size}:{info.st_mtime_ns}"


def put_if_version(info: os.stat_result) -> str:
    """The version :meth:`~statebackend.blobstores.file.FileBlobStore.put_if` compares: :func:`blob_version`, or on
    a filesystem that keeps coarse times the same four fields as they are (the lock makes check and write one step)."""
    return blob_version(info) or f"{info.st_dev}:{info.st_ino}:{info.st_size}:{info.st_mtime_ns}"


def is_reserved(name: str) -> bool:
    """Whether a segment of ``name`` starts with :data:`RESERVED_PREFIX` (the store's own files)."""
    return any(segment.startswith(RESERVED_PREFIX) for segment in name.split("/"))
