"""The changelog backend's sweep and its grace period: an orphaned delta is deleted only once the grace period is
past, and a sweep never takes a blob a checkpoint in the log or a commit in flight needs."""

from __future__ import annotations

import shutil
import time
from pathlib import Path
from typing import Any

import pytest

from statebackend.blobstores.memory import MemoryBlobStore
from statebackend.errors import CommitError
from statebackend.task import TaskStorage
from statebackend.testing.backend_contract import contents, write_round
from statebackend.testing.controlled import ControlledBlobStore
from tests.backend_helpers import CHANGELOG_PREFIX as PREFIX
from tests.backend_helpers import changelog_config as config_for
from tests.backend_helpers import commit_round, expect_failed_commit

# -- sweep grace period (review finding 4) ----------------------------------------------------------------------------

ORPHAN = "job/task-0/counts/changelog/delta/000000000001-orphan.delta"


def _changelog_manager(task: TaskStorage) -> Any:
    from statebackend.backends.changelog.backup import ChangelogBackupManager

    manager = next(b.manager for b in task.commit_manager.backups if b.factory_name == "changelog")
    assert isinstance(manager, ChangelogBackupManager)
    return manager


@pytest.mark.parametrize("metadata", [True, False])
def test_sweep_leaves_a_young_delta_of_a_replay_still_committing_below_the_heads_seq_and_takes_old_orphans(
    tmp_path: Path, metadata: bool
) -> None:
    """A Spark replay (restored #2, fenced above #4) has uploaded its delta, seq 3: at or below the head's recipe
    seq, named by no checkpoint yet. A sweep of the previous owner meanwhile must leave it (it is younger than the
    grace period); an unreferenced blob older than the grace period goes. Without metadata, age is first-seen."""

    inner = MemoryBlobStore()
    inner.supports_metadata = metadata
    blobs = ControlledBlobStore(inner)
    extra = {
        "changelog.gc.interval.commits": 0,
        "task.checkpoint.retained": 10,
        "changelog.snapshot.interval.commits": 1000,
        "changelog.snapshot.interval.ratio": 0,
    }
    config = config_for(tmp_path, **extra)
    model: dict[bytes, bytes] = {}
    models: list[dict[bytes, bytes]] = []
    with TaskStorage.open(config, "task-0", blob_store=blobs) as task:
        for n in range(4):
            commit_round(task, n, model)
            models.append(dict(model))
        task.commit_manager.close()
        entries = task.checkpoint_log.entries()
        sweeper = _changelog_manager(task)
        inner.put(ORPHAN, b"left by a commit that died", metadata={"created_at": f"{time.time():.3f}"})
        replayed = dict(models[1])
        with TaskStorage.open(
            config_for(tmp_path / "replay", **extra),
            "task-0",
            blob_store=blobs,
            checkpoint=entries[1],
            fence_seq=entries[-1].seq,
        ) as replay:
            write_round(replay, 10, replayed)
            blobs.hold = lambda name: "/checkpoints/" in name
            pending = replay.commit({"input": "replay"})
            assert pending is not None
            try:
                assert blobs.held.wait(30), "the checkpoint write never started"
                assert sweeper.sweep() == 0  # everything unreferenced is young
            finally:
                blobs.release.set()
            acknowledged = pending.result(timeout=30)
        assert ORPHAN in set(inner.list(ORPHAN))
        sweeper.shared.clock = lambda: time.time() + 2 * 3600  # past the grace period (first seen by the sweep above)
        assert sweeper.sweep() == 1
        assert ORPHAN not in set(inner.list(ORPHAN))
    with TaskStorage.open(config_for(tmp_path / "check", **extra), "task-0", blob_store=inner) as check:
        assert check.restored == acknowledged
        assert contents(check) == replayed


def test_a_sweep_that_outlives_a_quarter_of_the_grace_period_since_its_mark_stops_deleting(tmp_path: Path) -> None:
    """Its marks are stale by then: a checkpoint written since may name a blob that has grown old meanwhile."""

    blobs = MemoryBlobStore()
    config = config_for(tmp_path, **{"changelog.gc.interval.commits": 0})
    model: dict[bytes, bytes] = {}
    with TaskStorage.open(config, "task-0", blob_store=blobs) as task:
        for n in range(2):
            commit_round(task, n, model)
        blobs.put(ORPHAN, b"ancient", metadata={"created_at": "1"})
        manager = _changelog_manager(task)
        ticks = iter(range(10**6))
        manager.shared.clock = lambda: time.time() + 1000 * next(ticks)  # every reading ~17 minutes later
        assert manager.sweep() == 0
        assert task.metrics.counter("changelog.sweep.stopped") == 1
        manager.shared.clock = time.time
        assert manager.sweep() == 1


def test_a_delta_reused_more_than_half_the_grace_period_after_its_upload_is_not_named_the_next_commit_rebases(
    tmp_path: Path,
) -> None:
    """A commit's checkpoint write failed; the next commit, an hour later, would name its delta (no checkpoint known
    durable names it, so another attempt's sweep may take it): it fails instead, and the one after re-bases."""

    from statebackend.backends.changelog.marker import Recipe

    blobs = ControlledBlobStore(MemoryBlobStore())
    config = config_for(tmp_path, **{"changelog.gc.interval.commits": 0})
    model: dict[bytes, bytes] = {}
    with TaskStorage.open(config, "task-0", blob_store=blobs) as task:
        commit_round(task, 0, model)
        blobs.fail, blobs.failures_left = (lambda name: "/checkpoints/" in name), 1
        write_round(task, 1, model)
        expect_failed_commit(task, "1")
        _changelog_manager(task).shared.clock = lambda: time.time() + 3600
        write_round(task, 2, model)
        with pytest.raises(CommitError, match="re-bases on a fresh snapshot"):
            task.commit_durably({"input": "2"})
        assert task.metrics.counter("changelog.rebase.old.blobs") == 1
        latest = commit_round(task, 3, model)
        recipe = Recipe.decode(latest.markers_for("changelog")["counts"], prefix=PREFIX)
        assert recipe.snapshot is not None and not recipe.deltas
    shutil.rmtree(tmp_path / "local")
    with TaskStorage.open(config, "task-0", blob_store=blobs.inner) as check:
        assert check.restored == latest
        assert contents(check) == model


def test_a_finished_snapshot_older_than_half_the_grace_period_is_not_adopted_at_open(tmp_path: Path) -> None:
    from statebackend.backends.changelog.marker import Recipe

    blobs = MemoryBlobStore()
    config = config_for(tmp_path, **{"changelog.snapshot.interval.commits": 3, "changelog.gc.interval.commits": 0})
    model: dict[bytes, bytes] = {}
    with TaskStorage.open(config, "task-0", blob_store=blobs) as task:
        for n in range(3):  # the third commit starts a background snapshot; close waits for it
            commit_round(task, n, model)
    (finished,) = list(blobs.list("job/task-0/counts/changelog/snapshot/"))
    blobs.set_metadata(finished, {"created_at": "1"})
    with TaskStorage.open(config, "task-0", blob_store=blobs) as task:
        assert task.metrics.counter("changelog.snapshot.too.old") == 1
        assert task.metrics.counter("changelog.snapshot.adopted") == 0
        latest = commit_round(task, 3, model)
        assert finished not in set(Recipe.decode(latest.markers_for("changelog")["counts"], prefix=PREFIX).blob_names())
    shutil.rmtree(tmp_path / "local")
    with TaskStorage.open(config, "task-0", blob_store=blobs) as check:
        assert check.restored == latest
        assert contents(check) == model
