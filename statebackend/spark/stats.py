"""How a task attempt's report (:class:`~statebackend.microbatch.protocol.TaskStats`, the protocol message) travels
to the driver: an accumulator on classic Spark (:class:`StatsParam`), the last element of an RDD's output
(:class:`StatsRecord`), or one extra row in :data:`STATS_COLUMN` under Spark Connect."""

from __future__ import annotations

from typing import Any

import attrs
from pyspark import AccumulatorParam

from statebackend.microbatch.protocol import TaskStats

__all__ = ["STATS_COLUMN", "StatsParam", "StatsRecord", "TaskStats", "is_output", "is_stats"]


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


class StatsParam(AccumulatorParam[list[TaskStats]]):
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
