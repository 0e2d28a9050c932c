"""The blob-snapshot backend end to end through TaskStorage and the commit protocol, on real LMDB and the in-memory
blob store (the fake that passes the blob store contract suite), plus its index format and stored samples.
Compaction, catch-up and the LSM-specific guarantees: tests/test_blobsnapshot_lsm.py."""

from __future__ import annotations

import json
import shutil
from pathlib import Path
from typing import Any, ClassVar

import attrs
import pytest
from statebackend.backends.blobsnapshot.blobs import read_marker
from statebackend.backends.blobsnapshot.format import (
    SCHEMA_VERSION,
    RunEntry,
    RunIndex,
    content_hash,
    is_inline_marker,
    run_name,
)
from statebackend.backends.blobsnapshot.restore import BlobSnapshotRestoreManager
from statebackend.checkpoint import CheckpointId, CheckpointV2

from statebackend.blobstores.file import FileBlobStore
from statebackend.blobstores.memory import MemoryBlobStore
from statebackend.contracts import BackendContext
from statebackend.errors import CorruptDataError, IncompatibleFormatError, NotFoundError
from statebackend.recordfile import FORMAT_VERSION, TRAILER_SIZE, iter_records, read_header
from statebackend.store import LocalVersion
from statebackend.task import TaskStorage
from statebackend.testing.backend_contract import BackendContract
from statebackend.testing.conditional_put_contract import PerSeqMemoryBlobStore
from statebackend.testing.controlled import ControlledBlobStore
from tests.backend_helpers import BLOBSNAPSHOT_PREFIX as PREFIX
from tests.backend_helpers import blobsnapshot_config as make_config
from tests.backend_helpers import commit_then_fail_next, fill, read_marker_index, restored_after_wipe, run_blobs
from tests.backend_helpers import store_contents as contents
from tests.blobsnapshot_legacy import as_index_blob_markers


class TestBlobSnapshotBackend(BackendContract):
    """The backup/restore contract suite, unchanged, against this backend (with its sweep at init on)."""

    backup_factories: ClassVar[str] = "blobsnapshot"
    extra_config: ClassVar[dict[str, Any]] = {
        "stores.counts.restore.factory": "blobsnapshot",
    }


def uploaded_by(task: TaskStorage, offsets: dict[str, str]) -> float:
    before = task.metrics.counter("commit.bytes.uploaded")
    task.commit_durably(offsets)
    return task.metrics.counter("commit.bytes.uploaded") - before


# -- commit and restore ---------------------------------------------------------------------------------------------


def test_first_commit_uploads_one_run_and_an_index_naming_it(tmp_path: Path) -> None:
    blobs = MemoryBlobStore()
    model: dict[bytes, bytes] = {}
    with TaskStorage.open(make_config(tmp_path), "task-0", blob_store=blobs) as task:
        fill(task, model, 0, 5000, "a")
        checkpoint = task.commit_durably({"input": "0"})
    index = read_marker_index(blobs, checkpoint)
    assert len(index.runs) == 1 and index.previous_index is None
    run = index.runs[0]
    # a store that started empty: its first run holds version 1 of the chain, key order, every key
    assert (run.first_seq, run.last_seq, run.records, run.level) == (1, 1, 5000, 0)
    assert index.blob_names(PREFIX) == run_blobs(blobs)
    assert blobs.head(run_name(PREFIX, run.hash)).size == run.size
    assert index.key_count == 5000 and index.seq == 1
    assert index.version.checkpoint_id == str(checkpoint.checkpoint_id)


def test_restart_reuses_local_state_by_its_version(tmp_path: Path) -> None:
    blobs = MemoryBlobStore()
    config = make_config(tmp_path)
    model: dict[bytes, bytes] = {}
    with TaskStorage.open(config, "task-0", blob_store=blobs) as task:
        fill(task, model, 0, 3000, "a")
        task.commit_durably({"input": "0"})
    with TaskStorage.open(config, "task-0", blob_store=blobs) as task:
        assert contents(task) == model
        assert task.metrics.counter("restore.stores.reused") == 1
        assert task.metrics.counter("restore.bytes") == 0
        assert task.metrics.counter("restore.runs.applied") == 0


def test_local_data_of_another_version_is_rebuilt_from_the_runs(tmp_path: Path) -> None:
    """Local data whose recorded version is no version of the index's chain (written after the checkpoint and never
    committed) is not reused: every run is applied again from the empty store."""
    blobs = MemoryBlobStore()
    config = make_config(tmp_path)
    model: dict[bytes, bytes] = {}
    with TaskStorage.open(config, "task-0", blob_store=blobs) as task:
        fill(task, model, 0, 3000, "a")
        task.commit_durably({"input": "0"})
        fill(task, model, 0, 100, "b")
        task.commit_durably({"input": "1"})
        store = task.stores["counts"]
        store.put(b"k0000001", b"never committed")
        store.put(b"zzz-extra", b"never committed either")
        store.flush(LocalVersion("1700000000000-1", "not-a-commit"))
    with TaskStorage.open(config, "task-0", blob_store=blobs) as task:
        assert contents(task) == model
        assert task.metrics.counter("restore.stores.reused") == 0
        assert task.metrics.counter("restore.stores.full") == 1
        assert task.metrics.counter("restore.runs.applied") == 2


def test_wiped_local_dir_restores_exactly(tmp_path: Path) -> None:
    blobs = MemoryBlobStore()
    config = make_config(tmp_path)
    model: dict[bytes, bytes] = {}
    with TaskStorage.open(config, "task-0", blob_store=blobs) as task:
        for round_no in range(4):
            fill(task, model, round_no * 700, 1500, f"r{round_no}")
            for i in range(0, 400, 7):
                key = f"k{i + round_no:07d}".encode()
                task.store("counts").delete(key)
                model.pop(key, None)
            task.commit_durably({"input": str(round_no)})
    shutil.rmtree(tmp_path / "local")
    with TaskStorage.open(config, "task-0", blob_store=blobs) as task:
        assert contents(task) == model
        assert task.metrics.counter("restore.stores.full") == 1
        assert task.metrics.counter("restore.runs.applied") == 4
        assert task.restored is not None and task.restored.input_offsets == {"input": "3"}
        # and it goes on committing from the restored state
        fill(task, model, 9000, 10, "after")
        task.commit_durably({"input": "4"})
    assert restored_after_wipe(config, blobs) == model


def test_file_blob_store_round_trip(tmp_path: Path) -> None:
    blobs = FileBlobStore.from_url(f"file://{tmp_path / 'blobs'}", FileBlobStore.parse_options({}))
    config = make_config(tmp_path, **{"blob.store.url": f"file://{tmp_path / 'blobs'}"})
    model: dict[bytes, bytes] = {}
    with TaskStorage.open(config, "task-0", blob_store=blobs) as task:
        fill(task, model, 0, 2000, "a")
        task.commit_durably({"input": "0"})
        fill(task, model, 100, 50, "b")
        task.commit_durably({"input": "1"})
    assert restored_after_wipe(config, blobs) == model


def test_no_change_commit_uploads_no_blob_and_restores_the_same_state(tmp_path: Path) -> None:
    blobs = MemoryBlobStore()
    config = make_config(tmp_path)
    model: dict[bytes, bytes] = {}
    with TaskStorage.open(config, "task-0", blob_store=blobs) as task:
        fill(task, model, 0, 5000, "a")
        first_checkpoint = task.commit_durably({"input": "0"})
        runs_before = run_blobs(blobs)
        second = uploaded_by(task, {"input": "1"})
        assert task.metrics.counter("blobsnapshot.runs.uploaded") == 1
        assert run_blobs(blobs) == runs_before
        latest = task.commit_manager.last_checkpoint
        assert latest is not None
        index = read_marker_index(blobs, latest)
        assert index.runs == read_marker_index(blobs, first_checkpoint).runs and index.seq == 2
        assert second == 0  # no blob: the index goes up inline in the checkpoint's marker
    shutil.rmtree(tmp_path / "local")
    with TaskStorage.open(config, "task-0", blob_store=blobs) as task:
        assert contents(task) == model
        assert task.restored is not None and task.restored.input_offsets == {"input": "1"}


def test_small_change_uploads_a_small_run(tmp_path: Path) -> None:
    blobs = MemoryBlobStore()
    config = make_config(tmp_path)
    model: dict[bytes, bytes] = {}
    with TaskStorage.open(config, "task-0", blob_store=blobs) as task:
        fill(task, model, 0, 20_000, "a")
        first = uploaded_by(task, {"input": "0"})
        fill(task, model, 10_000, 5, "b")
        second = uploaded_by(task, {"input": "1"})
        assert second < first / 4
        latest = task.commit_manager.last_checkpoint
        assert latest is not None
        index = read_marker_index(blobs, latest)
        assert index.previous_index is not None and len(index.runs) == 2
        assert index.runs[-1].records == 5 and (index.runs[-1].first_seq, index.runs[-1].last_seq) == (2, 2)
        assert index.runs[-1].size < index.runs[0].size / 20
        # the commit uploaded the new run (the index is inline in the marker), nothing of the first run
        assert second == index.runs[-1].size
    assert restored_after_wipe(config, blobs) == model


def test_deletes_are_tombstones_in_the_run_and_restore_exactly(tmp_path: Path) -> None:
    blobs = MemoryBlobStore()
    config = make_config(tmp_path)
    model: dict[bytes, bytes] = {}
    with TaskStorage.open(config, "task-0", blob_store=blobs) as task:
        fill(task, model, 0, 1000, "a")
        task.commit_durably({"input": "0"})
        for i in range(0, 1000, 3):
            key = f"k{i:07d}".encode()
            task.store("counts").delete(key)
            del model[key]
        task.store("counts").delete(b"never-there")
        checkpoint = task.commit_durably({"input": "1"})
    index = read_marker_index(blobs, checkpoint)
    last = index.runs[-1]
    records = list(iter_records(blobs.get(run_name(PREFIX, last.hash)), name="run"))
    assert records and all(value is None for _, value in records)
    assert {key for key, _ in records} >= {f"k{i:07d}".encode() for i in range(0, 1000, 3)}
    assert index.key_count == len(model)
    assert restored_after_wipe(config, blobs) == model


def test_runs_are_written_in_the_newest_record_file_version(tmp_path: Path) -> None:
    """Runs use the shared record file format; they get its newest version (byte planes for keys of one length)."""
    blobs = MemoryBlobStore()
    model: dict[bytes, bytes] = {}
    with TaskStorage.open(make_config(tmp_path), "task-0", blob_store=blobs) as task:
        fill(task, model, 0, 500, "a")
        checkpoint = task.commit_durably({"input": "0"})
    data = blobs.get(run_name(PREFIX, read_marker_index(blobs, checkpoint).runs[-1].hash))
    assert read_header(data, name="run").format_version == FORMAT_VERSION == 4
    assert dict(iter_records(data, name="run")) == model
    # the name is the hash of the content: every byte but the nonce trailer the run ends in
    run = read_marker_index(blobs, checkpoint).runs[-1]
    assert content_hash(data) != run.hash and content_hash(data[:-TRAILER_SIZE]) == run.hash


def test_index_names_its_previous_index_and_appends_the_new_run(tmp_path: Path) -> None:
    blobs = MemoryBlobStore()
    config = make_config(tmp_path)
    model: dict[bytes, bytes] = {}
    with TaskStorage.open(config, "task-0", blob_store=blobs) as task:
        fill(task, model, 0, 2000, "a")
        first = task.commit_durably({"input": "0"})
        fill(task, model, 1500, 2, "b")
        second = task.commit_durably({"input": "1"})
    a = read_marker_index(blobs, first)
    b = read_marker_index(blobs, second)
    assert is_inline_marker(first.markers_for("blobsnapshot")["counts"])
    assert b.previous_index == f"{a.seq:012d}-{a.token}"  # the previous inline index's seq and token
    assert b.runs[:-1] == a.runs and b.runs[-1].first_seq == a.runs[-1].last_seq + 1
    assert b.runs[-1].version == b.version


def test_store_dropped_from_config_leaves_the_others_restorable(tmp_path: Path) -> None:
    blobs = MemoryBlobStore()
    config = make_config(
        tmp_path, **{"stores.other.backup.factories": "blobsnapshot", "stores.other.restore.factory": "blobsnapshot"}
    )
    model: dict[bytes, bytes] = {}
    with TaskStorage.open(config, "task-0", blob_store=blobs) as task:
        fill(task, model, 0, 1000, "a")
        fill(task, {}, 0, 1000, "o", name="other")
        task.commit_durably({"input": "0"})
    dropped = {k: v for k, v in config.items() if not k.startswith("stores.other.")}
    shutil.rmtree(tmp_path / "local")
    with TaskStorage.open(dropped, "task-0", blob_store=blobs) as task:
        assert set(task.stores) == {"counts"}
        assert contents(task) == model
        fill(task, model, 2000, 10, "b")
        checkpoint = task.commit_durably({"input": "1"})
        assert set(checkpoint.markers_for("blobsnapshot")) == {"counts"}
    shutil.rmtree(tmp_path / "local")
    with TaskStorage.open(dropped, "task-0", blob_store=blobs) as task:
        assert contents(task) == model


# -- damage: detected, named, never loaded ----------------------------------------------------------------------------


def _committed_twice(tmp_path: Path, blobs: MemoryBlobStore) -> tuple[dict[str, object], dict[bytes, bytes], str]:
    config = make_config(tmp_path)
    model: dict[bytes, bytes] = {}
    with TaskStorage.open(config, "task-0", blob_store=blobs) as task:
        fill(task, model, 0, 3000, "a")
        task.commit_durably({"input": "0"})
        older = dict(model)
        fill(task, model, 0, 3000, "b")
        checkpoint = task.commit_durably({"input": "1"})
    # local state at the older checkpoint: a restore must leave it exactly so when it fails
    with TaskStorage.open(config, "task-0", blob_store=blobs, checkpoint=lambda e: e.seq == 1) as task:
        assert contents(task) == older
    return config, older, checkpoint.markers_for("blobsnapshot")["counts"]


def _newest_run(blobs: MemoryBlobStore, marker: str) -> str:
    return run_name(PREFIX, read_marker(blobs, marker, job="job", task="task-0", store="counts").runs[-1].hash)


def test_corrupt_run_is_named_never_loaded_and_previous_local_state_stays(tmp_path: Path) -> None:
    blobs = MemoryBlobStore()
    config, older, marker = _committed_twice(tmp_path, blobs)
    victim = _newest_run(blobs, marker)
    data = bytearray(blobs.get(victim))
    data[len(data) // 2] ^= 0x01
    blobs.put(victim, bytes(data))
    with pytest.raises(CorruptDataError) as excinfo:
        TaskStorage.open(config, "task-0", blob_store=blobs)
    assert victim in str(excinfo.value)
    with TaskStorage.open(config, "task-0", blob_store=blobs, checkpoint=lambda e: e.seq == 1) as task:
        assert contents(task) == older
        assert task.metrics.counter("restore.stores.reused") == 1


def test_missing_run_is_named_and_nothing_is_applied(tmp_path: Path) -> None:
    blobs = MemoryBlobStore()
    config, older, marker = _committed_twice(tmp_path, blobs)
    victim = _newest_run(blobs, marker)
    blobs.delete(victim)
    with pytest.raises(NotFoundError) as excinfo:
        TaskStorage.open(config, "task-0", blob_store=blobs)
    assert victim in str(excinfo.value)
    with TaskStorage.open(config, "task-0", blob_store=blobs, checkpoint=lambda e: e.seq == 1) as task:
        assert contents(task) == older
        assert task.metrics.counter("restore.stores.reused") == 1


#: both checkpoint log layouts: the head (a store with conditional writes) and the per-seq blobs (one without)
LAYOUTS = pytest.mark.parametrize("store_type", [MemoryBlobStore, PerSeqMemoryBlobStore], ids=["head", "per-seq"])


def _committed_twice_as_index_blobs(tmp_path: Path, blobs: MemoryBlobStore) -> tuple[dict[str, object], str]:
    """:func:`_committed_twice`, its checkpoints rewritten as an older release wrote them (the marker names an index
    blob); returns the config and the newest checkpoint's marker."""
    config, _, _ = _committed_twice(tmp_path, blobs)
    head = "job/task-0/checkpoints/HEAD.v3.json"
    assert (head in set(blobs.list("job/task-0/checkpoints/"))) is blobs.supports_conditional_put  # the layout
    return config, as_index_blob_markers(blobs, "job", "task-0")[2]["counts"]


@LAYOUTS
def test_missing_index_is_named(tmp_path: Path, store_type: type[MemoryBlobStore]) -> None:
    blobs = store_type()
    config, marker = _committed_twice_as_index_blobs(tmp_path, blobs)
    blobs.delete(marker)
    with pytest.raises(NotFoundError) as excinfo:
        TaskStorage.open(config, "task-0", blob_store=blobs)
    assert marker in str(excinfo.value)


@LAYOUTS
def test_corrupt_or_truncated_index_is_named(tmp_path: Path, store_type: type[MemoryBlobStore]) -> None:
    blobs = store_type()
    config, marker = _committed_twice_as_index_blobs(tmp_path, blobs)
    original = blobs.get(marker)
    document = json.loads(original)
    document["runs"][0]["size"] += 1  # still valid JSON; the checksum no longer matches
    blobs.put(marker, json.dumps(document).encode())
    with pytest.raises(CorruptDataError, match="checksum") as excinfo:
        TaskStorage.open(config, "task-0", blob_store=blobs)
    assert marker in str(excinfo.value)
    blobs.put(marker, original[: len(original) // 2])
    with pytest.raises(CorruptDataError) as excinfo:
        TaskStorage.open(config, "task-0", blob_store=blobs)
    assert marker in str(excinfo.value)


def test_index_with_a_broken_chain_is_refused_even_with_a_valid_checksum() -> None:
    """An index whose runs do not rebuild one history (a gap) is refused at decode, whatever its checksum says."""
    index = _sample_index()
    gap = attrs.evolve(index.runs[1], first_seq=index.runs[1].first_seq + 1)
    broken = attrs.evolve(index, runs=(index.runs[0], gap, *index.runs[2:]))
    with pytest.raises(CorruptDataError, match="chain") as excinfo:
        RunIndex.decode(broken.encode(), name="x/index/000000000007-tok-7.json")
    assert "x/index/000000000007-tok-7.json" in str(excinfo.value)


def test_index_of_a_future_schema_version_is_rejected_as_incompatible() -> None:
    document = json.loads(_sample_index().encode())
    document["schema_version"] = SCHEMA_VERSION + 1
    with pytest.raises(IncompatibleFormatError, match="schema_version"):
        RunIndex.decode(json.dumps(document).encode(), name="x/index/000000000001-t.json")


def test_index_round_trips_through_its_encoding() -> None:
    index = _sample_index()
    assert RunIndex.decode(index.encode(), name="i") == index


def test_stored_v1_index_sample_is_refused_naming_the_migration_path() -> None:
    """A sample written by schema version 1 (tests/data/blobsnapshot/index-v1.json): whole-environment chunks are no
    longer read, and the error says how to migrate."""
    path = SAMPLES / "index-v1.json"
    with pytest.raises(IncompatibleFormatError) as excinfo:
        RunIndex.decode(path.read_bytes(), name=str(path))
    message = str(excinfo.value)
    assert str(path) in message and "schema version 1" in message
    assert "changelog" in message and "backup.factories" in message and "base run" in message
    assert "docs/formats-blobsnapshot.md" in message


@LAYOUTS
def test_stored_v1_index_is_refused_at_restore_naming_the_migration_path(
    tmp_path: Path, store_type: type[MemoryBlobStore]
) -> None:
    """A checkpoint whose only marker for the store is a schema-1 index: the open fails, naming the index and the
    migration path (with another backend's marker, restore falls back to it: tests/test_migration.py)."""
    blobs = store_type()
    config = make_config(tmp_path)
    with TaskStorage.open(config, "task-0", blob_store=blobs) as task:
        fill(task, {}, 0, 10, "a")
        checkpoint = task.commit_durably({"input": "0"})
    assert checkpoint.checkpoint_id is not None
    marker = as_index_blob_markers(blobs, "job", "task-0")[1]["counts"]  # as a release of schema 1's time named it
    blobs.put(marker, (SAMPLES / "index-v1.json").read_bytes())
    shutil.rmtree(tmp_path / "local")
    with pytest.raises(IncompatibleFormatError) as excinfo:
        TaskStorage.open(config, "task-0", blob_store=blobs)
    assert marker in str(excinfo.value) and "schema version 1" in str(excinfo.value)


def test_stored_inline_marker_sample_decodes_to_the_stored_index() -> None:
    """The stored inline marker (form 1: ``inline-index:1:``; tests/data/blobsnapshot/marker-inline-v1.txt, written
    once from the schema-2 index sample with ``inline_marker`` and kept as written) decodes to exactly that index,
    bound to its job, task and store; a later marker form must keep reading it."""
    from statebackend.backends.blobsnapshot.format import decode_inline_marker

    expected = json.loads((SAMPLES / "expected-v2.json").read_text())
    index = RunIndex.decode((SAMPLES / "index-v2.json").read_bytes(), name=expected["index_name"])
    marker = (SAMPLES / "marker-inline-v1.txt").read_text().strip()
    assert marker.startswith("inline-index:1:")
    assert decode_inline_marker(marker, job="sample-job", task="task-0", store="counts") == index
    with pytest.raises(CorruptDataError):
        decode_inline_marker(marker, job="sample-job", task="task-1", store="counts")


def test_stored_v2_sample_decodes_re_encodes_byte_for_byte_and_restores_exactly(tmp_path: Path) -> None:
    """The stored schema-2 sample (tests/data/blobsnapshot/make_samples.py): the index decodes and encodes back to
    the same bytes, every run is the hash its index names, and a restore of it gives exactly the expected store."""
    expected = json.loads((SAMPLES / "expected-v2.json").read_text())
    name = expected["index_name"]
    data = (SAMPLES / "index-v2.json").read_bytes()
    index = RunIndex.decode(data, name=name)
    assert index.encode() == data
    assert [run.base for run in index.runs] == [True, False, False] and index.seq == 7
    assert index.runs[-1].last_seq == 6  # commit 7 changed nothing
    prefix = "sample-job/task-0/counts/blobsnapshot/"
    blobs = MemoryBlobStore()
    blobs.put(name, data)
    for run in index.runs:
        run_bytes = (SAMPLES / "runs-v2" / run.hash).read_bytes()
        assert content_hash(run_bytes) == run.hash and len(run_bytes) == run.size
        blobs.put(run_name(prefix, run.hash), run_bytes)
    want = {bytes.fromhex(k): bytes.fromhex(v) for k, v in expected["contents"].items()}
    assert index.key_count == len(want)
    config = make_config(tmp_path, **{"job.name": "sample-job"})
    with TaskStorage.open(config, "task-0", blob_store=MemoryBlobStore()) as task:
        context = BackendContext(
            factory_name="blobsnapshot",
            job_name="sample-job",
            task_name="task-0",
            stores=task.stores,
            blob_store=blobs,
            checkpoint_log=task.checkpoint_log,
            executor=task.commit_manager.executor,
            metrics=task.metrics,
        )
        manager = BlobSnapshotRestoreManager(context=context)
        manager.init(
            CheckpointV2(CheckpointId.parse(index.checkpoint_id), {"input": "0"}, {"blobsnapshot": {"counts": name}})
        )
        manager.restore()
        assert contents(task) == want
        assert task.stores["counts"].version == index.version
        assert task.metrics.counter("restore.runs.applied") == 3


SAMPLES = Path(__file__).parent / "data" / "blobsnapshot"


def _sample_index() -> RunIndex:
    def entry(seed: bytes, first: int, last: int, level: int, base: bool) -> RunEntry:
        return RunEntry(
            hash=content_hash(seed),
            size=100 + last,
            records=10 * last,
            level=level,
            base=base,
            first_seq=first,
            last_seq=last,
            checkpoint_id=f"1700000000000-{last:06d}",
            token=f"tok-{last}",
        )

    return RunIndex(
        job="job",
        task="task-0",
        store="counts",
        checkpoint_id="1700000000000-000007",
        token="tok-7",
        seq=7,
        runs=(entry(b"base", 1, 3, 1 << 16, True), entry(b"merged", 4, 5, 1, False), entry(b"one", 6, 6, 0, False)),
        key_count=42,
        previous_index="job/task-0/counts/blobsnapshot/index/000000000006-tok-6.json",
    )


# -- failures during commit ------------------------------------------------------------------------------------------


def test_failed_run_upload_fails_the_commit_and_the_next_one_recovers(tmp_path: Path) -> None:
    blobs = ControlledBlobStore(MemoryBlobStore())
    config = make_config(tmp_path)
    model: dict[bytes, bytes] = {}
    with TaskStorage.open(config, "task-0", blob_store=blobs) as task:
        commit_then_fail_next(task, blobs, model, "/runs/", keys=2000, failed_keys=2000)
        again = task.commit({"input": "1b"})  # the failure was reported through result(): not raised again
        assert again is not None
        again.result(timeout=30)
        fill(task, model, 50, 10, "c")
        checkpoint = task.commit_durably({"input": "2"})
        assert checkpoint.input_offsets == {"input": "2"}
    assert restored_after_wipe(config, blobs) == model


def test_processing_goes_on_while_a_snapshot_uploads(tmp_path: Path) -> None:
    blobs = ControlledBlobStore(MemoryBlobStore())
    config = make_config(tmp_path, **{"task.commit.max.delay.ms": 3_600_000})
    model: dict[bytes, bytes] = {}
    with TaskStorage.open(config, "task-0", blob_store=blobs) as task:
        blobs.hold = lambda name: "/runs/" in name
        fill(task, model, 0, 2000, "a")
        snapshot_state = dict(model)
        first = task.commit({"input": "0"})
        assert first is not None and blobs.held.wait(30)
        # the upload is stuck on its run write; the task keeps writing and even flushing
        fill(task, model, 0, 2000, "b")
        assert task.commit({"input": "1"}) is None
        blobs.release.set()
        first.result(timeout=30)
    shutil.rmtree(tmp_path / "local")
    with TaskStorage.open(config, "task-0", blob_store=blobs, checkpoint=lambda e: e.seq == 1) as task:
        assert contents(task) == snapshot_state


def test_interrupted_restore_leaves_previous_state(tmp_path: Path) -> None:
    blobs = MemoryBlobStore()
    config, older, _ = _committed_twice(tmp_path, blobs)
    with TaskStorage.open(config, "task-0", blob_store=blobs, checkpoint=lambda e: e.seq == 1) as task:
        context = BackendContext(
            factory_name="blobsnapshot",
            job_name="job",
            task_name="task-0",
            stores=task.stores,
            blob_store=blobs,
            checkpoint_log=task.checkpoint_log,
            executor=task.commit_manager.executor,
            metrics=task.metrics,
        )
        manager = BlobSnapshotRestoreManager(context=context)
        manager.init(task.checkpoint_log.read(2).checkpoint)  # type: ignore[arg-type]
        manager.interrupt()
        with pytest.raises(InterruptedError):
            manager.restore()
        assert contents(task) == older
