"""Prometheus: the text exposition format (version 0.0.4), an HTTP endpoint, textfiles and pushes.

The format is written here, not through ``prometheus_client``: statebackend keeps its own registry (per task, merged
per process, merged per Spark batch on the driver), so a client library would only add a second registry and a
dependency on every executor; the format is small and stable, and the tests parse what this module writes with
``prometheus_client``'s own parser.

- :data:`PROCESS` collects the series of every task of the process that was opened with a Prometheus exporter
  configured: live tasks are read at scrape time, closed ones are kept merged (so counters never go back when a task
  closes and reopens in the same process, as a Spark task does every batch).
- :func:`serve` starts the endpoint (``GET /metrics``) for long-lived processes.
- :func:`write_textfile` writes one task's series atomically (the node exporter's textfile collector, or a file a
  Spark task leaves for a shipper; :mod:`statebackend.exporters` rewrites it after every durable commit);
  :func:`push` PUTs them to a Pushgateway.

Histograms in milliseconds are exported in seconds; every series has the labels ``job_name`` and ``task``.
"""

from __future__ import annotations

import logging
import math
import os
import threading
import urllib.parse
from collections.abc import Mapping

from statebackend.fsutil import atomic_write
from statebackend.metrics import HistogramData, Labels, Metrics, MetricsSnapshot
from statebackend.metrics.catalogue import COUNTER, HISTOGRAM, spec_for

__all__ = ["CONTENT_TYPE", "PROCESS", "MetricsServer", "ProcessCollector", "push", "render", "serve", "write_textfile"]

log = logging.getLogger(__name__)

CONTENT_TYPE = "text/plain; version=0.0.4; charset=utf-8"


# -- the text format --------------------------------------------------------------------------------------------


def _number(value: float) -> str:
    if math.isinf(value):
        return "+Inf" if value > 0 else "-Inf"
    if math.isnan(value):
        return "NaN"
    if value == int(value) and abs(value) < 1e15:
        return str(int(value))
    return repr(float(value))


def _label_value(value: str) -> str:
    return value.replace("\\", "\\\\").replace("\n", "\\n").replace('"', '\\"')


def _labels(labels: Labels, extra: tuple[str, str] | None = None) -> str:
    items = list(labels) + ([extra] if extra else [])
    if not items:
        return ""
    return "{" + ",".join(f'{k}="{_label_value(v)}"' for k, v in items) + "}"


def _help(text: str) -> str:
    return text.replace("\\", "\\\\").replace("\n", "\\n")


def render(snapshot: MetricsSnapshot) -> str:
    """``snapshot`` in the Prometheus text exposition format: one family per metric, with HELP and TYPE."""
    families: dict[str, list[str]] = {}
    heads: dict[str, str] = {}
    for (name, labels), value in sorted(snapshot.counters.items()):
        spec = spec_for(name, COUNTER)
        family = spec.prometheus
        heads.setdefault(family, f"# HELP {family} {_help(spec.help)}\n# TYPE {family} counter\n")
        families.setdefault(family, []).append(f"{family}{_labels(labels)} {_number(value)}\n")
    for (name, labels), histogram in sorted(snapshot.histograms.items()):
        spec = spec_for(name, HISTOGRAM)
        family = spec.prometheus
        heads.setdefault(family, f"# HELP {family} {_help(spec.help)}\n# TYPE {family} histogram\n")
        families.setdefault(family, []).extend(_histogram_lines(family, labels, histogram, spec.prometheus_scale))
    return "".join(heads[family] + "".join(lines) for family, lines in sorted(families.items()))


def _histogram_lines(family: str, labels: Labels, histogram: HistogramData, scale: float) -> list[str]:
    lines = []
    cumulative = 0
    for i, count in enumerate(histogram.counts):
        cumulative += count
        bound = "+Inf" if i == len(histogram.bounds) else _number(histogram.bounds[i] * scale)
        lines.append(f"{family}_bucket{_labels(labels, ('le', bound))} {cumulative}\n")
    lines.append(f"{family}_sum{_labels(labels)} {_number(histogram.sum * scale)}\n")
    lines.append(f"{family}_count{_labels(labels)} {histogram.count}\n")
    return lines


# -- the process collector --------------------------------------------------------------------------------------


class ProcessCollector:
    """The series of the tasks of this process: live registries read at collection time, closed ones merged."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._live: dict[int, tuple[Metrics, dict[str, str]]] = {}
        self._retired = MetricsSnapshot()

    def register(self, metrics: Metrics, labels: Mapping[str, str] | None = None) -> None:
        """Serve ``metrics`` from now on; ``labels`` are set on its series (for a registry built without them)."""
        with self._lock:
            self._live[id(metrics)] = (metrics, dict(labels or {}))

    def retire(self, metrics: Metrics) -> None:
        """The task closed: keep what it counted, merged with the closed tasks' series."""
        with self._lock:
            found = self._live.pop(id(metrics), None)
            if found is not None:
                self._retired.merge(_labelled(*found))

    def collect(self, **labels: str) -> MetricsSnapshot:
        """Every series (of those whose labels include ``labels``)."""
        with self._lock:
            live = list(self._live.values())
            total = MetricsSnapshot().merge(self._retired)
        for metrics, extra in live:
            total.merge(_labelled(metrics, extra))
        if not labels:
            return total
        wanted = set(labels.items())
        return MetricsSnapshot(
            {k: v for k, v in total.counters.items() if wanted <= set(k[1])},
            {k: h for k, h in total.histograms.items() if wanted <= set(k[1])},
        )

    def clear(self) -> None:
        with self._lock:
            self._live.clear()
            self._retired = MetricsSnapshot()


def _labelled(metrics: Metrics, labels: Mapping[str, str]) -> MetricsSnapshot:
    snapshot = metrics.export()
    return snapshot.relabel(**labels) if labels else snapshot


#: the collector of this process: what the endpoint serves
PROCESS = ProcessCollector()


# -- the endpoint -----------------------------------------------------------------------------------------------


class MetricsServer:
    """An HTTP server answering ``GET /metrics`` with :data:`PROCESS` rendered, on a daemon thread."""

    def __init__(self, host: str, port: int, collector: ProcessCollector = PROCESS) -> None:
        from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer  # only a process that serves pays for it

        collect = collector.collect

        class Handler(BaseHTTPRequestHandler):
            def do_GET(self) -> None:
                if urllib.parse.urlsplit(self.path).path not in ("/metrics", "/metrics/"):
                    self.send_error(404, "only /metrics is served")
                    return
                body = render(collect()).encode()
                self.send_response(200)
                self.send_header("Content-Type", CONTENT_TYPE)
                self.send_header("Content-Length", str(len(body)))
                self.end_headers()
                self.wfile.write(body)

            def log_message(self, format: str, *args: object) -> None:
                log.debug("metrics endpoint: " + format, *args)

        self._server = ThreadingHTTPServer((host, port), Handler)
        self._server.daemon_threads = True
        self.host = host
        self.port = int(self._server.server_address[1])
        self._thread = threading.Thread(target=self._server.serve_forever, name="statebackend-metrics", daemon=True)
        self._thread.start()

    @property
    def url(self) -> str:
        host = f"[{self.host}]" if ":" in self.host else self.host
        return f"http://{host}:{self.port}/metrics"

    def close(self) -> None:
        self._server.shutdown()
        self._server.server_close()
        self._thread.join(timeout=5)


_servers: dict[tuple[str, int], MetricsServer] = {}
_servers_lock = threading.Lock()


def serve(host: str, port: int) -> MetricsServer:
    """The process's endpoint on ``host:port``, started on first call (later calls return the same server; port 0
    starts one on a free port once per host). Raises :class:`OSError` when the port cannot be bound."""
    with _servers_lock:
        server = _servers.get((host, port))
        if server is None:
            server = _servers[(host, port)] = MetricsServer(host, port)
            log.info("metrics endpoint serving %s", server.url)
        return server


def servers() -> list[MetricsServer]:
    """The endpoints started in this process."""
    with _servers_lock:
        return list(_servers.values())


# -- textfiles and pushes ----------------------------------------------------------------------------------------


def textfile_name(job_name: str, task_name: str) -> str:
    """The file a task's series are written to (job and task names are letters, digits, '.', '_' and '-')."""
    return f"statebackend-{job_name}-{task_name}.prom"


def write_textfile(directory: str | os.PathLike[str], job_name: str, task_name: str, snapshot: MetricsSnapshot) -> str:
    """Write ``snapshot`` to ``<directory>/statebackend-<job>-<task>.prom`` atomically: a temp file (a collector never
    reads half a file: its name does not end in ``.prom``), fsynced, renamed over the file (a crash leaves the
    previous file or the new one whole, never an empty one); returns the path. About 6 ms for a task's usual
    400 lines, mostly the fsync: :mod:`statebackend.exporters` calls it off the task's thread."""
    os.makedirs(directory, exist_ok=True)
    path = os.path.join(os.fspath(directory), textfile_name(job_name, task_name))
    with atomic_write(path, prefix=".statebackend-metrics-", mode=0o644, fsync=True) as out:
        out.write(render(snapshot).encode())
    return path


def push(url: str, job_name: str, task_name: str, snapshot: MetricsSnapshot, *, timeout_s: float = 5.0) -> None:
    """PUT ``snapshot`` to a Pushgateway at ``url`` under the grouping key ``job=statebackend``, ``job_name``,
    ``task`` (a PUT replaces the group's previous push). Raises :class:`OSError` when the gateway fails."""
    import urllib.request  # only a process that pushes pays for it

    quote = urllib.parse.quote
    target = (
        f"{url.rstrip('/')}/metrics/job/statebackend/job_name/{quote(job_name, safe='')}"
        f"/task/{quote(task_name, safe='')}"
    )
    request = urllib.request.Request(
        target, data=render(snapshot).encode(), method="PUT", headers={"Content-Type": CONTENT_TYPE}
    )
    with urllib.request.urlopen(request, timeout=timeout_s) as response:
        response.read()
