"""The blob-snapshot backend beside the changelog backend in a dual commit: a failed first snapshot keeps the
other chain whole, a fallback restore in either order rebases the broken backend, a lost run is noticed whichever
backend restored first, and random dual histories with faults, damage and replays restore exactly by either backend."""

from __future__ import annotations

import shutil
from pathlib import Path
from typing import Any

import pytest
from statebackend.backends.blobsnapshot.backup import BlobSnapshotBackupManager
from statebackend.backends.blobsnapshot.blobs import read_marker
from statebackend.backends.blobsnapshot.format import run_name
from statebackend.backends.changelog.backup import ChangelogBackupManager

from statebackend.blobstores.base import BlobStore
from statebackend.blobstores.memory import MemoryBlobStore
from statebackend.task import TaskStorage
from statebackend.testing.controlled import ControlledBlobStore
from tests.backend_helpers import BLOBSNAPSHOT_PREFIX as PREFIX
from tests.backend_helpers import EAGER_FULL as EAGER
from tests.backend_helpers import NEVER, base_keys, churn, latest_index, missing_runs, naming, put_all, settle
from tests.backend_helpers import blobsnapshot_config as make_config
from tests.backend_helpers import store_contents as contents


@pytest.mark.parametrize(("failing", "other"), [("changelog", "blobsnapshot"), ("blobsnapshot", "changelog")])
def test_a_dual_commit_whose_first_snapshot_failed_keeps_the_other_backends_chain_whole(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, failing: str, other: str
) -> None:
    """backup.factories=<failing>,<other>: the first backend's snapshot() raises before it prepared anything, so the
    other backend's never runs for that commit, but every store was already flushed (the framework marks it dirty and
    aborts every backend). Neither chain may go on as if that flush never happened: restoring the next checkpoint from
    the other backend (no fallback), and from the failing one, must give the whole state, not the value before the
    failed commit. Both orders: changelog failing first, and blobsnapshot failing first."""
    blobs = MemoryBlobStore()
    config = make_config(tmp_path, **NEVER)
    config["stores.counts.backup.factories"] = f"{failing},{other}"
    config["stores.counts.restore.factory"] = other
    model: dict[bytes, bytes] = {}
    manager_class: Any = {"changelog": ChangelogBackupManager, "blobsnapshot": BlobSnapshotBackupManager}[failing]
    real_snapshot = manager_class.snapshot
    failures = [1]

    def failing_snapshot(self: Any, checkpoint_id: Any, changes: Any) -> Any:
        if failures[0]:
            failures[0] -= 1
            raise RuntimeError(f"injected: {failing} snapshot failed")
        return real_snapshot(self, checkpoint_id, changes)

    with TaskStorage.open(config, "task-0", blob_store=blobs) as task:
        assert [b.factory_name for b in task.commit_manager.backups] == [failing, other]
        put_all(task, model, base_keys())
        task.commit_durably({"input": "0"})
        monkeypatch.setattr(manager_class, "snapshot", failing_snapshot)
        put_all(task, model, {b"key-00007": b"second"})
        with pytest.raises(RuntimeError, match="injected"):
            task.commit_durably({"input": "1"})
        put_all(task, model, {b"key-00011": b"third"})
        task.commit_durably({"input": "2"})
        assert contents(task) == model
    for factory in (other, failing):
        shutil.rmtree(tmp_path / "local")
        with TaskStorage.open({**config, "stores.counts.restore.factory": factory}, "task-0", blob_store=blobs) as task:
            if factory == other:
                assert task.metrics.counter("restore.stores.full") == 1  # restored by it, no fallback
            assert contents(task) == model, f"restored from {factory}: the failed commit's change is lost"


# -- restore fallback between the two backends of a dual commit, both orders -------------------------------------

DUAL = {
    **EAGER,
    "stores.counts.backup.factories": "changelog,blobsnapshot",
    "changelog.snapshot.interval.commits": 3,
    "task.checkpoint.retained": 3,
}


def restored_by(task: TaskStorage) -> str | None:
    return task.commit_manager.backups[0].manager.shared.context.restored_by["counts"]  # type: ignore[attr-defined]


def _damage_newest(blobs: BlobStore, task: TaskStorage, factory: str) -> str:
    """Delete the newest blob (by name order: a run or delta of the newest commit) the checkpoint's marker of
    ``factory`` needs, other than the marker itself, so that backend's restore fails on a missing blob."""
    checkpoint = task.commit_manager.last_checkpoint
    assert checkpoint is not None
    marker = checkpoint.markers_for(factory)["counts"]
    if factory == "blobsnapshot":
        index = read_marker(blobs, marker, job="job", task="task-0", store="counts")
        victim = run_name(PREFIX, index.runs[-1].hash)
    else:
        prefix = "job/task-0/counts/changelog/"
        names = sorted(name for name in blobs.list(prefix) if name != marker and "/delta" in name)
        assert names, list(blobs.list(prefix))
        victim = names[-1]
    blobs.delete(victim)
    return victim


@pytest.mark.parametrize(("broken", "fallback"), [("blobsnapshot", "changelog"), ("changelog", "blobsnapshot")])
def test_a_fallback_restore_in_either_order_rebases_the_broken_backend_and_both_stay_exact(
    tmp_path: Path, broken: str, fallback: str
) -> None:
    """restore.factories=<broken>,<fallback>: the broken backend's blob of the newest checkpoint is missing, so the
    other one restores; the broken one must start anew (restore_failures), not continue its chain. After more commits
    (with compactions), each backend alone restores exactly, cold."""
    blobs = MemoryBlobStore()
    config = make_config(tmp_path, **DUAL)
    config["stores.counts.restore.factories"] = f"{broken},{fallback}"
    del config["stores.counts.restore.factory"]
    model: dict[bytes, bytes] = {}
    with TaskStorage.open(config, "task-0", blob_store=blobs) as task:
        put_all(task, model, base_keys(300))
        task.commit_durably({"input": "0"})
        for round_no in range(1, 5):
            churn(task, model, round_no)
            task.commit_durably({"input": str(round_no)})
            settle(task)
        _damage_newest(blobs, task, broken)
    shutil.rmtree(tmp_path / "local")
    with TaskStorage.open(config, "task-0", blob_store=blobs) as task:
        assert restored_by(task) == fallback
        assert contents(task) == model
        for round_no in range(5, 10):
            churn(task, model, round_no)
            task.commit_durably({"input": str(round_no)})
            settle(task)
    for alone in (broken, fallback):
        shutil.rmtree(tmp_path / "local")
        only = {**config, "stores.counts.restore.factories": alone}
        with TaskStorage.open(only, "task-0", blob_store=blobs) as task:
            assert restored_by(task) == alone
            assert contents(task) == model, f"restored by {alone} alone"


def test_a_lost_run_is_noticed_when_the_other_backend_of_a_dual_commit_restored_first(tmp_path: Path) -> None:
    """restore.factories=changelog,blobsnapshot, a dual commit. The bottom run of blobsnapshot's chain is lost from
    the blob store. The next open is restored by changelog (blobsnapshot is never tried, so restore_failures is empty)
    and blobsnapshot continues its chain because the version matches: every later index names the lost run, so every
    later checkpoint's blobsnapshot marker is unrestorable, silently, until a full compaction happens to replace the
    bottom run (never, with small changes). The redundancy of the dual commit is gone without a word: a later loss in
    the changelog loses the acknowledged checkpoint, and so does dropping changelog in a migration. (The mirror holds
    for a lost changelog delta when blobsnapshot restores first.)"""
    blobs = MemoryBlobStore()
    config = make_config(
        tmp_path,
        **NEVER,
        **{
            "stores.counts.backup.factories": "changelog,blobsnapshot",
            "stores.counts.restore.factories": "changelog,blobsnapshot",
            "changelog.snapshot.interval.commits": 3,
        },
    )
    del config["stores.counts.restore.factory"]
    model: dict[bytes, bytes] = {}
    with TaskStorage.open(config, "task-0", blob_store=blobs) as task:
        put_all(task, model, base_keys())
        task.commit_durably({"input": "0"})
        for round_no in range(1, 4):
            churn(task, model, round_no)
            task.commit_durably({"input": str(round_no)})
        bottom = latest_index(blobs, task).runs[0]
    blobs.delete(run_name(PREFIX, bottom.hash))  # lost (an operator, a lifecycle rule, a bad gc)
    shutil.rmtree(tmp_path / "local")
    with TaskStorage.open(config, "task-0", blob_store=blobs) as task:
        assert restored_by(task) == "changelog"
        for round_no in range(4, 7):
            churn(task, model, round_no)
            task.commit_durably({"input": str(round_no)})
        index = latest_index(blobs, task)
        assert missing_runs(blobs, index) == [], "every new blobsnapshot index names the lost run"
    shutil.rmtree(tmp_path / "local")
    with TaskStorage.open(
        {**config, "stores.counts.restore.factories": "blobsnapshot"}, "task-0", blob_store=blobs
    ) as task:
        assert restored_by(task) == "blobsnapshot"
        assert contents(task) == model


@pytest.mark.slow
@pytest.mark.parametrize("seed", range(4))
def test_random_dual_commit_histories_with_faults_damage_and_replays_restore_exactly_by_either_backend(
    tmp_path: Path, seed: int
) -> None:
    """Dual commit (changelog + blobsnapshot, compactions at almost every commit, sweeps with no grace period): commits
    that fail at a run, index, delta or checkpoint write or land with their reply lost, reopens, wiped dirs, replays,
    and a lost blob of one backend's newest checkpoint (the next open tries that backend first, so it notices and
    re-bases). Every open restores exactly the newest durable (or replayed) checkpoint, and at the end each backend
    alone restores the last one exactly."""
    import random

    rng = random.Random(seed)
    blobs = ControlledBlobStore(MemoryBlobStore())
    config = make_config(
        tmp_path,
        **DUAL,
        **{
            "blobsnapshot.gc.interval.commits": 3,
            "changelog.gc.interval.commits": 3,
            "blobsnapshot.gc.grace.period.ms": 0,
            "changelog.gc.grace.period.ms": 0,
        },
    )
    del config["stores.counts.restore.factory"]
    damaged_first: list[str] = []

    def open_config() -> dict[str, object]:
        order = rng.choice(["blobsnapshot,changelog", "changelog,blobsnapshot"])
        if damaged_first:
            which = damaged_first.pop()
            order = f"{which},{'changelog' if which == 'blobsnapshot' else 'blobsnapshot'}"
        return {**config, "stores.counts.restore.factories": order}

    model: dict[bytes, bytes] = {}
    models: dict[str, dict[bytes, bytes]] = {}
    newest: str | None = None
    damaged = False
    task = TaskStorage.open(open_config(), "task-0", blob_store=blobs)
    try:
        for step in range(40):
            label = f"s{step}"
            churn(task, model, step)
            action = rng.random()
            if action < 0.55:
                task.commit_durably({"input": label})
                models[label], newest, damaged = dict(model), label, False
            elif action < 0.8:
                where = rng.choice(["/blobsnapshot/runs/", "/blobsnapshot/index/", "/checkpoints/", "/changelog/"])
                lose = rng.random() < 0.4
                if lose:
                    blobs.lose_reply, blobs.replies_to_lose = naming(where), 1
                else:
                    blobs.fail, blobs.failures_left = naming(where), 1
                try:
                    task.commit_durably({"input": label})
                    landed = True
                except Exception:  # noqa: BLE001 - the injected failure
                    landed = lose and where == "/checkpoints/"
                blobs.failures_left = blobs.replies_to_lose = 0
                if landed:
                    models[label], newest, damaged = dict(model), label, False
            settle(task)
            if rng.random() < 0.3 and newest is not None:
                task.close()
                kind = rng.choice(["reopen", "wipe", "replay", "damage"])
                if kind in ("wipe", "damage"):
                    shutil.rmtree(tmp_path / "local")
                if kind == "damage" and not damaged:
                    which = rng.choice(["blobsnapshot", "changelog"])
                    try:
                        _damage_newest(blobs.inner, task, which)
                        damaged = True
                        damaged_first.append(which)
                    except AssertionError:
                        pass  # no delta to lose yet
                entries = task.checkpoint_log.entries()
                expected = newest
                if kind == "replay" and len(entries) >= 2:
                    chosen = entries[-2]
                    task = TaskStorage.open(
                        open_config(), "task-0", blob_store=blobs, checkpoint=chosen, fence_seq=entries[-1].seq
                    )
                    expected = chosen.checkpoint.input_offsets["input"]
                else:
                    task = TaskStorage.open(open_config(), "task-0", blob_store=blobs)
                assert task.restored is not None
                assert task.restored.input_offsets["input"] == expected, (step, kind)
                model = dict(models[expected])
                assert contents(task) == model, (step, kind)
        if damaged:
            churn(task, model, 999)
            task.commit_durably({"input": "final"})
            models["final"], newest = dict(model), "final"
        task.close()
        assert newest is not None
        for alone in ("blobsnapshot", "changelog"):
            shutil.rmtree(tmp_path / "local")
            task = TaskStorage.open(
                {**config, "stores.counts.restore.factories": alone}, "task-0", blob_store=blobs.inner
            )
            assert restored_by(task) == alone
            assert contents(task) == models[newest], alone
            task.close()
    finally:
        task.close()
