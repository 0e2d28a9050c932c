"""The list-append benchmark runs against today's API: one measurement at a tiny size (its timings are not
asserted: benchmarks measure, tests do not time)."""

from __future__ import annotations

from pathlib import Path

from bench.list_append import ROUNDS, config, measure
from statebackend.task import TaskStorage


def test_the_list_append_bench_measures_every_column_at_a_tiny_size(tmp_path: Path) -> None:
    with TaskStorage.open(config(tmp_path), "task-0") as task:
        result = measure(task, 20, 5)
        assert len(task.list_store("events").get("len20")) == 20 + 5 * ROUNDS  # built, then the rounds' appends
    assert set(result) == {"append", "append_trim", "json_rewrite"}
    assert all(value > 0 for value in result.values())
