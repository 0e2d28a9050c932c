"""TaskCommitManager: makes a task's state and its input position durable together.

One commit, in this order:

1. If the previous commit's async part failed and nobody has seen that failure yet (its ``PendingCommit.result()``
   was not called), raise it now, once (``CommitError`` from it), or count it and go on while fewer than
   ``task.commit.async.failures.tolerated`` failures ran in a row. A failure already reported is not raised again:
   this commit simply commits anew (its change set includes the failed commit's changes).
2. If the previous async part is still running: when it started less than ``task.commit.max.delay.ms`` ago, **skip**
   this commit (the changes stay in the write batch and ride with the next); otherwise **block** until it ends, at
   most ``task.commit.timeout.ms``, then fail with :class:`CommitTimeoutError`.
3. Sync part, on the caller's thread: flush every store (one LMDB transaction each), a new checkpoint id, every
   backup manager's ``snapshot()``.
4. Async part, on the bounded pool shared by the tasks of the process: every backend's ``upload()`` in parallel;
   then the CheckpointV2 is written to the checkpoint log: on a blob store with conditional writes, one
   compare-and-swap of the task's checkpoint head with the version seen at the restore decision (or at this task's
   previous commit), which is the commit point and the fence at once; elsewhere a create-only write of the seq's
   blob (first writer of a sequence number wins) and a listing that checks that no newer checkpoint exists. Either
   way a competing or zombie attempt gets :class:`CommitConflictError`, never tolerated; then ``CHECKPOINT-V2`` in each
   store dir; then ``cleanup()`` and checkpoint-log retention, fed by that listing, once it has
   ``CheckpointLog.retention_interval`` old checkpoints to delete in one request, and ``after_durable`` (the
   metrics textfile), whose work :meth:`TaskCommitManager.close` waits for like a cleanup.

The sequence number written is the one after the head seen when the task was restored, then one more per durable
commit. A checkpoint write whose outcome is unknown (the reply was lost and every retry failed) is resolved before
the next write: if the blob holds exactly that checkpoint (on the head: the entry of that seq carries the nonce of
this writer's write, read back with one GET), it did land and the next commit takes the next seq; if it is absent,
the seq is still free; anything else is a conflict.

The async part never waits on a pool future from inside the pool: the steps are chained with callbacks, so a pool
of any size cannot deadlock however many tasks commit at once.
"""

from __future__ import annotations

import logging
import os
import secrets
import threading
import time
from collections.abc import Callable, Mapping, Sequence
from concurrent.futures import Executor, Future, ThreadPoolExecutor, wait
from concurrent.futures import TimeoutError as FutureTimeoutError
from typing import Any

import attrs

from statebackend.checkpoint import (
    CheckpointId,
    CheckpointIdGenerator,
    CheckpointLog,
    CheckpointV2,
    write_local_checkpoint,
)
from statebackend.concurrency import SharedPools, when_all
from statebackend.contracts import StoreMarkers, TaskBackupManager
from statebackend.crashpoints import crashpoint
from statebackend.errors import AlreadyExistsError, CommitConflictError, CommitError, CommitTimeoutError
from statebackend.kit.lifetime import collector_of
from statebackend.metrics import Metrics
from statebackend.store import ChangeSet, LocalStore, LocalVersion

__all__ = ["BackupBinding", "PendingCommit", "TaskCommitManager", "shared_commit_pool"]

log = logging.getLogger(__name__)

_commit_pools = SharedPools("statebackend-commit")


def shared_commit_pool(size: int) -> ThreadPoolExecutor:
    """The process-wide commit pool of the given size (one per size, created on first use)."""
    return _commit_pools.get(size)


@attrs.frozen
class BackupBinding:
    """One backend's backup manager and the stores it backs up. A backend may have several (one per group of stores
    with equal options): their markers are merged under the backend's name in the checkpoint, and each manager's
    cleanup gets its own stores' markers."""

    factory_name: str
    manager: TaskBackupManager
    store_names: tuple[str, ...]


@attrs.define(eq=False)
class PendingCommit:
    """A commit whose sync part is done. ``result()`` waits until its checkpoint is durable."""

    checkpoint_id: CheckpointId
    #: the checkpoint log seq this commit writes (fixed when its checkpoint is written)
    seq: int
    future: Future[CheckpointV2]
    started: float
    #: set once the failure was raised to a caller, so the next commit does not raise it again
    reported: bool = False

    def result(self, timeout: float | None = None) -> CheckpointV2:
        """The durable checkpoint; raises :class:`CommitError` when the async part failed."""
        try:
            return self.future.result(timeout)
        except FutureTimeoutError as exc:
            raise CommitTimeoutError(f"commit {self.checkpoint_id} was not durable within {timeout} s") from exc
        except BaseException:
            self.reported = True
            raise

    def done(self) -> bool:
        return self.future.done()


@attrs.define(eq=False)
class TaskCommitManager:
    """Runs the commit protocol for one task. Call :meth:`commit` from the task's thread only."""

    task_name: str
    stores: Mapping[str, LocalStore]
    backups: Sequence[BackupBinding]
    checkpoint_log: CheckpointLog
    executor: Executor
    metrics: Metrics
    max_delay_ms: int
    timeout_ms: int
    async_failures_tolerated: int = 0
    #: the sequence number the next checkpoint takes in the checkpoint log
    next_seq: int = 1
    id_generator: CheckpointIdGenerator = attrs.field(factory=CheckpointIdGenerator)
    clock: Callable[[], float] = time.monotonic
    last_checkpoint: CheckpointV2 | None = None
    #: store -> {"key": serde, "msg": serde}, recorded in every checkpoint so a changed serde is caught at restore
    serdes: Mapping[str, Mapping[str, str]] = attrs.field(factory=dict)
    #: called on the commit pool once a checkpoint is durable, before its waiter is released; it must be quick (it
    #: queues its work and returns that work's future, or None), its future is waited for by close() like a cleanup
    #: (statebackend.exporters.textfile_after_commit: the metrics textfile)
    after_durable: Callable[[], Future[Any] | None] | None = None

    _inflight: PendingCommit | None = attrs.field(init=False, default=None)
    _failure: tuple[BaseException, PendingCommit] | None = attrs.field(init=False, default=None)
    #: a checkpoint write whose outcome is unknown: (seq, checkpoint), resolved before the next write
    _uncertain: tuple[int, CheckpointV2] | None = attrs.field(init=False, default=None)
    _failures_in_a_row: int = attrs.field(init=False, default=0)
    _lock: threading.Lock = attrs.field(init=False, factory=threading.Lock)
    _cleanups: list[Future[Any]] = attrs.field(init=False, factory=list)  # backend cleanups and log retention
    _conflict: CommitConflictError | None = attrs.field(init=False, default=None)
    #: the listing of the last durable commit's fencing: retention at close deletes what it shows past ``retained``
    _last_listing: Any = attrs.field(init=False, default=None)
    #: the last durable checkpoint (id, seq) and its markers: the backends' cleanups run again for it after that
    #: retention
    _last_cleanup: tuple[CheckpointId, int, list[StoreMarkers]] | None = attrs.field(init=False, default=None)

    def __attrs_post_init__(self) -> None:
        """The backends are initialised by now: a backend whose lifetime sweeps at start has its sweep queued."""
        for binding in self.backups:
            lifetime = binding.manager.blob_lifetime()
            if lifetime is None:
                continue
            try:
                started = collector_of(lifetime).start()
            except RuntimeError:  # pool shut down: the next commit's sweep, when due, does it
                continue
            if started is not None:
                self._cleanups.append(started)

    def commit(self, input_offsets: Mapping[str, str]) -> PendingCommit | None:
        """Commit the task's state with ``input_offsets``. Returns the pending commit, or ``None`` when skipped
        because the previous upload is still within ``task.commit.max.delay.ms``."""
        self._raise_previous_failure()
        inflight = self._inflight
        if inflight is not None and not inflight.done():
            waited_ms = (self.clock() - inflight.started) * 1000.0
            if waited_ms < self.max_delay_ms:
                self.metrics.increment("commit.skips")
                log.debug(
                    "task %s: skip commit, upload of %s running for %.0f ms",
                    self.task_name,
                    inflight.checkpoint_id,
                    waited_ms,
                    extra=self._log_extra(inflight.checkpoint_id),
                )
                return None
            self.metrics.increment("commit.blocks")
            block_start = self.clock()
            try:
                inflight.future.exception(timeout=self.timeout_ms / 1000.0)
            except FutureTimeoutError:
                self.metrics.increment("commit.timeouts")
                raise CommitTimeoutError(
                    f"task {self.task_name}: the upload of checkpoint {inflight.checkpoint_id} ran longer than "
                    f"task.commit.timeout.ms={self.timeout_ms}; check the blob store's health or raise the timeout"
                ) from None
            finally:
                self.metrics.record("commit.block.ms", (self.clock() - block_start) * 1000.0)
        # again: the commit in flight may have failed since the first check (then it is raised now, before a newer
        # commit is acknowledged, never one commit late)
        self._raise_previous_failure()
        return self._commit_now(dict(input_offsets))

    @property
    def write_outcome_unknown(self) -> bool:
        """A checkpoint write's reply was lost and nothing read it back yet: the next commit may take the seq after
        it (see :meth:`_resolve_uncertain`), so that commit's seq is not known before its checkpoint is written."""
        return self._uncertain is not None

    def wait(self, timeout: float | None = None, *, raise_failure: bool = True) -> CheckpointV2 | None:
        """Wait for the commit in flight (if any) to end; raise its failure unless it was already reported (or
        ``raise_failure`` is false: then it is logged, once, and counts as reported). Returns the newest durable
        checkpoint."""
        inflight = self._inflight
        if inflight is None:
            return self.last_checkpoint
        try:
            inflight.future.exception(timeout)
        except FutureTimeoutError:
            raise CommitTimeoutError(f"commit {inflight.checkpoint_id} was not durable within {timeout} s") from None
        if raise_failure:
            self._raise_previous_failure()
        else:
            if self._conflict is not None:
                raise self._conflict
            with self._lock:
                failure, self._failure = self._failure, None
            if failure is not None and not failure[1].reported:
                failure[1].reported = True
                log.warning(
                    "task %s: the previous commit %s failed (%s); committing anew",
                    self.task_name,
                    failure[1].checkpoint_id,
                    failure[0],
                    extra=self._log_extra(failure[1].checkpoint_id),
                )
        return self.last_checkpoint

    def _log_extra(self, checkpoint_id: object = None, *, seq: int | None = None) -> dict[str, object]:
        """Fields for structured log handlers (``extra``): job, task, and the checkpoint concerned."""
        extra: dict[str, object] = {"job": getattr(self.checkpoint_log, "job_name", None), "task": self.task_name}
        if checkpoint_id is not None:
            extra["checkpoint_id"] = str(checkpoint_id)
        if seq is not None:
            extra["seq"] = seq
        return extra

    def close(self, *, handover: bool = False) -> None:
        """Wait for the commit in flight and its cleanups so no upload outlives the task; failures are logged, not
        raised. Then retention deletes what the last commit's listing showed past ``retained`` (while the task runs
        it waits for a batch's worth) and each backend's cleanup runs again for the last checkpoint (idempotent), so
        it lets go of what only those checkpoints needed: a closed task leaves exactly ``retained`` checkpoints.
        ``handover``: another process waits for this close; the requests of that last retention are left to the
        next owner's commits."""
        inflight = self._inflight
        if inflight is not None:
            try:
                inflight.future.exception(self.timeout_ms / 1000.0)
            except FutureTimeoutError:
                log.warning(
                    "task %s: closing with commit %s still running",
                    self.task_name,
                    inflight.checkpoint_id,
                    extra=self._log_extra(inflight.checkpoint_id),
                )
        if not handover:
            self._retain_at_close()
        with self._lock:
            cleanups, self._cleanups = self._cleanups, []
        _, not_done = wait(cleanups, timeout=self.timeout_ms / 1000.0)
        if not_done:
            log.warning(
                "task %s: closing with %d cleanups still running",
                self.task_name,
                len(not_done),
                extra=self._log_extra(),
            )

    def _retain_at_close(self) -> None:
        """The last retention of this task (see :meth:`close`): after the last commit's cleanups, on the closing
        thread; the backends' cleanups then run again, chained like a commit's."""
        listing, last = self._last_listing, self._last_cleanup
        if listing is None or last is None or self._conflict is not None:
            return
        if not self.checkpoint_log.retention_due(listing, closing=True):
            return
        self._last_listing = None
        with self._lock:
            running = list(self._cleanups)
        wait(running, timeout=self.timeout_ms / 1000.0)
        self.checkpoint_log.start_trim()
        try:
            self.executor.submit(self.checkpoint_log.retain, listing).result(timeout=self.timeout_ms / 1000.0)
        except Exception as exc:  # noqa: BLE001 - the next open's commits retain again; no backend deletes meanwhile
            self.metrics.increment("commit.cleanup.failures")
            log.warning(
                "task %s: retention at close failed (the next commits retry it): %s",
                self.task_name,
                exc,
                extra=self._log_extra(),
            )
            return
        checkpoint_id, seq, uploaded = last
        self._cleanup_backends(checkpoint_id, seq, uploaded)

    # -- internals ---------------------------------------------------------------------------------------------

    def _raise_previous_failure(self) -> None:
        if self._conflict is not None:
            raise self._conflict
        with self._lock:
            found, self._failure = self._failure, None
        if found is None:
            return
        failure, pending = found
        if pending.reported:  # the caller saw it through result(): this commit commits anew
            return
        pending.reported = True
        self._failures_in_a_row += 1
        if self._failures_in_a_row <= self.async_failures_tolerated:
            log.warning(
                "task %s: async commit failure %d tolerated: %s",
                self.task_name,
                self._failures_in_a_row,
                failure,
                extra=self._log_extra(),
            )
            return
        if isinstance(failure, CommitError):
            raise failure
        raise CommitError(f"task {self.task_name}: the previous commit failed: {failure}") from failure

    def _commit_now(self, input_offsets: dict[str, str]) -> PendingCommit:
        started = self.clock()
        checkpoint_id = self.id_generator.next()
        version = LocalVersion(checkpoint_id=str(checkpoint_id), token=secrets.token_hex(8))
        # The flushed batches reach LMDB after the uploads: the LMDB write is not needed for durability, and beside
        # the delta's encoding and fsyncs it slows the wait for them (measured: docs/benchmarks.md). Reads see the
        # batches in the overlay meanwhile; a snapshot's read view of one releases it at once.
        try:
            changes: dict[str, ChangeSet] = {
                name: store.flush(version, hold_apply=True) for name, store in self.stores.items()
            }
        except BaseException:
            self._start_applies()  # the stores flushed before the one that failed
            raise
        crashpoint("commit.after_flush")
        preliminary: list[StoreMarkers] = []  # by binding
        try:
            for binding in self.backups:
                preliminary.append(
                    binding.manager.snapshot(checkpoint_id, {name: changes[name] for name in binding.store_names})
                )
        except BaseException:
            self._start_applies()
            _close_all(changes)
            for binding in self.backups:  # each forgets what its snapshot() prepared for this commit
                try:
                    binding.manager.abort(checkpoint_id)
                except Exception as exc:  # noqa: BLE001 - the snapshot failure is the one to raise
                    log.warning(
                        "task %s: %s abort after a failed snapshot: %s",
                        self.task_name,
                        binding.factory_name,
                        exc,
                        extra=self._log_extra(),
                    )
            for store in self.stores.values():
                store.mark_dirty()
            raise
        crashpoint("commit.after_snapshot")
        sync_ms = (self.clock() - started) * 1000.0
        self.metrics.record("commit.sync.ms", sync_ms)
        self.metrics.increment("commit.count")

        seq = self.next_seq
        result: Future[CheckpointV2] = Future()
        result.add_done_callback(lambda _: self._start_applies())  # durable or failed: the uploads are over
        pending = PendingCommit(checkpoint_id=checkpoint_id, seq=seq, future=result, started=started)
        self._inflight = pending
        self._start_async(pending, input_offsets, preliminary, changes)
        return pending

    def _start_applies(self) -> None:
        """Release the flushed batches held back from the stores' appliers."""
        for store in self.stores.values():
            try:
                store.start_apply()
            except Exception as exc:  # noqa: BLE001 - the batch stays pending: the next flush, read view or close applies it
                log.warning(
                    "task %s: store %s: could not start applying a flushed batch: %s",
                    self.task_name,
                    store.name,
                    exc,
                    extra=self._log_extra(),
                )

    def _start_async(
        self,
        pending: PendingCommit,
        input_offsets: dict[str, str],
        preliminary: list[StoreMarkers],
        changes: dict[str, ChangeSet],
    ) -> None:
        uploads: list[Future[StoreMarkers]] = []  # by binding
        try:
            for binding, markers in zip(self.backups, preliminary, strict=True):
                uploads.append(binding.manager.upload(pending.checkpoint_id, markers))
        except BaseException as exc:  # noqa: BLE001 - an upload failing to even start fails this commit, not the task
            failure = exc  # Python unbinds ``exc`` when the except block ends, before a started upload may end

            def fail_when_started_ones_end() -> None:  # never leave an upload running behind a failed commit
                _close_all(changes)
                self._fail(pending, failure)

            when_all(list(uploads), fail_when_started_ones_end)
            return

        def after_uploads() -> None:
            self.metrics.record("commit.upload.ms", (self.clock() - pending.started) * 1000.0)
            _close_all(changes)
            errors = [error for f in uploads if (error := f.exception()) is not None]
            if errors:
                self._fail(pending, errors[0])
                return
            try:
                self.executor.submit(self._write_checkpoint, pending, input_offsets, [f.result() for f in uploads])
            except BaseException as exc:  # noqa: BLE001 - pool shut down: the commit fails, the task goes on
                self._fail(pending, exc)

        when_all(list(uploads), after_uploads)

    def _write_checkpoint(
        self, pending: PendingCommit, input_offsets: dict[str, str], uploaded: list[StoreMarkers]
    ) -> None:
        writing_started = self.clock()
        try:
            markers: dict[str, StoreMarkers] = {}  # a backend's managers back up disjoint stores
            for binding, own in zip(self.backups, uploaded, strict=True):
                markers.setdefault(binding.factory_name, {}).update(own)
            checkpoint = CheckpointV2(
                checkpoint_id=pending.checkpoint_id,
                input_offsets=input_offsets,
                state_checkpoint_markers=markers,
                serdes=self.serdes,
            )
            crashpoint("commit.before_checkpoint_write")
            writing = False
            try:
                pending.seq = self._resolve_uncertain(pending.seq)
                writing = True
                listing = self.checkpoint_log.write(pending.seq, checkpoint)
            except AlreadyExistsError as exc:
                self._uncertain = None
                for store in self.stores.values():
                    store.mark_dirty()
                self.metrics.increment("commit.conflicts")
                conflict = CommitConflictError(
                    f"task {self.task_name}: checkpoint #{pending.seq} is taken or the checkpoint log has moved past "
                    f"it: another attempt of this task committed after this one restored its state. This attempt "
                    f"is fenced and its commit discarded: reopen the task (restore) before going on ({exc})"
                )
                conflict.__cause__ = exc
                self._conflict = conflict  # never tolerated, and every later commit refuses too
                raise conflict from exc
            except BaseException:
                if writing:  # the write may have landed with its reply lost: the next write reads it back
                    self._uncertain = (pending.seq, checkpoint)
                raise
            self._uncertain = None
        except BaseException as exc:  # noqa: BLE001 - handed to the commit's future, raised by its waiter
            self._abort_backends(pending.checkpoint_id, uploaded)
            self._fail(pending, exc)
            return
        # The checkpoint is durable from here on: whatever fails below is reported, never taken for a failed commit
        # (that would retry the same, taken, sequence number).
        crashpoint("commit.after_checkpoint_write")
        self._became_durable(pending.seq, checkpoint)
        self.metrics.record("commit.checkpoint.ms", (self.clock() - writing_started) * 1000.0)
        with self._lock:  # an older commit's failure nobody saw is moot now: this checkpoint holds its changes
            if self._failure is not None and self._failure[1] is not pending:
                log.warning(
                    "task %s: commit %s failed earlier (%s); checkpoint %s now holds its changes",
                    self.task_name,
                    self._failure[1].checkpoint_id,
                    self._failure[0],
                    checkpoint.checkpoint_id,
                    extra=self._log_extra(checkpoint.checkpoint_id),
                )
                self._failure = None
        total_ms = (self.clock() - pending.started) * 1000.0
        self.metrics.record("commit.total.ms", total_ms)
        self._cleanup(
            pending.checkpoint_id, pending.seq, uploaded, listing
        )  # registered before the result: close() waits for it
        self._after_durable(pending.checkpoint_id)
        pending.future.set_result(checkpoint)

    def _resolve_uncertain(self, seq: int) -> int:
        """The seq to write, after resolving a previous write of ``seq`` whose outcome is unknown."""
        uncertain = self._uncertain
        if uncertain is None or uncertain[0] != seq:
            return seq
        if self.checkpoint_log.holds(seq, uncertain[1]):
            # It landed: it is durable only if it is still the newest (a zombie's write is removed and fenced).
            self.checkpoint_log.fence(seq)
            log.info(
                "task %s: checkpoint #%d, reported failed, did land (its reply was lost); this commit takes #%d",
                self.task_name,
                seq,
                seq + 1,
                extra=self._log_extra(seq=seq),
            )
            self.metrics.increment("commit.landed.after.failure")
            self._uncertain = None
            self._became_durable(seq, uncertain[1])
            return seq + 1
        return seq  # absent (it never landed) or someone else's: the create-only write tells

    def _became_durable(self, seq: int, checkpoint: CheckpointV2) -> None:
        """Bookkeeping once checkpoint ``seq`` is known durable: the next seq, the log's floor, the local file."""
        self.next_seq = seq + 1
        self.checkpoint_log.raise_floor(seq)
        self.last_checkpoint = checkpoint
        self._failures_in_a_row = 0
        for store in self.stores.values():
            try:
                write_local_checkpoint(store.path, checkpoint, self.checkpoint_log.binding(seq))
            except Exception as exc:  # noqa: BLE001 - only a restore shortcut and a bound on listings are lost
                self.metrics.increment("commit.local.checkpoint.failures")
                log.warning(
                    "task %s: checkpoint %s is durable but its local file in %s was not written: %s",
                    self.task_name,
                    checkpoint.checkpoint_id,
                    store.path,
                    exc,
                    extra=self._log_extra(checkpoint.checkpoint_id),
                )

    def _cleanup(
        self, checkpoint_id: CheckpointId, seq: int, uploaded: list[StoreMarkers], listing: Any = None
    ) -> None:
        # retention waits until enough old checkpoints pile up for one delete request; the backends delete what
        # their retention let go with it (CheckpointLog.trims), never blobs of a checkpoint the log still holds
        # (a retention that failed left its checkpoints: the next commit's listing shows them, so it is due again)
        trim = listing is not None and self.checkpoint_log.retention_due(listing)
        if trim:
            self.checkpoint_log.start_trim()
        # what the close trims (nothing when this commit's retention deletes all this listing shows past retained)
        self._last_listing, self._last_cleanup = (None if trim else listing), (checkpoint_id, seq, uploaded)
        self._cleanup_backends(checkpoint_id, seq, uploaded)
        if listing is not None and not trim:
            return  # too few old checkpoints yet for a delete request of their own: they go with a later one
        try:
            retention = self.executor.submit(self.checkpoint_log.retain, listing)
        except RuntimeError:
            return  # pool shut down: retention runs at the next commit
        with self._lock:
            self._cleanups.append(retention)
        retention.add_done_callback(self._report_cleanup(checkpoint_id))

    def _cleanup_backends(self, checkpoint_id: CheckpointId, seq: int, uploaded: list[StoreMarkers]) -> None:
        """After checkpoint ``checkpoint_id`` (#``seq``) is durable, per backend: on the commit pool, its
        ``checkpoint_completed`` notice and then the framework's collection of its blobs (when it states a
        :class:`~statebackend.contracts.BlobLifetime`); and its ``cleanup()`` (the earlier contract: the default
        does nothing). Each registered so :meth:`close` waits for it."""
        for binding, markers in zip(self.backups, uploaded, strict=True):
            try:
                completion = self.executor.submit(self._complete_backend, binding.manager, checkpoint_id, seq, markers)
                future = binding.manager.cleanup(checkpoint_id, markers)
                with self._lock:
                    self._cleanups = [f for f in self._cleanups if not f.done()] + [completion, future]
                completion.add_done_callback(self._report_cleanup(checkpoint_id))
                future.add_done_callback(self._report_cleanup(checkpoint_id))
            except BaseException as exc:  # noqa: BLE001 - cleanup is retried at the next commit; the commit stands
                self.metrics.increment("commit.cleanup.failures")
                log.warning(
                    "task %s: cleanup of %s could not start: %s",
                    self.task_name,
                    binding.factory_name,
                    exc,
                    extra=self._log_extra(checkpoint_id),
                )

    @staticmethod
    def _complete_backend(
        manager: TaskBackupManager, checkpoint_id: CheckpointId, seq: int, markers: StoreMarkers
    ) -> None:
        """On the commit pool: the backend's completion notice, then the framework's release and sweep of its blobs
        (statebackend.kit.lifetime), which read what the notice updated."""
        manager.checkpoint_completed(checkpoint_id, markers)
        lifetime = manager.blob_lifetime()
        if lifetime is not None:
            collector_of(lifetime).completed(seq, markers)

    def _abort_backends(self, checkpoint_id: CheckpointId, uploaded: list[StoreMarkers]) -> None:
        """The uploads of ``checkpoint_id`` succeeded but its checkpoint write failed: each backend's
        ``checkpoint_aborted`` notice (on the commit pool, where the write ran). A notice that raises is logged."""
        for binding, markers in zip(self.backups, uploaded, strict=True):
            try:
                binding.manager.checkpoint_aborted(checkpoint_id, markers)
            except Exception as exc:  # noqa: BLE001 - a notice; the commit's own failure is what is reported
                log.warning(
                    "task %s: the abort notice of %s to %s failed: %s",
                    self.task_name,
                    checkpoint_id,
                    binding.factory_name,
                    exc,
                    extra=self._log_extra(checkpoint_id),
                )

    def _after_durable(self, checkpoint_id: CheckpointId) -> None:
        """Start ``after_durable``'s work and register it so :meth:`close` waits for it (a failure is logged: the
        commit stands)."""
        hook = self.after_durable
        if hook is None:
            return
        try:
            future = hook()
        except Exception as exc:  # noqa: BLE001 - only the metrics textfile is late; the commit is durable
            log.warning(
                "task %s: after checkpoint %s: %s",
                self.task_name,
                checkpoint_id,
                exc,
                extra=self._log_extra(checkpoint_id),
            )
            return
        if future is None:
            return
        with self._lock:
            self._cleanups = [f for f in self._cleanups if not f.done()] + [future]
        future.add_done_callback(self._report_after_durable(checkpoint_id))

    def _report_after_durable(self, checkpoint_id: CheckpointId) -> Callable[[Future[Any]], None]:
        def report(future: Future[Any]) -> None:
            exc = future.exception()
            if exc is not None:
                log.warning(
                    "task %s: after checkpoint %s: %s",
                    self.task_name,
                    checkpoint_id,
                    exc,
                    extra=self._log_extra(checkpoint_id),
                )

        return report

    def _report_cleanup(self, checkpoint_id: CheckpointId) -> Callable[[Future[Any]], None]:
        def report(future: Future[Any]) -> None:
            exc = future.exception()
            if exc is not None:
                self.metrics.increment("commit.cleanup.failures")
                log.warning(
                    "task %s: cleanup after checkpoint %s failed (retried at the next commit): %s",
                    self.task_name,
                    checkpoint_id,
                    exc,
                    extra=self._log_extra(checkpoint_id),
                )

        return report

    def _fail(self, pending: PendingCommit, exc: BaseException) -> None:
        self.metrics.increment("commit.failures")
        log.warning(
            "task %s: commit %s failed: %s",
            self.task_name,
            pending.checkpoint_id,
            exc,
            extra=self._log_extra(pending.checkpoint_id),
        )
        if not isinstance(exc, CommitError):
            wrapped = CommitError(f"task {self.task_name}: commit {pending.checkpoint_id} failed: {exc}")
            wrapped.__cause__ = exc
            exc = wrapped
        with self._lock:
            self._failure = (exc, pending)
        pending.future.set_exception(exc)


def _close_all(changes: Mapping[str, ChangeSet]) -> None:
    for change in changes.values():
        change.close()


def default_pool_size() -> int:
    return min(32, 4 * (os.cpu_count() or 1))
