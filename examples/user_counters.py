"""A map of counters per user, kept in a map store (``stores.counters.kind=map``), checked against plain Python.

Run::

    python examples/user_counters.py                  # 4 batches of 400 events, 2 tasks, local[2]
    python examples/user_counters.py --batches 8 --events-per-batch 2000 --tasks 3 --state-dir ./counters-state

What it does:

1. Makes a few batches of events ``(user, action)`` (deterministic, so the check below can recompute them).
2. Runs :class:`statebackend.spark.StatefulForeachBatch` over each batch, as ``writeStream.foreachBatch(job)`` would:
   each task counts a user's events per action in the user's map (``get(user, action)``, ``put(user, action, n)``:
   one entry read and written, whatever the map's size) and outputs the user's most frequent action so far, from
   ``items(user)`` (the entries in sub-key order).
3. Reads the maps back from the blob store alone (:func:`statebackend.spark.read_state`: a map store's value is a map
   column) and compares every user's counters with a plain-Python count. Prints OK or FAIL; exits 1 on FAIL.

Without ``--state-dir`` everything goes into a new temp dir, removed at the end.
"""

from __future__ import annotations

import argparse
import shutil
import sys
import tempfile
from collections import Counter
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))  # run from a clone without installing

from statebackend.spark import StatefulForeachBatch, local_spark_session, read_state

ACTIONS = ("view", "click", "cart", "buy", "search", "share")


def count_actions(stores: Any, rows: Any) -> list[tuple[str, str, int]]:
    """One task's batch: each event adds one to its user's counter of its action."""
    counters = stores["counters"]
    users = set()
    for row in rows:
        counters.put(row.user, row.action, (counters.get(row.user, row.action) or 0) + 1)
        users.add(row.user)
    top = []
    for user in sorted(users):
        action, count = max(counters.items(user), key=lambda item: item[1])  # ties: the first in sub-key order
        top.append((user, action, count))
    return top


def batch_events(batch_id: int, count: int, users: int) -> list[tuple[str, str]]:
    """The events of batch ``batch_id``: ``(user, action)``."""
    return [
        (f"u{(i * 11 + batch_id) % users:03d}", ACTIONS[(batch_id * count + i) * 13 // 5 % len(ACTIONS)])
        for i in range(count)
    ]


def expected_counters(batches: int, count: int, users: int) -> dict[str, dict[str, int]]:
    seen: dict[str, Counter[str]] = {}
    for batch_id in range(batches):
        for user, action in batch_events(batch_id, count, users):
            seen.setdefault(user, Counter())[action] += 1
    return {user: dict(counts) for user, counts in seen.items()}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--batches", type=int, default=4)
    parser.add_argument("--events-per-batch", type=int, default=400)
    parser.add_argument("--users", type=int, default=40)
    parser.add_argument("--tasks", type=int, default=2)
    parser.add_argument("--state-dir", type=Path, default=None)
    args = parser.parse_args()
    root = args.state_dir or Path(tempfile.mkdtemp(prefix="statebackend-user-counters-"))
    try:
        config = {
            "job.name": "user-counters",
            "state.local.dir": str(root / "state"),
            "blob.store.url": (root / "backups").as_uri(),
            "blob.store.create.if.missing": "true",
            "stores.counters.backup.factories": "changelog",
            "stores.counters.kind": "map",  # values under sub-keys per key: get, put, delete, items, range, clear
            "stores.counters.key.serde": "string",
            "stores.counters.subkey.serde": "string",
            "stores.counters.msg.serde": "integer",
        }
        spark = local_spark_session("user-counters")
        job = StatefulForeachBatch(
            count_actions,
            key_columns=["user"],
            num_tasks=args.tasks,
            config=config,
            output_schema="user string, action string, count long",
        )
        for batch_id in range(args.batches):
            frame = spark.createDataFrame(
                batch_events(batch_id, args.events_per_batch, args.users), "user string, action string"
            )
            top = job.run_batch(frame, batch_id).orderBy("user").first()
            print(f"batch {batch_id}: {top.user}'s most frequent action so far: {top.action} ({top['count']})")
        state = read_state(spark, config, "counters", num_tasks=args.tasks)  # task, key, value (a map column)
        got = {row.key: dict(row.value) for row in state.collect()}
        want = expected_counters(args.batches, args.events_per_batch, args.users)
        if got != want:
            wrong = sorted(user for user in set(got) | set(want) if got.get(user) != want.get(user))
            print(f"FAIL: {len(wrong)} users differ, e.g. {wrong[:3]}")
            return 1
        print(f"OK: the counters of all {len(got)} users equal the plain-Python count")
        return 0
    finally:
        if args.state_dir is None:
            shutil.rmtree(root, ignore_errors=True)


if __name__ == "__main__":
    sys.exit(main())
