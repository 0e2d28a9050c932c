"""Checkpoint ids: Samza-compatible, totally ordered, strictly increasing per task.

A :class:`CheckpointId` is ``(millis, nanos)`` with ``nanos`` in ``[0, 1_000_000)``. Its string form is Samza's
``"<millis>-<nanos>"`` (no padding), which :meth:`CheckpointId.parse` reads back exactly. Ids order by
``(millis, nanos)``; :meth:`CheckpointId.sortable` gives a zero-padded form whose lexicographic order is the id order
(for blob names and file names).

:class:`CheckpointIdGenerator` issues ids from a nanosecond clock. The ids it issues MUST be strictly increasing, also
when the wall clock steps back (NTP, VM migration) and after a restore (``observe`` the restored id first): when the
clock gives an id that is not greater than the last one, the next id is the last one plus one nano-unit.
"""

from __future__ import annotations

import re
import threading
import time
from collections.abc import Callable

import attrs

from statebackend.errors import ConfigError

__all__ = ["NANOS_PER_MILLI", "CheckpointId", "CheckpointIdGenerator"]

#: ``nanos`` is the clock's nanoseconds modulo this (Samza: ``System.nanoTime() % 1_000_000``)
NANOS_PER_MILLI = 1_000_000

# Strict: digits only, no sign, no spaces; leading zeros are allowed so sortable() output parses too.
_ID_RE = re.compile(r"^([0-9]{1,19})-([0-9]{1,6})$")


def _check_millis(instance: object, attribute: attrs.Attribute[int], value: int) -> None:
    if type(value) is not int or value < 0:
        raise ConfigError(f"checkpoint id millis must be a non-negative int, got {value!r}")


def _check_nanos(instance: object, attribute: attrs.Attribute[int], value: int) -> None:
    if type(value) is not int or not 0 <= value < NANOS_PER_MILLI:
        raise ConfigError(f"checkpoint id nanos must be an int in [0, {NANOS_PER_MILLI}), got {value!r}")


@attrs.frozen(order=True)
class CheckpointId:
    """A checkpoint's id: wall-clock milliseconds and a sub-millisecond part. Ordered by ``(millis, nanos)``."""

    millis: int = attrs.field(validator=_check_millis)
    nanos: int = attrs.field(validator=_check_nanos)

    @classmethod
    def parse(cls, text: str) -> CheckpointId:
        """Read the Samza form ``"<millis>-<nanos>"``; a malformed string raises :class:`ConfigError`."""
        match = _ID_RE.match(text) if isinstance(text, str) else None
        if match is None:
            raise ConfigError(
                f"checkpoint id {text!r} is not of the form '<millis>-<nanos>' "
                f"(two non-negative integers, nanos below {NANOS_PER_MILLI}), e.g. '1700000000000-123456'"
            )
        return cls(int(match.group(1)), int(match.group(2)))

    @classmethod
    def from_ns(cls, ns: int) -> CheckpointId:
        """The id for a nanosecond timestamp (``time.time_ns()``)."""
        return cls(ns // NANOS_PER_MILLI, ns % NANOS_PER_MILLI)

    def successor(self) -> CheckpointId:
        """The smallest id greater than this one."""
        if self.nanos + 1 < NANOS_PER_MILLI:
            return CheckpointId(self.millis, self.nanos + 1)
        return CheckpointId(self.millis + 1, 0)

    def sortable(self) -> str:
        """Zero-padded form whose lexicographic order equals the id order."""
        return f"{self.millis:015d}-{self.nanos:06d}"

    def __str__(self) -> str:
        return f"{self.millis}-{self.nanos}"


@attrs.define(eq=False)
class CheckpointIdGenerator:
    """Issues strictly increasing checkpoint ids from a clock. Thread-safe.

    ``clock_ns`` returns nanoseconds since the epoch; tests pass a fake clock that steps back.
    """

    clock_ns: Callable[[], int] = time.time_ns
    _last: CheckpointId | None = attrs.field(init=False, default=None)
    _lock: threading.Lock = attrs.field(init=False, factory=threading.Lock)

    def next(self) -> CheckpointId:
        """A new id, greater than every id issued or observed before."""
        candidate = CheckpointId.from_ns(self.clock_ns())
        with self._lock:
            if self._last is not None and candidate <= self._last:
                # The clock stepped back or ran too slowly: keep the order, let the clock catch up.
                candidate = self._last.successor()
            self._last = candidate
            return candidate

    def observe(self, checkpoint_id: CheckpointId) -> None:
        """Make every later id greater than ``checkpoint_id`` (call with the restored checkpoint's id)."""
        if not isinstance(checkpoint_id, CheckpointId):
            raise TypeError(f"observe() needs a CheckpointId, got {type(checkpoint_id).__name__}")
        with self._lock:
            if self._last is None or checkpoint_id > self._last:
                self._last = checkpoint_id

    @property
    def last(self) -> CheckpointId | None:
        """The greatest id issued or observed so far, or None."""
        with self._lock:
            return self._last
