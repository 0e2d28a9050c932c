"""The changelog backend's restore: the deltas after the snapshot apply in one LMDB transaction, a damaged or
missing blob is named and leaves the previous local state, a restore is interrupted cleanly, an empty store under
a recipe past seq 0 continues from a snapshot, a handover close and a running background snapshot, and a delta whose
earlier try landed is not a conflict."""

from __future__ import annotations

import itertools
import shutil
import threading
import time
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import pytest
from statebackend.backends.changelog.backup import maintenance_pool

from statebackend import envbase
from statebackend.blobstores.memory import MemoryBlobStore
from statebackend.task import TaskStorage
from statebackend.testing.backend_contract import contents, write_round
from tests.backend_helpers import CHANGELOG_PREFIX as PREFIX
from tests.backend_helpers import backend_context, commit_round, restored_after_wipe
from tests.backend_helpers import changelog_config as config_for

# -- restore: the deltas after the snapshot apply in one LMDB transaction --------------------------------------------


def _chain_of(tmp_path: Path, rounds: int, empty: set[int], interval: int) -> tuple[MemoryBlobStore, Any, dict, Path]:
    """Commit ``rounds`` rounds, each in its own open (``empty``: rounds that change nothing), a snapshot every
    ``interval`` commits; the blobs, the head checkpoint, the model at every local version, and the dir holding a
    copy of the local state after each round (``<dir>/<round>``)."""
    from statebackend.backends.changelog.marker import Recipe

    blobs = MemoryBlobStore()
    config = config_for(
        tmp_path,
        **{
            "changelog.snapshot.interval.commits": interval,
            "changelog.snapshot.interval.ratio": 0,
            "changelog.gc.interval.commits": 0,
        },
    )
    model: dict[bytes, bytes] = {}
    models: dict[Any, dict[bytes, bytes]] = {None: {}}
    copies = tmp_path / "copies"
    for round_no in range(rounds):
        with TaskStorage.open(config, "task-0", blob_store=blobs) as task:
            if round_no not in empty:
                write_round(task, round_no, model)
            checkpoint = task.commit_durably({"input": str(round_no)})
            models[task.stores["counts"].version] = dict(model)
        shutil.copytree(tmp_path / "local" / "job" / "task-0" / "counts", copies / str(round_no))
    recipe = Recipe.decode(checkpoint.markers_for("changelog")["counts"], prefix=PREFIX)
    assert [step.version for step in recipe.steps()][-1] in models
    return blobs, checkpoint, models, copies


def _restore_into(
    blobs: Any, checkpoint: Any, directory: Path, on_get: Any = None
) -> tuple[Exception | None, Any, dict[bytes, bytes], float]:
    """Restore the store counts of ``checkpoint`` from ``blobs`` into the local store at ``directory`` with the
    changelog restore manager alone: the error (None: restored), the store's version and contents after it, and
    the deltas it counts replayed."""
    from statebackend.backends.changelog.restore import ChangelogRestoreManager

    from statebackend.metrics import Metrics
    from statebackend.store import LocalStore

    with LocalStore.open(directory, name="counts") as store:
        metrics = Metrics()
        manager = ChangelogRestoreManager(
            backend_context("changelog", blobs, stores={"counts": store}, metrics=metrics)
        )
        if on_get is not None:
            on_get(manager)
        manager.init(checkpoint)
        error = None
        try:
            manager.restore()
        except Exception as exc:  # noqa: BLE001 - returned to the test
            error = exc
        return error, store.version, dict(store.items()), metrics.counter("restore.deltas.replayed")


def _damaged(blobs: MemoryBlobStore, victim: str, how: str) -> MemoryBlobStore:
    copy = MemoryBlobStore()
    for name in blobs.list(""):
        data = blobs.get(name)
        if name != victim:
            copy.put(name, data)
        elif how == "flipped":
            copy.put(name, data[:-20] + bytes([data[-20] ^ 1]) + data[-19:])
        elif how == "truncated":
            copy.put(name, data[: len(data) // 2])
    return copy


def test_a_bad_delta_anywhere_after_the_snapshot_aborts_the_whole_replay_at_a_step_the_next_restore_continues_from(
    tmp_path: Path,
) -> None:
    """Full restore: the store stays at the snapshot's version with its contents; catch-up: at its own version.
    Either way the next restore (the blob put back) reaches the head exactly."""
    from statebackend.backends.changelog.marker import Recipe

    from statebackend.errors import CorruptDataError, NotFoundError
    from statebackend.store import LocalStore

    blobs, checkpoint, models, copies = _chain_of(tmp_path, 9, empty={5, 8}, interval=3)
    recipe = Recipe.decode(checkpoint.markers_for("changelog")["counts"], prefix=PREFIX)
    assert recipe.snapshot is not None and recipe.deltas[-1].name is None  # an empty commit ends the chain
    named = [step.name for step in recipe.deltas if step.name is not None]
    assert len(named) >= 2
    head = recipe.deltas[-1].version
    with LocalStore.open(copies / "5", name="counts") as store:
        assert store.version == recipe.snapshot.version  # round 5 is the snapshot's: a catch-up of every delta
    for victim in named:
        for how, error in (("flipped", CorruptDataError), ("missing", NotFoundError), ("truncated", CorruptDataError)):
            for start in (None, "5"):
                local = tmp_path / f"restore-{victim[-12:]}-{how}-{start}"
                if start is not None:
                    shutil.copytree(copies / start, local)
                failed, version, data, replayed = _restore_into(_damaged(blobs, victim, how), checkpoint, local)
                assert isinstance(failed, error), (victim, how, start, failed)
                assert version == recipe.snapshot.version and data == models[version], (victim, how, start)
                assert replayed == 0
                failed, version, data, replayed = _restore_into(blobs, checkpoint, local)
                assert failed is None and version == head and data == models[head]
                assert replayed == len(named)


def test_a_catch_up_restore_with_a_bad_delta_leaves_the_store_at_its_own_older_version(tmp_path: Path) -> None:
    from statebackend.backends.changelog.marker import Recipe

    from statebackend.errors import CorruptDataError

    blobs, checkpoint, models, copies = _chain_of(tmp_path, 9, empty={5, 8}, interval=3)
    recipe = Recipe.decode(checkpoint.markers_for("changelog")["counts"], prefix=PREFIX)
    named = [step for step in recipe.deltas if step.name is not None]
    newest = named[-1].name
    assert newest is not None
    local = tmp_path / "behind"
    shutil.copytree(copies / "6", local)  # at the first delta after the snapshot
    assert _restore_into(blobs, checkpoint, tmp_path / "probe")[1] == recipe.deltas[-1].version
    failed, version, data, replayed = _restore_into(_damaged(blobs, newest, "flipped"), checkpoint, local)
    assert isinstance(failed, CorruptDataError)
    assert version == named[0].version and data == models[version] and replayed == 0
    failed, version, data, replayed = _restore_into(blobs, checkpoint, local)
    assert (failed, version, data, replayed) == (None, recipe.deltas[-1].version, models[version], len(named) - 1)


def test_a_chain_without_snapshot_restores_with_empty_steps_at_start_middle_and_end_and_a_bad_delta_after_the_bulk_load(
    tmp_path: Path,
) -> None:
    """The first delta loads in bulk onto the empty store (its own transaction), the rest in one more: a bad delta
    after it leaves the store at the first delta's version; empty steps anywhere pass by."""
    from statebackend.backends.changelog.marker import Recipe

    from statebackend.errors import CorruptDataError

    for empty in ({0, 3, 5}, {2, 5}):
        base = tmp_path / "-".join(map(str, sorted(empty)))
        blobs, checkpoint, models, _ = _chain_of(base, 6, empty=empty, interval=1000)
        recipe = Recipe.decode(checkpoint.markers_for("changelog")["counts"], prefix=PREFIX)
        assert recipe.snapshot is None and [step.name is None for step in recipe.deltas] == [
            r in empty for r in range(6)
        ]
        named = [step for step in recipe.deltas if step.name is not None]
        head = recipe.deltas[-1].version
        failed, version, data, replayed = _restore_into(blobs, checkpoint, base / "full")
        assert (failed, version, data, replayed) == (None, head, models[head], len(named))
        newest = named[-1].name
        assert newest is not None
        failed, version, data, replayed = _restore_into(_damaged(blobs, newest, "flipped"), checkpoint, base / "bad")
        assert isinstance(failed, CorruptDataError)
        # the bulk path ran only when the first step has a blob; else nothing is applied
        expected = named[0].version if recipe.deltas[0].name is not None else None
        assert version == expected and data == models[expected]
        assert replayed == (1 if expected is not None else 0)
        failed, version, data, _ = _restore_into(blobs, checkpoint, base / "bad")
        assert (failed, version, data) == (None, head, models[head])


def test_an_interrupt_during_the_replay_aborts_it_at_the_snapshot_and_the_next_restore_finishes(tmp_path: Path) -> None:
    from statebackend.backends.changelog.marker import Recipe

    from statebackend.errors import RestoreInterrupted

    blobs, checkpoint, models, _ = _chain_of(tmp_path, 9, empty={8}, interval=3)
    recipe = Recipe.decode(checkpoint.markers_for("changelog")["counts"], prefix=PREFIX)
    assert recipe.snapshot is not None
    last = [step.name for step in recipe.deltas if step.name is not None][-1]

    class Interrupting(MemoryBlobStore):
        manager: Any = None

        def get(self, name: str, *, start: int | None = None, end: int | None = None) -> bytes:
            if name == last:
                self.manager.interrupt()  # while the chain replays (or before it starts): never half of it
            return super().get(name, start=start, end=end)

    interrupting = Interrupting()
    for name in blobs.list(""):
        interrupting.put(name, blobs.get(name))

    def hook(manager: Any) -> None:
        interrupting.manager = manager

    failed, version, data, replayed = _restore_into(interrupting, checkpoint, tmp_path / "local-2", on_get=hook)
    assert isinstance(failed, RestoreInterrupted)
    assert version == recipe.snapshot.version and data == models[version] and replayed == 0
    failed, version, data, _ = _restore_into(blobs, checkpoint, tmp_path / "local-2")
    assert (failed, version, data) == (None, recipe.deltas[-1].version, models[version])


def _endless_view_items(started: threading.Event) -> Any:
    """A stand-in for ``ReadView.items``: strictly increasing records without end (a snapshot that never finishes
    unless it is cancelled), announcing the first one."""

    def items(view: Any) -> Any:
        def records() -> Any:
            started.set()
            for i in itertools.count():
                yield b"zz%012d" % i, b"v"

        return records()

    return items


def _endless_chunks(started: threading.Event) -> Any:
    """A stand-in for the env-file base writer's chunks of the environment file: without end, announcing the
    first."""

    def chunks(path: Any) -> Any:
        started.set()
        while True:
            yield b"\0" * 4096

    return chunks


def test_a_handover_close_cancels_a_running_background_snapshot_and_the_chain_stays_exact(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Another process waits for a parked task (``close(handover=True)``): a running background snapshot stops at its
    next chunk instead of being waited for; nothing of it is uploaded or left staged, and the chain restores exactly,
    from the local dir kept and wiped. A plain close still waits for a snapshot (a task opened per batch needs it)."""
    from statebackend.store.view import ReadView

    blobs = MemoryBlobStore()
    config = config_for(
        tmp_path,
        **{
            "changelog.snapshot.interval.commits": 100,
            "changelog.snapshot.interval.ratio": 0.01,
            "changelog.snapshot.ratio.min.bytes": 0,
        },
    )
    model: dict[bytes, bytes] = {}
    started = threading.Event()
    task = TaskStorage.open(config, "task-0", blob_store=blobs)
    for round_no in range(2):  # the base, then a delta whose uploaded size the ratio weighs at the next commit
        commit_round(task, round_no, model)
    monkeypatch.setattr(ReadView, "items", _endless_view_items(started))
    monkeypatch.setattr(envbase, "_file_chunks", _endless_chunks(started))  # a snapshot is an env-file base
    commit_round(task, 2, model)  # due by the ratio: a background snapshot starts, endless
    assert started.wait(30), "no background snapshot started"
    closer = threading.Thread(target=task.close, kwargs={"sync_local": False, "handover": True}, daemon=True)
    closer.start()
    closer.join(30)
    assert not closer.is_alive(), "the handover close waited for the background snapshot"
    monkeypatch.undo()
    assert list(blobs.list(PREFIX + "snapshot/")) == []
    staging = list((tmp_path / "local").rglob("*.snapshot*"))
    assert staging == [], f"a cancelled snapshot left files behind: {staging}"
    with TaskStorage.open(config, "task-0", blob_store=blobs) as reopened:
        assert contents(reopened) == model
        maintenance_pool().submit(lambda: None).result(30)  # the look-up of the chain's sizes at open has answered
        commit_round(reopened, 3, model)  # the new owner snapshots when due: this plain close waits for it
    assert len(list(blobs.list(PREFIX + "snapshot/"))) == 1
    shutil.rmtree(tmp_path / "local")
    with TaskStorage.open(config, "task-0", blob_store=blobs) as restored:
        assert contents(restored) == model


def test_a_handover_does_not_cancel_a_snapshot_once_the_chain_reached_the_commit_cap(tmp_path: Path) -> None:
    """Handovers that keep interrupting snapshots must not let a chain grow without bound: at the cap
    (``snapshot.interval.commits``) the handover close waits for the snapshot, which lands."""
    blobs = MemoryBlobStore()
    config = config_for(tmp_path, **{"changelog.snapshot.interval.commits": 3, "changelog.snapshot.interval.ratio": 0})
    model: dict[bytes, bytes] = {}
    task = TaskStorage.open(config, "task-0", blob_store=blobs)
    for round_no in range(3):  # the third commit reaches the cap: a background snapshot starts
        commit_round(task, round_no, model)
    task.close(sync_local=False, handover=True)
    assert len(list(blobs.list(PREFIX + "snapshot/"))) == 1
    shutil.rmtree(tmp_path / "local")
    with TaskStorage.open(config, "task-0", blob_store=blobs) as restored:
        assert contents(restored) == model


@pytest.mark.parametrize("restored_by", ["blobsnapshot", None])
def test_an_empty_store_under_a_recipe_past_seq_0_continues_from_a_snapshot_not_from_a_bare_delta(
    tmp_path: Path, restored_by: str | None
) -> None:
    """Another backend (or nothing) left the store empty and without a version while this backend's recipe is at
    seq 3: the next commit's recipe starts from a snapshot at seq 4. Deltas after seq 1 without a snapshot are what
    a recipe whose snapshot was removed looks like, which restore refuses; the new chain must not look like one."""
    from statebackend.backends.changelog.backup import ChangelogBackupManager, ChangelogSettings
    from statebackend.backends.changelog.marker import Recipe

    from statebackend.store import LocalStore, LocalVersion

    blobs, checkpoint, _, _ = _chain_of(tmp_path, 3, empty=set(), interval=1000)
    recipe = Recipe.decode(checkpoint.markers_for("changelog")["counts"], prefix=PREFIX)
    assert recipe.snapshot is None and recipe.seq == 3
    with LocalStore.open(tmp_path / "elsewhere", name="counts") as store:
        assert store.version is None and store.count() == 0
        manager = ChangelogBackupManager(
            backend_context("changelog", blobs, stores={"counts": store}, restored_by={"counts": restored_by}),
            ChangelogSettings(
                snapshot_interval_commits=100,
                snapshot_interval_bytes=64 << 20,
                compression="zstd",
                compression_level=3,
                retained=3,
                snapshot_interval_ratio=0,
            ),
        )
        try:
            manager.init(checkpoint)
            store.put(b"k", b"v")
            change = store.flush(LocalVersion("1800000000000-1", "00000000000000aa"))
            try:
                markers = manager.snapshot(checkpoint.checkpoint_id, {"counts": change})
            finally:
                manager.abort(checkpoint.checkpoint_id)  # closes the read view the re-base holds
                change.close()
        finally:
            manager.close()
    after = Recipe.decode(markers["counts"], prefix=PREFIX)
    assert after.snapshot is not None and after.snapshot.seq == 4 and after.deltas == ()


def test_a_restore_removes_the_snapshot_copy_a_restore_killed_during_its_download_left_in_the_store_dir(
    tmp_path: Path,
) -> None:
    """A full restore downloads the snapshot into a temporary dir inside the store dir; a SIGKILL there (no finally
    runs) leaves that copy, as big as the state. The next restore of the store (which holds its lock, so no other
    restore can be using it) removes it: a task that keeps being killed while it restores must not fill the disk."""
    from statebackend.backends.changelog.marker import Recipe

    blobs, checkpoint, models, _ = _chain_of(tmp_path, 4, empty=set(), interval=2)
    recipe = Recipe.decode(checkpoint.markers_for("changelog")["counts"], prefix=PREFIX)
    assert recipe.snapshot is not None and recipe.snapshot.name is not None
    local = tmp_path / "killed-restore"
    local.mkdir()
    left = local / ".restore-k1ll3d"
    left.mkdir()
    (left / "snapshot").write_bytes(blobs.get(recipe.snapshot.name))
    (left / "snapshot.partial").write_bytes(b"cut")
    failed, version, data, _ = _restore_into(blobs, checkpoint, local)
    assert recipe.head is not None
    assert (failed, version, data) == (None, recipe.head.version, models[recipe.head.version])
    assert not left.exists()
    assert not list(local.glob(".restore-*"))


class EarlierTryLanded(MemoryBlobStore):
    """A memory store on which the first create-only write of a delta finds it written already by an earlier try of
    the same upload that landed ``landed_ago`` seconds ago (its reply lost): the blob holds the same bytes with that
    age, and the write is refused as taken."""

    def __init__(self, landed_ago: float) -> None:
        super().__init__()
        self.landed_ago = landed_ago
        self.landed: list[str] = []

    def put(
        self, name: str, data: bytes, *, create_only: bool = False, metadata: Mapping[str, str] | None = None
    ) -> None:
        if create_only and "/delta/" in name and not self.landed:
            from statebackend.errors import AlreadyExistsError
            from statebackend.kit import created_at_metadata

            super().put(name, data, metadata=created_at_metadata(time.time() - self.landed_ago))
            self.landed.append(name)
            raise AlreadyExistsError(f"{name} exists")
        super().put(name, data, create_only=create_only, metadata=metadata)


@pytest.mark.parametrize(("landed_ago", "refreshed"), [(60.0, False), (3 * 3600.0, True)])
def test_a_delta_an_earlier_try_wrote_is_named_only_while_young_else_written_again(
    tmp_path: Path, landed_ago: float, refreshed: bool
) -> None:
    """A delta found written by an earlier try (create-only refused) is as old as that try: a young one is named as it
    is, one older than half the grace period is written again with a fresh age (a sweep of another attempt would
    judge it by the age it holds, not by when this commit found it)."""
    from statebackend.kit import read_created_at

    blobs = EarlierTryLanded(landed_ago)
    config = config_for(tmp_path, **{"changelog.gc.grace.period.ms": 3_600_000})
    model: dict[bytes, bytes] = {}
    started = time.time()
    with TaskStorage.open(config, "task-0", blob_store=blobs) as task:
        commit_round(task, 0, model)
        commit_round(task, 1, model)
        assert len(blobs.landed) == 1
        age = read_created_at(blobs.head(blobs.landed[0]).metadata)
        assert age is not None
        if refreshed:
            assert age >= started - 1, "an old delta was named with the age an earlier try gave it"
        else:
            assert age < started - 30, "a young delta was written again for nothing"
        assert task.metrics.counter("changelog.blobs.refreshed") == (1 if refreshed else 0)
    assert restored_after_wipe(config, blobs) == model
