"""End to end against Spark's own state store: the same stateful count through (a) Spark's ``groupBy(key).count()``
with the RocksDB state store provider and changelog checkpointing, and (b) a ``foreachBatch`` count on statebackend.

Run from the repository root (the reference workload of docs/benchmarks.md; a few minutes per update size on 2 cores)::

    python -m bench.spark_e2e                                   # 1M keys, 4 partitions, 10k and 50k updates, 20 batches
    python -m bench.spark_e2e --keys 200000 --batches 8         # a quick run
    python -m bench.spark_e2e --backend blobsnapshot            # statebackend's store on the blob-snapshot backend
    python -m bench.spark_e2e --blob-store s3                   # on moto's S3 server: requests per batch counted
    python -m bench.spark_e2e --tws --keys 100000 --updates 10000 --batches 10 --rescale-to 0 --cluster-batches 0 \
        --figure docs/img/spark-tws.png                         # beside transformWithStateInPandas (minutes)

After each update size, a rescale step (``--rescale-to 6``; 0 skips it): three more update batches with 6 tasks on the
4-task state, the first of them rescaled. At the end, a two-executor step (``--cluster-batches 12``; 0 skips it): the
word count of tests/cluster_child.py on ``local-cluster[2,1,1024]``, rows and arrow modes, with and without affinity,
counting the task-batches that ran on another executor than their previous batch.

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

Next to the bytes written per batch it reports the blob store requests per batch: the ``blob_store.requests``
counters of the batch's tasks (by operation; the checkpoint reads of the driver's confirmations are not in them).
A ``file://`` store sends no requests and counts none: ``--blob-store s3`` runs statebackend on moto's S3 server
(started by the test setup's code, tests/servers.py), where every request is counted and the bytes are the
``blob_store.bytes.sent`` of the tasks.

``--tws`` adds Spark's ``transformWithStateInPandas`` (a ``StatefulProcessor`` on the same RocksDB state store
provider with changelog checkpointing) to the count, its state checked equal to statebackend's key by key, and then
runs a second workload through both: a sessionization whose sessions end by event-time timers, its closed sessions
checked equal (bench/spark_tws.py says how). transformWithStateInPandas calls Python per key and goes to the JVM for
every state access (about half a second per 1,000 keys a batch on 2 cores, a minute to load 100k keys): size the
run with ``--keys``, ``--batches`` and the ``--session-*`` flags. ``--figure`` draws the batch times per engine
(matplotlib: the ``bench`` extra). Any check that fails (statebackend's state, the two counts, the two sessions'
outputs) prints FAIL, and the bench exits 1.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any, Self

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from bench.common import count_keys, load_text, summary
from statebackend.metrics import percentile
from statebackend.spark import StatefulForeachBatch, local_spark_session, read_state

NUM_TASKS = 4


def count_keys_per_key(stores: Any, batches: Any) -> None:
    """The same with the per-key API (``--per-key``)."""
    import pyarrow as pa

    received = list(batches)
    if not received:
        return
    grouped = pa.Table.from_batches(received).group_by("key").aggregate([("key", "count")])
    counts = stores["counts"]
    for key, n in zip(grouped.column("key").to_pylist(), grouped.column("key_count").to_pylist(), strict=True):
        counts.put(key, (counts.get(key) or 0) + n)
    return


def aggregate_only(batches: Any) -> Any:
    """The floor's task: the same Arrow aggregation as ``count_keys``, and no state."""
    import pyarrow as pa

    received = list(batches)
    if received:
        pa.Table.from_batches(received).group_by("key").aggregate([("key", "count")])
    return iter(())


def no_state_batch(batch_df: Any, batch_id: int) -> None:
    """The no-state floor: the same shuffle into 4 tasks and the same Python aggregation per task, one action."""
    batch_df.repartition(NUM_TASKS, "key").mapInArrow(aggregate_only, "key string").write.format("noop").mode(
        "overwrite"
    ).save()


class DirWatcher:
    """Every file that appears under a directory while it runs, with its largest size seen (polled every 100 ms in a
    thread of the driver, outside the batches): the bytes written, also of files deleted later by retention."""

    def __init__(self, root: Path) -> None:
        import threading

        self.root = root
        self.sizes: dict[str, int] = {}
        #: when each file was first seen (wall clock), to tell the load batch's bytes from the update batches'
        self.first_seen: dict[str, float] = {}
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def __enter__(self) -> Self:
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._thread.join()
        self.scan()

    def _run(self) -> None:
        while not self._stop.wait(0.1):
            self.scan()

    def scan(self) -> None:
        for path in self.root.rglob("*") if self.root.exists() else ():
            if "~tmp." in path.name or path.name.endswith(".partial"):
                continue  # a blob being written aside: counted once, under its name, after the rename
            try:
                if path.is_file():
                    key = str(path)
                    stat = path.stat()
                    self.sizes[key] = max(self.sizes.get(key, 0), stat.st_size)
                    self.first_seen.setdefault(key, min(time.time(), stat.st_mtime))
            except OSError:
                continue

    def total(self, after: float = 0.0) -> int:
        """Bytes of the files that appeared after ``after`` (unix time)."""
        return sum(size for key, size in self.sizes.items() if self.first_seen[key] > after)

    def by_kind(self, after: float = 0.0) -> dict[str, tuple[int, int]]:
        """(bytes, files) by kind of the files that appeared after ``after``."""
        kinds: dict[str, tuple[int, int]] = {}
        for key, size in self.sizes.items():
            if self.first_seen[key] > after:
                kind = statebackend_kind(key)
                total, files = kinds.get(kind, (0, 0))
                kinds[kind] = (total + size, files + 1)
        return kinds


#: (bytes, files) by kind of file
Kinds = dict[str, tuple[int, int]]


def statebackend_kind(path: str) -> str:
    for kind, part in (("delta", "/delta/"), ("snapshot", "/snapshot/"), ("checkpoint", "/checkpoints/")):
        if part in path:
            return kind
    return "other"


def spark_kind(path: str) -> str:
    name = path.rsplit("/", 1)[-1]
    for kind, ends in (("changelog", ".changelog"), ("snapshot", ".zip"), ("sst", ".sst"), ("crc", ".crc")):
        if name.endswith(ends):
            return kind
    return "other"


def dir_bytes_by_kind(root: Path, after: float = 0.0) -> dict[str, tuple[int, int]]:
    """(bytes, files) by kind of the files under ``root`` last modified after ``after``."""
    kinds: dict[str, tuple[int, int]] = {}
    for path in root.rglob("*") if root.exists() else ():
        if path.is_file() and path.stat().st_mtime > after:
            kind = spark_kind(str(path))
            total, files = kinds.get(kind, (0, 0))
            kinds[kind] = (total + path.stat().st_size, files + 1)
    return kinds


def kinds_text(kinds: dict[str, tuple[int, int]], batches: int) -> str:
    return ", ".join(
        f"{kind} {total / batches / 1e3:.1f} KB ({files} files)"
        for kind, (total, files) in sorted(kinds.items(), key=lambda item: -item[1][0])
    )


def dir_bytes(root: Path, after: float = 0.0) -> int:
    """Bytes of the files under ``root`` last modified after ``after`` (Spark writes each state file once)."""
    if not root.exists():
        return 0
    return sum(p.stat().st_size for p in root.rglob("*") if p.is_file() and p.stat().st_mtime > after)


def load_end(query: Any) -> float:
    """Unix time at which the query's first batch with input (the load) ended."""
    from datetime import datetime

    for progress in query.recentProgress:
        if progress["numInputRows"] > 0:
            started = datetime.fromisoformat(progress["timestamp"]).timestamp()
            return started + progress["durationMs"]["triggerExecution"] / 1000.0
    return 0.0


def write_input(directory: Path, keys: int, updates: int, batches: int, seed: int = 11, first: int = 0) -> int:
    """Parquet files batch-0000 (every key) .. batch-N (``updates`` distinct random keys each); returns total rows.
    ``first`` > 0 appends update batches ``first .. first + batches - 1`` to an existing input."""
    import numpy as np
    import pyarrow as pa
    import pyarrow.parquet as pq

    directory.mkdir(parents=True, exist_ok=first > 0)
    rng = np.random.default_rng(seed + first)
    total = 0
    now = time.time() - 10 * (batches + 1)
    for batch in range(first, first + batches + (1 if first == 0 else 0)):
        ids = np.arange(keys) if batch == 0 else rng.choice(keys, size=min(updates, keys), replace=False)
        column = pa.array([f"k{i:08d}" for i in ids.tolist()], pa.string())
        path = directory / f"batch-{batch:04d}.parquet"
        pq.write_table(pa.table({"key": column}), path)
        stamp = now + 10 * (batch - first)
        os.utime(path, (stamp, stamp))  # the file source orders files by modification time
        total += len(column)
    return total


def run_spark_state_store(spark: Any, source: Path, work: Path) -> list[dict[str, Any]]:
    stream = spark.readStream.schema("key string").option("maxFilesPerTrigger", 1).parquet(str(source))
    query = (
        stream.groupBy("key")
        .count()
        .writeStream.outputMode("update")
        .format("noop")
        .option("checkpointLocation", str(work / "spark-rocksdb-checkpoint"))
        .trigger(availableNow=True)
        .start()
    )
    query.awaitTermination()
    if query.exception() is not None:
        raise RuntimeError(f"Spark's stateful query failed: {query.exception()}")
    rows = []
    loaded = load_end(query)
    for progress in query.recentProgress:
        if progress["numInputRows"] == 0:
            continue
        operator = progress["stateOperators"][0]
        rows.append(
            {
                "batch": progress["batchId"],
                "duration_ms": progress["durationMs"]["triggerExecution"],
                "commit_ms": operator["commitTimeMs"],
                "state_rows": operator["numRowsTotal"],
                "updated_rows": operator["numRowsUpdated"],
                "load_end": loaded,
            }
        )
    return rows


def run_floor(spark: Any, source: Path, work: Path) -> list[dict[str, Any]]:
    stream = spark.readStream.schema("key string").option("maxFilesPerTrigger", 1).parquet(str(source))
    query = (
        stream.writeStream.foreachBatch(no_state_batch)
        .option("checkpointLocation", str(work / "floor-checkpoint"))
        .trigger(availableNow=True)
        .start()
    )
    query.awaitTermination()
    if query.exception() is not None:
        raise RuntimeError(f"the no-state query failed: {query.exception()}")
    return [
        {"batch": p["batchId"], "duration_ms": p["durationMs"]["triggerExecution"]}
        for p in query.recentProgress
        if p["numInputRows"] > 0
    ]


def run_statebackend(
    spark: Any,
    source: Path,
    work: Path,
    fn: Any = count_keys,
    keep_open: bool = True,
    backend: str = "changelog",
    options: dict[str, str] | None = None,
    num_tasks: int = NUM_TASKS,
    confirm_on_driver: bool | None = None,
    dump_stats: Path | None = None,
    blob_store: dict[str, object] | None = None,
) -> tuple[list[dict[str, Any]], dict[str, object], tuple[int, int, Kinds]]:
    """``blob_store``: the ``blob.store.*`` keys of a remote store (default: ``file://`` under ``work``, whose
    bytes a watcher of its directory counts; a remote store's bytes are the tasks' ``blob_store.bytes.sent``)."""
    config: dict[str, object] = {
        "job.name": "bench",
        "state.local.dir": str(work / "sb-local"),
        **(blob_store or {"blob.store.url": f"file://{work / 'sb-blobs'}"}),
        "blob.store.create.if.missing": "true",
        "stores.counts.backup.factories": backend,
        "stores.counts.key.serde": "string",
        "stores.counts.msg.serde": "integer",
        **(options or {}),
    }
    job = StatefulForeachBatch(
        fn,
        key_columns=["key"],
        num_tasks=num_tasks,
        config=config,
        output_schema="key string",
        mode="arrow",
        sink=lambda frame, batch_id: None,
        keep_open=keep_open,
        confirm_on_driver=confirm_on_driver,
    )
    stream = spark.readStream.schema("key string").option("maxFilesPerTrigger", 1).parquet(str(source))
    with DirWatcher(work / "sb-blobs") as blobs:
        query = (
            stream.writeStream.foreachBatch(job)
            .option("checkpointLocation", str(work / "sb-spark-checkpoint"))
            .trigger(availableNow=True)
            .start()
        )
        query.awaitTermination()
        time.sleep(3)  # a background snapshot started by the last batches is written in this time
    if query.exception() is not None:
        raise RuntimeError(f"the statebackend query failed: {query.exception()}")
    rows = []
    durable = durable_commit_ms(job.history)
    for progress in query.recentProgress:
        if progress["numInputRows"] == 0:
            continue
        stats = [s for s in job.history if s.batch_id == progress["batchId"]]
        commits = durable.get(progress["batchId"]) or [s.commit_ms for s in stats]
        rows.append(
            {
                "batch": progress["batchId"],
                "duration_ms": progress["durationMs"]["triggerExecution"],
                "commit_max_ms": max(commits),
                # a deferred commit of a task handed over to another worker reports nowhere: the mean of the known ones
                # times the tasks stands for the sum then
                "commit_sum_ms": sum(commits) / len(commits) * len(stats),
                "sync_max_ms": max(s.commit_sync_ms for s in stats),
                "open_max_ms": max(s.open_ms for s in stats),
                "kept_open": sum(s.kept_open for s in stats),
                "requests": batch_requests(job.history, progress["batchId"]),
                "bytes_sent": batch_counter(job.history, progress["batchId"], "blob_store.bytes.sent"),
            }
        )
    if dump_stats is not None:
        write_task_stats(dump_stats, job.history)
    loaded = load_end(query)
    if blob_store is not None:  # no directory to watch: the bytes the tasks sent, the load batch's apart
        sent = [row["bytes_sent"] for row in rows]
        return rows, config, (int(sum(sent)), int(sum(sent[1:])), {"sent": (int(sum(sent[1:])), 0)})
    return rows, config, (blobs.total(), blobs.total(after=loaded), blobs.by_kind(after=loaded))


def final_attempts(history: list[Any], batch_id: int) -> list[Any]:
    """The attempt of each task of ``batch_id`` whose output counted (the last one reported)."""
    final = {s.task_index: s for s in history if s.batch_id == batch_id}
    return list(final.values())


def batch_counter(history: list[Any], batch_id: int, name: str) -> float:
    """The counter ``name`` summed over the batch's tasks (what each attempt counted since its previous report)."""
    return sum(s.metrics.counter(name) for s in final_attempts(history, batch_id) if s.metrics is not None)


def batch_requests(history: list[Any], batch_id: int) -> dict[str, float]:
    """The blob store requests of the batch's tasks, by operation (``blob_store.requests``, outcomes summed)."""
    counts: dict[str, float] = {}
    for stats in final_attempts(history, batch_id):
        if stats.metrics is None:
            continue
        for (name, labels), value in stats.metrics.counters.items():
            if name == "blob_store.requests":
                operation = dict(labels).get("operation", "?")
                counts[operation] = counts.get(operation, 0.0) + value
    return counts


def requests_text(rows: list[dict[str, Any]], tasks: int) -> str:
    """Requests per batch over ``rows``, by operation, and per task's commit."""
    total: dict[str, float] = {}
    for row in rows:
        for operation, count in row["requests"].items():
            total[operation] = total.get(operation, 0.0) + count
    per_batch = sum(total.values()) / max(1, len(rows))
    detail = ", ".join(f"{op} {count / max(1, len(rows)):.2f}" for op, count in sorted(total.items()))
    return f"{per_batch:.2f} ({detail}); {per_batch / tasks:.2f} per task's commit"


def _series(key: Any) -> str:
    """A metric series key (name, labels) as one string."""
    name, labels = key if isinstance(key, tuple) and len(key) == 2 else (key, ())
    extra = ",".join(f"{k}={v}" for k, v in labels if k not in ("job_name", "task")) if labels else ""
    return f"{name}{{{extra}}}" if extra else str(name)


def write_task_stats(path: Path, history: list[Any]) -> None:
    """Every task attempt's stats as JSON lines (times, where it ran, whether it was kept open, its counters and the
    sums and maxima of its histograms): to see what a slow batch's tasks did."""
    path.parent.mkdir(parents=True, exist_ok=True)
    with path.open("w") as out:
        for s in history:
            metrics = s.metrics
            record = {
                "batch": s.batch_id,
                "task": s.task_index,
                "attempt": s.attempt,
                "open_ms": round(s.open_ms, 2),
                "process_ms": round(s.process_ms, 2),
                "commit_ms": round(s.commit_ms, 2),
                "sync_ms": round(s.commit_sync_ms, 2),
                "kept_open": s.kept_open,
                "private_dir": s.private_dir,
                "executor": s.executor,
                "pending": bool(s.pending_checkpoint_id),
                "counters": {} if metrics is None else {_series(k): v for k, v in metrics.counters.items()},
                "histograms": {}
                if metrics is None
                else {
                    _series(k): {"count": h.count, "sum": round(h.sum, 2), "max": round(h.max, 2)}
                    for k, h in metrics.histograms.items()
                    if h.count
                },
            }
            out.write(json.dumps(record, default=str) + "\n")


def durable_commit_ms(history: list[Any]) -> dict[int, list[float]]:
    """Per batch, each task's durable commit time: from the start of its commit until its checkpoint was durable.
    A task that waited for its checkpoint measured it itself (``commit_ms``); one that handed its output on first
    (``pending_checkpoint_id``: the driver confirmed it) recorded it in its ``commit.total.ms`` histogram when the
    upload ended, which reaches the driver with that task's metrics of the next batch (minus that batch's own
    commit, when that one was waited for). The last batch's deferred commits have no next batch: left out."""
    final = {(s.batch_id, s.task_index): s for s in history}  # the attempt whose output counted comes last
    out: dict[int, list[float]] = {}
    for (batch, task), stats in sorted(final.items()):
        if not stats.pending_checkpoint_id:
            out.setdefault(batch, []).append(stats.commit_ms)
            continue
        following = final.get((batch + 1, task))
        histogram = following.metrics.histogram("commit.total.ms") if following and following.metrics else None
        if histogram is None:
            continue
        own = 0 if following.pending_checkpoint_id else 1
        if histogram.count - own >= 1:
            own_ms = following.commit_ms if own else 0.0
            out.setdefault(batch, []).append((histogram.sum - own_ms) / (histogram.count - own))
    return out


def rescale_step(spark: Any, work: Path, args: Any, updates: int, total_rows: int, fn: Any) -> bool:
    """Three more update batches with ``num_tasks=args.rescale_to`` on the same state and Spark checkpoint: the first
    is rescaled (each new task takes its key groups from the old tasks' checkpoints). Prints their times; checks."""
    more = 3
    total_rows += write_input(work / "input", args.keys, updates, more, first=args.batches + 1)
    rows, config, _ = run_statebackend(
        spark,
        work / "input",
        work,
        fn,
        keep_open=not args.close_every_batch,
        backend=args.backend,
        options=dict(option.split("=", 1) for option in args.option),
        num_tasks=args.rescale_to,
    )
    print(f"### Rescale: {NUM_TASKS} -> {args.rescale_to} tasks ({more} more update batches)\n")
    print(
        "| batch | statebackend batch ms | open ms (max; the rescaled batch: restore of the key groups) | "
        "durable commit ms (max) |"
    )
    print("|---:|---:|---:|---:|")
    for row in rows:
        print(f"| {row['batch']} | {row['duration_ms']} | {row['open_max_ms']:.0f} | {row['commit_max_ms']:.0f} |")
    state = read_state(spark, config, "counts", num_tasks=args.rescale_to).selectExpr("count(*)", "sum(value)")
    keys, counted = state.first()
    ok = keys == args.keys and counted == total_rows and len(rows) == more
    print(
        f"\nstatebackend state check after the rescale: {keys} keys in {args.rescale_to} tasks, counts sum to "
        f"{counted} of {total_rows} input rows: {'OK' if ok else 'FAIL'}\n",
        flush=True,
    )
    return ok


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--keys", type=int, default=1_000_000, help="keys of state (default 1M)")
    parser.add_argument(
        "--updates",
        type=int,
        nargs="+",
        default=[10_000, 50_000],
        help="distinct keys updated per batch; one run per value (default 10000 50000)",
    )
    parser.add_argument("--batches", type=int, default=20, help="update batches after the load batch (default 20)")
    parser.add_argument("--work-dir", type=Path, default=None, help="default: a temp dir, deleted at the end")
    parser.add_argument("--per-key", action="store_true", help="statebackend's count with the per-key API")
    parser.add_argument(
        "--backend",
        choices=["changelog", "blobsnapshot"],
        default="changelog",
        help="statebackend's backend for the counts store (default changelog)",
    )
    parser.add_argument(
        "--option",
        action="append",
        default=[],
        metavar="KEY=VALUE",
        help="one more statebackend config key (repeatable), e.g. changelog.snapshot.interval.commits=50",
    )
    parser.add_argument(
        "--rescale-to",
        type=int,
        default=6,
        metavar="N",
        help="then run 3 more update batches with num_tasks=N on the same state (0: skip; default 6)",
    )
    parser.add_argument(
        "--cluster-batches",
        type=int,
        default=12,
        metavar="N",
        help="then a word count of N batches on local-cluster[2,1,1024] with and without affinity, "
        "counting the task-batches that moved executor (0: skip; default 12)",
    )
    parser.add_argument(
        "--confirm-on-driver",
        choices=["auto", "on", "off"],
        default="auto",
        help="StatefulForeachBatch(confirm_on_driver=...): None (auto: on for az:// and s3://, off for "
        "file://), True or False (default auto)",
    )
    parser.add_argument(
        "--close-every-batch",
        action="store_true",
        help="StatefulForeachBatch(keep_open=False): open and close every task every batch",
    )
    parser.add_argument(
        "--dump-stats",
        type=Path,
        default=None,
        metavar="DIR",
        help="write every statebackend task attempt's stats to DIR/task-stats-<updates>.jsonl",
    )
    parser.add_argument(
        "--blob-store",
        choices=["file", "s3"],
        default="file",
        help="statebackend's blob store: file:// (default; sends no requests, so counts none) or "
        "moto's S3 server started here (every request counted)",
    )
    parser.add_argument(
        "--tws",
        action="store_true",
        help="add transformWithStateInPandas to the count (state checked equal), then run the "
        "sessionization through statebackend and transformWithStateInPandas (output checked equal)",
    )
    parser.add_argument("--session-keys", type=int, default=10_000, help="sessionization: keys (default 10000)")
    parser.add_argument(
        "--session-events", type=int, default=10_000, help="sessionization: events per batch (default 10000)"
    )
    parser.add_argument(
        "--session-batches",
        type=int,
        default=10,
        help="sessionization: batches of events, each 60 s of event time (default 10)",
    )
    parser.add_argument("--session-gap", type=int, default=120, help="sessionization: gap in s (default 120)")
    parser.add_argument(
        "--session-delay", type=int, default=10, help="sessionization: watermark delay in s (default 10)"
    )
    parser.add_argument(
        "--figure",
        type=Path,
        default=None,
        metavar="PNG",
        help="draw the batch times per engine (the first --updates value) with matplotlib",
    )
    args = parser.parse_args(argv)

    work_root = args.work_dir or Path(tempfile.mkdtemp(prefix="statebackend-bench-spark-"))
    moto = None
    if args.blob_store == "s3":
        from tests.servers import start_moto

        (work_root / "moto").mkdir(parents=True, exist_ok=True)
        moto = start_moto(work_root / "moto")
        # before the session starts: its Python workers inherit the environment
        os.environ.setdefault("AWS_ACCESS_KEY_ID", "testing")
        os.environ.setdefault("AWS_SECRET_ACCESS_KEY", "testing")
        os.environ.setdefault("AWS_DEFAULT_REGION", "us-east-1")
    spark = local_spark_session(
        "statebackend-bench-spark",
        master="local[2]",
        conf={
            "spark.sql.shuffle.partitions": str(NUM_TASKS),
            "spark.sql.streaming.stateStore.providerClass": (
                "org.apache.spark.sql.execution.streaming.state.RocksDBStateStoreProvider"
            ),
            "spark.sql.streaming.stateStore.rocksdb.changelogCheckpointing.enabled": "true",
            "spark.driver.memory": "4g",
        },
    )
    spark.sparkContext.setLogLevel("ERROR")
    failed = False
    try:
        print(
            f"# Spark {spark.version}, local[2], {os.cpu_count()} CPUs, {args.keys} keys, {NUM_TASKS} partitions, "
            f"{args.batches} update batches; statebackend: {args.backend} backend"
            f"{', ' + ', '.join(args.option) if args.option else ''}; load average {load_text(os.getloadavg())}\n"
        )
        figure_count: dict[str, list[dict[str, Any]]] = {}
        for updates in args.updates:
            work = work_root / f"updates-{updates}"
            remote = (
                None
                if moto is None
                else {
                    "blob.store.url": f"s3://bench-{updates}-{os.getpid()}/state",
                    "blob.store.endpoint.url": moto.endpoint,
                }
            )
            if remote is not None:
                from statebackend.blobstores.base import open_blob_store

                with open_blob_store(str(remote["blob.store.url"]), {"endpoint.url": moto.endpoint}) as bucket:
                    bucket.create_resources()
            total_rows = write_input(work / "input", args.keys, updates, args.batches)
            spark_rows = run_spark_state_store(spark, work / "input", work)
            spark_state = work / "spark-rocksdb-checkpoint" / "state"
            spark_bytes = (dir_bytes(spark_state), dir_bytes(spark_state, after=spark_rows[0]["load_end"]))
            floor_rows = run_floor(spark, work / "input", work)
            sb_rows, config, sb_bytes = run_statebackend(
                spark,
                work / "input",
                work,
                count_keys_per_key if args.per_key else count_keys,
                keep_open=not args.close_every_batch,
                backend=args.backend,
                options=dict(option.split("=", 1) for option in args.option),
                confirm_on_driver={"auto": None, "on": True, "off": False}[args.confirm_on_driver],
                dump_stats=args.dump_stats / f"task-stats-{updates}.jsonl" if args.dump_stats else None,
                blob_store=remote,
            )
            state = read_state(spark, config, "counts", num_tasks=NUM_TASKS).selectExpr("count(*)", "sum(value)")
            keys, counted = state.first()
            ok = keys == args.keys and counted == total_rows
            failed |= not ok
            tws_rows: list[dict[str, Any]] = []
            if args.tws:
                from bench.spark_tws import check_counts, run_tws_count  # PySpark >= 4.0 (transformWithState)

                tws_rows = run_tws_count(spark, work / "input", work)
                tws_ok, tws_check = check_counts(spark, config, work, NUM_TASKS, args.keys)
                failed |= not tws_ok
            if not figure_count:
                figure_count = {
                    "no-state floor": floor_rows,
                    "Spark built-in (RocksDB)": spark_rows,
                    "statebackend": sb_rows,
                    **({"transformWithStateInPandas": tws_rows} if args.tws else {}),
                }
            print(f"## {updates} updated keys per batch\n")
            print(
                "| batch | no-state floor batch ms | Spark+RocksDB batch ms | Spark commitTimeMs (sum of 4) | "
                "statebackend batch ms | statebackend durable commit ms (max / sum of 4) | "
                "statebackend sync part ms (max) | open ms (max) | tasks kept open |"
                f"{' transformWithStateInPandas batch ms |' if args.tws else ''}"
            )
            print(f"|---:|---:|---:|---:|---:|---:|---:|---:|---:|{'---:|' if args.tws else ''}")
            by_batch = {row["batch"]: row for row in sb_rows}
            tws_by_batch = {row["batch"]: row["duration_ms"] for row in tws_rows}
            floor_by_batch = {row["batch"]: row for row in floor_rows}
            for row in spark_rows:
                sb = by_batch.get(row["batch"])
                fl = floor_by_batch.get(row["batch"])
                tws_cell = f" {tws_by_batch.get(row['batch'], '-')} |" if args.tws else ""
                sb_cells = (
                    (
                        f"{sb['duration_ms']} | {sb['commit_max_ms']:.0f} / {sb['commit_sum_ms']:.0f} | "
                        f"{sb['sync_max_ms']:.0f} | {sb['open_max_ms']:.0f} | {sb['kept_open']}"
                    )
                    if sb
                    else "- | - | - | - | -"
                )
                print(
                    f"| {row['batch']} | {fl['duration_ms'] if fl else '-'} | {row['duration_ms']} | "
                    f"{row['commit_ms']} | {sb_cells} |{tws_cell}"
                )
            steady_spark = [r for r in spark_rows if r["batch"] > 0]
            steady_sb = [r for r in sb_rows if r["batch"] > 0]
            steady_floor = [r for r in floor_rows if r["batch"] > 0]
            print("\np50 / p95 over the update batches (batch 0, the load, left out):\n")
            print("| | batch ms | commit ms |")
            print("|---|---:|---:|")
            print(
                f"| no-state floor (same shuffle and Arrow aggregation, no state) | "
                f"{summary([r['duration_ms'] for r in steady_floor])} | - |"
            )
            print(
                f"| Spark + RocksDB (changelog checkpointing) | {summary([r['duration_ms'] for r in steady_spark])} "
                f"| {summary([r['commit_ms'] for r in steady_spark])} (sum of 4 partitions) |"
            )
            print(
                f"| statebackend foreachBatch | {summary([r['duration_ms'] for r in steady_sb])} | "
                f"{summary([r['commit_max_ms'] for r in steady_sb])} (slowest task, durable); "
                f"{summary([r['commit_sum_ms'] for r in steady_sb])} (sum of 4); sync part "
                f"{summary([r['sync_max_ms'] for r in steady_sb])} (slowest task) |"
            )
            steady_tws = [r for r in tws_rows if r["batch"] > 0]
            if args.tws:
                print(
                    f"| transformWithStateInPandas (RocksDB, changelog checkpointing) | "
                    f"{summary([r['duration_ms'] for r in steady_tws])} | "
                    f"{summary([r['commit_ms'] for r in steady_tws])} (sum of 4 partitions) |"
                )
            med = statistics.median
            floor50 = med([r["duration_ms"] for r in steady_floor])
            spark50 = med([r["duration_ms"] for r in steady_spark])
            sb50 = med([r["duration_ms"] for r in steady_sb])
            spark_c50 = med([r["commit_ms"] for r in steady_spark])
            spark_c95 = percentile([r["commit_ms"] for r in steady_spark], 0.95)
            batches_run = len(spark_rows)
            print("\nRatios (p50 unless said):\n")
            print(
                f"- batch: statebackend / Spark {sb50 / spark50:.2f}x; statebackend / floor {sb50 / floor50:.2f}x; "
                f"Spark / floor {spark50 / floor50:.2f}x; above the floor: statebackend {sb50 - floor50:.0f} ms, "
                f"Spark {spark50 - floor50:.0f} ms ({(sb50 - floor50) / max(1.0, spark50 - floor50):.2f}x)"
            )
            if args.tws:
                tws50 = med([r["duration_ms"] for r in steady_tws])
                print(
                    f"- batch: statebackend / transformWithStateInPandas {sb50 / tws50:.3f}x (goal: at most 0.1x); "
                    f"transformWithStateInPandas' load (batch 0) {tws_rows[0]['duration_ms'] / 1000:.1f} s, "
                    f"statebackend's {sb_rows[0]['duration_ms'] / 1000:.1f} s; load average after it "
                    f"{load_text(os.getloadavg())}"
                )
                print(f"- transformWithStateInPandas state check against statebackend's: {tws_check}")
            for basis, column in (("slowest task", "commit_max_ms"), ("sum of 4 tasks", "commit_sum_ms")):
                values = [r[column] for r in steady_sb]
                print(
                    f"- durable commit ({basis}) / Spark commitTimeMs: p50 {med(values) / spark_c50:.2f}x, "
                    f"p95 {percentile(values, 0.95) / spark_c95:.2f}x"
                )
            updates_run = len(steady_spark)
            print(
                f"- bytes written per update batch (the load left out; snapshots included): statebackend "
                f"{sb_bytes[1] / updates_run / 1e6:.3f} MB (blob store: deltas, snapshots, checkpoints), Spark "
                f"{spark_bytes[1] / updates_run / 1e6:.3f} MB (state dir: changelogs, snapshots), "
                f"{sb_bytes[1] / max(1, spark_bytes[1]):.2f}x"
            )
            spark_kinds = dir_bytes_by_kind(spark_state, after=spark_rows[0]["load_end"])
            print(
                f"  - by kind, per update batch: statebackend {kinds_text(sb_bytes[2], updates_run)}; Spark "
                f"{kinds_text(spark_kinds, updates_run)}"
            )
            if remote is not None:
                print(
                    f"- blob store requests per update batch (statebackend's {NUM_TASKS} tasks, "
                    f"blob_store.requests): {requests_text(steady_sb, NUM_TASKS)}"
                )
            else:
                print(
                    "- blob store requests per update batch: not counted (file:// sends none); --blob-store s3 "
                    "counts them"
                )
            if "snapshot" not in sb_bytes[2] or not ({"snapshot", "sst"} & set(spark_kinds)):
                print(
                    "  - NOT AMORTIZED: a system wrote no snapshot in these batches (statebackend snapshots once "
                    "its deltas reach the last snapshot's size, Spark's maintenance every 60 s); run more batches "
                    "(--batches 60) for bytes with snapshots in them"
                )
            print(
                f"- bytes written per batch, all {batches_run} batches (the load included): statebackend "
                f"{sb_bytes[0] / batches_run / 1e6:.3f} MB, Spark {spark_bytes[0] / batches_run / 1e6:.3f} MB, "
                f"{sb_bytes[0] / max(1, spark_bytes[0]):.2f}x"
            )
            kept_share = sum(r["kept_open"] for r in steady_sb) / max(1, NUM_TASKS * len(steady_sb))
            print(f"- tasks kept open (taken back without open or restore): {kept_share:.0%} of update-batch tasks")
            print(
                f"\nstatebackend state check: {keys} keys, counts sum to {counted} of {total_rows} input rows: "
                f"{'OK' if ok else 'FAIL'}\n",
                flush=True,
            )
            if args.rescale_to:
                failed |= not rescale_step(
                    spark, work, args, updates, total_rows, count_keys_per_key if args.per_key else count_keys
                )
        figure_sessions: dict[str, list[dict[str, Any]]] = {}
        if args.tws:
            from bench.spark_tws import session_step

            sessions_ok, figure_sessions = session_step(spark, work_root / "sessions", args, NUM_TASKS)
            failed |= not sessions_ok
        if args.figure is not None:
            from bench.spark_tws import draw_figure

            draw_figure(
                args.figure,
                figure_count,
                figure_sessions,
                f"Spark {spark.version}, local[2], {os.cpu_count()} CPUs; count: {args.keys} keys, "
                f"{args.updates[0]} updated per batch; sessions: {args.session_keys} keys, "
                f"{args.session_events} events per batch",
            )
    finally:
        spark.stop()
        if moto is not None:
            moto.stop()
        if args.work_dir is None:
            shutil.rmtree(work_root, ignore_errors=True)
    if args.cluster_batches:
        failed |= not cluster_step(args.cluster_batches)
    if failed:
        print("# FAIL: a check above failed (the state or an output differs); see the FAIL lines", flush=True)
    return 1 if failed else 0


def cluster_step(batches: int, warm_up: int = 2) -> bool:
    """The word count of tests/cluster_child.py on ``local-cluster[2,1,1024]`` (two executors, a local state dir
    each), with affinity and without: how many task-batches after warm-up ran on another executor than the task's
    previous batch (each such move restores or catches up), the batch p50, and the state check."""
    from tests.test_spark_cluster import moves, run_cluster

    print(f"## Two executors (local-cluster[2,1,1024]), 4 tasks, {batches} batches, {warm_up} of warm-up\n")
    print(
        "| mode | affinity | task-batches moved | tasks taken back kept open | open ms p50 / max | batch ms p50 | "
        "state |"
    )
    print("|---|---|---:|---:|---:|---:|---|")
    ok = True
    for mode, affinity in (("rows", True), ("rows", False), ("arrow", True), ("arrow", False)):
        work = Path(tempfile.mkdtemp(prefix="statebackend-bench-cluster-"))
        try:
            result = run_cluster(work, batches, affinity, mode)
        finally:
            shutil.rmtree(work, ignore_errors=True)
        moved, counted = moves(result["attempts"], warm_up)
        steady = [a for a in result["attempts"] if a["batch"] >= warm_up]
        opens = [a["open_ms"] for a in steady]
        kept = sum(a["kept_open"] for a in steady)
        ok &= bool(result["state_ok"]) and bool(result["outputs_ok"])
        print(
            f"| {mode} | {'on' if affinity else 'off'} | {moved} of {counted} ({moved / max(1, counted):.0%}) | "
            f"{kept} of {len(steady)} | {statistics.median(opens):.1f} / {max(opens):.0f} | "
            f"{statistics.median(result['batch_ms'][warm_up:]):.0f} | "
            f"{'OK' if result['state_ok'] and result['outputs_ok'] else 'FAIL'} |"
        )
    print(flush=True)
    return ok


if __name__ == "__main__":
    sys.exit(main())
