"""Helpers shared by the benchmarks: percentiles, a plain-text table printer, machine facts and the result file.

Contract: nothing here times anything; :func:`machine_info` reads only local facts (CPU count, memory, load
average, versions) so a result file says what it ran on; :func:`write_result` writes one JSON file under
``bench/results/`` named after the benchmark and the UTC time, and returns its path.
"""

from __future__ import annotations

import datetime as _dt
import json
import os
import platform
import statistics
import sys
from collections.abc import Mapping, Sequence
from importlib import metadata
from pathlib import Path
from typing import Any

from statebackend.metrics import percentile

__all__ = [
    "RESULTS_DIR",
    "format_table",
    "local_cluster_session",
    "machine_info",
    "p50_p95",
    "percentile",
    "write_result",
]

RESULTS_DIR = Path(__file__).resolve().parent / "results"


def local_cluster_session(app_name: str, master: str, conf: Mapping[str, str]) -> Any:
    """A SparkSession on a ``local-cluster[...]`` master whose application id no other such session on this machine
    has. Each local cluster has a master of its own, which names its first application ``app-<second>-0000``, and
    every local cluster keeps its executors' working dirs under ``<pyspark>/work/<application id>/<executor id>``:
    two started in the same second would share those dirs (a relative ``state.local.dir`` included), and one's
    cleanup or kill would hit the other. So the start is serialized by a lock file, and the lock is held until the
    wall clock has left the second of this application's id (seen: a test's cluster and a bench's, started together,
    failed with ``FileNotFoundError`` in their executors)."""
    import fcntl
    import tempfile
    import time

    from statebackend.spark import local_spark_session

    with open(Path(tempfile.gettempdir()) / "statebackend-local-cluster.lock", "a+") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        spark = local_spark_session(app_name, master=master, conf=conf)
        # the id is fixed once the session exists (the standalone backend waits for its registration)
        # (local time, as the master writes it; at most 2 s, should the JVM's time zone differ from Python's)
        started, bound = spark.sparkContext.applicationId.split("-")[1], time.monotonic() + 2.0
        while time.strftime("%Y%m%d%H%M%S") <= started and time.monotonic() < bound:
            time.sleep(0.05)
    return spark


def p50_p95(samples: Sequence[float]) -> tuple[float, float]:
    """Nearest-rank p50 and p95 (the same definition as :class:`statebackend.metrics.Metrics`)."""
    values = list(samples)
    return percentile(values, 0.50), percentile(values, 0.95)


def summary(values: list[float]) -> str:
    """``p50 / p95`` of ``values`` in whole ms (``-`` for none)."""
    if not values:
        return "-"
    return f"{statistics.median(values):.0f} / {percentile(values, 0.95):.0f}"


def load_text(load: tuple[float, float, float]) -> str:
    """The load average ``os.getloadavg()`` gave, as the bench prints it."""
    return " / ".join(f"{value:.2f}" for value in load) + " (1 / 5 / 15 min)"


def format_table(headers: Sequence[str], rows: Sequence[Sequence[Any]]) -> str:
    """A GitHub-markdown table (also readable as plain text): numbers right-aligned, floats with 1 decimal."""

    def cell(value: Any) -> str:
        if isinstance(value, float):
            return f"{value:,.1f}"
        if isinstance(value, int):
            return f"{value:,}"
        return str(value)

    cells = [[cell(v) for v in row] for row in rows]
    widths = [max(len(h), *(len(r[i]) for r in cells)) if cells else len(h) for i, h in enumerate(headers)]
    numeric = [bool(rows) and all(isinstance(r[i], (int, float)) for r in rows) for i in range(len(headers))]

    def line(values: Sequence[str]) -> str:
        parts = [v.rjust(w) if num else v.ljust(w) for v, w, num in zip(values, widths, numeric, strict=True)]
        return "| " + " | ".join(parts) + " |"

    rule = (
        "|"
        + "|".join(("-" * (w + 1) + ":") if num else ("-" * (w + 2)) for w, num in zip(widths, numeric, strict=True))
        + "|"
    )
    return "\n".join([line(headers), rule, *(line(r) for r in cells)])


def machine_info() -> dict[str, Any]:
    """CPU count, memory, load average, OS, Python and the versions of the libraries that matter for timing."""
    memory_gib = None
    try:
        with open("/proc/meminfo") as meminfo:
            for row in meminfo:
                if row.startswith("MemTotal:"):
                    memory_gib = round(int(row.split()[1]) / (1 << 20), 1)
                    break
    except OSError:
        pass
    versions = {}
    for package in ("lmdb", "zstandard", "attrs"):
        try:
            versions[package] = metadata.version(package)
        except metadata.PackageNotFoundError:
            versions[package] = None
    return {
        "cpus": os.cpu_count(),
        "memory_gib": memory_gib,
        "load_average": [round(x, 2) for x in os.getloadavg()],
        "platform": platform.platform(),
        "python": sys.version.split()[0],
        "python_implementation": platform.python_implementation(),
        "libraries": versions,
    }


def write_result(benchmark: str, result: Mapping[str, Any]) -> Path:
    """Write ``result`` as ``bench/results/<benchmark>-<UTC time>.json``; returns the path."""
    RESULTS_DIR.mkdir(parents=True, exist_ok=True)
    stamp = _dt.datetime.now(_dt.UTC).strftime("%Y%m%dT%H%M%SZ")
    path = RESULTS_DIR / f"{benchmark}-{stamp}.json"
    path.write_text(json.dumps(result, indent=2, sort_keys=False) + "\n")
    return path


def count_keys(stores: Any, batches: Any) -> None:
    """statebackend's side: add each key's occurrences in the batch to its stored count (Arrow, no output), with the
    vectorized state API: one get_many and one put_many per task and batch."""
    import pyarrow as pa

    received = list(batches)
    if not received:
        return
    grouped = pa.Table.from_batches(received).group_by("key").aggregate([("key", "count")])
    keys, added = grouped.column("key"), grouped.column("key_count").to_pylist()
    counts = stores["counts"]
    counts.put_many(keys, [(old or 0) + n for old, n in zip(counts.get_many(keys), added, strict=True)])
    return
