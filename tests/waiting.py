"""Waiting in tests for what background threads do: a condition polled until true, failing the test after a bound;
the LMDB appliers drained of every apply submitted so far. Every bound here guards a hang only: it is the time the wait
may take on an idle machine, stretched by the machine's load (:func:`scaled`), so a busy machine never fails a wait
that a hang would."""

from __future__ import annotations

import threading
import time
from collections.abc import Callable

from statebackend.testing.deadline import load_factor, scaled

__all__ = ["drain_appliers", "load_factor", "scaled", "wait_until"]


def wait_until(condition: Callable[[], object], timeout: float = 30.0) -> None:
    """Poll ``condition`` every 10 ms until it is true; fail the test when ``scaled(timeout)`` seconds pass first."""
    timeout = scaled(timeout)
    deadline = time.monotonic() + timeout
    while not condition():
        assert time.monotonic() < deadline, f"condition not reached in {timeout:.0f} s"
        time.sleep(0.01)


def drain_appliers(timeout: float = 30.0) -> None:
    """Return once every apply submitted to the process's applier threads before this call has ended: one job per
    thread that waits at a barrier with this thread. The pool takes jobs in order and a thread takes a job only after
    its previous one, so when every thread is at the barrier, every earlier job is done."""
    from statebackend.store.applier import APPLIER_THREADS, _applier_pool

    timeout = scaled(timeout)
    barrier = threading.Barrier(APPLIER_THREADS + 1)
    for _ in range(APPLIER_THREADS):
        _applier_pool().submit(barrier.wait, timeout)
    barrier.wait(timeout)
