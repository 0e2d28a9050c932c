"""examples/initial_timers.py runs as written: trials loaded by initial_state expire by the timers on_initial_state
registered, each reported exactly once, equal to a plain Python pass (the script checks and exits 1 otherwise)."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent


@pytest.mark.slow
@pytest.mark.spark
def test_the_initial_timers_example_reports_every_trial_once(tmp_path: Path) -> None:
    done = subprocess.run(
        [sys.executable, "examples/initial_timers.py", "--users", "80", "--dir", str(tmp_path / "run")],
        cwd=ROOT,
        capture_output=True,
        text=True,
        check=False,
    )
    assert done.returncode == 0, done.stdout + done.stderr
    assert "OK: every trial reported exactly once" in done.stdout
    converted, expired = (int(part.split()[0]) for part in done.stdout.split("trials: ")[1].split(", ")[:2])
    assert converted > 0 and expired > 0  # both outcomes happened: the timers and the events both did their part
