"""Reading flushed data: the read view (a consistent snapshot in one LMDB read transaction) and key-range cursors.

Contract:

- A ``ReadView`` is a consistent snapshot of a store's FLUSHED data: it never sees the write batch, nor a flushed
  batch the applier has not written yet. It may be used from another thread than the one that made it (py-lmdb opens
  environments with MDB_NOTLS), one thread at a time. Close it soon: while it is open LMDB cannot reuse the pages it
  pins. Using it after ``close()`` raises ``StateBackendError``.
- ``copy_to`` writes a compacted copy of exactly that snapshot as an LMDB environment.
- ``lmdb_range`` yields a cursor's records with ``start <= key < end`` (``None`` = unbounded) in key order;
  ``prefix_end`` turns a prefix into the ``end`` of that range.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from os import PathLike
from pathlib import Path
from typing import Any, Self

import attrs
import lmdb

from statebackend.errors import ClosedError
from statebackend.store.env import LocalVersion


@attrs.define(eq=False)
class ReadView:
    """A consistent snapshot of a store's flushed data: one LMDB read transaction. Never sees the write batch.

    May be used from another thread than the one that made it, one thread at a time. Close it soon: while it is open
    LMDB cannot reuse the pages it pins.
    """

    #: the name of the store it is a snapshot of
    store_name: str
    _env: lmdb.Environment
    _txn: lmdb.Transaction[bytes]
    _data_db: Any
    #: the version the snapshot's data is at (``None``: a store no flush or restore has recorded a version in)
    version: LocalVersion | None
    #: the number of records in the snapshot
    count: int
    _closed: bool = attrs.field(default=False, init=False)

    def get(self, key: bytes) -> bytes | None:
        """The value of ``key`` in the snapshot (``None``: absent)."""
        return self._txn.get(key, db=self._data_db)

    def items(self) -> Iterator[tuple[bytes, bytes]]:
        """All records in key order."""
        return self.iter_range(None, None)

    def iter_range(self, start: bytes | None, end: bytes | None) -> Iterator[tuple[bytes, bytes]]:
        """Records with ``start <= key < end`` (``None`` = unbounded) in key order."""
        self._check_open()
        return lmdb_range(self._txn.cursor(db=self._data_db), start, end)

    def copy_to(self, target_dir: str | PathLike[str]) -> Path:
        """A compacted copy of exactly this snapshot as an LMDB environment in ``target_dir`` (created if absent)."""
        self._check_open()
        target = Path(target_dir)
        target.mkdir(parents=True, exist_ok=True)
        self._env.copy(str(target), compact=True, txn=self._txn)
        return target

    def close(self) -> None:
        """End the read transaction, so LMDB may reuse the pages it pinned; idempotent. Later reads raise
        :class:`~statebackend.errors.ClosedError`."""
        if not self._closed:
            self._closed = True
            with contextlib.suppress(lmdb.Error):  # the environment was closed first: that ended the transaction
                self._txn.abort()

    def __enter__(self) -> Self:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def _check_open(self) -> None:
        if self._closed:
            raise ClosedError(f"read view of store {self.store_name!r} is closed")


def lmdb_range(cursor: lmdb.Cursor[bytes], start: bytes | None, end: bytes | None) -> Iterator[tuple[bytes, bytes]]:
    found = cursor.set_range(start) if start else cursor.first()
    if not found:
        return
    if end is None:
        yield from cursor.iternext(keys=True, values=True)
        return
    for key, value in cursor.iternext(keys=True, values=True):
        if key >= end:
            return
        yield key, value


def prefix_end(prefix: bytes) -> bytes | None:
    """The smallest key greater than every key starting with ``prefix`` (None when there is none)."""
    stripped = prefix.rstrip(b"\xff")
    if not stripped:
        return None
    return stripped[:-1] + bytes([stripped[-1] + 1])
