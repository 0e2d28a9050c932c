"""Event time: the watermark each batch fires event-time timers at, derived the way Spark's ``withWatermark`` does.

Contract:

- The watermark batch ``N`` uses is the largest event time seen in batches before ``N`` minus the delay, never
  lower than the previous batch's (None until an event time was seen). The driver derives it per batch
  (:class:`EventClock`) and every task of the batch gets it.
- Every task records in its checkpoint the watermark its batch used (input offset :data:`WATERMARK_OFFSET`) and the
  largest event time seen so far: the largest of batches before (the driver hands it on) and of its own input
  (:data:`EVENT_MAX_OFFSET`). A replay of a batch the task committed takes the watermark its checkpoint recorded,
  and a task never goes below the watermark of the checkpoint it starts from.
- A driver that does not know the previous batch's values (its first batch after a start, a task whose stats did not
  come back) reads them from the checkpoints of the newest batch below ``N`` (:func:`recover_event_clock`, one Spark
  task reading every task's log from the blob store): the largest event time is the largest any task recorded, so
  the watermark is the one a driver that never stopped would have derived.
- The tasks read the event times of their input (:class:`EventTimes`): a ``timestamp`` column (its instant), a
  ``timestamp_ntz`` column (its wall-clock time taken as UTC), or a ``long``/``integer`` column of ms since the epoch.
  A null event time is passed over.
- **Late rows.** A row is late when its event time is below the batch's watermark (``event < watermark``), as in
  Spark, where a stateful operator drops a row whose event time is below the watermark and fires a timer whose time
  is at or below it (``at <= watermark``, :func:`statebackend.microbatch.timers.take_due`): a row at exactly the
  watermark is on time, and a timer registered for it at its own event time fires in the next batch. Rows are
  dropped for the function only when the job asks (``StatefulForeachBatch(drop_late=True)``: :attr:`EventTimes.
  drop_below`); otherwise the function sees them and may ask ``stores.is_late(event_time)``. A late row still
  counts towards the largest event time (it cannot raise it: it is below the watermark already).
"""

from __future__ import annotations

import datetime
import logging
from collections.abc import Iterable, Iterator, Sequence
from typing import Any

import attrs

from statebackend.config import parse_duration_ms
from statebackend.errors import ConfigError, InconsistentStateError
from statebackend.microbatch.batches import (
    EVENT_MAX_OFFSET,
    WATERMARK_OFFSET,
    _newest_below,
    batch_of,
    layout_of,
    task_name,
)
from statebackend.microbatch.keygroups import _epoch_micros

__all__ = [
    "EVENT_TIME_TYPES",
    "EventClock",
    "EventTimes",
    "next_watermark",
    "parse_delay",
    "recorded_ms",
    "recover_event_clock",
]

log = logging.getLogger(__name__)

#: Spark type names an event-time column may have
EVENT_TIME_TYPES = ("timestamp", "timestamp_ntz", "long", "integer")


def parse_delay(value: Any) -> int:
    """The watermark delay in ms: an int of ms, a ``datetime.timedelta``, or a duration such as ``"10s"``,
    ``"5min"``, ``"1h"``."""
    if isinstance(value, datetime.timedelta):
        value = int(value / datetime.timedelta(milliseconds=1))
    return int(parse_duration_ms(min=0)("StatefulForeachBatch watermark_delay", value))


def next_watermark(watermark_ms: int | None, event_max_ms: int | None, delay_ms: int) -> int | None:
    """The watermark of the batch after one that used ``watermark_ms``, when the largest event time seen up to and
    including that batch is ``event_max_ms``: never decreasing, None while no event time was seen."""
    candidates = [w for w in (watermark_ms, None if event_max_ms is None else event_max_ms - delay_ms) if w is not None]
    return max(candidates) if candidates else None


def recorded_ms(entry: Any, offset: str) -> int | None:
    """An int input offset of a checkpoint's log entry (or a checkpoint), or None."""
    checkpoint = getattr(entry, "checkpoint", entry)
    raw = checkpoint.input_offsets.get(offset) if checkpoint is not None else None
    try:
        return None if raw is None else int(raw)
    except ValueError:
        return None


@attrs.define
class EventClock:
    """The driver's view of event time: after which batch, the watermark it used and the largest event time seen up
    to and including it."""

    delay_ms: int
    #: (batch id, its watermark, the largest event time through it) of the last batch whose every task reported
    _known: tuple[int, int | None, int | None] | None = None

    def for_batch(self, spark: Any, settings: Any, batch_id: int) -> tuple[int | None, int | None]:
        """(the watermark of ``batch_id``, the largest event time of the batches before it)."""
        if self._known is not None and self._known[0] == batch_id - 1:
            _, watermark, event_max = self._known
        else:
            watermark, event_max = recover_event_clock(spark, settings, batch_id)
            log.info(
                "batch %d: event time recovered from the checkpoints below it: watermark %s, largest event time %s",
                batch_id,
                watermark,
                event_max,
            )
        return next_watermark(watermark, event_max, self.delay_ms), event_max

    def completed(self, batch_id: int, stats: Sequence[Any], num_tasks: int) -> None:
        """Batch ``batch_id`` ran to its end with ``stats``: remember its values, or forget them when a task's stats
        are missing (the next batch then reads them from the checkpoints)."""
        if {s.task_index for s in stats} != set(range(num_tasks)):
            self._known = None
            return
        watermarks = [s.watermark_ms for s in stats if s.watermark_ms is not None]
        maxima = [s.event_max_ms for s in stats if s.event_max_ms is not None]
        self._known = (batch_id, max(watermarks) if watermarks else None, max(maxima) if maxima else None)


def recover_event_clock(spark: Any, settings: Any, batch_id: int) -> tuple[int | None, int | None]:
    """(watermark, largest event time) recorded by the checkpoints of the newest batch below ``batch_id``, read on an
    executor (one task: executors reach the blob store, the driver need not)."""
    from pyspark.sql.pandas.types import to_arrow_schema
    from pyspark.sql.types import LongType, StructField, StructType

    schema = StructType([StructField("watermark", LongType(), True), StructField("event_max", LongType(), True)])
    reader = _ClockReader(settings, batch_id, to_arrow_schema(schema))
    rows = spark.range(0, 1, 1, 1).mapInArrow(reader.read_arrow, schema).collect()
    return rows[0]["watermark"], rows[0]["event_max"]


@attrs.frozen
class _ClockReader:
    #: the job's settings (statebackend.config.Settings), as the driver parsed them
    settings: Any
    batch_id: int
    schema: Any

    def read_arrow(self, batches: Iterable[Any]) -> Iterator[Any]:
        import pyarrow as pa

        for _ in batches:
            pass
        watermark, event_max = self.read()
        yield pa.RecordBatch.from_arrays(
            [pa.array([watermark], pa.int64()), pa.array([event_max], pa.int64())], schema=self.schema
        )

    def read(self) -> tuple[int | None, int | None]:
        from statebackend.blobstores.base import open_blob_store
        from statebackend.lifecycle import task_checkpoint_log

        settings = self.settings
        blob_store = open_blob_store(settings.blob_store_url, settings.blob_store_options)
        try:
            zero = task_name(0)
            zero_log = task_checkpoint_log(settings, blob_store, zero)
            first = _newest_below(zero_log, zero_log.latest(), zero, self.batch_id)
            if first is None:
                return None, None  # the job's first batch
            previous = batch_of(first, zero)
            entries = [first]
            for index in range(1, layout_of(first, zero).tasks):
                name = task_name(index)
                task_log = task_checkpoint_log(settings, blob_store, name)
                entry = _newest_below(task_log, task_log.latest(), name, self.batch_id)
                if entry is None or batch_of(entry, name) != previous:
                    raise InconsistentStateError(
                        f"batch {self.batch_id}: the watermark is derived from every task's checkpoint of batch "
                        f"{previous}, but {name}'s newest below batch {self.batch_id} is "
                        f"{'none' if entry is None else f'of batch {batch_of(entry, name)}'}: its checkpoints are "
                        "missing from the blob store"
                    )
                entries.append(entry)
        finally:
            blob_store.close()
        watermarks = [w for w in (recorded_ms(e, WATERMARK_OFFSET) for e in entries) if w is not None]
        maxima = [m for m in (recorded_ms(e, EVENT_MAX_OFFSET) for e in entries) if m is not None]
        return (max(watermarks) if watermarks else None), (max(maxima) if maxima else None)


class EventTimes:
    """The largest event time of one task's input, read as the input passes (rows, Arrow batches, pandas frames).

    ``column`` None: event time is off and every method passes its input through untouched."""

    def __init__(self, column: str | None, type_name: str = "", time_zone: str = "UTC") -> None:
        self.column = column
        self.type_name = type_name
        self.time_zone = time_zone
        self.max_ms: int | None = None
        #: rows whose event time is below this are dropped as they pass (None: none is); set by the task attempt to
        #: the batch's watermark when the job drops late rows, before the input is read
        self.drop_below: int | None = None
        #: how many rows were dropped as late
        self.dropped = 0

    def ms_of(self, value: Any) -> int:
        """ms since the epoch of an event time as a row holds it: a datetime (``timestamp``: naive is the local
        time of the process, as PySpark's rows have it; ``timestamp_ntz``: its wall clock as UTC) or an int of ms."""
        if hasattr(value, "item") and not isinstance(value, (int, datetime.datetime)):
            value = value.item()  # a numpy scalar
        if hasattr(value, "to_pydatetime"):
            value = value.to_pydatetime()  # a pandas Timestamp
        return self._row_ms(value)

    def rows(self, rows: Iterator[Any]) -> Iterator[Any]:
        if self.column is None:
            return rows
        return self._rows(rows)

    def batches(self, batches: Iterator[Any]) -> Iterator[Any]:
        if self.column is None:
            return batches
        return self._batches(batches)

    def frame(self, frame: Any) -> Any:
        """A pandas frame (naive timestamps are in the session's time zone, as PySpark hands them over)."""
        if self.column is None or frame.empty:
            return frame
        import pandas as pd

        series = frame[self.column].dropna()
        if series.empty:
            return frame
        if self.type_name in ("long", "integer"):
            self._see(int(series.max()))
            return self._frame_on_time(frame, series < self.drop_below if self.drop_below is not None else None)
        stamps = pd.to_datetime(series)
        if stamps.dt.tz is None:
            stamps = stamps.dt.tz_localize(
                "UTC" if self.type_name == "timestamp_ntz" else self.time_zone, ambiguous="NaT", nonexistent="NaT"
            ).dropna()
        if not stamps.empty:
            self._see(int(stamps.max().value // 1_000_000))
        if self.drop_below is None:
            return frame
        return self._frame_on_time(frame, stamps < pd.Timestamp(self.drop_below, unit="ms", tz="UTC"))

    def _frame_on_time(self, frame: Any, late: Any) -> Any:
        """``frame`` without the rows ``late`` (a boolean series over some of its index) marks."""
        if late is None:
            return frame
        late_index = late[late].index
        if len(late_index):
            self.dropped += len(late_index)
            frame = frame.drop(index=late_index).reset_index(drop=True)
        return frame

    def _rows(self, rows: Iterator[Any]) -> Iterator[Any]:
        column = self.column
        for row in rows:
            value = row[column]
            if value is not None:
                ms = self._row_ms(value)
                self._see(ms)
                if self.drop_below is not None and ms < self.drop_below:
                    self.dropped += 1
                    continue
            yield row

    def _row_ms(self, value: Any) -> int:
        if isinstance(value, datetime.datetime):
            return _epoch_micros(value, local=self.type_name != "timestamp_ntz") // 1000
        if isinstance(value, int) and not isinstance(value, bool):
            return value
        raise ConfigError(
            f"event-time column {self.column!r} holds {value!r}: an event time is a timestamp or "
            "ms since the epoch (long)"
        )

    def _batches(self, batches: Iterator[Any]) -> Iterator[Any]:
        import pyarrow as pa
        import pyarrow.compute as pc

        for batch in batches:
            column = batch.column(self.column)
            if column.null_count < len(column):
                largest = pc.max(column)
                if pa.types.is_timestamp(column.type):  # the instant (the wall clock as UTC without a zone)
                    self._see(_unit_ms(int(largest.value), column.type.unit))
                else:
                    self._see(int(largest.as_py()))
                if self.drop_below is not None:
                    batch = self._on_time(batch, column)
            yield batch

    def _on_time(self, batch: Any, column: Any) -> Any:
        """``batch`` without its late rows (a null event time is kept)."""
        import pyarrow as pa
        import pyarrow.compute as pc

        assert self.drop_below is not None
        if pa.types.is_timestamp(column.type):
            unit = column.type.unit
            per_ms = {"s": None, "ms": 1, "us": 1000, "ns": 1_000_000}[unit]
            # the smallest raw value at or above the bound, in the column's unit
            bound = -(-self.drop_below // 1000) if per_ms is None else self.drop_below * per_ms
            raw = pc.cast(column, pa.int64())
        else:
            bound, raw = self.drop_below, column
        keep = pc.or_kleene(pc.is_null(raw), pc.greater_equal(raw, pa.scalar(bound, pa.int64())))
        kept = batch.filter(keep)
        self.dropped += batch.num_rows - kept.num_rows
        return kept

    def _see(self, event_ms: int) -> None:
        if self.max_ms is None or event_ms > self.max_ms:
            self.max_ms = event_ms


def _unit_ms(raw: int, unit: str) -> int:
    """ms of a raw Arrow timestamp in ``unit`` (rounded down)."""
    return raw * 1000 if unit == "s" else raw if unit == "ms" else raw // (1000 if unit == "us" else 1_000_000)
