"""The changelog backend's snapshot interval ratio: a background snapshot is due once the delta files after the base
hold ``changelog.snapshot.interval.ratio`` times the base's bytes, so snapshot bytes follow the change, and a restore
downloads at most the base plus that ratio of it."""

from __future__ import annotations

import hashlib
import threading
from pathlib import Path

import pytest
from statebackend.backends.changelog.backup import UNKNOWN_SIZES_INTERVAL_COMMITS, maintenance_pool

from statebackend.blobstores.base import BlobInfo
from statebackend.blobstores.memory import MemoryBlobStore
from statebackend.errors import ConfigError, TransientStorageError
from statebackend.task import TaskStorage
from statebackend.testing.backend_contract import BackendContract, contents
from tests.waiting import scaled

PREFIX = "job/task-0/counts/changelog/"
LOAD_KEYS = 2_000
UPDATES = 100


def config_for(tmp_path: Path, **extra: object) -> dict[str, object]:
    # states of some hundred KiB: the ratio alone decides (snapshot.ratio.min.bytes, tested below, would hold off
    # the snapshots of so small a state)
    return BackendContract().make_config(
        tmp_path,
        **{
            "changelog.snapshot.interval.commits": 1000,
            "changelog.snapshot.ratio.min.bytes": 0,
            "changelog.gc.interval.commits": 0,
            **extra,
        },
    )


def value(key: int, round_no: int) -> bytes:
    return hashlib.sha256(f"{key}-{round_no}".encode()).hexdigest().encode()  # compresses about 2:1, as hex does


def commit_round(task: TaskStorage, round_no: int, model: dict[bytes, bytes]) -> None:
    store = task.store("counts")
    keys = range(LOAD_KEYS) if round_no == 0 else [(round_no * 37 + i * 11) % LOAD_KEYS for i in range(UPDATES)]
    for key in keys:
        name = f"k{key:06d}".encode()
        store.put(name, value(key, round_no))
        model[name] = value(key, round_no)
    task.commit_durably({"input": str(round_no)})


def delta_sizes(blobs: MemoryBlobStore, sizes: dict[int, int]) -> None:
    for name in blobs.list(PREFIX + "delta/"):
        sizes.setdefault(int(name.rsplit("/", 1)[-1][:12]), blobs.head(name).size)


def snapshot_seqs(blobs: MemoryBlobStore, seen: set[int]) -> list[int]:
    """Every snapshot seen so far (retention deletes the older ones once a newer one is adopted)."""
    seen.update(int(name.rsplit("/", 1)[-1][:12]) for name in blobs.list(PREFIX + "snapshot/"))
    return sorted(seen)


def check_first_snapshot(sizes: dict[int, int], seq: int, ratio: float) -> None:
    """The first snapshot came once the deltas after the load (seq 1, the base) reached ``ratio`` times its bytes:
    not a commit earlier than an estimate from the deltas known then allows, nor later than the commit after."""
    base = sizes[1]
    assert sum(sizes[s] for s in range(2, seq - 1)) < ratio * base, (seq, sizes)
    assert sum(sizes[s] for s in range(2, seq + 1)) + max(sizes[s] for s in range(2, seq + 1)) >= ratio * base


@pytest.mark.parametrize("ratio", [0.5, 1.0])
def test_a_snapshot_comes_when_the_deltas_reach_the_ratio_of_the_base(tmp_path: Path, ratio: float) -> None:
    blobs = MemoryBlobStore()
    config = config_for(tmp_path, **{"changelog.snapshot.interval.ratio": ratio})
    model: dict[bytes, bytes] = {}
    sizes: dict[int, int] = {}
    seen: set[int] = set()
    with TaskStorage.open(config, "task-0", blob_store=blobs) as task:
        for round_no in range(60):
            commit_round(task, round_no, model)
            delta_sizes(blobs, sizes)
            maintenance_pool().submit(lambda: None).result()  # a started snapshot is written before the next round
            snapshot_seqs(blobs, seen)
    seqs = snapshot_seqs(blobs, seen)
    assert seqs, "no snapshot in 60 commits, though the deltas outgrew the base"
    check_first_snapshot(sizes, seqs[0], ratio)
    # each delta holds UPDATES of LOAD_KEYS keys: a smaller ratio snapshots sooner, at about ratio * 20 commits
    assert abs(seqs[0] - 1 - ratio * LOAD_KEYS / UPDATES) <= 3, seqs
    shutil_rmtree(tmp_path / "local")
    with TaskStorage.open(config, "task-0", blob_store=blobs) as task:
        assert contents(task) == model
        assert task.metrics.counter("restore.deltas.replayed") < 60 - seqs[0] + 2


def test_a_task_opened_for_every_commit_snapshots_by_the_ratio_too(tmp_path: Path) -> None:
    """Its manager sees one commit: the sizes of the base and of the newest delta are looked up at open."""
    blobs = MemoryBlobStore()
    config = config_for(tmp_path)
    model: dict[bytes, bytes] = {}
    sizes: dict[int, int] = {}
    seen: set[int] = set()
    for round_no in range(40):
        with TaskStorage.open(config, "task-0", blob_store=blobs) as task:
            maintenance_pool().submit(lambda: None).result()  # the look-up at open has run
            commit_round(task, round_no, model)
        delta_sizes(blobs, sizes)
        snapshot_seqs(blobs, seen)
    seqs = snapshot_seqs(blobs, seen)
    assert seqs
    check_first_snapshot(sizes, seqs[0], 1.0)


def test_deltas_under_the_ratio_min_bytes_make_no_snapshot_due(tmp_path: Path) -> None:
    """``snapshot.ratio.min.bytes``: the ratio (0.2 here: a snapshot every 4 commits or so on this state) waits until
    the deltas since the base hold that many bytes too, so a small state does not pay a snapshot PUT every few
    commits; the first snapshot comes once the deltas reach it, not a commit earlier than the sizes allow."""
    blobs = MemoryBlobStore()
    sizes: dict[int, int] = {}
    seen: set[int] = set()
    model: dict[bytes, bytes] = {}
    min_bytes = 40_000
    config = config_for(
        tmp_path, **{"changelog.snapshot.interval.ratio": 0.2, "changelog.snapshot.ratio.min.bytes": min_bytes}
    )
    with TaskStorage.open(config, "task-0", blob_store=blobs) as task:
        for round_no in range(40):
            commit_round(task, round_no, model)
            delta_sizes(blobs, sizes)
            maintenance_pool().submit(lambda: None).result()
            snapshot_seqs(blobs, seen)
    seqs = snapshot_seqs(blobs, seen)
    assert seqs, "no snapshot in 40 commits, though the deltas outgrew the minimum"
    first = seqs[0]
    assert 0.2 * sizes[1] < min_bytes, "the ratio alone would not have waited: the test shows nothing"
    assert sum(sizes[s] for s in range(2, first - 1)) < min_bytes, (first, sizes)
    assert sum(sizes[s] for s in range(2, first + 1)) + max(sizes[s] for s in range(2, first + 1)) >= min_bytes
    shutil_rmtree(tmp_path / "local")
    with TaskStorage.open(config, "task-0", blob_store=blobs) as task:
        assert contents(task) == model


def test_ratio_zero_leaves_the_commit_interval_alone(tmp_path: Path) -> None:
    blobs = MemoryBlobStore()
    config = config_for(tmp_path, **{"changelog.snapshot.interval.ratio": 0, "changelog.snapshot.interval.commits": 45})
    model: dict[bytes, bytes] = {}
    seen: set[int] = set()
    with TaskStorage.open(config, "task-0", blob_store=blobs) as task:
        for round_no in range(50):
            commit_round(task, round_no, model)
            maintenance_pool().submit(lambda: None).result()
            snapshot_seqs(blobs, seen)
    assert snapshot_seqs(blobs, seen) == [45]  # 45 commits after the empty store (the load is the first)


def test_a_bad_ratio_names_the_key(tmp_path: Path) -> None:
    config = config_for(tmp_path, **{"changelog.snapshot.interval.ratio": -1})
    with pytest.raises(ConfigError, match="changelog.snapshot.interval.ratio"):
        TaskStorage.open(config, "task-0", blob_store=MemoryBlobStore())


def shutil_rmtree(path: Path) -> None:
    import shutil

    shutil.rmtree(path)


class LookUps(MemoryBlobStore):
    """HEADs from the maintenance thread (the size look-up at open) wait for ``release`` while ``hold`` is set, or
    fail while ``fail`` is set; every other call behaves as the memory store's."""

    def __init__(self) -> None:
        super().__init__()
        self.hold = False
        self.fail = False
        self.held = threading.Event()
        self.release = threading.Event()
        self.looked_up: list[str] = []

    def head(self, name: str) -> BlobInfo:
        if threading.current_thread().name.startswith("statebackend-maintenance"):
            if self.fail:
                raise TransientStorageError(f"injected: HEAD {name} failed")
            if self.hold:
                self.held.set()
                assert self.release.wait(timeout=scaled(60)), "the test never released the look-up"
            self.looked_up.append(name)
        return super().head(name)


def test_a_look_up_held_past_the_close_of_its_task_blocks_neither_commits_nor_close_and_ends_harmlessly(
    tmp_path: Path,
) -> None:
    blobs = LookUps()
    config = config_for(tmp_path)
    model: dict[bytes, bytes] = {}
    with TaskStorage.open(config, "task-0", blob_store=blobs) as task:
        for round_no in range(3):
            commit_round(task, round_no, model)
    blobs.hold = True
    task = TaskStorage.open(config, "task-0", blob_store=blobs)
    try:
        assert blobs.held.wait(timeout=scaled(30))  # the look-up runs, held in the maintenance thread
        for round_no in range(3, 6):
            commit_round(task, round_no, model)  # never waits for it
    finally:
        task.close()  # nor does the close: the look-up outlives the task, its blob store closed
    assert blobs.looked_up == []
    blobs.hold = False
    blobs.release.set()
    maintenance_pool().submit(lambda: None).result(timeout=scaled(30))  # the shared thread is free again
    assert blobs.looked_up  # it finished without an error escaping
    shutil_rmtree(tmp_path / "local")
    seen: set[int] = set()
    with TaskStorage.open(config, "task-0", blob_store=blobs) as task:
        assert contents(task) == model
        maintenance_pool().submit(lambda: None).result(timeout=scaled(30))
        for round_no in range(6, 40):  # this open's look-up worked: the ratio brings a snapshot
            commit_round(task, round_no, model)
            maintenance_pool().submit(lambda: None).result(timeout=scaled(30))
            if snapshot_seqs(blobs, seen):
                break
    assert snapshot_seqs(blobs, seen), "no snapshot by the ratio after a look-up that outlived its task"


@pytest.mark.parametrize("fail", [False, True])
def test_without_the_sizes_the_commit_cap_still_brings_the_snapshot(tmp_path: Path, fail: bool) -> None:
    """The look-up at open fails: this manager never learns the base's size, the ratio cannot fire, the commit
    interval does (a control run where the look-up works snapshots by the ratio, earlier)."""
    blobs = LookUps()
    config = config_for(
        tmp_path, **{"changelog.snapshot.interval.ratio": 0.1, "changelog.snapshot.interval.commits": 9}
    )
    model: dict[bytes, bytes] = {}
    seen: set[int] = set()
    with TaskStorage.open(config, "task-0", blob_store=blobs) as task:
        commit_round(task, 0, model)  # the load: 2,000 keys, the base; each round after changes 100 of them
    blobs.fail = fail
    with TaskStorage.open(config, "task-0", blob_store=blobs) as task:
        maintenance_pool().submit(lambda: None).result(timeout=scaled(30))  # the look-up at open has run (or failed)
        for round_no in range(1, 12):
            commit_round(task, round_no, model)
            maintenance_pool().submit(lambda: None).result(timeout=scaled(30))
            snapshot_seqs(blobs, seen)
        assert task.metrics.counter("changelog.snapshot.adopted") >= 1
    seqs = snapshot_seqs(blobs, seen)
    assert seqs and (seqs[0] == 9 if fail else seqs[0] < 9), seqs
    shutil_rmtree(tmp_path / "local")
    with TaskStorage.open(config, "task-0", blob_store=blobs) as task:
        assert contents(task) == model


def test_a_task_opened_for_each_commit_whose_look_ups_never_answer_snapshots_at_the_old_interval_not_the_cap(
    tmp_path: Path,
) -> None:
    """Without the sizes the ratio cannot weigh the chain: the snapshot comes after 20 commits (the fixed interval
    of the first releases), not after ``snapshot.interval.commits`` (100), so a chain is never longer than before."""
    blobs = LookUps()
    blobs.fail = True
    config = config_for(tmp_path, **{"changelog.snapshot.interval.commits": 100})
    model: dict[bytes, bytes] = {}
    seen: set[int] = set()
    for round_no in range(25):
        with TaskStorage.open(config, "task-0", blob_store=blobs) as task:
            commit_round(task, round_no, model)
        snapshot_seqs(blobs, seen)
    assert snapshot_seqs(blobs, seen)[0] == UNKNOWN_SIZES_INTERVAL_COMMITS == 20
    shutil_rmtree(tmp_path / "local")
    with TaskStorage.open(config, "task-0", blob_store=blobs) as task:
        assert contents(task) == model
