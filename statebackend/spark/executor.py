"""The executor side of a micro-batch, as Spark hands it over: the task's input and output in Spark's forms (Rows,
Arrow record batches, pandas frames) around one :class:`~statebackend.microbatch.attempt.TaskAttempt`, and the
attempt's report on its way back (:mod:`statebackend.spark.stats`).

The attempt itself (open or take back, plan, run, commit, park) needs no Spark: :mod:`statebackend.microbatch`."""

from __future__ import annotations

import logging
from collections.abc import Callable, Iterable, Iterator
from itertools import chain
from typing import Any

import attrs
from pyspark import TaskContext

from statebackend.errors import ConfigError
from statebackend.microbatch.attempt import Counted, TaskAttempt, TaskStores
from statebackend.microbatch.held import HeldOutput
from statebackend.microbatch.spec import BATCH_FIELDS, JOB_FIELDS, BatchSpec, JobSpec
from statebackend.microbatch.watermark import EventTimes
from statebackend.microbatch.worker import process_outlives_task
from statebackend.spark.frames import (
    arrow_batches,
    batches_to_rows,
    pandas_frames,
    pandas_with_stats,
    rows_to_batches,
    rows_to_input_batches,
)
from statebackend.spark.outputs import check_arrow, check_pandas, check_rows, check_rows_for_arrow
from statebackend.spark.stats import STATS_COLUMN, StatsRecord, TaskStats

__all__ = ["TaskRunner", "TaskStores"]

log = logging.getLogger(__name__)


def _partition_index() -> int:
    context = TaskContext.get()
    if context is None:
        raise ConfigError("the Spark driver's task function ran outside a Spark task (no TaskContext)")
    return context.partitionId()


@attrs.frozen
class TaskRunner:
    """What travels to the executors for one run of a batch: the job's spec and the batch's (pickled with them, the
    user's functions). Each ``run_*`` method is the task function of one route of the driver (:mod:`.driver`)."""

    job: JobSpec
    batch: BatchSpec

    @classmethod
    def of(cls, *, config: Any, **fields: Any) -> TaskRunner:
        """A runner from a configuration and the fields of :class:`JobSpec` and :class:`BatchSpec` together, for
        running tasks without the driver (tests and tools): ``TaskRunner.of(fn=..., config=..., batch_id=0,
        num_tasks=1, input_columns=("word",))``."""
        unknown = sorted(set(fields) - JOB_FIELDS - BATCH_FIELDS)
        if unknown:
            raise TypeError(f"TaskRunner.of: unknown field(s) {', '.join(unknown)}")
        job = JobSpec.from_config(config, **{k: v for k, v in fields.items() if k in JOB_FIELDS})
        return cls(job, BatchSpec(**{k: v for k, v in fields.items() if k in BATCH_FIELDS}))

    def run_rows(self, index: int, rows: Iterable[Any]) -> Iterator[Any]:
        """Rows mode on an RDD (classic Spark): Rows in, the function's rows out, then a :class:`StatsRecord`. Every
        row is checked against the output schema before the commit (the driver then skips Spark's own check)."""
        attempt = self._attempt(index)
        events = self._events()
        # Spark passes an iterator (iter() returns it) but promises only an iterable
        counted = Counted(events.rows(iter(rows)))
        check = check_rows(self.batch.output_struct, self._where(attempt))

        def convert(result: Any) -> Iterator[Any]:
            return check(result or ())

        outputs, stats = attempt.run(
            lambda stores: attempt.held().extend(convert(self.job.fn(stores, counted))),
            counted,
            events=events,
            convert=convert,
            drain=counted,
        )
        return self._with_stats_record(outputs, stats)

    def run_arrow_from_rows(self, index: int, rows: Iterable[Any]) -> Iterator[Any]:
        """Arrow mode through an RDD of Rows (affinity on a multi-executor cluster): the input rows become record
        batches of ``input_schema``, the function's output batches become rows, then a :class:`StatsRecord`."""
        attempt = self._attempt(index)
        events = self._events()
        counted = Counted(events.rows(iter(rows)))
        check = check_arrow(self.batch.output_schema, self._where(attempt))

        def convert(result: Any) -> Iterator[Any]:
            return check(arrow_batches(result))

        outputs, stats = attempt.run(
            lambda stores: attempt.held().extend(
                convert(self.job.fn(stores, rows_to_input_batches(counted, self.batch.input_schema)))
            ),
            counted,
            events=events,
            convert=convert,
            drain=counted,
        )
        return self._with_stats_record(batches_to_rows(outputs, self.batch.output_schema), stats)

    def run_pandas_from_rows(self, index: int, rows: Iterable[Any]) -> Iterator[Any]:
        """Pandas mode through an RDD of Rows (affinity on a multi-executor cluster)."""
        import pyarrow as pa

        attempt = self._attempt(index)
        check = check_pandas(self.batch.output_schema, self._where(attempt))

        def tables(result: Any) -> Iterator[Any]:
            return (
                pa.Table.from_pandas(part, schema=self.batch.output_schema, preserve_index=False)
                for part in check(pandas_frames(result))
            )

        def work(stores: TaskStores) -> HeldOutput:
            batches = list(rows_to_input_batches(events.rows(iter(rows)), self.batch.input_schema))
            frame = pa.Table.from_batches(batches, schema=self.batch.input_schema).to_pandas()
            counted.count = len(frame)
            return attempt.held().extend(tables(self.job.fn(stores, frame)))

        events = self._events()
        counted = Counted(iter(()))
        outputs, stats = attempt.run(work, counted, events=events, convert=tables)
        return self._with_stats_record(batches_to_rows(outputs, self.batch.output_schema), stats)

    def run_anchored(
        self,
        run: Callable[[int, Iterable[Any]], Iterator[Any]],
        deserializer: Any,
        index: int,
        partition: Iterable[Any],
    ) -> Iterator[Any]:
        """A task with affinity (the driver's ``_anchored``): the partition is one list of the task's serialized
        row batches, each read with the rows' own ``deserializer``; ``run`` (``run_rows``, ``run_arrow_from_rows``,
        ``run_pandas_from_rows``) gets the rows."""
        from pyspark.serializers import BatchedSerializer

        batched = isinstance(deserializer, BatchedSerializer)  # each element a pickled list of rows, else one row
        loads = deserializer.serializer.loads if batched else deserializer.loads

        def rows() -> Iterator[Any]:
            for elements in partition:
                for element in elements:
                    if batched:
                        yield from loads(bytes(element))
                    else:
                        yield loads(bytes(element))

        return run(index, rows())

    def run_rows_arrow(self, batches: Iterator[Any]) -> Iterator[Any]:
        """Rows mode over Arrow (Spark Connect has no RDDs): Rows in, the function's rows out as Arrow batches."""
        from pyspark.sql import Row

        def rows() -> Iterator[Any]:
            for batch in source:
                counted.count += batch.num_rows
                for record in batch.to_pylist():
                    yield Row(**record)

        attempt = self._attempt(_partition_index())
        events = self._events()
        source = events.batches(batches)
        counted = Counted(iter(()))
        check = check_rows_for_arrow(self.batch.output_schema, self._where(attempt))

        def convert(result: Any) -> Iterator[Any]:
            return check(result or ())

        outputs, stats = attempt.run(
            lambda stores: attempt.held().extend(convert(self.job.fn(stores, rows()))),
            counted,
            events=events,
            convert=convert,
            drain=source,
        )
        return self._with_stats(rows_to_batches(outputs, self.batch.output_schema), stats)

    def run_arrow(self, batches: Iterator[Any]) -> Iterator[Any]:
        attempt = self._attempt(_partition_index())
        events = self._events()
        counted = Counted(events.batches(batches), size=lambda batch: batch.num_rows)
        check = check_arrow(self.batch.output_schema, self._where(attempt))

        def convert(result: Any) -> Iterator[Any]:
            return check(arrow_batches(result))

        outputs, stats = attempt.run(
            lambda stores: attempt.held().extend(convert(self.job.fn(stores, counted))),
            counted,
            events=events,
            convert=convert,
            drain=counted,
        )
        return self._with_stats(outputs, stats)

    def run_pandas(self, frames: Iterator[Any]) -> Iterator[Any]:
        import pandas as pd

        attempt = self._attempt(_partition_index())
        check = check_pandas(self.batch.output_schema, self._where(attempt))

        def convert(result: Any) -> Iterator[Any]:
            return check(pandas_frames(result))

        def work(stores: TaskStores) -> HeldOutput:
            parts = list(frames)
            frame = pd.concat(parts, ignore_index=True) if parts else pd.DataFrame(columns=list(self.job.input_columns))
            counted.count = len(frame)
            return attempt.held().extend(convert(self.job.fn(stores, events.frame(frame))))

        events = self._events()
        counted = Counted(iter(()))
        outputs, stats = attempt.run(work, counted, events=events, convert=convert)
        if self._reported(stats):
            return iter(outputs)
        return pandas_with_stats(outputs, stats, self.batch.output_schema)

    def _attempt(self, index: int) -> TaskAttempt:
        context = TaskContext.get()
        return TaskAttempt(
            self.job,
            self.batch,
            index,
            attempt=context.attemptNumber() if context is not None else 0,
            outlives_task=process_outlives_task(context),
        )

    def _where(self, attempt: TaskAttempt) -> str:
        return f"{attempt.name}, batch {self.batch.batch_id}"

    def _events(self) -> EventTimes:
        """What reads the largest event time of this task's input (nothing without an event-time column)."""
        return EventTimes(self.job.event_time, self.job.event_time_type, self.job.time_zone)

    def _reported(self, stats: TaskStats) -> bool:
        """Report ``stats`` through the driver's accumulator, if there is one (classic Spark)."""
        if self.batch.stats_to is None:
            return False
        self.batch.stats_to.add([stats])
        return True

    def _with_stats_record(self, outputs: Iterable[Any], stats: TaskStats) -> Iterator[Any]:
        """The output elements, then a :class:`StatsRecord` (unless ``stats`` went to the accumulator)."""
        if self._reported(stats):
            return iter(outputs)
        return chain(outputs, [StatsRecord(stats)])

    def _with_stats(self, batches: Iterable[Any], stats: TaskStats) -> Iterator[Any]:
        """The output batches, with :data:`STATS_COLUMN` (null) appended and then one row carrying ``stats`` unless
        ``stats`` went to the accumulator."""
        if self._reported(stats):
            return iter(batches)
        return self._with_stats_column(batches, stats)

    def _with_stats_column(self, batches: Iterable[Any], stats: TaskStats) -> Iterator[Any]:
        import pickle

        import pyarrow as pa

        schema = self.batch.output_schema
        field = pa.field(STATS_COLUMN, pa.binary())
        for batch in batches:
            yield batch.append_column(field, pa.nulls(batch.num_rows, pa.binary()))
        nulls = [pa.nulls(1, f.type) for f in schema]
        yield pa.RecordBatch.from_arrays(
            [*nulls, pa.array([pickle.dumps(stats)], pa.binary())],
            schema=pa.schema([*(f.with_nullable(True) for f in schema), field]),
        )
