"""The write batch: what it holds, how reads see it above LMDB (the overlay), and what a flush makes of it.

Contract:

- The write batch is a dict ``key -> value`` in memory, last write per key wins; a delete is ``TOMBSTONE``.
- Reads see layers above LMDB, oldest first: the pending batches (flushed, not yet written by the applier), then the
  write batch. ``overlay`` merges them for a key range (a later layer wins); ``merge_overlay`` merges that sorted
  overlay into LMDB's records in key order, the overlay winning on equal keys and its tombstones hiding keys.
- A ``ChangeSet`` is the frozen result of one flush: every key written since the previous flush, sorted, one record
  per key (``(key, value)`` for a put, ``(key, None)`` for a delete), from the flush's spill runs (read lazily; later
  runs win) and the final batch. It is immutable, iterable many times, and ``close()`` deletes its runs.
"""

from __future__ import annotations

import contextlib
import heapq
import threading
import weakref
from collections.abc import Callable, Iterable, Iterator
from concurrent.futures import Future
from pathlib import Path
from typing import Any, Self

import lmdb

from statebackend.errors import ClosedError, UsageError
from statebackend.recordfile import RecordColumns
from statebackend.store.env import LocalVersion
from statebackend.store.spill import read_run, unlink_all
from statebackend.store.view import ReadView


class _Tombstone:
    """Marks a deleted key in the write batch."""

    __slots__ = ()

    def __repr__(self) -> str:
        return "TOMBSTONE"


#: the write batch's marker of a deleted key. A backend never meets it: a change set gives a delete as
#: ``(key, None)``, and a read view holds no deleted key
TOMBSTONE: Any = _Tombstone()


def first(item: tuple[bytes, Any]) -> bytes:
    return item[0]


def sorted_columns(batch: dict[bytes, Any]) -> tuple[list[bytes], list[bytes | None]]:
    """The batch as two columns sorted by key: the keys, and their values (a tombstone becomes ``None``). Sorts the
    keys themselves (no key function) and looks the values up in C; only a batch with tombstones takes a pass in
    Python."""
    keys = sorted(batch)
    values = list(map(batch.__getitem__, keys))
    if TOMBSTONE in values:  # compared in C: the tombstone equals nothing but itself
        values = [None if v is TOMBSTONE else v for v in values]
    return keys, values


def sorted_records(batch: dict[bytes, Any]) -> list[tuple[bytes, bytes | None]]:
    """The batch as change records sorted by key (a tombstone becomes ``None``)."""
    return list(zip(*sorted_columns(batch), strict=True))


class SortedBatch:
    """A frozen write batch and its change records sorted by key, sorted once, on first use, by whichever thread
    needs them first (the commit's upload encoding the delta, the applier, a snapshot's view): not in the sync part
    of the commit, which stops processing. Sorting 12,500 keys in random order costs about 2.5 ms; the records as
    tuples (:meth:`records`, for LMDB) are made only for a consumer that asks for them, the delta's encoding takes
    the columns (:meth:`columns`)."""

    __slots__ = ("_columns", "_lock", "_records", "batch")

    def __init__(self, batch: dict[bytes, Any]) -> None:
        self.batch = batch  # never written again: a flush hands the store a new dict
        self._lock = threading.Lock()
        self._columns: tuple[list[bytes], list[bytes | None]] | None = None
        self._records: list[tuple[bytes, bytes | None]] | None = None

    def columns(self) -> tuple[list[bytes], list[bytes | None]]:
        columns = self._columns
        if columns is None:
            with self._lock:
                columns = self._columns
                if columns is None:
                    columns = self._columns = sorted_columns(self.batch)
        return columns

    def records(self) -> list[tuple[bytes, bytes | None]]:
        records = self._records
        if records is None:
            keys, values = self.columns()
            with self._lock:
                records = self._records
                if records is None:
                    records = self._records = list(zip(keys, values, strict=True))
        return records


def overlay(
    layers: Iterable[dict[bytes, Any]], start: bytes | None, end: bytes | None, *, as_dict: bool = False
) -> Any:
    """What reads see above LMDB in ``[start, end)``: the ``layers`` oldest first, a later one winning; sorted pairs,
    or a dict with ``as_dict``."""
    merged: dict[bytes, Any] = {}
    for layer in layers:
        if start is None and end is None:
            merged.update(layer)
        else:
            merged.update(
                (k, v) for k, v in layer.items() if (start is None or k >= start) and (end is None or k < end)
            )
    if as_dict:
        return merged
    return sorted(merged.items(), key=first)


def merge_overlay(
    stored: Iterator[tuple[bytes, bytes]], batch: list[tuple[bytes, Any]], txn: lmdb.Transaction[bytes]
) -> Iterator[tuple[bytes, bytes]]:
    """Merge LMDB records with sorted batch records; the batch wins on equal keys and its tombstones hide keys. Ends
    the read transaction ``txn`` that ``stored`` reads when done."""
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
        with contextlib.suppress(lmdb.Error):
            txn.abort()


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

    #: the version the flush that made this change set brought the store to (the commit's checkpoint id and a new
    #: token): what the backend's marker describes, and what a restore records with ``replace_contents`` and friends
    version: LocalVersion
    #: the bytes of the change (every key, and every value of a put), after dedupe: a backend's measure of what
    #: changed since its last snapshot
    raw_bytes: int

    def __init__(
        self,
        version: LocalVersion,
        runs: list[Path],
        final: SortedBatch,
        view_source: Callable[[], Future[ReadView]] | None = None,
        *,
        final_bytes: int | None = None,
    ) -> None:
        self.version = version
        self._view_source = view_source
        self._runs = tuple(runs)
        self._final: SortedBatch | None = final
        self._closed = False
        self._finalizer = weakref.finalize(self, unlink_all, self._runs)
        # The exact numbers after dedupe, at flush time: O(change), and without sorting anything when there are no
        # spill runs (this runs in the sync part of every commit): the final batch is then the whole change, one
        # record per key, and ``final_bytes`` (what the store counted as it wrote) its bytes. With runs, one merged
        # pass.
        if not runs:
            self._length = len(final.batch)
            self.raw_bytes = final_bytes if final_bytes is not None else _raw_bytes(final.records())
        else:
            length = 0
            raw = 0
            for key, value in self._merged():
                length += 1
                raw += len(key) + (len(value) if value is not None else 0)
            self._length = length
            self.raw_bytes = raw

    def __iter__(self) -> Iterator[tuple[bytes, bytes | None]]:
        if self._closed:
            raise ClosedError(f"change set of {self.version} is closed; take the records before closing it")
        if not self._runs:
            return iter(self._final_records())  # no generator frame per record
        return self._merged()

    def __len__(self) -> int:
        return self._length

    def columns(self) -> RecordColumns | None:
        """The records as sorted columns, when the change set is the final batch alone (no spill runs): what the
        record file writer takes without a tuple per record. None otherwise: iterate the change set."""
        if self._closed:
            raise ClosedError(f"change set of {self.version} is closed; take the records before closing it")
        if self._runs or self._final is None:
            return None
        keys, values = self._final.columns()
        return RecordColumns(keys, values)

    def __repr__(self) -> str:
        return f"ChangeSet(version={self.version!r}, records={self._length}, raw_bytes={self.raw_bytes})"

    def read_view(self) -> Future[ReadView]:
        """A future read view of the store at exactly this change set's version, opened right after the flush's
        background apply commits (or now, when it already has). Ask during the sync part of the commit that flushed
        it, before the task writes again; the caller closes the view."""
        if self._view_source is None:
            raise UsageError(f"change set of {self.version} has no store to open a read view on")
        return self._view_source()

    @property
    def spill_runs(self) -> int:
        """How many spill runs back this change set (0 when the batch never spilled)."""
        return len(self._runs)

    def close(self) -> None:
        """Delete the spill runs and drop the records; idempotent. The framework closes every change set once the
        commit's uploads are over: a backend that needs the records later keeps its own copy."""
        self._closed = True
        self._final = None
        self._finalizer()

    def __enter__(self) -> Self:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def _final_records(self) -> list[tuple[bytes, bytes | None]]:
        final = self._final
        return [] if final is None else final.records()

    def _merged(self) -> Iterator[tuple[bytes, bytes | None]]:
        if not self._runs:
            yield from self._final_records()
            return
        # Rank -i sorts later runs first among equal keys; the first record of each key is the one that wins.
        streams = [_ranked(read_run(path), -i) for i, path in enumerate(self._runs)]
        streams.append(_ranked(iter(self._final_records()), -len(self._runs)))
        previous: bytes | None = None
        for key, _rank, value in heapq.merge(*streams):
            if key == previous:
                continue
            previous = key
            yield key, value


def _raw_bytes(records: list[tuple[bytes, bytes | None]]) -> int:
    """Key and value bytes of ``records`` (a delete's value counts 0), in C calls."""
    if not records:
        return 0
    keys, values = zip(*records, strict=True)
    return sum(map(len, keys)) + sum(map(len, filter(None, values)))


def _ranked(records: Iterator[tuple[bytes, bytes | None]], rank: int) -> Iterator[tuple[bytes, int, bytes | None]]:
    for key, value in records:
        yield key, rank, value
