"""Helpers of the backend contract suite that other tests reuse: the deterministic writes it commits, the model it
compares with, and what it counts (restores, calls on the task's thread)."""

from __future__ import annotations

import hashlib
import sys
from types import FrameType
from typing import Any

from statebackend.task import TaskStorage

__all__ = [
    "RESTORE_COUNTERS",
    "contents",
    "flood",
    "incompressible",
    "restore_counts",
    "task_thread_calls",
    "write_round",
]

#: the counters a restore manager increments, once per store it restores: reused whole, caught up, or restored full
RESTORE_COUNTERS = ("restore.stores.reused", "restore.stores.caught.up", "restore.stores.full")


def contents(task: TaskStorage, name: str = "counts") -> dict[bytes, bytes]:
    """Everything store ``name`` holds, as the task's code sees it."""
    return dict(task.store(name).items())


def write_round(
    task: TaskStorage, round_no: int, model: dict[bytes, bytes], keys: int = 50, *, store: str = "counts"
) -> None:
    """Deterministic puts and deletes over 200 keys, mirrored into ``model``."""
    target = task.store(store)
    for i in range(keys):
        key = f"k{(i * 7 + round_no * 13) % 200:04d}".encode()
        if (i + round_no) % 9 == 0:
            target.delete(key)
            model.pop(key, None)
        else:
            value = f"v{round_no}-{i}".encode()
            target.put(key, value)
            model[key] = value


def flood(
    task: TaskStorage,
    tag: str,
    model: dict[bytes, bytes],
    *,
    keys: int = 300,
    value_size: int = 64,
    store: str = "counts",
) -> None:
    """Put ``keys`` new keys with values of ``value_size`` bytes (enough to spill a small write batch), mirrored
    into ``model``."""
    target = task.store(store, typed=False)
    for i in range(keys):
        key = f"{tag}-{i:06d}".encode()
        value = incompressible(f"{tag}/{i}", value_size)
        target.put(key, value)
        model[key] = value


def incompressible(seed: object, size: int) -> bytes:
    """``size`` bytes that no compressor shrinks, the same for the same seed."""
    out = b""
    counter = 0
    while len(out) < size:
        out += hashlib.blake2b(f"{seed}/{counter}".encode(), digest_size=64).digest()
        counter += 1
    return out[:size]


def restore_counts(task: TaskStorage) -> dict[str, int]:
    """The restore counters that are not zero: a correct restore counts each store it restored exactly once."""
    counts = {name: int(task.metrics.counter(name)) for name in RESTORE_COUNTERS}
    return {name: count for name, count in counts.items() if count}


def task_thread_calls(task: TaskStorage, key: bytes) -> int:
    """Change ``key`` of store counts and commit it: the Python and C calls the task's thread makes in the commit's
    sync part (``commit_now`` after the previous commit ended), counted with a profile hook on this thread only.
    Work on the commit pool (the upload) is not counted: it may cost more."""
    task.wait_for_commit()
    task.store("counts", typed=False).put(key, b"changed")
    calls = 0

    def count(frame: FrameType, event: str, arg: Any) -> None:
        nonlocal calls
        if event in ("call", "c_call"):
            calls += 1

    previous = sys.getprofile()
    sys.setprofile(count)
    try:
        pending = task.commit_now({"input": key.decode()})
    finally:
        sys.setprofile(previous)
    pending.result(timeout=60)
    return calls
