"""Backup side of the changelog-delta backend (seeds 000 and 001).

Per commit and store, ``snapshot()`` (sync, O(1) besides bookkeeping) appends a step to the store's recipe and
``upload()`` (async) encodes the commit's change set into one delta file and uploads it create-only. Every
``snapshot.interval.commits`` commits or ``snapshot.interval.bytes`` delta bytes, a background job materializes a
snapshot of a committed version from an LMDB read transaction (processing goes on meanwhile); the next commit after
it is durable starts its recipe from that snapshot, which lets older deltas go.

The framework owns the lifetime of these blobs (statebackend.kit.lifetime; what this backend states: lifetime.py).
Blobs retention lets go are released when the checkpoint log trims; garbage that retention cannot see (deltas of
commits that died before their checkpoint write, snapshots never adopted, files only checkpoints of an earlier
process needed) is swept every ``gc.interval.commits`` commits: the mark is every blob named by a changelog marker of
a checkpoint in the checkpoint log plus this manager's own chain. An unmarked blob is deleted only when both hold:

- its sequence number is at or below the seq of the **newest** checkpoint's recipe (the log's head; not the highest
  seq of any entry: after a replay, superseded checkpoints carry higher seqs than the head's chain);
- it is older than ``gc.grace.period.ms`` by the age rule of :mod:`statebackend.kit.gc` (age from its
  ``created_at`` metadata, written at upload; where that cannot be read, from the time this manager's sweep first saw
  it).

The grace period is the general guard: another attempt of the task (a failover owner, a Spark replay that builds on
an older checkpoint, below the head's seq) may be between its upload and its checkpoint write, and its blobs are
young. Both sides keep to a bound so that holds however long a sweep or a chain lives: a sweep stops deleting once
``grace / 4`` has passed since its mark (its marks may be stale), and a commit never names a blob it did not upload
itself that no checkpoint it knows durable names, unless the blob is younger than ``grace / 2``: such a blob (a
delta of a commit whose checkpoint write failed, reused much later; a finished snapshot adopted late) fails the
commit, and the next one re-bases on a fresh snapshot. A finished snapshot older than that is not adopted.

The manager is one class that holds small helpers around one shared state (:class:`ChangelogShared`, lineage.py: the
context, the options, the clock, each store's lineage): the uploader of a commit's recipe (upload.py), the background
snapshots (snapshots.py), what it states about its blobs (lifetime.py). Each helper is handed the shared state when
the manager makes it, and the background snapshots the uploader; none reaches into another. This module holds the
contract's methods and the retention window of recipes it keeps (``checkpoint_completed``).

Failure handling: a delta whose upload failed stays staged on local disk and is uploaded again by the next commit,
whose recipe still lists it. If a delta could not even be encoded, the chain is broken and the next commit re-bases
on a fresh snapshot of its own version. Retention: ``checkpoint_completed`` keeps the recipes of the last
``task.checkpoint.retained`` durable checkpoints (held from the framework's collector) and removes staged files no
future commit uploads; the framework deletes what only older ones needed, in one request when the checkpoint log lets
its old checkpoints go (every ``retention_interval`` commits, and at close).
"""

from __future__ import annotations

import contextlib
import logging
from collections import deque
from collections.abc import Mapping
from concurrent.futures import CancelledError, Future
from contextlib import ExitStack
from pathlib import Path

from statebackend.backends.changelog.lifetime import ChangelogLifetime
from statebackend.backends.changelog.lineage import STAGING_DIR, ChangelogSettings, ChangelogShared, Lineage, seq_of
from statebackend.backends.changelog.marker import Recipe, Step, delta_name, snapshot_name
from statebackend.backends.changelog.snapshots import (
    UNKNOWN_SIZES_INTERVAL_COMMITS,
    BackgroundSnapshots,
    maintenance_pool,
)
from statebackend.backends.changelog.upload import ChangelogUpload
from statebackend.checkpoint import CheckpointId, CheckpointV2

from statebackend.concurrency import gather
from statebackend.contracts import BackendContext, StoreMarkers, TaskBackupManager
from statebackend.kit import IN_FLIGHT, close_when_ready, collector_of, log_extra
from statebackend.store import ChangeSet

__all__ = [
    "STAGING_DIR",
    "UNKNOWN_SIZES_INTERVAL_COMMITS",
    "ChangelogBackupManager",
    "ChangelogSettings",
    "delta_name",
    "maintenance_pool",
    "snapshot_name",
]

log = logging.getLogger(__name__)


class ChangelogBackupManager(TaskBackupManager):
    """The changelog backend's backup manager: the contract's methods, over the helpers it holds (see the module
    docstring)."""

    def __init__(self, context: BackendContext, settings: ChangelogSettings) -> None:
        #: what the manager and its helpers share: context, options, clock (tests may replace it), each store's lineage
        self.shared = ChangelogShared(context, settings)
        #: stages and uploads deltas and snapshots (the commit's, and the background snapshots')
        self.uploader = ChangelogUpload(self.shared)
        self.snapshots = BackgroundSnapshots(self.shared, self.uploader)
        #: what this manager states about its blobs; the framework's collector of them hangs off it
        self.lifetime = ChangelogLifetime(self.shared)

    def init(self, checkpoint: CheckpointV2 | None) -> None:
        markers = checkpoint.markers_for(self.shared.context.factory_name) if checkpoint is not None else {}
        for name, store in self.shared.context.stores.items():
            staging = Path(store.path) / STAGING_DIR
            staging.mkdir(exist_ok=True)
            for stale in staging.iterdir():  # left by a crashed process (its commits never became durable), not in
                IN_FLIGHT.remove_unless_held(stale)  # flight for an earlier open in this process whose close timed out
            lineage = Lineage(name=name, store=store, prefix=self.shared.context.blob_prefix(name), staging=staging)
            recipe = (
                Recipe.decode(markers[name], prefix=lineage.prefix, source=f"store {name}") if name in markers else None
            )
            head = recipe.head if recipe is not None else None
            # which backend restored the store at open (absent: a context built outside TaskStorage, taken as this
            # one). Restored by another backend (this one's restore failed: a blob of the chain may be missing), the
            # store's version equals the recipe head's, yet the chain must not be continued.
            restorer = self.shared.context.restored_by.get(name, self.shared.context.factory_name)
            ours = restorer == self.shared.context.factory_name
            if ours and recipe is not None and head is not None and head.version == store.version:
                lineage.seq, lineage.base, lineage.deltas = recipe.seq, recipe.snapshot, list(recipe.deltas)
                lineage.uploaded.update(recipe.blob_names())
                lineage.retained.append(recipe)
                collector_of(self.lifetime).adopt(0, {name: markers[name]})  # released once later ones push it out
                lineage.commits_since_snapshot = len(recipe.deltas)
                self.snapshots.adopt_at_open(lineage)
                self.snapshots.look_up_sizes(lineage)
            elif store.version is None and store.count() == 0 and (recipe is None or recipe.seq == 0):
                lineage.seq = 0  # an empty store and no chain yet: the chain starts empty, its first delta at seq 1
            else:
                # Restored by another backend (migration, or a fallback after this backend's restore failed) or the
                # marker is for other data: start a new chain from a snapshot of the state at the first commit. So
                # too for an empty store whose recipe is past seq 0: deltas after seq 1 without a snapshot are what a
                # recipe whose snapshot was removed looks like, and restore refuses them.
                if recipe is not None and not ours:
                    log.warning(
                        "store %s: restored by the %s backend, not from this backend's recipe; the changelog "
                        "chain starts anew from a snapshot at the next commit",
                        name,
                        restorer,
                        extra=log_extra(self.shared.context, name),
                    )
                    self.shared.context.metrics.increment("changelog.rebase.after.fallback")
                lineage.seq = recipe.seq if recipe is not None else 0
                lineage.base = None
                lineage.deltas = []
                lineage.rebase_view = None
                lineage.commits_since_snapshot = -1  # forces a re-base at the first commit
            self.shared.stores[name] = lineage

    def snapshot(self, checkpoint_id: CheckpointId, changes: Mapping[str, ChangeSet]) -> StoreMarkers:
        markers: StoreMarkers = {}
        for name, lineage in self.shared.stores.items():
            change = changes[name]
            with lineage.lock:
                self.snapshots.adopt(lineage)
                lineage.seq += 1
                version = change.version
                if lineage.commits_since_snapshot < 0:
                    # re-base: the recipe is one snapshot of this very version, written by upload()
                    lineage.rebase_view = change.read_view()  # future: opened once the flush is applied
                    step = Step(
                        lineage.seq,
                        version.checkpoint_id,
                        version.token,
                        snapshot_name(lineage.prefix, lineage.seq, version.token),
                    )
                    lineage.base, lineage.deltas = step, []
                    lineage.commits_since_snapshot = 0
                    lineage.bytes_since_snapshot = 0
                else:
                    name_or_none = delta_name(lineage.prefix, lineage.seq, version.token) if len(change) else None
                    step = Step(lineage.seq, version.checkpoint_id, version.token, name_or_none)
                    lineage.deltas.append(step)
                    if name_or_none is not None:
                        lineage.to_encode[name_or_none] = change
                    lineage.commits_since_snapshot += 1
                    lineage.bytes_since_snapshot += change.raw_bytes
                    self.snapshots.start_if_due(lineage, change)
                markers[name] = lineage.recipe().encode(prefix=lineage.prefix)
        return markers

    def upload(self, checkpoint_id: CheckpointId, markers: StoreMarkers) -> Future[StoreMarkers]:
        return gather(
            {
                name: self.shared.context.executor.submit(self.uploader.upload_store, self.shared.stores[name], marker)
                for name, marker in markers.items()
            }
        )

    def blob_lifetime(self) -> ChangelogLifetime:
        return self.lifetime

    def sweep(self) -> int:
        """Sweep every store's blobs now (the framework's collector; see the module docstring). Returns the number of
        blobs deleted."""
        return sum(len(result.deleted) for result in collector_of(self.lifetime).sweep().values())

    def checkpoint_completed(self, checkpoint_id: CheckpointId, markers: StoreMarkers) -> None:
        """Retention's bookkeeping: keep the recipes of the last ``retained`` durable checkpoints (held from the
        collector), and remove the staged files no future commit uploads. Idempotent and order-proof."""
        for name, marker in markers.items():
            lineage = self.shared.stores[name]
            recipe = Recipe.decode(marker, prefix=lineage.prefix, source=f"store {name}")
            with lineage.lock:
                # a repeated or late notice must not take a slot of the window (that would drop a recipe a retained
                # checkpoint still needs); the window is ordered by seq, newest last
                if recipe not in lineage.retained:
                    lineage.retained.append(recipe)
                    lineage.retained = deque(sorted(lineage.retained, key=lambda r: r.seq))
                while len(lineage.retained) > max(1, self.shared.settings.retained):
                    lineage.retained.popleft()
            self._drop_abandoned_staged_files(lineage, recipe)

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

    def abort(self, checkpoint_id: CheckpointId) -> None:
        """A snapshot of this commit failed (another backend's, before or after ours ran): the commit flushed every
        store, but the change sets are closed, so the chain cannot get this commit's delta (nor, when ours never
        ran, even a step for it). Re-base on a fresh snapshot at the next commit."""
        for lineage in self.shared.stores.values():
            with lineage.lock:
                lineage.to_encode.clear()
                if lineage.rebase_view is not None:
                    close_when_ready(lineage.rebase_view)
                    lineage.rebase_view = None
                lineage.commits_since_snapshot = -1

    def cancel_background(self) -> None:
        """Stop the background snapshots (see the contract), unless a chain has reached
        ``snapshot.interval.commits`` (the cap): then its snapshot has been put off long enough and close waits for
        it, so handovers that keep interrupting snapshots cannot let a chain grow without bound."""
        with ExitStack() as held:
            for lineage in self.shared.stores.values():
                held.enter_context(lineage.lock)
            if all(
                lineage.commits_since_snapshot < self.shared.settings.snapshot_interval_commits
                for lineage in self.shared.stores.values()
            ):
                self.shared.cancellation.cancel()

    def close(self) -> None:
        if self.shared.closed:
            return
        self.shared.closed = True
        for lineage in self.shared.stores.values():
            background = lineage.background
            if background is not None:
                with contextlib.suppress(CancelledError):  # a cancelled job
                    background.exception()  # the read view must not outlive the store
            if lineage.rebase_view is not None:
                close_when_ready(lineage.rebase_view)
                lineage.rebase_view = None
