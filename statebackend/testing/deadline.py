"""A per-test deadline for the contract suites that needs no plugin: a backend or blob store that hangs fails its
test instead of hanging the run.

``statebackend[testing]`` needs only pytest and hypothesis, so the suites cannot count on pytest-timeout. The
deadline is an interval timer (``SIGALRM``) whose handler fails the test with :func:`pytest.fail`, naming the test
and showing where every other thread stands; a wait in the test's thread (a future's ``result()``, an event, a lock)
is interrupted by it. When the timer cannot be used (no ``SIGALRM``, or a test run outside the main thread) and as a
backstop when the test's thread is stuck in C code that never returns to Python, :mod:`faulthandler` dumps every
thread's stack and ends the process: the run fails, it does not hang. Once passed, the deadline fires again every
:data:`REPEAT_S` seconds until the block ends, so a teardown stuck on the same hung work (a close waiting for the
upload) is interrupted as well. The timer fails a test only inside one of its phases (setup, call, teardown): one
that fires while pytest writes a report between them waits for the next repeat, since failing there would end the
session.

An interval timer pytest-timeout (or anything else) armed is put back afterwards with the time it had left.

:func:`scaled` stretches a bound that holds on an idle machine by how loaded the machine is now (:func:`load_factor`):
the suites pass their deadlines and hang guards through it, so a machine busy with other work makes a test slower,
never a failure.
"""

from __future__ import annotations

import faulthandler
import os
import signal
import sys
import threading
import time
import traceback
from collections.abc import Iterator
from contextlib import contextmanager
from types import FrameType

import pytest

__all__ = ["BACKSTOP_S", "REPEAT_S", "deadline", "load_factor", "scaled"]

#: seconds past the deadline after which the backstop ends a process whose test never came back to Python
BACKSTOP_S = 60.0
#: once the deadline passed, the test's thread is interrupted again every this many seconds until the block ends
REPEAT_S = 2.0


def load_factor() -> float:
    """How many times slower than on an idle machine work runs now, at least 1: the 1-minute load average per CPU
    (1 where the platform has no load average)."""
    try:
        load = os.getloadavg()[0]
    except (AttributeError, OSError):
        return 1.0
    return max(1.0, load / (os.cpu_count() or 1))


def scaled(seconds: float) -> float:
    """``seconds``, a bound that holds on an idle machine, times :func:`load_factor`: the bound of a wait that only
    guards a hang, so a loaded machine does not trip it. ``seconds <= 0`` (no bound) stays as it is."""
    return seconds * load_factor() if seconds > 0 else seconds


@contextmanager
def deadline(seconds: float, what: str) -> Iterator[None]:
    """Fail ``what`` (a test's name) with :func:`pytest.fail` when the block runs longer than ``seconds``;
    ``seconds <= 0`` sets no deadline."""
    if seconds <= 0:
        yield
        return
    faulthandler.dump_traceback_later(seconds + BACKSTOP_S, exit=True)
    try:
        if hasattr(signal, "SIGALRM") and threading.current_thread() is threading.main_thread():
            with _alarm(seconds, what):
                yield
        else:
            yield
    finally:
        faulthandler.cancel_dump_traceback_later()


@contextmanager
def _alarm(seconds: float, what: str) -> Iterator[None]:
    def expired(signum: int, frame: FrameType | None) -> None:
        if not _in_a_test_phase(frame):
            return  # pytest is between phases (writing a report): failing there ends the session; fires again soon
        pytest.fail(
            f"{what} did not finish within {seconds:g} s, the contract suite's per-test deadline (the class "
            f"attribute test_timeout_s): the backend or blob store under test hangs, or waits on something that "
            f"never comes.\nThe other threads:\n{_other_stacks()}",
            pytrace=True,
        )

    previous_handler = signal.signal(signal.SIGALRM, expired)
    # fires again every REPEAT_S: a teardown that waits on the same hung work (a close waiting for the upload) is
    # interrupted too, until the block ends
    previous_delay, previous_interval = signal.setitimer(signal.ITIMER_REAL, seconds, REPEAT_S)
    started = time.monotonic()
    try:
        yield
    finally:
        signal.setitimer(signal.ITIMER_REAL, 0)
        signal.signal(signal.SIGALRM, previous_handler)
        if previous_delay > 0:  # someone else's timer (pytest-timeout): give it back what it had left
            left = previous_delay - (time.monotonic() - started)
            signal.setitimer(signal.ITIMER_REAL, max(left, 0.001), previous_interval)


def _in_a_test_phase(frame: FrameType | None) -> bool:
    """Whether ``frame`` runs inside a test's setup, call or teardown (under pytest's ``CallInfo.from_call``), where
    pytest makes an exception that test's failure. Between the phases pytest writes its reports: an exception there
    is an INTERNALERROR that ends the whole session, and the later tests never run."""
    runner = os.path.join("_pytest", "runner.py")
    while frame is not None:
        code = frame.f_code
        if code.co_name == "from_call" and code.co_filename.endswith(runner):
            return True
        frame = frame.f_back
    return False


def _other_stacks() -> str:
    names = {thread.ident: thread.name for thread in threading.enumerate()}
    me = threading.get_ident()
    parts = []
    for ident, frame in sys._current_frames().items():
        if ident == me:
            continue
        stack = "".join(traceback.format_stack(frame)[-8:])
        parts.append(f"--- thread {names.get(ident, ident)}:\n{stack}")
    return "\n".join(parts) or "(none)"
