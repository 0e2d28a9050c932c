"""A key or value its serde cannot encode raises SerdeError at the call that gave it (the first offending row),
naming the store, the serde, the key and the type and saying how to fix it; nothing of the store is lost."""

from __future__ import annotations

import decimal
import pickle
import threading
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from statebackend.errors import ClosedError, CorruptDataError, InvalidKeyError, SerdeError, StateBackendError
from statebackend.serdes import get_serde
from statebackend.store import LocalStore
from statebackend.store.typed import TypedStore
from statebackend.task import TaskStorage
from tests import record_values as rv
from tests.backend_helpers import counts_config

V1 = "record:tests.record_values:CountV1"

#: per serde: (a value it takes, values it cannot encode, with the type name the message gives)
CASES: dict[str, tuple[Any, list[tuple[Any, str]]]] = {
    "bytes": (b"ok", [("text", "a str"), (bytearray(b"x"), "a bytearray"), (None, "None")]),
    "string": ("ok", [(b"raw", "a bytes"), ("bad\udcff", "a str"), (7, "an int")]),
    "integer": (7, [("ada", "a str"), (True, "a bool"), (2**63, "an int"), (1.5, "a float")]),
    "json": (
        {"n": 1},
        [
            (decimal.Decimal("1.5"), "a decimal.Decimal"),
            ({"p": [1, {2, 3}]}, "a dict"),
            (float("nan"), "a float"),
            ({(1, 2): 3}, "a dict"),
        ],
    ),
    "pickle": ((1, "x"), [(lambda: None, "a function"), (threading.Lock(), "a _thread.lock")]),
    V1: (
        rv.CountV1(1, "x"),
        [
            (rv.CountV1(True, "x"), "a tests.record_values.CountV1"),  # type: ignore[arg-type]
            (rv.CountV1(2**63, "x"), "a tests.record_values.CountV1"),
            (rv.CountV1(1, "\ud800"), "a tests.record_values.CountV1"),
            ({"count": 1, "first": "x"}, "a dict"),
        ],
    ),
}
KEY_SERDES = ["bytes", "string", "integer", "json", "pickle"]
GOOD_KEY = {"bytes": b"good", "string": "good", "integer": 1, "json": ["good"], "pickle": ("good",)}


@pytest.fixture
def local(tmp_path: Path) -> Iterator[LocalStore]:
    with LocalStore.open(tmp_path / "s", name="counts", map_size=16 << 20) as store:
        yield store


def assert_names_it(error: SerdeError, *, serde: str, key: Any, type_text: str, role: str) -> None:
    message = str(error)
    assert message.startswith("store 'counts': "), message
    assert f"the {serde} serde cannot encode" in message
    assert repr(key)[:60] in message
    assert f"({type_text})" in message
    assert (error.store, error.serde, error.key, error.role) == ("counts", serde, repr(key)[:80], role)
    assert error.reason and error.reason in message and len(error.reason) > 20  # the serde's reason and its fix
    assert error.value_type is not None
    assert error.value_type.rsplit(".", 1)[-1] in type_text or (error.value_type, type_text) == ("NoneType", "None")
    assert error.__cause__ is not None  # the serde's own error, chained
    for base in (StateBackendError, ValueError, TypeError):
        assert isinstance(error, base)


@pytest.mark.parametrize("serde", list(CASES))
def test_a_value_its_serde_cannot_encode_raises_at_the_put_naming_store_serde_key_and_type(
    local: LocalStore, serde: str
) -> None:
    good, bad_values = CASES[serde]
    typed = local.typed(get_serde("string"), get_serde(serde))
    typed.put("before", good)
    batch = local.batch_bytes
    for bad, type_text in bad_values:
        with pytest.raises(SerdeError) as raised:
            typed.put("ada", bad)
        assert_names_it(raised.value, serde=serde, key="ada", type_text=type_text, role="value")
        with pytest.raises(StateBackendError):  # what callers catching the root get
            typed.put("ada", bad)
    assert local.batch_bytes == batch and typed.get("ada") is None and typed.get("before") == good


@pytest.mark.parametrize("serde", KEY_SERDES)
def test_a_key_its_serde_cannot_encode_raises_naming_it(local: LocalStore, serde: str) -> None:
    typed = local.typed(get_serde(serde), get_serde("integer"))
    typed.put(GOOD_KEY[serde], 1)
    batch = local.batch_bytes
    for bad, type_text in CASES[serde][1]:
        for call in (lambda k: typed.put(k, 2), typed.get, typed.contains, typed.delete):
            with pytest.raises(SerdeError) as raised:
                call(bad)
            assert_names_it(raised.value, serde=serde, key=bad, type_text=type_text, role="key")
    assert local.batch_bytes == batch and list(typed.items()) == [(GOOD_KEY[serde], 1)]


def test_the_json_decimal_message_says_how_to_fix_it(local: LocalStore) -> None:
    typed = local.typed(get_serde("string"), get_serde("json"))
    with pytest.raises(SerdeError) as raised:
        typed.put("ada", {"price": decimal.Decimal("9.99")})
    message = str(raised.value)
    assert message.startswith("store 'counts': the json serde cannot encode the value of key 'ada' (a dict): ")
    assert "['price'] is a decimal.Decimal" in message
    assert "str" in message and "float" in message and "pickle or record serde" in message
    assert isinstance(raised.value.__cause__, SerdeError)
    assert "not JSON serializable" in str(raised.value.__cause__.__cause__)  # json's own TypeError, at the bottom


def test_a_key_of_the_wrong_type_for_the_integer_serde(local: LocalStore) -> None:
    typed = local.typed(get_serde("integer"), get_serde("json"))
    with pytest.raises(SerdeError) as raised:
        typed.put("ada", 1)
    assert str(raised.value).startswith("store 'counts': the integer serde cannot encode the key 'ada' (a str): ")
    assert "int(...)" in str(raised.value)


def test_a_long_key_is_cut_in_the_message(local: LocalStore) -> None:
    typed = local.typed(get_serde("string"), get_serde("json"))
    key = "k" * 500
    with pytest.raises(SerdeError) as raised:
        typed.put(key, {1, 2})
    error = raised.value
    assert error.key is not None and len(error.key) <= 80 and error.key.endswith("...")
    assert error.key in str(error) and key not in str(error)


def test_vectorized_calls_name_the_first_bad_item_and_write_nothing(local: LocalStore) -> None:
    typed = local.typed(get_serde("string"), get_serde("json"))
    typed.put("kept", 0)
    batch = local.batch_bytes
    with pytest.raises(SerdeError) as raised:
        typed.put_many(["a", "b", "c", "d"], [1, 2, decimal.Decimal(3), {4}])
    assert "the value of key 'c' (a decimal.Decimal)" in str(raised.value) and raised.value.key == "'c'"
    with pytest.raises(SerdeError) as raised:
        typed.put_many(["a", 2, "c"], [1, 2, 3])
    assert "the key 2 (an int)" in str(raised.value) and raised.value.role == "key"
    with pytest.raises(SerdeError) as raised:
        typed.update_many(["kept", "x", "y"], lambda olds: [None, 1, decimal.Decimal(2)])
    assert "the value of key 'y' (a decimal.Decimal)" in str(raised.value)
    with pytest.raises(SerdeError, match=r"the key b'z' \(a bytes\)"):
        typed.get_many(["a", b"z"])
    with pytest.raises(SerdeError, match=r"the key 3 \(an int\)"):
        typed.delete_many(["a", 3])
    with pytest.raises(SerdeError, match=r"the range start 1 \(an int\)"):
        typed.iter_range(1, None)
    with pytest.raises(SerdeError, match=r"the prefix 1 \(an int\)"):
        typed.iter_prefix(1)
    assert local.batch_bytes == batch and dict(typed.items()) == {"kept": 0}


def test_put_all_and_delete_all_raise_at_the_bad_item_after_the_items_before_it(local: LocalStore) -> None:
    typed = local.typed(get_serde("string"), get_serde("integer"))
    typed.put("kept", 0)
    with pytest.raises(SerdeError) as raised:
        typed.put_all([("a", 1), ("b", "two"), ("c", 3)])
    assert "store 'counts': the integer serde cannot encode the value of key 'b' (a str)" in str(raised.value)
    with pytest.raises(SerdeError, match=r"the string serde cannot encode the key 5 \(an int\)"):
        typed.delete_all(["a", 5])
    assert dict(typed.items()) == {"kept": 0}  # put_all is not atomic (documented): 'a' went in, delete_all took it


def test_bad_input_loses_nothing_the_store_held_or_was_about_to_commit(tmp_path: Path) -> None:
    config = counts_config(tmp_path, "json")
    with TaskStorage.open(config, "task-0") as task:
        counts = task.store("counts")
        assert isinstance(counts, TypedStore)
        counts.put("committed", 1)
        task.commit_durably({"input": "1"})
        counts.put("pending", 2)
        with pytest.raises(SerdeError) as raised:
            counts.put("ada", decimal.Decimal("1.5"))
        assert str(raised.value).startswith(
            "store 'counts': the json serde cannot encode the value of key 'ada' (a decimal.Decimal): "
        )
        counts.put("after", 3)
        task.commit_durably({"input": "2"})
        assert dict(counts.items()) == {"committed": 1, "pending": 2, "after": 3}
    with TaskStorage.open(config, "task-0") as task:  # what was committed is what a restore brings back
        assert dict(task.store("counts").items()) == {"committed": 1, "pending": 2, "after": 3}


def test_the_stores_own_errors_are_not_taken_for_serde_errors(local: LocalStore) -> None:
    typed = local.typed(get_serde("string"), get_serde("integer"))
    with pytest.raises(InvalidKeyError) as raised:
        typed.put("", 1)  # the string serde encodes it; the store refuses an empty key
    assert not isinstance(raised.value, SerdeError)
    local.close()
    with pytest.raises(ClosedError):
        typed.put("a", 1)
    with pytest.raises(ClosedError):
        typed.get("a")


def test_stored_bytes_the_serde_cannot_decode_name_the_store_serde_and_key(local: LocalStore) -> None:
    local.put(b"ada", b"not eight bytes")
    typed = local.typed(get_serde("string"), get_serde("integer"))
    for call in (lambda: typed.get("ada"), lambda: typed.get_many(["x", "ada"]), lambda: dict(typed.items())):
        with pytest.raises(CorruptDataError) as raised:
            call()
        message = str(raised.value)
        assert message.startswith("store 'counts': the integer serde cannot decode the stored value of key 'ada': ")
        assert "expected 8 bytes, got 15" in message and isinstance(raised.value.__cause__, CorruptDataError)
    local.delete(b"ada")
    local.put(b"\xff", b"\x80" + b"\x00" * 7)  # a key the string serde cannot decode
    with pytest.raises(CorruptDataError, match=r"the string serde cannot decode the stored key b'\\xff'"):
        dict(typed.items())


class _Strict:
    """A serde of another library's making: raises its own exceptions."""

    name = "strict"

    def to_bytes(self, obj: Any) -> bytes:
        return int(obj).to_bytes(8, "big", signed=True)

    def from_bytes(self, data: bytes) -> int:
        return int.from_bytes(data, "big", signed=True)


def test_a_third_party_serdes_error_is_wrapped_naming_it(local: LocalStore) -> None:
    typed = TypedStore(local, get_serde("string"), _Strict())
    with pytest.raises(SerdeError) as raised:
        typed.put("ada", "x")
    assert str(raised.value) == (
        "store 'counts': the strict serde cannot encode the value of key 'ada' (a str): "
        "ValueError: invalid literal for int() with base 10: 'x'"
    )
    assert isinstance(raised.value.__cause__, ValueError) and not isinstance(raised.value.__cause__, SerdeError)


def test_a_serde_called_alone_names_itself_and_the_type() -> None:
    with pytest.raises(SerdeError) as raised:
        get_serde("json").to_bytes(decimal.Decimal(1))
    error = raised.value
    assert str(error).startswith("the json serde cannot encode a decimal.Decimal: ")
    assert (error.store, error.key, error.serde, error.value_type) == (None, None, "json", "decimal.Decimal")
    with pytest.raises(SerdeError, match="the integer serde cannot encode a str"):
        get_serde("integer").to_bytes("1")


def test_a_serde_error_keeps_its_fields_through_pickle(local: LocalStore) -> None:
    typed = local.typed(get_serde("string"), get_serde("json"))
    with pytest.raises(SerdeError) as raised:
        typed.put("ada", decimal.Decimal(1))
    copy = pickle.loads(pickle.dumps(raised.value))
    assert str(copy) == str(raised.value)
    assert (copy.store, copy.serde, copy.key, copy.value_type, copy.role) == (
        "counts",
        "json",
        "'ada'",
        "decimal.Decimal",
        "value",
    )
