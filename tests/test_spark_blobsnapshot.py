"""The Spark driver on the blob-snapshot backend, with compaction at almost every batch: runs are merged and
replaced by base runs while tasks open and close per batch, batches are replayed, a task fails after its commit, and
the local state is wiped. The state always equals a batch count."""

from __future__ import annotations

import shutil
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from statebackend.backends.blobsnapshot.blobs import read_marker
from statebackend.backends.blobsnapshot.format import RunEntry
from statebackend.checkpoint import CheckpointLog, CheckpointV2

from statebackend.blobstores.file import FileBlobStore
from tests.spark_helpers import word_job
from tests.test_spark import (
    NUM_TASKS,
    OUTPUT,
    FailOnceAfterCommit,
    batch_count,
    count_rows,
    make_config,
    run_batch,
    state_of,
)

pytest_plugins = ["tests.spark_fixtures"]
pytestmark = [pytest.mark.spark, pytest.mark.slow]


def lsm_config(tmp_path: Path) -> dict[str, object]:
    return make_config(
        tmp_path,
        **{
            "stores.counts.backup.factories": "blobsnapshot",
            "blobsnapshot.compaction.fanout": 2,
            "blobsnapshot.compaction.full.ratio": 3,
            "blobsnapshot.compaction.full.min.bytes": 0,
        },
    )


def test_compacting_state_stays_exact_through_replays_failures_and_wipes(spark: Any, tmp_path: Path) -> None:
    config = lsm_config(tmp_path)
    fail = FailOnceAfterCommit(tmp_path / "marker", batch_id=3, task_index=1)
    job = word_job(fail, config, num_tasks=NUM_TASKS, output_schema=OUTPUT)
    outputs = {}
    for batch_id in range(8):
        if batch_id == 5:
            shutil.rmtree(tmp_path / "local")
        outputs[batch_id] = run_batch(spark, job, batch_id)
        if batch_id == 6:
            assert run_batch(spark, job, 6) == outputs[6]  # replayed: same output, applied once
    assert (tmp_path / "marker").exists()
    assert state_of(spark, config) == batch_count(spark, list(range(8)))
    # both kinds of compaction happened while the tasks opened and closed per batch, and indexes adopted them
    runs = list(_runs_of_retained_indexes(FileBlobStore(str(tmp_path / "blobs"), create=False)))
    assert any(run.base and run.last_seq > 1 for run in runs), "no full compaction was adopted"
    assert any(not run.base and run.level >= 1 for run in runs), "no merge was adopted"
    shutil.rmtree(tmp_path / "local")
    assert run_batch(spark, job, 8) == sorted(
        (w, c) for w, c in batch_count(spark, list(range(9))).items() if w in set(_words(8))
    )


def test_rows_mode_on_blobsnapshot_equals_changelog(spark: Any, tmp_path: Path) -> None:
    lsm = lsm_config(tmp_path / "lsm")
    changelog = make_config(tmp_path / "changelog")
    jobs = [word_job(count_rows, config, num_tasks=NUM_TASKS, output_schema=OUTPUT) for config in (lsm, changelog)]
    for batch_id in range(5):
        first, second = (run_batch(spark, job, batch_id) for job in jobs)
        assert first == second
    assert state_of(spark, lsm) == state_of(spark, changelog) == batch_count(spark, list(range(5)))


def _words(batch_id: int) -> list[str]:
    from tests.test_spark import batch_words

    return batch_words(batch_id)


def _runs_of_retained_indexes(blobs: FileBlobStore) -> Iterator[RunEntry]:
    """The runs every blob-snapshot index of the checkpoints each task's log still holds lists (inline in markers),
    read through the log (one head blob per task on this store, or per-seq blobs)."""
    tasks = sorted({tuple(name.split("/")[:2]) for name in blobs.list("") if "/checkpoints/" in name})
    for job, task in tasks:
        for entry in CheckpointLog(blobs, job, task).entries():
            checkpoint = entry.checkpoint
            assert isinstance(checkpoint, CheckpointV2)
            for store, marker in checkpoint.markers_for("blobsnapshot").items():
                yield from read_marker(blobs, marker, job=job, task=task, store=store).runs
