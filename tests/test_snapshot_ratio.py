"""The changelog backend's snapshot interval ratio: a background snapshot is due once the delta files after the base
hold ``changelog.snapshot.interval.ratio`` times the base's bytes, so snapshot bytes follow the change, and a restore
downloads at most the base plus that ratio of it."""

from __future__ import annotations

import hashlib
from pathlib import Path

import pytest
from statebackend.backends.changelog.backup import maintenance_pool

from statebackend.blobstores.memory import MemoryBlobStore
from statebackend.errors import ConfigError
from statebackend.task import TaskStorage
from statebackend.testing.backend_contract import BackendContract, contents

PREFIX = "job/task-0/counts/changelog/"
LOAD_KEYS = 2_000
UPDATES = 100


def config_for(tmp_path: Path, **extra: object) -> dict[str, object]:
    return BackendContract().make_config(tmp_path, **{"changelog.snapshot.interval.commits": 1000,
                                                      "changelog.gc.interval.commits": 0, **extra})


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


def test_ratio_zero_leaves_the_commit_interval_alone(tmp_path: Path) -> None:
    blobs = MemoryBlobStore()
    config = config_for(tmp_path, **{"changelog.snapshot.interval.ratio": 0,
                                     "changelog.snapshot.interval.commits": 45})
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
