"""Sessionization with a gap timeout on PySpark Structured Streaming with statebackend; expired sessions leave state.

Run::

    python examples/sessionize.py                 # 6 files of click events, gap 30 s, 4 tasks, local[2]

Events ``(user, ts)`` arrive as JSON files (one file per micro-batch). A user's session is a run of events with no
gap longer than ``--gap`` seconds. Per task, statebackend keeps two stores:

- ``sessions``: user -> the open session ``{"start", "end", "events"}`` (json);
- ``expiry``: ``<end:012d>|<user>`` -> user, an index of open sessions by end time, so expiring is a range scan over
  the sessions that are due, never a scan of all state.

Each task's clock is the largest event time it has seen (kept in a third store, ``clock``). After each batch, every
session that ended more than ``gap`` before that clock is emitted as closed and deleted from both stores.

Event time only moves when events come: a task whose users all go quiet would keep their open sessions forever. So
``sessions`` and ``expiry`` also have a time to live in processing time (``stores.<name>.ttl.ms``, ``--idle-ttl``,
default 24h): a session nobody wrote for that long is invisible to reads and swept from state, without a line of
code here (such a session is dropped, not emitted). The demo's run lasts seconds, so its TTL never fires. At the end
the closed sessions plus the still-open ones (read back from the blob store) are compared with a batch
sessionization of all events; the script prints OK or FAIL and exits 1 on FAIL.
"""

from __future__ import annotations

import argparse
import json
import random
import sys
import tempfile
import time
from collections import defaultdict
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))  # run from a clone without installing

from statebackend.spark import StatefulForeachBatch, local_spark_session, read_state

SESSION_SCHEMA = "user string, start long, end long, events long"


class Sessionize:
    """The per-task function (a class so the gap travels to the executors with it)."""

    def __init__(self, gap: int) -> None:
        self.gap = gap

    def __call__(self, stores: Any, rows: Any) -> list[tuple[str, int, int, int]]:
        sessions, expiry, clock = stores["sessions"], stores["expiry"], stores["clock"]
        closed: list[tuple[str, int, int, int]] = []
        now = clock.get("now") or 0
        events = sorted(rows, key=lambda r: (r.ts, r.user))
        # Every user's session read in one call (the vectorized API), worked on in memory, written back in one call
        users = sorted({row.user for row in events})
        current: dict[str, dict[str, int] | None] = dict(zip(users, sessions.get_many(users), strict=True))
        expiry_changes: dict[str, str | None] = {}  # expiry key -> user, or None to delete it
        for row in events:
            now = max(now, row.ts)
            session = current[row.user]
            if session is not None and row.ts - session["end"] > self.gap:
                closed.append((row.user, session["start"], session["end"], session["events"]))
                expiry_changes[_expiry_key(session["end"], row.user)] = None
                session = None
            if session is None:
                session = {"start": row.ts, "end": row.ts, "events": 0}
            else:
                expiry_changes[_expiry_key(session["end"], row.user)] = None
            session["start"] = min(session["start"], row.ts)
            session["end"] = max(session["end"], row.ts)
            session["events"] += 1
            current[row.user] = session
            expiry_changes[_expiry_key(session["end"], row.user)] = row.user
        sessions.put_many(users, [current[user] for user in users])
        expiry.delete_many([key for key, user in expiry_changes.items() if user is None])
        expiry.put_many(
            [key for key, user in expiry_changes.items() if user is not None],
            [user for user in expiry_changes.values() if user is not None],
        )
        clock.put("now", now)
        # Every session whose end is more than gap before the clock can no longer grow (events arrive in time order
        # across batches): emit it and drop its state.
        due = list(expiry.iter_range(None, _expiry_key(now - self.gap, "")))
        due_users = [user for _, user in due]
        for user, session in zip(due_users, sessions.get_many(due_users), strict=True):
            if session is not None:  # None: the session outlived its TTL (idle too long) and is gone already
                closed.append((user, session["start"], session["end"], session["events"]))
        sessions.delete_many(due_users)
        expiry.delete_many([key for key, _ in due])
        return closed


def _expiry_key(end: int, user: str) -> str:
    return f"{max(end, 0):012d}|{user}"


def batch_sessions(events: list[tuple[str, int]], gap: int) -> set[tuple[str, int, int, int]]:
    """The reference: sessionize all events at once."""
    by_user: dict[str, list[int]] = defaultdict(list)
    for user, ts in events:
        by_user[user].append(ts)
    result = set()
    for user, times in by_user.items():
        times.sort()
        start = end = times[0]
        count = 0
        for ts in times:
            if ts - end > gap:
                result.add((user, start, end, count))
                start, count = ts, 0
            end = ts
            count += 1
        result.add((user, start, end, count))
    return result


def write_input(
    directory: Path, files: int, events_per_file: int, users: int, seconds_per_file: int, seed: int = 7
) -> list[tuple[str, int]]:
    """Files of events in time order; each user is active in bursts, so sessions open, grow and time out."""
    rng = random.Random(seed)
    events: list[tuple[str, int]] = []
    directory.mkdir(parents=True)
    for index in range(files):
        base = index * seconds_per_file
        chunk = sorted(
            (
                f"user{rng.randrange(users) if rng.random() < 0.7 else rng.randrange(users // 10 + 1)}",
                base + rng.randrange(seconds_per_file),
            )
            for _ in range(events_per_file)
        )
        events.extend(chunk)
        lines = "\n".join(json.dumps({"user": user, "ts": ts}) for user, ts in chunk)
        (directory / f"events-{index:04d}.json").write_text(lines + "\n")
    return events


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--files", type=int, default=6, help="input files = micro-batches (default 6)")
    parser.add_argument("--events-per-file", type=int, default=2000)
    parser.add_argument("--users", type=int, default=500)
    parser.add_argument("--gap", type=int, default=30, help="session gap timeout in seconds (default 30)")
    parser.add_argument("--tasks", type=int, default=4)
    parser.add_argument(
        "--idle-ttl",
        default="24h",
        help="processing-time TTL of open sessions nobody wrote (stores.<name>.ttl.ms; default 24h)",
    )
    parser.add_argument("--state-dir", type=Path, default=None, help="default: a new temp dir")
    args = parser.parse_args(argv)

    root = (args.state_dir or Path(tempfile.mkdtemp(prefix="statebackend-sessionize-"))).resolve()
    run_dir = root / f"run-{time.strftime('%Y%m%d-%H%M%S')}"
    events = write_input(run_dir / "input", args.files, args.events_per_file, args.users, seconds_per_file=60)
    config = {
        "job.name": "sessionize",
        "state.local.dir": str(run_dir / "local"),
        "blob.store.url": f"file://{run_dir / 'blobs'}",
        "blob.store.create.if.missing": "true",
        **{f"stores.{name}.backup.factories": "changelog" for name in ("sessions", "expiry", "clock")},
        **{f"stores.{name}.key.serde": "string" for name in ("sessions", "expiry", "clock")},
        "stores.sessions.msg.serde": "json",
        "stores.expiry.msg.serde": "string",
        "stores.clock.msg.serde": "integer",
        # abandoned sessions leave state by themselves (the expiry index entry with its session)
        "stores.sessions.ttl.ms": args.idle_ttl,
        "stores.expiry.ttl.ms": args.idle_ttl,
    }
    closed: list[tuple[str, int, int, int]] = []

    def collect(output: Any, batch_id: int) -> None:
        rows = [tuple(row) for row in output.collect()]
        closed.extend(rows)
        print(f"batch {batch_id}: {len(rows)} sessions closed")

    spark = local_spark_session("statebackend-sessionize", master="local[2]")
    spark.sparkContext.setLogLevel("ERROR")
    try:
        job = StatefulForeachBatch(
            Sessionize(args.gap),
            key_columns=["user"],
            num_tasks=args.tasks,
            config=config,
            output_schema=SESSION_SCHEMA,
            sink=collect,
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
    finally:
        spark.stop()

    open_sessions = {(row.key, *(json.loads(row.value)[f] for f in ("start", "end", "events"))) for row in still_open}
    got = set(closed) | open_sessions
    expected = batch_sessions(events, args.gap)
    print(
        f"{len(events)} events, {len(closed)} sessions closed and expired from state, {len(open_sessions)} "
        f"still open in state"
    )
    if len(closed) != len(set(closed)) or got != expected:
        print(
            f"FAIL: {len(got ^ expected)} sessions differ from a batch sessionization, e.g. "
            f"{sorted(got ^ expected)[:3]}"
        )
        return 1
    print(f"OK: all {len(expected)} sessions equal a batch sessionization (gap {args.gap} s)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
