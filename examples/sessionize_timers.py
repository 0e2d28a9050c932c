"""Sessionization with a gap timeout where sessions end by event-time timers, also for users with no new event.

Run::

    python examples/sessionize_timers.py          # 6 files of click events, gap 30 s, 4 tasks, local[2]

Events ``(user, ts)`` (``ts`` in ms) arrive as JSON files, one file per micro-batch. A user's session is a run of
events with no gap longer than ``--gap`` seconds. Per task, statebackend keeps one store, ``sessions``: user -> the
open session ``{"start", "end", "events"}`` (json), and the task's timers.

Each event extends its user's session and moves the session's event-time timer to ``end + gap + 1 ms``: the first
moment no later event can join it. The watermark is the largest event time of the batches before, minus
``--delay``; once it passes a session's timer, ``on_timers`` emits the session and deletes it, in the same commit.
So a session ends when the stream's event time moves on, whether or not its user ever sends another event, with no
scan of the state and no clock store of our own (compare examples/sessionize.py). An event that comes after the gap
closes the user's session right away (and deletes its timer).

At the end the closed sessions plus the still-open ones (read back from the blob store with ``read_state``, their
timers too) are compared with a batch sessionization of all events; the script prints OK or FAIL and exits 1 on
FAIL.
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))  # run from a clone without installing

from examples.sessionize import batch_sessions, write_input
from statebackend.spark import EVENT, TIMERS_STORE, StatefulForeachBatch, local_spark_session, read_state

SESSION_SCHEMA = "user string, start long, end long, events long, closed_by string"


class Sessionize:
    """The per-task function: events extend sessions and move their timers (a class so the gap travels with it)."""

    def __init__(self, gap_ms: int) -> None:
        self.gap_ms = gap_ms

    def __call__(self, stores: Any, rows: Any) -> list[tuple[str, int, int, int, str]]:
        sessions, timers = stores["sessions"], stores.timers
        closed: list[tuple[str, int, int, int, str]] = []
        events = sorted(rows, key=lambda r: (r.ts, r.user))
        users = sorted({row.user for row in events})
        current: dict[str, dict[str, int] | None] = dict(zip(users, sessions.get_many(users), strict=True))
        for row in events:
            session = current[row.user]
            if session is not None:
                timers.delete(row.user, session["end"] + self.gap_ms + 1, kind=EVENT)
                if row.ts - session["end"] > self.gap_ms:  # its timer was not due yet: the event closes it
                    closed.append((row.user, session["start"], session["end"], session["events"], "event"))
                    session = None
            if session is None:
                session = {"start": row.ts, "end": row.ts, "events": 0}
            session["end"] = max(session["end"], row.ts)
            session["events"] += 1
            current[row.user] = session
            timers.register(row.user, session["end"] + self.gap_ms + 1, kind=EVENT)
        sessions.put_many(users, [current[user] for user in users])
        return closed


def end_sessions(stores: Any, due: Any) -> list[tuple[str, int, int, int, str]]:
    """``on_timers``: the watermark passed these sessions' ends plus the gap; no event can join them any more."""
    sessions = stores["sessions"]
    users = [timer.key for timer in due]
    closed = [
        (user, s["start"], s["end"], s["events"], "timer")
        for user, s in zip(users, sessions.get_many(users), strict=True)
        if s is not None
    ]
    sessions.delete_many(users)
    return closed


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--files", type=int, default=6, help="input files = micro-batches (default 6)")
    parser.add_argument("--events-per-file", type=int, default=2000)
    parser.add_argument("--users", type=int, default=500)
    parser.add_argument("--gap", type=int, default=30, help="session gap timeout in seconds (default 30)")
    parser.add_argument("--delay", type=int, default=5, help="watermark delay in seconds (default 5)")
    parser.add_argument("--tasks", type=int, default=4)
    parser.add_argument("--state-dir", type=Path, default=None, help="default: a new temp dir")
    args = parser.parse_args(argv)

    root = (args.state_dir or Path(tempfile.mkdtemp(prefix="statebackend-sessionize-timers-"))).resolve()
    run_dir = root / f"run-{time.strftime('%Y%m%d-%H%M%S')}"
    events = write_input(run_dir / "input", args.files, args.events_per_file, args.users, seconds_per_file=60)
    # the same events in ms: the event-time column is a long of ms since the epoch (a timestamp column works too)
    for path in sorted((run_dir / "input").iterdir()):
        lines = [json.loads(line) for line in path.read_text().splitlines()]
        path.write_text("".join(json.dumps({"user": e["user"], "ts": e["ts"] * 1000}) + "\n" for e in lines))
    gap_ms = args.gap * 1000
    config = {
        "job.name": "sessionize-timers",
        "state.local.dir": str(run_dir / "local"),
        "blob.store.url": f"file://{run_dir / 'blobs'}",
        "blob.store.create.if.missing": "true",
        "stores.sessions.backup.factories": "changelog",  # the timer store is backed up the same way
        "stores.sessions.key.serde": "string",
        "stores.sessions.msg.serde": "json",
    }
    closed: list[tuple[str, int, int, int, str]] = []

    def collect(output: Any, batch_id: int) -> None:
        rows = [tuple(row) for row in output.collect()]
        closed.extend(rows)
        by_timer = sum(1 for row in rows if row[4] == "timer")
        print(f"batch {batch_id}: {len(rows)} sessions closed, {by_timer} of them by their timer")

    spark = local_spark_session("statebackend-sessionize-timers", master="local[2]")
    spark.sparkContext.setLogLevel("ERROR")
    try:
        job = StatefulForeachBatch(
            Sessionize(gap_ms),
            key_columns=["user"],
            num_tasks=args.tasks,
            config=config,
            output_schema=SESSION_SCHEMA,
            sink=collect,
            on_timers=end_sessions,
            event_time="ts",
            watermark_delay=args.delay * 1000,
        )
        stream = (
            spark.readStream.schema("user string, ts long").option("maxFilesPerTrigger", 1).json(str(run_dir / "input"))
        )
        query = (
            stream.writeStream.foreachBatch(job)
            .option("checkpointLocation", str(run_dir / "spark-checkpoint"))
            .trigger(availableNow=True)
            .start()
        )
        query.awaitTermination()
        still_open = read_state(spark, config, "sessions", num_tasks=args.tasks).collect()
        pending = read_state(spark, config, TIMERS_STORE, num_tasks=args.tasks).collect()
    finally:
        spark.stop()

    open_sessions = {(row.key, *(json.loads(row.value)[f] for f in ("start", "end", "events"))) for row in still_open}
    to_seconds = {(user, start // 1000, end // 1000, count) for user, start, end, count in open_sessions}
    closed_seconds = [(user, start // 1000, end // 1000, count) for user, start, end, count, _ in closed]
    got = set(closed_seconds) | to_seconds
    expected = batch_sessions(events, args.gap)
    by_timer = sum(1 for row in closed if row[4] == "timer")
    timers_ok = sorted((row.key, row.at_ms) for row in pending) == sorted(
        (user, end + gap_ms + 1) for user, _, end, _ in open_sessions
    )
    print(
        f"{len(events)} events, {len(closed)} sessions closed ({by_timer} by their timer, before any later event "
        f"of their user), {len(open_sessions)} still open in state, each with its pending timer: {timers_ok}"
    )
    if len(closed_seconds) != len(set(closed_seconds)) or got != expected or not timers_ok or not by_timer:
        print(
            f"FAIL: {len(got ^ expected)} sessions differ from a batch sessionization, e.g. "
            f"{sorted(got ^ expected)[:3]}; timers of open sessions as expected: {timers_ok}"
        )
        return 1
    print(
        f"OK: all {len(expected)} sessions equal a batch sessionization (gap {args.gap} s, watermark delay "
        f"{args.delay} s)"
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
