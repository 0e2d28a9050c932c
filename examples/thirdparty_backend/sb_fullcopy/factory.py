"""Factory of the full-copy backend: what the entry point ``fullcopy`` (group ``statebackend.backends``) names."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from sb_fullcopy.admin import FullCopyAdmin
from sb_fullcopy.backup import FullCopyBackupManager
from sb_fullcopy.restore import FullCopyRestoreManager
from statebackend.config import OptionSpec, parse_int
from statebackend.contracts import BackendContext, StateBackendFactory

__all__ = ["FullCopyStateBackendFactory"]


class FullCopyStateBackendFactory(StateBackendFactory):
    """A whole copy of each store per commit. O(state) per commit: an example, not for large state."""

    #: the ``fullcopy.*`` keys, declared with ``statebackend.config.OptionSpec``; statebackend validates them and
    #: hands them over parsed, defaults filled, as ``BackendContext.options``. Each may be set for one store too
    #: (``stores.<name>.fullcopy.keep``): the framework then gives that store a manager of its own
    options: Mapping[str, Any] = {
        "keep": OptionSpec(
            parse_int(min=0),
            0,
            "whole copies of a store kept beyond those the checkpoint log names, newest first: older states to "
            "go back to by hand (0: none)",
        ),
    }

    def backup_manager(self, context: BackendContext) -> FullCopyBackupManager:
        return FullCopyBackupManager(context=context, keep=context.options["keep"])

    def restore_manager(self, context: BackendContext) -> FullCopyRestoreManager:
        return FullCopyRestoreManager(context=context)

    def admin(self, context: BackendContext) -> FullCopyAdmin:
        return FullCopyAdmin(context=context)
