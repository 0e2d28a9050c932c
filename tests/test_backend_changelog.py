"""The changelog-delta backend: the backend contract suite, plus what only this backend does (background snapshots,
catch-up by deltas, re-upload of a failed delta, retention of deltas)."""

from __future__ import annotations

import itertools
import random
import shutil
import threading
import time
from collections.abc import Mapping
from pathlib import Path
from typing import Any, ClassVar

import pytest
from statebackend.backends.changelog.backup import maintenance_pool

from statebackend import envbase
from statebackend.blobstores.memory import MemoryBlobStore
from statebackend.envbase import is_env_base
from statebackend.errors import CommitError, ConfigError
from statebackend.recordfile import FORMAT_VERSION, read_header
from statebackend.task import TaskStorage
from statebackend.testing.backend_contract import BackendContract, contents, write_round
from statebackend.testing.controlled import ControlledBlobStore


class TestChangelogBackend(BackendContract):
    backup_factories: ClassVar[str] = "changelog"
    extra_config: ClassVar[dict[str, Any]] = {"changelog.snapshot.interval.commits": 3}


#: the blob prefix of store counts of task-0 (``BackendContext.blob_prefix``), under which its recipe names blobs
PREFIX = "job/task-0/counts/changelog/"


def config_for(tmp_path: Path, **extra: object) -> dict[str, object]:
    return TestChangelogBackend().make_config(tmp_path, **extra)


def test_background_snapshot_is_adopted_and_old_deltas_are_deleted(tmp_path: Path) -> None:
    blobs = MemoryBlobStore()
    config = config_for(tmp_path)
    model: dict[bytes, bytes] = {}
    with TaskStorage.open(config, "task-0", blob_store=blobs) as task:
        for round_no in range(12):
            write_round(task, round_no, model)
            task.commit_durably({"input": str(round_no)})
            maintenance_pool().submit(lambda: None).result(30)  # a snapshot started is done: the next commit adopts it
        assert task.metrics.counter("changelog.snapshot.adopted") >= 2
    # retention's deletes go in batches with the log's (every retention_interval old checkpoints), and at close
    assert task.metrics.counter("changelog.blobs.deleted") > 0
    deltas = list(blobs.list("job/task-0/counts/changelog/delta/"))
    assert len(deltas) < 12
    snapshots = list(blobs.list("job/task-0/counts/changelog/snapshot/"))
    assert snapshots
    # deltas are written in the record file's newest version, snapshots as environment-file bases
    assert {read_header(blobs.get(name), name=name).format_version for name in deltas} == {FORMAT_VERSION} == {3}
    assert all(is_env_base(blobs.get(name, start=0, end=8)) for name in snapshots)
    shutil.rmtree(tmp_path / "local")
    with TaskStorage.open(config, "task-0", blob_store=blobs) as task:
        assert contents(task) == model
        assert task.metrics.counter("restore.deltas.replayed") < 12


def test_older_local_copy_catches_up_by_applying_only_missing_deltas(tmp_path: Path) -> None:
    blobs = MemoryBlobStore()
    config = config_for(
        tmp_path, **{"changelog.snapshot.interval.commits": 100, "changelog.snapshot.interval.ratio": 0}
    )
    model: dict[bytes, bytes] = {}
    with TaskStorage.open(config, "task-0", blob_store=blobs) as task:
        for round_no in range(3):
            write_round(task, round_no, model)
            task.commit_durably({"input": str(round_no)})
    shutil.copytree(tmp_path / "local", tmp_path / "older")
    with TaskStorage.open(config, "task-0", blob_store=blobs) as task:
        for round_no in range(3, 7):
            write_round(task, round_no, model)
            task.commit_durably({"input": str(round_no)})
    shutil.rmtree(tmp_path / "local")
    shutil.move(tmp_path / "older", tmp_path / "local")
    with TaskStorage.open(config, "task-0", blob_store=blobs) as task:
        assert contents(task) == model
        assert task.metrics.counter("restore.stores.caught.up") == 1
        assert task.metrics.counter("restore.deltas.replayed") == 4


def test_delta_whose_upload_failed_is_uploaded_by_the_next_commit(tmp_path: Path) -> None:
    blobs = ControlledBlobStore(MemoryBlobStore())
    config = config_for(tmp_path)
    model: dict[bytes, bytes] = {}
    with TaskStorage.open(config, "task-0", blob_store=blobs) as task:
        write_round(task, 0, model)
        task.commit_durably({"input": "0"})
        blobs.fail, blobs.failures_left = (lambda name: name.endswith(".delta")), 1
        write_round(task, 1, model)
        failed = task.commit({"input": "1"})
        assert failed is not None
        with pytest.raises(CommitError):
            failed.result(timeout=30)
        again = task.commit({"input": "1b"})  # the failure was reported through result(): not raised again
        assert again is not None
        again.result(timeout=30)
        write_round(task, 2, model)
        task.commit_durably({"input": "2"})
        assert task.metrics.counter("changelog.delta.reuploads") == 1
    shutil.rmtree(tmp_path / "local")
    with TaskStorage.open(config, "task-0", blob_store=blobs) as task:
        assert contents(task) == model


def test_bytes_uploaded_follow_the_change_not_the_state(tmp_path: Path) -> None:
    blobs = MemoryBlobStore()
    config = config_for(
        tmp_path, **{"changelog.snapshot.interval.commits": 1000, "changelog.snapshot.interval.ratio": 0}
    )
    with TaskStorage.open(config, "task-0", blob_store=blobs) as task:
        store = task.store("counts")
        # values that do not compress away (sequential keys and equal values shrink to a few KB as byte planes)
        store.put_all((f"key-{i:07d}".encode(), random.Random(i).randbytes(20)) for i in range(50_000))
        task.commit_durably({"input": "load"})
        before = task.metrics.counter("commit.bytes.uploaded")
        for i in range(0, 50_000, 500):
            store.put(f"key-{i:07d}".encode(), b"y" * 20)
        task.commit_durably({"input": "small"})
        small = task.metrics.counter("commit.bytes.uploaded") - before
    assert 0 < small < before / 20


def test_unknown_backend_name_lists_known_ones(tmp_path: Path) -> None:
    config = config_for(tmp_path, **{"stores.counts.backup.factories": "changelgo"})
    with pytest.raises(ConfigError, match="changelog"):
        TaskStorage.open(config, "task-0")


def test_missing_blob_store_url_says_what_to_set(tmp_path: Path) -> None:
    config = config_for(tmp_path)
    del config["blob.store.url"]
    with pytest.raises(ConfigError, match="blob.store.url"):
        TaskStorage.open(config, "task-0")


def test_commit_if_due_follows_task_commit_ms(tmp_path: Path) -> None:
    blobs = MemoryBlobStore()
    with TaskStorage.open(config_for(tmp_path, **{"task.commit.ms": 3_600_000}), "task-0", blob_store=blobs) as task:
        task.store("counts").put(b"k", b"v")
        assert task.commit_if_due({"input": "1"}) is None
        assert task.metrics.counter("commit.count") == 0
    with TaskStorage.open(config_for(tmp_path, **{"task.commit.ms": 0}), "task-0", blob_store=blobs) as task:
        task.store("counts").put(b"k", b"v")
        pending = task.commit_if_due({"input": "1"})
        assert pending is not None and pending.result(timeout=30).input_offsets == {"input": "1"}


def test_sweep_deletes_blobs_no_checkpoint_needs_and_keeps_every_retained_checkpoint_restorable(
    tmp_path: Path,
) -> None:
    """Orphans of commits that never became durable, and files only an earlier process's checkpoints needed, are
    swept; every checkpoint still in the log restores exactly afterwards."""
    from statebackend.backends.changelog.marker import Recipe
    from statebackend.checkpoint import CheckpointLog

    inner = MemoryBlobStore()
    blobs = ControlledBlobStore(inner)
    config = config_for(
        tmp_path,
        **{"changelog.gc.interval.commits": 2, "task.checkpoint.retained": 3, "changelog.gc.grace.period.ms": 0},
    )
    model: dict[bytes, bytes] = {}
    models: dict[str, dict[bytes, bytes]] = {}
    round_no = 0
    for restart in range(4):
        with TaskStorage.open(config, "task-0", blob_store=blobs) as task:
            for _ in range(3):
                write_round(task, round_no, model)
                task.commit_durably({"input": str(round_no)})
                models[str(round_no)] = dict(model)
                round_no += 1
            # a commit whose delta lands but whose checkpoint never does: its delta is an orphan
            blobs.fail, blobs.failures_left = (lambda name: "/checkpoints/" in name), 1
            write_round(task, 99, {})
            failed = task.commit({"input": "lost"})
            assert failed is not None
            with pytest.raises(CommitError):
                failed.result(timeout=30)
        shutil.rmtree(tmp_path / "local")  # the lost commit's local state must not come back
    with TaskStorage.open(config, "task-0", blob_store=blobs) as task:
        for _ in range(4):
            write_round(task, round_no, model)
            task.commit_durably({"input": str(round_no)})
            models[str(round_no)] = dict(model)
            round_no += 1
        assert task.metrics.counter("changelog.sweep.deleted") > 0
        task.commit_manager.wait()
    # what the last process left goes at the next sweep, except a finished snapshot this open adopted at init
    # (its next commit will reference it)
    with TaskStorage.open(config, "task-0", blob_store=inner) as task:
        manager = task.commit_manager.backups[0].manager
        manager.sweep()  # type: ignore[attr-defined]
        own_chain = set(manager._lineages["counts"].recipe().blob_names())  # type: ignore[attr-defined]
    entries = CheckpointLog(inner, "job", "task-0").entries()
    referenced = {
        n
        for e in entries
        for n in Recipe.decode(e.checkpoint.markers_for("changelog")["counts"], prefix=PREFIX).blob_names()
    }
    stored = set(inner.list("job/task-0/counts/changelog/"))
    newest = max(Recipe.decode(e.checkpoint.markers_for("changelog")["counts"], prefix=PREFIX).seq for e in entries)
    unreferenced_old = {n for n in stored - referenced if int(n.rsplit("/", 1)[-1].split("-")[0]) <= newest}
    assert unreferenced_old - own_chain == set()
    for entry in entries:
        shutil.rmtree(tmp_path / "local", ignore_errors=True)
        with TaskStorage.open(config, "task-0", blob_store=inner, checkpoint=entry) as task:
            assert contents(task) == models[entry.checkpoint.input_offsets["input"]]


def test_a_task_opened_for_each_commit_adopts_the_snapshots_it_takes_and_keeps_its_chain_short(
    tmp_path: Path,
) -> None:
    """The Spark driver opens, commits once and closes per batch: a background snapshot finished by one open is
    adopted by the next, so the recipe (and a wiped restore) stays bounded and old deltas are deleted."""
    from statebackend.backends.changelog.marker import Recipe

    blobs = MemoryBlobStore()
    config = config_for(
        tmp_path,
        **{
            "changelog.snapshot.interval.commits": 3,
            "task.checkpoint.retained": 2,
            "changelog.gc.interval.commits": 5,
            "changelog.gc.grace.period.ms": 0,
        },
    )
    model: dict[bytes, bytes] = {}
    longest_chain = 0
    adopted = 0.0
    for batch in range(15):
        with TaskStorage.open(config, "task-0", blob_store=blobs) as task:
            adopted += task.metrics.counter("changelog.snapshot.adopted")
            write_round(task, batch, model)
            checkpoint = task.commit_durably({"batch": str(batch)})
            recipe = Recipe.decode(checkpoint.markers_for("changelog")["counts"], prefix=PREFIX)
            longest_chain = max(longest_chain, len(recipe.deltas))
    assert adopted >= 3
    assert longest_chain <= 2 * 3 + 1
    # one open holds one commit, so retention's window never drops anything in-process: the sweep (every 5th
    # checkpoint, by sequence number) deletes what no checkpoint in the log needs
    assert len(list(blobs.list("job/task-0/counts/changelog/delta/"))) <= 2 * 3 + 5
    shutil.rmtree(tmp_path / "local")
    with TaskStorage.open(config, "task-0", blob_store=blobs) as task:
        assert contents(task) == model
        assert task.metrics.counter("restore.deltas.replayed") <= 2 * 3 + 1


def test_failed_retry_of_an_older_delta_keeps_this_commits_delta_staged_and_needs_no_rebase(tmp_path: Path) -> None:
    blobs = ControlledBlobStore(MemoryBlobStore())
    config = config_for(
        tmp_path,
        **{
            "changelog.snapshot.interval.commits": 1000,
            "changelog.snapshot.interval.ratio": 0,
            "task.commit.async.failures.tolerated": 5,
        },
    )
    model: dict[bytes, bytes] = {}
    with TaskStorage.open(config, "task-0", blob_store=blobs) as task:
        write_round(task, 0, model)
        task.commit_durably({"input": "0"})
        for round_no in (1, 2):  # round 1's delta fails; round 2 fails again on the retry of round 1's delta
            blobs.fail, blobs.failures_left = (lambda name: name.endswith(".delta")), 1
            write_round(task, round_no, model)
            failed = task.commit({"input": str(round_no)})
            assert failed is not None
            with pytest.raises(CommitError):
                failed.result(timeout=30)
        write_round(task, 3, model)
        task.commit_durably({"input": "3"})
        assert task.metrics.counter("changelog.delta.reuploads") == 2
        assert task.metrics.counter("changelog.snapshot.uploads") == 0  # no re-base on a full snapshot
    shutil.rmtree(tmp_path / "local")
    with TaskStorage.open(config, "task-0", blob_store=blobs) as task:
        assert contents(task) == model


@pytest.mark.parametrize("damage", ["cut", "older", "other_task"])
def test_a_finished_snapshot_is_adopted_at_open_only_when_it_is_whole_and_the_one_named(
    tmp_path: Path, damage: str
) -> None:
    """A background snapshot an earlier open finished is adopted by name at the next open; a blob under that name
    that is cut short, or is another snapshot (an older one of the store, another task's), is not adopted (every
    later checkpoint would name it and be unrestorable): the chain keeps its deltas and restores exactly."""
    from statebackend.backends.changelog.marker import Recipe

    blobs = MemoryBlobStore()
    config = config_for(
        tmp_path,
        **{
            "changelog.snapshot.interval.commits": 3,
            "changelog.snapshot.interval.ratio": 0,
            "changelog.gc.interval.commits": 0,
        },
    )
    snapshots = "job/task-0/counts/changelog/snapshot/"
    model: dict[bytes, bytes] = {}
    for task_name in ("task-1", "task-0"):  # task-1: another task's snapshot of the same seq
        model = {}
        with TaskStorage.open(config, task_name, blob_store=blobs) as task:
            for round_no in range(3):  # the third commit starts a background snapshot; close waits for it
                write_round(task, round_no, model)
                task.commit_durably({"input": str(round_no)})
    if damage == "older":  # the next open adopts that snapshot and finishes a newer one, not adopted yet
        with TaskStorage.open(config, "task-0", blob_store=blobs) as task:
            assert task.metrics.counter("changelog.snapshot.adopted") == 1
            for round_no in range(3, 6):
                write_round(task, round_no, model)
                task.commit_durably({"input": str(round_no)})
    finished = list(blobs.list(snapshots))  # sorted by seq
    victim = finished[-1]
    data = blobs.get(victim)
    if damage == "cut":
        blobs.put(victim, data[: len(data) - 10])
    elif damage == "older":
        assert len(finished) == 2 and blobs.get(finished[0]) != data
        blobs.put(victim, blobs.get(finished[0]))
    else:
        (foreign,) = list(blobs.list("job/task-1/counts/changelog/snapshot/"))
        assert foreign.rsplit("/", 1)[-1][:13] == victim.rsplit("/", 1)[-1][:13]  # the same seq, another task
        blobs.put(victim, blobs.get(foreign))
    with TaskStorage.open(config, "task-0", blob_store=blobs) as task:
        assert task.metrics.counter("changelog.snapshot.rejected") == 1
        assert task.metrics.counter("changelog.snapshot.adopted") == 0
        write_round(task, 10, model)
        checkpoint = task.commit_durably({"input": "10"})
        recipe = Recipe.decode(checkpoint.markers_for("changelog")["counts"], prefix=PREFIX)
        assert victim not in set(recipe.blob_names())
    shutil.rmtree(tmp_path / "local")
    with TaskStorage.open(config, "task-0", blob_store=blobs) as task:
        assert contents(task) == model


def test_cleanup_never_deletes_the_staged_file_of_a_snapshot_still_uploading(tmp_path: Path) -> None:
    """A slow network: the background snapshot's upload is held while later commits become durable and clean up.
    Their cleanups must leave its staged file alone (before, they deleted it, the upload failed, and on a network
    that is always this slow every snapshot failed and the delta chain grew without bound)."""
    from concurrent.futures import ThreadPoolExecutor

    from statebackend.backends.changelog.backup import STAGING_DIR, ChangelogBackupManager
    from statebackend.backends.changelog.marker import Recipe

    blobs = ControlledBlobStore(MemoryBlobStore())
    config = config_for(tmp_path, **{"changelog.snapshot.interval.commits": 2, "changelog.gc.interval.commits": 0})
    model: dict[bytes, bytes] = {}
    # one pool thread: a commit's cleanup runs before the next commit's upload (FIFO), so when a commit is durable
    # the previous commit's cleanup has run
    with ThreadPoolExecutor(1) as pool, TaskStorage.open(config, "task-0", blob_store=blobs, executor=pool) as task:
        manager = next(b.manager for b in task.commit_manager.backups)
        assert isinstance(manager, ChangelogBackupManager)
        lineage = manager._lineages["counts"]  # the test waits on the backend's own background future
        blobs.hold = lambda name: "/snapshot/" in name
        try:
            for round_no in range(2):  # the second commit starts a background snapshot
                write_round(task, round_no, model)
                task.commit_durably({"input": str(round_no)})
            assert blobs.held.wait(30), "the background snapshot never started uploading"
            (snapshot_blob,) = [name for name in blobs.put_names if "/snapshot/" in name]
            staged = Path(task.stores["counts"].path) / STAGING_DIR / snapshot_blob.rsplit("/", 1)[-1]
            for round_no in range(2, 5):  # durable commits past the snapshot's seq, each followed by its cleanup
                write_round(task, round_no, model)
                task.commit_durably({"input": str(round_no)})
            pool.submit(lambda: None).result(timeout=30)  # the last commit's cleanup has run too
            assert task.metrics.counter("commit.cleanup.failures") == 0
            assert staged.exists(), "cleanup deleted the staged file of a snapshot that is still uploading"
        finally:  # a failing assertion must not leave the upload held until its own timeout
            blobs.release.set()
        background = lineage.background
        assert background is not None
        assert background.exception(timeout=30) is None
        write_round(task, 5, model)
        checkpoint = task.commit_durably({"input": "5"})
        assert task.metrics.counter("changelog.snapshot.failures") == 0
        assert task.metrics.counter("changelog.snapshot.adopted") == 1
        recipe = Recipe.decode(checkpoint.markers_for("changelog")["counts"], prefix=PREFIX)
        assert recipe.snapshot is not None and recipe.snapshot.seq == 2
    assert not staged.exists()  # uploaded, then removed by the upload itself
    shutil.rmtree(tmp_path / "local")
    with TaskStorage.open(config, "task-0", blob_store=blobs) as task:
        assert contents(task) == model


def test_a_repeated_or_late_cleanup_never_drops_a_recipe_a_retained_checkpoint_needs(tmp_path: Path) -> None:
    """cleanup() is idempotent and may come late (a framework resolving a lost checkpoint reply): a repeated cleanup
    of the newest checkpoint, or a late one of an older checkpoint, must not take a slot of the retention window and
    delete blobs that a checkpoint the log still retains needs."""
    from statebackend.backends.changelog.backup import ChangelogBackupManager
    from statebackend.backends.changelog.marker import Recipe
    from statebackend.checkpoint import CheckpointLog

    blobs = MemoryBlobStore()
    config = config_for(tmp_path, **{"changelog.snapshot.interval.commits": 2, "changelog.gc.interval.commits": 0})
    model: dict[bytes, bytes] = {}
    models: dict[str, dict[bytes, bytes]] = {}
    with TaskStorage.open(config, "task-0", blob_store=blobs) as task:
        manager = next(b.manager for b in task.commit_manager.backups)
        assert isinstance(manager, ChangelogBackupManager)
        lineage = manager._lineages["counts"]  # the test waits on the backend's own background future
        checkpoints = []
        for round_no in range(20):
            write_round(task, round_no, model)
            checkpoints.append(task.commit_durably({"input": str(round_no)}))
            models[str(round_no)] = dict(model)
            if lineage.background is not None:
                lineage.background.exception(timeout=30)
            if len(checkpoints) >= 2:
                older, newer = (
                    Recipe.decode(c.markers_for("changelog")["counts"], prefix=PREFIX) for c in checkpoints[-2:]
                )
                if set(older.blob_names()) - set(newer.blob_names()):
                    break  # the older retained checkpoint needs blobs the newer one does not
        else:
            pytest.fail("no snapshot was adopted: the scenario needs two retained recipes that differ")
        task.commit_manager.close()  # the commits' own cleanups are done
        newest, previous = checkpoints[-1], checkpoints[-2]
        for checkpoint in (newest, newest, previous):
            manager.cleanup(checkpoint.checkpoint_id, checkpoint.markers_for("changelog")).result(timeout=30)
    entries = CheckpointLog(blobs, "job", "task-0").entries()
    assert [e.checkpoint.input_offsets["input"] for e in entries] == [
        previous.input_offsets["input"],
        newest.input_offsets["input"],
    ]
    for entry in entries:
        shutil.rmtree(tmp_path / "local")
        with TaskStorage.open(config, "task-0", blob_store=blobs, checkpoint=entry) as task:
            assert contents(task) == models[entry.checkpoint.input_offsets["input"]]


# -- sweep grace period (review finding 4) ----------------------------------------------------------------------------

ORPHAN = "job/task-0/counts/changelog/delta/000000000001-orphan.delta"


def _changelog_manager(task: TaskStorage) -> Any:
    from statebackend.backends.changelog.backup import ChangelogBackupManager

    manager = next(b.manager for b in task.commit_manager.backups if b.factory_name == "changelog")
    assert isinstance(manager, ChangelogBackupManager)
    return manager


@pytest.mark.parametrize("metadata", [True, False])
def test_sweep_leaves_a_young_delta_of_a_replay_still_committing_below_the_heads_seq_and_takes_old_orphans(
    tmp_path: Path, metadata: bool
) -> None:
    """A Spark replay (restored #2, fenced above #4) has uploaded its delta, seq 3: at or below the head's recipe
    seq, named by no checkpoint yet. A sweep of the previous owner meanwhile must leave it (it is younger than the
    grace period); an unreferenced blob older than the grace period goes. Without metadata, age is first-seen."""
    import time

    inner = MemoryBlobStore()
    inner.supports_metadata = metadata
    blobs = ControlledBlobStore(inner)
    extra = {
        "changelog.gc.interval.commits": 0,
        "task.checkpoint.retained": 10,
        "changelog.snapshot.interval.commits": 1000,
        "changelog.snapshot.interval.ratio": 0,
    }
    config = config_for(tmp_path, **extra)
    model: dict[bytes, bytes] = {}
    models: list[dict[bytes, bytes]] = []
    with TaskStorage.open(config, "task-0", blob_store=blobs) as task:
        for n in range(4):
            write_round(task, n, model)
            task.commit_durably({"input": str(n)})
            models.append(dict(model))
        task.commit_manager.close()
        entries = task.checkpoint_log.entries()
        sweeper = _changelog_manager(task)
        inner.put(ORPHAN, b"left by a commit that died", metadata={"created_at": f"{time.time():.3f}"})
        replayed = dict(models[1])
        with TaskStorage.open(
            config_for(tmp_path / "replay", **extra),
            "task-0",
            blob_store=blobs,
            checkpoint=entries[1],
            fence_seq=entries[-1].seq,
        ) as replay:
            write_round(replay, 10, replayed)
            blobs.hold = lambda name: "/checkpoints/" in name
            pending = replay.commit({"input": "replay"})
            assert pending is not None
            try:
                assert blobs.held.wait(30), "the checkpoint write never started"
                assert sweeper.sweep() == 0  # everything unreferenced is young
            finally:
                blobs.release.set()
            acknowledged = pending.result(timeout=30)
        assert ORPHAN in set(inner.list(ORPHAN))
        sweeper.clock = lambda: time.time() + 2 * 3600  # past the grace period (first seen by the sweep above)
        assert sweeper.sweep() == 1
        assert ORPHAN not in set(inner.list(ORPHAN))
    with TaskStorage.open(config_for(tmp_path / "check", **extra), "task-0", blob_store=inner) as check:
        assert check.restored == acknowledged
        assert contents(check) == replayed


def test_a_sweep_that_outlives_a_quarter_of_the_grace_period_since_its_mark_stops_deleting(tmp_path: Path) -> None:
    """Its marks are stale by then: a checkpoint written since may name a blob that has grown old meanwhile."""
    import time

    blobs = MemoryBlobStore()
    config = config_for(tmp_path, **{"changelog.gc.interval.commits": 0})
    model: dict[bytes, bytes] = {}
    with TaskStorage.open(config, "task-0", blob_store=blobs) as task:
        for n in range(2):
            write_round(task, n, model)
            task.commit_durably({"input": str(n)})
        blobs.put(ORPHAN, b"ancient", metadata={"created_at": "1"})
        manager = _changelog_manager(task)
        ticks = iter(range(10**6))
        manager.clock = lambda: time.time() + 1000 * next(ticks)  # every reading ~17 minutes later
        assert manager.sweep() == 0
        assert task.metrics.counter("changelog.sweep.stopped") == 1
        manager.clock = time.time
        assert manager.sweep() == 1


def test_a_delta_reused_more_than_half_the_grace_period_after_its_upload_is_not_named_the_next_commit_rebases(
    tmp_path: Path,
) -> None:
    """A commit's checkpoint write failed; the next commit, an hour later, would name its delta (no checkpoint known
    durable names it, so another attempt's sweep may take it): it fails instead, and the one after re-bases."""
    import time

    from statebackend.backends.changelog.marker import Recipe

    blobs = ControlledBlobStore(MemoryBlobStore())
    config = config_for(tmp_path, **{"changelog.gc.interval.commits": 0})
    model: dict[bytes, bytes] = {}
    with TaskStorage.open(config, "task-0", blob_store=blobs) as task:
        write_round(task, 0, model)
        task.commit_durably({"input": "0"})
        blobs.fail, blobs.failures_left = (lambda name: "/checkpoints/" in name), 1
        write_round(task, 1, model)
        failed = task.commit({"input": "1"})
        assert failed is not None
        with pytest.raises(CommitError):
            failed.result(timeout=30)
        _changelog_manager(task).clock = lambda: time.time() + 3600
        write_round(task, 2, model)
        with pytest.raises(CommitError, match="re-bases on a fresh snapshot"):
            task.commit_durably({"input": "2"})
        assert task.metrics.counter("changelog.rebase.old.blobs") == 1
        write_round(task, 3, model)
        latest = task.commit_durably({"input": "3"})
        recipe = Recipe.decode(latest.markers_for("changelog")["counts"], prefix=PREFIX)
        assert recipe.snapshot is not None and not recipe.deltas
    shutil.rmtree(tmp_path / "local")
    with TaskStorage.open(config, "task-0", blob_store=blobs.inner) as check:
        assert check.restored == latest
        assert contents(check) == model


def test_a_finished_snapshot_older_than_half_the_grace_period_is_not_adopted_at_open(tmp_path: Path) -> None:
    from statebackend.backends.changelog.marker import Recipe

    blobs = MemoryBlobStore()
    config = config_for(tmp_path, **{"changelog.snapshot.interval.commits": 3, "changelog.gc.interval.commits": 0})
    model: dict[bytes, bytes] = {}
    with TaskStorage.open(config, "task-0", blob_store=blobs) as task:
        for n in range(3):  # the third commit starts a background snapshot; close waits for it
            write_round(task, n, model)
            task.commit_durably({"input": str(n)})
    (finished,) = list(blobs.list("job/task-0/counts/changelog/snapshot/"))
    blobs.set_metadata(finished, {"created_at": "1"})
    with TaskStorage.open(config, "task-0", blob_store=blobs) as task:
        assert task.metrics.counter("changelog.snapshot.too.old") == 1
        assert task.metrics.counter("changelog.snapshot.adopted") == 0
        write_round(task, 3, model)
        latest = task.commit_durably({"input": "3"})
        assert finished not in set(Recipe.decode(latest.markers_for("changelog")["counts"], prefix=PREFIX).blob_names())
    shutil.rmtree(tmp_path / "local")
    with TaskStorage.open(config, "task-0", blob_store=blobs) as check:
        assert check.restored == latest
        assert contents(check) == model


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
    from statebackend.checkpoint import CheckpointLog

    from statebackend.contracts import BackendContext
    from statebackend.metrics import Metrics
    from statebackend.store import LocalStore

    with LocalStore.open(directory, name="counts") as store:
        metrics = Metrics()
        manager = ChangelogRestoreManager(
            BackendContext(
                factory_name="changelog",
                job_name="job",
                task_name="task-0",
                stores={"counts": store},
                blob_store=blobs,
                checkpoint_log=CheckpointLog(blobs, "job", "task-0"),
                executor=None,  # type: ignore[arg-type]
                metrics=metrics,
            )
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
    local = tmp_path / "behind"
    shutil.copytree(copies / "6", local)  # at the first delta after the snapshot
    assert _restore_into(blobs, checkpoint, tmp_path / "probe")[1] == recipe.deltas[-1].version
    failed, version, data, replayed = _restore_into(_damaged(blobs, named[-1].name, "flipped"), checkpoint, local)
    assert isinstance(failed, CorruptDataError)
    assert version == named[0].version and data == models[version] and replayed == 0
    failed, version, data, replayed = _restore_into(blobs, checkpoint, local)
    assert (failed, version, data, replayed) == (None, recipe.deltas[-1].version, models[version], len(named) - 1)


def test_a_chain_without_snapshot_restores_with_empty_steps_at_its_start_middle_and_end_and_a_bad_delta_after_the_bulk_load(
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
        failed, version, data, replayed = _restore_into(
            _damaged(blobs, named[-1].name, "flipped"), checkpoint, base / "bad"
        )
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
        write_round(task, round_no, model)
        task.commit_durably({"input": str(round_no)})
    monkeypatch.setattr(ReadView, "items", _endless_view_items(started))
    monkeypatch.setattr(envbase, "_file_chunks", _endless_chunks(started))  # a snapshot is an env-file base
    write_round(task, 2, model)
    task.commit_durably({"input": "2"})  # due by the ratio: a background snapshot starts, endless
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
        write_round(reopened, 3, model)
        reopened.commit_durably({"input": "3"})  # the new owner snapshots when due: this plain close waits for it
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
        write_round(task, round_no, model)
        task.commit_durably({"input": str(round_no)})
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
    from statebackend.backends.changelog.backup import ChangelogBackupManager
    from statebackend.backends.changelog.marker import Recipe
    from statebackend.checkpoint import CheckpointLog

    from statebackend.contracts import BackendContext
    from statebackend.metrics import Metrics
    from statebackend.store import LocalStore, LocalVersion

    blobs, checkpoint, _, _ = _chain_of(tmp_path, 3, empty=set(), interval=1000)
    recipe = Recipe.decode(checkpoint.markers_for("changelog")["counts"], prefix=PREFIX)
    assert recipe.snapshot is None and recipe.seq == 3
    with LocalStore.open(tmp_path / "elsewhere", name="counts") as store:
        assert store.version is None and store.count() == 0
        manager = ChangelogBackupManager(
            context=BackendContext(
                factory_name="changelog",
                job_name="job",
                task_name="task-0",
                stores={"counts": store},
                blob_store=blobs,
                checkpoint_log=CheckpointLog(blobs, "job", "task-0"),
                executor=None,  # type: ignore[arg-type]
                metrics=Metrics(),
                restored_by={"counts": restored_by},
            ),
            snapshot_interval_commits=100,
            snapshot_interval_bytes=64 << 20,
            compression="zstd",
            compression_level=3,
            retained=3,
            snapshot_interval_ratio=0,
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
        write_round(task, 0, model)
        task.commit_durably({"input": "0"})
        write_round(task, 1, model)
        task.commit_durably({"input": "1"})
        assert len(blobs.landed) == 1
        age = read_created_at(blobs.head(blobs.landed[0]).metadata)
        assert age is not None
        if refreshed:
            assert age >= started - 1, "an old delta was named with the age an earlier try gave it"
        else:
            assert age < started - 30, "a young delta was written again for nothing"
        assert task.metrics.counter("changelog.blobs.refreshed") == (1 if refreshed else 0)
    shutil.rmtree(tmp_path / "local")
    with TaskStorage.open(config, "task-0", blob_store=blobs) as task:
        assert contents(task) == model
