"""The examples run as a user runs them (a fresh interpreter, from the repository root) and check themselves."""

from __future__ import annotations

import re
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


def readme_python_blocks() -> list[str]:
    text = (ROOT / "README.md").read_text()
    return re.findall(r"```python\n(.*?)```", text, flags=re.DOTALL)


def test_readme_quick_start_runs_as_written_and_prints_restored_counts(tmp_path: Path) -> None:
    quick_start = readme_python_blocks()[0]
    script = tmp_path / "quick_start.py"
    script.write_text(quick_start)
    result = subprocess.run([sys.executable, str(script)], cwd=tmp_path, capture_output=True, text=True, timeout=120,
                            check=False)
    assert result.returncode == 0, result.stderr[-3000:]
    assert result.stdout.splitlines() == ["3 {'ada': 2, 'bob': 1}", "5 {'ada': 2, 'bob': 2, 'cy': 1}"]


@pytest.mark.slow
@pytest.mark.spark
def test_readme_spark_snippet_runs_as_written_after_the_quick_start(tmp_path: Path) -> None:
    quick_start, spark_snippet = readme_python_blocks()[:2]
    script = tmp_path / "spark_snippet.py"
    script.write_text(quick_start + "\n" + spark_snippet)
    result = subprocess.run([sys.executable, str(script)], cwd=tmp_path, capture_output=True, text=True, timeout=600,
                            check=False)
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    rows = [line for line in result.stdout.splitlines() if line.startswith("|task-")]
    counts = {cells[2]: int(cells[3]) for cells in (row.split("|") for row in rows)}
    assert {key.strip(): value for key, value in counts.items()} == {"ada": 2, "bob": 2, "cy": 1}


def test_the_public_api_is_importable_from_the_package() -> None:
    import statebackend

    assert statebackend.__version__ and statebackend.__version__ != "0+unknown"
    for name in statebackend.__all__:
        assert getattr(statebackend, name) is not None, name
    assert issubclass(statebackend.CommitConflictError, statebackend.CommitError)
