"""The local store: one LMDB environment per (task, store), with a write batch and a sorted change set per flush.

Contract (DESIGN.md section 5):

- Keys and values are ``bytes``. Keys are non-empty and at most ``max_key_size`` (511) bytes; a wrong type raises
  ``TypeError``, a bad key ``StateBackendError`` naming the limit, both before the write reaches the batch.
- Writes go to an in-memory write batch (last write per key wins; deletes are tombstones) that every read sees:
  ``get``/``contains`` look in the batch first, iterations merge the batch and LMDB in key order and tombstones hide
  keys. An iteration works on a snapshot (an LMDB read transaction plus a sorted copy of the batch in its range), so
  writing while iterating is safe and not seen by that iteration.
- ``flush(version)`` freezes the batch and returns the ``ChangeSet``: every key written since the previous flush,
  sorted, one record per key. It costs the sort of the change and nothing that grows with the state: the frozen
  batch is applied to LMDB (in ONE write transaction that also records ``version`` in the meta db) by a background
  applier thread, while reads keep seeing it as an overlay between the new batch and LMDB. Whatever must see LMDB at
  a version waits for that apply: ``version``, ``read_view()``, spills, restores, ``close()``; a backend that wants
  a snapshot of exactly the flushed version without waiting on the task thread asks the change set
  (``ChangeSet.read_view()``: a future read view, opened right after the apply commits).
- Bounded memory: when the batch holds more than ``max_batch_bytes`` it spills: it is written, sorted, as a spill run
  under ``path/"spill"``, applied to LMDB in one transaction that also clears the meta version (the data is now ahead
  of every checkpoint: "dirty", ``version is None``), and cleared. The next flush's change set is the k-way merge of
  the runs and the final batch (later runs win), so neither the store nor the change set holds more than one batch
  in memory. The batch exceeds the bound by at most the one record that crossed it.
- ``count()`` is LMDB's entry count (O(1), kept by LMDB itself). With a non-empty batch it is adjusted by looking up
  each batch key in LMDB (a put of an absent key adds one, a delete of a present key removes one): O(batch), no cost
  per write.
- ``read_view()`` is a consistent snapshot of the FLUSHED data (an LMDB read transaction): it never sees the batch,
  and it may be used from another thread (py-lmdb opens environments with MDB_NOTLS) while the task keeps writing and
  flushing. One thread at a time per view.
- ``replace_contents`` / ``apply_changes`` load sorted data in one write transaction each: a crash or an error midway
  leaves the previous contents (LMDB transactions are atomic).
- A store dir is held by one opener at a time: ``flock`` on ``path/"LOCK"`` (the holder's pid written in it). A second
  opener, in another process or in this one, gets ``StoreLockedError``.
- Durability: none is needed locally (the blob store holds the durable state), so write transactions do not
  fsync: a flush costs page writes into the OS cache, not a disk round trip per commit. A killed *process* loses
  nothing that LMDB committed (the OS cache survives it), so its data stays consistent. A *machine* crash could tear
  an unsynced LMDB file, so that case is detected instead: while the store is open, ``path/"UNSYNCED"`` holds the
  kernel's boot id; a clean ``close()`` syncs the environment and removes it. An open that finds the file written
  under another boot id (the machine went down with the store open) deletes the LMDB environment and starts empty,
  and restore rebuilds it from the blob store. Where no boot id is available, any leftover file counts as a machine
  crash (a full restore after every unclean stop: safe, slower).

Layout of the store dir ``path``: ``data/`` the LMDB environment (named dbs ``data`` and ``meta``), ``LOCK``,
``spill/`` spill runs. Other files (e.g. ``CHECKPOINT-V2``) belong to others and are left alone.

A ``LocalStore`` is used by one thread (the task's); only ``read_view()`` objects and ``copy_environment`` are meant
for other threads.
"""

from __future__ import annotations

import contextlib
import errno
import fcntl
import heapq
import json
import logging
import os
import secrets
import shutil
import struct
import threading
import weakref
from collections.abc import Callable, Iterable, Iterator
from concurrent.futures import Future, ThreadPoolExecutor
from os import PathLike
from pathlib import Path
from types import TracebackType
from typing import Any, BinaryIO, Self, cast

import attrs
import lmdb

from statebackend.errors import (
    ConfigError,
    CorruptDataError,
    LocalDirError,
    StateBackendError,
    StorageError,
    StoreLockedError,
)
from statebackend.fsutil import fsync_dir
from statebackend.serdes import Serde

__all__ = ["MAX_KEY_SIZE", "TOMBSTONE", "ChangeSet", "LocalStore", "LocalVersion", "ReadView", "TypedStore"]

log = logging.getLogger(__name__)

MAX_KEY_SIZE = 511  # LMDB's compiled-in limit; checked against env.max_key_size() at open

DATA_DIR = "data"
LOCK_FILE = "LOCK"
SPILL_DIR = "spill"
_DATA_DB = b"data"
_META_DB = b"meta"
_VERSION_KEY = b"version"


class _Tombstone:
    """Marks a deleted key in the write batch."""

    __slots__ = ()

    def __repr__(self) -> str:
        return "TOMBSTONE"


TOMBSTONE: Any = _Tombstone()


@attrs.frozen
class LocalVersion:
    """Identifies the state a store's data is at: the commit whose flush produced it, and that flush's lineage token."""

    checkpoint_id: str
    token: str

    @classmethod
    def new(cls, checkpoint_id: object) -> LocalVersion:
        """A version for ``checkpoint_id`` with a fresh random token."""
        return cls(str(checkpoint_id), secrets.token_hex(8))

    def to_bytes(self) -> bytes:
        return json.dumps({"checkpoint_id": self.checkpoint_id, "token": self.token}, sort_keys=True).encode()

    @classmethod
    def from_bytes(cls, data: bytes) -> LocalVersion:
        try:
            obj = json.loads(bytes(data))
            return cls(str(obj["checkpoint_id"]), str(obj["token"]))
        except (ValueError, KeyError, TypeError) as exc:
            raise CorruptDataError(f"local store meta 'version' is unreadable: {bytes(data)[:100]!r}") from exc


# ---------------------------------------------------------------------------------------------------------------------
# Change sets


class ChangeSet:
    """The sorted change records of one flush: ``(key, value)`` for a put, ``(key, None)`` for a delete.

    Iterable many times, in key order, one record per key (the last write wins). Backed by the flush's spill runs
    (files, read lazily) and the final batch (in memory). ``close()`` deletes the spill runs; it is idempotent and also
    happens when the change set is garbage collected. Iterating after close raises ``StateBackendError``.
    """

    __slots__ = (
        "__weakref__",
        "_closed",
        "_final",
        "_finalizer",
        "_length",
        "_runs",
        "_view_source",
        "raw_bytes",
        "version",
    )

    version: LocalVersion
    raw_bytes: int

    def __init__(
        self,
        version: LocalVersion,
        runs: list[Path],
        final: list[tuple[bytes, bytes | None]],
        view_source: Callable[[], Future[ReadView]] | None = None,
    ) -> None:
        self.version = version
        self._view_source = view_source
        self._runs = tuple(runs)
        self._final = final
        self._closed = False
        self._finalizer = weakref.finalize(self, _unlink_all, self._runs)
        # One pass at flush time: O(change), and the exact numbers after dedupe.
        length = 0
        raw = 0
        for key, value in self._merged():
            length += 1
            raw += len(key) + (len(value) if value is not None else 0)
        self._length = length
        self.raw_bytes = raw

    def __iter__(self) -> Iterator[tuple[bytes, bytes | None]]:
        if self._closed:
            raise StateBackendError(f"change set of {self.version} is closed; take the records before closing it")
        return self._merged()

    def __len__(self) -> int:
        return self._length

    def __repr__(self) -> str:
        return f"ChangeSet(version={self.version!r}, records={self._length}, raw_bytes={self.raw_bytes})"

    def read_view(self) -> Future[ReadView]:
        """A future read view of the store at exactly this change set's version, opened right after the flush's
        background apply commits (or now, when it already has). Ask during the sync part of the commit that flushed
        it, before the task writes again; the caller closes the view."""
        if self._view_source is None:
            raise StateBackendError(f"change set of {self.version} has no store to open a read view on")
        return self._view_source()

    @property
    def spill_runs(self) -> int:
        """How many spill runs back this change set (0 when the batch never spilled)."""
        return len(self._runs)

    def close(self) -> None:
        self._closed = True
        self._final = []
        self._finalizer()

    def __enter__(self) -> Self:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def _merged(self) -> Iterator[tuple[bytes, bytes | None]]:
        if not self._runs:
            yield from self._final
            return
        # Rank -i sorts later runs first among equal keys; the first record of each key is the one that wins.
        streams = [_ranked(_read_run(path), -i) for i, path in enumerate(self._runs)]
        streams.append(_ranked(iter(self._final), -len(self._runs)))
        previous: bytes | None = None
        for key, _rank, value in heapq.merge(*streams):
            if key == previous:
                continue
            previous = key
            yield key, value


def _ranked(
    records: Iterator[tuple[bytes, bytes | None]], rank: int
) -> Iterator[tuple[bytes, int, bytes | None]]:
    for key, value in records:
        yield key, rank, value


def _unlink_all(paths: Iterable[Path]) -> None:
    for path in paths:
        try:
            path.unlink()
        except FileNotFoundError:
            pass


# Spill run file: magic, then records "key length u32, value length u32 (0xFFFFFFFF = delete), key, value".
# Private and short-lived (read back by the next flush's change set only), so no checksum and no fsync.
_RUN_MAGIC = b"SBSPILL1"
_RUN_HEADER = struct.Struct(">II")
_RUN_DELETE = 0xFFFFFFFF


def _write_run(path: Path, records: Iterable[tuple[bytes, bytes | None]]) -> None:
    pack = _RUN_HEADER.pack
    with open(path, "wb", buffering=1 << 20) as f:
        f.write(_RUN_MAGIC)
        for key, value in records:
            if value is None:
                f.write(pack(len(key), _RUN_DELETE))
                f.write(key)
            else:
                f.write(pack(len(key), len(value)))
                f.write(key)
                f.write(value)


def _read_run(path: Path) -> Iterator[tuple[bytes, bytes | None]]:
    try:
        f: BinaryIO = open(path, "rb", buffering=1 << 20)  # noqa: SIM115 - entered below; only open() is translated
    except FileNotFoundError as exc:
        raise StateBackendError(f"spill run {path} is gone; its change set was closed or the store reopened") from exc
    with f:
        if f.read(len(_RUN_MAGIC)) != _RUN_MAGIC:
            raise CorruptDataError(f"spill run {path} has a bad magic number")
        unpack = _RUN_HEADER.unpack
        size = _RUN_HEADER.size
        while True:
            header = f.read(size)
            if not header:
                return
            if len(header) != size:
                raise CorruptDataError(f"spill run {path} is cut short")
            key_len, value_len = unpack(header)
            key = f.read(key_len)
            if value_len == _RUN_DELETE:
                yield key, None
            else:
                yield key, f.read(value_len)


# ---------------------------------------------------------------------------------------------------------------------
# Read views


@attrs.define
class ReadView:
    """A consistent snapshot of a store's flushed data: one LMDB read transaction. Never sees the write batch.

    May be used from another thread than the one that made it, one thread at a time. Close it soon: while it is open
    LMDB cannot reuse the pages it pins.
    """

    store_name: str
    _env: lmdb.Environment
    _txn: lmdb.Transaction[bytes]
    _data_db: Any
    version: LocalVersion | None
    count: int
    _closed: bool = attrs.field(default=False, init=False)

    def get(self, key: bytes) -> bytes | None:
        return self._txn.get(key, db=self._data_db)

    def items(self) -> Iterator[tuple[bytes, bytes]]:
        """All records in key order."""
        return self.iter_range(None, None)

    def iter_range(self, start: bytes | None, end: bytes | None) -> Iterator[tuple[bytes, bytes]]:
        """Records with ``start <= key < end`` (``None`` = unbounded) in key order."""
        self._check_open()
        return _lmdb_range(self._txn.cursor(db=self._data_db), start, end)

    def copy_to(self, target_dir: str | PathLike[str]) -> Path:
        """A compacted copy of exactly this snapshot as an LMDB environment in ``target_dir`` (created if absent)."""
        self._check_open()
        target = Path(target_dir)
        target.mkdir(parents=True, exist_ok=True)
        self._env.copy(str(target), compact=True, txn=self._txn)
        return target

    def close(self) -> None:
        if not self._closed:
            self._closed = True
            try:
                self._txn.abort()
            except lmdb.Error:
                pass  # the environment was closed first, which already ended the transaction

    def __enter__(self) -> Self:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def _check_open(self) -> None:
        if self._closed:
            raise StateBackendError(f"read view of store {self.store_name!r} is closed")


def _lmdb_range(cursor: lmdb.Cursor[bytes], start: bytes | None, end: bytes | None) -> Iterator[tuple[bytes, bytes]]:
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


# ---------------------------------------------------------------------------------------------------------------------
# The store


@attrs.define(eq=False)
class _Pending:
    """A flushed batch on its way into LMDB.

    Readers take the store's ``_pending`` tuple before they read LMDB; the applier removes an entry only after its
    transaction committed. So a reader sees the batch either in the overlay or in LMDB (or both, equal), never in
    neither.
    """

    version: LocalVersion
    records: list[tuple[bytes, bytes | None]]
    index: dict[bytes, Any]
    applied: bool = False
    view_requests: list[Future[ReadView]] = attrs.field(factory=list)


_applier_lock = threading.Lock()
_applier_pool: list[ThreadPoolExecutor] = []


def _applier() -> ThreadPoolExecutor:
    """The process-wide threads that apply flushed batches to LMDB (one store's applies are serialized by its lock)."""
    with _applier_lock:
        if not _applier_pool:
            _applier_pool.append(ThreadPoolExecutor(max_workers=2, thread_name_prefix="statebackend-apply"))
        return _applier_pool[0]


@attrs.define
class LocalStore:
    """One named key-value store of a task: LMDB on local disk plus a write batch. See the module docstring."""

    path: Path
    name: str
    max_batch_bytes: int
    map_size: int
    _env: lmdb.Environment = attrs.field(alias="env")
    _data_db: Any = attrs.field(alias="data_db")
    _meta_db: Any = attrs.field(alias="meta_db")
    _lock_fd: int = attrs.field(alias="lock_fd")
    _batch: dict[bytes, Any] = attrs.field(factory=dict, init=False)
    _batch_bytes: int = attrs.field(default=0, init=False)
    _runs: list[Path] = attrs.field(factory=list, init=False)
    _run_prefix: str = attrs.field(factory=lambda: secrets.token_hex(6), init=False)
    _max_key_size: int = attrs.field(default=MAX_KEY_SIZE, init=False)
    _closed: bool = attrs.field(default=False, init=False)
    #: flushed batches not yet in LMDB, oldest first; replaced (never mutated) so readers can take it unlocked
    _pending: tuple[_Pending, ...] = attrs.field(default=(), init=False)
    #: serializes applies of pending batches with every other LMDB write of this store
    _apply_lock: threading.RLock = attrs.field(factory=threading.RLock, init=False)
    #: guards _pending, each pending's applied flag and view requests, and _apply_error; never held across LMDB I/O
    _state_lock: threading.Lock = attrs.field(factory=threading.Lock, init=False)
    _apply_error: BaseException | None = attrs.field(default=None, init=False)

    # -- lifecycle ------------------------------------------------------------------------------------------------

    @classmethod
    def open(
        cls,
        path: str | PathLike[str],
        *,
        name: str,
        max_batch_bytes: int = 64 << 20,
        map_size: int = 1 << 40,
    ) -> LocalStore:
        """Open (creating if needed) the store in directory ``path``; ``StoreLockedError`` if someone holds it."""
        if max_batch_bytes <= 0:
            raise ConfigError(f"store {name!r}: max_batch_bytes must be positive, got {max_batch_bytes}")
        store_dir = Path(path)
        try:
            store_dir.mkdir(parents=True, exist_ok=True)
            lock_fd = _acquire_lock(store_dir, name)
        except StoreLockedError:
            raise
        except OSError as exc:
            raise _local_dir_error(store_dir, name, exc) from exc
        try:
            _recover_swap(store_dir)
            _guard_unsynced(store_dir, name)
            spill = store_dir / SPILL_DIR
            # Spill runs only matter until the flush that reads them; any left here are from a process that died
            # (the lock proves no one else uses them).
            shutil.rmtree(spill, ignore_errors=True)
            spill.mkdir()
            env, data_db, meta_db = _open_env(store_dir / DATA_DIR, map_size)
        except BaseException:
            _release_lock(lock_fd)
            raise
        store = cls(
            path=store_dir,
            name=name,
            max_batch_bytes=max_batch_bytes,
            map_size=map_size,
            env=env,
            data_db=data_db,
            meta_db=meta_db,
            lock_fd=lock_fd,
        )
        store._max_key_size = env.max_key_size()
        return store

    def close(self) -> None:
        """Close the environment and release the lock. Unflushed writes are dropped (they belong to no commit)."""
        if self._closed:
            return
        try:
            self.apply_pending()
        except BaseException as exc:  # noqa: BLE001 - the data stays at the previous version; restore sees that
            log.warning("store %s: closing with a flushed batch that could not be applied: %s", self.name, exc)
        with self._apply_lock, self._state_lock:
            self._closed = True
            self._fail_view_requests(StateBackendError(f"store {self.name!r} was closed"))
        self._discard_pending()
        try:
            self._env.sync(True)
            self._env.close()
            _clear_unsynced(self.path)
        finally:
            _release_lock(self._lock_fd)

    def __enter__(self) -> Self:
        return self

    def __exit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        self.close()

    @property
    def closed(self) -> bool:
        return self._closed

    # -- reads ----------------------------------------------------------------------------------------------------

    def get(self, key: bytes) -> bytes | None:
        """The value of ``key`` (the batch first, then LMDB), or ``None``."""
        self._check_open()
        self._check_key(key)
        value = self._batch.get(key)
        if value is None:
            for pending in reversed(self._pending):  # taken before LMDB is read: see _Pending
                value = pending.index.get(key)
                if value is not None:
                    break
        if value is not None:
            return None if value is TOMBSTONE else value
        with self._env.begin(db=self._data_db) as txn:
            return txn.get(key)

    def contains(self, key: bytes) -> bool:
        return self.get(key) is not None

    def iter_prefix(self, prefix: bytes) -> Iterator[tuple[bytes, bytes]]:
        """Records whose key starts with ``prefix``, in key order, batch included."""
        if not isinstance(prefix, bytes):
            raise TypeError(f"store {self.name!r}: prefix must be bytes, got {type(prefix).__name__}")
        return self.iter_range(prefix or None, _prefix_end(prefix))

    def iter_range(self, start: bytes | None, end: bytes | None) -> Iterator[tuple[bytes, bytes]]:
        """Records with ``start <= key < end`` (``None`` = unbounded), in key order, batch included."""
        for bound in (start, end):
            if bound is not None and not isinstance(bound, bytes):
                raise TypeError(f"store {self.name!r}: range bounds must be bytes or None, got {type(bound).__name__}")
        self._check_open()
        # Snapshot now, not at first next(): later writes must not leak into (or break) this iteration.
        batch = self._overlay(start, end)  # before the read transaction: see _Pending
        txn = self._env.begin(db=self._data_db)
        return _merge_batch(_lmdb_range(txn.cursor(), start, end), batch, txn)

    def items(self) -> Iterator[tuple[bytes, bytes]]:
        return self.iter_range(None, None)

    def count(self) -> int:
        """Number of keys. O(1) from LMDB's stats; plus an O(batch) adjustment when the batch is not empty."""
        self._check_open()
        overlay = self._overlay(None, None, as_dict=True)
        with self._env.begin(db=self._data_db) as txn:
            entries: int = txn.stat(self._data_db)["entries"]
            for key, value in overlay.items():
                present = txn.get(key) is not None
                if value is TOMBSTONE:
                    entries -= present
                elif not present:
                    entries += 1
        return entries

    @property
    def version(self) -> LocalVersion | None:
        """The version of the flushed data: ``None`` when fresh or dirty (after a spill or mark_dirty). Waits for a
        flushed batch still being applied."""
        self._check_open()
        self.apply_pending()
        with self._env.begin(db=self._meta_db) as txn:
            raw = txn.get(_VERSION_KEY)
        return None if raw is None else LocalVersion.from_bytes(raw)

    @property
    def pending_bytes(self) -> int:
        """Bytes (keys plus values) in the in-memory write batch."""
        return self._batch_bytes

    @property
    def pending_runs(self) -> int:
        """Spill runs written since the last flush (their data is already in LMDB)."""
        return len(self._runs)

    def read_view(self) -> ReadView:
        """A consistent snapshot of the flushed data; see ``ReadView``. Waits for a flushed batch still being
        applied (``ChangeSet.read_view()`` does not block)."""
        self.apply_pending()
        return self._open_view()

    def _open_view(self) -> ReadView:
        self._check_open()
        txn = self._env.begin()
        try:
            raw = txn.get(_VERSION_KEY, db=self._meta_db)
            count = txn.stat(self._data_db)["entries"]
        except BaseException:
            txn.abort()
            raise
        return ReadView(
            store_name=self.name,
            env=self._env,
            txn=txn,
            data_db=self._data_db,
            version=None if raw is None else LocalVersion.from_bytes(raw),
            count=count,
        )

    # -- writes ---------------------------------------------------------------------------------------------------

    def put(self, key: bytes, value: bytes) -> None:
        self._check_key(key)
        if not isinstance(value, bytes):
            raise TypeError(f"store {self.name!r}: value must be bytes, got {type(value).__name__}")
        self._write(key, value)

    def delete(self, key: bytes) -> None:
        self._check_key(key)
        self._write(key, TOMBSTONE)

    def put_all(self, items: Iterable[tuple[bytes, bytes]]) -> None:
        """Put each item in order. Not atomic: a bad item raises after the items before it reached the batch."""
        for key, value in items:
            self.put(key, value)

    def delete_all(self, keys: Iterable[bytes]) -> None:
        for key in keys:
            self.delete(key)

    def flush(self, version: LocalVersion) -> ChangeSet:
        """Freeze the batch as the change set since the previous flush (spill runs included) and hand it to the
        background applier, which writes it to LMDB with ``version``. Never waits for an apply. The caller owns the
        change set and closes it."""
        if not isinstance(version, LocalVersion):
            raise TypeError(f"store {self.name!r}: flush needs a LocalVersion, got {type(version).__name__}")
        self._check_open()
        self._raise_apply_error()
        final = self._sorted_records()
        pending = _Pending(version=version, records=final, index=self._batch)
        with self._state_lock:
            self._pending = (*self._pending, pending)
        runs = self._runs
        self._runs = []
        self._run_prefix = secrets.token_hex(6)
        self._batch = {}
        self._batch_bytes = 0
        _applier().submit(self._apply_in_background)
        return ChangeSet(version, runs, final, view_source=lambda: self._view_at(pending))

    def apply_pending(self) -> None:
        """Apply every flushed batch not yet in LMDB, in order (normally done by the background applier; calling it
        waits for that). Raises the error of an apply that failed.

        Two locks: ``_apply_lock`` is held while LMDB is written and while the views asked of a just-applied version
        are opened (so nothing writes in between); ``_state_lock`` guards only the bookkeeping (the pending tuple,
        view requests, the error), so ``flush`` and ``ChangeSet.read_view`` never wait for an apply."""
        with self._apply_lock:
            while True:
                with self._state_lock:
                    self._raise_apply_error()
                    if self._closed or not self._pending:
                        return
                    pending = self._pending[0]
                try:
                    with self._write_txn("flush") as txn:
                        _apply_records(txn, self._data_db, pending.records)
                        txn.put(_VERSION_KEY, pending.version.to_bytes(), db=self._meta_db)
                except BaseException as exc:
                    with self._state_lock:
                        self._apply_error = exc
                        self._fail_view_requests(exc)  # every waiting batch: none of them can be applied now
                    raise
                with self._state_lock:  # bookkeeping first: a view failing to open below cannot re-apply the batch
                    pending.applied = True
                    self._pending = self._pending[1:]
                    requests, pending.view_requests = pending.view_requests, []
                for request in requests:  # still under _apply_lock: nothing has written since, exactly this version
                    try:
                        request.set_result(self._open_view())
                    except BaseException as exc:  # noqa: BLE001 - handed to the waiter, not lost
                        request.set_exception(exc)

    def _fail_view_requests(self, exc: BaseException) -> None:
        """Fail every waiting view request (call with ``_state_lock`` held)."""
        for pending in self._pending:
            requests, pending.view_requests = pending.view_requests, []
            for request in requests:
                if not request.done():
                    request.set_exception(exc)

    def _apply_in_background(self) -> None:
        try:
            self.apply_pending()
        except BaseException as exc:  # noqa: BLE001 - kept in _apply_error, raised by the store's next operation
            log.error("store %s: applying a flushed batch to LMDB failed: %s", self.name, exc)

    def _view_at(self, pending: _Pending) -> Future[ReadView]:
        future: Future[ReadView] = Future()
        future.set_running_or_notify_cancel()  # cannot be cancelled: the applier always resolves it
        with self._state_lock:
            if self._closed or self._apply_error is not None or (
                not pending.applied and pending not in self._pending
            ):
                future.set_exception(StateBackendError(
                    f"store {self.name!r}: no read view of {pending.version}: the store is closed, was replaced, or "
                    f"its flushed batch could not be applied"))
                return future
            if not pending.applied:
                pending.view_requests.append(future)
                return future
        # Already applied. Asked during the sync part of its commit, as documented, nothing can have written since;
        # the version check below catches a caller that asked too late.
        view = self._open_view()
        if view.version != pending.version:
            view.close()
            future.set_exception(StateBackendError(
                f"store {self.name!r}: a read view of {pending.version} was asked after the store moved on"))
        else:
            future.set_result(view)
        return future

    def _raise_apply_error(self) -> None:
        error = self._apply_error
        if error is not None:
            raise StorageError(
                f"store {self.name!r} at {self.path}: a flushed batch could not be applied to LMDB ({error}); reopen "
                f"the store (restore rebuilds it)"
            ) from error

    def replace_contents(self, items: Iterable[tuple[bytes, bytes]], version: LocalVersion | None) -> int:
        """Bulk restore: in ONE write transaction drop all data, load ``items`` (strictly sorted by key) by append
        and set ``version``. An error midway (unsorted input included) leaves the old contents. Discards the batch
        and spill runs. Returns the number of records loaded."""
        self._check_open()
        self._settle_pending()
        self._discard_pending()
        # LMDB checks the order itself: in append mode a key not after the previous one is refused (not added), so
        # the records go straight from the iterator into putmulti with no per-record Python check in between
        with self._write_txn("replace_contents") as txn:
            txn.drop(self._data_db, delete=False)
            try:
                consumed, loaded = txn.cursor(db=self._data_db).putmulti(items, append=True)
            except lmdb.BadValsizeError as exc:
                raise StateBackendError(
                    f"store {self.name!r}: replace_contents got a key of 0 or more than {self._max_key_size} bytes "
                    f"(LMDB's limit); nothing was changed"
                ) from exc
            if loaded != consumed:
                raise StateBackendError(
                    f"store {self.name!r}: replace_contents needs keys strictly ascending (record {loaded + 1} of "
                    f"{consumed} was not after its predecessor); nothing was changed"
                )
            _set_version(txn, self._meta_db, version)
        return loaded

    def apply_changes(
        self, records: Iterable[tuple[bytes, bytes | None]], version: LocalVersion, *, verified_order: bool = False
    ) -> int:
        """Catch-up: apply strictly sorted put (value) / delete (``None``) records and set ``version`` in ONE write
        transaction. Needs an empty batch and no spill runs. Returns the number of records applied.

        ``verified_order``: the source already guarantees strictly increasing ``bytes`` keys (a verified changelog
        file); the records then go to LMDB in bulk (``putmulti``, in C) with no Python check per record."""
        self._check_open()
        if self._batch or self._runs:
            raise StateBackendError(
                f"store {self.name!r}: apply_changes needs no unflushed writes; flush or discard them first"
            )
        self.apply_pending()
        if verified_order:
            return self._apply_verified(records, version)
        applied = 0
        max_key = self._max_key_size
        with self._write_txn("apply_changes") as txn:
            cursor = txn.cursor(db=self._data_db)
            put, set_key, delete = cursor.put, cursor.set_key, cursor.delete
            previous = b""
            # the checks are inlined: this loop runs once per restored record
            for key, value in records:
                if type(key) is not bytes or not 0 < len(key) <= max_key:
                    self._check_key(key)
                if key <= previous:
                    raise StateBackendError(
                        f"store {self.name!r}: apply_changes needs keys strictly ascending, got {key[:64]!r} "
                        f"after {previous[:64]!r}; nothing was changed"
                    )
                previous = key
                if value is None:
                    if set_key(key):
                        delete()
                elif type(value) is bytes:
                    put(key, value)
                else:
                    raise TypeError(f"store {self.name!r}: value must be bytes or None, got {type(value).__name__}")
                applied += 1
            _set_version(txn, self._meta_db, version)
        return applied

    def _apply_verified(self, records: Iterable[tuple[bytes, bytes | None]], version: LocalVersion) -> int:
        # every key occurs once, so puts and deletes commute: bulk-put the puts, then delete the deletes
        listed = list(records)
        puts = [record for record in listed if record[1] is not None]
        with self._write_txn("apply_changes") as txn:
            cursor = txn.cursor(db=self._data_db)
            try:
                cursor.putmulti(cast("list[tuple[bytes, bytes]]", puts))  # the None values were filtered out
            except lmdb.BadValsizeError as exc:
                raise StateBackendError(
                    f"store {self.name!r}: apply_changes got a key of 0 or more than {self._max_key_size} bytes "
                    f"(LMDB's limit); nothing was changed"
                ) from exc
            if len(puts) != len(listed):
                for key, value in listed:
                    if value is None and cursor.set_key(key):
                        cursor.delete()
            _set_version(txn, self._meta_db, version)
        return len(listed)

    def mark_dirty(self) -> None:
        """Clear the meta version: the data no longer equals a known checkpoint."""
        self._check_open()
        try:
            self.apply_pending()
        except StateBackendError:
            pass  # the version is cleared below all the same
        with self._write_txn("mark_dirty") as txn:
            txn.delete(_VERSION_KEY, db=self._meta_db)

    def discard_pending(self) -> None:
        """Drop the write batch. Spill runs already reached LMDB; they are dropped too and the store is marked dirty."""
        self._check_open()
        had_runs = bool(self._runs)
        self._discard_pending()
        if had_runs:
            self.mark_dirty()

    # -- whole environments (blob-snapshot backend) ---------------------------------------------------------------

    def copy_environment(self, target_dir: str | PathLike[str]) -> LocalVersion | None:
        """A consistent, compacted copy of the flushed environment into ``target_dir`` (created if absent; must not
        hold an environment already). Returns the version the copy holds."""
        with self.read_view() as view:
            view.copy_to(target_dir)
            return view.version

    def replace_environment(self, source_dir: str | PathLike[str]) -> None:
        """Swap in the LMDB environment in ``source_dir`` (closed; ``data.mdb`` inside), discarding the batch.

        ``source_dir`` is moved (renamed when on the same file system). Until the swap the old data stays in place;
        a crash between the two renames is repaired by the next ``open``."""
        self._check_open()
        self._settle_pending()
        source = Path(source_dir)
        if not (source / "data.mdb").is_file():
            raise StateBackendError(f"store {self.name!r}: {source} holds no LMDB environment (no data.mdb)")
        # Validate before touching the live data: it must open and have our two dbs.
        env, _, _ = _open_env(source, self.map_size, create=False)
        env.close()
        self._discard_pending()
        incoming = self.path / f"{DATA_DIR}.incoming"
        shutil.rmtree(incoming, ignore_errors=True)
        try:
            os.rename(source, incoming)
        except OSError as exc:
            if exc.errno != errno.EXDEV:
                raise StorageError(f"store {self.name!r}: cannot move {source} into {self.path}: {exc}") from exc
            shutil.copytree(source, incoming)
        (incoming / "lock.mdb").unlink(missing_ok=True)  # the reader table of another environment; LMDB makes its own
        current = self.path / DATA_DIR
        old = self.path / f"{DATA_DIR}.old"
        self._env.close()
        try:
            shutil.rmtree(old, ignore_errors=True)
            os.rename(current, old)
            os.rename(incoming, current)
        except BaseException:
            if not current.exists() and old.exists():
                os.rename(old, current)
            self._env, self._data_db, self._meta_db = _open_env(current, self.map_size)
            raise
        fsync_dir(self.path)
        self._env, self._data_db, self._meta_db = _open_env(current, self.map_size)
        shutil.rmtree(old, ignore_errors=True)

    # -- typed view -----------------------------------------------------------------------------------------------

    def typed(self, key_serde: Serde, value_serde: Serde) -> TypedStore:
        return TypedStore(self, key_serde, value_serde)

    # -- internals ------------------------------------------------------------------------------------------------

    def _check_open(self) -> None:
        if self._closed:
            raise StateBackendError(f"store {self.name!r} at {self.path} is closed")

    def _check_key(self, key: bytes) -> None:
        if not isinstance(key, bytes):
            raise TypeError(f"store {self.name!r}: key must be bytes, got {type(key).__name__}")
        if not 0 < len(key) <= self._max_key_size:
            raise StateBackendError(
                f"store {self.name!r}: key of {len(key)} bytes; keys must be 1 to {self._max_key_size} bytes "
                f"(LMDB's limit); hash or shorten longer keys"
            )

    def _write(self, key: bytes, value: Any) -> None:
        self._check_open()
        size = len(key) + (0 if value is TOMBSTONE else len(value))
        old = self._batch.get(key)
        if old is not None:
            size -= len(key) + (0 if old is TOMBSTONE else len(old))
        self._batch[key] = value
        self._batch_bytes += size
        if self._batch_bytes > self.max_batch_bytes:
            self._spill()

    def _sorted_records(self) -> list[tuple[bytes, bytes | None]]:
        return [(k, None if v is TOMBSTONE else v) for k, v in sorted(self._batch.items(), key=_first)]

    def _overlay(self, start: bytes | None, end: bytes | None, *, as_dict: bool = False) -> Any:
        """What reads see above LMDB in ``[start, end)``: the pending (flushed, not yet applied) batches, oldest
        first, then the write batch; sorted pairs, or a dict with ``as_dict``."""
        layers = [*(p.index for p in self._pending), self._batch]
        merged: dict[bytes, Any] = {}
        for layer in layers:
            if start is None and end is None:
                merged.update(layer)
            else:
                merged.update((k, v) for k, v in layer.items()
                              if (start is None or k >= start) and (end is None or k < end))
        if as_dict:
            return merged
        return sorted(merged.items(), key=_first)

    def _settle_pending(self) -> None:
        """Before the whole contents are replaced: apply what was flushed (so a failed replace leaves the flushed
        state), or, when that apply fails, forget it (the replace overwrites it anyway)."""
        try:
            self.apply_pending()
        except StateBackendError:
            self._drop_pending()

    def _drop_pending(self) -> None:
        """Forget flushed batches not applied yet."""
        with self._apply_lock, self._state_lock:
            self._fail_view_requests(StateBackendError(f"store {self.name!r} was replaced"))
            self._pending = ()
            self._apply_error = None

    def _spill(self) -> None:
        self.apply_pending()  # order: the flushed batches reach LMDB before this newer data
        records = self._sorted_records()
        run = self.path / SPILL_DIR / f"{self._run_prefix}-{len(self._runs):06d}.run"
        _write_run(run, records)
        self._runs.append(run)
        try:
            with self._write_txn("spill") as txn:
                _apply_records(txn, self._data_db, records)
                txn.delete(_VERSION_KEY, db=self._meta_db)
        except BaseException:
            self._runs.pop()
            run.unlink(missing_ok=True)
            raise
        self._batch = {}
        self._batch_bytes = 0
        log.debug("store %s spilled %d records to %s", self.name, len(records), run)

    def _discard_pending(self) -> None:
        self._batch = {}
        self._batch_bytes = 0
        _unlink_all(self._runs)
        self._runs = []

    @contextlib.contextmanager
    def _write_txn(self, what: str) -> Iterator[lmdb.Transaction[bytes]]:
        """One LMDB write transaction: committed on success, aborted on any error; LMDB errors become
        ``StorageError`` naming the store (a full map says to raise ``map_size``)."""
        try:
            with self._env.begin(write=True) as txn:
                yield txn
        except lmdb.MapFullError as exc:
            raise StorageError(
                f"store {self.name!r} at {self.path}: {what} failed, the LMDB map is full ({self.map_size} bytes); "
                "open the store with a larger map_size"
            ) from exc
        except lmdb.Error as exc:
            raise StorageError(f"store {self.name!r} at {self.path}: {what} failed in LMDB: {exc}") from exc



@attrs.define
class TypedStore:
    """The ``LocalStore`` API over typed keys and values, converted by the two serdes.

    ``iter_prefix`` needs a key serde that keeps prefixes (``bytes``, ``string``); with other key serdes (integer,
    json, pickle) a prefix of the object is not a prefix of the bytes, so use ``iter_range``. ``iter_range`` follows
    byte order, which equals the object order for bytes, string (code points) and integer.
    """

    store: LocalStore
    key_serde: Serde
    value_serde: Serde

    def get(self, key: Any) -> Any:
        raw = self.store.get(self.key_serde.to_bytes(key))
        return None if raw is None else self.value_serde.from_bytes(raw)

    def contains(self, key: Any) -> bool:
        return self.store.contains(self.key_serde.to_bytes(key))

    def put(self, key: Any, value: Any) -> None:
        self.store.put(self.key_serde.to_bytes(key), self.value_serde.to_bytes(value))

    def delete(self, key: Any) -> None:
        self.store.delete(self.key_serde.to_bytes(key))

    def put_all(self, items: Iterable[tuple[Any, Any]]) -> None:
        to_key, to_value = self.key_serde.to_bytes, self.value_serde.to_bytes
        self.store.put_all((to_key(k), to_value(v)) for k, v in items)

    def delete_all(self, keys: Iterable[Any]) -> None:
        self.store.delete_all(self.key_serde.to_bytes(k) for k in keys)

    def iter_prefix(self, prefix: Any) -> Iterator[tuple[Any, Any]]:
        if not getattr(self.key_serde, "prefix_preserving", False):
            raise ConfigError(
                f"store {self.store.name!r}: iter_prefix needs a key serde that keeps prefixes (bytes, string), "
                f"this store's key serde is {self.key_serde.name!r}; use iter_range instead"
            )
        return self._decode(self.store.iter_prefix(self.key_serde.to_bytes(prefix)))

    def iter_range(self, start: Any | None, end: Any | None) -> Iterator[tuple[Any, Any]]:
        to_key = self.key_serde.to_bytes
        return self._decode(
            self.store.iter_range(None if start is None else to_key(start), None if end is None else to_key(end))
        )

    def items(self) -> Iterator[tuple[Any, Any]]:
        return self._decode(self.store.items())

    def count(self) -> int:
        return self.store.count()

    def _decode(self, records: Iterator[tuple[bytes, bytes]]) -> Iterator[tuple[Any, Any]]:
        from_key, from_value = self.key_serde.from_bytes, self.value_serde.from_bytes
        for key, value in records:
            yield from_key(key), from_value(value)


# ---------------------------------------------------------------------------------------------------------------------
# Helpers


def _first(item: tuple[bytes, Any]) -> bytes:
    return item[0]


def _prefix_end(prefix: bytes) -> bytes | None:
    """The smallest key greater than every key starting with ``prefix`` (None when there is none)."""
    stripped = prefix.rstrip(b"\xff")
    if not stripped:
        return None
    return stripped[:-1] + bytes([stripped[-1] + 1])


def _merge_batch(
    stored: Iterator[tuple[bytes, bytes]], batch: list[tuple[bytes, Any]], txn: lmdb.Transaction[bytes]
) -> Iterator[tuple[bytes, bytes]]:
    """Merge LMDB records with sorted batch records; the batch wins on equal keys and its tombstones hide keys."""
    try:
        if not batch:
            yield from stored
            return
        i, n = 0, len(batch)
        for key, value in stored:
            while i < n and batch[i][0] < key:
                bkey, bvalue = batch[i]
                i += 1
                if bvalue is not TOMBSTONE:
                    yield bkey, bvalue
            if i < n and batch[i][0] == key:
                bvalue = batch[i][1]
                i += 1
                if bvalue is not TOMBSTONE:
                    yield key, bvalue
            else:
                yield key, value
        for bkey, bvalue in batch[i:]:
            if bvalue is not TOMBSTONE:
                yield bkey, bvalue
    finally:
        try:
            txn.abort()
        except lmdb.Error:
            pass


def _apply_records(txn: lmdb.Transaction[bytes], db: Any, records: Iterable[tuple[bytes, bytes | None]]) -> None:
    cursor = txn.cursor(db=db)
    for key, value in records:
        if value is None:
            if cursor.set_key(key):
                cursor.delete()
        else:
            cursor.put(key, value)


def _set_version(txn: lmdb.Transaction[bytes], meta_db: Any, version: LocalVersion | None) -> None:
    if version is None:
        txn.delete(_VERSION_KEY, db=meta_db)
    else:
        txn.put(_VERSION_KEY, version.to_bytes(), db=meta_db)


def _open_env(directory: Path, map_size: int, *, create: bool = True) -> tuple[lmdb.Environment, Any, Any]:
    try:
        env = lmdb.open(
            str(directory),
            map_size=map_size,
            subdir=True,
            max_dbs=2,
            readahead=False,
            create=create,
            max_spare_txns=4,
            sync=False,  # see "Durability" in the module docstring
            metasync=False,
        )
    except lmdb.Error as exc:
        raise StorageError(f"cannot open the LMDB environment in {directory}: {exc}") from exc
    try:
        data_db = env.open_db(_DATA_DB, create=create)
        meta_db = env.open_db(_META_DB, create=create)
    except lmdb.Error as exc:
        env.close()
        raise CorruptDataError(
            f"the LMDB environment in {directory} lacks the 'data' and 'meta' dbs of a statebackend store: {exc}"
        ) from exc
    return env, data_db, meta_db


UNSYNCED_FILE = "UNSYNCED"
_BOOT_ID = Path("/proc/sys/kernel/random/boot_id")


def _boot_id() -> str:
    try:
        return _BOOT_ID.read_text().strip()
    except OSError:
        return ""


def _guard_unsynced(store_dir: Path, name: str) -> None:
    """Drop the LMDB environment if the machine crashed while it was open; then mark it open under this boot."""
    marker = store_dir / UNSYNCED_FILE
    boot = _boot_id()
    try:
        recorded = marker.read_text().strip()
    except FileNotFoundError:
        recorded = None
    if recorded is not None and (not boot or recorded != boot):
        log.warning("store %s at %s: the machine stopped while the store was open (unsynced LMDB writes may be "
                     "torn); discarding local data, restore rebuilds it from the blob store", name, store_dir)
        shutil.rmtree(store_dir / DATA_DIR, ignore_errors=True)
    tmp = store_dir / (UNSYNCED_FILE + ".tmp")
    with open(tmp, "w") as out:
        out.write(boot + "\n")
        out.flush()
        os.fsync(out.fileno())
    os.replace(tmp, marker)
    fsync_dir(store_dir)


def _clear_unsynced(store_dir: Path) -> None:
    try:
        (store_dir / UNSYNCED_FILE).unlink()
    except FileNotFoundError:
        return
    fsync_dir(store_dir)


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


def _release_lock(fd: int) -> None:
    try:
        os.ftruncate(fd, 0)
        fcntl.flock(fd, fcntl.LOCK_UN)
    finally:
        os.close(fd)


def _recover_swap(store_dir: Path) -> None:
    """Repair an interrupted ``replace_environment``: bring back the old data if the new never arrived."""
    current = store_dir / DATA_DIR
    old = store_dir / f"{DATA_DIR}.old"
    if not current.exists() and old.exists():
        log.warning("store dir %s: restoring %s left by an interrupted environment swap", store_dir, old)
        os.rename(old, current)
    shutil.rmtree(old, ignore_errors=True)
    shutil.rmtree(store_dir / f"{DATA_DIR}.incoming", ignore_errors=True)
