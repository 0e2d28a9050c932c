"""Key TTL per store (``stores.<name>.ttl.ms``): expired keys are invisible to every read, the sweep deletes them
through the ordinary write path (so the deletes reach the blob store and later snapshots and runs leave them out), a
restore never brings one back, and a replayed Spark batch sees the keys its first run saw."""

from __future__ import annotations

import json
import shutil
from pathlib import Path
from typing import Any

import pytest
from pyspark.sql import Row

from statebackend.cli import main
from statebackend.config import Settings
from statebackend.errors import ConfigError
from statebackend.spark import TaskRunner
from statebackend.spark.stats import is_output
from statebackend.store.ttl import unwrap
from statebackend.task import TaskStorage
from tests.backend_helpers import file_job_config, write_config

BACKENDS = ["changelog", "blobsnapshot"]


def make_config(tmp_path: Path, backend: str = "changelog", /, **extra: object) -> dict[str, object]:
    store: dict[str, object] = {
        "stores.last.backup.factories": backend,
        "stores.last.key.serde": "string",
        "stores.last.msg.serde": "integer",
        "stores.last.ttl.ms": 100,
    }
    if backend == "changelog":
        store["changelog.snapshot.interval.commits"] = 2
    return file_job_config(tmp_path, "sessions", **{**store, **extra})


def open_at(config: dict[str, object], now: int) -> TaskStorage:
    storage = TaskStorage.open(config, "task-0")
    storage.ttl_now_ms = now
    return storage


def physical(storage: TaskStorage) -> dict[bytes, int]:
    """What LMDB and the write batch hold: key -> expiry, expired keys included."""
    return {key: unwrap(raw)[0] for key, raw in storage.stores["last"].items()}


@pytest.mark.parametrize("backend", BACKENDS)
def test_an_expired_key_is_invisible_to_every_read(tmp_path: Path, backend: str) -> None:
    with open_at(make_config(tmp_path, backend, **{"stores.last.ttl.sweep.keys": 0}), 1000) as storage:
        store = storage.store("last")
        store.put("a", 1)
        store.put_many(["b", "c"], [2, 3])
        storage.ttl_now_ms = 1050
        store.put("c", 30)  # a write refreshes the expiry: c now lives until 1150
        storage.commit_durably({"n": "1"})
        storage.ttl_now_ms = 1099
        assert store.get("a") == 1 and store.contains("b") and store.count() == 3
        storage.ttl_now_ms = 1100  # a and b expire at 1100: invisible from that instant
        assert store.get("a") is None and not store.contains("b")
        assert store.get_many(["a", "b", "c", "d"]) == [None, None, 30, None]
        assert list(store.items()) == [("c", 30)]
        assert list(store.iter_prefix("")) == [("c", 30)] and list(store.iter_range("a", "z")) == [("c", 30)]
        assert store.count() == 1
        seen: list[Any] = []

        def update(values: list[Any]) -> list[int]:
            seen.extend(values)
            return [5, 31]

        store.update_many(["a", "c"], update)
        assert seen == [None, 30]  # update_many reads through the TTL too: an expired key is absent
        assert store.get("a") == 5  # and a write brings the key back with a fresh expiry
        bytes_view = storage.store("last", typed=False)
        assert bytes_view.get(b"b") is None
        assert set(physical(storage)) == {b"a", b"b", b"c"}  # not swept (ttl.sweep.keys=0): only hidden


@pytest.mark.parametrize("backend", BACKENDS)
def test_the_sweep_deletes_expired_keys_and_the_deletes_reach_the_blob_store(tmp_path: Path, backend: str) -> None:
    config = make_config(tmp_path, backend)
    with open_at(config, 1000) as storage:
        store = storage.store("last")
        store.put_many([f"k{i}" for i in range(10)], list(range(10)))
        storage.commit_durably({"n": "1"})
        storage.ttl_now_ms = 1050
        store.put("k3", 33)  # refreshed: lives until 1150
        storage.commit_durably({"n": "2"})
        storage.ttl_now_ms = 1120
        storage.commit_durably({"n": "3"})  # the sweep before this commit deletes the 9 expired keys
        assert set(physical(storage)) == {b"k3"}
        assert storage.metrics.snapshot()["ttl.keys.expired"] == 9
        for _ in range(3):  # later commits: snapshots / compactions are written from the swept state
            storage.commit_durably({"n": "4"})
    shutil.rmtree(tmp_path / "local")
    with open_at(config, 0) as restored:  # a clock where nothing has expired: only what is stored can show
        assert physical(restored) == {b"k3": 1150}
        assert dict(restored.store("last").items()) == {"k3": 33}


def test_the_sweep_examines_its_budget_per_commit_and_wraps_around(tmp_path: Path) -> None:
    config = make_config(tmp_path, **{"stores.last.ttl.sweep.keys": 4})
    with open_at(config, 1000) as storage:
        store = storage.store("last")
        store.put_many([f"k{i:02d}" for i in range(10)], list(range(10)))
        storage.ttl_now_ms = 1090
        store.put("k05", 50)  # expires at 1190; the other nine at 1100
        storage.ttl_now_ms = 1100
        remaining = []
        for n in range(4):
            storage.commit_durably({"n": str(n)})
            remaining.append(len(physical(storage)))
        assert remaining == [6, 3, 1, 1]  # 4 examined per commit (k05 among them, kept), then around again
        assert dict(store.items()) == {"k05": 50}


@pytest.mark.parametrize("backend", BACKENDS)
def test_a_restore_never_brings_an_expired_key_back(tmp_path: Path, backend: str) -> None:
    config = make_config(tmp_path, backend, **{"stores.last.ttl.sweep.keys": 0})
    with open_at(config, 1000) as storage:
        storage.store("last").put_many(["a", "b"], [1, 2])
        storage.ttl_now_ms = 1080
        storage.store("last").put("b", 20)
        storage.commit_durably({"n": "1"})
    shutil.rmtree(tmp_path / "local")  # restored from the blob store alone
    with open_at(config, 1150) as restored:
        assert dict(restored.store("last").items()) == {"b": 20}  # a expired at 1100; b lives until 1180
        assert physical(restored) == {b"a": 1100, b"b": 1180}  # the expiries came back with the values
        restored.ttl_now_ms = 1180
        assert restored.store("last").get("b") is None


def test_turning_a_ttl_on_or_off_on_existing_state_is_refused_naming_the_key(tmp_path: Path) -> None:
    plain = make_config(tmp_path)
    del plain["stores.last.ttl.ms"]
    with TaskStorage.open(plain, "task-0") as storage:
        storage.store("last").put("a", 1)
        storage.commit_durably({"n": "1"})
    with pytest.raises(ConfigError, match=r"stores\.last\.ttl\.ms is set but store 'last' was written without a TTL"):
        TaskStorage.open(make_config(tmp_path), "task-0")
    other = tmp_path / "other"
    with open_at(make_config(other), 1000) as storage:
        storage.store("last").put("a", 1)
        storage.commit_durably({"n": "1"})
    plain_other = make_config(other)
    del plain_other["stores.last.ttl.ms"]
    with pytest.raises(ConfigError, match=r"was written with a TTL .* Set stores\.last\.ttl\.ms"):
        TaskStorage.open(plain_other, "task-0")
    with TaskStorage.open(make_config(other, **{"stores.last.ttl.ms": "1h"}), "task-0") as storage:
        assert storage.restored is not None  # another duration is fine: the stored expiries stay


@pytest.mark.parametrize("value", [0, -5, "soon"])
def test_a_wrong_ttl_names_the_key(tmp_path: Path, value: object) -> None:
    with pytest.raises(ConfigError, match=r"stores\.last\.ttl\.ms"):
        Settings.from_config(make_config(tmp_path, **{"stores.last.ttl.ms": value}))


def count_words(stores: Any, rows: Any) -> list[tuple[str, int]]:
    """Sessions: a word's count since it was last seen more than the TTL ago (the state expires)."""
    counts = stores["last"]
    out = {}
    for row in rows:
        out[row.word] = (counts.get(row.word) or 0) + 1
        counts.put(row.word, out[row.word])
    return sorted(out.items())


def run_batch(config: dict[str, object], batch_id: int, now: int, *words: str) -> list[Any]:
    runner = TaskRunner.of(
        fn=count_words,
        config=config,
        batch_id=batch_id,
        num_tasks=1,
        on_replay="redo",
        input_columns=("word",),
        now_ms=now,
    )
    return [item for item in runner.run_rows(0, iter([Row(word=w) for w in words])) if is_output(item)]


def test_a_replayed_batch_sees_the_keys_its_first_run_saw(tmp_path: Path) -> None:
    config = make_config(tmp_path)
    assert run_batch(config, 0, 1000, "a", "b") == [("a", 1), ("b", 1)]
    assert run_batch(config, 1, 1060, "a") == [("a", 2)]  # a lives until 1160, b until 1100
    assert run_batch(config, 2, 1110, "a", "b") == [("a", 3), ("b", 1)]  # b expired between batches 1 and 2
    # Spark re-runs batch 2 much later (a new driver, a new clock): the replay reads batch 2's recorded clock back
    assert run_batch(config, 2, 9_999_999, "a", "b") == [("a", 3), ("b", 1)]
    # the next batch goes on from the replay's state at its own clock: a, written at 1110, lives until 1210
    assert run_batch(config, 3, 1205, "a") == [("a", 4)]
    assert run_batch(config, 4, 1400, "a", "b") == [("a", 1), ("b", 1)]  # both expired by 1400
    shutil.rmtree(tmp_path / "local")  # a replay on another machine, from the blob store alone
    assert run_batch(config, 4, 5_000_000, "a", "b") == [("a", 1), ("b", 1)]


def test_dump_leaves_expired_keys_out_and_shows_the_expiry(capsys: pytest.CaptureFixture[str], tmp_path: Path) -> None:
    config = make_config(tmp_path, **{"stores.last.ttl.sweep.keys": 0})
    run_batch(config, 0, 1000, "a", "b")
    run_batch(config, 1, 1060, "a")
    path = write_config(tmp_path / "job.properties", config)
    assert main(["dump", str(path), "task-0", "last"]) == 0
    records = [json.loads(line) for line in capsys.readouterr().out.splitlines()]
    # at batch 1's clock (1060) b is still alive (until 1100); a was refreshed at 1060
    assert records == [{"key": "a", "value": 2, "expires_at_ms": 1160}, {"key": "b", "value": 1, "expires_at_ms": 1100}]
    run_batch(config, 2, 1100, "c")
    assert main(["dump", str(path), "task-0", "last"]) == 0
    keys = [json.loads(line)["key"] for line in capsys.readouterr().out.splitlines()]
    assert keys == ["a", "c"]  # b expired at batch 2's clock: left out, though not swept
