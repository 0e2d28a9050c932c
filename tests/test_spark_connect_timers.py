"""Under Spark Connect: a rows-mode function without output needs no ``output_schema`` (one that returns rows is
refused, naming it), timers of both kinds fire as on classic Spark, also in a batch without input, and stores start
from an initial state (a DataFrame of the client's session, or a function of the session, also through a streaming
query's foreachBatch) loaded once."""

from __future__ import annotations

import pytest

from tests.connect_child import command
from tests.script_runs import ScriptRuns, register
from tests.spark_helpers import report_of

pytestmark = [pytest.mark.spark, pytest.mark.slow]


# the child that runs under Spark Connect (tests/connect_child.py), shared with tests/test_spark_connect.py and run in
# the background with the suite's other scripts (tests/script_runs.py)
register("spark-connect", __name__, ["test_no_output_without_schema_and_timers_under_spark_connect"], command)


@pytest.mark.connect
def test_no_output_without_schema_and_timers_under_spark_connect(script_runs: ScriptRuns) -> None:
    report = report_of(script_runs.result("spark-connect"))
    assert report["connect"] is True
    result = report["timers"]
    assert result["quiet"] == {"shapes": [[[], 0], [[], 0]], "state_ok": True, "moved": []}
    assert "no output_schema" in result["loud_error"] and "Spark Connect" in result["loud_error"]
    assert result["pending_after_0"] == [["a", 1500], ["b", 2500]]
    assert result["processing"] == {
        "outputs": [[["c", 900, "processing", 0]], [["a", 1500, "processing", 1]], [["b", 2500, "processing", 2]]],
        "tasks": [0, 1, 2],  # the batch without input ran every task
    }
    assert result["event"] == {"outputs": [[], [], [["a", 1500, "event", 2]]], "watermarks": [[None], [900], [2900]]}
    initial = result["initial"]
    assert {k: v for k, v in initial.items() if k != "refused"} == {
        "first_ok": True,
        "second_ok": True,
        "state_ok": True,
        "stream_ok": True,
    }
    assert "already has state" in initial["refused"] and "'counts'" in initial["refused"]
