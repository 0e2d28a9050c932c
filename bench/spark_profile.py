"""Where a micro-batch's time goes, for statebackend's foreachBatch count and the no-state floor of bench/spark_e2e.py
(same input, same shuffle, same Arrow aggregation), in one run.

Run from the repository root::

    python -m bench.spark_profile                     # 1M keys, 10k and 50k updates per batch, 10 update batches

Per update batch it takes, from Spark's own query progress: ``triggerExecution`` (the batch) and ``addBatch`` (the
``foreachBatch`` call; the rest is Spark's streaming bookkeeping: offsets, the file listing, its commit log); on the
driver, inside ``foreachBatch``: the actions (``save``, ``collect``, ``count``, ``localCheckpoint``: the one that runs
the tasks, and any other) and the rest of ours
(building the task function, the accumulator, the sink call, unpersist); per task, from ``TaskStats`` and timers in
the task function: opening or taking back the task, the Arrow conversion and aggregation, the state calls
(``get_many`` + ``put_many``), the durable commit and its sync part. Tasks run two at a time (``local[2]``), so a
batch's task time is about the sum over the tasks divided by two. p50 over the update batches.
"""

from __future__ import annotations

import argparse
import json
import shutil
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from bench.spark_e2e import NUM_TASKS, no_state_batch, write_input
from statebackend.spark import StatefulForeachBatch, local_spark_session


def timed_count(stores: Any, batches: Any) -> None:
    """``bench.spark_e2e.count_keys`` with timers around the Arrow part and the state calls (appended to a file)."""
    import pyarrow as pa

    started = time.perf_counter()
    received = list(batches)
    if not received:
        return
    grouped = pa.Table.from_batches(received).group_by("key").aggregate([("key", "count")])
    keys, added = grouped.column("key"), grouped.column("key_count").to_pylist()
    arrow_done = time.perf_counter()
    counts = stores["counts"]
    counts.put_many(keys, [(old or 0) + n for old, n in zip(counts.get_many(keys), added, strict=True)])
    state_done = time.perf_counter()
    timings = Path(stores.storage.settings.local_dir).parent / "task-timings.jsonl"
    with open(timings, "a") as out:
        out.write(
            json.dumps(
                {
                    "batch": stores.batch_id,
                    "task": stores.task_index,
                    "arrow_ms": (arrow_done - started) * 1000.0,
                    "state_ms": (state_done - arrow_done) * 1000.0,
                }
            )
            + "\n"
        )


class Timed:
    """Wraps a foreachBatch function: times the whole call and the noop-sink action inside it."""

    def __init__(self, inner: Any) -> None:
        self.inner = inner
        self.calls: dict[int, dict[str, float]] = {}

    def __call__(self, batch_df: Any, batch_id: int) -> Any:
        record = self.calls.setdefault(int(batch_id), {"action_ms": 0.0})
        frame, writer = type(batch_df), type(batch_df.write)  # Spark 4's classic classes override the base ones
        originals = [
            (writer, "save", writer.save),
            (frame, "collect", frame.collect),
            (frame, "count", frame.count),
            (frame, "localCheckpoint", frame.localCheckpoint),
        ]

        def timed(original: Any) -> Any:
            def action(self: Any, *args: Any, **kwargs: Any) -> Any:
                started = time.perf_counter()
                try:
                    return original(self, *args, **kwargs)
                finally:
                    record["action_ms"] += (time.perf_counter() - started) * 1000.0

            return action

        for owner, name, original in originals:
            setattr(owner, name, timed(original))
        started = time.perf_counter()
        try:
            return self.inner(batch_df, batch_id)
        finally:
            record["call_ms"] = (time.perf_counter() - started) * 1000.0
            for owner, name, original in originals:
                setattr(owner, name, original)


def run(spark: Any, source: Path, work: Path, fn: Any, name: str) -> dict[int, dict[str, float]]:
    stream = spark.readStream.schema("key string").option("maxFilesPerTrigger", 1).parquet(str(source))
    query = (
        stream.writeStream.foreachBatch(fn)
        .option("checkpointLocation", str(work / f"{name}-checkpoint"))
        .trigger(availableNow=True)
        .start()
    )
    query.awaitTermination()
    if query.exception() is not None:
        raise RuntimeError(f"{name} failed: {query.exception()}")
    out = {}
    for p in query.recentProgress:
        if p["numInputRows"] > 0:
            durations = p["durationMs"]
            out[p["batchId"]] = {"batch_ms": durations["triggerExecution"], "add_batch_ms": durations["addBatch"]}
    return out


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--keys", type=int, default=1_000_000)
    parser.add_argument("--updates", type=int, nargs="+", default=[10_000, 50_000])
    parser.add_argument("--batches", type=int, default=10)
    args = parser.parse_args(argv)
    root = Path(tempfile.mkdtemp(prefix="statebackend-bench-profile-"))
    spark = local_spark_session(
        "statebackend-profile",
        master="local[2]",
        conf={"spark.sql.shuffle.partitions": str(NUM_TASKS), "spark.driver.memory": "4g"},
    )
    spark.sparkContext.setLogLevel("ERROR")
    med = statistics.median
    try:
        for updates in args.updates:
            work = root / f"updates-{updates}"
            write_input(work / "input", args.keys, updates, args.batches)
            timings = work / "task-timings.jsonl"  # written by timed_count next to state.local.dir
            floor_fn = Timed(no_state_batch)
            floor = run(spark, work / "input", work, floor_fn, "floor")
            config = {
                "job.name": "profile",
                "state.local.dir": str(work / "local"),
                "blob.store.url": f"file://{work / 'blobs'}",
                "blob.store.create.if.missing": "true",
                "stores.counts.backup.factories": "changelog",
                "stores.counts.key.serde": "string",
                "stores.counts.msg.serde": "integer",
            }
            job = StatefulForeachBatch(
                timed_count,
                key_columns=["key"],
                num_tasks=NUM_TASKS,
                config=config,
                output_schema="key string",
                mode="arrow",
                sink=lambda df, batch_id: None,
            )
            ours_fn = Timed(job)
            ours = run(spark, work / "input", work, ours_fn, "statebackend")
            tasks = [json.loads(line) for line in timings.read_text().splitlines()] if timings.exists() else []
            steady = sorted(b for b in ours if b > 0)

            def p50(values: list[float]) -> str:
                return f"{med(values):.0f}" if values else "-"

            def per_batch_task_sum(field: str, source: list[Any], batches: list[int] = steady) -> list[float]:
                return [
                    sum(
                        getattr(s, field) if not isinstance(s, dict) else s[field]
                        for s in source
                        if (s.batch_id if not isinstance(s, dict) else s["batch"]) == b
                    )
                    for b in batches
                ]

            stats = job.history
            print(
                f"\n## {updates} updated keys per batch ({args.keys} keys, {NUM_TASKS} tasks, p50 over "
                f"{len(steady)} update batches, ms)\n"
            )
            print("| | no-state floor | statebackend |")
            print("|---|---:|---:|")
            print(
                f"| batch (triggerExecution) | {p50([floor[b]['batch_ms'] for b in steady if b in floor])} | "
                f"{p50([ours[b]['batch_ms'] for b in steady])} |"
            )
            print(
                f"| Spark's streaming bookkeeping (batch - addBatch) | "
                f"{p50([floor[b]['batch_ms'] - floor[b]['add_batch_ms'] for b in steady if b in floor])} | "
                f"{p50([ours[b]['batch_ms'] - ours[b]['add_batch_ms'] for b in steady])} |"
            )
            print(
                f"| foreachBatch call (addBatch) | {p50([floor[b]['add_batch_ms'] for b in steady if b in floor])}"
                f" | {p50([ours[b]['add_batch_ms'] for b in steady])} |"
            )
            print(
                f"| - its actions (shuffle + tasks) | "
                f"{p50([floor_fn.calls[b]['action_ms'] for b in steady if b in floor_fn.calls])} | "
                f"{p50([ours_fn.calls[b]['action_ms'] for b in steady])} |"
            )
            floor_rest = [
                floor_fn.calls[b]["call_ms"] - floor_fn.calls[b]["action_ms"] for b in steady if b in floor_fn.calls
            ]
            print(
                f"| - the rest of the call (driver side) | "
                f"{p50(floor_rest)} | "
                f"{p50([ours_fn.calls[b]['call_ms'] - ours_fn.calls[b]['action_ms'] for b in steady])} |"
            )
            print(f"| tasks, sum of {NUM_TASKS}: open or take back | - | {p50(per_batch_task_sum('open_ms', stats))} |")
            print(
                f"| tasks, sum of {NUM_TASKS}: Arrow conversion + group_by | - | "
                f"{p50(per_batch_task_sum('arrow_ms', tasks))} |"
            )
            print(
                f"| tasks, sum of {NUM_TASKS}: state calls (get_many + put_many) | - | "
                f"{p50(per_batch_task_sum('state_ms', tasks))} |"
            )
            print(f"| tasks, sum of {NUM_TASKS}: durable commit | - | {p50(per_batch_task_sum('commit_ms', stats))} |")
            print(
                f"| tasks, sum of {NUM_TASKS}: of it the sync part | - | "
                f"{p50(per_batch_task_sum('commit_sync_ms', stats))} |"
            )
            kept = sum(s.kept_open for s in stats if s.batch_id > 0) / max(1, len([s for s in stats if s.batch_id > 0]))
            print(f"\ntasks kept open: {kept:.0%}", flush=True)
    finally:
        spark.stop()
        shutil.rmtree(root, ignore_errors=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
