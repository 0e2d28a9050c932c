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

from statebackend.spark.session import is_local_master, living_executors, spark_executors
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
        _anchor: tuple[Any, list[Any], Any] | None
        _spreading: tuple[str, int] | None
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
        """``rows`` (one partition per task) zipped with the anchor: the union of ``num_tasks`` one-element RDDs,
        each persisted and reused batch after batch. Task ``i``'s anchor is cached where it was first computed,
        inside the task that ran it, and Spark prefers to run a task on the executor caching a partition of its
        first narrow parent (``ExecutorCacheTaskLocation``, waiting up to ``spark.locality.wait`` for it; the
        scheduler walks the zip and the union down to the anchor), so task ``i`` returns to the executor that ran it,
        whose local dir holds its state. When that executor is lost, the cached anchor goes with it and is computed
        again where task ``i`` runs next: its new home. An anchor of its own per task lets the driver move one task
        (:meth:`_spread`) by replacing that task's anchor alone. The zip needs one element a side per partition, so
        the zip is done in the JVM over each partition's serialized row batches gathered in one list (``glom``: a
        task's input is held serialized in the executor's memory, as a whole) and the task unpickles the batches
        itself: one Python worker per task, as without affinity, so tasks kept open in their worker are taken
        back."""
        from pyspark.rdd import RDD
        from pyspark.serializers import AutoBatchedSerializer, CPickleSerializer

        context = spark.sparkContext
        moving = None
        if self._anchor is None or self._anchor[0] is not context or len(self._anchor[1]) != self.num_tasks:
            if self._anchor is not None and self._anchor[0] is context:  # a stopped context's blocks went with it
                for part in self._anchor[1]:
                    part.unpersist(False)
            parts = [_anchor_part(context, task) for task in range(self.num_tasks)]
            self._anchor = (context, parts, _union(context, parts))
            self._spreading = None
        elif not is_local_master(context.master or ""):
            moving = self._spread(context)
        anchor = self._anchor[2] if moving is None else moving
        batches = anchor.zip(rows._jrdd.glom()).values()  # per partition: [pickled row batches]
        jvm = context._jvm
        assert jvm is not None
        return RDD(
            jvm.org.apache.spark.api.python.SerDeUtil.javaToPython(batches),
            context,
            AutoBatchedSerializer(CPickleSerializer()),
        )

    def _spread(self, context: Any) -> Any | None:
        """Give an executor that holds no task's anchor one task of an executor that holds two or more: a
        replacement of a lost executor, or one that joined after the first anchored batch, gets work, where the
        anchors alone would keep every task where it is (a lost task's new home is the executor it ran on next, often
        the survivor). The task's anchor is replaced by a new one, cached nowhere yet; for the coming batch alone it
        is reached through a hint that Spark prefers the idle executor (:func:`_at_executor`), so the task runs there,
        where without it the task would take whatever free core the scheduler offered it, the crowded executor's
        included when that one has several cores. There the task restores from the blob store once, its anchor is
        cached, and that executor is its home from then on. Returns the union of anchors to run the coming batch
        with when it differs from the one kept (a hinted move), else None.

        At most one task moves a batch, and only while an executor holds no anchor (an uneven placement such as 3
        and 1 stays: a move costs the task a restore). The executors are asked for every batch (two py4j calls);
        where the anchors are, only while the set of executors has changed since it was last found even (a job of
        one element, then a py4j round trip per task); an anchor not cached anywhere (its executor lost) is computed
        where its task runs next, and its place waited for, not guessed. After ``num_tasks + 3`` looks for one set of
        executors, nothing more is moved until the set changes. Anything Spark refuses leaves the placement as it
        is."""
        assert self._anchor is not None
        live = ""
        try:
            executors = living_executors(context._jsc.sc())
            live = "\n".join(executors)
            looks = self._spreading[1] if self._spreading is not None and self._spreading[0] == live else 0
            if looks < 0 or len(executors) < 2 or looks >= self.num_tasks + 3:
                self._spreading = (live, -1)  # even, or given up, for this set of executors
                return None
            self._spreading = (live, looks + 1)
            # Spark's scheduler answers from what it knew when it submitted its last job (an anchor computed since
            # would show a batch late, after the scheduler had fallen back to another executor for it): a job of
            # one element makes it look again
            context._jsc.parallelize([0], 1).count()
            scheduler = context._jsc.sc().dagScheduler()
            parts = self._anchor[1]
            held: dict[str, list[int]] = {executor: [] for executor in executors}
            for task, part in enumerate(parts):
                places = _executor_ids(str(scheduler.getPreferredLocs(part.rdd(), 0).mkString("\n")))
                if not places:
                    log.debug("task %d's anchor is cached nowhere: where it runs next is its home", task)
                    return None  # the next batch looks again
                for place in places:
                    held.get(place, []).append(task)
            log.debug("the tasks' anchors by executor: %s", held)
            idle = [executor for executor in executors if not held[executor]]
            crowded = max(executors, key=lambda executor: len(held[executor]))
            if not idle or len(held[crowded]) < 2:
                self._spreading = (live, -1)
                return None
            task, target = held[crowded][-1], idle[0]
            parts[task].unpersist(False)
            parts[task] = _anchor_part(context, task)
            self._anchor = (context, parts, _union(context, parts))
        except Exception as exc:  # noqa: BLE001 - another Spark's internals: the placement stays as it is
            self._spreading = (live, -1)
            log.warning("could not spread the tasks over the executors (%s); they stay where they run", exc)
            return None
        log.info(
            "executor %s runs no task and executor %s runs %d (tasks %s): task %d moves to executor %s in this "
            "batch (it restores there from the blob store once) and stays there",
            ", ".join(idle),
            crowded,
            len(held[crowded]),
            held[crowded],
            task,
            target,
        )
        try:
            hinted = _at_executor(context, parts[task], target)
        except Exception as exc:  # noqa: BLE001 - another Spark's internals: the move goes where Spark puts it
            log.warning(
                "could not ask Spark to run task %d on executor %s (%s): it moves to whatever free core the "
                "scheduler gives it",
                task,
                target,
                exc,
            )
            return None
        if hinted is None:
            log.info("executor %s is not in Spark's status store yet: task %d moves where Spark puts it", target, task)
            return None
        return _union(context, [hinted if index == task else part for index, part in enumerate(parts)])

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


def _anchor_part(context: Any, task: int) -> Any:
    """Task ``task``'s anchor: a JavaRDD of one partition holding ``task``, persisted in memory."""
    part = context._jsc.parallelize([task], 1)
    part.persist(context._getJavaStorageLevel(StorageLevel.MEMORY_ONLY))
    return part


def _at_executor(context: Any, part: Any, executor: str) -> Any | None:
    """``part`` (a one-partition JavaRDD), reached through an RDD whose one partition Spark prefers to compute on
    ``executor``: a job over it runs that task there (``ExecutorCacheTaskLocation``, process-local), and ``part``,
    computed inside that task, is cached there. The preference is given once, by the job's RDD (``makeRDD`` with
    location preferences, zipped with ``part``), not by ``part``: where ``part`` lives afterwards is where it is cached,
    and when that executor is lost, it is computed again where its task runs next, as any anchor. None when Spark's
    status store does not list the executor yet (its host is not known)."""
    host = _executor_host(context, executor)
    if host is None:
        return None
    jvm = context._jvm
    utils = jvm.org.apache.spark.api.python.PythonUtils
    where = utils.toSeq(_java_list(jvm, [f"executor_{host}_{executor}"]))
    hint = context._jsc.sc().makeRDD(utils.toSeq(_java_list(jvm, [jvm.scala.Tuple2(0, where)])), part.classTag())
    return hint.toJavaRDD().zip(part).values()


def _executor_host(context: Any, executor: str) -> str | None:
    """The host of a living executor, from Spark's status store (its ``host:port``, or its host alone)."""
    summaries = context._jsc.sc().statusStore().executorList(True).iterator()
    while summaries.hasNext():
        summary = summaries.next()
        if str(summary.id()) == executor:
            host_port = str(summary.hostPort())
            host, colon, port = host_port.rpartition(":")
            return host.strip("[]") if colon and port.isdigit() and host else host_port
    return None


def _java_list(jvm: Any, items: list[Any]) -> Any:
    """A java.util.ArrayList of ``items`` (py4j converts each)."""
    array = jvm.java.util.ArrayList()
    for item in items:
        array.add(item)
    return array


def _union(context: Any, parts: list[Any]) -> Any:
    """The JavaRDD of the anchors' partitions, task ``i``'s the ``i``-th."""
    gateway = context._gateway
    array = gateway.new_array(context._jvm.org.apache.spark.api.java.JavaRDD, len(parts))
    for index, part in enumerate(parts):
        array[index] = part
    return context._jsc.union(array)


def _executor_ids(locations: str) -> list[str]:
    """The executor ids in Spark's preferred locations of a cached block, one a line (``executor_<host>_<id>``);
    locations of other kinds (a host alone) are left out."""
    tag = "executor_"  # Spark's ExecutorCacheTaskLocation: executor_<host>_<executor id>
    found = (line[len(tag) :] for line in locations.split("\n") if line.startswith(tag))
    return [host_and_id.rsplit("_", 1)[1] for host_and_id in found if "_" in host_and_id]


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
