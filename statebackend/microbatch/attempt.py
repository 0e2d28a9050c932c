"""One attempt of one task of one micro-batch, on a worker: the task attempt's state machine, without Spark.

The steps, in order (each a method; :meth:`TaskAttempt.run` drives them):

1. **resume or connect**: take back the task parked in this process by an earlier batch (same job, same
   configuration; its last commit settled), else open the blob store and a fresh metrics registry;
2. **decide**: one listing of the task's checkpoint log gives the newest checkpoint and the head the commit is
   fenced at (:func:`statebackend.lifecycle.decide_open`);
3. **skip a replay** (``on_replay="skip"`` and this batch already committed): report and stop;
4. **plan**: the batch's base (the previous batch's checkpoint, a replay's, or the old tasks' of a rescale:
   :func:`statebackend.microbatch.batches.plan_batch`), refusing what would lose state (timers dropped, a rescale
   retention cannot serve);
5. **open**: the decision rebased on the plan's base; the parked task taken back when it is exactly that state,
   else the task opened (restoring), in a private directory when another attempt holds the local stores; a
   rescaled task takes its key groups from the old tasks;
6. **run**: the user's function over the input, then the due timers; their output held (spilling past a bound)
   and checked by the adapter's ``convert`` before anything is committed;
7. **commit**: the batch's offsets (batch id, layout, clock, watermark, attempt token); the attempt waits for its
   checkpoint unless it is a first attempt of a first run that stays parked and the driver confirms checkpoints;
8. **park or close**, and report: one :class:`~statebackend.microbatch.protocol.TaskStats`.

A failure at any step closes what the attempt opened and leaves the last durable checkpoint as it was: the attempt
commits nothing it has not finished, and its output never leaves it before its commit.

This module is the state machine; its parts are beside it (their public names re-exported here): what the user code
gets (:mod:`~statebackend.microbatch.task_stores`), the expiry sweep (:mod:`~statebackend.microbatch.expiry`), and
what a commit records in its offsets with the batch times (:mod:`~statebackend.microbatch.offsets`).
"""

from __future__ import annotations

import logging
import secrets
import shutil
import threading
import time
import uuid
from collections.abc import Callable, Iterable, Iterator
from pathlib import Path
from typing import Any, Self

import attrs

from statebackend.blobstores.base import BlobStore, open_blob_store
from statebackend.checkpoint import CheckpointLog
from statebackend.commit import PendingCommit
from statebackend.errors import ConfigError, StoreLockedError
from statebackend.exporters import export_now, task_metrics
from statebackend.lifecycle import OpenDecision, decide_open, task_checkpoint_log
from statebackend.metrics import Metrics, MetricsSnapshot
from statebackend.microbatch import kept
from statebackend.microbatch.batches import (
    ATTEMPTS_DIR,
    EVENT_MAX_OFFSET,
    WATERMARK_OFFSET,
    Layout,
    Plan,
    batch_of,
    layout_of,
    plan_batch,
    task_name,
)
from statebackend.microbatch.expiry import EXPIRY_FROM_OFFSET, Expired, sweep_expired
from statebackend.microbatch.held import SPILL_DIR, HeldOutput
from statebackend.microbatch.offsets import (
    TIMER_KEY_OFFSET,
    batch_clock,
    batch_event_max,
    batch_watermark,
    commit_offsets,
    starts,
)
from statebackend.microbatch.protocol import MAX_WARNINGS, AttemptWarning, TaskStats
from statebackend.microbatch.rescale import MIN_RETAINED_FOR_RESCALE, KeyRouting, take_key_groups
from statebackend.microbatch.spec import BatchSpec, JobSpec
from statebackend.microbatch.task_stores import Counted as Counted
from statebackend.microbatch.task_stores import TaskStores
from statebackend.microbatch.task_stores import Work as Work
from statebackend.microbatch.timers import TIMERS_STORE, Timer, Timers, owner_check, refuse_dropping_timers, take_due
from statebackend.microbatch.watermark import EventTimes, recorded_ms
from statebackend.microbatch.worker import executor_id, freeze_survivors
from statebackend.task import TaskStorage

__all__ = ["EXPIRY_FROM_OFFSET", "TIMER_KEY_OFFSET", "Expired", "TaskAttempt", "TaskStores"]

log = logging.getLogger(__name__)


@attrs.define(eq=False)
class TaskAttempt:
    """Attempt ``attempt`` of task ``index`` of the batch ``batch`` of the job ``job`` (see the module docstring).
    ``outlives_task``: this process runs later tasks too, so the task may stay open (parked) in it."""

    job: JobSpec
    batch: BatchSpec
    index: int
    attempt: int = 0
    outlives_task: bool = True

    name: str = attrs.field(init=False)
    _started: float = attrs.field(init=False, factory=time.monotonic)
    _key: tuple[str, str, str] = attrs.field(init=False)
    _task_dir: Path = attrs.field(init=False)
    _parked: kept.KeptTask | None = attrs.field(init=False, default=None)
    _blob_store: BlobStore | None = attrs.field(init=False, default=None)
    _metrics: Metrics | None = attrs.field(init=False, default=None)
    _storage: TaskStorage | None = attrs.field(init=False, default=None)
    _private: Path | None = attrs.field(init=False, default=None)
    #: what a closed parked task counted since its last export (it counts in this batch)
    _prior: MetricsSnapshot | None = attrs.field(init=False, default=None)
    _handed_on: bool = attrs.field(init=False, default=False)
    #: the parked task's storage was closed (reopened afresh, or closed after its commit)
    _parked_closed: bool = attrs.field(init=False, default=False)
    #: the task's checkpoint log: one object from the decision to the plan (:meth:`_task_log`)
    _checkpoint_log: CheckpointLog | None = attrs.field(init=False, default=None)
    #: where the output waits for the commit (closed with its spill file when the attempt fails)
    _outputs: HeldOutput | None = attrs.field(init=False, default=None)
    _warnings: _WarningCapture = attrs.field(init=False)

    def __attrs_post_init__(self) -> None:
        settings = self.job.settings
        self.name = task_name(self.index)
        self._key = kept.task_key(settings.local_dir, settings.job_name, self.name)
        self._task_dir = Path(settings.local_dir) / settings.job_name / self.name
        self._warnings = _WarningCapture()

    # -- the state machine ------------------------------------------------------------------------------------------

    def run(
        self,
        work: Work,
        counted: Counted,
        *,
        events: EventTimes,
        convert: Callable[[Any], Iterable[Any]],
        drain: Iterator[Any] | None = None,
    ) -> tuple[Iterable[Any], TaskStats]:
        """Run the attempt: the held output (handed on only now, after the commit) and the attempt's report.
        ``work`` runs the user's function over the input into held output; ``convert`` turns ``on_timers``' result
        into output elements (checked as the function's are); ``drain`` is the input iterator, read to its end
        after the function for its event times."""
        if self.job.settings.gc_freeze:
            freeze_survivors()
        with self._warnings:
            failed = True
            try:
                self._resume_or_connect()
                listed = self._decide()
                skipped = self._skip_replay(listed)
                if skipped is None:
                    plan = self._plan(listed)
                    self._open(listed, plan)
                    result = self._run_and_commit(listed, plan, work, counted, events, convert, drain)
                else:
                    result = [], skipped
                failed = False
                return result
            finally:
                self._release(failed)

    def _resume_or_connect(self) -> None:
        """Take back the task parked in this process (its last commit settled first), or connect afresh."""
        parked = kept.take(self._key) if self.job.keep_open else None
        if parked is not None and parked.fingerprint != self.job.fingerprint:
            parked.close()  # another configuration: not this job's task as it is configured now
            parked = None
        if parked is not None:
            parked.settle(self.job.settings.commit_timeout_ms / 1000.0)
            self._parked = parked
            self._blob_store, self._metrics = parked.blob_store, parked.storage.metrics
            return
        settings = self.job.settings
        self._blob_store = open_blob_store(settings.blob_store_url, settings.blob_store_options)
        self._metrics = task_metrics(settings, self.name)
        self._blob_store.use_metrics(self._metrics)

    def _decide(self) -> OpenDecision:
        """The one decision of this attempt: one listing that reaches what this machine knows durable gives the
        newest checkpoint and the head the commit is fenced at; the plan only rebases it."""
        return decide_open(self.job.settings, self.name, self._task_log())

    def _skip_replay(self, listed: OpenDecision) -> TaskStats | None:
        """With ``on_replay="skip"``, the report of an attempt whose batch is already committed (None: run it)."""
        latest = listed.entry
        if (
            self.job.on_replay != "skip"
            or latest is None
            or batch_of(latest, self.name) != self.batch.batch_id
            or layout_of(latest, self.name) != self._layout()
        ):
            return None
        log.info(
            "%s: batch %d already committed as checkpoint #%d; skipping it", self.name, self.batch.batch_id, latest.seq
        )
        metrics = self._registry()
        exported = kept.export_since(metrics, self._parked.exported if self._parked is not None else None)
        if self._parked is not None:
            self._parked.exported = metrics.export()
            kept.park(self._key, self._parked)  # nothing was done: it is parked again (the next batch checks it)
            self._handed_on = True
        return self._report(
            base_seq=latest.seq,
            committed_seq=0,
            opened=time.monotonic(),
            processed=None,
            committed=None,
            counted=0,
            output_rows=0,
            metrics=exported,
            watermark=recorded_ms(latest, WATERMARK_OFFSET),
            event_max=recorded_ms(latest, EVENT_MAX_OFFSET),
        )

    def _plan(self, listed: OpenDecision) -> Plan:
        """Where the batch starts from, refusing a start that would drop timers or that retention cannot serve."""
        settings, blob_store = self.job.settings, self._connected_store()
        # the same log object the decision listed: it knows what that listing showed, so a later listing that comes
        # back short is retried or refused, never taken for an empty log
        plan = plan_batch(
            self._task_log(),
            listed.entry,
            self.name,
            self.batch.batch_id,
            self._layout(),
            lambda other: task_checkpoint_log(settings, blob_store, other),
            previous_seen=self.batch.previous_seen,
        )
        if self.job.on_timers is None:
            refuse_dropping_timers(self.name, starts(plan))
        if plan.rescaled and settings.checkpoint_retained < MIN_RETAINED_FOR_RESCALE:
            # the old tasks' checkpoints of the previous batch are read by other tasks while this batch (and any
            # replay of it) runs; a task's own commits of this batch must not have retention drop them
            raise ConfigError(
                f"{self.name}: batch {self.batch.batch_id} changes num_tasks ({plan.previous} -> num_tasks="
                f"{self.job.num_tasks}), which needs task.checkpoint.retained >= {MIN_RETAINED_FOR_RESCALE} (it is "
                f"{settings.checkpoint_retained}): the new tasks read the old tasks' checkpoints of the previous "
                "batch while other tasks commit. Raise it, or keep the old num_tasks"
            )
        return plan

    def _open(self, listed: OpenDecision, plan: Plan) -> None:
        """The task at the plan's base: the parked one when it is exactly that state, else opened (restoring)."""
        settings = self.job.settings
        decision = listed.rebased(plan.base, settings)
        parked = self._parked
        if parked is not None and not plan.rescaled and parked.is_current(listed, decision):
            self._storage = parked.storage
            return
        if parked is not None:
            # the log moved on (another attempt committed), a replay, or the local dir changed: reopen
            log.info(
                "%s: the task kept open at checkpoint #%d is not current (newest #%s, base #%s); reopening it",
                self.name,
                parked.seq,
                listed.head,
                plan.base.seq if plan.base is not None else None,
            )
            self._parked_closed = True
            parked.storage.close()
            self._prior = kept.export_since(self._registry(), parked.exported)
            self._parked = None
            self._metrics = task_metrics(settings, self.name)  # a fresh registry for the fresh open
            self._connected_store().use_metrics(self._metrics)
        routing = self._routing() if plan.rescaled else None
        self._storage = self._open_storage(decision)
        if routing is not None:
            take_key_groups(self._storage, settings, self._connected_store(), plan, self.index, routing)

    def _run_and_commit(
        self,
        listed: OpenDecision,
        plan: Plan,
        work: Work,
        counted: Counted,
        events: EventTimes,
        convert: Callable[[Any], Iterable[Any]],
        drain: Iterator[Any] | None,
    ) -> tuple[Iterable[Any], TaskStats]:
        storage = self._storage
        assert storage is not None
        latest = listed.entry
        opened = time.monotonic()
        token = secrets.token_hex(8)
        replaying = latest is not None and batch_of(latest, self.name) == self.batch.batch_id
        now_ms = batch_clock(self.batch, self.name, latest, plan)
        storage.ttl_now_ms = now_ms
        watermark = batch_watermark(self.job, self.batch, self.name, latest, plan)
        if self.job.drop_late:
            events.drop_below = watermark  # before the input is read: the function never sees a late row
        stores = TaskStores(
            storage,
            self.index,
            self.batch.batch_id,
            timers=self._timers(storage),
            now_ms=now_ms,
            watermark_ms=watermark,
            event_ms=events.ms_of if self.job.event_time is not None else None,
        )
        stays_open = self.job.keep_open and self._private is None and self.outlives_task
        pending: PendingCommit | None = None
        # a failure from here on closes the held output (its spill file) and the task: _release
        outputs = self._call_user(self.job.fn, lambda: work(stores))
        self._outputs = outputs
        fired, pending_timers = self._after_fn(stores, outputs, convert, drain)
        cursors = self._expire(stores, outputs, convert, plan)
        processed = time.monotonic()
        event_max = batch_event_max(self.job, self.batch, events, plan)
        offsets = {**commit_offsets(self.job, self.batch, now_ms, watermark, event_max, token), **cursors}
        pending = storage.commit_now(offsets)
        # Only a first attempt of a batch's first run leaves its upload running: the task stays parked in this
        # worker and the driver confirms the checkpoint before the batch ends (a worker that dies first: the driver
        # runs the batch again). A retry, a speculative copy or a replay waits, so the output of an attempt whose
        # commit lost never leaves it. So does a commit whose seq may still move (a previous checkpoint write's
        # reply was lost: its read-back decides).
        if not (
            stays_open
            and self.batch.confirm_on_driver
            and self.attempt == 0
            and not replaying
            and not storage.write_outcome_unknown
        ):
            pending.result()
            pending = None
        committed = time.monotonic()
        metrics = self._registry()
        sync_samples = storage.metrics.samples("commit.sync.ms")
        committed_seq = pending.seq if pending is not None else storage.committed_seq
        snapshot = metrics.export()
        exported = kept.export_since(metrics, self._parked.exported if self._parked is not None else None, snapshot)
        if self._prior is not None:
            exported = self._prior.merge(exported)
        kept_open = self._parked is not None
        report = self._report(
            base_seq=plan.base.seq if plan.base is not None else 0,
            committed_seq=committed_seq,
            opened=opened,
            processed=processed,
            committed=committed,
            counted=counted.count,
            output_rows=outputs.rows,
            metrics=exported,
            watermark=watermark,
            event_max=event_max,
            kept_open=kept_open,
            commit_sync_ms=sync_samples[-1] if sync_samples else 0.0,
            pending_checkpoint_id=str(pending.checkpoint_id) if pending is not None else "",
            token=token,
            timers_fired=fired,
            timers_pending=pending_timers,
        )
        if stays_open:
            # what a close would push: the task stays open (its textfile follows every durable commit already)
            export_now(self.job.settings, self.name, textfile=False)
            kept.park(
                self._key,
                kept.KeptTask.after_commit(
                    storage, self._connected_store(), self.job.fingerprint, self._task_dir, snapshot, pending=pending
                ),
            )
            self._handed_on = True
            self._storage = None
        return outputs, report

    def _release(self, failed: bool) -> None:
        """Close what the attempt opened and did not hand on: the held output of a failed attempt (its spill file),
        the task unless it was parked again, the parked task it did not take back, the blob store (a parked task
        keeps its own), the private directory."""
        if failed and self._outputs is not None:
            self._outputs.close()
        if not self._handed_on:
            storage, self._storage = self._storage, None
            parked = self._parked
            if parked is not None and not self._parked_closed and parked.storage is not storage:
                parked.storage.close()
            if storage is not None:
                storage.close()
            if self._blob_store is not None:
                self._blob_store.close()
        if self._private is not None:
            shutil.rmtree(self._private, ignore_errors=True)

    # -- the steps' parts -------------------------------------------------------------------------------------------

    def _call_user(self, fn: Any, call: Callable[[], Any]) -> Any:
        """Call the user's code, adding to any exception where it ran (task, batch, function)."""
        try:
            return call()
        except Exception as exc:
            exc.add_note(
                f"(statebackend: raised in {_function_name(fn)} of {self.name}, batch "
                f"{self.batch.batch_id}, attempt {self.attempt})"
            )
            raise

    def _after_fn(
        self,
        stores: TaskStores,
        outputs: HeldOutput,
        convert: Callable[[Any], Iterable[Any]],
        drain: Iterator[Any] | None,
    ) -> tuple[int, int | None]:
        """After ``fn``: the rest of the input read for its event times, the due timers fired (their handler's
        output joining ``fn``'s), and output refused when the job declared none; the number of timers fired and
        pending after the batch (None: the job has no timers), also counted in the task's metrics."""
        if self.job.event_time is not None and drain is not None:
            for _ in drain:
                pass
        fired, pending = 0, None
        on_timers = self.job.on_timers
        if on_timers is not None:
            due: list[Timer] = take_due(stores.timers, stores.now_ms, stores.watermark_ms)
            if due:
                self._call_user(on_timers, lambda: outputs.extend(convert(on_timers(stores, due))))
                fired = len(due)
            pending = stores.timers.pending()
            metrics = stores.storage.metrics
            metrics.increment("timers.registered", stores.timers.registered)
            metrics.increment("timers.deleted", stores.timers.deleted)
            metrics.increment("timers.fired", fired)
            metrics.record("timers.pending", pending)
        schema = self.batch.output_schema
        if schema is not None and len(schema) == 0 and outputs.rows:
            raise ConfigError(
                f"the function (or on_timers) returned {outputs.rows} output row(s), but StatefulForeachBatch has no "
                "output_schema: under Spark Connect, Spark must know the output's schema before the tasks run (no "
                "RDD to infer it from). Give output_schema (a StructType or a DDL string such as 'word string, "
                "count long'), or return None or nothing"
            )
        return fired, pending

    def _expire(
        self, stores: TaskStores, outputs: HeldOutput, convert: Callable[[Any], Iterable[Any]], plan: Plan
    ) -> dict[str, str]:
        """With ``on_expiry``: the batch's expiry sweep (:func:`~statebackend.microbatch.expiry.sweep_expired`), its
        expired keys handed to ``on_expiry`` (its output joining the rest); the cursors for the commit's offsets."""
        on_expiry = self.job.on_expiry
        if on_expiry is None:
            return {}
        expired, cursors = sweep_expired(stores.storage, plan)
        if expired:
            self._call_user(on_expiry, lambda: outputs.extend(convert(on_expiry(stores, expired))))
        return cursors

    def _timers(self, storage: TaskStorage) -> Timers:
        job = self.job
        if job.on_timers is None:
            return Timers(None)
        check = (
            owner_check(self.index, job.num_tasks, job.key_groups, job.key_types)
            if job.key_types and job.key_groups is not None
            else None
        )
        return Timers(storage.store(TIMERS_STORE, typed=False), key_types=job.key_types, check_owner=check)

    def _routing(self) -> KeyRouting:
        if self.job.key_groups is None:
            raise ConfigError("a change of num_tasks needs key groups: give StatefulForeachBatch(key_groups=...)")
        return KeyRouting(self.job.num_tasks, self.job.key_groups, self.job.key_types, self.job.key_of)

    def _open_storage(self, decision: OpenDecision) -> TaskStorage:
        """Open the task on ``decision``; when another process has it parked, ask it to hand the task over; when
        another attempt holds it, work in a private copy."""
        settings, blob_store, metrics = self.job.settings, self._connected_store(), self._registry()
        try:
            return TaskStorage.open(settings, self.name, blob_store=blob_store, decision=decision, metrics=metrics)
        except StoreLockedError:
            if self.job.keep_open and kept.parked_elsewhere(self._task_dir):
                deadline = time.monotonic() + kept.HANDOVER_TIMEOUT_S
                with kept.request_handover(self._task_dir):
                    while time.monotonic() < deadline:
                        time.sleep(0.002)
                        try:
                            return TaskStorage.open(
                                settings, self.name, blob_store=blob_store, decision=decision, metrics=metrics
                            )
                        except StoreLockedError:
                            continue
        # Another attempt of this task runs on this machine (speculation, or a retry while the first one is still
        # winding down): work in a private copy restored from the blob store; the commit protocol decides which
        # attempt wins.
        self._private = Path(settings.local_dir) / ATTEMPTS_DIR / uuid.uuid4().hex
        log.warning(
            "%s attempt %d: local stores are locked by another attempt; using %s",
            self.name,
            self.attempt,
            self._private,
        )
        return TaskStorage.open(
            attrs.evolve(settings, local_dir=self._private),
            self.name,
            blob_store=blob_store,
            decision=decision,
            metrics=metrics,
        )

    def held(self) -> HeldOutput:
        """Where this task's output waits for its durable commit (spilling under ``state.local.dir``); closed with
        its spill file when the attempt fails."""
        self._outputs = HeldOutput(self.job.output_memory_bytes, Path(self.job.settings.local_dir) / SPILL_DIR)
        return self._outputs

    def _report(
        self,
        *,
        base_seq: int,
        committed_seq: int,
        opened: float,
        processed: float | None,
        committed: float | None,
        counted: int,
        output_rows: int,
        metrics: MetricsSnapshot,
        watermark: int | None,
        event_max: int | None,
        kept_open: bool = False,
        commit_sync_ms: float = 0.0,
        pending_checkpoint_id: str = "",
        token: str = "",
        timers_fired: int = 0,
        timers_pending: int | None = None,
    ) -> TaskStats:
        processed = processed if processed is not None else opened
        committed = committed if committed is not None else processed
        return TaskStats(
            batch_id=self.batch.batch_id,
            task_index=self.index,
            attempt=self.attempt,
            base_seq=base_seq,
            committed_seq=committed_seq,
            open_ms=(opened - self._started) * 1000.0,
            process_ms=(processed - opened) * 1000.0,
            commit_ms=(committed - processed) * 1000.0,
            commit_sync_ms=commit_sync_ms,
            input_rows=counted,
            output_rows=output_rows,
            private_dir=self._private is not None,
            metrics=metrics,
            kept_open=kept_open,
            executor=executor_id(),
            pending_checkpoint_id=pending_checkpoint_id,
            attempt_token=token,
            run_id=self.batch.run_id,
            timers_fired=timers_fired,
            watermark_ms=watermark,
            event_max_ms=event_max,
            timers_pending=timers_pending,
            warnings=self._warnings.taken(),
        )

    def _task_log(self) -> CheckpointLog:
        """The task's checkpoint log, one object for the whole attempt (the parked task's own, when taken back)."""
        if self._checkpoint_log is None:
            self._checkpoint_log = (
                self._parked.storage.checkpoint_log
                if self._parked is not None
                else task_checkpoint_log(self.job.settings, self._connected_store(), self.name)
            )
        return self._checkpoint_log

    def _layout(self) -> Layout:
        return Layout(self.job.num_tasks, self.job.key_groups)

    def _connected_store(self) -> BlobStore:
        assert self._blob_store is not None, "the attempt is not connected"
        return self._blob_store

    def _registry(self) -> Metrics:
        assert self._metrics is not None, "the attempt is not connected"
        return self._metrics


def _function_name(fn: Any) -> str:
    name = getattr(fn, "__qualname__", None) or getattr(fn, "__name__", None) or type(fn).__name__
    module = getattr(fn, "__module__", None)
    return f"{module}.{name}" if module and module != "__main__" else str(name)


class _WarningCapture(logging.Handler):
    """What the library logs at WARNING or above while an attempt runs (in any thread of the process: an upload's
    retries run on the commit pool), kept for the attempt's report; at most :data:`MAX_WARNINGS`."""

    def __init__(self) -> None:
        super().__init__(logging.WARNING)
        self._lock_taken = threading.Lock()
        self._records: list[AttemptWarning] = []
        self.dropped = 0

    def emit(self, record: logging.LogRecord) -> None:
        try:
            message = record.getMessage()
        except Exception:  # noqa: BLE001 - a malformed record is the logging module's to report
            return
        with self._lock_taken:
            if len(self._records) < MAX_WARNINGS:
                self._records.append(AttemptWarning(record.name, record.levelname, message))
            else:
                self.dropped += 1

    def taken(self) -> tuple[AttemptWarning, ...]:
        with self._lock_taken:
            return tuple(self._records)

    def __enter__(self) -> Self:
        logging.getLogger("statebackend").addHandler(self)
        return self

    def __exit__(self, *exc: object) -> None:
        logging.getLogger("statebackend").removeHandler(self)
