"""The driver's confirmation that every task's checkpoint of a batch is durable, for tasks that did not wait for it.

A task kept open in a reused Python worker hands its output on right after the sync part of its commit; the upload
and the checkpoint write go on in that worker, beside the batch's next tasks (``TaskStats.pending_checkpoint_id``).
Spark takes a batch as done when ``foreachBatch`` returns, so the driver reads each such checkpoint back from the
task's log before it hands the output to the sink or returns: exactly the sequence number the task committed, with
exactly its checkpoint id (a checkpoint another attempt of the task wrote there holds another state). Whatever is not
confirmed within the bound (an upload that failed, a worker that died with its upload, another attempt's
checkpoint) makes the driver run the batch again with every task waiting for its own checkpoint, which is a replay
of the batch: tasks whose checkpoint did land redo it from the previous batch's (docs/spark.md).

A checkpoint present under its name was written by a create-only write: it is durable. Its writer removes it again
only when its fencing listing finds a newer checkpoint of the task, which needs another attempt that restored this
very checkpoint and committed after it: a redo of the same batch, or a later batch, never a lost one.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Sequence

from statebackend.blobstores.base import BlobStore
from statebackend.checkpoint import CheckpointLog
from statebackend.config import Settings
from statebackend.errors import StateBackendError, TransientStorageError
from statebackend.spark.batches import task_name
from statebackend.spark.executor import TaskStats

__all__ = ["unconfirmed_checkpoints"]

log = logging.getLogger(__name__)

#: the first and the longest pause between two reads of a checkpoint not there yet (seconds)
FIRST_POLL_S = 0.001
LONGEST_POLL_S = 0.05


def unconfirmed_checkpoints(blob_store: BlobStore, settings: Settings, stats: Sequence[TaskStats],
                            timeout_s: float) -> list[str]:
    """Of the task attempts in ``stats`` that did not wait for their checkpoint, why each one whose checkpoint is not
    in its task's log within ``timeout_s`` (absent, or another checkpoint at its sequence number) is not confirmed;
    empty when every checkpoint is there."""
    waiting = [(s, _log(blob_store, settings, s)) for s in stats if s.pending_checkpoint_id]
    problems: list[str] = []
    deadline = time.monotonic() + timeout_s
    pause = FIRST_POLL_S
    while waiting:
        still: list[tuple[TaskStats, CheckpointLog]] = []
        for attempt, checkpoint_log in waiting:
            name = task_name(attempt.task_index)
            try:
                entry = checkpoint_log.read_written(attempt.committed_seq)
            except TransientStorageError:
                still.append((attempt, checkpoint_log))  # read it again below, until the deadline
                continue
            except StateBackendError as exc:
                problems.append(f"{name}: checkpoint #{attempt.committed_seq} cannot be read: {exc}")
                continue
            if entry is None:
                still.append((attempt, checkpoint_log))
                continue
            found = str(getattr(entry.checkpoint, "checkpoint_id", ""))
            if found != attempt.pending_checkpoint_id:
                problems.append(f"{name}: checkpoint #{attempt.committed_seq} is {found}, another attempt's, not "
                                f"{attempt.pending_checkpoint_id} as attempt {attempt.attempt} committed it")
        waiting = still
        if not waiting:
            break
        if time.monotonic() >= deadline:
            problems.extend(f"{task_name(a.task_index)}: checkpoint #{a.committed_seq} ({a.pending_checkpoint_id}) is "
                            f"not in the log after {timeout_s:.0f} s" for a, _ in waiting)
            break
        time.sleep(pause)
        pause = min(pause * 2, LONGEST_POLL_S)
    for problem in problems:
        log.warning("batch not confirmed: %s", problem)
    return problems


def _log(blob_store: BlobStore, settings: Settings, attempt: TaskStats) -> CheckpointLog:
    return CheckpointLog(blob_store, settings.job_name, task_name(attempt.task_index),
                         write_versions=settings.checkpoint_write_versions,
                         read_versions=settings.checkpoint_read_versions, retained=settings.checkpoint_retained)
