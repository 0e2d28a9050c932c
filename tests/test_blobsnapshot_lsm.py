"""The blob-snapshot backend as an LSM tree of immutable runs (issue 10), end to end through TaskStorage on real LMDB
and the in-memory blob store: bytes per commit follow the change; merges and full compactions keep the state exact
(random histories against a dict); compaction runs in the background and never blocks a commit; a finished
compaction is adopted by a later commit, or by the next open; a warm open downloads nothing; catch-up applies only
the missing runs; a retried upload is not uploaded twice; garbage collection deletes runs merged away and never one a
retained index needs; damage to a compacted run or a cached copy is caught. SIGKILL at the run-upload and compaction
crash points: tests/test_crash_blobsnapshot.py; migrations with compaction: tests/test_migration.py."""

from __future__ import annotations

import random
import shutil
import tempfile
import threading
from collections import Counter
from collections.abc import Iterator, Mapping
from concurrent import futures
from pathlib import Path
from typing import Any

import attrs
import pytest
from statebackend.backends.blobsnapshot.backup import COMPACTED_FILE
from statebackend.backends.blobsnapshot.blobs import read_marker
from statebackend.backends.blobsnapshot.format import RunIndex, run_name
from statebackend.checkpoint import CheckpointLog

from statebackend import envbase
from statebackend.blobstores.base import BlobStore
from statebackend.blobstores.memory import MemoryBlobStore
from statebackend.errors import CorruptDataError
from statebackend.recordfile import iter_records
from statebackend.store import LocalVersion
from statebackend.store.env import open_env
from statebackend.task import TaskStorage
from statebackend.testing.controlled import ControlledBlobStore
from tests.backend_helpers import BLOBSNAPSHOT_PREFIX as PREFIX
from tests.backend_helpers import FAR_FUTURE, NEVER, latest_index, restored_after_wipe, settle
from tests.backend_helpers import blobsnapshot_config as make_config
from tests.backend_helpers import blobsnapshot_manager as manager_of
from tests.backend_helpers import store_contents as contents

#: compactions as often as possible: merges of every two runs of a level, no minimum size for a full compaction
EAGER = {"blobsnapshot.compaction.fanout": 2, "blobsnapshot.compaction.full.min.bytes": 0}
#: no compaction at all (fanout and size thresholds out of reach)
METRICS = (
    "blobsnapshot.compactions.merge",
    "blobsnapshot.compactions.full",
    "blobsnapshot.compaction.adopted",
    "blobsnapshot.base.runs",
    "blobsnapshot.runs.deleted",
)


class CountingStore(ControlledBlobStore):
    """Records every ``get`` (a restore reads runs and indexes with it). The inner store's conditional writes pass
    through with its flag, so the checkpoint log keeps the layout it has on the inner store (its head there)."""

    def __init__(self, inner: BlobStore) -> None:
        super().__init__(inner)
        self.supports_conditional_put = inner.supports_conditional_put
        self.gets: list[str] = []

    def get(self, name: str, *, start: int | None = None, end: int | None = None) -> bytes:
        self.gets.append(name)
        return super().get(name, start=start, end=end)

    def get_versioned(self, name: str) -> tuple[bytes, str]:
        self.gets.append(name)
        return self.inner.get_versioned(name)

    def put_if(self, name: str, data: bytes, *, version: str | None) -> str:
        self._before_write(name)
        written = self.inner.put_if(name, data, version=version)
        self._after_write(name, len(data))
        return written

    def run_gets(self) -> list[str]:
        return [name for name in self.gets if "/blobsnapshot/runs/" in name]


def write(task: TaskStorage, model: dict[bytes, bytes], items: Mapping[bytes, bytes | None]) -> None:
    store = task.store("counts")
    for key, value in items.items():
        if value is None:
            store.delete(key)
            model.pop(key, None)
        else:
            store.put(key, value)
            model[key] = value


def rounds(task: TaskStorage, model: dict[bytes, bytes], start: int, count: int, *, keys: int = 400) -> None:
    """``count`` commits of 60 updates and 20 deletes each over ``keys`` keys."""
    for round_no in range(start, start + count):
        items: dict[bytes, bytes | None] = {}
        for i in range(80):
            key = f"k{(i * 37 + round_no * 101) % keys:05d}".encode()
            items[key] = None if i % 4 == 3 else f"value-{round_no}-{i}-".encode() * 5
        write(task, model, items)
        task.commit_durably({"input": str(round_no)})


def copy_blob_store(blobs: MemoryBlobStore) -> MemoryBlobStore:
    copy = MemoryBlobStore()
    for name in blobs.list(""):
        copy.put(name, blobs.get(name), metadata=dict(blobs.head(name).metadata) or None)
    return copy


def run_records(blobs: BlobStore, digest: str) -> list[tuple[bytes, bytes | None]]:
    name = run_name(PREFIX, digest)
    data = blobs.get(name)
    if not envbase.is_env_base(data):
        return list(iter_records(data, name=digest))
    # a base run written as an environment file: its records are those of the LMDB environment it holds
    with tempfile.TemporaryDirectory() as tmp:
        envbase.restore_env_base(
            envbase.BlobSource(blobs, name, len(data)), Path(tmp) / "env", check=lambda header: None
        )
        env, data_db, _ = open_env(Path(tmp) / "env", 1 << 30, create=False)
        try:
            with env.begin(db=data_db) as txn:
                return list(txn.cursor().iternext())
        finally:
            env.close()


# -- cost follows the change ------------------------------------------------------------------------------------------


def no_more_full_compactions(task: TaskStorage) -> None:
    """The task's blob-snapshot manager compacts by merges only from now on (a full-compaction ratio no run reaches)."""
    shared = manager_of(task).shared
    shared.settings = attrs.evolve(shared.settings, compaction_full_ratio=100.0)


def test_bytes_uploaded_per_commit_follow_the_change_not_the_store(tmp_path: Path) -> None:
    blobs = MemoryBlobStore()
    model: dict[bytes, bytes] = {}
    with TaskStorage.open(make_config(tmp_path), "task-0", blob_store=blobs) as task:
        write(task, model, {f"key-{i:08d}".encode(): f"{i * 7919 % 100_003}".encode() for i in range(50_000)})
        task.commit_durably({"input": "0"})
        first = task.metrics.counter("commit.bytes.uploaded")
        write(task, model, {b"key-00025000": b"changed"})
        task.commit_durably({"input": "1"})
        second = task.metrics.counter("commit.bytes.uploaded") - first
        index = latest_index(blobs, task)
    assert [run.records for run in index.runs] == [50_000, 1]
    assert run_records(blobs, index.runs[-1].hash) == [(b"key-00025000", b"changed")]
    # the commit uploaded its one-record run (its index is inline in the marker): nothing that grows with the store
    assert second == index.runs[-1].size
    assert index.runs[-1].size < 1024 and second < first / 50
    shutil.rmtree(tmp_path / "local")
    with TaskStorage.open(make_config(tmp_path), "task-0", blob_store=blobs) as task:
        assert contents(task) == model


# -- compaction keeps the state exact ---------------------------------------------------------------------------------


@pytest.mark.parametrize("seed", [*range(3), *(pytest.param(seed, marks=pytest.mark.slow) for seed in range(3, 12))])
def test_random_histories_with_merges_and_full_compactions_restore_exactly(tmp_path: Path, seed: int) -> None:
    """Puts, deletes, commits, reopens (local dir kept) and wipes (local dir gone) against a dict, with compactions
    at almost every commit; after every open the state is exactly the last durable checkpoint's, every index's key
    count is the model's, and every base run holds no tombstone."""
    rng = random.Random(seed)
    blobs = MemoryBlobStore()
    config = make_config(tmp_path, **EAGER, **{"blobsnapshot.compaction.full.ratio": rng.choice([0.3, 1.0, 2.5])})
    model: dict[bytes, bytes] = {}
    durable: dict[bytes, bytes] = {}
    totals: Counter[str] = Counter()
    commits = 0
    task = TaskStorage.open(config, "task-0", blob_store=blobs)

    def reopen(wipe: bool) -> TaskStorage:
        task.close()
        totals.update({name: int(task.metrics.counter(name)) for name in METRICS})
        if wipe:
            shutil.rmtree(tmp_path / "local")
        reopened = TaskStorage.open(config, "task-0", blob_store=blobs)
        assert contents(reopened) == durable, f"seed {seed}: restored state differs after {commits} commits"
        return reopened

    try:
        for _ in range(150):
            action = rng.random()
            if action < 0.5:
                items: dict[bytes, bytes | None] = {}
                for _ in range(rng.randint(1, 40)):
                    key = f"k{rng.randrange(250):04d}".encode()
                    items[key] = None if rng.random() < 0.3 else rng.randbytes(rng.choice([0, 1, 10, 100, 400]))
                write(task, model, items)
            elif action < 0.85:
                task.commit_durably({"input": str(commits)})
                commits += 1
                durable = dict(model)
                index = latest_index(blobs, task)
                assert index.key_count == len(durable)
                for run in index.runs:
                    if run.base:
                        assert all(value is not None for _, value in run_records(blobs, run.hash))
                if rng.random() < 0.6:
                    settle(task)
            else:
                task = reopen(wipe=action > 0.95)
                model = dict(durable)
        task.commit_durably({"input": str(commits)})
        durable = dict(model)
        task = reopen(wipe=True)
    finally:
        task.close()
    totals.update({name: int(task.metrics.counter(name)) for name in METRICS})
    assert totals["blobsnapshot.compactions.merge"] > 0 and totals["blobsnapshot.compactions.full"] > 0, totals
    assert totals["blobsnapshot.compaction.adopted"] > 0, totals


def test_a_full_compaction_writes_a_base_run_without_tombstones_and_restores_exactly(tmp_path: Path) -> None:
    """Deletes are tombstones in the runs above the bottom; a full compaction rewrites the store from LMDB as a base
    run: no tombstone, exactly the live keys, adopted by the next commit in place of every run it covers."""
    blobs = MemoryBlobStore()
    config = make_config(
        tmp_path,
        **{
            "blobsnapshot.compaction.fanout": 100,
            "blobsnapshot.compaction.full.ratio": 0.05,
            "blobsnapshot.compaction.full.min.bytes": 0,
        },
    )
    model: dict[bytes, bytes] = {}
    with TaskStorage.open(config, "task-0", blob_store=blobs) as task:
        write(task, model, {f"k{i:05d}".encode(): f"value-{i}".encode() * 3 for i in range(500)})
        task.commit_durably({"input": "0"})
        write(task, model, {f"k{i:05d}".encode(): None for i in range(0, 500, 2)})  # 250 tombstones
        task.commit_durably({"input": "1"})
        tombstones = latest_index(blobs, task).runs[-1]
        assert [value for _, value in run_records(blobs, tombstones.hash)] == [None] * 250
        settle(task)
        no_more_full_compactions(task)  # no second one
        write(task, model, {b"k00001": b"after"})
        task.commit_durably({"input": "2"})
        index = latest_index(blobs, task)
        assert task.metrics.counter("blobsnapshot.compactions.full") == 1
        assert task.metrics.counter("blobsnapshot.compaction.adopted") == 1
    base, last = index.runs
    assert base.base and (base.first_seq, base.last_seq) == (1, 2) and base.version == tombstones.version
    records = run_records(blobs, base.hash)
    assert all(value is not None for _, value in records) and len(records) == base.records == 250
    assert (last.first_seq, last.last_seq, last.records) == (3, 3, 1)
    assert restored_after_wipe(config, blobs) == model


def test_merges_replace_the_runs_of_one_level_with_one_run_of_the_next(tmp_path: Path) -> None:
    blobs = MemoryBlobStore()
    config = make_config(
        tmp_path,
        **{
            "blobsnapshot.compaction.fanout": 3,
            "blobsnapshot.compaction.full.ratio": 100.0,
            "blobsnapshot.compaction.full.min.bytes": 0,
        },
    )
    model: dict[bytes, bytes] = {}
    with TaskStorage.open(config, "task-0", blob_store=blobs) as task:
        rounds(task, model, 0, 4)  # the bottom run and three level-0 runs above it: a merge starts
        before = latest_index(blobs, task)
        assert [run.level for run in before.runs] == [0, 0, 0, 0]
        settle(task)
        rounds(task, model, 4, 1)
        after = latest_index(blobs, task)
        assert task.metrics.counter("blobsnapshot.compactions.merge") == 1
    bottom, merged, newest = after.runs
    assert bottom == before.runs[0] and merged.level == 1 and newest.level == 0
    assert (merged.first_seq, merged.last_seq, merged.version) == (2, 4, before.runs[-1].version)
    # the merge holds the newest value of each key of its inputs, tombstones included (the bottom run may hold them)
    expected: dict[bytes, bytes | None] = {}
    for run in before.runs[1:]:
        expected.update(run_records(blobs, run.hash))
    assert run_records(blobs, merged.hash) == sorted(expected.items())
    assert restored_after_wipe(config, blobs) == model


# -- compaction in the background -------------------------------------------------------------------------------------


def test_a_compaction_held_on_its_upload_never_blocks_commits(tmp_path: Path) -> None:
    blobs = ControlledBlobStore(MemoryBlobStore())
    blobs.hold = lambda name: threading.current_thread().name.startswith("blobsnapshot-compaction")
    config = make_config(tmp_path, **EAGER)
    model: dict[bytes, bytes] = {}
    try:
        with TaskStorage.open(config, "task-0", blob_store=blobs) as task:
            state = manager_of(task).shared.stores["counts"]
            round_no = 0
            while state.compaction is None:
                rounds(task, model, round_no, 1)
                round_no += 1
                assert round_no < 10, "no compaction started"
            compaction = state.compaction
            assert blobs.held.wait(30), "the compaction never reached its upload"
            live = len(latest_index(blobs, task).runs)
            for _ in range(5):  # commits go on, each with its own run, while the compaction waits
                rounds(task, model, round_no, 1)
                round_no += 1
                assert not compaction.done()
                assert len(latest_index(blobs, task).runs) == live + 1
                live += 1
            assert task.metrics.counter("blobsnapshot.compaction.adopted") == 0
            blobs.release.set()
            assert compaction.result(timeout=60) is not None
            rounds(task, model, round_no, 1)
            assert task.metrics.counter("blobsnapshot.compaction.adopted") == 1
            assert len(latest_index(blobs.inner, task).runs) < live + 1
    finally:
        blobs.release.set()
    shutil.rmtree(tmp_path / "local")
    with TaskStorage.open(config, "task-0", blob_store=blobs.inner) as task:
        assert contents(task) == model


def test_a_compaction_finished_after_the_last_commit_is_recorded_and_adopted_by_the_next_open(tmp_path: Path) -> None:
    blobs = MemoryBlobStore()
    config = make_config(tmp_path, **EAGER)
    model: dict[bytes, bytes] = {}
    with TaskStorage.open(config, "task-0", blob_store=blobs) as task:
        state = manager_of(task).shared.stores["counts"]
        round_no = 0
        while state.compaction is None:
            rounds(task, model, round_no, 1)
            round_no += 1
            assert round_no < 10, "no compaction started"
        compacted = state.compaction.result(timeout=60)
        assert compacted is not None
        record = Path(task.stores["counts"].path) / COMPACTED_FILE
    assert record.exists(), "closed with an unadopted compaction: it must be recorded in the store dir"
    with TaskStorage.open(config, "task-0", blob_store=blobs) as task:
        assert task.metrics.counter("restore.stores.reused") == 1
        rounds(task, model, round_no, 1)
        assert task.metrics.counter("blobsnapshot.compaction.adopted") == 1
        index = latest_index(blobs, task)
        assert compacted.output in index.runs
        assert all(run not in index.runs for run in compacted.inputs)
    assert not record.exists()
    assert restored_after_wipe(config, blobs) == model


# -- restore: reuse and catch-up --------------------------------------------------------------------------------------


def test_a_warm_open_reuses_the_local_store_without_downloading_any_run(tmp_path: Path) -> None:
    inner = MemoryBlobStore()
    config = make_config(tmp_path, **NEVER)
    model: dict[bytes, bytes] = {}
    with TaskStorage.open(config, "task-0", blob_store=inner) as task:
        write(task, model, {f"key-{i:07d}".encode(): b"v" * 20 for i in range(20_000)})
        task.commit_durably({"input": "-1"})
        rounds(task, model, 0, 4)
    counting = CountingStore(inner)
    with TaskStorage.open(config, "task-0", blob_store=counting) as task:
        assert contents(task) == model
        assert task.metrics.counter("restore.stores.reused") == 1
        assert task.metrics.counter("restore.bytes") == 0
        assert task.metrics.counter("restore.runs.applied") == 0
    assert counting.run_gets() == []
    # the index is inline in the checkpoint's marker: no read of any blob of this backend
    assert {name for name in counting.gets if "/blobsnapshot/" in name} == set()


def test_catch_up_applies_and_downloads_only_the_missing_runs(tmp_path: Path) -> None:
    inner = MemoryBlobStore()
    config = make_config(tmp_path, **NEVER)
    model: dict[bytes, bytes] = {}
    with TaskStorage.open(config, "task-0", blob_store=inner) as task:
        rounds(task, model, 0, 3)
    shutil.copytree(tmp_path / "local", tmp_path / "behind")
    with TaskStorage.open(config, "task-0", blob_store=inner) as task:
        rounds(task, model, 3, 3)
        index = latest_index(inner, task)
    assert len(index.runs) == 6
    shutil.rmtree(tmp_path / "local")
    (tmp_path / "behind").rename(tmp_path / "local")
    counting = CountingStore(inner)
    with TaskStorage.open(config, "task-0", blob_store=counting) as task:
        assert contents(task) == model
        assert task.metrics.counter("restore.stores.caught.up") == 1
        assert task.metrics.counter("restore.stores.full") == 0
        assert task.metrics.counter("restore.runs.applied") == 3
    assert sorted(counting.run_gets()) == sorted(run_name(PREFIX, run.hash) for run in index.runs[3:])


def test_a_damaged_cached_run_is_not_used_the_blob_store_copy_is(tmp_path: Path) -> None:
    """A full restore reads the runs this machine wrote from its local run cache when a copy there has the size and
    hash the index names; a damaged copy is passed over and the run is downloaded."""
    inner = MemoryBlobStore()
    config = make_config(tmp_path, **NEVER)
    model: dict[bytes, bytes] = {}
    with TaskStorage.open(config, "task-0", blob_store=inner) as task:
        rounds(task, model, 0, 3)
        index = latest_index(inner, task)
        store = task.stores["counts"]
        cache = Path(store.path) / "blobsnapshot-runs"
        store.put(b"zzz", b"flushed, never committed")
        store.flush(LocalVersion("1700000000000-1", "not-a-commit"))  # no version of the chain: a full restore
    damaged = cache / index.runs[1].hash
    assert damaged.exists() and all((cache / run.hash).exists() for run in index.runs)
    data = bytearray(damaged.read_bytes())
    data[len(data) // 2] ^= 0x01
    damaged.write_bytes(bytes(data))
    counting = CountingStore(inner)
    with TaskStorage.open(config, "task-0", blob_store=counting) as task:
        assert contents(task) == model
        assert task.metrics.counter("restore.stores.full") == 1
    assert counting.run_gets() == [run_name(PREFIX, index.runs[1].hash)]


# -- content addressing and garbage -----------------------------------------------------------------------------------


def test_a_retried_run_upload_is_not_uploaded_again(tmp_path: Path) -> None:
    """The reply to a run's upload is lost (the run landed): the commit fails; the next commit lists the same run
    (same content, same name) and finds it in the blob store with its length: it is not written twice."""
    blobs = ControlledBlobStore(MemoryBlobStore())
    config = make_config(tmp_path, **NEVER)
    model: dict[bytes, bytes] = {}
    with TaskStorage.open(config, "task-0", blob_store=blobs) as task:
        rounds(task, model, 0, 1)
        blobs.lose_reply, blobs.replies_to_lose = (lambda name: "/runs/" in name), 1
        write(task, model, {b"k-lost-reply": b"landed"})
        failed = task.commit({"input": "1"})
        assert failed is not None
        with pytest.raises(Exception, match="reply was lost"):
            failed.result(timeout=30)
        assert blobs.replies_to_lose == 0
        rounds(task, model, 2, 1)
        index = latest_index(blobs.inner, task)
        assert task.metrics.counter("blobsnapshot.runs.reused") == 1
    retried = run_name(PREFIX, index.runs[1].hash)
    assert (index.runs[1].first_seq, index.runs[1].last_seq) == (2, 2)
    assert blobs.put_names.count(retried) == 1
    shutil.rmtree(tmp_path / "local")
    with TaskStorage.open(config, "task-0", blob_store=blobs.inner) as task:
        assert contents(task) == model


def _runs_the_log_needs(blobs: MemoryBlobStore) -> set[str]:
    needed: set[str] = set()
    for entry in CheckpointLog(blobs, "job", "task-0").entries():
        marker = entry.checkpoint.markers_for("blobsnapshot")["counts"]  # type: ignore[union-attr]
        needed |= read_marker(blobs, marker, job="job", task="task-0", store="counts").blob_names(PREFIX)
    return needed


def test_gc_deletes_runs_merged_away_once_out_of_retention_and_never_one_a_retained_index_needs(
    tmp_path: Path,
) -> None:
    blobs = MemoryBlobStore()
    config = make_config(
        tmp_path, **EAGER, **{"blobsnapshot.gc.grace.period.ms": 0, "blobsnapshot.gc.interval.commits": 1}
    )
    model: dict[bytes, bytes] = {}
    states: dict[str, dict[bytes, bytes]] = {}
    ever_listed: set[str] = set()
    with TaskStorage.open(config, "task-0", blob_store=blobs) as task:
        task.checkpoint_log.retention_interval = 2  # retention's batches (the log's and the runs') within the rounds
        for round_no in range(14):
            rounds(task, model, round_no, 1)
            states[str(round_no)] = dict(model)
            task.commit_manager.wait()
            with task.commit_manager._lock:  # the commit's cleanups (retention and a sweep) run after it: wait for them
                cleanups = list(task.commit_manager._cleanups)
            futures.wait(cleanups, timeout=60)
            needed = _runs_the_log_needs(blobs)
            present = set(blobs.list(PREFIX + "runs/"))
            assert needed <= present, f"round {round_no}: runs a retained index needs are gone: {needed - present}"
            ever_listed |= needed
            if round_no % 2:
                settle(task)
        settle(task)
        manager = manager_of(task)
        manager.sweep(now=manager.shared.clock() + FAR_FUTURE)
        state = manager.shared.stores["counts"]
        in_flight = {run_name(PREFIX, state.compaction_output)} if state.compaction_output is not None else set()
        assert task.metrics.counter("blobsnapshot.compaction.adopted") >= 2
        assert task.metrics.counter("blobsnapshot.runs.deleted") > 0
    present = set(blobs.list(PREFIX + "runs/"))
    assert present - in_flight == _runs_the_log_needs(blobs)
    assert ever_listed - present, "no run was ever deleted"
    for entry in CheckpointLog(blobs, "job", "task-0").entries():
        shutil.rmtree(tmp_path / "local")
        offsets = entry.checkpoint.input_offsets
        with TaskStorage.open(config, "task-0", blob_store=blobs, checkpoint=entry) as task:
            assert contents(task) == states[offsets["input"]]


# -- damage to compacted runs -----------------------------------------------------------------------------------------


@pytest.fixture
def compacted_history(
    tmp_path: Path,
) -> Iterator[tuple[MemoryBlobStore, dict[str, object], RunIndex, dict[bytes, bytes]]]:
    """A history whose newest index lists a base run written by a full compaction, a merged run and a level-0 run."""
    blobs = MemoryBlobStore()
    config = make_config(
        tmp_path,
        **{
            "blobsnapshot.compaction.fanout": 2,
            "blobsnapshot.compaction.full.ratio": 0.05,
            "blobsnapshot.compaction.full.min.bytes": 0,
        },
    )
    model: dict[bytes, bytes] = {}
    with TaskStorage.open(config, "task-0", blob_store=blobs) as task:
        rounds(task, model, 0, 2)  # the run above the bottom one: a full compaction (ratio 0.05)
        settle(task)
        no_more_full_compactions(task)  # from now on only merges
        rounds(task, model, 2, 2)  # adopts the base run; then two level-0 runs above it: a merge
        settle(task)
        rounds(task, model, 4, 1)  # adopts the merge
        index = latest_index(blobs, task)
    assert [(run.base, run.level) for run in index.runs] == [(True, 1 << 16), (False, 1), (False, 0)], index.runs
    yield blobs, config, index, model


@pytest.mark.parametrize("position", [0, 1, 2], ids=["base-from-full-compaction", "merged", "level-0"])
@pytest.mark.parametrize("damage", ["flip", "cut", "swap"])
def test_every_damage_to_a_compacted_run_is_named_and_never_loaded(
    compacted_history: tuple[MemoryBlobStore, dict[str, object], RunIndex, dict[bytes, bytes]],
    tmp_path: Path,
    position: int,
    damage: str,
) -> None:
    blobs, config, index, _ = compacted_history
    damaged = copy_blob_store(blobs)
    victim = run_name(PREFIX, index.runs[position].hash)
    data = damaged.get(victim)
    if damage == "flip":
        data = data[: len(data) // 2] + bytes([data[len(data) // 2] ^ 0x01]) + data[len(data) // 2 + 1 :]
    elif damage == "cut":
        data = data[: len(data) * 2 // 3]
    else:  # another run of the same index under this name
        data = damaged.get(run_name(PREFIX, index.runs[(position + 1) % 3].hash))
    damaged.put(victim, data)
    shutil.rmtree(tmp_path / "local")
    with pytest.raises(CorruptDataError) as excinfo:
        TaskStorage.open(config, "task-0", blob_store=damaged).close()
    assert victim in str(excinfo.value)


def test_undamaged_compacted_history_restores_exactly(
    compacted_history: tuple[MemoryBlobStore, dict[str, object], RunIndex, dict[bytes, bytes]], tmp_path: Path
) -> None:
    """The matrix above is not vacuous: the same history restores, from the blob store alone."""
    blobs, config, index, model = compacted_history
    shutil.rmtree(tmp_path / "local")
    with TaskStorage.open(config, "task-0", blob_store=copy_blob_store(blobs)) as task:
        assert task.metrics.counter("restore.runs.applied") == 3
        assert contents(task) == model and len(model) == index.key_count


def test_a_handover_close_cancels_a_running_compaction_and_every_checkpoint_stays_exact(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Another process waits for a parked task (``close(handover=True)``): a running compaction (a full one reads an
    endless LMDB view here, a merge endless records) stops at its next chunk instead of being waited for; nothing of it
    is uploaded or recorded, and the state restores exactly, from the local dir kept and wiped."""
    from statebackend.backends.blobsnapshot import compaction as blobsnapshot_compaction

    from statebackend.store.view import ReadView

    started = threading.Event()

    def endless(*args: Any, **kwargs: Any) -> Any:
        def records() -> Any:
            started.set()
            i = 0
            while True:
                yield b"zz%012d" % i, b"v"
                i += 1

        return records()

    def endless_chunks(path: Any) -> Any:  # a full compaction writes an env-file base
        started.set()
        while True:
            yield b"\0" * 4096

    monkeypatch.setattr(ReadView, "items", endless)
    monkeypatch.setattr(envbase, "_file_chunks", endless_chunks)
    monkeypatch.setattr(blobsnapshot_compaction, "_merge", endless)
    blobs = MemoryBlobStore()
    config = make_config(tmp_path, **EAGER)
    model: dict[bytes, bytes] = {}
    task = TaskStorage.open(config, "task-0", blob_store=blobs)
    state = manager_of(task).shared.stores["counts"]
    for round_no in range(6):
        rounds(task, model, round_no, 1)
        if state.compaction is not None:
            break  # no more commits: more runs than twice the fanout would make the close wait for it (by design)
    assert state.compaction is not None, "no compaction was started"
    assert len(state.runs) <= 2 * EAGER["blobsnapshot.compaction.fanout"]
    assert started.wait(30), "the compaction never ran"
    runs_before = set(blobs.list(PREFIX + "runs/"))
    closer = threading.Thread(target=task.close, kwargs={"sync_local": False, "handover": True}, daemon=True)
    closer.start()
    closer.join(30)
    assert not closer.is_alive(), "the handover close waited for the compaction"
    monkeypatch.undo()
    assert set(blobs.list(PREFIX + "runs/")) == runs_before  # nothing of the compaction uploaded
    assert not (tmp_path / "local" / "job" / "task-0" / "counts" / COMPACTED_FILE).exists()
    with TaskStorage.open(config, "task-0", blob_store=blobs) as reopened:
        assert contents(reopened) == model
        rounds(reopened, model, 6, 2)
    shutil.rmtree(tmp_path / "local")
    with TaskStorage.open(config, "task-0", blob_store=blobs) as restored:
        assert contents(restored) == model
