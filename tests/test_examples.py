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
    return subprocess.run([sys.executable, *args], cwd=ROOT, capture_output=True, text=True, timeout=timeout,
                          check=False)


class Started:
    """A script started in the background; :meth:`result` waits for it (the Spark examples each start a JVM and
    spend much of their time waiting on it, so the module starts them together and each test waits for its own)."""

    def __init__(self, args: list[str], cwd: Path) -> None:
        self.process = subprocess.Popen([sys.executable, *args], cwd=cwd, stdout=subprocess.PIPE,
                                        stderr=subprocess.PIPE, text=True)
        self.args = args
        self._done: subprocess.CompletedProcess[str] | None = None

    def result(self, timeout: float = 900) -> subprocess.CompletedProcess[str]:
        if self._done is None:
            stdout, stderr = self.process.communicate(timeout=timeout)
            self._done = subprocess.CompletedProcess(self.args, self.process.returncode, stdout, stderr)
        return self._done

    def stop(self) -> None:
        if self.process.poll() is None:
            self.process.kill()
            self.process.communicate()


@pytest.fixture(scope="module")
def spark_examples(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> Iterator[dict[str, Started]]:
    """The Spark examples of this module, started at once when the first of their tests runs (none when the run
    deselects them all)."""
    wanted = {item.name for item in request.session.items if item.module is request.module}
    started: dict[str, Started] = {}
    if "test_readme_demo_counts_words_exactly_on_local_spark" in wanted:
        started["demo"] = Started(["examples/demo.py", "--batches", "3", "--rows-per-batch", "2000"], ROOT)
    if "test_sessionize_example_equals_a_batch_sessionization" in wanted:
        started["sessionize"] = Started(["examples/sessionize.py", "--files", "3", "--events-per-file", "1000"], ROOT)
    if "test_readme_spark_snippet_runs_as_written_after_the_quick_start" in wanted:
        folder = tmp_path_factory.mktemp("snippet")
        quick_start, spark_snippet = readme_python_blocks()[:2]
        script = folder / "spark_snippet.py"
        script.write_text(quick_start + "\n" + spark_snippet)
        started["snippet"] = Started([str(script)], folder)
    try:
        yield started
    finally:
        for run in started.values():
            run.stop()


@pytest.mark.slow
@pytest.mark.spark
def test_readme_demo_counts_words_exactly_on_local_spark(spark_examples: dict[str, Started]) -> None:
    result = spark_examples["demo"].result()
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
def test_sessionize_example_equals_a_batch_sessionization(spark_examples: dict[str, Started]) -> None:
    result = spark_examples["sessionize"].result()
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
def test_readme_spark_snippet_runs_as_written_after_the_quick_start(spark_examples: dict[str, Started]) -> None:
    result = spark_examples["snippet"].result()
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
