"""Evolving values (statebackend/serdes/record.py, statebackend/values.py): a record store's class may change between
opens in the ways an old value reads through, any other change is refused at open naming the field, and a migration
rewrites a store's values exactly once: its writes and its name land in one checkpoint, so a crash, a replay or a
second open never runs it twice over, nor leaves the store half migrated."""

from __future__ import annotations

import json
import shutil
import struct
from pathlib import Path
from typing import Any

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from statebackend.checkpoint import decode_checkpoint, encode_checkpoint
from statebackend.checkpoint.serde import Binding

from statebackend.config import Settings
from statebackend.errors import ConfigError, CorruptDataError, SerdeError
from statebackend.restore import restored_stores
from statebackend.serdes import RecordSerde, get_serde, record_class
from statebackend.serdes.record import RecordDicts, RecordSchema, read_problems, schemas_from_text, schemas_to_text
from statebackend.store.ttl import unwrap
from statebackend.task import TaskStorage
from tests import record_values as rv
from tests.backend_helpers import counts_config

V1 = "record:tests.record_values:CountV1"
V2 = "record:tests.record_values:CountV2"
V3 = "record:tests.record_values:CountV3"
SPLIT = {
    "stores.counts.migration.id": "split-first",
    "stores.counts.migration.function": "tests.record_values:split_first",
}


def make_config(tmp_path: Path, msg_serde: str, backend: str = "changelog", /, **extra: Any) -> dict[str, Any]:
    return counts_config(tmp_path, msg_serde, job="values", factories=backend, **extra)


def write_v1(tmp_path: Path, keys: int = 10, /, **extra: object) -> dict[str, object]:
    """Commit ``keys`` CountV1 values (k0.. with count i, first "b<i>") as checkpoint #1; returns the config."""
    config = make_config(tmp_path, V1, **extra)
    with TaskStorage.open(config, "task-0") as task:
        task.store("counts").put_many([f"k{i}" for i in range(keys)], [rv.CountV1(i, f"b{i}") for i in range(keys)])
        task.commit_durably({"batch": "1"})
    return config


def contents(task: TaskStorage) -> dict[str, Any]:
    return dict(task.store("counts").items())


@pytest.fixture(autouse=True)
def _no_calls_before() -> None:
    rv.CALLS.clear()


# -- evolution ----------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("backend", ["changelog", "blobsnapshot"])
def test_a_value_schema_gains_and_loses_a_field_across_opens(tmp_path: Path, backend: str) -> None:
    config = write_v1(tmp_path, 3, **{"stores.counts.backup.factories": backend})
    evolved = dict(config, **{"stores.counts.msg.serde": V2})
    with TaskStorage.open(evolved, "task-0") as task:
        counts = task.store("counts")
        # 'first' dropped, 'last' added with its default, count widened to float: old values read as the new class
        assert counts.get("k2") == rv.CountV2(2.0, "")
        assert isinstance(counts.get("k2").count, float)
        counts.put("k2", rv.CountV2(counts.get("k2").count + 0.5, "b9"))
        counts.update_many(["k1", "new"], lambda old: [rv.CountV2(old[0].count * 10, "b9"), rv.CountV2(7.0)])
        checkpoint = task.commit_durably({"batch": "2"})
    schemas = schemas_from_text(checkpoint.serdes["counts"]["msg.schemas"])
    assert {s.text for s in schemas} == {"count:int,first:str", "count:float,last:str"}  # old values still stored
    shutil.rmtree(tmp_path / "local")  # from the blob store alone: old and new values side by side
    with TaskStorage.open(evolved, "task-0") as task:
        assert contents(task) == {
            "k0": rv.CountV2(0.0),
            "k1": rv.CountV2(10.0, "b9"),
            "k2": rv.CountV2(2.5, "b9"),
            "new": rv.CountV2(7.0),
        }
        assert task.store("counts").get_many(["k0", "nope", "new"]) == [rv.CountV2(0.0), None, rv.CountV2(7.0)]
        k0, k2 = task.store("counts", typed=False).get(b"k0"), task.store("counts", typed=False).get(b"k2")
        assert k0 is not None and k2 is not None
        assert k0[1:5] != k2[1:5]  # each value carries the fingerprint it was written with


def test_an_incompatible_change_is_refused_at_open_naming_the_store_and_the_field(tmp_path: Path) -> None:
    config = write_v1(tmp_path, 3)
    with pytest.raises(
        ConfigError,
        match=r"stores\.counts\.msg\.serde: CountBadType cannot read the values of store "
        r"'counts' written with count:int,first:str .*field 'first' was str and is "
        r"int now.*stores\.counts\.migration\.id",
    ):
        TaskStorage.open(
            dict(config, **{"stores.counts.msg.serde": "record:tests.record_values:CountBadType"}), "task-0"
        )
    with pytest.raises(ConfigError, match="field 'seen' is new and has no default"):
        TaskStorage.open(
            dict(config, **{"stores.counts.msg.serde": "record:tests.record_values:CountNoDefault"}), "task-0"
        )
    with pytest.raises(
        ConfigError, match="stores.counts.msg.serde is 'json' but store 'counts' was written with record values"
    ):
        TaskStorage.open(dict(config, **{"stores.counts.msg.serde": "json"}), "task-0")
    with TaskStorage.open(config, "task-0") as task:  # refused opens changed nothing
        assert contents(task) == {f"k{i}": rv.CountV1(i, f"b{i}") for i in range(3)}


def test_a_schema_recorded_once_must_stay_readable_until_a_migration(tmp_path: Path) -> None:
    """V1 -> V2 is readable, but going back to V1 is not: V2's values hold a float count and no 'first'."""
    config = write_v1(tmp_path, 1)
    with TaskStorage.open(dict(config, **{"stores.counts.msg.serde": V2}), "task-0") as task:
        task.store("counts").put("k9", rv.CountV2(1.5))
        task.commit_durably({"batch": "2"})
    with pytest.raises(
        ConfigError,
        match="written with count:float,last:str .*field 'count' was float and is int "
        "now: .*; field 'first' is new and has no default",
    ):
        TaskStorage.open(config, "task-0")


def test_the_read_rules() -> None:
    def schema(text: str) -> RecordSchema:
        return RecordSchema.parse(text)

    count_v1 = record_class(V1)
    assert read_problems(schema("count:int,first:str"), count_v1) == []
    assert read_problems(schema("count:int,first:str,gone:bytes?"), count_v1) == []  # a dropped field
    assert read_problems(schema("count:int,first:str?"), count_v1) == [
        "field 'first' was optional and is required now: stored values may hold None"
    ]
    assert read_problems(schema("count:float,first:str"), count_v1) == [
        "field 'count' was float and is int now: only int -> float and a scalar -> json read old values"
    ]
    every = record_class("record:tests.record_values:Every")
    # scalars widen to a JSON field, a required field may become optional
    old = schema("i:int,f:int,b:bool,s:str,raw:bytes,items:str,note:str,n:int,props:bool")
    assert read_problems(old, every) == []


def test_a_record_store_read_without_its_recorded_schemas_says_where_to_read_it(tmp_path: Path) -> None:
    config = write_v1(tmp_path, 1)
    with TaskStorage.open(dict(config, **{"stores.counts.msg.serde": V2}), "task-0") as task:
        old = task.store("counts", typed=False).get(b"k0")
        assert old is not None
    with pytest.raises(CorruptDataError, match="written with record schema .*TaskStorage.store"):
        get_serde(V2).from_bytes(old)  # the bare serde knows the class's own schema only


def test_a_damaged_schema_record_is_corrupt_data(tmp_path: Path) -> None:
    good = schemas_to_text([record_class(V1).schema])
    assert schemas_from_text(good) == (record_class(V1).schema,)
    with pytest.raises(CorruptDataError, match="it was altered"):
        schemas_from_text(good.replace("first:str", "first:int"))
    with pytest.raises(CorruptDataError, match="not JSON"):
        schemas_from_text("{")


def test_checkpoints_record_the_schemas_as_strings_every_checkpoint_reader_reads(tmp_path: Path) -> None:
    """No new checkpoint format: the records are strings in the serdes map (format 2's rules, and those of the
    releases before record serdes, which read every string of it); encoding stays canonical."""
    config = write_v1(tmp_path, 1, **SPLIT)
    with TaskStorage.open(config, "task-0") as task:
        checkpoint = task.restored
        assert checkpoint is not None
        assert task.recorded_serdes["counts"] == checkpoint.serdes["counts"]
    recorded = dict(checkpoint.serdes["counts"])
    assert recorded == {
        "key": "string",
        "msg": "record",
        "msg.migration": "split-first",
        "msg.schemas": json.dumps(
            {record_class(V1).schema.fingerprint.hex(): "count:int,first:str"}, separators=(",", ":")
        ),
    }
    binding = Binding("values", "task-0", 1)
    data = encode_checkpoint(checkpoint, binding)
    assert decode_checkpoint(data, expect=binding) == checkpoint
    assert encode_checkpoint(decode_checkpoint(data), binding) == data
    assert json.loads(data)["version"] == 2 and json.loads(data)["format"] == 2


# -- migrations ---------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("backend", ["changelog", "blobsnapshot"])
def test_a_migration_runs_once_its_writes_and_its_name_in_one_checkpoint(tmp_path: Path, backend: str) -> None:
    config = write_v1(tmp_path, **{"stores.counts.backup.factories": backend})
    migrating = dict(config, **{"stores.counts.msg.serde": V3}, **SPLIT)
    expected = {f"k{i}": rv.CountV3(i, i, f"b{i}") for i in range(10)}
    # an open that is never committed (a crash): nothing of the migration is durable
    task = TaskStorage.open(migrating, "task-0")
    assert contents(task) == expected and len(rv.CALLS) == 10
    task.close()
    assert [e.seq for e in task.checkpoint_log.entries()] == [1]
    # so the next open migrates again, from the old values, and its commit carries the writes and the name
    rv.CALLS.clear()
    with TaskStorage.open(migrating, "task-0") as task:
        assert contents(task) == expected and len(rv.CALLS) == 10
        task.store("counts").put("k0", rv.CountV3(100, 0))
        migrated = task.commit_durably({"batch": "2"})
    assert migrated.serdes["counts"]["msg.migration"] == "split-first"
    assert {s.text for s in schemas_from_text(migrated.serdes["counts"]["msg.schemas"])} == {
        "count:int,first:int,tag:str"
    }  # every value was rewritten: the old schema is no longer recorded
    # a second open, and an open from the blob store alone, do not run it again
    rv.CALLS.clear()
    for wipe in (False, True):
        if wipe:
            shutil.rmtree(tmp_path / "local")
        with TaskStorage.open(migrating, "task-0") as task:
            assert contents(task) == {**expected, "k0": rv.CountV3(100, 0)}
            task.commit_durably({"batch": "3"})
    assert rv.CALLS == []
    # a replay from the checkpoint before the migration migrates that state again (it is the one restored)
    with TaskStorage.open(migrating, "task-0") as task:
        first = task.checkpoint_log.entries()[0]
        head = task.committed_seq
    assert first.seq == 1
    with TaskStorage.open(migrating, "task-0", checkpoint=first, fence_seq=head) as task:
        assert contents(task) == expected and len(rv.CALLS) == 10
        task.commit_durably({"batch": "2"})
    rv.CALLS.clear()
    with TaskStorage.open(migrating, "task-0") as task:
        assert contents(task) == expected and rv.CALLS == []


def test_a_migration_that_fails_part_way_leaves_the_store_as_it_was(tmp_path: Path) -> None:
    config = write_v1(tmp_path)
    failing = dict(
        config,
        **{
            "stores.counts.msg.serde": V3,
            "stores.counts.migration.id": "split-first",
            "stores.counts.migration.function": "tests.record_values:fail_at_k5",
        },
    )
    with pytest.raises(RuntimeError, match="injected failure") as raised:
        TaskStorage.open(failing, "task-0")
    assert "in migration 'split-first' of store 'counts', at key 'k5'" in raised.value.__notes__
    assert len(rv.CALLS) == 5  # k0..k4 were rewritten in the write batch before k5 failed
    with TaskStorage.open(config, "task-0") as task:  # none of it reached the store
        assert contents(task) == {f"k{i}": rv.CountV1(i, f"b{i}") for i in range(10)}


def test_a_migration_larger_than_the_write_batch_crashing_before_its_commit_is_not_seen(tmp_path: Path) -> None:
    """A migration bigger than write.batch.max.bytes spills to LMDB (which then is ahead of every checkpoint); a
    crash before the commit must not leave those values in the store: the next open restores the checkpoint."""
    small = {"stores.counts.write.batch.max.bytes": 2048}
    config = write_v1(tmp_path, 300, **small)
    task = TaskStorage.open(dict(config, **{"stores.counts.msg.serde": V3}, **SPLIT), "task-0")
    assert task.stores["counts"].spill_runs or task.stores["counts"].version is None  # it spilled
    task.close()
    with TaskStorage.open(config, "task-0") as task:
        assert contents(task) == {f"k{i}": rv.CountV1(i, f"b{i}") for i in range(300)}


def test_a_migration_of_json_values_rewrites_and_deletes_keeping_each_expiry(tmp_path: Path) -> None:
    config = make_config(tmp_path, "json", **{"stores.counts.ttl.ms": 60_000, "stores.counts.ttl.sweep.keys": 0})
    with TaskStorage.open(config, "task-0") as task:
        for i, now in enumerate([1_000, 2_000, 3_000]):
            task.ttl_now_ms = now
            task.store("counts").put(f"k{i}", i)
        task.commit_durably({"batch": "1"})
    migrating = dict(
        config,
        **{
            "stores.counts.migration.id": "drop-small",
            "stores.counts.migration.function": "tests.record_values:drop_small",
        },
    )
    with TaskStorage.open(migrating, "task-0") as task:
        task.ttl_now_ms = 10_000
        assert contents(task) == {"k2": 4}
        assert {k: unwrap(v)[0] for k, v in task.stores["counts"].items()} == {b"k2": 63_000}  # expiry of its put
        task.commit_durably({"batch": "2"})
    assert sorted(key for _, key in rv.CALLS) == ["k0", "k1", "k2"]
    # counted: one run, one value rewritten, two keys deleted; an open after it has landed runs and counts nothing
    assert [task.metrics.counter(f"migration.{name}") for name in ("runs", "values.rewritten", "values.deleted")] == [
        1,
        1,
        2,
    ]
    with TaskStorage.open(migrating, "task-0") as task:
        assert task.metrics.counter("migration.runs") == 0 and task.metrics.counter("migration.values.rewritten") == 0


def test_a_migration_declared_on_a_store_without_state_records_its_name_and_runs_nothing(tmp_path: Path) -> None:
    config = make_config(tmp_path, V3, **SPLIT)
    with TaskStorage.open(config, "task-0") as task:
        task.store("counts").put("a", rv.CountV3(1, 2))
        checkpoint = task.commit_durably({"batch": "1"})
    assert checkpoint.serdes["counts"]["msg.migration"] == "split-first"
    with TaskStorage.open(config, "task-0") as task:
        assert contents(task) == {"a": rv.CountV3(1, 2)}
    assert rv.CALLS == []


def test_a_migration_function_returning_the_wrong_type_fails_the_open_naming_the_key(tmp_path: Path) -> None:
    config = write_v1(tmp_path, 2)
    wrong = dict(config, **{"stores.counts.msg.serde": V2}, **SPLIT)  # split_first returns CountV3, not CountV2
    with pytest.raises(TypeError, match="stores CountV2 instances, got CountV3") as raised:
        TaskStorage.open(wrong, "task-0")
    assert "in migration 'split-first' of store 'counts', at key 'k0'" in raised.value.__notes__


# -- values copied between tasks (a rescale) ----------------------------------------------------------------------


def test_values_copied_from_another_tasks_checkpoint_read_with_its_schemas(tmp_path: Path) -> None:
    config = make_config(tmp_path, V1)
    with TaskStorage.open(config, "task-1") as old:
        old.store("counts").put("a", rv.CountV1(1, "b1"))
        old.commit_durably({"batch": "1"})
    evolved = dict(config, **{"stores.counts.msg.serde": V2})
    with (
        TaskStorage.open(evolved, "task-0") as task,
        restored_stores(dict(evolved, **{"state.local.dir": str(tmp_path / "scratch")}), "task-1") as source,
    ):
        task.adopt_values(source.checkpoint, "task-1's checkpoint")
        task.stores["counts"].put_many(*map(list, zip(*source.stores["counts"].items(), strict=True)))
        assert contents(task) == {"a": rv.CountV2(1.0)}
        checkpoint = task.commit_durably({"batch": "2"})
    assert {s.text for s in schemas_from_text(checkpoint.serdes["counts"]["msg.schemas"])} == {
        "count:int,first:str",
        "count:float,last:str",
    }


def test_values_copied_from_a_checkpoint_before_this_stores_migration_are_refused(tmp_path: Path) -> None:
    config = make_config(tmp_path, V1)
    with TaskStorage.open(config, "task-1") as old:
        old.store("counts").put("a", rv.CountV1(1, "b1"))
        old.commit_durably({"batch": "1"})
    migrating = dict(config, **{"stores.counts.msg.serde": V3}, **SPLIT)
    with (
        TaskStorage.open(migrating, "task-0") as task,
        restored_stores(dict(config, **{"state.local.dir": str(tmp_path / "scratch")}), "task-1") as source,
    ):
        with pytest.raises(ConfigError, match="change num_tasks in a run before or after"):
            task.adopt_values(source.checkpoint, "task-1's checkpoint")
        assert task.recorded_serdes["counts"]["msg.migration"] == "split-first"  # nothing was changed


# -- the serde ----------------------------------------------------------------------------------------------------

TEXT = st.text(max_size=20)
JSON = st.recursive(
    st.none() | st.booleans() | st.integers(-(2**53), 2**53) | st.floats(allow_nan=False, allow_infinity=False) | TEXT,
    lambda children: st.lists(children, max_size=3) | st.dictionaries(TEXT, children, max_size=3),
    max_leaves=8,
)
INT64 = st.integers(-(2**63), 2**63 - 1)
EVERY = st.builds(
    rv.Every,
    i=INT64,
    f=st.floats(allow_nan=False),
    b=st.booleans(),
    s=TEXT,
    raw=st.binary(max_size=20),
    items=st.lists(JSON, max_size=4),
    note=st.none() | TEXT,
    n=st.none() | INT64,
    props=st.none() | st.dictionaries(TEXT, JSON, max_size=3),
)


@given(EVERY)
def test_every_field_type_round_trips(value: rv.Every) -> None:
    serde = get_serde("record:tests.record_values:Every")
    assert isinstance(serde, RecordSerde)
    data = serde.to_bytes(value)
    assert serde.from_bytes(data) == value
    assert serde.from_bytes_many(serde.to_bytes_many([value, value])) == [value, value]
    # nothing but the header, one struct and the variable fields: no field names
    assert b"items" not in data and data[:1] == b"\xa1"


@given(st.lists(st.tuples(INT64, TEXT), max_size=5))
def test_named_tuples_and_attrs_classes_round_trip(items: list[tuple[int, str]]) -> None:
    pairs = get_serde("record:tests.record_values:Pair")
    counts = get_serde(V1)
    for left, right in items:
        assert pairs.from_bytes(pairs.to_bytes(rv.Pair(left, right))) == rv.Pair(left, right)
        assert counts.from_bytes(counts.to_bytes(rv.CountV1(left, right))) == rv.CountV1(left, right)


@settings(max_examples=50)
@given(INT64, TEXT)
def test_an_old_value_reads_as_the_new_class_and_as_a_dict_of_its_own_fields(count: int, first: str) -> None:
    old = get_serde(V1)
    data = old.to_bytes(rv.CountV1(count, first))
    new = get_serde(V2)
    assert isinstance(old, RecordSerde) and isinstance(new, RecordSerde)
    assert new.with_schemas([old.schema]).from_bytes(data) == rv.CountV2(float(count))
    assert RecordDicts([old.schema]).from_bytes(data) == {"count": count, "first": first}


def test_encoding_errors_name_the_field() -> None:
    serde = get_serde(V1)
    with pytest.raises(TypeError, match="field 'count' takes int, got bool"):
        serde.to_bytes(rv.CountV1(True, "x"))  # type: ignore[arg-type]
    with pytest.raises(TypeError, match="field 'first' is not optional"):
        serde.to_bytes(rv.CountV1(1, None))  # type: ignore[arg-type]
    with pytest.raises(TypeError, match="stores CountV1 instances, got dict"):
        serde.to_bytes({"count": 1, "first": "x"})
    with pytest.raises(SerdeError, match="field 'count': 9223372036854775808 is outside the signed 64-bit range"):
        serde.to_bytes(rv.CountV1(2**63, "x"))
    with pytest.raises(SerdeError, match="field 'first': .* has a lone surrogate"):
        serde.to_bytes(rv.CountV1(1, "\ud800"))
    with pytest.raises(SerdeError, match="field 'items': cannot encode a set as JSON"):
        get_serde("record:tests.record_values:Every").to_bytes(rv.Every(1, 1.0, True, "", b"", {1}))  # type: ignore[arg-type]


def test_damaged_bytes_are_corrupt_data() -> None:
    serde = get_serde(V1)
    data = serde.to_bytes(rv.CountV1(1, "abc"))
    for damaged in (data[:-1], data + b"x", data[:7], b"\xa1\x00\x00\x00\x00" + data[5:], b"{}", b""):
        with pytest.raises(CorruptDataError):
            serde.from_bytes(damaged)
    lengths = struct.unpack_from("<qI", data, 5)
    assert lengths == (1, 3)  # the layout the module docstring gives: the fixed fields, then the lengths


# -- configuration ------------------------------------------------------------------------------------------------


def _settings(**keys: object) -> Settings:
    return Settings.from_config(
        {
            "blob.store.url": "file:///tmp/values",
            "stores.counts.backup.factories": "changelog",
            **{f"stores.counts.{k.replace('__', '.')}": v for k, v in keys.items()},
        }
    )


def test_a_record_class_is_named_or_given_and_checked_where_the_config_is_read() -> None:
    assert _settings(msg__serde=V1).stores["counts"].msg_serde == V1
    assert _settings(msg__serde=rv.CountV1).stores["counts"].msg_serde == V1
    with pytest.raises(
        ConfigError,
        match="stores.counts.msg.serde='record:tests.record_values:Nope' is not valid: "
        "record class tests.record_values:Nope: module 'tests.record_values' has "
        "no 'Nope'",
    ):
        _settings(msg__serde="record:tests.record_values:Nope")
    with pytest.raises(ConfigError, match="module 'no_such_module' cannot be imported"):
        _settings(msg__serde="record:no_such_module:Count")
    with pytest.raises(ConfigError, match="is not an attrs class, a dataclass or a NamedTuple"):
        _settings(msg__serde="record:pathlib:Path")
    with pytest.raises(ConfigError, match="a record serde is for values"):
        _settings(key__serde=V1)


def test_an_unsupported_field_type_is_refused_naming_the_field() -> None:
    with pytest.raises(ConfigError, match="field 'when' is annotated .*a record field is int, float, bool, str"):
        record_class("record:tests.record_values:WithADate")


def test_a_migration_needs_its_name_and_an_importable_function() -> None:
    with pytest.raises(
        ConfigError, match="stores.counts.migration.id is set but stores.counts.migration.function is not"
    ):
        _settings(migration__id="v2")
    with pytest.raises(
        ConfigError,
        match="stores.counts.migration.function='tests.record_values:nope' is not "
        "valid: function tests.record_values:nope: module 'tests.record_values' has "
        "no 'nope'",
    ):
        _settings(migration__id="v2", migration__function="tests.record_values:nope")
    with pytest.raises(ConfigError, match="is a int, not a function"):
        _settings(migration__id="v2", migration__function="tests.record_values:NOT_A_FUNCTION")
    with pytest.raises(ConfigError, match="stores.counts.migration.id='no/slash' is not valid"):
        _settings(migration__id="no/slash", migration__function="tests.record_values:split_first")
