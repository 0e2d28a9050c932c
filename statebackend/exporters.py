"""A task's metrics leaving the process: a fresh registry per open (mirrored into OpenTelemetry), the Prometheus
endpoint, textfile and push gateway. Never fails a task: an exporter that cannot bind, write or push is logged.

The textfile is written after every durable commit (:func:`textfile_after_commit`), not only when the task closes: a
Spark task kept open between batches would otherwise leave a file that lags its commits. One write (collect, render,
fsync, rename) takes about 7 ms for a task's usual 400 lines, so it runs on the commit pool, never on the task's
thread, and commits that land while a write waits there share that write.
"""

from __future__ import annotations

import logging
import os
import threading
import weakref
from collections.abc import Callable, Mapping
from concurrent.futures import Executor, Future
from typing import Any

from statebackend.config import Settings
from statebackend.metrics import Metrics
from statebackend.metrics import prometheus as prom
from statebackend.metrics.otel import otel_sink
from statebackend.redact import redact

__all__ = ["export_now", "export_on_close", "start_exporters", "task_metrics", "textfile_after_commit"]

log = logging.getLogger(__name__)


def task_metrics(settings: Settings, task_name: str) -> Metrics:
    """A fresh registry for one open of a task: labelled ``job_name`` and ``task``, mirrored into OpenTelemetry
    unless ``metrics.otel=off`` (a no-op when the API is not installed or no SDK is)."""
    labels = {"job_name": settings.job_name, "task": task_name}
    sink = otel_sink(labels) if settings.metrics_otel != "off" else None
    return Metrics(labels=labels, sink=sink)


def _exports_prometheus(settings: Settings) -> bool:
    return (
        settings.metrics_prometheus_port is not None
        or settings.metrics_prometheus_textfile_dir is not None
        or settings.metrics_prometheus_push_url is not None
    )


def start_exporters(
    settings: Settings, metrics: Metrics, task_name: str | None = None, *, labels: Mapping[str, str] | None = None
) -> None:
    """With a Prometheus exporter configured: register ``metrics`` with the process collector (labelled with the job
    and ``task_name`` when it has no labels of its own, or with ``labels`` when given: the Spark driver's registry
    gives ``job_name`` so its own series carry it) and start the endpoint (once per process). Never fails the task:
    an endpoint that cannot bind is logged."""
    if not _exports_prometheus(settings):
        return
    if labels is None and task_name and not metrics.labels:
        labels = {"job_name": settings.job_name, "task": task_name}
    prom.PROCESS.register(metrics, labels)
    port = settings.metrics_prometheus_port
    if port is not None:
        try:
            prom.serve(settings.metrics_prometheus_host, port)
        except OSError as exc:
            log.warning(
                "metrics endpoint not started on %s:%d (metrics.prometheus.host, metrics.prometheus.port): %s",
                settings.metrics_prometheus_host,
                port,
                exc,
            )


def export_on_close(settings: Settings, task_name: str, metrics: Metrics) -> None:
    """A task closed: keep its series in the process collector and write or push them where configured. Never
    fails the close: a failure is logged."""
    if not _exports_prometheus(settings):
        return
    prom.PROCESS.retire(metrics)
    export_now(settings, task_name)


def export_now(settings: Settings, task_name: str, *, textfile: bool = True) -> None:
    """Write or push the task's series where configured, now, on the caller's thread (a task kept open between
    batches pushes after each batch, since it is not closed). ``textfile=False``: push only; the textfile of an open
    task is written after every durable commit anyway (:func:`textfile_after_commit`), and a write here would cost
    the caller's thread the fsync. Never fails: a failure is logged."""
    if settings.metrics_prometheus_textfile_dir is None and settings.metrics_prometheus_push_url is None:
        return
    if textfile and settings.metrics_prometheus_textfile_dir is not None:
        _textfile(settings, task_name).write()
    if settings.metrics_prometheus_push_url is not None:
        series = prom.PROCESS.collect(job_name=settings.job_name, task=task_name)
        try:
            prom.push(settings.metrics_prometheus_push_url, settings.job_name, task_name, series)
        except OSError as exc:
            log.warning(
                "task %s: metrics not pushed to %s (metrics.prometheus.push.url): %s",
                task_name,
                redact(settings.metrics_prometheus_push_url),
                redact(str(exc)),
            )


def textfile_after_commit(
    settings: Settings, task_name: str, executor: Executor
) -> Callable[[], Future[Any] | None] | None:
    """What a task's commit manager calls once a commit is durable (``TaskCommitManager.after_durable``) with
    ``metrics.prometheus.textfile.dir`` set: it queues a write of the task's textfile on ``executor`` (the commit
    pool) and returns its future, or ``None`` when a write is already queued (that one collects when it starts, so
    it holds this commit too). ``None`` without a textfile dir."""
    if settings.metrics_prometheus_textfile_dir is None:
        return None
    textfile = _textfile(settings, task_name)
    return lambda: textfile.schedule(executor)


class _Textfile:
    """One task's textfile. Writes take turns and each collects the series when its turn comes, so the last rename
    always holds the newest counts; a write queued and not started yet makes another one needless."""

    def __init__(self, directory: str, job_name: str, task_name: str) -> None:
        self.directory = directory
        self.job_name = job_name
        self.task_name = task_name
        self._turn = threading.Lock()  # collect, render, write and rename: one at a time
        self._lock = threading.Lock()
        self._queued = False

    def schedule(self, executor: Executor) -> Future[Any] | None:
        with self._lock:
            if self._queued:
                return None
            self._queued = True
        try:
            return executor.submit(self.write)
        except RuntimeError:  # the pool shut down (the process is exiting): the close writes it, if it still can
            with self._lock:
                self._queued = False
            return None

    def write(self) -> None:
        """Collect the task's series and write them (a failure is logged, never raised)."""
        with self._turn:
            with self._lock:
                self._queued = False
            try:
                series = prom.PROCESS.collect(job_name=self.job_name, task=self.task_name)
                prom.write_textfile(self.directory, self.job_name, self.task_name, series)
            except OSError as exc:
                log.warning(
                    "task %s: metrics textfile not written to %s (metrics.prometheus.textfile.dir): %s",
                    self.task_name,
                    self.directory,
                    exc,
                )


#: the textfile of each task with one in use (a task's commit manager holds it; the close and export_now write it
#: in the same turns)
_textfiles: weakref.WeakValueDictionary[str, _Textfile] = weakref.WeakValueDictionary()
_textfiles_lock = threading.Lock()


def _textfile(settings: Settings, task_name: str) -> _Textfile:
    assert settings.metrics_prometheus_textfile_dir is not None
    directory = os.fspath(settings.metrics_prometheus_textfile_dir)
    key = os.path.join(os.path.abspath(directory), prom.textfile_name(settings.job_name, task_name))
    with _textfiles_lock:
        found = _textfiles.get(key)
        if found is None:
            found = _textfiles[key] = _Textfile(directory, settings.job_name, task_name)
        return found
