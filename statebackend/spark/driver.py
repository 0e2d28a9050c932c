"""The driver side: the callable given to ``writeStream.foreachBatch``, what the user function gets, and the per-task
statistics that travel back."""

from __future__ import annotations

import logging
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import attrs
from pyspark import AccumulatorParam, StorageLevel
from pyspark.sql import DataFrame, SparkSession
from pyspark.sql.types import StructType

from statebackend.config import Settings
from statebackend.errors import ConfigError
from statebackend.spark.batches import MODES, ON_REPLAY
from statebackend.spark.executor import TaskRunner, TaskStats, TaskStores

log = logging.getLogger(__name__)

Sink = Callable[[DataFrame, int], Any]


@attrs.define(eq=False)
class StatefulForeachBatch:
    """A ``foreachBatch`` callable that runs ``fn`` per task against durable keyed state. See the module docstring.

    ``fn(stores, rows)``: ``rows`` is an iterator of :class:`pyspark.sql.Row` (mode ``"rows"``), an iterator of
    ``pyarrow.RecordBatch`` (``"arrow"``) or one ``pandas.DataFrame`` with the task's whole input (``"pandas"``). It
    returns the task's output: an iterable of rows (tuples, Rows or dicts) for ``"rows"``; a ``pyarrow.Table``, a
    ``RecordBatch`` or an iterable of them for ``"arrow"``; a ``pandas.DataFrame`` (or iterable of them) for
    ``"pandas"``; or ``None`` for no output. ``fn`` and ``config`` travel to the executors: both must pickle.
    """

    fn: Callable[[TaskStores, Any], Any]
    key_columns: Sequence[str] = attrs.field(converter=tuple)
    num_tasks: int
    config: Mapping[str, Any] = attrs.field(converter=dict)
    output_schema: StructType | str | None = None
    mode: str = "rows"
    sink: Sink | None = None
    on_replay: str = "redo"
    #: stats of every task attempt of the last batch run, and of all batches (bench and tests read them)
    last_batch_stats: list[TaskStats] = attrs.field(init=False, factory=list)
    history: list[TaskStats] = attrs.field(init=False, factory=list)
    _previous: Any = attrs.field(init=False, default=None)

    def __attrs_post_init__(self) -> None:
        if self.mode not in MODES:
            raise ConfigError(f"StatefulForeachBatch mode {self.mode!r} is not one of {', '.join(MODES)}")
        if self.on_replay not in ON_REPLAY:
            raise ConfigError(f"StatefulForeachBatch on_replay {self.on_replay!r} is not one of {', '.join(ON_REPLAY)}")
        if not self.key_columns:
            raise ConfigError("StatefulForeachBatch needs at least one key column to partition the input by")
        if type(self.num_tasks) is not int or self.num_tasks < 1:
            raise ConfigError(f"StatefulForeachBatch num_tasks must be a positive int, got {self.num_tasks!r}")
        if self.mode != "rows" and self.output_schema is None:
            raise ConfigError(
                f"StatefulForeachBatch mode {self.mode!r} needs output_schema (a StructType or a DDL string such as "
                "'word string, count long'): Spark must know the schema before the tasks run"
            )
        Settings.from_config(self.config)  # a wrong key fails here, on the driver, not in every task

    def __call__(self, batch_df: DataFrame, batch_id: int) -> DataFrame | None:
        """Run micro-batch ``batch_id``; hand the output to the sink, or return it (persisted until the next call)."""
        if self._previous is not None:
            self._previous.unpersist()
            self._previous = None
        spark = batch_df.sparkSession
        accumulator = spark.sparkContext.accumulator([], _ListParam())
        runner = TaskRunner(
            fn=self.fn,
            config=self.config,
            batch_id=int(batch_id),
            num_tasks=self.num_tasks,
            on_replay=self.on_replay,
            input_columns=tuple(batch_df.columns),
            stats=accumulator,
        )
        partitioned = batch_df.repartition(self.num_tasks, *self.key_columns)
        schema = self.output_schema  # a StructType or a DDL string: Spark accepts either
        if self.mode == "rows":
            rdd = partitioned.rdd.mapPartitionsWithIndex(runner.run_rows)
            rdd.persist(StorageLevel.MEMORY_AND_DISK)
            rdd.count()  # the one action that runs the tasks; everything after reads the persisted output
            output = _rows_frame(spark, rdd, schema)
            persisted: Any = rdd
        else:
            assert schema is not None  # checked at construction for every mode but "rows"
            run = runner.run_arrow if self.mode == "arrow" else runner.run_pandas
            mapped = (
                partitioned.mapInArrow(run, schema) if self.mode == "arrow" else partitioned.mapInPandas(run, schema)
            )
            output = mapped.persist(StorageLevel.MEMORY_AND_DISK)
            output.count()
            persisted = output
        self.last_batch_stats = sorted(accumulator.value, key=lambda s: (s.task_index, s.attempt))
        self.history.extend(self.last_batch_stats)
        if self.sink is None:
            self._previous = persisted
            return output
        try:
            self.sink(output, int(batch_id))
        finally:
            persisted.unpersist()
        return None


class _ListParam(AccumulatorParam):  # type: ignore[type-arg]
    """Accumulates lists (of TaskStats) by concatenation."""

    def zero(self, value: list[Any]) -> list[Any]:
        return []

    def addInPlace(self, value1: list[Any], value2: list[Any]) -> list[Any]:  # pyspark's name
        value1.extend(value2)
        return value1


def _rows_frame(spark: SparkSession, rdd: Any, schema: Any) -> DataFrame:
    if schema is not None:
        return spark.createDataFrame(rdd, schema)
    if rdd.isEmpty():
        return spark.createDataFrame([], StructType([]))
    return spark.createDataFrame(rdd)


