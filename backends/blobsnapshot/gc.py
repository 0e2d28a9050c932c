"""Garbage of the blob-snapshot backend: retention after each durable checkpoint, and the mark-and-sweep of what
retention cannot see.

- **Retention** (``cleanup()``, after a checkpoint is durable): seed 002's remove-TTL (the index and its runs lose
  their ``expires_at``; their ``created_at`` restarts, so a collection by age of a blob that later falls out of
  retention still waits a grace period), the index joins the window of the last ``task.checkpoint.retained`` durable
  ones, and the indexes that fall out of it and the runs only they referenced are deleted.
- **Mark-and-sweep** (:meth:`BlobSnapshotGc.sweep`, every ``gc.interval.commits`` commits and at init with
  ``gc.on.init``): the mark is every index a checkpoint in the checkpoint log names plus the ones this manager holds,
  and every run they, the chain and a running compaction reference; the sweep deletes unmarked indexes, runs and
  schema-1 chunks that are already expired (``expires_at``) or old enough by the age rule of
  :mod:`statebackend.kit.gc`, and stops a quarter of the grace period after its mark. When a live index cannot be
  read, no run is deleted.
"""

from __future__ import annotations

import logging
from collections import deque
from collections.abc import Mapping

import attrs
from statebackend.backends.blobsnapshot.format import (
    RunIndex,
    index_prefix,
    legacy_chunks_prefix,
    parse_index_name,
    run_name,
    runs_prefix,
)
from statebackend.backends.blobsnapshot.state import DURABLE_AT, EXPIRES_AT, BlobSnapshotManagerState, StoreState

from statebackend.crashpoints import crashpoint
from statebackend.errors import CorruptDataError, IncompatibleFormatError, NotFoundError, StateBackendError
from statebackend.kit import Mark, created_at_metadata, mark_referenced, sweep_unreferenced

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

    def _cleanup_store(self, state: StoreState, marker: str) -> None:
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
                log.info("store %s: index %s belongs to a checkpoint that landed although its write was reported "
                         "failed; kept as durable", state.name, marker, extra=self._extra(state.name))
                self._make_durable(state, marker, index)
                state.retained.append((marker, index))
                self.context.metrics.increment("blobsnapshot.indexes.landed.after.failure")
            else:
                log.debug("store %s: index %s belongs to a commit whose checkpoint never landed; the sweep deletes "
                          "it after the grace period", state.name, marker, extra=self._extra(state.name))

    def _make_durable(self, state: StoreState, marker: str, index: RunIndex) -> None:
        """Seed 002's remove-TTL: a durable checkpoint's index and runs never expire."""
        blob_store = self.context.blob_store
        if not blob_store.supports_metadata:
            state.durable_runs |= index.run_hashes()
            return
        # the expiry goes; the age restarts now, so a collection by age (a sweep, `statebackend gc`) of a blob that
        # later falls out of retention still waits a grace period from here
        now = self.clock()
        durable = {**created_at_metadata(now), DURABLE_AT: f"{now:.3f}"}
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

    def _sweep_store(self, state: StoreState, now: float) -> SweepReport:
        marked_at = self.clock()  # before the listing: the marks show the log as of then, at the latest
        live: dict[str, RunIndex | None] = dict(state.live_indexes(suspect_pending=False))
        for marker in self._markers_in_checkpoint_log(state.name):
            live.setdefault(marker, state.pending.get(marker))
        own = {run_name(state.prefix, run.hash) for run in (*state.runs, *state.compaction_inputs)}
        if state.compaction_output is not None:
            own.add(run_name(state.prefix, state.compaction_output))
        kept_seqs = [parsed[0] for m, _ in state.retained if (parsed := parse_index_name(m)) is not None]
        oldest_kept = min(kept_seqs) if kept_seqs else None

        def runs_named_by(marker: str) -> set[str] | None:
            """The runs of live index ``marker``; None (runs are left alone) when it cannot be read."""
            index = live[marker]
            if index is None:
                try:
                    index = self._read_index(marker, state.name)
                except NotFoundError:
                    parsed = parse_index_name(marker)
                    if oldest_kept is not None and parsed is not None and parsed[0] < oldest_kept:
                        # deleted by this manager's retention while the checkpoint log still lists it (the log is
                        # trimmed concurrently): no longer live, its runs were released with it
                        return set()
                    log.warning("store %s: sweep cannot find live index %s; runs are left alone", state.name,
                                marker, extra=self._extra(state.name))
                    return None
                except (CorruptDataError, IncompatibleFormatError) as exc:
                    # its runs (or chunks) are unknown: deleting "unreferenced" ones could hurt it
                    log.warning("store %s: sweep cannot read live index %s (%s); runs are left alone",
                                state.name, marker, exc, extra=self._extra(state.name))
                    return None
            return index.blob_names(state.prefix)

        runs = mark_referenced(list(live), runs_named_by, at=marked_at, also=own)
        indexes = Mark(frozenset(live), at=marked_at)

        def index_deleted(name: str) -> None:
            crashpoint("blobsnapshot.sweep.deleted")
            state.pending.pop(name, None)

        def run_deleted(name: str) -> None:
            crashpoint("blobsnapshot.sweep.deleted")
            digest = name.rsplit("/", 1)[-1]
            state.uploaded.discard(digest)
            state.durable_runs.discard(digest)

        blob_store = self.context.blob_store
        swept = [sweep_unreferenced(blob_store, index_prefix(state.prefix), indexes, self._grace, clock=self.clock,
                                    now=now, expired=_expired, on_deleted=index_deleted)]
        # runs, and the chunks of schema-1 snapshots once no live index is one (an incomplete mark sweeps nothing)
        for prefix in (runs_prefix(state.prefix), legacy_chunks_prefix(state.prefix)):
            if not swept[-1].stopped:
                swept.append(sweep_unreferenced(blob_store, prefix, runs, self._grace, clock=self.clock, now=now,
                                                expired=_expired, on_deleted=run_deleted))
        indexes_deleted = len(swept[0].deleted)
        runs_deleted = sum(len(s.deleted) for s in swept[1:])
        if any(s.stopped for s in swept):
            log.warning("store %s: sweep ran longer than a quarter of the gc grace period since its mark; stopped "
                        "(the next sweep marks anew)", state.name, extra=self._extra(state.name))
        metrics = self.context.metrics
        metrics.increment("blobsnapshot.sweeps")
        metrics.increment("blobsnapshot.sweep.runs.deleted", runs_deleted)
        metrics.increment("blobsnapshot.sweep.indexes.deleted", indexes_deleted)
        if runs_deleted or indexes_deleted:
            log.debug("store %s: sweep deleted %d unreferenced runs and %d indexes", state.name, runs_deleted,
                      indexes_deleted, extra=self._extra(state.name))
        return SweepReport(indexes_deleted, runs_deleted, not runs.complete)


def _expired(metadata: Mapping[str, str], now: float) -> bool:
    """Whether a blob's ``expires_at`` (seed 002: set at upload, removed once a durable checkpoint names the blob)
    has passed: an expired blob goes whatever its age. An unreadable expiry is no expiry."""
    value = metadata.get(EXPIRES_AT)
    if value is None:
        return False
    try:
        return float(value) <= now
    except ValueError:
        log.warning("blob metadata %s=%r is not a time; the blob is taken as not expired", EXPIRES_AT, value)
        return False
