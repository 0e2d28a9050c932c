"""Backup side of the blob-snapshot backend: an LSM tree of immutable sorted runs on the blob store.

Per commit and store:

- ``snapshot()`` (task thread, O(1)): takes the commit's change set and a future read view on exactly the version
  the commit flushed (opened by the store's applier; nothing is copied or hashed here), and names the index this
  commit will write.
- ``upload()`` (commit pool): encodes the change set into one run (a sorted record file of kind ``run``: puts and
  tombstones in key order, zstd, lineage in its header, checksum in its footer), names it by the blake2b-256 of its
  bytes, uploads it unless the blob store already holds exactly those bytes, adopts a finished compaction, then
  writes the index (the live runs, oldest first) create-only. The marker is the index's name. Cost and bytes follow
  the change. When this backend has no chain for the store's data (the first commit after a migration, a fallback
  restore from another backend, a broken chain), the upload writes a *base run* of the whole store instead, once.
- ``cleanup()`` (commit pool, after the checkpoint is durable): removes the expiry of the index and of its runs
  (seed 002's remove-TTL), then deletes the indexes that fell out of the last ``task.checkpoint.retained`` and the
  runs only they referenced.

Compaction (one at a time per store, on a process-wide compaction thread; never on the task thread, never awaited
by a commit): size-tiered. When ``compaction.fanout`` runs of one level exist, the oldest of them are merged into one
run of the next level (newest value per key, tombstones kept). When the runs above the bottom run (the base, or the
first run of a chain that began on the empty store) add up to ``compaction.full.ratio`` times its size, a new base
run is written from an LMDB read view of the last committed version (the local store already is the merge of every
run). The result is uploaded in the background and a later commit's index lists it in place of its inputs; it is
recorded in the store dir, so a result that an open closed before adopting is adopted by the next open. Write
amplification and space bound: docs/formats-blobsnapshot.md.

Garbage of failed or abandoned uploads is removed by a mark-and-sweep (:meth:`BlobSnapshotBackupManager.sweep`,
every ``gc.interval.commits`` commits and at init with ``gc.on.init``): the mark is every index a checkpoint in the
checkpoint log names plus the ones this manager holds; the sweep deletes unreferenced blobs older than the grace
period (``created_at`` metadata), already expired (``expires_at``), or made durable once and since dropped.

Uploads, cleanups and sweeps of a store are serialized by a per-store lock; ``snapshot()`` takes only a short lock.
"""

from __future__ import annotations

import heapq
import json
import logging
import os
import shutil
import threading
import time
import uuid
from collections import deque
from collections.abc import Callable, Iterable, Iterator, Mapping
from concurrent.futures import Future
from contextlib import contextmanager
from operator import itemgetter
from pathlib import Path
from typing import Any, BinaryIO, cast

import attrs
from statebackend.backends.blobsnapshot.format import (
    RunEntry,
    RunIndex,
    check_index_binding,
    check_run_binding,
    content_hash,
    index_prefix,
    legacy_chunks_prefix,
    new_hasher,
    parse_index_name,
    replace_runs,
    run_name,
    runs_prefix,
)
from statebackend.backends.blobsnapshot.format import index_name as make_index_name
from statebackend.checkpoint import CheckpointId, CheckpointLog, CheckpointV2

from statebackend.blobstores.base import BlobStore
from statebackend.concurrency import SharedPools, until_cancelled
from statebackend.contracts import BackendContext, StoreMarkers, TaskBackupManager
from statebackend.crashpoints import crashpoint
from statebackend.errors import (
    AlreadyExistsError,
    CorruptDataError,
    IncompatibleFormatError,
    NotFoundError,
    StateBackendError,
)
from statebackend.recordfile import KIND_RUN, FileHeader, check_digest, iter_records, write_file
from statebackend.store import ChangeSet, LocalStore, LocalVersion, ReadView

__all__ = ["CACHE_DIR", "STAGING_DIR", "BlobSnapshotBackupManager", "SweepReport", "read_index", "read_run"]

log = logging.getLogger(__name__)

STAGING_DIR = "blobsnapshot-staging"
#: local copies of the chain's non-base runs (what merges read), of base runs until durable and of runs not uploaded
#: yet, named by their hash
CACHE_DIR = "blobsnapshot-runs"
#: a compaction result not yet adopted by an index (the open that made it closed first)
COMPACTED_FILE = "blobsnapshot-compacted.json"
#: metadata keys on runs and indexes (seconds since the epoch, as decimal strings)
CREATED_AT = "created_at"
EXPIRES_AT = "expires_at"
DURABLE_AT = "durable_at"
#: merges of up to this many records run in a dict (C speed); bigger ones stream through a heap (bounded memory)
_DICT_MERGE_MAX_RECORDS = 2_000_000

_compaction_pools = SharedPools("blobsnapshot-compaction")


def read_index(blob_store: BlobStore, name: str, *, job: str, task: str, store: str) -> RunIndex:
    """Read and verify index blob ``name``: intact (checksum) and bound to its name (job, task, store, seq, token;
    see :func:`check_index_binding`). :class:`NotFoundError` / :class:`CorruptDataError` name it."""
    try:
        data = blob_store.get(name)
    except NotFoundError as exc:
        raise NotFoundError(
            f"store {store}: index blob {name} is missing from {blob_store.describe()}; the checkpoint "
            f"cannot be restored from blobsnapshot: restore an older checkpoint or from another backend's marker"
        ) from exc
    index = RunIndex.decode(data, name=name)
    check_index_binding(index, name=name, job=job, task=task, store=store)
    return index


def read_run(blob_store: BlobStore, store_prefix: str, entry: RunEntry, *, index: str, job: str, task: str,
             store: str, local: Path | None = None) -> bytes:
    """The verified bytes of ``entry``'s run: from ``local`` when that file holds exactly them, else downloaded.
    Size, content hash and header lineage are checked; a missing or damaged run names itself and the index."""
    name = run_name(store_prefix, entry.hash)
    data: bytes | None = None
    if local is not None:
        try:
            data = local.read_bytes()
        except OSError:
            data = None
        if data is not None and (len(data) != entry.size or content_hash(data) != entry.hash):
            data = None
    if data is None:
        try:
            data = blob_store.get(name)
        except NotFoundError as exc:
            raise NotFoundError(
                f"run {name} that index {index} lists is missing from {blob_store.describe()}; this checkpoint cannot "
                f"be restored from blobsnapshot: restore an older checkpoint or from another backend's marker"
            ) from exc
        if len(data) != entry.size or content_hash(data) != entry.hash:
            raise CorruptDataError(
                f"run {name} that index {index} lists failed its hash check ({len(data)} bytes, expected "
                f"{entry.size}); it was damaged in the blob store and was not loaded"
            )
    header = check_digest(data, name=name)
    check_run_binding(header, entry, name=name, index=index, job=job, task=task, store=store)
    return data


@attrs.frozen
class SweepReport:
    """What one mark-and-sweep deleted (and whether it had to skip runs because a live index was unreadable)."""

    indexes_deleted: int = 0
    runs_deleted: int = 0
    runs_skipped: bool = False


@attrs.frozen
class _Prepared:
    """What ``snapshot()`` took for one commit of one store, until ``upload()`` uses it."""

    seq: int
    version: LocalVersion
    change: ChangeSet | None
    view: Future[ReadView]


@attrs.frozen
class _Compacted:
    """A finished compaction: ``output`` replaces the contiguous ``inputs`` in a later index."""

    inputs: tuple[RunEntry, ...]
    output: RunEntry
    generation: int
    uploaded_at: float | None

    def to_json(self) -> dict[str, Any]:
        return {"inputs": [run.to_json() for run in self.inputs], "output": self.output.to_json(),
                "uploaded_at": self.uploaded_at}

    @classmethod
    def from_json(cls, document: Mapping[str, Any], generation: int) -> _Compacted:
        return cls(tuple(RunEntry.from_json(item) for item in document["inputs"]),
                   RunEntry.from_json(document["output"]), generation, document.get("uploaded_at"))


class CompactionCancelled(StateBackendError):
    """A compaction stopped because the task was handed to another opener; nothing of it was uploaded."""


@attrs.define(eq=False)
class _StoreState:
    """The backup state of one store."""

    name: str
    store: LocalStore
    prefix: str
    staging: Path
    cache: Path
    seq: int = 0
    #: the chain the next index lists, oldest first (runs of failed commits included: their changes are in LMDB)
    runs: list[RunEntry] = attrs.field(factory=list)
    #: the chain does not describe the local data: the next upload writes a base run
    needs_base: bool = True
    #: bumped whenever the chain is replaced by a base run; compactions of an older generation are dropped
    generation: int = 0
    #: run hashes known present in the blob store, and when this manager uploaded them
    uploaded: set[str] = attrs.field(factory=set)
    uploaded_at: dict[str, float] = attrs.field(factory=dict)
    #: run hashes whose expiry was removed (referenced by a durable index)
    durable_runs: set[str] = attrs.field(factory=set)
    prepared: dict[str, _Prepared] = attrs.field(factory=dict)
    compaction: Future[_Compacted | None] | None = None
    compaction_inputs: tuple[RunEntry, ...] = ()
    compaction_output: str | None = None
    #: the last index written: the previous index of the next one
    previous: RunIndex | None = None
    previous_name: str | None = None
    #: indexes written whose checkpoint is not (yet) known durable
    pending: dict[str, RunIndex] = attrs.field(factory=dict)
    #: durable indexes, oldest first, at most ``retained``
    retained: deque[tuple[str, RunIndex]] = attrs.field(factory=deque)
    cleanups: int = 0
    last_durable_seq: int = 0
    #: first time a sweep saw a blob, for blob stores without metadata
    first_seen: dict[str, float] = attrs.field(factory=dict)
    #: guards the quick fields (seq, prepared, compaction); held only briefly
    state_lock: threading.Lock = attrs.field(factory=threading.Lock)
    #: serializes upload, cleanup and sweep of this store
    io_lock: threading.Lock = attrs.field(factory=threading.Lock)

    def live_indexes(self, *, suspect_pending: bool = True) -> dict[str, RunIndex]:
        """Indexes this manager must keep. ``suspect_pending=False`` leaves out the pending ones older than the
        newest durable one: their commit failed, or their cleanup is late (then the checkpoint log names them)."""
        live = dict(self.retained)
        live.update((name, index) for name, index in self.pending.items()
                    if suspect_pending or index.seq > self.last_durable_seq)
        if self.previous is not None and self.previous_name is not None:
            live[self.previous_name] = self.previous
        return live

    def cached(self, entry: RunEntry) -> Path:
        return self.cache / entry.hash


@attrs.define(eq=False)
class BlobSnapshotBackupManager(TaskBackupManager):
    context: BackendContext
    retained: int
    grace_period_ms: int
    ttl_ms: int
    gc_interval_commits: int
    gc_on_init: bool = False
    compaction_fanout: int = 10
    compaction_full_ratio: float = 1.0
    compaction_full_min_bytes: int = 1 << 20
    compression_level: int = 3
    #: wall clock (seconds since the epoch) for blob ages; tests may replace it
    clock: Callable[[], float] = time.time
    _states: dict[str, _StoreState] = attrs.field(init=False, factory=dict)
    _init_sweep: Future[SweepReport] | None = attrs.field(init=False, default=None)
    _closed: bool = attrs.field(init=False, default=False)
    #: compactions stop at their next check (:meth:`cancel_background`)
    _cancelled: bool = attrs.field(init=False, default=False)

    # -- contract -----------------------------------------------------------------------------------------------

    def init(self, checkpoint: CheckpointV2 | None) -> None:
        markers = checkpoint.markers_for(self.context.factory_name) if checkpoint is not None else {}
        for name, store in self.context.stores.items():
            staging = Path(store.path) / STAGING_DIR
            cache = Path(store.path) / CACHE_DIR
            staging.mkdir(exist_ok=True)
            cache.mkdir(exist_ok=True)
            for stale in staging.iterdir():  # partial files of a crashed process (never referenced), not those of
                _remove_unless_in_flight(stale)  # an upload of an earlier open in this process whose close timed out
            state = _StoreState(name=name, store=store, prefix=self.context.blob_prefix(name), staging=staging,
                                cache=cache)
            marker = markers.get(name)
            if marker is not None:
                parsed = parse_index_name(marker)
                state.seq = parsed[0] if parsed is not None else 0
                self._adopt_restored_index(state, marker)
            elif store.version is None and store.count() == 0:
                state.needs_base = False  # an empty store: the chain starts empty
            self._drop_stale_cache(state, at_init=True)
            self._states[name] = state
        if self.gc_on_init and self._states:
            self._init_sweep = self.context.executor.submit(self.sweep)

    def snapshot(self, checkpoint_id: CheckpointId, changes: Mapping[str, ChangeSet]) -> StoreMarkers:
        markers: StoreMarkers = {}
        for name, state in self._states.items():
            change = changes[name]
            # O(1) and non-blocking: a read transaction on exactly this version, opened by the store's applier as
            # soon as the flushed batch is in LMDB; upload() waits for it on the commit pool
            view = change.read_view()
            with state.state_lock:
                state.seq += 1
                marker = make_index_name(state.prefix, state.seq, change.version.token)
                state.prepared[marker] = _Prepared(state.seq, change.version, change if len(change) else None, view)
            markers[name] = marker
        return markers

    def upload(self, checkpoint_id: CheckpointId, markers: StoreMarkers) -> Future[StoreMarkers]:
        futures = {name: self.context.executor.submit(self._upload_store, self._states[name], marker)
                   for name, marker in markers.items()}
        return _gather(futures)

    def cleanup(self, checkpoint_id: CheckpointId, markers: StoreMarkers) -> Future[None]:
        return self.context.executor.submit(self._cleanup, dict(markers))

    def abort(self, checkpoint_id: CheckpointId) -> None:
        """The commit's sync part failed after our snapshot(): its flush is in LMDB but will never be uploaded as a
        run, so the chain no longer describes the data: the next upload writes a base run."""
        for state in self._states.values():
            with state.state_lock:
                prepared, state.prepared = list(state.prepared.values()), {}
                # whether or not our snapshot() ran (in a dual commit another backend's may have failed first), the
                # commit flushed every store: that change is in LMDB and in no run
                state.needs_base = True
            for item in prepared:
                _close_when_ready(item.view)

    def close(self) -> None:
        if self._closed:
            return
        self._closed = True
        if self._init_sweep is not None:
            try:
                self._init_sweep.exception()
            except BaseException:  # noqa: BLE001, S110 - a cancelled sweep
                pass
        for state in self._states.values():
            compaction = state.compaction
            if compaction is not None:
                # a full compaction reads an LMDB view: it must end before the store closes. Its result is recorded
                # in the store dir, and the next open adopts it.
                try:
                    compaction.exception()
                except BaseException:  # noqa: BLE001, S110 - a cancelled compaction
                    pass
            with state.state_lock:
                prepared, state.prepared = list(state.prepared.values()), {}
            for item in prepared:
                _close_when_ready(item.view)

    # -- garbage collection -------------------------------------------------------------------------------------

    def sweep(self, now: float | None = None) -> SweepReport:
        """Mark-and-sweep every store's blobs (see the module docstring). Safe to call at any time."""
        total = SweepReport()
        for state in self._states.values():
            with state.io_lock:
                report = self._sweep_store(state, self.clock() if now is None else now)
            total = SweepReport(
                total.indexes_deleted + report.indexes_deleted,
                total.runs_deleted + report.runs_deleted,
                total.runs_skipped or report.runs_skipped,
            )
        return total

    # -- init ---------------------------------------------------------------------------------------------------

    def _adopt_restored_index(self, state: _StoreState, marker: str) -> None:
        context = self.context
        failed_here = context.factory_name in context.restore_failures.get(state.name, ())
        try:
            index = self._read_index(marker, state.name)
        except (NotFoundError, CorruptDataError, IncompatibleFormatError) as exc:
            log.warning("store %s: cannot read the checkpoint's blobsnapshot index (%s); the next commit uploads a "
                        "base run of the whole store", state.name, exc, extra=self._extra(state.name))
            return
        state.previous, state.previous_name = index, marker
        state.retained.append((marker, index))
        state.last_durable_seq = index.seq
        if failed_here or state.store.version != index.version:
            # this backend's restore failed (a run may be missing or damaged), or the store holds other data: the
            # chain must not be continued
            log.warning("store %s: the local data is not this backend's index %s (restored by %s); the next commit "
                        "uploads a base run", state.name, marker, context.restored_by.get(state.name),
                        extra=self._extra(state.name))
            context.metrics.increment("blobsnapshot.rebase.after.fallback")
            return
        restorer = context.restored_by.get(state.name, context.factory_name)
        if restorer != context.factory_name:
            # another backend restored the store (it came first in restore.factories): this backend's runs were never
            # read at this open, so a lost or cut run would go unnoticed while every later index named it. One head()
            # per run (at most 1 + (fanout - 1) x levels) says whether the chain can be continued.
            lost = self._runs_not_whole(state, index)
            if lost:
                log.warning("store %s: run %s of index %s (and %d more) is missing or cut; restored by %s, the next "
                            "commit uploads a base run", state.name, lost[0], marker, len(lost) - 1, restorer,
                            extra=self._extra(state.name))
                context.metrics.increment("blobsnapshot.rebase.after.fallback")
                return
        state.runs = list(index.runs)
        state.needs_base = False
        state.uploaded.update(index.run_hashes())
        self._adopt_recorded_compaction(state)
        # A crash between the checkpoint write and cleanup leaves the expiry on a durable index: remove it now.
        if context.blob_store.supports_metadata:
            try:
                metadata = context.blob_store.head(marker).metadata
            except NotFoundError:
                metadata = {}
            if EXPIRES_AT in metadata:
                self._make_durable(state, marker, index)
            else:
                state.durable_runs = index.run_hashes()

    def _runs_not_whole(self, state: _StoreState, index: RunIndex) -> list[str]:
        """The runs of ``index`` the blob store does not hold at their exact length."""
        blob_store = self.context.blob_store
        lost = []
        for run in index.runs:
            name = run_name(state.prefix, run.hash)
            try:
                if blob_store.head(name).size == run.size:
                    continue
            except NotFoundError:
                pass
            lost.append(name)
        return lost

    def _adopt_recorded_compaction(self, state: _StoreState) -> None:
        """A compaction an earlier open finished but could not list in an index: adopt it at the next upload if its
        inputs are still a stretch of the chain and its output is in the blob store."""
        record = Path(state.store.path) / COMPACTED_FILE
        try:
            document = json.loads(record.read_text())
            compacted = _Compacted.from_json(document, state.generation)
        except FileNotFoundError:
            return
        except (ValueError, KeyError, TypeError, AttributeError, OSError) as exc:
            log.warning("store %s: ignoring unreadable compaction record %s (%s)", state.name, record, exc,
                        extra=self._extra(state.name))
            record.unlink(missing_ok=True)
            return
        if replace_runs(state.runs, compacted.inputs, compacted.output) is None:
            record.unlink(missing_ok=True)
            return
        done: Future[_Compacted | None] = Future()
        done.set_result(compacted)
        state.compaction = done
        state.compaction_inputs = compacted.inputs
        state.compaction_output = compacted.output.hash

    def _drop_stale_cache(self, state: _StoreState, *, at_init: bool = False) -> None:
        """Delete cached runs the chain no longer lists (merged away, or left by a crashed process), and base runs
        once durable (merges never read a base run; until a durable index names it, a commit may have to write it
        again: see :meth:`_ensure_uploaded`)."""
        with state.state_lock:
            if state.compaction is not None and not state.compaction.done():
                return  # its output may be in the cache before it is recorded
            keep = {run.hash for run in state.runs if not (run.base and run.hash in state.durable_runs)}
            keep |= {run.hash for run in state.compaction_inputs}
            if state.compaction_output is not None:
                keep.add(state.compaction_output)
        for path in state.cache.iterdir():
            if path.name not in keep:
                if at_init:
                    _remove_unless_in_flight(path)  # an upload of an earlier open in this process may use it
                else:
                    path.unlink(missing_ok=True)

    def _read_index(self, marker: str, store: str) -> RunIndex:
        context = self.context
        return read_index(context.blob_store, marker, job=context.job_name, task=context.task_name, store=store)

    # -- upload -------------------------------------------------------------------------------------------------

    def _upload_store(self, state: _StoreState, marker: str) -> str:
        with state.state_lock:
            prepared = state.prepared.pop(marker, None)
            parsed = parse_index_name(marker)
            seq = parsed[0] if parsed is not None else 0
            stale = [state.prepared.pop(m) for m in list(state.prepared) if state.prepared[m].seq < seq]
            if stale:
                # snapshots whose upload never started (their commit failed before upload): their changes are in
                # LMDB but in no run, so this upload writes a base run
                state.needs_base = True
        for item in stale:
            _close_when_ready(item.view)
        if prepared is None:
            raise StateBackendError(f"store {state.name}: no snapshot was taken for {marker}; call snapshot() first")
        view = prepared.view.result()  # waits for the store's applier, never for this pool
        handed_over = False
        try:
            with state.io_lock:
                handed_over = self._upload_prepared(state, marker, prepared, view)
        finally:
            if not handed_over:
                view.close()
        return marker

    def _upload_prepared(self, state: _StoreState, marker: str, prepared: _Prepared, view: ReadView) -> bool:
        """Write this commit's run and index; returns whether ``view`` was handed to a full compaction."""
        context = self.context
        with _in_flight([state.staging, state.cache]):
            covered = False  # whether the chain holds this commit's change (as a run, in a base run, or: none)
            try:
                if state.needs_base:
                    base = self._write_run(state, view.items(), first_seq=1, last_seq=prepared.seq,
                                           version=prepared.version, level=_BASE_LEVEL, base=True)
                    with state.state_lock:
                        state.runs = [base]
                        state.generation += 1
                        state.needs_base = False
                    context.metrics.increment("blobsnapshot.base.runs")
                elif prepared.change is not None:
                    first = state.runs[-1].last_seq + 1 if state.runs else 1
                    run = self._write_run(state, iter(prepared.change), first_seq=first, last_seq=prepared.seq,
                                          version=prepared.version, level=0, base=False)
                    state.runs.append(run)
                covered = True
                crashpoint("blobsnapshot.upload.run_staged")
                for run in state.runs:
                    self._ensure_uploaded(state, run)
                crashpoint("blobsnapshot.upload.runs_uploaded")
            except BaseException:
                if not covered or (state.runs and not all(state.cached(r).exists() or r.hash in state.uploaded
                                                          for r in state.runs)):
                    # this commit's change could not be written as a run (it is in LMDB all the same), or a run is
                    # neither uploaded nor staged: the chain cannot be completed, the next upload writes a base run
                    state.needs_base = True
                raise
            runs = self._adopt_compaction(state, tuple(state.runs))
            index = RunIndex(
                job=context.job_name, task=context.task_name, store=state.name,
                checkpoint_id=prepared.version.checkpoint_id, token=prepared.version.token, seq=prepared.seq,
                runs=runs, key_count=view.count, previous_index=state.previous_name,
            )
            self._put_index(marker, index)
            crashpoint("blobsnapshot.upload.index_written")
            state.runs = list(runs)
            state.previous, state.previous_name = index, marker
            state.pending[marker] = index
            self._drop_stale_cache(state)
            context.metrics.record("blobsnapshot.runs.live", len(runs))
            return self._maybe_compact(state, view)

    def _write_run(self, state: _StoreState, records: Iterable[tuple[bytes, bytes | None]], *, first_seq: int,
                   last_seq: int, version: LocalVersion, level: int, base: bool) -> RunEntry:
        """Encode ``records`` (sorted) as a run file in the cache dir, named by its hash."""
        header = FileHeader(kind=KIND_RUN, job=self.context.job_name, task=self.context.task_name, store=state.name,
                            checkpoint_id=version.checkpoint_id, token=version.token, seq=last_seq,
                            base_seq=first_seq - 1)
        partial = state.staging / f"{uuid.uuid4().hex}.partial"
        try:
            with open(partial, "wb") as raw:
                out = _HashingWriter(raw)
                stats = write_file(cast("BinaryIO", out), header, records, level=self.compression_level)
            digest = out.hexdigest()
            os.replace(partial, state.cache / digest)
        except BaseException:
            partial.unlink(missing_ok=True)
            raise
        return RunEntry(hash=digest, size=stats.file_bytes, records=stats.record_count, level=level, base=base,
                        first_seq=first_seq, last_seq=last_seq, checkpoint_id=version.checkpoint_id,
                        token=version.token)

    def _ensure_uploaded(self, state: _StoreState, run: RunEntry) -> None:
        """Make sure the blob store holds ``run``. A run this manager uploaded that no durable index names and that
        is older than half the grace period is written again (a sweep of another attempt could take it for
        garbage); the same bytes under the same name, with a fresh age."""
        if run.hash in state.uploaded:
            uploaded_at = state.uploaded_at.get(run.hash)
            if run.hash in state.durable_runs or self._young_enough(uploaded_at):
                return
            if not self.context.blob_store.supports_metadata:
                return  # no age on the blob store: a sweep counts it from when it first saw it, nothing to refresh
            if not state.cached(run).exists():
                state.needs_base = True
                raise StateBackendError(
                    f"store {state.name}: run {run_name(state.prefix, run.hash)} was uploaded more than half of "
                    f"blobsnapshot.gc.grace.period.ms ago and no durable checkpoint names it; it is not cached "
                    f"locally to refresh it. The next commit uploads a base run"
                )
        path = state.cached(run)
        if not path.exists():
            state.needs_base = True
            raise StateBackendError(
                f"store {state.name}: run {run_name(state.prefix, run.hash)} is neither uploaded nor staged; the next "
                f"commit uploads a base run"
            )
        written = self._put_run(state, run, path)
        metrics = self.context.metrics
        if written:
            metrics.increment("commit.bytes.uploaded", run.size)
            metrics.increment("commit.files.uploaded")
            metrics.increment("blobsnapshot.runs.uploaded")
        else:
            metrics.increment("commit.bytes.reused", run.size)
            metrics.increment("blobsnapshot.runs.reused")
        state.uploaded.add(run.hash)

    def _put_run(self, state: _StoreState, run: RunEntry, path: Path) -> bool:
        """Upload one run unless the blob store holds exactly its bytes and an index may name them; whether it was
        written.

        "Present" needs evidence about *this* run: a ``head()`` that finds a blob of its length under its
        content-addressed name. A create-only write refused as "already exists" is checked the same way; a blob of
        another length under the name is overwritten with the run's bytes, the only bytes the name can hold. A
        present blob is reused only when no sweep can take it before a checkpoint names it: a retained durable index
        names it, or it is younger than half the grace period. Otherwise (a run whose upload reply was lost long
        ago, an identical run of a checkpoint retention dropped) the same bytes are written again, with a fresh
        age."""
        blob_store = self.context.blob_store
        name = run_name(state.prefix, run.hash)
        refresh = run.hash in state.uploaded  # an old upload no durable index names: write it again, same bytes
        created_at = self.clock()
        if not refresh:
            found, age = self._present(state, name, run)
            if found == "reusable":
                self._found_at(state, run, age)
                return False
            refresh = found == "too old"
        if refresh:
            blob_store.put_file(name, path, metadata=self._new_metadata(created_at))
        else:
            try:
                blob_store.put_file(name, path, create_only=True, metadata=self._new_metadata(created_at))
            except AlreadyExistsError:
                found, age = self._present(state, name, run)
                if found == "reusable":
                    self._found_at(state, run, age)
                    return False  # same name, same content: an earlier try wrote it first
                if found == "absent":
                    log.warning("store %s: run %s was reported taken but holds no blob of its length; writing it "
                                "again", state.name, name, extra=self._extra(state.name))
                blob_store.put_file(name, path, metadata=self._new_metadata(created_at))
        state.uploaded_at[run.hash] = created_at
        crashpoint("blobsnapshot.upload.run_uploaded")
        return True

    def _present(self, state: _StoreState, name: str, run: RunEntry) -> tuple[str, float | None]:
        """``"absent"`` (no blob of the run's length under ``name``), ``"reusable"`` or ``"too old"`` (see
        :meth:`_put_run`), with the blob's age (its ``created_at``) when known."""
        blob_store = self.context.blob_store
        try:
            info = blob_store.head(name)
        except NotFoundError:
            return "absent", None
        if info.size != run.size:
            log.warning("run %s: the blob store reports %d bytes where the run has %d; not taken as present",
                        name, info.size, run.size, extra=self._extra(state.name))
            return "absent", None
        try:
            created: float | None = float(info.metadata[CREATED_AT])
        except (KeyError, ValueError):
            created = None  # no age we can read (durable once and since dropped, or written by another tool)
        if run.hash in state.durable_runs or not blob_store.supports_metadata:
            return "reusable", created
        return ("reusable", created) if self._young_enough(created) else ("too old", created)

    def _found_at(self, state: _StoreState, run: RunEntry, created: float | None) -> None:
        """A run found present is as old as its blob: a later index names it only while that age allows (else it is
        written again), as for a run this manager uploaded."""
        if created is not None:
            state.uploaded_at[run.hash] = created
        else:
            state.uploaded_at.pop(run.hash, None)

    def _put_index(self, marker: str, index: RunIndex) -> None:
        data = index.encode()
        blob_store = self.context.blob_store
        try:
            blob_store.put(marker, data, create_only=True, metadata=self._new_metadata(self.clock()))
        except AlreadyExistsError:
            # the name carries the flush's random token: only an earlier try of this very upload can have written it
            try:
                existing = blob_store.get(marker)
            except NotFoundError:
                existing = None
            if existing != data:
                raise StateBackendError(
                    f"index blob {marker} already exists with other content in {blob_store.describe()}; another "
                    f"attempt of task {self.context.task_name} wrote it: restore from the latest checkpoint"
                ) from None
        metrics = self.context.metrics
        metrics.increment("commit.bytes.uploaded", len(data))
        metrics.increment("commit.files.uploaded")
        metrics.increment("blobsnapshot.indexes.uploaded")

    def _new_metadata(self, now: float) -> dict[str, str] | None:
        if not self.context.blob_store.supports_metadata:
            return None
        return {CREATED_AT: f"{now:.3f}", EXPIRES_AT: f"{now + self.ttl_ms / 1000.0:.3f}"}

    def _young_enough(self, uploaded_at: float | None) -> bool:
        """Whether a blob this manager uploaded at ``uploaded_at`` may still be named by a new index: younger than
        half the grace period, so no sweep (whose own deletions stop after a quarter of it) can take it, and younger
        than half its ``ttl.ms``, so it has not expired (a sweep deletes an expired blob whatever its grace)."""
        window = min(self.grace_period_ms, self.ttl_ms) / 2000.0
        return uploaded_at is not None and self.clock() - uploaded_at < window

    # -- compaction ---------------------------------------------------------------------------------------------

    def _adopt_compaction(self, state: _StoreState, runs: tuple[RunEntry, ...]) -> tuple[RunEntry, ...]:
        with state.state_lock:
            compaction = state.compaction
            if compaction is None or not compaction.done():
                return runs
            state.compaction = None
            state.compaction_inputs = ()
            state.compaction_output = None
        record = Path(state.store.path) / COMPACTED_FILE
        record.unlink(missing_ok=True)
        exc = compaction.exception()
        if exc is not None:
            self.context.metrics.increment("blobsnapshot.compaction.failures")
            log.warning("store %s: compaction failed (tried again later): %s", state.name, exc,
                        extra=self._extra(state.name))
            return runs
        compacted = compaction.result()
        if compacted is None or compacted.generation != state.generation:
            return runs
        replaced = replace_runs(runs, compacted.inputs, compacted.output)
        if replaced is None:
            return runs
        if not self._young_enough(compacted.uploaded_at) and compacted.output.hash not in state.durable_runs:
            # a sweep may take it (with gc.grace.period.ms 0 at once, so it could otherwise never be adopted): write
            # it again from its local copy, same bytes under the same name with a fresh age, as for a chain's run
            path = state.cached(compacted.output)
            if not path.exists():
                self.context.metrics.increment("blobsnapshot.compaction.too.old")
                log.warning("store %s: not adopting compacted run %s: uploaded more than half of "
                            "blobsnapshot.gc.grace.period.ms ago", state.name, compacted.output.hash,
                            extra=self._extra(state.name))
                return runs
            now = self.clock()
            try:
                self.context.blob_store.put_file(run_name(state.prefix, compacted.output.hash), path,
                                                 metadata=self._new_metadata(now))
            except StateBackendError as exc:
                self.context.metrics.increment("blobsnapshot.compaction.failures")
                log.warning("store %s: could not write compacted run %s again (compacting later): %s", state.name,
                            compacted.output.hash, exc, extra=self._extra(state.name))
                return runs
            compacted = attrs.evolve(compacted, uploaded_at=now)
            self.context.metrics.increment("blobsnapshot.compaction.refreshed")
        state.uploaded.add(compacted.output.hash)
        if compacted.uploaded_at is not None:
            state.uploaded_at[compacted.output.hash] = compacted.uploaded_at
        self.context.metrics.increment("blobsnapshot.compaction.adopted")
        return replaced

    def cancel_background(self) -> None:
        """Stop a running compaction at its next chunk of records, before it uploads anything (see the contract),
        unless a store holds more than twice ``compaction.fanout`` runs: compactions put off that long are waited
        for, so handovers that keep interrupting them cannot let the runs (and a restore's work) grow without
        bound."""
        limit = 2 * self.compaction_fanout
        for state in self._states.values():
            with state.state_lock:
                if len(state.runs) > limit:
                    return
        self._cancelled = True

    def _until_cancelled(self, records: Iterable[Any], state: _StoreState) -> Iterator[Any]:
        return until_cancelled(records, lambda: self._cancelled, lambda: CompactionCancelled(
            f"store {state.name}: compaction stopped: the task was handed to another opener"))

    def _maybe_compact(self, state: _StoreState, view: ReadView) -> bool:
        """Start a compaction when one is due and none runs; whether ``view`` was handed to it."""
        if self._closed or self._cancelled:
            return False
        with state.state_lock:
            if state.compaction is not None:
                return False
            runs = tuple(state.runs)
            # the bottom run (a base run, or the first run of a chain that started on the empty store) is only ever
            # replaced by a full compaction; the runs above it are merged by tiers
            upper = list(runs[1:])
            base_bytes = runs[0].size if runs else 0
            upper_bytes = sum(run.size for run in upper)
            pool = _compaction_pools.get(1)
            if upper and view.version == upper[-1].version and upper_bytes >= max(
                    self.compaction_full_ratio * base_bytes, self.compaction_full_min_bytes):
                state.compaction_inputs = runs
                state.compaction = pool.submit(self._compact_full, state, view, runs, state.generation)
                return True
            inputs = _tier_to_merge(upper, self.compaction_fanout)
            if inputs:
                state.compaction_inputs = inputs
                state.compaction = pool.submit(self._compact_merge, state, inputs, state.generation)
        return False

    def _compact_full(self, state: _StoreState, view: ReadView, inputs: tuple[RunEntry, ...],
                      generation: int) -> _Compacted:
        """A new base run: the whole store at the last input's version, from an LMDB read view of it."""
        last = inputs[-1]
        try:
            with _in_flight([state.staging, state.cache]):
                output = self._write_run(state, self._until_cancelled(view.items(), state), first_seq=1,
                                         last_seq=last.last_seq, version=last.version, level=_BASE_LEVEL, base=True)
        finally:
            view.close()
        return self._publish_compaction(state, inputs, output, generation)

    def _compact_merge(self, state: _StoreState, inputs: tuple[RunEntry, ...], generation: int) -> _Compacted:
        """Merge contiguous runs above the bottom run into one of the next level: the newest value of each key, and
        the tombstones (the bottom run below may hold the keys they delete)."""
        context = self.context
        with _in_flight([state.staging, state.cache]):
            sources = [read_run(context.blob_store, state.prefix, run, index="(compaction)", job=context.job_name,
                                task=context.task_name, store=state.name, local=state.cached(run))
                       for run in inputs]
            records = _merge([iter_records(data, name=run_name(state.prefix, run.hash), verified=True)
                              for run, data in zip(inputs, sources, strict=True)],
                             total=sum(run.records for run in inputs), drop_tombstones=inputs[0].first_seq == 1)
            del sources
            last = inputs[-1]
            output = self._write_run(state, self._until_cancelled(records, state), first_seq=inputs[0].first_seq,
                                     last_seq=last.last_seq, version=last.version,
                                     level=max(run.level for run in inputs) + 1, base=False)
        return self._publish_compaction(state, inputs, output, generation)

    def _publish_compaction(self, state: _StoreState, inputs: tuple[RunEntry, ...], output: RunEntry,
                            generation: int) -> _Compacted:
        if self._cancelled:  # written, not uploaded: the cached file goes with the next cleanup of the cache
            raise CompactionCancelled(f"store {state.name}: compaction stopped before its upload: the task was "
                                      "handed to another opener")
        with state.state_lock:
            state.compaction_output = output.hash
        crashpoint("blobsnapshot.compaction.written")
        path = state.cached(output)
        written = self._put_run(state, output, path)
        metrics = self.context.metrics
        if written:
            metrics.increment("blobsnapshot.compaction.bytes", output.size)
            metrics.increment("blobsnapshot.compaction.runs")
        metrics.increment("blobsnapshot.compactions.full" if output.base else "blobsnapshot.compactions.merge")
        crashpoint("blobsnapshot.compaction.uploaded")
        compacted = _Compacted(inputs, output, generation, state.uploaded_at.get(output.hash))
        record = Path(state.store.path) / COMPACTED_FILE
        partial = record.with_name(record.name + ".partial")
        partial.write_text(json.dumps(compacted.to_json()))
        os.replace(partial, record)
        return compacted

    # -- cleanup ------------------------------------------------------------------------------------------------

    def _cleanup(self, markers: dict[str, str]) -> None:
        for name, marker in markers.items():
            state = self._states[name]
            with state.io_lock:
                self._cleanup_store(state, marker)
                state.cleanups += 1
                # by the checkpoint's sequence number, not by cleanups in this process: a job that opens its task
                # for each batch (the Spark driver) sweeps every gc.interval.commits commits all the same
                parsed = parse_index_name(marker)
                seq = parsed[0] if parsed is not None else state.cleanups
                if self.gc_interval_commits and seq % self.gc_interval_commits == 0:
                    self._sweep_store(state, self.clock())

    def _cleanup_store(self, state: _StoreState, marker: str) -> None:
        retained = dict(state.retained)
        index = state.pending.pop(marker, None) or retained.get(marker)
        if index is None:
            try:
                index = self._read_index(marker, state.name)
            except NotFoundError:
                # a late cleanup of a checkpoint that already fell out of retention: nothing left to do
                log.debug("store %s: cleanup of %s found it gone already", state.name, marker,
                          extra=self._extra(state.name))
                return
        self._make_durable(state, marker, index)
        crashpoint("blobsnapshot.cleanup.expiry_removed")
        state.last_durable_seq = max(state.last_durable_seq, index.seq)
        if marker not in retained:
            state.retained.append((marker, index))
        self._settle_older_pending(state, index.seq)
        # cleanups may finish out of order on a pool: keep the window ordered by seq, newest last
        state.retained = deque(sorted(state.retained, key=lambda item: item[1].seq))
        dropped: list[tuple[str, RunIndex]] = []
        while len(state.retained) > max(1, self.retained):
            dropped.append(state.retained.popleft())
        if not dropped:
            return
        live = state.live_indexes()
        keep = {digest for live_index in live.values() for digest in live_index.run_hashes()}
        keep |= {run.hash for run in state.runs} | {run.hash for run in state.compaction_inputs}
        if state.compaction_output is not None:
            keep.add(state.compaction_output)
        garbage = sorted({digest for _, i in dropped for digest in i.run_hashes()} - keep)
        blob_store = self.context.blob_store
        for digest in garbage:
            blob_store.delete(run_name(state.prefix, digest))
            crashpoint("blobsnapshot.cleanup.deleted")
            state.uploaded.discard(digest)
            state.durable_runs.discard(digest)
        for name, _ in dropped:
            if name not in live:
                blob_store.delete(name)
                crashpoint("blobsnapshot.cleanup.deleted")
        self.context.metrics.increment("blobsnapshot.runs.deleted", len(garbage))
        self.context.metrics.increment("blobsnapshot.indexes.deleted", len(dropped))

    def _settle_older_pending(self, state: _StoreState, seq: int) -> None:
        """Indexes written before ``seq`` whose commit never got a cleanup: their checkpoint write failed, or it
        landed with its reply lost (the framework then builds on it, without a cleanup for it). Once a later
        checkpoint is durable their outcome is settled, and the checkpoint log tells which: one it lists is durable
        (its expiry is removed and it joins the retention window); one it does not list is garbage the sweep
        collects."""
        older = sorted((m for m, i in state.pending.items() if i.seq < seq), key=lambda m: state.pending[m].seq)
        if not older:
            return
        in_log = self._markers_in_checkpoint_log(state.name)
        for marker in older:
            index = state.pending.pop(marker)
            if marker in in_log:
                log.info("store %s: index %s belongs to a checkpoint that landed although its write was reported "
                         "failed; kept as durable", state.name, marker, extra=self._extra(state.name))
                self._make_durable(state, marker, index)
                state.retained.append((marker, index))
                self.context.metrics.increment("blobsnapshot.indexes.landed.after.failure")
            else:
                log.debug("store %s: index %s belongs to a commit whose checkpoint never landed; the sweep deletes "
                          "it after the grace period", state.name, marker, extra=self._extra(state.name))

    def _make_durable(self, state: _StoreState, marker: str, index: RunIndex) -> None:
        """Seed 002's remove-TTL: a durable checkpoint's index and runs never expire."""
        blob_store = self.context.blob_store
        if not blob_store.supports_metadata:
            state.durable_runs |= index.run_hashes()
            return
        # the expiry goes; the age restarts now, so a collection by age (a sweep, `statebackend gc`) of a blob that
        # later falls out of retention still waits a grace period from here
        now = f"{self.clock():.3f}"
        durable = {CREATED_AT: now, DURABLE_AT: now}
        for digest in sorted(index.run_hashes() - state.durable_runs):
            name = run_name(state.prefix, digest)
            try:
                blob_store.set_metadata(name, durable)
            except NotFoundError:
                self.context.metrics.increment("blobsnapshot.runs.missing")
                log.error("store %s: run %s of durable index %s is missing; that checkpoint cannot be restored "
                          "from blobsnapshot; the next commit uploads a base run", state.name, name, marker,
                          extra=self._extra(state.name))
                state.uploaded.discard(digest)
                if any(run.hash == digest for run in state.runs):
                    state.needs_base = True
                continue
            except StateBackendError as exc:
                # not fatal to retention: the run stays out of durable_runs and the next index using it retries
                self.context.metrics.increment("blobsnapshot.ttl.failures")
                log.warning("store %s: could not remove the expiry of run %s: %s", state.name, name, exc,
                            extra=self._extra(state.name))
                continue
            state.durable_runs.add(digest)
            self.context.metrics.increment("blobsnapshot.ttl.removed")
        try:
            blob_store.set_metadata(marker, durable)
        except NotFoundError:
            log.error("store %s: durable index %s is missing", state.name, marker, extra=self._extra(state.name))
        except StateBackendError as exc:
            self.context.metrics.increment("blobsnapshot.ttl.failures")
            log.warning("store %s: could not remove the expiry of index %s: %s", state.name, marker, exc,
                        extra=self._extra(state.name))

    # -- mark and sweep -----------------------------------------------------------------------------------------

    def _sweep_store(self, state: _StoreState, now: float) -> SweepReport:
        blob_store = self.context.blob_store
        live: dict[str, RunIndex | None] = dict(state.live_indexes(suspect_pending=False))
        for marker in self._markers_in_checkpoint_log(state.name):
            live.setdefault(marker, state.pending.get(marker))
        referenced: set[str] = {run.hash for run in state.runs} | {run.hash for run in state.compaction_inputs}
        if state.compaction_output is not None:
            referenced.add(state.compaction_output)
        complete = True
        kept_seqs = [parsed[0] for m, _ in state.retained if (parsed := parse_index_name(m)) is not None]
        oldest_kept = min(kept_seqs) if kept_seqs else None
        for marker, index in list(live.items()):
            if index is None:
                try:
                    index = self._read_index(marker, state.name)
                except NotFoundError:
                    parsed = parse_index_name(marker)
                    if oldest_kept is not None and parsed is not None and parsed[0] < oldest_kept:
                        # deleted by this manager's retention while the checkpoint log still lists it (the log is
                        # trimmed concurrently): no longer live, its runs were released with it
                        del live[marker]
                        continue
                    complete = False
                    log.warning("store %s: sweep cannot find live index %s; runs are left alone", state.name, marker,
                                extra=self._extra(state.name))
                    continue
                except (CorruptDataError, IncompatibleFormatError) as exc:
                    complete = False  # its runs (or chunks) are unknown: deleting "unreferenced" ones could hurt it
                    log.warning("store %s: sweep cannot read live index %s (%s); runs are left alone",
                                state.name, marker, exc, extra=self._extra(state.name))
                    continue
            referenced |= index.run_hashes()
        indexes_deleted = 0
        for name in list(blob_store.list(index_prefix(state.prefix))):
            if name not in live and self._old_enough(state, name, now):
                blob_store.delete(name)
                crashpoint("blobsnapshot.sweep.deleted")
                state.pending.pop(name, None)
                indexes_deleted += 1
        runs_deleted = 0
        if complete:
            # runs, and the chunks of schema-1 snapshots once no live index is one
            names = [*blob_store.list(runs_prefix(state.prefix)), *blob_store.list(legacy_chunks_prefix(state.prefix))]
            for name in names:
                digest = name.rsplit("/", 1)[-1]
                if digest not in referenced and self._old_enough(state, name, now):
                    blob_store.delete(name)
                    crashpoint("blobsnapshot.sweep.deleted")
                    state.uploaded.discard(digest)
                    state.durable_runs.discard(digest)
                    state.first_seen.pop(name, None)
                    runs_deleted += 1
        metrics = self.context.metrics
        metrics.increment("blobsnapshot.sweeps")
        metrics.increment("blobsnapshot.sweep.runs.deleted", runs_deleted)
        metrics.increment("blobsnapshot.sweep.indexes.deleted", indexes_deleted)
        if runs_deleted or indexes_deleted:
            log.debug("store %s: sweep deleted %d unreferenced runs and %d indexes", state.name, runs_deleted,
                      indexes_deleted, extra=self._extra(state.name))
        return SweepReport(indexes_deleted, runs_deleted, not complete)

    def _extra(self, store: str, **fields: object) -> dict[str, object]:
        """Key fields of a log record, for structured handlers."""
        return {"job": self.context.job_name, "task": self.context.task_name, "store": store, **fields}

    def _checkpoint_log(self) -> CheckpointLog:
        """The task's log (its listings never show less than the newest checkpoint the task knows durable, so a
        short listing cannot make live indexes look unreferenced)."""
        return self.context.checkpoint_log

    def _markers_in_checkpoint_log(self, store_name: str) -> set[str]:
        """Index names that a checkpoint still in the checkpoint log needs: never garbage, whatever their age."""
        names = set()
        for entry in self._checkpoint_log().entries():
            if isinstance(entry.checkpoint, CheckpointV2):
                marker = entry.checkpoint.markers_for(self.context.factory_name).get(store_name)
                if marker is not None:
                    names.add(marker)
        return names

    def _old_enough(self, state: _StoreState, name: str, now: float) -> bool:
        """Whether an unreferenced blob may go: past its grace period, expired, or durable once and since dropped."""
        grace = self.grace_period_ms / 1000.0
        blob_store = self.context.blob_store
        if not blob_store.supports_metadata:
            return now - state.first_seen.setdefault(name, now) >= grace
        try:
            metadata = blob_store.head(name).metadata
        except NotFoundError:
            return False
        try:
            if EXPIRES_AT in metadata and float(metadata[EXPIRES_AT]) <= now:
                return True
            if CREATED_AT in metadata:
                return now - float(metadata[CREATED_AT]) >= grace
        except ValueError:
            log.warning("blob %s has unreadable age metadata %r; treating it as new", name, dict(metadata),
                        extra=self._extra(state.name))
            return False
        if DURABLE_AT in metadata:
            # no age: its expiry was removed when a durable checkpoint used it, and no retained one does any more
            return True
        # no metadata we know (a reply whose metadata headers were cut, or a blob another tool wrote): its age is
        # unknown, so it is counted from when this manager first saw it, like a store that keeps no metadata
        return now - state.first_seen.setdefault(name, now) >= grace


#: the level of base runs (above every merge level)
_BASE_LEVEL = 1 << 16


def _tier_to_merge(upper: list[RunEntry], fanout: int) -> tuple[RunEntry, ...]:
    """The oldest ``fanout`` runs of the lowest level that has that many (runs are ordered by level, highest and
    oldest first, so they are contiguous), or nothing."""
    by_level: dict[int, list[RunEntry]] = {}
    for run in upper:
        by_level.setdefault(run.level, []).append(run)
    for level in sorted(by_level):
        runs = by_level[level]
        if len(runs) >= fanout:
            start = upper.index(runs[0])
            candidate = tuple(upper[start:start + fanout])
            if all(run.level == level for run in candidate):
                return candidate
    return ()


def _merge(sources: list[Iterable[tuple[bytes, bytes | None]]], *, total: int,
           drop_tombstones: bool) -> Iterator[tuple[bytes, bytes | None]]:
    """The records of ``sources`` (oldest first, each sorted) as one sorted stream, newest value per key."""
    if total <= _DICT_MERGE_MAX_RECORDS:
        merged: dict[bytes, bytes | None] = {}
        for source in sources:
            merged.update(source)  # newer sources overwrite: C speed, no Python frame per record
        items = sorted(merged.items(), key=itemgetter(0))
        if drop_tombstones:
            return (item for item in items if item[1] is not None)
        return iter(items)
    return _heap_merge(sources, drop_tombstones=drop_tombstones)


def _heap_merge(sources: list[Iterable[tuple[bytes, bytes | None]]], *,
                drop_tombstones: bool) -> Iterator[tuple[bytes, bytes | None]]:
    ranked = [((key, -rank, value) for key, value in source) for rank, source in enumerate(sources)]
    previous: bytes | None = None
    for key, _rank, value in heapq.merge(*ranked):
        if key == previous:
            continue
        previous = key
        if value is None and drop_tombstones:
            continue
        yield key, value


class _HashingWriter:
    """A write-only file wrapper that hashes what passes through (the run's name is the hash of its bytes)."""

    def __init__(self, out: BinaryIO) -> None:
        self._out = out
        self._hasher = new_hasher()

    def write(self, data: bytes) -> int:
        self._hasher.update(data)
        return self._out.write(data)

    def hexdigest(self) -> str:
        return str(self._hasher.hexdigest())


#: dirs (staging, cache) of uploads and compactions running in this process, with a use count: the init of a later
#: open of the same store (its previous open's close timed out while an upload ran) must not delete their files
_in_flight_lock = threading.Lock()
_in_flight_dirs: dict[str, int] = {}


@contextmanager
def _in_flight(paths: list[Path]) -> Iterator[None]:
    keys = [str(path) for path in paths]
    with _in_flight_lock:
        for key in keys:
            _in_flight_dirs[key] = _in_flight_dirs.get(key, 0) + 1
    try:
        yield
    finally:
        with _in_flight_lock:
            for key in keys:
                _in_flight_dirs[key] -= 1
                if not _in_flight_dirs[key]:
                    del _in_flight_dirs[key]


def _remove_unless_in_flight(path: Path) -> None:
    with _in_flight_lock:
        if str(path.parent) in _in_flight_dirs:
            return
        if path.is_dir():
            shutil.rmtree(path, ignore_errors=True)
        else:
            path.unlink(missing_ok=True)


def _gather(futures: Mapping[str, Future[str]]) -> Future[StoreMarkers]:
    """One future for a dict of futures (resolved by callbacks: nobody waits on a pool thread)."""
    result: Future[StoreMarkers] = Future()
    if not futures:
        result.set_result({})
        return result
    lock = threading.Lock()
    remaining = [len(futures)]

    def one_done(_: Future[str]) -> None:
        with lock:
            remaining[0] -= 1
            if remaining[0]:
                return
        errors = [f.exception() for f in futures.values() if f.exception() is not None]
        if errors:
            result.set_exception(errors[0])
        else:
            result.set_result({name: f.result() for name, f in futures.items()})

    for future in futures.values():
        future.add_done_callback(one_done)
    return result


def _close_when_ready(view: Future[ReadView]) -> None:
    """Close a read view that may not be open yet (its flush still being applied)."""

    def close(done: Future[ReadView]) -> None:
        if not done.cancelled() and done.exception() is None:
            done.result().close()

    view.add_done_callback(close)
