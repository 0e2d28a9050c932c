"""Metrics under Spark (issue 13): each task attempt hands its metrics to the driver with its stats; the driver
merges them into one aggregate per batch and one over all batches, which its own Prometheus endpoint serves; the
executors' tasks write their textfiles."""

from __future__ import annotations

import shutil
import urllib.request
from pathlib import Path
from typing import Any

import pytest
from prometheus_client.parser import text_string_to_metric_families

from statebackend.metrics import prometheus as prom
from tests.backend_helpers import counts_config
from tests.spark_helpers import word_job

pytest_plugins = ["tests.spark_fixtures"]  # the session-wide ``spark`` fixture

pytestmark = [pytest.mark.spark, pytest.mark.slow]

NUM_TASKS = 3


def count_words(stores: Any, rows: Any) -> None:
    """Word count (module level: pickled by reference and imported on the executors)."""
    counts = stores["counts"]
    for row in rows:
        counts.put(row.word, (counts.get(row.word) or 0) + 1)


def test_the_driver_merges_every_tasks_metrics_per_batch_and_serves_them(spark: Any, tmp_path: Path) -> None:
    textfiles = {"metrics.prometheus.textfile.dir": str(tmp_path / "textfiles"), "metrics.prometheus.port": 0}
    config = {**counts_config(tmp_path, job="sparkmetrics"), **textfiles}
    # tasks wait for their checkpoints: a task that hands its output on first (the driver confirming its checkpoint)
    # hands its upload's metrics on with its next batch
    job = word_job(count_words, config, num_tasks=NUM_TASKS, output_schema=None, confirm_on_driver=False)
    words = [(f"w{i % 17}",) for i in range(60)]
    job(spark.createDataFrame(words, "word string"), 0)
    first = job.last_batch_metrics
    assert [first.counter("commit.count", job_name="sparkmetrics", task=f"task-{i}") for i in range(NUM_TASKS)] == [
        1
    ] * NUM_TASKS  # one series per task
    sync = first.histogram("commit.sync.ms")
    assert sync is not None and sync.count == NUM_TASKS
    assert first.counter("restore.stores.full") == 0
    assert (
        first.counter("commit.bytes.uploaded")
        == sum(s.metrics.counter("commit.bytes.uploaded") for s in job.last_batch_stats if s.metrics is not None)
        > 0
    )

    shutil.rmtree(tmp_path / "local")  # batch 1 restores every task from the blob store
    job(spark.createDataFrame(words, "word string"), 1)
    second = job.last_batch_metrics
    assert second.counter("commit.count") == NUM_TASKS
    assert second.counter("restore.stores.full") == NUM_TASKS
    assert second.counter("restore.bytes") > 0
    assert job.metrics.counter("commit.count") == 2 * NUM_TASKS  # all batches

    with urllib.request.urlopen(prom.serve("127.0.0.1", 0).url, timeout=10) as response:
        families = list(text_string_to_metric_families(response.read().decode()))
    served = {
        (s.name, s.labels.get("task")): s.value
        for f in families
        for s in f.samples
        if s.labels.get("job_name") == "sparkmetrics"
    }
    # the driver's endpoint carries every task's series (a job-wide figure is a sum() in the query)
    assert [served[("statebackend_commits_total", f"task-{i}")] for i in range(NUM_TASKS)] == [2] * NUM_TASKS
    assert [served[("statebackend_restore_stores_full_total", f"task-{i}")] for i in range(NUM_TASKS)] == (
        [1] * NUM_TASKS
    )

    for index in range(NUM_TASKS):  # each executor task wrote its own textfile when it closed
        text = (tmp_path / "textfiles" / f"statebackend-sparkmetrics-task-{index}.prom").read_text()
        commits = [
            s.value
            for f in text_string_to_metric_families(text)
            for s in f.samples
            if s.name == "statebackend_commits_total"
        ]
        assert commits and commits[0] >= 1
