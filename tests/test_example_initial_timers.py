"""examples/initial_timers.py runs as written: trials loaded by initial_state expire by the timers on_initial_state
registered, each reported exactly once, equal to a plain Python pass (the script checks and exits 1 otherwise)."""

from __future__ import annotations

import pytest

from tests.script_runs import REPO as ROOT
from tests.script_runs import ScriptRuns, register

# in the background with the suite's other scripts (tests/script_runs.py)
register(
    "example-initial-timers",
    __name__,
    ["test_the_initial_timers_example_reports_every_trial_once"],
    lambda folder, tests: (["examples/initial_timers.py", "--users", "80", "--dir", str(folder / "run")], ROOT),
)


@pytest.mark.slow
@pytest.mark.spark
def test_the_initial_timers_example_reports_every_trial_once(script_runs: ScriptRuns) -> None:
    done = script_runs.result("example-initial-timers")
    assert done.returncode == 0, done.stdout + done.stderr
    assert "OK: every trial reported exactly once" in done.stdout
    converted, expired = (int(part.split()[0]) for part in done.stdout.split("trials: ")[1].split(", ")[:2])
    assert converted > 0 and expired > 0  # both outcomes happened: the timers and the events both did their part
