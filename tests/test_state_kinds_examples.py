"""The list and map store examples run as a user runs them (a fresh interpreter, from the repository root) and check
themselves against plain Python; both run in the background with the suite's other scripts (tests/script_runs.py)."""

from __future__ import annotations

from tests.script_runs import ScriptRuns, from_repo, register

SCRIPTS = {
    "last_events": ["examples/last_events.py", "--batches", "3", "--events-per-batch", "300", "--tasks", "3"],
    "user_counters": ["examples/user_counters.py", "--batches", "3", "--events-per-batch", "300", "--tasks", "3"],
}


# in the background with the suite's other scripts (tests/script_runs.py)
register(
    "example-last-events",
    __name__,
    ["test_the_last_events_example_keeps_each_users_last_5_events"],
    from_repo(*SCRIPTS["last_events"]),
)
register(
    "example-user-counters",
    __name__,
    ["test_the_user_counters_example_counts_each_users_actions"],
    from_repo(*SCRIPTS["user_counters"]),
)


def finished(script_runs: ScriptRuns, name: str) -> tuple[int, str, str]:
    done = script_runs.result(name)
    return done.returncode, done.stdout, done.stderr


def test_the_last_events_example_keeps_each_users_last_5_events(script_runs: ScriptRuns) -> None:
    code, stdout, stderr = finished(script_runs, "example-last-events")
    assert code == 0, stdout + stderr[-3000:]
    assert "OK: the last 5 events of all 50 users equal the plain-Python computation" in stdout
    assert stdout.count("users with new events") == 3


def test_the_user_counters_example_counts_each_users_actions(script_runs: ScriptRuns) -> None:
    code, stdout, stderr = finished(script_runs, "example-user-counters")
    assert code == 0, stdout + stderr[-3000:]
    assert "OK: the counters of all 40 users equal the plain-Python count" in stdout
    assert stdout.count("most frequent action so far") == 3
