"""The micro-batch core without Spark: the task attempt's state machine, its report and warnings, the batch
coordinator's progress line and listener, the configuration parsed once, and the driver's error summary."""

from __future__ import annotations

import logging
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from statebackend.config import Settings
from statebackend.errors import TaskFailedError
from statebackend.metrics import Metrics, MetricsSnapshot
from statebackend.microbatch.attempt import Counted, TaskAttempt, TaskStores
from statebackend.microbatch.coordinator import BatchCoordinator
from statebackend.microbatch.held import HeldOutput
from statebackend.microbatch.protocol import BatchReport, TaskStats
from statebackend.microbatch.spec import BatchSpec, JobSpec
from statebackend.microbatch.watermark import EventTimes
from statebackend.task import TaskStorage
from tests.backend_helpers import counts_config
from tests.spark_helpers import task_stats


def make_config(tmp_path: Path) -> dict[str, object]:
    return counts_config(tmp_path, job="core")


def count(stores: TaskStores, words: Iterator[str]) -> list[tuple[str, int]]:
    counts = stores["counts"]
    out = []
    for word in words:
        total = (counts.get(word) or 0) + 1
        counts.put(word, total)
        out.append((word, total))
    return out


def attempt_batch(job: JobSpec, batch_id: int, words: list[str], fn: Any = count) -> tuple[list[Any], TaskStats]:
    attempt = TaskAttempt(job, BatchSpec(batch_id=batch_id), 0)
    counted = Counted(iter(words))

    def work(stores: TaskStores) -> HeldOutput:
        return attempt.held().extend(fn(stores, counted) or ())

    outputs, stats = attempt.run(work, counted, events=EventTimes(None), convert=lambda result: result or ())
    return list(outputs), stats


def test_the_core_imports_no_spark() -> None:
    code = (
        "import sys, statebackend.microbatch.attempt, statebackend.microbatch.coordinator; "
        "print('pyspark' in sys.modules)"
    )
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert result.stdout.strip() == "False"


def test_an_attempt_commits_its_batch_and_the_next_one_builds_on_it_without_parsing_the_config(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    job = JobSpec.from_config(make_config(tmp_path), fn=count, num_tasks=1, key_groups=4, key_types=("string",))
    parses: list[int] = []
    original = Settings.from_config.__func__  # type: ignore[attr-defined]

    def counted(cls: type[Settings], config: Any) -> Settings:
        parses.append(1)
        return original(cls, config)

    monkeypatch.setattr(Settings, "from_config", classmethod(counted))
    out0, stats0 = attempt_batch(job, 0, ["a", "b", "a"])
    out1, stats1 = attempt_batch(job, 1, ["a"])
    assert parses == []  # the workers use the settings the spec carries
    assert out0 == [("a", 1), ("b", 1), ("a", 2)] and out1 == [("a", 3)]
    assert (stats0.base_seq, stats0.committed_seq, stats1.base_seq, stats1.committed_seq) == (0, 1, 1, 2)
    assert (stats1.input_rows, stats1.output_rows, stats1.task) == (1, 1, "task-0")
    monkeypatch.undo()
    with TaskStorage.open(make_config(tmp_path), "task-0") as task:
        assert dict(task.store("counts").items()) == {"a": 3, "b": 1}
        assert task.restored is not None and task.restored.input_offsets["batch"] == "1"


def test_a_replayed_batch_is_redone_from_the_previous_checkpoint(tmp_path: Path) -> None:
    job = JobSpec.from_config(make_config(tmp_path), fn=count, num_tasks=1)
    attempt_batch(job, 0, ["a"])
    attempt_batch(job, 1, ["a"])
    out, stats = attempt_batch(job, 1, ["a"])  # Spark runs batch 1 again
    assert out == [("a", 2)] and stats.base_seq == 1 and stats.committed_seq == 3


def test_a_failing_function_commits_nothing_and_says_where_it_ran(tmp_path: Path) -> None:
    job = JobSpec.from_config(make_config(tmp_path), fn=count, num_tasks=1)
    attempt_batch(job, 0, ["a"])

    def explode(stores: TaskStores, words: Iterator[str]) -> list[Any]:
        stores["counts"].put("a", 100)
        raise RuntimeError("boom in the user's function")

    failing = JobSpec.from_config(make_config(tmp_path), fn=explode, num_tasks=1)
    with pytest.raises(RuntimeError, match="boom") as raised:
        attempt_batch(failing, 1, ["a"], fn=explode)
    assert any("explode of task-0, batch 1" in note for note in getattr(raised.value, "__notes__", []))
    with TaskStorage.open(make_config(tmp_path), "task-0") as task:
        assert dict(task.store("counts").items()) == {"a": 1}
        assert task.restored is not None and task.restored.input_offsets["batch"] == "0"


def test_what_an_attempt_logs_at_warning_travels_back_in_its_report(tmp_path: Path) -> None:
    job = JobSpec.from_config(make_config(tmp_path), fn=count, num_tasks=1)

    def warn(stores: TaskStores, words: Iterator[str]) -> list[Any]:
        logging.getLogger("statebackend.blobstores.test").warning("retrying a put: %s", "reset by peer")
        logging.getLogger("statebackend.blobstores.test").info("not carried")
        return count(stores, words)

    _, stats = attempt_batch(job, 0, ["a"], fn=warn)
    assert [(w.level, w.message, w.logger) for w in stats.warnings] == [
        ("WARNING", "retrying a put: reset by peer", "statebackend.blobstores.test")
    ]


def stats_of(task: int, *, commit_ms: float, restored: int = 0, warnings: tuple[Any, ...] = ()) -> TaskStats:
    metrics = Metrics(labels={"job_name": "core", "task": f"task-{task}"})
    metrics.increment("commit.count")
    metrics.increment("blob_store.requests", 2, operation="put", outcome="ok")
    if restored:
        metrics.increment("restore.stores.full")
        metrics.increment("restore.bytes", restored)
    else:
        metrics.increment("restore.stores.reused")
    times = {"open_ms": 1.0, "process_ms": 10.0 * (task + 1), "commit_ms": commit_ms, "commit_sync_ms": 1.0}
    counts = {"batch_id": 3, "base_seq": 2, "committed_seq": 3, "input_rows": 5, "output_rows": 2}
    return task_stats(task, **times, **counts, metrics=metrics.export(), timers_fired=task, warnings=warnings)


def test_the_coordinator_logs_one_line_a_batch_carries_warnings_and_keeps_task_labels(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    from statebackend.microbatch.protocol import AttemptWarning

    settings = Settings.from_config(make_config(tmp_path))
    reports: list[BatchReport] = []
    metrics = Metrics()
    coordinator = BatchCoordinator(settings, 2, metrics, on_batch=reports.append)
    warning = AttemptWarning("statebackend.restore", "WARNING", "changelog restore failed; falling back")
    stats = [stats_of(0, commit_ms=4.0, restored=2048, warnings=(warning,)), stats_of(1, commit_ms=8.0)]
    caplog.set_level(logging.INFO, logger="statebackend")
    released = []
    _, output, report = coordinator.run(
        3, lambda confirming: (lambda: released.append(1), "out", stats), confirming=False
    )
    assert output == "out" and released == [] and reports == [report]
    assert (
        report.input_rows,
        report.output_rows,
        report.committed,
        report.stores_restored,
        report.stores_reused,
        report.restore_bytes,
        report.blob_requests,
        report.timers_fired,
    ) == (10, 4, 2, 1, 1, 2048, 4, 1)
    assert report.slowest_task == "task-1" and report.commit_max_ms == 8.0
    lines = [r.getMessage() for r in caplog.records if r.levelno == logging.INFO]
    assert lines[0].startswith("batch 3: the first batch of this query") and lines[1:] == [report.line()]
    assert "batch 3: 2 tasks" in lines[1] and "1 restored (2.0 KiB)" in lines[1] and "slowest task-1" in lines[1]
    warned = [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]
    assert warned == ["batch 3 task-0 (attempt 0): changelog restore failed; falling back [statebackend.restore]"]
    served = metrics.export()
    assert served.counter("commit.count", task="task-0") == 1 and served.counter("commit.count", task="task-1") == 1
    batch_time = served.histogram("spark.batch.ms")
    assert batch_time is not None and batch_time.count == 1


def test_a_long_batch_says_on_the_driver_that_it_is_still_running(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    import threading

    caplog.set_level(logging.INFO, logger="statebackend")
    coordinator = BatchCoordinator(Settings.from_config(make_config(tmp_path)), 1, Metrics(), progress_every_s=0.01)
    said = threading.Event()

    class Seen(logging.Handler):
        def emit(self, record: logging.LogRecord) -> None:
            if "still running" in record.getMessage():
                said.set()

    handler = Seen()
    logging.getLogger("statebackend").addHandler(handler)
    try:

        def slow(confirming: bool) -> Any:
            assert said.wait(600), "no progress line while the batch ran"  # the tasks end once it was said
            return lambda: None, None, [stats_of(0, commit_ms=1.0)]

        coordinator.run(5, slow, confirming=False)
    finally:
        logging.getLogger("statebackend").removeHandler(handler)
    messages = [r.getMessage() for r in caplog.records]
    assert any(m.startswith("batch 5: still running after") for m in messages)
    quiet = BatchCoordinator(Settings.from_config(make_config(tmp_path)), 1, Metrics(), progress_every_s=None)
    caplog.clear()
    quiet.run(6, lambda c: (lambda: None, None, [stats_of(0, commit_ms=1.0)]), confirming=False)
    assert not any("still running" in r.getMessage() for r in caplog.records)


def test_a_listener_that_fails_does_not_fail_the_batch(tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    def listener(report: BatchReport) -> None:
        raise ValueError("listener bug")

    coordinator = BatchCoordinator(Settings.from_config(make_config(tmp_path)), 1, Metrics(), on_batch=listener)
    _, _, report = coordinator.run(0, lambda c: (lambda: None, None, [stats_of(0, commit_ms=1.0)]), confirming=False)
    assert report.committed == 1
    assert any("on_batch listener failed" in r.getMessage() for r in caplog.records)


def test_a_spark_failure_is_summarized_with_the_error_first_and_the_users_frame() -> None:
    from statebackend.spark.errors import summarized

    trace = (
        "py4j.protocol.Py4JJavaError: An error occurred while calling o93.count.\n"
        ": org.apache.spark.SparkException: Job aborted due to stage failure: Task 2 in stage 4.0 failed 1 times, "
        "most recent failure: Lost task 2.0 in stage 4.0: org.apache.spark.api.python.PythonException: "
        "Traceback (most recent call last):\n"
        f'  File "{Path(__file__).parent.parent / "statebackend" / "microbatch" / "attempt.py"}", line 292, in run\n'
        "    outputs = self._call_user(self.job.fn, lambda: work(stores))\n"
        '  File "/home/ada/jobs/orders.py", line 17, in total\n'
        "    totals.put(row.user, Decimal(row.amount))\n"
        f'  File "{Path(__file__).parent.parent / "statebackend" / "store" / "typed.py"}", line 80, in put\n'
        "    raise SerdeError(...)\n"
        "statebackend.errors.SerdeError: store 'totals': the json serde cannot encode the value of key 'ada'\n"
        "(statebackend: raised in orders.total of task-2, batch 7, attempt 0)\n"
        "\n\tat org.apache.spark.api.python.BasePythonRunner.handlePythonException(PythonRunner.scala:600)\n"
    )
    summary = summarized(RuntimeError(trace), 7)
    assert isinstance(summary, TaskFailedError)
    lines = str(summary).splitlines()
    assert lines[0] == (
        "task-2 of batch 7 failed: statebackend.errors.SerdeError: store 'totals': the json serde "
        "cannot encode the value of key 'ada'"
    )
    assert (
        "in your code: /home/ada/jobs/orders.py, line 17, in total: totals.put(row.user, Decimal(row.amount))"
        in str(summary)
    )
    assert summarized(RuntimeError("no traceback here"), 7) is None


def test_a_batch_report_sums_the_tasks_and_handles_an_empty_batch() -> None:
    empty = BatchReport.of(0, [], 5.0)
    assert (empty.committed, empty.commit_p50_ms, empty.slowest_task) == (0, 0.0, "")
    assert empty.line().startswith("batch 0: 0 tasks")
    first, second = stats_of(0, commit_ms=1.0).metrics, stats_of(1, commit_ms=1.0).metrics
    assert first is not None and second is not None
    merged = MetricsSnapshot.merged([first, second])
    assert merged.counter("commit.count") == 2
