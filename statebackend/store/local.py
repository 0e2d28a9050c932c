"""The local store: one LMDB environment per (task, store), with a write batch and a sorted change set per flush.

Contract:

- Keys and values are ``bytes``. Keys are non-empty and at most ``max_key_size`` (511) bytes; a wrong type raises
  ``TypeError``, a bad key ``StateBackendError`` naming the limit, both before the write reaches the batch.
- Writes go to an in-memory write batch (last write per key wins; deletes are tombstones) that every read sees:
  ``get``/``contains`` look in the batch first, iterations merge the batch and LMDB in key order and tombstones hide
  keys. An iteration works on a snapshot (an LMDB read transaction plus a sorted copy of the batch in its range), so
  writing while iterating is safe and not seen by that iteration.
- ``flush(version)`` freezes the batch and returns the ``ChangeSet``: every key written since the previous flush,
  sorted (on first use, by whichever thread needs the records first), one record per key. It costs O(1) besides
  counting the change, and nothing that grows with the state: the frozen
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
- ``get_many`` / ``put_many`` / ``delete_many`` / ``write_many`` (the vectorized path) give exactly what ``get`` /
  ``put`` / ``delete`` key by key give, overlay, tombstones and spills included; a bad key or value raises before
  anything of the call reaches the batch. Reads use one LMDB read transaction, its get mapped over the keys; writes are
  one dict update when no key repeats or is already in the batch and no spill is due, else they fall back to the per-key
  loop.
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
for other threads. Users get a view with the user operations only (``typed``); the rest is for backends.

This module ties the parts of the package together; each keeps its own contract: ``env`` (the LMDB layout and the
version record), ``batch`` (the write batch, its overlay, the change set), ``spill`` (spill runs), ``applier``
(pending batches into LMDB in the background), ``view`` (read views), ``bulk`` (bulk loads, environment swaps),
``directory`` (the lock, the ``UNSYNCED`` guard) and ``typed`` (the user views).
"""

from __future__ import annotations

import contextlib
import logging
import secrets
from collections.abc import Iterable, Iterator, Sequence
from os import PathLike
from pathlib import Path
from types import TracebackType
from typing import Any, Self

import attrs
import lmdb

from statebackend.errors import ClosedError, ConfigError, InvalidKeyError, StateBackendError, StorageError, UsageError
from statebackend.fsutil import fsync_dir
from statebackend.serdes import Serde
from statebackend.store import bulk
from statebackend.store.applier import Applier, PendingBatch
from statebackend.store.batch import TOMBSTONE, ChangeSet, SortedBatch, merge_overlay, overlay, sorted_records
from statebackend.store.directory import DATA_DIR, clear_unsynced, guard_unsynced, lock_store_dir, release_lock
from statebackend.store.env import (
    MAX_KEY_SIZE,
    VERSION_KEY,
    LocalVersion,
    apply_records,
    open_env,
    read_version,
    set_version,
)
from statebackend.store.spill import reset_spill_dir, run_path, unlink_all, write_run
from statebackend.store.typed import TypedStore
from statebackend.store.view import ReadView, lmdb_range, prefix_end

__all__ = ["LocalStore"]

log = logging.getLogger("statebackend.store")


@attrs.define(eq=False)
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
    #: the write batch (see ``batch``) and its size in bytes (keys plus values)
    _batch: dict[bytes, Any] = attrs.field(factory=dict, init=False)
    _batch_bytes: int = attrs.field(default=0, init=False)
    #: spill runs of the write batch since the last flush (their data is already in LMDB)
    _runs: list[Path] = attrs.field(factory=list, init=False)
    _run_prefix: str = attrs.field(factory=lambda: secrets.token_hex(6), init=False)
    _max_key_size: int = attrs.field(default=MAX_KEY_SIZE, init=False)
    _closed: bool = attrs.field(default=False, init=False)
    #: the pending batches (flushed, not yet in LMDB) and their way into LMDB
    _applier: Applier = attrs.field(init=False)

    def __attrs_post_init__(self) -> None:
        self._applier = Applier(self.name, self.path, self._write_pending, self._open_view)

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
        lock_fd = lock_store_dir(store_dir, name)
        try:
            bulk.recover_swap(store_dir)
            guard_unsynced(store_dir, name)
            reset_spill_dir(store_dir)
            env, data_db, meta_db = open_env(store_dir / DATA_DIR, map_size)
        except BaseException:
            release_lock(lock_fd)
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

    def close(self, *, sync: bool = True) -> None:
        """Close the environment and release the lock. Unflushed writes are dropped (they belong to no commit).

        ``sync=False`` skips the sync of the environment and leaves ``UNSYNCED`` in place: a close as cheap as a
        process exit and as safe (under the same boot id the next open reuses the data; after a machine crash it
        restores), for a store handed straight to another opener on this machine."""
        if self._closed:
            return
        try:
            self.apply_pending()
        except BaseException as exc:  # noqa: BLE001 - the data stays at the previous version; restore sees that
            log.warning("store %s: closing with a flushed batch that could not be applied: %s", self.name, exc)
        self._applier.close()
        self._closed = True
        self._discard_batch()
        try:
            if sync:
                self._env.sync(True)
            self._env.close()
            if sync:
                clear_unsynced(self.path)
        finally:
            release_lock(self._lock_fd)

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
        """The value of ``key`` (the batch first, then the pending batches, then LMDB), or ``None``."""
        self._check_open()
        self._check_key(key)
        value = self._batch.get(key)
        if value is None:
            for pending in reversed(self._applier.pending):  # taken before LMDB is read: see applier
                value = pending.index.get(key)
                if value is not None:
                    break
        if value is not None:
            return None if value is TOMBSTONE else value
        with self._env.begin(db=self._data_db) as txn:
            return txn.get(key)

    def contains(self, key: bytes) -> bool:
        return self.get(key) is not None

    def get_many(self, keys: Sequence[bytes]) -> list[bytes | None]:
        """The values of ``keys`` (``None`` where absent), in their order: what ``get`` gives for each, from one LMDB
        read transaction (its ``get`` mapped over the keys, in C: measured 1.6x faster than py-lmdb's ``getmulti`` and
        the dict built from it, at 12,500 random keys of 250,000), with the pending batches and the write batch laid
        over it."""
        self._check_open()
        keys = self._check_keys(keys)
        if not keys:
            return []
        layers = [*(p.index for p in self._applier.pending), self._batch]  # taken before LMDB is read: see applier
        with self._env.begin(db=self._data_db) as txn:
            values: list[Any] = list(map(txn.get, keys))
        for layer in layers:  # oldest first: a later layer wins
            if not layer or layer.keys().isdisjoint(keys):
                continue
            values = [old if new is None else new for old, new in zip(values, map(layer.get, keys), strict=True)]
        if TOMBSTONE in values:  # compared in C: TOMBSTONE equals nothing but itself
            values = [None if v is TOMBSTONE else v for v in values]
        return values

    def iter_prefix(self, prefix: bytes) -> Iterator[tuple[bytes, bytes]]:
        """Records whose key starts with ``prefix``, in key order, batch included."""
        if not isinstance(prefix, bytes):
            raise TypeError(f"store {self.name!r}: prefix must be bytes, got {type(prefix).__name__}")
        return self.iter_range(prefix or None, prefix_end(prefix))

    def iter_range(self, start: bytes | None, end: bytes | None) -> Iterator[tuple[bytes, bytes]]:
        """Records with ``start <= key < end`` (``None`` = unbounded), in key order, batch included."""
        for bound in (start, end):
            if bound is not None and not isinstance(bound, bytes):
                raise TypeError(f"store {self.name!r}: range bounds must be bytes or None, got {type(bound).__name__}")
        self._check_open()
        # Snapshot now, not at first next(): later writes must not leak into (or break) this iteration.
        batch = self._overlay(start, end)  # before the read transaction: see applier
        txn = self._env.begin(db=self._data_db)
        return merge_overlay(lmdb_range(txn.cursor(), start, end), batch, txn)

    def items(self) -> Iterator[tuple[bytes, bytes]]:
        return self.iter_range(None, None)

    def count(self) -> int:
        """Number of keys. O(1) from LMDB's stats; plus an O(batch) adjustment when the batch is not empty."""
        self._check_open()
        layers = self._overlay(None, None, as_dict=True)
        with self._env.begin(db=self._data_db) as txn:
            entries: int = txn.stat(self._data_db)["entries"]
            for key, value in layers.items():
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
        with self._env.begin() as txn:
            return read_version(txn, self._meta_db)

    @property
    def batch_bytes(self) -> int:
        """Bytes (keys plus values) in the in-memory write batch."""
        return self._batch_bytes

    @property
    def spill_runs(self) -> int:
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
            version = read_version(txn, self._meta_db)
            count = txn.stat(self._data_db)["entries"]
        except BaseException:
            txn.abort()
            raise
        return ReadView(
            store_name=self.name,
            env=self._env,
            txn=txn,
            data_db=self._data_db,
            version=version,
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

    def put_many(self, keys: Sequence[bytes], values: Sequence[bytes]) -> None:
        """``put(keys[i], values[i])`` for each ``i``, in order (a later duplicate key wins), with the same result,
        spills included. Every key and value is checked before any reaches the batch: a bad one raises and writes
        nothing. The common case (distinct keys, none in the batch yet, no spill due) is one dict update in C."""
        self._check_open()
        keys = self._check_keys(keys)
        values = list(values)
        if len(values) != len(keys):
            raise ValueError(f"store {self.name!r}: put_many got {len(keys)} keys and {len(values)} values")
        if not set(map(type, values)) <= {bytes}:
            bad = next(v for v in values if not isinstance(v, bytes))
            raise TypeError(f"store {self.name!r}: value must be bytes, got {type(bad).__name__}")
        self._write_many(keys, values, sum(map(len, keys)) + sum(map(len, values)))

    def delete_many(self, keys: Sequence[bytes]) -> None:
        """``delete(k)`` for each key, with the same result; every key is checked before any reaches the batch."""
        self._check_open()
        keys = self._check_keys(keys)
        self._write_many(keys, [TOMBSTONE] * len(keys), sum(map(len, keys)))

    def write_many(self, keys: Sequence[bytes], values: Sequence[bytes | None]) -> None:
        """Puts and deletes (``None``) in order: what ``put`` / ``delete`` one by one do, spills included; every key
        and value is checked before any reaches the batch."""
        self._check_open()
        keys = self._check_keys(keys)
        values = list(values)
        if len(values) != len(keys):
            raise ValueError(f"store {self.name!r}: write_many got {len(keys)} keys and {len(values)} values")
        if not set(map(type, values)) <= {bytes, type(None)}:
            bad = next(v for v in values if not isinstance(v, bytes) and v is not None)
            raise TypeError(f"store {self.name!r}: value must be bytes, got {type(bad).__name__}")
        size = sum(map(len, keys)) + sum(len(v) for v in values if v is not None)
        self._write_many(keys, [TOMBSTONE if v is None else v for v in values], size)

    def flush(self, version: LocalVersion, *, hold_apply: bool = False) -> ChangeSet:
        """Freeze the batch as the change set since the previous flush (spill runs included) and hand it to the
        background applier, which writes it to LMDB with ``version``. Never waits for an apply. The caller owns the
        change set and closes it. ``hold_apply``: the applier starts on it only at :meth:`start_apply` (or a read
        view of it, or anything else that applies what is pending); reads see it in the overlay meanwhile."""
        if not isinstance(version, LocalVersion):
            raise TypeError(f"store {self.name!r}: flush needs a LocalVersion, got {type(version).__name__}")
        self._check_open()
        self._applier.raise_error()
        final = SortedBatch(self._batch)  # sorted by the first thread that needs it, not here
        final_bytes = self._batch_bytes
        pending = PendingBatch(version=version, sorted_batch=final, index=self._batch)
        runs = self._runs
        self._runs = []
        self._run_prefix = secrets.token_hex(6)
        self._batch = {}
        self._batch_bytes = 0
        applier = self._applier
        applier.submit(pending, start=not hold_apply)
        return ChangeSet(version, runs, final, view_source=lambda: applier.view_at(pending), final_bytes=final_bytes)

    def start_apply(self) -> None:
        """Let the background applier write the batches a flush held back (``flush(hold_apply=True)``)."""
        if not self._closed:
            self._applier.start()

    def apply_pending(self) -> None:
        """Apply every pending batch (flushed, not yet in LMDB), in order (normally done by the background applier;
        calling it waits for that). Raises the error of an apply that failed."""
        self._applier.apply_all()

    def replace_contents(self, items: Iterable[tuple[bytes, bytes]], version: LocalVersion | None) -> int:
        """Bulk restore: in ONE write transaction drop all data, load ``items`` (strictly sorted by key) by append
        and set ``version``. An error midway (unsorted input included) leaves the old contents. Discards the batch
        and spill runs. Returns the number of records loaded."""
        self._check_open()
        self._applier.settle()
        self._discard_batch()
        with self._write_txn("replace_contents") as txn:
            loaded = bulk.load_sorted(txn, self._data_db, items, self.name, self._max_key_size)
            set_version(txn, self._meta_db, version)
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
            raise UsageError(
                f"store {self.name!r}: apply_changes needs no unflushed writes; flush or discard them first"
            )
        self.apply_pending()
        with self._write_txn("apply_changes") as txn:
            if verified_order:
                applied = bulk.apply_verified(txn, self._data_db, records, self.name, self._max_key_size)
            else:
                applied = bulk.apply_sorted(txn, self._data_db, records, self.name, self._max_key_size, self._check_key)
            set_version(txn, self._meta_db, version)
        return applied

    def apply_change_sets(self, sources: Iterable[Iterable[tuple[bytes, bytes | None]]], version: LocalVersion) -> int:
        """Catch-up by several change sets in ONE write transaction: each source's records, in order, strictly
        sorted and verified by the source (as ``apply_changes(..., verified_order=True)``), then ``version``. A
        failure anywhere (a source that raises, a bad key) aborts them all: the store stays at its version before.
        One transaction copies each LMDB page it touches once, where one per change set copies it for every set
        (the bulk of a replay's cost: a chain of deltas applies several times faster). Returns the records
        applied."""
        self._check_open()
        if self._batch or self._runs:
            raise UsageError(
                f"store {self.name!r}: apply_change_sets needs no unflushed writes; flush or discard them first"
            )
        self.apply_pending()
        applied = 0
        with self._write_txn("apply_change_sets") as txn:
            for records in sources:
                applied += bulk.apply_verified(txn, self._data_db, records, self.name, self._max_key_size)
            set_version(txn, self._meta_db, version)
        return applied

    def mark_dirty(self) -> None:
        """Clear the meta version: the data no longer equals a known checkpoint."""
        self._check_open()
        with contextlib.suppress(StateBackendError):  # the version is cleared below all the same
            self.apply_pending()
        with self._write_txn("mark_dirty") as txn:
            txn.delete(VERSION_KEY, db=self._meta_db)

    def discard_batch(self) -> None:
        """Drop the write batch. Spill runs already reached LMDB; they are dropped too and the store is marked dirty."""
        self._check_open()
        had_runs = bool(self._runs)
        self._discard_batch()
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
        self._applier.settle()
        source = Path(source_dir)
        bulk.check_environment(source, self.name, self.map_size)
        self._discard_batch()
        incoming = bulk.move_in(self.path, source, self.name)
        current = self.path / DATA_DIR
        self._env.close()
        try:
            bulk.swap_dirs(self.path, incoming)
        except BaseException:
            self._env, self._data_db, self._meta_db = open_env(current, self.map_size)
            raise
        fsync_dir(self.path)
        self._env, self._data_db, self._meta_db = open_env(current, self.map_size)
        bulk.remove_old(self.path)

    # -- user views -----------------------------------------------------------------------------------------------

    def typed(self, key_serde: Serde, value_serde: Serde) -> TypedStore:
        return TypedStore(self, key_serde, value_serde)

    # -- internals ------------------------------------------------------------------------------------------------

    def _check_open(self) -> None:
        if self._closed:
            raise ClosedError(f"store {self.name!r} at {self.path} is closed")

    def _check_key(self, key: bytes) -> None:
        if not isinstance(key, bytes):
            raise TypeError(f"store {self.name!r}: key must be bytes, got {type(key).__name__}")
        if not 0 < len(key) <= self._max_key_size:
            raise InvalidKeyError(
                f"store {self.name!r}: key of {len(key)} bytes; keys must be 1 to {self._max_key_size} bytes "
                f"(LMDB's limit); hash or shorten longer keys"
            )

    def _check_keys(self, keys: Sequence[bytes]) -> list[bytes]:
        """``keys`` as a list, each checked as ``_check_key`` does (in C for the common case)."""
        keys = list(keys)
        if not keys:
            return keys
        lengths = set(map(len, keys)) if set(map(type, keys)) <= {bytes} else None  # one pass; a few lengths
        if lengths is None or not (min(lengths) > 0 and max(lengths) <= self._max_key_size):
            for key in keys:  # the first bad key raises the per-key error
                self._check_key(key)
        return keys

    def _write_many(self, keys: list[bytes], values: list[Any], size: int) -> None:
        """Write checked ``keys``/``values`` (``size``: their bytes, tombstones counting 0) to the batch, exactly as
        ``_write`` one by one would."""
        batch = self._batch
        if (
            self._batch_bytes + size <= self.max_batch_bytes
            and len(set(keys)) == len(keys)
            and batch.keys().isdisjoint(keys)
        ):
            batch.update(
                zip(keys, values, strict=True)
            )  # no key replaced, no spill: the per-key path ends in the same state
            self._batch_bytes += size
            return
        for key, value in zip(keys, values, strict=True):
            self._write(key, value)

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

    def _overlay(self, start: bytes | None, end: bytes | None, *, as_dict: bool = False) -> Any:
        """What reads see above LMDB in ``[start, end)``: the pending batches, oldest first, then the write batch."""
        return overlay([*(p.index for p in self._applier.pending), self._batch], start, end, as_dict=as_dict)

    def _write_pending(self, pending: PendingBatch) -> None:
        """The applier's write: a pending batch's records and its version, in one transaction."""
        with self._write_txn("flush") as txn:
            apply_records(txn, self._data_db, pending.records)
            txn.put(VERSION_KEY, pending.version.to_bytes(), db=self._meta_db)

    def _spill(self) -> None:
        self.apply_pending()  # order: the pending batches reach LMDB before this newer data
        records = sorted_records(self._batch)
        run = run_path(self.path, self._run_prefix, len(self._runs))
        write_run(run, records)
        self._runs.append(run)
        try:
            with self._write_txn("spill") as txn:
                apply_records(txn, self._data_db, records)
                txn.delete(VERSION_KEY, db=self._meta_db)
        except BaseException:
            self._runs.pop()
            run.unlink(missing_ok=True)
            raise
        self._batch = {}
        self._batch_bytes = 0
        log.debug("store %s spilled %d records to %s", self.name, len(records), run)

    def _discard_batch(self) -> None:
        self._batch = {}
        self._batch_bytes = 0
        unlink_all(self._runs)
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
