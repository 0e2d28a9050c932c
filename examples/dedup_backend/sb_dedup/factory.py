"""Factory of the dedup backend: what the entry point ``dedup`` (group ``statebackend.backends``) names, and its
admin."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import attrs

from sb_dedup.backup import DedupBackupManager, referenced_blobs
from sb_dedup.restore import DedupRestoreManager
from statebackend.config import OptionSpec, parse_int
from statebackend.contracts import DEFAULT_GRACE_MS, BackendContext, StateBackendAdmin, StateBackendFactory

__all__ = ["DedupAdmin", "DedupStateBackendFactory"]


class DedupStateBackendFactory(StateBackendFactory):
    """Content-addressed chunks shared across commits, a manifest per checkpoint. Subclasses (the mutants of
    :mod:`sb_dedup.mutants`) swap in their own manager classes."""

    backup_class: type[DedupBackupManager] = DedupBackupManager
    restore_class: type[DedupRestoreManager] = DedupRestoreManager

    #: the ``dedup.*`` keys (``stores.<name>.dedup.*`` for one store), validated by the framework
    options: Mapping[str, Any] = {
        "chunk.records": OptionSpec(
            parse_int(min=1), 256, "records per chunk at most: a commit rewrites the chunks whose key range it touched"
        ),
        "grace.ms": OptionSpec(
            parse_int(min=0),
            DEFAULT_GRACE_MS,
            "an unreferenced blob younger than this is kept (another attempt may be about to name it)",
        ),
        "sweep.interval.commits": OptionSpec(
            parse_int(min=0),
            100,
            "the framework sweeps the backend's blobs after every this many checkpoints (0: never)",
        ),
    }

    def backup_manager(self, context: BackendContext) -> DedupBackupManager:
        options = context.options
        return self.backup_class(
            context=context,
            chunk_records=options["chunk.records"],
            grace_ms=options["grace.ms"],
            sweep_interval_commits=options["sweep.interval.commits"],
        )

    def restore_manager(self, context: BackendContext) -> DedupRestoreManager:
        return self.restore_class(context=context)

    def admin(self, context: BackendContext) -> DedupAdmin:
        return DedupAdmin(context=context)


@attrs.define
class DedupAdmin(StateBackendAdmin):
    """The blob store is this backend's only resource; a marker's blobs are its manifest and the manifest's chunks."""

    context: BackendContext

    def create_resources(self) -> None:
        self.context.blob_store.create_resources()

    def validate_resources(self) -> None:
        self.context.blob_store.validate()

    def referenced_blobs(self, store: str, marker: str) -> set[str] | None:
        return set(referenced_blobs(self.context, store, marker))
