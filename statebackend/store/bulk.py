"""Whole-contents operations: bulk loads in one write transaction, and swapping in a whole LMDB environment.

Contract:

- ``load_sorted`` (behind ``LocalStore.replace_contents``) loads strictly ascending records by append in the caller's
  transaction, LMDB checking the order itself; ``apply_sorted`` / ``apply_verified`` (behind ``apply_changes``) apply
  strictly ascending puts and deletes, checked per record unless the source already verified the order. Keys out of
  order, or of 0 or more than the key limit bytes, raise ``StateBackendError`` and the caller's transaction is
  aborted: a crash or an error midway leaves the previous contents (LMDB transactions are atomic).
- An environment swap moves a closed environment into the store dir as ``data.incoming/`` (renamed when on the same
  file system, else copied), then renames ``data/`` to ``data.old/`` and ``data.incoming/`` to ``data/``. Until then
  the old data stays in place; ``recover_swap``, run at every open, repairs a crash between the two renames (the old
  data comes back when the new never arrived) and deletes what a swap left.
"""

from __future__ import annotations

import errno
import logging
import os
import shutil
from collections.abc import Callable, Iterable
from itertools import compress, repeat
from operator import is_, is_not, itemgetter
from pathlib import Path
from typing import Any, cast

import lmdb

from statebackend.errors import InvalidKeyError, NotFoundError, StorageError
from statebackend.store.directory import DATA_DIR
from statebackend.store.env import open_env

log = logging.getLogger("statebackend.store")

_INCOMING = f"{DATA_DIR}.incoming"
_OLD = f"{DATA_DIR}.old"


def load_sorted(
    txn: lmdb.Transaction[bytes], data_db: Any, items: Iterable[tuple[bytes, bytes]], name: str, max_key: int
) -> int:
    """Drop all data and append ``items`` (strictly sorted by key); the number of records loaded."""
    txn.drop(data_db, delete=False)
    # LMDB checks the order itself: in append mode a key not after the previous one is refused (not added), so
    # the records go straight from the iterator into putmulti with no per-record Python check in between
    try:
        consumed, loaded = txn.cursor(db=data_db).putmulti(items, append=True)
    except lmdb.BadValsizeError as exc:
        raise InvalidKeyError(
            f"store {name!r}: replace_contents got a key of 0 or more than {max_key} bytes "
            f"(LMDB's limit); nothing was changed"
        ) from exc
    if loaded != consumed:
        raise InvalidKeyError(
            f"store {name!r}: replace_contents needs keys strictly ascending (record {loaded + 1} of "
            f"{consumed} was not after its predecessor); nothing was changed"
        )
    return int(loaded)


def apply_sorted(
    txn: lmdb.Transaction[bytes],
    data_db: Any,
    records: Iterable[tuple[bytes, bytes | None]],
    name: str,
    max_key: int,
    check_key: Callable[[Any], None],
) -> int:
    """Apply strictly sorted put / delete records, checking each; the number applied."""
    applied = 0
    cursor = txn.cursor(db=data_db)
    put, set_key, delete = cursor.put, cursor.set_key, cursor.delete
    previous = b""
    # the checks are inlined: this loop runs once per restored record
    for key, value in records:
        if type(key) is not bytes or not 0 < len(key) <= max_key:
            check_key(key)
        if key <= previous:
            raise InvalidKeyError(
                f"store {name!r}: apply_changes needs keys strictly ascending, got {key[:64]!r} "
                f"after {previous[:64]!r}; nothing was changed"
            )
        previous = key
        if value is None:
            if set_key(key):
                delete()
        elif type(value) is bytes:
            put(key, value)
        else:
            raise TypeError(f"store {name!r}: value must be bytes or None, got {type(value).__name__}")
        applied += 1
    return applied


def apply_verified(
    txn: lmdb.Transaction[bytes], data_db: Any, records: Iterable[tuple[bytes, bytes | None]], name: str, max_key: int
) -> int:
    """Apply records whose order the source verified, in bulk; the number applied."""
    # every key occurs once, so puts and deletes commute: bulk-put the puts, then delete the deletes. Splitting them
    # runs in C (map, compress): no Python frame per record, only per delete
    listed = records if isinstance(records, list) else list(records)
    values = list(map(itemgetter(1), listed))
    deletes = values.count(None)
    puts = listed if not deletes else list(compress(listed, map(is_not, values, repeat(None))))
    cursor = txn.cursor(db=data_db)
    try:
        cursor.putmulti(cast("list[tuple[bytes, bytes]]", puts))  # the None values were filtered out
    except lmdb.BadValsizeError as exc:
        raise InvalidKeyError(
            f"store {name!r}: apply_changes got a key of 0 or more than {max_key} bytes "
            f"(LMDB's limit); nothing was changed"
        ) from exc
    if deletes:
        for key, _ in compress(listed, map(is_, values, repeat(None))):
            if cursor.set_key(key):
                cursor.delete()
    return len(listed)


def check_environment(source: Path, name: str, map_size: int) -> None:
    """``source`` must hold a closed environment of a store (``data.mdb`` that opens with our two dbs)."""
    if not (source / "data.mdb").is_file():
        raise NotFoundError(f"store {name!r}: {source} holds no LMDB environment (no data.mdb)")
    # Validate before touching the live data: it must open and have our two dbs.
    env, _, _ = open_env(source, map_size, create=False)
    env.close()


def move_in(store_dir: Path, source: Path, name: str) -> Path:
    """Move ``source`` to ``data.incoming/`` in ``store_dir`` (copied across file systems); returns that."""
    incoming = store_dir / _INCOMING
    shutil.rmtree(incoming, ignore_errors=True)
    try:
        os.rename(source, incoming)
    except OSError as exc:
        if exc.errno != errno.EXDEV:
            raise StorageError(f"store {name!r}: cannot move {source} into {store_dir}: {exc}") from exc
        shutil.copytree(source, incoming)
    (incoming / "lock.mdb").unlink(missing_ok=True)  # the reader table of another environment; LMDB makes its own
    return incoming


def swap_dirs(store_dir: Path, incoming: Path) -> None:
    """Rename ``data/`` to ``data.old/`` and ``incoming`` to ``data/`` (the environment closed); on an error the old
    data is put back and the error raised."""
    current = store_dir / DATA_DIR
    old = store_dir / _OLD
    try:
        shutil.rmtree(old, ignore_errors=True)
        os.rename(current, old)
        os.rename(incoming, current)
    except BaseException:
        if not current.exists() and old.exists():
            os.rename(old, current)
        raise


def remove_old(store_dir: Path) -> None:
    """Delete the data a finished swap replaced."""
    shutil.rmtree(store_dir / _OLD, ignore_errors=True)


def recover_swap(store_dir: Path) -> None:
    """Repair an interrupted environment swap: bring back the old data if the new never arrived."""
    current = store_dir / DATA_DIR
    old = store_dir / _OLD
    if not current.exists() and old.exists():
        log.warning("store dir %s: restoring %s left by an interrupted environment swap", store_dir, old)
        os.rename(old, current)
    shutil.rmtree(old, ignore_errors=True)
    shutil.rmtree(store_dir / _INCOMING, ignore_errors=True)
