"""bench/tws_state.py: the plain-Python outputs both engines are checked against, the key-by-key check that fails the
bench, and the bench end to end at tiny sizes (Spark: statebackend's list and map stores beside
transformWithStateInPandas' ListState and MapState, the outputs equal)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from bench.tws_state import batch_events, compare, difference_text, expected_outputs, kept_text
from tests.script_runs import ScriptRuns, register

ROOT = Path(__file__).resolve().parent.parent


def test_the_input_is_the_same_for_every_reader_and_seq_increases_across_batches() -> None:
    first = [batch_events(batch, users=7, events=20, seed=3) for batch in range(3)]
    assert first == [batch_events(batch, users=7, events=20, seed=3) for batch in range(3)]
    assert first != [batch_events(batch, users=7, events=20, seed=4) for batch in range(3)]
    seqs = [seq for events in first for _, seq, _ in events]
    assert seqs == sorted(seqs) == list(range(60))
    assert {user for events in first for user, _, _ in events} <= {f"u{i:07d}" for i in range(7)}


def test_expected_outputs_keep_the_last_n_events_and_count_by_type_batch_by_batch() -> None:
    batches = [
        [("a", 2, "view"), ("a", 0, "click"), ("b", 1, "view"), ("a", 3, "view")],  # out of seq order: sorted
        [("a", 4, "buy"), ("a", 5, "view")],
    ]
    out = expected_outputs(batches, keep=3)
    assert sorted(out["list"]) == sorted(
        [
            ("a", 3, kept_text([(0, "click"), (2, "view"), (3, "view")])),
            ("b", 1, kept_text([(1, "view")])),
            ("a", 3, kept_text([(3, "view"), (4, "buy"), (5, "view")])),  # the oldest two dropped
        ]
    )
    assert sorted(out["map"]) == sorted(
        [("a", "click", 1), ("a", "view", 2), ("b", "view", 1), ("a", "buy", 1), ("a", "view", 3)]
    )


def test_compare_names_the_users_whose_rows_differ_on_any_side() -> None:
    expected = [("a", "view", 1), ("a", "view", 2), ("b", "buy", 1)]
    assert compare(list(reversed(expected)), list(expected), expected) == []  # row order does not matter
    assert compare(expected[1:], expected, expected) == ["a"]  # statebackend lost a row
    assert compare(expected, [*expected, ("c", "buy", 1)], expected) == ["c"]  # transformWithStateInPandas invented one
    assert compare(expected, [*expected, ("b", "buy", 1)], expected) == ["b"]  # one emitted twice
    assert compare([("a", "view", 1), ("a", "view", 3), expected[2]], expected, expected) == ["a"]  # a count differs
    assert compare(expected[:2], expected[:2], expected) == ["b"]  # equal to each other, not to plain Python
    line = difference_text("b", expected[:2], [*expected, ("b", "buy", 1)], expected)  # what a FAIL line shows
    assert line == (
        "  b: statebackend []; transformWithStateInPandas [('b', 'buy', 1), ('b', 'buy', 1)]; "
        "expected [('b', 'buy', 1)]"
    )


def bench_at_tiny_sizes(folder: Path, tests: frozenset[str]) -> tuple[list[str], Path]:
    """The bench at tiny sizes, its results in ``folder / "results"``."""
    sizes = ["--users", "12", "--events", "40", "--batches", "2", "--partitions", "1"]
    return ["-m", "bench.tws_state", *sizes, "--results-dir", str(folder / "results")], ROOT


# in the background with the suite's other scripts (tests/script_runs.py)
register(
    "bench-tws-state",
    __name__,
    ["test_the_bench_runs_end_to_end_and_both_engines_agree_key_by_key"],
    bench_at_tiny_sizes,
)


@pytest.mark.spark
@pytest.mark.slow
def test_the_bench_runs_end_to_end_and_both_engines_agree_key_by_key(script_runs: ScriptRuns) -> None:
    result = script_runs.result("bench-tws-state")
    assert result.returncode == 0, result.stdout[-4000:] + result.stderr[-4000:]
    assert "list check:" in result.stdout and "map check:" in result.stdout
    [raw] = (result.dir / "results").glob("tws-state-*.json")
    workloads = json.loads(raw.read_text())["workloads"]
    assert set(workloads) == {"list", "map"}
    for name, workload in workloads.items():
        rows = workload["output_rows"]
        assert workload["ok"] and workload["differing_users"] == [], name
        assert rows["expected"] > 0 and rows["statebackend"] == rows["transformWithStateInPandas"] == rows["expected"]
        for engine, batches in workload["batches"].items():
            assert [b["batch"] for b in batches] == [0, 1], (name, engine)  # every engine ran both batches
            assert all(b["duration_ms"] > 0 for b in batches), (name, engine)
