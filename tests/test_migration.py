"""Dual commit and migration between backends, end to end through TaskStorage on real LMDB and the in-memory blob store:
changelog only -> dual (changelog,blobsnapshot) -> blobsnapshot only -> back to changelog, restarting between steps
(with the local dir kept and wiped); the state is exact at every step (seed 004, "Dual Commit")."""

from __future__ import annotations

import logging
import shutil
import uuid
from pathlib import Path

import pytest

from statebackend.blobstores.memory import MemoryBlobStore
from statebackend.task import TaskStorage
from statebackend.testing.conditional_put_contract import PerSeqMemoryBlobStore
from tests.backend_helpers import churn
from tests.blobsnapshot_legacy import as_index_blob_markers


def config_for(tmp_path: Path, url: str, backup: str, restore: str) -> dict[str, object]:
    return {
        "job.name": "job",
        "state.local.dir": str(tmp_path / "local"),
        "blob.store.url": url,
        "stores.counts.backup.factories": backup,
        "stores.counts.restore.factory": restore,
        "changelog.snapshot.interval.commits": 3,
        # compactions at almost every commit, so every step also runs on merged and rewritten base runs
        "blobsnapshot.compaction.fanout": 2,
        "blobsnapshot.compaction.full.min.bytes": 0,
        "blobsnapshot.gc.on.init": "false",
        "task.checkpoint.retained": 2,
    }


def work(task: TaskStorage, model: dict[bytes, bytes], round_no: int) -> None:
    """One round of a migration step: 300 writes (a fifth of them deletes) over 1500 keys."""
    churn(task, model, round_no, writes=300, keys=1500)


def run_step(
    config: dict[str, object], blobs: MemoryBlobStore, model: dict[bytes, bytes], rounds: range, offsets: list[int]
) -> TaskStorage:
    """Open (restoring), check the state is exact, commit some rounds, close; returns the closed task for metrics."""
    task = TaskStorage.open(config, "task-0", blob_store=blobs)
    try:
        assert dict(task.store("counts").items()) == model
        for round_no in rounds:
            work(task, model, round_no)
            offsets.append(round_no)
            task.commit_durably({"input": str(round_no)})
            assert dict(task.store("counts").items()) == model
    finally:
        task.close()
    return task


def reopen_exact(
    config: dict[str, object], blobs: MemoryBlobStore, model: dict[bytes, bytes], tmp_path: Path, *, wipe: bool
) -> TaskStorage:
    if wipe:
        shutil.rmtree(tmp_path / "local")
    with TaskStorage.open(config, "task-0", blob_store=blobs) as task:
        assert dict(task.store("counts").items()) == model
    return task


def test_changelog_to_dual_to_blobsnapshot_and_back(tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    blobs = MemoryBlobStore()
    url = f"memory://{uuid.uuid4().hex}"
    model: dict[bytes, bytes] = {}
    offsets: list[int] = []
    changelog_only = config_for(tmp_path, url, "changelog", "changelog")
    dual_via_blob = config_for(tmp_path, url, "changelog,blobsnapshot", "blobsnapshot")
    dual_via_changelog = config_for(tmp_path, url, "changelog,blobsnapshot", "changelog")
    blob_only = config_for(tmp_path, url, "blobsnapshot", "blobsnapshot")

    # 1. changelog only
    run_step(changelog_only, blobs, model, range(4), offsets)
    reopen_exact(changelog_only, blobs, model, tmp_path, wipe=True)

    # 2. dual commit, restore.factory=blobsnapshot: the checkpoint has no blobsnapshot marker yet -> fallback, logged
    caplog.clear()
    with caplog.at_level(logging.WARNING, logger="statebackend.lifecycle"):
        run_step(dual_via_blob, blobs, model, range(4, 8), offsets)
    assert any("no blobsnapshot marker" in r.getMessage() and "changelog" in r.getMessage() for r in caplog.records)
    with TaskStorage.open(dual_via_blob, "task-0", blob_store=blobs) as task:
        assert task.restored is not None
        assert set(task.restored.state_checkpoint_markers) == {"changelog", "blobsnapshot"}
        assert dict(task.store("counts").items()) == model
        assert task.metrics.counter("restore.stores.reused") == 1
    # both markers of the dual checkpoint restore the same state, each on its own
    restored = reopen_exact(dual_via_blob, blobs, model, tmp_path, wipe=True)
    assert restored.metrics.counter("restore.stores.full") == 1
    reopen_exact(dual_via_changelog, blobs, model, tmp_path, wipe=True)
    run_step(dual_via_changelog, blobs, model, range(8, 10), offsets)  # changelog continues after its own restore
    reopen_exact(dual_via_blob, blobs, model, tmp_path, wipe=True)
    run_step(dual_via_blob, blobs, model, range(10, 12), offsets)  # ... and after blobsnapshot restored the store
    reopen_exact(dual_via_changelog, blobs, model, tmp_path, wipe=True)

    # 3. blobsnapshot only
    run_step(blob_only, blobs, model, range(12, 16), offsets)
    reopen_exact(blob_only, blobs, model, tmp_path, wipe=False)
    reopen_exact(blob_only, blobs, model, tmp_path, wipe=True)

    # 4. back to changelog only: the checkpoint has only a blobsnapshot marker -> fallback, logged; changelog
    #    re-bases on a snapshot of the restored state at its first commit
    caplog.clear()
    with caplog.at_level(logging.WARNING, logger="statebackend.lifecycle"):
        run_step(changelog_only, blobs, model, range(16, 20), offsets)
    assert any("no changelog marker" in r.getMessage() and "blobsnapshot" in r.getMessage() for r in caplog.records)
    reopen_exact(changelog_only, blobs, model, tmp_path, wipe=False)
    restored = reopen_exact(changelog_only, blobs, model, tmp_path, wipe=True)
    assert restored.metrics.counter("restore.stores.full") == 1
    with TaskStorage.open(changelog_only, "task-0", blob_store=blobs) as task:
        assert task.restored is not None
        assert set(task.restored.state_checkpoint_markers) == {"changelog"}
        assert task.restored.input_offsets == {"input": str(offsets[-1])}


def test_rolling_back_from_dual_to_changelog_loses_nothing(tmp_path: Path) -> None:
    """Onboarding blobsnapshot went wrong: drop it from the config; the changelog chain it ran beside still holds."""
    blobs = MemoryBlobStore()
    url = f"memory://{uuid.uuid4().hex}"
    model: dict[bytes, bytes] = {}
    offsets: list[int] = []
    run_step(config_for(tmp_path, url, "changelog,blobsnapshot", "changelog"), blobs, model, range(5), offsets)
    shutil.rmtree(tmp_path / "local")
    changelog_only = config_for(tmp_path, url, "changelog", "changelog")
    run_step(changelog_only, blobs, model, range(5, 8), offsets)
    reopen_exact(changelog_only, blobs, model, tmp_path, wipe=True)


def test_dual_commit_writes_both_markers_in_one_checkpoint(tmp_path: Path) -> None:
    blobs = MemoryBlobStore()
    url = f"memory://{uuid.uuid4().hex}"
    with TaskStorage.open(
        config_for(tmp_path, url, "changelog,blobsnapshot", "blobsnapshot"), "task-0", blob_store=blobs
    ) as task:
        work(task, {}, 0)
        checkpoint = task.commit_durably({"input": "0"})
    assert set(checkpoint.markers_for("changelog")) == {"counts"}
    assert checkpoint.markers_for("blobsnapshot")["counts"].startswith("inline-index:1:000000000001-")


def test_a_schema_1_index_in_a_dual_checkpoint_falls_back_to_changelog_and_the_next_commit_uploads_a_base_run(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """The migration path the schema-1 refusal names: a dual checkpoint whose blobsnapshot index is one written by
    the release before runs (the stored sample over the marker) restores through the changelog marker by itself,
    and the first commit after it uploads a base run of the whole store, from which blobsnapshot alone restores.
    The per-seq checkpoint log, as that release kept it (a store without conditional writes)."""
    blobs = PerSeqMemoryBlobStore()
    url = f"memory://{uuid.uuid4().hex}"
    model: dict[bytes, bytes] = {}
    offsets: list[int] = []
    dual = config_for(tmp_path, url, "changelog,blobsnapshot", "blobsnapshot")
    run_step(dual, blobs, model, range(3), offsets)
    with TaskStorage.open(dual, "task-0", blob_store=blobs) as task:
        assert task.restored is not None
        seq = task.checkpoint_log.latest().seq  # type: ignore[union-attr]
    # the newest checkpoint as a release of schema 1's time wrote it: its marker names an index blob
    marker = as_index_blob_markers(blobs, "job", "task-0", seqs=lambda s: s == seq)[seq]["counts"]
    blobs.put(marker, (Path(__file__).parent / "data" / "blobsnapshot" / "index-v1.json").read_bytes())
    shutil.rmtree(tmp_path / "local")
    caplog.clear()
    with caplog.at_level(logging.ERROR, logger="statebackend.restore"):
        task = run_step(dual, blobs, model, range(3, 4), offsets)
    messages = " ".join(r.getMessage() for r in caplog.records)
    assert marker in messages and "schema version 1" in messages
    assert task.metrics.counter("blobsnapshot.base.runs") == 1
    blob_only = config_for(tmp_path, url, "blobsnapshot", "blobsnapshot")
    restored = reopen_exact(blob_only, blobs, model, tmp_path, wipe=True)
    assert restored.metrics.counter("restore.stores.full") == 1
