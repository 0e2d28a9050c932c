"""The last 5 events per user, kept in a list store (``stores.events.kind=list``), checked against plain Python.

Run::

    python examples/last_events.py                    # 4 batches of 400 events, 2 tasks, local[2]
    python examples/last_events.py --batches 8 --events-per-batch 2000 --tasks 3 --state-dir ./last-events-state

What it does:

1. Makes a few batches of click events ``(user, at, action)`` (deterministic, so the check below can recompute them).
2. Runs :class:`statebackend.spark.StatefulForeachBatch` over each batch, as ``writeStream.foreachBatch(job)`` would:
   each task appends every event of a user to the user's list without reading the list (the cost of an append does
   not grow with the list), then trims it to the last 5, and outputs each user's newest action.
3. Reads the lists back from the blob store alone (:func:`statebackend.spark.read_state`: a list store's value is an
   array column, in append order) and compares every user's list with the last 5 events computed in plain Python.
   Prints OK or FAIL; exits 1 on FAIL.

Without ``--state-dir`` everything goes into a new temp dir, removed at the end.
"""

from __future__ import annotations

import argparse
import json
import shutil
import sys
import tempfile
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))  # run from a clone without installing

from statebackend.spark import StatefulForeachBatch, local_spark_session, read_state

KEEP = 5
ACTIONS = ("view", "click", "cart", "buy", "search")


def keep_last_events(stores: Any, rows: Any) -> list[tuple[str, str]]:
    """One task's batch: each event appended to its user's list, the list trimmed to the last ``KEEP``."""
    events = stores["events"]
    newest: dict[str, str] = {}
    for row in sorted(rows, key=lambda r: r.at):  # in event order, whatever order the rows came in
        events.append(row.user, {"at": row.at, "action": row.action})
        events.trim(row.user, keep_last=KEEP)
        newest[row.user] = row.action
    return sorted(newest.items())


def batch_events(batch_id: int, count: int, users: int) -> list[tuple[str, int, str]]:
    """The events of batch ``batch_id``: ``(user, at, action)``, ``at`` increasing across batches."""
    return [
        (
            f"u{(i * 7 + batch_id * 3) % users:03d}",
            batch_id * count + i,
            ACTIONS[(batch_id * count + i) * 31 // 7 % len(ACTIONS)],
        )
        for i in range(count)
    ]


def expected_lists(batches: int, count: int, users: int) -> dict[str, list[dict[str, Any]]]:
    """The last ``KEEP`` events per user, in plain Python."""
    seen: dict[str, list[dict[str, Any]]] = {}
    for batch_id in range(batches):
        for user, at, action in batch_events(batch_id, count, users):
            seen.setdefault(user, []).append({"at": at, "action": action})
    return {user: events[-KEEP:] for user, events in seen.items()}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--batches", type=int, default=4)
    parser.add_argument("--events-per-batch", type=int, default=400)
    parser.add_argument("--users", type=int, default=50)
    parser.add_argument("--tasks", type=int, default=2)
    parser.add_argument("--state-dir", type=Path, default=None)
    args = parser.parse_args()
    root = args.state_dir or Path(tempfile.mkdtemp(prefix="statebackend-last-events-"))
    try:
        config = {
            "job.name": "last-events",
            "state.local.dir": str(root / "state"),
            "blob.store.url": (root / "backups").as_uri(),
            "blob.store.create.if.missing": "true",
            "stores.events.backup.factories": "changelog",
            "stores.events.kind": "list",  # a list of values per key: append, extend, get, trim, len, clear
            "stores.events.key.serde": "string",
            "stores.events.msg.serde": "json",  # each element: {"at": ..., "action": ...}
        }
        spark = local_spark_session("last-events")
        job = StatefulForeachBatch(
            keep_last_events,
            key_columns=["user"],
            num_tasks=args.tasks,
            config=config,
            output_schema="user string, action string",
        )
        for batch_id in range(args.batches):
            frame = spark.createDataFrame(
                batch_events(batch_id, args.events_per_batch, args.users), "user string, at long, action string"
            )
            newest = job.run_batch(frame, batch_id).count()
            print(f"batch {batch_id}: {newest} users with new events")
        state = read_state(spark, config, "events", num_tasks=args.tasks)  # task, key, value: an array of json text
        got = {row.key: [json.loads(element) for element in row.value] for row in state.collect()}
        want = expected_lists(args.batches, args.events_per_batch, args.users)
        sample = sorted(got)[0]
        print(f"{len(got)} users; {sample}'s last {KEEP}: {[e['action'] for e in got[sample]]}")
        if got != want:
            wrong = sorted(user for user in set(got) | set(want) if got.get(user) != want.get(user))
            print(f"FAIL: {len(wrong)} users differ, e.g. {wrong[:3]}")
            return 1
        print(f"OK: the last {KEEP} events of all {len(got)} users equal the plain-Python computation")
        return 0
    finally:
        if args.state_dir is None:
            shutil.rmtree(root, ignore_errors=True)


if __name__ == "__main__":
    sys.exit(main())
