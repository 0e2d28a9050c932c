"""The ages of blob-snapshot runs and the grace period: a run or merge found present is not taken as young when it
is old, a run this manager uploaded long ago is refreshed before another attempt's sweep could take it, and an index
never names a run past its ttl."""

from __future__ import annotations

import contextlib
import shutil
from collections.abc import Iterator
from pathlib import Path

import pytest
from statebackend.backends.blobsnapshot.format import RunIndex
from statebackend.backends.blobsnapshot.state import Compacted

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
    blobsnapshot_config,
    blobsnapshot_manager,
    latest_index,
    missing_runs,
    put_all,
    store_contents,
)

GRACE = {"blobsnapshot.gc.grace.period.ms": GRACE_MS}
# ttl.ms 100 s is accepted with the 1000 s grace period
SHORT_TTL = {**GRACE, "blobsnapshot.ttl.ms": 100_000}
PAST_GRACE_S = 1.5 * GRACE_MS / 1000.0


# -- the grace period: a run found present is taken as young ----------------------------------------------------------


def _zombie_sweep(tmp_path: Path, config: dict[str, object], blobs: BlobStore, now: float) -> int:
    """Another attempt of the same task (its own local dir) opens at the log's head and sweeps, as at init with
    gc.on.init: its mark is the log and its own chain."""
    zombie_config = {**config, "state.local.dir": str(tmp_path / "zombie")}
    with TaskStorage.open(zombie_config, "task-0", blob_store=zombie_blobs(blobs)) as zombie:
        return blobsnapshot_manager(zombie).sweep(now=now).runs_deleted


def zombie_blobs(blobs: BlobStore) -> BlobStore:
    """The zombie reaches the store directly: none of the faults or holds set for the task applies to it."""
    return blobs.inner if isinstance(blobs, ControlledBlobStore) else blobs


@contextlib.contextmanager
def _task_on_clock(config: dict[str, object], blobs: BlobStore, clock: FakeClock) -> Iterator[TaskStorage]:
    """The task, its manager reading ``clock``; a held write is released whatever happens."""
    try:
        with TaskStorage.open(config, "task-0", blob_store=blobs) as task:
            blobsnapshot_manager(task).shared.clock = clock
            yield task
    finally:
        if isinstance(blobs, ControlledBlobStore):
            blobs.release.set()


def _failed_commit(
    task: TaskStorage, blobs: ControlledBlobStore, model: dict[bytes, bytes], fault: str, no: int
) -> None:
    """Commit ``no`` fails once: the reply to its run upload is lost (``"lost reply"``, the run lands) or its index
    write fails (``"failed index"``, the run was uploaded)."""
    if fault == "lost reply":
        blobs.lose_reply, blobs.replies_to_lose = (lambda name: "/runs/" in name), 1
        expected = "reply was lost"
    else:
        blobs.fail, blobs.failures_left = (lambda name: "/checkpoints/" in name), 1
        expected = "injected failure"
    put_all(task, model, {f"key-{5 + 2 * no:05d}".encode(): f"commit {no}".encode()})
    with pytest.raises(Exception, match=expected):
        task.commit_durably({"input": str(no)})


def _commit_across_a_zombie_sweep(
    tmp_path: Path,
    config: dict[str, object],
    task: TaskStorage,
    blobs: ControlledBlobStore,
    model: dict[bytes, bytes],
    items: dict[bytes, bytes],
    no: int,
    now: float,
) -> RunIndex:
    """Commit ``items`` as ``no``; its index is written, and before its checkpoint lands another attempt sweeps. The
    acknowledged checkpoint names no deleted run; its index is returned."""
    blobs.hold = lambda name: "/checkpoints/" in name
    put_all(task, model, items)
    pending = task.commit({"input": str(no)})
    assert pending is not None
    assert blobs.held.wait(30), "the checkpoint write never started"
    _zombie_sweep(tmp_path, config, blobs, now)
    blobs.release.set()
    pending.result(timeout=30)
    index = latest_index(blobs.inner, task)
    assert missing_runs(blobs.inner, index) == [], "the acknowledged checkpoint names a deleted run"
    return index


def _restores_the_model(tmp_path: Path, config: dict[str, object], blobs: BlobStore, model: dict[bytes, bytes]) -> None:
    """The local dir is lost: a task opened from the blob store alone holds exactly the model."""
    shutil.rmtree(tmp_path / "local")
    with TaskStorage.open(config, "task-0", blob_store=zombie_blobs(blobs)) as task:
        assert store_contents(task) == model


@pytest.mark.parametrize(
    ("faults", "extra"),
    [
        pytest.param([("lost reply", PAST_GRACE_S)], GRACE, id="found-present-after-a-lost-reply"),
        pytest.param([("failed index", PAST_GRACE_S)], GRACE, id="uploaded-by-this-manager"),
        pytest.param([("failed index", 200.0)], SHORT_TTL, id="named-past-its-ttl"),
        pytest.param(
            [("lost reply", 10.0), ("failed index", PAST_GRACE_S)], GRACE, id="found-young-then-named-much-later"
        ),
    ],
)
def test_a_run_of_a_failed_commit_that_a_later_index_names_survives_another_attempts_sweep(
    tmp_path: Path, faults: list[tuple[str, float]], extra: dict[str, object]
) -> None:
    """A commit fails after its run was uploaded; the task idles, and a later commit names that run without writing
    it. Another attempt's sweep between that index write and its checkpoint must not take the run.

    - found-present-after-a-lost-reply: the run lands, its reply is lost; the next commit, past the grace period,
      finds it present and would name it with its old ``created_at``. A run written by this manager that old is
      written again before an index names it (docs/formats-blobsnapshot.md, Garbage); the found-present path skipped
      that.
    - uploaded-by-this-manager: the case the grace logic handles: the index write fails, the next commit past the
      grace period writes the run again (fresh age) before naming it.
    - named-past-its-ttl: ttl.ms 100 s, grace 1000 s; the next commit, 200 s later, names a run young by the grace
      rule (no refresh) but past its expiry, which a sweep takes at once.
    - found-young-then-named-much-later: commit 2 finds the run present and young (reused, not written) and fails at
      its index write; commit 3 comes past the grace period and must write the run again: the age it was found with
      is now past the grace period.
    """
    clock = FakeClock()
    blobs = ControlledBlobStore(MemoryBlobStore())
    config = blobsnapshot_config(tmp_path, **NEVER, **extra)
    model: dict[bytes, bytes] = {}
    with _task_on_clock(config, blobs, clock) as task:
        put_all(task, model, base_keys())
        task.commit_durably({"input": "0"})
        for no, (fault, idle) in enumerate(faults, start=1):
            _failed_commit(task, blobs, model, fault, no)
            clock.now += idle
        index = _commit_across_a_zombie_sweep(
            tmp_path, config, task, blobs, model, {b"key-00099": b"named"}, len(faults) + 1, clock.now
        )
        assert len(index.runs) == len(faults) + 2  # the base run, each failed commit's run, the last commit's run
    _restores_the_model(tmp_path, config, blobs, model)


def _commit_until_a_merge(
    task: TaskStorage, model: dict[bytes, bytes], clock: FakeClock, step_s: float
) -> tuple[Compacted, int]:
    """Commit the base keys, then one key a commit, ``step_s`` apart, until a merge starts (within five commits);
    return the finished merge and the number of the next commit."""
    state = blobsnapshot_manager(task).shared.stores["counts"]
    put_all(task, model, base_keys())
    task.commit_durably({"input": "0"})
    round_no = 1
    while state.compaction is None:
        clock.now += step_s
        put_all(task, model, {f"key-{round_no:05d}".encode(): f"round-{round_no}".encode()})
        task.commit_durably({"input": str(round_no)})
        round_no += 1
        assert round_no < 6, "no compaction started"
    merged = state.compaction.result(timeout=60)
    assert merged is not None
    return merged, round_no


def test_a_recomputed_compaction_found_present_with_an_old_age_is_not_adopted_as_young(tmp_path: Path) -> None:
    """A merge is uploaded, then the task moves to another machine (its record is left behind) and comes back more
    than the grace period later: the new machine recomputes the same merge (same inputs, same bytes, same name), finds
    it present and records ``uploaded_at = now``. The blob still carries its first ``created_at``: a sweep of another
    attempt deletes it, and the next commit's index adopts it anyway (it looks young), naming a deleted run."""
    clock = FakeClock()
    blobs = MemoryBlobStore()
    config = blobsnapshot_config(tmp_path, **MERGE_EAGER, **GRACE)
    model: dict[bytes, bytes] = {}
    with _task_on_clock(config, blobs, clock) as task:
        first, round_no = _commit_until_a_merge(task, model, clock, step_s=0.0)
        assert not first.output.base
    shutil.rmtree(tmp_path / "local")  # the task moves to another machine
    clock.now += PAST_GRACE_S
    with _task_on_clock(config, blobs, clock) as task:
        state = blobsnapshot_manager(task).shared.stores["counts"]
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
    _restores_the_model(tmp_path, config, blobs, model)


def test_a_merge_adopted_after_its_ttl_is_not_named_expired(tmp_path: Path) -> None:
    """No failure at all: ttl.ms 100 s (accepted with the 1000 s grace period), one commit every 150 s. A merge
    uploaded after commit n is adopted by commit n+1, 150 s later: young for the grace rule, so not written again,
    but past its expiry. A sweep of another attempt between that index write and its checkpoint deletes it."""
    clock = FakeClock()
    blobs = ControlledBlobStore(MemoryBlobStore())
    config = blobsnapshot_config(tmp_path, **MERGE_EAGER, **SHORT_TTL)
    model: dict[bytes, bytes] = {}
    with _task_on_clock(config, blobs, clock) as task:
        merged, round_no = _commit_until_a_merge(task, model, clock, step_s=150.0)
        clock.now += 150.0
        index = _commit_across_a_zombie_sweep(
            tmp_path, config, task, blobs, model, {b"key-00100": b"adopts the merge"}, round_no, clock.now
        )
        assert merged.output in index.runs
    _restores_the_model(tmp_path, config, blobs, model)
