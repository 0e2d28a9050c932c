"""What the blob-snapshot backend states about its blobs, for the framework's collector (statebackend.kit.lifetime):
a marker references the runs its index lists (and, for an index blob of an older release, that blob); the manager
holds the indexes it knows live (retained, pending, the last one made) with their runs, its chain and a running
compaction; an unnamed blob whose ``expires_at`` passed goes whatever its age. Its prefixes are the index blobs',
the runs' and the schema-1 chunks'. This module deletes nothing: the notices keep the manager's bookkeeping (a
deleted run is no longer uploaded), its metrics, and check the chain against the sweep's listing of the runs."""

from __future__ import annotations

import contextlib
import logging
from collections.abc import Mapping, Sequence

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
from statebackend.backends.blobsnapshot.state import EXPIRES_AT, BlobSnapshotShared, StoreState

from statebackend.contracts import BlobLifetime, StoreMarkers
from statebackend.crashpoints import crashpoint
from statebackend.errors import NotFoundError
from statebackend.kit import LifetimeSweep, log_extra

__all__ = ["BlobSnapshotLifetime"]

log = logging.getLogger(__name__)


class BlobSnapshotLifetime(BlobLifetime):
    """The blob-snapshot manager's blobs (see the module docstring), read off the manager's
    :class:`BlobSnapshotShared`."""

    def __init__(self, shared: BlobSnapshotShared) -> None:
        settings = shared.settings
        super().__init__(
            shared.context,
            grace_ms=settings.grace_period_ms,
            sweep_interval_commits=settings.gc_interval_commits,
            sweep_on_init=settings.gc_on_init,
        )
        self.shared = shared

    def _state(self, store: str) -> StoreState:
        return self.shared.stores[store]

    def _index(self, state: StoreState, marker: str) -> RunIndex | None:
        """The index of ``marker`` as this manager knows it (no request), else ``None``."""
        known = dict(state.retained)
        return state.pending.get(marker) or known.get(marker) or state.released.get(marker)

    def referenced_blobs(self, store: str, marker: str) -> set[str] | None:
        state = self._state(store)
        index = self._index(state, marker)
        if index is None:
            try:
                index = self.shared.read_index(marker, store)
            except NotFoundError:
                kept = [seq for m, _ in state.retained if (seq := marker_seq(m)) is not None]
                seq = marker_seq(marker)
                if kept and seq is not None and seq < min(kept):
                    # deleted by retention while the checkpoint log still lists it (the log is trimmed
                    # concurrently): no longer live, its runs were released with it
                    return set()
                log.warning(
                    "store %s: cannot find live index %s; its blobs are left alone",
                    store,
                    marker_label(marker),
                    extra=log_extra(self.context, store),
                )
                return None
        names = index.blob_names(state.prefix)
        if not is_inline_marker(marker):
            names.add(marker)  # an index blob of an older release
        return names

    def stores(self) -> Sequence[str]:
        return list(self.shared.stores)

    def prefixes(self, store: str) -> Sequence[str]:
        prefix = self._state(store).prefix
        return (index_prefix(prefix), runs_prefix(prefix), legacy_chunks_prefix(prefix))

    def held_blobs(self, store: str) -> set[str]:
        state = self._state(store)
        held: set[str] = set()
        for marker, index in state.live_indexes().items():
            held |= index.blob_names(state.prefix)
            if not is_inline_marker(marker):
                held.add(marker)
        held |= {run_name(state.prefix, run.hash) for run in (*state.runs, *state.compaction_inputs)}
        if state.compaction_output is not None:
            held.add(run_name(state.prefix, state.compaction_output))
        return held

    def expired(self, metadata: Mapping[str, str], now: float) -> bool:
        """Whether a blob's ``expires_at`` (set at upload; no sweep acts on it while a checkpoint names the blob) has
        passed. An unreadable expiry is no expiry."""
        value = metadata.get(EXPIRES_AT)
        if value is None:
            return False
        try:
            return float(value) <= now
        except ValueError:
            log.warning("blob metadata %s=%r is not a time; the blob is taken as not expired", EXPIRES_AT, value)
            return False

    def sweep_due(self, seq: int, markers: StoreMarkers) -> bool:
        # by the checkpoint's index seq, not by commits in this process: a job that opens its task for each batch
        # (the Spark driver) sweeps every gc.interval.commits commits all the same
        interval = self.sweep_interval_commits
        if not interval:
            return False
        return any((marker_seq(marker) or seq) % interval == 0 for marker in markers.values())

    def now(self) -> float:
        return self.shared.clock()

    def guard(self, store: str) -> contextlib.AbstractContextManager[object]:
        return self._state(store).io_lock

    def released(self, store: str, blobs: Sequence[str], *, swept: bool) -> None:
        crashpoint("blobsnapshot.sweep.deleted" if swept else "blobsnapshot.cleanup.deleted")
        state = self._state(store)
        runs = runs_prefix(state.prefix)
        deleted_runs = [name for name in blobs if name.startswith(runs)]
        for name in deleted_runs:
            digest = name.rsplit("/", 1)[-1]
            state.uploaded.discard(digest)
            state.durable_runs.discard(digest)
        for name in blobs:
            state.pending.pop(name, None)
            state.released.pop(name, None)
        metrics = self.context.metrics
        indexes = sum(1 for name in blobs if name.startswith(index_prefix(state.prefix)))
        if swept:
            metrics.increment("blobsnapshot.sweep.runs.deleted", len(deleted_runs))
            metrics.increment("blobsnapshot.sweep.indexes.deleted", indexes)
        else:
            metrics.increment("blobsnapshot.runs.deleted", len(deleted_runs))
            metrics.increment("blobsnapshot.indexes.deleted", indexes)

    def swept(self, store: str, sweep: LifetimeSweep) -> None:
        metrics = self.context.metrics
        metrics.increment("blobsnapshot.sweeps")
        if sweep.kept:
            metrics.increment("blobsnapshot.sweep.kept", len(sweep.kept))
        state = self._state(store)
        listed = sweep.listed.get(runs_prefix(state.prefix))
        if sweep.complete and listed is not None:
            self._check_chain_present(state, listed)

    def _check_chain_present(self, state: StoreState, listed: frozenset[str]) -> None:
        """A run of the chain that the sweep's listing of the runs did not show, and that a ``head()`` then does not
        find, was lost on the blob store's side: the next commit uploads a base run, so no later checkpoint depends
        on it. The listing is the sweep's own, so this costs no request unless a run is missing from it."""
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
                extra=log_extra(self.context, state.name),
            )
            state.uploaded.discard(run.hash)
            state.durable_runs.discard(run.hash)
            state.needs_base = True
