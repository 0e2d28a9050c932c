"""The user function's input and output between Spark's forms (Rows, Arrow record batches, pandas frames) and the
forms the task's modes hand over, one bounded batch at a time."""

from __future__ import annotations

from collections.abc import Iterable, Iterator, Mapping
from typing import Any

from statebackend.errors import ConfigError
from statebackend.spark.stats import STATS_COLUMN, TaskStats

__all__ = [
    "arrow_batches",
    "batches_to_rows",
    "pandas_frames",
    "pandas_with_stats",
    "row_record",
    "rows_to_batches",
    "rows_to_input_batches",
]


def arrow_batches(result: Any) -> Iterator[Any]:
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
            yield from arrow_batches(item)


#: output rows per Arrow batch in rows mode over Arrow
_ROWS_PER_BATCH = 1 << 16


def rows_to_batches(rows: Iterable[Any], schema: Any) -> Iterator[Any]:
    """The function's output rows (tuples, Rows or dicts) as Arrow batches of the declared output ``schema``, at most
    64Ki rows at a time."""
    import pyarrow as pa

    names = list(schema.names)
    records: list[dict[str, Any]] = []
    for row in rows:
        records.append(row_record(row, names))
        if len(records) >= _ROWS_PER_BATCH:
            yield from pa.Table.from_pylist(records, schema=schema).to_batches()
            records = []
    if records:
        yield from pa.Table.from_pylist(records, schema=schema).to_batches()


def row_record(row: Any, names: list[str]) -> dict[str, Any]:
    """An output row (a dict, a Row, or a tuple of the schema's ``names`` in order) as a dict by column name."""
    if isinstance(row, Mapping):
        return dict(row)
    if hasattr(row, "asDict"):
        return dict(row.asDict())
    values = tuple(row)
    if len(values) != len(names):
        raise ConfigError(
            f"an output row has {len(values)} values where output_schema has {len(names)} columns "
            f"({', '.join(names)}): {values!r}"
        )
    return dict(zip(names, values, strict=True))


def rows_to_input_batches(rows: Iterable[Any], schema: Any) -> Iterator[Any]:
    """Spark Rows as Arrow record batches of ``schema`` (its columns in order), at most 64Ki rows at a time."""
    import pyarrow as pa

    chunk: list[tuple[Any, ...]] = []

    def batch() -> Any:
        columns = list(zip(*chunk, strict=True)) if chunk else [() for _ in schema]
        return pa.RecordBatch.from_arrays(
            [pa.array(column, type=field.type) for column, field in zip(columns, schema, strict=True)], schema=schema
        )

    for row in rows:
        chunk.append(tuple(row))
        if len(chunk) >= _ROWS_PER_BATCH:
            yield batch()
            chunk = []
    if chunk:
        yield batch()


def batches_to_rows(batches: Iterable[Any], schema: Any) -> Iterator[tuple[Any, ...]]:
    """Arrow record batches (or tables) as tuples in ``schema``'s column order."""
    names = schema.names
    for batch in batches:
        columns = [batch.column(name).to_pylist() for name in names]
        yield from zip(*columns, strict=True)


def pandas_with_stats(frames: Iterable[Any], stats: TaskStats, schema: Any) -> Iterator[Any]:
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


def pandas_frames(result: Any) -> Iterator[Any]:
    import pandas as pd

    if result is None:
        return
    if isinstance(result, pd.DataFrame):
        yield result
    else:
        for item in result:
            yield from pandas_frames(item)
