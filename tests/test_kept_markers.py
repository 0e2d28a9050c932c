"""The ``PARKED`` and ``HANDOVER`` files of tasks kept open (statebackend.microbatch.kept), without Spark and without a
task: a marker goes with its parked task (taken, closed, process exit) and one left behind by a dead process, or
naming a pid the system gave to a younger process, is ignored."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from statebackend.microbatch import kept

REPO = Path(__file__).resolve().parent.parent


class _Storage:
    """Stands in for a TaskStorage: what a kept task's close and its log lines use."""

    task_name = "task-0"

    def __init__(self) -> None:
        self.closed = 0

    def close(self, *, sync_local: bool = True, handover: bool = False) -> None:
        self.closed += 1


class _BlobStore:
    def close(self) -> None:
        pass


def _kept(task_dir: Path) -> kept.KeptTask:
    return kept.KeptTask(
        storage=_Storage(),  # type: ignore[arg-type]  # a stand-in with what a kept task uses
        blob_store=_BlobStore(),  # type: ignore[arg-type]  # a stand-in with what a kept task uses
        fingerprint="f",
        seq=1,
        checkpoint_id="1-1",
        files={},
        task_dir=task_dir,
    )


@pytest.fixture
def task_dir(tmp_path: Path) -> Iterator[Path]:
    directory = tmp_path / "local" / "job" / "task-0"
    directory.mkdir(parents=True)
    yield directory
    kept.release_all()


@pytest.fixture
def sleeper() -> Iterator[subprocess.Popen[bytes]]:
    process = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(600)"])
    yield process
    process.kill()
    process.wait()


def _dead_pid() -> int:
    process = subprocess.Popen([sys.executable, "-c", "pass"])
    process.wait()
    return process.pid


def test_a_marker_of_a_live_process_counts_and_one_of_a_dead_process_does_not(
    task_dir: Path, sleeper: subprocess.Popen[bytes]
) -> None:
    marker = task_dir / kept.PARKED_FILE
    marker.write_text(str(sleeper.pid))
    assert kept.parked_elsewhere(task_dir)
    marker.write_text(str(_dead_pid()))
    assert not kept.parked_elsewhere(task_dir)
    marker.write_text(str(os.getpid()))  # this process: not elsewhere
    assert not kept.parked_elsewhere(task_dir)
    marker.write_text("not a pid")
    assert not kept.parked_elsewhere(task_dir)


def test_a_marker_naming_a_pid_reused_by_a_younger_process_does_not_count(
    task_dir: Path, sleeper: subprocess.Popen[bytes]
) -> None:
    """The file was written before the process that has its pid now started: that process is not its writer."""
    started = kept._started_at(sleeper.pid)
    assert started is not None and abs(started - time.time()) < 600  # a start time, in this clock
    for name, asked in (
        (kept.PARKED_FILE, lambda: kept.parked_elsewhere(task_dir)),
        (kept.HANDOVER_FILE, lambda: kept._handover_asked(task_dir)),
    ):
        marker = task_dir / name
        marker.write_text(str(sleeper.pid))
        assert asked(), name  # written after the process started: its own
        os.utime(marker, (started - 60, started - 60))
        assert not asked(), name  # written a minute before it started: a stale file of the pid's earlier owner
        marker.unlink()


def test_the_marker_goes_when_the_parked_task_is_taken_closed_or_released(task_dir: Path) -> None:
    marker = task_dir / kept.PARKED_FILE
    key = kept.task_key(task_dir.parent.parent, "job", "task-0")
    first = _kept(task_dir)
    kept.park(key, first)
    assert marker.read_text() == str(os.getpid())
    second = _kept(task_dir)
    kept.park(key, second)  # the first is closed: the second, parked in the same directory, keeps the marker
    assert first.storage.closed == 1 and marker.read_text() == str(os.getpid())  # type: ignore[attr-defined]
    assert kept.take(key) is second and not marker.exists()
    kept.park(key, second)
    assert marker.exists() and kept.release_all() == 1 and not marker.exists()
    # a kept task closed by its owner with its marker still there (however it got there) removes it
    marker.write_text(str(os.getpid()))
    _kept(task_dir).close()
    assert not marker.exists()
    # ... but never another process's
    marker.write_text(str(os.getpid() + 1))
    _kept(task_dir).close()
    assert marker.read_text() == str(os.getpid() + 1)


def _park_in_a_child(task_dir: Path, exit_line: str) -> int:
    child = textwrap.dedent(f"""
        import os, sys
        from pathlib import Path
        from statebackend.microbatch import kept
        from tests.test_kept_markers import _kept
        task_dir = Path({str(task_dir)!r})
        kept.park(kept.task_key(task_dir.parent.parent, "job", "task-0"), _kept(task_dir))
        assert (task_dir / kept.PARKED_FILE).read_text() == str(os.getpid())
        print(os.getpid(), flush=True)
        {exit_line}
    """)
    done = subprocess.run(
        [sys.executable, "-c", child],
        cwd=REPO,
        env=dict(os.environ, PYTHONPATH=str(REPO)),
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
    )
    assert done.returncode == 0, done.stderr
    return int(done.stdout.split()[0])


def test_the_marker_goes_when_the_process_exits(task_dir: Path) -> None:
    _park_in_a_child(task_dir, "sys.exit(0)")
    assert not (task_dir / kept.PARKED_FILE).exists()


def test_a_marker_left_by_a_process_that_died_without_exit_handlers_is_ignored(task_dir: Path) -> None:
    pid = _park_in_a_child(task_dir, "os._exit(0)")  # as a forked Spark worker ends: no atexit
    marker = task_dir / kept.PARKED_FILE
    assert marker.read_text() == str(pid)
    assert not kept.parked_elsewhere(task_dir)
