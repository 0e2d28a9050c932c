"""Run by tests/test_spark_connect.py and tests/test_spark_connect_timers.py in one process of their own: a Spark
Connect session (``remote("local[2]")``, a local Connect server in this process's JVM, which cannot share the JVM with
the test session's classic SparkContext) runs the parts asked for, one after the other on the one server (each in
its own directories, with its own jobs), and prints what each saw as one JSON document on the last line of stdout:
``{"connect": <is a Connect session>, <part>: {...}}``.

Parts: ``driver`` (:func:`driver_part`: the driver in every mode, a replay, a real streaming query through
``foreachBatch`` and ``read_state``) and ``timers`` (tests/connect_timers_child.py). Usage::

    python -m tests.connect_child <work dir> <part>[,<part>...]
"""

from __future__ import annotations

import json
import os
import sys
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from tests.spark_helpers import output_of, start_query, word_job

#: the part each test module's test needs (tests/script_runs.py: the one script both register)
PARTS = {"tests.test_spark_connect": "driver", "tests.test_spark_connect_timers": "timers"}


def command(folder: Path, tests: frozenset[str]) -> tuple[Sequence[str], Path]:
    """This child's command for the selected tests ``tests`` (``module::test``): the parts they need, in ``folder``."""
    parts = sorted({PARTS[test.split("::")[0]] for test in tests})
    return ["-m", "tests.connect_child", str(folder), ",".join(parts)], Path(__file__).resolve().parents[1]


def connect_session() -> Any:
    """A Spark Connect session on a local Connect server of this process, on an ephemeral port."""
    root = str(Path(__file__).resolve().parents[1])
    os.environ["PYSPARK_PYTHON"] = sys.executable
    # an ephemeral port for the local Connect server (pyspark's test mode, where the client asks the server's JVM for
    # its port): the default 15002 collides with any other Connect server on the machine
    os.environ["SPARK_TESTING"] = "1"
    os.environ["PYTHONPATH"] = os.pathsep.join(
        [root, *filter(None, os.environ.get("PYTHONPATH", "").split(os.pathsep))]
    )
    from pyspark.sql import SparkSession

    return (
        SparkSession.builder.remote("local[2]")
        .config("spark.sql.shuffle.partitions", "2")
        # a statebackend key given only through the Spark conf (as spark-submit --conf would): the driver part's
        # configs leave it out; every other part's configs give it in code, which wins
        .config("spark.statebackend.stores.counts.msg.serde", "integer")
        .getOrCreate()
    )


def main(workdir: str, parts: list[str]) -> None:
    from statebackend.spark.session import is_connect
    from tests.connect_timers_child import timers_part

    runs = {"driver": driver_part, "timers": timers_part}
    unknown = sorted(set(parts) - set(runs))
    if unknown:
        raise SystemExit(f"unknown parts {unknown}: the parts are {sorted(runs)}")
    spark = connect_session()
    result: dict[str, Any] = {"connect": is_connect(spark)}
    for part in parts:
        result[part] = runs[part](spark, Path(workdir) / part)
    spark.stop()
    print(json.dumps(result))


def driver_part(spark: Any, workdir: Path) -> dict[str, Any]:
    """The driver in every mode, a replay, a streaming query through ``foreachBatch`` and ``read_state``."""
    from statebackend.spark import read_state
    from tests.test_spark import COUNTERS, OUTPUT, batch_words, make_config

    workdir.mkdir(parents=True)
    result: dict[str, Any] = {}

    def expected(batch_ids: list[int]) -> dict[str, int]:
        totals: dict[str, int] = {}
        for batch_id in batch_ids:
            for word in batch_words(batch_id):
                totals[word] = totals.get(word, 0) + 1
        return totals

    def state(config: dict[str, Any], checkpoint: Any = "latest") -> dict[str, int]:
        rows = read_state(spark, config, "counts", num_tasks=3, checkpoint=checkpoint).collect()
        return {row.key: row.value for row in rows}

    for mode in ("rows", "arrow", "pandas"):
        config = make_config(Path(workdir) / mode)
        del config["stores.counts.msg.serde"]  # comes from the Spark conf
        job = word_job(COUNTERS[mode], config, num_tasks=3, output_schema=OUTPUT, mode=mode)
        outputs = []
        for batch_id in range(3):
            frame = spark.createDataFrame([(w,) for w in batch_words(batch_id)], "word string")
            outputs.append(sorted((row.word, row["count"]) for row in output_of(job, frame, batch_id).collect()))
        frame = spark.createDataFrame([(w,) for w in batch_words(2)], "word string")
        replayed = sorted((row.word, row["count"]) for row in output_of(job, frame, 2).collect())
        totals = expected([0, 1, 2])
        result[mode] = {
            "output_ok": outputs[2] == sorted((w, totals[w]) for w in set(batch_words(2))),
            "replay_same_output": replayed == outputs[2],
            "state_ok": state(dict(config, **{"stores.counts.msg.serde": "integer"})) == totals,
            "state_after_batch_0_ok": state(dict(config, **{"stores.counts.msg.serde": "integer"}), 0) == expected([0]),
            "stats": sorted((s.task_index, s.base_seq, s.committed_seq) for s in job.last_batch_stats),
        }

    # a real streaming query: foreachBatch runs the job in a Python process of the Connect server
    source = Path(workdir) / "input"
    source.mkdir()
    config = make_config(Path(workdir) / "stream")
    for batch_id in range(2):
        (source / f"part-{batch_id}.txt").write_text("\n".join(batch_words(batch_id)) + "\n")
    words = spark.readStream.text(str(source)).withColumnRenamed("value", "word")
    job = word_job(COUNTERS["arrow"], config, num_tasks=3, output_schema=OUTPUT, mode="arrow")
    query = start_query(
        words.writeStream.foreachBatch(job)
        .option("checkpointLocation", str(Path(workdir) / "spark-cp"))
        .option("maxFilesPerTrigger", 1)
        .trigger(availableNow=True)
    )
    query.awaitTermination()
    result["stream_state_ok"] = state(config) == expected([0, 1])
    return result


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2].split(","))
