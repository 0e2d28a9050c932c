"""The PySpark Structured Streaming driver: keyed state per task, committed with the batch id.

Use::

    job = StatefulForeachBatch(count_words, key_columns=["word"], num_tasks=4, config=config,
                               output_schema="word string, count long", sink=write_counts)
    stream.writeStream.foreachBatch(job).option("checkpointLocation", ...).start()

Contract of one micro-batch ``(batch_df, batch_id)``, called on the driver by Spark:

- The batch is split by ``key_columns`` into ``num_tasks`` partitions: each key has a key group (Spark's hash of the
  key columns modulo ``key_groups``, fixed for the life of the state and recorded in every checkpoint), task ``t``
  owns a contiguous range of key groups, and partition ``t`` is the task ``task-<t>`` (the same key always reaches the
  same task). ``num_tasks`` may change between runs of the query, from 1 up to ``key_groups``: the first batch with
  the new number redistributes the state by key group (``statebackend.microbatch.keygroups``).
- On the executor, each task opens :class:`~statebackend.task.TaskStorage` restored to its **base**: the newest
  checkpoint whose batch id is below ``batch_id``. In the normal case that is the newest checkpoint and the local
  LMDB files already are that state (kept in ``state.local.dir`` between batches), so nothing is downloaded. Then it
  runs the user function, commits durably with input offsets ``{"batch": str(batch_id), "tasks": str(num_tasks)}``,
  closes, and only then hands back its output. Output is materialized before the commit; a task whose commit fails
  fails, so Spark never uses output of state that is not durable.
- The driver runs the tasks with one action that keeps their output (so each task runs once per batch, not once per
  action of the sink), then calls ``sink(df, batch_id)`` or returns the DataFrame.

Exactly once, and why it holds:

- A replayed batch id (Spark re-runs the last batch after a driver crash between our commit and its own) restores
  the newest checkpoint *below* that batch id and redoes the batch; the checkpoint log is linear, so the redo is
  committed as the newest entry and the earlier commit of the same batch is simply superseded. State never includes a
  batch twice, because the base is never a checkpoint of the batch being run.
- A retried task attempt does the same: its base is the newest checkpoint below the batch, whatever a failed
  attempt committed or left in its write batch (uncommitted writes are discarded with the attempt; a local store that
  is ahead of its base is rebuilt by the restore manager).
- Two attempts at once (speculation, or a zombie attempt): both read the same base and commit the same checkpoint
  sequence number; the checkpoint log's create-only write lets exactly one win; the other gets a
  :class:`~statebackend.errors.CommitError` (conflict) and fails, so its output is never used. On one machine the
  second attempt finds the task's local stores locked (:class:`StoreLockedError`): it then works in a private
  directory ``<state.local.dir>/.attempts/<random>/`` restored from the blob store, deleted when it ends.
- A batch id *older* than the newest committed batch means the Spark checkpoint was reset while the state was not
  (or two queries share ``job.name``): refused with a StateBackendError rather than silently mixing histories.

Timers (``on_timers``, :mod:`statebackend.microbatch.timers`): ``fn`` registers per-key timers in processing time (the
batch clock) or event time (a watermark derived from ``event_time``, :mod:`statebackend.microbatch.watermark`); after
``fn`` each task hands its due timers to ``on_timers``, whose output joins the batch's. Timers live in a store of the
task and are deleted in the commit of the batch that fired them: fired once under replays, retries and rescales.
Spark runs no batch without new input: :func:`with_heartbeat` (:mod:`statebackend.spark.heartbeat`) keeps batches,
and so processing-time timers, coming when the input stops.

``on_replay="skip"`` lets a task whose newest checkpoint already is ``batch_id`` skip the work (its output for that
batch is then empty): only for jobs whose sink does not need a replayed batch's output again.

``pyspark``, ``pyarrow`` and ``pandas`` are imported here only; the rest of statebackend runs without them.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from statebackend.microbatch.batches import ATTEMPTS_DIR, BATCH_OFFSET, MODES, ON_REPLAY, TASKS_OFFSET, task_name
    from statebackend.microbatch.protocol import BatchReport, TaskStats
    from statebackend.microbatch.timers import EVENT, PROCESSING, TIMERS_STORE, Timer, Timers
    from statebackend.spark.driver import StatefulForeachBatch
    from statebackend.spark.executor import TaskRunner, TaskStores
    from statebackend.spark.heartbeat import HEARTBEAT_COLUMN, with_heartbeat
    from statebackend.spark.read import read_state
    from statebackend.spark.session import local_spark_session

# The names are imported when first used (PEP 562): the modules that need no Spark (timers, key groups, kept tasks,
# held output, batches) are imported by statebackend.microbatch without importing pyspark.
_LAZY = {
    "ATTEMPTS_DIR": "statebackend.microbatch.batches",
    "BATCH_OFFSET": "statebackend.microbatch.batches",
    "MODES": "statebackend.microbatch.batches",
    "ON_REPLAY": "statebackend.microbatch.batches",
    "TASKS_OFFSET": "statebackend.microbatch.batches",
    "task_name": "statebackend.microbatch.batches",
    "BatchReport": "statebackend.microbatch.protocol",
    "TaskStats": "statebackend.microbatch.protocol",
    "StatefulForeachBatch": "statebackend.spark.driver",
    "TaskRunner": "statebackend.spark.executor",
    "TaskStores": "statebackend.spark.executor",
    "HEARTBEAT_COLUMN": "statebackend.spark.heartbeat",
    "with_heartbeat": "statebackend.spark.heartbeat",
    "read_state": "statebackend.spark.read",
    "local_spark_session": "statebackend.spark.session",
    "EVENT": "statebackend.microbatch.timers",
    "PROCESSING": "statebackend.microbatch.timers",
    "TIMERS_STORE": "statebackend.microbatch.timers",
    "Timer": "statebackend.microbatch.timers",
    "Timers": "statebackend.microbatch.timers",
}


def __getattr__(name: str) -> Any:
    module = _LAZY.get(name)
    if module is None:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    value = getattr(importlib.import_module(module), name)
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    return sorted([*globals(), *_LAZY])


__all__ = [
    "ATTEMPTS_DIR",
    "BATCH_OFFSET",
    "EVENT",
    "HEARTBEAT_COLUMN",
    "MODES",
    "ON_REPLAY",
    "PROCESSING",
    "TASKS_OFFSET",
    "TIMERS_STORE",
    "BatchReport",
    "StatefulForeachBatch",
    "TaskRunner",
    "TaskStats",
    "TaskStores",
    "Timer",
    "Timers",
    "local_spark_session",
    "read_state",
    "task_name",
    "with_heartbeat",
]
