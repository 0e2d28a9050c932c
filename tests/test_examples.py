"""The examples run as a user runs them (a fresh interpreter, from the repository root) and check themselves."""

from __future__ import annotations

import re
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent


def run_example(*args: str, timeout: float = 600) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, *args], cwd=ROOT, capture_output=True, text=True, timeout=timeout, check=False
    )


class Examples:
    """The Spark examples of this module, run in the background two at a time (each starts a JVM and waits on it
    much of its time, so two overlap well on two cores, and more only compete): :meth:`result` waits for one,
    starting it first if it is not running yet, and starts the next waiting one as a slot frees."""

    running_at_once = 2

    def __init__(self, scripts: dict[str, tuple[list[str], Path]]) -> None:
        self._waiting = dict(scripts)
        self._running: dict[str, subprocess.Popen[str]] = {}
        self._done: dict[str, subprocess.CompletedProcess[str]] = {}
        self._top_up()

    def result(self, name: str, timeout: float = 900) -> subprocess.CompletedProcess[str]:
        if name in self._waiting:
            self._start(name)
        if name not in self._done:
            process = self._running.pop(name)
            stdout, stderr = process.communicate(timeout=timeout)
            self._done[name] = subprocess.CompletedProcess(process.args, process.returncode, stdout, stderr)
            self._top_up()
        return self._done[name]

    def stop(self) -> None:
        for process in self._running.values():
            if process.poll() is None:
                process.kill()
            process.communicate()
        self._running.clear()

    def _top_up(self) -> None:
        while self._waiting and len(self._running) < self.running_at_once:
            self._start(next(iter(self._waiting)))

    def _start(self, name: str) -> None:
        args, cwd = self._waiting.pop(name)
        self._running[name] = subprocess.Popen(
            [sys.executable, *args], cwd=cwd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True
        )


#: the Spark examples that check their own result and print "OK: all" when it holds, by name: their arguments (run
#: from the repository root). demo: the README's demo counts words exactly; sessionize: a streaming sessionization
#: equals the batch one of the same events
SELF_CHECKING = {
    "demo": ["examples/demo.py", "--batches", "3", "--rows-per-batch", "2000"],
    "sessionize": ["examples/sessionize.py", "--files", "3", "--events-per-file", "1000"],
}


@pytest.fixture(scope="module")
def spark_examples(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Examples]:
    """The Spark examples of this module, in test order (none when the run deselects them all)."""
    wanted = {
        item.name
        for item in request.session.items
        if isinstance(item, pytest.Function) and item.module is request.module
    }
    scripts: dict[str, tuple[list[str], Path]] = {}
    for name, args in SELF_CHECKING.items():
        if f"test_a_spark_example_checks_its_own_result_on_local_spark[{name}]" in wanted:
            scripts[name] = (args, ROOT)
    if "test_the_sessionization_example_ends_sessions_by_timer_and_equals_a_batch_sessionization" in wanted:
        scripts["sessionize_timers"] = (
            ["examples/sessionize_timers.py", "--files", "3", "--events-per-file", "1000"],
            ROOT,
        )
    if "test_readme_spark_snippet_runs_as_written_after_the_quick_start" in wanted:
        folder = tmp_path_factory.mktemp("snippet")
        quick_start, spark_snippet = readme_python_blocks()[:2]
        script = folder / "spark_snippet.py"
        script.write_text(quick_start + "\n" + spark_snippet)
        scripts["snippet"] = ([str(script)], folder)
    examples = Examples(scripts)
    try:
        yield examples
    finally:
        examples.stop()


@pytest.mark.slow
@pytest.mark.spark
@pytest.mark.parametrize("example", list(SELF_CHECKING))
def test_a_spark_example_checks_its_own_result_on_local_spark(spark_examples: Examples, example: str) -> None:
    """Each of ``SELF_CHECKING`` exits 0 and prints "OK: all" (its own check of its result held)."""
    result = spark_examples.result(example)
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
    spark_examples: Examples,
) -> None:
    result = spark_examples.result("sessionize_timers")
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
def test_readme_spark_snippet_runs_as_written_after_the_quick_start(spark_examples: Examples) -> None:
    result = spark_examples.result("snippet")
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
