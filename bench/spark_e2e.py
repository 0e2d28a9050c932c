"""End to end against Spark's own state store: the same stateful count through (a) Spark's ``groupBy(key).count()``
with the RocksDB state store provider and changelog checkpointing, and (b) a ``foreachBatch`` count on statebackend.

Run from the repository root (the reference workload of docs/benchmarks.md; a few minutes per update size on 2 cores)::

    python -m bench.spark_e2e                                   # 1M keys, 4 partitions, 10k and 50k updates, 20 batches
    python -m bench.spark_e2e --keys 200000 --batches 8         # a quick run

Input, identical for both, as Parquet files read one per micro-batch (``maxFilesPerTrigger=1``): batch 0 holds every
key once (it loads the state: ``--keys`` keys), each later batch holds ``--updates`` distinct keys drawn at random, so
every batch updates that many keys of a state of ``--keys`` keys. Both run ``local[2]`` with 4 shuffle partitions /
4 tasks, one after the other in the same process, on the same files.

Per batch it reports, from Spark's own query progress for both: the batch duration (``triggerExecution``); Spark's
state commit time (``commitTimeMs`` of the state operator: summed over its 4 partitions, as Spark reports it) and
statebackend's durable commit (per task, wall clock from the start of the commit until the checkpoint is durable;
max and sum over the 4 tasks) and its sync part (flush + snapshot, the part that blocks processing). Batch 0 (the
load) is shown but left out of the summaries. The statebackend result is checked: the sum of all counts read back
from the blob store must equal the number of input rows, and the number of keys must equal ``--keys``.
"""

from __future__ import annotations

import argparse
import os
import shutil
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from statebackend.metrics import percentile
from statebackend.spark import StatefulForeachBatch, local_spark_session, read_state

NUM_TASKS = 4


def count_keys(stores: Any, batches: Any) -> None:
    """statebackend's side: add each key's occurrences in the batch to its stored count (Arrow, no output)."""
    import pyarrow as pa

    received = list(batches)
    if not received:
        return
    grouped = pa.Table.from_batches(received).group_by("key").aggregate([("key", "count")])
    counts = stores["counts"]
    for key, n in zip(grouped.column("key").to_pylist(), grouped.column("key_count").to_pylist()):
        counts.put(key, (counts.get(key) or 0) + n)
    return


def write_input(directory: Path, keys: int, updates: int, batches: int, seed: int = 11) -> int:
    """Parquet files batch-0000 (every key) .. batch-N (``updates`` distinct random keys each); returns total rows."""
    import numpy as np
    import pyarrow as pa
    import pyarrow.parquet as pq

    directory.mkdir(parents=True)
    rng = np.random.default_rng(seed)
    total = 0
    now = time.time() - 10 * (batches + 1)
    for batch in range(batches + 1):
        ids = np.arange(keys) if batch == 0 else rng.choice(keys, size=min(updates, keys), replace=False)
        column = pa.array([f"k{i:08d}" for i in ids.tolist()], pa.string())
        path = directory / f"batch-{batch:04d}.parquet"
        pq.write_table(pa.table({"key": column}), path)
        os.utime(path, (now + 10 * batch, now + 10 * batch))  # the file source orders files by modification time
        total += len(column)
    return total


def run_spark_state_store(spark: Any, source: Path, work: Path) -> list[dict[str, Any]]:
    stream = spark.readStream.schema("key string").option("maxFilesPerTrigger", 1).parquet(str(source))
    query = (stream.groupBy("key").count().writeStream.outputMode("update").format("noop")
             .option("checkpointLocation", str(work / "spark-rocksdb-checkpoint")).trigger(availableNow=True).start())
    query.awaitTermination()
    if query.exception() is not None:
        raise RuntimeError(f"Spark's stateful query failed: {query.exception()}")
    rows = []
    for progress in query.recentProgress:
        if progress["numInputRows"] == 0:
            continue
        operator = progress["stateOperators"][0]
        rows.append({
            "batch": progress["batchId"],
            "duration_ms": progress["durationMs"]["triggerExecution"],
            "commit_ms": operator["commitTimeMs"],
            "state_rows": operator["numRowsTotal"],
            "updated_rows": operator["numRowsUpdated"],
        })
    return rows


def run_statebackend(spark: Any, source: Path, work: Path) -> tuple[list[dict[str, Any]], dict[str, object]]:
    config: dict[str, object] = {
        "job.name": "bench",
        "state.local.dir": str(work / "sb-local"),
        "blob.store.url": f"file://{work / 'sb-blobs'}",
        "blob.store.create.if.missing": "true",
        "stores.counts.backup.factories": "changelog",
        "stores.counts.key.serde": "string",
        "stores.counts.msg.serde": "integer",
    }
    job = StatefulForeachBatch(count_keys, key_columns=["key"], num_tasks=NUM_TASKS, config=config,
                               output_schema="key string", mode="arrow", sink=lambda frame, batch_id: None)
    stream = spark.readStream.schema("key string").option("maxFilesPerTrigger", 1).parquet(str(source))
    query = (stream.writeStream.foreachBatch(job).option("checkpointLocation", str(work / "sb-spark-checkpoint"))
             .trigger(availableNow=True).start())
    query.awaitTermination()
    if query.exception() is not None:
        raise RuntimeError(f"the statebackend query failed: {query.exception()}")
    rows = []
    for progress in query.recentProgress:
        if progress["numInputRows"] == 0:
            continue
        stats = [s for s in job.history if s.batch_id == progress["batchId"]]
        rows.append({
            "batch": progress["batchId"],
            "duration_ms": progress["durationMs"]["triggerExecution"],
            "commit_max_ms": max(s.commit_ms for s in stats),
            "commit_sum_ms": sum(s.commit_ms for s in stats),
            "sync_max_ms": max(s.commit_sync_ms for s in stats),
            "open_max_ms": max(s.open_ms for s in stats),
        })
    return rows, config


def summary(values: list[float]) -> str:
    if not values:
        return "-"
    return f"{statistics.median(values):.0f} / {percentile(values, 0.95):.0f}"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--keys", type=int, default=1_000_000, help="keys of state (default 1M)")
    parser.add_argument("--updates", type=int, nargs="+", default=[10_000, 50_000],
                        help="distinct keys updated per batch; one run per value (default 10000 50000)")
    parser.add_argument("--batches", type=int, default=20, help="update batches after the load batch (default 20)")
    parser.add_argument("--work-dir", type=Path, default=None, help="default: a temp dir, deleted at the end")
    args = parser.parse_args(argv)

    work_root = args.work_dir or Path(tempfile.mkdtemp(prefix="statebackend-bench-spark-"))
    spark = local_spark_session("statebackend-bench-spark", master="local[2]", conf={
        "spark.sql.shuffle.partitions": str(NUM_TASKS),
        "spark.sql.streaming.stateStore.providerClass":
            "org.apache.spark.sql.execution.streaming.state.RocksDBStateStoreProvider",
        "spark.sql.streaming.stateStore.rocksdb.changelogCheckpointing.enabled": "true",
        "spark.driver.memory": "4g",
    })
    spark.sparkContext.setLogLevel("ERROR")
    failed = False
    try:
        print(f"# Spark {spark.version}, local[2], {os.cpu_count()} CPUs, {args.keys} keys, {NUM_TASKS} partitions, "
              f"{args.batches} update batches\n")
        for updates in args.updates:
            work = work_root / f"updates-{updates}"
            total_rows = write_input(work / "input", args.keys, updates, args.batches)
            spark_rows = run_spark_state_store(spark, work / "input", work)
            sb_rows, config = run_statebackend(spark, work / "input", work)
            state = read_state(spark, config, "counts", num_tasks=NUM_TASKS).selectExpr("count(*)", "sum(value)")
            keys, counted = state.first()
            ok = keys == args.keys and counted == total_rows
            failed |= not ok
            print(f"## {updates} updated keys per batch\n")
            print("| batch | Spark+RocksDB batch ms | Spark commitTimeMs (sum of 4) | statebackend batch ms | "
                  "statebackend durable commit ms (max / sum of 4) | statebackend sync part ms (max) |")
            print("|---:|---:|---:|---:|---:|---:|")
            by_batch = {row["batch"]: row for row in sb_rows}
            for row in spark_rows:
                sb = by_batch.get(row["batch"])
                sb_cells = (f"{sb['duration_ms']} | {sb['commit_max_ms']:.0f} / {sb['commit_sum_ms']:.0f} | "
                            f"{sb['sync_max_ms']:.0f}") if sb else "- | - | -"
                print(f"| {row['batch']} | {row['duration_ms']} | {row['commit_ms']} | {sb_cells} |")
            steady_spark = [r for r in spark_rows if r["batch"] > 0]
            steady_sb = [r for r in sb_rows if r["batch"] > 0]
            print("\np50 / p95 over the update batches (batch 0, the load, left out):\n")
            print("| | batch ms | commit ms |")
            print("|---|---:|---:|")
            print(f"| Spark + RocksDB (changelog checkpointing) | {summary([r['duration_ms'] for r in steady_spark])} "
                  f"| {summary([r['commit_ms'] for r in steady_spark])} (sum of 4 partitions) |")
            print(f"| statebackend foreachBatch | {summary([r['duration_ms'] for r in steady_sb])} | "
                  f"{summary([r['commit_max_ms'] for r in steady_sb])} (slowest task, durable); "
                  f"{summary([r['commit_sum_ms'] for r in steady_sb])} (sum of 4); sync part "
                  f"{summary([r['sync_max_ms'] for r in steady_sb])} (slowest task) |")
            print(f"\nstatebackend state check: {keys} keys, counts sum to {counted} of {total_rows} input rows: "
                  f"{'OK' if ok else 'FAIL'}\n")
    finally:
        spark.stop()
        if args.work_dir is None:
            shutil.rmtree(work_root, ignore_errors=True)
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
