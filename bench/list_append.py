"""The cost of an append to a list store (``stores.<name>.kind=list``) by the list's length: flat, where a list kept
as one value (a JSON list read, changed and rewritten) grows with it.

Run from the repository root: ``python -m bench.list_append [--lengths 10,1000,100000] [--appends 2000]``. One task,
changelog backend on ``file://``, a string key, json elements. For each length a list of that many elements is built
and committed (so it lies in LMDB, not in the write batch), then each round times ``--appends`` appends to it (then
commits them, untimed): ``append`` alone, ``append`` then ``trim(keep_last=length)`` (a "last N" list kept at its
length), and the same list kept as one json value (``get``, ``append`` to the Python list, ``put``; fewer appends,
it is slow). Microseconds per append, the best of five rounds; the ratio is the longest list's over the shortest's.
"""

from __future__ import annotations

import argparse
import shutil
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from bench.common import format_table, machine_info, write_result
from statebackend.task import TaskStorage

ROUNDS = 5


def config(root: Path) -> dict[str, object]:
    return {
        "job.name": "bench-list",
        "state.local.dir": str(root / "local"),
        "blob.store.url": (root / "blobs").as_uri(),
        "blob.store.create.if.missing": "true",
        "stores.events.backup.factories": "changelog",
        "stores.events.kind": "list",
        "stores.events.key.serde": "string",
        "stores.events.msg.serde": "json",
        "stores.whole.backup.factories": "changelog",
        "stores.whole.key.serde": "string",
        "stores.whole.msg.serde": "json",
    }


def element(i: int) -> dict[str, Any]:
    return {"at": i, "action": "click"}


def best_us(task: TaskStorage, appends: int, step: Callable[[int], None]) -> float:
    """The best of ``ROUNDS`` rounds of ``appends`` calls of ``step``, in microseconds per call; a commit after each
    round (untimed) moves the appends out of the write batch."""
    times = []
    for round_no in range(ROUNDS):
        started = time.perf_counter()
        for i in range(appends):
            step(round_no * appends + i)
        times.append((time.perf_counter() - started) / appends * 1e6)
        task.commit_durably({"round": str(round_no)})
    return min(times)


def measure(task: TaskStorage, length: int, appends: int) -> dict[str, float]:
    events = task.list_store("events")
    whole = task.store("whole")
    key, last_n = f"len{length}", f"last{length}"
    for name in (key, last_n):
        for start in range(0, length, 10_000):
            events.extend(name, [element(i) for i in range(start, min(length, start + 10_000))])
    whole.put(key, [element(i) for i in range(length)])
    task.commit_durably({"built": str(length)})

    def append(i: int) -> None:
        events.append(key, element(i))

    def append_trim(i: int) -> None:
        events.append(last_n, element(i))
        events.trim(last_n, keep_last=length)

    def rewrite(i: int) -> None:
        values = whole.get(key)
        values.append(element(i))
        whole.put(key, values)

    result = {
        "append": best_us(task, appends, append),
        "append_trim": best_us(task, appends, append_trim),
        "json_rewrite": best_us(task, max(5, min(appends, 200_000 // max(length, 1))), rewrite),
    }
    assert events.len(last_n) == length
    assert events.len(key) == length + ROUNDS * appends
    return result


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--lengths", default="10,1000,100000")
    parser.add_argument("--appends", type=int, default=2000)
    args = parser.parse_args()
    lengths = [int(n) for n in args.lengths.split(",")]
    root = Path(tempfile.mkdtemp(prefix="bench-list-"))
    try:
        with TaskStorage.open(config(root), "task-0") as task:
            results = {length: measure(task, length, args.appends) for length in lengths}
    finally:
        shutil.rmtree(root, ignore_errors=True)
    short, long = results[lengths[0]], results[lengths[-1]]
    rows = [[f"{length:,}", r["append"], r["append_trim"], r["json_rewrite"]] for length, r in results.items()]
    rows.append(
        [
            f"ratio {lengths[-1]:,} / {lengths[0]:,}",
            f"{long['append'] / short['append']:.2f}",
            f"{long['append_trim'] / short['append_trim']:.2f}",
            f"{long['json_rewrite'] / short['json_rewrite']:.1f}",
        ]
    )
    print(format_table(["list length", "append (us)", "append + trim (us)", "one json value (us)"], rows))
    path = write_result(
        "list_append",
        {"lengths": lengths, "appends": args.appends, "rounds": ROUNDS, "results": results, "machine": machine_info()},
    )
    print(f"written to {path}")


if __name__ == "__main__":
    main()
