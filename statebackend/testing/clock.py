"""A clock a test sets: the batch clock of :class:`~statebackend.spark.StatefulForeachBatch` (``clock=``), which TTL
stores and processing-time timers read, so a test moves time by assignment instead of sleeping or patching.

``clock = ManualClock(1_000)``, ``StatefulForeachBatch(..., clock=clock)``, then ``clock.now_ms = 5_000`` (or
``clock.advance(4_000)``) before the next batch: that batch's ``stores.now_ms`` is 5000, keys written at 1000 with a
``ttl.ms`` of 4000 are expired, and processing-time timers at or before 5000 fire. A task never goes below the clock
of the checkpoint it starts from (a replay keeps the clock its first run recorded), as with the wall clock.
"""

from __future__ import annotations

import datetime
import threading

from statebackend.errors import ConfigError

__all__ = ["ManualClock"]


class ManualClock:
    """ms since the epoch, as set: a callable ``() -> int`` like ``statebackend.store.ttl.wall_clock_ms``. Thread
    safe; it never moves by itself."""

    def __init__(self, now_ms: int | datetime.datetime = 0) -> None:
        self._lock = threading.Lock()
        self._now = self._ms(now_ms)

    def __call__(self) -> int:
        with self._lock:
            return self._now

    def __repr__(self) -> str:
        return f"ManualClock(now_ms={self()})"

    @property
    def now_ms(self) -> int:
        """The time the clock shows, ms since the epoch."""
        return self()

    @now_ms.setter
    def now_ms(self, value: int | datetime.datetime) -> None:
        ms = self._ms(value)
        with self._lock:
            self._now = ms

    def advance(self, ms: int | datetime.timedelta) -> int:
        """Move the clock forward by ``ms`` (an int of ms >= 0, or a timedelta); the new time."""
        if isinstance(ms, datetime.timedelta):
            ms = int(ms / datetime.timedelta(milliseconds=1))
        if type(ms) is not int or ms < 0:
            raise ConfigError(f"ManualClock.advance takes ms >= 0 (an int) or a timedelta, got {ms!r}")
        with self._lock:
            self._now += ms
            return self._now

    @staticmethod
    def _ms(value: int | datetime.datetime) -> int:
        if isinstance(value, datetime.datetime):
            if value.tzinfo is None:
                raise ConfigError(f"ManualClock takes an aware datetime (its instant), got the naive {value!r}")
            return int(value.timestamp() * 1000)
        if type(value) is not int:
            raise ConfigError(
                f"ManualClock time must be ms since the epoch (an int) or an aware datetime, got {value!r}"
            )
        return value
