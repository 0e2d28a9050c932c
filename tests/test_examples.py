"""The examples run as a user runs them (a fresh interpreter, from the repository root) and check themselves."""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

import pytest

from tests.script_runs import ScriptRuns, from_repo, register

ROOT = Path(__file__).resolve().parent.parent


def run_example(*args: str, timeout: float = 600) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, *args], cwd=ROOT, capture_output=True, text=True, timeout=timeout, check=False
    )


#: the Spark examples that check their own result and print "OK: all" when it holds, by name: their arguments (run
#: from the repository root). demo: the README's demo counts words exactly; sessionize: a streaming sessionization
#: equals the batch one of the same events
SELF_CHECKING = {
    "demo": ["examples/demo.py", "--batches", "3", "--rows-per-batch", "2000"],
    "sessionize": ["examples/sessionize.py", "--files", "3", "--events-per-file", "1000"],
}


def readme_snippet(folder: Path, tests: frozenset[str]) -> tuple[list[str], Path]:
    """The README's quick start and Spark snippet as one script, run where it is written (they use relative paths)."""
    quick_start, spark_snippet = readme_python_blocks()[:2]
    script = folder / "spark_snippet.py"
    script.write_text(quick_start + "\n" + spark_snippet)
    return [str(script)], folder


# the Spark examples run in the background with the suite's other scripts (tests/script_runs.py)
for _name, _args in SELF_CHECKING.items():
    register(
        f"example-{_name}",
        __name__,
        [f"test_a_spark_example_checks_its_own_result_on_local_spark[{_name}]"],
        from_repo(*_args),
    )
register(
    "example-sessionize-timers",
    __name__,
    ["test_the_sessionization_example_ends_sessions_by_timer_and_equals_a_batch_sessionization"],
    from_repo("examples/sessionize_timers.py", "--files", "3", "--events-per-file", "1000"),
)
register(
    "readme-spark-snippet",
    __name__,
    ["test_readme_spark_snippet_runs_as_written_after_the_quick_start"],
    readme_snippet,
)


@pytest.mark.slow
@pytest.mark.spark
@pytest.mark.parametrize("example", list(SELF_CHECKING))
def test_a_spark_example_checks_its_own_result_on_local_spark(script_runs: ScriptRuns, example: str) -> None:
    """Each of ``SELF_CHECKING`` exits 0 and prints "OK: all" (its own check of its result held)."""
    result = script_runs.result(f"example-{example}")
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
def test_the_sessionization_example_ends_sessions_by_timer_and_equals_a_batch_sessionization(
    script_runs: ScriptRuns,
) -> None:
    result = script_runs.result("example-sessionize-timers")
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    assert "OK: all" in result.stdout
    closed_by_timer = [
        int(line.split(", ")[1].split()[0]) for line in result.stdout.splitlines() if line.startswith("batch ")
    ]
    assert closed_by_timer[0] == 0 and sum(closed_by_timer) > 0  # no watermark yet in the first batch


def readme_python_blocks() -> list[str]:
    text = (ROOT / "README.md").read_text()
    return re.findall(r"```python\n(.*?)```", text, flags=re.DOTALL)


def test_readme_quick_start_runs_as_written_and_prints_restored_counts(tmp_path: Path) -> None:
    quick_start = readme_python_blocks()[0]
    script = tmp_path / "quick_start.py"
    script.write_text(quick_start)
    result = subprocess.run(
        [sys.executable, str(script)], cwd=tmp_path, capture_output=True, text=True, timeout=120, check=False
    )
    assert result.returncode == 0, result.stderr[-3000:]
    assert result.stdout.splitlines() == ["3 {'ada': 2, 'bob': 1}", "5 {'ada': 2, 'bob': 2, 'cy': 1}"]


@pytest.mark.slow
@pytest.mark.spark
def test_readme_spark_snippet_runs_as_written_after_the_quick_start(script_runs: ScriptRuns) -> None:
    result = script_runs.result("readme-spark-snippet")
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
