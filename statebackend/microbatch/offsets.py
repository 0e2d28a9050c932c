"""What a task attempt's checkpoint records in its input offsets (batch id, layout, clock, watermark, event-time
maximum, timer key columns, attempt token), and the batch times it derives from the checkpoints the batch starts
from: a replay sees what its first run saw, and no time runs backwards across batches. The task attempt
(:mod:`statebackend.microbatch.attempt`, which re-exports :data:`TIMER_KEY_OFFSET`) commits them."""

from __future__ import annotations

import json
from typing import Any

from statebackend.microbatch.batches import (
    ATTEMPT_OFFSET,
    BATCH_OFFSET,
    EVENT_MAX_OFFSET,
    KEY_GROUPS_OFFSET,
    NOW_OFFSET,
    TASKS_OFFSET,
    WATERMARK_OFFSET,
    Plan,
    batch_of,
)
from statebackend.microbatch.spec import BatchSpec, JobSpec
from statebackend.microbatch.watermark import EventTimes, recorded_ms
from statebackend.store.ttl import wall_clock_ms

__all__ = ["TIMER_KEY_OFFSET", "batch_clock", "batch_event_max", "batch_watermark", "commit_offsets", "starts"]

#: the input offset recording the key columns of a job with timers as a Spark struct's JSON (their names and type
#: names): ``read_state`` of the timer store gives timer keys in their columns' types
TIMER_KEY_OFFSET = "timers.key.schema"


def commit_offsets(
    job: JobSpec, batch: BatchSpec, now_ms: int, watermark: int | None, event_max: int | None, token: str
) -> dict[str, str]:
    """The input offsets a task's commit of ``batch`` records (the expiry cursors are added to them)."""
    offsets = {
        BATCH_OFFSET: str(batch.batch_id),
        TASKS_OFFSET: str(job.num_tasks),
        NOW_OFFSET: str(now_ms),
    }
    if job.key_groups is not None:
        offsets[KEY_GROUPS_OFFSET] = str(job.key_groups)
    if watermark is not None:
        offsets[WATERMARK_OFFSET] = str(watermark)
    if event_max is not None:
        offsets[EVENT_MAX_OFFSET] = str(event_max)
    key_columns = job.key_columns
    if job.on_timers is not None and key_columns and len(key_columns) == len(job.key_types):
        offsets[TIMER_KEY_OFFSET] = json.dumps(
            {
                "type": "struct",
                "fields": [
                    {"name": column, "type": type_name, "nullable": True, "metadata": {}}
                    for column, type_name in zip(key_columns, job.key_types, strict=True)
                ],
            },
            separators=(",", ":"),
        )
    offsets[ATTEMPT_OFFSET] = token
    return offsets


def batch_clock(batch: BatchSpec, task: str, latest: Any, plan: Plan) -> int:
    """The batch's clock: the one task ``task``'s checkpoint of this very batch recorded (a replay of a committed
    batch sees what its first run saw), else the driver's (or, without one, the wall clock), never earlier than the
    clock of the checkpoints the batch starts from: a driver clock behind the previous batch's (a restart on another
    machine, a clock step) would make keys that batch saw expired visible again."""
    if latest is not None and batch_of(latest, task) == batch.batch_id:
        recorded = _recorded_clock(latest)
        if recorded is not None:
            return recorded
    now = batch.now_ms if batch.now_ms is not None else wall_clock_ms()
    return max([now, *(clock for clock in map(_recorded_clock, starts(plan)) if clock is not None)])


def batch_watermark(job: JobSpec, batch: BatchSpec, task: str, latest: Any, plan: Plan) -> int | None:
    """The batch's watermark (None without event time): the one task ``task``'s checkpoint of this very batch
    recorded (a replay fires what its first run fired), else the driver's, never below the watermark of the
    checkpoints the batch starts from."""
    if job.event_time is None:
        return None
    if latest is not None and batch_of(latest, task) == batch.batch_id:
        recorded = recorded_ms(latest, WATERMARK_OFFSET)
        if recorded is not None:
            return recorded
    known = [
        w for w in (batch.watermark_ms, *(recorded_ms(e, WATERMARK_OFFSET) for e in starts(plan))) if w is not None
    ]
    return max(known) if known else None


def batch_event_max(job: JobSpec, batch: BatchSpec, events: EventTimes, plan: Plan) -> int | None:
    """The largest event time seen up to and including this batch: of the batches before it (the driver's, and what
    the checkpoints the batch starts from recorded) and of this task's input."""
    if job.event_time is None:
        return None
    known = [
        m
        for m in (
            batch.event_max_ms,
            events.max_ms,
            *(recorded_ms(e, EVENT_MAX_OFFSET) for e in starts(plan)),
        )
        if m is not None
    ]
    return max(known) if known else None


def starts(plan: Plan) -> list[Any]:
    """The checkpoints the batch starts from: its base, or the old tasks' of a rescale."""
    return [plan.base] if plan.base is not None else [entry for _, entry in plan.sources]


def _recorded_clock(entry: Any) -> int | None:
    """The batch clock a checkpoint recorded (``now.ms``), if any."""
    recorded = entry.checkpoint.input_offsets.get(NOW_OFFSET)
    return int(recorded) if recorded is not None and str(recorded).isdigit() else None
