"""Key groups: how the Spark driver routes rows to tasks so that ``num_tasks`` can change while the state lives.

Contract:

- A job's state is split into ``K`` key groups (``StatefulForeachBatch(key_groups=K)``, recorded in every checkpoint
  as the input offset ``key_groups``). A row's key group is ``pmod(hash(key columns), K)`` with Spark's own ``hash``
  (Murmur3 x86 32-bit, seed 42), computed by Spark: no Python runs per row to route it.
- With ``n`` tasks, task ``t`` owns the contiguous key groups ``[ceil(t*K/n), ceil((t+1)*K/n))``; key group ``g`` goes
  to task ``g*n // K`` (Flink's operator index). :func:`route` repartitions a batch so every row lands in exactly the
  partition of its task: Spark hashes the partition expression again, so the expression is, per task, an integer
  whose own Murmur3 hash lands in that partition (:func:`partition_tags`).
- :func:`spark_hash` is Spark's ``hash`` in Python for the key column types, used only when the state is rescaled:
  each stored key's key group decides which new task takes it. A store's decoded key must be its row's key column
  value (one key column) or the tuple of them, unless ``key_of`` maps it.
"""

from __future__ import annotations

import datetime
import math
import struct
from collections.abc import Sequence
from typing import Any

from statebackend.errors import ConfigError

__all__ = [
    "DEFAULT_KEY_GROUPS",
    "HASHABLE_TYPES",
    "MAX_KEY_GROUPS",
    "hash_int",
    "hash_long",
    "key_group_range",
    "partition_tags",
    "route",
    "spark_hash",
    "task_of_group",
    "with_every_partition",
]

DEFAULT_KEY_GROUPS = 128
MAX_KEY_GROUPS = 32768
SEED = 42
#: Spark type names (``DataType.typeName()``) :func:`spark_hash` hashes as Spark does
HASHABLE_TYPES = (
    "string",
    "binary",
    "boolean",
    "byte",
    "short",
    "integer",
    "long",
    "date",
    "timestamp",
    "timestamp_ntz",
    "float",
    "double",
)

_MASK = 0xFFFFFFFF
_C1 = 0xCC9E2D51
_C2 = 0x1B873593


def _rotl(x: int, r: int) -> int:
    return ((x << r) | (x >> (32 - r))) & _MASK


def _mix_k1(k1: int) -> int:
    k1 = (k1 * _C1) & _MASK
    k1 = _rotl(k1, 15)
    return (k1 * _C2) & _MASK


def _mix_h1(h1: int, k1: int) -> int:
    h1 ^= k1
    h1 = _rotl(h1, 13)
    return (h1 * 5 + 0xE6546B64) & _MASK


def _fmix(h1: int, length: int) -> int:
    h1 ^= length
    h1 ^= h1 >> 16
    h1 = (h1 * 0x85EBCA6B) & _MASK
    h1 ^= h1 >> 13
    h1 = (h1 * 0xC2B2AE35) & _MASK
    h1 ^= h1 >> 16
    return h1


def _signed(h: int) -> int:
    return h - (1 << 32) if h & 0x80000000 else h


def hash_int(value: int, seed: int = SEED) -> int:
    """Spark's ``Murmur3_x86_32.hashInt`` (a signed 32-bit result)."""
    return _signed(_fmix(_mix_h1(seed & _MASK, _mix_k1(value & _MASK)), 4))


def hash_long(value: int, seed: int = SEED) -> int:
    """Spark's ``Murmur3_x86_32.hashLong``."""
    value &= 0xFFFFFFFFFFFFFFFF
    h1 = _mix_h1(seed & _MASK, _mix_k1(value & _MASK))
    h1 = _mix_h1(h1, _mix_k1(value >> 32))
    return _signed(_fmix(h1, 8))


def hash_bytes(data: bytes, seed: int = SEED) -> int:
    """Spark's ``Murmur3_x86_32.hashUnsafeBytes`` (strings and binaries): little-endian 4-byte words, then each
    remaining byte as a signed int of its own (not the reference Murmur3's tail)."""
    aligned = len(data) - len(data) % 4
    h1 = seed & _MASK
    for (word,) in struct.iter_unpack("<I", data[:aligned]):
        h1 = _mix_h1(h1, _mix_k1(word))
    for byte in data[aligned:]:
        h1 = _mix_h1(h1, _mix_k1((byte - 256 if byte > 127 else byte) & _MASK))
    return _signed(_fmix(h1, len(data)))


def _hash_value(value: Any, type_name: str, seed: int) -> int:
    if value is None:
        return seed
    if type_name == "string":
        if not isinstance(value, str):
            raise TypeError(f"a string key column needs str, got {type(value).__name__}")
        return hash_bytes(value.encode("utf-8"), seed)
    if type_name == "binary":
        return hash_bytes(bytes(value), seed)
    if type_name == "boolean":
        return hash_int(1 if value else 0, seed)
    if type_name in ("byte", "short", "integer"):
        return hash_int(_as_int(value), seed)
    if type_name == "date":
        if isinstance(value, datetime.date):
            value = (value - datetime.date(1970, 1, 1)).days
        return hash_int(_as_int(value), seed)
    if type_name == "long":
        return hash_long(_as_int(value), seed)
    if type_name in ("timestamp", "timestamp_ntz"):
        if isinstance(value, datetime.datetime):
            value = _epoch_micros(value, local=type_name == "timestamp")
        return hash_long(_as_int(value), seed)
    if type_name == "float":
        number = float(value)
        bits = 0 if number == 0.0 else struct.unpack("<I", struct.pack("<f", number))[0]
        if math.isnan(number):
            bits = 0x7FC00000
        return hash_int(bits, seed)
    if type_name == "double":
        number = float(value)
        bits = 0 if number == 0.0 else struct.unpack("<Q", struct.pack("<d", number))[0]
        if math.isnan(number):
            bits = 0x7FF8000000000000
        return hash_long(bits, seed)
    raise ConfigError(
        f"key columns of type {type_name!r} cannot be rescaled by key group; supported: {', '.join(HASHABLE_TYPES)}"
    )


def _epoch_micros(value: datetime.datetime, *, local: bool) -> int:
    """Microseconds since the epoch of a datetime as Spark holds it. Aware: its instant. Naive: for a ``timestamp``
    column the process's local time (PySpark's ``TimestampType.fromInternal`` gives the task's rows local naive
    datetimes), for ``timestamp_ntz`` the wall-clock time taken as UTC."""
    if value.tzinfo is None and local:
        # a plain datetime (a pandas Timestamp's own timestamp() takes naive as UTC), fold kept: an ambiguous local
        # time is the one the row's instant gave
        plain = datetime.datetime(
            value.year, value.month, value.day, value.hour, value.minute, value.second, fold=value.fold
        )
        return int(plain.timestamp()) * 1_000_000 + value.microsecond
    epoch = datetime.datetime(1970, 1, 1, tzinfo=None if value.tzinfo is None else datetime.UTC)
    delta = value - epoch  # aware minus UTC: the instants' difference, whatever the zone's offset at either
    return (delta.days * 86_400 + delta.seconds) * 1_000_000 + delta.microseconds


def _as_int(value: Any) -> int:
    if isinstance(value, bool) or not isinstance(value, int):
        raise TypeError(f"an integral key column needs int, got {type(value).__name__}")
    return value


def spark_hash(values: Sequence[Any], type_names: Sequence[str]) -> int:
    """Spark's ``hash(col1, col2, ...)`` of one row's key column values with their Spark types."""
    if len(values) != len(type_names):
        raise ConfigError(f"{len(values)} key values for {len(type_names)} key columns")
    h = SEED
    for value, type_name in zip(values, type_names, strict=True):
        h = _hash_value(value, type_name, h)
    return h


def key_group(values: Sequence[Any], type_names: Sequence[str], key_groups: int) -> int:
    """``pmod(hash(values), key_groups)``, as Spark computes it for routing."""
    return spark_hash(values, type_names) % key_groups


def task_of_group(group: int, num_tasks: int, key_groups: int) -> int:
    return group * num_tasks // key_groups


def key_group_range(task: int, num_tasks: int, key_groups: int) -> range:
    """The key groups task ``task`` of ``num_tasks`` owns: ``[ceil(t*K/n), ceil((t+1)*K/n))``."""
    return range(-(-task * key_groups // num_tasks), -(-(task + 1) * key_groups // num_tasks))


_TAGS: dict[int, tuple[int, ...]] = {}


def partition_tags(num_tasks: int) -> tuple[int, ...]:
    """For each task ``t``, the smallest non-negative int whose Spark hash lands in partition ``t`` of ``num_tasks``
    (``pmod(hash_int(v), n) == t``): repartitioning by it puts task ``t``'s rows in partition ``t`` exactly."""
    tags = _TAGS.get(num_tasks)
    if tags is None:
        found: dict[int, int] = {}
        value = 0
        while len(found) < num_tasks:
            found.setdefault(hash_int(value) % num_tasks, value)
            value += 1
        tags = _TAGS[num_tasks] = tuple(found[t] for t in range(num_tasks))
    return tags


def route(batch_df: Any, key_columns: Sequence[str], num_tasks: int, key_groups: int) -> Any:
    """``batch_df`` repartitioned into ``num_tasks`` partitions, partition ``t`` holding exactly the rows of the key
    groups task ``t`` owns (DataFrame API only: works under Spark Connect too). The row :func:`with_every_partition`
    added is dropped after the shuffle."""
    routed = batch_df.repartition(
        num_tasks, _partition_column(tuple(key_columns), num_tasks, key_groups, _is_connect(batch_df))
    )
    if vars(batch_df).get(_HAS_ADDED_ROW, False):  # not getattr: a Connect DataFrame's is a column of that name
        from pyspark.sql import functions as F

        # in the task the row went to, before any function sees it; a nondeterministic condition, which Spark never
        # pushes below the shuffle (there it would leave the shuffle empty again)
        added = F.col(EVERY_PARTITION_COLUMN)
        routed = routed.where(added.isNull() | (F.spark_partition_id() < F.lit(0))).drop(EVERY_PARTITION_COLUMN)
    return routed


#: the column that marks the row :func:`with_every_partition` adds (null in every row of the input)
EVERY_PARTITION_COLUMN = "__statebackend_every_partition"
#: the attribute :func:`with_every_partition` sets on the DataFrame it returns, so that :func:`route` drops the row
#: without reading the schema (a round trip on classic Spark)
_HAS_ADDED_ROW = "_statebackend_has_added_row"


def with_every_partition(batch_df: Any, schema: Any) -> Any:
    """``batch_df`` with one more row, which makes every task of :func:`route`'s repartition run when Spark knew the
    input to be empty before it ran (an empty local relation, a filter on false, a limit of 0) and planned it with no
    partition at all. The row (nulls, marked in :data:`EVERY_PARTITION_COLUMN`) goes through the shuffle and is
    dropped after it, in the task that gets it: a shuffle that wrote no row is not enough, since adaptive execution
    (Spark 3.5) plans what reads an empty shuffle as an empty relation, with no partition again."""
    from pyspark.sql import functions as F

    marked = batch_df.withColumn(EVERY_PARTITION_COLUMN, F.lit(None).cast("boolean"))
    row = batch_df.sparkSession.range(0, 1, 1, 1).select(
        *(F.lit(None).cast(field.dataType).alias(field.name) for field in schema.fields),
        F.lit(True).alias(EVERY_PARTITION_COLUMN),
    )
    frame = marked.unionByName(row)
    setattr(frame, _HAS_ADDED_ROW, True)
    return frame


def _is_connect(batch_df: Any) -> bool:
    return type(batch_df).__module__.startswith("pyspark.sql.connect")


_COLUMNS: dict[tuple[tuple[str, ...], int, int, bool], Any] = {}


def _partition_column(key_columns: tuple[str, ...], num_tasks: int, key_groups: int, connect: bool) -> Any:
    """The partition expression, built once per (key columns, tasks, key groups): building it costs a dozen py4j
    round trips on classic Spark, tens of ms a batch. A column of names only is not bound to a DataFrame."""
    key = (key_columns, num_tasks, key_groups, connect)
    column = _COLUMNS.get(key)
    if column is None:
        from pyspark.sql import functions as F

        group = F.pmod(F.hash(*(F.col(c) for c in key_columns)), F.lit(key_groups))
        task = F.floor(group * F.lit(num_tasks) / F.lit(key_groups)).cast("int")
        tags = F.array(*(F.lit(tag) for tag in partition_tags(num_tasks)))
        column = _COLUMNS[key] = F.element_at(tags, task + F.lit(1))
    return column
