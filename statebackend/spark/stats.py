"""What a task attempt reports to the driver (:class:`TaskStats`) and the ways it travels: an accumulator on classic
Spark (:class:`StatsParam`), the last element of an RDD's output (:class:`StatsRecord`), or one extra row in
:data:`STATS_COLUMN` under Spark Connect."""

from __future__ import annotations

from typing import Any

import attrs
from pyspark import AccumulatorParam

from statebackend.metrics import MetricsSnapshot

__all__ = ["STATS_COLUMN", "StatsParam", "StatsRecord", "TaskStats", "is_output", "is_stats"]


@attrs.frozen
class TaskStats:
    """What one task attempt did in one batch (travels to the driver with the task's output)."""

    batch_id: int
    task_index: int
    attempt: int
    #: sequence number of the checkpoint restored (0: none), and of the one committed (0: skipped)
    base_seq: int
    committed_seq: int
    open_ms: float
    process_ms: float
    commit_ms: float
    #: sync part of the commit (flush + snapshot): the part that blocks processing
    commit_sync_ms: float
    input_rows: int
    output_rows: int
    private_dir: bool
    #: what the attempt counted (commits, restores, blob-store requests), mergeable: the driver adds them up per batch
    metrics: MetricsSnapshot | None = None
    #: the task was kept open from an earlier batch in this worker (no open, no restore, no close)
    kept_open: bool = False
    #: where the attempt ran: ``host:working directory`` of the executor (one per executor in standalone, YARN and
    #: Kubernetes deployments), to see whether tasks stay with their state
    executor: str = ""
    #: the id of the checkpoint (``committed_seq``) this attempt committed without waiting for it to be durable (its
    #: upload goes on in the worker, where the task stays open): the driver confirms it in the task's log before the
    #: batch ends, with ``attempt_token`` (its input offset ``attempt``). Empty: the checkpoint was durable before the
    #: task handed its output on. ``commit_ms`` is then the sync part only
    pending_checkpoint_id: str = ""
    attempt_token: str = ""
    #: the driver's token of the run of the batch this attempt belongs to (:attr:`TaskRunner.run_id`): stats reported
    #: through an accumulator are told apart from those of an earlier run by it
    run_id: str = ""
    #: timers the attempt fired (handed to ``on_timers``); the watermark its batch used and the largest event time
    #: seen up to and including it (None: no event time; ``statebackend.spark.watermark``)
    timers_fired: int = 0
    watermark_ms: int | None = None
    event_max_ms: int | None = None
    #: timers the task's timer store holds after the batch (None: the job has no timers)
    timers_pending: int | None = None


@attrs.frozen
class StatsRecord:
    """A task attempt's :class:`TaskStats`, travelling back to the driver as the last element of the task's output
    (rows mode on an RDD). The other modes carry the same pickled stats in the output's :data:`STATS_COLUMN`."""

    stats: TaskStats


def is_stats(item: Any) -> bool:
    return isinstance(item, StatsRecord)


def is_output(item: Any) -> bool:
    return not isinstance(item, StatsRecord)


#: the column that carries each task attempt's pickled TaskStats in one extra output row (null in every output row),
#: under Spark Connect (no accumulators there); classic Spark reports them through :class:`StatsParam` instead
STATS_COLUMN = "__statebackend_stats__"


class StatsParam(AccumulatorParam):  # type: ignore[type-arg]
    """The accumulator the tasks of classic Spark report their :class:`TaskStats` through (a list, in no order).

    Spark merges a task's accumulator updates into the driver's value when the task succeeds, before the action that
    ran it returns (the driver acknowledges each update), and never those of a failed attempt: after the action, the
    value holds at most one entry per task of the run, none for a task whose output Spark read from a block a failed
    attempt had stored (the driver's ``_without_stats``). So the stats need no row of the output and no second job to
    collect them. ``addInPlace`` builds a new list: the driver swaps the value out while the accumulator server's
    thread may merge a late update of another run's zombie attempt, which then lands in one list or the other, never
    half in both (the driver tells runs apart by :attr:`TaskStats.run_id`)."""

    def zero(self, value: list[TaskStats]) -> list[TaskStats]:
        return []

    def addInPlace(self, value1: list[TaskStats], value2: list[TaskStats]) -> list[TaskStats]:
        return [*value1, *value2]

