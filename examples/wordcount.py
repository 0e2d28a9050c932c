"""Stateful word count on PySpark Structured Streaming with statebackend, checked against a batch computation.

Run::

    python examples/wordcount.py                      # 8 batches of 5,000 input rows, 4 tasks, local[2]
    python examples/wordcount.py --batches 20 --rows-per-batch 20000 --mode rows --state-dir ./demo-state
    python examples/wordcount.py --keep-state         # keep the temp dir to look at it (statebackend ... commands)

What it does:

1. Reads the ``rate-micro-batch`` source (the ``rate`` source with a fixed number of rows per batch, so the input of
   batch ``b`` is exactly the values ``[b * rows, (b + 1) * rows)``) and turns each value into three words.
2. Counts words with :class:`statebackend.spark.StatefulForeachBatch`: 4 tasks, each keeping its counts in LMDB under
   the state directory and committing them to a ``file://`` blob store with every batch (embedded defaults: nothing
   to set up). Batches after ``--batches`` are ignored, then the query is stopped.
3. Reads the state back from the blob store alone (:func:`statebackend.spark.read_state`), prints the top counts and
   compares every count with a plain Spark batch ``groupBy(word).count()`` over the same input. Prints OK or FAIL;
   exits 1 on FAIL.

Without ``--state-dir`` everything goes into a new ``statebackend-wordcount-*`` temp dir, removed at the end, also
when the run fails or is interrupted, unless ``--keep-state``. A ``--state-dir`` is the user's and is never removed.
"""

from __future__ import annotations

import argparse
import contextlib
import shutil
import sys
import tempfile
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))  # run from a clone without installing

from statebackend.spark import StatefulForeachBatch, local_spark_session, read_state


def count_words(stores: Any, batches: Any) -> Any:
    """One task's batch (Arrow record batches): add each word's occurrences to its stored count."""
    import pyarrow as pa

    counts = stores["counts"]
    received = list(batches)
    if not received:
        return pa.table({"word": pa.array([], pa.string()), "count": pa.array([], pa.int64())})
    grouped = pa.Table.from_batches(received).group_by("word").aggregate([("word", "count")])
    words = grouped.column("word")
    # the vectorized state API: every word's count read in one call and written back in one call
    totals = [
        (old or 0) + n for old, n in zip(counts.get_many(words), grouped.column("word_count").to_pylist(), strict=True)
    ]
    counts.put_many(words, totals)
    return pa.table({"word": words, "count": pa.array(totals, pa.int64())})


def count_words_rows(stores: Any, rows: Any) -> list[tuple[str, int]]:
    """The same, one row at a time (mode ``rows``)."""
    counts = stores["counts"]
    totals: dict[str, int] = {}
    for row in rows:
        total = (counts.get(row.word) or 0) + 1
        counts.put(row.word, total)
        totals[row.word] = total
    return list(totals.items())


def words_of(values: Any, vocabulary: int) -> Any:
    """Three words per input value, a skewed mix (some words are far more common than others)."""
    from pyspark.sql import functions as F

    v = F.col("value")
    choices = [
        F.concat(F.lit("w"), (v * 7919 % vocabulary).cast("string")),
        F.concat(F.lit("w"), (v * v % 101).cast("string")),
        F.concat(F.lit("w"), (v % 13).cast("string")),
    ]
    return values.select(F.explode(F.array(*choices)).alias("word"))


def config_for(state_dir: Path) -> dict[str, object]:
    return {
        "job.name": "wordcount",
        "state.local.dir": str(state_dir / "local"),
        "blob.store.url": f"file://{state_dir / 'blobs'}",
        "blob.store.create.if.missing": "true",
        "stores.counts.backup.factories": "changelog",
        "stores.counts.key.serde": "string",
        "stores.counts.msg.serde": "integer",
    }


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--batches", type=int, default=8, help="micro-batches to process (default 8)")
    parser.add_argument("--rows-per-batch", type=int, default=5000, help="input rows per batch (default 5000)")
    parser.add_argument("--vocabulary", type=int, default=20000, help="distinct words of the first kind")
    parser.add_argument("--tasks", type=int, default=4, help="state tasks (partitions by word; default 4)")
    parser.add_argument("--mode", choices=["arrow", "rows"], default="arrow", help="vectorized (default) or rows")
    parser.add_argument(
        "--state-dir",
        type=Path,
        default=None,
        help="where state, blobs and the Spark checkpoint go (default: a new temp dir, removed at "
        "the end); each run uses a fresh run-<time> directory under it",
    )
    parser.add_argument(
        "--keep-state", action="store_true", help="keep the temp dir (without --state-dir) after the run, to look at it"
    )
    parser.add_argument("--top", type=int, default=10, help="how many top counts to print")
    args = parser.parse_args(argv)

    with state_root(args.state_dir, keep=args.keep_state) as root:
        run_dir = root.resolve() / f"run-{time.strftime('%Y%m%d-%H%M%S')}"
        run_dir.mkdir(parents=True)
        config = config_for(run_dir)
        print(f"state, blobs and Spark checkpoint under {run_dir}")

        spark = local_spark_session("statebackend-wordcount", master="local[2]")
        spark.sparkContext.setLogLevel("ERROR")
        try:
            return _run(spark, args, config, run_dir)
        finally:
            spark.stop()  # before the directory goes: Spark's checkpoint and the tasks' stores are in it


@contextlib.contextmanager
def state_root(state_dir: Path | None, *, keep: bool) -> Iterator[Path]:
    """``state_dir`` as given (the user's: never removed), or a new temp dir removed when the block ends, however it
    ends, unless ``keep``."""
    if state_dir is not None:
        yield state_dir
        return
    root = Path(tempfile.mkdtemp(prefix="statebackend-wordcount-"))
    try:
        yield root
    finally:
        if keep:
            print(f"kept {root} (--keep-state): remove it when done")
        else:
            shutil.rmtree(root, ignore_errors=True)
            if root.exists():
                print(f"could not remove all of {root}: remove it by hand")


def _run(spark: Any, args: argparse.Namespace, config: dict[str, object], run_dir: Path) -> int:
    done = threading.Event()

    def report(output: Any, batch_id: int) -> None:
        updated = output.count()
        stats = job.last_batch_stats
        commit = max((s.commit_ms for s in stats), default=0.0)
        restore = max((s.open_ms for s in stats), default=0.0)
        print(
            f"batch {batch_id:3d}: {sum(s.input_rows for s in stats):7d} words in, {updated:6d} counts updated; "
            f"slowest task: open+restore {restore:6.1f} ms, durable commit {commit:6.1f} ms"
        )

    job = StatefulForeachBatch(
        count_words if args.mode == "arrow" else count_words_rows,
        key_columns=["word"],
        num_tasks=args.tasks,
        config=config,
        output_schema="word string, count long",
        mode=args.mode,
        sink=report,
    )

    def process(batch: Any, batch_id: int) -> None:
        if batch_id >= args.batches:  # bounded demo: later batches change nothing, the query is being stopped
            done.set()
            return
        job(batch, batch_id)
        if batch_id == args.batches - 1:
            done.set()

    source = (
        spark.readStream.format("rate-micro-batch")
        .option("rowsPerBatch", args.rows_per_batch)
        .option("numPartitions", 2)
        .load()
    )
    query = (
        words_of(source, args.vocabulary)
        .writeStream.foreachBatch(process)
        .option("checkpointLocation", str(run_dir / "spark-checkpoint"))
        .start()
    )
    started = time.monotonic()
    while not done.wait(1.0):
        if not query.isActive:
            print(f"FAIL: the streaming query stopped early: {query.exception()}")
            return 1
    query.stop()
    print(f"{args.batches} batches in {time.monotonic() - started:.1f} s")

    state = {
        row.key: row.value
        for row in read_state(spark, config, "counts", num_tasks=args.tasks, checkpoint=args.batches - 1).collect()
    }
    values = spark.range(args.batches * args.rows_per_batch).withColumnRenamed("id", "value")
    expected = {row.word: row["count"] for row in words_of(values, args.vocabulary).groupBy("word").count().collect()}

    top = sorted(state.items(), key=lambda item: (-item[1], item[0]))[: args.top]
    print(f"top {len(top)} of {len(state)} words (state read back from the blob store):")
    for word, count in top:
        print(f"  {word:>8s} {count:8d}")
    wrong = {w for w in expected.keys() | state.keys() if expected.get(w) != state.get(w)}
    if wrong:
        sample = sorted(wrong)[:5]
        print(
            f"FAIL: {len(wrong)} of {len(expected)} counts differ from the batch count, e.g. "
            + ", ".join(f"{w}: state {state.get(w)} != batch {expected.get(w)}" for w in sample)
        )
        return 1
    print(
        f"OK: all {len(expected)} counts equal a batch groupBy(word).count() over the same "
        f"{args.batches * args.rows_per_batch} input rows"
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
