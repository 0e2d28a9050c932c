"""Admin of the blob-snapshot backend: the blob store must exist and accept create-only writes, reads and deletes."""

from __future__ import annotations

import attrs

from statebackend.blobstores.admin import create_blob_store_resources, validate_blob_store
from statebackend.contracts import BackendContext, StateBackendAdmin

__all__ = ["BlobSnapshotAdmin"]


@attrs.define
class BlobSnapshotAdmin(StateBackendAdmin):
    context: BackendContext

    def create_resources(self) -> None:
        create_blob_store_resources(self.context.blob_store)

    def validate_resources(self) -> None:
        validate_blob_store(self.context.blob_store, probe_prefix=f"{self.context.job_name}/{self.context.task_name}/")
