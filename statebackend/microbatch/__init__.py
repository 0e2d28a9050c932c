"""Micro-batch execution of a keyed stateful job, independent of the engine that schedules it.

Two roles and one message between them, as Flink names a checkpoint storage's coordinator view and worker view:

- :class:`~statebackend.microbatch.spec.JobSpec` and :class:`~statebackend.microbatch.spec.BatchSpec`: what the
  driver decides, once per job (the settings, parsed once) and once per batch (its id, clock, watermark); frozen and
  picklable, they travel to the workers.
- :class:`~statebackend.microbatch.attempt.TaskAttempt`: one attempt of one task of one batch on a worker: resume
  the task kept open in this process or open it at the batch's base, skip a replay, plan, rebase, rescale, run the
  user's function and the due timers, check the output, commit, park. It needs no Spark: tests drive it directly.
- :class:`~statebackend.microbatch.protocol.TaskStats`: the one message an attempt sends back, its warnings
  included.
- :class:`~statebackend.microbatch.coordinator.BatchCoordinator`: the driver's side of a batch: which tasks may hand
  their output on before their checkpoint is durable, the confirmation of those checkpoints, the run again when one
  is missing, the event-time clock, and what an operator sees (one INFO line per batch, the attempts' warnings, a
  listener).

``statebackend.spark`` holds the adapters: frames in and out, routing rows to tasks, the session. This package
imports no Spark.
"""

from __future__ import annotations

from statebackend.microbatch.protocol import AttemptWarning, BatchReport, TaskStats
from statebackend.microbatch.spec import BatchSpec, JobSpec

__all__ = ["AttemptWarning", "BatchReport", "BatchSpec", "JobSpec", "TaskStats"]
