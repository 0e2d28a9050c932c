"""The ages of blob-snapshot runs and the grace period: a run or merge found present is not taken as young when it
is old, a run this manager uploaded long ago is refreshed before another attempt's sweep could take it, and an index
never names a run past its ttl."""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest

from statebackend.blobstores.base import BlobStore
from statebackend.blobstores.memory import MemoryBlobStore
from statebackend.task import TaskStorage
from statebackend.testing.controlled import ControlledBlobStore
from tests.backend_helpers import (
    GRACE_MS,
    MERGE_EAGER,
    NEVER,
    FakeClock,
    base_keys,
    latest_index,
    missing_runs,
    put_all,
)
from tests.backend_helpers import blobsnapshot_config as make_config
from tests.backend_helpers import blobsnapshot_manager as manager_of
from tests.backend_helpers import store_contents as contents

# -- the grace period: a run found present is taken as young ----------------------------------------------------------


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
