"""The contract suites' per-test deadline (statebackend.testing.deadline) fails a hung test without any plugin, and
gives back an interval timer someone else (pytest-timeout) armed; the bounds the suites give it are stretched by the
machine's load."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest

from statebackend.testing.deadline import deadline, load_factor, scaled


def test_a_wait_past_the_deadline_fails_the_test_naming_it() -> None:
    started = time.monotonic()
    with (
        pytest.raises(pytest.fail.Exception, match="the-hung-test did not finish within 0.2 s"),
        deadline(0.2, "the-hung-test"),
    ):
        threading.Event().wait(30)
    assert time.monotonic() - started < 10


def test_a_block_within_the_deadline_is_left_alone_and_the_previous_timer_is_given_back() -> None:
    fired: list[int] = []
    previous = signal.signal(signal.SIGALRM, lambda signum, frame: fired.append(signum))
    try:
        signal.setitimer(signal.ITIMER_REAL, 30.0)
        with deadline(5.0, "quick"):
            pass
        left, _ = signal.getitimer(signal.ITIMER_REAL)
        assert 20.0 < left <= 30.0
        assert signal.getsignal(signal.SIGALRM) is not previous and fired == []
    finally:
        signal.setitimer(signal.ITIMER_REAL, 0)
        signal.signal(signal.SIGALRM, previous)


def test_no_deadline_when_it_is_zero() -> None:
    before = signal.getsignal(signal.SIGALRM)
    with deadline(0, "unbounded"):
        inside = signal.getsignal(signal.SIGALRM)
        threading.Event().wait(0.05)
    assert inside is before


def test_a_bound_is_stretched_by_the_load_per_cpu_and_never_shortened(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(os, "cpu_count", lambda: 2)
    monkeypatch.setattr(os, "getloadavg", lambda: (8.0, 1.0, 1.0))
    assert load_factor() == 4.0 and scaled(30.0) == 120.0
    monkeypatch.setattr(os, "getloadavg", lambda: (0.5, 0.5, 0.5))  # an idle machine: the bound as given
    assert load_factor() == 1.0 and scaled(30.0) == 30.0
    assert scaled(0) == 0  # no bound stays no bound


SLOW_REPORT_CONFTEST = """
import time

import pytest

from statebackend.testing.deadline import REPEAT_S, deadline


@pytest.fixture(autouse=True)
def _contract_deadline(request):
    with deadline(0.2, request.node.name):
        yield


def pytest_runtest_logreport(report):
    if report.when == "call":  # pytest writes a report slowly (a loaded machine): the deadline's repeat fires here
        end = time.monotonic() + REPEAT_S * 1.5
        while time.monotonic() < end:
            time.sleep(0.01)
"""

HUNG_THEN_QUICK = """
import threading


def test_hung():
    threading.Event().wait(30)


def test_after_it():
    pass
"""


def test_a_deadline_firing_while_pytest_writes_a_report_fails_no_session(tmp_path: Path) -> None:
    """The repeat of a passed deadline can land in pytest's reporting between a test's phases: it must wait for the
    next phase there, not raise (an INTERNALERROR that ends the session and drops every later test)."""
    (tmp_path / "conftest.py").write_text(SLOW_REPORT_CONFTEST)
    (tmp_path / "test_hung.py").write_text(HUNG_THEN_QUICK)
    run = subprocess.run(
        [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-p", "no:timeout", str(tmp_path)],
        cwd=tmp_path,
        capture_output=True,
        text=True,
        timeout=300,
    )
    out = run.stdout + run.stderr
    assert "INTERNALERROR" not in out, out
    assert run.returncode == 1, out  # tests failed: the session itself ran to its end
    assert "1 failed, 1 passed" in out, out
