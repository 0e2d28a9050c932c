"""Crash tests: SIGKILL a real process at each step of the commit protocol, restore in fresh processes, and check the
state is exactly the last durable checkpoint, with the local dir kept and with it wiped.

The killed process is tests/crash_child.py; where it dies is chosen with ``STATEBACKEND_CRASH_AT`` (the hook in
statebackend/crashpoints.py and the one-line ``crashpoint(...)`` calls in statebackend/commit.py and
backends/changelog/backup.py, plus the blob store wrapper in crash_child.py for deaths mid-write).

Which checkpoint is "the last durable one" is read from the checkpoint log itself (the child cannot know whether
the write it died in landed): its input offset is the commit number, and the data is a function of the commit
number (crash_child.expected_state), so the expected state is exact. Per crash point the test checks:

1. the child died by SIGKILL (the point was reached) and the durable checkpoint is the one the point implies;
2. the local ``CHECKPOINT-V2`` file never claims a checkpoint newer than the durable one;
3. a fresh process with the local dir kept restores exactly that state and then commits on from it;
4. a fresh process with the local dir wiped (on a copy taken right after the crash) restores exactly that state and
   commits on from it;
5. after (3), a fresh process with the local dir wiped restores the state of the continued commits from the blob
   store alone, so what the crash left behind did not break the chain.

The children are forked by one fork server per module (tests/fork_server.py), which imported the child and the
backends once: each child is a process of its own, with the environment and directory a fresh interpreter would get,
and reads its crash point anew, without an interpreter start and imports of its own.
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.crash_child import (
    CRASH_COMMITS,
    PRELOAD,
    SETTLE_ENV,
    crash_workdir,
    restore_kept_and_wiped,
    run_to_crash,
)
from tests.fork_server import ForkServer

#: crash point -> (which commits must be durable: an exact commit number, or (low, high) for points on a
#: background thread, whose timing against the task's commits is not fixed)
CRASH_POINTS: dict[str, int | tuple[int, int]] = {
    # sync part of commit 4: the flush reached LMDB (after a spill), nothing reached the blob store
    "commit.after_flush:4": 3,
    "commit.after_snapshot:4": 3,
    # async part of commit 4: the delta half written as a temp file, then death
    "blobstore.put.delta:4": 3,
    # delta uploaded, checkpoint not written: an orphan delta, the checkpoint is still 3
    "commit.before_checkpoint_write:4": 3,
    # the checkpoint blob half written as a temp file: not visible, so not durable
    "blobstore.put.checkpoint:4": 3,
    # the commit point passed: durable, though the process never wrote CHECKPOINT-V2 nor learned of it
    "commit.after_checkpoint_write:4": 4,
    # the very first commit dies before its checkpoint: nothing durable, restore gives the empty store
    "commit.before_checkpoint_write:1": 0,
    # the first commit's marker for older releases written, its head not: nothing durable
    "blobstore.put.checkpoint_marker:1": 0,
    # retention deleted one blob of an older recipe, then death
    "changelog.cleanup.deleted:1": (4, CRASH_COMMITS),
    # a background snapshot (of commit 3's version, started in commit 3's sync part, so possibly before 3 is
    # durable) half uploaded; and one fully uploaded but never adopted by a commit
    "blobstore.put.background_snapshot:1": (2, CRASH_COMMITS),
    "changelog.background_snapshot.uploaded:1": (2, CRASH_COMMITS),
}


@pytest.mark.slow
@pytest.mark.parametrize("crash_at", list(CRASH_POINTS))
def test_sigkill_at_a_commit_step_restores_exactly_the_last_durable_checkpoint(
    work: Path, crash_at: str, fork_server: ForkServer
) -> None:
    # retention deletes only once a snapshot is adopted: the child waits for its background snapshots
    env = {SETTLE_ENV: "1"} if crash_at.startswith("changelog.cleanup.") else {}
    durable, reported = run_to_crash(work, crash_at, env, server=fork_server)
    assert reported <= durable <= reported + 1, "at most the commit in flight can have landed unreported"
    wanted = CRASH_POINTS[crash_at]
    if isinstance(wanted, int):
        assert durable == wanted
    else:
        assert wanted[0] <= durable <= wanted[1]
    restore_kept_and_wiped(work, durable, server=fork_server)


# -- helpers ----------------------------------------------------------------------------------------------------


@pytest.fixture
def work() -> Iterator[Path]:
    with crash_workdir("statebackend-crash-") as path:
        yield path


@pytest.fixture(scope="module")
def fork_server() -> Iterator[ForkServer]:
    """The module's fork server: its children skip the interpreter's start and the imports."""
    with ForkServer(PRELOAD) as server:
        yield server
