"""The executor side of a micro-batch: one task opens its stores at the batch's base, runs the user function,
commits, and hands its output back once its checkpoint is durable, or, when the task stays open in its worker and
the driver confirms checkpoints (``statebackend.spark.confirm``), right after the sync part of its commit."""

from __future__ import annotations

import gc
import logging
import os
import secrets
import shutil
import threading
import time
import uuid
from collections.abc import Callable, Iterable, Iterator, Mapping
from itertools import chain
from pathlib import Path
from typing import Any

import attrs
from pyspark import AccumulatorParam, TaskContext

from statebackend.blobstores.base import open_blob_store
from statebackend.checkpoint import CheckpointLog
from statebackend.commit import PendingCommit
from statebackend.config import Settings
from statebackend.errors import ConfigError, StateBackendError, StoreLockedError
from statebackend.metrics import MetricsSnapshot
from statebackend.spark import kept
from statebackend.spark.batches import (
    ATTEMPT_OFFSET,
    ATTEMPTS_DIR,
    BATCH_OFFSET,
    KEY_GROUPS_OFFSET,
    NOW_OFFSET,
    RESCALE_DIR,
    TASKS_OFFSET,
    Layout,
    Plan,
    batch_of,
    layout_of,
    plan_batch,
    task_name,
)
from statebackend.spark.held import DEFAULT_BOUND, SPILL_DIR, HeldOutput
from statebackend.store.ttl import wall_clock_ms
from statebackend.task import TaskStorage, export_now, known_durable_seq, task_metrics

log = logging.getLogger(__name__)


class TaskStores(Mapping[str, Any]):
    """What the user function gets: the task's stores by name (typed views per their serdes), plus where it runs."""

    def __init__(self, storage: TaskStorage, task_index: int, batch_id: int) -> None:
        self.storage = storage
        self.task_index = task_index
        self.task_name = storage.task_name
        self.batch_id = batch_id

    def __getitem__(self, name: str) -> Any:
        if name not in self.storage.stores:
            raise KeyError(name)
        return self.storage.store(name)

    def __iter__(self) -> Iterator[str]:
        return iter(self.storage.stores)

    def __len__(self) -> int:
        return len(self.storage.stores)


@attrs.frozen
class TaskStats:
    """What one task attempt did in one batch (travels to the driver with the task's output)."""

    batch_id: int
    task_index: int
    attempt: int
    #: sequence number of the checkpoint restored (0: none), and of the one committed (0: skipped)
    base_seq: int
    committed_seq: int
    open_ms: float
    process_ms: float
    commit_ms: float
    #: sync part of the commit (flush + snapshot): the part that blocks processing
    commit_sync_ms: float
    input_rows: int
    output_rows: int
    private_dir: bool
    #: what the attempt counted (commits, restores, blob-store requests), mergeable: the driver adds them up per batch
    metrics: MetricsSnapshot | None = None
    #: the task was kept open from an earlier batch in this worker (no open, no restore, no close)
    kept_open: bool = False
    #: where the attempt ran: ``host:working directory`` of the executor (one per executor in standalone, YARN and
    #: Kubernetes deployments), to see whether tasks stay with their state
    executor: str = ""
    #: the id of the checkpoint (``committed_seq``) this attempt committed without waiting for it to be durable (its
    #: upload goes on in the worker, where the task stays open): the driver confirms it in the task's log before the
    #: batch ends, with ``attempt_token`` (its input offset ``attempt``). Empty: the checkpoint was durable before the
    #: task handed its output on. ``commit_ms`` is then the sync part only
    pending_checkpoint_id: str = ""
    attempt_token: str = ""
    #: the driver's token of the run of the batch this attempt belongs to (:attr:`TaskRunner.run_id`): stats reported
    #: through an accumulator are told apart from those of an earlier run by it
    run_id: str = ""


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
        raise StateBackendError("the Spark driver's task function ran outside a Spark task (no TaskContext)")
    return context.partitionId()


@attrs.frozen
class StatsRecord:
    """A task attempt's :class:`TaskStats`, travelling back to the driver as the last element of the task's output
    (rows mode on an RDD). The other modes carry the same pickled stats in the output's :data:`STATS_COLUMN`."""

    stats: TaskStats


def is_stats(item: Any) -> bool:
    return isinstance(item, StatsRecord)


def is_output(item: Any) -> bool:
    return not isinstance(item, StatsRecord)


#: the column that carries each task attempt's pickled TaskStats in one extra output row (null in every output row),
#: under Spark Connect (no accumulators there); classic Spark reports them through :class:`StatsParam` instead
STATS_COLUMN = "__statebackend_stats__"


class StatsParam(AccumulatorParam):  # type: ignore[type-arg]
    """The accumulator the tasks of classic Spark report their :class:`TaskStats` through (a list, in no order).

    Spark merges a task's accumulator updates into the driver's value when the task succeeds, before the action that
    ran it returns (the driver acknowledges each update), and never those of a failed attempt: after the action, the
    value holds at most one entry per task of the run, none for a task whose output Spark read from a block a failed
    attempt had stored (the driver's ``_without_stats``). So the stats need no row of the output and no second job to
    collect them. ``addInPlace`` builds a new list: the driver swaps the value out while the accumulator server's
    thread may merge a late update of another run's zombie attempt, which then lands in one list or the other, never
    half in both (the driver tells runs apart by :attr:`TaskStats.run_id`)."""

    def zero(self, value: list[TaskStats]) -> list[TaskStats]:
        return []

    def addInPlace(self, value1: list[TaskStats], value2: list[TaskStats]) -> list[TaskStats]:
        return [*value1, *value2]


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

    def run_rows(self, index: int, rows: Iterable[Any]) -> Iterator[Any]:
        """Rows mode on an RDD (classic Spark): Rows in, the function's rows out, then a :class:`StatsRecord`."""
        counted = _Counted(iter(rows))  # Spark passes an iterator (iter() returns it) but promises only an iterable
        outputs, stats = self._run(index, lambda stores: self._held().extend(self.fn(stores, counted) or ()), counted)
        return self._with_stats_record(outputs, stats)

    def run_arrow_from_rows(self, index: int, rows: Iterable[Any]) -> Iterator[Any]:
        """Arrow mode through an RDD of Rows (affinity on a multi-executor cluster): the input rows become record
        batches of ``input_schema``, the function's output batches become rows, then a :class:`StatsRecord`."""
        counted = _Counted(iter(rows))
        outputs, stats = self._run(
            index,
            lambda stores: self._held().extend(_arrow_batches(self.fn(stores, _rows_to_input_batches(
                counted, self.input_schema)))),
            counted)
        return self._with_stats_record(_batches_to_rows(outputs, self.output_schema), stats)

    def run_pandas_from_rows(self, index: int, rows: Iterable[Any]) -> Iterator[Any]:
        """Pandas mode through an RDD of Rows (affinity on a multi-executor cluster)."""
        import pyarrow as pa

        def work(stores: TaskStores) -> HeldOutput:
            batches = list(_rows_to_input_batches(iter(rows), self.input_schema))
            frame = pa.Table.from_batches(batches, schema=self.input_schema).to_pandas()
            counted.count = len(frame)
            return self._held().extend(
                pa.Table.from_pandas(part, schema=self.output_schema, preserve_index=False)
                for part in _pandas_frames(self.fn(stores, frame)))

        counted = _Counted(iter(()))
        outputs, stats = self._run(index, work, counted)
        return self._with_stats_record(_batches_to_rows(outputs, self.output_schema), stats)

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
            for batch in batches:
                counted.count += batch.num_rows
                for record in batch.to_pylist():
                    yield Row(**record)

        counted = _Counted(iter(()))
        outputs, stats = self._run(_partition_index(),
                                   lambda stores: self._held().extend(self.fn(stores, rows()) or ()), counted)
        return self._with_stats(_rows_to_batches(outputs, self.output_schema), stats)

    def run_arrow(self, batches: Iterator[Any]) -> Iterator[Any]:
        counted = _Counted(batches, size=lambda batch: batch.num_rows)
        outputs, stats = self._run(_partition_index(),
                                   lambda stores: self._held().extend(_arrow_batches(self.fn(stores, counted))),
                                   counted)
        return self._with_stats(outputs, stats)

    def run_pandas(self, frames: Iterator[Any]) -> Iterator[Any]:
        import pandas as pd

        def work(stores: TaskStores) -> HeldOutput:
            parts = list(frames)
            frame = pd.concat(parts, ignore_index=True) if parts else pd.DataFrame(columns=list(self.input_columns))
            counted.count = len(frame)
            return self._held().extend(_pandas_frames(self.fn(stores, frame)))

        counted = _Counted(iter(()))
        outputs, stats = self._run(_partition_index(), work, counted)
        if self._reported(stats):
            return iter(outputs)
        return _pandas_with_stats(outputs, stats, self.output_schema)

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

    def _run(self, index: int, work: Callable[[TaskStores], HeldOutput],
             counted: _Counted) -> tuple[Iterable[Any], TaskStats]:
        started = time.monotonic()
        context = TaskContext.get()
        attempt = context.attemptNumber() if context is not None else 0
        fingerprint = repr(sorted((k, repr(v)) for k, v in self.config.items()))
        settings = _task_settings(self.config, fingerprint)
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
            if parked is not None:
                checkpoint_log = parked.storage.checkpoint_log
            else:
                checkpoint_log = CheckpointLog(
                    blob_store, settings.job_name, name,
                    write_versions=settings.checkpoint_write_versions,
                    read_versions=settings.checkpoint_read_versions,
                    retained=settings.checkpoint_retained,
                )
            # the local CHECKPOINT-V2 bounds what the listing must show; the head seen here fences the commit
            known = known_durable_seq(settings.local_dir, settings.job_name, name)
            latest, head = checkpoint_log.latest_and_head(at_least=known)
            # every later listing (a replay's search for its base) must reach what is known durable too
            checkpoint_log.raise_floor(max(known, latest.seq if latest is not None else 0))
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
                    executor=_executor(), run_id=self.run_id)
                return [], skipped
            plan = plan_batch(checkpoint_log, latest, name, self.batch_id, layout,
                              lambda other: CheckpointLog(blob_store, settings.job_name, other,
                                                          read_versions=settings.checkpoint_read_versions,
                                                          retained=settings.checkpoint_retained),
                              previous_seen=self.previous_seen)
            base = plan.base
            if plan.rescaled and settings.checkpoint_retained < MIN_RETAINED_FOR_RESCALE:
                # the old tasks' checkpoints of the previous batch are read by other tasks while this batch (and
                # any replay of it) runs; a task's own commits of this batch must not have retention drop them
                raise ConfigError(
                    f"{name}: batch {self.batch_id} changes num_tasks ({plan.previous} -> num_tasks="
                    f"{self.num_tasks}), which needs task.checkpoint.retained >= {MIN_RETAINED_FOR_RESCALE} (it is "
                    f"{settings.checkpoint_retained}): the new tasks read the old tasks' checkpoints of the previous "
                    "batch while other tasks commit. Raise it, or keep the old num_tasks"
                )
            if parked is not None and not plan.rescaled and parked.is_current(latest, head, base):
                storage = parked.storage
            else:
                if parked is not None:
                    # the log moved on (another attempt committed), a replay, or the local dir changed: reopen
                    log.info("%s: the task kept open at checkpoint #%d is not current (newest #%s, base #%s); "
                             "reopening it", name, parked.seq, head, base.seq if base is not None else None)
                    parked.storage.close()
                    # what the closed task did since its last export (e.g. while parked) counts in this batch
                    prior = kept.export_since(metrics, parked.exported)
                    parked = None
                    metrics = task_metrics(settings, name)  # a fresh registry for the fresh open
                    blob_store.use_metrics(metrics)
                storage, private = self._open(settings, name, task_dir, blob_store, base, head, attempt, metrics)
                if plan.rescaled:
                    try:
                        self._take_key_groups(storage, settings, blob_store, plan, index)
                    except BaseException:
                        storage.close()
                        raise
            opened = time.monotonic()
            token = secrets.token_hex(8)
            replaying = latest is not None and batch_of(latest, name) == self.batch_id
            now_ms = self._batch_clock(latest, name, plan)
            storage.ttl_now_ms = now_ms
            try:
                outputs = work(TaskStores(storage, index, self.batch_id))
                processed = time.monotonic()
                try:
                    offsets = {BATCH_OFFSET: str(self.batch_id), TASKS_OFFSET: str(self.num_tasks),
                               NOW_OFFSET: str(now_ms)}
                    if self.key_groups is not None:
                        offsets[KEY_GROUPS_OFFSET] = str(self.key_groups)
                    offsets[ATTEMPT_OFFSET] = token
                    stays_open = self.keep_open and private is None and _process_outlives_task(context)
                    pending = storage.commit_now(offsets)
                    # Only a first attempt of a batch's first run leaves its upload running: the task stays parked
                    # in this worker and the driver confirms the checkpoint before the batch ends (a worker that dies
                    # first: the driver runs the batch again). A retry, a speculative copy or a replay waits, so the
                    # output of an attempt whose commit lost never leaves it. So does a commit whose seq may still
                    # move (a previous checkpoint write's reply was lost: its read-back decides).
                    if not (stays_open and self.confirm_on_driver and attempt == 0 and not replaying
                            and not storage.commit_manager.write_outcome_unknown):
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
            committed_seq = pending.seq if pending is not None else storage.commit_manager.next_seq - 1
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
                metrics=exported, kept_open=parked is not None, executor=_executor(),
                pending_checkpoint_id=str(pending.checkpoint_id) if pending is not None else "", attempt_token=token,
                run_id=self.run_id,
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

    def _take_key_groups(self, storage: TaskStorage, settings: Settings, blob_store: Any, plan: Plan,
                         index: int) -> None:
        """A rescaled batch: fill the task's empty stores with the keys of the key groups it owns now, read from the
        old tasks' checkpoints of the previous batch (each restored read-only into a scratch dir, then dropped).
        Values are copied as stored (a TTL store's expiries included)."""
        from statebackend.serdes import get_serde
        from statebackend.spark.keygroups import key_group_range, spark_hash
        from statebackend.task import restored_stores

        if self.key_groups is None:
            raise StateBackendError("rescaling needs key groups")
        mine = key_group_range(index, self.num_tasks, self.key_groups)
        previous = plan.previous
        assert previous is not None
        started, copied = time.monotonic(), 0
        for old_name, entry in plan.sources:
            old_index = int(old_name.rsplit("-", 1)[1])
            # what the old task was routed: its key groups, or (state before key groups) hash modulo its num_tasks
            held = (key_group_range(old_index, previous.tasks, previous.key_groups)
                    if previous.key_groups is not None else None)
            scratch = Path(settings.local_dir) / RESCALE_DIR / uuid.uuid4().hex
            try:
                with restored_stores(attrs.evolve(settings, local_dir=scratch), old_name, blob_store=blob_store,
                                     checkpoint=_seq_is(entry.seq)) as old:
                    for store_name, source in old.stores.items():
                        key_serde = get_serde(settings.stores[store_name].key_serde)
                        keys: list[bytes] = []
                        values: list[bytes] = []
                        for key, value in source.items():
                            decoded = key_serde.from_bytes(key)
                            columns = self._key_columns(store_name, decoded)
                            try:
                                hashed = spark_hash(columns, self.key_types)
                            except (TypeError, ConfigError) as exc:
                                raise ConfigError(
                                    f"{task_name(index)}: rescaling store {store_name!r}: its key {decoded!r} does not "
                                    f"hash as the key columns ({', '.join(self.key_types)}): {exc}. A store's keys "
                                    "must be the key column value (a tuple for several), or give "
                                    "StatefulForeachBatch(key_of=...) mapping them to it"
                                ) from exc
                            group = hashed % self.key_groups
                            if (group not in held) if held is not None else hashed % previous.tasks != old_index:
                                # the old task was never routed this key's rows: the store is not keyed by the key
                                # columns (or key_of maps it wrong); each old task may hold its own such key, and
                                # taking them into one new task would keep one and drop the others silently
                                raise ConfigError(
                                    f"{task_name(index)}: rescaling store {store_name!r}: its key {decoded!r} is held "
                                    f"by {old_name}, but its key columns ({', '.join(self.key_types)}) hash to key "
                                    f"group {group}, which {old_name} does not own under {previous}: the rows of this "
                                    "key never went to that task. A store's keys must be the key column value (a "
                                    "tuple for several), or give StatefulForeachBatch(key_of=...) mapping them to it"
                                )
                            if group in mine:
                                keys.append(key)
                                values.append(value)
                        if keys:
                            storage.stores[store_name].put_many(keys, values)
                            copied += len(keys)
            finally:
                shutil.rmtree(scratch, ignore_errors=True)
        log.info("%s: took %d keys of key groups %d..%d from %s (%s) in %.0f ms", task_name(index), copied,
                 mine.start, mine.stop - 1, ", ".join(n for n, _ in plan.sources), previous,
                 (time.monotonic() - started) * 1000.0)

    def _key_columns(self, store_name: str, key: Any) -> tuple[Any, ...]:
        value = self.key_of(store_name, key) if self.key_of is not None else key
        if len(self.key_types) == 1:
            if isinstance(value, bytes) and self.key_types[0] == "string":
                value = value.decode("utf-8")
            return (value,)
        if not isinstance(value, (tuple, list)) or len(value) != len(self.key_types):
            raise ConfigError(
                f"rescaling store {store_name!r}: its key {key!r} is not a tuple of the {len(self.key_types)} key "
                "column values: give StatefulForeachBatch(key_of=...) mapping a stored key to them"
            )
        return tuple(value)

    def _open(self, settings: Settings, name: str, task_dir: Path, blob_store: Any, base: Any, head: int,
              attempt: int, metrics: Any) -> tuple[TaskStorage, Path | None]:
        """Open the task at ``base`` fenced at ``head``; when another process has it parked, ask it to hand the task
        over; when another attempt holds it, work in a private copy."""
        try:
            return TaskStorage.open(settings, name, blob_store=blob_store, checkpoint=base, fence_seq=head,
                                    metrics=metrics), None
        except StoreLockedError:
            if self.keep_open and kept.parked_elsewhere(task_dir):
                deadline = time.monotonic() + kept.HANDOVER_TIMEOUT_S
                with kept.request_handover(task_dir):
                    while time.monotonic() < deadline:
                        time.sleep(0.002)
                        try:
                            return TaskStorage.open(settings, name, blob_store=blob_store, checkpoint=base,
                                                    fence_seq=head, metrics=metrics), None
                        except StoreLockedError:
                            continue
        # Another attempt of this task runs on this machine (speculation, or a retry while the first one is still
        # winding down): work in a private copy restored from the blob store; the commit protocol decides which
        # attempt wins.
        private = Path(settings.local_dir) / ATTEMPTS_DIR / uuid.uuid4().hex
        log.warning("%s attempt %d: local stores are locked by another attempt; using %s", name, attempt, private)
        private_settings = attrs.evolve(settings, local_dir=private)
        return TaskStorage.open(private_settings, name, blob_store=blob_store, checkpoint=base, fence_seq=head,
                                metrics=metrics), private


#: a worker's parsed settings by config fingerprint: every batch of a job unpickles the same config, and parsing it
#: (every key, every backend's options) costs milliseconds per task and batch
_SETTINGS: dict[str, Settings] = {}
_SETTINGS_KEPT = 16


#: tasks between two full collections of the process under ``task.gc.freeze``
GC_FULL_EVERY = 64
_gc_lock = threading.Lock()
_gc_tasks = 0
#: whether something else in the process froze objects before the first task did (then the collector is left alone)
_gc_foreign: bool | None = None


def freeze_survivors() -> None:
    """At a task's start in a Python worker: collect the process's garbage, then move every object that survives out
    of later collections (``gc.freeze``); every :data:`GC_FULL_EVERY` tasks, everything frozen is put back first, so
    the collection is a full one.

    A reused PySpark worker runs a full ``gc.collect()`` after every task. With pyspark, pyarrow, pandas and this
    library loaded that is about 82,000 objects and 45 ms, the GIL held throughout: a task's upload left running
    beside it waits, and so does the worker's next task. Measured on a foreachBatch of 10k updates a batch (1M keys,
    4 tasks, ``local[2]``, 20 batches interleaved): 337 -> 299 ms p50 a call with every task waiting for its
    checkpoint, 373 -> 282 ms with the driver confirming them (docs/benchmarks-spark.md). Once the long-lived
    objects are frozen, a collection walks only what was made since the last task.

    What it costs: a reference cycle among frozen objects that turns to garbage (a closed task's) waits for the next
    full collection, at most :data:`GC_FULL_EVERY` tasks later; objects are still freed as soon as nothing refers to
    them. A process that froze objects itself before its first task is left alone: thawing would undo its freeze."""
    global _gc_tasks, _gc_foreign
    with _gc_lock:
        if _gc_foreign is None:
            _gc_foreign = gc.get_freeze_count() > 0
        if _gc_foreign:
            return
        if _gc_tasks and _gc_tasks % GC_FULL_EVERY == 0:
            gc.unfreeze()
        _gc_tasks += 1
        gc.collect()
        gc.freeze()


def _task_settings(config: Mapping[str, Any], fingerprint: str) -> Settings:
    """The task's settings: ``config`` parsed, with no Prometheus port (it is the driver's endpoint: Python workers
    would fight over it; they write a textfile or push)."""
    settings = _SETTINGS.get(fingerprint)
    if settings is None:
        settings = attrs.evolve(Settings.from_config(config), metrics_prometheus_port=None)
        if len(_SETTINGS) >= _SETTINGS_KEPT:
            _SETTINGS.pop(next(iter(_SETTINGS)))
        _SETTINGS[fingerprint] = settings
    return settings


def _executor() -> str:
    import socket

    return f"{socket.gethostname()}:{os.getcwd()}"


#: the smallest task.checkpoint.retained a change of num_tasks runs with: a task commits a rescaled batch, and
#: perhaps a replay of it, while other tasks still read its checkpoint of the previous batch
MIN_RETAINED_FOR_RESCALE = 3


def _recorded_clock(entry: Any) -> int | None:
    """The batch clock a checkpoint recorded (``now.ms``), if any."""
    recorded = entry.checkpoint.input_offsets.get(NOW_OFFSET)
    return int(recorded) if recorded is not None and str(recorded).isdigit() else None


def _seq_is(seq: int) -> Callable[[Any], bool]:
    return lambda entry: bool(entry.seq == seq)


def _process_outlives_task(context: Any) -> bool:
    """Whether this process runs later tasks too: a Spark Python worker only with worker reuse on (the daemon gets
    ``SPARK_REUSE_WORKER``); a worker that exits after its task would take a parked task's background snapshot and
    cleanups with it every time. Outside a Spark task (the caller runs tasks itself): yes."""
    return context is None or bool(os.environ.get("SPARK_REUSE_WORKER"))


def _arrow_batches(result: Any) -> Iterator[Any]:
    """The function's arrow-mode output as record batches, one at a time (a generator's are never all in memory)."""
    import pyarrow as pa

    if result is None:
        return
    if isinstance(result, pa.Table):
        yield from result.to_batches()
    elif isinstance(result, pa.RecordBatch):
        yield result
    else:
        for item in result:
            yield from _arrow_batches(item)


#: output rows per Arrow batch in rows mode over Arrow
_ROWS_PER_BATCH = 1 << 16


def _rows_to_batches(rows: Iterable[Any], schema: Any) -> Iterator[Any]:
    """The function's output rows (tuples, Rows or dicts) as Arrow batches of the declared output ``schema``, at most
    64Ki rows at a time."""
    import pyarrow as pa

    names = schema.names
    records: list[dict[str, Any]] = []
    for row in rows:
        if isinstance(row, Mapping):
            records.append(dict(row))
        elif hasattr(row, "asDict"):
            records.append(row.asDict())
        else:
            values = tuple(row)
            if len(values) != len(names):
                raise StateBackendError(
                    f"an output row has {len(values)} values where output_schema has {len(names)} columns "
                    f"({', '.join(names)}): {values!r}"
                )
            records.append(dict(zip(names, values, strict=True)))
        if len(records) >= _ROWS_PER_BATCH:
            yield from pa.Table.from_pylist(records, schema=schema).to_batches()
            records = []
    if records:
        yield from pa.Table.from_pylist(records, schema=schema).to_batches()


def _rows_to_input_batches(rows: Iterable[Any], schema: Any) -> Iterator[Any]:
    """Spark Rows as Arrow record batches of ``schema`` (its columns in order), at most 64Ki rows at a time."""
    import pyarrow as pa

    chunk: list[tuple[Any, ...]] = []

    def batch() -> Any:
        columns = list(zip(*chunk, strict=True)) if chunk else [() for _ in schema]
        return pa.RecordBatch.from_arrays([pa.array(column, type=field.type) for column, field in
                                           zip(columns, schema, strict=True)], schema=schema)

    for row in rows:
        chunk.append(tuple(row))
        if len(chunk) >= _ROWS_PER_BATCH:
            yield batch()
            chunk = []
    if chunk:
        yield batch()


def _batches_to_rows(batches: Iterable[Any], schema: Any) -> Iterator[tuple[Any, ...]]:
    """Arrow record batches (or tables) as tuples in ``schema``'s column order."""
    names = schema.names
    for batch in batches:
        columns = [batch.column(name).to_pylist() for name in names]
        yield from zip(*columns, strict=True)


def _pandas_with_stats(frames: Iterable[Any], stats: TaskStats, schema: Any) -> Iterator[Any]:
    """The output frames with :data:`STATS_COLUMN` (None) added, then a one-row frame carrying ``stats``."""
    import pickle

    import pandas as pd

    for frame in frames:
        frame = frame.copy(deep=False)
        frame[STATS_COLUMN] = None
        yield frame
    record: dict[str, Any] = {name: pd.Series([None], dtype=object) for name in schema.names}
    record[STATS_COLUMN] = pd.Series([pickle.dumps(stats)], dtype=object)
    yield pd.DataFrame(record)


def _pandas_frames(result: Any) -> Iterator[Any]:
    import pandas as pd

    if result is None:
        return
    if isinstance(result, pd.DataFrame):
        yield result
    else:
        for item in result:
            yield from _pandas_frames(item)
