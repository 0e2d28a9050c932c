"""A/B of the Spark driver's row routing: key-group routing (``statebackend.microbatch.keygroups.route``) against the
routing before key groups (``repartition(num_tasks, *key_columns)``), on bench.spark_e2e's workload, in one process,
the two alternated so the machine's drift hits both alike.

    python -m bench.spark_routing                      # 200k keys, 10k updates, 10 batches, 4 rounds
"""

from __future__ import annotations

import argparse
import shutil
import statistics
import sys
import tempfile
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import bench.spark_e2e as e2e
from statebackend.spark import driver, local_spark_session


def old_route(batch_df: Any, key_columns: Any, num_tasks: int, key_groups: int) -> Any:
    return batch_df.repartition(num_tasks, *key_columns)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--keys", type=int, default=200_000)
    parser.add_argument("--updates", type=int, default=10_000)
    parser.add_argument("--batches", type=int, default=10)
    parser.add_argument("--rounds", type=int, default=4)
    args = parser.parse_args(argv)
    spark = local_spark_session(
        "statebackend-bench-routing",
        master="local[2]",
        conf={"spark.sql.shuffle.partitions": str(e2e.NUM_TASKS), "spark.driver.memory": "4g"},
    )
    spark.sparkContext.setLogLevel("ERROR")
    routes = {"key groups": driver.route, "repartition(n, key)": old_route}
    times: dict[str, list[float]] = {name: [] for name in routes}
    try:
        for round_ in range(args.rounds):
            order = list(routes.items())
            for name, route in order if round_ % 2 == 0 else reversed(order):  # each goes first every other round
                driver.route = route  # type: ignore[assignment]
                work = Path(tempfile.mkdtemp(prefix="statebackend-bench-routing-"))
                try:
                    e2e.write_input(work / "input", args.keys, args.updates, args.batches)
                    rows, _, _ = e2e.run_statebackend(spark, work / "input", work)
                finally:
                    shutil.rmtree(work, ignore_errors=True)
                times[name] += [row["duration_ms"] for row in rows if row["batch"] > 1]  # the load and one warm-up
    finally:
        driver.route = routes["key groups"]  # type: ignore[assignment]
        spark.stop()
    print("| routing | batch ms p50 | batches |\n|---|---:|---:|")
    for name, values in times.items():
        print(f"| {name} | {statistics.median(values):.1f} | {len(values)} |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
