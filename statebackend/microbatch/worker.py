"""What a task does to the Python worker process it runs in: the garbage
collector frozen at each task's start (``task.gc.freeze``), and facts about the process (its executor, whether it
outlives the task)."""

from __future__ import annotations

import gc
import os
import threading
from typing import Any

__all__ = ["GC_FULL_EVERY", "executor_id", "freeze_survivors", "process_outlives_task"]


#: tasks between two full collections of the process under ``task.gc.freeze``
GC_FULL_EVERY = 64
_gc_lock = threading.Lock()
_gc_tasks = 0
#: whether something else in the process froze objects before the first task did (then the collector is left alone)
_gc_foreign: bool | None = None


def freeze_survivors() -> None:
    """At a task's start in a Python worker: collect the process's garbage, then move every object that survives out
    of later collections (``gc.freeze``); every :data:`GC_FULL_EVERY` tasks, everything frozen is put back first, so
    the collection is a full one.

    A reused PySpark worker runs a full ``gc.collect()`` after every task. With pyspark, pyarrow, pandas and this
    library loaded that is about 82,000 objects and 45 ms, the GIL held throughout: a task's upload left running
    beside it waits, and so does the worker's next task. Measured on a foreachBatch of 10k updates a batch (1M keys,
    4 tasks, ``local[2]``, 20 batches interleaved): 337 -> 299 ms p50 a call with every task waiting for its
    checkpoint, 373 -> 282 ms with the driver confirming them (docs/benchmarks-spark.md). Once the long-lived
    objects are frozen, a collection walks only what was made since the last task.

    What it costs: a reference cycle among frozen objects that turns to garbage (a closed task's) waits for the next
    full collection, at most :data:`GC_FULL_EVERY` tasks later; objects are still freed as soon as nothing refers to
    them. A process that froze objects itself before its first task is left alone: thawing would undo its freeze."""
    global _gc_tasks, _gc_foreign
    with _gc_lock:
        if _gc_foreign is None:
            _gc_foreign = gc.get_freeze_count() > 0
        if _gc_foreign:
            return
        if _gc_tasks and _gc_tasks % GC_FULL_EVERY == 0:
            gc.unfreeze()
        _gc_tasks += 1
        gc.collect()
        gc.freeze()


def executor_id() -> str:
    """Where an attempt runs: ``host:working directory`` (one per executor in standalone, YARN and Kubernetes)."""
    import socket

    return f"{socket.gethostname()}:{os.getcwd()}"


def process_outlives_task(context: Any) -> bool:
    """Whether this process runs later tasks too: a Spark Python worker only with worker reuse on (the daemon gets
    ``SPARK_REUSE_WORKER``); a worker that exits after its task would take a parked task's background snapshot and
    cleanups with it every time. Outside a Spark task (the caller runs tasks itself): yes."""
    return context is None or bool(os.environ.get("SPARK_REUSE_WORKER"))
