"""The ``timers`` part of tests/connect_child.py (run there, on the Connect server it shares with the ``driver`` part,
for tests/test_spark_connect_timers.py): a function without output and without ``output_schema`` in rows mode, one
that does return rows without it, timers of both kinds and an initial state, all under Spark Connect.
``python -m tests.connect_timers_child <work dir>`` runs this part alone."""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Any

from tests.spark_helpers import output_of, start_query, word_job


def count_quietly(stores: Any, rows: Any) -> None:
    """A word count with no output."""
    counts = stores["counts"]
    for row in rows:
        counts.put(row.word, (counts.get(row.word) or 0) + 1)


def count_loudly(stores: Any, rows: Any) -> list[tuple[str, int]]:
    count_quietly(stores, iter(()))
    return [(row.word, 1) for row in rows]


def seed_frame(spark: Any) -> Any:
    """The initial counts, built with the session it is given (the form for a driver run by the Connect server)."""
    return spark.createDataFrame(
        [(f"w{i}", 100 + i) for i in range(0, 23, 2)] + [("only-seed", 7)], "word string, value long"
    )


def timers_part(spark: Any, workdir: Path) -> dict[str, Any]:
    """What the part saw, by check (tests/test_spark_connect_timers.py asserts it)."""
    from statebackend.spark import TIMERS_STORE, read_state
    from statebackend.testing import ManualClock
    from tests.test_spark import batch_words, make_config
    from tests.test_spark_timers import OUTPUT, event_timers_arrow, fired_arrow, fired_rows, register_rows

    workdir.mkdir(parents=True)
    result: dict[str, Any] = {}

    # no output, no output_schema: runs as on classic Spark
    config = make_config(Path(workdir) / "quiet")
    job = word_job(count_quietly, config, num_tasks=3, output_schema=None)
    shapes = []
    for batch_id in range(2):
        output = output_of(job, spark.createDataFrame([(w,) for w in batch_words(batch_id)], "word string"), batch_id)
        shapes.append([output.columns, output.count()])
    totals: dict[str, int] = {}
    for word in batch_words(0) + batch_words(1):
        totals[word] = totals.get(word, 0) + 1
    state = {row.key: row.value for row in read_state(spark, config, "counts", num_tasks=3).collect()}
    result["quiet"] = {"shapes": shapes, "state_ok": state == totals, "moved": job.last_batch_moved}

    # rows returned without output_schema: refused, naming what to give
    loud = word_job(count_loudly, make_config(Path(workdir) / "loud"), num_tasks=3, output_schema=None)
    try:
        output_of(loud, spark.createDataFrame([("a",)], "word string"), 0).collect()
        result["loud_error"] = ""
    except Exception as exc:  # noqa: BLE001 - the task's error comes back as Spark's exception
        result["loud_error"] = str(exc)

    # processing-time timers (the driver's clock set here), one batch without input
    clock = ManualClock(1000)
    config = make_config(Path(workdir) / "timers")
    timers = word_job(register_rows, config, num_tasks=3, output_schema=OUTPUT, on_timers=fired_rows, clock=clock)
    outputs = []
    for batch_id, rows in enumerate([[("a", 1500), ("b", 2500), ("c", 900)], [], []]):
        outputs.append(
            sorted(
                tuple(row)
                for row in output_of(timers, spark.createDataFrame(rows, "word string, ts long"), batch_id).collect()
            )
        )
        if batch_id == 0:
            result["pending_after_0"] = sorted(
                (row.key, row.at_ms) for row in read_state(spark, config, TIMERS_STORE, num_tasks=3).collect()
            )
        clock.now_ms += 1000
    result["processing"] = {"outputs": outputs, "tasks": sorted(s.task_index for s in timers.last_batch_stats)}

    # event-time timers: the watermark of the batches before, minus the delay
    events = word_job(
        event_timers_arrow,
        make_config(Path(workdir) / "events"),
        num_tasks=3,
        output_schema=OUTPUT,
        mode="arrow",
        on_timers=fired_arrow,
        event_time="ts",
        watermark_delay=100,
    )
    outputs, watermarks = [], []
    for batch_id, rows in enumerate([[("a", 1000)], [("b", 3000)], []]):
        outputs.append(
            sorted(
                tuple(row)
                for row in output_of(events, spark.createDataFrame(rows, "word string, ts long"), batch_id).collect()
            )
        )
        watermarks.append(sorted({s.watermark_ms for s in events.last_batch_stats}, key=str))
    result["event"] = {"outputs": outputs, "watermarks": watermarks}

    # initial state: a DataFrame of the client's session, then (a restart) the function form; loaded once
    from tests.test_spark import OUTPUT as COUNT_OUTPUT
    from tests.test_spark import count_rows

    config = make_config(Path(workdir) / "initial")
    seed = seed_frame(spark)
    seeded = word_job(count_rows, config, num_tasks=3, output_schema=COUNT_OUTPUT, initial_state={"counts": seed})

    def batch(job: Any, batch_id: int) -> dict[str, int]:
        frame = spark.createDataFrame([(w,) for w in batch_words(batch_id)], "word string")
        return {row.word: row["count"] for row in job.run_batch(frame, batch_id).collect()}

    first = batch(seeded, 0)
    restarted = word_job(
        count_rows, config, num_tasks=3, output_schema=COUNT_OUTPUT, initial_state={"counts": lambda session: seed}
    )
    second = batch(restarted, 1)
    counts: dict[str, int] = {f"w{i}": 100 + i for i in range(0, 23, 2)} | {"only-seed": 7}
    after_0 = dict(counts)
    for word in batch_words(0):
        after_0[word] = after_0.get(word, 0) + 1
    for word in batch_words(0) + batch_words(1):
        counts[word] = counts.get(word, 0) + 1
    state = {row.key: row.value for row in read_state(spark, config, "counts", num_tasks=3).collect()}
    late = word_job(
        count_rows,
        make_config(Path(workdir) / "quiet"),
        num_tasks=3,
        output_schema=COUNT_OUTPUT,
        initial_state={"counts": seed},
    )
    try:
        batch(late, 2)
        refused = ""
    except Exception as exc:  # noqa: BLE001 - a ConfigError raised on the client
        refused = str(exc)
    # through foreachBatch, where the driver runs in a Python process of the Connect server: the function form
    source = Path(workdir) / "initial-input"
    source.mkdir()
    (source / "part-0.txt").write_text("\n".join(batch_words(0)) + "\n")
    streamed = make_config(Path(workdir) / "initial-stream")
    job = word_job(count_rows, streamed, num_tasks=3, output_schema=COUNT_OUTPUT, initial_state={"counts": seed_frame})
    query = start_query(
        spark.readStream.text(str(source))
        .withColumnRenamed("value", "word")
        .writeStream.foreachBatch(job)
        .option("checkpointLocation", str(Path(workdir) / "initial-cp"))
        .trigger(availableNow=True)
    )
    query.awaitTermination()
    streamed_state = {row.key: row.value for row in read_state(spark, streamed, "counts", num_tasks=3).collect()}
    result["initial"] = {
        "first_ok": first == {w: after_0[w] for w in batch_words(0)},
        "second_ok": second == {w: counts[w] for w in batch_words(1)},
        "state_ok": state == counts,
        "stream_ok": query.exception() is None and streamed_state == after_0,
        "refused": refused,
    }
    return result


if __name__ == "__main__":
    from tests.connect_child import main

    main(sys.argv[1], ["timers"])
