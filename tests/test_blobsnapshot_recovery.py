"""The blob-snapshot LSM backend recovering from faults without losing, altering, mixing or resurrecting
acknowledged state: a run not written locally, a failed snapshot in a single-backend commit, replays to older
checkpoints with compaction records, a lost cached copy, random faults, reopens, wipes and replays, spilled write
batches, merges whose cached inputs are gone, and a close during a full compaction. Run ages:
test_blobsnapshot_runs.py; dual commits: test_blobsnapshot_dual.py."""

from __future__ import annotations

import shutil
from pathlib import Path
from typing import Any

import pytest
from statebackend.backends.blobsnapshot import upload as upload_module
from statebackend.backends.blobsnapshot.backup import BlobSnapshotBackupManager

from statebackend.blobstores.memory import MemoryBlobStore
from statebackend.recordfile import write_file
from statebackend.task import TaskStorage
from statebackend.testing.controlled import ControlledBlobStore
from tests.backend_helpers import EAGER_FULL as EAGER
from tests.backend_helpers import (
    GRACE_MS,
    MERGE_EAGER,
    NEVER,
    FakeClock,
    base_keys,
    churn,
    latest_index,
    naming,
    put_all,
    restored_after_wipe,
    settle,
)
from tests.backend_helpers import blobsnapshot_config as make_config
from tests.backend_helpers import blobsnapshot_manager as manager_of
from tests.backend_helpers import store_contents as contents

#: no compaction at all
#: merges of every two runs of a level; a full compaction only when the runs above the bottom outgrow it


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
    real_write_file = write_file
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


def test_a_failed_blobsnapshot_snapshot_in_a_single_backend_commit_rebases(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Contrast to the dual-commit test (test_blobsnapshot_dual.py): with two stores on blobsnapshot alone, the second
    store's snapshot failing after the first one's ran makes abort() re-base both; the next checkpoint restores
    exactly."""
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
        assert manager.shared.stores["counts"].needs_base
        put_all(task, model, {b"key-00011": b"third"})
        task.commit_durably({"input": "2"})
    assert restored_after_wipe(config, blobs) == model


# -- replays, records and lineages that held ---------------------------------------------------------------------------


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
        manager_of(task).shared.clock = clock
        state = manager_of(task).shared.stores["counts"]
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
                    blobs.lose_reply, blobs.replies_to_lose = naming(where), 1
                else:
                    blobs.fail, blobs.failures_left = naming(where), 1
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
        state = manager_of(task).shared.stores["counts"]
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
        state = manager_of(task).shared.stores["counts"]
        put_all(task, model, base_keys())
        task.commit_durably({"input": "0"})
        put_all(task, model, {f"key-{i:05d}".encode(): b"changed" for i in range(0, 200, 3)})
        task.commit_durably({"input": "1"})
        assert state.compaction is not None and state.compaction_inputs[0].first_seq == 1  # a full compaction
        assert blobs.held.wait(30)

        def close() -> None:
            task.close()
            closed.set()

        closer = threading.Thread(target=close)
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
