"""The OpenTelemetry bridge: every count of a :class:`~statebackend.metrics.Metrics` is mirrored into the
OpenTelemetry metrics API as it happens.

The instruments are ``statebackend.<name>`` on the meter ``statebackend``: a Counter for each counter, a Histogram for
each histogram, with the catalogue's unit and description and its bucket bounds as the
``explicit_bucket_boundaries_advisory`` (so an SDK's histograms use the same fixed, mergeable buckets as statebackend's
own). Every data point carries ``job_name`` and ``task``, plus the metric's own labels (``operation``, ``outcome``).

Only the API is used (``pip install 'statebackend[otel]'``): without an SDK it is a no-op, and an application that
installs an SDK ``MeterProvider`` (globally, or for statebackend alone with :func:`set_meter_provider`) receives the
metrics with whatever exporter it configured (OTLP, Prometheus, ...). Without the package, :func:`otel_sink` returns
``None`` and nothing is mirrored.
"""

from __future__ import annotations

import importlib.util
import threading
from collections.abc import Mapping
from typing import Any

from statebackend.metrics.catalogue import COUNTER, HISTOGRAM, spec_for

__all__ = ["OtelSink", "otel_available", "otel_sink", "set_meter_provider"]

_VERSION = "0.1.0"
_lock = threading.Lock()
_provider: Any = None  # statebackend's own provider (set_meter_provider), else the global one
_bridges: dict[int, _Bridge] = {}


def otel_available() -> bool:
    """Whether the OpenTelemetry metrics API is installed."""
    try:
        return importlib.util.find_spec("opentelemetry.metrics") is not None
    except ModuleNotFoundError:
        return False


def set_meter_provider(provider: Any) -> None:
    """Send statebackend's metrics to ``provider`` (an OpenTelemetry ``MeterProvider``) instead of the global one;
    ``None`` goes back to the global provider. Affects the :class:`Metrics` created afterwards."""
    global _provider
    with _lock:
        _provider = provider


class _Bridge:
    """The instruments of one meter, created on first use."""

    def __init__(self, meter: Any, provider: Any) -> None:
        self.meter = meter
        self.provider = provider
        self.instruments: dict[str, Any] = {}
        self.lock = threading.Lock()

    def instrument(self, name: str, kind: str) -> Any:
        found = self.instruments.get(name)
        if found is not None:
            return found
        with self.lock:
            found = self.instruments.get(name)
            if found is None:
                spec = spec_for(name, kind)
                if spec.kind == COUNTER:
                    found = self.meter.create_counter(f"statebackend.{name}", unit=spec.unit, description=spec.help)
                else:
                    found = self.meter.create_histogram(
                        f"statebackend.{name}",
                        unit=spec.unit,
                        description=spec.help,
                        explicit_bucket_boundaries_advisory=list(spec.buckets),
                    )
                self.instruments[name] = found
        return found


class OtelSink:
    """A :class:`~statebackend.metrics.MetricsSink` that mirrors counts into OpenTelemetry instruments, with the
    constant attributes of its task."""

    def __init__(self, bridge: _Bridge, attributes: Mapping[str, str]) -> None:
        self._bridge = bridge
        self._attributes = dict(attributes)

    def add(self, name: str, amount: float, labels: Mapping[str, str]) -> None:
        attributes = {**self._attributes, **labels} if labels else self._attributes
        self._bridge.instrument(name, COUNTER).add(amount, attributes)

    def record(self, name: str, value: float, labels: Mapping[str, str]) -> None:
        attributes = {**self._attributes, **labels} if labels else self._attributes
        self._bridge.instrument(name, HISTOGRAM).record(value, attributes)


def otel_sink(attributes: Mapping[str, str]) -> OtelSink | None:
    """A sink into the current provider's ``statebackend`` meter, or ``None`` when OpenTelemetry is not installed."""
    if not otel_available():
        return None
    from opentelemetry import metrics as otel_metrics

    with _lock:
        provider = _provider
        key = id(provider) if provider is not None else 0
        bridge = _bridges.get(key)
        if bridge is None or bridge.provider is not provider:
            meter = (
                provider.get_meter("statebackend", _VERSION)
                if provider is not None
                else otel_metrics.get_meter("statebackend", _VERSION)
            )
            bridge = _bridges[key] = _Bridge(meter, provider)
    return OtelSink(bridge, attributes)
