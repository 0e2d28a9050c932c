"""Trust of rescaling and of the batch clock, run in this process without a SparkSession: a stored key's key group is
the one Spark routes its row to, a key held by the wrong task is an error (never a silent loss), a task never
restores its checkpoint of an abandoned attempt, and an expired key never comes back."""

from __future__ import annotations

import datetime
import time
from collections.abc import Iterator

import pytest

from statebackend.spark.keygroups import hash_long, spark_hash


@pytest.fixture
def new_york(monkeypatch: pytest.MonkeyPatch) -> Iterator[None]:
    """The process runs in a time zone other than UTC, as a Spark executor may."""
    monkeypatch.setenv("TZ", "America/New_York")
    time.tzset()
    yield
    monkeypatch.undo()
    time.tzset()


@pytest.mark.usefixtures("new_york")
def test_a_timestamp_key_hashes_as_spark_hashes_its_row_in_any_time_zone() -> None:
    """Spark hashes a timestamp as its microseconds since the epoch; a task's Row holds it as a naive datetime in the
    process's local time (PySpark's TimestampType.fromInternal), a tz-aware one from Arrow."""
    import pandas as pd
    from pyspark.sql.types import TimestampNTZType, TimestampType

    july = 1_719_835_200_123_456  # 2024-07-01 12:00:00.123456 UTC (summer time in New York)
    ambiguous = 1_730_615_400_000_000  # 2024-11-03 06:30 UTC: 01:30 in New York, the second time (fold=1)
    for micros in (july, ambiguous, ambiguous - 3_600_000_000, -315_619_200_000_000, -1, 0):
        row_value = TimestampType().fromInternal(micros)
        assert row_value.tzinfo is None
        assert spark_hash([row_value], ["timestamp"]) == hash_long(micros), row_value
        assert spark_hash([pd.Timestamp(row_value)], ["timestamp"]) == hash_long(micros), row_value
        aware = datetime.datetime.fromtimestamp(micros // 1_000_000, datetime.UTC).replace(
            microsecond=micros % 1_000_000)
        assert spark_hash([aware.astimezone(_zone("Europe/Berlin"))], ["timestamp"]) == hash_long(micros)
        ntz = TimestampNTZType().fromInternal(micros)  # wall-clock time, hashed as if UTC
        assert spark_hash([ntz], ["timestamp_ntz"]) == hash_long(micros)


def _zone(name: str) -> datetime.tzinfo:
    from zoneinfo import ZoneInfo

    return ZoneInfo(name)

