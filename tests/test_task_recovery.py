"""A task's recovery from faults around commit and restore: a landed checkpoint whose write reply failed, an
unreadable newest blob, a failure landing late, a fallback of one store among several, a chain rebased after a
failed restore, sweeps and fencing listings of a previous owner, and a store added later; each keeps the first
invariant (tests/test_task.py)."""

from __future__ import annotations

import threading
from pathlib import Path
from typing import Any

import pytest

from statebackend.blobstores.memory import MemoryBlobStore
from statebackend.errors import CommitError, StateBackendError, TransientStorageError
from statebackend.task import TaskStorage
from statebackend.testing.backend_contract import contents, write_round
from statebackend.testing.conditional_put_contract import PerSeqMemoryBlobStore
from tests.backend_helpers import (
    CHECKPOINTS,
    HookedBlobStore,
    checkpoint_name,
    commit_round,
    commit_rounds,
    task_config,
)

pytestmark = pytest.mark.usefixtures("fast_rechecks")


def _cold_restore_gives(
    tmp_path: Path, config: dict[str, Any], blobs: Any, latest: Any, model: dict[bytes, bytes], last_seq: int = 0
) -> None:
    """A task opened in a fresh local dir on ``blobs`` restores checkpoint ``latest``, holding exactly ``model``; its
    log ends at ``last_seq`` when given."""
    with TaskStorage.open(
        task_config(tmp_path / "fresh", "changelog", config["blob.store.url"]), "task-0", blob_store=blobs
    ) as check:
        assert check.restored == latest
        assert contents(check) == model
        assert not last_seq or check.checkpoint_log.seqs()[-1] == last_seq


def test_landed_checkpoint_then_a_failed_write_is_no_conflict(tmp_path: Path) -> None:
    blobs = HookedBlobStore(MemoryBlobStore())
    config = task_config(tmp_path)
    model: dict[bytes, bytes] = {}
    plan: dict[str, str] = {}

    def faults(name: str, landed: bool) -> None:
        action = plan.pop(name, None) if "/checkpoints/" in name else None
        if action == "lose_reply" and landed:
            raise TransientStorageError(f"connection reset after the server stored {name}")
        if action == "lose_reply":
            plan[name] = action  # only after it landed
        if action == "fail" and not landed:
            raise TransientStorageError(f"blob store unreachable writing {name}")

    blobs.on_put = faults
    with TaskStorage.open(config, "task-0", blob_store=blobs) as task:
        commit_round(task, 0, model)  # seq 1
        plan[checkpoint_name(2)] = "lose_reply"  # seq 2 lands, its reply is lost
        write_round(task, 1, model)
        with pytest.raises(CommitError, match="connection reset"):
            task.commit_durably({"input": "1"})
        plan[checkpoint_name(3)] = "fail"  # the next commit resolves seq 2 as landed and takes 3, which fails
        write_round(task, 2, model)
        with pytest.raises(CommitError, match="unreachable"):
            task.commit_durably({"input": "2"})
        latest = commit_round(task, 3, model)  # the blob store is healthy again: must commit as seq 3
        assert task.metrics.counter("commit.conflicts") == 0
    _cold_restore_gives(tmp_path, config, blobs.inner, latest, model)


@pytest.mark.parametrize("fault", ["stale_read", "deleted_v2"])
def test_newest_v2_blob_unreadable_never_restores_empty_from_its_v1_twin(tmp_path: Path, fault: str) -> None:
    blobs = HookedBlobStore(MemoryBlobStore())
    config = task_config(tmp_path, **{"task.checkpoint.write.versions": "2,1"})
    model: dict[bytes, bytes] = {}
    latest = commit_rounds(config, blobs, model)
    newest_v2 = checkpoint_name(3, 2)
    assert set(blobs.inner.list(CHECKPOINTS)) >= {newest_v2, checkpoint_name(3, 1)}
    if fault == "deleted_v2":
        blobs.inner.delete(newest_v2)
    else:
        misses = {"left": 1}

        def stale(name: str) -> None:
            if name == newest_v2 and misses["left"]:
                misses["left"] -= 1
                from statebackend.errors import NotFoundError

                raise NotFoundError(f"{name}: 404 from a lagging replica")

        blobs.on_get = stale
    # the same machine: its local CHECKPOINT-V2 says checkpoint #3 is a V2 checkpoint with state
    try:
        task = TaskStorage.open(config, "task-0", blob_store=blobs)
    except StateBackendError:
        return  # a clear error is a correct outcome
    with task:
        assert task.restored == latest
        assert contents(task) == model


def test_failure_landing_during_commit_is_never_raised_after_a_newer_acknowledged_commit(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    from statebackend.commit import TaskCommitManager

    blobs = HookedBlobStore(MemoryBlobStore())
    config = task_config(tmp_path)
    model: dict[bytes, bytes] = {}
    held, release = threading.Event(), threading.Event()

    def fail_held(name: str, landed: bool) -> None:
        if name == checkpoint_name(2) and not landed and not release.is_set():
            held.set()
            assert release.wait(30)
            raise TransientStorageError(f"blob store unreachable writing {name}")

    blobs.on_put = fail_held
    with TaskStorage.open(config, "task-0", blob_store=blobs) as task:
        commit_round(task, 0, model)
        write_round(task, 1, model)
        first = task.commit({"input": "1"})
        assert first is not None
        assert held.wait(30)  # its checkpoint write is in flight

        original = TaskCommitManager._raise_previous_failure
        armed = {"on": True}

        def interleaved(self: TaskCommitManager) -> None:
            original(self)
            if armed["on"]:  # the pool thread fails the commit in flight right after the check
                armed["on"] = False
                release.set()
                first.future.exception(timeout=30)

        monkeypatch.setattr(TaskCommitManager, "_raise_previous_failure", interleaved)
        write_round(task, 2, model)
        try:
            second = task.commit({"input": "2"})
        except CommitError:  # raising the earlier failure here, before anything newer is acknowledged, is fine
            second = task.commit({"input": "2"})
        assert second is not None
        second.result(timeout=30)  # acknowledged: holds the failed commit's changes too
        write_round(task, 3, model)
        third = task.commit({"input": "3"})  # seen: raises commit 1's failure, one commit late
        assert third is not None
        latest = third.result(timeout=30)
    _cold_restore_gives(tmp_path, config, blobs.inner, latest, model)


def _fill(task: TaskStorage, name: str, round_no: int, model: dict[bytes, bytes]) -> None:
    store = task.store(name)
    for i in range(20):
        key, value = f"{name}-{i:03d}".encode(), f"{name}-{round_no}-{i}".encode()
        store.put(key, value)
        model[key] = value


def _commit_both(
    config: dict[str, Any], blobs: MemoryBlobStore, rounds: int
) -> tuple[dict[str, dict[bytes, bytes]], Any]:
    """Commit ``rounds`` rounds of stores ``counts`` and ``other``; their models and the last checkpoint."""
    models: dict[str, dict[bytes, bytes]] = {"counts": {}, "other": {}}
    with TaskStorage.open(config, "task-0", blob_store=blobs) as task:
        for n in range(rounds):
            _fill(task, "counts", n, models["counts"])
            _fill(task, "other", n, models["other"])
            latest = task.commit_durably({"input": str(n)})
    return models, latest


def test_fallback_of_one_store_does_not_fail_a_sibling_store_restored_by_the_same_backend(tmp_path: Path) -> None:
    blobs = MemoryBlobStore()
    config = task_config(
        tmp_path,
        **{
            "stores.other.backup.factories": "changelog,blobsnapshot",
            "stores.other.restore.factories": "changelog,blobsnapshot",
        },
    )
    models, latest = _commit_both(config, blobs, 3)
    deltas = sorted(b for b in blobs.list("job/task-0/other/changelog/") if b.endswith(".delta"))
    assert deltas
    blobs.delete(deltas[-1])  # only the store with a second backend loses a blob
    with TaskStorage.open(
        task_config(
            tmp_path / "fresh",
            "changelog",
            config["blob.store.url"],
            **{
                "stores.other.backup.factories": "changelog,blobsnapshot",
                "stores.other.restore.factories": "changelog,blobsnapshot",
            },
        ),
        "task-0",
        blob_store=blobs,
    ) as check:
        assert check.restored == latest
        assert contents(check, "counts") == models["counts"]
        assert contents(check, "other") == models["other"]


def test_changelog_chain_is_rebased_after_its_restore_failed_and_another_backend_restored(tmp_path: Path) -> None:
    blobs = MemoryBlobStore()
    dual = {"stores.counts.restore.factories": "changelog,blobsnapshot"}
    config = task_config(tmp_path / "a", "changelog,blobsnapshot", **dual)
    url = config["blob.store.url"]
    model: dict[bytes, bytes] = {}
    commit_rounds(config, blobs, model)
    deltas = sorted(b for b in blobs.list("job/task-0/counts/changelog/") if b.endswith(".delta"))
    blobs.delete(deltas[1])
    # a new machine, migrating dual -> changelog: the restore falls back to the blobsnapshot marker (exact state)
    with TaskStorage.open(task_config(tmp_path / "b", "changelog", url), "task-0", blob_store=blobs) as task:
        assert contents(task) == model
        acknowledged = commit_round(task, 3, model)
    assert set(acknowledged.state_checkpoint_markers) == {"changelog"}
    with TaskStorage.open(task_config(tmp_path / "c", "changelog", url), "task-0", blob_store=blobs) as check:
        assert check.restored == acknowledged
        assert contents(check) == model


class ListHookedBlobStore(HookedBlobStore):
    """HookedBlobStore plus ``on_list(prefix)``, run before each listing."""

    def __init__(self, inner: Any) -> None:
        super().__init__(inner)
        self.on_list: Any = lambda prefix: None

    def list(self, prefix: str = "") -> Any:
        self.on_list(prefix)
        return super().list(prefix)


class HeadListHookedBlobStore(ListHookedBlobStore):
    """ListHookedBlobStore that passes the conditional put through: a checkpoint log on it keeps its head blob."""

    supports_conditional_put = True

    def put_if(self, name: str, data: bytes, *, version: str | None) -> str:
        return str(self.inner.put_if(name, data, version=version))

    def get_versioned(self, name: str) -> tuple[bytes, str]:
        data, version = self.inner.get_versioned(name)
        return data, version


@pytest.mark.parametrize("layout", ["per-seq", "head"])
@pytest.mark.parametrize("replay", [False, True])
def test_sweep_of_a_previous_owner_never_deletes_the_next_owners_delta(
    tmp_path: Path, replay: bool, layout: str
) -> None:
    inner = PerSeqMemoryBlobStore() if layout == "per-seq" else MemoryBlobStore()
    blobs = ListHookedBlobStore(inner) if layout == "per-seq" else HeadListHookedBlobStore(inner)
    extra = {"changelog.gc.interval.commits": 1}
    config = task_config(tmp_path / "first", **extra)
    url = config["blob.store.url"]
    models: list[dict[bytes, bytes]] = []
    model: dict[bytes, bytes] = {}
    with TaskStorage.open(config, "task-0", blob_store=inner) as task:
        for n in range(4):
            commit_round(task, n, model)
            models.append(dict(model))
        entries = task.checkpoint_log.entries()
    if replay:  # redo from checkpoint #2, superseding #3 and #4 (what the Spark driver does for a replayed batch)
        owner = TaskStorage.open(
            task_config(tmp_path / "w", "changelog", url, **extra),
            "task-0",
            blob_store=blobs,
            checkpoint=entries[1],
            fence_seq=entries[-1].seq,
        )
        model = dict(models[1])
    else:
        owner = TaskStorage.open(task_config(tmp_path / "w", "changelog", url, **extra), "task-0", blob_store=blobs)
    sweeping, go = threading.Event(), threading.Event()

    def hold_sweep(prefix: str) -> None:
        if prefix.endswith("/counts/changelog/delta/") and not go.is_set():
            sweeping.set()
            assert go.wait(30)

    blobs.on_list = hold_sweep  # only the sweep lists delta blobs
    with owner:
        write_round(owner, 10, model)
        owner.commit_durably({"input": "owner"})
        assert sweeping.wait(30)  # the owner's sweep has marked, and is about to list delta blobs
        # the next owner (a failover) restores the owner's checkpoint and commits durably meanwhile
        with TaskStorage.open(
            task_config(tmp_path / "next", "changelog", url, **extra), "task-0", blob_store=inner
        ) as nxt:
            assert contents(nxt) == model
            write_round(nxt, 11, model)
            acknowledged = nxt.commit_durably({"input": "next"})
        go.set()
        owner.commit_manager.close()  # the sweep has run
    with TaskStorage.open(task_config(tmp_path / "check", "changelog", url), "task-0", blob_store=inner) as check:
        assert check.restored == acknowledged
        assert contents(check) == model
    assert (f"{CHECKPOINTS}HEAD.v3.json" in set(inner.list(CHECKPOINTS))) == (layout == "head")


def test_zombie_checkpoint_whose_fencing_listing_failed_does_not_stay_in_the_log(tmp_path: Path) -> None:
    """The per-seq layout (a store without conditional writes), whose commit is fenced by a listing."""
    inner = PerSeqMemoryBlobStore()
    extra = {"task.checkpoint.retained": 1}
    config = task_config(tmp_path / "owner", **extra)
    url = config["blob.store.url"]
    model: dict[bytes, bytes] = {}
    with TaskStorage.open(config, "task-0", blob_store=inner) as task:
        write_round(task, 0, model)
        task.commit_durably({"input": "1"})
    zombie_blobs = ListHookedBlobStore(inner)
    zombie = TaskStorage.open(
        task_config(tmp_path / "zombie", "changelog", url, **extra), "task-0", blob_store=zombie_blobs
    )
    with TaskStorage.open(config, "task-0", blob_store=inner) as owner:
        for n in range(2, 5):
            commit_round(owner, n, model)
        owner.commit_manager.close()  # retention keeps #4 only: #2 and #3 are free again
    failures = {"left": 0}

    def flaky_listing(prefix: str) -> None:
        if "/checkpoints/" in prefix and failures["left"]:
            failures["left"] -= 1
            raise TransientStorageError("listing reset by peer")

    zombie_blobs.on_list = flaky_listing
    with zombie:
        write_round(zombie, 9, {})
        failures["left"] = 1  # the zombie's create-only #2 lands; the listing that would fence it fails
        with pytest.raises(CommitError):
            zombie.commit_durably({"input": "zombie"})
        write_round(zombie, 10, {})
        with pytest.raises(CommitError, match="another attempt"):
            zombie.commit_durably({"input": "zombie-2"})
    with TaskStorage.open(task_config(tmp_path / "check", "changelog", url), "task-0", blob_store=inner) as check:
        offsets = [entry.checkpoint.input_offsets["input"] for entry in check.checkpoint_log.entries()]
    assert offsets == ["4"]  # seen: ["zombie", "4"]
    # a restore chosen by offsets (what a Spark replay or read_state does) never lands on the zombie's state
    with TaskStorage.open(
        task_config(tmp_path / "pick", "changelog", url),
        "task-0",
        blob_store=inner,
        checkpoint=lambda entry: entry.checkpoint.input_offsets["input"] != "4",
    ) as picked:
        assert picked.restored is None


def test_unbound_legacy_blob_under_the_newest_name_is_not_a_silent_rollback(tmp_path: Path) -> None:
    from statebackend.checkpoint.serde import decode_checkpoint, encode_checkpoint

    blobs = PerSeqMemoryBlobStore()  # the per-seq layout, where a legacy blob can stand under a seq's name
    config = task_config(tmp_path)
    model: dict[bytes, bytes] = {}
    latest = commit_rounds(config, blobs, model)
    oldest = decode_checkpoint(blobs.get(checkpoint_name(1)))
    blobs.put(checkpoint_name(3), encode_checkpoint(oldest))  # checkpoint #1, unbound, put back as #3
    try:
        task = TaskStorage.open(config, "task-0", blob_store=blobs)
    except StateBackendError:
        return  # refusing it is correct
    with task:
        assert task.restored == latest  # seen: checkpoint #1 (input "0") and its state
        assert contents(task) == model


def test_spark_replay_never_redoes_a_batch_on_empty_state_after_a_short_listing(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    import statebackend.microbatch.attempt as spark_module
    from statebackend.blobstores.base import open_blob_store
    from tests.test_spark import make_config
    from tests.test_spark_tasks import run, task_state

    config = make_config(tmp_path)
    run(config, 0, "a", "b")
    run(config, 1, "a", "c")
    real_open = open_blob_store  # what the attempt module calls
    listings = {"n": 0}

    def hooked_open(url: str, options: Any) -> Any:
        blobs = ListHookedBlobStore(real_open(url, options))

        def short_after_first(prefix: str) -> None:
            if "/checkpoints/" in prefix:
                listings["n"] += 1
                if listings["n"] == 2:  # the listing that chose latest/head was whole; the next two are cut short
                    blobs.short_lists = 2

        blobs.on_list = short_after_first
        return blobs

    monkeypatch.setattr(spark_module, "open_blob_store", hooked_open)
    try:
        run(config, 1, "a", "c")  # Spark replays batch 1
    except StateBackendError:
        return  # a clear error is correct
    monkeypatch.setattr(spark_module, "open_blob_store", real_open)
    state, _ = task_state(config)
    assert state == {"a": 2, "b": 1, "c": 1}  # batch 0 then batch 1, once each (seen: {"a": 1, "c": 1})


# -- scenarios checked that hold --------------------------------------------------------------------------------------


def test_checkpoint_that_landed_but_whose_fencing_listing_came_back_short_is_no_conflict(tmp_path: Path) -> None:
    """The create-only write lands, the listing after it stays short (InconsistentStateError): the commit is reported
    failed, the next one reads the blob back, takes the next seq, and a cold restore gets exactly the newest."""
    blobs = ListHookedBlobStore(MemoryBlobStore())
    config = task_config(tmp_path)
    model: dict[bytes, bytes] = {}
    wrote = {"seq2": False}

    def short_after_seq2(name: str, landed: bool) -> None:
        if landed and name == checkpoint_name(2):
            wrote["seq2"] = True
            blobs.short_lists = 4  # the listing and its three re-listings

    blobs.on_put = short_after_seq2
    with TaskStorage.open(config, "task-0", blob_store=blobs) as task:
        commit_round(task, 0, model)
        write_round(task, 1, model)
        with pytest.raises(CommitError, match="known to be durable"):
            task.commit_durably({"input": "1"})
        assert wrote["seq2"]
        latest = commit_round(task, 2, model)
        assert task.metrics.counter("commit.conflicts") == 0
    _cold_restore_gives(tmp_path, config, blobs.inner, latest, model, last_seq=3)


def test_two_stores_two_backends_one_restore_fails_is_a_clear_error_and_nothing_is_lost(tmp_path: Path) -> None:
    from statebackend.errors import NotFoundError

    blobs = MemoryBlobStore()
    extra = {"stores.other.backup.factories": "blobsnapshot"}
    config = task_config(tmp_path / "a", **extra)
    models, latest = _commit_both(config, blobs, 2)
    from statebackend.backends.blobsnapshot.blobs import read_marker

    marker = latest.state_checkpoint_markers["blobsnapshot"]["other"]
    index = read_marker(blobs, marker, job="job", task="task-0", store="other")  # the index is in the marker
    hashes = {run.hash for run in index.runs}
    victim = next(name for name in blobs.list() if "/other/" in name and name.rsplit("/", 1)[-1] in hashes)
    kept = blobs.get(victim)
    blobs.delete(victim)  # a run the checkpoint's marker names is gone
    fresh = task_config(tmp_path / "b", "changelog", config["blob.store.url"], **extra)
    with pytest.raises(NotFoundError, match=r"job/task-0/other/blobsnapshot/runs/\w+ .* is missing"):
        TaskStorage.open(fresh, "task-0", blob_store=blobs)
    blobs.put(victim, kept)
    with TaskStorage.open(fresh, "task-0", blob_store=blobs) as check:
        assert check.restored == latest
        assert contents(check, "counts") == models["counts"]
        assert contents(check, "other") == models["other"]


def test_store_added_later_keeps_the_local_floor_and_starts_empty(tmp_path: Path) -> None:
    blobs = HookedBlobStore(MemoryBlobStore())
    config = task_config(tmp_path)
    model: dict[bytes, bytes] = {}
    latest = commit_rounds(config, blobs, model)
    grown = dict(config, **{"stores.extra.backup.factories": "blobsnapshot"})
    blobs.short_lists = 100
    with pytest.raises(StateBackendError, match="#3 of this task is known to be durable"):
        TaskStorage.open(grown, "task-0", blob_store=blobs)
    blobs.short_lists = 0
    with TaskStorage.open(grown, "task-0", blob_store=blobs) as task:
        assert task.restored == latest
        assert contents(task) == model
        assert contents(task, "extra") == {}
        task.store("extra").put(b"x", b"1")
        latest = commit_round(task, 3, model)
    with TaskStorage.open(
        dict(grown, **{"state.local.dir": str(tmp_path / "fresh")}), "task-0", blob_store=blobs.inner
    ) as check:
        assert check.restored == latest
        assert contents(check) == model
        assert contents(check, "extra") == {b"x": b"1"}
