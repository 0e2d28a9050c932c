"""The backup/restore contract suite: what every state backend must do, end to end through TaskStorage and the
commit protocol on real LMDB.

A backend's test module subclasses :class:`BackendContract` and sets ``backup_factories`` (the value of
``stores.counts.backup.factories``) and, if needed, ``extra_config``. The blob store is the in-memory fake by default
(it passes the blob store contract suite); override the ``blobs`` fixture to run the suite on Azurite or S3.
``backend_prefix`` is where the backend keeps the store's blobs, used by the corruption tests.
"""

from __future__ import annotations

import shutil
import threading
import uuid
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any, ClassVar

import pytest

from statebackend.blobstores.base import BlobStore
from statebackend.blobstores.memory import MemoryBlobStore
from statebackend.errors import CommitError, CommitTimeoutError, CorruptDataError, NotFoundError
from statebackend.task import TaskStorage
from statebackend.testing.controlled import ControlledBlobStore

__all__ = ["BackendContract", "contents", "write_round"]


def contents(task: TaskStorage, name: str = "counts") -> dict[bytes, bytes]:
    return dict(task.store(name).items())


def write_round(task: TaskStorage, round_no: int, model: dict[bytes, bytes], keys: int = 50) -> None:
    """Deterministic puts and deletes over 200 keys, mirrored into ``model``."""
    store = task.store("counts")
    for i in range(keys):
        key = f"k{(i * 7 + round_no * 13) % 200:04d}".encode()
        if (i + round_no) % 9 == 0:
            store.delete(key)
            model.pop(key, None)
        else:
            value = f"v{round_no}-{i}".encode()
            store.put(key, value)
            model[key] = value


class BackendContract:
    backup_factories: ClassVar[str] = "changelog"
    extra_config: ClassVar[dict[str, Any]] = {}

    @pytest.fixture
    def blobs(self) -> Iterator[BlobStore]:
        with MemoryBlobStore() as store:
            yield store

    def backend_prefix(self) -> str:
        return f"job/task-0/counts/{self.backup_factories.split(',')[0]}/"

    def make_config(self, tmp_path: Path, **extra: object) -> dict[str, object]:
        config: dict[str, object] = {
            "job.name": "job",
            "state.local.dir": str(tmp_path / "local"),
            "blob.store.url": f"memory://{uuid.uuid4().hex}",
            "stores.counts.backup.factories": self.backup_factories,
            "task.checkpoint.retained": 2,
        }
        config.update(self.extra_config)
        config.update(extra)
        return config

    def test_restart_reuses_local_state_without_download(self, blobs: BlobStore, tmp_path: Path) -> None:
        config = self.make_config(tmp_path)
        model: dict[bytes, bytes] = {}
        with TaskStorage.open(config, "task-0", blob_store=blobs) as task:
            for round_no in range(5):
                write_round(task, round_no, model)
                task.commit_durably({"input": str(round_no)})
        with TaskStorage.open(config, "task-0", blob_store=blobs) as task:
            assert contents(task) == model
            assert task.metrics.counter("restore.stores.reused") == 1
            assert task.metrics.counter("restore.stores.full") == 0
            assert task.restored is not None and task.restored.input_offsets == {"input": "4"}

    def test_wiped_local_dir_restores_exactly_from_snapshot_and_deltas(self, blobs: BlobStore, tmp_path: Path) -> None:
        config = self.make_config(tmp_path)
        model: dict[bytes, bytes] = {}
        with TaskStorage.open(config, "task-0", blob_store=blobs) as task:
            for round_no in range(10):
                write_round(task, round_no, model)
                task.commit_durably({"input": str(round_no)})
            task.wait_for_commit()
        shutil.rmtree(tmp_path / "local")
        with TaskStorage.open(config, "task-0", blob_store=blobs) as task:
            assert contents(task) == model
            assert task.metrics.counter("restore.stores.full") == 1

    def test_older_local_copy_is_brought_to_the_newest_checkpoint(self, blobs: BlobStore, tmp_path: Path) -> None:
        config = self.make_config(tmp_path)
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
            assert task.metrics.counter("restore.stores.reused") == 0

    def test_uncommitted_local_changes_are_discarded_on_restore(self, blobs: BlobStore, tmp_path: Path) -> None:
        config = self.make_config(tmp_path)
        model: dict[bytes, bytes] = {}
        task = TaskStorage.open(config, "task-0", blob_store=blobs)
        write_round(task, 0, model)
        task.commit_durably({"input": "0"})
        durable = dict(model)
        write_round(task, 1, model)
        # flushed to LMDB by a commit whose upload never lands: local data is ahead of every durable checkpoint
        controlled = ControlledBlobStore(blobs)
        task.commit_manager.checkpoint_log.blob_store = controlled
        controlled.fail, controlled.failures_left = (lambda name: "checkpoints" in name), 10
        pending = task.commit({"input": "1"})
        assert pending is not None
        with pytest.raises(CommitError):
            pending.result(timeout=30)
        task.close()
        with TaskStorage.open(config, "task-0", blob_store=blobs) as again:
            assert contents(again) == durable
            assert again.metrics.counter("restore.stores.reused") == 0

    def test_failed_upload_surfaces_at_next_commit_and_does_not_poison_later_ones(
        self, blobs: BlobStore, tmp_path: Path
    ) -> None:
        blobs = ControlledBlobStore(blobs)
        config = self.make_config(tmp_path)
        model: dict[bytes, bytes] = {}
        with TaskStorage.open(config, "task-0", blob_store=blobs) as task:
            write_round(task, 0, model)
            task.commit_durably({"input": "0"})
            prefix = self.backend_prefix()
            # the commit's own upload fails; a background snapshot (changelog) must not take the injected failure
            blobs.fail = lambda name: name.startswith(prefix) and "/snapshot/" not in name
            blobs.failures_left = 1
            write_round(task, 1, model)
            failed = task.commit({"input": "1"})
            assert failed is not None
            with pytest.raises(CommitError):
                failed.result(timeout=30)
            # reported once, through result(): the next commit commits anew instead of raising it again
            again = task.commit({"input": "1b"})
            assert again is not None and again.result(timeout=30).input_offsets == {"input": "1b"}
            # a failure nobody saw is raised once by the next commit, then the one after commits
            blobs.failures_left = 1
            write_round(task, 2, model)
            unseen = task.commit({"input": "2a"})
            assert unseen is not None
            assert unseen.future.exception(timeout=30) is not None
            with pytest.raises(CommitError, match="previous commit failed|injected"):
                task.commit({"input": "2b"})
            checkpoint = task.commit_durably({"input": "2"})
            assert checkpoint.input_offsets == {"input": "2"}
            assert task.metrics.counter("commit.failures") == 2
        shutil.rmtree(tmp_path / "local")
        with TaskStorage.open(config, "task-0", blob_store=blobs) as task:
            assert contents(task) == model

    def test_commit_is_skipped_while_upload_runs_within_max_delay(self, blobs: BlobStore, tmp_path: Path) -> None:
        blobs = ControlledBlobStore(blobs)
        config = self.make_config(tmp_path, **{"task.commit.max.delay.ms": 3_600_000})
        model: dict[bytes, bytes] = {}
        with TaskStorage.open(config, "task-0", blob_store=blobs) as task:
            prefix = self.backend_prefix()
            blobs.hold = (lambda name: name.startswith(prefix))
            write_round(task, 0, model)
            first = task.commit({"input": "0"})
            assert first is not None
            assert blobs.held.wait(30)
            write_round(task, 1, model)
            assert task.commit({"input": "1"}) is None
            assert task.metrics.counter("commit.skips") == 1
            blobs.release.set()
            assert first.result(timeout=30).input_offsets == {"input": "0"}
            # the skipped commit's changes ride with the next one
            task.commit_durably({"input": "2"})
        shutil.rmtree(tmp_path / "local")
        with TaskStorage.open(config, "task-0", blob_store=blobs) as task:
            assert contents(task) == model

    def test_commit_blocks_past_max_delay_then_times_out(self, blobs: BlobStore, tmp_path: Path) -> None:
        blobs = ControlledBlobStore(blobs)
        config = self.make_config(tmp_path, **{"task.commit.max.delay.ms": 0, "task.commit.timeout.ms": 50})
        model: dict[bytes, bytes] = {}
        with TaskStorage.open(config, "task-0", blob_store=blobs) as task:
            prefix = self.backend_prefix()
            blobs.hold = (lambda name: name.startswith(prefix))
            write_round(task, 0, model)
            first = task.commit({"input": "0"})
            assert first is not None and blobs.held.wait(30)
            with pytest.raises(CommitTimeoutError, match="task.commit.timeout.ms"):
                task.commit({"input": "1"})
            assert task.metrics.counter("commit.blocks") == 1
            assert task.metrics.counter("commit.timeouts") == 1
            blobs.release.set()
            first.result(timeout=30)

    def test_blocked_commit_proceeds_when_the_upload_ends(self, blobs: BlobStore, tmp_path: Path) -> None:
        blobs = ControlledBlobStore(blobs)
        config = self.make_config(tmp_path, **{"task.commit.max.delay.ms": 0, "task.commit.timeout.ms": 60_000})
        model: dict[bytes, bytes] = {}
        with TaskStorage.open(config, "task-0", blob_store=blobs) as task:
            calls = {"n": 0}

            def hold_first_delta(name: str) -> bool:
                if name.startswith(self.backend_prefix()):
                    calls["n"] += 1
                    return calls["n"] == 1
                return False

            blobs.hold = hold_first_delta
            write_round(task, 0, model)
            first = task.commit({"input": "0"})
            assert first is not None and blobs.held.wait(30)
            # the manager's clock says the upload is past max delay; release it only once the commit is blocking
            def release_when_blocked() -> None:
                while task.metrics.counter("commit.blocks") == 0:
                    threading.Event().wait(0.005)
                blobs.release.set()

            releaser = threading.Thread(target=release_when_blocked)
            releaser.start()
            write_round(task, 1, model)
            second = task.commit({"input": "1"})
            releaser.join()
            assert second is not None
            assert second.result(timeout=30).input_offsets == {"input": "1"}
            assert task.metrics.counter("commit.blocks") == 1
            assert task.metrics.counter("commit.skips") == 0

    def damage_then_restore(
        self,
        blobs: BlobStore,
        tmp_path: Path,
        *,
        rounds: int,
        damage: Callable[[BlobStore, str], None],
        errors: type[BaseException] | tuple[type[BaseException], ...],
    ) -> tuple[list[str], pytest.ExceptionInfo[BaseException]]:
        """Commit ``rounds`` rounds, damage every blob under the backend's prefix, wipe the local dir and restore:
        the restore must raise one of ``errors``. Returns the damaged names and the raised error."""
        config = self.make_config(tmp_path)
        with TaskStorage.open(config, "task-0", blob_store=blobs) as task:
            for round_no in range(rounds):
                write_round(task, round_no, {})
                task.commit_durably({"input": str(round_no)})
        victims = list(blobs.list(self.backend_prefix()))
        assert victims, "the backend wrote no blobs under its prefix"
        for victim in victims:
            damage(blobs, victim)
        shutil.rmtree(tmp_path / "local")
        with pytest.raises(errors) as excinfo:
            TaskStorage.open(config, "task-0", blob_store=blobs)
        return victims, excinfo

    def test_flipped_byte_in_backend_blobs_is_detected_and_never_applied(
        self, blobs: BlobStore, tmp_path: Path
    ) -> None:
        def flip_a_byte(store: BlobStore, name: str) -> None:
            data = bytearray(store.get(name))
            data[len(data) // 2] ^= 0x01
            store.put(name, bytes(data))

        victims, excinfo = self.damage_then_restore(blobs, tmp_path, rounds=3, damage=flip_a_byte,
                                                    errors=CorruptDataError)
        assert any(victim in str(excinfo.value) for victim in victims)

    def test_truncated_backend_blobs_are_detected(self, blobs: BlobStore, tmp_path: Path) -> None:
        def cut_short(store: BlobStore, name: str) -> None:
            data = store.get(name)
            store.put(name, data[: len(data) // 3])

        victims, excinfo = self.damage_then_restore(blobs, tmp_path, rounds=3, damage=cut_short,
                                                    errors=CorruptDataError)
        assert any(victim in str(excinfo.value) for victim in victims)

    def test_missing_backend_blob_is_an_error_naming_it(self, blobs: BlobStore, tmp_path: Path) -> None:
        victims, excinfo = self.damage_then_restore(blobs, tmp_path, rounds=1, damage=lambda store, name:
                                                    store.delete(name), errors=(NotFoundError, CorruptDataError))
        assert any(victim in str(excinfo.value) for victim in victims)

    def test_empty_commits_and_deleting_everything_restore_exactly(self, blobs: BlobStore, tmp_path: Path) -> None:
        config = self.make_config(tmp_path)
        model: dict[bytes, bytes] = {}
        with TaskStorage.open(config, "task-0", blob_store=blobs) as task:
            write_round(task, 0, model)
            task.commit_durably({"input": "0"})
            task.commit_durably({"input": "1"})  # no change
            store = task.store("counts")
            for key in list(model):
                store.delete(key)
            model.clear()
            task.commit_durably({"input": "2"})
        shutil.rmtree(tmp_path / "local")
        with TaskStorage.open(config, "task-0", blob_store=blobs) as task:
            assert contents(task) == model == {}
            assert task.restored is not None and task.restored.input_offsets == {"input": "2"}

    def test_second_attempt_committing_the_same_checkpoint_is_detected(self, blobs: BlobStore, tmp_path: Path) -> None:
        config_a = self.make_config(tmp_path / "a")
        config_b = dict(config_a, **{"state.local.dir": str(tmp_path / "b" / "local")})
        model: dict[bytes, bytes] = {}
        with TaskStorage.open(config_a, "task-0", blob_store=blobs) as task:
            write_round(task, 0, model)
            task.commit_durably({"input": "0"})
        attempt_a = TaskStorage.open(config_a, "task-0", blob_store=blobs)
        attempt_b = TaskStorage.open(config_b, "task-0", blob_store=blobs)
        try:
            write_round(attempt_a, 1, {})
            write_round(attempt_b, 2, {})
            attempt_a.commit_durably({"input": "1"})
            with pytest.raises(CommitError, match="another attempt"):
                attempt_b.commit_durably({"input": "1"})
        finally:
            attempt_a.close()
            attempt_b.close()
