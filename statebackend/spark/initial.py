"""Initial state: a job's stores start from DataFrames, loaded into each task by key group before the first batch,
exactly once (``StatefulForeachBatch(initial_state={"counts": df})``).

Contract:

- ``initial_state`` maps store names to a DataFrame, or to a function ``spark -> DataFrame`` (built with the
  batch's session: the form that works under Spark Connect, where the driver function runs on the server). A
  frame has a ``value`` column and the key: the job's key columns (a store's key is then their value, or the tuple
  of them, as for rescaling), or a ``key`` column (the stored key; with several key columns, or keys that are not
  the key columns' value, the key columns too, which route it). Values go through the store's serde as
  ``pyarrow``'s ``to_pylist`` gives them: a struct is a dict, and a record store builds its class from it.
- At the driver's first batch ``B`` the load runs as one Spark job before the batch's: the frames are encoded,
  routed to tasks exactly as the batch's rows are (:func:`~statebackend.microbatch.keygroups.route`), and every task of
  the layout, with rows or none, opens its stores empty, writes its rows and commits one checkpoint with the input
  offsets of batch ``B - 1`` (``-1`` before batch 0) and :data:`INITIAL_OFFSET` (the stores loaded): batch ``B``
  then starts from it as from any previous batch. Every later checkpoint records the load per store
  (``serdes[store]["initial"]``, carried by :mod:`statebackend.values`, rescales included).
- **Exactly once.** A task whose newest checkpoint is this load (same layout, same batch) skips it, so a load run
  again (a retried task, a driver that failed during the load and restarts) completes it without loading any task
  twice; a task's load checkpoint of another layout is loaded over from empty. Once batches ran, task-0's
  checkpoint records the load: a restart with the same ``initial_state`` loads nothing.
- **Timers start with the state.** ``on_initial_state(stores, keys)`` (given to StatefulForeachBatch) is called in
  each task after its rows are written, before the load's checkpoint, with the key column values of the keys loaded
  into the task (sorted): the timers it registers and the state it changes are in the load's checkpoint, so they
  are loaded exactly once with the rows (Spark's ``handleInitialState``), and the first batch fires what is due.
- **Refusals.** A key given twice in a store's frame is refused (Spark refuses it too; here the last one would win
  in an order that depends on how rows reach the task): each task keeps the key bytes of its rows in a set while
  loading (memory for its keys, not its values), counts the keys that came more than once and names the first
  ones. The timer store cannot be loaded from a frame (its records are the framework's): register timers in
  ``on_initial_state``.
- **Refused on existing state.** When the job already has state that no initial load made (a task's newest
  checkpoint is a batch's and does not record the load of every store given), the driver raises a
  :class:`ConfigError` naming the stores, before running anything: remove ``initial_state``, or start a new
  ``job.name``.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence
from typing import Any

import attrs

from statebackend.blobstores.base import open_blob_store
from statebackend.config import Settings
from statebackend.errors import ConfigError
from statebackend.lifecycle import decide_open, task_checkpoint_log
from statebackend.microbatch.batches import BATCH_OFFSET, KEY_GROUPS_OFFSET, NOW_OFFSET, TASKS_OFFSET, task_name
from statebackend.microbatch.keygroups import route
from statebackend.microbatch.timers import TIMERS_STORE, Timers, encode_key, normalize_key, owner_check
from statebackend.serdes import RecordSerde, encode_many, get_serde
from statebackend.store.ttl import wall_clock_ms
from statebackend.task import TaskStorage
from statebackend.values import INITIAL

__all__ = ["INITIAL_OFFSET", "InitialState", "check_initial_stores", "initial_state_of"]

log = logging.getLogger(__name__)

#: the input offset of a load's checkpoints: the names of the stores loaded, comma-separated
INITIAL_OFFSET = "initial.state"
_STORE, _KEY, _VALUE = "__statebackend_store", "__statebackend_key", "__statebackend_value"

Frame = Any  # a DataFrame, or a function of the SparkSession giving one


@attrs.define(eq=False)
class InitialState:
    """The frames to start stores from, and whether this driver object has loaded (or found loaded) them."""

    frames: Mapping[str, Frame]
    done: bool = False

    def load_once(self, job: Any, batch_df: Any, settings: Settings, batch_id: int, now_ms: int | None = None) -> None:
        """Before the first batch this object runs (``job`` is the StatefulForeachBatch): load the frames unless the
        job's state is this load already (see the module docstring). ``now_ms``: the load's clock (the first
        batch's; None: the wall clock)."""
        if self.done:
            return
        load_initial_state(job, batch_df, settings, batch_id, self.frames, now_ms)
        self.done = True

    def check(self, settings: Settings) -> None:
        """:class:`ConfigError` when the frames cannot be loaded into the stores of ``settings`` (see
        :func:`check_initial_stores`): for the driver to call when it builds the job, before any batch."""
        check_initial_stores(self.frames, settings)


def check_initial_stores(frames: Mapping[str, Frame], settings: Settings) -> None:
    """:class:`ConfigError` when ``frames`` name the timer store, a store the configuration lacks, or a list or map
    store: a frame's row is one key and one value, which is a value store's record only (a list or map store's state
    is per element or entry; fill it from the function or ``on_initial_state`` instead)."""
    if TIMERS_STORE in frames:
        raise ConfigError(
            f"StatefulForeachBatch initial_state names the timer store {TIMERS_STORE!r}: its records are "
            "statebackend's own and cannot be loaded from a frame. Register the loaded keys' timers in "
            "on_initial_state(stores, keys) with stores.timers.register or register_many"
        )
    unknown = sorted(set(frames) - set(settings.stores))
    if unknown:
        raise ConfigError(
            f"StatefulForeachBatch initial_state: no store {', '.join(map(repr, unknown))} in the "
            f"configuration; configured stores: {', '.join(sorted(settings.stores)) or 'none'}"
        )
    kinds = [(name, settings.stores[name].kind) for name in sorted(frames) if settings.stores[name].kind != "value"]
    if kinds:
        raise ConfigError(
            "StatefulForeachBatch initial_state loads value stores only; "
            + "; ".join(f"store {name!r} is a {kind} store (stores.{name}.kind={kind})" for name, kind in kinds)
            + ". Load a value store and fill the list or map from it in the function, or in on_initial_state"
        )


def initial_state_of(value: Mapping[str, Frame] | InitialState | None) -> InitialState | None:
    """The converter of ``StatefulForeachBatch(initial_state=...)``: a mapping of store name to frame."""
    if value is None or isinstance(value, InitialState):
        return value
    if not isinstance(value, Mapping) or not value:
        raise ConfigError(
            f"StatefulForeachBatch initial_state must map store names to DataFrames (or to functions "
            f"of the SparkSession giving one), got {value!r}"
        )
    return InitialState(dict(value))


def load_initial_state(
    job: Any,
    batch_df: Any,
    settings: Settings,
    batch_id: int,
    frames: Mapping[str, Frame],
    now_ms: int | None = None,
) -> None:
    """Load ``frames`` into every task of ``job``'s layout as the checkpoint before batch ``batch_id``, unless
    task-0's newest checkpoint says the job's state is this load already; refuse a job with other state.
    ``settings``: the job's, as the driver parsed them (the workers get them pickled, never parse again)."""
    check_initial_stores(frames, settings)
    if _loaded_before(settings, sorted(frames), job.num_tasks, job.key_groups, batch_id):
        return
    spark = batch_df.sparkSession
    types = {field.name: field.dataType.typeName() for field in batch_df.schema.fields}
    missing = [c for c in job.key_columns if c not in types]
    if missing:
        raise ConfigError(
            f"StatefulForeachBatch key columns {missing} are not in the batch's columns ({', '.join(types)})"
        )
    key_types = {c: types[c] for c in job.key_columns}
    started = time.monotonic()
    encoded = None
    for store in sorted(frames):
        frame = frames[store](spark) if callable(frames[store]) else frames[store]
        part = _encoded(frame, store, tuple(job.key_columns), key_types, settings)
        encoded = part if encoded is None else encoded.unionByName(part)
    routed = route(encoded, job.key_columns, job.num_tasks, job.key_groups)
    loader = _Loader(
        settings,
        tuple(sorted(frames)),
        batch_id,
        job.num_tasks,
        job.key_groups,
        wall_clock_ms() if now_ms is None else now_ms,
        key_columns=tuple(job.key_columns),
        key_types=tuple(key_types[c] for c in job.key_columns),
        on_initial_state=getattr(job, "on_initial_state", None),
    )
    reports = routed.mapInArrow(loader.load, "task int, keys long, skipped boolean").collect()
    tasks = sorted(row.task for row in reports)
    if tasks != list(range(job.num_tasks)):
        raise ConfigError(
            f"initial_state: tasks {sorted(set(range(job.num_tasks)) - set(tasks))} did not report "
            "their load; run the query again (the load completes without loading any task twice)"
        )
    log.info(
        "initial state of %s: %d keys loaded into %d tasks (%d had it already) before batch %d in %.0f ms",
        ", ".join(sorted(frames)),
        sum(row["keys"] for row in reports),
        job.num_tasks,
        sum(row.skipped for row in reports),
        batch_id,
        (time.monotonic() - started) * 1000.0,
    )


def _loaded_before(settings: Settings, stores: list[str], num_tasks: int, key_groups: int, batch_id: int) -> bool:
    """Whether task-0's newest checkpoint records the load of ``stores`` (True: nothing to do), after batches or
    alone; raises when the job has state no load made."""
    blob_store = open_blob_store(settings.blob_store_url, settings.blob_store_options)
    try:
        latest = task_checkpoint_log(settings, blob_store, task_name(0)).latest()
    finally:
        blob_store.close()
    if latest is None:
        return False
    offsets = latest.checkpoint.input_offsets
    if INITIAL_OFFSET in offsets:
        return False  # a load's own checkpoint: this load, or one of another layout; the tasks tell (_Loader)
    serdes = getattr(latest.checkpoint, "serdes", {})
    missing = [store for store in stores if INITIAL not in serdes.get(store, {})]
    if not missing:
        log.info(
            "initial state of %s: loaded before (task-0's checkpoint #%d records it); nothing to load",
            ", ".join(stores),
            latest.seq,
        )
        return True
    raise ConfigError(
        f"StatefulForeachBatch initial_state: job {settings.job_name!r} already has state (task-0's checkpoint "
        f"#{latest.seq}, batch {offsets.get(BATCH_OFFSET)}) that no initial load of store(s) "
        f"{', '.join(map(repr, missing))} made: loading now would mix the two. Remove initial_state to go on with "
        "the state, or give the query a new job.name (and checkpoint location) to start from the initial state"
    )


def _encoded(
    frame: Any, store: str, key_columns: tuple[str, ...], key_types: Mapping[str, str], settings: Settings
) -> Any:
    """``frame`` as (the key columns, store, key bytes, value bytes), encoded with the store's serdes on the
    executors."""
    columns = {field.name: field.dataType for field in frame.schema.fields}
    where = f"initial_state[{store!r}]"
    if "value" not in columns:
        raise ConfigError(f"{where} has no 'value' column (columns: {', '.join(columns)})")
    if all(c in columns for c in key_columns):
        routing = key_columns
    elif "key" in columns and len(key_columns) == 1:
        routing = ("key",)
    else:
        raise ConfigError(
            f"{where} needs the key columns {', '.join(key_columns)} (or, with one key column, a 'key' "
            f"column holding its value); it has {', '.join(columns)}"
        )
    for column, source in zip(key_columns, routing, strict=True):
        if columns[source].typeName() != key_types[column]:
            raise ConfigError(
                f"{where}: column {source!r} is {columns[source].typeName()} but the key column "
                f"{column!r} of the stream is {key_types[column]}: a key routes to its task by its "
                f"hash, which differs between types. Cast it to {key_types[column]}"
            )
    from pyspark.sql.pandas.types import to_arrow_schema
    from pyspark.sql.types import BinaryType, StringType, StructField, StructType

    out = StructType(
        [
            *(StructField(c, columns[s], True) for c, s in zip(key_columns, routing, strict=True)),
            StructField(_STORE, StringType(), False),
            StructField(_KEY, BinaryType(), False),
            StructField(_VALUE, BinaryType(), False),
        ]
    )
    encoder = _Encoder(settings, store, routing, "key" if "key" in columns else None, to_arrow_schema(out))
    return frame.mapInArrow(encoder.encode, out)


@attrs.frozen
class _Encoder:
    """Runs on the executors: a frame's rows as (key columns, store, key bytes, value bytes)."""

    settings: Settings
    store: str
    routing: tuple[str, ...]
    key_column: str | None
    schema: Any

    def encode(self, batches: Iterable[Any]) -> Iterator[Any]:
        import pyarrow as pa

        store_settings = self.settings.stores[self.store]
        key_serde, value_serde = get_serde(store_settings.key_serde), get_serde(store_settings.msg_serde)
        build = value_serde.record.cls if isinstance(value_serde, RecordSerde) else None
        for batch in batches:
            if self.key_column is not None:
                keys = batch.column(self.key_column).to_pylist()
            elif len(self.routing) == 1:
                keys = batch.column(self.routing[0]).to_pylist()
            else:
                keys = list(zip(*(batch.column(c).to_pylist() for c in self.routing), strict=True))
            values = batch.column("value").to_pylist()
            if None in values or None in keys:
                raise ConfigError(f"initial_state[{self.store!r}]: a row has a null key or value; drop or fill it")
            if build is not None:
                values = [build(**v) if isinstance(v, dict) else v for v in values]
            arrays = [
                *(batch.column(c) for c in self.routing),
                pa.array([self.store] * batch.num_rows, pa.string()),
                pa.array(encode_many(key_serde, keys), pa.binary()),
                pa.array(encode_many(value_serde, values), pa.binary()),
            ]
            yield pa.RecordBatch.from_arrays(arrays, schema=self.schema)


@attrs.frozen
class _Loader:
    """Runs on the executors, one partition per task: loads the task's rows and commits the load's checkpoint."""

    settings: Settings
    stores: tuple[str, ...]
    batch_id: int
    num_tasks: int
    key_groups: int
    now_ms: int
    key_columns: tuple[str, ...] = ()
    key_types: tuple[str, ...] = ()
    on_initial_state: Callable[..., Any] | None = None

    def load(self, batches: Iterable[Any]) -> Iterator[Any]:
        import pyarrow as pa
        from pyspark import TaskContext

        context = TaskContext.get()
        if context is None:
            raise ConfigError("the initial-state load ran outside a Spark task (no TaskContext)")
        index = context.partitionId()
        keys, skipped = self._load_task(index, batches)
        yield pa.RecordBatch.from_pydict(
            {
                "task": pa.array([index], pa.int32()),
                "keys": pa.array([keys], pa.int64()),
                "skipped": pa.array([skipped], pa.bool_()),
            }
        )

    def offsets(self) -> dict[str, str]:
        """The input offsets of the load's checkpoints: those of the batch before the first, and the stores."""
        return {
            BATCH_OFFSET: str(self.batch_id - 1),
            TASKS_OFFSET: str(self.num_tasks),
            KEY_GROUPS_OFFSET: str(self.key_groups),
            NOW_OFFSET: str(self.now_ms),
            INITIAL_OFFSET: ",".join(self.stores),
        }

    def _load_task(self, index: int, batches: Iterable[Any]) -> tuple[int, bool]:
        settings = self.settings
        name = task_name(index)
        offsets = self.offsets()
        blob_store = open_blob_store(settings.blob_store_url, settings.blob_store_options)
        try:
            decision = decide_open(settings, name, task_checkpoint_log(settings, blob_store, name))
            latest = decision.entry
            if latest is not None:
                theirs = latest.checkpoint.input_offsets
                if INITIAL_OFFSET not in theirs:
                    raise ConfigError(
                        f"initial_state: {name} already has state (checkpoint #{latest.seq}, batch "
                        f"{theirs.get(BATCH_OFFSET)}) that no initial load made; remove initial_state, "
                        "or start a new job.name"
                    )
                if {k: theirs.get(k) for k in offsets if k != NOW_OFFSET} == {
                    k: v for k, v in offsets.items() if k != NOW_OFFSET
                }:
                    return 0, True  # this load, committed by an earlier attempt
                decision = decision.rebased(None, settings)  # a load of another layout: loaded over, from empty
            with TaskStorage.open(settings, name, blob_store=blob_store, decision=decision) as storage:
                storage.ttl_now_ms = self.now_ms
                loaded = 0
                seen: dict[str, set[bytes]] = {}
                duplicates: dict[str, dict[bytes, None]] = {}
                keys: dict[bytes, Any] = {}
                for batch in batches:
                    loaded += self._put(storage, batch, seen, duplicates)
                    if self.on_initial_state is not None:
                        self._note_keys(batch, keys)
                if duplicates:
                    raise self._duplicates(storage, name, duplicates)
                if self.on_initial_state is not None:
                    self._call_hook(storage, index, [keys[encoded] for encoded in sorted(keys)])
                storage.mark_initial_load(self.stores, f"before batch {self.batch_id}")
                storage.commit_durably(offsets)
            return loaded, False
        finally:
            blob_store.close()

    def _note_keys(self, batch: Any, keys: dict[bytes, Any]) -> None:
        """The key column values of ``batch``'s rows, by their encoding (each key once, in a stable order)."""
        columns = [batch.column(c).to_pylist() for c in self.key_columns]
        for values in zip(*columns, strict=True):
            normalized = normalize_key(values if len(values) > 1 else values[0], self.key_types)
            keys.setdefault(encode_key(normalized), normalized[0] if len(normalized) == 1 else normalized)

    def _call_hook(self, storage: TaskStorage, index: int, keys: list[Any]) -> None:
        """``on_initial_state(stores, keys)`` over the task's loaded state, its timers in the timer store."""
        from statebackend.microbatch.attempt import TaskStores

        hook = self.on_initial_state
        assert hook is not None
        timers = (
            Timers(
                storage.store(TIMERS_STORE, typed=False),
                key_types=self.key_types,
                check_owner=owner_check(index, self.num_tasks, self.key_groups, self.key_types),
            )
            if TIMERS_STORE in storage.stores
            else Timers(None)
        )
        stores = TaskStores(storage, index, self.batch_id - 1, timers=timers, now_ms=self.now_ms)
        try:
            result = hook(stores, keys)
        except Exception as exc:
            exc.add_note(f"(statebackend: raised in on_initial_state of {storage.task_name}, initial-state load)")
            raise
        if result is not None:
            raise ConfigError(
                f"on_initial_state returned {type(result).__name__}, not None: the initial-state load has no output "
                "(register timers and change state through stores; the first batch's fn and on_timers give output)"
            )

    def _duplicates(self, storage: TaskStorage, name: str, duplicates: dict[str, dict[bytes, None]]) -> ConfigError:
        """The error naming the keys given more than once, per store (at most 5 each, decoded by the key serde)."""
        parts = []
        for store in sorted(duplicates):
            found = list(duplicates[store])
            serde = get_serde(self.settings.stores[store].key_serde)
            shown = []
            for key in found[:5]:
                try:
                    shown.append(repr(serde.from_bytes(key)))
                except Exception:  # noqa: BLE001 - a key the serde cannot read back is shown as its bytes
                    shown.append(repr(key))
            more = f" and {len(found) - 5} more" if len(found) > 5 else ""
            parts.append(
                f"initial_state[{store!r}]: {len(found)} key(s) given more than once: {', '.join(shown)}{more}"
            )
        return ConfigError(
            f"{'; '.join(parts)} (in {name}'s rows). A key may have one initial value: deduplicate the frame "
            "(e.g. dropDuplicates on the key, or an aggregation) before giving it"
        )

    @staticmethod
    def _put(
        storage: TaskStorage, batch: Any, seen: dict[str, set[bytes]], duplicates: dict[str, dict[bytes, None]]
    ) -> int:
        stores: Sequence[str] = batch.column(_STORE).to_pylist()
        keys: list[bytes] = batch.column(_KEY).to_pylist()
        values: list[bytes] = batch.column(_VALUE).to_pylist()
        by_store: dict[str, tuple[list[bytes], list[bytes]]] = {}
        for store, key, value in zip(stores, keys, values, strict=True):
            known = seen.setdefault(store, set())
            if key in known:
                duplicates.setdefault(store, {})[key] = None
                continue
            known.add(key)
            pair = by_store.setdefault(store, ([], []))
            pair[0].append(key)
            pair[1].append(value)
        for store, (store_keys, store_values) in by_store.items():
            storage.store(store, typed=False).put_many(store_keys, store_values)  # a TTL store wraps the expiry
        return len(keys)
