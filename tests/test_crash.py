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
"""

from __future__ import annotations

import os
import shutil
import signal
import subprocess
import sys
import tempfile
from collections.abc import Iterator
from pathlib import Path

import pytest
from statebackend.checkpoint import CheckpointLog, read_local_checkpoint

from statebackend.blobstores.file import FileBlobStore
from tests.crash_child import (
    SETTLE_ENV,
    STORE,
    TASK,
    blobs_dir,
    expected_state,
    read_report,
    report_contents,
    reported_durable,
)
from tests.waiting import scaled

REPO = Path(__file__).resolve().parent.parent
COMMITS = 8  # commits the crashing child attempts
MORE = 2  # commits each restoring child adds

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
    "changelog.cleanup.deleted:1": (4, COMMITS),
    # a background snapshot (of commit 3's version, started in commit 3's sync part, so possibly before 3 is
    # durable) half uploaded; and one fully uploaded but never adopted by a commit
    "blobstore.put.background_snapshot:1": (2, COMMITS),
    "changelog.background_snapshot.uploaded:1": (2, COMMITS),
}


@pytest.mark.slow
@pytest.mark.parametrize("crash_at", list(CRASH_POINTS))
def test_sigkill_at_a_commit_step_restores_exactly_the_last_durable_checkpoint(work: Path, crash_at: str) -> None:
    tmp_path = work
    workdir = tmp_path / "run"
    workdir.mkdir()
    crashed = _child(workdir, tmp_path / "crashing.json", COMMITS, crash_at=crash_at)
    assert crashed.returncode == -signal.SIGKILL, (
        f"the child was to die at {crash_at} but exited with {crashed.returncode}:\n{crashed.stderr[-3000:]}"
    )
    assert read_report(tmp_path / "crashing.json")["restored"] == 0

    durable = _durable_commit(workdir)
    reported = reported_durable(workdir)
    assert reported <= durable <= reported + 1, "at most the commit in flight can have landed unreported"
    wanted = CRASH_POINTS[crash_at]
    if isinstance(wanted, int):
        assert durable == wanted
    else:
        assert wanted[0] <= durable <= wanted[1]
    local = read_local_checkpoint(workdir / "local" / "job" / TASK / STORE)
    if local is not None:
        assert int(local.input_offsets["input"]) <= durable, "CHECKPOINT-V2 claims a checkpoint that is not durable"

    wiped = tmp_path / "wiped"
    shutil.copytree(workdir, wiped)
    shutil.rmtree(wiped / "local")

    for label, directory in (("kept", workdir), ("wiped", wiped)):
        resumed = _child(directory, tmp_path / f"{label}.json", MORE)
        assert resumed.returncode == 0, f"restore with the local dir {label} failed:\n{resumed.stderr[-3000:]}"
        report = read_report(tmp_path / f"{label}.json")
        assert report["restored"] == durable, f"local dir {label}"
        assert report_contents(report) == expected_state(durable), f"local dir {label}: restored state differs"
        assert _durable_commit(directory) == durable + MORE

    shutil.rmtree(workdir / "local")
    final = _child(workdir, tmp_path / "final.json", 0)
    assert final.returncode == 0, final.stderr[-3000:]
    assert read_report(tmp_path / "final.json")["restored"] == durable + MORE
    assert report_contents(read_report(tmp_path / "final.json")) == expected_state(durable + MORE)


@pytest.fixture
def work() -> Iterator[Path]:
    """A temp dir, RAM-backed where possible: SIGKILL takes the process, not the page cache, so the fsyncs of LMDB
    and the file:// store change nothing these tests can observe; on a shared disk they only cost seconds."""
    fast = "/dev/shm" if os.path.isdir("/dev/shm") and os.access("/dev/shm", os.W_OK) else None
    path = Path(tempfile.mkdtemp(prefix="statebackend-crash-", dir=fast))
    try:
        yield path
    finally:
        shutil.rmtree(path, ignore_errors=True)


def _child(
    workdir: Path, report: Path, commits: int, *, crash_at: str | None = None
) -> subprocess.CompletedProcess[str]:
    env = {key: value for key, value in os.environ.items() if key != "STATEBACKEND_CRASH_AT"}
    if crash_at is not None:
        env["STATEBACKEND_CRASH_AT"] = crash_at
        if crash_at.startswith("changelog.cleanup."):  # retention deletes only once a snapshot is adopted
            env[SETTLE_ENV] = "1"
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(REPO), env.get("PYTHONPATH")]))
    return subprocess.run(
        [sys.executable, "-m", "tests.crash_child", str(workdir), str(report), str(commits)],
        cwd=REPO,
        env=env,
        capture_output=True,
        text=True,
        timeout=scaled(90),
        check=False,  # a hang guard
    )


def _durable_commit(workdir: Path) -> int:
    """The commit number of the newest checkpoint in the checkpoint log (0: none), read by this process. No blob
    store root yet is no checkpoint: a child killed while it still imports never got to create it."""
    if not blobs_dir(workdir).is_dir():
        return 0
    entry = CheckpointLog(FileBlobStore(str(blobs_dir(workdir)), create=False), "job", TASK).latest()
    return 0 if entry is None else int(entry.checkpoint.input_offsets["input"])
