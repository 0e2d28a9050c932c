"""The full-copy backend against the contract suites statebackend ships, alone and in dual commits with each
built-in backend, plus what is its own (format, cleanup).

The suite finds the backend the way a job does: ``stores.counts.backup.factories=fullcopy`` resolves the entry point
this project declares, so it runs only once the project is installed (``pip install -e examples/thirdparty_backend``).
"""

from __future__ import annotations

import shutil
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any, ClassVar

import pytest
from sb_fullcopy.format import Header, blob_name, check_binding, decode, encode, parse_blob_name

from statebackend.blobstores.base import BlobStore
from statebackend.blobstores.file import FileBlobStore
from statebackend.blobstores.memory import MemoryBlobStore
from statebackend.errors import CorruptDataError
from statebackend.store import LocalVersion
from statebackend.task import TaskStorage
from statebackend.testing.backend_contract import BackendContract, contents, write_round

PREFIX = "job/task-0/counts/fullcopy/"
CONFIG: dict[str, Any] = {"stores.counts.restore.factory": "fullcopy"}
#: the suite runs with a per-store option of this backend (one unnamed older copy kept for store ``counts``), as a job
#: would set it: the framework validates it by the backend's schema and hands it to that store's manager
SUITE_CONFIG: dict[str, Any] = {**CONFIG, "stores.counts.fullcopy.keep": 1}


class TestFullCopyBackend(BackendContract):
    """The backup/restore contract suite, unchanged, on the in-memory blob store. Every commit uploads a whole copy
    of the store (``uploads_whole_state``): the suite then bounds an upload by one copy, not by the change."""

    backup_factories: ClassVar[str] = "fullcopy"
    extra_config: ClassVar[dict[str, Any]] = SUITE_CONFIG
    uploads_whole_state: ClassVar[bool] = True


class TestFullCopyBackendOnFiles(BackendContract):
    """The same suite on the file blob store (real files, real create-only writes)."""

    backup_factories: ClassVar[str] = "fullcopy"
    extra_config: ClassVar[dict[str, Any]] = SUITE_CONFIG
    uploads_whole_state: ClassVar[bool] = True

    @pytest.fixture
    def blobs(self, tmp_path: Path) -> Iterator[BlobStore]:
        with FileBlobStore(tmp_path / "blobs") as store:
            yield store


class TestFullCopyBackendDualWithChangelog(BackendContract):
    """The suite in a dual commit: fullcopy beside the built-in changelog backend, fullcopy first in the restore
    order. A damaged, cut or missing fullcopy blob must make the restore fall back to changelog, with the exact
    state."""

    backup_factories: ClassVar[str] = "fullcopy"
    dual_with: ClassVar[str | None] = "changelog"
    extra_config: ClassVar[dict[str, Any]] = {"stores.counts.fullcopy.keep": 1}
    uploads_whole_state: ClassVar[bool] = True


class TestFullCopyBackendDualWithBlobSnapshot(BackendContract):
    """The same beside the built-in blob-snapshot backend."""

    backup_factories: ClassVar[str] = "fullcopy"
    dual_with: ClassVar[str | None] = "blobsnapshot"
    extra_config: ClassVar[dict[str, Any]] = {"stores.counts.fullcopy.keep": 1}
    uploads_whole_state: ClassVar[bool] = True


def make_config(tmp_path: Path) -> dict[str, object]:
    return {
        "job.name": "job",
        "state.local.dir": str(tmp_path / "local"),
        "blob.store.url": f"memory://{uuid.uuid4().hex}",
        "stores.counts.backup.factories": "fullcopy",
        "task.checkpoint.retained": 2,
        **CONFIG,
    }


def test_blob_round_trips_and_names_its_version() -> None:
    version = LocalVersion("1700000000000-42", "00ff00ff00ff00ff")
    name = blob_name(PREFIX, version)
    assert parse_blob_name(PREFIX, name) == version
    items = [(b"a", b"1"), (b"b", b""), (b"c", b"3" * 1000)]
    header = Header("job", "task-0", "counts", version.checkpoint_id, version.token, records=0)
    decoded, records = decode(encode(header, items), name=name)
    assert records == items and decoded.records == 3 and decoded.version == version
    check_binding(decoded, name=name, prefix=PREFIX, job="job", task="task-0", store="counts")


def test_every_single_byte_flip_and_every_cut_is_detected() -> None:
    version = LocalVersion("1700000000000-0", "0123456789abcdef")
    data = encode(Header("job", "task-0", "counts", version.checkpoint_id, version.token, 0), [(b"k", b"v")])
    for position in range(len(data)):
        damaged = bytearray(data)
        damaged[position] ^= 0x01
        with pytest.raises(CorruptDataError, match="the-blob"):
            decode(bytes(damaged), name="the-blob")
        with pytest.raises(CorruptDataError, match="the-blob"):
            decode(data[:position], name="the-blob")


def test_a_blob_copied_under_another_tasks_name_is_refused(tmp_path: Path) -> None:
    blobs = MemoryBlobStore()
    config = make_config(tmp_path)
    with TaskStorage.open(config, "task-0", blob_store=blobs) as task:
        write_round(task, 0, {})
        task.commit_durably({"input": "0"})
    with TaskStorage.open(config, "task-1", blob_store=blobs) as task:
        write_round(task, 1, {})
        task.commit_durably({"input": "0"})
    (ours,) = blobs.list(PREFIX)
    (theirs,) = blobs.list("job/task-1/counts/fullcopy/")
    blobs.put(ours, blobs.get(theirs))  # same checkpoint id is not needed: the header names task-1
    shutil.rmtree(tmp_path / "local")
    with pytest.raises(CorruptDataError, match="was not loaded"):
        TaskStorage.open(config, "task-0", blob_store=blobs)


def test_cleanup_keeps_only_the_blobs_of_retained_checkpoints(tmp_path: Path) -> None:
    blobs = MemoryBlobStore()
    config = make_config(tmp_path)
    model: dict[bytes, bytes] = {}
    with TaskStorage.open(config, "task-0", blob_store=blobs) as task:
        for round_no in range(6):
            write_round(task, round_no, model)
            task.commit_durably({"input": str(round_no)})
        checkpoint_log = task.checkpoint_log
    # after the close, which waits for the last commit's cleanup and the log's retention: read before them, the log
    # could still hold a checkpoint that retention drops next, and whose blob the cleanup rightly deletes
    log_markers = {
        entry.checkpoint.markers_for("fullcopy")["counts"]  # type: ignore[union-attr]
        for entry in checkpoint_log.entries()
    }
    kept = set(blobs.list(PREFIX))
    # six commits wrote six blobs; the log keeps 2 checkpoints, and a cleanup runs before the log trims the third
    assert log_markers <= kept and len(kept) <= 3
    shutil.rmtree(tmp_path / "local")
    with TaskStorage.open(config, "task-0", blob_store=blobs) as task:
        assert contents(task) == model
