"""Rescaling under real Spark: rows land exactly in their key group's task, Python's hash is Spark's, and a streaming
query keeps exact state while ``num_tasks`` goes 4 -> 6 -> 2 -> 4 between runs, also when a rescaled batch is
killed with SIGKILL halfway."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from statebackend.microbatch.keygroups import key_group_range, partition_tags, spark_hash, task_of_group
from statebackend.spark import read_state
from tests.spark_helpers import stream_text_files, word_job
from tests.test_spark import batch_words, count_rows, make_config

pytest_plugins = ["tests.spark_fixtures"]
pytestmark = [pytest.mark.slow, pytest.mark.spark]

REPO = Path(__file__).resolve().parent.parent
OUTPUT = "word string, count long"


def test_key_group_ranges_cover_every_group_once_and_match_the_routing() -> None:
    for key_groups in (1, 7, 128, 1000):
        for num_tasks in range(1, min(key_groups, 40) + 1):
            owned = [g for t in range(num_tasks) for g in key_group_range(t, num_tasks, key_groups)]
            assert owned == list(range(key_groups))
            for task in range(num_tasks):
                assert all(
                    task_of_group(g, num_tasks, key_groups) == task
                    for g in key_group_range(task, num_tasks, key_groups)
                )


def test_every_row_lands_in_the_partition_of_its_task(spark: Any) -> None:
    from pyspark.sql import functions as F

    from statebackend.microbatch.keygroups import route

    frame = spark.createDataFrame([(f"k{i}", i) for i in range(3000)], "word string, n long")
    for num_tasks, key_groups in ((1, 8), (2, 128), (3, 128), (4, 128), (6, 128), (7, 10), (13, 64), (20, 128)):
        routed = route(frame, ["word"], num_tasks, key_groups).withColumn("partition", F.spark_partition_id())
        wanted = F.floor(F.pmod(F.hash("word"), F.lit(key_groups)) * num_tasks / key_groups).cast("int")
        wrong = routed.where(F.col("partition") != wanted).count()
        assert wrong == 0, (num_tasks, key_groups)
        assert routed.rdd.getNumPartitions() == num_tasks
    assert len(set(partition_tags(20))) == 20


VALUES = {
    "string": st.text(max_size=12),
    "long": st.integers(min_value=-(2**63), max_value=2**63 - 1),
    "integer": st.integers(min_value=-(2**31), max_value=2**31 - 1),
    "short": st.integers(min_value=-(2**15), max_value=2**15 - 1),
    "boolean": st.booleans(),
    "binary": st.binary(max_size=11),
    "double": st.floats(allow_nan=True, width=64),
}


@settings(max_examples=3, deadline=None)
@given(st.data())
def test_the_python_hash_is_sparks_hash(spark: Any, data: st.DataObject) -> None:
    """Property: for values of every supported type (one column and two), Python's spark_hash equals Spark's hash."""
    from pyspark.sql import functions as F

    for type_name, strategy in VALUES.items():
        values = data.draw(st.lists(strategy, min_size=50, max_size=80), label=type_name)
        values = [*values, None] if type_name != "boolean" else values
        frame = spark.createDataFrame([(v,) for v in values], f"v {type_name}")
        got = [row[0] for row in frame.select(F.hash("v")).collect()]
        assert got == [spark_hash([v], [type_name]) for v in values], type_name
    pairs = data.draw(st.lists(st.tuples(VALUES["string"], VALUES["long"]), min_size=30, max_size=50))
    frame = spark.createDataFrame(pairs, "a string, b long")
    assert [row[0] for row in frame.select(F.hash("a", "b")).collect()] == [
        spark_hash(list(p), ["string", "long"]) for p in pairs
    ]


def _write(source: Path, batch: int) -> None:
    (source / f"part-{batch:03d}.txt").write_text("\n".join(batch_words(batch)) + "\n")


def _expected(batches: range) -> dict[str, int]:
    counts: dict[str, int] = {}
    for batch in batches:
        for word in batch_words(batch):
            counts[word] = counts.get(word, 0) + 1
    return counts


def _state(spark: Any, config: dict[str, object], num_tasks: int) -> dict[str, int]:
    rows = read_state(spark, config, "counts", num_tasks=num_tasks).collect()
    keys = [row.key for row in rows]
    assert len(keys) == len(set(keys)), "a key lives in exactly one task"
    return {row.key: row.value for row in rows}


@pytest.mark.parametrize("backend", ["changelog", "blobsnapshot"])
def test_num_tasks_4_6_2_4_between_runs_keeps_exact_state(spark: Any, tmp_path: Path, backend: str) -> None:
    config = make_config(tmp_path, **{"stores.counts.backup.factories": backend})
    if backend != "changelog":
        del config["changelog.snapshot.interval.commits"]
    source = tmp_path / "input"
    source.mkdir()
    written = 0
    for num_tasks in (4, 6, 2, 4):
        for _ in range(2):
            _write(source, written)
            written += 1
        job = word_job(count_rows, config, num_tasks=num_tasks, output_schema=OUTPUT, key_groups=16)
        stream_text_files(spark, job, source, tmp_path / "spark-checkpoint", timeout_s=180)
        assert {s.task_index for s in job.history} == set(range(num_tasks))
        assert _state(spark, config, num_tasks) == _expected(range(written)), num_tasks
    # read_state with a num_tasks the state is not spread over is refused, not read wrong
    with pytest.raises(Exception, match="num_tasks"):
        read_state(spark, config, "counts", num_tasks=6).collect()


CHILD = """
import os, sys, time
from pathlib import Path
sys.path.insert(0, {repo!r})
from statebackend.spark import StatefulForeachBatch, local_spark_session
from tests.test_spark import count_rows

root, num_tasks, slow_batch = Path(sys.argv[1]), int(sys.argv[2]), int(sys.argv[3])
config = {config!r}

def fn(stores, rows):
    out = count_rows(stores, rows)
    if stores.batch_id == slow_batch:
        (root / f"in-{{stores.batch_id}}-{{stores.task_index}}").touch()
        if stores.task_index > 0:
            time.sleep(60)  # the parent kills the run while task 0 may have committed and the others process
    return out

spark = local_spark_session("rescale-child", master="local[2]", conf={{"spark.sql.shuffle.partitions": "2"}})
job = StatefulForeachBatch(fn, key_columns=["word"], num_tasks=num_tasks, config=config,
                           output_schema="word string, count long", key_groups=16)
stream = spark.readStream.option("maxFilesPerTrigger", 1).text(str(root / "input")).withColumnRenamed("value", "word")
query = (stream.writeStream.foreachBatch(job).option("checkpointLocation", str(root / "spark-checkpoint"))
         .trigger(availableNow=True).start())
query.awaitTermination()
assert query.exception() is None, query.exception()
spark.stop()
"""


def test_sigkill_in_a_rescaled_first_batch_then_resume(spark: Any, tmp_path: Path) -> None:
    config = make_config(tmp_path)
    source = tmp_path / "input"
    source.mkdir()
    script = tmp_path / "child.py"
    script.write_text(CHILD.format(repo=str(REPO), config=config))
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [str(REPO), os.environ.get("PYTHONPATH")]))}

    def child(num_tasks: int, slow_batch: int) -> subprocess.Popen[str]:
        return subprocess.Popen(
            [sys.executable, str(script), str(tmp_path), str(num_tasks), str(slow_batch)],
            cwd=REPO,
            env=env,
            stderr=subprocess.PIPE,
            text=True,
            start_new_session=True,
        )

    for batch in range(2):
        _write(source, batch)
    # the first run, 4 tasks over batches 0 and 1, in this process's session (a child would start another JVM); its
    # master retries a failed task attempt, which local[2] would not: no attempt may have needed that
    first = word_job(count_rows, config, num_tasks=4, output_schema=OUTPUT, key_groups=16)
    stream_text_files(spark, first, source, tmp_path / "spark-checkpoint", timeout_s=300)
    assert sorted((s.batch_id, s.task_index, s.attempt) for s in first.history) == [
        (batch, task, 0) for batch in range(2) for task in range(4)
    ]
    for batch in range(2, 4):
        _write(source, batch)
    second = child(6, 2)  # batch 2 is the first with 6 tasks: rescaled
    deadline = time.monotonic() + 240
    while not any(tmp_path.glob("in-2-*")) and time.monotonic() < deadline and second.poll() is None:
        time.sleep(0.2)
    time.sleep(1.5)
    os.killpg(second.pid, signal.SIGKILL)
    second.wait(60)
    assert second.returncode == -signal.SIGKILL
    # the resume in this process's session (a third JVM would cost tens of seconds): Spark re-runs batch 2, then 3
    third = word_job(count_rows, config, num_tasks=6, output_schema=OUTPUT, key_groups=16)
    stream_text_files(spark, third, source, tmp_path / "spark-checkpoint", timeout_s=300)
    assert sorted({(s.batch_id, s.task_index) for s in third.history}) == [
        (batch, task) for batch in (2, 3) for task in range(6)
    ]
    assert _state(spark, config, 6) == _expected(range(4))
