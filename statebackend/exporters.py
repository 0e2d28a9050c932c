"""A task's metrics leaving the process: a fresh registry per open (mirrored into OpenTelemetry), the Prometheus
endpoint, textfile and push gateway. Never fails a task: an exporter that cannot bind, write or push is logged."""

from __future__ import annotations

import logging

from statebackend.config import Settings
from statebackend.metrics import Metrics
from statebackend.metrics import prometheus as prom
from statebackend.metrics.otel import otel_sink
from statebackend.redact import redact

__all__ = ["export_now", "export_on_close", "start_exporters", "task_metrics"]

log = logging.getLogger(__name__)


def task_metrics(settings: Settings, task_name: str) -> Metrics:
    """A fresh registry for one open of a task: labelled ``job_name`` and ``task``, mirrored into OpenTelemetry
    unless ``metrics.otel=off`` (a no-op when the API is not installed or no SDK is)."""
    labels = {"job_name": settings.job_name, "task": task_name}
    sink = otel_sink(labels) if settings.metrics_otel != "off" else None
    return Metrics(labels=labels, sink=sink)


def _exports_prometheus(settings: Settings) -> bool:
    return (settings.metrics_prometheus_port is not None or settings.metrics_prometheus_textfile_dir is not None
            or settings.metrics_prometheus_push_url is not None)


def start_exporters(settings: Settings, metrics: Metrics, task_name: str | None = None) -> None:
    """With a Prometheus exporter configured: register ``metrics`` with the process collector (labelled with the job
    and ``task_name`` when it has no labels of its own) and start the endpoint (once per process). Never fails the
    task: an endpoint that cannot bind is logged."""
    if not _exports_prometheus(settings):
        return
    labels = {"job_name": settings.job_name, "task": task_name} if task_name and not metrics.labels else None
    prom.PROCESS.register(metrics, labels)
    port = settings.metrics_prometheus_port
    if port is not None:
        try:
            prom.serve(settings.metrics_prometheus_host, port)
        except OSError as exc:
            log.warning("metrics endpoint not started on %s:%d (metrics.prometheus.host, metrics.prometheus.port): "
                        "%s", settings.metrics_prometheus_host, port, exc)


def export_on_close(settings: Settings, task_name: str, metrics: Metrics) -> None:
    """A task closed: keep its series in the process collector and write or push them where configured. Never
    fails the close: a failure is logged."""
    if not _exports_prometheus(settings):
        return
    prom.PROCESS.retire(metrics)
    export_now(settings, task_name)


def export_now(settings: Settings, task_name: str) -> None:
    """Write or push the task's series where configured (a task kept open between batches does so after each batch,
    since it is not closed). Never fails: a failure is logged."""
    if settings.metrics_prometheus_textfile_dir is None and settings.metrics_prometheus_push_url is None:
        return
    series = prom.PROCESS.collect(job_name=settings.job_name, task=task_name)
    if settings.metrics_prometheus_textfile_dir is not None:
        try:
            prom.write_textfile(settings.metrics_prometheus_textfile_dir, settings.job_name, task_name, series)
        except OSError as exc:
            log.warning("task %s: metrics textfile not written to %s (metrics.prometheus.textfile.dir): %s",
                        task_name, settings.metrics_prometheus_textfile_dir, exc)
    if settings.metrics_prometheus_push_url is not None:
        try:
            prom.push(settings.metrics_prometheus_push_url, settings.job_name, task_name, series)
        except OSError as exc:
            log.warning("task %s: metrics not pushed to %s (metrics.prometheus.push.url): %s", task_name,
                        redact(settings.metrics_prometheus_push_url), redact(str(exc)))
