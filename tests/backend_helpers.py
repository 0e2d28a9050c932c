"""Helpers shared by the tests that run one scenario against each backend: a config for a backend with its own
extra keys, and a sweep that lets every unreferenced blob go (blob-snapshot judges age by a clock given to it)."""

from __future__ import annotations

import uuid
from collections.abc import Mapping
from pathlib import Path

from statebackend.backends.blobsnapshot.backup import BlobSnapshotBackupManager
from statebackend.backends.changelog.backup import ChangelogBackupManager

from statebackend.contracts import TaskBackupManager

FAR_FUTURE = 10 * 365 * 86400.0


def make_config(backend: str, tmp_path: Path, extra: Mapping[str, object]) -> dict[str, object]:
    """One task, store ``counts`` on ``backend`` alone, two retained checkpoints, plus ``extra``."""
    config: dict[str, object] = {
        "job.name": "job",
        "state.local.dir": str(tmp_path / "local"),
        "blob.store.url": f"memory://{uuid.uuid4().hex}",
        "stores.counts.backup.factories": backend,
        "stores.counts.restore.factory": backend,
        "task.checkpoint.retained": 2,
    }
    config.update(extra)
    return config


def sweep(manager: TaskBackupManager) -> None:
    if isinstance(manager, BlobSnapshotBackupManager):
        manager.sweep(now=manager.clock() + FAR_FUTURE)
    else:
        assert isinstance(manager, ChangelogBackupManager)
        manager.sweep()
