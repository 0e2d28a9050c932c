"""The store directory: its layout, the inter-process lock, and the guard against data a machine crash may have torn.

Contract:

- Layout of a store dir: ``data/`` the LMDB environment, ``LOCK``, ``UNSYNCED``, ``spill/`` spill runs (and, only
  during an environment swap, ``data.incoming/`` and ``data.old/``). Other files (e.g. ``CHECKPOINT-V2``) belong to
  others and are left alone.
- A store dir is held by one opener at a time: ``flock`` on ``LOCK`` (the holder's pid written in it). A second
  opener, in another process or in this one, gets ``StoreLockedError`` naming the holder's pid. A directory that
  cannot be created or locked is ``LocalDirError`` saying what to check.
- While a store is open, ``UNSYNCED`` holds the kernel's boot id (written and fsynced at open); a clean close syncs
  the environment and removes it (``clear_unsynced``). An open that finds it written under another boot id (the
  machine went down with the store open, so unsynced LMDB writes may be torn) deletes ``data/``: the store starts
  empty and restore rebuilds it from the blob store. Where no boot id is available, any leftover file counts as a
  machine crash (a full restore after every unclean stop: safe, slower).
"""

from __future__ import annotations

import fcntl
import logging
import os
import shutil
from pathlib import Path

from statebackend.errors import LocalDirError, StoreLockedError
from statebackend.fsutil import atomic_write, fsync_dir

log = logging.getLogger("statebackend.store")

DATA_DIR = "data"
LOCK_FILE = "LOCK"
UNSYNCED_FILE = "UNSYNCED"
_BOOT_ID = Path("/proc/sys/kernel/random/boot_id")


def lock_store_dir(store_dir: Path, name: str) -> int:
    """Create ``store_dir`` if needed and lock it; the lock's file descriptor (``release_lock`` gives it back)."""
    try:
        store_dir.mkdir(parents=True, exist_ok=True)
        return _acquire_lock(store_dir, name)
    except StoreLockedError:
        raise
    except OSError as exc:
        raise _local_dir_error(store_dir, name, exc) from exc


def release_lock(fd: int) -> None:
    try:
        os.ftruncate(fd, 0)
        fcntl.flock(fd, fcntl.LOCK_UN)
    finally:
        os.close(fd)


def guard_unsynced(store_dir: Path, name: str) -> None:
    """Drop the LMDB environment if the machine crashed while it was open; then mark it open under this boot."""
    marker = store_dir / UNSYNCED_FILE
    boot = _boot_id()
    try:
        recorded = marker.read_text().strip()
    except FileNotFoundError:
        recorded = None
    if recorded is not None and (not boot or recorded != boot):
        log.warning(
            "store %s at %s: the machine stopped while the store was open (unsynced LMDB writes may be "
            "torn); discarding local data, restore rebuilds it from the blob store",
            name,
            store_dir,
        )
        shutil.rmtree(store_dir / DATA_DIR, ignore_errors=True)
    with atomic_write(marker, temp_name=UNSYNCED_FILE + ".tmp", sync_directory=True) as out:
        out.write((boot + "\n").encode())


def clear_unsynced(store_dir: Path) -> None:
    try:
        (store_dir / UNSYNCED_FILE).unlink()
    except FileNotFoundError:
        return
    fsync_dir(store_dir)


def _boot_id() -> str:
    try:
        return _BOOT_ID.read_text().strip()
    except OSError:
        return ""


def _local_dir_error(store_dir: Path, name: str, exc: OSError) -> LocalDirError:
    reason = exc.strerror or type(exc).__name__
    return LocalDirError(
        exc.errno,
        f"store {name!r}: cannot create or lock its local directory {store_dir} ({reason}). state.local.dir must be "
        f"a directory this process can write (check its owner and permissions, that no part of the path is a file, "
        f"and that the disk is mounted read-write and not full), or set state.local.dir to one that is",
    )


def _acquire_lock(store_dir: Path, name: str) -> int:
    lock_path = store_dir / LOCK_FILE
    fd = os.open(lock_path, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o644)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        try:
            holder = os.pread(fd, 64, 0).decode("ascii", "replace").strip() or "unknown"
        finally:
            os.close(fd)
        raise StoreLockedError(
            f"store {name!r} at {store_dir} is locked by pid {holder}; close that store (or stop that process) first"
        ) from None
    except BaseException:
        os.close(fd)
        raise
    os.ftruncate(fd, 0)
    os.pwrite(fd, f"{os.getpid()}\n".encode(), 0)
    return fd
