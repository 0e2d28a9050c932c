"""Helpers shared by the Spark and micro-batch tests: a job keyed by one column, a streaming query over text files,
a task attempt's stats, a once-only marker and a child Python process.

pyspark is imported only when a job is built, so the micro-batch tests (which run without Spark) can use the rest.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any

from statebackend.microbatch.protocol import TaskStats

if TYPE_CHECKING:
    from pyspark.sql import DataFrame

    from statebackend.spark import StatefulForeachBatch, TaskRunner

REPO = Path(__file__).resolve().parents[1]

#: what Spark says when the Python process that runs a Spark Connect server's ``foreachBatch`` did not connect back
#: within its fixed 10 s (``PythonWorkerFactory``, not configurable): on a loaded machine that process's start can take
#: longer. Only that error is retried (:func:`start_query`); the query's work is asserted as always.
PYTHON_WORKER_TIMEOUT = "Timed out while waiting for the Python worker to connect back"


#: options for the JVMs of the tests' child processes (Spark drivers, executors, Connect servers): the client
#: compiler only (``TieredStopAtLevel=1``: no C2, whose compile threads cost a short-lived JVM more CPU than they save)
#: and the serial collector (a small heap, no parallel GC threads). A test's JVM lives seconds to a minute: these cut
#: its CPU time by about a third on 2 cores (examples/demo.py: 25 s -> 15 s) and change no outcome.
CHILD_JVM_OPTIONS = "-XX:TieredStopAtLevel=1 -XX:+UseSerialGC"


def with_child_jvm_options(env: Mapping[str, str]) -> dict[str, str]:
    """``env`` with :data:`CHILD_JVM_OPTIONS` added to ``JDK_JAVA_OPTIONS`` (read by every ``java`` launch: Spark's
    launcher, the driver, a local cluster's executors), after any options already there."""
    given = env.get("JDK_JAVA_OPTIONS", "")
    return {**env, "JDK_JAVA_OPTIONS": f"{given} {CHILD_JVM_OPTIONS}".strip()}


def start_query(writer: Any, attempts: int = 3, bound_s: float = 60.0) -> Any:
    """``writer.start()``, started again when Spark gave up waiting for its Python worker
    (:data:`PYTHON_WORKER_TIMEOUT`: a fixed 10 s in Spark, the machine's load, not the job). Any other error is
    raised; that one is raised once ``attempts`` starts failed and the failed starts took more than ``bound_s``
    stretched by the machine's load (``scaled``): on a busy machine the worker's start can miss Spark's 10 s several
    times in a row, and the bound follows the load."""
    from statebackend.testing.deadline import scaled

    started = time.monotonic()
    attempt = 0
    while True:
        attempt += 1
        try:
            return writer.start()
        except Exception as exc:
            if PYTHON_WORKER_TIMEOUT not in str(exc):
                raise
            spent = time.monotonic() - started
            if attempt >= attempts and spent > scaled(bound_s):
                raise
            print(
                f"start_query: attempt {attempt} ({spent:.0f} s in all): Spark's Python worker did not connect "
                "back; again",
                file=sys.stderr,
            )


def output_of(job: StatefulForeachBatch, frame: Any, batch_id: int) -> DataFrame:
    """The output ``job`` returns for batch ``batch_id`` of ``frame`` (a job with an output schema and no sink)."""
    output = job.run_batch(frame, batch_id)
    assert output is not None, "the job returned no output: it has no output schema, or a sink"
    return output


def word_job(
    fn: Callable[..., Any],
    config: Mapping[str, object],
    *,
    num_tasks: int,
    output_schema: str | None,
    key: str = "word",
    **options: Any,
) -> StatefulForeachBatch:
    """A ``StatefulForeachBatch`` of ``fn`` keyed by the one column ``key``; ``options`` are its other arguments."""
    from statebackend.spark import StatefulForeachBatch

    arguments: dict[str, Any] = {"key_columns": [key], "num_tasks": num_tasks, "config": config, **options}
    return StatefulForeachBatch(fn, output_schema=output_schema, **arguments)


def task_runner(config: dict[str, object], fn: Callable[..., Any], batch_id: int = 0, **options: Any) -> TaskRunner:
    """A ``TaskRunner`` of ``fn`` over rows of one ``word`` column, one task that redoes a replayed batch; ``options``
    set those and its other arguments."""
    from statebackend.spark import TaskRunner

    settings: dict[str, Any] = {"num_tasks": 1, "on_replay": "redo", **options}
    return TaskRunner.of(fn=fn, config=config, batch_id=batch_id, input_columns=("word",), **settings)


def stream_text_files(spark: Any, job: Any, source: Path, checkpoint: Path, timeout_s: float = 120) -> None:
    """Run ``job`` as a streaming query over the text files in ``source`` (one file a batch, each line a ``word``)
    until it has read them all, and assert it ended without an error."""
    stream = spark.readStream.option("maxFilesPerTrigger", 1).text(str(source)).withColumnRenamed("value", "word")
    query = stream.writeStream.foreachBatch(job).option("checkpointLocation", str(checkpoint))
    started = query.trigger(availableNow=True).start()
    started.awaitTermination(timeout_s)
    assert started.exception() is None, started.exception()


def task_stats(task_index: int, **fields: Any) -> TaskStats:
    """The stats of one attempt of task ``task_index``: the first attempt of batch 0, from checkpoint 1 to 2, no time
    spent, no rows, in the shared directory; ``fields`` set any of them and the optional ones."""
    times = dict.fromkeys(("open_ms", "process_ms", "commit_ms", "commit_sync_ms"), 0.0)
    counts = {"batch_id": 0, "attempt": 0, "base_seq": 1, "committed_seq": 2, "input_rows": 0, "output_rows": 0}
    return TaskStats(task_index=task_index, **{**times, **counts, "private_dir": False, **fields})


def first_time(marker: str) -> bool:
    """True the first time it is called with ``marker`` (a file path), in any process: a fault injected once."""
    try:
        os.close(os.open(marker, os.O_CREAT | os.O_EXCL | os.O_WRONLY))
    except FileExistsError:
        return False
    return True


def run_python(
    args: Sequence[str], env: Mapping[str, str] | None = None, timeout_s: float = 600
) -> subprocess.CompletedProcess[str]:
    """Run ``python args`` in the repository root (a Spark session of its own needs its own process) and assert it
    exited 0, showing the end of its stderr if not."""
    done = subprocess.run(
        [sys.executable, *args], cwd=REPO, env=env, capture_output=True, text=True, timeout=timeout_s, check=False
    )
    assert done.returncode == 0, done.stderr[-5000:]
    return done


def child_report(*args: str, env: Mapping[str, str] | None = None) -> dict[str, Any]:
    """Run ``python args`` as :func:`run_python` does and return the JSON object on the last line of its stdout."""
    done = run_python(args, env)
    report: dict[str, Any] = json.loads(done.stdout.strip().splitlines()[-1])
    return report


def report_of(done: Any) -> dict[str, Any]:
    """The JSON object on the last line of a child's stdout (a ``script_runs`` result, or a completed process), after
    asserting it exited 0 (showing the end of its stderr if not)."""
    assert done.returncode == 0, done.stderr[-5000:]
    report: dict[str, Any] = json.loads(done.stdout.strip().splitlines()[-1])
    return report


def env_with_repo(**extra: str) -> dict[str, str]:
    """This process's environment, with the repository on PYTHONPATH, the children's JVM options
    (:func:`with_child_jvm_options`) and ``extra`` set."""
    path = os.pathsep.join(filter(None, [str(REPO), os.environ.get("PYTHONPATH")]))
    return {**with_child_jvm_options(os.environ), "PYTHONPATH": path, **extra}
