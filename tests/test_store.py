"""LocalStore on LMDB: the contract suite plus what is specific to this implementation (spill runs, the lock file,
threads, the store dir layout)."""

from __future__ import annotations

import os
import subprocess
import sys
import threading
from collections.abc import Iterator
from pathlib import Path

import lmdb
import pytest

from statebackend.errors import LocalDirError, StateBackendError, StoreLockedError
from statebackend.store import LocalStore, LocalVersion
from statebackend.testing.store_contract import LocalStoreContract, v
from tests.backend_helpers import counts_config
from tests.waiting import drain_appliers, scaled, wait_until

REPO_ROOT = Path(__file__).resolve().parents[1]


class TestLocalStore(LocalStoreContract):
    pass


def spill_files(store: LocalStore) -> list[Path]:
    return sorted((store.path / "spill").iterdir())


def test_spill_keeps_batch_within_one_record_of_the_bound_and_marks_store_dirty(tmp_path: Path) -> None:
    bound = 100
    with LocalStore.open(tmp_path / "s", name="s", max_batch_bytes=bound) as store:
        store.put(b"a", b"1")
        store.flush(v(1)).close()
        assert store.version == v(1)
        largest_record = 0
        for i in range(500):
            key, value = b"key%04d" % (i % 300), b"x" * (i % 17)
            largest_record = max(largest_record, len(key) + len(value))
            store.put(key, value)
            assert store.batch_bytes <= bound  # a spill happens as soon as the bound is crossed
        assert store.spill_runs > 0 and len(spill_files(store)) == store.spill_runs
        assert store.version is None  # LMDB holds data ahead of any checkpoint
        with store.flush(v(2)) as changes:
            assert changes.spill_runs > 0
            assert len(changes) == 300
            assert [k for k, _ in changes] == sorted(b"key%04d" % i for i in range(300))
        assert store.version == v(2)
        assert store.count() == 301


def test_batch_exceeds_bound_by_at_most_one_record_before_it_spills(tmp_path: Path) -> None:
    """The check runs after every write, so the batch never grows past bound + one record."""
    bound = 50
    with LocalStore.open(tmp_path / "s", name="s", max_batch_bytes=bound) as store:
        seen_max = 0
        runs_before = 0
        for i in range(200):
            before = store.batch_bytes
            store.put(b"k%03d" % i, b"v" * 10)
            if store.spill_runs == runs_before:
                seen_max = max(seen_max, store.batch_bytes)
            else:
                runs_before = store.spill_runs
                assert before <= bound and before + 14 > bound
        assert seen_max <= bound
        assert runs_before >= 200 * 14 // (bound + 14)


def test_change_set_close_deletes_its_spill_runs_and_next_open_cleans_stale_ones(tmp_path: Path) -> None:
    with LocalStore.open(tmp_path / "s", name="s", max_batch_bytes=10) as store:
        store.put_all((b"k%d" % i, b"value") for i in range(20))
        changes = store.flush(v(1))
        assert len(spill_files(store)) == changes.spill_runs > 0
        changes.close()
        assert spill_files(store) == []
        store.put_all((b"k%d" % i, b"other") for i in range(20))
        assert spill_files(store)
    (tmp_path / "s" / "CHECKPOINT-V2").write_text("someone else's")
    with LocalStore.open(tmp_path / "s", name="s") as store:
        assert spill_files(store) == []
        assert store.version is None  # the spilled writes reached LMDB but no flush claimed them
    assert (tmp_path / "s" / "CHECKPOINT-V2").read_text() == "someone else's"


def test_change_sets_of_consecutive_flushes_are_independent(tmp_path: Path) -> None:
    """A change set still being uploaded keeps its runs while the next flush spills and flushes."""
    with LocalStore.open(tmp_path / "s", name="s", max_batch_bytes=10) as store:
        store.put_all((b"a%d" % i, b"1") for i in range(10))
        first = store.flush(v(1))
        store.put_all((b"b%d" % i, b"2") for i in range(10))
        second = store.flush(v(2))
        second.close()
        assert [k for k, _ in first] == sorted(b"a%d" % i for i in range(10))
        first.close()


def test_store_layout_on_disk(tmp_path: Path) -> None:
    with LocalStore.open(tmp_path / "s", name="s") as store:
        store.put(b"a", b"1")
        store.flush(v(1)).close()
        assert (tmp_path / "s" / "data" / "data.mdb").is_file()
        assert (tmp_path / "s" / "LOCK").read_text().strip() == str(os.getpid())
        assert (tmp_path / "s" / "spill").is_dir()
        assert store.path == tmp_path / "s" and store.name == "s"


def test_second_open_in_same_process_raises_store_locked(tmp_path: Path) -> None:
    with LocalStore.open(tmp_path / "s", name="counts"):
        with pytest.raises(StoreLockedError) as info:
            LocalStore.open(tmp_path / "s", name="counts")
        message = str(info.value)
        assert "counts" in message and str(tmp_path / "s") in message and str(os.getpid()) in message
        assert "\n" not in message
    with LocalStore.open(tmp_path / "s", name="counts") as store:  # released on close
        assert store.count() == 0


def test_open_from_another_process_gets_the_lock_error(tmp_path: Path) -> None:
    code = (
        "import sys\n"
        "from statebackend.store import LocalStore\n"
        "from statebackend.errors import StoreLockedError\n"
        "try:\n"
        "    LocalStore.open(sys.argv[1], name='counts')\n"
        "except StoreLockedError as exc:\n"
        "    print(exc)\n"
        "    sys.exit(3)\n"
    )
    with LocalStore.open(tmp_path / "s", name="counts"):
        result = subprocess.run(
            [sys.executable, "-c", code, str(tmp_path / "s")],
            cwd=REPO_ROOT,
            capture_output=True,
            text=True,
            timeout=60,
            env={**os.environ, "PYTHONPATH": str(REPO_ROOT)},
            check=False,  # the exit code is the outcome under test
        )
    assert result.returncode == 3, result.stderr
    assert f"locked by pid {os.getpid()}" in result.stdout and str(tmp_path / "s") in result.stdout


def test_read_view_in_another_thread_stays_consistent_while_task_writes_and_flushes(tmp_path: Path) -> None:
    keys = [b"k%03d" % i for i in range(200)]
    with LocalStore.open(tmp_path / "s", name="s", max_batch_bytes=512) as store:
        store.put_all((k, b"gen1") for k in keys)
        store.flush(v(1)).close()
        view = store.read_view()
        half_read = threading.Event()
        writes_done = threading.Event()
        result: dict[str, object] = {}

        def reader() -> None:
            try:
                it = view.items()
                first = [next(it) for _ in range(100)]
                half_read.set()
                assert writes_done.wait(30)
                rest = list(it)
                result["records"] = first + rest
                result["version"] = view.version
                result["count"] = view.count
            except BaseException as exc:  # noqa: BLE001 - surfaced by the assertion below
                result["error"] = exc
                half_read.set()
            finally:
                view.close()

        thread = threading.Thread(target=reader)
        thread.start()
        assert half_read.wait(30)
        for gen in range(2, 6):
            store.put_all((k, b"gen%d" % gen) for k in keys)  # spills too (tiny bound)
            store.delete_all(keys[::3])
            store.flush(v(gen)).close()
        writes_done.set()
        thread.join(30)
        assert "error" not in result, result.get("error")
        assert result["records"] == [(k, b"gen1") for k in keys]
        assert result["version"] == v(1) and result["count"] == 200
        assert store.version == v(5) and store.count() == 200 - len(keys[::3])


def test_replace_contents_discards_spill_runs(tmp_path: Path) -> None:
    with LocalStore.open(tmp_path / "s", name="s", max_batch_bytes=10) as store:
        store.put_all((b"k%d" % i, b"v") for i in range(20))
        assert store.spill_runs > 0
        store.replace_contents([(b"a", b"1")], v(3))
        assert store.spill_runs == 0 and spill_files(store) == []
        with store.flush(v(4)) as changes:
            assert list(changes) == []
        assert list(store.items()) == [(b"a", b"1")]


def test_open_repairs_an_environment_swap_interrupted_between_renames(tmp_path: Path) -> None:
    with LocalStore.open(tmp_path / "s", name="s") as store:
        store.put(b"a", b"1")
        store.flush(v(1)).close()
    os.rename(tmp_path / "s" / "data", tmp_path / "s" / "data.old")  # the crash left only the old data aside
    with LocalStore.open(tmp_path / "s", name="s") as store:
        assert list(store.items()) == [(b"a", b"1")] and store.version == v(1)


def test_copy_environment_excludes_unflushed_writes_and_is_a_valid_lmdb_env(tmp_path: Path) -> None:
    with LocalStore.open(tmp_path / "s", name="s") as store:
        store.put(b"a", b"1")
        store.flush(v(1)).close()
        store.put(b"b", b"2")
        assert store.copy_environment(tmp_path / "copy") == v(1)
    env = lmdb.open(str(tmp_path / "copy"), readonly=True, lock=False, max_dbs=2)
    try:
        with env.begin() as txn:
            data = env.open_db(b"data", txn=txn, create=False)
            assert list(txn.cursor(db=data)) == [(b"a", b"1")]
    finally:
        env.close()


def test_closed_store_raises_on_use(tmp_path: Path) -> None:
    store = LocalStore.open(tmp_path / "s", name="s")
    store.close()
    store.close()
    with pytest.raises(StateBackendError, match="closed"):
        store.put(b"a", b"1")
    with pytest.raises(StateBackendError, match="closed"):
        store.get(b"a")


def test_local_version_new_has_fresh_tokens() -> None:
    a, b = LocalVersion.new("1-2"), LocalVersion.new("1-2")
    assert a.checkpoint_id == "1-2" and a.token != b.token and len(a.token) == 16
    assert LocalVersion.from_bytes(a.to_bytes()) == a


def test_full_lmdb_map_raises_storage_error_naming_map_size_and_keeps_flushed_data(tmp_path: Path) -> None:
    from statebackend.errors import StorageError

    with LocalStore.open(tmp_path / "s", name="s", map_size=1 << 18) as store:
        store.put(b"a", b"1")
        store.flush(v(1)).close()
        store.put_all((b"k%04d" % i, b"x" * 1000) for i in range(1000))
        store.flush(v(2)).close()  # applied in the background: the failure surfaces at the next operation
        with pytest.raises(StorageError, match="map_size"):
            store.apply_pending()
        with pytest.raises(StorageError, match="map_size"):
            store.flush(v(3))
    with LocalStore.open(tmp_path / "s", name="s", map_size=1 << 30) as store:
        assert store.version == v(1)
        with store.read_view() as view:
            assert list(view.items()) == [(b"a", b"1")]


def test_store_open_under_another_boot_id_discards_unsynced_local_data(tmp_path: Path) -> None:
    """A killed process leaves consistent LMDB data that is kept; a machine crash (UNSYNCED left under another boot
    id) may have torn the unsynced file, so the data is dropped and restore rebuilds it."""
    from statebackend.store import UNSYNCED_FILE

    child = (
        "import os, signal, sys\n"
        "from statebackend.store import LocalStore, LocalVersion\n"
        "store = LocalStore.open(sys.argv[1], name='s')\n"
        "store.put(b'k', b'v')\n"
        "store.flush(LocalVersion('1-1', 'aa'))\n"
        "store.apply_pending()\n"
        "os.kill(os.getpid(), signal.SIGKILL)\n"
    )
    store_dir = tmp_path / "s"
    subprocess.run([sys.executable, "-c", child, str(store_dir)], cwd=Path(__file__).parent.parent, check=False)
    assert (store_dir / UNSYNCED_FILE).exists()
    with LocalStore.open(store_dir, name="s") as same_boot:
        assert same_boot.get(b"k") == b"v" and same_boot.version == LocalVersion("1-1", "aa")
    assert not (store_dir / UNSYNCED_FILE).exists()
    subprocess.run([sys.executable, "-c", child, str(store_dir)], cwd=Path(__file__).parent.parent, check=False)
    (store_dir / UNSYNCED_FILE).write_text("another-boot-id\n")
    with LocalStore.open(store_dir, name="s") as after_machine_crash:
        assert after_machine_crash.get(b"k") is None
        assert after_machine_crash.version is None and after_machine_crash.count() == 0


def test_flushed_batch_is_read_through_the_overlay_until_the_background_apply_lands(tmp_path: Path) -> None:
    with LocalStore.open(tmp_path / "s", name="s") as store:
        store.put(b"a", b"1")
        store.flush(v(1)).close()
        store.apply_pending()
        with store._applier.lock:  # the background applier cannot run while the test holds the lock
            store.put(b"b", b"2")
            store.delete(b"a")
            change = store.flush(v(2))
            assert store._applier.pending, "the flush must not have reached LMDB yet"
            assert store.get(b"b") == b"2" and store.get(b"a") is None
            assert list(store.items()) == [(b"b", b"2")]
            assert store.count() == 1
            future = change.read_view()
            assert not future.done()
            store.put(b"c", b"3")
        with future.result(timeout=30) as view:
            assert view.version == v(2)
            assert list(view.items()) == [(b"b", b"2")]
        change.close()
        assert store.version == v(2)
        assert list(store.items()) == [(b"b", b"2"), (b"c", b"3")]


def test_read_view_of_a_change_set_is_exactly_its_version_even_after_later_flushes(tmp_path: Path) -> None:
    with LocalStore.open(tmp_path / "s", name="s", max_batch_bytes=64) as store:
        store.put(b"k1", b"v1")
        first = store.flush(v(1))
        future = first.read_view()
        for i in range(50):  # later writes spill (tiny batch bound) and flush again
            store.put(b"x%03d" % i, b"y" * 10)
        store.flush(v(2)).close()
        with future.result(timeout=30) as view:
            assert view.version == v(1)
            assert list(view.items()) == [(b"k1", b"v1")]
        first.close()


def test_apply_changes_with_verified_order_equals_the_checked_path(tmp_path: Path) -> None:
    records = [(b"a", b"1"), (b"b", None), (b"c", b"3"), (b"d", None), (b"e", b"5")]
    results = []
    for verified in (False, True):
        with LocalStore.open(tmp_path / f"s{verified}", name="s") as store:
            store.replace_contents([(b"b", b"old"), (b"d", b"old"), (b"z", b"26")], v(1))
            assert store.apply_changes(iter(records), v(2), verified_order=verified) == len(records)
            results.append((list(store.items()), store.version))
    assert results[0] == results[1] == ([(b"a", b"1"), (b"c", b"3"), (b"e", b"5"), (b"z", b"26")], v(2))


def test_apply_change_sets_applies_them_in_order_in_one_transaction_or_none_of_them(tmp_path: Path) -> None:
    sets: list[list[tuple[bytes, bytes | None]]] = [
        [(b"a", b"1"), (b"b", None)],
        [(b"a", b"2"), (b"c", b"3")],
        [(b"c", None), (b"d", b"4")],
    ]
    with LocalStore.open(tmp_path / "s", name="s") as store:
        store.replace_contents([(b"b", b"old"), (b"z", b"26")], v(1))
        assert store.apply_change_sets((iter(records) for records in sets), v(4)) == 6
        assert (list(store.items()), store.version) == ([(b"a", b"2"), (b"d", b"4"), (b"z", b"26")], v(4))

        def failing() -> Iterator[list[tuple[bytes, bytes | None]]]:
            yield [(b"e", b"5")]
            raise StateBackendError("the third delta is damaged")

        with pytest.raises(StateBackendError, match="damaged"):
            store.apply_change_sets(failing(), v(6))
        assert (list(store.items()), store.version) == ([(b"a", b"2"), (b"d", b"4"), (b"z", b"26")], v(4))


def test_flush_and_read_view_requests_never_wait_for_an_apply_in_progress(tmp_path: Path) -> None:
    with LocalStore.open(tmp_path / "s", name="s") as store:
        holding, release = threading.Event(), threading.Event()

        def applier_busy() -> None:  # stands for a long apply: it holds the LMDB write side
            with store._applier.lock:
                holding.set()
                release.wait(30)

        busy = threading.Thread(target=applier_busy)
        busy.start()
        assert holding.wait(30)
        outcome: dict[str, object] = {}

        def task_thread() -> None:
            store.put(b"k", b"v")
            change = store.flush(v(1))
            outcome["future"] = change.read_view()
            outcome["change"] = change

        worker = threading.Thread(target=task_thread)
        worker.start()
        worker.join(scaled(10))  # done long before, unless it waits for the lock (until release)
        finished_while_busy = not worker.is_alive()
        release.set()
        busy.join(30)
        worker.join(30)
        assert finished_while_busy, "flush or ChangeSet.read_view() waited for the apply lock"
        future = outcome["future"]
        assert not future.cancel()  # type: ignore[attr-defined]  # the applier always resolves it
        with future.result(timeout=30) as view:  # type: ignore[attr-defined]
            assert view.version == v(1) and list(view.items()) == [(b"k", b"v")]
        outcome["change"].close()  # type: ignore[attr-defined]


def test_a_local_dir_that_cannot_be_created_is_a_clear_error(tmp_path: Path) -> None:
    blocker = tmp_path / "not-a-dir"
    blocker.write_text("a file where the state directory should be")
    with pytest.raises(LocalDirError, match="state.local.dir must be a directory this process can write") as info:
        LocalStore.open(blocker / "job" / "task-0" / "counts", name="counts")
    assert isinstance(info.value, OSError) and str(blocker) in str(info.value)


#: what users may do with a store; everything else public on ``LocalStore`` is for backends
USER_OPERATIONS = {
    "name",
    "get",
    "contains",
    "put",
    "delete",
    "put_all",
    "delete_all",
    "iter_prefix",
    "iter_range",
    "items",
    "count",
    "get_many",
    "put_many",
    "delete_many",
}


@pytest.mark.parametrize(
    ("serdes", "typed"),
    [
        (("bytes", "bytes"), False),
        (("string", "integer"), False),
        (("bytes", "bytes"), True),
        (("string", "integer"), True),
    ],
)
def test_task_store_gives_users_the_user_operations_only(tmp_path: Path, serdes: tuple[str, str], typed: bool) -> None:
    from statebackend.task import TaskStorage

    config = counts_config(tmp_path, serdes[1], key_serde=serdes[0])
    backend_only = {name for name in dir(LocalStore) if not name.startswith("_")} - USER_OPERATIONS
    assert {"flush", "replace_environment", "replace_contents", "apply_changes", "mark_dirty"} <= backend_only
    with TaskStorage.open(config, "task-0") as task:
        view = task.store("counts", typed=typed)
        assert not isinstance(view, LocalStore)
        public = {name for name in dir(view) if not name.startswith("_")}
        assert public & backend_only == set()
        assert public >= USER_OPERATIONS
        assert task.stores["counts"].flush is not None  # backends (and tests) keep the LocalStore
        if not typed or serdes == ("bytes", "bytes"):
            view.put(b"k", b"v")
            assert view.get(b"k") == b"v" and dict(view.iter_prefix(b"")) == {b"k": b"v"} and view.count() == 1
            with pytest.raises(TypeError, match="key must be bytes"):  # the same errors as the store's
                view.put("k", b"v")


def test_close_without_sync_leaves_unsynced_like_a_process_exit(tmp_path: Path) -> None:
    """close(sync=False) (a task handed to another process): the data is kept under the same boot id, and counts as
    possibly torn after a machine crash, exactly as after a killed process."""
    from statebackend.store import UNSYNCED_FILE

    store_dir = tmp_path / "s"
    store = LocalStore.open(store_dir, name="s")
    store.put(b"k", b"v")
    store.flush(LocalVersion("1-1", "aa")).close()
    store.close(sync=False)
    assert (store_dir / UNSYNCED_FILE).exists()
    with LocalStore.open(store_dir, name="s") as same_boot:
        assert same_boot.get(b"k") == b"v" and same_boot.version == LocalVersion("1-1", "aa")
        same_boot.close(sync=False)
    (store_dir / UNSYNCED_FILE).write_text("another-boot-id\n")
    with LocalStore.open(store_dir, name="s") as after_machine_crash:
        assert after_machine_crash.get(b"k") is None and after_machine_crash.version is None


def test_a_held_flush_waits_in_the_overlay_until_started_and_a_read_view_of_it_releases_it(tmp_path: Path) -> None:
    with LocalStore.open(tmp_path / "s", name="s") as store:
        store.put(b"a", b"1")
        store.flush(v(1), hold_apply=True).close()
        drain_appliers()  # an apply submitted at the flush would have ended by now
        assert store._applier.pending, "a held flush must not reach LMDB before start_apply"
        assert store.get(b"a") == b"1" and list(store.items()) == [(b"a", b"1")]
        store.start_apply()
        wait_until(lambda: not store._applier.pending)
        assert store.version == v(1)

        store.put(b"b", b"2")
        change = store.flush(v(2), hold_apply=True)  # e.g. a snapshot due at this commit asks for its view
        with change.read_view().result(timeout=30) as view:
            assert view.version == v(2) and list(view.items()) == [(b"a", b"1"), (b"b", b"2")]
        change.close()
        assert not store._applier.pending

        store.put(b"c", b"3")
        store.flush(v(3), hold_apply=True).close()
    with LocalStore.open(tmp_path / "s", name="s") as reopened:  # close applied the held batch
        assert reopened.version == v(3) and reopened.get(b"c") == b"3"


def test_a_flush_sorts_nothing_its_change_set_sorts_once_on_first_use_and_counts_exactly(tmp_path: Path) -> None:
    with LocalStore.open(tmp_path / "s", name="s") as store:
        store.put(b"a", b"old")
        store.flush(v(1)).close()
        store.put_many([b"d", b"b", b"c", b"a"], [b"4", b"2", b"3", b"1"])
        store.put(b"b", b"22")  # overwritten: counted once
        store.delete(b"c")  # a delete: its key counts, no value
        change = store.flush(v(2), hold_apply=True)
        assert change._final is not None and change._final._records is None, "the flush sorted in the sync part"
        assert len(change) == 4 and change.raw_bytes == 4 + len(b"1") + len(b"22") + len(b"4")
        expected = [(b"a", b"1"), (b"b", b"22"), (b"c", None), (b"d", b"4")]
        assert list(change) == expected and list(change) == expected
        assert store.get(b"b") == b"22" and store.get(b"c") is None  # the overlay, while the apply is held
        store.start_apply()
        wait_until(lambda: not store._applier.pending)
        assert list(store.items()) == [(b"a", b"1"), (b"b", b"22"), (b"d", b"4")]
        change.close()
