"""The blob-snapshot admin for the ``statebackend`` command: a marker (an index) described, its blobs named, and
every blob verified as restore checks it, with each damage named."""

from __future__ import annotations

import base64
import zlib
from pathlib import Path
from typing import Any

import pytest
from statebackend.backends.blobsnapshot.admin import BlobSnapshotAdmin
from statebackend.backends.blobsnapshot.blobs import read_marker

from statebackend import TaskStorage
from statebackend.blobstores.memory import MemoryBlobStore
from statebackend.errors import CorruptDataError
from tests.blobsnapshot_legacy import as_index_blob_markers


def config(tmp_path: Path) -> dict[str, Any]:
    return {
        "job.name": "job",
        "state.local.dir": str(tmp_path / "local"),
        "blob.store.url": "memory://admin",
        "stores.counts.backup.factories": "blobsnapshot",
        "blobsnapshot.compaction.full.min.bytes": "100GiB",  # no compaction: every commit's run stays listed
    }


def admin_and_marker(tmp_path: Path, blobs: MemoryBlobStore) -> tuple[BlobSnapshotAdmin, str]:
    with TaskStorage.open(config(tmp_path), "task-0", blob_store=blobs) as task:
        store = task.store("counts", typed=False)
        for commit in range(3):
            store.put_all((b"key-%05d" % i, b"v%d" % commit) for i in range(commit * 50, commit * 50 + 100))
            if commit == 2:
                store.delete(b"key-00000")
            task.commit_durably({"input": str(commit)})
        last = task.commit_manager.last_checkpoint
        assert last is not None
        marker = last.markers_for("blobsnapshot")["counts"]
        binding = next(b for b in task.commit_manager.backups if b.factory_name == "blobsnapshot")
        context = binding.manager.shared.context  # type: ignore[attr-defined]
    return BlobSnapshotAdmin(context=context), marker


def test_describe_names_every_run_with_its_size_and_the_key_count(tmp_path: Path) -> None:
    blobs = MemoryBlobStore()
    admin, marker = admin_and_marker(tmp_path, blobs)
    described = admin.describe_marker("counts", marker)
    index = read_marker(blobs, marker, job="job", task="task-0", store="counts")
    assert described["inline"] is True and described["marker_bytes"] == len(marker)
    assert described["index"] == f"inline index {index.seq:012d}-{index.token}"
    assert described["runs"] == described["blobs"] == len(index.runs) == 3
    assert described["keys"] == index.key_count == 199
    assert described["missing"] == 0
    sizes = {item["blob"]: item["bytes"] for item in described["run_list"]}
    assert all(sizes[name] == blobs.head(name).size for name in sizes)
    assert described["bytes"] == sum(sizes.values())  # no index blob: the index is in the marker
    legacy = as_index_blob_markers(blobs, "job", "task-0")[3]["counts"]
    described = admin.describe_marker("counts", legacy)
    assert described["inline"] is False and described["index"] == legacy and described["blobs"] == 4
    assert described["bytes"] == sum(sizes.values()) + blobs.head(legacy).size


def test_referenced_blobs_are_the_runs_and_an_older_markers_index_blob(tmp_path: Path) -> None:
    blobs = MemoryBlobStore()
    admin, marker = admin_and_marker(tmp_path, blobs)
    referenced = admin.referenced_blobs("counts", marker)
    runs = {name for name in blobs.list("job/task-0/counts/blobsnapshot/runs/")}
    assert referenced == runs
    legacy = as_index_blob_markers(blobs, "job", "task-0")[3]["counts"]
    assert admin.referenced_blobs("counts", legacy) == {legacy} | runs


def test_verify_passes_on_sound_blobs_and_names_each_damaged_or_missing_one(tmp_path: Path) -> None:
    blobs = MemoryBlobStore()
    admin, marker = admin_and_marker(tmp_path, blobs)
    assert admin.verify_marker("counts", marker) == []
    runs = sorted(admin.referenced_blobs("counts", marker))
    flipped, gone = runs[0], runs[1]
    data = bytearray(blobs.get(flipped))
    data[len(data) // 2] ^= 0xFF
    blobs.put(flipped, bytes(data))
    blobs.delete(gone)
    problems = admin.verify_marker("counts", marker)
    assert len(problems) == 2
    assert any(flipped in p and "hash" in p for p in problems)
    assert any(gone in p and "missing" in p for p in problems)


def test_verify_names_a_damaged_inline_index(tmp_path: Path) -> None:
    blobs = MemoryBlobStore()
    admin, marker = admin_and_marker(tmp_path, blobs)
    prefix, payload = marker.rsplit(":", 1)
    data = bytearray(zlib.decompress(base64.urlsafe_b64decode(payload + "=" * (-len(payload) % 4))))
    digit = data.index(b'"records":') + 10  # the first digit of a record count: changed, still JSON
    data[digit] = ord("7") if data[digit] != ord("7") else ord("8")
    damaged = f"{prefix}:{base64.urlsafe_b64encode(zlib.compress(bytes(data))).rstrip(b'=').decode()}"
    problems = admin.verify_marker("counts", damaged)
    assert len(problems) == 1 and "checksum" in problems[0] and "inline index 000000000003-" in problems[0]
    with pytest.raises(CorruptDataError, match="inline index"):
        admin.describe_marker("counts", damaged)
    with pytest.raises(CorruptDataError, match="damaged"):
        admin.describe_marker("counts", marker[:-5])  # cut: no longer inflates to a whole index


def test_verify_names_a_damaged_index_blob(tmp_path: Path) -> None:
    blobs = MemoryBlobStore()
    admin, _ = admin_and_marker(tmp_path, blobs)
    marker = as_index_blob_markers(blobs, "job", "task-0")[3]["counts"]
    assert admin.verify_marker("counts", marker) == []
    blobs.put(marker, blobs.get(marker)[:-10])
    problems = admin.verify_marker("counts", marker)
    assert len(problems) == 1 and marker in problems[0]
    with pytest.raises(Exception, match="index blob"):
        admin.describe_marker("counts", marker)
