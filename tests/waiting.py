"""Waiting in tests for what background threads do: a condition polled until true, failing the test after a bound."""

from __future__ import annotations

import time
from collections.abc import Callable


def wait_until(condition: Callable[[], object], timeout: float = 30.0) -> None:
    """Poll ``condition`` every 10 ms until it is true; fail the test when ``timeout`` seconds pass first."""
    deadline = time.monotonic() + timeout
    while not condition():
        assert time.monotonic() < deadline, "condition not reached in time"
        time.sleep(0.01)
