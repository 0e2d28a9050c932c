"""Spark's ``transformWithStateInPandas`` beside statebackend, for bench/spark_e2e.py (``--tws``): the same per-key
logic through both, on the same input files, checked equal.

Two workloads:

- **The running count** of bench/spark_e2e.py: a ``StatefulProcessor`` keeps each key's count in a ``ValueState``
  (``handleInputRows`` adds the key's rows of the batch; no output), grouped by key into 4 partitions, on the RocksDB
  state store provider with changelog checkpointing (the session's conf). Its state is read back with Spark's state
  data source (``format("statestore")``, ``stateVarName="count"``) and compared key by key with statebackend's
  (``read_state``): same keys, same counts.
- **Sessionization by event-time timers**: events ``(key, ts)`` (``ts`` in ms), one Parquet file per micro-batch,
  each file ``BATCH_SPAN_MS`` of event time later than the one before. A key's session is a run of its events with no
  gap longer than ``--session-gap``; its timer is at ``end + gap + 1`` ms, the first moment no later event can join
  it. Both sides run :func:`advance` per key and batch (an event after the gap closes the session at once and
  deletes its timer; otherwise the timer moves to the new end), and emit ``(key, start, end, events)`` when the
  session's timer fires. The watermark is the largest event time of the batches before minus ``--session-delay`` on
  both: ``withWatermark`` on Spark's side (``timeMode="EventTime"``), ``event_time="ts"`` and ``watermark_delay`` on
  statebackend's (``on_timers``). No event is late (each file's events come after the previous file's watermark), so
  which path closes a session (an event or the timer) never changes the sessions. Two last files hold one event each
  of two sentinel keys far in the future: the second one's batch runs at a watermark past every real session's
  timer, so both sides close every real session in the same data batch (Spark may run one more batch without data
  for the sentinels; their sessions are left out). Both write the closed sessions to Parquet; the two sets must be
  equal (no session twice) and equal to a batch sessionization of the events.
"""

from __future__ import annotations

import os
import statistics
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from pyspark.sql.streaming.stateful_processor import StatefulProcessor, StatefulProcessorHandle

from bench.common import load_text, summary
from statebackend.spark import StatefulForeachBatch, read_state

#: event time covered by one input file of the sessionization (ms)
BATCH_SPAN_MS = 60_000
#: the sentinel keys of the last two files (sorted after every real key; left out of every comparison)
SENTINELS = ("~end-1", "~end-2")
SESSION_SCHEMA = "key string, start long, end long, events long"

#: a session: (start ms, end ms, events)
Session = tuple[int, int, int]


def advance(session: Session | None, times: list[int], gap_ms: int) -> tuple[list[Session], Session]:
    """One key's batch: its open session (or None) and the event times of its rows in the batch -> the sessions the
    events closed (an event more than ``gap_ms`` after the session's end) and the open session after them. The same
    function runs on both sides."""
    closed: list[Session] = []
    for ts in sorted(times):
        if session is not None and ts - session[1] > gap_ms:
            closed.append(session)
            session = None
        session = (ts, ts, 1) if session is None else (session[0], max(session[1], ts), session[2] + 1)
    assert session is not None, "advance needs at least one event"
    return closed, session


class CountProcessor(StatefulProcessor):
    """transformWithStateInPandas' side of the count: each key's count in a ValueState, no output."""

    def init(self, handle: StatefulProcessorHandle) -> None:
        self.count = handle.getValueState("count", "value long")

    def handleInputRows(self, key: Any, rows: Any, timerValues: Any) -> Iterator[Any]:
        added = sum(len(frame) for frame in rows)
        old = self.count.get()
        self.count.update(((old[0] if old is not None else 0) + added,))
        return iter(())

    def close(self) -> None:
        pass


class SessionProcessor(StatefulProcessor):
    """transformWithStateInPandas' side of the sessionization: the open session in a ValueState, its event-time
    timer at ``end + gap + 1``; :func:`advance` per key and batch; a fired timer emits the session and clears it."""

    def __init__(self, gap_ms: int) -> None:
        self.gap_ms = gap_ms

    def init(self, handle: StatefulProcessorHandle) -> None:
        self.handle = handle
        self.session = handle.getValueState("session", "start long, end long, events long")

    def handleInputRows(self, key: Any, rows: Any, timerValues: Any) -> Iterator[Any]:
        import pandas as pd

        times = [int(ts) for frame in rows for ts in frame["ts"].tolist()]
        stored = self.session.get()
        old = None if stored is None else (int(stored[0]), int(stored[1]), int(stored[2]))
        closed, session = advance(old, times, self.gap_ms)
        if old is None or session[1] != old[1]:
            if old is not None:
                self.handle.deleteTimer(old[1] + self.gap_ms + 1)
            self.handle.registerTimer(session[1] + self.gap_ms + 1)
        self.session.update(session)
        if closed:
            yield pd.DataFrame(
                {
                    "key": [key[0]] * len(closed),
                    "start": [s[0] for s in closed],
                    "end": [s[1] for s in closed],
                    "events": [s[2] for s in closed],
                }
            )

    def handleExpiredTimer(self, key: Any, timerValues: Any, expiredTimerInfo: Any) -> Iterator[Any]:
        import pandas as pd

        stored = self.session.get()
        if stored is not None:
            self.session.clear()
            yield pd.DataFrame(
                {"key": [key[0]], "start": [int(stored[0])], "end": [int(stored[1])], "events": [int(stored[2])]}
            )

    def close(self) -> None:
        pass


class SessionizeKeys:
    """statebackend's side of the sessionization (Arrow mode): the open session per key in the ``sessions`` store
    (json ``[start, end, events]``), its event-time timer at ``end + gap + 1``; :func:`advance` per key and batch,
    one ``get_many`` and one ``put_many`` per task and batch."""

    def __init__(self, gap_ms: int) -> None:
        self.gap_ms = gap_ms

    def __call__(self, stores: Any, batches: Any) -> Any:
        import pyarrow as pa

        from statebackend.spark import EVENT

        received = list(batches)
        if not received:
            return None
        table = pa.Table.from_batches(received)
        times: dict[str, list[int]] = {}
        for key, ts in zip(table.column("key").to_pylist(), table.column("ts").to_pylist(), strict=True):
            times.setdefault(key, []).append(ts)
        keys = sorted(times)
        store, timers = stores["sessions"], stores.timers
        out: list[tuple[str, int, int, int]] = []
        kept: list[list[int]] = []
        for key, stored in zip(keys, store.get_many(keys), strict=True):
            old = None if stored is None else (stored[0], stored[1], stored[2])
            closed, session = advance(old, times[key], self.gap_ms)
            out.extend((key, *s) for s in closed)
            if old is None or session[1] != old[1]:
                if old is not None:
                    timers.delete(key, old[1] + self.gap_ms + 1, kind=EVENT)
                timers.register(key, session[1] + self.gap_ms + 1, kind=EVENT)
            kept.append(list(session))
        store.put_many(keys, kept)
        return session_table(out)


def end_sessions(stores: Any, due: Any) -> Any:
    """statebackend's ``on_timers``: the watermark passed these sessions' ends plus the gap: emit and delete them."""
    store = stores["sessions"]
    keys = [timer.key for timer in due]
    out = [(key, s[0], s[1], s[2]) for key, s in zip(keys, store.get_many(keys), strict=True) if s is not None]
    store.delete_many(keys)
    return session_table(out)


def session_table(sessions: list[tuple[str, int, int, int]]) -> Any:
    """Closed sessions as an Arrow table of ``SESSION_SCHEMA``."""
    import pyarrow as pa

    return pa.table(
        {
            "key": pa.array([s[0] for s in sessions], pa.string()),
            **{
                name: pa.array([s[i] for s in sessions], pa.int64())
                for i, name in enumerate(("start", "end", "events"), 1)
            },
        }
    )


def run_tws_count(spark: Any, source: Path, work: Path) -> list[dict[str, Any]]:
    """The count through transformWithStateInPandas (update mode, ``noop`` sink): per batch with input, Spark's
    ``triggerExecution`` and the state operator's ``commitTimeMs``."""
    stream = spark.readStream.schema("key string").option("maxFilesPerTrigger", 1).parquet(str(source))
    counted = stream.groupBy("key").transformWithStateInPandas(
        statefulProcessor=CountProcessor(),
        outputStructType="key string, count long",
        outputMode="Update",
        timeMode="None",
    )
    query = (
        counted.writeStream.outputMode("update")
        .format("noop")
        .option("checkpointLocation", str(work / "tws-checkpoint"))
        .trigger(availableNow=True)
        .start()
    )
    query.awaitTermination()
    if query.exception() is not None:
        raise RuntimeError(f"the transformWithStateInPandas count failed: {query.exception()}")
    return progress_rows(query)


def check_counts(spark: Any, sb_config: dict[str, object], work: Path, num_tasks: int, keys: int) -> tuple[bool, str]:
    """statebackend's counts (``read_state``) against transformWithStateInPandas' (the state data source): the keys
    of either that the other lacks or counts differently."""
    from pyspark.sql import functions as F

    ours = read_state(spark, sb_config, "counts", num_tasks=num_tasks).select("key", F.col("value").alias("ours"))
    theirs = (
        spark.read.format("statestore")
        .option("path", str(work / "tws-checkpoint"))
        .option("stateVarName", "count")
        .load()
        .select(F.col("key.key").alias("key"), F.col("value.value").alias("theirs"))
    )
    joined = ours.join(theirs, "key", "full_outer")
    differ = joined.where(~F.col("ours").eqNullSafe(F.col("theirs")))
    n_ours, n_theirs, n_differ = ours.count(), theirs.count(), differ.count()
    ok = n_differ == 0 and n_ours == keys == n_theirs
    example = [tuple(row) for row in differ.limit(3).collect()] if n_differ else []
    return ok, (
        f"{n_ours} keys in statebackend, {n_theirs} in transformWithStateInPandas, {n_differ} keys differ"
        f"{' e.g. ' + str(example) if example else ''}: {'OK' if ok else 'FAIL'}"
    )


def write_session_input(
    directory: Path,
    keys: int,
    events: int,
    batches: int,
    seed: int = 17,
) -> list[tuple[str, int]]:
    """Parquet files session-0000 .. (``events`` events of ``keys`` random keys each, event times uniform in the
    file's ``BATCH_SPAN_MS``), then the two sentinel files; returns the real events ``(key, ts)``."""
    import numpy as np
    import pyarrow as pa
    import pyarrow.parquet as pq

    directory.mkdir(parents=True)
    rng = np.random.default_rng(seed)
    start = 1_700_000_000_000
    stamp = time.time() - 10 * (batches + 3)
    out: list[tuple[str, int]] = []
    far = start + (batches + 1000) * BATCH_SPAN_MS
    for batch in range(batches + 2):
        if batch < batches:
            ids = rng.integers(0, keys, size=events).tolist()
            offsets = rng.integers(0, BATCH_SPAN_MS, size=events).tolist()
            rows = [(f"u{i:07d}", start + batch * BATCH_SPAN_MS + o) for i, o in zip(ids, offsets, strict=True)]
            out.extend(rows)
        else:
            rows = [(SENTINELS[batch - batches], far + batch - batches)]
        path = directory / f"session-{batch:04d}.parquet"
        pq.write_table(
            pa.table(
                {"key": pa.array([r[0] for r in rows], pa.string()), "ts": pa.array([r[1] for r in rows], pa.int64())}
            ),
            path,
        )
        os.utime(path, (stamp + 10 * batch, stamp + 10 * batch))  # the file source orders files by modification time
    return out


def batch_sessions(events: list[tuple[str, int]], gap_ms: int) -> list[tuple[str, int, int, int]]:
    """Every session of ``events``, computed at once: what both streaming sides must have closed by the end."""
    times: dict[str, list[int]] = {}
    for key, ts in events:
        times.setdefault(key, []).append(ts)
    out: list[tuple[str, int, int, int]] = []
    for key, values in times.items():
        closed, last = advance(None, values, gap_ms)
        out.extend((key, *s) for s in [*closed, last])
    return sorted(out)


def run_sb_sessions(
    spark: Any,
    source: Path,
    work: Path,
    gap_ms: int,
    delay_ms: int,
    num_tasks: int,
) -> list[dict[str, Any]]:
    """The sessionization through StatefulForeachBatch (changelog backend, ``file://``), its sink appending each
    batch's closed sessions to Parquet under ``work/sb-sessions``."""
    config: dict[str, object] = {
        "job.name": "bench-sessions",
        "state.local.dir": str(work / "sb-local"),
        "blob.store.url": f"file://{work / 'sb-blobs'}",
        "blob.store.create.if.missing": "true",
        "stores.sessions.backup.factories": "changelog",
        "stores.sessions.key.serde": "string",
        "stores.sessions.msg.serde": "json",
    }
    target = str(work / "sb-sessions")
    sink_ms: dict[int, float] = {}

    def sink(frame: Any, batch_id: int) -> None:
        started = time.perf_counter()
        frame.write.mode("append").parquet(target)
        sink_ms[batch_id] = (time.perf_counter() - started) * 1000

    job = StatefulForeachBatch(
        SessionizeKeys(gap_ms),
        key_columns=["key"],
        num_tasks=num_tasks,
        config=config,
        output_schema=SESSION_SCHEMA,
        mode="arrow",
        sink=sink,
        on_timers=end_sessions,
        event_time="ts",
        watermark_delay=delay_ms,
    )
    stream = spark.readStream.schema("key string, ts long").option("maxFilesPerTrigger", 1).parquet(str(source))
    query = (
        stream.writeStream.foreachBatch(job)
        .option("checkpointLocation", str(work / "sb-spark-checkpoint"))
        .trigger(availableNow=True)
        .start()
    )
    query.awaitTermination()
    if query.exception() is not None:
        raise RuntimeError(f"the statebackend sessionization failed: {query.exception()}")
    rows = progress_rows(query)
    for row in rows:  # where the batch's time went: the slowest task's parts, the timers fired, the sink's write
        stats = list({s.task_index: s for s in job.history if s.batch_id == row["batch"]}.values())
        row.update(
            open_ms=max(s.open_ms for s in stats),
            process_ms=max(s.process_ms for s in stats),
            task_commit_ms=max(s.commit_ms for s in stats),
            fired=sum(s.timers_fired for s in stats),
            sink_ms=sink_ms.get(row["batch"], 0.0),
        )
    return rows


def run_tws_sessions(spark: Any, source: Path, work: Path, gap_ms: int, delay_ms: int) -> list[dict[str, Any]]:
    """The sessionization through transformWithStateInPandas (event time, ``withWatermark``, append mode), its
    output to Parquet under ``work/tws-sessions``."""
    from pyspark.sql import functions as F

    stream = (
        spark.readStream.schema("key string, ts long")
        .option("maxFilesPerTrigger", 1)
        .parquet(str(source))
        .withColumn("event_time", F.timestamp_millis("ts"))
        .withWatermark("event_time", f"{delay_ms} milliseconds")
    )
    sessions = stream.groupBy("key").transformWithStateInPandas(
        statefulProcessor=SessionProcessor(gap_ms),
        outputStructType=SESSION_SCHEMA,
        outputMode="Append",
        timeMode="EventTime",
    )
    query = (
        sessions.writeStream.outputMode("append")
        .format("parquet")
        .option("path", str(work / "tws-sessions"))
        .option("checkpointLocation", str(work / "tws-checkpoint"))
        .trigger(availableNow=True)
        .start()
    )
    query.awaitTermination()
    if query.exception() is not None:
        raise RuntimeError(f"the transformWithStateInPandas sessionization failed: {query.exception()}")
    return progress_rows(query)


def session_step(spark: Any, work: Path, args: Any, num_tasks: int) -> tuple[bool, dict[str, list[dict[str, Any]]]]:
    """The sessionization through both on the same files; prints the batch times and the check. Returns whether the
    check passed and the per-batch rows by engine (for the figure)."""
    gap_ms, delay_ms = args.session_gap * 1000, args.session_delay * 1000
    events = write_session_input(work / "input", args.session_keys, args.session_events, args.session_batches)
    load = os.getloadavg()
    sb_rows = run_sb_sessions(spark, work / "input", work, gap_ms, delay_ms, num_tasks)
    tws_rows = run_tws_sessions(spark, work / "input", work, gap_ms, delay_ms)
    load_after = os.getloadavg()
    ours = read_sessions(spark, work / "sb-sessions")
    theirs = read_sessions(spark, work / "tws-sessions")
    expected = batch_sessions(events, gap_ms)
    ok, check = compare_sessions(ours, theirs, expected)
    print(
        f"## Sessionization by event-time timers: {args.session_keys} keys, {args.session_events} events per "
        f"batch, {args.session_batches} batches of {BATCH_SPAN_MS // 1000} s of event time (+2 sentinel batches), "
        f"gap {args.session_gap} s, watermark delay {args.session_delay} s, {num_tasks} partitions\n"
    )
    print(f"load average before: {load_text(load)}; after: {load_text(load_after)}\n")
    print(
        "| batch | statebackend batch ms | of it: open / process / commit ms (slowest task) | timers fired | "
        "sink (Parquet write) ms | transformWithStateInPandas batch ms | its commitTimeMs (sum of 4) |"
    )
    print("|---:|---:|---:|---:|---:|---:|---:|")
    tws_by_batch = {row["batch"]: row for row in tws_rows}
    for row in sb_rows:
        tws = tws_by_batch.get(row["batch"])
        print(
            f"| {row['batch']} | {row['duration_ms']} | {row['open_ms']:.0f} / {row['process_ms']:.0f} / "
            f"{row['task_commit_ms']:.0f} | {row['fired']} | {row['sink_ms']:.0f} | "
            f"{tws['duration_ms'] if tws else '-'} | {tws['commit_ms'] if tws else '-'} |"
        )
    steady = session_steady(sb_rows, args.session_batches), session_steady(tws_rows, args.session_batches)
    print(
        f"\np50 / p95 over batches 1 .. {args.session_batches - 1} (the first batch and the sentinels' left out): "
        f"statebackend {summary(steady[0])} ms, transformWithStateInPandas {summary(steady[1])} ms; statebackend / "
        f"transformWithStateInPandas p50 {statistics.median(steady[0]) / statistics.median(steady[1]):.3f}x "
        f"(goal: at most 0.1x)"
    )
    print(
        f"- whole run: statebackend {sum(r['duration_ms'] for r in sb_rows) / 1000:.1f} s, "
        f"transformWithStateInPandas {sum(r['duration_ms'] for r in tws_rows) / 1000:.1f} s"
    )
    print(f"\nsessions check: {len(events)} events; {check}\n", flush=True)
    return ok, {"statebackend": sb_rows, "transformWithStateInPandas": tws_rows}


def compare_sessions(
    ours: list[tuple[str, int, int, int]],
    theirs: list[tuple[str, int, int, int]],
    expected: list[tuple[str, int, int, int]],
) -> tuple[bool, str]:
    """Whether both sides closed exactly the sessions of a batch sessionization (sorted lists: a session closed twice
    counts twice), and the check's line: OK, or FAIL with a few sessions that differ."""
    ok = ours == theirs == expected
    text = (
        f"{len(expected)} sessions in a batch sessionization; statebackend closed {len(ours)}, "
        f"transformWithStateInPandas {len(theirs)}; equal to each other: {ours == theirs}, to the batch "
        f"sessionization: {ours == expected and theirs == expected}: {'OK' if ok else 'FAIL'}"
    )
    if not ok:
        differ = sorted(set(ours) ^ set(theirs)) or sorted(set(ours) ^ set(expected))
        doubled = sorted({s for s in [*ours, *theirs] if ours.count(s) > 1 or theirs.count(s) > 1})
        text += f"\nFAIL: the sessions differ, e.g. {(differ or doubled)[:5]}"
    return ok, text


def read_sessions(spark: Any, directory: Path) -> list[tuple[str, int, int, int]]:
    """The closed sessions written under ``directory``, the sentinels' left out, sorted (duplicates kept)."""
    from pyspark.sql import functions as F

    if not directory.exists():
        return []
    frame = spark.read.parquet(str(directory)).where(~F.col("key").isin(*SENTINELS))
    return sorted((row.key, row.start, row.end, row.events) for row in frame.collect())


def session_steady(rows: list[dict[str, Any]], batches: int) -> list[float]:
    """Batch times of the real batches after the first (the sentinels' batches and any batch without input out)."""
    return [row["duration_ms"] for row in rows if 0 < row["batch"] < batches]


def progress_rows(query: Any) -> list[dict[str, Any]]:
    """Per batch with input: its id, Spark's ``triggerExecution`` and (for a stateful operator) ``commitTimeMs``."""
    rows = []
    for progress in query.recentProgress:
        if progress["numInputRows"] == 0:
            continue
        operators = progress["stateOperators"]
        rows.append(
            {
                "batch": progress["batchId"],
                "duration_ms": progress["durationMs"]["triggerExecution"],
                "commit_ms": operators[0]["commitTimeMs"] if operators else None,
            }
        )
    return rows


def draw_figure(
    path: Path, count: dict[str, list[dict[str, Any]]], sessions: dict[str, list[dict[str, Any]]], title: str
) -> None:
    """Batch time per batch and engine, log scale: the count (left; the load batch 0 included) and the
    sessionization (right). matplotlib comes with the ``bench`` extra."""
    from bench.figures import pyplot

    plt = pyplot()
    from matplotlib.ticker import FuncFormatter, LogLocator, MaxNLocator, NullFormatter

    panels = [("running count", count), ("sessionization (event-time timers)", sessions)]
    panels = [(name, series) for name, series in panels if series]
    figure, axes = plt.subplots(1, len(panels), figsize=(6.5 * len(panels), 4.5), squeeze=False)
    styles = {
        "statebackend": "tab:blue",
        "Spark built-in (RocksDB)": "tab:green",
        "transformWithStateInPandas": "tab:red",
        "no-state floor": "tab:gray",
    }
    for axis, (name, series) in zip(axes[0], panels, strict=True):
        for engine, rows in series.items():
            axis.plot(
                [r["batch"] for r in rows],
                [r["duration_ms"] / 1000 for r in rows],
                marker="o",
                markersize=3,
                label=engine,
                color=styles.get(engine),
            )
        axis.set_yscale("log")
        axis.yaxis.set_major_locator(LogLocator(subs=(1.0, 2.0, 5.0)))
        axis.yaxis.set_major_formatter(FuncFormatter(lambda value, _: f"{value:g}"))
        axis.yaxis.set_minor_formatter(NullFormatter())
        axis.xaxis.set_major_locator(MaxNLocator(integer=True))
        axis.set_xlabel("batch")
        axis.set_ylabel("batch time (s, log scale)")
        axis.set_title(name)
        axis.grid(True, which="both", alpha=0.3)
        axis.legend(fontsize="small")
    figure.suptitle(title, fontsize="medium")
    figure.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    figure.savefig(path, dpi=110)
    plt.close(figure)
