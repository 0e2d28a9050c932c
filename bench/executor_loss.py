"""Executor loss to recovery, measured: on Spark's ``local-cluster[2,1,<MB>]`` master (two executor processes, a local
state dir each), the time from an executor's loss (SIGKILL of its JVM) to the end of the next batch, against the
restore time of the same state (the target: restore time + one batch).

Run from the repository root (minutes per size on 2 cores; 10M keys per task wants several GiB of memory)::

    python -m bench.executor_loss --keys-per-task 1000000 --keys-per-task 10000000
    python -m bench.executor_loss --keys-per-task 100000 --updates 5000 --batches 3   # a quick run
    python -m bench.executor_loss --backend blobsnapshot

Per ``--keys-per-task`` size N, on a cluster of its own (a new application: both executors fresh):

1. The state: ``StatefulForeachBatch`` over 2 tasks (one per executor), Arrow mode, affinity on, tasks kept open,
   ``file://`` blob store under a temp dir, the counts store on ``--backend``. N x 2 keys (``k`` and 10 digits) are
   loaded with value 1 through ``initial_state`` (a frame from ``spark.range``: the keys are made and encoded on the
   executors, routed to their tasks by Spark, written with ``put_many``; the driver builds no rows). Then
   ``--batches`` update batches, each ``--updates`` x 2 distinct random keys (about ``--updates`` per task), counted
   with the vectorized state API (bench/common.py's ``count_keys``: one ``get_many`` and one ``put_many`` per
   task). The first 2 are warm-up (a task may first run on the other executor than the one that loaded it, and
   restore there); the p50 of the rest is "one batch".
2. The restore of the same state, measured on its own: task-0's newest checkpoint restored by ``TaskStorage.open``
   into an empty directory in a fresh process (timed inside it, as bench/restore.py does; best of ``--restores``,
   default 2), before the kill.
3. The loss: the JVM of the executor that ran task 0 in the last batch (the process whose command line has
   ``CoarseGrainedExecutorBackend``, the application id and that executor id) gets SIGKILL; the next batch runs at
   once. Recovery = from the kill to the end of that batch (``run_batch`` returned: every task committed durably).
   A thread of the driver polls meanwhile, every 50 ms, the executor processes (``/proc``) and the executors Spark
   knows (``SparkContext.getExecutorIds``): when Spark dropped the lost one, when a new executor process started and
   when it registered. Each task's function reports when it started (unix time) and where; with the attempt's stats
   (open with its restore, processing, commit) that splits the recovery into the wait before task 0 ran again, its
   open (the restore), its work and the batch's end.
4. ``--after`` more batches, once Spark has a second executor again (the replacement registered; waited for, at most
   300 s): where the tasks run after the recovery, and their batch times. The tasks spread over both executors
   again: in the first batch that runs anchored, the driver moves one of the survivor's two tasks to the
   replacement, which restores it (``statebackend/spark/runs.py``, ``_spread``).
5. The check: the state read back from the blob store (``read_state``) has every key exactly once and each count
   equals 1 + the updates of that key over all batches (the recovered batch's included); else FAIL and exit 1.

Prints markdown tables; writes ``bench/results/executor-loss-<UTC time>.json`` (or ``--result PATH``). The Spark work
dir of each application (the executors' working dirs, local state included) and the temp dirs are removed.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import signal
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from bench.common import count_keys, format_table, local_cluster_session, machine_info, write_result

NUM_TASKS = 2
WARM_UP = 2
EXECUTOR_CLASS = "org.apache.spark.executor.CoarseGrainedExecutorBackend"
#: the stored keys: ``k`` and the key's number in 10 digits, the same in Spark SQL (the load) and in Python (updates)
KEY_SQL = "concat('k', lpad(cast(id as string), 10, '0'))"
OUTPUT_SCHEMA = "task int, fn_started double, pid long, cwd string"


def key_of(number: int) -> str:
    return f"k{number:010d}"


def timed_count(stores: Any, batches: Any) -> Any:
    """``count_keys`` (bench/common.py, the vectorized count of bench/spark_e2e.py), and one output row: the task,
    when its function started (unix time: the driver compares it with the kill), its process and its executor's
    working dir."""
    import pyarrow as pa

    started = time.time()
    count_keys(stores, batches)
    return pa.table(
        {
            "task": pa.array([stores.task_index], pa.int32()),
            "fn_started": pa.array([started], pa.float64()),
            "pid": pa.array([os.getpid()], pa.int64()),
            "cwd": pa.array([os.getcwd()], pa.string()),
        }
    )


# -- the executor processes --------------------------------------------------------------------------------------------


def _argument(args: Sequence[str], flag: str) -> str | None:
    for i, arg in enumerate(args[:-1]):
        if arg == flag:
            return args[i + 1]
    return None


def executor_processes(app_id: str, others: set[int] | None = None) -> dict[str, int]:
    """Executor id -> pid of the application's executor JVMs running now (read from ``/proc``). ``others``: pids
    known not to be one, skipped, and added to (a process's command line is fixed once it has started Java)."""
    found: dict[str, int] = {}
    for entry in os.scandir("/proc"):
        if not entry.name.isdigit() or (others is not None and int(entry.name) in others):
            continue
        try:
            with open(f"/proc/{entry.name}/cmdline", "rb") as handle:
                raw = handle.read()
        except OSError:
            continue
        if EXECUTOR_CLASS.encode() not in raw:
            if others is not None and raw and b"jspawnhelper" not in raw:  # not a process about to exec Java
                others.add(int(entry.name))
            continue
        args = [part.decode(errors="replace") for part in raw.split(b"\0")]
        executor = _argument(args, "--executor-id")
        if _argument(args, "--app-id") == app_id and executor is not None:
            found[executor] = int(entry.name)
    return found


def wait_until(ready: Callable[[], bool], since: float, failure: str, bound_s: float = 300.0) -> None:
    """Poll ``ready`` every 0.2 s (Spark has no call that blocks until executors come) until it holds; a hang guard
    of ``bound_s`` from ``since`` (monotonic) raises ``RuntimeError(failure)``."""
    while not ready():
        if time.monotonic() - since > bound_s:
            raise RuntimeError(f"{failure} in {bound_s:.0f} s")
        time.sleep(0.2)


def spark_executor_ids(spark: Any) -> set[str] | None:
    """The executor ids the driver knows now (``SparkContext.getExecutorIds``); None when it cannot be read."""
    from statebackend.spark.session import living_executors

    try:
        return set(living_executors(spark.sparkContext._jsc.sc()))
    except Exception:  # noqa: BLE001 - another Spark: no such call; the timeline then lacks the driver's view
        return None


class Watcher:
    """Polls, in a thread, the application's executor processes and the executors Spark knows; records the
    monotonic time of every change (what appeared, what went)."""

    def __init__(self, spark: Any, app_id: str, period_s: float = 0.05) -> None:
        self.spark = spark
        self.app_id = app_id
        self.period_s = period_s
        self.events: list[tuple[float, str, str, str]] = []  # (monotonic, "process"|"spark", "+"|"-", executor id)
        self._processes = executor_processes(app_id)
        self._known = spark_executor_ids(spark)
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="executor-watcher", daemon=True)

    def __enter__(self) -> Watcher:
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._thread.join()

    def _run(self) -> None:
        others: set[int] = set()
        polls = 0
        while not self._stop.wait(self.period_s):
            polls += 1
            if polls % 50 == 0:
                others.clear()  # a pid may be reused
            now = time.monotonic()
            processes = executor_processes(self.app_id, others)
            self._note(now, "process", set(self._processes), set(processes))
            self._processes = processes
            known = spark_executor_ids(self.spark)
            if known is not None and self._known is not None:
                self._note(now, "spark", self._known, known)
            self._known = known

    def _note(self, now: float, kind: str, before: set[str], after: set[str]) -> None:
        self.events.extend((now, kind, "-", e) for e in sorted(before - after))
        self.events.extend((now, kind, "+", e) for e in sorted(after - before))

    def first(self, kind: str, change: str, executor: str | None = None) -> float | None:
        """The first time ``kind`` saw ``change`` (of ``executor``, or of any)."""
        for when, k, c, e in self.events:
            if k == kind and c == change and (executor is None or e == executor):
                return when
        return None


# -- the restore on its own ------------------------------------------------------------------------------------------


def restore_in_child(config: dict[str, Any], task: str, local_dir: Path) -> dict[str, Any]:
    """Restore ``task``'s newest checkpoint into the empty ``local_dir`` in a fresh process (``TaskStorage.open``
    timed inside it: the interpreter's start is not counted); its seconds, keys and restore counters."""
    shutil.rmtree(local_dir, ignore_errors=True)
    spec = {"config": {**config, "state.local.dir": str(local_dir)}, "task": task}
    done = subprocess.run(
        [sys.executable, "-m", "bench.executor_loss", "--restore-child", json.dumps(spec)],
        capture_output=True,
        text=True,
        check=False,
        cwd=Path(__file__).resolve().parent.parent,
    )
    shutil.rmtree(local_dir, ignore_errors=True)
    if done.returncode != 0:
        raise RuntimeError(f"the restoring process failed:\n{done.stderr[-4000:]}")
    return dict(json.loads(done.stdout.strip().splitlines()[-1]))


def restore_child(spec_text: str) -> None:
    """The restoring process: open (restore) the task, count its keys, print one JSON line."""
    from statebackend.task import TaskStorage

    spec = json.loads(spec_text)
    started = time.perf_counter()
    with TaskStorage.open(spec["config"], spec["task"]) as task:
        seconds = time.perf_counter() - started
        keys = task.store("counts").count()
        counters = {
            name: task.metrics.counter(name)
            for name in ("restore.stores.full", "restore.stores.caught.up", "restore.bytes")
        }
    print(json.dumps({"seconds": seconds, "keys": keys, "counters": counters}))


# -- one size ------------------------------------------------------------------------------------------------------


def update_keys(rng: Any, total: int, count: int) -> Any:
    """``count`` distinct key numbers out of ``total``, at random (numpy array)."""
    return rng.choice(total, size=min(count, total), replace=False)


def key_frame(spark: Any, numbers: Any) -> Any:
    import pandas as pd

    return spark.createDataFrame(pd.DataFrame({"key": [key_of(n) for n in numbers.tolist()]}))


def attempts_of(job: Any, batch: int) -> list[dict[str, Any]]:
    """Every reported attempt of ``batch``: task, attempt, executor id (the last part of its working dir), times,
    kept open, restore counters."""
    out = []
    for s in job.history:
        if s.batch_id != batch:
            continue
        out.append(
            {
                "task": s.task_index,
                "attempt": s.attempt,
                "executor": s.executor.rstrip("/").rsplit("/", 1)[-1],
                "open_ms": round(s.open_ms, 1),
                "process_ms": round(s.process_ms, 1),
                "commit_ms": round(s.commit_ms, 1),
                "kept_open": s.kept_open,
                "restored_full": int(s.counter("restore.stores.full")),
                "caught_up": int(s.counter("restore.stores.caught.up")),
                "restore_bytes": int(s.counter("restore.bytes")),
            }
        )
    return out


def run_size(args: argparse.Namespace, keys_per_task: int, work: Path) -> dict[str, Any]:
    """Steps 1 to 5 of the module docstring for one size, on a cluster of its own."""
    import numpy as np

    from statebackend.spark import StatefulForeachBatch

    total = keys_per_task * NUM_TASKS
    mem = args.executor_memory_mb
    starting = time.monotonic()
    spark = local_cluster_session(
        f"statebackend-executor-loss-{keys_per_task}",
        master=f"local-cluster[{NUM_TASKS},1,{mem}]",
        conf={
            "spark.executor.memory": f"{mem}m",
            "spark.sql.shuffle.partitions": str(NUM_TASKS),
            "spark.sql.execution.arrow.pyspark.enabled": "true",
            "spark.driver.memory": "2g",
        },
    )
    spark.sparkContext.setLogLevel("ERROR")
    app_id = spark.sparkContext.applicationId
    import pyspark

    assert pyspark.__file__ is not None
    app_work_dir = Path(pyspark.__file__).parent / "work" / app_id  # local-cluster's executors work under it
    loads: dict[str, list[float]] = {"start": [round(x, 2) for x in os.getloadavg()]}
    phases: dict[str, float] = {}  # seconds of each step, to say what a size took
    try:
        wait_until(
            lambda: len(executor_processes(app_id)) >= NUM_TASKS and len(spark_executor_ids(spark) or ()) >= NUM_TASKS,
            starting,
            f"the cluster has not started {NUM_TASKS} executors",
        )
        phases["cluster_start"] = round(time.monotonic() - starting, 1)  # the session and both executors
        config: dict[str, Any] = {
            "job.name": f"executor-loss-{keys_per_task}",
            "state.local.dir": "statebackend-local",  # relative: each executor's own working dir
            "blob.store.url": f"file://{work / 'blobs'}",
            "blob.store.create.if.missing": "true",
            "stores.counts.backup.factories": args.backend,
            "stores.counts.key.serde": "string",
            "stores.counts.msg.serde": "integer",
        }
        initial = spark.range(0, total, 1, max(NUM_TASKS, total // 1_000_000)).selectExpr(
            f"{KEY_SQL} as key", "1L as value"
        )
        job = StatefulForeachBatch(
            timed_count,
            key_columns=["key"],
            num_tasks=NUM_TASKS,
            config=config,
            output_schema=OUTPUT_SCHEMA,
            mode="arrow",
            affinity=True,
            initial_state={"counts": initial},
        )
        rng = np.random.default_rng(args.seed)
        updated = np.zeros(total, dtype=np.int32)
        batch_ms: list[float] = []
        fn_offsets: list[dict[int, float]] = []  # per batch, task -> when its function started, s after the call

        def run(batch: int, frame: Any) -> tuple[float, list[Any]]:
            """Run the batch; (its end, monotonic: every task committed durably; the output rows, read after)."""
            output = job.run_batch(frame, batch)
            ended = time.monotonic()
            assert output is not None
            return ended, output.collect()

        batch = 0
        print(f"## {keys_per_task:,} keys per task ({total:,} keys, {NUM_TASKS} tasks)\n", flush=True)
        for batch in range(args.batches):
            numbers = update_keys(rng, total, args.updates * NUM_TASKS)
            updated[numbers] += 1
            frame = key_frame(spark, numbers)
            began, began_wall = time.monotonic(), time.time()
            ended, rows = run(batch, frame)
            batch_ms.append((ended - began) * 1000.0)
            fn_offsets.append({int(r["task"]): round(float(r["fn_started"]) - began_wall, 3) for r in rows})
            print(f"batch {batch}: {batch_ms[-1]:,.0f} ms {attempts_of(job, batch)}", flush=True)
        loads["before_kill"] = [round(x, 2) for x in os.getloadavg()]
        phases["load_and_batch_0"] = round(batch_ms[0] / 1000.0, 1)
        phases["update_batches"] = round(sum(batch_ms[1:]) / 1000.0, 1)
        steady = batch_ms[WARM_UP:] or batch_ms[-1:]
        one_batch_ms = statistics.median(steady)

        victim_executor = next(a["executor"] for a in attempts_of(job, batch) if a["task"] == 0)
        restoring = time.monotonic()
        restores = [restore_in_child(config, "task-0", work / f"restore-{turn}") for turn in range(args.restores)]
        restore = min(restores, key=lambda r: float(r["seconds"]))
        phases["restores_with_process_start"] = round(time.monotonic() - restoring, 1)
        print(f"restore of task-0 in a fresh process: {[round(r['seconds'], 3) for r in restores]} s", flush=True)

        # the loss: the batch's input is built before the kill, then the batch runs at once
        batch += 1
        numbers = update_keys(rng, total, args.updates * NUM_TASKS)
        updated[numbers] += 1
        frame = key_frame(spark, numbers)
        processes = executor_processes(app_id)
        victim_pid = processes.get(victim_executor)
        if victim_pid is None:
            raise RuntimeError(
                f"no process of executor {victim_executor!r} (task 0 ran there in batch {batch - 1}); the "
                f"application's executors: {processes}"
            )
        with Watcher(spark, app_id) as watcher:  # on until the batches after it end: the new executor may come late
            os.kill(victim_pid, signal.SIGKILL)
            killed_at, killed_wall = time.monotonic(), time.time()
            ended, rows = run(batch, frame)
            recovery_s = ended - killed_at
            recovered_batch = batch
            recovered = attempts_of(job, recovered_batch)
            loads["after_recovery"] = [round(x, 2) for x in os.getloadavg()]
            print(f"batch {batch} (the recovery): {recovery_s * 1000.0:,.0f} ms {recovered}", flush=True)
            after = []
            waited = time.monotonic()
            if args.after:
                wait_until(
                    lambda: len(spark_executor_ids(spark) or ()) >= NUM_TASKS,
                    waited,
                    f"Spark has not had {NUM_TASKS} executors again after the kill",
                )
            phases["replacement_wait"] = round(time.monotonic() - waited, 1)
            for _ in range(args.after):
                batch += 1
                numbers = update_keys(rng, total, args.updates * NUM_TASKS)
                updated[numbers] += 1
                frame = key_frame(spark, numbers)
                began = time.monotonic()
                seconds = run(batch, frame)[0] - began
                after.append({"batch": batch, "ms": round(seconds * 1000.0, 1), "attempts": attempts_of(job, batch)})
                print(f"batch {batch}: {seconds * 1000.0:,.0f} ms {after[-1]['attempts']}", flush=True)
            time.sleep(0.5)
        fn_started = {int(r["task"]): float(r["fn_started"]) - killed_wall for r in rows}
        task0 = [a for a in recovered if a["task"] == 0][-1]
        timeline = {
            "spark_dropped_lost_executor_s": _since(watcher.first("spark", "-", victim_executor), killed_at),
            "new_executor_process_s": _since(watcher.first("process", "+"), killed_at),
            "new_executor_registered_s": _since(watcher.first("spark", "+"), killed_at),
            "task0_fn_started_s": round(fn_started.get(0, float("nan")), 3),
            "task0_attempt_started_s": round(fn_started.get(0, float("nan")) - task0["open_ms"] / 1000.0, 3),
            "task1_fn_started_s": round(fn_started.get(1, float("nan")), 3),
            "batch_end_s": round(recovery_s, 3),
            # the same in the steady batches (p50), from the call: what a batch takes before any function runs
            "steady_task0_fn_started_s": _median([o[0] for o in fn_offsets[WARM_UP:] if 0 in o]),
            "steady_task1_fn_started_s": _median([o[1] for o in fn_offsets[WARM_UP:] if 1 in o]),
        }
        phases["kill_to_after_batches_end"] = round(time.monotonic() - killed_at, 1)

        checked = time.monotonic()
        check = check_state(spark, config, total, updated)
        phases["check"] = round(time.monotonic() - checked, 1)
        loads["end"] = [round(x, 2) for x in os.getloadavg()]
        target_s = float(restore["seconds"]) + one_batch_ms / 1000.0
        return {
            "keys_per_task": keys_per_task,
            "keys": total,
            "backend": args.backend,
            "updates_per_task": args.updates,
            "executor_memory_mb": mem,
            "batch_ms": [round(x, 1) for x in batch_ms],
            "fn_started_s": fn_offsets,
            "one_batch_ms": round(one_batch_ms, 1),
            "restore_s": round(float(restore["seconds"]), 3),
            "restores": restores,
            "victim_executor": victim_executor,
            "executors_before": sorted(processes),
            "recovery_s": round(recovery_s, 3),
            "target_s": round(target_s, 3),
            "recovery_over_target": round(recovery_s / target_s, 2),
            "recovered_attempts": recovered,
            "task0_recovered": task0,
            "timeline": timeline,
            "watcher_events": [(round(t - killed_at, 3), k, c, e) for t, k, c, e in watcher.events],
            "after": after,
            "check": check,
            "load_average": loads,
            "phases_s": phases,
        }
    finally:
        spark.stop()
        shutil.rmtree(app_work_dir, ignore_errors=True)


def _median(values: list[float]) -> float | None:
    return round(statistics.median(values), 3) if values else None


def _since(when: float | None, start: float) -> float | None:
    return None if when is None else round(when - start, 3)


def check_state(spark: Any, config: dict[str, Any], total: int, updated: Any) -> dict[str, Any]:
    """The state read back from the blob store against the expected counts: every key once, each count 1 + its
    updates (the keys updated are joined in from a frame of theirs; every other key must hold 1)."""
    import numpy as np
    import pandas as pd

    from statebackend.spark import read_state

    state = read_state(spark, config, "counts", num_tasks=NUM_TASKS)
    numbers = np.nonzero(updated)[0]
    expected = spark.createDataFrame(
        pd.DataFrame({"key": [key_of(n) for n in numbers.tolist()], "n": updated[numbers].astype("int64")})
    )
    from pyspark.sql import functions as F

    # one pass (read_state restores every task): per task and, in the row whose task is null, over all of them
    rows = (
        state.join(expected, "key", "left")
        .rollup("task")
        .agg(
            *(
                F.expr(text)
                for text in (
                    "count(*) as keys",
                    "count(distinct key) as distinct_keys",
                    "count(n) as updated_keys",
                    "sum(CASE WHEN value = 1 + coalesce(n, 0) THEN 0 ELSE 1 END) as wrong",
                )
            )
        )
        .collect()
    )
    row = next(r for r in rows if r["task"] is None)
    result = {
        "keys": row["keys"],
        "distinct_keys": row["distinct_keys"],
        "updated_keys": row["updated_keys"],
        "expected_updated_keys": len(numbers),
        "wrong_counts": row["wrong"],
        "keys_per_task": {r["task"]: r["keys"] for r in rows if r["task"] is not None},
    }
    result["ok"] = (
        row["keys"] == total
        and row["distinct_keys"] == total
        and row["updated_keys"] == len(numbers)
        and row["wrong"] == 0
    )
    return result


def _cell(value: float | None, scale: float = 1.0) -> Any:
    return "-" if value is None or value != value else round(value * scale, 2)


def report(results: list[dict[str, Any]]) -> None:
    """The markdown tables: one row per size, then each size's recovery timeline."""
    rows = []
    for r in results:
        t0 = r["task0_recovered"]
        where = "the surviving executor" if t0["executor"] in r["executors_before"] else "a new executor"
        rows.append(
            [
                r["keys_per_task"],
                r["one_batch_ms"],
                r["restore_s"],
                r["target_s"],
                r["recovery_s"],
                f"{r['recovery_over_target']:.2f}x",
                f"{where} ({t0['executor']})",
                t0["open_ms"],
                "restore" if t0["restored_full"] else ("catch-up" if t0["caught_up"] else "reused"),
                "OK" if r["check"]["ok"] else "FAIL",
            ]
        )
    print(
        "\n"
        + format_table(
            [
                "keys per task",
                "one batch p50 ms",
                "restore s (fresh process)",
                "target s (restore + one batch)",
                "recovery s (kill -> end of next batch)",
                "recovery / target",
                "task 0 ran again on",
                "its open ms",
                "open was",
                "state",
            ],
            rows,
        )
    )
    for r in results:
        t = r["timeline"]
        t0 = r["task0_recovered"]
        print(f"\n{r['keys_per_task']:,} keys per task: seconds after the kill\n")
        print(
            format_table(
                ["event", "s"],
                [
                    ["Spark dropped the lost executor (getExecutorIds)", _cell(t["spark_dropped_lost_executor_s"])],
                    ["a new executor process started", _cell(t["new_executor_process_s"])],
                    ["the new executor registered", _cell(t["new_executor_registered_s"])],
                    [
                        "task 1's function started (steady batches, p50: "
                        f"{_cell(t['steady_task1_fn_started_s'])} s after the call)",
                        _cell(t["task1_fn_started_s"]),
                    ],
                    ["task 0's attempt started (its function's start - its open)", _cell(t["task0_attempt_started_s"])],
                    [
                        "task 0's function started, after its open (steady batches, p50: "
                        f"{_cell(t['steady_task0_fn_started_s'])} s after the call)",
                        _cell(t["task0_fn_started_s"]),
                    ],
                    [
                        f"the batch ended (task 0: process {t0['process_ms']:.0f} ms, commit {t0['commit_ms']:.0f} ms)",
                        _cell(t["batch_end_s"]),
                    ],
                ],
            )
        )
        after = ", ".join(
            f"{a['ms']:.0f} ms (" + ", ".join(f"task {x['task']} on {x['executor']}" for x in a["attempts"]) + ")"
            for a in r["after"]
        )
        print(f"\nbatches after it: {after or '-'}; load average {r['load_average']}; state check {r['check']}")
        print(f"steps (s): {r['phases_s']}")


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument(
        "--keys-per-task",
        type=int,
        action="append",
        default=None,
        help="keys of state per task (repeatable: one run per size; default 1000000)",
    )
    parser.add_argument("--updates", type=int, default=50_000, help="random keys updated per task per batch")
    parser.add_argument("--batches", type=int, default=8, help=f"update batches before the kill ({WARM_UP} warm-up)")
    parser.add_argument("--after", type=int, default=3, help="batches after the recovered one")
    parser.add_argument("--backend", choices=["changelog", "blobsnapshot"], default="changelog")
    parser.add_argument(
        "--executor-memory-mb", type=int, default=2048, help="each executor's (and worker's) memory, MB"
    )
    parser.add_argument(
        "--restores", type=int, default=2, help="restores of task 0 in a fresh process before the kill (best kept)"
    )
    parser.add_argument("--seed", type=int, default=7)
    parser.add_argument("--result", type=Path, default=None, help="the JSON result's path (default bench/results/)")
    parser.add_argument("--restore-child", default=None, help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.restore_child is not None:
        restore_child(args.restore_child)
        return 0
    sizes = args.keys_per_task or [1_000_000]
    if any(n < 1 for n in sizes) or min(args.updates, args.batches, args.restores) < 1 or args.after < 0:
        parser.error("--keys-per-task, --updates, --batches and --restores must be positive, --after at least 0")
    if args.updates > min(sizes):
        parser.error(f"--updates ({args.updates}) cannot exceed --keys-per-task ({min(sizes)})")
    print(
        f"# Executor loss to recovery: local-cluster[{NUM_TASKS},1,{args.executor_memory_mb}], {NUM_TASKS} tasks, "
        f"{args.backend} backend, {args.updates:,} updates per task per batch, {args.batches} batches before the "
        f"kill ({WARM_UP} warm-up); load average {os.getloadavg()}\n",
        flush=True,
    )
    results = []
    for size in sizes:
        work = Path(tempfile.mkdtemp(prefix="statebackend-bench-executor-loss-"))
        try:
            results.append(run_size(args, size, work))
        finally:
            shutil.rmtree(work, ignore_errors=True)
    report(results)
    result = {"args": {k: v for k, v in vars(args).items() if k != "restore_child"}, "sizes": results}
    result["machine"] = machine_info()
    if args.result is not None:
        args.result.write_text(json.dumps(result, indent=2, default=str) + "\n")
        path = args.result
    else:
        path = write_result("executor-loss", result)
    print(f"\nresult: {path}")
    failed = [r["keys_per_task"] for r in results if not r["check"]["ok"]]
    if failed:
        print(f"# FAIL: the state after the recovery is not exact at {failed} keys per task", flush=True)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
