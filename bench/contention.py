"""The commit's threads beside CPU-bound processing: the GIL switch interval (``task.thread.switch.interval.us``).

Run from the repository root::

    python -m bench.contention                     # 250k keys, 2,500 updates per commit, 30 rounds per interval
    python -m bench.contention --intervals-us 5000,500,200 --updates 12500

What it does: one task on a ``file://`` blob store (changelog backend, string keys, integer values, as the Spark
benchmark keeps them) is loaded with ``--keys`` keys. Each round updates ``--updates`` random keys with the
vectorized API, then, with one thread spinning in pure Python beside it (a task thread's CPU-bound processing, or
the next task of a Spark worker), times ``commit_durably`` (the durable commit: flush, delta upload, checkpoint write,
with their system calls) and, once the commit's batch is in LMDB (a parked task is handed over a batch later), a close
as a handover does it (``close(sync_local=False, handover=True)``: what a parked Spark task's watcher thread does
while the worker runs another task), then reopens the task. The interval
is set with ``sys.setswitchinterval`` before each round and the task is opened with
``task.thread.switch.interval.us=0`` (left alone), the settings taking turns round by round so that the machine's
noise falls on all of them alike. The same rounds without the spinning thread give the floor.

Nothing here is a test: the numbers depend on the machine and its load (recorded in the result file).
"""

from __future__ import annotations

if __package__ in (None, ""):  # run as a script: make the repository root importable
    import sys as _sys
    from pathlib import Path as _Path

    _sys.path.insert(0, str(_Path(__file__).resolve().parent.parent))

import argparse
import random
import shutil
import sys
import tempfile
import threading
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from bench.bytes import keys_of
from bench.common import format_table, machine_info, p50_p95, write_result
from statebackend.task import TaskStorage


def config(root: Path) -> dict[str, Any]:
    return {
        "job.name": "bench",
        "state.local.dir": str(root / "local"),
        "blob.store.url": (root / "blobs").as_uri(),
        "blob.store.create.if.missing": True,
        "stores.counts.backup.factories": "changelog",
        "stores.counts.key.serde": "string",
        "stores.counts.msg.serde": "integer",
        "changelog.snapshot.interval.ratio": 0,
        "changelog.snapshot.interval.commits": 100_000,
        "task.thread.switch.interval.us": 0,
    }


def spin(stop: threading.Event) -> None:
    """CPU-bound Python until ``stop``."""
    x = 0
    while not stop.is_set():
        for i in range(1000):
            x += i * i


def run(keys: int, updates: int, rounds: int, intervals_us: Sequence[int]) -> dict[str, Any]:
    root = Path(tempfile.mkdtemp(prefix="bench-contention-"))
    original = sys.getswitchinterval()
    settings = [(interval, busy) for busy in (True, False) for interval in intervals_us]
    samples: dict[tuple[int, bool], dict[str, list[float]]] = {s: {"commit": [], "close": []} for s in settings}
    try:
        cfg = config(root)
        with TaskStorage.open(cfg, "task-0") as task:
            task.store("counts").put_many(keys_of(range(keys)), [1] * keys)
            task.commit_durably({"batch": "0"})
        rng = random.Random(1)
        for round_no in range(rounds):
            for interval, busy in settings[round_no % len(settings) :] + settings[: round_no % len(settings)]:
                sys.setswitchinterval(interval / 1_000_000)
                task = TaskStorage.open(cfg, "task-0")
                store = task.store("counts")
                batch = keys_of(rng.sample(range(keys), updates))
                store.put_many(batch, [value + 1 for value in store.get_many(batch)])
                stop = threading.Event()
                spinner = threading.Thread(target=spin, args=(stop,))
                if busy:
                    spinner.start()
                started = time.perf_counter()
                task.commit_durably({"batch": f"{round_no}-{interval}-{busy}"})
                committed = time.perf_counter()
                for local in task.stores.values():  # a parked task is handed over a batch later: its apply is done
                    local.apply_pending()
                closing = time.perf_counter()
                task.close(sync_local=False, handover=True)
                closed = time.perf_counter()
                stop.set()
                if busy:
                    spinner.join()
                samples[(interval, busy)]["commit"].append((committed - started) * 1000.0)
                samples[(interval, busy)]["close"].append((closed - closing) * 1000.0)
    finally:
        sys.setswitchinterval(original)
        shutil.rmtree(root, ignore_errors=True)
    rows = []
    for (interval, busy), got in samples.items():
        commit_p50, commit_p95 = p50_p95(got["commit"])
        close_p50, close_p95 = p50_p95(got["close"])
        rows.append(
            {
                "interval_us": interval,
                "spinning_thread": busy,
                "durable_commit_p50_ms": commit_p50,
                "durable_commit_p95_ms": commit_p95,
                "handover_close_p50_ms": close_p50,
                "handover_close_p95_ms": close_p95,
            }
        )
    return {"keys": keys, "updates": updates, "rounds": rounds, "rows": rows}


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--keys", type=int, default=250_000, help="keys of the task's state")
    parser.add_argument("--updates", type=int, default=2_500, help="distinct keys updated per commit")
    parser.add_argument("--rounds", type=int, default=30, help="rounds per setting")
    parser.add_argument("--intervals-us", default="5000,500", help="switch intervals to compare, in microseconds")
    args = parser.parse_args(argv)
    intervals = [int(value) for value in args.intervals_us.split(",")]
    result = run(args.keys, args.updates, args.rounds, intervals)
    print(f"# {args.keys:,} keys, {args.updates:,} updates per commit, {args.rounds} rounds per setting\n")
    print(
        format_table(
            [
                "switch interval us",
                "thread spinning beside",
                "durable commit p50 ms",
                "p95",
                "handover close p50 ms",
                "p95",
            ],
            [
                [
                    r["interval_us"],
                    "yes" if r["spinning_thread"] else "no",
                    r["durable_commit_p50_ms"],
                    r["durable_commit_p95_ms"],
                    r["handover_close_p50_ms"],
                    r["handover_close_p95_ms"],
                ]
                for r in result["rows"]
            ],
        )
    )
    path = write_result("contention", {**result, "machine": machine_info()})
    print(f"\nresult: {path}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
