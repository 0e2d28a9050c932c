"""bench/executor_loss.py at a tiny size: an executor of ``local-cluster`` is killed, the next batch recovers on
another executor from the blob store, and the state read back afterwards is exact."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from tests.script_runs import REPO, ScriptRuns, register

pytestmark = [pytest.mark.slow, pytest.mark.spark]


def bench_at_a_tiny_size(folder: Path, tests: frozenset[str]) -> tuple[list[str], Path]:
    """The bench at a tiny size, its result in ``folder / "result.json"``."""
    args = ["--keys-per-task", "3000", "--updates", "200", "--batches", "2", "--after", "3", "--restores", "1"]
    return ["-m", "bench.executor_loss", *args, "--result", str(folder / "result.json")], REPO


# in the background with the suite's other scripts (tests/script_runs.py): most of its time is JVMs starting
register(
    "bench-executor-loss",
    __name__,
    ["test_the_lost_task_is_restored_on_another_executor_and_the_state_is_exact"],
    bench_at_a_tiny_size,
)


def test_the_lost_task_is_restored_on_another_executor_and_the_state_is_exact(script_runs: ScriptRuns) -> None:
    result = script_runs.result("bench-executor-loss")
    assert result.returncode == 0, result.stdout[-4000:] + result.stderr[-4000:]
    (size,) = json.loads((result.dir / "result.json").read_text())["sizes"]

    check = size["check"]
    assert check["ok"], check
    assert check["keys"] == check["distinct_keys"] == 6000
    assert check["wrong_counts"] == 0 and check["updated_keys"] == check["expected_updated_keys"] > 0
    assert sum(check["keys_per_task"].values()) == 6000 and len(check["keys_per_task"]) == 2

    victim, task0 = size["victim_executor"], size["task0_recovered"]
    assert victim in size["executors_before"]
    # the killed JVM is gone, and task 0 ran again elsewhere, its state taken from the blob store
    assert [e[0] >= 0.0 for e in size["watcher_events"] if e[1:] == ["process", "-", victim]] == [True]
    assert task0["executor"] != victim
    assert task0["restored_full"] + task0["caught_up"] >= 1 and task0["restore_bytes"] > 0
    assert not task0["kept_open"]
    # the recovery is measured from the kill to the batch's end, after task 0's function started again
    assert 0 < size["timeline"]["task0_fn_started_s"] < size["recovery_s"] == size["timeline"]["batch_end_s"]
    assert size["restore_s"] > 0 and size["restores"][0]["keys"] == check["keys_per_task"]["task-0"]
    # once the replacement registered, the tasks spread over both living executors again and stay there: the driver
    # moves one of two tasks sharing an executor to one that runs none (statebackend/spark/runs.py, _spread)
    placements = [{a["task"]: a["executor"] for a in batch["attempts"]} for batch in size["after"]]
    assert all(set(p) == {0, 1} and victim not in p.values() for p in placements), placements
    assert len(set(placements[-1].values())) == 2 and placements[-1] == placements[-2], placements
