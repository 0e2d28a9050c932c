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
only when its fencing listing finds a newer checkpoint of the task: either another attempt restored this very
checkpoint and committed after it (a redo of the same batch, or a later batch: the state holds the batch), or the
writer is a zombie whose sequence number retention had freed, which cannot be the attempt the driver is confirming,
since the driver's batch is the newest the task ran. Two attempts may issue the same checkpoint id (ids follow the
restored checkpoint's when the clock is behind it), so each commit also records a random attempt token (input offset
``attempt``), compared too. Only a task's first attempt in a batch's first run leaves its upload running; retries,
speculative copies and replays wait for their checkpoint before their output leaves the task.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Sequence

from statebackend.blobstores.base import BlobStore
from statebackend.checkpoint import CheckpointLog
from statebackend.config import Settings
from statebackend.errors import ConfirmationError, StateBackendError, TransientStorageError
from statebackend.lifecycle import task_checkpoint_log
from statebackend.microbatch.batches import ATTEMPT_OFFSET, task_name
from statebackend.microbatch.protocol import TaskStats

__all__ = ["ConfirmationError", "unconfirmed_checkpoints"]

log = logging.getLogger(__name__)

#: the pause between two reads of a checkpoint not there yet (seconds): short while the uploads a batch's last tasks
#: left running normally land (tens of ms), then doubling up to the longest. A backoff from the first read made the
#: driver see checkpoints that landed 33 ms after the job up to 30 ms late (the sum of the pauses is 63 ms by then).
FIRST_POLL_S = 0.002
SHORT_POLLS_FOR_S = 0.25
LONGEST_POLL_S = 0.05


def unconfirmed_checkpoints(
    blob_store: BlobStore, settings: Settings, stats: Sequence[TaskStats], timeout_s: float
) -> list[str]:
    """Of the task attempts in ``stats`` that did not wait for their checkpoint, why each one whose checkpoint is not
    in its task's log within ``timeout_s`` (absent, or another attempt's checkpoint at its sequence number: another
    checkpoint id or attempt token) is not confirmed; empty when every checkpoint is there. Raises
    :class:`ConfirmationError` when a checkpoint cannot be read at all (not a transient fault)."""
    waiting = [(s, _log(blob_store, settings, s)) for s in stats if s.pending_checkpoint_id]
    problems: list[str] = []
    started = time.monotonic()
    deadline = started + timeout_s
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
                raise ConfirmationError(
                    f"{name}: checkpoint #{attempt.committed_seq} cannot be read from {blob_store.describe()} on the "
                    f"driver: {exc}"
                ) from exc
            if entry is None:
                still.append((attempt, checkpoint_log))
                continue
            found = str(getattr(entry.checkpoint, "checkpoint_id", ""))
            token = entry.checkpoint.input_offsets.get(ATTEMPT_OFFSET, "")
            if found != attempt.pending_checkpoint_id or token != attempt.attempt_token:
                problems.append(
                    f"{name}: checkpoint #{attempt.committed_seq} is {found} (attempt token {token!r}), "
                    f"another attempt's, not {attempt.pending_checkpoint_id} (attempt token "
                    f"{attempt.attempt_token!r}) as attempt {attempt.attempt} committed it"
                )
        waiting = still
        if not waiting:
            break
        if time.monotonic() >= deadline:
            problems.extend(
                f"{task_name(a.task_index)}: checkpoint #{a.committed_seq} ({a.pending_checkpoint_id}) is "
                f"not in the log after {timeout_s:.0f} s"
                for a, _ in waiting
            )
            break
        time.sleep(pause)
        if time.monotonic() - started >= SHORT_POLLS_FOR_S:
            pause = min(pause * 2, LONGEST_POLL_S)
    for problem in problems:
        log.warning("batch not confirmed: %s", problem)
    return problems


def _log(blob_store: BlobStore, settings: Settings, attempt: TaskStats) -> CheckpointLog:
    return task_checkpoint_log(settings, blob_store, task_name(attempt.task_index))
