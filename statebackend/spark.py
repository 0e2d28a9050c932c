"""The PySpark Structured Streaming driver (DESIGN section 10): keyed state per task, committed with the batch id.

Use::

    job = StatefulForeachBatch(count_words, key_columns=["word"], num_tasks=4, config=config,
                               output_schema="word string, count long", sink=write_counts)
    stream.writeStream.foreachBatch(job).option("checkpointLocation", ...).start()

Contract of one micro-batch ``(batch_df, batch_id)``, called on the driver by Spark:

- ``batch_df.repartition(num_tasks, *key_columns)``: the same key always lands in the same partition ``i`` (Spark's
  Murmur3 hash modulo ``num_tasks``), and partition ``i`` is the task ``task-<i>``. ``num_tasks`` is therefore fixed
  for the life of the state; it is written into every checkpoint and a change is refused with a ConfigError.
- On the executor, each task opens :class:`~statebackend.task.TaskStorage` restored to its **base**: the newest
  checkpoint whose batch id is below ``batch_id``. In the normal case that is the newest checkpoint and the local
  LMDB files already are that state (kept in ``state.local.dir`` between batches), so nothing is downloaded. Then it
  runs the user function, commits durably with input offsets ``{"batch": str(batch_id), "tasks": str(num_tasks)}``,
  closes, and only then hands back its output. Output is materialized before the commit; a task whose commit fails
  fails, so Spark never uses output of state that is not durable.
- The driver persists the output, forces it with one action (so each task runs once per batch, not once per action
  of the sink), then calls ``sink(df, batch_id)`` or returns the DataFrame.

Exactly once, and why it holds:

- A replayed batch id (Spark re-runs the last batch after a driver crash between our commit and its own) restores
  the newest checkpoint *below* that batch id and redoes the batch; the checkpoint log is linear, so the redo is
  committed as the newest entry and the earlier commit of the same batch is simply superseded. State never includes a
  batch twice, because the base is never a checkpoint of the batch being run.
- A retried task attempt does the same: its base is the newest checkpoint below the batch, whatever a failed
  attempt committed or left in its write batch (uncommitted writes are discarded with the attempt; a local store that
  is ahead of its base is rebuilt by the restore manager).
- Two attempts at once (speculation, or a zombie attempt): both read the same base and commit the same checkpoint
  sequence number; the checkpoint log's create-only write lets exactly one win; the other gets a
  :class:`~statebackend.errors.CommitError` (conflict) and fails, so its output is never used. On one machine the
  second attempt finds the task's local stores locked (:class:`StoreLockedError`): it then works in a private
  directory ``<state.local.dir>/.attempts/<random>/`` restored from the blob store, deleted when it ends.
- A batch id *older* than the newest committed batch means the Spark checkpoint was reset while the state was not
  (or two queries share ``job.name``): refused with a StateBackendError rather than silently mixing histories.

``on_replay="skip"`` lets a task whose newest checkpoint already is ``batch_id`` skip the work (its output for that
batch is then empty): only for jobs whose sink does not need a replayed batch's output again.

``pyspark``, ``pyarrow`` and ``pandas`` are imported here only; the rest of statebackend runs without them.
"""

from __future__ import annotations

import logging
import shutil
import time
import uuid
from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence
from pathlib import Path
from typing import Any

import attrs
from pyspark import AccumulatorParam, StorageLevel, TaskContext
from pyspark.sql import DataFrame, SparkSession
from pyspark.sql.types import BinaryType, DataType, LongType, StringType, StructField, StructType

from checkpoint import CheckpointLog, LogEntry
from statebackend.blobstore import open_blob_store
from statebackend.config import Settings
from statebackend.errors import ConfigError, NotFoundError, StateBackendError, StoreLockedError
from statebackend.task import TaskStorage, known_durable_seq

__all__ = [
    "BATCH_OFFSET",
    "TASKS_OFFSET",
    "StatefulForeachBatch",
    "TaskStats",
    "TaskStores",
    "local_spark_session",
    "read_state",
    "task_name",
]

log = logging.getLogger(__name__)

#: input offset keys of every checkpoint the driver writes
BATCH_OFFSET = "batch"
TASKS_OFFSET = "tasks"
#: under ``state.local.dir``: private directories of concurrent attempts of a task on one machine
ATTEMPTS_DIR = ".attempts"

MODES = ("rows", "arrow", "pandas")
ON_REPLAY = ("redo", "skip")

Sink = Callable[[DataFrame, int], Any]


def task_name(index: int) -> str:
    """The task name of partition ``index``: ``task-<index>``."""
    return f"task-{index}"


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
    """What one task attempt did in one batch (collected on the driver through an accumulator)."""

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


@attrs.define
class StatefulForeachBatch:
    """A ``foreachBatch`` callable that runs ``fn`` per task against durable keyed state. See the module docstring.

    ``fn(stores, rows)``: ``rows`` is an iterator of :class:`pyspark.sql.Row` (mode ``"rows"``), an iterator of
    ``pyarrow.RecordBatch`` (``"arrow"``) or one ``pandas.DataFrame`` with the task's whole input (``"pandas"``). It
    returns the task's output: an iterable of rows (tuples, Rows or dicts) for ``"rows"``; a ``pyarrow.Table``, a
    ``RecordBatch`` or an iterable of them for ``"arrow"``; a ``pandas.DataFrame`` (or iterable of them) for
    ``"pandas"``; or ``None`` for no output. ``fn`` and ``config`` travel to the executors: both must pickle.
    """

    fn: Callable[[TaskStores, Any], Any]
    key_columns: Sequence[str] = attrs.field(converter=tuple)
    num_tasks: int
    config: Mapping[str, Any] = attrs.field(converter=dict)
    output_schema: StructType | str | None = None
    mode: str = "rows"
    sink: Sink | None = None
    on_replay: str = "redo"
    #: stats of every task attempt of the last batch run, and of all batches (bench and tests read them)
    last_batch_stats: list[TaskStats] = attrs.field(init=False, factory=list)
    history: list[TaskStats] = attrs.field(init=False, factory=list)
    _previous: Any = attrs.field(init=False, default=None)

    def __attrs_post_init__(self) -> None:
        if self.mode not in MODES:
            raise ConfigError(f"StatefulForeachBatch mode {self.mode!r} is not one of {', '.join(MODES)}")
        if self.on_replay not in ON_REPLAY:
            raise ConfigError(f"StatefulForeachBatch on_replay {self.on_replay!r} is not one of {', '.join(ON_REPLAY)}")
        if not self.key_columns:
            raise ConfigError("StatefulForeachBatch needs at least one key column to partition the input by")
        if type(self.num_tasks) is not int or self.num_tasks < 1:
            raise ConfigError(f"StatefulForeachBatch num_tasks must be a positive int, got {self.num_tasks!r}")
        if self.mode != "rows" and self.output_schema is None:
            raise ConfigError(
                f"StatefulForeachBatch mode {self.mode!r} needs output_schema (a StructType or a DDL string such as "
                "'word string, count long'): Spark must know the schema before the tasks run"
            )
        Settings.from_config(self.config)  # a wrong key fails here, on the driver, not in every task

    def __call__(self, batch_df: DataFrame, batch_id: int) -> DataFrame | None:
        """Run micro-batch ``batch_id``; hand the output to the sink, or return it (persisted until the next call)."""
        if self._previous is not None:
            self._previous.unpersist()
            self._previous = None
        spark = batch_df.sparkSession
        accumulator = spark.sparkContext.accumulator([], _ListParam())
        runner = _TaskRunner(
            fn=self.fn,
            config=self.config,
            batch_id=int(batch_id),
            num_tasks=self.num_tasks,
            on_replay=self.on_replay,
            input_columns=tuple(batch_df.columns),
            stats=accumulator,
        )
        partitioned = batch_df.repartition(self.num_tasks, *self.key_columns)
        schema = self.output_schema  # a StructType or a DDL string: Spark accepts either
        if self.mode == "rows":
            rdd = partitioned.rdd.mapPartitionsWithIndex(runner.run_rows)
            rdd.persist(StorageLevel.MEMORY_AND_DISK)
            rdd.count()  # the one action that runs the tasks; everything after reads the persisted output
            output = _rows_frame(spark, rdd, schema)
            persisted: Any = rdd
        else:
            assert schema is not None  # checked at construction for every mode but "rows"
            run = runner.run_arrow if self.mode == "arrow" else runner.run_pandas
            mapped = (
                partitioned.mapInArrow(run, schema) if self.mode == "arrow" else partitioned.mapInPandas(run, schema)
            )
            output = mapped.persist(StorageLevel.MEMORY_AND_DISK)
            output.count()
            persisted = output
        self.last_batch_stats = sorted(accumulator.value, key=lambda s: (s.task_index, s.attempt))
        self.history.extend(self.last_batch_stats)
        if self.sink is None:
            self._previous = persisted
            return output
        try:
            self.sink(output, int(batch_id))
        finally:
            persisted.unpersist()
        return None


def read_state(
    spark: SparkSession,
    config: Mapping[str, Any],
    store: str,
    *,
    num_tasks: int,
    checkpoint: str | int = "latest",
) -> DataFrame:
    """A store's state as a DataFrame ``(task string, key, value)``, read from the blob store alone.

    ``checkpoint``: ``"latest"`` (each task's newest checkpoint) or a batch id (each task's state after that batch:
    its newest checkpoint with a batch id at most that one). Each task is restored on an executor into a temporary
    directory that is deleted afterwards; local state directories are never touched. Column types follow the store's
    serdes: ``string`` and ``json`` give strings, ``integer`` longs, ``bytes`` and ``pickle`` binary.
    """
    settings = Settings.from_config(config)
    if store not in settings.stores:
        raise ConfigError(
            f"read_state: no store {store!r} in the configuration; configured stores: "
            f"{', '.join(sorted(settings.stores)) or 'none'}"
        )
    if checkpoint != "latest" and (type(checkpoint) is not int or checkpoint < 0):
        raise ConfigError(f"read_state checkpoint must be 'latest' or a batch id (int >= 0), got {checkpoint!r}")
    store_settings = settings.stores[store]
    schema = StructType([
        StructField("task", StringType(), False),
        StructField("key", _column_type(store_settings.key_serde), False),
        StructField("value", _column_type(store_settings.msg_serde), True),
    ])
    # Only this store's keys: restoring the others would download state nobody asked for.
    reader_config = {k: v for k, v in config.items() if not k.startswith("stores.") or k.startswith(f"stores.{store}.")}
    reader = _StateReader(reader_config, store, checkpoint, num_tasks)
    rdd = spark.sparkContext.parallelize(range(num_tasks), num_tasks).mapPartitions(reader.read)
    return spark.createDataFrame(rdd, schema)


def local_spark_session(
    app_name: str = "statebackend", master: str = "local[2]", conf: Mapping[str, str] | None = None
) -> SparkSession:
    """A local SparkSession set up for statebackend jobs on one machine (examples, tests, benchmarks).

    Python workers run this interpreter (``PYSPARK_PYTHON``, unless set) and can import statebackend even when it is
    not installed (its source root is put on ``PYTHONPATH``); the UI and progress bars are off and shuffles use a few
    partitions, which is what a 2-core machine wants. ``conf`` adds or overrides Spark settings.
    """
    import os
    import sys

    os.environ.setdefault("PYSPARK_PYTHON", sys.executable)
    root = str(Path(__file__).resolve().parent.parent)
    paths = [p for p in os.environ.get("PYTHONPATH", "").split(os.pathsep) if p]
    if root not in paths:
        os.environ["PYTHONPATH"] = os.pathsep.join([root, *paths])
    builder = SparkSession.builder.appName(app_name).master(master)
    settings = {
        "spark.ui.enabled": "false",
        "spark.ui.showConsoleProgress": "false",
        "spark.sql.shuffle.partitions": "4",
        "spark.driver.memory": "2g",
        **(conf or {}),
    }
    for key, value in settings.items():
        builder = builder.config(key, value)
    return builder.getOrCreate()


# -- executor side ------------------------------------------------------------------------------------------------


class _ListParam(AccumulatorParam):  # type: ignore[type-arg]
    """Accumulates lists (of TaskStats) by concatenation."""

    def zero(self, value: list[Any]) -> list[Any]:
        return []

    def addInPlace(self, value1: list[Any], value2: list[Any]) -> list[Any]:  # pyspark's name
        value1.extend(value2)
        return value1


@attrs.frozen
class _TaskRunner:
    """The part of a batch that travels to the executors (pickled with ``fn`` and the config)."""

    fn: Callable[[TaskStores, Any], Any]
    config: Mapping[str, Any]
    batch_id: int
    num_tasks: int
    on_replay: str
    input_columns: tuple[str, ...]
    stats: Any

    def run_rows(self, index: int, rows: Iterable[Any]) -> Iterator[Any]:
        counted = _Counted(iter(rows))  # Spark passes an iterator (iter() returns it) but promises only an iterable
        outputs = self._run(index, lambda stores: list(self.fn(stores, counted) or ()), counted)
        return iter(outputs)

    def run_arrow(self, batches: Iterator[Any]) -> Iterator[Any]:
        counted = _Counted(batches, size=lambda batch: batch.num_rows)
        outputs = self._run(_partition_index(), lambda stores: _arrow_batches(self.fn(stores, counted)), counted)
        return iter(outputs)

    def run_pandas(self, frames: Iterator[Any]) -> Iterator[Any]:
        import pandas as pd

        def work(stores: TaskStores) -> list[Any]:
            parts = list(frames)
            frame = pd.concat(parts, ignore_index=True) if parts else pd.DataFrame(columns=list(self.input_columns))
            counted.count = len(frame)
            return _pandas_frames(self.fn(stores, frame))

        counted = _Counted(iter(()))
        outputs = self._run(_partition_index(), work, counted)
        return iter(outputs)

    def _run(self, index: int, work: Callable[[TaskStores], list[Any]], counted: _Counted) -> list[Any]:
        started = time.monotonic()
        context = TaskContext.get()
        attempt = context.attemptNumber() if context is not None else 0
        settings = Settings.from_config(self.config)
        name = task_name(index)
        blob_store = open_blob_store(settings.blob_store_url, settings.blob_store_options)
        private: Path | None = None
        try:
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
            if (self.on_replay == "skip" and latest is not None
                    and _batch_of(latest, name, self.num_tasks) == self.batch_id):
                log.info("%s: batch %d already committed as checkpoint #%d; skipping it", name, self.batch_id,
                         latest.seq)
                return []
            base = _base_checkpoint(checkpoint_log, latest, name, self.batch_id, self.num_tasks)
            try:
                storage = TaskStorage.open(settings, name, blob_store=blob_store, checkpoint=base, fence_seq=head)
            except StoreLockedError:
                # Another attempt of this task runs on this machine (speculation, or a retry while the first one
                # is still winding down): work in a private copy restored from the blob store; the commit protocol
                # decides which attempt wins.
                private = Path(settings.local_dir) / ATTEMPTS_DIR / uuid.uuid4().hex
                log.warning("%s attempt %d: local stores are locked by another attempt; using %s", name, attempt,
                            private)
                private_settings = attrs.evolve(settings, local_dir=private)
                storage = TaskStorage.open(private_settings, name, blob_store=blob_store, checkpoint=base,
                                           fence_seq=head)
            opened = time.monotonic()
            with storage:
                outputs = work(TaskStores(storage, index, self.batch_id))
                processed = time.monotonic()
                storage.commit_durably({BATCH_OFFSET: str(self.batch_id), TASKS_OFFSET: str(self.num_tasks)})
                committed = time.monotonic()
                sync_samples = storage.metrics.samples("commit.sync.ms")
                committed_seq = storage.commit_manager.next_seq - 1
            self.stats.add([TaskStats(
                batch_id=self.batch_id, task_index=index, attempt=attempt,
                base_seq=base.seq if base is not None else 0, committed_seq=committed_seq,
                open_ms=(opened - started) * 1000.0, process_ms=(processed - opened) * 1000.0,
                commit_ms=(committed - processed) * 1000.0,
                commit_sync_ms=sync_samples[-1] if sync_samples else 0.0,
                input_rows=counted.count, output_rows=sum(_size(o) for o in outputs), private_dir=private is not None,
            )])
            return outputs
        finally:
            blob_store.close()
            if private is not None:
                shutil.rmtree(private, ignore_errors=True)


@attrs.frozen
class _StateReader:
    config: Mapping[str, Any]
    store: str
    checkpoint: str | int
    num_tasks: int

    def read(self, indexes: Iterable[int]) -> Iterator[tuple[str, Any, Any]]:
        import tempfile

        settings = Settings.from_config(self.config)
        store_settings = settings.stores[self.store]
        for index in indexes:
            name = task_name(index)
            with tempfile.TemporaryDirectory(prefix="statebackend-read-") as tmp:
                private = attrs.evolve(settings, local_dir=Path(tmp))
                if self.checkpoint == "latest":
                    choice: Any = "latest"
                else:
                    wanted = int(self.checkpoint)
                    choice = _at_or_below(name, wanted, self.num_tasks)
                with TaskStorage.open(private, name, checkpoint=choice) as storage:
                    if choice != "latest" and storage.restored is None and storage.checkpoint_log.seqs():
                        raise NotFoundError(
                            f"read_state: {name} has no checkpoint at or below batch {self.checkpoint} (older "
                            f"checkpoints were deleted by retention, task.checkpoint.retained="
                            f"{settings.checkpoint_retained})"
                        )
                    raw = storage.store(self.store, typed=False)
                    for key, value in raw.items():
                        yield (name, _column_value(store_settings.key_serde, key),
                               _column_value(store_settings.msg_serde, value))


# -- helpers ------------------------------------------------------------------------------------------------------


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


def _batch_of(entry: LogEntry, name: str, num_tasks: int) -> int:
    offsets = entry.checkpoint.input_offsets
    batch = offsets.get(BATCH_OFFSET)
    if batch is None or not str(batch).isdigit():
        raise StateBackendError(
            f"{name}: checkpoint #{entry.seq} has no {BATCH_OFFSET!r} input offset ({dict(offsets)}); this state was "
            "not written by the Spark driver: give the Spark job its own job.name"
        )
    tasks = offsets.get(TASKS_OFFSET)
    if tasks is not None and tasks != str(num_tasks):
        raise ConfigError(
            f"{name}: the state was written with num_tasks={tasks} but this query uses num_tasks={num_tasks}; keys "
            f"are assigned to tasks by hash modulo num_tasks, so it cannot change while the state lives: set "
            f"num_tasks={tasks}, or start the job with a new job.name"
        )
    return int(batch)


def _base_checkpoint(
    checkpoint_log: CheckpointLog, latest: LogEntry | None, name: str, batch_id: int, num_tasks: int
) -> LogEntry | None:
    """The newest checkpoint with a batch id below ``batch_id`` (None: start empty)."""
    if latest is None:
        return None
    newest_batch = _batch_of(latest, name, num_tasks)
    if newest_batch < batch_id:
        return latest  # the normal case: one checkpoint read
    if newest_batch > batch_id:
        raise StateBackendError(
            f"{name}: Spark runs batch {batch_id} but the state already committed batch {newest_batch} (checkpoint "
            f"#{latest.seq} in {checkpoint_log.blob_store.describe()}); Spark only re-runs its last batch, so its "
            "checkpoint location was reset or another query uses the same job.name. Restore the Spark checkpoint, "
            "or start over with a new job.name (or delete the old state)"
        )
    base = checkpoint_log.find(lambda entry: _batch_of(entry, name, num_tasks) < batch_id)
    if base is None and min(checkpoint_log.seqs(), default=1) > 1:
        raise StateBackendError(
            f"{name}: batch {batch_id} is replayed but the checkpoint before it was deleted by retention "
            f"(task.checkpoint.retained); raise task.checkpoint.retained so a batch can be replayed that often"
        )
    if base is not None:
        log.info("%s: batch %d is replayed; restoring checkpoint #%d (batch %s) and redoing it", name, batch_id,
                 base.seq, base.checkpoint.input_offsets.get(BATCH_OFFSET))
    return base


def _at_or_below(name: str, batch_id: int, num_tasks: int) -> Callable[[LogEntry], bool]:
    def choose(entry: LogEntry) -> bool:
        return _batch_of(entry, name, num_tasks) <= batch_id

    return choose


def _arrow_batches(result: Any) -> list[Any]:
    import pyarrow as pa

    if result is None:
        return []
    if isinstance(result, pa.Table):
        return result.to_batches()
    if isinstance(result, pa.RecordBatch):
        return [result]
    batches: list[Any] = []
    for item in result:
        batches.extend(_arrow_batches(item))
    return batches


def _pandas_frames(result: Any) -> list[Any]:
    import pandas as pd

    if result is None:
        return []
    if isinstance(result, pd.DataFrame):
        return [result]
    return [frame for item in result for frame in _pandas_frames(item)]


def _size(output: Any) -> int:
    if hasattr(output, "num_rows"):
        return int(output.num_rows)
    if hasattr(output, "shape"):
        return int(output.shape[0])
    return 1


def _rows_frame(spark: SparkSession, rdd: Any, schema: Any) -> DataFrame:
    if schema is not None:
        return spark.createDataFrame(rdd, schema)
    if rdd.isEmpty():
        return spark.createDataFrame([], StructType([]))
    return spark.createDataFrame(rdd)


def _column_type(serde: str) -> DataType:
    return {"string": StringType(), "json": StringType(), "integer": LongType()}.get(serde, BinaryType())


def _column_value(serde: str, data: bytes) -> Any:
    if serde in ("string", "json"):
        return data.decode("utf-8")
    if serde == "integer":
        from statebackend.serdes import get_serde

        return get_serde("integer").from_bytes(data)
    return bytearray(data)
