"""Backup side of the full-copy backend.

Per commit and store:

- ``snapshot()`` (task thread, O(1)): takes a read view on exactly the version the commit just flushed (the change
  set's ``read_view()``, which does not wait) and names the blob; the change set itself is not needed.
- ``upload()`` (commit pool): encodes the view's whole content into one blob (:mod:`sb_fullcopy.format`), writes it
  create-only, closes the view. The marker is the blob's name. This is the O(state) step.
- Blob lifetime: the framework's. :class:`FullCopyLifetime` states that a marker references one blob (the marker
  itself), and holds the blobs of snapshots not yet uploaded and the newest ``keep`` copies that checkpoints this
  manager completed named beyond those the log keeps (option ``fullcopy.keep``: older states to go back to by hand).
  The framework deletes the rest once the checkpoint log lets their checkpoints go, or after the grace period for
  blobs no checkpoint ever named. This backend writes no cleanup and no sweep.
"""

from __future__ import annotations

import logging
import threading
from collections import deque
from collections.abc import Mapping, Sequence
from concurrent.futures import Future

import attrs
from statebackend.checkpoint import CheckpointId, CheckpointV2

from sb_fullcopy.format import Header, blob_name, encode
from statebackend.contracts import BackendContext, BlobLifetime, StoreMarkers, TaskBackupManager
from statebackend.errors import AlreadyExistsError, UsageError
from statebackend.kit import close_when_ready, created_at_metadata
from statebackend.store import ChangeSet, ReadView

__all__ = ["FullCopyBackupManager", "FullCopyLifetime"]

log = logging.getLogger(__name__)


@attrs.define(eq=False)
class FullCopyBackupManager(TaskBackupManager):
    context: BackendContext
    #: unnamed older copies kept beyond those the checkpoint log names, per store (``fullcopy.keep``)
    keep: int = 0
    #: store -> (marker, read view) taken by snapshot() and not yet uploaded
    _views: dict[str, tuple[str, Future[ReadView]]] = attrs.field(init=False, factory=dict)
    #: store -> the blobs of the checkpoints completed last, newest last (``keep`` + the log's ``retained``)
    _completed: dict[str, deque[str]] = attrs.field(init=False, factory=dict)
    _lock: threading.Lock = attrs.field(init=False, factory=threading.Lock)
    _lifetime: FullCopyLifetime = attrs.field(init=False)

    @_lifetime.default
    def _make_lifetime(self) -> FullCopyLifetime:
        return FullCopyLifetime(self)

    def init(self, checkpoint: CheckpointV2 | None) -> None:
        """Nothing to adopt: every commit writes a whole copy, never building on an earlier blob."""

    def snapshot(self, checkpoint_id: CheckpointId, changes: Mapping[str, ChangeSet]) -> StoreMarkers:
        markers: StoreMarkers = {}
        for name in self.context.stores:
            change = changes[name]
            marker = blob_name(self.context.blob_prefix(name), change.version)
            with self._lock:
                abandoned = self._views.pop(name, None)  # its commit failed before upload()
                self._views[name] = (marker, change.read_view())
            if abandoned is not None:
                close_when_ready(abandoned[1])
            markers[name] = marker
        return markers

    def upload(self, checkpoint_id: CheckpointId, markers: StoreMarkers) -> Future[StoreMarkers]:
        # one pool task for all stores, kept simple; it waits only on read views, which the store's applier opens
        return self.context.executor.submit(self._upload_all, dict(markers))

    def blob_lifetime(self) -> FullCopyLifetime:
        return self._lifetime

    def checkpoint_completed(self, checkpoint_id: CheckpointId, markers: StoreMarkers) -> None:
        """Remember the copy each store's marker names, to hold the newest ``keep`` beyond the log's."""
        size = self.keep + self.context.checkpoint_log.retained
        with self._lock:
            for name, marker in markers.items():
                completed = self._completed.setdefault(name, deque(maxlen=max(1, size)))
                if marker not in completed:
                    completed.append(marker)

    def held(self, store: str) -> list[str]:
        """The copies of ``store`` the framework must keep though no retained checkpoint may name them: a snapshot
        not uploaded yet, and the newest ``keep`` copies completed checkpoints named."""
        with self._lock:
            held = [marker for name, (marker, _) in self._views.items() if name == store]
            if self.keep:
                held += list(self._completed.get(store, ()))
        return held

    def abort(self, checkpoint_id: CheckpointId) -> None:
        self._close_views()

    def close(self) -> None:
        self._close_views()

    # -- internals ----------------------------------------------------------------------------------------------

    def _upload_all(self, markers: StoreMarkers) -> StoreMarkers:
        for name, marker in markers.items():
            self._upload_store(name, marker)
        return markers

    def _upload_store(self, name: str, marker: str) -> None:
        with self._lock:
            taken = self._views.get(name)
            if taken is None or taken[0] != marker:
                raise UsageError(f"store {name}: no snapshot was taken for {marker}; call snapshot() first")
            del self._views[name]
        view = taken[1].result()
        try:
            if view.version is None:
                raise UsageError(f"store {name}: the snapshot for {marker} has no version")
            header = Header(
                job=self.context.job_name,
                task=self.context.task_name,
                store=name,
                checkpoint_id=view.version.checkpoint_id,
                token=view.version.token,
                records=0,
            )
            data = encode(header, view.items())
        finally:
            view.close()
        blob_store = self.context.blob_store
        # its age for the framework's grace rule, where the blob store keeps metadata
        metadata = created_at_metadata(self._lifetime.now()) if blob_store.supports_metadata else None
        try:
            blob_store.put(marker, data, create_only=True, metadata=metadata)
        except AlreadyExistsError:
            # a retried write whose first reply was lost: fine if the blob holds exactly these bytes
            if blob_store.get(marker) != data:
                raise
        self.context.metrics.increment("commit.bytes.uploaded", len(data))

    def _close_views(self) -> None:
        with self._lock:
            views, self._views = list(self._views.values()), {}
        for _, view in views:
            close_when_ready(view)


class FullCopyLifetime(BlobLifetime):
    """This backend's blobs, for the framework's collector: a marker names one blob, itself."""

    def __init__(self, manager: FullCopyBackupManager) -> None:
        super().__init__(manager.context)
        self.manager = manager

    def referenced_blobs(self, store: str, marker: str) -> list[str]:
        return [marker]

    def held_blobs(self, store: str) -> list[str]:
        return self.manager.held(store)

    def released(self, store: str, blobs: Sequence[str], *, swept: bool) -> None:
        self.manager.context.metrics.increment("fullcopy.blobs.deleted", len(blobs))
        log.debug("store %s: deleted %d copies no retained checkpoint names", store, len(blobs))
