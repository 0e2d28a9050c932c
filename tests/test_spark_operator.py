"""What an operator sees of a Spark job: a wrong blob store when the job is built, a bad value or a bad output row
as the first line of the driver's error with nothing committed for the batch, one INFO line per batch, and the
driver's metrics per task."""

from __future__ import annotations

import decimal
import logging
from pathlib import Path
from typing import Any

import pytest

from statebackend.errors import StorageError, TaskFailedError
from statebackend.task import TaskStorage
from tests.spark_helpers import word_job
from tests.test_spark import count_rows, make_config

pytest_plugins = ["tests.spark_fixtures"]
pytestmark = [pytest.mark.spark, pytest.mark.slow]


def words(spark: Any, *values: str) -> Any:
    return spark.createDataFrame([(w,) for w in values], "word string")


def newest_batch(config: dict[str, object], task: str) -> str | None:
    with TaskStorage.open(config, task) as storage:
        return storage.restored.input_offsets["batch"] if storage.restored is not None else None


def test_a_missing_blob_store_directory_fails_when_the_job_is_built(tmp_path: Path) -> None:
    config = make_config(tmp_path, **{"blob.store.create.if.missing": "false"})
    with pytest.raises(StorageError, match="blob.store.create.if.missing") as raised:
        word_job(count_rows, config, num_tasks=2, output_schema=None)
    assert "check 1 of 3" in str(raised.value)


def test_a_value_its_serde_cannot_encode_is_the_first_line_and_nothing_is_committed(spark: Any, tmp_path: Path) -> None:
    config = make_config(tmp_path, **{"stores.counts.msg.serde": "json"})

    def decimals(stores: Any, rows: Any) -> list[Any]:
        for row in rows:
            stores["counts"].put(row.word, decimal.Decimal("1.5"))
        return []

    job = word_job(decimals, config, num_tasks=1, output_schema=None)
    with pytest.raises(TaskFailedError) as raised:
        job(words(spark, "ada"), 0)
    first = str(raised.value).splitlines()[0]
    assert "SerdeError" in first and "'counts'" in first and "json" in first and "decimal.Decimal" in first
    assert "in your code:" in str(raised.value) and "decimals" in str(raised.value)
    assert newest_batch(config, "task-0") is None


def test_output_rows_of_the_wrong_shape_fail_the_task_before_its_commit(spark: Any, tmp_path: Path) -> None:
    config = make_config(tmp_path)

    def wrong(stores: Any, rows: Any) -> list[Any]:
        count_rows(stores, rows)
        return [("ada", 1, "extra")]

    job = word_job(count_rows, config, num_tasks=1, output_schema="word string, count long")
    job(words(spark, "ada"), 0)
    bad = word_job(wrong, config, num_tasks=1, output_schema="word string, count long")
    with pytest.raises(TaskFailedError, match="OutputSchemaError") as raised:
        bad(words(spark, "ada"), 1)
    first = str(raised.value).splitlines()[0]
    assert "does not fit output_schema (word string, count bigint)" in first and "('ada', 1, 'extra')" in first
    assert newest_batch(config, "task-0") == "0"  # batch 1 made no checkpoint


def test_every_batch_logs_one_line_and_the_driver_keeps_metrics_per_task(
    spark: Any, tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    config = make_config(tmp_path)
    seen: list[Any] = []
    job = word_job(count_rows, config, num_tasks=2, output_schema=None, on_batch=seen.append, keep_open=False)
    caplog.set_level(logging.INFO, logger="statebackend")
    job(words(spark, "ada", "bob", "ada"), 0)
    job(words(spark, "cy"), 1)
    said = [
        r.getMessage()
        for r in caplog.records
        if r.name == "statebackend.microbatch.coordinator" and r.levelno == logging.INFO
    ]
    assert said[0].startswith("batch 0: the first batch of this query")
    lines = [line for line in said if " tasks (" in line]  # the batch lines
    assert [line.split(":")[0] for line in lines] == ["batch 0", "batch 1"]
    assert [report.batch_id for report in seen] == [0, 1] and seen[-1] is job.last_batch
    assert seen[0].input_rows == 3 and seen[1].input_rows == 1 and seen[1].committed == 2
    assert "rows 3 in" in lines[0] and "2 tasks (2 committed" in lines[0]
    commits = {task: job.metrics.export().counter("commit.count", task=task) for task in ("task-0", "task-1")}
    assert commits == {"task-0": 2, "task-1": 2}
