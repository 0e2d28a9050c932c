"""Crash points for the crash tests: named places in the commit protocol where a test can make the process die.

``crashpoint(name)`` does nothing unless the environment variable ``STATEBACKEND_CRASH_AT`` is set to
``<name>[:<nth>]`` when this module is first imported; then the ``nth`` time (default 1) the process reaches
``crashpoint(name)`` it sends itself SIGKILL: no ``finally`` blocks, no atexit handlers, no flushing of Python
buffers, exactly like a machine losing the process. Reading the variable once keeps the cost of an unset hook to one
comparison; a crash test sets it in the environment of the child process it starts.

Private to the project (underscore): the names are listed in tests/test_crash.py, which is their documentation.
"""

from __future__ import annotations

import os
import signal
import threading

__all__ = ["ENV_VAR", "crashpoint"]

ENV_VAR = "STATEBACKEND_CRASH_AT"


def _parse(spec: str | None) -> tuple[str | None, int]:
    if not spec:
        return None, 0
    name, _, nth = spec.partition(":")
    try:
        count = int(nth) if nth else 1
    except ValueError:
        raise ValueError(f"{ENV_VAR}={spec!r}: expected <crash point name>[:<nth hit, an integer >= 1>]") from None
    if count < 1:
        raise ValueError(f"{ENV_VAR}={spec!r}: the hit number must be >= 1")
    return name, count


_target, _nth = _parse(os.environ.get(ENV_VAR))
_hits = 0
_lock = threading.Lock()


def crashpoint(name: str) -> None:
    """Die by SIGKILL here if ``STATEBACKEND_CRASH_AT`` names this point and this is its chosen hit."""
    global _hits
    if _target != name:
        return
    with _lock:
        _hits += 1
        fire = _hits == _nth
    if fire:
        os.kill(os.getpid(), signal.SIGKILL)
