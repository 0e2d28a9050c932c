"""Reading state back as a DataFrame, from the blob store alone (each task restored into a temporary directory)."""

from __future__ import annotations

import functools
import json
import logging
from collections.abc import Callable, Iterable, Iterator, Mapping
from itertools import islice
from pathlib import Path
from typing import Any

import attrs
from pyspark.sql import DataFrame, SparkSession
from pyspark.sql.pandas.types import to_arrow_schema
from pyspark.sql.types import (
    ArrayType,
    BinaryType,
    BooleanType,
    DataType,
    DoubleType,
    LongType,
    MapType,
    StringType,
    StructField,
    StructType,
)

from statebackend.config import Settings
from statebackend.errors import ConfigError, InconsistentStateError, NotFoundError
from statebackend.lifecycle import task_checkpoint_log
from statebackend.microbatch.batches import BATCH_OFFSET, KEY_GROUPS_OFFSET, TASKS_OFFSET, at_or_below, task_name
from statebackend.microbatch.spec import job_settings
from statebackend.microbatch.timers import TIMERS_STORE, key_text, stored_timers
from statebackend.serdes import is_record, record_class, record_serde
from statebackend.serdes.record import schemas_from_text
from statebackend.store.kinds import ListStore, MapStore
from statebackend.store.ttl import batch_clock
from statebackend.task import TaskStorage
from statebackend.values import MSG_SCHEMAS

log = logging.getLogger(__name__)


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
    serdes: ``string`` and ``json`` give strings, ``integer`` longs, ``bytes`` and ``pickle`` binary, and a record
    store (``record:<module>:<Class>``) a struct of the class's fields, each value read as the class (a value written
    with an older schema of the class as the job's code reads it: a field added since takes its default) and typed
    ``int`` long, ``float`` double, ``bool`` boolean, ``str`` string, ``bytes`` binary, ``json`` a string of compact
    JSON. The class must be importable on the driver and the executors, as for the job itself (otherwise the
    :class:`ConfigError` names the class and the store's key); ``statebackend dump`` reads a record store without
    its class. A list store (``stores.<name>.kind=list``) gives one row per key, its value an array of the elements
    in append order; a map store, a map column from sub-key (typed per ``subkey.serde``) to value.

    ``store=TIMERS_STORE`` (``"statebackend-timers"``) reads the tasks' pending timers as ``(task string, key,
    kind string, at_ms long)``: the key in the key column's type (a struct of the key columns for several), as the
    job's checkpoints record the key columns (task-0's checkpoint is read on the driver for them); the kind
    ``processing`` or ``event``, the time in ms since the epoch; by task, kind, then time. State whose checkpoints
    do not record them (written before) gives the key as a string, as
    :func:`~statebackend.microbatch.timers.key_text` shows it.
    """
    settings = job_settings(config, timers=store == TIMERS_STORE)
    if store not in settings.stores:
        raise ConfigError(
            f"read_state: no store {store!r} in the configuration; configured stores: "
            f"{', '.join(sorted(settings.stores)) or 'none'}"
        )
    if checkpoint != "latest" and (type(checkpoint) is not int or checkpoint < 0):
        raise ConfigError(f"read_state checkpoint must be 'latest' or a batch id (int >= 0), got {checkpoint!r}")
    store_settings = settings.stores[store]
    key_fields: tuple[str, ...] | None = None
    if store == TIMERS_STORE:
        keys = _timer_key_struct(settings, checkpoint, num_tasks)
        key_type: DataType = StringType()
        if keys is not None:
            key_fields = tuple(keys.fieldNames())
            key_type = keys.fields[0].dataType if len(keys.fields) == 1 else keys
        schema = StructType(
            [
                StructField("task", StringType(), False),
                StructField("key", key_type, True),
                StructField("kind", StringType(), False),
                StructField("at_ms", LongType(), False),
            ]
        )
    else:
        schema = StructType(
            [
                StructField("task", StringType(), False),
                StructField("key", _column_type(store_settings.key_serde), False),
                StructField("value", _kind_type(store_settings.kind, store_settings), True),
            ]
        )
    # Only this store's keys: restoring the others would download state nobody asked for.
    reader = _StateReader(
        attrs.evolve(settings, stores={store: store_settings}),
        store,
        checkpoint,
        num_tasks,
        to_arrow_schema(schema),
        key_fields,
    )
    # one partition per task index; DataFrame operations only, so this works alike under Spark Connect (no RDDs)
    indexes = spark.range(0, num_tasks, 1, num_tasks)
    return indexes.mapInArrow(reader.read_arrow, schema)


@attrs.frozen
class _StateReader:
    #: the job's settings as parsed on the driver, with only the store read
    settings: Settings
    store: str
    checkpoint: str | int
    num_tasks: int
    schema: Any
    #: the timer store: the key columns' names (a timer's key as its columns' values); None: the key as text
    key_fields: tuple[str, ...] | None = None

    def read_arrow(self, batches: Iterable[Any]) -> Iterator[Any]:
        """For ``mapInArrow`` over ``spark.range(num_tasks)``: the records of the tasks whose index is in ``batches``,
        as Arrow batches of at most 64Ki rows."""
        import pyarrow as pa

        for batch in batches:
            for index in batch.column(0).to_pylist():
                rows = self.read([index])
                while chunk := list(islice(rows, 1 << 16)):
                    yield pa.RecordBatch.from_arrays(
                        [
                            pa.array(column, field.type)
                            for column, field in zip(zip(*chunk, strict=True), self.schema, strict=True)
                        ],
                        schema=self.schema,
                    )

    def read(self, indexes: Iterable[int]) -> Iterator[tuple[Any, ...]]:
        import tempfile

        settings = self.settings
        store_settings = settings.stores[self.store]
        for index in indexes:
            name = task_name(index)
            with tempfile.TemporaryDirectory(prefix="statebackend-read-") as tmp:
                private = attrs.evolve(settings, local_dir=Path(tmp))
                if self.checkpoint == "latest":
                    choice: Any = "latest"
                else:
                    wanted = int(self.checkpoint)
                    choice = at_or_below(name, wanted, self.num_tasks)
                with TaskStorage.open(private, name, checkpoint=choice) as storage:
                    if choice != "latest" and storage.restored is None and storage.checkpoint_log.seqs():
                        raise NotFoundError(
                            f"read_state: {name} has no checkpoint at or below batch {self.checkpoint} (older "
                            f"checkpoints were deleted by retention, task.checkpoint.retained="
                            f"{settings.checkpoint_retained})"
                        )
                    restored = storage.restored
                    tasks = restored.input_offsets.get(TASKS_OFFSET) if restored is not None else None
                    if restored is not None and tasks is not None and tasks != str(self.num_tasks):
                        raise ConfigError(
                            f"read_state: {name}'s checkpoint {restored.checkpoint_id} is of a batch that ran "
                            f"with num_tasks={tasks}, not num_tasks={self.num_tasks}: read the state with "
                            f"num_tasks={tasks} (the number the query last ran with)"
                        )
                    self._check_like_task_zero(settings, storage, name)
                    storage.ttl_now_ms = batch_clock(storage.restored)  # a TTL store: the keys its batch saw
                    raw = storage.view(self.store, typed=False)
                    if self.store == TIMERS_STORE:
                        for timer in stored_timers(raw):
                            yield name, self._timer_key(timer.key), timer.kind, timer.at_ms
                        continue
                    column = _value_column(store_settings.msg_serde, storage, self.store)
                    if isinstance(raw, ListStore):
                        for key, elements in raw.raw_lists():
                            yield name, _column_value(store_settings.key_serde, key), [column(e) for e in elements]
                        continue
                    if isinstance(raw, MapStore):
                        sub = store_settings.subkey_serde
                        for key, entries in raw.raw_maps():
                            yield (
                                name,
                                _column_value(store_settings.key_serde, key),
                                [(_column_value(sub, k), column(v)) for k, v in entries],
                            )
                        continue
                    for key, value in raw.items():
                        yield name, _column_value(store_settings.key_serde, key), column(value)

    def _timer_key(self, key: Any) -> Any:
        """A timer's key as its column holds it: the value (one key column), a dict of the columns (several), or
        the text of :func:`key_text` when the key columns are not recorded."""
        if self.key_fields is None:
            return key_text(key)
        if len(self.key_fields) == 1:
            return key
        return dict(zip(self.key_fields, key, strict=True))

    def _check_like_task_zero(self, settings: Settings, storage: TaskStorage, name: str) -> None:
        """The task's checkpoint must be spread like task-0's (which runs in every layout) and of its batch or a
        neighbour (a batch in progress): a task with none, with another spread, or an older one, means a batch that
        changed num_tasks or moved to key groups was committed by some tasks only; the keys it moved are then in no
        task read, or in two."""
        zero = task_name(0)
        if name == zero:
            return
        zero_log = task_checkpoint_log(settings, storage.blob_store, zero)
        entry = (
            zero_log.latest()
            if self.checkpoint == "latest"
            else zero_log.find(at_or_below(zero, int(self.checkpoint), self.num_tasks))
        )
        if entry is None:
            return  # task-0 has nothing to read: neither has the job (its checkpoint offsets are checked above)
        theirs = entry.checkpoint.input_offsets
        mine = storage.restored.input_offsets if storage.restored is not None else None
        if (
            mine is None
            or mine.get(KEY_GROUPS_OFFSET) != theirs.get(KEY_GROUPS_OFFSET)
            or mine.get(TASKS_OFFSET) != theirs.get(TASKS_OFFSET)
            or not str(mine.get(BATCH_OFFSET, "")).isdigit()
            or not str(theirs.get(BATCH_OFFSET, "")).isdigit()
            or abs(int(mine[BATCH_OFFSET]) - int(theirs[BATCH_OFFSET])) > 1
        ):

            def spread(offsets: Mapping[str, str] | None) -> str:
                if offsets is None:
                    return "no checkpoint"
                return (
                    f"batch {offsets.get(BATCH_OFFSET)}, num_tasks={offsets.get(TASKS_OFFSET)}, "
                    f"key_groups={offsets.get(KEY_GROUPS_OFFSET, 'none')}"
                )

            raise InconsistentStateError(
                f"read_state: {name} has {spread(mine)} but {zero} has {spread(theirs)}: the batch that changed "
                "num_tasks (or moved the state to key groups) was committed by some tasks only, so reading each task's "
                "checkpoint would miss keys or give them twice. Let the query run that batch to its end, or read a "
                "batch id before it"
            )


def _kind_type(kind: str, store_settings: Any) -> DataType:
    """The value column's type by the store's kind: a list's an array, a map's a map from its sub-keys."""
    value = _value_type(store_settings.msg_serde)
    if kind == "list":
        return ArrayType(value, False)
    if kind == "map":
        return MapType(_column_type(store_settings.subkey_serde), value, False)
    return value


def _timer_key_struct(settings: Settings, checkpoint: str | int, num_tasks: int) -> StructType | None:
    """The key columns of a job with timers, as task-0's checkpoint (the newest, or the one at or below batch
    ``checkpoint``) records them; None when it records none (state written before they were recorded)."""
    from statebackend.blobstores.base import open_blob_store
    from statebackend.microbatch.attempt import TIMER_KEY_OFFSET

    zero = task_name(0)
    blob_store = open_blob_store(settings.blob_store_url, settings.blob_store_options)
    try:
        zero_log = task_checkpoint_log(settings, blob_store, zero)
        entry = (
            zero_log.latest()
            if checkpoint == "latest"
            else zero_log.find(at_or_below(zero, int(checkpoint), num_tasks))
        )
    finally:
        blob_store.close()
    recorded = entry.checkpoint.input_offsets.get(TIMER_KEY_OFFSET) if entry is not None else None
    if not recorded:
        return None
    try:
        keys = StructType.fromJson(json.loads(recorded))
    except (ValueError, KeyError, TypeError) as exc:
        log.warning("read_state: the key columns task-0's checkpoint records cannot be read (%s); keys as text", exc)
        return None
    return keys if keys.fields else None


def _value_type(serde: str) -> DataType:
    """The value column's type: a record store's is a struct of its class's fields."""
    if not is_record(serde):
        return _column_type(serde)
    return StructType(
        [StructField(f.name, _FIELD_TYPES[f.type], f.nullable) for f in record_class(serde).schema.fields]
    )


def _value_column(serde: str, storage: TaskStorage, store: str) -> Callable[[bytes], Any]:
    """How a stored value becomes its column's value: a record store's value is read as its class (knowing every
    schema the task's checkpoint recorded) and given as a dict of the class's fields, ``json`` ones as JSON text."""
    if not is_record(serde):
        return functools.partial(_column_value, serde)
    recorded = storage.recorded_serdes[store].get(MSG_SCHEMAS, "")
    reader = record_serde(serde).with_schemas(schemas_from_text(recorded, where=f"store {store!r}") if recorded else ())
    fields = [(f.name, f.type == "json") for f in reader.schema.fields]

    def column(data: bytes) -> dict[str, Any]:
        value = reader.from_bytes(data)
        row = {}
        for field, is_json in fields:
            item = getattr(value, field)
            row[field] = (
                item
                if not is_json or item is None
                else json.dumps(item, sort_keys=True, separators=(",", ":"), ensure_ascii=False)
            )  # as the record stores it
        return row

    return column


_FIELD_TYPES: Mapping[str, DataType] = {
    "int": LongType(),
    "float": DoubleType(),
    "bool": BooleanType(),
    "str": StringType(),
    "bytes": BinaryType(),
    "json": StringType(),
}


def _column_type(serde: str) -> DataType:
    return {"string": StringType(), "json": StringType(), "integer": LongType()}.get(serde, BinaryType())


def _column_value(serde: str, data: bytes) -> Any:
    if serde in ("string", "json"):
        return data.decode("utf-8")
    if serde == "integer":
        from statebackend.serdes import get_serde

        return get_serde("integer").from_bytes(data)
    return bytes(data)
