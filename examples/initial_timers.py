"""Timers that start with the state: trials loaded from ``initial_state`` expire by event-time timers that
``on_initial_state`` registers, also for users who never send an event.

Run::

    python examples/initial_timers.py            # 200 users on trial, 4 tasks, local[2]

A store ``trials`` (user -> the trial's end, ms) starts from a DataFrame. The same load calls ``on_initial_state``
with each task's loaded users; it registers one event-time timer per user at the trial's end, with
``register_many``, in the load's checkpoint: the timers exist from the first batch on, exactly once. Then batches of
events ``(user, ts)`` arrive: a purchase converts the user's trial (its timer deleted, the trial too), and
``on_timers`` expires the trials whose end the watermark reached. ``drop_late=True`` drops events below the watermark
before the function sees them (a late purchase does not convert a trial that the watermark has already let expire).

At the end every user on trial must have been reported exactly once, converted or expired, as a plain Python pass over
the same events says; the script prints OK or FAIL and exits 1 on FAIL.
"""

from __future__ import annotations

import argparse
import random
import sys
import tempfile
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))  # run from a clone without installing

from statebackend.spark import EVENT, StatefulForeachBatch, local_spark_session

OUTPUT = "user string, outcome string, at_ms long"
DAY = 86_400_000


def start_timers(stores: Any, users: list[str]) -> None:
    """``on_initial_state``: each loaded user's trial ends by an event-time timer at its end."""
    ends = stores["trials"].get_many(users)
    stores.timers.register_many(users, ends, kind=EVENT)


def purchases(stores: Any, rows: Any) -> list[tuple[str, str, int]]:
    """Events ``(user, ts)``: a purchase converts an open trial (no late event gets here: ``drop_late``)."""
    trials, converted = stores["trials"], []
    for row in rows:
        end = trials.get(row.user)
        if end is not None:
            stores.timers.delete(row.user, end, kind=EVENT)
            trials.delete(row.user)
            converted.append((row.user, "converted", row.ts))
    return converted


def expire(stores: Any, timers: Any) -> list[tuple[str, str, int]]:
    """``on_timers``: the trials whose end the watermark reached."""
    stores["trials"].delete_many([t.key for t in timers])
    return [(t.key, "expired", t.at_ms) for t in timers]


def make_input(users: int, batches: int, seed: int) -> tuple[dict[str, int], list[list[tuple[str, int]]]]:
    """Trial ends (ms) per user, and per batch its events: purchases by some users well before their trial ends,
    then a clock user whose events move the watermark a day per batch."""
    rng = random.Random(seed)
    ends = {f"user{i:04d}": rng.randrange(1, batches) * DAY + rng.randrange(DAY) for i in range(users)}
    events: list[list[tuple[str, int]]] = [[] for _ in range(batches + 2)]
    for user, end in ends.items():
        if rng.random() < 0.4:
            day = rng.randrange(0, end // DAY)  # a batch whose watermark is a day or more below the end
            events[day].append((user, day * DAY))
    for day, batch in enumerate(events):
        batch.append(("clock", (day + 1) * DAY))  # no trial: moves event time on
    return ends, events


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--users", type=int, default=200)
    parser.add_argument("--batches", type=int, default=6)
    parser.add_argument("--tasks", type=int, default=4)
    parser.add_argument("--dir", default=None, help="where the state goes (default: a temporary directory)")
    args = parser.parse_args()
    root = Path(args.dir or tempfile.mkdtemp(prefix="statebackend-initial-timers-"))
    ends, events = make_input(args.users, args.batches, seed=7)
    config = {
        "job.name": "initial-timers",
        "state.local.dir": str(root / "local"),
        "blob.store.url": f"file://{root / 'blobs'}",
        "blob.store.create.if.missing": "true",
        "stores.trials.backup.factories": "changelog",
        "stores.trials.key.serde": "string",
        "stores.trials.msg.serde": "integer",
    }
    spark = local_spark_session("statebackend-initial-timers", master="local[2]")
    spark.sparkContext.setLogLevel("ERROR")
    reported: list[tuple[str, str, int]] = []
    try:
        job = StatefulForeachBatch(
            purchases,
            key_columns=["user"],
            num_tasks=args.tasks,
            config=config,
            output_schema=OUTPUT,
            on_timers=expire,
            initial_state={"trials": spark.createDataFrame(sorted(ends.items()), "user string, value long")},
            on_initial_state=start_timers,
            event_time="ts",
            drop_late=True,
        )
        late = ("user0000", 0)  # a purchase whose event time is below every watermark after the first batch
        for batch_id, batch in enumerate(events):
            rows = [*batch, late] if batch_id > 1 else batch
            output = job.run_batch(spark.createDataFrame(rows, "user string, ts long"), batch_id)
            reported += [tuple(row) for row in output.collect()]
    finally:
        spark.stop()

    buyers = {user for batch in events for user, _ in batch if user in ends}
    expected = {user: ("converted" if user in buyers else "expired") for user in ends}
    seen: set[str] = set()
    twice = []
    for user, _, _ in reported:
        if user in seen:
            twice.append(user)
        seen.add(user)
    got = {user: outcome for user, outcome, _ in reported}
    converted = sum(1 for outcome in got.values() if outcome == "converted")
    print(f"{len(ends)} trials: {converted} converted, {len(got) - converted} expired by their timer")
    if twice or got != expected:
        print(f"FAIL: reported twice {twice[:3]}; differing {sorted(set(got.items()) ^ set(expected.items()))[:3]}")
        return 1
    print("OK: every trial reported exactly once, as a plain pass over the events says")
    return 0


if __name__ == "__main__":
    sys.exit(main())
