"""The executor side of a micro-batch: one task opens its stores at the batch's base, runs the user function,
commits, and hands its output back once its checkpoint is durable, or, when the task stays open in its worker and
the driver confirms checkpoints (``statebackend.spark.confirm``), right after the sync part of its commit.

The open follows the task's one lifecycle (:mod:`statebackend.lifecycle`): the executor decides once from one listing
of the task's log (the newest checkpoint and the head it is fenced at), plans the batch on that decision (its base:
the previous batch's checkpoint, a replay's, or the old tasks' of a rescale), and opens the task with the decision
rebased on the plan's base, or takes back the task parked in this worker when the decision shows it is current."""

from __future__ import annotations

import logging
import secrets
import shutil
import time
import uuid
from collections.abc import Callable, Iterable, Iterator, Mapping
from itertools import chain
from pathlib import Path
from typing import Any

import attrs
from pyspark import TaskContext

from statebackend.blobstores.base import BlobStore, open_blob_store
from statebackend.commit import PendingCommit
from statebackend.config import Settings
from statebackend.errors import ConfigError, StoreLockedError
from statebackend.exporters import export_now, task_metrics
from statebackend.lifecycle import OpenDecision, decide_open, task_checkpoint_log
from statebackend.metrics import Metrics, MetricsSnapshot
from statebackend.spark import kept
from statebackend.spark.batches import (
    ATTEMPT_OFFSET,
    ATTEMPTS_DIR,
    BATCH_OFFSET,
    EVENT_MAX_OFFSET,
    KEY_GROUPS_OFFSET,
    NOW_OFFSET,
    TASKS_OFFSET,
    WATERMARK_OFFSET,
    Layout,
    Plan,
    batch_of,
    layout_of,
    plan_batch,
    task_name,
)
from statebackend.spark.frames import (
    arrow_batches,
    batches_to_rows,
    pandas_frames,
    pandas_with_stats,
    rows_to_batches,
    rows_to_input_batches,
)
from statebackend.spark.held import DEFAULT_BOUND, SPILL_DIR, HeldOutput
from statebackend.spark.rescale import MIN_RETAINED_FOR_RESCALE, KeyRouting, take_key_groups
from statebackend.spark.stats import STATS_COLUMN, StatsRecord, TaskStats
from statebackend.spark.timers import (
    TIMERS_STORE,
    Timer,
    Timers,
    owner_check,
    refuse_dropping_timers,
    take_due,
)
from statebackend.spark.watermark import EventTimes, recorded_ms
from statebackend.spark.worker import (
    executor_id,
    freeze_survivors,
    process_outlives_task,
    task_settings,
)
from statebackend.store.ttl import wall_clock_ms
from statebackend.task import TaskStorage

__all__ = ["TaskRunner", "TaskStores"]

log = logging.getLogger(__name__)


class TaskStores(Mapping[str, Any]):
    """What the user function and the timer handler get: the task's stores by name (typed views per their serdes),
    where it runs, the batch's times (``now_ms``: the batch clock; ``watermark_ms``: the event-time watermark, None
    without one) and the task's :class:`~statebackend.spark.timers.Timers`. The timer store is not among the stores."""

    def __init__(self, storage: TaskStorage, task_index: int, batch_id: int, *, timers: Timers | None = None,
                 now_ms: int | None = None, watermark_ms: int | None = None) -> None:
        self.storage = storage
        self.task_index = task_index
        self.task_name = storage.task_name
        self.batch_id = batch_id
        self.timers = timers if timers is not None else Timers(None)
        self.now_ms = now_ms if now_ms is not None else storage.now_ms()
        self.watermark_ms = watermark_ms

    def __getitem__(self, name: str) -> Any:
        if name not in self.storage.stores or name == TIMERS_STORE:
            raise KeyError(name)
        return self.storage.store(name)

    def __iter__(self) -> Iterator[str]:
        return (name for name in self.storage.stores if name != TIMERS_STORE)

    def __len__(self) -> int:
        return sum(1 for _ in self)


class _Counted:
    """An iterator that counts what passes through it (rows, or rows of batches)."""

    def __init__(self, inner: Iterator[Any], size: Callable[[Any], int] | None = None) -> None:
        self.inner = inner
        self.size = size
        self.count = 0

    def __iter__(self) -> Iterator[Any]:
        return self

    def __next__(self) -> Any:
        item = next(self.inner)
        self.count += 1 if self.size is None else self.size(item)
        return item


def _partition_index() -> int:
    context = TaskContext.get()
    if context is None:
        raise ConfigError("the Spark driver's task function ran outside a Spark task (no TaskContext)")
    return context.partitionId()


@attrs.frozen
class TaskRunner:
    """The part of a batch that travels to the executors (pickled with ``fn`` and the config).

    ``output_schema``: the Arrow schema of the user's output (arrow and pandas modes, and rows mode over Arrow);
    the task's output gets :data:`STATS_COLUMN` appended and one more row carrying its stats."""

    fn: Callable[[TaskStores, Any], Any]
    config: Mapping[str, Any]
    batch_id: int
    num_tasks: int
    on_replay: str
    input_columns: tuple[str, ...]
    output_schema: Any = None
    #: park the task after its durable commit for the next batch in this worker (``statebackend.spark.kept``)
    keep_open: bool = False
    #: bytes of a task's output held in memory until its commit is durable; the rest waits in a spill file
    output_memory_bytes: int = DEFAULT_BOUND
    #: the batch's clock for TTL stores (ms since the epoch), chosen by the driver; None: the wall clock at the task
    now_ms: int | None = None
    #: key groups of the job (None: rows hashed modulo num_tasks, as before key groups) and the Spark type names of
    #: the key columns (to find a stored key's key group when the state is rescaled)
    key_groups: int | None = None
    key_types: tuple[str, ...] = ()
    #: (store name, decoded stored key) -> the key column value(s); None: the key itself
    key_of: Callable[[str, Any], Any] | None = None
    #: the Arrow schema of the input rows (arrow and pandas modes through an RDD of Rows)
    input_schema: Any = None
    #: the driver ran batch ``batch_id - 1`` to its end with this layout (every task committed it): a task's own
    #: checkpoint of it is the previous batch's state without asking task-0's log (``plan_batch``)
    previous_seen: bool = False
    #: the driver confirms each task's checkpoint in the log before the batch ends, so a task that stays open in its
    #: worker (``keep_open`` and a reused worker) hands its output on right after the sync part of its commit, its
    #: upload going on beside the next tasks; False: every task waits until its checkpoint is durable
    confirm_on_driver: bool = False
    #: classic Spark: the accumulator (of :class:`StatsParam`) each task attempt adds its stats to, the output then
    #: being the function's alone; None (Spark Connect, and tasks run outside Spark): the stats travel in the output
    #: (a :class:`StatsRecord` last, or one more row in :data:`STATS_COLUMN`)
    stats_to: Any = None
    #: the driver's token of this run of the batch, copied into every :class:`TaskStats`
    run_id: str = ""
    #: ``on_timers(stores, due_timers)``: called after ``fn`` with the timers due in this batch, its output joining
    #: ``fn``'s; None: the job has no timers (no timer store)
    on_timers: Callable[[TaskStores, list[Timer]], Any] | None = None
    #: the event-time column, its Spark type name and the session time zone (naive pandas timestamps are in it); the
    #: watermark the driver derived for this batch and the largest event time of the batches before it
    event_time: str | None = None
    event_time_type: str = ""
    time_zone: str = "UTC"
    watermark_ms: int | None = None
    event_max_ms: int | None = None

    def run_rows(self, index: int, rows: Iterable[Any]) -> Iterator[Any]:
        """Rows mode on an RDD (classic Spark): Rows in, the function's rows out, then a :class:`StatsRecord`."""
        events = self._events()
        # Spark passes an iterator (iter() returns it) but promises only an iterable
        counted = _Counted(events.rows(iter(rows)))
        outputs, stats = self._run(index, lambda stores: self._held().extend(self.fn(stores, counted) or ()), counted,
                                   events=events, convert=_rows_out, drain=counted)
        return self._with_stats_record(outputs, stats)

    def run_arrow_from_rows(self, index: int, rows: Iterable[Any]) -> Iterator[Any]:
        """Arrow mode through an RDD of Rows (affinity on a multi-executor cluster): the input rows become record
        batches of ``input_schema``, the function's output batches become rows, then a :class:`StatsRecord`."""
        events = self._events()
        counted = _Counted(events.rows(iter(rows)))
        outputs, stats = self._run(
            index,
            lambda stores: self._held().extend(arrow_batches(self.fn(stores, rows_to_input_batches(
                counted, self.input_schema)))),
            counted, events=events, convert=arrow_batches, drain=counted)
        return self._with_stats_record(batches_to_rows(outputs, self.output_schema), stats)

    def run_pandas_from_rows(self, index: int, rows: Iterable[Any]) -> Iterator[Any]:
        """Pandas mode through an RDD of Rows (affinity on a multi-executor cluster)."""
        import pyarrow as pa

        def tables(result: Any) -> Iterator[Any]:
            return (pa.Table.from_pandas(part, schema=self.output_schema, preserve_index=False)
                    for part in pandas_frames(result))

        def work(stores: TaskStores) -> HeldOutput:
            batches = list(rows_to_input_batches(events.rows(iter(rows)), self.input_schema))
            frame = pa.Table.from_batches(batches, schema=self.input_schema).to_pandas()
            counted.count = len(frame)
            return self._held().extend(tables(self.fn(stores, frame)))

        events = self._events()
        counted = _Counted(iter(()))
        outputs, stats = self._run(index, work, counted, events=events, convert=tables)
        return self._with_stats_record(batches_to_rows(outputs, self.output_schema), stats)

    def run_anchored(self, run: Callable[[int, Iterable[Any]], Iterator[Any]], deserializer: Any, index: int,
                     partition: Iterable[Any]) -> Iterator[Any]:
        """A task with affinity (the driver's ``_anchored``): the partition is one list of the task's serialized
        row batches, each read with the rows' own ``deserializer``; ``run`` (``run_rows``, ``run_arrow_from_rows``,
        ``run_pandas_from_rows``) gets the rows."""
        from pyspark.serializers import BatchedSerializer

        batched = isinstance(deserializer, BatchedSerializer)  # each element a pickled list of rows, else one row
        loads = deserializer.serializer.loads if batched else deserializer.loads

        def rows() -> Iterator[Any]:
            for elements in partition:
                for element in elements:
                    if batched:
                        yield from loads(bytes(element))
                    else:
                        yield loads(bytes(element))

        return run(index, rows())

    def run_rows_arrow(self, batches: Iterator[Any]) -> Iterator[Any]:
        """Rows mode over Arrow (Spark Connect has no RDDs): Rows in, the function's rows out as Arrow batches."""
        from pyspark.sql import Row

        def rows() -> Iterator[Any]:
            for batch in source:
                counted.count += batch.num_rows
                for record in batch.to_pylist():
                    yield Row(**record)

        events = self._events()
        source = events.batches(batches)
        counted = _Counted(iter(()))
        outputs, stats = self._run(_partition_index(),
                                   lambda stores: self._held().extend(self.fn(stores, rows()) or ()), counted,
                                   events=events, convert=_rows_out, drain=source)
        return self._with_stats(rows_to_batches(outputs, self.output_schema), stats)

    def run_arrow(self, batches: Iterator[Any]) -> Iterator[Any]:
        events = self._events()
        counted = _Counted(events.batches(batches), size=lambda batch: batch.num_rows)
        outputs, stats = self._run(_partition_index(),
                                   lambda stores: self._held().extend(arrow_batches(self.fn(stores, counted))),
                                   counted, events=events, convert=arrow_batches, drain=counted)
        return self._with_stats(outputs, stats)

    def run_pandas(self, frames: Iterator[Any]) -> Iterator[Any]:
        import pandas as pd

        def work(stores: TaskStores) -> HeldOutput:
            parts = list(frames)
            frame = pd.concat(parts, ignore_index=True) if parts else pd.DataFrame(columns=list(self.input_columns))
            counted.count = len(frame)
            return self._held().extend(pandas_frames(self.fn(stores, events.frame(frame))))

        events = self._events()
        counted = _Counted(iter(()))
        outputs, stats = self._run(_partition_index(), work, counted, events=events, convert=pandas_frames)
        if self._reported(stats):
            return iter(outputs)
        return pandas_with_stats(outputs, stats, self.output_schema)

    def _events(self) -> EventTimes:
        """What reads the largest event time of this task's input (nothing without an event-time column)."""
        return EventTimes(self.event_time, self.event_time_type, self.time_zone)

    def _reported(self, stats: TaskStats) -> bool:
        """Report ``stats`` through the driver's accumulator, if there is one (classic Spark)."""
        if self.stats_to is None:
            return False
        self.stats_to.add([stats])
        return True

    def _with_stats_record(self, outputs: Iterable[Any], stats: TaskStats) -> Iterator[Any]:
        """The output elements, then a :class:`StatsRecord` (unless ``stats`` went to the accumulator)."""
        if self._reported(stats):
            return iter(outputs)
        return chain(outputs, [StatsRecord(stats)])

    def _with_stats(self, batches: Iterable[Any], stats: TaskStats) -> Iterator[Any]:
        """The output batches, with :data:`STATS_COLUMN` (null) appended and then one row carrying ``stats`` unless
        ``stats`` went to the accumulator."""
        if self._reported(stats):
            return iter(batches)
        return self._with_stats_column(batches, stats)

    def _with_stats_column(self, batches: Iterable[Any], stats: TaskStats) -> Iterator[Any]:
        import pickle

        import pyarrow as pa

        schema = self.output_schema
        field = pa.field(STATS_COLUMN, pa.binary())
        for batch in batches:
            yield batch.append_column(field, pa.nulls(batch.num_rows, pa.binary()))
        nulls = [pa.nulls(1, f.type) for f in schema]
        yield pa.RecordBatch.from_arrays(
            [*nulls, pa.array([pickle.dumps(stats)], pa.binary())],
            schema=pa.schema([*(f.with_nullable(True) for f in schema), field]))

    def _held(self) -> HeldOutput:
        """Where this task's output waits for its durable commit (spilling under ``state.local.dir``)."""
        local_dir = self.config.get("state.local.dir")
        if local_dir is None:
            local_dir = Settings.from_config(self.config).local_dir
        return HeldOutput(self.output_memory_bytes, Path(str(local_dir)) / SPILL_DIR)

    def _run(self, index: int, work: Callable[[TaskStores], HeldOutput], counted: _Counted, *, events: EventTimes,
             convert: Callable[[Any], Iterable[Any]], drain: Iterator[Any] | None = None,
             ) -> tuple[Iterable[Any], TaskStats]:
        """Open (or take back) the task at the batch's base, run ``work`` (``fn`` over the input into held output)
        and the due timers (``on_timers``, its result through ``convert``), commit, and return the held output and
        the attempt's stats. ``drain``: the input iterator, read to its end after ``fn`` for its event times."""
        started = time.monotonic()
        context = TaskContext.get()
        attempt = context.attemptNumber() if context is not None else 0
        fingerprint = repr(sorted((k, repr(v)) for k, v in self.config.items()))
        settings = task_settings(self.config, fingerprint)
        if settings.gc_freeze:
            freeze_survivors()
        name = task_name(index)
        key = kept.task_key(settings.local_dir, settings.job_name, name)
        task_dir = Path(settings.local_dir) / settings.job_name / name
        parked = kept.take(key) if self.keep_open else None
        if parked is not None and parked.fingerprint != fingerprint:
            parked.close()
            parked = None
        if parked is not None:
            parked.settle(settings.commit_timeout_ms / 1000.0)  # its last commit, if it went on after its batch
        if parked is not None:
            blob_store, metrics = parked.blob_store, parked.storage.metrics
        else:
            blob_store = open_blob_store(settings.blob_store_url, settings.blob_store_options)
            metrics = task_metrics(settings, name)
            blob_store.use_metrics(metrics)
        private: Path | None = None
        storage: TaskStorage | None = None
        pending: PendingCommit | None = None
        prior: MetricsSnapshot | None = None
        handed_on = False
        try:
            checkpoint_log = (parked.storage.checkpoint_log if parked is not None
                              else task_checkpoint_log(settings, blob_store, name))
            # the one decision of this attempt: one listing that reaches what this machine knows durable gives the
            # newest checkpoint and the head the commit is fenced at; the plan below only rebases it
            listed = decide_open(settings, name, checkpoint_log)
            latest = listed.entry
            layout = Layout(self.num_tasks, self.key_groups)
            if (self.on_replay == "skip" and latest is not None
                    and batch_of(latest, name) == self.batch_id and layout_of(latest, name) == layout):
                log.info("%s: batch %d already committed as checkpoint #%d; skipping it", name, self.batch_id,
                         latest.seq)
                exported = kept.export_since(metrics, parked.exported if parked is not None else None)
                if parked is not None:
                    parked.exported = metrics.export()
                    kept.park(key, parked)  # nothing was done: it is parked again (the next batch checks it)
                    handed_on = True
                skipped = TaskStats(
                    batch_id=self.batch_id, task_index=index, attempt=attempt, base_seq=latest.seq, committed_seq=0,
                    open_ms=(time.monotonic() - started) * 1000.0, process_ms=0.0, commit_ms=0.0,
                    commit_sync_ms=0.0, input_rows=0, output_rows=0, private_dir=False, metrics=exported,
                    executor=executor_id(), run_id=self.run_id, watermark_ms=recorded_ms(latest, WATERMARK_OFFSET),
                    event_max_ms=recorded_ms(latest, EVENT_MAX_OFFSET))
                return [], skipped
            plan = plan_batch(checkpoint_log, latest, name, self.batch_id, layout,
                              lambda other: task_checkpoint_log(settings, blob_store, other),
                              previous_seen=self.previous_seen)
            base = plan.base
            if self.on_timers is None:
                refuse_dropping_timers(name, [base] if base is not None else [entry for _, entry in plan.sources])
            if plan.rescaled and settings.checkpoint_retained < MIN_RETAINED_FOR_RESCALE:
                # the old tasks' checkpoints of the previous batch are read by other tasks while this batch (and
                # any replay of it) runs; a task's own commits of this batch must not have retention drop them
                raise ConfigError(
                    f"{name}: batch {self.batch_id} changes num_tasks ({plan.previous} -> num_tasks="
                    f"{self.num_tasks}), which needs task.checkpoint.retained >= {MIN_RETAINED_FOR_RESCALE} (it is "
                    f"{settings.checkpoint_retained}): the new tasks read the old tasks' checkpoints of the previous "
                    "batch while other tasks commit. Raise it, or keep the old num_tasks"
                )
            decision = listed.rebased(base, settings)
            if parked is not None and not plan.rescaled and parked.is_current(listed, decision):
                storage = parked.storage
            else:
                if parked is not None:
                    # the log moved on (another attempt committed), a replay, or the local dir changed: reopen
                    log.info("%s: the task kept open at checkpoint #%d is not current (newest #%s, base #%s); "
                             "reopening it", name, parked.seq, listed.head, base.seq if base is not None else None)
                    parked.storage.close()
                    # what the closed task did since its last export (e.g. while parked) counts in this batch
                    prior = kept.export_since(metrics, parked.exported)
                    parked = None
                    metrics = task_metrics(settings, name)  # a fresh registry for the fresh open
                    blob_store.use_metrics(metrics)
                storage, private = self._open(settings, name, task_dir, blob_store, decision, attempt, metrics)
                if plan.rescaled:
                    try:
                        take_key_groups(storage, settings, blob_store, plan, index, self._routing())
                    except BaseException:
                        storage.close()
                        raise
            opened = time.monotonic()
            token = secrets.token_hex(8)
            replaying = latest is not None and batch_of(latest, name) == self.batch_id
            now_ms = self._batch_clock(latest, name, plan)
            storage.ttl_now_ms = now_ms
            watermark = self._batch_watermark(latest, name, plan)
            stores = TaskStores(storage, index, self.batch_id, timers=self._timers(storage, index), now_ms=now_ms,
                                watermark_ms=watermark)
            try:
                outputs = work(stores)
                try:
                    fired, pending_timers = self._after_fn(stores, outputs, convert, drain)
                except BaseException:
                    outputs.close()
                    raise
                processed = time.monotonic()
                event_max = self._event_max(events, plan)
                try:
                    offsets = {BATCH_OFFSET: str(self.batch_id), TASKS_OFFSET: str(self.num_tasks),
                               NOW_OFFSET: str(now_ms)}
                    if self.key_groups is not None:
                        offsets[KEY_GROUPS_OFFSET] = str(self.key_groups)
                    if watermark is not None:
                        offsets[WATERMARK_OFFSET] = str(watermark)
                    if event_max is not None:
                        offsets[EVENT_MAX_OFFSET] = str(event_max)
                    offsets[ATTEMPT_OFFSET] = token
                    stays_open = self.keep_open and private is None and process_outlives_task(context)
                    pending = storage.commit_now(offsets)
                    # Only a first attempt of a batch's first run leaves its upload running: the task stays parked
                    # in this worker and the driver confirms the checkpoint before the batch ends (a worker that dies
                    # first: the driver runs the batch again). A retry, a speculative copy or a replay waits, so the
                    # output of an attempt whose commit lost never leaves it. So does a commit whose seq may still
                    # move (a previous checkpoint write's reply was lost: its read-back decides).
                    if not (stays_open and self.confirm_on_driver and attempt == 0 and not replaying
                            and not storage.write_outcome_unknown):
                        pending.result()
                        pending = None
                except BaseException:
                    outputs.close()  # its spill file goes with the failed attempt
                    raise
                committed = time.monotonic()
            except BaseException:
                storage.close()
                raise
            sync_samples = storage.metrics.samples("commit.sync.ms")
            committed_seq = pending.seq if pending is not None else storage.committed_seq
            snapshot = metrics.export()
            exported = kept.export_since(metrics, parked.exported if parked is not None else None, snapshot)
            if prior is not None:
                exported = prior.merge(exported)
            if stays_open:
                export_now(settings, name)  # what a close would write or push: the task stays open
                kept.park(key, kept.KeptTask.after_commit(storage, blob_store, fingerprint, task_dir, snapshot,
                                                          pending=pending))
                handed_on = True
            else:
                storage.close()
            stats = TaskStats(
                batch_id=self.batch_id, task_index=index, attempt=attempt,
                base_seq=base.seq if base is not None else 0, committed_seq=committed_seq,
                open_ms=(opened - started) * 1000.0, process_ms=(processed - opened) * 1000.0,
                commit_ms=(committed - processed) * 1000.0,
                commit_sync_ms=sync_samples[-1] if sync_samples else 0.0,
                input_rows=counted.count, output_rows=outputs.rows, private_dir=private is not None,
                metrics=exported, kept_open=parked is not None, executor=executor_id(),
                pending_checkpoint_id=str(pending.checkpoint_id) if pending is not None else "", attempt_token=token,
                run_id=self.run_id, timers_fired=fired, timers_pending=pending_timers, watermark_ms=watermark,
                event_max_ms=event_max,
            )
            return outputs, stats
        finally:
            if not handed_on:
                if parked is not None and storage is None:
                    parked.storage.close()
                blob_store.close()
            if private is not None:
                shutil.rmtree(private, ignore_errors=True)

    def _batch_clock(self, latest: Any, name: str, plan: Plan) -> int:
        """The batch's clock: the one this task's checkpoint of this very batch recorded (a replay of a committed
        batch sees what its first run saw), else the driver's (or, without one, the wall clock), never earlier than
        the clock of the checkpoints the batch starts from: a driver clock behind the previous batch's (a restart on
        another machine, a clock step) would make keys that batch saw expired visible again."""
        if latest is not None and batch_of(latest, name) == self.batch_id:
            recorded = _recorded_clock(latest)
            if recorded is not None:
                return recorded
        now = self.now_ms if self.now_ms is not None else wall_clock_ms()
        starts = [plan.base] if plan.base is not None else [entry for _, entry in plan.sources]
        return max([now, *(clock for clock in map(_recorded_clock, starts) if clock is not None)])

    def _batch_watermark(self, latest: Any, name: str, plan: Plan) -> int | None:
        """The batch's watermark (None without event time): the one this task's checkpoint of this very batch
        recorded (a replay fires what its first run fired), else the driver's, never below the watermark of the
        checkpoints the batch starts from."""
        if self.event_time is None:
            return None
        if latest is not None and batch_of(latest, name) == self.batch_id:
            recorded = recorded_ms(latest, WATERMARK_OFFSET)
            if recorded is not None:
                return recorded
        starts = [plan.base] if plan.base is not None else [entry for _, entry in plan.sources]
        known = [w for w in (self.watermark_ms, *(recorded_ms(e, WATERMARK_OFFSET) for e in starts)) if w is not None]
        return max(known) if known else None

    def _event_max(self, events: EventTimes, plan: Plan) -> int | None:
        """The largest event time seen up to and including this batch: of the batches before it (the driver's, and
        what the checkpoints the batch starts from recorded) and of this task's input."""
        if self.event_time is None:
            return None
        starts = [plan.base] if plan.base is not None else [entry for _, entry in plan.sources]
        known = [m for m in (self.event_max_ms, events.max_ms, *(recorded_ms(e, EVENT_MAX_OFFSET) for e in starts))
                 if m is not None]
        return max(known) if known else None

    def _timers(self, storage: TaskStorage, index: int) -> Timers:
        if self.on_timers is None:
            return Timers(None)
        check = (owner_check(index, self.num_tasks, self.key_groups, self.key_types)
                 if self.key_types and self.key_groups is not None else None)
        return Timers(storage.store(TIMERS_STORE, typed=False), key_types=self.key_types, check_owner=check)

    def _after_fn(self, stores: TaskStores, outputs: HeldOutput, convert: Callable[[Any], Iterable[Any]],
                  drain: Iterator[Any] | None) -> tuple[int, int | None]:
        """After ``fn``: the rest of the input read for its event times, the due timers fired (their handler's
        output joining ``fn``'s), and output refused when the job declared none; the number of timers fired and
        pending after the batch (None: the job has no timers), also counted in the task's metrics."""
        if self.event_time is not None and drain is not None:
            for _ in drain:
                pass
        fired, pending = 0, None
        if self.on_timers is not None:
            due = take_due(stores.timers, stores.now_ms, stores.watermark_ms)
            if due:
                outputs.extend(convert(self.on_timers(stores, due)))
                fired = len(due)
            pending = stores.timers.pending()
            metrics = stores.storage.metrics
            metrics.increment("timers.registered", stores.timers.registered)
            metrics.increment("timers.deleted", stores.timers.deleted)
            metrics.increment("timers.fired", fired)
            metrics.record("timers.pending", pending)
        if self.output_schema is not None and len(self.output_schema) == 0 and outputs.rows:
            raise ConfigError(
                f"the function (or on_timers) returned {outputs.rows} output row(s), but StatefulForeachBatch has no "
                "output_schema: under Spark Connect, Spark must know the output's schema before the tasks run (no "
                "RDD to infer it from). Give output_schema (a StructType or a DDL string such as 'word string, "
                "count long'), or return None or nothing"
            )
        return fired, pending

    def _routing(self) -> KeyRouting:
        if self.key_groups is None:
            raise ConfigError("a change of num_tasks needs key groups: give StatefulForeachBatch(key_groups=...)")
        return KeyRouting(self.num_tasks, self.key_groups, self.key_types, self.key_of)

    def _open(self, settings: Settings, name: str, task_dir: Path, blob_store: BlobStore, decision: OpenDecision,
              attempt: int, metrics: Metrics) -> tuple[TaskStorage, Path | None]:
        """Open the task on ``decision``; when another process has it parked, ask it to hand the task over; when
        another attempt holds it, work in a private copy."""
        try:
            return TaskStorage.open(settings, name, blob_store=blob_store, decision=decision, metrics=metrics), None
        except StoreLockedError:
            if self.keep_open and kept.parked_elsewhere(task_dir):
                deadline = time.monotonic() + kept.HANDOVER_TIMEOUT_S
                with kept.request_handover(task_dir):
                    while time.monotonic() < deadline:
                        time.sleep(0.002)
                        try:
                            return TaskStorage.open(settings, name, blob_store=blob_store, decision=decision,
                                                    metrics=metrics), None
                        except StoreLockedError:
                            continue
        # Another attempt of this task runs on this machine (speculation, or a retry while the first one is still
        # winding down): work in a private copy restored from the blob store; the commit protocol decides which
        # attempt wins.
        private = Path(settings.local_dir) / ATTEMPTS_DIR / uuid.uuid4().hex
        log.warning("%s attempt %d: local stores are locked by another attempt; using %s", name, attempt, private)
        private_settings = attrs.evolve(settings, local_dir=private)
        return TaskStorage.open(private_settings, name, blob_store=blob_store, decision=decision,
                                metrics=metrics), private


def _rows_out(result: Any) -> Iterable[Any]:
    """Rows mode: the function's rows (None: none)."""
    return result or ()


def _recorded_clock(entry: Any) -> int | None:
    """The batch clock a checkpoint recorded (``now.ms``), if any."""
    recorded = entry.checkpoint.input_offsets.get(NOW_OFFSET)
    return int(recorded) if recorded is not None and str(recorded).isdigit() else None
