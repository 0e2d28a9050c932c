"""A stateful word count on Spark's ``local-cluster[2,1,1024]`` master: two executor processes, each with its own
working directory, so a relative ``state.local.dir`` is a separate local state dir per executor, as on separate
machines. Used by tests/test_spark_cluster.py and bench/spark_e2e.py.

Usage::

    python -m tests.cluster_child <work dir> <batches> <affinity: 0|1> <report.json> [<mode>[,<mode>...]]

with modes out of ``rows`` (the default), ``arrow`` and ``pandas``. Per mode, one after the other on the same cluster
(each its own job: job name, blob store under ``<work dir>/<mode>`` and local state dir), runs ``<batches>`` batches
of 4 tasks (``StatefulForeachBatch`` called directly with each batch's DataFrame). Then writes a JSON report: under
``modes``, per mode, per task attempt its batch, task and executor, the batch times, whether the state read back from
the blob store equals a plain count of all input; with affinity, under ``placed``, where an anchor moved to each
executor was cached (:func:`place_on_each_executor`); and the Spark work dir of the application (the executors'
working directories are under it; the caller deletes it).
"""

from __future__ import annotations

import json
import sys
import time
from pathlib import Path
from typing import Any

from bench.common import local_cluster_session
from statebackend.spark import read_state
from tests.spark_helpers import word_job

NUM_TASKS = 4


def words(batch: int) -> list[str]:
    return [f"w{(batch * 13 + i * i) % 97}" for i in range(400)]


def count(stores: Any, rows: Any) -> list[tuple[str, int]]:
    counts = stores["counts"]
    totals: dict[str, int] = {}
    for row in rows:
        totals[row.word] = (totals.get(row.word) or counts.get(row.word) or 0) + 1
    counts.put_many(list(totals), list(totals.values()))
    return sorted(totals.items())


def count_arrow(stores: Any, batches: Any) -> Any:
    import pyarrow as pa

    seen: dict[str, int] = {}
    for batch in batches:
        for word in batch.column("word").to_pylist():
            seen[word] = seen.get(word, 0) + 1
    words_seen = sorted(seen)
    totals = [(old or 0) + seen[w] for w, old in zip(words_seen, stores["counts"].get_many(words_seen), strict=True)]
    stores["counts"].put_many(words_seen, totals)
    return pa.table({"word": pa.array(words_seen, pa.string()), "count": pa.array(totals, pa.int64())})


def count_pandas(stores: Any, frame: Any) -> Any:
    import pandas as pd

    seen = frame.groupby("word").size()
    words_seen = [str(w) for w in seen.index]
    totals = [(old or 0) + int(n) for old, n in zip(stores["counts"].get_many(words_seen), seen.values, strict=True)]
    stores["counts"].put_many(words_seen, totals)
    return pd.DataFrame({"word": words_seen, "count": totals})


FUNCTIONS = {"rows": count, "arrow": count_arrow, "pandas": count_pandas}


def main(argv: list[str]) -> int:
    work, batches, affinity, report = Path(argv[1]), int(argv[2]), argv[3] == "1", Path(argv[4])
    modes = (argv[5] if len(argv) > 5 else "rows").split(",")
    spark = local_cluster_session(
        "statebackend-cluster", master="local-cluster[2,1,1024]", conf={"spark.sql.shuffle.partitions": str(NUM_TASKS)}
    )
    spark.sparkContext.setLogLevel("ERROR")
    try:
        # the modes run one after the other in the same application (starting a cluster costs tens of seconds), each
        # as its own job: its own job name, blob store and local state dir
        results = {mode: run_mode(spark, work / mode, batches, affinity, mode) for mode in modes}
        placed = place_on_each_executor(spark) if affinity else {}
        import pyspark

        assert pyspark.__file__ is not None
        spark_home = Path(pyspark.__file__).parent  # local-cluster's workers work under it
        report.write_text(
            json.dumps(
                {
                    "modes": results,
                    "placed": placed,
                    "app_work_dir": str(spark_home / "work" / spark.sparkContext.applicationId),
                }
            )
        )
    finally:
        spark.stop()
    return 0


def place_on_each_executor(spark: Any, rounds: int = 3) -> dict[str, list[list[str]]]:
    """Per executor, ``rounds`` times: an anchor computed through the hint that Spark prefers that executor (what the
    driver does when it moves a task, statebackend/spark/runs.py ``_at_executor``), and the executors Spark's
    scheduler then finds it cached on."""
    from statebackend.spark.runs import _anchor_part, _at_executor, _executor_ids
    from statebackend.spark.session import living_executors

    context = spark.sparkContext
    scheduler = context._jsc.sc().dagScheduler()
    executors = living_executors(context._jsc.sc())
    placed: dict[str, list[list[str]]] = {}
    for executor in executors:
        for _ in range(rounds):
            part = _anchor_part(context, 0)
            hinted = _at_executor(context, part, executor)
            assert hinted is not None, f"executor {executor} is not in Spark's status store"
            hinted.count()
            context._jsc.parallelize([0], 1).count()  # the scheduler looks at the cache again at a job's submission
            placed.setdefault(executor, []).append(
                _executor_ids(str(scheduler.getPreferredLocs(part.rdd(), 0).mkString("\n")))
            )
            part.unpersist(False)
    return placed


def run_mode(spark: Any, work: Path, batches: int, affinity: bool, mode: str) -> dict[str, Any]:
    config = {
        "job.name": f"cluster-{mode}",
        "state.local.dir": f"statebackend-local-{mode}",  # relative: each executor's own working directory
        "blob.store.url": f"file://{work / 'blobs'}",
        "blob.store.create.if.missing": "true",
        "stores.counts.backup.factories": "changelog",
        "stores.counts.key.serde": "string",
        "stores.counts.msg.serde": "integer",
    }
    job = word_job(
        FUNCTIONS[mode],
        config,
        num_tasks=NUM_TASKS,
        output_schema="word string, count long",
        affinity=affinity,
        mode=mode,
    )
    times = []
    outputs: list[list[tuple[str, int]]] = []
    for batch in range(batches):
        started = time.monotonic()
        output = job.run_batch(spark.createDataFrame([(w,) for w in words(batch)], "word string"), batch)
        assert output is not None
        outputs.append(sorted((row.word, row["count"]) for row in output.collect()))
        times.append((time.monotonic() - started) * 1000.0)
    expected: dict[str, int] = {}
    for batch in range(batches):
        for word in words(batch):
            expected[word] = expected.get(word, 0) + 1
    state = {row.key: row.value for row in read_state(spark, config, "counts", num_tasks=NUM_TASKS).collect()}
    return {
        "attempts": [
            {
                "batch": s.batch_id,
                "task": s.task_index,
                "executor": s.executor,
                "kept_open": s.kept_open,
                "open_ms": s.open_ms,
            }
            for s in job.history
        ],
        "batch_ms": times,
        "state_ok": state == expected,
        "outputs_ok": all(out == _expected_output(batch) for batch, out in enumerate(outputs)),
    }


def _expected_output(batch: int) -> list[tuple[str, int]]:
    """Each word of a batch with its count over all batches up to it."""
    totals: dict[str, int] = {}
    for b in range(batch + 1):
        for word in words(b):
            totals[word] = totals.get(word, 0) + 1
    return sorted((w, totals[w]) for w in set(words(batch)))


if __name__ == "__main__":
    sys.exit(main(sys.argv))
