"""The task's output checked against the output schema inside the task, before its commit.

Output that cannot be written fails the attempt with an :class:`~statebackend.errors.OutputSchemaError` naming the
fields, so no checkpoint holds a batch whose output Spark cannot take (found only at the sink otherwise, after
every task's checkpoint was durable). The checks apply the rules of the conversion that follows, never stricter
ones: a row Spark (or Arrow) would take passes.

- rows mode on an RDD (classic Spark): every row through Spark's own row verifier, the one
  ``createDataFrame(rdd, schema)`` runs (the driver then skips it there: the work moves before the commit, it is
  not done twice). Without ``output_schema``, Spark infers the schema from the rows: only a tuple whose length
  differs from the first tuple's is refused.
- rows mode over Arrow (Spark Connect): every row's shape (a tuple's length, as :func:`rows_to_batches` needs it)
  and the first :data:`TYPED_ROWS` rows converted exactly as :func:`rows_to_batches` converts them (by name,
  Arrow's casts), where Arrow checks every row later anyway.
- arrow mode: a batch must have every column of the schema (by name); its columns are put in the schema's order
  and cast to its types (a cast that fails is refused).
- pandas mode: a frame with string column labels must have every column of the schema (Spark matches them by
  name); one with positional labels is left to Spark.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Iterator
from typing import Any

from statebackend.errors import OutputSchemaError

__all__ = ["TYPED_ROWS", "check_arrow", "check_pandas", "check_rows", "check_rows_for_arrow"]

#: rows over Arrow: the first rows of a task converted to Arrow before the commit, as the output will be after it
TYPED_ROWS = 1000


def check_rows(struct: Any, where: str) -> Callable[[Iterable[Any]], Iterator[Any]]:
    """Rows mode on an RDD: a filter over output rows that raises on the first one Spark's verifier refuses for
    ``struct`` (a Spark StructType; None: no schema declared, only tuples of another length than the first's)."""
    if struct is not None and not struct.fields:
        return lambda rows: iter(rows or ())  # no output at all: the attempt refuses rows, naming output_schema
    verify = _row_verifier(struct) if struct is not None else None

    def checked(rows: Iterable[Any]) -> Iterator[Any]:
        width: int | None = None
        for row in rows or ():
            if verify is not None:
                try:
                    verify(row)
                except (TypeError, ValueError) as exc:
                    raise OutputSchemaError(
                        f"{where}: an output row does not fit output_schema ({_ddl(struct)}): {exc} (row {_short(row)})"
                    ) from exc
            elif _is_plain_tuple(row):
                if width is None:
                    width = len(row)
                elif len(row) != width:
                    raise OutputSchemaError(
                        f"{where}: an output row has {len(row)} values where the first row (the "
                        f"schema Spark infers without output_schema) has {width}: {_short(row)}"
                    )
            yield row

    return checked


def check_rows_for_arrow(
    schema: Any,
    where: str,
    *,
    typed_rows: int = TYPED_ROWS,
) -> Callable[[Iterable[Any]], Iterator[Any]]:
    """Rows mode over Arrow: a filter over output rows that raises on the first whose shape :func:`rows_to_batches`
    cannot take, and on the first of the first ``typed_rows`` rows Arrow cannot convert to ``schema``."""
    if schema is None or len(schema) == 0:
        return lambda rows: iter(rows or ())  # no output at all: the attempt refuses rows, naming output_schema
    import pyarrow as pa

    from statebackend.spark.frames import row_record

    names = list(schema.names)

    def checked(rows: Iterable[Any]) -> Iterator[Any]:
        sample: list[dict[str, Any]] = []
        for number, row in enumerate(rows or ()):
            try:
                record = row_record(row, names)
            except (TypeError, ValueError) as exc:
                raise OutputSchemaError(f"{where}: {exc}") from exc
            if number < typed_rows:
                sample.append(record)
                if len(sample) == typed_rows:
                    _convert(pa, sample, schema, where)
            yield row
        if 0 < len(sample) < typed_rows:
            _convert(pa, sample, schema, where)

    return checked


def check_arrow(schema: Any, where: str) -> Callable[[Iterable[Any]], Iterator[Any]]:
    """A filter over output record batches: each has every column of ``schema`` (by name), comes out in its order
    and types (cast), or the attempt fails naming the columns."""
    import pyarrow as pa

    names = list(schema.names)

    def checked(batches: Iterable[Any]) -> Iterator[Any]:
        for batch in batches:
            if batch.schema.equals(schema, check_metadata=False):
                yield batch
                continue
            have = list(batch.schema.names)
            missing = [name for name in names if name not in have]
            got = ", ".join(f"{f.name} {f.type}" for f in batch.schema)
            want = ", ".join(f"{f.name} {f.type}" for f in schema)
            if missing:
                raise OutputSchemaError(
                    f"{where}: an output batch has columns ({got}) where output_schema has "
                    f"({want}); missing: {', '.join(missing)}"
                )
            try:
                columns = [batch.column(have.index(f.name)).cast(f.type) for f in schema]
                yield pa.RecordBatch.from_arrays(columns, schema=schema)
            except (pa.ArrowInvalid, pa.ArrowNotImplementedError, TypeError, ValueError) as exc:
                raise OutputSchemaError(
                    f"{where}: an output batch has columns ({got}) that do not cast to output_schema ({want}): {exc}"
                ) from exc

    return checked


def check_pandas(schema: Any, where: str) -> Callable[[Iterable[Any]], Iterator[Any]]:
    """A filter over output frames: a frame with string column labels has every column of ``schema``."""
    names = list(schema.names)

    def checked(frames: Iterable[Any]) -> Iterator[Any]:
        for frame in frames:
            labels = list(frame.columns)
            if len(frame) and labels and any(isinstance(label, str) for label in labels):
                missing = [name for name in names if name not in labels]
                if missing:
                    raise OutputSchemaError(
                        f"{where}: an output frame has columns ({', '.join(map(str, labels))}) where output_schema "
                        f"has ({', '.join(names)}); missing: {', '.join(missing)}"
                    )
            yield frame

    return checked


def _convert(pa: Any, records: list[dict[str, Any]], schema: Any, where: str) -> None:
    try:
        pa.Table.from_pylist(records, schema=schema)
    except (
        pa.ArrowInvalid,
        pa.ArrowTypeError,
        pa.ArrowNotImplementedError,
        TypeError,
        ValueError,
        OverflowError,
    ) as exc:
        want = ", ".join(f"{f.name} {f.type}" for f in schema)
        raise OutputSchemaError(f"{where}: output rows do not convert to output_schema ({want}): {exc}") from exc


def _row_verifier(struct: Any) -> Callable[[Any], None]:
    from pyspark.sql.types import _make_type_verifier

    verifier: Callable[[Any], None] = _make_type_verifier(struct)
    return verifier


def _is_plain_tuple(row: Any) -> bool:
    return isinstance(row, tuple) and getattr(row, "__fields__", None) is None and not hasattr(row, "_fields")


def _ddl(struct: Any) -> str:
    return ", ".join(f"{f.name} {f.dataType.simpleString()}" for f in struct.fields)


def _short(value: Any, limit: int = 120) -> str:
    text = repr(value)
    return text if len(text) <= limit else text[: limit - 3] + "..."
