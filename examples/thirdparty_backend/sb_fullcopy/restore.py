"""Restore side of the full-copy backend.

For each store the marker names one blob. If the local store's version (checkpoint id + flush token, kept in its
LMDB meta) is the one the name stands for, the local data already is that checkpoint: nothing is downloaded.
Otherwise the blob is downloaded and verified whole (:func:`sb_fullcopy.format.decode`, then bound to its name and
this task), and only then bulk-loaded with ``LocalStore.replace_contents``: one LMDB transaction that drops the old
data, loads the records and sets the version, so a failure leaves the previous local state as it was.

A missing blob is a :class:`NotFoundError`, a damaged or misplaced one a :class:`CorruptDataError`; both name the
blob, and nothing of it is loaded.
"""

from __future__ import annotations

import logging
import time

import attrs
from statebackend.checkpoint import CheckpointV2

from sb_fullcopy.format import check_binding, decode, parse_blob_name
from statebackend.contracts import BackendContext, TaskRestoreManager
from statebackend.errors import CorruptDataError, NotFoundError
from statebackend.store import LocalStore

__all__ = ["FullCopyRestoreManager"]

log = logging.getLogger(__name__)


@attrs.define(eq=False)
class FullCopyRestoreManager(TaskRestoreManager):
    context: BackendContext
    _markers: dict[str, str] = attrs.field(init=False, factory=dict)

    def init(self, checkpoint: CheckpointV2 | None) -> None:
        markers = checkpoint.markers_for(self.context.factory_name) if checkpoint is not None else {}
        self._markers = {name: markers[name] for name in self.context.stores if name in markers}

    def restore(self) -> None:
        for name, store in self.context.stores.items():
            started = time.monotonic()
            marker = self._markers.get(name)
            if marker is None:
                store.replace_contents([], None)  # no state in the checkpoint: the store starts empty
            else:
                self._restore_store(name, store, marker)
            self.context.metrics.record("restore.store.ms", (time.monotonic() - started) * 1000.0)

    def _restore_store(self, name: str, store: LocalStore, marker: str) -> None:
        context = self.context
        prefix = context.blob_prefix(name)
        version = parse_blob_name(prefix, marker)
        if version is None:
            raise CorruptDataError(
                f"store {name}: the checkpoint's {context.factory_name} marker {marker!r} is not a full-copy blob of "
                f"this store (expected under {prefix}); restore an older checkpoint or from another backend's marker"
            )
        if store.version == version:
            context.metrics.increment("restore.stores.reused")
            log.info("store %s: local state already is %s", name, marker)
            return
        try:
            data = context.blob_store.get(marker)
        except NotFoundError as exc:
            raise NotFoundError(
                f"store {name}: blob {marker} that the checkpoint names is missing from "
                f"{context.blob_store.describe()}; restore an older checkpoint or from another backend's marker"
            ) from exc
        header, records = decode(data, name=marker)
        check_binding(header, name=marker, prefix=prefix, job=context.job_name, task=context.task_name, store=name)
        store.replace_contents(records, header.version)
        context.metrics.increment("restore.bytes", len(data))
        context.metrics.increment("restore.stores.full")
        log.info("store %s: restored %d records from %s", name, header.records, marker)
