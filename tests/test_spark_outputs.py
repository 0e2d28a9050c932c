"""The output checks a task runs before its commit take what Spark and Arrow take, and refuse what they would refuse
later (after the commit), naming the fields."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import numpy as np
import pandas as pd
import pyarrow as pa
import pytest
from pyspark.sql import Row
from pyspark.sql.types import DoubleType, LongType, StringType, StructField, StructType

from statebackend.errors import OutputSchemaError
from statebackend.spark.frames import rows_to_batches
from statebackend.spark.outputs import check_arrow, check_pandas, check_rows, check_rows_for_arrow

pytestmark = pytest.mark.spark_matrix

STRUCT = StructType([StructField("word", StringType(), True), StructField("count", LongType(), True)])
ARROW = pa.schema([("word", pa.string()), ("count", pa.int64())])


@dataclass
class Point:
    word: str
    count: int


def test_rows_on_the_rdd_route_take_what_spark_verifies_and_refuse_the_rest() -> None:
    check = check_rows(STRUCT, "task-0, batch 1")
    good = [("a", 1), Row(word="b", count=2), {"word": "c"}, {"word": "d", "count": 4, "extra": 1}, ("e", None)]
    assert list(check(good)) == good
    with pytest.raises(
        OutputSchemaError,
        match=r"task-0, batch 1: an output row does not fit output_schema "
        r"\(word string, count bigint\)",
    ):
        list(check([("a", 1), ("b", 1, "extra")]))
    with pytest.raises(OutputSchemaError, match="count"):
        list(check([("a", "not a number")]))


def test_rows_without_a_schema_refuse_only_tuples_of_another_length() -> None:
    check = check_rows(None, "task-0, batch 1")
    good = [{"a": 1, "b": 2}, {"b": 3, "a": 4}, ("x", 1), ("y", 2)]
    assert list(check(good)) == good
    with pytest.raises(OutputSchemaError, match="3 values where the first row"):
        list(check([("x", 1), ("y", 2, 3)]))


def test_rows_over_arrow_take_what_arrow_converts_and_refuse_before_the_commit_what_it_does_not() -> None:
    check = check_rows_for_arrow(ARROW, "task-2, batch 0")
    good = [("a", np.int64(1)), Row(count=2, word="b"), {"word": "c"}, ("d", 4)]
    assert list(check(good)) == good
    assert pa.Table.from_batches(list(rows_to_batches(good, ARROW))).num_rows == 4  # what follows the commit
    with pytest.raises(OutputSchemaError, match="3 values where output_schema has 2 columns"):
        list(check([("a", 1, "x")]))
    with pytest.raises(OutputSchemaError, match="do not convert to output_schema"):
        list(check([("a", "not a number")]))
    doubles = check_rows_for_arrow(pa.schema([("word", pa.string()), ("score", pa.float64())]), "t")
    assert list(doubles([("a", 1)])) == [("a", 1)]


def test_arrow_batches_are_put_in_the_schemas_order_and_types_or_refused_naming_the_columns() -> None:
    check = check_arrow(ARROW, "task-1, batch 4")
    swapped = pa.record_batch({"count": pa.array([1], pa.int32()), "word": pa.array(["a"])})
    [fixed] = list(check([swapped]))
    assert fixed.schema.equals(ARROW) and fixed.to_pylist() == [{"word": "a", "count": 1}]
    with pytest.raises(OutputSchemaError, match="missing: count"):
        list(check([pa.record_batch({"word": pa.array(["a"])})]))
    with pytest.raises(OutputSchemaError, match="do not cast"):
        list(check([pa.record_batch({"word": pa.array(["a"]), "count": pa.array(["x"])})]))


def test_pandas_frames_need_the_schemas_columns_by_name_unless_positional() -> None:
    check = check_pandas(ARROW, "task-0, batch 0")
    good = [pd.DataFrame({"count": [1], "word": ["a"]}), pd.DataFrame([["a", 1]]), pd.DataFrame(columns=["x"])]
    assert len(list(check(good))) == 3
    with pytest.raises(OutputSchemaError, match="missing: count"):
        list(check([pd.DataFrame({"word": ["a"], "total": [1]})]))


def test_dataclass_rows_pass_spark_s_verifier_on_the_rdd_route() -> None:
    doubles = StructType([StructField("word", StringType()), StructField("count", DoubleType())])
    rows: list[Any] = [Point("a", 1)]
    assert list(check_rows(STRUCT, "t")(rows)) == rows
    with pytest.raises(OutputSchemaError):
        list(check_rows(doubles, "t")([Point("a", "x")]))  # type: ignore[arg-type]
