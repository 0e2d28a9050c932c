"""Every bench imports on the PySpark it runs with (the Spark matrix runs this module on 3.5 and 4.0 too): only the
benches built on transformWithState, which PySpark 3.5 lacks, may fail to import there, and only for that."""

from __future__ import annotations

import importlib
import pkgutil

import pyspark
import pytest

from tests.script_runs import REPO

pytestmark = pytest.mark.spark_matrix

#: the benches that compare with Spark's transformWithStateInPandas (PySpark >= 4.0)
NEEDS_TRANSFORM_WITH_STATE = frozenset({"bench.spark_tws", "bench.tws_state"})
BENCHES = sorted(f"bench.{module.name}" for module in pkgutil.iter_modules([str(REPO / "bench")]))


def test_every_bench_is_listed() -> None:
    assert {"bench.spark_e2e", "bench.spark_ab", "bench.executor_loss", "bench.restore"} <= set(BENCHES)
    assert set(BENCHES) >= NEEDS_TRANSFORM_WITH_STATE


@pytest.mark.parametrize("name", BENCHES)
def test_a_bench_imports(name: str) -> None:
    if name in NEEDS_TRANSFORM_WITH_STATE and int(pyspark.__version__.split(".")[0]) < 4:
        with pytest.raises(ModuleNotFoundError, match="stateful_processor"):
            importlib.import_module(name)
    else:
        assert importlib.import_module(name).__name__ == name
