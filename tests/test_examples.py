"""The examples run as a user runs them (a fresh interpreter, from the repository root) and check themselves."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent


def run_example(*args: str, timeout: float = 600) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, *args], cwd=ROOT, capture_output=True, text=True, timeout=timeout,
                          check=False)


@pytest.mark.slow
@pytest.mark.spark
def test_readme_demo_counts_words_exactly_on_local_spark() -> None:
    result = run_example("examples/demo.py", "--batches", "3", "--rows-per-batch", "2000")
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    assert "OK: all" in result.stdout


@pytest.mark.slow
def test_crash_restore_example_restores_exact_counts_after_sigkill() -> None:
    result = run_example("examples/crash_restore.py")
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    assert "child exited with -9" in result.stdout
    assert "OK: restored counts equal" in result.stdout


@pytest.mark.slow
@pytest.mark.spark
def test_sessionize_example_equals_a_batch_sessionization() -> None:
    result = run_example("examples/sessionize.py", "--files", "3", "--events-per-file", "1000")
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    assert "OK: all" in result.stdout
