"""Factory of the blob-snapshot backend (short name ``blobsnapshot``)."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from statebackend.backends.blobsnapshot.admin import BlobSnapshotAdmin
from statebackend.backends.blobsnapshot.backup import BlobSnapshotBackupManager, BlobSnapshotSettings
from statebackend.backends.blobsnapshot.restore import BlobSnapshotRestoreManager

from statebackend.config import OptionSpec, parse_bool, parse_bytes, parse_duration_ms, parse_float, parse_int
from statebackend.contracts import BackendContext, StateBackendFactory

__all__ = ["BlobSnapshotStateBackendFactory"]


class BlobSnapshotStateBackendFactory(StateBackendFactory):
    """An LSM tree on the blob store: one immutable sorted run per commit, merged in the background, and an index per
    commit listing the live runs, carried inline by the checkpoint's marker."""

    options: Mapping[str, Any] = {
        "compaction.fanout": OptionSpec(
            parse_int(min=2, max=1000),
            10,
            "merge this many runs of one level into one run of the next level (size-tiered compaction)",
        ),
        "compaction.full.ratio": OptionSpec(
            parse_float(min=0.05, max=100.0),
            1.0,
            "write a new base run once the runs above the base add up to this many times its size",
        ),
        "compaction.full.min.bytes": OptionSpec(
            parse_bytes(min=0), 1 << 20, "runs above the base smaller than this in total never trigger a base run"
        ),
        "upload.base.min.records": OptionSpec(
            parse_int(min=1),
            250_000,
            "a commit whose change holds at least this many records (and upload.base.ratio of the store's keys) is "
            "uploaded as a base run, an environment file a cold restore opens, instead of a run it re-inserts: a bulk "
            "load",
        ),
        "upload.base.ratio": OptionSpec(
            parse_float(min=0.0, max=1.0),
            0.5,
            "the share of the store's keys a commit's change must hold to be uploaded as a base run (with "
            "upload.base.min.records)",
        ),
        "compression.level": OptionSpec(parse_int(min=1, max=22), 3, "zstd level of the runs"),
        "restore.download.concurrency": OptionSpec(parse_int(min=1, max=64), 8, "parallel run downloads per restore"),
        "gc.grace.period.ms": OptionSpec(
            parse_duration_ms(min=0), 3_600_000, "an unreferenced run or index younger than this is left alone"
        ),
        "gc.interval.commits": OptionSpec(
            parse_int(min=0), 100, "run the mark-and-sweep every this many commits (0: only when the task starts)"
        ),
        "gc.on.init": OptionSpec(
            parse_bool(),
            False,
            "also sweep in the background when the task starts (off: a job that opens its task per batch would "
            "sweep every batch)",
        ),
        "ttl.ms": OptionSpec(
            parse_duration_ms(min=1),
            7 * 24 * 3_600_000,
            "expiry written on new runs and indexes: a sweep deletes an expired blob no checkpoint names whatever "
            "its age",
        ),
    }

    def backup_manager(self, context: BackendContext) -> BlobSnapshotBackupManager:
        options = _with_defaults(context.options, self.options)
        settings = BlobSnapshotSettings(
            retained=context.checkpoint_log.retained,
            grace_period_ms=options["gc.grace.period.ms"],
            ttl_ms=options["ttl.ms"],
            gc_interval_commits=options["gc.interval.commits"],
            gc_on_init=options["gc.on.init"],
            compaction_fanout=options["compaction.fanout"],
            compaction_full_ratio=options["compaction.full.ratio"],
            compaction_full_min_bytes=options["compaction.full.min.bytes"],
            compression_level=options["compression.level"],
            upload_base_min_records=options["upload.base.min.records"],
            upload_base_ratio=options["upload.base.ratio"],
        )
        return BlobSnapshotBackupManager(context, settings)

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
