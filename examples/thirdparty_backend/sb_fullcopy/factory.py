"""Factory of the full-copy backend: what the entry point ``fullcopy`` (group ``statebackend.backends``) names."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from sb_fullcopy.admin import FullCopyAdmin
from sb_fullcopy.backup import FullCopyBackupManager
from sb_fullcopy.restore import FullCopyRestoreManager
from statebackend.contracts import BackendContext, StateBackendFactory

__all__ = ["FullCopyStateBackendFactory"]


class FullCopyStateBackendFactory(StateBackendFactory):
    """A whole copy of each store per commit. O(state) per commit: an example, not for large state."""

    #: no ``fullcopy.*`` options; a backend declares its keys here with ``statebackend.config.OptionSpec``
    options: Mapping[str, Any] = {}

    def backup_manager(self, context: BackendContext) -> FullCopyBackupManager:
        return FullCopyBackupManager(context=context)

    def restore_manager(self, context: BackendContext) -> FullCopyRestoreManager:
        return FullCopyRestoreManager(context=context)

    def admin(self, context: BackendContext) -> FullCopyAdmin:
        return FullCopyAdmin(context=context)
