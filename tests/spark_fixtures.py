"""One local SparkSession for the whole test session (starting one costs seconds on a small machine).

Load the fixture in a test module with ``pytest_plugins = ["tests.spark_fixtures"]``. The master is
``local[2,2]``: two cores and ``spark.task.maxFailures=2``, so a task attempt made to fail once is retried once.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import pytest


@pytest.fixture(scope="session")
def spark() -> Iterator[Any]:
    from statebackend.spark import local_spark_session

    session = local_spark_session(
        "statebackend-tests",
        master="local[2,2]",
        conf={"spark.sql.shuffle.partitions": "2", "spark.default.parallelism": "2"},
    )
    session.sparkContext.setLogLevel("ERROR")
    yield session
    session.stop()
