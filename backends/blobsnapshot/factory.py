"""Factory of the blob-snapshot backend (short name ``blobsnapshot``)."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from statebackend.backends.blobsnapshot.admin import BlobSnapshotAdmin
from statebackend.backends.blobsnapshot.backup import BlobSnapshotBackupManager
from statebackend.backends.blobsnapshot.restore import BlobSnapshotRestoreManager

from statebackend.config import OptionSpec, parse_bool, parse_bytes, parse_duration_ms, parse_int
from statebackend.contracts import BackendContext, StateBackendFactory

__all__ = ["BlobSnapshotStateBackendFactory"]


class BlobSnapshotStateBackendFactory(StateBackendFactory):
    """Whole-environment snapshots cut into content-addressed chunks, with an index blob per snapshot."""

    options: Mapping[str, Any] = {
        "chunk.size": OptionSpec(
            parse_bytes(min=64 << 10, max=256 << 20), 4 << 20, "size of the chunks a snapshot file is cut into"),
        "upload.concurrency": OptionSpec(parse_int(min=1, max=64), 4, "parallel chunk uploads per store"),
        "restore.download.concurrency": OptionSpec(parse_int(min=1, max=64), 8, "parallel chunk downloads per restore"),
        "gc.grace.period.ms": OptionSpec(
            parse_duration_ms(min=0), 3_600_000, "an unreferenced chunk or index younger than this is left alone"),
        "gc.interval.commits": OptionSpec(
            parse_int(min=0), 100, "run the mark-and-sweep every this many commits (0: only when the task starts)"),
        "gc.on.init": OptionSpec(
            parse_bool(), False,
            "also sweep in the background when the task starts (off: a job that opens its task per batch would "
            "sweep every batch)"),
        "ttl.ms": OptionSpec(
            parse_duration_ms(min=1), 7 * 24 * 3_600_000,
            "expiry written on new chunks and indexes; removed once a durable checkpoint uses them"),
    }

    def backup_manager(self, context: BackendContext) -> BlobSnapshotBackupManager:
        options = _with_defaults(context.options, self.options)
        return BlobSnapshotBackupManager(
            context=context,
            chunk_size=options["chunk.size"],
            upload_concurrency=options["upload.concurrency"],
            retained=context.checkpoint_log.retained,
            grace_period_ms=options["gc.grace.period.ms"],
            ttl_ms=options["ttl.ms"],
            gc_interval_commits=options["gc.interval.commits"],
            gc_on_init=options["gc.on.init"],
        )

    def restore_manager(self, context: BackendContext) -> BlobSnapshotRestoreManager:
        options = _with_defaults(context.options, self.options)
        return BlobSnapshotRestoreManager(context=context, download_concurrency=options["restore.download.concurrency"])

    def admin(self, context: BackendContext) -> BlobSnapshotAdmin:
        return BlobSnapshotAdmin(context=context)


def _with_defaults(given: Mapping[str, Any], specs: Mapping[str, Any]) -> dict[str, Any]:
    """The options as validated by config, with defaults for any the caller's context left out (a hand-built
    context in a test or a tool)."""
    options = {key: spec.default_value(key) for key, spec in specs.items()}
    options.update(given)
    return options
