"""The backend contract suite's tests of faults: uploads under load, torn (emptied) blobs, a restore that fails
half-way, and processes killed at random instants. Part of
:class:`statebackend.testing.backend_contract.BackendContract` (import the suite from there); each test's docstring
says the data loss it catches."""

from __future__ import annotations

import json
import os
import shutil
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import ClassVar

import pytest

from statebackend.blobstores.base import BlobStore
from statebackend.commit import PendingCommit
from statebackend.errors import CommitError, CommitTimeoutError, CorruptDataError, StorageError
from statebackend.task import TaskStorage
from statebackend.testing.backend_base import BackendContractBase
from statebackend.testing.backend_support import contents, flood, write_round
from statebackend.testing.controlled import GatedExecutor
from statebackend.testing.kills import KillSpec, kill_rounds

__all__ = ["FaultTests"]


class FaultTests(BackendContractBase):
    """Fault tests of the backend suite (see the module docstring)."""

    #: modules the child process of the kill test imports before it opens the task (a backend that registers
    #: itself at import); the backend itself is resolved by its name, as a job resolves it
    child_imports: ClassVar[tuple[str, ...]] = ()
    #: how many times the kill test kills a committing process (each round costs about half a second)
    kill_rounds: ClassVar[int] = 3

    def test_uploads_of_tasks_committing_at_once_resolve_only_once_written(
        self, blobs: BlobStore, tmp_path: Path
    ) -> None:
        """Catches an upload that resolves (so its checkpoint is written) before its blobs are, only under load:
        two tasks of the process committing at once, each a large change set (1,500 keys). Every write of the
        backend's uploads is held, then fails: neither commit may complete, both must fail, and each task must
        restore its last durable checkpoint."""
        blobs = self.controlled(blobs)
        config = self.make_config(tmp_path)
        names = ("task-0", "task-1")
        prefixes = [f"job/{name}/counts/{self.backend}/" for name in names]
        models: dict[str, dict[bytes, bytes]] = {name: {} for name in names}
        pool = ThreadPoolExecutor(4, thread_name_prefix="contract-load")
        tasks = {name: TaskStorage.open(config, name, blob_store=blobs, executor=pool) for name in names}
        try:
            for name, task in tasks.items():
                write_round(task, 0, models[name])
                task.commit_durably({"input": "0"})
            durable = {name: dict(model) for name, model in models.items()}
            blobs.hold = lambda blob: any(blob.startswith(p) for p in prefixes) and "/snapshot/" not in blob
            blobs.fail_held = True
            pending: dict[str, PendingCommit] = {}
            for name, task in tasks.items():
                flood(task, "load", models[name], keys=1_500)
                started = task.commit({"input": "1"})
                assert started is not None
                pending[name] = started
            assert blobs.held.wait(self.wait_s)
            # both uploads in flight at once before anything is checked: the second one's start may lag (its flush
            # applied first, on a loaded machine); a backend that runs the uploads of a process one at a time never
            # holds both, and is checked after this wait (at most 5 s) all the same
            deadline = time.monotonic() + min(self.wait_s, 5.0)
            while (
                not all(any(held.startswith(p) for held in list(blobs.held_names)) for p in prefixes)
                and time.monotonic() < deadline
            ):
                time.sleep(0.01)
            for name in names:
                assert not pending[name].done(), (
                    f"{name}: the commit was durable while the backend's writes were still held (two at once)"
                )
            blobs.release.set()
            for name in names:
                with pytest.raises(CommitError) as failed:
                    pending[name].result(timeout=self.wait_s)
                assert not isinstance(failed.value, CommitTimeoutError), f"{name}: the failed write was never reported"
        finally:
            blobs.release.set()
            for task in tasks.values():
                task.close()
            pool.shutdown()
        shutil.rmtree(tmp_path / "local")
        for name in names:
            with TaskStorage.open(config, name, blob_store=blobs) as task:
                assert contents(task) == durable[name], f"{name} did not restore its last durable checkpoint"
                assert task.restored is not None and task.restored.input_offsets == {"input": "0"}

    @pytest.mark.parametrize("uploader", ["this_attempt", "another_attempt"])
    def test_cleanup_never_deletes_what_a_later_upload_just_wrote(
        self, blobs: BlobStore, tmp_path: Path, uploader: str
    ) -> None:
        """Catches a cleanup that deletes blobs no checkpoint names yet, those a later upload just wrote included
        (its checkpoint is about to name them): the race of a cleanup with the next commit, made certain, of this
        attempt of the task and of another one (a retried or speculative task that restored the same checkpoint;
        a cleanup that spares only its own manager's uploads fails there). The first listing under the backend's
        prefix after commit 3's checkpoint write (its cleanup's) is held until commit 4's upload has written its
        blobs and commit 4's checkpoint write is held; then the cleanup runs to its end, the checkpoint is written,
        and it must restore exactly. A backend whose cleanup does not list within half a second is not held (the
        race is then not provoked, the rest still checked)."""
        blobs = self.controlled(blobs)
        config = self.make_config(tmp_path)
        pool = GatedExecutor(4, gate_timeout_s=2 * self.wait_s)
        model: dict[bytes, bytes] = {}
        other: TaskStorage | None = None
        try:
            with TaskStorage.open(config, "task-0", blob_store=blobs, executor=pool) as task:
                for round_no in range(3):
                    write_round(task, round_no, model)
                    task.commit_durably({"input": str(round_no)})
                start, armed = len(blobs.put_names), [True]

                def cleanup_listing(prefix: str) -> bool:
                    if not armed[0] or not prefix.startswith(self.backend_prefix()):
                        return False
                    if not any("/checkpoints/" in name for name in blobs.put_names[start:]):
                        return False  # commit 3's own upload, before its checkpoint
                    armed[0] = False
                    return True

                blobs.hold_listing = cleanup_listing
                write_round(task, 3, model)
                task.commit_durably({"input": "3"})
                blobs.listing_held.wait(0.5)
                armed[0] = False  # a cleanup that did not list by now is not held; nothing else may be
                committer = task
                if uploader == "another_attempt":
                    again = dict(config, **{"state.local.dir": str(tmp_path / "other")})
                    committer = other = TaskStorage.open(again, "task-0", blob_store=blobs, executor=pool)
                    assert contents(other) == model
                blobs.hold = lambda name: "/checkpoints/" in name
                write_round(committer, 4, model)
                later = committer.commit({"input": "4"})
                assert later is not None and blobs.held.wait(self.wait_s), "commit 4 never wrote its checkpoint"
                blobs.listing_release.set()
                for thread in blobs.listing_threads:
                    assert pool.task_ended(thread, self.wait_s), "the held cleanup did not end"
                blobs.release.set()
                assert later.result(timeout=self.wait_s).input_offsets == {"input": "4"}
                if other is not None:
                    other.close()
        finally:
            blobs.listing_release.set()
            blobs.release.set()
            if other is not None:
                other.close()
            pool.shutdown()
        shutil.rmtree(tmp_path / "local")
        with TaskStorage.open(config, "task-0", blob_store=blobs) as task:
            assert contents(task) == model, "the checkpoint of the upload that raced a cleanup restored other state"
            assert task.restored is not None and task.restored.input_offsets == {"input": "4"}

    def test_a_failed_write_of_any_store_fails_the_commit(self, blobs: BlobStore, tmp_path: Path) -> None:
        """Catches an upload that reports the failure of one store's write only (the first store's, say): the
        checkpoint of a two-store task then names a blob that never landed. The writes of each store fail in
        turn; each commit must fail, and the task then restores exactly its last durable checkpoint."""
        blobs = self.controlled(blobs)
        config = self.make_config(tmp_path, **self.store_config("totals"))
        models: dict[str, dict[bytes, bytes]] = {"counts": {}, "totals": {}}
        with TaskStorage.open(config, "task-0", blob_store=blobs) as task:
            for round_no, victim in enumerate((None, "counts", "totals", None)):
                write_round(task, round_no, models["counts"])
                write_round(task, round_no + 50, models["totals"], store="totals")
                if victim is None:
                    task.commit_durably({"input": str(round_no)})
                    continue
                # every write under the store's prefix fails until the commit ends: its own (however often a
                # backend tries it) and any background one (a compaction's, which may come first and must not use
                # up the failure meant for the commit's write)
                blobs.fail = _commit_writes_under(self.backend_prefix(victim))
                blobs.failures_left = 1_000_000
                failed = task.commit({"input": str(round_no)})
                assert failed is not None
                with pytest.raises(CommitError):
                    failed.result(timeout=self.wait_s)
                blobs.failures_left = 0
        shutil.rmtree(tmp_path / "local")
        with TaskStorage.open(config, "task-0", blob_store=blobs) as task:
            assert {name: contents(task, name) for name in models} == models
            assert task.restored is not None and task.restored.input_offsets == {"input": "3"}

    def test_a_replayed_checkpoint_restores_exactly_over_a_superseded_local_copy(
        self, blobs: BlobStore, tmp_path: Path
    ) -> None:
        """Catches a catch-up that places a local copy in the checkpoint's chain by checkpoint order instead of by
        its exact version. A replay restores an older checkpoint and commits past it (``fence_seq``), superseding
        the newer ones; a machine whose local copy holds a superseded checkpoint (newer than the replay's base,
        older than its commits) must then restore exactly the replay's newest checkpoint, not the replayed steps on
        top of changes the replay undid."""
        config = self.make_config(tmp_path, **{"task.checkpoint.retained": 4})
        model: dict[bytes, bytes] = {}
        models: dict[int, dict[bytes, bytes]] = {}
        with TaskStorage.open(config, "task-0", blob_store=blobs) as task:
            for round_no in range(5):
                write_round(task, round_no, model)
                task.commit_durably({"input": str(round_no)})
                models[task.committed_seq] = dict(model)
            head = task.committed_seq
            base = task.checkpoint_log.entries()[-3]
        shutil.copytree(tmp_path / "local", tmp_path / "superseded")
        model = dict(models[base.seq])
        with TaskStorage.open(config, "task-0", blob_store=blobs, checkpoint=base, fence_seq=head) as task:
            assert contents(task) == model
            for round_no in (30, 31):
                write_round(task, round_no, model)
                task.commit_durably({"input": f"replay-{round_no}"})
        shutil.rmtree(tmp_path / "local")
        shutil.move(tmp_path / "superseded", tmp_path / "local")
        with TaskStorage.open(config, "task-0", blob_store=blobs) as task:
            assert contents(task) == model, "a superseded local copy was brought to the replay's checkpoint wrong"
            assert task.restored is not None and task.restored.input_offsets == {"input": "replay-31"}
            assert task.metrics.counter("restore.stores.reused") == 0

    def test_emptied_backend_blobs_are_detected(
        self, blobs: BlobStore, tmp_path: Path, caplog: pytest.LogCaptureFixture
    ) -> None:
        """Catches a restore that takes an empty blob (a write torn before its first byte, as a crash leaves it on
        some stores) for a step without changes: every blob of the backend is emptied."""

        def empty(store: BlobStore, names: list[str]) -> list[str]:
            for name in names:
                store.put(name, b"")
            return names

        victims, text = self.restore_after_damage(
            blobs, tmp_path, caplog, rounds=3, damage=empty, errors=CorruptDataError
        )
        assert any(victim in text for victim in victims)

    def test_a_restore_that_fails_half_way_is_never_taken_for_whole(self, blobs: BlobStore, tmp_path: Path) -> None:
        """Catches a restore that loads its blobs one by one, each step labelled with the checkpoint's version: when
        a read fails half-way (every read of the backend's blobs after the first fails), the store must be left at
        a version of the chain or as it was, never "at the checkpoint" with part of its data, and the next restore
        must give exactly the checkpoint's state (alone the failed open raises a storage error; in a dual commit it
        falls back)."""
        blobs = self.controlled(blobs)
        config = self.make_config(tmp_path)
        model: dict[bytes, bytes] = {}
        with TaskStorage.open(config, "task-0", blob_store=blobs) as task:
            for round_no in range(4):
                write_round(task, round_no, model)
                task.commit_durably({"input": str(round_no)})
        shutil.rmtree(tmp_path / "local")
        reads = {"n": 0}

        def after_the_first(name: str) -> bool:
            if not name.startswith(self.backend_prefix()):
                return False
            reads["n"] += 1
            return reads["n"] > 1

        blobs.fail_read = after_the_first
        try:
            with TaskStorage.open(config, "task-0", blob_store=blobs) as task:
                # a backend that read one blob only (or the fallback of a dual commit) restored: exactly, then
                assert contents(task) == model, "a restore whose reads failed gave other state without an error"
        except StorageError:
            assert self.dual_with is None, f"a failed read of {self.backend} did not fall back to {self.dual_with}"
        blobs.fail_read = lambda name: False
        with TaskStorage.open(config, "task-0", blob_store=blobs) as task:
            assert contents(task) == model, "the restore after one that failed half-way did not give the checkpoint"

    def test_sigkilled_commits_restore_exactly_the_newest_durable_checkpoint(self, tmp_path: Path) -> None:
        """Catches what only a crash shows: a child process, the backend resolved by its name from the suite's
        config (``extra_config`` included), commits deterministic data and is killed with SIGKILL at random
        instants (:mod:`statebackend.testing.kills`); after each kill the newest checkpoint must hold every
        acknowledged commit, the next process must restore exactly it on the local dir the kill left, and so must
        a fresh local dir. The last kill lands in a full restore. Runs on a ``file://`` store under the test's
        temp dir (the in-memory store is not shared by processes)."""
        workdir = tmp_path / "kills"
        config = self.make_config(
            workdir, **{"blob.store.url": f"file://{workdir / 'blobs'}", "stores.counts.write.batch.max.bytes": 2048}
        )
        try:
            json.dumps(config)
        except TypeError as exc:
            pytest.skip(
                f"extra_config holds values a child process cannot be given as JSON ({exc}): the kill test "
                "needs settings that are strings, numbers or booleans"
            )
        seed = os.environ.get("STATEBACKEND_KILL_SEED", type(self).__name__)
        kill_rounds(
            KillSpec(config=config, imports=self.child_imports),
            workdir,
            rounds=self.kill_rounds,
            seed=seed,
            wait_s=self.wait_s,
        )


def _commit_writes_under(prefix: str) -> Callable[[str], bool]:
    """Whether a write is a commit's upload under ``prefix`` (a background snapshot's is not)."""
    return lambda name: name.startswith(prefix) and "/snapshot/" not in name
