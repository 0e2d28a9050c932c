"""A Hypothesis state machine over a task's life: puts, deletes, durable commits, commits whose upload fails, crashes
(local dir kept or wiped) and restores, checked against two dicts: the state the task should show now, and the state
of the last durable checkpoint.

Real LMDB stores, the real commit protocol and the changelog-delta backend on a real ``file://`` blob store in a temp
dir, with settings that make the interesting paths common: a write batch of a few records (so flushes merge spill
runs and a crash leaves LMDB ahead of every checkpoint), a background snapshot every 2 commits, and
``task.checkpoint.retained=2`` (so retention deletes blobs while the machine runs).

A crash here is the loss of the process state: the write batch, spill runs, backup bookkeeping and the commit
manager are abandoned, nothing is committed or closed gracefully; only the LMDB lock is released (by closing the
environments without a flush, which drops the batch). Work already running in background threads (a background
snapshot, a cleanup) is let finish before the crash so every example is deterministic; crashes *inside* that work are
the job of tests/test_crash.py, which kills a real process there.

Determinism: a background snapshot's upload is held back (``ControlledBlobStore.hold``) until the rule
``finish_background_snapshots`` lets it go, so whether the next commit adopts it is the machine's choice, not the
scheduler's.
"""

from __future__ import annotations

import os
import shutil
import tempfile
import threading
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest
from hypothesis import HealthCheck, settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, precondition, rule
from statebackend.backends.changelog.backup import ChangelogBackupManager

from statebackend.blobstores.file import FileBlobStore
from statebackend.errors import CommitError
from statebackend.task import TaskStorage
from statebackend.testing.controlled import ControlledBlobStore

TASK = "task-0"
#: a RAM-backed temp dir where there is one: an in-process crash never loses the page cache, so the fsyncs LMDB and
#: the file:// store do on every commit prove nothing here and would only make the 3000 steps slow
_FAST_TEMP = "/dev/shm" if os.path.isdir("/dev/shm") and os.access("/dev/shm", os.W_OK) else None
KEYS = st.sampled_from([f"k{i:02d}".encode() for i in range(12)])
VALUES = st.binary(min_size=0, max_size=48)


def _on_maintenance_thread() -> bool:
    return threading.current_thread().name.startswith("statebackend-maintenance")


def _commit_thread_upload(name: str) -> bool:
    """A delta or snapshot upload of the commit itself (not one of the maintenance thread's background snapshots,
    which a failure here must not hit: the commit would then succeed and the rule would test nothing)."""
    return name.endswith((".delta", ".snap")) and not _on_maintenance_thread()


def _background_snapshot_upload(name: str) -> bool:
    return name.endswith(".snap") and _on_maintenance_thread()


class TaskLifecycle(RuleBasedStateMachine):
    def __init__(self) -> None:
        super().__init__()
        self.root = Path(tempfile.mkdtemp(prefix="statebackend-machine-", dir=_FAST_TEMP))
        self.blobs = ControlledBlobStore(FileBlobStore(str(self.root / "blobs")))
        self.blobs.hold = _background_snapshot_upload
        self.config: dict[str, object] = {
            "job.name": "job",
            "state.local.dir": str(self.root / "local"),
            "blob.store.url": f"file://{self.root / 'blobs'}",
            "stores.counts.backup.factories": "changelog",
            "stores.counts.write.batch.max.bytes": 96,
            "stores.counts.lmdb.map.size": "16MiB",
            "changelog.snapshot.interval.commits": 2,
            "task.checkpoint.retained": 2,
        }
        #: what the task must show now (writes since the last commit included)
        self.current: dict[bytes, bytes] = {}
        #: the state of the last durable checkpoint, and its input offset (None: no checkpoint yet)
        self.durable: dict[bytes, bytes] = {}
        self.durable_offset: str | None = None
        self.offset = 0
        self.verifications = 0
        self.unverified_after_failure = False
        self.executor: ThreadPoolExecutor | None = None
        self.task: TaskStorage | None = None
        self._open()

    # -- rules --------------------------------------------------------------------------------------------------

    @precondition(lambda self: self.task is not None)
    @rule(key=KEYS, value=VALUES)
    def put(self, key: bytes, value: bytes) -> None:
        self._store().put(key, value)
        self.current[key] = value

    @precondition(lambda self: self.task is not None)
    @rule(key=KEYS)
    def delete(self, key: bytes) -> None:
        self._store().delete(key)
        self.current.pop(key, None)

    @precondition(lambda self: self.task is not None)
    @rule(finish_background_snapshots_first=st.booleans())
    def commit(self, finish_background_snapshots_first: bool = False) -> None:
        assert self.task is not None
        if finish_background_snapshots_first:
            self._finish_background_snapshots(self.task)
        self.offset += 1
        checkpoint = self.task.commit_durably({"input": str(self.offset)}, timeout=30)
        assert checkpoint.input_offsets == {"input": str(self.offset)}
        self.durable = dict(self.current)
        self.durable_offset = str(self.offset)
        if self.unverified_after_failure:
            # the commit after a failed one must carry the failed commit's changes too: prove it from the blob
            # store alone, in a separate local dir, without touching the running task
            self.unverified_after_failure = False
            assert self._restore_elsewhere() == self.durable

    @precondition(lambda self: self.task is not None)
    @rule(key=KEYS, value=VALUES, times=st.integers(min_value=1, max_value=3))
    def commit_with_failed_upload(self, key: bytes, value: bytes, times: int) -> None:
        """``times`` commits in a row, each with one upload failing (the second one fails re-uploading the first one's
        staged delta, so its own change set is never staged and the chain breaks): each fails, the durable state
        stays where it was, the failure surfaces once to the task, and the task goes on."""
        for _ in range(times):
            self._commit_with_failed_upload(key, value)

    def _commit_with_failed_upload(self, key: bytes, value: bytes) -> None:
        assert self.task is not None
        self.put(key, value)  # a non-empty change, so the commit has a blob to upload
        self.offset += 1
        self.blobs.fail, self.blobs.failures_left = _commit_thread_upload, 1
        try:
            pending = self.task.commit({"input": str(self.offset)})
            assert pending is not None
            with pytest.raises(CommitError):
                pending.result(timeout=30)
        finally:
            self.blobs.fail = lambda name: False
        assert self.blobs.failures_left == 0
        latest = self.task.checkpoint_log.latest()
        durable_now = None if latest is None else latest.checkpoint.input_offsets["input"]
        assert durable_now == self.durable_offset, "a failed commit must not advance the durable checkpoint"
        # reported once, through result(): waiting or committing again does not raise it a second time
        assert self.task.commit_manager.wait(timeout=30) is not None or self.durable_offset is None
        self.unverified_after_failure = True

    @precondition(lambda self: self.task is not None)
    @rule()
    def finish_background_snapshots(self) -> None:
        """Let a held background snapshot upload; the next commit then starts its recipe from it."""
        assert self.task is not None
        self._finish_background_snapshots(self.task)

    @precondition(lambda self: self.task is not None)
    @rule(wipe_local_dir=st.booleans())
    def crash(self, wipe_local_dir: bool) -> None:
        assert self.task is not None
        task, self.task = self.task, None
        self._let_background_work_finish(task)
        for store in task.stores.values():
            store.close()  # drops the write batch and spill runs; releases the LMDB lock; commits nothing
        if wipe_local_dir:
            shutil.rmtree(self.root / "local")
        self.current = dict(self.durable)

    @precondition(lambda self: self.task is not None)
    @rule()
    def close_and_reopen(self) -> None:
        """A graceful restart: unflushed writes belong to no commit and are dropped; local state is reused."""
        assert self.task is not None
        self._finish_background_snapshots(self.task)
        self.task.close()
        self.task = None
        self.current = dict(self.durable)
        self._open()

    @precondition(lambda self: self.task is None)
    @rule()
    def restore(self) -> None:
        self._open()

    # -- checks -------------------------------------------------------------------------------------------------

    @invariant()
    def task_shows_the_current_model(self) -> None:
        if self.task is not None:
            assert dict(self._store().items()) == self.current
            assert self._store().count() == len(self.current)

    def teardown(self) -> None:
        self.blobs.release.set()  # nothing may stay held once the example ends
        try:
            if self.task is not None:
                self.task.close()
        finally:
            if self.executor is not None:
                self.executor.shutdown(wait=True)
            shutil.rmtree(self.root, ignore_errors=True)

    # -- helpers ------------------------------------------------------------------------------------------------

    def _open(self) -> None:
        """Open (restore) the task and check it came back at exactly the last durable checkpoint."""
        if self.executor is not None:
            self.executor.shutdown(wait=True)
        # a private commit pool per incarnation, so a crash can wait for exactly this incarnation's cleanups
        self.executor = ThreadPoolExecutor(max_workers=2, thread_name_prefix="machine-commit")
        self.task = TaskStorage.open(self.config, TASK, blob_store=self.blobs, executor=self.executor)
        restored = self.task.restored
        assert (None if restored is None else restored.input_offsets["input"]) == self.durable_offset
        assert dict(self._store().items()) == self.durable
        self.current = dict(self.durable)

    def _store(self):  # type: ignore[no-untyped-def]
        assert self.task is not None
        return self.task.store("counts")

    def _finish_background_snapshots(self, task: TaskStorage) -> None:
        self.blobs.release.set()
        for binding in task.commit_manager.backups:
            manager = binding.manager
            assert isinstance(manager, ChangelogBackupManager)
            for lineage in manager.shared.stores.values():  # private: the one handle on the background job
                if lineage.background is not None:
                    lineage.background.exception(timeout=30)
        self.blobs.release = threading.Event()  # hold the next one again (none is running now)

    def _let_background_work_finish(self, task: TaskStorage) -> None:
        self._finish_background_snapshots(task)
        assert self.executor is not None
        self.executor.shutdown(wait=True)  # cleanups and checkpoint-log retention of this incarnation
        self.executor = None

    def _restore_elsewhere(self) -> dict[bytes, bytes]:
        self.verifications += 1
        config = dict(self.config, **{"state.local.dir": str(self.root / f"verify-{self.verifications}")})
        with TaskStorage.open(config, TASK, blob_store=self.blobs, executor=self.executor) as other:
            return dict(other.store("counts").items())


TaskLifecycle.TestCase.settings = settings(
    max_examples=100,
    stateful_step_count=30,
    deadline=None,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.filter_too_much],
)
test_task_lifecycle_matches_the_model_at_the_last_durable_checkpoint = TaskLifecycle.TestCase


def test_background_snapshot_finishing_after_a_broken_chain_does_not_fail_the_next_commit(tmp_path: Path) -> None:
    """Regression: two failed commits in a row break the delta chain (the second one's change set is never staged)
    and schedule a re-base; a background snapshot of an older version that finishes afterwards must not cancel that
    re-base, or the next commit fails on the lost delta ("neither uploaded nor staged")."""
    blobs = ControlledBlobStore(FileBlobStore(str(tmp_path / "blobs")))
    blobs.hold = _background_snapshot_upload
    config = {
        "job.name": "job",
        "state.local.dir": str(tmp_path / "local"),
        "blob.store.url": f"file://{tmp_path / 'blobs'}",
        "stores.counts.backup.factories": "changelog",
        "changelog.snapshot.interval.commits": 2,
    }
    model: dict[bytes, bytes] = {}
    try:
        with TaskStorage.open(config, TASK, blob_store=blobs) as task:
            store = task.store("counts")

            def write(n: int) -> None:
                store.put(b"k%d" % n, b"v%d" % n)
                model[b"k%d" % n] = b"v%d" % n

            write(1)
            task.commit_durably({"input": "1"})
            for n in (2, 3):  # 2 starts a background snapshot of its version (held); 3's re-upload of 2 fails
                write(n)
                blobs.fail, blobs.failures_left = _commit_thread_upload, 1
                pending = task.commit({"input": str(n)})
                assert pending is not None
                with pytest.raises(CommitError):
                    pending.result(timeout=30)
                task.commit_manager.wait(timeout=30)  # reported through result(): not raised again
            blobs.fail = lambda name: False
            blobs.release.set()
            manager = task.commit_manager.backups[0].manager
            assert isinstance(manager, ChangelogBackupManager)
            for lineage in manager.shared.stores.values():
                assert lineage.background is not None
                lineage.background.exception(timeout=30)
            write(4)
            assert task.commit_durably({"input": "4"}, timeout=30).input_offsets == {"input": "4"}
    finally:
        blobs.release.set()
    shutil.rmtree(tmp_path / "local")
    with TaskStorage.open(config, TASK, blob_store=blobs) as task:
        assert dict(task.store("counts").items()) == model
