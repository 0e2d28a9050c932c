"""A/B of one micro-batch's ``foreachBatch`` call, interleaved batch by batch in one SparkSession so the shared
machine's drift hits every variant alike: statebackend's count with the driver confirming the checkpoints (tasks hand
their output on after the sync part of their commit: ``confirm_on_driver=True``, the default on remote blob stores),
the same with every task waiting for its own checkpoint (the default on ``file://``), the same again with the stats
travelling as rows of a persisted output (the Spark Connect route, which classic Spark took until the stats went
through an accumulator: ``--stats-rows``), and the no-state floor (same shuffle and Arrow aggregation, no state).

    python -m bench.spark_ab                          # 1M keys, 10k updates, 16 batches; --batches 80 to see 5%

Each batch's Parquet file of bench.spark_e2e's workload is read once as a DataFrame and handed to each variant's
``foreachBatch`` function in turn, the order rotating every batch; the time is the whole call (what Spark reports as
``addBatch``: the shuffle, the tasks, the driver's work), the load batch left out. Each statebackend variant keeps its
own state (its own local and blob dirs); each is checked against a batch count at the end.
"""

from __future__ import annotations

import argparse
import shutil
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from bench.spark_e2e import NUM_TASKS, count_keys, no_state_batch, write_input
from statebackend.metrics import percentile
from statebackend.spark import StatefulForeachBatch, local_spark_session, read_state


class StatsRows(StatefulForeachBatch):
    """Stats as rows of the persisted output, the route Spark Connect takes (no accumulator), on classic Spark."""

    def _stats_accumulator(self, spark: Any) -> None:
        return None


def job(
    work: Path, name: str, kind: type[StatefulForeachBatch] = StatefulForeachBatch, **options: Any
) -> tuple[StatefulForeachBatch, dict[str, object]]:
    config: dict[str, object] = {
        "job.name": name,
        "state.local.dir": str(work / name / "local"),
        "blob.store.url": f"file://{work / name / 'blobs'}",
        "blob.store.create.if.missing": "true",
        "stores.counts.backup.factories": "changelog",
        "stores.counts.key.serde": "string",
        "stores.counts.msg.serde": "integer",
    }
    return kind(
        count_keys,
        key_columns=["key"],
        num_tasks=NUM_TASKS,
        config=config,
        output_schema="key string",
        mode="arrow",
        sink=lambda frame, batch_id: None,
        **options,
    ), config


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--keys", type=int, default=1_000_000)
    parser.add_argument("--updates", type=int, default=10_000)
    parser.add_argument("--batches", type=int, default=16)
    parser.add_argument(
        "--stats-rows", action="store_true", help="add the variant whose stats travel as rows of a persisted output"
    )
    args = parser.parse_args(argv)
    work = Path(tempfile.mkdtemp(prefix="statebackend-bench-ab-"))
    spark = local_spark_session(
        "statebackend-bench-ab",
        master="local[2]",
        conf={"spark.sql.shuffle.partitions": str(NUM_TASKS), "spark.driver.memory": "4g"},
    )
    spark.sparkContext.setLogLevel("ERROR")
    try:
        total = write_input(work / "input", args.keys, args.updates, args.batches)
        confirmed, confirmed_config = job(work, "confirmed", confirm_on_driver=True)
        waiting, waiting_config = job(work, "waiting", confirm_on_driver=False)
        variants: dict[str, Any] = {
            "driver confirms": confirmed,
            "tasks wait (default on file://)": waiting,
            "no-state floor": no_state_batch,
        }
        checked = [("driver confirms", confirmed, confirmed_config), ("tasks wait", waiting, waiting_config)]
        if args.stats_rows:
            rows_job, rows_config = job(work, "rows", StatsRows, confirm_on_driver=False)
            variants["tasks wait, stats as rows of a persisted output"] = rows_job
            checked.append(("stats as rows", rows_job, rows_config))
        times: dict[str, list[float]] = {name: [] for name in variants}
        names = list(variants)
        for batch in range(args.batches + 1):
            frame = spark.read.parquet(str(work / "input" / f"batch-{batch:04d}.parquet"))
            order = names[batch % len(names) :] + names[: batch % len(names)]
            for name in order:
                started = time.perf_counter()
                variants[name](frame, batch)
                if batch > 0:
                    times[name].append((time.perf_counter() - started) * 1000.0)
        print(
            f"# foreachBatch call ms, {args.keys} keys, {args.updates} updates, {args.batches} batches, "
            f"interleaved (p50 / p95)\n"
        )
        print("| variant | p50 | p95 | p50 vs the floor |")
        print("|---|---:|---:|---:|")
        floor = statistics.median(times["no-state floor"])
        for name, values in times.items():
            p50 = statistics.median(values)
            print(f"| {name} | {p50:.0f} | {percentile(values, 0.95):.0f} | {p50 / floor:.2f}x |")
        ok = True
        for name, _, config in checked:
            keys, counted = (
                read_state(spark, config, "counts", num_tasks=NUM_TASKS).selectExpr("count(*)", "sum(value)").first()
            )
            good = keys == args.keys and counted == total
            ok &= good
            print(f"\n{name}: {keys} keys, counts sum to {counted} of {total} rows: {'OK' if good else 'FAIL'}")
        for name, variant, _ in checked:
            counters = variant.metrics.export()
            print(
                f"{name}: reruns {counters.counter('spark.batch.reruns')}, stats missing "
                f"{counters.counter('spark.task.stats.missing')}"
            )
        return 0 if ok else 1
    finally:
        spark.stop()
        shutil.rmtree(work, ignore_errors=True)


if __name__ == "__main__":
    sys.exit(main())
