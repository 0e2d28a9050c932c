"""What the changelog backend states about its blobs, for the framework's collector (statebackend.kit.lifetime):
the deltas and the snapshot a recipe names, what the manager holds (its chain, the recipes it retains, a background
snapshot being written), and that a blob whose seq is beyond the newest checkpoint's recipe is kept (after a replay,
superseded checkpoints carry higher seqs than the head's chain, and the next owner builds on the head's). This
module deletes nothing: the framework releases and sweeps; the notices here keep the manager's bookkeeping and
metrics."""

from __future__ import annotations

import logging
from collections.abc import Sequence

from statebackend.backends.changelog.lineage import ChangelogShared, seq_of
from statebackend.backends.changelog.marker import Recipe
from statebackend.checkpoint import CheckpointV2

from statebackend.contracts import BlobLifetime, StoreMarkers
from statebackend.crashpoints import crashpoint
from statebackend.kit import LifetimeSweep, log_extra

__all__ = ["ChangelogLifetime"]

log = logging.getLogger(__name__)


class ChangelogLifetime(BlobLifetime):
    """The changelog manager's blobs (see the module docstring), read off the manager's :class:`ChangelogShared`."""

    def __init__(self, shared: ChangelogShared) -> None:
        super().__init__(
            shared.context,
            grace_ms=shared.settings.gc_grace_period_ms,
            sweep_interval_commits=shared.settings.gc_interval_commits,
        )
        self.shared = shared
        #: (store, marker) -> the seq of the recipe of a head checkpoint, decoded once per head
        self._head_seqs: dict[tuple[str, str], int] = {}

    def _recipe(self, store: str, marker: str, source: str = "") -> Recipe:
        return Recipe.decode(marker, prefix=self.context.blob_prefix(store), source=source or f"store {store}")

    def referenced_blobs(self, store: str, marker: str) -> list[str]:
        return list(self._recipe(store, marker).blob_names())

    def stores(self) -> Sequence[str]:
        return list(self.shared.stores)

    def prefixes(self, store: str) -> Sequence[str]:
        prefix = self.shared.stores[store].prefix
        return (prefix + "delta/", prefix + "snapshot/")

    def held_blobs(self, store: str) -> list[str]:
        lineage = self.shared.stores[store]
        with lineage.lock:
            held = [*lineage.recipe().blob_names(), *(n for r in lineage.retained for n in r.blob_names())]
            if lineage.background_name is not None:
                held.append(lineage.background_name)
        return held

    def spare(self, store: str, blob: str, head: CheckpointV2 | None) -> bool:
        limit = 0  # the head has no recipe of this store: nothing is deleted
        marker = head.markers_for(self.context.factory_name).get(store) if head is not None else None
        if marker is not None:
            key = (store, marker)
            if key not in self._head_seqs:
                self._head_seqs = {key: self._recipe(store, marker, f"store {store} in the newest checkpoint").seq}
            limit = self._head_seqs[key]
        seq = seq_of(blob)
        return seq is None or seq > limit

    def sweep_due(self, seq: int, markers: StoreMarkers) -> bool:
        # by the recipes' seqs, not by commits in this process: a job that opens its task for each batch (the Spark
        # driver) sweeps every gc.interval.commits commits all the same
        heads = [self._recipe(name, marker).seq for name, marker in markers.items()]
        interval = self.sweep_interval_commits
        return bool(heads) and bool(interval) and max(heads) % interval == 0

    def now(self) -> float:
        return self.shared.clock()

    def released(self, store: str, blobs: Sequence[str], *, swept: bool) -> None:
        if not swept:
            crashpoint("changelog.cleanup.deleted")
        lineage = self.shared.stores[store]
        with lineage.lock:
            for blob in blobs:
                lineage.uploaded.discard(blob)
                lineage.uploaded_at.pop(blob, None)
                lineage.blob_bytes.pop(blob, None)
        metrics = self.context.metrics
        metrics.increment("changelog.sweep.deleted" if swept else "changelog.blobs.deleted", len(blobs))

    def swept(self, store: str, sweep: LifetimeSweep) -> None:
        metrics = self.context.metrics
        metrics.increment("changelog.sweeps")
        if sweep.kept:
            metrics.increment("changelog.sweep.kept", len(sweep.kept))
        if sweep.stopped:
            metrics.increment("changelog.sweep.stopped")
        if sweep.deleted:
            log.debug(
                "task %s: changelog sweep deleted %d unreferenced blobs of store %s",
                self.context.task_name,
                len(sweep.deleted),
                store,
                extra=log_extra(self.context, store),
            )
