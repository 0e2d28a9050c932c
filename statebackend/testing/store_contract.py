"""Contract suite for the local store: what every ``LocalStore``-like implementation must do.

Subclass ``LocalStoreContract`` in a test module (a class named ``Test...``) and, for another implementation,
override ``open_store``. The tests use only the public API plus ``read_view`` (the flushed data), so the batch and the
flushed state are checked separately.
"""

from __future__ import annotations

import tempfile
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from statebackend.errors import ConfigError, StateBackendError
from statebackend.serdes import get_serde
from statebackend.store import LocalStore, LocalVersion


def v(n: int) -> LocalVersion:
    return LocalVersion(checkpoint_id=f"{n}-0", token=f"{n:016x}")


class LocalStoreContract:
    """Behaviour every local store implementation must show."""

    def open_store(self, path: Path, **kwargs: Any) -> LocalStore:
        return LocalStore.open(path, name="s", **kwargs)

    @pytest.fixture
    def store(self, tmp_path: Path) -> Iterator[LocalStore]:
        with self.open_store(tmp_path / "store") as store:
            yield store

    # -- CRUD and the batch -------------------------------------------------------------------------------------

    def test_get_of_absent_key_is_none(self, store: LocalStore) -> None:
        assert store.get(b"nope") is None
        assert not store.contains(b"nope")

    def test_put_get_delete_before_and_after_flush(self, store: LocalStore) -> None:
        store.put(b"a", b"1")
        assert store.get(b"a") == b"1" and store.contains(b"a")
        store.flush(v(1)).close()
        assert store.get(b"a") == b"1"
        store.put(b"a", b"2")
        assert store.get(b"a") == b"2"
        store.delete(b"a")
        assert store.get(b"a") is None and not store.contains(b"a")
        store.flush(v(2)).close()
        assert store.get(b"a") is None

    def test_batch_is_visible_to_reads_but_not_to_read_view_until_flush(self, store: LocalStore) -> None:
        store.put(b"k", b"v")
        with store.read_view() as view:
            assert view.get(b"k") is None and view.count == 0
        store.flush(v(1)).close()
        with store.read_view() as view:
            assert view.get(b"k") == b"v" and view.count == 1 and view.version == v(1)

    def test_flushed_data_and_version_survive_reopen(self, tmp_path: Path) -> None:
        with self.open_store(tmp_path / "s") as store:
            store.put_all([(b"x", b"1"), (b"y", b"2")])
            store.flush(v(7)).close()
            store.put(b"z", b"unflushed")
        with self.open_store(tmp_path / "s") as store:
            assert list(store.items()) == [(b"x", b"1"), (b"y", b"2")]
            assert store.version == v(7)

    def test_put_all_and_delete_all(self, store: LocalStore) -> None:
        store.put_all((bytes([i]), b"v") for i in range(1, 11))
        store.delete_all(bytes([i]) for i in range(1, 6))
        assert [k for k, _ in store.items()] == [bytes([i]) for i in range(6, 11)]

    def test_wrong_types_raise_type_error_and_write_nothing(self, store: LocalStore) -> None:
        # the wrong types on purpose (what an untyped caller passes): the type checker's complaint is the point
        with pytest.raises(TypeError):
            store.put("a", b"1")  # type: ignore[arg-type]
        with pytest.raises(TypeError):
            store.put(b"a", "1")  # type: ignore[arg-type]
        with pytest.raises(TypeError):
            store.delete(1)  # type: ignore[arg-type]
        assert store.batch_bytes == 0 and store.count() == 0

    def test_too_long_or_empty_key_raises_naming_the_limit(self, store: LocalStore) -> None:
        with pytest.raises(StateBackendError, match="511"):
            store.put(b"k" * 512, b"v")
        with pytest.raises(StateBackendError, match="511"):
            store.put(b"", b"v")
        store.put(b"k" * 511, b"v")
        store.flush(v(1)).close()
        assert store.get(b"k" * 511) == b"v"

    # -- iteration ----------------------------------------------------------------------------------------------

    def test_items_merge_batch_and_flushed_in_key_order_with_deletes(self, store: LocalStore) -> None:
        store.put_all([(b"b", b"old"), (b"d", b"old"), (b"f", b"old")])
        store.flush(v(1)).close()
        store.put(b"a", b"new")
        store.put(b"d", b"new")
        store.delete(b"f")
        store.put(b"g", b"new")
        store.delete(b"zz")  # absent key: a no-op for reads
        assert list(store.items()) == [(b"a", b"new"), (b"b", b"old"), (b"d", b"new"), (b"g", b"new")]

    def test_iteration_is_a_snapshot_unaffected_by_later_writes(self, store: LocalStore) -> None:
        store.put_all([(b"a", b"1"), (b"b", b"1")])
        store.flush(v(1)).close()
        store.put(b"c", b"1")
        it = store.items()
        store.put(b"d", b"1")
        store.delete(b"a")
        assert [k for k, _ in it] == [b"a", b"b", b"c"]

    def test_iter_prefix_returns_only_prefixed_keys(self, store: LocalStore) -> None:
        keys = [b"a", b"ab", b"ab\x00", b"ab\xff", b"ab\xff\xff", b"ac", b"b", b"\xff", b"\xff\x01"]
        store.put_all((k, k) for k in keys[:5])
        store.flush(v(1)).close()
        store.put_all((k, k) for k in keys[5:])
        assert [k for k, _ in store.iter_prefix(b"ab")] == [b"ab", b"ab\x00", b"ab\xff", b"ab\xff\xff"]
        assert [k for k, _ in store.iter_prefix(b"ab\xff")] == [b"ab\xff", b"ab\xff\xff"]
        assert [k for k, _ in store.iter_prefix(b"\xff")] == [b"\xff", b"\xff\x01"]
        assert [k for k, _ in store.iter_prefix(b"")] == sorted(keys)

    def test_iter_range_is_half_open(self, store: LocalStore) -> None:
        store.put_all((bytes([i]), b"x") for i in range(1, 10, 2))
        store.flush(v(1)).close()
        store.put_all((bytes([i]), b"x") for i in range(2, 10, 2))
        store.delete(bytes([4]))
        assert [k[0] for k, _ in store.iter_range(bytes([3]), bytes([7]))] == [3, 5, 6]
        assert [k[0] for k, _ in store.iter_range(None, bytes([3]))] == [1, 2]
        assert [k[0] for k, _ in store.iter_range(bytes([8]), None)] == [8, 9]
        assert list(store.iter_range(bytes([7]), bytes([7]))) == []

    # -- count --------------------------------------------------------------------------------------------------

    def test_count_with_and_without_a_write_batch(self, store: LocalStore) -> None:
        assert store.count() == 0
        store.put_all([(b"a", b"1"), (b"b", b"1"), (b"c", b"1")])
        assert store.count() == 3
        store.flush(v(1)).close()
        assert store.count() == 3
        store.put(b"a", b"2")  # overwrite: no change
        store.put(b"d", b"1")  # new: +1
        store.delete(b"b")  # present: -1
        store.delete(b"zz")  # absent: no change
        store.put(b"e", b"1")
        store.delete(b"e")  # put then delete of a new key: no change
        assert store.count() == 3
        store.flush(v(2)).close()
        assert store.count() == 3

    # -- flush and change sets ----------------------------------------------------------------------------------

    def test_flush_returns_sorted_deduped_change_set(self, store: LocalStore) -> None:
        store.put(b"a", b"0")
        store.flush(v(1)).close()
        store.put(b"c", b"1")
        store.put(b"b", b"1")
        store.put(b"c", b"22")
        store.delete(b"a")
        store.put(b"d", b"1")
        store.delete(b"d")
        changes = store.flush(v(2))
        expected = [(b"a", None), (b"b", b"1"), (b"c", b"22"), (b"d", None)]
        assert list(changes) == expected
        assert list(changes) == expected  # iterable again
        assert len(changes) == 4
        assert changes.raw_bytes == 1 + 2 + 3 + 1
        assert changes.version == v(2)
        changes.close()
        changes.close()  # idempotent
        with pytest.raises(StateBackendError):
            list(changes)

    def test_flush_of_nothing_gives_empty_change_set_and_sets_version(self, store: LocalStore) -> None:
        changes = store.flush(v(3))
        assert list(changes) == [] and len(changes) == 0 and changes.raw_bytes == 0
        assert store.version == v(3)

    def test_version_is_none_when_fresh_set_by_flush_cleared_by_mark_dirty(self, store: LocalStore) -> None:
        assert store.version is None
        store.put(b"a", b"1")
        store.flush(v(1)).close()
        assert store.version == v(1)
        store.put(b"b", b"1")
        assert store.version == v(1)  # the flushed data is still v1
        store.mark_dirty()
        assert store.version is None

    @settings(max_examples=40, deadline=None)
    @given(
        steps=st.lists(
            st.one_of(
                st.tuples(st.just("put"), st.sampled_from([b"a", b"b", b"c", b"dd", b"e" * 9]), st.binary(max_size=12)),
                st.tuples(st.just("del"), st.sampled_from([b"a", b"b", b"c", b"dd", b"e" * 9]), st.none()),
                st.tuples(st.just("flush"), st.none(), st.none()),
            ),
            max_size=60,
        ),
        max_batch_bytes=st.sampled_from([1, 8, 24, 1 << 20]),
    )
    def test_change_sets_and_contents_equal_a_dict_model_whatever_the_spills(
        self, steps: list[tuple[str, bytes | None, bytes | None]], max_batch_bytes: int
    ) -> None:
        with (
            tempfile.TemporaryDirectory() as tmp,
            self.open_store(Path(tmp) / "s", max_batch_bytes=max_batch_bytes) as store,
        ):
            model: dict[bytes, bytes] = {}
            changed: dict[bytes, bytes | None] = {}
            n = 0
            for op, key, value in steps + [("flush", None, None)]:
                if op == "put":
                    assert key is not None and value is not None
                    store.put(key, value)
                    model[key] = value
                    changed[key] = value
                elif op == "del":
                    assert key is not None
                    store.delete(key)
                    model.pop(key, None)
                    changed[key] = None
                else:
                    n += 1
                    with store.flush(v(n)) as changes:
                        assert list(changes) == sorted(changed.items())
                        assert changes.raw_bytes == sum(len(k) + len(v or b"") for k, v in changed.items())
                    changed = {}
                    assert store.version == v(n)
                assert list(store.items()) == sorted(model.items())
                assert store.count() == len(model)

    # -- read views ---------------------------------------------------------------------------------------------

    def test_read_view_is_a_snapshot_of_flushed_data(self, store: LocalStore) -> None:
        store.put_all([(b"a", b"1"), (b"b", b"1")])
        store.flush(v(1)).close()
        with store.read_view() as view:
            store.put(b"a", b"2")
            store.delete(b"b")
            store.put(b"c", b"2")
            store.flush(v(2)).close()
            assert list(view.items()) == [(b"a", b"1"), (b"b", b"1")]
            assert view.version == v(1) and view.count == 2
        assert list(store.items()) == [(b"a", b"2"), (b"c", b"2")]

    # -- bulk loads -----------------------------------------------------------------------------------------------

    def test_replace_contents_drops_old_data_and_sets_version(self, store: LocalStore) -> None:
        store.put_all([(b"old", b"1"), (b"b", b"old")])
        store.flush(v(1)).close()
        store.put(b"unflushed", b"x")
        loaded = store.replace_contents(iter([(b"a", b"1"), (b"b", b"2"), (b"c", b"3")]), v(9))
        assert loaded == 3
        assert list(store.items()) == [(b"a", b"1"), (b"b", b"2"), (b"c", b"3")]
        assert store.version == v(9) and store.count() == 3 and store.batch_bytes == 0

    def test_replace_contents_failing_midway_keeps_old_contents(self, store: LocalStore) -> None:
        store.put_all([(b"x", b"1"), (b"y", b"2")])
        store.flush(v(1)).close()

        def items() -> Iterator[tuple[bytes, bytes]]:
            yield b"a", b"1"
            yield b"b", b"2"
            raise OSError("download failed")

        with pytest.raises(OSError, match="download failed"):
            store.replace_contents(items(), v(2))
        assert list(store.items()) == [(b"x", b"1"), (b"y", b"2")]
        assert store.version == v(1)

    def test_replace_contents_rejects_unsorted_or_duplicate_keys(self, store: LocalStore) -> None:
        store.put(b"x", b"1")
        store.flush(v(1)).close()
        with pytest.raises(StateBackendError, match="ascending"):
            store.replace_contents([(b"b", b"1"), (b"a", b"1")], v(2))
        with pytest.raises(StateBackendError, match="ascending"):
            store.replace_contents([(b"a", b"1"), (b"a", b"2")], v(2))
        assert list(store.items()) == [(b"x", b"1")] and store.version == v(1)

    def test_replace_contents_with_no_version_leaves_store_dirty(self, store: LocalStore) -> None:
        store.flush(v(1)).close()
        assert store.replace_contents([(b"a", b"1")], None) == 1
        assert store.version is None

    def test_apply_changes_puts_deletes_and_sets_version(self, store: LocalStore) -> None:
        store.put_all([(b"a", b"1"), (b"b", b"1"), (b"c", b"1")])
        store.flush(v(1)).close()
        applied = store.apply_changes([(b"a", None), (b"b", b"2"), (b"bb", b"3"), (b"zz", None)], v(2))
        assert applied == 4
        assert list(store.items()) == [(b"b", b"2"), (b"bb", b"3"), (b"c", b"1")]
        assert store.version == v(2)

    def test_apply_changes_rejects_unsorted_records_and_keeps_contents(self, store: LocalStore) -> None:
        store.put(b"a", b"1")
        store.flush(v(1)).close()
        with pytest.raises(StateBackendError, match="ascending"):
            store.apply_changes([(b"c", b"1"), (b"b", None)], v(2))
        assert list(store.items()) == [(b"a", b"1")] and store.version == v(1)

    def test_apply_changes_refuses_unflushed_writes(self, store: LocalStore) -> None:
        store.put(b"a", b"1")
        with pytest.raises(StateBackendError, match="unflushed"):
            store.apply_changes([(b"b", b"1")], v(1))

    # -- whole environments -----------------------------------------------------------------------------------

    def test_copy_and_replace_environment_round_trip(self, tmp_path: Path) -> None:
        with self.open_store(tmp_path / "src") as src:
            src.put_all((b"k%03d" % i, b"v%d" % i) for i in range(100))
            src.flush(v(5)).close()
            src.put(b"unflushed", b"x")
            copy_version = src.copy_environment(tmp_path / "copy")
        assert copy_version == v(5)
        with self.open_store(tmp_path / "dst") as dst:
            dst.put(b"other", b"1")
            dst.flush(v(1)).close()
            dst.put(b"unflushed", b"1")
            dst.replace_environment(tmp_path / "copy")
            assert dst.version == v(5)
            assert list(dst.items()) == [(b"k%03d" % i, b"v%d" % i) for i in range(100)]
            dst.put(b"after", b"1")
            dst.flush(v(6)).close()
        with self.open_store(tmp_path / "dst") as dst:
            assert dst.count() == 101 and dst.version == v(6)

    def test_replace_environment_with_a_non_environment_keeps_old_data(self, store: LocalStore, tmp_path: Path) -> None:
        store.put(b"a", b"1")
        store.flush(v(1)).close()
        (tmp_path / "junk").mkdir()
        with pytest.raises(StateBackendError):
            store.replace_environment(tmp_path / "junk")
        assert list(store.items()) == [(b"a", b"1")] and store.version == v(1)

    # -- typed view -------------------------------------------------------------------------------------------

    def test_typed_store_round_trips_and_orders_integer_keys(self, store: LocalStore) -> None:
        typed = store.typed(get_serde("integer"), get_serde("json"))
        for k in (5, -3, 0, 2**40, -(2**40)):
            typed.put(k, {"k": k})
        typed.delete(0)
        assert typed.get(5) == {"k": 5} and typed.get(0) is None and typed.contains(-3)
        assert [k for k, _ in typed.items()] == [-(2**40), -3, 5, 2**40]
        assert [k for k, _ in typed.iter_range(-3, 2**40)] == [-3, 5]
        assert typed.count() == 4
        with pytest.raises(ConfigError, match="iter_range"):
            typed.iter_prefix(1)

    def test_typed_store_prefix_iteration_with_string_keys(self, store: LocalStore) -> None:
        typed = store.typed(get_serde("string"), get_serde("string"))
        typed.put_all([("user:1", "a"), ("user:2", "b"), ("users", "c"), ("x", "d")])
        assert list(typed.iter_prefix("user:")) == [("user:1", "a"), ("user:2", "b")]
