"""The driver confirms the checkpoints tasks did not wait for (``StatefulForeachBatch(confirm_on_driver=True)``; the
default on remote blob stores): what it accepts, what it refuses, and a streaming query whose Python workers die by
SIGKILL at checkpoint writes, often after their task has handed its output on, which keeps exact state and hands every
batch's output to the sink exactly as a batch count gives it."""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

import attrs
import pytest
from statebackend.checkpoint.log import HEAD_BLOB

from statebackend.blobstores.base import open_blob_store
from statebackend.config import Settings
from statebackend.microbatch.batches import ATTEMPT_OFFSET
from statebackend.microbatch.confirm import ConfirmationError, unconfirmed_checkpoints
from statebackend.spark.stats import TaskStats
from statebackend.task import TaskStorage
from statebackend.testing.conditional_put_contract import PerSeqMemoryBlobStore
from tests.spark_helpers import child_report, env_with_repo, task_stats, word_job
from tests.test_spark import NUM_TASKS, batch_words, count_arrow, make_config, state_of

pytest_plugins = ["tests.spark_fixtures"]

REPO = Path(__file__).resolve().parent.parent


def _stats(task_index: int, seq: int, checkpoint_id: str, token: str = "") -> TaskStats:
    return task_stats(
        task_index,
        batch_id=1,
        base_seq=seq - 1,
        committed_seq=seq,
        input_rows=1,
        pending_checkpoint_id=checkpoint_id,
        attempt_token=token,
    )


@pytest.mark.parametrize("layout", ["head", "per-seq"])
def test_a_checkpoint_is_confirmed_only_when_its_seq_holds_exactly_its_id(tmp_path: Path, layout: str) -> None:
    """On both checkpoint log layouts: the file store's head (conditional writes) and per-seq blobs (a store
    without them)."""
    config = make_config(tmp_path)
    settings = Settings.from_config(config)
    per_seq = PerSeqMemoryBlobStore() if layout == "per-seq" else None
    with TaskStorage.open(config, "task-0", blob_store=per_seq) as task:
        assert task.checkpoint_log.head_mode is (layout == "head")
        prefix = task.checkpoint_log.prefix
        task.store("counts").put("a", 1)
        first = task.commit_durably({"batch": "0"})
        task.store("counts").put("a", 2)
        pending = task.commit_now({"batch": "1", ATTEMPT_OFFSET: "token-a"})
        second = pending.result()
    blob_store = per_seq or open_blob_store(settings.blob_store_url, settings.blob_store_options)
    try:
        second_id = str(second.checkpoint_id)
        assert unconfirmed_checkpoints(blob_store, settings, [_stats(0, 2, second_id, "token-a")], 1.0) == []
        # another attempt's checkpoint at that seq: refused at once, naming both; by its id, or, with the same id
        # (two attempts can issue one), by its attempt token
        wrong = unconfirmed_checkpoints(blob_store, settings, [_stats(0, 2, str(first.checkpoint_id), "token-a")], 30.0)
        assert len(wrong) == 1 and "another attempt's" in wrong[0] and second_id in wrong[0]
        twin = unconfirmed_checkpoints(blob_store, settings, [_stats(0, 2, second_id, "token-b")], 30.0)
        assert len(twin) == 1 and "token-a" in twin[0] and "token-b" in twin[0]
        # not there (yet): refused after the bound
        missing = unconfirmed_checkpoints(blob_store, settings, [_stats(0, 3, "1-1")], 0.2)
        assert len(missing) == 1 and "not in the log" in missing[0]
        # a task that waited for its own checkpoint needs no confirmation
        assert unconfirmed_checkpoints(blob_store, settings, [_stats(0, 9, "")], 0.0) == []
        # a checkpoint the driver cannot read at all is an error of its own, not a missing checkpoint (the driver
        # then stops confirming): per-seq, one written in a version the config does not read (the head holds each
        # checkpoint in the one version it was written in); on both, one whose blob is damaged
        if layout == "per-seq":
            unreadable = attrs.evolve(settings, checkpoint_read_versions=(1,))
            with pytest.raises(ConfirmationError, match="does not read"):
                unconfirmed_checkpoints(blob_store, unreadable, [_stats(0, 2, second_id, "token-a")], 1.0)
        damaged = prefix + (HEAD_BLOB if layout == "head" else "000000000002.v2.json")
        data, version = blob_store.get_versioned(damaged) if layout == "head" else (blob_store.get(damaged), "")
        spoilt = data.replace(second_id.encode(), second_id[::-1].encode())  # still JSON; the checksum fails
        assert spoilt != data
        if layout == "head":
            blob_store.put_if(damaged, spoilt, version=version)
        else:
            blob_store.put(damaged, spoilt)
        with pytest.raises(ConfirmationError, match="cannot be read") as excinfo:
            unconfirmed_checkpoints(blob_store, settings, [_stats(0, 2, second_id, "token-a")], 1.0)
        assert damaged in str(excinfo.value)
    finally:
        blob_store.close()


CHILD = """
import json, sys
from pathlib import Path
sys.path.insert(0, {repo!r})
from statebackend.spark import StatefulForeachBatch, local_spark_session
from tests.test_spark import count_rows

root = Path(sys.argv[1])
config = {config!r}
outputs = root / "outputs.jsonl"

def sink(frame, batch_id):
    rows = sorted((r["word"], r["count"]) for r in frame.collect())
    with open(outputs, "a") as out:
        out.write(json.dumps({{"batch": batch_id, "rows": rows}}) + "\\n")

# local[2,8]: a task whose worker is killed under it is retried (local mode retries none by default)
spark = local_spark_session("confirm-child", master="local[2,8]", conf={{"spark.sql.shuffle.partitions": "2"}})
job = StatefulForeachBatch(count_rows, key_columns=["word"], num_tasks=3, config=config,
                           output_schema="word string, count long", sink=sink, confirm_on_driver=True,
                           confirm_timeout_s=3.0)
stream = spark.readStream.option("maxFilesPerTrigger", 1).text(str(root / "input")).withColumnRenamed("value", "word")
query = (stream.writeStream.foreachBatch(job).option("checkpointLocation", str(root / "spark-checkpoint"))
         .trigger(availableNow=True).start())
query.awaitTermination()
assert query.exception() is None, query.exception()
print(json.dumps({{"deferred": sum(1 for s in job.history if s.pending_checkpoint_id),
                   "reruns": job.metrics.export().counter("spark.batch.reruns")}}))
spark.stop()
"""


@pytest.mark.slow
@pytest.mark.spark
def test_workers_killed_at_checkpoint_writes_lose_no_batch_and_sink_each_output_once(tmp_path: Path) -> None:
    """Each Python worker dies by SIGKILL at its third checkpoint write: often in the upload a task left running
    after handing its output on, so the driver does not find that checkpoint and runs the batch again."""
    config = make_config(tmp_path)
    source = tmp_path / "input"
    source.mkdir()
    batches = 4
    for batch in range(batches):
        (source / f"part-{batch:03d}.txt").write_text("\n".join(batch_words(batch)) + "\n")
        os.utime(source / f"part-{batch:03d}.txt", (1_000_000 + batch, 1_000_000 + batch))
    script = tmp_path / "child.py"
    script.write_text(CHILD.format(repo=str(REPO), config=config))
    env = env_with_repo(STATEBACKEND_CRASH_AT="commit.before_checkpoint_write:3")
    summary = child_report(str(script), str(tmp_path), env=env)
    assert summary["deferred"] > 0  # tasks did hand their output on before their checkpoint was durable
    assert summary["reruns"] >= 1  # and a worker died with an upload of one: the driver ran that batch again

    expected: dict[str, int] = {}
    wanted_outputs = []
    for batch in range(batches):
        totals: dict[str, int] = {}
        for word in batch_words(batch):
            expected[word] = expected.get(word, 0) + 1
            totals[word] = expected[word]
        wanted_outputs.append(sorted(totals.items()))
    delivered = [json.loads(line) for line in (tmp_path / "outputs.jsonl").read_text().splitlines()]
    assert [d["batch"] for d in delivered] == list(range(batches))  # each batch's output reached the sink once
    assert [[tuple(r) for r in d["rows"]] for d in delivered] == wanted_outputs
    state: dict[str, int] = {}
    for task in range(3):
        with TaskStorage.open(config, f"task-{task}") as opened:
            for word, count in opened.store("counts").items():
                assert word not in state
                state[word] = count
    assert state == expected


def count_arrow_quietly_until(batch: int) -> Any:
    """``count_arrow``, with no output for batches before ``batch``."""

    def fn(stores: Any, batches: Any) -> Any:
        output = count_arrow(stores, batches)
        return output if stores.batch_id >= batch else None

    return fn


@pytest.mark.slow
@pytest.mark.spark
@pytest.mark.parametrize("confirm_on_driver", [False, True])
def test_output_after_batches_without_any_reaches_the_sink_exactly(
    spark: Any, tmp_path: Path, confirm_on_driver: bool
) -> None:
    """Batches without output, then batches with: the sink gets exactly a batch count's output each batch (empty
    while there is none), once, and the state is exact, whether tasks wait for their checkpoints or not."""
    config = make_config(tmp_path)
    delivered: dict[int, list[tuple[str, int]]] = {}

    def sink(frame: Any, batch_id: int) -> None:
        delivered[batch_id] = sorted((row["word"], row["count"]) for row in frame.collect())

    job = word_job(
        count_arrow_quietly_until(3),
        config,
        num_tasks=NUM_TASKS,
        output_schema="word string, count long",
        mode="arrow",
        sink=sink,
        confirm_on_driver=confirm_on_driver,
    )
    expected: dict[str, int] = {}
    for batch_id in range(5):
        job(spark.createDataFrame([(w,) for w in batch_words(batch_id)], "word string"), batch_id)
        totals: dict[str, int] = {}
        for word in batch_words(batch_id):
            expected[word] = expected.get(word, 0) + 1
            totals[word] = expected[word]
        assert delivered[batch_id] == (sorted(totals.items()) if batch_id >= 3 else []), batch_id
    assert job.metrics.export().counter("spark.batch.reruns") == 0
    assert sorted({s.batch_id for s in job.history if s.output_rows}) == [3, 4]
    assert state_of(spark, config) == expected
