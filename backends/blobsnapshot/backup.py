"""Backup side of the blob-snapshot backend: an LSM tree of immutable sorted runs on the blob store.

Per commit and store:

- ``snapshot()`` (task thread, O(1)): takes the commit's change set and a future read view on exactly the version
  the commit flushed (opened by the store's applier; nothing is copied or hashed here), and a preliminary marker
  (the index blob name of older releases: the key of the prepared upload).
- ``upload()`` (commit pool): encodes the change set into one run (a sorted record file of kind ``run``: puts and
  tombstones in key order, zstd, lineage in its header, checksum in its footer), names it by the blake2b-256 of its
  bytes, uploads it unless the blob store already holds exactly those bytes, adopts a finished compaction, then
  makes the index (the live runs, oldest first) and returns it as the marker itself (``inline-index:1:...``): the
  checkpoint, written create-only and fenced by the framework, carries it, so no index blob is written and a commit
  that changed nothing writes no blob at all. Cost and bytes follow the change. When this backend has no chain for the
  store's data (the first commit after a migration, a fallback restore from another backend, a broken chain), the upload
  writes a *base run* of the whole store instead, once. So does a commit whose change is most of a large store (a bulk
  load: ``upload.base.min.records`` and ``upload.base.ratio``), so no cold restore re-inserts it record by record.
- ``checkpoint_completed()`` (commit pool, after the checkpoint is durable): the index joins the window of the last
  ``task.checkpoint.retained`` durable ones. The framework owns the blobs' lifetime (statebackend.kit.lifetime; what
  this backend states: lifetime.py): the runs only indexes that left the window referenced are released in one
  request when the checkpoint log lets its old checkpoints go (every ``retention_interval`` commits, and at close).
  The expiry (``expires_at``) written at upload stays on blobs a durable checkpoint names (no sweep deletes a marked
  blob; removing it cost a COPY per blob per commit).

Compaction (one at a time per store, on a process-wide compaction thread; never on the task thread, never awaited
by a commit): size-tiered. When ``compaction.fanout`` runs of one level exist, the oldest of them are merged into one
run of the next level (newest value per key, tombstones kept). When the runs above the bottom run (the base, or the
first run of a chain that began on the empty store) add up to ``compaction.full.ratio`` times its size, a new base
run is written from an LMDB read view of the last committed version (the local store already is the merge of every
run). The result is uploaded in the background and a later commit's index lists it in place of its inputs; it is
recorded in the store dir, so a result that an open closed before adopting is adopted by the next open. Write
amplification and space bound: docs/formats-blobsnapshot.md.

Garbage of failed or abandoned uploads is removed by the framework's mark-and-sweep (every ``gc.interval.commits``
commits and at init with ``gc.on.init``; :meth:`BlobSnapshotBackupManager.sweep` runs one now): the mark is every
index a checkpoint in the checkpoint log names plus the ones this manager holds; the sweep deletes unreferenced
blobs already expired (``expires_at``) or old enough by the age rule of :mod:`statebackend.kit.gc` (``created_at``
metadata, else counted from the collector's first sighting).

Uploads, cleanups and sweeps of a store are serialized by a per-store lock; ``snapshot()`` takes only a short lock.

The manager is one class that holds small helpers around one shared state (:class:`BlobSnapshotShared`, state.py:
the context, the options, the clock, each store's chain): the uploader, which writes and uploads runs (upload.py);
the compactor (compaction.py); what it states about its blobs (lifetime.py). Each helper is handed the shared state
when the manager makes it, and the compactor the uploader; none reaches into another. Blobs are read back verified
by blobs.py. This module holds the contract's methods, the adoption of the restored index at init, retention's
bookkeeping, and the upload of a commit.
"""

from __future__ import annotations

import contextlib
import logging
from collections import deque
from collections.abc import Mapping
from concurrent.futures import CancelledError, Future
from pathlib import Path

import attrs
from statebackend.backends.blobsnapshot.blobs import read_index, read_marker, read_run
from statebackend.backends.blobsnapshot.compaction import Compactor
from statebackend.backends.blobsnapshot.format import (
    RunIndex,
    index_prefix,
    inline_marker,
    is_inline_marker,
    marker_label,
    marker_seq,
    parse_index_name,
    run_name,
)
from statebackend.backends.blobsnapshot.format import index_name as make_index_name
from statebackend.backends.blobsnapshot.lifetime import BlobSnapshotLifetime
from statebackend.backends.blobsnapshot.state import (
    CACHE_DIR,
    COMPACTED_FILE,
    EXPIRES_AT,
    STAGING_DIR,
    BlobSnapshotSettings,
    BlobSnapshotShared,
    Prepared,
    StoreState,
)
from statebackend.backends.blobsnapshot.upload import RunUpload
from statebackend.checkpoint import CheckpointId, CheckpointV2

from statebackend.concurrency import gather
from statebackend.contracts import BackendContext, StoreMarkers, TaskBackupManager
from statebackend.crashpoints import crashpoint
from statebackend.errors import CorruptDataError, IncompatibleFormatError, NotFoundError, UsageError
from statebackend.kit import IN_FLIGHT, close_when_ready, collector_of, log_extra, markers_in_log
from statebackend.store import ChangeSet, ReadView

__all__ = [
    "CACHE_DIR",
    "COMPACTED_FILE",
    "EXPIRES_AT",
    "STAGING_DIR",
    "BlobSnapshotBackupManager",
    "BlobSnapshotSettings",
    "SweepReport",
    "read_index",
    "read_marker",
    "read_run",
]

log = logging.getLogger(__name__)


@attrs.frozen
class SweepReport:
    """What one sweep deleted (and whether a live index was unreadable, so nothing was swept)."""

    indexes_deleted: int = 0
    runs_deleted: int = 0
    runs_skipped: bool = False


class BlobSnapshotBackupManager(TaskBackupManager):
    """The blob-snapshot backend's backup manager: the contract's methods, over the helpers it holds (see the module
    docstring)."""

    def __init__(self, context: BackendContext, settings: BlobSnapshotSettings) -> None:
        #: what the manager and its helpers share: context, options, clock (tests may replace it), each store's state
        self.shared = BlobSnapshotShared(context, settings)
        #: writes runs into the cache dir and uploads them (the commit's, and the compactor's)
        self.uploader = RunUpload(self.shared)
        self.compactor = Compactor(self.shared, self.uploader)
        #: what this manager states about its blobs; the framework's collector of them hangs off it
        self.lifetime = BlobSnapshotLifetime(self.shared)

    def blob_lifetime(self) -> BlobSnapshotLifetime:
        return self.lifetime

    def sweep(self, now: float | None = None) -> SweepReport:
        """Sweep every store's blobs now (the framework's collector; see the module docstring)."""
        results = collector_of(self.lifetime).sweep(now).values()
        indexes = runs = 0
        for result in results:
            prefix = index_prefix(self.shared.stores[result.store].prefix)
            indexes += sum(1 for name in result.deleted if name.startswith(prefix))
            runs += sum(1 for name in result.deleted if not name.startswith(prefix))
        return SweepReport(indexes, runs, any(not result.complete for result in results))

    def checkpoint_completed(self, checkpoint_id: CheckpointId, markers: StoreMarkers) -> None:
        """Retention's bookkeeping: each store's index joins the window of the last ``retained`` durable ones (held
        from the collector), older indexes whose commit got no notice are settled. Idempotent."""
        for name, marker in markers.items():
            state = self.shared.stores[name]
            with state.io_lock:
                self._complete_store(state, marker)
                state.cleanups += 1

    def _complete_store(self, state: StoreState, marker: str) -> None:
        retained = dict(state.retained)
        index = state.pending.pop(marker, None) or retained.get(marker)
        if index is None:
            try:
                index = self.shared.read_index(marker, state.name)
            except NotFoundError:
                # a late notice of a checkpoint that already fell out of retention: nothing left to do
                log.debug(
                    "store %s: notice of %s found it gone already",
                    state.name,
                    marker_label(marker),
                    extra=log_extra(self.shared.context, state.name),
                )
                return
        self._make_durable(state, index)
        crashpoint("blobsnapshot.cleanup.durable")
        state.last_durable_seq = max(state.last_durable_seq, index.seq)
        if marker not in retained:
            state.retained.append((marker, index))
        self._settle_older_pending(state, index.seq)
        # notices may run out of order on a pool: keep the window ordered by seq, newest last
        state.retained = deque(sorted(state.retained, key=lambda item: item[1].seq))
        while len(state.retained) > max(1, self.shared.settings.retained):
            dropped, dropped_index = state.retained.popleft()
            if not is_inline_marker(dropped):  # an index blob of an older release: known without reading it again
                state.released[dropped] = dropped_index

    def _settle_older_pending(self, state: StoreState, seq: int) -> None:
        """Indexes written before ``seq`` whose commit got no notice: their checkpoint write failed, or it landed with
        its reply lost. Once a later checkpoint is durable the checkpoint log tells which: one it lists is durable (it
        joins the retention window); one it does not list is garbage the framework's sweep collects."""
        older = sorted((m for m, i in state.pending.items() if i.seq < seq), key=lambda m: state.pending[m].seq)
        if not older:
            return
        in_log = markers_in_log(self.shared.context, state.name)
        for marker in older:
            index = state.pending.pop(marker)
            if marker in in_log:
                log.info(
                    "store %s: index %s belongs to a checkpoint that landed although its write was reported "
                    "failed; kept as durable",
                    state.name,
                    marker_label(marker),
                    extra=log_extra(self.shared.context, state.name),
                )
                self._make_durable(state, index)
                state.retained.append((marker, index))
                self.shared.context.metrics.increment("blobsnapshot.indexes.landed.after.failure")
            else:
                log.debug(
                    "store %s: index %s belongs to a commit whose checkpoint never landed; the sweep deletes "
                    "its runs after the grace period",
                    state.name,
                    marker_label(marker),
                    extra=log_extra(self.shared.context, state.name),
                )

    def _make_durable(self, state: StoreState, index: RunIndex) -> None:
        """A durable checkpoint names ``index``: its runs may be named again by any later index whatever their age.
        Bookkeeping only: the blobs keep their ``expires_at``, which no sweep acts on while they are marked."""
        state.durable_runs |= index.run_hashes()

    def init(self, checkpoint: CheckpointV2 | None) -> None:
        markers = checkpoint.markers_for(self.shared.context.factory_name) if checkpoint is not None else {}
        for name, store in self.shared.context.stores.items():
            staging = Path(store.path) / STAGING_DIR
            cache = Path(store.path) / CACHE_DIR
            staging.mkdir(exist_ok=True)
            cache.mkdir(exist_ok=True)
            # partial files of a crashed process (never referenced), not those of an upload of an earlier open in this
            # process whose close timed out
            for stale in staging.iterdir():
                IN_FLIGHT.remove_unless_held(stale)
            state = StoreState(
                name=name, store=store, prefix=self.shared.context.blob_prefix(name), staging=staging, cache=cache
            )
            marker = markers.get(name)
            if marker is not None:
                state.seq = marker_seq(marker) or 0
                self._adopt_restored_index(state, marker)
            elif store.version is None and store.count() == 0:
                state.needs_base = False  # an empty store: the chain starts empty
            self._drop_stale_cache(state, at_init=True)
            self.shared.stores[name] = state
            if marker is not None and state.retained:  # released once later checkpoints push it out
                collector_of(self.lifetime).adopt(0, {name: marker})

    def snapshot(self, checkpoint_id: CheckpointId, changes: Mapping[str, ChangeSet]) -> StoreMarkers:
        markers: StoreMarkers = {}
        for name, state in self.shared.stores.items():
            change = changes[name]
            # O(1) and non-blocking: a read transaction on exactly this version, opened by the store's applier as
            # soon as the flushed batch is in LMDB; upload() waits for it on the commit pool
            view = change.read_view()
            with state.state_lock:
                state.seq += 1
                marker = make_index_name(state.prefix, state.seq, change.version.token)
                state.prepared[marker] = Prepared(state.seq, change.version, change if len(change) else None, view)
            markers[name] = marker
        return markers

    def upload(self, checkpoint_id: CheckpointId, markers: StoreMarkers) -> Future[StoreMarkers]:
        return gather(
            {
                name: self.shared.context.executor.submit(self._upload_store, self.shared.stores[name], marker)
                for name, marker in markers.items()
            }
        )

    def abort(self, checkpoint_id: CheckpointId) -> None:
        """The commit's sync part failed after our snapshot(): its flush is in LMDB but will never be uploaded as a
        run, so the chain no longer describes the data: the next upload writes a base run."""
        for state in self.shared.stores.values():
            with state.state_lock:
                prepared, state.prepared = list(state.prepared.values()), {}
                # whether or not our snapshot() ran (in a dual commit another backend's may have failed first), the
                # commit flushed every store: that change is in LMDB and in no run
                state.needs_base = True
            for item in prepared:
                close_when_ready(item.view)

    def close(self) -> None:
        if self.shared.closed:
            return
        self.shared.closed = True
        for state in self.shared.stores.values():
            compaction = state.compaction
            if compaction is not None:
                # a full compaction reads an LMDB view: it must end before the store closes. Its result is recorded
                # in the store dir, and the next open adopts it.
                with contextlib.suppress(CancelledError):  # a cancelled compaction
                    compaction.exception()
            with state.state_lock:
                prepared, state.prepared = list(state.prepared.values()), {}
            for item in prepared:
                close_when_ready(item.view)

    def cancel_background(self) -> None:
        """Stop a running compaction at its next chunk of records, before it uploads anything (see the contract),
        unless a store holds more than twice ``compaction.fanout`` runs: compactions put off that long are waited
        for, so handovers that keep interrupting them cannot let the runs (and a restore's work) grow without
        bound."""
        limit = 2 * self.shared.settings.compaction_fanout
        for state in self.shared.stores.values():
            with state.state_lock:
                if len(state.runs) > limit:
                    return
        self.shared.cancellation.cancel()

    # -- init ---------------------------------------------------------------------------------------------------

    def _adopt_restored_index(self, state: StoreState, marker: str) -> None:
        context = self.shared.context
        failed_here = context.factory_name in context.restore_failures.get(state.name, ())
        try:
            index = self.shared.read_index(marker, state.name)
        except (NotFoundError, CorruptDataError, IncompatibleFormatError) as exc:
            log.warning(
                "store %s: cannot read the checkpoint's blobsnapshot index (%s); the next commit uploads a "
                "base run of the whole store",
                state.name,
                exc,
                extra=log_extra(self.shared.context, state.name),
            )
            return
        state.previous, state.previous_name = index, marker
        state.retained.append((marker, index))
        state.last_durable_seq = index.seq
        if failed_here or state.store.version != index.version:
            # this backend's restore failed (a run may be missing or damaged), or the store holds other data: the
            # chain must not be continued
            log.warning(
                "store %s: the local data is not this backend's index %s (restored by %s); the next commit "
                "uploads a base run",
                state.name,
                marker_label(marker),
                context.restored_by.get(state.name),
                extra=log_extra(self.shared.context, state.name),
            )
            context.metrics.increment("blobsnapshot.rebase.after.fallback")
            return
        restorer = context.restored_by.get(state.name, context.factory_name)
        if restorer != context.factory_name:
            # another backend restored the store (it came first in restore.factories): this backend's runs were never
            # read at this open, so a lost or cut run would go unnoticed while every later index named it. One head()
            # per run (at most 1 + (fanout - 1) x levels) says whether the chain can be continued.
            lost = self._runs_not_whole(state, index)
            if lost:
                log.warning(
                    "store %s: run %s of index %s (and %d more) is missing or cut; restored by %s, the next "
                    "commit uploads a base run",
                    state.name,
                    lost[0],
                    marker_label(marker),
                    len(lost) - 1,
                    restorer,
                    extra=log_extra(self.shared.context, state.name),
                )
                context.metrics.increment("blobsnapshot.rebase.after.fallback")
                return
        state.runs = list(index.runs)
        state.needs_base = False
        state.uploaded.update(index.run_hashes())
        self.compactor.adopt_recorded(state)
        # the restored checkpoint is durable: its runs may be named again whatever their age
        self._make_durable(state, index)

    def _runs_not_whole(self, state: StoreState, index: RunIndex) -> list[str]:
        """The runs of ``index`` the blob store does not hold at their exact length."""
        blob_store = self.shared.context.blob_store
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

    def _drop_stale_cache(self, state: StoreState, *, at_init: bool = False) -> None:
        """Delete cached runs the chain no longer lists (merged away, or left by a crashed process), and base runs
        once durable (merges never read a base run; until a durable index names it, a commit may have to write it
        again: see :meth:`RunUpload.ensure_uploaded`)."""
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
                    IN_FLIGHT.remove_unless_held(path)  # an upload of an earlier open in this process may use it
                else:
                    path.unlink(missing_ok=True)

    # -- upload -------------------------------------------------------------------------------------------------

    def _upload_store(self, state: StoreState, marker: str) -> str:
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
            close_when_ready(item.view)
        if prepared is None:
            raise UsageError(f"store {state.name}: no snapshot was taken for {marker}; call snapshot() first")
        view = prepared.view.result()  # waits for the store's applier, never for this pool
        handed_over = False
        try:
            with state.io_lock:
                handed_over, final = self._upload_prepared(state, prepared, view)
        finally:
            if not handed_over:
                view.close()
        return final

    def _bulk_change(self, state: StoreState, prepared: Prepared, view: ReadView) -> bool:
        """Whether this commit's change is a bulk load, uploaded as a base run of the whole store rather than as a run:
        it holds at least ``upload.base.min.records`` records and ``upload.base.ratio`` of the store's keys. A run of
        it would be re-inserted by every cold restore until a full compaction replaced it (a full compaction waits
        for the runs above the bottom one to reach its size, which a bulk load's run rarely sees); the base is
        opened, not re-inserted. It costs the commit about what the run would (LMDB's compacting copy and the
        compression of the copy, against sorting and encoding the change), never a second upload."""
        change = prepared.change
        if change is None:
            return False
        records = len(change)
        settings = self.shared.settings
        if records < settings.upload_base_min_records or records < settings.upload_base_ratio * view.count:
            return False
        log.debug(  # not INFO: a store rewritten whole at every commit would log it at every commit
            "store %s: a commit of %d changes over %d keys is uploaded as a base run (a bulk load)",
            state.name,
            records,
            view.count,
            extra=log_extra(self.shared.context, state.name),
        )
        return True

    def _upload_prepared(self, state: StoreState, prepared: Prepared, view: ReadView) -> tuple[bool, str]:
        """Write this commit's run and make its index; returns whether ``view`` was handed to a full compaction, and
        the marker, which carries the index (the checkpoint records it: no index blob is written)."""
        context = self.shared.context
        with IN_FLIGHT.hold([state.staging, state.cache]):
            covered = False  # whether the chain holds this commit's change (as a run, in a base run, or: none)
            try:
                bulk = not state.needs_base and self._bulk_change(state, prepared, view)
                if state.needs_base or bulk:
                    base = self.uploader.write_base(state, view, last_seq=prepared.seq, version=prepared.version)
                    with state.state_lock:
                        state.runs = [base]
                        state.generation += 1
                        state.needs_base = False
                    context.metrics.increment("blobsnapshot.base.runs")
                elif prepared.change is not None:
                    first = state.runs[-1].last_seq + 1 if state.runs else 1
                    run = self.uploader.write_run(
                        state,
                        iter(prepared.change),
                        first_seq=first,
                        last_seq=prepared.seq,
                        version=prepared.version,
                        level=0,
                        base=False,
                    )
                    state.runs.append(run)
                covered = True
                crashpoint("blobsnapshot.upload.run_staged")
                for run in state.runs:
                    self.uploader.ensure_uploaded(state, run)
                crashpoint("blobsnapshot.upload.runs_uploaded")
            except BaseException:
                if not covered or (
                    state.runs and not all(state.cached(r).exists() or r.hash in state.uploaded for r in state.runs)
                ):
                    # this commit's change could not be written as a run (it is in LMDB all the same), or a run is
                    # neither uploaded nor staged: the chain cannot be completed, the next upload writes a base run
                    state.needs_base = True
                raise
            runs = self.compactor.adopt(state, tuple(state.runs))
            index = RunIndex(
                job=context.job_name,
                task=context.task_name,
                store=state.name,
                checkpoint_id=prepared.version.checkpoint_id,
                token=prepared.version.token,
                seq=prepared.seq,
                runs=runs,
                key_count=view.count,
                previous_index=None if state.previous_name is None else _previous_label(state.previous_name),
            )
            marker = inline_marker(index)
            context.metrics.increment("blobsnapshot.indexes.uploaded")  # inline: it goes up with the checkpoint
            crashpoint("blobsnapshot.upload.index_written")
            state.runs = list(runs)
            state.previous, state.previous_name = index, marker
            state.pending[marker] = index
            self._drop_stale_cache(state)
            context.metrics.record("blobsnapshot.runs.live", len(runs))
            return self.compactor.maybe_start(state, view), marker


def _previous_label(marker: str) -> str:
    """What an index records as its ``previous_index``: the previous index blob's name, or ``<seq:012d>-<token>`` of
    an inline previous index (a marker cannot hold another)."""
    return marker_label(marker).removeprefix("inline index ") if is_inline_marker(marker) else marker
