"""Crash tests of the blob-snapshot backend: SIGKILL a real process at each step of snapshot, run upload, index write,
compaction, cleanup and sweep, restore in fresh processes, and check the state is exactly the last durable checkpoint,
with the local dir kept and with it wiped; also for dual commit (changelog,blobsnapshot) restoring through either
backend.

The killed process is tests/crash_child.py with ``CRASH_CHILD_BACKUP_FACTORIES`` set (long values; a compaction
fanout of 2 and a full compaction once the runs above the base are 3x its size, so merges and new base runs happen,
and can be killed, within a few commits; no gc grace period and a sweep every 2 commits, so garbage collection runs,
and can be killed, within a few commits). Where it dies is chosen with ``STATEBACKEND_CRASH_AT``: the one-line
``crashpoint(...)`` calls in backends/blobsnapshot/backup.py and statebackend/commit.py, and crash_child's blob store
wrapper for deaths mid-write (``blobstore.put.run`` leaves half the blob in a temp file).

Which checkpoint is durable is read from the checkpoint log (the child cannot know whether the write it died in
landed); the data is a function of the commit number (crash_child.expected_state), so the expected state is exact.
Per crash point the test checks:

1. the child died by SIGKILL and the durable checkpoint is the one the point implies, including whether the commit
   in flight landed (against the child's own log of the commits it saw durable);
2. the local ``CHECKPOINT-V2`` file never claims a checkpoint newer than the durable one;
3. the newest ``task.checkpoint.retained`` checkpoints in the log still have their index and every run it lists
   (cleanup and sweep never delete what a retained checkpoint needs), after the crash and at the end;
4. fresh processes with the local dir kept and wiped (a copy taken right after the crash) restore exactly that
   state and commit twice more;
5. after (4), a fresh process with the local dir wiped restores the state of the continued commits from the blob
   store alone, and its start-up sweep leaves only the blobs the checkpoints in the log need (the crash's orphans,
   runs of commits and compactions no index lists, are collected).

The children are forked by one fork server per module (tests/fork_server.py), which imported the child and the
backends once: each child is a process of its own, with the environment and directory a fresh interpreter would get,
and reads its crash point anew, without an interpreter start and imports of its own.
"""

from __future__ import annotations

import signal
import subprocess
from collections.abc import Iterator
from pathlib import Path

import attrs
import pytest
from statebackend.backends.blobsnapshot.backup import read_marker
from statebackend.backends.blobsnapshot.format import index_prefix, is_inline_marker, run_name, runs_prefix
from statebackend.checkpoint import CheckpointV2

from statebackend.blobstores.file import FileBlobStore
from tests.crash_child import (
    BACKUP_FACTORIES_ENV,
    CRASH_AT_ENV,
    PRELOAD,
    RESTORE_FACTORY_ENV,
    STORE,
    TASK,
    VALUE_REPEAT_ENV,
    blobs_dir,
    checkpoint_log,
    crash_workdir,
    durable_commit,
    restore_kept_and_wiped,
    run_child,
    run_to_crash,
)
from tests.fork_server import ForkServer

RETAINED = 2  # task.checkpoint.retained in crash_child.config
#: ~600-byte values: a base run of the store is some tens of KiB
VALUE_REPEAT = 50


@attrs.frozen
class Durable:
    """The checkpoint a crash must leave durable: a commit number in [low, high], and whether the commit in flight
    landed (``True``/``False``; ``None`` for points off the task's thread, whose timing against its commits is not
    fixed)."""

    low: int
    high: int
    in_flight_landed: bool | None


def exactly(commit: int, *, landed: bool) -> Durable:
    return Durable(commit, commit, landed)


#: crash point (``<name>[:<nth hit>]``) -> the durable checkpoint it implies
CRASH_POINTS: dict[str, Durable] = {
    # commit 4's read view is open, nothing copied nor uploaded
    "commit.after_snapshot:4": exactly(3, landed=False),
    # commit 4's run is written to the local run cache, nothing uploaded
    "blobsnapshot.upload.run_staged:4": exactly(3, landed=False),
    # the first run ever half written as a temp file; and fully written, then death
    "blobstore.put.run:1": exactly(0, landed=False),
    "blobsnapshot.upload.run_uploaded:1": exactly(0, landed=False),
    # a later run uploaded, then death (commit 4's, or a compaction's on the compaction thread)
    "blobsnapshot.upload.run_uploaded:4": Durable(2, 4, None),
    # every run of commit 4 uploaded, no index: an orphan run
    "blobsnapshot.upload.runs_uploaded:4": exactly(3, landed=False),
    # the first compaction's run written locally, not uploaded; then uploaded, not adopted by any index (an orphan
    # run, and no record of it in the store dir); and the same for the second compaction
    "blobsnapshot.compaction.written:1": Durable(1, 4, None),
    "blobsnapshot.compaction.uploaded:1": Durable(1, 4, None),
    "blobsnapshot.compaction.written:2": Durable(2, 7, None),
    "blobsnapshot.compaction.uploaded:2": Durable(2, 7, None),
    # commit 4's index made (it goes into the checkpoint's marker; no index blob), no checkpoint carries it
    "blobsnapshot.upload.index_written:4": exactly(3, landed=False),
    # commit 4 durable, but its cleanup never ran
    "commit.after_checkpoint_write:4": exactly(4, landed=True),
    # the first cleanup took commit 1's index and runs as durable (bookkeeping: nothing is written), then death
    "blobsnapshot.cleanup.durable:1": Durable(1, 3, None),
    # retention's first batch with garbage (the log's retention_interval is 2 in the child) deleted the runs that
    # compaction merged away and that only the indexes it let go listed, in one request, then death (with no index
    # blob a commit, the first batch that deletes anything comes once a merged-away run falls out: commit 6 here)
    "blobsnapshot.cleanup.deleted:1": Durable(3, 7, None),
}

BLOBSNAPSHOT = "blobsnapshot"
DUAL = "changelog,blobsnapshot"


@pytest.mark.slow
@pytest.mark.parametrize("crash_at", list(CRASH_POINTS))
def test_sigkill_at_a_blobsnapshot_step_restores_exactly_the_last_durable_checkpoint(
    work: Path, crash_at: str, fork_server: ForkServer
) -> None:
    durable = _crash(work, fork_server, crash_at, CRASH_POINTS[crash_at], factories=BLOBSNAPSHOT)
    _restore_and_go_on(work, fork_server, durable, factories=BLOBSNAPSHOT)


@pytest.mark.slow
def test_sigkill_during_a_sweep_of_a_crashed_upload_restores_exactly_the_last_durable_checkpoint(
    work: Path, fork_server: ForkServer
) -> None:
    """A first child dies after making commit 4's index (an orphan run, no checkpoint); the next one restores
    commit 3 and dies at the first delete of its start-up sweep of that garbage."""
    _crash(work, fork_server, "blobsnapshot.upload.index_written:4", exactly(3, landed=False), factories=BLOBSNAPSHOT)
    sweeping = _child(
        fork_server,
        work / "run",
        work / "sweeping.json",
        0,
        crash_at="blobsnapshot.sweep.deleted:1",
        factories=BLOBSNAPSHOT,
    )
    assert sweeping.returncode == -signal.SIGKILL, (
        f"the start-up sweep was to die at its first delete but the child exited with {sweeping.returncode}:\n"
        f"{sweeping.stderr[-3000:]}"
    )
    # (the sweep runs in the background from TaskStorage.open: it may kill the child before its report is written)
    assert durable_commit(work / "run") == 3
    _assert_retained_checkpoints_restorable(work / "run")
    _restore_and_go_on(work, fork_server, 3, factories=BLOBSNAPSHOT)


@pytest.mark.slow
@pytest.mark.parametrize("restore_factory", ["blobsnapshot", "changelog"])
def test_sigkill_mid_blobsnapshot_upload_of_a_dual_commit_restores_exactly_through_either_backend(
    work: Path, restore_factory: str, fork_server: ForkServer
) -> None:
    """Dual commit: the changelog delta of the commit in flight may be uploaded, its blobsnapshot upload is cut
    short; no checkpoint names either, and both backends restore exactly the previous one."""
    durable = _crash(
        work,
        fork_server,
        "blobsnapshot.upload.run_staged:4",
        exactly(3, landed=False),
        factories=DUAL,
        restore_factory=restore_factory,
    )
    _restore_and_go_on(work, fork_server, durable, factories=DUAL, restore_factory=restore_factory)


# -- steps ------------------------------------------------------------------------------------------------------


def _crash(
    work: Path,
    server: ForkServer,
    crash_at: str,
    wanted: Durable,
    *,
    factories: str,
    restore_factory: str | None = None,
) -> int:
    """Run the crashing child in ``work/run`` (forked by ``server``); check what it left; return the durable commit
    number."""
    durable, reported = run_to_crash(work, crash_at, _env(factories, restore_factory), server=server)
    assert wanted.low <= durable <= wanted.high, f"{crash_at}: durable commit {durable}"
    if wanted.in_flight_landed is None:
        assert reported <= durable <= reported + 1, "at most the commit in flight can have landed unreported"
    else:
        assert durable == reported + int(wanted.in_flight_landed), (
            f"{crash_at}: durable commit {durable}, last reported durable {reported}"
        )
    _assert_retained_checkpoints_restorable(work / "run")
    return durable


def _restore_and_go_on(
    work: Path, server: ForkServer, durable: int, *, factories: str, restore_factory: str | None = None
) -> None:
    """Restore in fresh processes with ``work/run``'s local dir kept and wiped, commit on, restore once more; every
    retained checkpoint stays restorable, and the last start-up sweep leaves only the blobs the log needs."""
    env = _env(factories, restore_factory)
    check = _assert_retained_checkpoints_restorable
    restore_kept_and_wiped(work, durable, env, value_repeat=VALUE_REPEAT, check=check, server=server)
    _assert_only_retained_blobs(work / "run")


# -- helpers ----------------------------------------------------------------------------------------------------


@pytest.fixture
def work() -> Iterator[Path]:
    with crash_workdir("statebackend-crash-blobsnapshot-") as path:
        yield path


@pytest.fixture(scope="module")
def fork_server() -> Iterator[ForkServer]:
    """The module's fork server: its children skip the interpreter's start and the imports."""
    with ForkServer(PRELOAD) as server:
        yield server


def _env(factories: str, restore_factory: str | None = None, crash_at: str | None = None) -> dict[str, str | None]:
    return {
        CRASH_AT_ENV: crash_at,
        RESTORE_FACTORY_ENV: restore_factory,
        BACKUP_FACTORIES_ENV: factories,
        VALUE_REPEAT_ENV: str(VALUE_REPEAT),
    }


def _child(
    server: ForkServer,
    workdir: Path,
    report: Path,
    commits: int,
    *,
    factories: str,
    restore_factory: str | None = None,
    crash_at: str | None = None,
) -> subprocess.CompletedProcess[str]:
    return run_child(workdir, report, commits, _env(factories, restore_factory, crash_at), server=server)


def _assert_retained_checkpoints_restorable(workdir: Path) -> None:
    """The newest RETAINED checkpoints' blobsnapshot indexes are readable and every run they list is present, with
    its size."""
    blob_store = FileBlobStore(str(blobs_dir(workdir)), create=False)
    entries = checkpoint_log(workdir).entries()[-RETAINED:]
    for entry in entries:
        assert isinstance(entry.checkpoint, CheckpointV2)
        marker = entry.checkpoint.markers_for(BLOBSNAPSHOT).get(STORE)
        assert marker is not None, f"checkpoint #{entry.seq} has no blobsnapshot marker"
        index = read_marker(blob_store, marker, job="job", task=TASK, store=STORE)
        prefix = f"job/{TASK}/{STORE}/{BLOBSNAPSHOT}/"
        missing = sorted(
            run.hash
            for run in index.runs
            if not blob_store.exists(run_name(prefix, run.hash))
            or blob_store.head(run_name(prefix, run.hash)).size != run.size
        )
        assert not missing, f"checkpoint #{entry.seq}: index {marker} lists missing runs {missing}"


def _assert_only_retained_blobs(workdir: Path) -> None:
    """Every index in the blob store is one a checkpoint in the log names, every run is one of theirs: what the
    crash left behind (orphan runs and indexes, compaction outputs never adopted, expiries never removed) was
    collected."""
    blob_store = FileBlobStore(str(blobs_dir(workdir)), create=False)
    markers = set()
    for entry in checkpoint_log(workdir).entries():
        assert isinstance(entry.checkpoint, CheckpointV2)
        markers.add(entry.checkpoint.markers_for(BLOBSNAPSHOT)[STORE])
    prefix = f"job/{TASK}/{STORE}/{BLOBSNAPSHOT}/"
    indexes = set(blob_store.list(index_prefix(prefix)))
    named = {m for m in markers if not is_inline_marker(m)}  # index blobs: none since inline markers
    assert indexes == named, f"indexes no checkpoint names: {sorted(indexes - named)}"
    referenced = {
        name
        for m in markers
        for name in read_marker(blob_store, m, job="job", task=TASK, store=STORE).blob_names(prefix)
    }
    runs = set(blob_store.list(runs_prefix(prefix)))
    assert runs == referenced, f"runs no retained index lists: {sorted(runs - referenced)}"
