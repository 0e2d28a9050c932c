"""Garbage of the blob-snapshot backend: retention after each durable checkpoint, and the mark-and-sweep of what
retention cannot see.

- **Retention** (``cleanup()``, after a checkpoint is durable): the index and its runs count as durable (bookkeeping
  only: their ``expires_at`` stays, since no sweep deletes a blob a retained checkpoint names, and rewriting the
  metadata cost a COPY per blob per commit), the index joins the window of the last ``task.checkpoint.retained``
  durable ones, and the runs only the indexes that fall out of it referenced (and their index blobs, for markers of
  older releases; an inline index goes with its checkpoint) become garbage, deleted with one ``delete_many`` when
  the checkpoint log lets its old checkpoints go (``CheckpointLog.trims``: every ``retention_interval`` commits, and
  at close), so no checkpoint the log still holds loses a blob. What is live again by then (a run a new index names)
  is kept.
- **Mark-and-sweep** (:meth:`BlobSnapshotGc.sweep`, every ``gc.interval.commits`` commits and at init with
  ``gc.on.init``): the mark is every index a checkpoint in the checkpoint log carries (inline in its marker) or
  names (an index blob, written by older releases) plus the ones this manager holds, and every run they, the chain
  and a running compaction reference; the sweep deletes unmarked index blobs, runs and schema-1 chunks that are
  already expired (``expires_at``) or old enough by the age rule of :mod:`statebackend.kit.gc`, and stops a quarter
  of the grace period after its mark. When a live index cannot be read, no run is deleted. Its listing of the runs
  also checks the chain: a run of the chain the blob store no longer holds (lost on its side) makes the next commit
  upload a base run.
"""

from __future__ import annotations

import logging
from collections import deque
from collections.abc import Mapping

import attrs
from statebackend.backends.blobsnapshot.format import (
    RunIndex,
    index_prefix,
    is_inline_marker,
    legacy_chunks_prefix,
    marker_label,
    marker_seq,
    run_name,
    runs_prefix,
)
from statebackend.backends.blobsnapshot.state import EXPIRES_AT, BlobSnapshotManagerState, StoreState

from statebackend.crashpoints import crashpoint
from statebackend.errors import CorruptDataError, IncompatibleFormatError, NotFoundError
from statebackend.kit import Mark, mark_referenced, sweep_unreferenced

__all__ = ["BlobSnapshotGc", "SweepReport"]

log = logging.getLogger(__name__)


@attrs.frozen
class SweepReport:
    """What one mark-and-sweep deleted (and whether it had to skip runs because a live index was unreadable)."""

    indexes_deleted: int = 0
    runs_deleted: int = 0
    runs_skipped: bool = False


class BlobSnapshotGc(BlobSnapshotManagerState):
    """Retention and the mark-and-sweep."""

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

    def _cleanup(self, markers: dict[str, str]) -> None:
        trims = self._checkpoint_log().trims
        trimming = trims != self._trims_seen  # the log lets its old checkpoints go now: their blobs go with them
        self._trims_seen = trims
        for name, marker in markers.items():
            state = self._states[name]
            with state.io_lock:
                self._cleanup_store(state, marker)
                state.cleanups += 1
                if trimming:
                    self._delete_garbage(state)
                # by the checkpoint's sequence number, not by cleanups in this process: a job that opens its task
                # for each batch (the Spark driver) sweeps every gc.interval.commits commits all the same
                seq = marker_seq(marker) or state.cleanups
                if self.gc_interval_commits and seq % self.gc_interval_commits == 0:
                    self._sweep_store(state, self.clock())

    def _cleanup_store(self, state: StoreState, marker: str) -> None:
        retained = dict(state.retained)
        index = state.pending.pop(marker, None) or retained.get(marker)
        if index is None:
            try:
                index = self._read_index(marker, state.name)
            except NotFoundError:
                # a late cleanup of a checkpoint that already fell out of retention: nothing left to do
                log.debug(
                    "store %s: cleanup of %s found it gone already",
                    state.name,
                    marker_label(marker),
                    extra=self._extra(state.name),
                )
                return
        self._make_durable(state, index)
        crashpoint("blobsnapshot.cleanup.durable")
        state.last_durable_seq = max(state.last_durable_seq, index.seq)
        if marker not in retained:
            state.retained.append((marker, index))
        self._settle_older_pending(state, index.seq)
        # cleanups may finish out of order on a pool: keep the window ordered by seq, newest last
        state.retained = deque(sorted(state.retained, key=lambda item: item[1].seq))
        dropped: list[tuple[str, RunIndex]] = []
        while len(state.retained) > max(1, self.retained):
            dropped.append(state.retained.popleft())
        for name, dropped_index in dropped:
            if not is_inline_marker(
                name
            ):  # an index blob of an older release; an inline index goes with its checkpoint
                state.garbage.add(name)
                state.released[name] = dropped_index
            state.garbage.update(run_name(state.prefix, digest) for digest in dropped_index.run_hashes())

    def _delete_garbage(self, state: StoreState) -> None:
        """Delete, in one request, the garbage retention left: what no live index, the chain or a compaction uses
        now (a run a newer index names again stays). Call with ``state.io_lock`` held."""
        if not state.garbage:
            return
        live = state.live_indexes()
        keep = set(live) | {run_name(state.prefix, digest) for index in live.values() for digest in index.run_hashes()}
        keep |= {run_name(state.prefix, run.hash) for run in (*state.runs, *state.compaction_inputs)}
        if state.compaction_output is not None:
            keep.add(run_name(state.prefix, state.compaction_output))
        state.garbage -= keep
        doomed = sorted(state.garbage)
        if not doomed:
            return
        self.context.blob_store.delete_many(doomed)
        crashpoint("blobsnapshot.cleanup.deleted")
        runs = runs_prefix(state.prefix)
        deleted_runs = [name for name in doomed if name.startswith(runs)]
        for name in deleted_runs:
            digest = name.rsplit("/", 1)[-1]
            state.uploaded.discard(digest)
            state.durable_runs.discard(digest)
        state.garbage.difference_update(doomed)
        for name in doomed:
            state.released.pop(name, None)
        self.context.metrics.increment("blobsnapshot.runs.deleted", len(deleted_runs))
        self.context.metrics.increment("blobsnapshot.indexes.deleted", len(doomed) - len(deleted_runs))

    def _settle_older_pending(self, state: StoreState, seq: int) -> None:
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
                log.info(
                    "store %s: index %s belongs to a checkpoint that landed although its write was reported "
                    "failed; kept as durable",
                    state.name,
                    marker_label(marker),
                    extra=self._extra(state.name),
                )
                self._make_durable(state, index)
                state.retained.append((marker, index))
                self.context.metrics.increment("blobsnapshot.indexes.landed.after.failure")
            else:
                log.debug(
                    "store %s: index %s belongs to a commit whose checkpoint never landed; the sweep deletes "
                    "its runs after the grace period",
                    state.name,
                    marker_label(marker),
                    extra=self._extra(state.name),
                )

    def _make_durable(self, state: StoreState, index: RunIndex) -> None:
        """A durable checkpoint names ``index``: its runs may be named again by any later index whatever their age
        (a sweep never deletes what a retained checkpoint names). Bookkeeping only: the blobs keep their
        ``expires_at``, which no sweep acts on while they are marked."""
        state.durable_runs |= index.run_hashes()

    def _sweep_store(self, state: StoreState, now: float) -> SweepReport:
        marked_at = self.clock()  # before the listing: the marks show the log as of then, at the latest
        live: dict[str, RunIndex | None] = dict(state.live_indexes(suspect_pending=False))
        for marker in self._markers_in_checkpoint_log(state.name):
            live.setdefault(marker, state.pending.get(marker))
        own = {run_name(state.prefix, run.hash) for run in (*state.runs, *state.compaction_inputs)}
        if state.compaction_output is not None:
            own.add(run_name(state.prefix, state.compaction_output))
        kept_seqs = [seq for m, _ in state.retained if (seq := marker_seq(m)) is not None]
        oldest_kept = min(kept_seqs) if kept_seqs else None

        def runs_named_by(marker: str) -> set[str] | None:
            """The runs of live index ``marker``; None (runs are left alone) when it cannot be read."""
            index = live[marker] or state.released.get(marker)  # one retention let go is not read again
            if index is None:
                try:
                    index = self._read_index(marker, state.name)
                except NotFoundError:
                    seq = marker_seq(marker)
                    if oldest_kept is not None and seq is not None and seq < oldest_kept:
                        # deleted by this manager's retention while the checkpoint log still lists it (the log is
                        # trimmed concurrently): no longer live, its runs were released with it
                        return set()
                    log.warning(
                        "store %s: sweep cannot find live index %s; runs are left alone",
                        state.name,
                        marker_label(marker),
                        extra=self._extra(state.name),
                    )
                    return None
                except (CorruptDataError, IncompatibleFormatError) as exc:
                    # its runs (or chunks) are unknown: deleting "unreferenced" ones could hurt it
                    log.warning(
                        "store %s: sweep cannot read live index %s (%s); runs are left alone",
                        state.name,
                        marker_label(marker),
                        exc,
                        extra=self._extra(state.name),
                    )
                    return None
            return index.blob_names(state.prefix)

        runs = mark_referenced(list(live), runs_named_by, at=marked_at, also=own)
        # the index blobs live markers name (older releases'); an inline marker is no blob
        indexes = Mark(frozenset(m for m in live if not is_inline_marker(m)), at=marked_at)

        def index_deleted(name: str) -> None:
            crashpoint("blobsnapshot.sweep.deleted")
            state.pending.pop(name, None)

        def run_deleted(name: str) -> None:
            crashpoint("blobsnapshot.sweep.deleted")
            digest = name.rsplit("/", 1)[-1]
            state.uploaded.discard(digest)
            state.durable_runs.discard(digest)

        blob_store = self.context.blob_store
        swept = [
            sweep_unreferenced(
                blob_store,
                index_prefix(state.prefix),
                indexes,
                self._grace,
                clock=self.clock,
                now=now,
                expired=_expired,
                on_deleted=index_deleted,
            )
        ]
        # runs, and the chunks of schema-1 snapshots once no live index is one (an incomplete mark sweeps nothing)
        for prefix in (runs_prefix(state.prefix), legacy_chunks_prefix(state.prefix)):
            if not swept[-1].stopped:
                swept.append(
                    sweep_unreferenced(
                        blob_store,
                        prefix,
                        runs,
                        self._grace,
                        clock=self.clock,
                        now=now,
                        expired=_expired,
                        on_deleted=run_deleted,
                    )
                )
        if len(swept) > 1 and runs.complete:
            self._check_chain_present(state, swept[1].listed)
        indexes_deleted = len(swept[0].deleted)
        runs_deleted = sum(len(s.deleted) for s in swept[1:])
        if any(s.stopped for s in swept):
            log.warning(
                "store %s: sweep ran longer than a quarter of the gc grace period since its mark; stopped "
                "(the next sweep marks anew)",
                state.name,
                extra=self._extra(state.name),
            )
        metrics = self.context.metrics
        metrics.increment("blobsnapshot.sweeps")
        metrics.increment("blobsnapshot.sweep.runs.deleted", runs_deleted)
        metrics.increment("blobsnapshot.sweep.indexes.deleted", indexes_deleted)
        if any(s.kept for s in swept):
            metrics.increment("blobsnapshot.sweep.kept", sum(len(s.kept) for s in swept))
        if runs_deleted or indexes_deleted:
            log.debug(
                "store %s: sweep deleted %d unreferenced runs and %d indexes",
                state.name,
                runs_deleted,
                indexes_deleted,
                extra=self._extra(state.name),
            )
        return SweepReport(indexes_deleted, runs_deleted, not runs.complete)

    def _check_chain_present(self, state: StoreState, listed: frozenset[str]) -> None:
        """A run of the chain that the sweep's listing of the runs did not show, and that a ``head()`` then does not
        find, was lost on the blob store's side (or never written, the reply that said so being another request's):
        the next commit uploads a base run, so no later checkpoint depends on it. The listing is the sweep's own, so
        this costs no request unless a run is missing from it."""
        blob_store = self.context.blob_store
        for run in list(state.runs):
            name = run_name(state.prefix, run.hash)
            if name in listed or run.hash not in state.uploaded:
                continue
            try:
                blob_store.head(name)
                continue
            except NotFoundError:
                pass
            self.context.metrics.increment("blobsnapshot.runs.missing")
            log.error(
                "store %s: run %s of the chain is missing from the blob store; the checkpoints that name it "
                "cannot be restored from blobsnapshot; the next commit uploads a base run",
                state.name,
                name,
                extra=self._extra(state.name),
            )
            state.uploaded.discard(run.hash)
            state.durable_runs.discard(run.hash)
            state.needs_base = True


def _expired(metadata: Mapping[str, str], now: float) -> bool:
    """Whether a blob's ``expires_at`` (seed 002: set at upload; no sweep acts on it while a checkpoint names the blob)
    has passed: an expired blob goes whatever its age. An unreadable expiry is no expiry."""
    value = metadata.get(EXPIRES_AT)
    if value is None:
        return False
    try:
        return float(value) <= now
    except ValueError:
        log.warning("blob metadata %s=%r is not a time; the blob is taken as not expired", EXPIRES_AT, value)
        return False
