"""The backend contract suite on dual commits of the built-in backends: each backend under test first in the restore
order, the other beside it; the damage tests expect the restore to fall back to the other one with the exact state."""

from __future__ import annotations

from typing import Any, ClassVar

from statebackend.testing.backend_contract import BackendContract


class TestChangelogDualWithBlobSnapshot(BackendContract):
    backup_factories: ClassVar[str] = "changelog"
    dual_with: ClassVar[str | None] = "blobsnapshot"
    extra_config: ClassVar[dict[str, Any]] = {"changelog.snapshot.interval.commits": 3}


class TestBlobSnapshotDualWithChangelog(BackendContract):
    backup_factories: ClassVar[str] = "blobsnapshot"
    dual_with: ClassVar[str | None] = "changelog"
