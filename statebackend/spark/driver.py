"""The driver side: the callable given to ``writeStream.foreachBatch``, what the user function gets, and the per-task
statistics that travel back. The Spark resources its runs keep batch after batch (the affinity anchor, the stats
accumulator, the executor count, the release of a run's output) are in :mod:`statebackend.spark.runs`."""

from __future__ import annotations

import datetime
import functools
import logging
import pickle
import secrets
from collections.abc import Callable, Iterable, Mapping, Sequence
from typing import Any

import attrs
from pyspark import StorageLevel
from pyspark.sql import DataFrame, SparkSession
from pyspark.sql.functions import col
from pyspark.sql.pandas.types import to_arrow_schema
from pyspark.sql.types import BinaryType, StructField, StructType

from statebackend.config import Settings
from statebackend.errors import ConfigError
from statebackend.exporters import start_exporters
from statebackend.metrics import Metrics, MetricsSnapshot
from statebackend.microbatch.batches import MODES, ON_REPLAY
from statebackend.microbatch.coordinator import BatchCoordinator, RunResult
from statebackend.microbatch.held import DEFAULT_BOUND
from statebackend.microbatch.keygroups import DEFAULT_KEY_GROUPS, MAX_KEY_GROUPS, route, with_every_partition
from statebackend.microbatch.protocol import BatchReport
from statebackend.microbatch.spec import BatchSpec, JobSpec, job_settings
from statebackend.microbatch.timers import TIMERS_STORE, Timer
from statebackend.microbatch.watermark import EVENT_TIME_TYPES, EventClock, parse_delay
from statebackend.spark.errors import summarized
from statebackend.spark.executor import TaskRunner, TaskStores
from statebackend.spark.heartbeat import drop_heartbeats, has_heartbeat_clock
from statebackend.spark.initial import InitialState, initial_state_of
from statebackend.spark.runs import _checkpointed_rdd, _release_checkpoint, _rows_frame, _SparkRuns, _TaskRun
from statebackend.spark.session import (
    effective_config,
    is_connect,
    spark_conf_keys,
    speculation,
)
from statebackend.spark.stats import STATS_COLUMN, TaskStats
from statebackend.store.ttl import wall_clock_ms

log = logging.getLogger(__name__)

Sink = Callable[[DataFrame, int], Any]


def _columns(value: Iterable[str]) -> tuple[str, ...]:
    """``key_columns`` as given (a list, a tuple, ...), kept as a tuple."""
    return tuple(value)


def _config(value: Mapping[str, Any]) -> dict[str, Any]:
    """``config`` as given, copied: a later change to the caller's mapping does not reach the job."""
    return dict(value)


@attrs.define(eq=False)
class StatefulForeachBatch(_SparkRuns):
    """A ``foreachBatch`` callable that runs ``fn`` per task against durable keyed state. See the module docstring.

    ``fn(stores, rows)``: ``rows`` is an iterator of :class:`pyspark.sql.Row` (mode ``"rows"``), an iterator of
    ``pyarrow.RecordBatch`` (``"arrow"``) or one ``pandas.DataFrame`` with the task's whole input (``"pandas"``). It
    returns the task's output: an iterable of rows (tuples, Rows or dicts) for ``"rows"``; a ``pyarrow.Table``, a
    ``RecordBatch`` or an iterable of them for ``"arrow"``; a ``pandas.DataFrame`` (or iterable of them) for
    ``"pandas"``; or ``None`` for no output. ``fn`` and ``config`` travel to the executors: both must pickle.
    """

    fn: Callable[[TaskStores, Any], Any]
    key_columns: Sequence[str] = attrs.field(converter=_columns)
    num_tasks: int
    config: Mapping[str, Any] = attrs.field(converter=_config)
    output_schema: StructType | str | None = None
    mode: str = "rows"
    sink: Sink | None = None
    on_replay: str = "redo"
    #: keep each task open in its Python worker after its durable commit, for that task's next batch in the same
    #: worker (``statebackend.microbatch.kept``); False: open and close the task every batch
    keep_open: bool = True
    #: bytes of each task's output held in memory until its commit is durable; beyond, it waits in a spill file under
    #: ``state.local.dir/.spill/``
    output_memory_bytes: int = DEFAULT_BOUND
    #: the number of key groups the state is split into, fixed for the life of the state (recorded in every
    #: checkpoint); ``num_tasks`` may change between runs up to it (``statebackend.microbatch.keygroups``)
    key_groups: int = DEFAULT_KEY_GROUPS
    #: ``key_of(store_name, key)``: the key column value(s) of a stored key, for stores whose keys are not the key
    #: column value (one key column) or the tuple of them (several); used only when the state is rescaled
    key_of: Callable[[str, Any], Any] | None = None
    #: classic Spark: run each task on the executor that ran it in the previous batch (where its local state is),
    #: through a cached anchor partition per task (see :meth:`_anchored`): rows mode always, arrow and pandas modes
    #: when there is more than one executor (through an RDD of Rows); False: wherever Spark likes
    affinity: bool = True
    #: True: a task kept open in a reused worker hands its output on right after the sync part of its commit, its
    #: upload going on beside the next tasks; the driver reads every such checkpoint back from the task's log before
    #: the batch ends (``statebackend.microbatch.confirm``), and runs the batch again, every task waiting for its
    #: checkpoint, when one is not there within ``confirm_timeout_s``. False: every task waits for its own
    #: checkpoint. None (default): True when the blob store's uploads wait on the network (``az://``, ``s3://``),
    #: False on a local directory (``file://``: measured, the durable latency of a commit doubles for a few percent
    #: of batch time, docs/benchmarks-spark.md). Needs ``on_replay="redo"`` and ``task.checkpoint.retained >= 3`` (a
    #: run again is a replay), and no ``spark.speculation``; else every task waits
    confirm_on_driver: bool | None = None
    confirm_timeout_s: float = 60.0
    #: ``on_timers(stores, due_timers)``: called in each task after ``fn``, every batch that has timers due, with the
    #: due timers in time order (``statebackend.microbatch.timers``); returns output as ``fn`` does. Given, ``fn`` and
    #: the handler may register timers through ``stores.timers``, kept in the task's timer store
    on_timers: Callable[[TaskStores, list[Timer]], Any] | None = None
    #: the event-time column (timestamp, or long ms) and the delay of the watermark event-time timers fire at
    #: (``statebackend.microbatch.watermark``): batch N's watermark is the largest event time of the batches before N
    #: minus the delay, never decreasing. ``watermark_delay``: ms, a timedelta, or a duration such as "10s", "5min"
    event_time: str | None = None
    watermark_delay: int | str | datetime.timedelta = 0
    #: store name -> a DataFrame (or a function of the SparkSession giving one) of (key, value) to start the store
    #: from, loaded into each task before the first batch, once (``statebackend.spark.initial``)
    initial_state: InitialState | None = attrs.field(default=None, converter=initial_state_of)
    #: ``on_batch(report)``: called on the driver after every batch with its :class:`BatchReport` (what the INFO line
    #: says, as numbers, and every task attempt's :class:`TaskStats`); its exception is logged, never raised
    on_batch: Callable[[BatchReport], Any] | None = None
    #: ``on_initial_state(stores, keys)``: called once per task by the ``initial_state`` load, after the task's rows
    #: are loaded and before the load's checkpoint, with the key column values (a tuple for several key columns) of
    #: the keys loaded into the task, sorted; it may register timers (``stores.timers``) and change state, which the
    #: load's checkpoint holds with the rows (Spark's ``handleInitialState``). It returns None (no output)
    on_initial_state: Callable[[TaskStores, list[Any]], None] | None = None
    #: with ``event_time``: rows whose event time is below the batch's watermark (late, as Spark drops them; a row at
    #: the watermark is on time) are dropped before ``fn`` sees them. False: ``fn`` gets them and may ask
    #: ``stores.is_late(event_time)``
    drop_late: bool = False
    #: ``on_expiry(stores, expired)``: called in each task after ``on_timers`` with the keys of TTL stores the batch's
    #: sweep found expired (:class:`~statebackend.microbatch.attempt.Expired`: store, key, last value, when), deleted
    #: in the same commit as the callback's changes: exactly once per expiry as timers are
    #: (``docs/spark.md``, "Timers and initial state"); returns output as ``fn`` does
    on_expiry: Callable[[TaskStores, list[Any]], Any] | None = None
    #: the batch clock, ms since the epoch (``stores.now_ms``, TTL stores and processing-time timers read it); None:
    #: the wall clock. Tests give a :class:`statebackend.testing.ManualClock`
    clock: Callable[[], int] | None = None
    #: probe the blob store when the job is built (it exists or can be created, the credentials work, it takes a
    #: write): a wrong ``blob.store.*`` fails here, saying which check and how to fix it. False: the first batch finds
    #: out (the driver cannot reach the blob store, say, where only the executors can)
    probe: bool = True
    #: the report of the last batch run (None before the first)
    last_batch: BatchReport | None = attrs.field(init=False, default=None)
    #: the merged metrics of every task attempt of the last batch (labels ``job_name`` and ``task``), and of all
    #: batches so far (exported by the driver's own Prometheus exporters when its config sets ``metrics.prometheus.*``)
    last_batch_metrics: MetricsSnapshot = attrs.field(init=False, factory=MetricsSnapshot)
    metrics: Metrics = attrs.field(init=False, factory=Metrics)
    _exporting: bool = attrs.field(init=False, default=False)
    #: frees the output returned by the last call (no sink), at the next call
    _previous: Callable[[], None] | None = attrs.field(init=False, default=None)
    #: (SparkContext, each task's anchor JavaRDD, their union) of :meth:`_anchored`
    _anchor: tuple[Any, list[Any], Any] | None = attrs.field(init=False, default=None)
    #: (the executors :meth:`_spread` last saw, its looks for them so far; -1: even, or given up, for them)
    _spreading: tuple[str, int] | None = attrs.field(init=False, default=None)
    _parsed_schema: StructType | None = attrs.field(init=False, default=None)
    _input_schema: StructType | None = attrs.field(init=False, default=None)
    #: the SparkContext seen to run in local mode (one executor), by :meth:`_executors`
    _local_context: Any = attrs.field(init=False, default=None)
    #: (the effective configuration, its settings as parsed once, the job spec built on them, the coordinator)
    _job: tuple[dict[str, Any], Settings, JobSpec | None, BatchCoordinator] | None = attrs.field(
        init=False, default=None
    )
    #: (SparkContext, the accumulator of :meth:`_stats_accumulator`)
    _stats_to: tuple[Any, Any] | None = attrs.field(init=False, default=None)
    #: (batch id, num_tasks, key_groups) of the last batch whose tasks all committed under this object
    _completed: tuple[int, int, int] | None = attrs.field(init=False, default=None)
    #: the watermark's state (with ``event_time``), the event-time column's Spark type and the session time zone
    _event_clock: EventClock | None = attrs.field(init=False, default=None)
    _event_type: str | None = attrs.field(init=False, default=None)
    _time_zone: str | None = attrs.field(init=False, default=None)
    #: the executor each task ran on last, and the tasks of the last batch that ran on another one than before
    _homes: dict[int, str] = attrs.field(init=False, factory=dict)
    last_batch_moved: list[int] = attrs.field(init=False, factory=list)
    _connect_noted: bool = attrs.field(init=False, default=False)

    def __attrs_post_init__(self) -> None:
        if self.mode not in MODES:
            raise ConfigError(f"StatefulForeachBatch mode {self.mode!r} is not one of {', '.join(MODES)}")
        if self.on_replay not in ON_REPLAY:
            raise ConfigError(f"StatefulForeachBatch on_replay {self.on_replay!r} is not one of {', '.join(ON_REPLAY)}")
        if not self.key_columns:
            raise ConfigError("StatefulForeachBatch needs at least one key column to partition the input by")
        if type(self.output_memory_bytes) is not int or self.output_memory_bytes < 0:
            raise ConfigError(
                f"StatefulForeachBatch output_memory_bytes must be an int >= 0, got {self.output_memory_bytes!r}"
            )
        if type(self.num_tasks) is not int or self.num_tasks < 1:
            raise ConfigError(f"StatefulForeachBatch num_tasks must be a positive int, got {self.num_tasks!r}")
        if type(self.key_groups) is not int or not 1 <= self.key_groups <= MAX_KEY_GROUPS:
            raise ConfigError(
                f"StatefulForeachBatch key_groups must be an int from 1 to {MAX_KEY_GROUPS}, got {self.key_groups!r}"
            )
        if self.num_tasks > self.key_groups:
            raise ConfigError(
                f"StatefulForeachBatch num_tasks ({self.num_tasks}) cannot exceed key_groups "
                f"({self.key_groups}): each task owns at least one key group"
            )
        if self.key_of is not None and not callable(self.key_of):
            raise ConfigError(
                f"StatefulForeachBatch key_of must be a function (store name, key) -> key column "
                f"value(s), got {self.key_of!r}"
            )
        if self.mode != "rows" and self.output_schema is None:
            raise ConfigError(
                f"StatefulForeachBatch mode {self.mode!r} needs output_schema (a StructType or a DDL string such as "
                "'word string, count long'): Spark must know the schema before the tasks run"
            )
        if self.on_timers is not None and not callable(self.on_timers):
            raise ConfigError(
                f"StatefulForeachBatch on_timers must be a function (stores, due timers) -> output, got "
                f"{self.on_timers!r}"
            )
        if self.event_time is not None:
            if not isinstance(self.event_time, str) or not self.event_time:
                raise ConfigError(f"StatefulForeachBatch event_time must be a column name, got {self.event_time!r}")
            self._event_clock = EventClock(parse_delay(self.watermark_delay))
        elif parse_delay(self.watermark_delay):
            raise ConfigError(
                "StatefulForeachBatch watermark_delay needs event_time: the column the watermark is derived from"
            )
        if not isinstance(self.drop_late, bool):
            raise ConfigError(f"StatefulForeachBatch drop_late must be True or False, got {self.drop_late!r}")
        if self.drop_late and self.event_time is None:
            raise ConfigError(
                "StatefulForeachBatch drop_late needs event_time: a row is late when its event time is below the "
                "watermark derived from that column"
            )
        for name, hook in (("on_initial_state", self.on_initial_state), ("on_expiry", self.on_expiry)):
            if hook is not None and not callable(hook):
                raise ConfigError(f"StatefulForeachBatch {name} must be a function (stores, ...), got {hook!r}")
        if self.on_initial_state is not None and self.initial_state is None:
            raise ConfigError(
                "StatefulForeachBatch on_initial_state needs initial_state: it is called by the initial-state load, "
                "with the keys it loaded"
            )
        if self.clock is not None and not callable(self.clock):
            raise ConfigError(
                f"StatefulForeachBatch clock must be a function () -> ms since the epoch (e.g. "
                f"statebackend.testing.ManualClock), got {self.clock!r}"
            )
        # a wrong key fails here, on the driver, not in every task; keys may also come from the active session's
        # Spark conf (spark.statebackend.*), which is read again at every batch (and parsed only when it changed)
        active = SparkSession.getActiveSession()
        settings = self._settings({**(spark_conf_keys(active) if active is not None else {}), **self.config})
        if self.initial_state is not None:
            self.initial_state.check(settings)  # the timer store, an unknown store, a list or map store: refused now
        if self.on_expiry is not None:
            swept = [
                name
                for name, store in settings.stores.items()
                if store.ttl_ms is not None and store.ttl_sweep_keys > 0 and name != TIMERS_STORE
            ]
            if not swept:
                raise ConfigError(
                    "StatefulForeachBatch on_expiry is called for keys of TTL stores found expired by the sweep, but "
                    "no store has stores.<name>.ttl.ms with stores.<name>.ttl.sweep.keys > 0; configured stores: "
                    f"{', '.join(sorted(settings.stores)) or 'none'}"
                )
        if self.probe:
            # the blob store exists (or is created), its credentials work and it takes writes: said now, in the
            # user's words, not at the first batch inside a Spark trace
            from statebackend.probe import probe_blob_store

            log.info("%s", probe_blob_store(settings).summary())

    def __call__(self, batch_df: DataFrame, batch_id: int) -> None:
        """Run micro-batch ``batch_id`` and hand its output to the sink: what ``foreachBatch(job)`` calls (its type is
        ``foreachBatch``'s, ``(DataFrame, int) -> None``). Without a sink the output is held until the next call;
        :meth:`run_batch` returns it."""
        self.run_batch(batch_df, batch_id)

    def run_batch(self, batch_df: DataFrame, batch_id: int) -> DataFrame | None:
        """Run micro-batch ``batch_id``; hand the output to the sink (``None``), or, without a sink, return it (held,
        and readable, until the next call): for a driver that runs batches itself, as the examples and tests do."""
        if self._previous is not None:
            self._previous()
            self._previous = None
        heartbeat_clock = has_heartbeat_clock(batch_df)
        if heartbeat_clock and self._event_clock is None:
            raise ConfigError(
                "with_heartbeat(advance_watermark=True) moves the watermark with the batch clock, but "
                "StatefulForeachBatch has no event_time: give event_time (and watermark_delay), or drop "
                "advance_watermark"
            )
        batch_df = drop_heartbeats(batch_df)  # rows of with_heartbeat: a batch to run, nothing for fn
        spark = batch_df.sparkSession
        batch_id = int(batch_id)
        now_ms = self._now_ms()
        settings = self._settings(effective_config(spark, self.config))
        job, coordinator = self._job_spec(batch_df, settings)
        if not self._exporting:  # in the process that runs the batches (under Spark Connect, the server's)
            start_exporters(settings, self.metrics, labels={"job_name": settings.job_name})
            self._exporting = True
        if self.initial_state is not None:
            self.initial_state.load_once(self, batch_df, settings, batch_id, now_ms)
        event = (
            self._event_clock.for_batch(spark, settings, batch_id) if self._event_clock is not None else (None, None)
        )
        event_max = event[1]
        if heartbeat_clock:  # the batch clock counts as an event time seen in this batch: the next watermark moves
            event_max = now_ms if event_max is None else max(event_max, now_ms)
        batch = BatchSpec(
            batch_id=batch_id,
            now_ms=now_ms,
            watermark_ms=event[0],
            event_max_ms=event_max,
            previous_seen=self._completed == (batch_id - 1, self.num_tasks, self.key_groups),
        )

        def run_tasks(confirming: bool) -> RunResult:
            return self._run_tasks(batch_df, job, attrs.evolve(batch, confirm_on_driver=confirming))

        output: DataFrame  # what run_tasks gave (the coordinator does not know Spark's types)
        try:
            release, output, report = coordinator.run(
                batch_id, run_tasks, confirming=coordinator.confirms(speculation=speculation(spark))
            )
        except Exception as exc:
            summary = summarized(exc, batch_id)
            if summary is None:
                raise
            log.error("%s", summary)
            raise summary from exc
        self._completed = (batch_id, self.num_tasks, self.key_groups)  # every task committed (or skipped) it
        self.last_batch = report
        if self._event_clock is not None:
            self._event_clock.completed(batch_id, report.tasks, self.num_tasks)
        self._note_moves(batch_id, report.tasks)
        self.last_batch_metrics = MetricsSnapshot.merged(s.metrics for s in report.tasks if s.metrics is not None)
        if self.sink is None:
            self._previous = release
            return output
        try:
            self.sink(output, batch_id)
        finally:
            release()
        return None

    # -- what earlier releases exposed, now read from the batch's report and the coordinator ---------------------------

    @property
    def last_batch_stats(self) -> list[TaskStats]:
        """Every task attempt's :class:`TaskStats` of the last batch's run whose output was used."""
        return list(self.last_batch.tasks) if self.last_batch is not None else []

    @property
    def history(self) -> list[TaskStats]:
        """Every task attempt's :class:`TaskStats` of every batch so far (runs discarded for a run again included)."""
        return self._job[3].history if self._job is not None else []

    @property
    def last_batch_ms(self) -> float:
        """Wall time of the last batch's call (tasks, confirmation, a run again), ms."""
        return self.last_batch.batch_ms if self.last_batch is not None else 0.0

    @property
    def last_confirm_ms(self) -> float:
        """Wall time the driver spent confirming the last batch's checkpoints, ms (0: none to confirm)."""
        return self._job[3].last_confirm_ms if self._job is not None else 0.0

    def _now_ms(self) -> int:
        """The batch clock: ``clock()`` (checked: an int of ms), else the wall clock."""
        if self.clock is None:
            return wall_clock_ms()
        now = self.clock()
        if type(now) is not int:
            raise ConfigError(f"StatefulForeachBatch clock() must return ms since the epoch (an int), got {now!r}")
        return now

    def _settings(self, config: dict[str, Any]) -> Settings:
        """The settings of ``config``: parsed the first time and whenever the configuration changed (a
        ``spark.statebackend.*`` key of the session's conf), else the ones parsed before. The job spec and the
        coordinator are built again on new settings."""
        if self._job is not None and self._job[0] == config:
            return self._job[1]
        settings = job_settings(config, timers=self.on_timers is not None)
        if self._job is not None:
            self._job[3].close()
        coordinator = BatchCoordinator(
            settings,
            self.num_tasks,
            self.metrics,
            self.confirm_on_driver,
            self.confirm_timeout_s,
            self.on_replay,
            self.on_batch,
        )
        if self._job is not None:
            coordinator.carry_on_from(self._job[3])
        self._job = (dict(config), settings, None, coordinator)
        return settings

    def _job_spec(self, batch_df: DataFrame, settings: Settings) -> tuple[JobSpec, BatchCoordinator]:
        """The job's spec on ``settings``, built at the first batch that has them (it reads the key columns' types and
        the input's columns from the batch's schema, which a streaming query's batches share)."""
        assert self._job is not None and self._job[1] is settings
        config, _, job, coordinator = self._job
        if job is not None and job.input_columns != tuple(batch_df.columns):
            job = attrs.evolve(job, input_columns=tuple(batch_df.columns))  # pandas mode's empty frame has them
            self._job = (config, settings, job, coordinator)
        if job is None:
            event = self.event_time is not None
            job = JobSpec(
                settings=attrs.evolve(settings, metrics_prometheus_port=None),
                key_columns=tuple(self.key_columns),
                drop_late=self.drop_late,
                on_expiry=self.on_expiry,
                fn=self.fn,
                num_tasks=self.num_tasks,
                on_replay=self.on_replay,
                input_columns=tuple(batch_df.columns),
                keep_open=self.keep_open,
                output_memory_bytes=self.output_memory_bytes,
                key_groups=self.key_groups,
                key_types=self._read_key_types(batch_df),
                key_of=self.key_of,
                on_timers=self.on_timers,
                event_time=self.event_time,
                event_time_type=self._event_time_type(batch_df) if event else "",
                time_zone=self._session_time_zone(batch_df.sparkSession) if event else "UTC",
            )
            self._job = (config, settings, job, coordinator)
        return job, coordinator

    def _run_tasks(
        self,
        batch_df: DataFrame,
        job: JobSpec,
        batch: BatchSpec,
        *,
        every_partition: bool = False,
    ) -> _TaskRun:
        """Run the batch's tasks (one action, one job): what frees the held output, the output, the tasks' stats.

        Classic Spark: the tasks report their stats through an accumulator (:class:`StatsParam`) and their output is
        kept by the action itself, the same single job the no-state floor runs: an RDD persisted and counted (rows
        through an RDD), or a local checkpoint of the mapped DataFrame counted (one executor). Measured on
        ``local[2]``, a DataFrame's ``persist()`` and a second job to collect the stats from it cost about 100 ms a
        batch more (docs/benchmarks-spark.md). Spark Connect has neither accumulators nor RDDs, and a local
        checkpoint's blocks lost with an executor are never computed again: there, and on the DataFrame route with
        several executors, each task's stats come as one more row of its output, read from the persisted output.

        Every task runs every batch, also without input. An RDD has every partition of the repartition, rows or not;
        a DataFrame over input Spark proves empty before it runs (an empty local relation, a filter on false, a
        limit of 0) is planned with no partition at all, so when no task of the DataFrame route reported and its
        output has no partition, the batch runs again over :func:`with_every_partition` (``every_partition``)."""
        spark = batch_df.sparkSession
        remote = is_connect(spark)
        if remote and self.affinity and not self._connect_noted:
            self._connect_noted = True
            log.info(
                "Spark Connect has no RDDs and no preferred locations: tasks run where Spark's scheduler puts "
                "them (affinity has no effect); a task kept open is handed over within a machine, and a task "
                "that moves catches up from the blob store (job.last_batch_moved lists them)"
            )
        run_id = secrets.token_hex(8)
        stats_to = None if remote else self._stats_accumulator(spark)
        batch = attrs.evolve(batch, run_id=run_id)
        # arrow and pandas modes go through an RDD of Rows only for affinity, when there is more than one executor
        # to choose from (the DataFrame route, Arrow all the way, cannot be pinned)
        through_rdd = not remote and (self.mode == "rows" or (self.affinity and self._executors(spark) > 1))
        if through_rdd:
            if self.mode == "rows":
                schema: Any = self._struct(spark) if self.output_schema is not None else None
                runner = TaskRunner(job, attrs.evolve(batch, stats_to=stats_to, output_struct=schema))
                task: Any = runner.run_rows
            else:
                schema = self._struct(spark)
                runner = TaskRunner(
                    job,
                    attrs.evolve(
                        batch,
                        stats_to=stats_to,
                        output_schema=to_arrow_schema(schema),
                        input_schema=to_arrow_schema(batch_df.schema),
                    ),
                )
                task = runner.run_arrow_from_rows if self.mode == "arrow" else runner.run_pandas_from_rows
            rows = route(batch_df, self.key_columns, self.num_tasks, self.key_groups).rdd
            if self.affinity:
                rdd = self._anchored(spark, rows).mapPartitionsWithIndex(
                    functools.partial(runner.run_anchored, task, rows._jrdd_deserializer)
                )
            else:
                rdd = rows.mapPartitionsWithIndex(task)
            rdd.persist(StorageLevel.MEMORY_AND_DISK)
            try:
                rdd.count()  # the one action: it runs the tasks, and the sink reads the output it cached
                stats = self._reported(stats_to, run_id)
            except BaseException:
                rdd.unpersist()
                raise
            return rdd.unpersist, _rows_frame(spark, rdd, schema), stats
        # rows mode without output_schema under Spark Connect: no output columns; a task whose function returns rows
        # fails naming output_schema (TaskRunner._after_fn)
        schema = self._struct(spark) if self.output_schema is not None else StructType([])
        if STATS_COLUMN in schema.fieldNames():
            raise ConfigError(
                f"StatefulForeachBatch output_schema has a column named {STATS_COLUMN!r}, the column the tasks' "
                "statistics travel in under Spark Connect: rename it"
            )
        # Arrow all the way on classic Spark with one executor (local mode): the one action computes a local
        # checkpoint of the mapped output (its rows kept in the block manager, memory then disk), the stats going
        # through the accumulator. A block of a local checkpoint is never computed again, so with more executors,
        # where one may be lost before the sink read its blocks, the persisted route below is taken instead, which
        # computes them again; its stats travel as rows, as under Spark Connect.
        if stats_to is not None and self._executors(spark) > 1:
            stats_to = None
        runner = TaskRunner(
            job, attrs.evolve(batch, stats_to=stats_to, output_schema=to_arrow_schema(schema), output_struct=schema)
        )
        source = with_every_partition(batch_df, self._input_struct(batch_df)) if every_partition else batch_df
        partitioned = route(source, self.key_columns, self.num_tasks, self.key_groups)
        again = functools.partial(self._run_tasks, batch_df, job, batch, every_partition=True)
        if self.mode == "pandas":
            map_in: Any = partitioned.mapInPandas
            function: Any = runner.run_pandas
        else:
            map_in = partitioned.mapInArrow
            function = runner.run_arrow if self.mode == "arrow" else runner.run_rows_arrow
        if stats_to is not None:
            checkpointed = map_in(function, schema).localCheckpoint(eager=False)
            try:
                _checkpointed_rdd(checkpointed).count()  # what eager=True runs; here a failure releases what it kept
                stats = self._reported(stats_to, run_id)
            except BaseException:
                _release_checkpoint(checkpointed)
                raise
            if not stats and not every_partition and _checkpointed_rdd(checkpointed).getNumPartitions() == 0:
                _release_checkpoint(checkpointed)
                return self._no_partition(batch.batch_id, again)
            return functools.partial(_release_checkpoint, checkpointed), checkpointed, stats
        # Spark Connect (and classic Spark with several executors): each task's stats in one extra row, in a column
        # that is null in every output row
        extended = StructType(
            [
                *(StructField(f.name, f.dataType, True) for f in schema.fields),
                StructField(STATS_COLUMN, BinaryType(), True),
            ]
        )
        persisted = map_in(function, extended).persist(StorageLevel.MEMORY_AND_DISK)
        # The one action that runs the tasks: it collects their stats rows, and computing any part of a persisted
        # DataFrame caches its partitions whole, so the output is cached by it too.
        stats_column = col(STATS_COLUMN)
        try:
            stats = [
                pickle.loads(row[0]) for row in persisted.where(stats_column.isNotNull()).select(stats_column).collect()
            ]
        except BaseException:
            persisted.unpersist()
            raise
        # Under Spark Connect a task's stats are in its output's cached block: none at all means no partition
        if not stats and not every_partition and (remote or persisted._jdf.rdd().getNumPartitions() == 0):
            persisted.unpersist()
            return self._no_partition(batch.batch_id, again)
        return persisted.unpersist, persisted.where(stats_column.isNull()).drop(STATS_COLUMN), stats

    def _event_time_type(self, batch_df: DataFrame) -> str:
        """The Spark type name of the event-time column, read once (checked: a timestamp, or long ms)."""
        if self._event_type is None:
            fields = {field.name: field.dataType.typeName() for field in batch_df.schema.fields}
            found = fields.get(str(self.event_time))
            if found not in EVENT_TIME_TYPES:
                raise ConfigError(
                    f"StatefulForeachBatch event_time {self.event_time!r} must be a column of type "
                    f"{', '.join(EVENT_TIME_TYPES)} (long/integer: ms since the epoch); the batch's columns are "
                    f"{', '.join(f'{n} {t}' for n, t in fields.items())}"
                )
            self._event_type = found
        return self._event_type

    def _session_time_zone(self, spark: SparkSession) -> str:
        """The session time zone (pandas frames hold naive timestamps in it), read once."""
        if self._time_zone is None:
            self._time_zone = str(spark.conf.get("spark.sql.session.timeZone", "UTC") or "UTC")
        return self._time_zone

    def _note_moves(self, batch_id: int, stats: Sequence[TaskStats]) -> None:
        """Which tasks of the batch ran on another executor than in their previous batch (their local state was not
        there, or not current: a restore or a catch-up), in ``last_batch_moved``."""
        ran = {s.task_index: s.executor for s in stats if s.executor}
        self.last_batch_moved = sorted(t for t, where in ran.items() if self._homes.get(t, where) != where)
        self._homes.update(ran)
        if self.last_batch_moved:
            log.info(
                "batch %d: task(s) %s ran on another executor than in their previous batch",
                batch_id,
                self.last_batch_moved,
            )

    def _read_key_types(self, batch_df: DataFrame) -> tuple[str, ...]:
        fields = {field.name: field.dataType for field in batch_df.schema.fields}
        missing = [c for c in self.key_columns if c not in fields]
        if missing:
            raise ConfigError(
                f"StatefulForeachBatch key columns {missing} are not in the batch's columns ({', '.join(fields)})"
            )
        return tuple(fields[c].typeName() for c in self.key_columns)

    def _input_struct(self, batch_df: DataFrame) -> StructType:
        """The batch's schema, read once (a streaming query's batches share it; reading costs a round trip)."""
        if self._input_schema is None:
            self._input_schema = batch_df.schema
        return self._input_schema

    def _struct(self, spark: SparkSession) -> StructType:
        """The output schema as a StructType (a DDL string is parsed by Spark, once)."""
        if isinstance(self.output_schema, StructType):
            return self.output_schema
        if self._parsed_schema is None:
            self._parsed_schema = spark.createDataFrame([], self.output_schema).schema
        return self._parsed_schema
