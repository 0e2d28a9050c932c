"""List and map state beside Spark's ``transformWithStateInPandas`` (issue 33): the same per-key logic through
statebackend's list and map stores and through a ``StatefulProcessor``'s ``ListState`` and ``MapState``, on the same
input files, the outputs checked equal key by key, next to a no-state floor.

Run from the repository root (minutes: transformWithStateInPandas calls Python per key and goes to the JVM for every
state access)::

    python -m bench.tws_state                                       # 10k users, 10k events a batch, 10 batches
    python -m bench.tws_state --users 200 --events 400 --batches 3  # a quick run
    python -m bench.tws_state --workloads list --figure docs/img/tws-state.png

Input, identical for every engine: one Parquet file per micro-batch (read one per trigger, ``maxFilesPerTrigger=1``,
``trigger(availableNow=True)``), ``--events`` events ``(user, seq, etype)`` each, the user drawn at random (seeded)
among ``--users``, ``seq`` increasing across the run, ``etype`` one of 8 event types.

Two workloads, each through three engines one after the other (``local[2]``, ``--partitions`` shuffle partitions /
tasks), every engine writing its output to Parquet (append) in its micro-batch:

- **list** (last N events): per event, append ``(seq, etype)`` to the user's list in ``seq`` order and keep the last
  ``--keep``; emit per user of the batch ``(user, size, kept)``, ``kept`` the list as text ``seq:etype,...``.
  statebackend: a list store (``stores.events.kind=list``), ``extend`` of the batch's events, ``trim(keep_last=N)``,
  ``get`` for the output. transformWithStateInPandas: a ``ListState`` (``get``, then ``put`` of the last N: ListState
  has no trim, so keeping the last N reads the list).
- **map** (counters by event type): per event, add one to the user's counter of its type; emit the changed entries
  ``(user, etype, count)``. statebackend: a map store (``stores.counters.kind=map``), ``get`` and ``put`` per changed
  entry. transformWithStateInPandas: a ``MapState`` (``getValue``, ``updateValue`` per changed entry).
- **the no-state floor**: the same read, the same shuffle into the same tasks, the same Arrow grouping and Parquet
  write, in ``foreachBatch``, without state (each batch's output from its own events alone).

transformWithStateInPandas runs on the RocksDB state store provider with changelog checkpointing; statebackend on the
changelog backend, ``file://`` blob store, through ``StatefulForeachBatch`` (arrow mode). The check: every output row
of statebackend, of transformWithStateInPandas and of the same logic in plain Python, grouped by user; a user whose
rows differ on any side fails the run (the users and their rows printed, exit 1). Per batch: Spark's
``triggerExecution`` for each engine; p50 / p95 over the batches after the first, the ratios statebackend /
transformWithStateInPandas and against the floor. The raw numbers go to ``--results-dir`` (default bench/results) as
``tws-state-<UTC time>.json``.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import shutil
import statistics
import sys
import tempfile
import time
from collections import Counter
from collections.abc import Iterator
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from pyspark.sql.streaming.stateful_processor import StatefulProcessor, StatefulProcessorHandle

from bench.common import RESULTS_DIR, load_text, machine_info, summary
from bench.spark_tws import progress_rows
from statebackend.spark import StatefulForeachBatch, local_spark_session

ETYPES = ("view", "click", "cart", "buy", "search", "share", "like", "rate")
INPUT_SCHEMA = "user string, seq long, etype string"
SCHEMAS = {"list": "user string, size long, kept string", "map": "user string, etype string, count long"}
FLOOR, SB, TWS = "no-state floor", "statebackend", "transformWithStateInPandas"
ENGINES = (FLOOR, SB, TWS)

#: one input event: (user, seq, etype)
Event = tuple[str, int, str]
#: one output row of either workload: (user, size, kept) or (user, etype, count)
Output = tuple[Any, ...]


def batch_events(batch: int, users: int, events: int, seed: int) -> list[Event]:
    """The events of batch ``batch``: the same for every engine and the plain-Python check (seeded)."""
    rng = random.Random(seed * 1_000_003 + batch)
    return [
        (f"u{rng.randrange(users):07d}", batch * events + i, ETYPES[rng.randrange(len(ETYPES))]) for i in range(events)
    ]


def write_input(directory: Path, users: int, events: int, batches: int, seed: int) -> list[list[Event]]:
    """One Parquet file per batch (``batch-0000`` ..), modification times in batch order (the file source reads
    them in that order); returns the events by batch."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    directory.mkdir(parents=True)
    stamp = time.time() - 10 * (batches + 1)
    out = []
    for batch in range(batches):
        rows = batch_events(batch, users, events, seed)
        path = directory / f"batch-{batch:04d}.parquet"
        pq.write_table(
            pa.table(
                {
                    "user": pa.array([r[0] for r in rows], pa.string()),
                    "seq": pa.array([r[1] for r in rows], pa.int64()),
                    "etype": pa.array([r[2] for r in rows], pa.string()),
                }
            ),
            path,
        )
        os.utime(path, (stamp + 10 * batch, stamp + 10 * batch))
        out.append(rows)
    return out


def kept_text(kept: list[tuple[int, str]]) -> str:
    """A kept list as the text both sides emit: ``seq:etype`` in list order, comma-separated."""
    return ",".join(f"{seq}:{etype}" for seq, etype in kept)


def expected_outputs(batches: list[list[Event]], keep: int) -> dict[str, list[Output]]:
    """What both streaming sides must emit, by workload, computed in plain Python batch by batch."""
    lists: dict[str, list[tuple[int, str]]] = {}
    counters: dict[str, Counter[str]] = {}
    out: dict[str, list[Output]] = {"list": [], "map": []}
    for events in batches:
        touched: set[str] = set()
        added: Counter[tuple[str, str]] = Counter()
        for user, seq, etype in sorted(events, key=lambda event: event[1]):
            kept = lists.setdefault(user, [])
            kept.append((seq, etype))
            del kept[:-keep]
            touched.add(user)
            added[(user, etype)] += 1
        out["list"].extend((user, len(lists[user]), kept_text(lists[user])) for user in touched)
        for (user, etype), n in added.items():
            counters.setdefault(user, Counter())[etype] += n
            out["map"].append((user, etype, counters[user][etype]))
    return out


# -- transformWithStateInPandas' side ----------------------------------------------------------------------------


class LastEventsProcessor(StatefulProcessor):
    """The list workload on a ``ListState``: the user's kept events read, the batch's appended in ``seq`` order, the
    last ``keep`` put back (ListState has no trim), one output row."""

    def __init__(self, keep: int) -> None:
        self.keep = keep

    def init(self, handle: StatefulProcessorHandle) -> None:
        self.events = handle.getListState("events", "seq long, etype string")

    def handleInputRows(self, key: Any, rows: Any, timerValues: Any) -> Iterator[Any]:
        import pandas as pd

        new = sorted(
            (int(seq), str(etype))
            for frame in rows
            for seq, etype in zip(frame["seq"].tolist(), frame["etype"].tolist(), strict=True)
        )
        old = [(int(row[0]), str(row[1])) for row in self.events.get()]
        kept = (old + new)[-self.keep :]
        self.events.put(kept)
        yield pd.DataFrame({"user": [key[0]], "size": [len(kept)], "kept": [kept_text(kept)]})

    def close(self) -> None:
        pass


class CountersProcessor(StatefulProcessor):
    """The map workload on a ``MapState`` (map key: the event type): ``getValue`` and ``updateValue`` per event type
    of the user's batch, the changed entries emitted."""

    def init(self, handle: StatefulProcessorHandle) -> None:
        self.counters = handle.getMapState("counters", "etype string", "count long")

    def handleInputRows(self, key: Any, rows: Any, timerValues: Any) -> Iterator[Any]:
        import pandas as pd

        added = Counter(etype for frame in rows for etype in frame["etype"].tolist())
        etypes = sorted(added)
        counts = []
        for etype in etypes:
            old = self.counters.getValue((etype,))
            count = (int(old[0]) if old is not None else 0) + added[etype]
            self.counters.updateValue((etype,), (count,))
            counts.append(count)
        yield pd.DataFrame({"user": [key[0]] * len(etypes), "etype": etypes, "count": counts})

    def close(self) -> None:
        pass


# -- statebackend's side and the floor -----------------------------------------------------------------------------


def grouped_events(batches: Any) -> dict[str, list[tuple[int, str]]]:
    """A task's Arrow batches as each user's events ``(seq, etype)`` in ``seq`` order."""
    import pyarrow as pa

    table = pa.Table.from_batches(list(batches)).sort_by("seq")
    events: dict[str, list[tuple[int, str]]] = {}
    for user, seq, etype in zip(
        table.column("user").to_pylist(),
        table.column("seq").to_pylist(),
        table.column("etype").to_pylist(),
        strict=True,
    ):
        events.setdefault(user, []).append((seq, etype))
    return events


def grouped_counts(batches: Any) -> list[tuple[str, str, int]]:
    """A task's Arrow batches as ``(user, etype, events)``, one per pair of the batch (Arrow's group by)."""
    import pyarrow as pa

    table = pa.Table.from_batches(list(batches)).group_by(["user", "etype"]).aggregate([("seq", "count")])
    return list(
        zip(
            table.column("user").to_pylist(),
            table.column("etype").to_pylist(),
            table.column("seq_count").to_pylist(),
            strict=True,
        )
    )


def list_table(rows: list[tuple[str, int, str]]) -> Any:
    import pyarrow as pa

    return pa.table(
        {
            "user": pa.array([r[0] for r in rows], pa.string()),
            "size": pa.array([r[1] for r in rows], pa.int64()),
            "kept": pa.array([r[2] for r in rows], pa.string()),
        }
    )


def map_table(rows: list[tuple[str, str, int]]) -> Any:
    import pyarrow as pa

    return pa.table(
        {
            "user": pa.array([r[0] for r in rows], pa.string()),
            "etype": pa.array([r[1] for r in rows], pa.string()),
            "count": pa.array([r[2] for r in rows], pa.int64()),
        }
    )


class KeepLastEvents:
    """statebackend's list workload: per user, ``extend`` with the batch's events (no read), ``trim`` to the last
    ``keep``, ``get`` the kept list for the output."""

    def __init__(self, keep: int) -> None:
        self.keep = keep

    def __call__(self, stores: Any, batches: Any) -> Any:
        events = stores["events"]
        out = []
        for user, new in grouped_events(batches).items():
            events.extend(user, [list(event) for event in new])
            events.trim(user, keep_last=self.keep)
            kept = [(seq, etype) for seq, etype in events.get(user)]
            out.append((user, len(kept), kept_text(kept)))
        return list_table(out)


def count_by_type(stores: Any, batches: Any) -> Any:
    """statebackend's map workload: per (user, etype) of the batch, ``get`` and ``put`` of that one entry."""
    counters = stores["counters"]
    out = []
    for user, etype, n in grouped_counts(batches):
        count = (counters.get(user, etype) or 0) + n
        counters.put(user, etype, count)
        out.append((user, etype, count))
    return map_table(out)


def floor_task(workload: str, keep: int) -> Any:
    """The floor's ``mapInArrow`` function: the workload's grouping and output from the batch alone, no state."""

    def run(batches: Iterator[Any]) -> Iterator[Any]:
        received = list(batches)
        if not received:
            return
        if workload == "list":
            table = list_table(
                [(user, len(new[-keep:]), kept_text(new[-keep:])) for user, new in grouped_events(received).items()]
            )
        else:
            table = map_table(grouped_counts(received))
        yield from table.to_batches()

    return run


# -- the runs ------------------------------------------------------------------------------------------------------


def run_query(writer: Any, what: str) -> list[dict[str, Any]]:
    """Start ``writer`` with ``trigger(availableNow=True)``, wait for it, and return its batches' rows."""
    query = writer.trigger(availableNow=True).start()
    query.awaitTermination()
    if query.exception() is not None:
        raise RuntimeError(f"the {what} query failed: {query.exception()}")
    return progress_rows(query)


def read_input(spark: Any, source: Path) -> Any:
    return spark.readStream.schema(INPUT_SCHEMA).option("maxFilesPerTrigger", 1).parquet(str(source))


def run_floor(spark: Any, source: Path, work: Path, workload: str, keep: int, partitions: int) -> list[dict[str, Any]]:
    target = str(work / "floor-out")
    task = floor_task(workload, keep)

    def batch(frame: Any, batch_id: int) -> None:
        frame.repartition(partitions, "user").mapInArrow(task, SCHEMAS[workload]).write.mode("append").parquet(target)

    writer = read_input(spark, source).writeStream.foreachBatch(batch)
    return run_query(writer.option("checkpointLocation", str(work / "floor-checkpoint")), f"{workload} floor")


def sb_config(work: Path, workload: str) -> dict[str, object]:
    """statebackend's config for a workload: the list store ``events`` or the map store ``counters``."""
    config: dict[str, object] = {
        "job.name": f"bench-tws-{workload}",
        "state.local.dir": str(work / "sb-local"),
        "blob.store.url": (work / "sb-blobs").as_uri(),
        "blob.store.create.if.missing": "true",
    }
    if workload == "list":
        stores = {"events.kind": "list", "events.key.serde": "string", "events.msg.serde": "json"}
        stores["events.backup.factories"] = "changelog"
    else:
        stores = {
            "counters.kind": "map",
            "counters.key.serde": "string",
            "counters.subkey.serde": "string",
            "counters.msg.serde": "integer",
            "counters.backup.factories": "changelog",
        }
    config.update({f"stores.{name}": value for name, value in stores.items()})
    return config


def run_sb(spark: Any, source: Path, work: Path, workload: str, keep: int, partitions: int) -> list[dict[str, Any]]:
    target = str(work / "sb-out")

    def sink(frame: Any, batch_id: int) -> None:
        frame.write.mode("append").parquet(target)

    job = StatefulForeachBatch(
        KeepLastEvents(keep) if workload == "list" else count_by_type,
        # the attrs converters (tuple, dict) of these two fields give mypy no parameter type to check against
        key_columns=["user"],
        num_tasks=partitions,
        config=sb_config(work, workload),
        output_schema=SCHEMAS[workload],
        mode="arrow",
        sink=sink,
    )
    writer = read_input(spark, source).writeStream.foreachBatch(job)
    return run_query(writer.option("checkpointLocation", str(work / "sb-checkpoint")), f"{workload} statebackend")


def run_tws(spark: Any, source: Path, work: Path, workload: str, keep: int) -> list[dict[str, Any]]:
    processor = LastEventsProcessor(keep) if workload == "list" else CountersProcessor()
    output = (
        read_input(spark, source)
        .groupBy("user")
        .transformWithStateInPandas(
            statefulProcessor=processor, outputStructType=SCHEMAS[workload], outputMode="Append", timeMode="None"
        )
    )
    writer = (
        output.writeStream.outputMode("append")
        .format("parquet")
        .option("path", str(work / "tws-out"))
        .option("checkpointLocation", str(work / "tws-checkpoint"))
    )
    return run_query(writer, f"{workload} transformWithStateInPandas")


def read_outputs(spark: Any, directory: Path) -> list[Output]:
    """Every output row written under ``directory`` (none if nothing was written)."""
    if not directory.exists():
        return []
    return [tuple(row) for row in spark.read.parquet(str(directory)).collect()]


def compare(ours: list[Output], theirs: list[Output], expected: list[Output]) -> list[str]:
    """The users whose output rows (all batches, sorted) differ between statebackend, transformWithStateInPandas and
    plain Python, sorted; empty when all three agree key by key."""

    def by_user(rows: list[Output]) -> dict[str, list[Output]]:
        grouped: dict[str, list[Output]] = {}
        for row in rows:
            grouped.setdefault(row[0], []).append(row)
        return {user: sorted(values) for user, values in grouped.items()}

    sides = by_user(ours), by_user(theirs), by_user(expected)
    users = set(sides[0]) | set(sides[1]) | set(sides[2])
    return sorted(user for user in users if not sides[0].get(user) == sides[1].get(user) == sides[2].get(user))


def difference_text(user: str, ours: list[Output], theirs: list[Output], expected: list[Output]) -> str:
    """One differing user's rows on each side, for the FAIL lines."""

    def rows(side: list[Output]) -> list[Output]:
        return sorted(row for row in side if row[0] == user)

    return f"  {user}: statebackend {rows(ours)}; transformWithStateInPandas {rows(theirs)}; expected {rows(expected)}"


def run_workload(spark: Any, work: Path, workload: str, args: Any, events: list[list[Event]]) -> dict[str, Any]:
    """One workload through the floor, statebackend and transformWithStateInPandas on the same files; prints the
    table and the check and returns the raw numbers."""
    source = work.parent / "input"
    load = os.getloadavg()
    runs = {
        FLOOR: run_floor(spark, source, work / "floor", workload, args.keep, args.partitions),
        SB: run_sb(spark, source, work / "sb", workload, args.keep, args.partitions),
        TWS: run_tws(spark, source, work / "tws", workload, args.keep),
    }
    load_after = os.getloadavg()
    ours = read_outputs(spark, work / "sb" / "sb-out")
    theirs = read_outputs(spark, work / "tws" / "tws-out")
    expected = expected_outputs(events, args.keep)[workload]
    differ = compare(ours, theirs, expected)
    title = {
        "list": f"ListState / list store: append per event, keep the last {args.keep}, emit the kept list",
        "map": "MapState / map store: a counter per user and event type, emit the changed entries",
    }[workload]
    print(f"## {title}\n")
    print(f"load average before: {load_text(load)}; after: {load_text(load_after)}\n")
    print("| batch | " + " | ".join(f"{engine} ms" for engine in ENGINES) + " |")
    print("|---:|" + "---:|" * len(ENGINES))
    by_batch = {engine: {row["batch"]: row["duration_ms"] for row in rows} for engine, rows in runs.items()}
    for batch in range(args.batches):
        print(f"| {batch} | " + " | ".join(str(by_batch[engine].get(batch, "-")) for engine in ENGINES) + " |")
    steady = {engine: [ms for batch, ms in by_batch[engine].items() if batch > 0] for engine in ENGINES}
    p50 = {engine: statistics.median(values) if values else float("nan") for engine, values in steady.items()}
    ratios: dict[str, float | None] = {
        "statebackend / transformWithStateInPandas": p50[SB] / p50[TWS],
        "no-state floor / transformWithStateInPandas": p50[FLOOR] / p50[TWS],
        "statebackend / no-state floor": p50[SB] / p50[FLOOR],
        # what the state costs each above the floor; none when either is not above it (noise at small sizes)
        "above the floor: statebackend / transformWithStateInPandas": (
            (p50[SB] - p50[FLOOR]) / (p50[TWS] - p50[FLOOR]) if min(p50[SB], p50[TWS]) > p50[FLOOR] else None
        ),
    }
    print(f"\np50 / p95 batch ms over batches 1 .. {args.batches - 1} (the first left out):\n")
    print("| engine | p50 / p95 ms |")
    print("|---|---:|")
    for engine in ENGINES:
        print(f"| {engine} | {summary(steady[engine])} |")
    print("\nRatios (p50):\n")
    for name, value in ratios.items():
        print(f"- {name}: {'-' if value is None else f'{value:.3f}x'}")
    ok = not differ and bool(expected)
    print(
        f"\n{workload} check: {len(expected)} output rows expected; statebackend wrote {len(ours)}, "
        f"transformWithStateInPandas {len(theirs)}; {len(differ)} users differ: {'OK' if ok else 'FAIL'}"
    )
    for user in differ[:10]:
        print(difference_text(user, ours, theirs, expected))
    if len(differ) > 10:
        print(f"  ... and {len(differ) - 10} more users: {differ[10:40]}")
    print(flush=True)
    return {
        "ok": ok,
        "differing_users": differ,
        "output_rows": {"expected": len(expected), SB: len(ours), TWS: len(theirs)},
        "load_average": {"before": list(load), "after": list(load_after)},
        "batches": {engine: rows for engine, rows in runs.items()},
        "p50_ms": p50,
        "ratios_p50": ratios,
    }


def draw_figure(path: Path, results: dict[str, dict[str, Any]], title: str) -> None:
    """Batch time per batch and engine, one panel per workload, log scale (matplotlib: the ``bench`` extra)."""
    from bench.figures import pyplot

    plt = pyplot()
    from matplotlib.ticker import FuncFormatter, LogLocator, MaxNLocator, NullFormatter

    colors = {FLOOR: "tab:gray", SB: "tab:blue", TWS: "tab:red"}
    figure, axes = plt.subplots(1, len(results), figsize=(6.5 * len(results), 4.5), squeeze=False)
    for axis, (workload, result) in zip(axes[0], results.items(), strict=True):
        for engine, rows in result["batches"].items():
            axis.plot(
                [r["batch"] for r in rows],
                [r["duration_ms"] / 1000 for r in rows],
                marker="o",
                markersize=3,
                label=engine,
                color=colors[engine],
            )
        axis.set_yscale("log")
        axis.yaxis.set_major_locator(LogLocator(subs=(1.0, 2.0, 5.0)))
        axis.yaxis.set_major_formatter(FuncFormatter(lambda value, _: f"{value:g}"))
        axis.yaxis.set_minor_formatter(NullFormatter())
        axis.xaxis.set_major_locator(MaxNLocator(integer=True))
        axis.set_xlabel("batch")
        axis.set_ylabel("batch time (s, log scale)")
        axis.set_title({"list": "ListState / list store", "map": "MapState / map store"}[workload])
        axis.grid(True, which="both", alpha=0.3)
        axis.legend(fontsize="small")
    figure.suptitle(title, fontsize="medium")
    figure.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    figure.savefig(path, dpi=110)
    plt.close(figure)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--users", type=int, default=10_000, help="users (keys) events are drawn from (default 10000)")
    parser.add_argument("--events", type=int, default=10_000, help="events per batch (default 10000)")
    parser.add_argument("--batches", type=int, default=10, help="micro-batches (default 10)")
    parser.add_argument("--keep", type=int, default=5, help="list workload: events kept per user (default 5)")
    parser.add_argument("--partitions", type=int, default=4, help="shuffle partitions = statebackend tasks")
    parser.add_argument("--seed", type=int, default=33)
    parser.add_argument(
        "--workloads", default="list,map", help="comma-separated, of: list, map (default both)", metavar="LIST"
    )
    parser.add_argument("--work-dir", type=Path, default=None, help="keep the work files there (default: a temp dir)")
    parser.add_argument(
        "--results-dir",
        type=Path,
        default=RESULTS_DIR,
        help="where tws-state-<UTC time>.json goes (default bench/results)",
    )
    parser.add_argument("--figure", type=Path, default=None, metavar="PNG", help="draw the batch times (matplotlib)")
    args = parser.parse_args(argv)
    workloads = [name.strip() for name in args.workloads.split(",") if name.strip()]
    unknown = sorted(set(workloads) - set(SCHEMAS))
    if unknown or not workloads:
        parser.error(f"--workloads: unknown {unknown or 'empty list'}; allowed: list, map")
    if args.batches < 2 or args.users < 1 or args.events < 1 or args.keep < 1 or args.partitions < 1:
        parser.error(
            "--batches must be >= 2 (the first is left out of the summaries); --users, --events, --keep "
            "and --partitions >= 1"
        )

    work_root = args.work_dir or Path(tempfile.mkdtemp(prefix="statebackend-bench-tws-state-"))
    spark = local_spark_session(
        "statebackend-bench-tws-state",
        master="local[2]",
        conf={
            "spark.sql.shuffle.partitions": str(args.partitions),
            "spark.sql.streaming.stateStore.providerClass": (
                "org.apache.spark.sql.execution.streaming.state.RocksDBStateStoreProvider"
            ),
            "spark.sql.streaming.stateStore.rocksdb.changelogCheckpointing.enabled": "true",
            "spark.driver.memory": "4g",
        },
    )
    spark.sparkContext.setLogLevel("ERROR")
    version = spark.version
    command = "python -m bench.tws_state " + " ".join(argv if argv is not None else sys.argv[1:])
    results: dict[str, dict[str, Any]] = {}
    try:
        print(
            f"# Spark {spark.version}, local[2], {os.cpu_count()} CPUs, {args.users} users, {args.events} events per "
            f"batch, {args.batches} batches, {args.partitions} partitions; load average {load_text(os.getloadavg())}"
            f"\n\n`{command.strip()}`\n"
        )
        events = write_input(work_root / "input", args.users, args.events, args.batches, args.seed)
        for workload in workloads:
            results[workload] = run_workload(spark, work_root / workload, workload, args, events)
        if args.figure is not None:
            draw_figure(
                args.figure,
                results,
                f"Spark {spark.version}, local[2], {os.cpu_count()} CPUs; {args.users} users, {args.events} events "
                f"per batch, {args.partitions} partitions",
            )
    finally:
        spark.stop()
        if args.work_dir is None:
            shutil.rmtree(work_root, ignore_errors=True)
    failed = [workload for workload, result in results.items() if not result["ok"]]
    args.results_dir.mkdir(parents=True, exist_ok=True)
    stamp = time.strftime("%Y%m%dT%H%M%SZ", time.gmtime())
    path = args.results_dir / f"tws-state-{stamp}.json"
    path.write_text(
        json.dumps(
            {
                "command": command.strip(),
                "machine": machine_info(),
                "spark": version,
                "parameters": {k: str(v) if isinstance(v, Path) else v for k, v in vars(args).items()},
                "workloads": results,
            },
            indent=2,
        )
        + "\n"
    )
    print(f"raw numbers: {path}")
    if failed:
        print(f"# FAIL: the outputs differ in {', '.join(failed)} (see the FAIL lines above)", flush=True)
        return 1
    print(f"# OK: statebackend's and transformWithStateInPandas' outputs equal, key by key ({', '.join(workloads)})")
    return 0


if __name__ == "__main__":
    sys.exit(main())
