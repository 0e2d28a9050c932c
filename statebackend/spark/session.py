"""A local SparkSession for statebackend jobs on one machine (examples, tests, benchmarks)."""

from __future__ import annotations

import logging
from collections.abc import Mapping
from pathlib import Path

from pyspark.sql import SparkSession

log = logging.getLogger(__name__)

def local_spark_session(
    app_name: str = "statebackend", master: str = "local[2]", conf: Mapping[str, str] | None = None
) -> SparkSession:
    """A local SparkSession set up for statebackend jobs on one machine (examples, tests, benchmarks).

    Python workers run this interpreter (``PYSPARK_PYTHON``, unless set) and can import statebackend even when it is
    not installed (its source root is put on ``PYTHONPATH``); the UI and progress bars are off and shuffles use a few
    partitions, which is what a 2-core machine wants. ``conf`` adds or overrides Spark settings.
    """
    import os
    import sys

    os.environ.setdefault("PYSPARK_PYTHON", sys.executable)
    root = str(Path(__file__).resolve().parents[2])  # the source root that holds the statebackend package
    paths = [p for p in os.environ.get("PYTHONPATH", "").split(os.pathsep) if p]
    if root not in paths:
        os.environ["PYTHONPATH"] = os.pathsep.join([root, *paths])
    builder = SparkSession.builder.appName(app_name).master(master)
    settings = {
        "spark.ui.enabled": "false",
        "spark.ui.showConsoleProgress": "false",
        "spark.sql.shuffle.partitions": "4",
        "spark.driver.memory": "2g",
        **(conf or {}),
    }
    for key, value in settings.items():
        builder = builder.config(key, value)
    return builder.getOrCreate()


