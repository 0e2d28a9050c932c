"""Metrics per commit and per restore: plain counters and timing samples, thread-safe.

A :class:`Metrics` is a registry of named counters and sample lists; ``snapshot()`` gives a plain dict a job can log
or export. Timings are kept as samples so callers can read p50/p95 without a metrics library.
"""

from __future__ import annotations

import threading
from collections import defaultdict
from typing import Any

import attrs

__all__ = ["Metrics", "percentile"]


def percentile(samples: list[float], fraction: float) -> float:
    """The nearest-rank percentile of ``samples`` (``fraction`` in [0, 1]); 0.0 for no samples."""
    if not samples:
        return 0.0
    ordered = sorted(samples)
    rank = max(0, min(len(ordered) - 1, round(fraction * len(ordered) + 0.5) - 1))
    return ordered[rank]


@attrs.define(eq=False)
class Metrics:
    """Named counters (``increment``) and timing or size samples (``record``). Thread-safe."""

    max_samples: int = 10_000
    _counters: dict[str, float] = attrs.field(init=False, factory=lambda: defaultdict(float))
    _samples: dict[str, list[float]] = attrs.field(init=False, factory=lambda: defaultdict(list))
    _lock: threading.Lock = attrs.field(init=False, factory=threading.Lock)

    def increment(self, name: str, amount: float = 1) -> None:
        with self._lock:
            self._counters[name] += amount

    def record(self, name: str, value: float) -> None:
        with self._lock:
            samples = self._samples[name]
            samples.append(value)
            if len(samples) > self.max_samples:
                del samples[: len(samples) - self.max_samples]

    def counter(self, name: str) -> float:
        with self._lock:
            return self._counters.get(name, 0)

    def samples(self, name: str) -> list[float]:
        with self._lock:
            return list(self._samples.get(name, ()))

    def snapshot(self) -> dict[str, Any]:
        """Counters as numbers; samples as count, p50, p95, max."""
        with self._lock:
            out: dict[str, Any] = dict(self._counters)
            for name, samples in self._samples.items():
                out[name] = {
                    "count": len(samples),
                    "p50": percentile(samples, 0.50),
                    "p95": percentile(samples, 0.95),
                    "max": max(samples) if samples else 0.0,
                }
            return out
