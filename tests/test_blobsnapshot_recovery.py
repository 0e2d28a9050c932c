"""Review of the blob-snapshot LSM backend (issue 10): attempts to lose, alter, mix or resurrect acknowledged state, or
to delete a blob a retained checkpoint needs. Some tests demonstrated a problem when written (a run not written
locally, a dual commit whose other snapshot failed first in either order, a run or merge found present with an old
age, an index naming a run past its ttl, a lost cached copy failing every later commit, a run found present and young
reused without its age, a lost run unnoticed when the other backend of a dual commit restored first); those are fixed
and the tests stay as regression tests. The others check a property that was found to hold."""

from __future__ import annotations

import hashlib
import shutil
import time
from pathlib import Path
from typing import Any

import pytest
from statebackend.backends.blobsnapshot import upload as upload_module
from statebackend.backends.blobsnapshot.backup import BlobSnapshotBackupManager
from statebackend.backends.blobsnapshot.blobs import read_marker
from statebackend.backends.blobsnapshot.format import RunIndex, run_name
from statebackend.backends.changelog.backup import ChangelogBackupManager

from statebackend.blobstores.base import BlobStore
from statebackend.blobstores.memory import MemoryBlobStore
from statebackend.task import TaskStorage
from statebackend.testing.controlled import ControlledBlobStore
from tests.backend_helpers import BLOBSNAPSHOT_PREFIX as PREFIX
from tests.backend_helpers import NEVER, latest_index, settle
from tests.backend_helpers import blobsnapshot_config as make_config
from tests.backend_helpers import blobsnapshot_manager as manager_of
from tests.backend_helpers import store_contents as contents

#: no compaction at all
#: merges of every two runs of a level; a full compaction only when the runs above the bottom outgrow it
MERGE_EAGER = {"blobsnapshot.compaction.fanout": 2, "blobsnapshot.compaction.full.min.bytes": 0}


def put_all(task: TaskStorage, model: dict[bytes, bytes], items: dict[bytes, bytes]) -> None:
    store = task.store("counts")
    for key, value in items.items():
        store.put(key, value)
        model[key] = value


def base_keys(count: int = 200) -> dict[bytes, bytes]:
    """``count`` keys with values that do not compress (so a few small runs never outgrow the bottom run)."""
    return {f"key-{i:05d}".encode(): hashlib.sha256(b"%d" % i).hexdigest().encode() for i in range(count)}


def missing_runs(blobs: BlobStore, index: RunIndex) -> list[str]:
    names = [run_name(PREFIX, run.hash) for run in index.runs]
    present = set(blobs.list(PREFIX + "runs/"))
    return [name for name in names if name not in present]


class FakeClock:
    def __init__(self) -> None:
        self.now = time.time()

    def __call__(self) -> float:
        return self.now


# -- a commit's change set that never became a run --------------------------------------------------------------------


def test_a_run_that_could_not_be_written_locally_is_not_dropped_from_the_chain(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Commit 2's run cannot be written into the run cache (disk full): commit 2 fails, its flush is in LMDB all the
    same (the store's batch was handed to the applier and is not carried into the next change set). The next commit
    must cover it (a base run, as after abort()); otherwise its index describes a state without commit 2's update,
    with the same key count, and a cold restore silently returns the older value."""
    blobs = MemoryBlobStore()
    config = make_config(tmp_path, **NEVER)
    model: dict[bytes, bytes] = {}
    real_write_file = upload_module.write_file
    failures = [1]

    def write_file_disk_full(out: Any, header: Any, records: Any, **kwargs: Any) -> Any:
        if header.base_seq > 0 and failures[0]:
            failures[0] -= 1
            raise OSError(28, "No space left on device")
        return real_write_file(out, header, records, **kwargs)

    with TaskStorage.open(config, "task-0", blob_store=blobs) as task:
        put_all(task, model, base_keys())
        task.commit_durably({"input": "0"})
        monkeypatch.setattr(upload_module, "write_file", write_file_disk_full)
        put_all(task, model, {b"key-00007": b"second"})
        with pytest.raises(Exception, match="No space left"):
            task.commit_durably({"input": "1"})
        assert failures == [0]
        put_all(task, model, {b"key-00011": b"third"})
        task.commit_durably({"input": "2"})
        assert contents(task) == model  # the local store has it all
    shutil.rmtree(tmp_path / "local")
    with TaskStorage.open(config, "task-0", blob_store=blobs) as task:
        assert contents(task) == model, "a cold restore of the last checkpoint lost commit 2's update"


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


def test_a_failed_blobsnapshot_snapshot_in_a_single_backend_commit_rebases(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Contrast to the dual-commit test above: with two stores on blobsnapshot alone, the second store's snapshot failing after the
    first one's ran makes abort() re-base both; the next checkpoint restores exactly."""
    blobs = MemoryBlobStore()
    config = make_config(tmp_path, **NEVER)
    config.update({"stores.other.backup.factories": "blobsnapshot", "stores.other.restore.factory": "blobsnapshot"})
    model: dict[bytes, bytes] = {}
    with TaskStorage.open(config, "task-0", blob_store=blobs) as task:
        put_all(task, model, base_keys())
        task.commit_durably({"input": "0"})
        manager = manager_of(task)
        real_snapshot = BlobSnapshotBackupManager.snapshot
        calls = [0]

        def snapshot_then_fail(self: BlobSnapshotBackupManager, checkpoint_id: Any, changes: Any) -> Any:
            markers = real_snapshot(self, checkpoint_id, changes)
            if calls[0] == 0:
                calls[0] += 1
                raise RuntimeError("injected after snapshot")
            return markers

        monkeypatch.setattr(BlobSnapshotBackupManager, "snapshot", snapshot_then_fail)
        put_all(task, model, {b"key-00007": b"second"})
        with pytest.raises(RuntimeError, match="injected"):
            task.commit_durably({"input": "1"})
        assert manager._states["counts"].needs_base
        put_all(task, model, {b"key-00011": b"third"})
        task.commit_durably({"input": "2"})
    shutil.rmtree(tmp_path / "local")
    with TaskStorage.open(config, "task-0", blob_store=blobs) as task:
        assert contents(task) == model


# -- the grace period: a run found present is taken as young ----------------------------------------------------------

GRACE_MS = 1_000_000  # 1000 s on the fake clock


def _zombie_sweep(tmp_path: Path, config: dict[str, object], blobs: BlobStore, now: float) -> int:
    """Another attempt of the same task (its own local dir) opens at the log's head and sweeps, as at init with
    gc.on.init: its mark is the log and its own chain."""
    zombie_config = {**config, "state.local.dir": str(tmp_path / "zombie")}
    with TaskStorage.open(zombie_config, "task-0", blob_store=blobs) as zombie:
        return manager_of(zombie).sweep(now=now).runs_deleted


def test_a_run_found_present_long_after_its_lost_reply_is_refreshed_before_an_index_names_it(tmp_path: Path) -> None:
    """Commit 2's run lands but its reply is lost: the commit fails, the run stays in the chain. The next commit comes
    more than the grace period later, finds the run present (a head of its length) and names it without writing it
    again, so the blob keeps its old ``created_at``. A run written by this manager that old is written again
    before an index names it (docs/formats-blobsnapshot.md, Garbage), precisely so that another attempt's sweep
    never takes it; the found-present path skips that. A sweep of another attempt between the index write and the
    checkpoint then deletes a run of an acknowledged checkpoint."""
    clock = FakeClock()
    blobs = ControlledBlobStore(MemoryBlobStore())
    config = make_config(tmp_path, **NEVER, **{"blobsnapshot.gc.grace.period.ms": GRACE_MS})
    model: dict[bytes, bytes] = {}
    try:
        with TaskStorage.open(config, "task-0", blob_store=blobs) as task:
            manager_of(task).clock = clock
            put_all(task, model, base_keys())
            task.commit_durably({"input": "0"})
            blobs.lose_reply, blobs.replies_to_lose = (lambda name: "/runs/" in name), 1
            put_all(task, model, {b"key-00007": b"second"})
            with pytest.raises(Exception, match="reply was lost"):
                task.commit_durably({"input": "1"})
            clock.now += 1.5 * GRACE_MS / 1000.0  # the task idles past the grace period after the failed commit
            blobs.hold = lambda name: "/checkpoints/" in name
            put_all(task, model, {b"key-00011": b"third"})
            pending = task.commit({"input": "2"})
            assert pending is not None
            assert blobs.held.wait(30), "the checkpoint write never started"
            # the index is written; before its checkpoint lands, another attempt sweeps
            _zombie_sweep(tmp_path, config, blobs.inner, clock.now)
            blobs.release.set()
            pending.result(timeout=30)
            index = latest_index(blobs.inner, task)
            assert missing_runs(blobs.inner, index) == [], "the acknowledged checkpoint names a deleted run"
    finally:
        blobs.release.set()
    shutil.rmtree(tmp_path / "local")
    with TaskStorage.open(config, "task-0", blob_store=blobs.inner) as task:
        assert contents(task) == model


def test_a_run_this_manager_uploaded_long_ago_is_refreshed_so_another_attempts_sweep_keeps_it(tmp_path: Path) -> None:
    """The case the grace logic handles: commit 2's run is uploaded, its index write fails; the next commit, past the
    grace period, writes the run again (fresh age) before naming it, and a concurrent sweep of another attempt leaves
    it alone."""
    clock = FakeClock()
    blobs = ControlledBlobStore(MemoryBlobStore())
    config = make_config(tmp_path, **NEVER, **{"blobsnapshot.gc.grace.period.ms": GRACE_MS})
    model: dict[bytes, bytes] = {}
    try:
        with TaskStorage.open(config, "task-0", blob_store=blobs) as task:
            manager_of(task).clock = clock
            put_all(task, model, base_keys())
            task.commit_durably({"input": "0"})
            blobs.fail, blobs.failures_left = (lambda name: "/checkpoints/" in name), 1
            put_all(task, model, {b"key-00007": b"second"})
            with pytest.raises(Exception, match="injected failure"):
                task.commit_durably({"input": "1"})
            clock.now += 1.5 * GRACE_MS / 1000.0
            blobs.hold = lambda name: "/checkpoints/" in name
            put_all(task, model, {b"key-00011": b"third"})
            pending = task.commit({"input": "2"})
            assert pending is not None
            assert blobs.held.wait(30)
            _zombie_sweep(tmp_path, config, blobs.inner, clock.now)
            blobs.release.set()
            pending.result(timeout=30)
            index = latest_index(blobs.inner, task)
            assert len(index.runs) == 3
            assert missing_runs(blobs.inner, index) == []
    finally:
        blobs.release.set()
    shutil.rmtree(tmp_path / "local")
    with TaskStorage.open(config, "task-0", blob_store=blobs.inner) as task:
        assert contents(task) == model


def test_a_recomputed_compaction_found_present_with_an_old_age_is_not_adopted_as_young(tmp_path: Path) -> None:
    """A merge is uploaded, then the task moves to another machine (its record is left behind) and comes back more
    than the grace period later: the new machine recomputes the same merge (same inputs, same bytes, same name), finds
    it present and records ``uploaded_at = now``. The blob still carries its first ``created_at``: a sweep of another
    attempt deletes it, and the next commit's index adopts it anyway (it looks young), naming a deleted run."""
    clock = FakeClock()
    blobs = MemoryBlobStore()
    config = make_config(tmp_path, **MERGE_EAGER, **{"blobsnapshot.gc.grace.period.ms": GRACE_MS})
    model: dict[bytes, bytes] = {}
    with TaskStorage.open(config, "task-0", blob_store=blobs) as task:
        state = manager_of(task)._states["counts"]
        manager_of(task).clock = clock
        put_all(task, model, base_keys())
        task.commit_durably({"input": "0"})
        round_no = 1
        while state.compaction is None:
            put_all(task, model, {f"key-{round_no:05d}".encode(): f"round-{round_no}".encode()})
            task.commit_durably({"input": str(round_no)})
            round_no += 1
            assert round_no < 6, "no compaction started"
        first = state.compaction.result(timeout=60)
        assert first is not None and not first.output.base
    shutil.rmtree(tmp_path / "local")  # the task moves to another machine
    clock.now += 1.5 * GRACE_MS / 1000.0
    with TaskStorage.open(config, "task-0", blob_store=blobs) as task:
        state = manager_of(task)._states["counts"]
        manager_of(task).clock = clock
        put_all(task, model, {b"key-00100": b"on the new machine"})
        task.commit_durably({"input": str(round_no)})
        round_no += 1
        assert state.compaction is not None
        again = state.compaction.result(timeout=60)
        assert again is not None and again.output == first.output  # the same merge, found present
        _zombie_sweep(tmp_path, config, blobs, clock.now)
        put_all(task, model, {b"key-00101": b"adopts the merge"})
        task.commit_durably({"input": str(round_no)})
        index = latest_index(blobs, task)
        assert missing_runs(blobs, index) == [], "the acknowledged checkpoint names a deleted run"
    shutil.rmtree(tmp_path / "local")
    with TaskStorage.open(config, "task-0", blob_store=blobs) as task:
        assert contents(task) == model


def test_an_index_never_names_a_run_that_has_already_expired(tmp_path: Path) -> None:
    """ttl.ms 100 s, gc.grace.period.ms 1000 s (both accepted). Commit 2's run is uploaded and its index write fails;
    the next commit, 200 s later, names that run: young by the grace rule (no refresh), but past its expiry, which a
    sweep takes as garbage at once. Another attempt's sweep between the index write and the checkpoint deletes it:
    the acknowledged checkpoint names a deleted run. (Either refuse ttl.ms < gc.grace.period.ms, or refresh a run
    whose expiry is near before an index names it.)"""
    clock = FakeClock()
    blobs = ControlledBlobStore(MemoryBlobStore())
    config = make_config(
        tmp_path, **NEVER, **{"blobsnapshot.gc.grace.period.ms": GRACE_MS, "blobsnapshot.ttl.ms": 100_000}
    )
    model: dict[bytes, bytes] = {}
    try:
        with TaskStorage.open(config, "task-0", blob_store=blobs) as task:
            manager_of(task).clock = clock
            put_all(task, model, base_keys())
            task.commit_durably({"input": "0"})
            blobs.fail, blobs.failures_left = (lambda name: "/checkpoints/" in name), 1
            put_all(task, model, {b"key-00007": b"second"})
            with pytest.raises(Exception, match="injected failure"):
                task.commit_durably({"input": "1"})
            clock.now += 200.0
            blobs.hold = lambda name: "/checkpoints/" in name
            put_all(task, model, {b"key-00011": b"third"})
            pending = task.commit({"input": "2"})
            assert pending is not None
            assert blobs.held.wait(30)
            _zombie_sweep(tmp_path, config, blobs.inner, clock.now)
            blobs.release.set()
            pending.result(timeout=30)
            index = latest_index(blobs.inner, task)
            assert missing_runs(blobs.inner, index) == [], "the acknowledged checkpoint names a deleted run"
    finally:
        blobs.release.set()
    shutil.rmtree(tmp_path / "local")
    with TaskStorage.open(config, "task-0", blob_store=blobs.inner) as task:
        assert contents(task) == model


# -- replays, records and lineages that held ---------------------------------------------------------------------------

EAGER = {
    "blobsnapshot.compaction.fanout": 2,
    "blobsnapshot.compaction.full.min.bytes": 0,
    "blobsnapshot.compaction.full.ratio": 0.3,
}


def churn(task: TaskStorage, model: dict[bytes, bytes], round_no: int, *, keys: int = 300) -> None:
    """40 updates and 10 deletes over ``keys`` keys, different each round."""
    store = task.store("counts")
    for i in range(50):
        key = f"key-{(i * 53 + round_no * 97) % keys:05d}".encode()
        if i % 5 == 4:
            store.delete(key)
            model.pop(key, None)
        else:
            value = f"r{round_no}-{i}".encode() * 3
            store.put(key, value)
            model[key] = value


@pytest.mark.parametrize("back", [1, 2, 3])
def test_a_replay_to_an_older_checkpoint_in_the_same_dir_with_a_compaction_record_restores_exactly(
    tmp_path: Path, back: int
) -> None:
    """A Spark replay restores an older checkpoint (fence_seq = the head) in the same local dir, which holds the newer
    state and the compaction record the superseded batches left. The redo and the commits after it (with merges and
    full compactions at almost every commit) restore exactly the replayed history, warm and cold; nothing of the
    superseded batches leaks in."""
    blobs = MemoryBlobStore()
    config = make_config(tmp_path, **EAGER, **{"task.checkpoint.retained": 5})
    model: dict[bytes, bytes] = {}
    models: list[dict[bytes, bytes]] = []
    with TaskStorage.open(config, "task-0", blob_store=blobs) as task:
        put_all(task, model, base_keys(300))
        task.commit_durably({"input": "base"})
        models.append(dict(model))
        for round_no in range(9):
            churn(task, model, round_no)
            task.commit_durably({"input": str(round_no)})
            models.append(dict(model))
        settle(task)
        entries = task.checkpoint_log.entries()
    replayed = dict(models[-1 - back])
    chosen = entries[-1 - back]
    assert chosen.checkpoint.input_offsets == {"input": str(8 - back)}
    with TaskStorage.open(config, "task-0", blob_store=blobs, checkpoint=chosen, fence_seq=entries[-1].seq) as replay:
        assert contents(replay) == replayed
        for round_no in range(100, 106):
            churn(replay, replayed, round_no)
            replay.commit_durably({"input": f"redo-{round_no}"})
            settle(replay)
        assert contents(replay) == replayed
    with TaskStorage.open(config, "task-0", blob_store=blobs) as warm:
        assert contents(warm) == replayed
        churn(warm, replayed, 200)
        warm.commit_durably({"input": "after"})
        settle(warm)
    shutil.rmtree(tmp_path / "local")
    with TaskStorage.open(config, "task-0", blob_store=blobs) as cold:
        assert contents(cold) == replayed


def test_a_lost_cached_copy_of_an_old_undurable_run_costs_one_commit_not_all_later_ones(tmp_path: Path) -> None:
    """Commit 2's run is uploaded, its index write fails: the run stays in the chain (its change is in LMDB only
    there). Its cached copy is then lost (a disk cleaner, an operator freeing space). Past half the grace period the
    next commit must write it again and cannot: it fails saying the next commit uploads a base run. That next commit
    must then succeed, and the state restore exactly."""
    clock = FakeClock()
    blobs = ControlledBlobStore(MemoryBlobStore())
    config = make_config(tmp_path, **NEVER, **{"blobsnapshot.gc.grace.period.ms": GRACE_MS})
    model: dict[bytes, bytes] = {}
    with TaskStorage.open(config, "task-0", blob_store=blobs) as task:
        manager_of(task).clock = clock
        state = manager_of(task)._states["counts"]
        put_all(task, model, base_keys())
        task.commit_durably({"input": "0"})
        blobs.fail, blobs.failures_left = (lambda name: "/checkpoints/" in name), 1
        put_all(task, model, {b"key-00007": b"second"})
        with pytest.raises(Exception, match="injected failure"):
            task.commit_durably({"input": "1"})
        lost = state.cached(state.runs[-1])
        assert lost.exists()
        lost.unlink()
        clock.now += 0.6 * GRACE_MS / 1000.0
        put_all(task, model, {b"key-00011": b"third"})
        with pytest.raises(Exception, match="base run"):
            task.commit_durably({"input": "2"})
        put_all(task, model, {b"key-00013": b"fourth"})
        task.commit_durably({"input": "3"})  # the promised base run
        assert task.metrics.counter("blobsnapshot.base.runs") == 1
    shutil.rmtree(tmp_path / "local")
    with TaskStorage.open(config, "task-0", blob_store=blobs.inner) as task:
        assert contents(task) == model


# -- a random history of faults, reopens, wipes and replays against a model -------------------------------------------


@pytest.mark.slow
@pytest.mark.parametrize("seed", range(6))
def test_random_faults_reopens_wipes_and_replays_restore_exactly_the_last_durable_checkpoint(
    tmp_path: Path, seed: int
) -> None:
    """Commits that fail at a run, index or checkpoint write, checkpoints that land with their reply lost, reopens in
    the same dir, wiped dirs and Spark-style replays of the previous checkpoint, with merges and full compactions at
    almost every commit: every open restores exactly the newest durable checkpoint (or the replayed one)."""
    import random

    rng = random.Random(seed)
    blobs = ControlledBlobStore(MemoryBlobStore())
    config = make_config(
        tmp_path,
        **EAGER,
        **{"task.checkpoint.retained": 3, "blobsnapshot.gc.interval.commits": 4, "blobsnapshot.gc.grace.period.ms": 0},
    )
    model: dict[bytes, bytes] = {}
    models: dict[str, dict[bytes, bytes]] = {}
    newest: str | None = None  # the label of the newest durable checkpoint (by seq: a replay's redo supersedes)
    task = TaskStorage.open(config, "task-0", blob_store=blobs)
    try:
        for step in range(60):
            label = f"s{step}"
            action = rng.random()
            churn(task, model, step)
            if action < 0.55:
                task.commit_durably({"input": label})
                models[label], newest = dict(model), label
            elif action < 0.75:
                where = rng.choice(["/runs/", "/index/", "/checkpoints/"])
                lose = where == "/checkpoints/" and rng.random() < 0.5
                if lose:
                    blobs.lose_reply, blobs.replies_to_lose = (lambda name, w=where: w in name), 1
                else:
                    blobs.fail, blobs.failures_left = (lambda name, w=where: w in name), 1
                try:
                    task.commit_durably({"input": label})
                    landed = True
                except Exception:  # noqa: BLE001 - the injected failure
                    landed = lose
                blobs.failures_left = blobs.replies_to_lose = 0
                if landed:
                    models[label], newest = dict(model), label
            settle(task)
            if rng.random() < 0.3 and newest is not None:
                task.close()
                kind = rng.choice(["reopen", "wipe", "replay"])
                if kind == "wipe":
                    shutil.rmtree(tmp_path / "local")
                entries = task.checkpoint_log.entries()
                expected = newest
                if kind == "replay" and len(entries) >= 2:
                    chosen = entries[-2]
                    task = TaskStorage.open(
                        config, "task-0", blob_store=blobs, checkpoint=chosen, fence_seq=entries[-1].seq
                    )
                    expected = chosen.checkpoint.input_offsets["input"]
                else:
                    task = TaskStorage.open(config, "task-0", blob_store=blobs)
                assert task.restored is not None
                assert task.restored.input_offsets["input"] == expected, (step, kind)
                model = dict(models[expected])
                assert contents(task) == model, (step, kind)
        task.close()
        shutil.rmtree(tmp_path / "local")
        task = TaskStorage.open(config, "task-0", blob_store=blobs.inner)
        assert newest is not None and task.restored is not None
        assert task.restored.input_offsets["input"] == newest
        assert contents(task) == models[newest]
    finally:
        task.close()


def test_commits_whose_write_batch_spilled_restore_exactly_cold_and_by_catch_up(tmp_path: Path) -> None:
    """A write batch over its bound spills to LMDB before the flush (the version is cleared then); the change set
    still holds every change, so each run does: a cold restore and a catch-up from an older local copy give exactly
    the state, tombstones of keys put and deleted across spills included."""
    blobs = MemoryBlobStore()
    config = make_config(tmp_path, **EAGER, **{"stores.counts.write.batch.max.bytes": "2KiB"})
    model: dict[bytes, bytes] = {}
    with TaskStorage.open(config, "task-0", blob_store=blobs) as task:
        put_all(task, model, base_keys(300))
        task.commit_durably({"input": "0"})
        for round_no in range(1, 4):
            for repeat in range(3):  # the same keys put, deleted and put again across spills
                churn(task, model, round_no * 10 + repeat)
            task.commit_durably({"input": str(round_no)})
            settle(task)
    shutil.copytree(tmp_path / "local", tmp_path / "older")
    with TaskStorage.open(config, "task-0", blob_store=blobs) as task:
        assert contents(task) == model
        for round_no in range(4, 7):
            for repeat in range(3):
                churn(task, model, round_no * 10 + repeat)
            task.commit_durably({"input": str(round_no)})
            settle(task)
    shutil.rmtree(tmp_path / "local")
    shutil.copytree(tmp_path / "older", tmp_path / "local")
    with TaskStorage.open(config, "task-0", blob_store=blobs) as task:
        assert contents(task) == model
        assert task.metrics.counter("restore.stores.full") + task.metrics.counter("restore.stores.caught.up") == 1
    shutil.rmtree(tmp_path / "local")
    with TaskStorage.open(config, "task-0", blob_store=blobs) as task:
        assert task.metrics.counter("restore.stores.full") == 1
        assert contents(task) == model


# -- restore fallback between the two backends of a dual commit, both orders --------------------------------------------

DUAL = {
    **EAGER,
    "stores.counts.backup.factories": "changelog,blobsnapshot",
    "changelog.snapshot.interval.commits": 3,
    "task.checkpoint.retained": 3,
}


def restored_by(task: TaskStorage) -> str | None:
    return task.commit_manager.backups[0].manager.context.restored_by["counts"]  # type: ignore[attr-defined]


def _damage_newest(blobs: MemoryBlobStore, task: TaskStorage, factory: str) -> str:
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


def test_a_merge_whose_cached_inputs_are_gone_downloads_them_and_stays_exact(tmp_path: Path) -> None:
    """The run cache is emptied (a disk cleaner) before a merge reads its inputs: the merge reads them from the blob
    store, verified, and the merged run restores exactly."""
    counting = ControlledBlobStore(MemoryBlobStore())
    gets: list[str] = []
    inner_get = counting.get

    def get(name: str, *, start: int | None = None, end: int | None = None) -> bytes:
        gets.append(name)
        return inner_get(name, start=start, end=end)

    counting.get = get  # type: ignore[method-assign]
    config = make_config(tmp_path, **MERGE_EAGER)
    model: dict[bytes, bytes] = {}
    with TaskStorage.open(config, "task-0", blob_store=counting) as task:
        state = manager_of(task)._states["counts"]
        put_all(task, model, base_keys())
        task.commit_durably({"input": "0"})
        put_all(task, model, {b"key-00001": b"one"})
        task.commit_durably({"input": "1"})
        for path in state.cache.iterdir():
            path.unlink()
        put_all(task, model, {b"key-00002": b"two"})
        task.commit_durably({"input": "2"})  # starts the merge of the two runs above the bottom
        assert state.compaction is not None
        compacted = state.compaction.result(timeout=60)
        assert compacted is not None and not compacted.output.base
        assert any("/runs/" in name for name in gets), "the merge read its inputs from the blob store"
        put_all(task, model, {b"key-00003": b"three"})
        task.commit_durably({"input": "3"})
        assert compacted.output in latest_index(counting.inner, task).runs
    shutil.rmtree(tmp_path / "local")
    with TaskStorage.open(config, "task-0", blob_store=counting.inner) as task:
        assert contents(task) == model


def test_close_waits_for_a_running_full_compaction_and_the_next_open_adopts_it(tmp_path: Path) -> None:
    """A full compaction (reading an LMDB view) is held on its upload when the task closes: close() waits for it
    (the view must end before the store closes), the result is recorded, and the next open adopts it."""
    import threading

    blobs = ControlledBlobStore(MemoryBlobStore())
    blobs.hold = lambda name: threading.current_thread().name.startswith("blobsnapshot-compaction")
    config = make_config(
        tmp_path, **{"blobsnapshot.compaction.full.min.bytes": 0, "blobsnapshot.compaction.full.ratio": 0.05}
    )
    model: dict[bytes, bytes] = {}
    closed = threading.Event()
    try:
        task = TaskStorage.open(config, "task-0", blob_store=blobs)
        state = manager_of(task)._states["counts"]
        put_all(task, model, base_keys())
        task.commit_durably({"input": "0"})
        put_all(task, model, {f"key-{i:05d}".encode(): b"changed" for i in range(0, 200, 3)})
        task.commit_durably({"input": "1"})
        assert state.compaction is not None and state.compaction_inputs[0].first_seq == 1  # a full compaction
        assert blobs.held.wait(30)
        closer = threading.Thread(target=lambda: (task.close(), closed.set()))
        closer.start()
        assert not closed.wait(0.5), "close() returned while the full compaction still read the store"
        blobs.release.set()
        assert closed.wait(30)
        closer.join()
    finally:
        blobs.release.set()
    with TaskStorage.open(config, "task-0", blob_store=blobs.inner) as task:
        assert contents(task) == model
        put_all(task, model, {b"key-00001": b"after"})
        task.commit_durably({"input": "2"})
        assert task.metrics.counter("blobsnapshot.compaction.adopted") == 1
        assert latest_index(blobs.inner, task).runs[0].base
    shutil.rmtree(tmp_path / "local")
    with TaskStorage.open(config, "task-0", blob_store=blobs.inner) as task:
        assert contents(task) == model


def test_a_merge_adopted_after_its_ttl_is_not_named_expired(tmp_path: Path) -> None:
    """No failure at all: ttl.ms 100 s (accepted with the 1000 s grace period), one commit every 150 s. A merge
    uploaded after commit n is adopted by commit n+1, 150 s later: young for the grace rule, so not written again,
    but past its expiry. A sweep of another attempt between that index write and its checkpoint deletes it."""
    import threading

    clock = FakeClock()
    blobs = ControlledBlobStore(MemoryBlobStore())
    config = make_config(
        tmp_path, **MERGE_EAGER, **{"blobsnapshot.gc.grace.period.ms": GRACE_MS, "blobsnapshot.ttl.ms": 100_000}
    )
    model: dict[bytes, bytes] = {}
    try:
        with TaskStorage.open(config, "task-0", blob_store=blobs) as task:
            manager_of(task).clock = clock
            state = manager_of(task)._states["counts"]
            put_all(task, model, base_keys())
            task.commit_durably({"input": "0"})
            round_no = 1
            while state.compaction is None:
                clock.now += 150.0
                put_all(task, model, {f"key-{round_no:05d}".encode(): b"x"})
                task.commit_durably({"input": str(round_no)})
                round_no += 1
                assert round_no < 6
            merged = state.compaction.result(timeout=60)
            assert merged is not None
            clock.now += 150.0
            blobs.hold = lambda name: "/checkpoints/" in name and threading.current_thread().name != "zombie"
            put_all(task, model, {b"key-00100": b"adopts the merge"})
            pending = task.commit({"input": str(round_no)})
            assert pending is not None
            assert blobs.held.wait(30)
            _zombie_sweep(tmp_path, config, blobs.inner, clock.now)
            blobs.release.set()
            pending.result(timeout=30)
            index = latest_index(blobs.inner, task)
            assert merged.output in index.runs
            assert missing_runs(blobs.inner, index) == [], "the acknowledged checkpoint names a deleted run"
    finally:
        blobs.release.set()
    shutil.rmtree(tmp_path / "local")
    with TaskStorage.open(config, "task-0", blob_store=blobs.inner) as task:
        assert contents(task) == model


def test_a_run_found_present_and_young_is_still_refreshed_when_a_much_later_index_names_it(tmp_path: Path) -> None:
    """Commit 2's run lands with its reply lost; commit 3, soon after, finds it present and young (reused, not
    written) and fails itself at its index write. Commit 4 comes more than the grace period later: the run must be
    written again before index 4 names it (it was found with an age, and that age is now past the grace period).
    If it is taken as fresh, another attempt's sweep between index 4 and its checkpoint deletes it."""
    clock = FakeClock()
    blobs = ControlledBlobStore(MemoryBlobStore())
    config = make_config(tmp_path, **NEVER, **{"blobsnapshot.gc.grace.period.ms": GRACE_MS})
    model: dict[bytes, bytes] = {}
    try:
        with TaskStorage.open(config, "task-0", blob_store=blobs) as task:
            manager_of(task).clock = clock
            put_all(task, model, base_keys())
            task.commit_durably({"input": "0"})
            blobs.lose_reply, blobs.replies_to_lose = (lambda name: "/runs/" in name), 1
            put_all(task, model, {b"key-00007": b"second"})
            with pytest.raises(Exception, match="reply was lost"):
                task.commit_durably({"input": "1"})
            clock.now += 10.0
            blobs.fail, blobs.failures_left = (lambda name: "/checkpoints/" in name), 1
            put_all(task, model, {b"key-00009": b"third"})
            with pytest.raises(Exception, match="injected failure"):
                task.commit_durably({"input": "2"})
            clock.now += 1.5 * GRACE_MS / 1000.0
            blobs.hold = lambda name: "/checkpoints/" in name
            put_all(task, model, {b"key-00011": b"fourth"})
            pending = task.commit({"input": "3"})
            assert pending is not None
            assert blobs.held.wait(30)
            _zombie_sweep(tmp_path, config, blobs.inner, clock.now)
            blobs.release.set()
            pending.result(timeout=30)
            index = latest_index(blobs.inner, task)
            assert missing_runs(blobs.inner, index) == [], "the acknowledged checkpoint names a deleted run"
    finally:
        blobs.release.set()
    shutil.rmtree(tmp_path / "local")
    with TaskStorage.open(config, "task-0", blob_store=blobs.inner) as task:
        assert contents(task) == model


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
                    blobs.lose_reply, blobs.replies_to_lose = (lambda name, w=where: w in name), 1
                else:
                    blobs.fail, blobs.failures_left = (lambda name, w=where: w in name), 1
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
