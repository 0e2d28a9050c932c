"""Admin of the changelog-delta backend: the blob store must exist and accept writes."""

from __future__ import annotations

import attrs

from statebackend.blobstores.admin import BlobStoreBackendAdmin
from statebackend.contracts import BackendContext, StateBackendAdmin

__all__ = ["ChangelogAdmin"]


@attrs.define
class ChangelogAdmin(BlobStoreBackendAdmin, StateBackendAdmin):
    context: BackendContext
