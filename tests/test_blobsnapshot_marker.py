"""The blob-snapshot marker carries its run index (no index blob); a damaged inline marker is refused and restore
falls back; markers of older releases (index blob names) mixed with inline ones restore and are swept right."""

from __future__ import annotations

import base64
import shutil
import zlib
from pathlib import Path

import pytest
from statebackend.backends.blobsnapshot.admin import BlobSnapshotAdmin
from statebackend.backends.blobsnapshot.blobs import read_marker

from statebackend.blobstores.memory import MemoryBlobStore
from statebackend.errors import CorruptDataError
from statebackend.task import TaskStorage
from statebackend.testing.conditional_put_contract import PerSeqMemoryBlobStore
from tests.backend_helpers import at_seq, fill, index_blobs, run_blobs
from tests.backend_helpers import blobsnapshot_config as make_config
from tests.backend_helpers import blobsnapshot_manager as backup_manager
from tests.backend_helpers import drain_cleanup as _drain
from tests.backend_helpers import live_runs as _live_runs
from tests.backend_helpers import store_contents as contents
from tests.blobsnapshot_legacy import as_index_blob_markers, rewrite_markers

#: both checkpoint log layouts: the head (a store with conditional writes) and the per-seq blobs (one without)
LAYOUTS = pytest.mark.parametrize("store_type", [MemoryBlobStore, PerSeqMemoryBlobStore], ids=["head", "per-seq"])

# -- the marker carries the index; markers of older releases (index blob names) ----------------------------------------


def _damaged(marker: str) -> str:
    """``marker`` with one digit of its index's key count changed and compressed again: it decodes, its checksum
    fails."""
    prefix, payload = marker.rsplit(":", 1)
    data = bytearray(zlib.decompress(base64.urlsafe_b64decode(payload + "=" * (-len(payload) % 4))))
    digit = data.index(b'"key_count":') + len(b'"key_count":')
    data[digit] = ord("7") if data[digit] != ord("7") else ord("8")
    return f"{prefix}:{base64.urlsafe_b64encode(zlib.compress(bytes(data))).rstrip(b'=').decode()}"


def test_a_commit_writes_no_index_blob_and_its_marker_carries_the_index(tmp_path: Path) -> None:
    blobs = MemoryBlobStore()
    config = make_config(tmp_path)
    model: dict[bytes, bytes] = {}
    with TaskStorage.open(config, "task-0", blob_store=blobs) as task:
        fill(task, model, 0, 1000, "a")
        checkpoint = task.commit_durably({"input": "0"})
        idle = task.commit_durably({"input": "1"})
    assert index_blobs(blobs) == []
    for commit, seq in ((checkpoint, 1), (idle, 2)):
        marker = commit.markers_for("blobsnapshot")["counts"]
        assert marker.startswith(f"inline-index:1:{seq:012d}-")
        index = read_marker(blobs, marker, job="job", task="task-0", store="counts")
        assert index.seq == seq and index.key_count == 1000 and len(index.runs) == 1
    with pytest.raises(CorruptDataError, match="is not the index its marker designates"):
        read_marker(blobs, marker, job="job", task="task-1", store="counts")  # another task's reader


@LAYOUTS
@pytest.mark.parametrize("fallback", [False, True])
def test_a_damaged_inline_marker_is_refused_and_restore_falls_back(
    tmp_path: Path, fallback: bool, store_type: type[MemoryBlobStore]
) -> None:
    blobs = store_type()
    config = make_config(tmp_path, **{"stores.counts.backup.factories": "changelog,blobsnapshot"} if fallback else {})
    if fallback:
        del config["stores.counts.restore.factory"]
        config["stores.counts.restore.factories"] = "blobsnapshot,changelog"
    model: dict[bytes, bytes] = {}
    with TaskStorage.open(config, "task-0", blob_store=blobs) as task:
        fill(task, model, 0, 1000, "a")
        task.commit_durably({"input": "0"})
        fill(task, model, 500, 10, "b")
        task.commit_durably({"input": "1"})
    rewrite_markers(blobs, "job", "task-0", lambda store, marker: _damaged(marker), seqs=lambda seq: seq == 2)
    shutil.rmtree(tmp_path / "local")
    if not fallback:
        with pytest.raises(CorruptDataError, match="checksum") as excinfo:
            TaskStorage.open(config, "task-0", blob_store=blobs)
        assert "inline index 000000000002-" in str(excinfo.value)
        return
    with TaskStorage.open(config, "task-0", blob_store=blobs) as task:
        assert task.commit_manager.backups[0].manager.shared.context.restored_by["counts"] == "changelog"  # type: ignore[attr-defined]
        assert contents(task) == model
        fill(task, model, 0, 5, "c")
        task.commit_durably({"input": "2"})  # blob-snapshot starts anew with a base run
    shutil.rmtree(tmp_path / "local")
    del config["stores.counts.restore.factories"]
    config["stores.counts.restore.factory"] = "blobsnapshot"
    with TaskStorage.open(config, "task-0", blob_store=blobs) as task:
        assert contents(task) == model


@LAYOUTS
def test_a_history_mixing_index_blob_markers_and_inline_ones_restores_and_is_swept_right(
    tmp_path: Path, store_type: type[MemoryBlobStore]
) -> None:
    """Checkpoints of an older release (markers naming index blobs) then of this one (inline): a warm open continues
    the chain from an index blob, every checkpoint in the log restores, an index blob is kept while a checkpoint in
    the log names it and swept once no checkpoint in the log names it, and verify passes on both forms."""
    blobs = store_type()
    config = make_config(tmp_path, **{"task.checkpoint.retained": 3})
    model: dict[bytes, bytes] = {}
    with TaskStorage.open(config, "task-0", blob_store=blobs) as task:
        for round_no in range(3):
            fill(task, model, round_no * 100, 300, f"old{round_no}")
            task.commit_durably({"input": str(round_no)})
    legacy = {markers["counts"] for markers in as_index_blob_markers(blobs, "job", "task-0").values()}
    assert set(index_blobs(blobs)) == legacy and len(legacy) == 3
    snapshots = {}
    with TaskStorage.open(config, "task-0", blob_store=blobs) as task:
        assert task.metrics.counter("restore.stores.reused") == 1  # the index blob names the local version
        task.checkpoint_log.retention_interval = 1
        admin = BlobSnapshotAdmin(context=backup_manager(task).shared.context)
        for entry in task.checkpoint_log.entries():
            assert admin.verify_marker("counts", entry.checkpoint.markers_for("blobsnapshot")["counts"]) == []  # type: ignore[union-attr]
        for round_no in range(3, 5):
            fill(task, model, round_no * 100, 300, f"new{round_no}")
            task.commit_durably({"input": str(round_no)})
            snapshots[round_no + 1] = dict(model)
        _drain(task)
        entries = task.checkpoint_log.entries()
        named = {e.checkpoint.markers_for("blobsnapshot")["counts"] for e in entries}  # type: ignore[union-attr]
        assert [e.seq for e in entries] == [3, 4, 5]
        assert len(named & legacy) == 1 and set(index_blobs(blobs)) == legacy  # seq 3's is still named; the two
        # before it this manager never held (the older open wrote them): the sweep collects them
        backup_manager(task).sweep(now=backup_manager(task).shared.clock() + 10 * 3600)
        assert set(index_blobs(blobs)) == named & legacy
        assert run_blobs(blobs) == _live_runs(blobs, task)
        for marker in named:
            assert admin.verify_marker("counts", marker) == []
    for seq in (3, 5):
        shutil.rmtree(tmp_path / "local")
        with TaskStorage.open(config, "task-0", blob_store=blobs, checkpoint=at_seq(seq)) as task:
            assert task.metrics.counter("restore.stores.full") == 1
            if seq == 5:
                assert contents(task) == snapshots[5]
