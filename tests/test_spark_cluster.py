"""Affinity on a multi-executor cluster: on Spark's ``local-cluster[2,1,1024]`` master (two executor processes, each
with its own local state dir, as separate machines have), tasks stay on the executor holding their local state: after
warm-up at most 10% of task-batches move, and the state is exact."""

from __future__ import annotations

import json
import shutil
from pathlib import Path
from typing import Any

import pytest

from tests.script_runs import ScriptRuns, register
from tests.spark_helpers import env_with_repo, run_python

pytestmark = [pytest.mark.slow, pytest.mark.spark]

REPO = Path(__file__).resolve().parent.parent
WARM_UP = 2


MODES = ("rows", "arrow", "pandas")


def run_cluster_modes(tmp_path: Path, batches: int, affinity: bool, modes: tuple[str, ...]) -> dict[str, Any]:
    """Run tests/cluster_child.py once: the given modes one after the other on one cluster; mode -> its result."""
    report = tmp_path / f"report-{int(affinity)}-{'-'.join(modes)}.json"
    args = [str(tmp_path), str(batches), "1" if affinity else "0", str(report), ",".join(modes)]
    run_python(["-m", "tests.cluster_child", *args], env_with_repo())
    result: dict[str, Any] = json.loads(report.read_text())
    shutil.rmtree(result["app_work_dir"], ignore_errors=True)  # the executors' working dirs, local state included
    return {mode: result["modes"][mode] for mode in modes}


def run_cluster(tmp_path: Path, batches: int, affinity: bool, mode: str = "rows") -> dict[str, Any]:
    """One mode on a cluster of its own (bench/spark_e2e.py)."""
    return run_cluster_modes(tmp_path, batches, affinity, (mode,))[mode]


def cluster_child(folder: Path, tests: frozenset[str]) -> tuple[list[str], Path]:
    """The three modes with affinity on one two-executor cluster (starting one costs tens of seconds), its report in
    ``folder / "report.json"``; each mode is its own job, so each test below checks one mode as if it had had the
    cluster to itself."""
    args = [str(folder), "12", "1", str(folder / "report.json"), ",".join(MODES)]
    return ["-m", "tests.cluster_child", *args], REPO


# in the background with the suite's other scripts (tests/script_runs.py): most of its time is JVMs starting
register(
    "spark-cluster",
    __name__,
    [
        *(f"test_tasks_stay_with_their_state_on_a_two_executor_cluster[{mode}]" for mode in MODES),
        "test_a_task_moved_to_an_executor_runs_there_in_the_batch_that_moves_it",
    ],
    cluster_child,
)


@pytest.fixture(scope="module")
def cluster_report(script_runs: ScriptRuns) -> dict[str, Any]:
    run = script_runs.result("spark-cluster")
    assert run.returncode == 0, run.stdout[-4000:] + run.stderr[-4000:]
    result: dict[str, Any] = json.loads((run.dir / "report.json").read_text())
    shutil.rmtree(result["app_work_dir"], ignore_errors=True)  # the executors' working dirs, local state included
    return result


@pytest.fixture(scope="module")
def cluster_results(cluster_report: dict[str, Any]) -> dict[str, Any]:
    modes: dict[str, Any] = cluster_report["modes"]
    return modes


def test_a_task_moved_to_an_executor_runs_there_in_the_batch_that_moves_it(cluster_report: dict[str, Any]) -> None:
    # seen: a moved task, its anchor cached nowhere, waited spark.locality.wait (3 s) and then ran on any free core:
    # the driver now asks Spark for the executor it moves the task to, in that batch alone
    placed = cluster_report["placed"]
    assert len(placed) == 2, placed
    assert placed == {executor: [[executor]] * 3 for executor in placed}, placed


def moves(attempts: list[dict[str, Any]], warm_up: int) -> tuple[int, int]:
    """(task-batches after warm-up that ran on another executor than the task's previous batch, task-batches)."""
    where: dict[int, str] = {}
    moved = counted = 0
    for attempt in sorted(attempts, key=lambda a: (a["batch"], a["task"])):
        previous = where.get(attempt["task"])
        if attempt["batch"] >= warm_up and previous is not None:
            counted += 1
            moved += previous != attempt["executor"]
        where[attempt["task"]] = attempt["executor"]
    return moved, counted


@pytest.mark.parametrize("mode", MODES)
def test_tasks_stay_with_their_state_on_a_two_executor_cluster(cluster_results: dict[str, Any], mode: str) -> None:
    result = cluster_results[mode]
    assert result["state_ok"] and result["outputs_ok"]
    executors = {a["executor"] for a in result["attempts"]}
    assert len(executors) == 2, f"expected two executors, the tasks ran on {executors}"
    moved, counted = moves(result["attempts"], WARM_UP)
    assert counted == 4 * (12 - WARM_UP)
    assert moved <= 0.1 * counted, f"{moved} of {counted} task-batches moved to another executor"
