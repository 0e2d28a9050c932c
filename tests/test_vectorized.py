"""The vectorized state API (get_many / put_many / delete_many / update_many and the serdes' whole-array calls) gives
exactly what the per-key API gives: a Hypothesis state machine drives two real LMDB stores side by side (one written
key by key, one by the vectorized calls) and a dict model, through write batches that spill, flushes whose batches
are still pending in the background applier (the overlay), and reads of keys written in this batch but not yet in
LMDB; commit and restore after vectorized writes give back exactly the model."""

from __future__ import annotations

import shutil
import tempfile
from pathlib import Path
from typing import Any

import pyarrow as pa
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, rule

from statebackend.errors import SerdeError, StateBackendError
from statebackend.serdes import SERDE_NAMES, decode_many, encode_many, get_serde
from statebackend.store import LocalStore, LocalVersion
from statebackend.task import TaskStorage

KEYS = st.sampled_from([f"k{i:02d}".encode() for i in range(16)])
VALUES = st.binary(min_size=0, max_size=40)


class VectorizedEqualsPerKey(RuleBasedStateMachine):
    """Store ``one`` gets per-key calls, ``many`` the vectorized ones; both must always read like ``model``."""

    def __init__(self) -> None:
        super().__init__()
        self.root = Path(tempfile.mkdtemp(prefix="statebackend-vectorized-"))
        # a batch of a few records: puts spill often, so the per-key path and the vectorized path both cross it
        self.one = LocalStore.open(self.root / "one", name="one", max_batch_bytes=120, map_size=16 << 20)
        self.many = LocalStore.open(self.root / "many", name="many", max_batch_bytes=120, map_size=16 << 20)
        self.model: dict[bytes, bytes] = {}
        self.flushes = 0

    @rule(items=st.lists(st.tuples(KEYS, VALUES), max_size=12))
    def put_many(self, items: list[tuple[bytes, bytes]]) -> None:
        for key, value in items:
            self.one.put(key, value)
            self.model[key] = value
        self.many.put_many([k for k, _ in items], [v for _, v in items])

    @rule(keys=st.lists(KEYS, unique=True, max_size=8), value=st.binary(min_size=10, max_size=40))
    def put_many_distinct(self, keys: list[bytes], value: bytes) -> None:
        """Distinct keys (the vectorized fast path when none is in the batch), often enough bytes to spill."""
        self.put_many([(k, value + k) for k in keys])

    @rule(keys=st.lists(KEYS, max_size=8))
    def delete_many(self, keys: list[bytes]) -> None:
        for key in keys:
            self.one.delete(key)
            self.model.pop(key, None)
        self.many.delete_many(keys)

    @rule(keys=st.lists(KEYS, max_size=10), delete_every=st.integers(min_value=0, max_value=3))
    def update_many(self, keys: list[bytes], delete_every: int) -> None:
        """Read-modify-write: append a byte; every ``delete_every``-th key (by position) is deleted instead."""

        def new_values(olds: list[bytes | None]) -> list[bytes | None]:
            return [
                None if delete_every and i % delete_every == 0 else (old or b"") + b"+" for i, old in enumerate(olds)
            ]

        expected = new_values([self.model.get(k) for k in keys])
        for key, value in zip(keys, expected, strict=True):
            if value is None:
                self.one.delete(key)
                self.model.pop(key, None)
            else:
                self.one.put(key, value)
                self.model[key] = value
        self.many.typed(get_serde("bytes"), get_serde("bytes")).update_many(keys, new_values)

    @rule(wait_for_apply=st.booleans())
    def flush(self, wait_for_apply: bool) -> None:
        """A flush: its batch stays pending (read as an overlay) until the applier writes it, unless waited for."""
        self.flushes += 1
        version = LocalVersion(f"c{self.flushes}", "t")
        with self.one.flush(version) as a, self.many.flush(version) as b:
            assert list(a) == list(b)
        if wait_for_apply:
            self.one.apply_pending()
            self.many.apply_pending()

    @rule(keys=st.lists(KEYS, max_size=16))
    def get_many(self, keys: list[bytes]) -> None:
        expected = [self.model.get(k) for k in keys]
        assert self.many.get_many(keys) == expected
        assert [self.one.get(k) for k in keys] == expected

    @invariant()
    def same_contents(self) -> None:
        assert dict(self.many.items()) == self.model
        assert dict(self.one.items()) == self.model
        assert self.many.count() == len(self.model)
        # the same spills at the same points: the write batches hold the same bytes, the same runs were written
        assert (self.many.batch_bytes, self.many.spill_runs) == (self.one.batch_bytes, self.one.spill_runs)

    def teardown(self) -> None:
        self.one.close()
        self.many.close()
        shutil.rmtree(self.root, ignore_errors=True)


VectorizedEqualsPerKey.TestCase.settings = settings(
    max_examples=60, stateful_step_count=40, deadline=None, suppress_health_check=[HealthCheck.too_slow]
)
TestVectorizedEqualsPerKey = VectorizedEqualsPerKey.TestCase


def test_get_many_reads_a_key_written_in_this_batch_and_one_only_in_a_pending_flush(tmp_path: Path) -> None:
    with LocalStore.open(tmp_path / "s", name="s", map_size=16 << 20) as store:
        store.put_many([b"a", b"b"], [b"1", b"2"])
        store.flush(LocalVersion("c1", "t")).close()
        store.apply_pending()
        store.put_many([b"c"], [b"3"])  # in the write batch only
        store.flush(LocalVersion("c2", "t")).close()  # now pending (maybe), then applied
        store.delete_many([b"a"])  # a tombstone over LMDB
        store.put_many([b"d", b"b"], [b"4", b"22"])
        assert store.get_many([b"a", b"b", b"c", b"d", b"x", b"b"]) == [None, b"22", b"3", b"4", None, b"22"]


def test_a_bad_key_or_value_in_a_vectorized_call_writes_nothing(tmp_path: Path) -> None:
    with LocalStore.open(tmp_path / "s", name="s", map_size=16 << 20) as store:
        with pytest.raises(TypeError):
            store.put_many([b"a", "b"], [b"1", b"2"])  # type: ignore[list-item]
        with pytest.raises(StateBackendError, match="keys must be 1 to"):
            store.put_many([b"a", b""], [b"1", b"2"])
        with pytest.raises(TypeError):
            store.put_many([b"a", b"b"], [b"1", 2])  # type: ignore[list-item]
        with pytest.raises(ValueError):
            store.put_many([b"a", b"b"], [b"1"])
        with pytest.raises(StateBackendError):
            store.delete_many([b"a", b"x" * 600])
        assert store.get_many([b"a", b"b"]) == [None, None]
        assert store.batch_bytes == 0
        typed = store.typed(get_serde("string"), get_serde("integer"))
        with pytest.raises(TypeError):
            typed.put_many(["a", "b"], [1, True])
        with pytest.raises(SerdeError):
            typed.put_many(["a", "\ud800"], [1, 2])
        with pytest.raises(StateBackendError, match="64-bit"):
            typed.put_many(["a", "b"], [1, 2**63])
        assert typed.get_many(["a", "b"]) == [None, None]


def test_typed_vectorized_calls_take_arrow_arrays_and_equal_the_per_key_calls(tmp_path: Path) -> None:
    with LocalStore.open(tmp_path / "s", name="s", map_size=16 << 20) as store:
        typed = store.typed(get_serde("string"), get_serde("integer"))
        words = pa.array(["ada", "bob", "cy", "dé"])
        typed.put_many(words, pa.array([1, -2, 2**62, 0], pa.int64()))
        assert typed.get_many(pa.chunked_array([words, pa.array(["zz"])])) == [1, -2, 2**62, 0, None]
        assert [typed.get(w) for w in ["ada", "bob", "cy", "dé", "zz"]] == [1, -2, 2**62, 0, None]
        typed.update_many(words, lambda olds: [None if o == 0 else o + 1 for o in olds])
        assert dict(typed.items()) == {"ada": 2, "bob": -1, "cy": 2**62 + 1}
        typed.delete_many(["ada", "nobody"])
        assert dict(typed.items()) == {"bob": -1, "cy": 2**62 + 1}
        with pytest.raises(TypeError):
            typed.put_many(pa.array(["a", None]), [1, 2])  # a null key is refused like None
        with pytest.raises(ValueError, match="returned 1 values for 2 keys"):
            typed.update_many(["a", "b"], lambda olds: [1])


SERDE_VALUES = {
    "bytes": st.binary(max_size=20),
    "string": st.text(max_size=12),
    "integer": st.integers(min_value=-(2**63), max_value=2**63 - 1),
    "json": st.recursive(
        st.none() | st.booleans() | st.integers() | st.text(max_size=5),
        lambda inner: st.lists(inner, max_size=3) | st.dictionaries(st.text(max_size=3), inner, max_size=3),
        max_leaves=6,
    ),
    "pickle": st.tuples(st.integers(), st.text(max_size=5)),
}


@pytest.mark.parametrize("name", SERDE_NAMES)
@settings(max_examples=60, deadline=None)
@given(data=st.data())
def test_encode_and_decode_many_equal_the_per_item_calls(name: str, data: Any) -> None:
    serde = get_serde(name)
    objs = data.draw(st.lists(SERDE_VALUES[name], max_size=20))
    encoded = encode_many(serde, objs)
    assert encoded == [serde.to_bytes(o) for o in objs]
    assert decode_many(serde, encoded) == [serde.from_bytes(b) for b in encoded]
    if name in ("string", "bytes", "integer"):
        assert (
            encode_many(
                serde, pa.array(objs, {"string": pa.string(), "bytes": pa.binary(), "integer": pa.int64()}[name])
            )
            == encoded
        )


def test_decode_many_refuses_corrupt_bytes_like_the_per_item_call() -> None:
    from statebackend.errors import CorruptDataError

    with pytest.raises(CorruptDataError, match="expected 8 bytes"):
        decode_many(get_serde("integer"), [b"\x80" * 8, b"\x00" * 7])
    with pytest.raises(CorruptDataError, match="UTF-8"):
        decode_many(get_serde("string"), [b"ok", b"\xff"])


@settings(max_examples=15, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(
    batches=st.lists(
        st.lists(st.tuples(st.text(min_size=1, max_size=4), st.integers(-5, 5) | st.none()), max_size=30),
        min_size=1,
        max_size=4,
    )
)
def test_commit_and_restore_after_vectorized_writes_are_exact(tmp_path_factory: Any, batches: Any) -> None:
    """Each batch's updates go through put_many / delete_many (None deletes); after each durable commit a restore
    into an empty directory from the blob store alone gives exactly the model; the reopened task does too."""
    root = tmp_path_factory.mktemp("vec")
    config = {
        "job.name": "vec",
        "state.local.dir": str(root / "local"),
        "blob.store.url": f"file://{root / 'blobs'}",
        "blob.store.create.if.missing": True,
        "stores.s.backup.factories": "changelog",
        "stores.s.key.serde": "string",
        "stores.s.msg.serde": "integer",
        "stores.s.write.batch.max.bytes": 64,  # spills inside a batch
        "changelog.snapshot.interval.commits": 2,
    }
    model: dict[str, int] = {}
    for i, updates in enumerate(batches):
        with TaskStorage.open(config, "task-0") as task:
            store = task.store("s")
            assert dict(store.items()) == model
            puts = [(k, v) for k, v in updates if v is not None]
            dels = [k for k, v in updates if v is None]
            store.delete_many(dels)
            store.put_many([k for k, _ in puts], [v for _, v in puts])
            for key in dels:
                model.pop(key, None)
            model.update(puts)
            assert store.get_many(sorted(model)) == [model[k] for k in sorted(model)]
            task.commit_durably({"in": str(i)})
        elsewhere = dict(config, **{"state.local.dir": str(root / f"elsewhere-{i}")})
        with TaskStorage.open(elsewhere, "task-0") as restored:
            assert dict(restored.store("s").items()) == model
