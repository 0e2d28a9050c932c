"""Admin of the blob-snapshot backend: the blob store must exist and accept create-only writes, reads and deletes."""

from __future__ import annotations

import attrs

from statebackend.blobstores.admin import BlobStoreBackendAdmin
from statebackend.contracts import BackendContext, StateBackendAdmin

__all__ = ["BlobSnapshotAdmin"]


@attrs.define
class BlobSnapshotAdmin(BlobStoreBackendAdmin, StateBackendAdmin):
    context: BackendContext
