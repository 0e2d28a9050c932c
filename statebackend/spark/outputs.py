"""The task's output checked against the output schema inside the task, before its commit.

A row, record batch or frame that does not fit the schema fails the attempt with an
:class:`~statebackend.errors.OutputSchemaError` naming the fields, so no checkpoint holds a batch whose output
Spark cannot write (found only at the sink otherwise, after every task's checkpoint was durable).

- rows mode: every row's shape (its number of values, or its field names for Rows and dicts); its values' types
  by Spark's own row verifier for every row on the RDD route (which then skips Spark's later verification of the
  same rows: the work moves before the commit, it is not done twice) and for the first :data:`TYPED_ROWS` rows
  over Arrow (where Arrow's conversion checks every value anyway). Without ``output_schema``, the first row's
  shape is the schema Spark infers, and every other row must have it.
- arrow mode: every batch's column names and types.
- pandas mode: every frame's column names.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Iterator, Mapping
from typing import Any

from statebackend.errors import OutputSchemaError

__all__ = ["TYPED_ROWS", "check_arrow", "check_pandas", "check_rows"]

#: rows over Arrow: the first rows of a task whose values are checked by type as well as by shape
TYPED_ROWS = 1000


def check_rows(struct: Any, where: str, *, typed_rows: int | None = None) -> Callable[[Iterable[Any]], Iterator[Any]]:
    """A filter over output rows that raises on the first one that does not fit ``struct`` (a Spark StructType, or
    None: the first row's shape). ``typed_rows``: rows checked by type too (None: all)."""
    if struct is not None and not struct.fields:
        return lambda rows: iter(rows or ())  # no output at all: the attempt refuses rows, naming output_schema
    verify = _row_verifier(struct) if struct is not None else None
    names = tuple(struct.names) if struct is not None else None

    def checked(rows: Iterable[Any]) -> Iterator[Any]:
        expected = names
        for number, row in enumerate(rows or ()):
            shape = _shape(row)
            if expected is None:
                expected = shape if isinstance(shape, tuple) else tuple(f"_{i + 1}" for i in range(shape))
            _check_shape(shape, expected, row, where, declared=names is not None)
            if verify is not None and (typed_rows is None or number < typed_rows):
                try:
                    verify(row)
                except (TypeError, ValueError) as exc:
                    raise OutputSchemaError(
                        f"{where}: an output row does not fit output_schema ({_ddl(struct)}): {exc} (row "
                        f"{_short(row)})") from exc
            yield row

    return checked


def check_arrow(schema: Any, where: str) -> Callable[[Iterable[Any]], Iterator[Any]]:
    """A filter over output record batches that raises on the first whose columns are not ``schema``'s."""

    def checked(batches: Iterable[Any]) -> Iterator[Any]:
        for batch in batches:
            if not batch.schema.equals(schema, check_metadata=False):
                got = [f"{f.name} {f.type}" for f in batch.schema]
                want = [f"{f.name} {f.type}" for f in schema]
                if [f.name for f in batch.schema] == list(schema.names):
                    try:
                        batch = batch.cast(schema)  # same columns, types Arrow casts safely (int32 -> int64, ...)
                    except (TypeError, ValueError, NotImplementedError) as exc:
                        raise OutputSchemaError(f"{where}: an output batch has columns ({', '.join(got)}) where "
                                                f"output_schema has ({', '.join(want)}): {exc}") from exc
                else:
                    raise OutputSchemaError(f"{where}: an output batch has columns ({', '.join(got)}) where "
                                            f"output_schema has ({', '.join(want)})")
            yield batch

    return checked


def check_pandas(schema: Any, where: str) -> Callable[[Iterable[Any]], Iterator[Any]]:
    """A filter over output frames that raises on the first whose columns are not ``schema``'s names."""
    names = list(schema.names)

    def checked(frames: Iterable[Any]) -> Iterator[Any]:
        for frame in frames:
            columns = [str(c) for c in frame.columns]
            if sorted(columns) != sorted(names) and len(frame):
                raise OutputSchemaError(f"{where}: an output frame has columns ({', '.join(columns)}) where "
                                        f"output_schema has ({', '.join(names)})")
            yield frame

    return checked


def _row_verifier(struct: Any) -> Callable[[Any], None]:
    from pyspark.sql.types import _make_type_verifier

    verifier: Callable[[Any], None] = _make_type_verifier(struct)
    return verifier


def _shape(row: Any) -> tuple[str, ...] | int:
    """A row's field names (a Row with names, a dict), or its number of values (a tuple)."""
    if isinstance(row, Mapping):
        return tuple(str(k) for k in row)
    fields = getattr(row, "__fields__", None)
    if fields is not None:
        return tuple(fields)
    try:
        return len(row)
    except TypeError:
        raise OutputSchemaError(f"an output row must be a tuple, a Row or a dict, got {type(row).__name__}: "
                                f"{_short(row)}") from None


def _check_shape(shape: tuple[str, ...] | int, expected: tuple[str, ...], row: Any, where: str, *,
                 declared: bool) -> None:
    schema = "output_schema" if declared else "the first output row"
    if isinstance(shape, int):
        if shape != len(expected):
            raise OutputSchemaError(f"{where}: an output row has {shape} values where {schema} has {len(expected)} "
                                    f"fields ({', '.join(expected)}): {_short(row)}")
    elif sorted(shape) != sorted(expected) if declared else shape != expected:
        missing = [name for name in expected if name not in shape]
        extra = [name for name in shape if name not in expected]
        raise OutputSchemaError(
            f"{where}: an output row has fields ({', '.join(shape)}) where {schema} has ({', '.join(expected)})"
            + (f"; missing: {', '.join(missing)}" if missing else "") + (f"; unknown: {', '.join(extra)}" if extra
                                                                         else "") + f": {_short(row)}")


def _ddl(struct: Any) -> str:
    return ", ".join(f"{f.name} {f.dataType.simpleString()}" for f in struct.fields)


def _short(value: Any, limit: int = 120) -> str:
    text = repr(value)
    return text if len(text) <= limit else text[:limit - 3] + "..."
