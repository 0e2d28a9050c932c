"""Admin of the full-copy backend: its only resource is the blob store, so it asks the store itself."""

from __future__ import annotations

import attrs

from statebackend.contracts import BackendContext, StateBackendAdmin

__all__ = ["FullCopyAdmin"]


@attrs.define
class FullCopyAdmin(StateBackendAdmin):
    context: BackendContext

    def create_resources(self) -> None:
        self.context.blob_store.create_resources()

    def validate_resources(self) -> None:
        self.context.blob_store.validate()
