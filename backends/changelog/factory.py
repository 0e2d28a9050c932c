"""Factory of the changelog-delta backend (short name ``changelog``)."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from statebackend.backends.changelog.admin import ChangelogAdmin
from statebackend.backends.changelog.backup import ChangelogBackupManager, ChangelogSettings
from statebackend.backends.changelog.restore import ChangelogRestoreManager

from statebackend.config import OptionSpec, parse_bytes, parse_choice, parse_duration_ms, parse_float, parse_int
from statebackend.contracts import BackendContext, StateBackendFactory

__all__ = ["ChangelogStateBackendFactory"]


class ChangelogStateBackendFactory(StateBackendFactory):
    """Per-commit delta files plus background materialized snapshots."""

    options: Mapping[str, Any] = {
        "snapshot.interval.ratio": OptionSpec(
            parse_float(min=0.0),
            1.0,
            "take a background snapshot once the delta files since the last one hold this many times its bytes "
            "(0: off): a restore then downloads at most 1 + this many snapshots' worth",
        ),
        "snapshot.interval.commits": OptionSpec(
            parse_int(min=1), 100, "... or after this many commits since the last one, whatever their size"
        ),
        "snapshot.interval.bytes": OptionSpec(
            parse_bytes(), 64 << 20, "... or after this many bytes of change since the last one"
        ),
        "snapshot.ratio.min.bytes": OptionSpec(
            parse_bytes(),
            1 << 20,
            "delta files since the last snapshot smaller than this in total never make one due by the ratio (a "
            "small state's snapshots would cost a PUT every few commits; restore reads at most this much more)",
        ),
        "compression": OptionSpec(parse_choice("zstd", "none"), "zstd", "compression of delta and snapshot files"),
        "compression.level": OptionSpec(parse_int(min=1, max=22), 3, "zstd level (1 fastest .. 22 smallest)"),
        "restore.download.concurrency": OptionSpec(parse_int(min=1, max=64), 8, "parallel downloads per restore"),
        "gc.interval.commits": OptionSpec(
            parse_int(min=0), 100, "mark-and-sweep unreferenced blobs every this many commits (0: never)"
        ),
        "gc.grace.period.ms": OptionSpec(
            parse_duration_ms(min=0), 3_600_000, "unreferenced blobs younger than this are left alone by the sweep"
        ),
    }

    def backup_manager(self, context: BackendContext) -> ChangelogBackupManager:
        options = context.options
        settings = ChangelogSettings(
            snapshot_interval_commits=options["snapshot.interval.commits"],
            snapshot_interval_ratio=options["snapshot.interval.ratio"],
            snapshot_interval_bytes=options["snapshot.interval.bytes"],
            compression=options["compression"],
            compression_level=options["compression.level"],
            retained=context.checkpoint_log.retained,
            gc_interval_commits=options["gc.interval.commits"],
            gc_grace_period_ms=options["gc.grace.period.ms"],
            snapshot_ratio_min_bytes=options["snapshot.ratio.min.bytes"],
        )
        return ChangelogBackupManager(context, settings)

    def restore_manager(self, context: BackendContext) -> ChangelogRestoreManager:
        return ChangelogRestoreManager(
            context=context, download_concurrency=context.options["restore.download.concurrency"]
        )

    def admin(self, context: BackendContext) -> ChangelogAdmin:
        return ChangelogAdmin(context=context)
