"""List and map stores (``stores.<name>.kind``) outside a task's own reads and writes: what checkpoints record of
them, where their error class lives, the command's ``dump``, the expiry callback and ``initial_state``."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest

from statebackend import errors
from statebackend.config import Settings
from statebackend.lifecycle import recorded_serdes
from statebackend.store import kinds
from statebackend.task import TaskStorage
from statebackend.values import base_recorded
from tests.backend_helpers import cli, write_config
from tests.test_state_kinds import make_config


def test_the_one_place_that_records_a_stores_serdes_records_its_kind(tmp_path: Path) -> None:
    config = make_config(tmp_path, **{"stores.plain.backup.factories": "changelog", "stores.plain.key.serde": "string"})
    settings = Settings.from_config(config)
    for name, kind in (("events", "list"), ("counters", "map")):
        assert base_recorded(settings.stores[name])["kind"] == kind
        assert recorded_serdes(settings.stores[name]) == base_recorded(settings.stores[name])
    assert "kind" not in base_recorded(settings.stores["plain"])  # a value store's checkpoints stay as they were
    with TaskStorage.open(config, "task-0") as task:
        task.commit_durably({"input": "0"})
        assert task.last_checkpoint is not None
        assert {name: dict(task.last_checkpoint.serdes[name]) for name in ("events", "counters", "plain")} == {
            name: base_recorded(settings.stores[name]) for name in ("events", "counters", "plain")
        }


def test_kind_error_lives_in_the_error_tree_and_imports_from_kinds_as_before() -> None:
    assert kinds.KindError is errors.KindError
    assert issubclass(errors.KindError, errors.UsageError) and issubclass(errors.KindError, AttributeError)
    with pytest.raises(errors.KindError, match="store 'events' is a list store"):
        raise kinds.wrong_kind("events", "list", "put")


def test_dump_shows_a_list_as_its_key_and_elements_and_a_map_as_its_key_and_entries(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    config = make_config(tmp_path)
    with TaskStorage.open(config, "task-0") as task:
        events, counters = task.list_store("events"), task.map_store("counters")
        for value in ({"n": 1}, "two", [3]):
            events.append("ada", value)
        events.append("bob", 4)
        counters.update("ada", {"b": 2, "a": 1})
        counters.put("zed", "x", 9)
        task.commit_durably({"input": "0"})
    path = write_config(tmp_path / "kinds.properties", config)
    code, out, _ = cli(capsys, "dump", str(path), "task-0", "events")
    assert code == 0 and sorted(map(json.loads, out.splitlines()), key=str) == [
        {"key": "ada", "elements": [{"value": {"n": 1}}, {"value": "two"}, {"value": [3]}]},
        {"key": "bob", "elements": [{"value": 4}]},
    ]
    code, out, _ = cli(capsys, "dump", str(path), "task-0", "counters")
    assert code == 0 and sorted(map(json.loads, out.splitlines()), key=str) == [
        {"key": "ada", "entries": [{"sub_key": "a", "value": 1}, {"sub_key": "b", "value": 2}]},
        {"key": "zed", "entries": [{"sub_key": "x", "value": 9}]},
    ]
    # --raw: the records as stored (a head record and one per element for a list)
    code, out, _ = cli(capsys, "dump", str(path), "task-0", "events", "--raw")
    assert code == 0 and len(out.splitlines()) == 2 + 4
    # a store dropped from the config dumps by the kind its checkpoint recorded
    dropped = {k: v for k, v in config.items() if not k.startswith("stores.events.")}
    code, out, _ = cli(capsys, "dump", str(write_config(tmp_path / "dropped.properties", dropped)), "task-0", "events")
    assert code == 0 and [json.loads(line)["elements"] for line in out.splitlines()] == [
        [{"value": {"n": 1}}, {"value": "two"}, {"value": [3]}],
        [{"value": 4}],
    ]


def append_and_put(stores: Any, rows: Any) -> list[Any]:
    for row in rows:
        stores["events"].append(row.word, row.n)
        stores["counters"].put(row.word, f"s{row.n}", row.n)
    return []


def expired_items(stores: Any, expired: list[Any]) -> list[tuple[Any, ...]]:
    return [(e.store, e.key, json.dumps(e.value), e.expired_at_ms) for e in expired]


def test_the_expiry_callback_gets_one_expired_per_list_element_and_map_entry_keyed_by_the_user_key(
    tmp_path: Path,
) -> None:
    from pyspark.sql import Row

    from tests.test_spark import make_config as spark_config
    from tests.test_timers_hooks_tasks import run

    config = spark_config(
        tmp_path,
        **{
            f"stores.{name}.{key}": value
            for name, kind in (("events", "list"), ("counters", "map"))
            for key, value in {
                "backup.factories": "changelog",
                "kind": kind,
                "key.serde": "string",
                "msg.serde": "integer",
                "ttl.ms": 100,
                "ttl.sweep.keys": 100,
            }.items()
        },
        **{"stores.counters.subkey.serde": "string"},
    )
    job = {"on_expiry": expired_items}
    rows = [Row(word=w, n=n) for w, n in [("a", 1), ("a", 2), ("b", 3)]]
    assert run(config, append_and_put, 0, rows, batch={"now_ms": 0}, **job)[0] == []
    assert run(config, append_and_put, 1, [], batch={"now_ms": 99}, **job)[0] == []  # alive until 100
    output, _ = run(config, append_and_put, 2, [], batch={"now_ms": 150}, **job)
    # store then record order: a map's entries by sub-key, a list's elements in append order; no list head records
    assert output == [
        ("counters", "a", '["s1", 1]', 100),
        ("counters", "a", '["s2", 2]', 100),
        ("counters", "b", '["s3", 3]', 100),
        ("events", "a", "1", 100),
        ("events", "a", "2", 100),
        ("events", "b", "3", 100),
    ]
    with TaskStorage.open(config, "task-0") as storage:
        assert [list(storage.stores[name].items()) for name in ("events", "counters")] == [[], []]  # all deleted


def test_initial_state_of_a_list_or_map_store_is_refused_naming_the_store_and_its_kind(tmp_path: Path) -> None:
    from statebackend.spark.initial import InitialState, load_initial_state

    config = make_config(tmp_path, **{"stores.plain.backup.factories": "changelog", "stores.plain.key.serde": "string"})
    settings = Settings.from_config(config)
    InitialState({"plain": object()}).check(settings)  # a value store loads
    for frames in ({"events": object()}, {"plain": object(), "counters": object()}):
        name = "events" if "events" in frames else "counters"
        kind = "list" if name == "events" else "map"
        message = f"initial_state loads value stores only; store '{name}' is a {kind} store"
        with pytest.raises(errors.ConfigError, match=message):
            InitialState(frames).check(settings)
        # the load itself refuses before it reads the job, the batch or a frame
        with pytest.raises(errors.ConfigError, match=message):
            load_initial_state(None, None, settings, 0, frames)
