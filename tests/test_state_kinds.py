"""Typed state per key (``stores.<name>.kind``): list and map stores against plain-Python oracles, their TTL per store
and per call, their errors, their backup and restore by every backend, record evolution of their values, and a value
store's bytes unchanged by the feature."""

from __future__ import annotations

import random
import shutil
from pathlib import Path
from typing import Any, cast

import pytest

from statebackend.errors import ConfigError, SerdeError
from statebackend.microbatch.attempt import TaskStores
from statebackend.microbatch.timers import TIMERS_STORE
from statebackend.serdes.record import schemas_from_text
from statebackend.store import BytesStore
from statebackend.store.kinds import KindError, ListStore, MapStore, key_prefix, user_key_of
from statebackend.task import TaskStorage
from tests.backend_helpers import file_job_config
from tests.record_values import CountV1, CountV2

BACKENDS = ["changelog", "blobsnapshot", "fullcopy"]


def make_config(tmp_path: Path, backend: str = "changelog", /, **extra: object) -> dict[str, object]:
    stores: dict[str, object] = {
        "stores.events.backup.factories": backend,
        "stores.events.kind": "list",
        "stores.events.key.serde": "string",
        "stores.events.msg.serde": "json",
        "stores.counters.backup.factories": backend,
        "stores.counters.kind": "map",
        "stores.counters.key.serde": "string",
        "stores.counters.subkey.serde": "string",
        "stores.counters.msg.serde": "integer",
        "changelog.snapshot.interval.commits": 3,
    }
    return file_job_config(tmp_path, "kinds", **{**stores, **extra})


def lists(task: TaskStorage) -> dict[str, list[Any]]:
    return dict(task.list_store("events").lists())


def maps(task: TaskStorage) -> dict[str, dict[str, int]]:
    return dict(task.map_store("counters").maps())


def mutate(
    task: TaskStorage, rng: random.Random, lists_model: dict[str, list[Any]], maps_model: dict[str, Any]
) -> None:
    """A round of random list and map calls, mirrored in the models."""
    events, counters = task.list_store("events"), task.map_store("counters")
    for _ in range(200):
        user = f"u{rng.randrange(12)}"
        op = rng.random()
        if op < 0.45:
            value = {"n": rng.randrange(1000)}
            events.append(user, value)
            lists_model.setdefault(user, []).append(value)
        elif op < 0.55:
            values = [rng.randrange(10) for _ in range(rng.randrange(4))]
            events.extend(user, values)
            if values:
                lists_model.setdefault(user, []).extend(values)
        elif op < 0.62:
            keep = rng.randrange(4)
            events.trim(user, keep_last=keep)
            kept = lists_model.get(user, [])[-keep:] if keep else []
            if kept:
                lists_model[user] = kept
            else:
                lists_model.pop(user, None)
        elif op < 0.64:
            events.clear(user)
            lists_model.pop(user, None)
        elif op < 0.85:
            sub = f"c{rng.randrange(6)}"
            total = (counters.get(user, sub) or 0) + 1
            counters.put(user, sub, total)
            maps_model.setdefault(user, {})[sub] = total
        elif op < 0.95:
            sub = f"c{rng.randrange(6)}"
            counters.delete(user, sub)
            if sub in maps_model.get(user, {}):
                del maps_model[user][sub]
                if not maps_model[user]:
                    del maps_model[user]
        else:
            counters.clear(user)
            maps_model.pop(user, None)


def sorted_maps(model: dict[str, dict[str, int]]) -> dict[str, dict[str, int]]:
    return {user: dict(sorted(entries.items())) for user, entries in model.items()}


# -- the operations --------------------------------------------------------------------------------------------------


def test_a_list_keeps_append_order_and_trims_to_the_last_n(tmp_path: Path) -> None:
    with TaskStorage.open(make_config(tmp_path), "task-0") as task:
        events = task.list_store("events")
        assert isinstance(events, ListStore)
        assert events.get("ann") == [] and events.len("ann") == 0 and not events.contains("ann")
        for i in range(7):
            events.append("ann", {"i": i})
        events.extend("ann", [{"i": 7}, {"i": 8}])
        events.append("bob", "only")
        assert events.get("ann") == [{"i": i} for i in range(9)]
        assert events.len("ann") == 9 and events.contains("ann")
        assert events.trim("ann", keep_last=5) == 4
        assert events.get("ann") == [{"i": i} for i in range(4, 9)]
        assert events.trim("ann", keep_last=5) == 0
        events.append("ann", {"i": 9})
        assert events.get("ann") == [{"i": i} for i in range(4, 10)] and events.len("ann") == 6
        events.replace("bob", [1, 2])
        assert events.get("bob") == [1, 2]
        assert sorted(events.user_keys()) == ["ann", "bob"]
        events.clear("ann")
        assert events.get("ann") == [] and events.len("ann") == 0
        events.append("ann", "again")
        assert events.get("ann") == ["again"]
        assert events.trim("ann", keep_last=0) == 1 and not events.contains("ann")


def test_a_map_gets_puts_deletes_and_ranges_its_sub_keys_in_byte_order(tmp_path: Path) -> None:
    with TaskStorage.open(make_config(tmp_path), "task-0") as task:
        counters = task.map_store("counters")
        assert isinstance(counters, MapStore)
        for sub, value in [("m", 1), ("a", 2), ("z", 3), ("b", 4)]:
            counters.put("ann", sub, value)
        counters.update("bob", {"x": 9})
        counters.put("an", "a", 100)  # "an" is a prefix of "ann": their maps stay apart
        assert counters.get("ann", "m") == 1 and counters.get("ann", "q") is None
        assert list(counters.items("ann")) == [("a", 2), ("b", 4), ("m", 1), ("z", 3)]
        assert list(counters.keys("ann")) == ["a", "b", "m", "z"]
        assert list(counters.range("ann", "b", "z")) == [("b", 4), ("m", 1)]
        assert list(counters.range("ann", None, "b")) == [("a", 2)]
        assert list(counters.range("ann", "n", None)) == [("z", 3)]
        assert list(counters.items("an")) == [("a", 100)] and counters.len("ann") == 4
        counters.delete("ann", "m")
        assert not counters.contains("ann", "m") and counters.contains("ann", "a")
        counters.clear("ann")
        assert list(counters.items("ann")) == [] and counters.get("an", "a") == 100
        assert dict(counters.maps()) == {"an": {"a": 100}, "bob": {"x": 9}}


def test_records_are_the_user_keys_prefix_so_no_key_group_depends_on_a_seq_or_sub_key(tmp_path: Path) -> None:
    with TaskStorage.open(make_config(tmp_path), "task-0") as task:
        task.list_store("events").append("ann", 1)
        task.map_store("counters").put("ann", "sub", 2)
        for name in ("events", "counters"):
            records = [key for key, _ in task.stores[name].items()]
            assert records and all(key.startswith(key_prefix(b"ann")) for key in records)
            assert {user_key_of(key) for key in records} == {b"ann"}


class CountingStore:
    """A local store that records the names of the calls made on it."""

    def __init__(self, store: Any) -> None:
        self.store = store
        self.calls: list[str] = []

    def __getattr__(self, name: str) -> Any:
        attribute = getattr(self.store, name)
        if callable(attribute):
            self.calls.append(name)
        return attribute


def test_append_reads_one_record_whatever_the_lists_length(tmp_path: Path) -> None:
    """An append reads the list's head record only (one get, never an iteration) and writes the element and the head
    record, at 10 or 5000 elements."""
    with TaskStorage.open(make_config(tmp_path), "task-0") as task:
        typed = task.list_store("events")
        assert isinstance(typed, ListStore)
        counting = CountingStore(task.stores["events"])
        events = ListStore(cast(Any, counting), typed.key_serde, typed.value_serde)
        for length in (10, 5000):
            events.extend(f"k{length}", range(length))
            counting.calls.clear()
            events.append(f"k{length}", -1)
            assert counting.calls == ["get", "put_many", "put"], counting.calls
        assert events.len("k5000") == 5001 and events.get("k10")[-2:] == [9, -1]


# -- errors ----------------------------------------------------------------------------------------------------------


def test_an_operation_of_another_kind_names_the_store_its_kind_and_what_it_offers(tmp_path: Path) -> None:
    config = make_config(tmp_path, **{"stores.plain.backup.factories": "changelog"})
    with TaskStorage.open(config, "task-0") as task:
        with pytest.raises(KindError, match=r"store 'events' is a list store.*no put.*offers append, extend"):
            task.list_store("events").put("ann", 1)
        with pytest.raises(KindError, match=r"store 'counters' is a map store.*no append.*offers get"):
            task.map_store("counters").append("ann", 1)
        with pytest.raises(KindError, match=r"store 'plain' is a value store.*no trim.*list stores"):
            task.store("plain").trim(b"k", keep_last=1)  # type: ignore[attr-defined]  # a list operation, on purpose
        with pytest.raises(AttributeError, match="no attribute 'nonsense'"):
            task.list_store("events").nonsense  # noqa: B018
        assert isinstance(KindError("x"), AttributeError) and not hasattr(task.store("plain"), "append")
        with pytest.raises(ValueError, match=r"store 'events'.*keep_last must be an int >= 0, got -1"):
            task.list_store("events").trim("ann", keep_last=-1)


@pytest.mark.parametrize(
    ("accessor", "name", "kind", "use"),
    [
        ("store", "events", "list", "list_store"),
        ("store", "counters", "map", "map_store"),
        ("list_store", "counters", "map", "map_store"),
        ("list_store", "plain", "value", "store"),
        ("map_store", "events", "list", "list_store"),
        ("map_store", "plain", "value", "store"),
    ],
)
def test_an_accessor_of_another_kind_is_refused_naming_the_stores_kind_and_its_accessor(
    tmp_path: Path, accessor: str, name: str, kind: str, use: str
) -> None:
    config = make_config(tmp_path, **{"stores.plain.backup.factories": "changelog"})
    with TaskStorage.open(config, "task-0") as task:
        stores = TaskStores(task, 0, 0)
        for owner in (task, stores):  # the task's accessors and a Spark function's, alike
            with pytest.raises(KindError, match=rf"store '{name}' is a {kind} store .*use task\.{use}\(name\)"):
                getattr(owner, accessor)(name)
        assert task.stores[name].count() == 0


def test_each_accessor_and_view_give_the_store_of_their_kind(tmp_path: Path) -> None:
    config = make_config(tmp_path, **{"stores.plain.backup.factories": "changelog"})
    with TaskStorage.open(config, "task-0") as task:
        stores = TaskStores(task, 0, 0)
        task.store("plain").put(b"k", b"v")
        task.list_store("events").append("ann", 1)
        task.map_store("counters").put("ann", "x", 2)
        assert task.store("plain").get(b"k") == stores["plain"].get(b"k") == stores.store("plain").get(b"k") == b"v"
        assert isinstance(task.view("events"), ListStore) and isinstance(stores["events"], ListStore)
        assert isinstance(task.view("counters"), MapStore) and isinstance(stores["counters"], MapStore)
        assert stores.list_store("events").get("ann") == [1] and stores.map_store("counters").get("ann", "x") == 2
        assert isinstance(task.store("plain", typed=False), BytesStore)
        assert task.list_store("events", typed=False).get(b"ann") == [b"1"]  # over bytes: as encoded
        with pytest.raises(ConfigError, match=r"no store 'nope' in this task; configured stores: counters, events"):
            task.list_store("nope")
        with pytest.raises(ConfigError, match=rf"store '{TIMERS_STORE}' holds the task's timers: use stores\.timers"):
            stores.store(TIMERS_STORE)


def test_bad_keys_sub_keys_and_values_raise_before_anything_is_written(tmp_path: Path) -> None:
    with TaskStorage.open(make_config(tmp_path), "task-0") as task:
        events, counters = task.list_store("events"), task.map_store("counters")
        assert isinstance(events, ListStore) and isinstance(counters, MapStore)
        with pytest.raises(SerdeError, match=r"store 'events'.*json serde cannot encode the value of key 'ann'"):
            events.extend("ann", [1, {1, 2}])
        with pytest.raises(SerdeError, match=r"store 'events'.*string serde cannot encode the key 5"):
            events.append(5, 1)
        with pytest.raises(SerdeError, match=r"store 'counters'.*string serde cannot encode the sub-key 7"):
            counters.put("ann", 7, 1)
        with pytest.raises(SerdeError, match=r"store 'counters'.*integer serde cannot encode the value of key 'ann'"):
            counters.update("ann", {"a": 1, "b": "two"})
        assert events.get("ann") == [] and list(counters.items("ann")) == []
        assert task.stores["events"].count() == 0 and task.stores["counters"].count() == 0


@pytest.mark.parametrize(
    ("extra", "message"),
    [
        ({"stores.events.kind": "set"}, r"stores\.events\.kind.*'set'.*value, list, map"),
        ({"stores.events.subkey.serde": "string"}, r"stores\.events\.subkey\.serde is set but store 'events' is of"),
        (
            {"stores.counters.migration.id": "m1", "stores.counters.migration.function": "tests.record_values:CALLS"},
            r"stores\.counters\.migration\.id is set but store 'counters' is of kind 'map'",
        ),
        ({"stores.counters.subkey.serde": "record:tests.record_values:CountV1"}, r"subkey\.serde.*a key must keep"),
    ],
)
def test_bad_kind_settings_are_refused_naming_the_key(tmp_path: Path, extra: dict[str, str], message: str) -> None:
    with pytest.raises(ConfigError, match=message):
        TaskStorage.open(make_config(tmp_path, **extra), "task-0")


def test_a_store_cannot_change_its_kind(tmp_path: Path) -> None:
    config = make_config(tmp_path)
    with TaskStorage.open(config, "task-0") as task:
        task.list_store("events").append("ann", 1)
        task.commit_durably({"input": "1"})
        assert task.last_checkpoint is not None
        assert task.last_checkpoint.serdes["events"]["kind"] == "list"
    for kind in ("value", "map"):
        with pytest.raises(ConfigError, match=rf"stores\.events\.kind is '{kind}' but store 'events' was written as"):
            TaskStorage.open({**config, "stores.events.kind": kind}, "task-0")


def test_a_value_store_records_and_stores_exactly_what_it_did_before(tmp_path: Path) -> None:
    config = make_config(tmp_path, **{"stores.plain.backup.factories": "changelog", "stores.plain.key.serde": "string"})
    config["stores.plain.msg.serde"] = "integer"
    with TaskStorage.open(config, "task-0") as task:
        task.store("plain").put("a", 1)
        assert list(task.stores["plain"].items()) == [(b"a", b"\x80" + b"\x00" * 6 + b"\x01")]
        task.commit_durably({"input": "1"})
        assert task.last_checkpoint is not None
        assert dict(task.last_checkpoint.serdes["plain"]) == {"key": "string", "msg": "integer"}


# -- TTL -------------------------------------------------------------------------------------------------------------


def test_ttl_per_store_and_per_call_hides_expired_elements_and_entries(tmp_path: Path) -> None:
    config = make_config(tmp_path, **{"stores.events.ttl.ms": 100, "stores.counters.ttl.ms": 100})
    with TaskStorage.open(config, "task-0") as task:
        events, counters = task.list_store("events"), task.map_store("counters")
        assert isinstance(events, ListStore) and isinstance(counters, MapStore)
        task.ttl_now_ms = 1000
        events.append("ann", "a")  # expires at 1100
        events.append("ann", "b", ttl_ms=500)  # at 1500
        counters.put("ann", "short", 1)  # at 1100
        counters.put("ann", "long", 2, ttl_ms=1000)  # at 2000
        task.ttl_now_ms = 1050
        events.append("ann", "c")  # at 1150
        assert events.get("ann") == ["a", "b", "c"] and events.len("ann") == 3
        task.ttl_now_ms = 1100
        assert events.get("ann") == ["b", "c"] and events.len("ann") == 2
        assert list(counters.items("ann")) == [("long", 2)] and counters.get("ann", "short") is None
        task.ttl_now_ms = 1149
        assert events.trim("ann", keep_last=1) == 1 and events.get("ann") == ["c"]
        task.commit_durably({"input": "1"})
        task.ttl_now_ms = 1500
        assert events.get("ann") == [] and not events.contains("ann")
        events.append("ann", "d")  # after every element expired: a new list, its seqs going on
        assert events.get("ann") == ["d"] and events.len("ann") == 1
        task.ttl_now_ms = 2000
        assert list(counters.maps()) == [] and list(events.lists()) == []
        assert task.stores["counters"].count() == 1  # stored until the sweep
        task.commit_durably({"input": "2"})  # the sweep before the commit deletes the expired records
        assert task.stores["counters"].count() == 0 and task.stores["events"].count() == 0


def test_ttl_ms_on_a_store_without_a_ttl_is_refused_naming_the_key(tmp_path: Path) -> None:
    config = make_config(tmp_path, **{"stores.plain.backup.factories": "changelog"})
    with TaskStorage.open(config, "task-0") as task:
        with pytest.raises(ConfigError, match=r"store 'events' \(list store\) has no TTL.*stores\.events\.ttl\.ms"):
            task.list_store("events").append("ann", 1, ttl_ms=10)
        with pytest.raises(ConfigError, match=r"store 'plain' has no TTL.*stores\.plain\.ttl\.ms"):
            task.store("plain").put(b"k", b"v", ttl_ms=10)
        assert task.stores["events"].count() == 0 and task.stores["plain"].count() == 0


def test_a_value_store_takes_a_ttl_per_call(tmp_path: Path) -> None:
    config = make_config(tmp_path, **{"stores.plain.backup.factories": "changelog", "stores.plain.ttl.ms": 100})
    config.update({"stores.plain.key.serde": "string", "stores.plain.msg.serde": "integer"})
    with TaskStorage.open(config, "task-0") as task:
        plain = task.store("plain")
        task.ttl_now_ms = 1000
        plain.put("short", 1)
        plain.put("long", 2, ttl_ms=1000)
        plain.put_many(["many"], [3], ttl_ms=500)
        with pytest.raises(ValueError, match=r"ttl_ms must be an int of at least 1.*got 0"):
            plain.put("zero", 1, ttl_ms=0)
        task.ttl_now_ms = 1100
        assert dict(plain.items()) == {"long": 2, "many": 3}
        task.ttl_now_ms = 1500
        assert dict(plain.items()) == {"long": 2}


# -- backup, restore, evolution ---------------------------------------------------------------------------------------


@pytest.mark.parametrize("backend", BACKENDS)
def test_lists_and_maps_are_backed_up_and_restored_exactly_by_every_backend(tmp_path: Path, backend: str) -> None:
    """Random list and map calls over commits, restored after every few from the blob store alone (the local dir
    wiped), compared with the models."""
    config = make_config(tmp_path, backend)
    rng = random.Random(f"kinds-{backend}")
    lists_model: dict[str, list[Any]] = {}
    maps_model: dict[str, Any] = {}
    for run in range(3):
        with TaskStorage.open(config, "task-0") as task:
            assert lists(task) == lists_model and maps(task) == sorted_maps(maps_model)
            for commit in range(3):
                mutate(task, rng, lists_model, maps_model)
                task.commit_durably({"input": f"{run}-{commit}"})
            assert lists(task) == lists_model and maps(task) == sorted_maps(maps_model)
        shutil.rmtree(tmp_path / "local")
    assert lists_model and maps_model  # the models were not trivially empty
    with TaskStorage.open(config, "task-0") as task:
        assert task.restored is not None and task.restored.serdes["counters"]["kind"] == "map"
        assert lists(task) == lists_model and maps(task) == sorted_maps(maps_model)


def test_a_record_class_evolves_for_list_elements_and_map_values(tmp_path: Path) -> None:
    old = {"stores.events.msg.serde": "record:tests.record_values:CountV1"}
    old["stores.counters.msg.serde"] = "record:tests.record_values:CountV1"
    config = make_config(tmp_path, **old)
    with TaskStorage.open(config, "task-0") as task:
        task.list_store("events").extend("ann", [CountV1(1, "b0"), CountV1(2, "b1")])
        task.map_store("counters").put("ann", "x", CountV1(3, "b0"))
        task.commit_durably({"input": "1"})
    shutil.rmtree(tmp_path / "local")
    new = {key: "record:tests.record_values:CountV2" for key in old}
    with TaskStorage.open({**config, **new}, "task-0") as task:
        events, counters = task.list_store("events"), task.map_store("counters")
        assert isinstance(events, ListStore) and isinstance(counters, MapStore)
        assert events.get("ann") == [CountV2(1.0), CountV2(2.0)]
        assert counters.get("ann", "x") == CountV2(3.0)
        events.append("ann", CountV2(4.5, "b2"))
        assert events.get("ann") == [CountV2(1.0), CountV2(2.0), CountV2(4.5, "b2")]
        task.commit_durably({"input": "2"})
        assert task.last_checkpoint is not None
        recorded = schemas_from_text(task.last_checkpoint.serdes["events"]["msg.schemas"], where="test")
        assert len(recorded) == 2  # the old elements' schema and the class's


def test_a_record_class_that_cannot_read_old_elements_is_refused_at_open(tmp_path: Path) -> None:
    config = make_config(tmp_path, **{"stores.events.msg.serde": "record:tests.record_values:CountV1"})
    with TaskStorage.open(config, "task-0") as task:
        task.list_store("events").append("ann", CountV1(1, "b0"))
        task.commit_durably({"input": "1"})
    bad = {**config, "stores.events.msg.serde": "record:tests.record_values:CountBadType"}
    with pytest.raises(ConfigError, match=r"stores\.events\.msg\.serde: CountBadType cannot read the values of store"):
        TaskStorage.open(bad, "task-0")


def test_bytes_views_give_the_encoded_keys_and_values(tmp_path: Path) -> None:
    with TaskStorage.open(make_config(tmp_path), "task-0") as task:
        task.list_store("events").append("ann", {"a": 1})
        task.map_store("counters").put("ann", "x", 5)
        raw_events = task.list_store("events", typed=False)
        raw_counters = task.map_store("counters", typed=False)
        assert isinstance(raw_events, ListStore) and isinstance(raw_counters, MapStore)
        assert list(raw_events.raw_lists()) == [(b"ann", [b'{"a":1}'])]
        assert list(raw_counters.raw_maps()) == [(b"ann", [(b"x", b"\x80" + b"\x00" * 6 + b"\x05")])]
