"""Metrics per task: labelled counters and mergeable histograms, thread-safe, exported through standards.

A :class:`Metrics` is what a :class:`~statebackend.task.TaskStorage` and its backends count into
(``increment``/``record``, a name from :mod:`statebackend.metrics.catalogue` and optional labels). It is recorded per
commit, per restore step and per blob-store request, never per key: one lock and a dict update each.

- Histograms have fixed bucket bounds per metric (the catalogue), so histograms of many tasks, processes or Spark
  batches merge exactly by adding counts: :meth:`Metrics.export` gives a picklable :class:`MetricsSnapshot` that
  merges with others (the Spark driver's per-batch aggregate is such a merge: :meth:`Metrics.merge_batch`, which
  keeps each task's series apart). The most recent values are kept too, for :meth:`Metrics.samples` and the p50/p95
  of :meth:`Metrics.snapshot`.
- OpenTelemetry: a :class:`Metrics` built with an OpenTelemetry sink (:mod:`statebackend.metrics.otel`) mirrors every
  count into the OpenTelemetry metrics API (a no-op until the application installs an SDK).
- Prometheus: :mod:`statebackend.metrics.prometheus` renders snapshots in the text exposition format, serves them over
  HTTP and writes them as textfiles or pushes them.
"""

from __future__ import annotations

import bisect
import math
import threading
from collections import deque
from collections.abc import Iterable, Mapping
from typing import Any, Protocol

import attrs

from statebackend.metrics.catalogue import CATALOGUE, HISTOGRAM, MetricSpec, spec_for

__all__ = ["CATALOGUE", "HistogramData", "MetricSpec", "Metrics", "MetricsSink", "MetricsSnapshot", "percentile"]

#: a series' labels, sorted by name
Labels = tuple[tuple[str, str], ...]
#: (metric name, labels)
SeriesKey = tuple[str, Labels]


def percentile(samples: list[float], fraction: float) -> float:
    """The nearest-rank percentile of ``samples`` (``fraction`` in [0, 1]); 0.0 for no samples."""
    if not samples:
        return 0.0
    ordered = sorted(samples)
    rank = max(0, min(len(ordered) - 1, round(fraction * len(ordered) + 0.5) - 1))
    return ordered[rank]


@attrs.define(eq=False)
class HistogramData:
    """A histogram with fixed bucket bounds: ``counts[i]`` values fell in ``(bounds[i-1], bounds[i]]``, the last
    count above every bound (+Inf). Merges exactly with any histogram of the same bounds."""

    #: the upper bounds of the buckets, ascending (the metric's, from the catalogue)
    bounds: tuple[float, ...]
    #: the number of values per bucket: one more than ``bounds`` (the last is above every bound)
    counts: list[int]
    #: the number of values added
    count: int = 0
    #: their sum
    sum: float = 0.0
    #: the smallest value added (``inf`` while empty)
    min: float = math.inf
    #: the largest value added (``-inf`` while empty)
    max: float = -math.inf

    @classmethod
    def empty(cls, bounds: tuple[float, ...]) -> HistogramData:
        """A histogram with these bucket bounds and no values."""
        return cls(bounds, [0] * (len(bounds) + 1))

    def add(self, value: float) -> None:
        """Count ``value`` into its bucket (the first whose bound is at least ``value``)."""
        self.counts[bisect.bisect_left(self.bounds, value)] += 1
        self.count += 1
        self.sum += value
        self.min = min(self.min, value)
        self.max = max(self.max, value)

    def merge(self, other: HistogramData) -> None:
        """Add ``other``'s values into this histogram (exact: bucket counts add). Raises ``ValueError`` when the
        bucket bounds differ."""
        if other.bounds != self.bounds:
            raise ValueError(f"cannot merge histograms with different bucket bounds: {self.bounds} and {other.bounds}")
        for i, n in enumerate(other.counts):
            self.counts[i] += n
        self.count += other.count
        self.sum += other.sum
        self.min = min(self.min, other.min)
        self.max = max(self.max, other.max)

    def copy(self) -> HistogramData:
        """An independent copy (its counts are a new list)."""
        return HistogramData(self.bounds, list(self.counts), self.count, self.sum, self.min, self.max)

    def quantile(self, fraction: float) -> float:
        """An estimate of the ``fraction`` quantile from the buckets (linear within the bucket, clamped to the
        observed min and max); 0.0 when empty."""
        if self.count == 0:
            return 0.0
        rank = fraction * self.count
        seen = 0
        for i, n in enumerate(self.counts):
            if n and seen + n >= rank:
                low = self.bounds[i - 1] if i > 0 else min(self.min, self.bounds[0] if self.bounds else self.min)
                high = self.bounds[i] if i < len(self.bounds) else self.max
                low, high = max(low, self.min), min(high, self.max)
                return low + (high - low) * max(0.0, min(1.0, (rank - seen) / n))
            seen += n
        return self.max

    def to_dict(self) -> dict[str, Any]:
        """Plain, JSON-friendly: count, sum, min, max (0.0 while empty), p50 and p95 estimated from the buckets, and
        the count per bucket by its bound (``"+Inf"`` for the last)."""
        return {
            "count": self.count,
            "sum": self.sum,
            "min": self.min if self.count else 0.0,
            "max": self.max if self.count else 0.0,
            "p50": self.quantile(0.5),
            "p95": self.quantile(0.95),
            "buckets": {("+Inf" if i == len(self.bounds) else self.bounds[i]): n for i, n in enumerate(self.counts)},
        }


def _matches(labels: Labels, wanted: Mapping[str, str]) -> bool:
    if not wanted:
        return True
    have = dict(labels)
    return all(have.get(k) == v for k, v in wanted.items())


def _key(name: str, labels: Mapping[str, str]) -> SeriesKey:
    return (name, tuple(sorted(labels.items()))) if labels else (name, ())


@attrs.define(eq=False)
class MetricsSnapshot:
    """Counters and histograms at one moment, by (name, labels); picklable, mergeable (counters add, histograms add
    bucket counts). What a Spark task hands to the driver and what the exporters render."""

    #: every counter's value by (name, labels)
    counters: dict[SeriesKey, float] = attrs.field(factory=dict)
    #: every histogram by (name, labels)
    histograms: dict[SeriesKey, HistogramData] = attrs.field(factory=dict)

    def merge(self, other: MetricsSnapshot) -> MetricsSnapshot:
        """Add ``other`` into this snapshot; returns it."""
        for key, value in other.counters.items():
            self.counters[key] = self.counters.get(key, 0) + value
        for key, histogram in other.histograms.items():
            mine = self.histograms.get(key)
            if mine is None:
                self.histograms[key] = histogram.copy()
            else:
                mine.merge(histogram)
        return self

    @classmethod
    def merged(cls, snapshots: Iterable[MetricsSnapshot]) -> MetricsSnapshot:
        """A new snapshot, the merge of ``snapshots`` (which are left as they were)."""
        total = cls()
        for snapshot in snapshots:
            total.merge(snapshot)
        return total

    def relabel(self, drop: Iterable[str] = (), **labels: str) -> MetricsSnapshot:
        """A copy with the labels in ``drop`` removed (series that then coincide are merged) and ``labels`` set."""
        dropped = set(drop) | set(labels)
        out = MetricsSnapshot()

        def key(old: SeriesKey) -> SeriesKey:
            kept = {k: v for k, v in old[1] if k not in dropped}
            kept.update(labels)
            return _key(old[0], kept)

        for old, value in self.counters.items():
            new = key(old)
            out.counters[new] = out.counters.get(new, 0) + value
        for old, histogram in self.histograms.items():
            new = key(old)
            if new in out.histograms:
                out.histograms[new].merge(histogram)
            else:
                out.histograms[new] = histogram.copy()
        return out

    def counter(self, name: str, **labels: str) -> float:
        """The sum of the counters ``name`` whose labels include ``labels``."""
        return sum(v for (n, ls), v in self.counters.items() if n == name and _matches(ls, labels))

    def histogram(self, name: str, **labels: str) -> HistogramData | None:
        """The merge of the histograms ``name`` whose labels include ``labels`` (``None``: none)."""
        found = [h for (n, ls), h in self.histograms.items() if n == name and _matches(ls, labels)]
        if not found:
            return None
        total = found[0].copy()
        for histogram in found[1:]:
            total.merge(histogram)
        return total

    def to_dict(self) -> dict[str, Any]:
        """Plain, JSON-friendly: ``name`` or ``name{label=value,...}`` -> a number (counters) or a dict (histograms:
        count, sum, min, max, p50, p95 estimated from the buckets, buckets)."""
        out: dict[str, Any] = {_display(k): v for k, v in sorted(self.counters.items())}
        out.update({_display(k): h.to_dict() for k, h in sorted(self.histograms.items())})
        return out


def _display(key: SeriesKey) -> str:
    name, labels = key
    return name if not labels else name + "{" + ",".join(f"{k}={v}" for k, v in labels) + "}"


class MetricsSink(Protocol):
    """Where a :class:`Metrics` mirrors each count as it happens (the OpenTelemetry bridge)."""

    def add(self, name: str, amount: float, labels: Mapping[str, str]) -> None: ...

    def record(self, name: str, value: float, labels: Mapping[str, str]) -> None: ...


@attrs.define(eq=False)
class Metrics:
    """Named counters (``increment``) and histograms (``record``), with optional labels per series. Thread-safe.

    ``labels`` are the constant labels of every series (``job_name``, ``task``), added when exported; queries
    (``counter``, ``samples``) ignore them. ``sink`` receives every count as it happens (OpenTelemetry).
    ``max_samples``: the most recent values kept per histogram for :meth:`samples` and the percentiles of
    :meth:`snapshot`.
    """

    #: the most recent values kept per histogram series, for :meth:`samples` and the percentiles of :meth:`snapshot`
    max_samples: int = 10_000
    #: the constant labels of every series (``job_name``, ``task``), added when exported
    labels: Mapping[str, str] = attrs.field(factory=dict, kw_only=True)
    #: where every count is mirrored as it happens (the OpenTelemetry bridge); ``None``: nowhere
    sink: MetricsSink | None = attrs.field(default=None, kw_only=True)
    _counters: dict[SeriesKey, float] = attrs.field(init=False, factory=dict)
    _histograms: dict[SeriesKey, HistogramData] = attrs.field(init=False, factory=dict)
    _samples: dict[SeriesKey, deque[float]] = attrs.field(init=False, factory=dict)
    _lock: threading.Lock = attrs.field(init=False, factory=threading.Lock)

    def increment(self, name: str, amount: float = 1, /, **labels: str) -> None:
        """Add ``amount`` to the counter ``name`` of the series ``labels`` (e.g. ``store=``, ``backend=``). Any
        thread; one lock and a dict update. ``name`` is one of the catalogue's counters
        (:mod:`statebackend.metrics.catalogue`); a name not in it is counted all the same and exported under a
        generic description (a third-party backend's own metric)."""
        key = _key(name, labels)
        with self._lock:
            self._counters[key] = self._counters.get(key, 0) + amount
        if self.sink is not None:
            self.sink.add(name, amount, labels)

    def record(self, name: str, value: float, /, **labels: str) -> None:
        """Record ``value`` (milliseconds, bytes, a count: the catalogue gives the unit) into the histogram ``name``
        of the series ``labels``, in the catalogue's bucket bounds for ``name`` (generic ones for a name not in it).
        Any thread; one lock, a bucket and a sample kept (:attr:`max_samples`)."""
        key = _key(name, labels)
        with self._lock:
            histogram = self._histograms.get(key)
            if histogram is None:
                histogram = self._histograms[key] = HistogramData.empty(spec_for(name, HISTOGRAM).buckets)
                self._samples[key] = deque(maxlen=self.max_samples)
            histogram.add(value)
            self._samples[key].append(value)
        if self.sink is not None:
            self.sink.record(name, value, labels)

    def counter(self, name: str, **labels: str) -> float:
        """The sum of the counters ``name`` whose labels include ``labels`` (all of them when none is given)."""
        with self._lock:
            return sum(v for (n, ls), v in self._counters.items() if n == name and _matches(ls, labels))

    def samples(self, name: str, **labels: str) -> list[float]:
        """The most recent values recorded under ``name`` (of the series whose labels include ``labels``)."""
        with self._lock:
            return [v for (n, ls), vs in self._samples.items() if n == name and _matches(ls, labels) for v in vs]

    def histogram(self, name: str, **labels: str) -> HistogramData | None:
        """The merge of the histograms ``name`` whose labels include ``labels``, with the constant labels
        (``None``: nothing recorded)."""
        return self.export().histogram(name, **labels)

    def export(self) -> MetricsSnapshot:
        """A mergeable copy of every series, with the constant labels added."""
        with self._lock:
            counters = dict(self._counters)
            histograms = {key: h.copy() for key, h in self._histograms.items()}
        snapshot = MetricsSnapshot(counters, histograms)
        return snapshot.relabel(**self.labels) if self.labels else snapshot

    def merge(self, snapshot: MetricsSnapshot) -> None:
        """Add a snapshot's series into this registry as they are (their labels kept); the sink is not told."""
        with self._lock:
            for key, value in snapshot.counters.items():
                self._counters[key] = self._counters.get(key, 0) + value
            for key, histogram in snapshot.histograms.items():
                mine = self._histograms.get(key)
                if mine is None:
                    self._histograms[key] = histogram.copy()
                    self._samples[key] = deque(maxlen=self.max_samples)
                else:
                    mine.merge(histogram)

    def merge_batch(
        self,
        snapshots: Iterable[MetricsSnapshot | None],
        *,
        batch_ms: float | None = None,
        job_name: str | None = None,
    ) -> MetricsSnapshot:
        """Add the snapshots the tasks of one batch handed back (``TaskStats.metrics``; ``None``: a task whose
        statistics did not come back) into this registry, each series keeping its labels: ``job_name`` and ``task``
        (every task's registry carries them: :func:`statebackend.exporters.task_metrics`), ``store`` and
        ``backend``, ``operation``... So an endpoint serving this registry has one series per task (and store), and
        job-wide totals are a ``sum`` in the query; no ``task="all"`` series is added, since a ``sum()`` over the
        task label would then count everything twice. ``batch_ms``: the batch's wall time, recorded as
        ``spark.batch.ms`` (labelled ``job_name`` when given). Returns the batch's merge (labels kept): its
        ``counter(name)`` and ``histogram(name)`` are the batch's job-wide totals, ``relabel(drop=["task"])`` a
        job-wide snapshot."""
        batch = MetricsSnapshot()
        for snapshot in snapshots:
            if snapshot is None:
                continue
            if not isinstance(snapshot, MetricsSnapshot):
                raise TypeError(
                    f"Metrics.merge_batch takes the tasks' MetricsSnapshot (or None), got {type(snapshot).__name__}"
                )
            batch.merge(snapshot)
        self.merge(batch)
        if batch_ms is not None:
            labels = {"job_name": job_name} if job_name is not None else {}
            self.record("spark.batch.ms", batch_ms, **labels)
        return batch

    def __reduce__(self) -> tuple[Any, ...]:
        """Pickles with its series (a Spark Connect server receives the driver's callable pickled); the sink does
        not travel: it mirrors into the process it was made in."""
        with self._lock:
            state = (
                dict(self._counters),
                {k: h.copy() for k, h in self._histograms.items()},
                {k: list(v) for k, v in self._samples.items()},
            )
        return (_rebuilt, (self.max_samples, dict(self.labels), *state))

    def snapshot(self) -> dict[str, Any]:
        """Counters as numbers; histograms as count, sum, p50, p95, max (percentiles of the most recent values).
        A labelled series is keyed ``name{label=value,...}``."""
        with self._lock:
            out: dict[str, Any] = {_display(k): v for k, v in self._counters.items()}
            for key, histogram in self._histograms.items():
                samples = list(self._samples.get(key) or ())
                out[_display(key)] = {
                    "count": histogram.count,
                    "sum": histogram.sum,
                    "p50": percentile(samples, 0.50) if samples else histogram.quantile(0.50),
                    "p95": percentile(samples, 0.95) if samples else histogram.quantile(0.95),
                    "max": histogram.max if histogram.count else 0.0,
                }
            return out


def _rebuilt(
    max_samples: int,
    labels: dict[str, str],
    counters: dict[SeriesKey, float],
    histograms: dict[SeriesKey, HistogramData],
    samples: dict[SeriesKey, list[float]],
) -> Metrics:
    metrics = Metrics(max_samples, labels=labels)
    metrics._counters.update(counters)
    metrics._histograms.update(histograms)
    metrics._samples.update({k: deque(v, maxlen=max_samples) for k, v in samples.items()})
    return metrics
