"""The Spark resources the driver runs a batch's tasks with, kept batch after batch: the anchor RDD that brings each
task back to the executor that ran it (affinity), the executor count, the accumulator the tasks' stats come back
through, the run again of a batch Spark planned without partitions, and the release of the output a run holds.

A base class of :class:`~statebackend.spark.driver.StatefulForeachBatch`, which chooses the route of each run
(``_run_tasks``) and holds the fields these methods keep.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

from pyspark import StorageLevel
from pyspark.sql import DataFrame, SparkSession
from pyspark.sql.types import StructType

from statebackend.spark.session import is_local_master, spark_executors
from statebackend.spark.stats import StatsParam, TaskStats

log = logging.getLogger(__name__)

#: what running a batch's tasks gives: what frees the held output, the output, the tasks' stats
_TaskRun = tuple[Callable[[], None], DataFrame, list[TaskStats]]


class _SparkRuns:
    """The driver's Spark resources of its runs (see the module docstring); the fields are the driver's."""

    if not TYPE_CHECKING:  # no instance dict, as the slotted driver has none (mypy would refuse its fields here)
        __slots__ = ()
    if TYPE_CHECKING:
        num_tasks: int
        _anchor: tuple[Any, int, Any] | None
        _local_context: Any
        _stats_to: tuple[Any, Any] | None

    def _no_partition(self, batch_id: int, again: Callable[[], _TaskRun]) -> _TaskRun:
        """The batch's input is empty as Spark planned it, so no task ran: run every task over an empty input."""
        log.info(
            "batch %d: Spark planned its input as empty, with no partition, so no task ran; running every task "
            "over an empty input (each commits the batch, and due timers fire)",
            batch_id,
        )
        return again()

    def _stats_accumulator(self, spark: SparkSession) -> Any:
        """The accumulator this object's tasks report their stats through (one per SparkContext: an accumulator
        stays registered in the driver for the context's life)."""
        context = spark.sparkContext
        if self._stats_to is None or self._stats_to[0] is not context:
            self._stats_to = (context, context.accumulator([], StatsParam()))
        return self._stats_to[1]

    @staticmethod
    def _reported(accumulator: Any, run_id: str) -> list[TaskStats]:
        """The stats the tasks of run ``run_id`` reported (the accumulator is emptied; an entry of another run, a
        zombie attempt's, is dropped)."""
        reported, accumulator.value = accumulator.value, []
        stats = [s for s in reported if s.run_id == run_id]
        if len(stats) < len(reported):
            log.warning(
                "%d task stats of an earlier run came late and were dropped (attempts of a run that had ended: "
                "a zombie, or a block computed again for a sink)",
                len(reported) - len(stats),
            )
        return stats

    def _anchored(self, spark: SparkSession, rows: Any) -> Any:
        """``rows`` (one partition per task) zipped with the anchor: an RDD of ``num_tasks`` one-element partitions,
        persisted and reused batch after batch. A partition is cached where it was first computed, inside the task
        that ran it, and Spark prefers to run a task on the executor caching a partition of its first narrow parent
        (``ExecutorCacheTaskLocation``, waiting up to ``spark.locality.wait`` for it), so task ``i`` returns to the
        executor that ran it, whose local dir holds its state. When that executor is lost, the cached partition goes
        with it and is computed again where task ``i`` runs next: its new home. The zip needs one element a side per
        partition, so the zip is done in the JVM over each partition's serialized row batches gathered in one list
        (``glom``: a task's input is held serialized in the executor's memory, as a whole) and the task unpickles the
        batches itself: one Python worker per task, as without affinity, so tasks kept open in their worker are
        taken back."""
        from pyspark.rdd import RDD
        from pyspark.serializers import AutoBatchedSerializer, CPickleSerializer

        context = spark.sparkContext
        if self._anchor is None or self._anchor[0] is not context or self._anchor[1] != self.num_tasks:
            if self._anchor is not None:
                self._anchor[2].unpersist()
            anchor = context.parallelize(range(self.num_tasks), self.num_tasks).persist(StorageLevel.MEMORY_ONLY)
            self._anchor = (context, self.num_tasks, anchor)
        batches = self._anchor[2]._jrdd.zip(rows._jrdd.glom()).values()  # per partition: [pickled row batches]
        jvm = context._jvm
        assert jvm is not None
        return RDD(
            jvm.org.apache.spark.api.python.SerDeUtil.javaToPython(batches),
            context,
            AutoBatchedSerializer(CPickleSerializer()),
        )

    def _executors(self, spark: SparkSession) -> int:
        """How many executors the application has. ``local[...]`` has one for its whole life: its count is read once
        (three py4j round trips a batch otherwise); elsewhere (``local-cluster``, a cluster manager) every batch, as
        executors come and go."""
        context = spark.sparkContext
        if self._local_context is not context:
            if not is_local_master(context.master or ""):
                return spark_executors(spark)
            self._local_context = context
        return 1


def _checkpointed_rdd(frame: DataFrame) -> Any:
    """The RDD (a py4j handle) a DataFrame made by ``localCheckpoint`` reads: its plan is a ``LogicalRDD`` over it."""
    return frame._jdf.queryExecution().analyzed().rdd()


def _release_checkpoint(frame: DataFrame) -> None:
    """Free the blocks of a DataFrame made by ``localCheckpoint`` (unpersisting its RDD drops its blocks from every
    executor). Not blocking."""
    try:
        _checkpointed_rdd(frame).unpersist(False)
    except Exception as exc:  # noqa: BLE001 - another Spark's plan: its blocks go when Spark's cleaner frees the RDD
        log.warning(
            "could not free the output of a batch held by a local checkpoint (%s); Spark frees it when the "
            "RDD is garbage collected",
            exc,
        )


def _rows_frame(spark: SparkSession, rdd: Any, schema: Any) -> DataFrame:
    if schema is not None:  # every row was checked against it in its task, before the commit (spark.outputs)
        return spark.createDataFrame(rdd, schema, verifySchema=False)
    if rdd.isEmpty():
        return spark.createDataFrame([], StructType([]))
    return spark.createDataFrame(rdd)
