"""The Spark session: a local one for statebackend jobs on one machine (examples, tests, benchmarks), and what the
library reads from a session (whether it is Spark Connect, its executors, whether it speculates, the
``spark.statebackend.*`` keys of its conf)."""

from __future__ import annotations

import logging
from collections.abc import Mapping
from pathlib import Path
from typing import Any

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


def speculation(spark: SparkSession) -> bool:
    """Whether Spark may run speculative copies of tasks (``spark.speculation``)."""
    try:
        return str(spark.conf.get("spark.speculation", "false")).strip().lower() == "true"
    except Exception:  # noqa: BLE001 - a conf that cannot be read: assume the worst
        return True


def is_local_master(master: str) -> bool:
    """``local``, ``local[n]``, ``local[*]``, ``local[n, f]``: one executor in the driver (not ``local-cluster``)."""
    return master == "local" or master.startswith("local[")


def living_executors(context: Any) -> list[str]:
    """The ids of the executors Spark's scheduler has now (``SparkContext.getExecutorIds`` of the py4j SparkContext
    ``context``, sorted; empty in local mode, and for a scheduler backend that does not say)."""
    return sorted(e for e in str(context.getExecutorIds().mkString("\n")).split("\n") if e)


def spark_executors(spark: SparkSession) -> int:
    """How many executors the application has now (classic Spark; local mode: 1): the scheduler's living executors
    (``getExecutorIds``), the view the driver's spread of tasks reads too. The block managers' count can lag it (a
    new executor's block manager registers after the executor), and a batch that counted one executor there while
    two ran took the unpinned route: a task landed on the new executor and the next batch moved it back. Where the
    scheduler lists none (a backend that does not say): the block managers, minus the driver's."""
    try:
        context = spark.sparkContext._jsc.sc()
        living = living_executors(context)
        if living:
            return len(living)
        return max(1, int(context.getExecutorMemoryStatus().size()) - 1)
    except Exception:  # noqa: BLE001 - no such call here: take it as one executor (no affinity needed)
        return 1


def is_connect(spark: SparkSession) -> bool:
    """Whether ``spark`` is a Spark Connect session (no SparkContext, RDDs or accumulators)."""
    return type(spark).__module__.startswith("pyspark.sql.connect")


#: keys of the Spark conf under this prefix are statebackend keys (``spark.statebackend.job.name`` is ``job.name``):
#: ``spark-submit --conf`` only passes keys that start with ``spark.``
SPARK_CONF_PREFIX = "spark.statebackend."


#: classic sessions: the text of the last conf read (``toString`` of the Java map: every key and value) -> the
#: statebackend keys in it. Keyed by content, not by session: ``foreachBatch`` hands every batch a new Python wrapper
#: of the query's session, and equal confs give equal keys.
_CONF_CACHE: dict[str, dict[str, str]] = {}


def spark_conf_keys(spark: SparkSession) -> dict[str, str]:
    """The statebackend keys set in the session's Spark conf (``spark.statebackend.*``), prefix removed.

    On a classic session, reading the conf entry by entry through py4j costs two round trips per entry, and the end of
    py4j's iteration is a Java exception that PySpark converts with a dozen more (together tens of ms, every batch).
    So one round trip fetches the conf's text (``toString`` of its Java map: every key and value); the keys are read
    again only when that text differs from the last read's."""
    java_conf = getattr(getattr(spark, "conf", None), "_jconf", None)
    if java_conf is not None:
        try:
            entries = _java_conf_map(spark, java_conf)
            text = str(entries.toString())
        except Exception:  # noqa: BLE001 - no such call on this Spark version: read the whole conf below
            text = None
        if text is not None:
            cached = _CONF_CACHE.get(text)
            if cached is None:
                cached = _read_java_map_keys(entries)
                _CONF_CACHE.clear()
                _CONF_CACHE[text] = cached
            return dict(cached)
    return _read_conf_keys(spark)


def _java_conf_map(spark: SparkSession, java_conf: Any) -> Any:
    """A classic session's runtime conf as one Java ``Map<String, String>``: ``getAllAsJava`` on Spark 4; Spark 3.5's
    ``RuntimeConfig`` has only ``getAll``, a Scala map, made a Java one by Scala's converters (still one round trip).
    The runtime conf holds the keys set with ``spark.conf.set`` as well as those the application started with."""
    import pyspark

    if int(pyspark.__version__.split(".")[0]) >= 4:
        return java_conf.getAllAsJava()
    jvm = spark._jvm
    assert jvm is not None, "a classic session has a JVM"
    return jvm.scala.collection.JavaConverters.mapAsJavaMap(java_conf.getAll())


def _read_java_map_keys(entries: Any) -> dict[str, str]:
    """The statebackend keys of a Java ``Map<String, String>``: its keys as one array (indexed, not iterated: no
    exception at the end), then the values of ours only."""
    names = [str(name) for name in entries.keySet().toArray()]
    return {
        name[len(SPARK_CONF_PREFIX) :]: str(entries.get(name))
        for name in names
        if name.startswith(SPARK_CONF_PREFIX) and len(name) > len(SPARK_CONF_PREFIX)
    }


def _read_conf_keys(spark: SparkSession) -> dict[str, str]:
    try:
        entries = dict(spark.conf.getAll)  # Spark 4: a property, on classic and Connect sessions alike
    except (AttributeError, TypeError):
        # no runtime conf readable (the Java map above failed): the conf the application started with
        entries = dict(spark.sparkContext.getConf().getAll())
    return {
        key[len(SPARK_CONF_PREFIX) :]: value
        for key, value in entries.items()
        if key.startswith(SPARK_CONF_PREFIX) and len(key) > len(SPARK_CONF_PREFIX)
    }


def effective_config(spark: SparkSession, config: Mapping[str, Any]) -> dict[str, Any]:
    """``config`` over the session's ``spark.statebackend.*`` keys: a key given in code wins over the same key in the
    Spark conf (as in Spark, where a setting made in code wins over ``spark-submit --conf``)."""
    merged: dict[str, Any] = dict(spark_conf_keys(spark))
    merged.update(config)
    return merged  # parsed by the caller, once per configuration: a wrong key from the Spark conf fails there
