"""The driver and ``read_state`` under Spark Connect (no SparkContext, RDD or accumulator), and statebackend keys
from the Spark conf (``spark.statebackend.*``) on classic Spark."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from statebackend.errors import ConfigError
from statebackend.spark.session import effective_config, is_connect
from tests.connect_child import command
from tests.script_runs import ScriptRuns, register
from tests.spark_helpers import report_of, word_job
from tests.test_spark import OUTPUT, batch_count, count_rows, make_config, run_batch, state_of

pytest_plugins = ["tests.spark_fixtures"]
pytestmark = [pytest.mark.spark, pytest.mark.slow]


# the child that runs under Spark Connect (tests/connect_child.py; its own process: a local Connect server cannot share
# a JVM with the test session's classic SparkContext), shared with tests/test_spark_connect_timers.py and run in the
# background with the suite's other scripts (tests/script_runs.py)
register(
    "spark-connect", __name__, ["test_every_mode_replay_streaming_query_and_read_state_under_spark_connect"], command
)


@pytest.mark.connect
def test_every_mode_replay_streaming_query_and_read_state_under_spark_connect(script_runs: ScriptRuns) -> None:
    report = report_of(script_runs.result("spark-connect"))
    assert report["connect"] is True
    result = report["driver"]
    for mode in ("rows", "arrow", "pandas"):
        outcome = result[mode]
        assert outcome["output_ok"], mode
        assert outcome["replay_same_output"], mode
        assert outcome["state_ok"], mode
        assert outcome["state_after_batch_0_ok"], mode
        # stats came back without an accumulator: the replay of batch 2 restored #2 and committed #4 in each task
        assert outcome["stats"] == [[0, 2, 4], [1, 2, 4], [2, 2, 4]], mode
    assert result["stream_state_ok"]


def test_keys_from_the_spark_conf_fill_in_and_keys_in_code_win(spark: Any, tmp_path: Path) -> None:
    assert not is_connect(spark)
    config = make_config(tmp_path)
    given = config.pop("stores.counts.msg.serde")
    spark.conf.set("spark.statebackend.stores.counts.msg.serde", given)
    spark.conf.set("spark.statebackend.job.name", "from-the-spark-conf")
    try:
        merged = effective_config(spark, config)
        assert merged["stores.counts.msg.serde"] == given  # filled in from the Spark conf
        assert merged["job.name"] == "wordcount"  # given in code: wins
        job = word_job(count_rows, config, num_tasks=3, output_schema=OUTPUT)
        for batch_id in range(2):
            run_batch(spark, job, batch_id)
        assert state_of(spark, dict(config, **{"stores.counts.msg.serde": given})) == batch_count(spark, [0, 1])
    finally:
        spark.conf.unset("spark.statebackend.stores.counts.msg.serde")
        spark.conf.unset("spark.statebackend.job.name")


def test_a_wrong_key_in_the_spark_conf_is_named(spark: Any, tmp_path: Path) -> None:
    spark.conf.set("spark.statebackend.changelog.snapshot.intervl.commits", "3")
    try:
        with pytest.raises(ConfigError, match="changelog.snapshot.intervl.commits"):
            word_job(count_rows, make_config(tmp_path), num_tasks=3, output_schema=OUTPUT)
    finally:
        spark.conf.unset("spark.statebackend.changelog.snapshot.intervl.commits")
