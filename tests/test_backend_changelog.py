"""The changelog-delta backend: the backend contract suite, plus what only this backend does (background snapshots,
catch-up by deltas, re-upload of a failed delta, retention of deltas)."""

from __future__ import annotations

import random
import shutil
from pathlib import Path

import pytest
from statebackend.backends.changelog.backup import maintenance_pool
from statebackend.checkpoint import CheckpointV2

from statebackend.blobstores.memory import MemoryBlobStore
from statebackend.envbase import is_env_base
from statebackend.errors import CommitError, ConfigError
from statebackend.recordfile import FORMAT_VERSION, read_header
from statebackend.task import TaskStorage
from statebackend.testing.backend_contract import contents, write_round
from statebackend.testing.controlled import ControlledBlobStore
from tests.backend_helpers import CHANGELOG_PREFIX as PREFIX
from tests.backend_helpers import ChangelogContract, commit_round, expect_failed_commit, restored_after_wipe
from tests.backend_helpers import changelog_config as config_for


class TestChangelogBackend(ChangelogContract):
    """The backup/restore contract suite, unchanged, against this backend."""


def test_background_snapshot_is_adopted_and_old_deltas_are_deleted(tmp_path: Path) -> None:
    blobs = MemoryBlobStore()
    config = config_for(tmp_path)
    model: dict[bytes, bytes] = {}
    with TaskStorage.open(config, "task-0", blob_store=blobs) as task:
        for round_no in range(12):
            commit_round(task, round_no, model)
            maintenance_pool().submit(lambda: None).result(30)  # a snapshot started is done: the next commit adopts it
        assert task.metrics.counter("changelog.snapshot.adopted") >= 2
    # retention's deletes go in batches with the log's (every retention_interval old checkpoints), and at close
    assert task.metrics.counter("changelog.blobs.deleted") > 0
    deltas = list(blobs.list("job/task-0/counts/changelog/delta/"))
    assert len(deltas) < 12
    snapshots = list(blobs.list("job/task-0/counts/changelog/snapshot/"))
    assert snapshots
    # deltas are written in the record file's newest version, snapshots as environment-file bases
    assert {read_header(blobs.get(name), name=name).format_version for name in deltas} == {FORMAT_VERSION} == {4}
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
            commit_round(task, round_no, model)
    shutil.copytree(tmp_path / "local", tmp_path / "older")
    with TaskStorage.open(config, "task-0", blob_store=blobs) as task:
        for round_no in range(3, 7):
            commit_round(task, round_no, model)
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
        commit_round(task, 0, model)
        blobs.fail, blobs.failures_left = (lambda name: name.endswith(".delta")), 1
        write_round(task, 1, model)
        expect_failed_commit(task, "1")
        again = task.commit({"input": "1b"})  # the failure was reported through result(): not raised again
        assert again is not None
        again.result(timeout=30)
        commit_round(task, 2, model)
        assert task.metrics.counter("changelog.delta.reuploads") == 1
    assert restored_after_wipe(config, blobs) == model


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
    for _restart in range(4):
        with TaskStorage.open(config, "task-0", blob_store=blobs) as task:
            for _ in range(3):
                commit_round(task, round_no, model)
                models[str(round_no)] = dict(model)
                round_no += 1
            # a commit whose delta lands but whose checkpoint never does: its delta is an orphan
            blobs.fail, blobs.failures_left = (lambda name: "/checkpoints/" in name), 1
            write_round(task, 99, {})
            expect_failed_commit(task, "lost")
        shutil.rmtree(tmp_path / "local")  # the lost commit's local state must not come back
    with TaskStorage.open(config, "task-0", blob_store=blobs) as task:
        for _ in range(4):
            commit_round(task, round_no, model)
            models[str(round_no)] = dict(model)
            round_no += 1
        assert task.metrics.counter("changelog.sweep.deleted") > 0
        task.commit_manager.wait()
    # what the last process left goes at the next sweep, except a finished snapshot this open adopted at init
    # (its next commit will reference it)
    with TaskStorage.open(config, "task-0", blob_store=inner) as task:
        manager = task.commit_manager.backups[0].manager
        manager.sweep()  # type: ignore[attr-defined]
        own_chain = set(manager.shared.stores["counts"].recipe().blob_names())  # type: ignore[attr-defined]
    entries = CheckpointLog(inner, "job", "task-0").entries()
    checkpoints = [e.checkpoint for e in entries if isinstance(e.checkpoint, CheckpointV2)]
    assert len(checkpoints) == len(entries)
    referenced = {
        n for c in checkpoints for n in Recipe.decode(c.markers_for("changelog")["counts"], prefix=PREFIX).blob_names()
    }
    stored = set(inner.list("job/task-0/counts/changelog/"))
    newest = max(Recipe.decode(c.markers_for("changelog")["counts"], prefix=PREFIX).seq for c in checkpoints)
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
        commit_round(task, 0, model)
        for round_no in (1, 2):  # round 1's delta fails; round 2 fails again on the retry of round 1's delta
            blobs.fail, blobs.failures_left = (lambda name: name.endswith(".delta")), 1
            write_round(task, round_no, model)
            failed = task.commit({"input": str(round_no)})
            assert failed is not None
            with pytest.raises(CommitError):
                failed.result(timeout=30)
        commit_round(task, 3, model)
        assert task.metrics.counter("changelog.delta.reuploads") == 2
        assert task.metrics.counter("changelog.snapshot.uploads") == 0  # no re-base on a full snapshot
    assert restored_after_wipe(config, blobs) == model


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
                commit_round(task, round_no, model)
    if damage == "older":  # the next open adopts that snapshot and finishes a newer one, not adopted yet
        with TaskStorage.open(config, "task-0", blob_store=blobs) as task:
            assert task.metrics.counter("changelog.snapshot.adopted") == 1
            for round_no in range(3, 6):
                commit_round(task, round_no, model)
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
        checkpoint = commit_round(task, 10, model)
        recipe = Recipe.decode(checkpoint.markers_for("changelog")["counts"], prefix=PREFIX)
        assert victim not in set(recipe.blob_names())
    assert restored_after_wipe(config, blobs) == model


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
        lineage = manager.shared.stores["counts"]  # the test waits on the backend's own background future
        blobs.hold = lambda name: "/snapshot/" in name
        try:
            for round_no in range(2):  # the second commit starts a background snapshot
                commit_round(task, round_no, model)
            assert blobs.held.wait(30), "the background snapshot never started uploading"
            (snapshot_blob,) = [name for name in blobs.put_names if "/snapshot/" in name]
            staged = Path(task.stores["counts"].path) / STAGING_DIR / snapshot_blob.rsplit("/", 1)[-1]
            for round_no in range(2, 5):  # durable commits past the snapshot's seq, each followed by its cleanup
                commit_round(task, round_no, model)
            pool.submit(lambda: None).result(timeout=30)  # the last commit's cleanup has run too
            assert task.metrics.counter("commit.cleanup.failures") == 0
            assert staged.exists(), "cleanup deleted the staged file of a snapshot that is still uploading"
        finally:  # a failing assertion must not leave the upload held until its own timeout
            blobs.release.set()
        background = lineage.background
        assert background is not None
        assert background.exception(timeout=30) is None
        checkpoint = commit_round(task, 5, model)
        assert task.metrics.counter("changelog.snapshot.failures") == 0
        assert task.metrics.counter("changelog.snapshot.adopted") == 1
        recipe = Recipe.decode(checkpoint.markers_for("changelog")["counts"], prefix=PREFIX)
        assert recipe.snapshot is not None and recipe.snapshot.seq == 2
    assert not staged.exists()  # uploaded, then removed by the upload itself
    assert restored_after_wipe(config, blobs) == model


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
        lineage = manager.shared.stores["counts"]  # the test waits on the backend's own background future
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
            manager.cleanup(checkpoint.checkpoint_id, dict(checkpoint.markers_for("changelog"))).result(timeout=30)
    entries = CheckpointLog(blobs, "job", "task-0").entries()
    assert [e.checkpoint.input_offsets["input"] for e in entries] == [
        previous.input_offsets["input"],
        newest.input_offsets["input"],
    ]
    for entry in entries:
        shutil.rmtree(tmp_path / "local")
        with TaskStorage.open(config, "task-0", blob_store=blobs, checkpoint=entry) as task:
            assert contents(task) == models[entry.checkpoint.input_offsets["input"]]
