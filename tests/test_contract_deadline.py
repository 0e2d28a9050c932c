"""The contract suites' per-test deadline (statebackend.testing.deadline) fails a hung test without any plugin, and
gives back an interval timer someone else (pytest-timeout) armed; the bounds the suites give it are stretched by the
machine's load."""

from __future__ import annotations

import os
import signal
import threading
import time

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
