"""Which checkpoint is which micro-batch: the input offsets the driver writes, task names, and the choice of the
checkpoint a batch starts from (its base), replays included."""

from __future__ import annotations

import logging
from collections.abc import Callable

from statebackend.checkpoint import CheckpointLog, LogEntry
from statebackend.errors import ConfigError, StateBackendError
from statebackend.store.ttl import CLOCK_OFFSET

log = logging.getLogger(__name__)

#: input offset keys of every checkpoint the driver writes
BATCH_OFFSET = "batch"
TASKS_OFFSET = "tasks"
#: the batch's clock (ms since the epoch), chosen by the driver when the batch first ran: TTL stores read and write at
#: it, and a replay of the batch reads it back from the task's checkpoint of that batch, so it sees the same keys
NOW_OFFSET = CLOCK_OFFSET
#: under ``state.local.dir``: private directories of concurrent attempts of a task on one machine
ATTEMPTS_DIR = ".attempts"

MODES = ("rows", "arrow", "pandas")
ON_REPLAY = ("redo", "skip")


def task_name(index: int) -> str:
    """The task name of partition ``index``: ``task-<index>``."""
    return f"task-{index}"


def batch_of(entry: LogEntry, name: str, num_tasks: int) -> int:
    offsets = entry.checkpoint.input_offsets
    batch = offsets.get(BATCH_OFFSET)
    if batch is None or not str(batch).isdigit():
        raise StateBackendError(
            f"{name}: checkpoint #{entry.seq} has no {BATCH_OFFSET!r} input offset ({dict(offsets)}); this state was "
            "not written by the Spark driver: give the Spark job its own job.name"
        )
    tasks = offsets.get(TASKS_OFFSET)
    if tasks is not None and tasks != str(num_tasks):
        raise ConfigError(
            f"{name}: the state was written with num_tasks={tasks} but this query uses num_tasks={num_tasks}; keys "
            f"are assigned to tasks by hash modulo num_tasks, so it cannot change while the state lives: set "
            f"num_tasks={tasks}, or start the job with a new job.name"
        )
    return int(batch)


def base_checkpoint(
    checkpoint_log: CheckpointLog, latest: LogEntry | None, name: str, batch_id: int, num_tasks: int
) -> LogEntry | None:
    """The newest checkpoint with a batch id below ``batch_id`` (None: start empty)."""
    if latest is None:
        return None
    newest_batch = batch_of(latest, name, num_tasks)
    if newest_batch == batch_id - 1:
        return latest  # the normal case: one checkpoint read
    if newest_batch < batch_id:
        # Spark starts batch B only once B-1 has finished, and every task commits every batch: a newest checkpoint
        # older than B-1 means the checkpoints after it are gone (deleted, or the blob store was rolled back).
        # Restoring it would silently drop acknowledged batches.
        raise StateBackendError(
            f"{name}: Spark runs batch {batch_id} but the newest checkpoint of this task is of batch {newest_batch} "
            f"(checkpoint #{latest.seq} in {checkpoint_log.blob_store.describe()}): the checkpoints of batches "
            f"{newest_batch + 1}..{batch_id - 1} are missing from the blob store (deleted, or the store was restored "
            "from an older copy). Refusing to restore older state: bring the missing checkpoints back, or start over "
            "with a new job.name and a new Spark checkpoint location"
        )
    if newest_batch > batch_id:
        raise StateBackendError(
            f"{name}: Spark runs batch {batch_id} but the state already committed batch {newest_batch} (checkpoint "
            f"#{latest.seq} in {checkpoint_log.blob_store.describe()}); Spark only re-runs its last batch, so its "
            "checkpoint location was reset or another query uses the same job.name. Restore the Spark checkpoint, "
            "or start over with a new job.name (or delete the old state)"
        )
    base = checkpoint_log.find(lambda entry: batch_of(entry, name, num_tasks) < batch_id)
    if base is None and min(checkpoint_log.seqs(), default=1) > 1:
        raise StateBackendError(
            f"{name}: batch {batch_id} is replayed but the checkpoint before it was deleted by retention "
            f"(task.checkpoint.retained); raise task.checkpoint.retained so a batch can be replayed that often"
        )
    if base is not None:
        log.info("%s: batch %d is replayed; restoring checkpoint #%d (batch %s) and redoing it", name, batch_id,
                 base.seq, base.checkpoint.input_offsets.get(BATCH_OFFSET))
    return base


def at_or_below(name: str, batch_id: int, num_tasks: int) -> Callable[[LogEntry], bool]:
    def choose(entry: LogEntry) -> bool:
        return batch_of(entry, name, num_tasks) <= batch_id

    return choose


