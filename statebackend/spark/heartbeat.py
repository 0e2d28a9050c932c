"""A heartbeat for a stream whose timers must fire when its input stops.

Spark runs a micro-batch only when a source has new input (foreachBatch queries run no "no-data" batches), so a job
whose input stops runs no batch and fires no timer, however due. :func:`with_heartbeat` unions a ``rate`` source into
the stream: it has a new row every second, so the query runs a batch at every trigger, with or without input. Its
rows carry :data:`HEARTBEAT_COLUMN` (true; null in the stream's own rows) and every other column null;
:class:`~statebackend.spark.StatefulForeachBatch` drops them (and the column) before anything else, so the job's
function never sees them, its output and state are the same as without them, and every task still runs each batch
(with no rows, or with its rows) and fires its due timers.

What it does not do: event-time timers fire when the watermark passes them, and the watermark moves only with the
event times of real rows, so a heartbeat fires processing-time timers only (as Spark's own event-time timers wait for
data). Under ``Trigger.AvailableNow`` a query stops once it has read what its sources had at its start, the rate
source included: the heartbeat then adds no batch after that (docs/spark.md, "Timers stop with the input").
"""

from __future__ import annotations

from typing import Any

from pyspark.sql import DataFrame
from pyspark.sql.functions import col, lit

from statebackend.errors import ConfigError

__all__ = ["HEARTBEAT_COLUMN", "drop_heartbeats", "with_heartbeat"]

#: the column that marks a heartbeat row (true); null in the stream's own rows
HEARTBEAT_COLUMN = "__statebackend_heartbeat"


def with_heartbeat(stream: DataFrame) -> DataFrame:
    """``stream`` with a ``rate`` source's rows (one a second) unioned in, marked by :data:`HEARTBEAT_COLUMN`: the
    query then runs a batch at every trigger (``trigger(processingTime=...)`` sets how often timers are checked), and
    the driver drops these rows before the job's function. Apply it last, after ``withWatermark`` and any other
    operation on the stream, right before ``writeStream``."""
    if not stream.isStreaming:
        raise ConfigError(
            "with_heartbeat takes a streaming DataFrame (spark.readStream...): a batch DataFrame runs "
            "once and has no timers to keep firing"
        )
    if HEARTBEAT_COLUMN in stream.columns:
        raise ConfigError(f"with_heartbeat: the stream already has a heartbeat (column {HEARTBEAT_COLUMN!r})")
    ticks: Any = (
        stream.sparkSession.readStream.format("rate").option("rowsPerSecond", 1).option("numPartitions", 1).load()
    )
    ticks = ticks.select(
        *(lit(None).cast(field.dataType).alias(field.name) for field in stream.schema.fields),
        lit(True).alias(HEARTBEAT_COLUMN),
    )
    return stream.withColumn(HEARTBEAT_COLUMN, lit(None).cast("boolean")).unionByName(ticks)


def drop_heartbeats(batch_df: DataFrame) -> DataFrame:
    """A micro-batch without its heartbeat rows and column (unchanged when it has none)."""
    if HEARTBEAT_COLUMN not in batch_df.columns:
        return batch_df
    return batch_df.filter(col(HEARTBEAT_COLUMN).isNull()).drop(HEARTBEAT_COLUMN)
