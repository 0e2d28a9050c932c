"""Serdes: round trips, integer order, errors."""

from __future__ import annotations

from pathlib import Path

import pytest
from hypothesis import given
from hypothesis import strategies as st

from statebackend.errors import ConfigError, CorruptDataError, SerdeError, StateBackendError
from statebackend.serdes import SERDE_NAMES, Serde, get_serde
from tests.backend_helpers import counts_config

INT64 = st.integers(min_value=-(2**63), max_value=2**63 - 1)
JSON = st.recursive(
    st.none() | st.booleans() | st.integers() | st.floats(allow_nan=False, allow_infinity=False) | st.text(),
    lambda children: st.lists(children) | st.dictionaries(st.text(), children),
    max_leaves=20,
)


@given(st.binary())
def test_bytes_round_trip(value: bytes) -> None:
    serde = get_serde("bytes")
    assert serde.from_bytes(serde.to_bytes(value)) == value


@given(st.text())
def test_string_round_trip(value: str) -> None:
    serde = get_serde("string")
    assert serde.from_bytes(serde.to_bytes(value)) == value


@given(INT64)
def test_integer_round_trip(value: int) -> None:
    serde = get_serde("integer")
    assert serde.from_bytes(serde.to_bytes(value)) == value


@given(INT64, INT64)
def test_integer_byte_order_equals_numeric_order(a: int, b: int) -> None:
    serde = get_serde("integer")
    assert (serde.to_bytes(a) < serde.to_bytes(b)) == (a < b)


@given(JSON)
def test_json_round_trip(value: object) -> None:
    serde = get_serde("json")
    assert serde.from_bytes(serde.to_bytes(value)) == value


@given(JSON)
def test_pickle_round_trip(value: object) -> None:
    serde = get_serde("pickle")
    assert serde.from_bytes(serde.to_bytes(value)) == value


def test_integer_serde_edges() -> None:
    serde = get_serde("integer")
    assert serde.to_bytes(-(2**63)) == b"\x00" * 8
    assert serde.to_bytes(0) == b"\x80" + b"\x00" * 7
    assert serde.to_bytes(2**63 - 1) == b"\xff" * 8
    with pytest.raises(StateBackendError, match="64-bit"):
        serde.to_bytes(2**63)
    with pytest.raises(TypeError):
        serde.to_bytes(True)
    with pytest.raises(TypeError):
        serde.to_bytes("1")
    with pytest.raises(CorruptDataError):
        serde.from_bytes(b"\x00" * 7)


def test_json_is_compact_with_sorted_keys() -> None:
    assert get_serde("json").to_bytes({"b": 1, "a": [1, 2]}) == b'{"a":[1,2],"b":1}'


def test_wrong_types_and_bad_bytes() -> None:
    with pytest.raises(TypeError):
        get_serde("bytes").to_bytes("text")
    with pytest.raises(TypeError):
        get_serde("string").to_bytes(b"bytes")
    with pytest.raises(CorruptDataError):
        get_serde("string").from_bytes(b"\xff\xfe")
    with pytest.raises(CorruptDataError):
        get_serde("json").from_bytes(b"{not json")
    with pytest.raises(CorruptDataError):
        get_serde("pickle").from_bytes(b"not a pickle")


def test_unknown_serde_name_lists_the_allowed_ones() -> None:
    with pytest.raises(ConfigError) as info:
        get_serde("avro")
    for name in ("bytes", "string", "integer", "json", "pickle"):
        assert name in str(info.value)


def test_every_named_serde_satisfies_the_protocol() -> None:
    assert SERDE_NAMES == ("bytes", "string", "integer", "json", "pickle")
    for name in SERDE_NAMES:
        serde = get_serde(name)
        assert isinstance(serde, Serde) and serde.name == name


def test_values_of_the_right_type_that_cannot_be_encoded_are_a_serde_error_naming_the_fix() -> None:
    with pytest.raises(SerdeError, match="lone surrogate at position 3") as info:
        get_serde("string").to_bytes("abc\udcff")
    assert isinstance(info.value, ValueError) and "errors='replace'" in str(info.value)
    with pytest.raises(SerdeError, match="json serde"):
        get_serde("json").to_bytes(float("nan"))
    with pytest.raises(SerdeError, match="pickle serde"):
        get_serde("pickle").to_bytes(lambda: None)


def test_a_lone_surrogate_key_is_refused_and_nothing_is_written(tmp_path: Path) -> None:
    from statebackend.task import TaskStorage

    config = counts_config(tmp_path)
    with TaskStorage.open(config, "task-0") as task:
        counts = task.store("counts")
        with pytest.raises(SerdeError):
            counts.put("k\ud800", 1)
        counts.put("ok", 2)
        task.commit_durably({"input": "1"})
        assert dict(counts.items()) == {"ok": 2}
