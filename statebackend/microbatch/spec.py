"""What the driver decides for the workers: once per job (:class:`JobSpec`) and once per batch (:class:`BatchSpec`).

The configuration is parsed once, on the driver, by :func:`job_settings`; the workers get the parsed
:class:`~statebackend.config.Settings` inside the pickled spec and never parse it again. A worker tells the
configurations of two jobs (or of one job before and after a change) apart by :attr:`JobSpec.fingerprint`, computed
with the spec, not per task."""

from __future__ import annotations

import hashlib
from collections.abc import Callable, Mapping
from typing import Any

import attrs

from statebackend.config import Settings

__all__ = ["BatchSpec", "JobSpec", "config_fingerprint", "job_settings"]


def job_settings(config: Mapping[str, Any], *, timers: bool = False) -> Settings:
    """The job's settings: ``config`` parsed (a wrong key or value raises :class:`ConfigError` naming it), with the
    timer store declared when the job has timers (:func:`statebackend.microbatch.timers.with_timer_store`). The one
    place the micro-batch driver parses a configuration."""
    if not timers:
        return Settings.from_config(config)
    from statebackend.microbatch.timers import TIMERS_STORE, with_timer_store

    prefix = f"stores.{TIMERS_STORE}."
    own = Settings.from_config({key: value for key, value in config.items() if not key.startswith(prefix)})
    return Settings.from_config(with_timer_store(config, own))


def config_fingerprint(settings: Settings) -> str:
    """A short digest of the configuration as given (every key and value): equal for equal configurations."""
    text = repr(sorted((str(key), repr(value)) for key, value in settings.raw.items()))
    return hashlib.blake2b(text.encode(), digest_size=12).hexdigest()


@attrs.frozen(eq=False)
class JobSpec:
    """Everything a task attempt needs that stays the same from batch to batch. Built on the driver at the job's
    first batch (the key columns' types come from the batch's schema), rebuilt only when the configuration changes
    (a ``spark.statebackend.*`` key in the session's conf); pickled to the workers with each batch's tasks.

    ``fn(stores, rows)`` and ``on_timers(stores, due)`` are the user's functions; ``key_of(store, key)`` gives the key
    column value(s) of a stored key when the state is rescaled."""

    #: the parsed configuration as the workers use it: no Prometheus port (that is the driver's endpoint)
    settings: Settings
    fn: Callable[..., Any]
    num_tasks: int
    on_replay: str = "redo"
    #: the Spark names of the input's columns (pandas mode builds an empty frame with them)
    input_columns: tuple[str, ...] = ()
    #: park the task after its commit for its next batch in the same worker (``statebackend.microbatch.kept``)
    keep_open: bool = False
    #: bytes of a task's output held in memory until its commit is durable; beyond, a spill file
    output_memory_bytes: int = 256 << 20
    #: key groups of the state (None: rows hashed modulo ``num_tasks``, state written before key groups) and the
    #: Spark type names of the key columns (how a stored key hashes when the state is rescaled)
    key_groups: int | None = None
    key_types: tuple[str, ...] = ()
    key_of: Callable[[str, Any], Any] | None = None
    on_timers: Callable[..., Any] | None = None
    #: the event-time column, its Spark type name and the session time zone (naive pandas timestamps are in it)
    event_time: str | None = None
    event_time_type: str = ""
    time_zone: str = "UTC"
    #: the key column names (``read_state`` types timer keys by them)
    key_columns: tuple[str, ...] = ()
    #: drop rows whose event time is below the batch's watermark before the function sees them
    drop_late: bool = False
    #: ``on_expiry(stores, expired)``: called after ``on_timers`` with the keys the batch's expiry sweep found
    #: expired (a list of ``statebackend.microbatch.attempt.Expired``), which are deleted in the same commit; returns
    #: output as ``fn`` does
    on_expiry: Callable[..., Any] | None = None
    #: :func:`config_fingerprint` of ``settings``: a task kept open under another configuration is closed, not reused
    fingerprint: str = attrs.field(
        default=attrs.Factory(lambda self: config_fingerprint(self.settings), takes_self=True)
    )

    @classmethod
    def from_config(cls, config: Mapping[str, Any] | Settings, **fields: Any) -> JobSpec:
        """A spec from a configuration (parsed here, the timer store declared when ``on_timers`` is given) and the
        job's other fields; for running tasks without the Spark driver (tests, tools)."""
        if isinstance(config, Settings):
            settings = config
        else:
            settings = job_settings(config, timers=fields.get("on_timers") is not None)
        return cls(settings=attrs.evolve(settings, metrics_prometheus_port=None), **fields)


@attrs.frozen(eq=False)
class BatchSpec:
    """What the driver decides for one run of one batch, the same for all its tasks."""

    batch_id: int
    #: the driver's token of this run of the batch (a batch may run twice: a run again), copied into every report
    run_id: str = ""
    #: the batch's clock for TTL stores and processing-time timers (ms since the epoch); None: the wall clock
    now_ms: int | None = None
    #: the event-time watermark the driver derived, and the largest event time of the batches before this one
    watermark_ms: int | None = None
    event_max_ms: int | None = None
    #: the driver ran batch ``batch_id - 1`` to its end with this layout, so a task's own checkpoint of it is the
    #: previous batch's state without reading task-0's log
    previous_seen: bool = False
    #: tasks kept open in a reused worker may hand their output on before their checkpoint is durable: the driver
    #: confirms those checkpoints before the batch ends (``BatchCoordinator``)
    confirm_on_driver: bool = False
    #: the Arrow schemas of the output and (arrow and pandas modes through an RDD of Rows) of the input; None: rows
    output_schema: Any = None
    input_schema: Any = None
    #: rows mode: the output schema as the engine's own type (a Spark StructType) that output rows are checked
    #: against before the commit; None: none declared (the first row's shape is the schema)
    output_struct: Any = None
    #: classic Spark: the accumulator each attempt adds its report to; None: the report travels in the output
    stats_to: Any = None


#: the fields of :class:`JobSpec` and :class:`BatchSpec`, to split one set of keyword arguments between them
JOB_FIELDS = frozenset(field.name for field in attrs.fields(JobSpec)) - {"settings", "fingerprint"}
BATCH_FIELDS = frozenset(field.name for field in attrs.fields(BatchSpec))
