"""A heartbeat for a stream whose timers must fire when its input stops.

Spark runs a micro-batch only when a source has new input (foreachBatch queries run no "no-data" batches), so a job
whose input stops runs no batch and fires no timer, however due. :func:`with_heartbeat` unions a ``rate`` source into
the stream: it has a new row every second, so the query runs a batch at every trigger, with or without input. Its
rows carry :data:`HEARTBEAT_COLUMN` (true; null in the stream's own rows) and every other column null;
:class:`~statebackend.spark.StatefulForeachBatch` drops them (and the column) before anything else, so the job's
function never sees them, its output and state are the same as without them, and every task still runs each batch
(with no rows, or with its rows) and fires its due timers.

By default event-time timers still wait for data: the watermark moves only with the event times of real rows (as
Spark's own event-time timers wait for data), so the heartbeat fires processing-time timers only.
``with_heartbeat(stream, advance_watermark=True)`` asks for more: its rows are marked by
:data:`HEARTBEAT_CLOCK_COLUMN` instead, and every batch counts its batch clock (``stores.now_ms``) as an event time
seen, so with no input the watermark still reaches ``clock - watermark_delay`` at the next batch and event-time timers
fire. The cost is in correctness for late data: processing time stands in for event time, so a row whose event time is
more than ``watermark_delay`` behind the batch clock when it arrives is late (below the watermark: dropped with
``drop_late=True``, ``stores.is_late`` true, and a timer registered at its event time fires in the next batch). Choose
the delay as the lag of the slowest source (its event time behind the clock), not only the disorder of the stream.
Under ``Trigger.AvailableNow`` a query stops once it has read what its sources had at its start, the rate
source included: the heartbeat then adds no batch after that (docs/spark.md, "Timers stop with the input").
"""

from __future__ import annotations

from typing import Any

from pyspark.sql import DataFrame
from pyspark.sql.functions import col, lit

from statebackend.errors import ConfigError

__all__ = ["HEARTBEAT_CLOCK_COLUMN", "HEARTBEAT_COLUMN", "drop_heartbeats", "has_heartbeat_clock", "with_heartbeat"]

#: the column that marks a heartbeat row (true); null in the stream's own rows
HEARTBEAT_COLUMN = "__statebackend_heartbeat"
#: the column that marks a heartbeat row of ``with_heartbeat(advance_watermark=True)``: its presence in a batch tells
#: the driver to count the batch clock as an event time seen
HEARTBEAT_CLOCK_COLUMN = "__statebackend_heartbeat_clock"


def with_heartbeat(stream: DataFrame, *, advance_watermark: bool = False) -> DataFrame:
    """``stream`` with a ``rate`` source's rows (one a second) unioned in, marked by :data:`HEARTBEAT_COLUMN`: the
    query then runs a batch at every trigger (``trigger(processingTime=...)`` sets how often timers are checked), and
    the driver drops these rows before the job's function. Apply it last, after ``withWatermark`` and any other
    operation on the stream, right before ``writeStream``. ``advance_watermark``: the watermark of a job with
    ``event_time`` also moves with the batch clock, so event-time timers fire without input (see the module
    docstring for what that costs late rows)."""
    if not isinstance(advance_watermark, bool):
        raise ConfigError(f"with_heartbeat advance_watermark must be True or False, got {advance_watermark!r}")
    marker = HEARTBEAT_CLOCK_COLUMN if advance_watermark else HEARTBEAT_COLUMN
    if not stream.isStreaming:
        raise ConfigError(
            "with_heartbeat takes a streaming DataFrame (spark.readStream...): a batch DataFrame runs "
            "once and has no timers to keep firing"
        )
    present = [c for c in (HEARTBEAT_COLUMN, HEARTBEAT_CLOCK_COLUMN) if c in stream.columns]
    if present:
        raise ConfigError(f"with_heartbeat: the stream already has a heartbeat (column {present[0]!r})")
    ticks: Any = (
        stream.sparkSession.readStream.format("rate").option("rowsPerSecond", 1).option("numPartitions", 1).load()
    )
    ticks = ticks.select(
        *(lit(None).cast(field.dataType).alias(field.name) for field in stream.schema.fields),
        lit(True).alias(marker),
    )
    return stream.withColumn(marker, lit(None).cast("boolean")).unionByName(ticks)


def has_heartbeat_clock(batch_df: DataFrame) -> bool:
    """Whether a micro-batch comes from ``with_heartbeat(advance_watermark=True)`` (its schema says: no Spark job)."""
    return HEARTBEAT_CLOCK_COLUMN in batch_df.columns


def drop_heartbeats(batch_df: DataFrame) -> DataFrame:
    """A micro-batch without its heartbeat rows and column (unchanged when it has none)."""
    for marker in (HEARTBEAT_COLUMN, HEARTBEAT_CLOCK_COLUMN):
        if marker in batch_df.columns:
            return batch_df.filter(col(marker).isNull()).drop(marker)
    return batch_df
