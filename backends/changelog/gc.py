"""Garbage of the changelog backend: retention after each durable commit, and the mark-and-sweep of what retention
cannot see.

- **Retention** (``cleanup()``, after a commit is durable): keep the blobs the last ``task.checkpoint.retained``
  durable recipes (and the chain being built) need; what only older recipes needed is garbage, deleted with one
  ``delete_many`` when the checkpoint log lets its old checkpoints go (``CheckpointLog.trims``: every
  ``retention_interval`` commits, and at close), so no checkpoint the log still holds loses a blob; remove staged
  files no future commit uploads (never one in flight: :data:`statebackend.kit.IN_FLIGHT`).
- **Mark-and-sweep** (:meth:`ChangelogGc.sweep`, every ``gc.interval.commits`` commits): the mark is every blob a
  changelog marker of a checkpoint in the checkpoint log names, plus this manager's own chain, its retained recipes
  and a running background snapshot's blob; an unmarked delta or snapshot is deleted only when its seq is at or below
  the seq of the **newest** checkpoint's recipe (not the highest seq of any entry: after a replay, superseded
  checkpoints carry higher seqs than the head's chain) and it is old enough by the age rule of
  :mod:`statebackend.kit.gc` (``created_at`` metadata, else counted from this manager's first sighting), and only
  until a quarter of the grace period has passed since the mark.
"""

from __future__ import annotations

import logging
from collections import deque
from collections.abc import Iterable
from pathlib import Path

from statebackend.backends.changelog.lineage import ChangelogManagerState, Lineage, seq_of
from statebackend.backends.changelog.marker import Recipe
from statebackend.checkpoint import CheckpointV2

from statebackend.contracts import StoreMarkers
from statebackend.crashpoints import crashpoint
from statebackend.kit import IN_FLIGHT, mark_referenced, sweep_unreferenced

__all__ = ["ChangelogGc"]

log = logging.getLogger(__name__)


class ChangelogGc(ChangelogManagerState):
    """Retention and the mark-and-sweep."""

    def sweep(self) -> int:
        """Mark-and-sweep every store's blobs (see the module docstring). Returns the number of blobs deleted."""
        # (store, seq, marker) of every changelog marker of a store of this task in the log, for the mark
        logged: dict[str, list[tuple[str, int, str]]] = {name: [] for name in self._lineages}
        # the seq of the head checkpoint's recipe, per store (0: the head has none, nothing is deleted). Not the
        # highest seq of any entry: after a replay (a task restored an older checkpoint and wrote head + 1) the
        # superseded checkpoints carry higher seqs than the chain the head and its next owner build on.
        newest_seq: dict[str, int] = {name: 0 for name in self._lineages}
        marked_at = self.clock()  # before the listing: the marks show the log as of then, at the latest
        entries = self._checkpoint_log().entries(cached=True)  # its own checkpoints are not read back
        for entry in entries:
            if not isinstance(entry.checkpoint, CheckpointV2):
                continue
            for name, marker in entry.checkpoint.markers_for(self.context.factory_name).items():
                if name in logged:
                    logged[name].append((name, entry.seq, marker))

        def recipe_blobs(item: tuple[str, int, str]) -> Iterable[str]:
            name, seq, marker = item
            return Recipe.decode(
                marker, prefix=self._lineages[name].prefix, source=f"store {name} in checkpoint #{seq}"
            ).blob_names()

        marks = {name: mark_referenced(items, recipe_blobs, at=marked_at) for name, items in logged.items()}
        head = entries[-1] if entries else None
        if head is not None and isinstance(head.checkpoint, CheckpointV2):
            for name, marker in head.checkpoint.markers_for(self.context.factory_name).items():
                if name in newest_seq:
                    newest_seq[name] = Recipe.decode(
                        marker, prefix=self._lineages[name].prefix, source=f"store {name} in checkpoint #{head.seq}"
                    ).seq
        deleted = kept = 0
        stopped = False
        for name, lineage in self._lineages.items():
            with lineage.lock:
                own = {*lineage.recipe().blob_names(), *(n for r in lineage.retained for n in r.blob_names())}
                if lineage.background_name is not None:
                    own.add(lineage.background_name)
                limit = newest_seq[name]
            mark = marks[name].plus(own)

            def beyond_the_head(blob: str, limit: int = limit) -> bool:
                seq = seq_of(blob)
                return seq is None or seq > limit

            def still_unmarked(blob: str, lineage: Lineage = lineage) -> bool:
                with lineage.lock:  # checked again: a snapshot may have been adopted or started meanwhile
                    return blob not in lineage.recipe().blob_names() and blob != lineage.background_name

            for kind in ("delta/", "snapshot/"):
                swept = sweep_unreferenced(
                    self.context.blob_store,
                    lineage.prefix + kind,
                    mark,
                    self._grace,
                    clock=self.clock,
                    spare=beyond_the_head,
                    confirm=still_unmarked,
                )
                deleted += len(swept.deleted)
                kept += len(swept.kept)
                if swept.stopped:
                    stopped = True  # a checkpoint written since the mark may name blobs that are old by now
                    break
            if stopped:
                log.warning(
                    "task %s: changelog sweep ran longer than a quarter of the gc grace period since its "
                    "mark; stopped (the next sweep marks anew)",
                    self.context.task_name,
                    extra=self._log_extra(),
                )
                self.context.metrics.increment("changelog.sweep.stopped")
                break
        self.context.metrics.increment("changelog.sweeps")
        if kept:
            self.context.metrics.increment("changelog.sweep.kept", kept)
        if deleted:
            self.context.metrics.increment("changelog.sweep.deleted", deleted)
            log.debug(
                "task %s: changelog sweep deleted %d unreferenced blobs",
                self.context.task_name,
                deleted,
                extra=self._log_extra(),
            )
        return deleted

    def _cleanup(self, markers: StoreMarkers) -> None:
        for name, marker in markers.items():
            lineage = self._lineages[name]
            recipe = Recipe.decode(marker, prefix=lineage.prefix, source=f"store {name}")
            with lineage.lock:
                # idempotent and order-proof: a repeated or late cleanup must not take a slot of the window (that
                # would drop a recipe a retained checkpoint still needs); the window is ordered by seq, newest last
                if recipe not in lineage.retained:
                    lineage.retained.append(recipe)
                    lineage.retained = deque(sorted(lineage.retained, key=lambda r: r.seq))
                dropped: list[Recipe] = []
                while len(lineage.retained) > max(1, self.retained):
                    dropped.append(lineage.retained.popleft())
                # garbage a failed delete left behind stays here and goes with the next batch (delete is idempotent)
                lineage.garbage.update(n for r in dropped for n in r.blob_names())
            self._drop_abandoned_staged_files(lineage, recipe)
        trims = self._checkpoint_log().trims
        if trims != self._trims_seen:  # the log lets its old checkpoints go now: their blobs go with them
            self._trims_seen = trims
            self._delete_garbage()
        heads = [
            Recipe.decode(marker, prefix=self._lineages[name].prefix, source=f"store {name}").seq
            for name, marker in markers.items()
        ]
        if heads and self.gc_interval_commits and max(heads) % self.gc_interval_commits == 0:
            self.sweep()

    def _delete_garbage(self) -> None:
        """Delete, in one request for every store of this manager, what retention let go and nothing needs now: no
        retained recipe, the chain being built, nor a background snapshot in progress."""
        doomed: dict[str, list[str]] = {}
        for name, lineage in self._lineages.items():
            with lineage.lock:
                keep = {n for r in lineage.retained for n in r.blob_names()}
                keep.update(lineage.recipe().blob_names())
                if lineage.background_name is not None:
                    keep.add(lineage.background_name)
                lineage.garbage.difference_update(keep)
                if lineage.garbage:
                    doomed[name] = sorted(lineage.garbage)
        if not doomed:
            return
        self.context.blob_store.delete_many([blob for blobs in doomed.values() for blob in blobs])
        crashpoint("changelog.cleanup.deleted")
        for name, blobs in doomed.items():
            lineage = self._lineages[name]
            with lineage.lock:
                lineage.garbage.difference_update(blobs)
                for blob in blobs:
                    lineage.uploaded.discard(blob)
                    lineage.uploaded_at.pop(blob, None)
                    lineage.blob_bytes.pop(blob, None)
        self.context.metrics.increment("changelog.blobs.deleted", sum(len(blobs) for blobs in doomed.values()))

    def _drop_abandoned_staged_files(self, lineage: Lineage, durable: Recipe) -> None:
        """Staged deltas a re-base or an adopted snapshot left behind: at or below the durable head and not in its
        recipe, no future commit uploads them (files above the head may belong to the commit now running). A file in
        flight (being written or uploaded: a background snapshot's, whose seq is below the head while it uploads on
        a slow network) is never deleted."""
        needed = {Path(name).name for name in durable.blob_names()}
        for staged in list(lineage.staging.iterdir()):
            seq = seq_of(staged.name)
            if staged.name.endswith(".partial") or seq is None or seq > durable.seq or staged.name in needed:
                continue
            IN_FLIGHT.remove_unless_held(staged)
