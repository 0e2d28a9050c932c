"""The list and map store examples run as a user runs them (a fresh interpreter, from the repository root) and check
themselves against plain Python; both start at once (each waits on its JVM much of its time)."""

from __future__ import annotations

import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
SCRIPTS = {
    "last_events": ["examples/last_events.py", "--batches", "3", "--events-per-batch", "300", "--tasks", "3"],
    "user_counters": ["examples/user_counters.py", "--batches", "3", "--events-per-batch", "300", "--tasks", "3"],
}


@pytest.fixture(scope="module")
def runs() -> Iterator[dict[str, subprocess.Popen[str]]]:
    started = {
        name: subprocess.Popen(
            [sys.executable, *args], cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True
        )
        for name, args in SCRIPTS.items()
    }
    yield started
    for process in started.values():
        if process.poll() is None:
            process.kill()
        process.communicate()


def finished(process: subprocess.Popen[str]) -> tuple[int, str, str]:
    stdout, stderr = process.communicate(timeout=900)  # a bound on a hung JVM only: the run itself takes seconds
    return process.returncode, stdout, stderr


def test_the_last_events_example_keeps_each_users_last_5_events(runs: dict[str, subprocess.Popen[str]]) -> None:
    code, stdout, stderr = finished(runs["last_events"])
    assert code == 0, stdout + stderr[-3000:]
    assert "OK: the last 5 events of all 50 users equal the plain-Python computation" in stdout
    assert stdout.count("users with new events") == 3


def test_the_user_counters_example_counts_each_users_actions(runs: dict[str, subprocess.Popen[str]]) -> None:
    code, stdout, stderr = finished(runs["user_counters"])
    assert code == 0, stdout + stderr[-3000:]
    assert "OK: the counters of all 40 users equal the plain-Python count" in stdout
    assert stdout.count("most frequent action so far") == 3
