"""Backup side of the full-copy backend.

Per commit and store:

- ``snapshot()`` (task thread, O(1)): takes a read view on exactly the version the commit just flushed (the change
  set's ``read_view()``, which does not wait) and names the blob; the change set itself is not needed.
- ``upload()`` (commit pool): encodes the view's whole content into one blob (:mod:`sb_fullcopy.format`), writes it
  create-only, closes the view. The marker is the blob's name. This is the O(state) step.
- ``cleanup()`` (commit pool, after the checkpoint is durable): deletes this store's blobs older than the commit that
  are not named by a checkpoint still in the task's checkpoint log (the log keeps ``task.checkpoint.retained``
  checkpoints, and its listing never shows less than the newest durable one), but for the newest ``keep`` of them
  (option ``fullcopy.keep``). Newer blobs (a later commit's upload running concurrently) are never touched.
  Idempotent.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Mapping
from concurrent.futures import Future

import attrs
from statebackend.checkpoint import CheckpointId, CheckpointV2

from sb_fullcopy.format import Header, blob_name, encode, parse_blob_name
from statebackend.contracts import BackendContext, StoreMarkers, TaskBackupManager
from statebackend.errors import AlreadyExistsError, UsageError
from statebackend.kit import close_when_ready
from statebackend.store import ChangeSet, ReadView

__all__ = ["FullCopyBackupManager"]

log = logging.getLogger(__name__)


@attrs.define(eq=False)
class FullCopyBackupManager(TaskBackupManager):
    context: BackendContext
    #: unnamed older copies a cleanup leaves, per store (``fullcopy.keep``)
    keep: int = 0
    #: store -> (marker, read view) taken by snapshot() and not yet uploaded
    _views: dict[str, tuple[str, Future[ReadView]]] = attrs.field(init=False, factory=dict)
    _lock: threading.Lock = attrs.field(init=False, factory=threading.Lock)

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

    def cleanup(self, checkpoint_id: CheckpointId, markers: StoreMarkers) -> Future[None]:
        return self.context.executor.submit(self._cleanup, checkpoint_id, dict(markers))

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
        try:
            blob_store.put(marker, data, create_only=True)
        except AlreadyExistsError:
            # a retried write whose first reply was lost: fine if the blob holds exactly these bytes
            if blob_store.get(marker) != data:
                raise
        self.context.metrics.increment("commit.bytes.uploaded", len(data))

    def _cleanup(self, checkpoint_id: CheckpointId, markers: StoreMarkers) -> None:
        blob_store = self.context.blob_store
        current = checkpoint_id.sortable()
        referenced = set(markers.values())
        for entry in self.context.checkpoint_log.entries():
            if isinstance(entry.checkpoint, CheckpointV2):
                referenced.update(entry.checkpoint.markers_for(self.context.factory_name).values())
        for name in markers:
            prefix = self.context.blob_prefix(name)
            older: list[str] = []  # in checkpoint order: the listing is sorted, and names sort like their ids
            for blob in list(blob_store.list(prefix)):
                version = parse_blob_name(prefix, blob)
                if version is None or blob in referenced:
                    continue
                if CheckpointId.parse(version.checkpoint_id).sortable() < current:
                    older.append(blob)
            for blob in older[: max(0, len(older) - self.keep)]:
                blob_store.delete(blob)
                self.context.metrics.increment("fullcopy.blobs.deleted")
                log.debug("store %s: deleted %s, which no retained checkpoint names", name, blob)

    def _close_views(self) -> None:
        with self._lock:
            views, self._views = list(self._views.values()), {}
        for _, view in views:
            close_when_ready(view)
