"""Metrics through standards (issue 13): the catalogue is what the code emits and what docs/operations.md lists;
histograms merge exactly; the Prometheus output (endpoint, textfile, push) parses with Prometheus's own parser and
moves with real commits and restores, on file:// and on real servers (blob-store requests and bytes); the
OpenTelemetry API receives the same metrics (read with the SDK's in-memory reader)."""

from __future__ import annotations

import http.server
import json
import logging
import os
import re
import shutil
import socket
import threading
import urllib.request
import uuid
from collections.abc import Iterator
from concurrent.futures import wait
from pathlib import Path
from typing import Any

import pytest
from opentelemetry.sdk.metrics import MeterProvider
from opentelemetry.sdk.metrics.export import HistogramDataPoint, InMemoryMetricReader
from prometheus_client.parser import text_string_to_metric_families

from statebackend import TaskStorage
from statebackend.errors import ConfigError
from statebackend.metrics import HistogramData, Metrics, MetricsSnapshot
from statebackend.metrics import otel as sb_otel
from statebackend.metrics import prometheus as prom
from statebackend.metrics.catalogue import CATALOGUE, MS_BUCKETS
from tests.backend_helpers import counts_config
from tests.servers import ServerProcess

ROOT = Path(__file__).resolve().parent.parent


def _config(root: Path, **extra: Any) -> dict[str, Any]:
    return counts_config(
        root, job=f"j{uuid.uuid4().hex[:8]}", local="state", factories="changelog,blobsnapshot", **extra
    )


def _run(config: dict[str, Any], commits: int, task: str = "task-0") -> None:
    with TaskStorage.open(config, task) as storage:
        counts = storage.store("counts")
        base = int(storage.restored.input_offsets["n"]) if storage.restored else 0
        for n in range(commits):
            counts.put(f"k{n % 3}", n)
            storage.commit_durably({"n": str(base + n + 1)})


def _samples(text: str) -> dict[tuple[str, frozenset[tuple[str, str]]], float]:
    """Every sample of a Prometheus text, parsed by prometheus_client: (sample name, labels) -> value."""
    return {
        (sample.name, frozenset(sample.labels.items())): sample.value
        for family in text_string_to_metric_families(text)
        for sample in family.samples
    }


def _value(samples: dict[tuple[str, frozenset[tuple[str, str]]], float], name: str, **labels: str) -> float:
    """The sum of the samples ``name`` whose labels include ``labels``."""
    wanted = set(labels.items())
    return sum(v for (n, ls), v in samples.items() if n == name and wanted <= ls)


# -- the catalogue, the code and the docs ------------------------------------------------------------------------


def _names_in_code() -> set[str]:
    """Every metric name the code counts under: the dotted string literals in ``.increment(``/``.record(`` calls
    (an f-string's ``{kind}`` is delta or snapshot), and the blob stores' METRIC_ constants."""
    names: set[str] = set()
    literal = re.compile(r'(f?)"([a-z_]+\.[a-z_.{}]+)"')
    for folder in ("statebackend", "backends", "checkpoint"):
        for path in (ROOT / folder).rglob("*.py"):
            if path.name == "catalogue.py":
                continue
            text = path.read_text()
            # the call's first argument, which a formatter may put on the next line
            for call in re.findall(r"\.(?:increment|record)\(\s*(.*)", text):
                for is_f, name in literal.findall(call):
                    if is_f and "{kind}" in name:
                        names.update(name.replace("{kind}", kind) for kind in ("delta", "snapshot"))
                    elif not is_f:
                        names.add(name)
            names.update(re.findall(r'^METRIC_[A-Z_]+ = "([a-z_.]+)"', text, re.MULTILINE))
    return names


def test_every_metric_in_the_catalogue_is_emitted_by_the_code_and_every_emitted_one_is_in_the_catalogue() -> None:
    in_code = _names_in_code()
    assert "commit.sync.ms" in in_code and "blob_store.requests" in in_code  # the scan finds both kinds of call
    assert sorted(set(CATALOGUE) - in_code) == [], "declared but never emitted"
    assert sorted(in_code - set(CATALOGUE)) == [], "emitted but not declared in statebackend/metrics/catalogue.py"


def test_operations_md_lists_every_metric_with_its_prometheus_name_type_and_unit() -> None:
    text = (ROOT / "docs" / "operations.md").read_text()
    rows = {line.split("|")[1].strip(): line for line in text.splitlines() if line.startswith("| `")}
    for spec in CATALOGUE.values():
        row = rows.get(f"`{spec.name}`")
        assert row is not None, f"docs/operations.md has no row for {spec.name}"
        assert f"`{spec.prometheus}`" in row and spec.kind in row and f"`{spec.unit}`" in row, row


# -- the registry ----------------------------------------------------------------------------------------------


def _task_snapshot(tmp_path: Path, config: dict[str, Any], task: str, commits: int) -> MetricsSnapshot:
    """What a Spark task hands the driver: its registry's snapshot after ``commits`` commits (labels job_name, task;
    store and backend on the per-store series)."""
    with TaskStorage.open(config, task) as storage:
        for n in range(commits):
            storage.store("counts").put(f"k{n}", n)
            storage.commit_durably({"n": str(n + 1)})
        return storage.metrics.export()


def test_export_now_without_the_textfile_leaves_it_to_the_commits(tmp_path: Path) -> None:
    from statebackend.config import Settings
    from statebackend.exporters import export_now

    settings = Settings.from_config(_config(tmp_path, **{"metrics.prometheus.textfile.dir": str(tmp_path / "tf")}))
    path = tmp_path / "tf" / prom.textfile_name(settings.job_name, "task-9")
    export_now(settings, "task-9", textfile=False)  # push only (none configured): nothing written
    assert not path.exists()
    export_now(settings, "task-9")
    assert path.exists()


def test_the_driver_merges_a_batch_keeping_every_tasks_series_apart(tmp_path: Path) -> None:
    config = _config(tmp_path)
    job = config["job.name"]
    first = _task_snapshot(tmp_path, config, "task-0", 1)
    second = _task_snapshot(tmp_path, config, "task-1", 2)
    driver = Metrics()
    batch = driver.merge_batch([first, None, second], batch_ms=1500.0, job_name=job)  # None: stats missing
    assert batch.counter("commit.count") == 3  # job-wide totals of the batch: a sum over the tasks' series
    assert batch.relabel(drop=["task"]).counter("commit.count", job_name=job) == 3
    driver.merge_batch([_task_snapshot(tmp_path, config, "task-0", 1)], batch_ms=700.0, job_name=job)

    samples = _samples(prom.render(driver.export()))
    tasks = {dict(labels).get("task") for (name, labels) in samples if name == "statebackend_commits_total"}
    assert tasks == {"task-0", "task-1"}  # one series per task, and none for "all" (a sum() would count twice)
    assert _value(samples, "statebackend_commits_total", job_name=job, task="task-0") == 2  # over both batches
    assert _value(samples, "statebackend_commits_total", job_name=job, task="task-1") == 2
    for task in ("task-0", "task-1"):
        for backend in ("changelog", "blobsnapshot"):
            assert (
                _value(
                    samples,
                    "statebackend_commit_uploaded_bytes_total",
                    job_name=job,
                    task=task,
                    store="counts",
                    backend=backend,
                )
                > 0
            )
    assert _value(samples, "statebackend_commit_duration_seconds_count", task="task-1") == 2
    assert _value(samples, "statebackend_spark_batch_seconds_count", job_name=job) == 2
    assert _value(samples, "statebackend_spark_batch_seconds_sum", job_name=job) == pytest.approx(2.2)
    assert _value(samples, "statebackend_spark_batch_seconds_bucket", job_name=job, le="1") == 1


def test_the_driver_refuses_to_merge_what_is_not_a_tasks_snapshot() -> None:
    with pytest.raises(TypeError, match="MetricsSnapshot .or None., got dict"):
        Metrics().merge_batch([MetricsSnapshot(), {"commit.count": 1}])  # type: ignore[list-item]


def test_histograms_merge_exactly_across_tasks() -> None:
    a, b, both = Metrics(labels={"task": "a"}), Metrics(labels={"task": "b"}), Metrics()
    for value in (0.5, 3, 3, 70, 400_000):
        a.record("commit.sync.ms", value)
        both.record("commit.sync.ms", value)
    for value in (1, 9000):
        b.record("commit.sync.ms", value)
        both.record("commit.sync.ms", value)
    merged = MetricsSnapshot.merged([a.export(), b.export()]).relabel(drop=["task"])
    histogram = merged.histogram("commit.sync.ms")
    expected = both.export().histogram("commit.sync.ms")
    assert histogram is not None and expected is not None
    assert (histogram.counts, histogram.count, histogram.sum, histogram.min, histogram.max) == (
        expected.counts,
        expected.count,
        expected.sum,
        expected.min,
        expected.max,
    )
    assert histogram.bounds == MS_BUCKETS and histogram.counts[-1] == 1  # 400 s lands above the last bound
    with pytest.raises(ValueError, match="different bucket bounds"):
        histogram.merge(HistogramData.empty((1.0, 2.0)))


def test_quantiles_of_a_merged_histogram_fall_in_the_right_bucket() -> None:
    histogram = HistogramData.empty(MS_BUCKETS)
    for value in [3.0] * 90 + [700.0] * 10:
        histogram.add(value)
    assert 2.0 <= histogram.quantile(0.5) <= 5.0  # the bucket (2, 5] holds the median
    assert 500.0 <= histogram.quantile(0.95) <= 700.0  # clamped to the observed max
    assert HistogramData.empty(MS_BUCKETS).quantile(0.5) == 0.0
    assert histogram.to_dict()["buckets"][5.0] == 90 and histogram.to_dict()["buckets"]["+Inf"] == 0


def test_a_registry_pickles_with_its_series_and_without_its_sink() -> None:
    import pickle

    metrics = Metrics(labels={"job_name": "j", "task": "t"}, sink=sb_otel.otel_sink({"job_name": "j", "task": "t"}))
    metrics.increment("commit.count", 2)
    metrics.record("commit.sync.ms", 7.0)
    copy = pickle.loads(pickle.dumps(metrics))
    assert copy.sink is None and copy.labels == {"job_name": "j", "task": "t"}
    assert copy.counter("commit.count") == 2 and copy.samples("commit.sync.ms") == [7.0]
    copy.record("commit.sync.ms", 9.0)  # a working registry, with its own lock
    assert copy.export().histogram("commit.sync.ms").count == 2  # type: ignore[union-attr]
    assert metrics.export().histogram("commit.sync.ms").count == 1  # type: ignore[union-attr]


def test_labelled_counters_are_queried_by_any_subset_of_their_labels() -> None:
    metrics = Metrics()
    metrics.increment("blob_store.requests", 1, operation="put", outcome="ok")
    metrics.increment("blob_store.requests", 2, operation="get", outcome="ok")
    metrics.increment("blob_store.requests", 1, operation="get", outcome="error")
    assert metrics.counter("blob_store.requests") == 4
    assert metrics.counter("blob_store.requests", operation="get") == 3
    assert metrics.counter("blob_store.requests", outcome="error") == 1
    assert metrics.snapshot()["blob_store.requests{operation=get,outcome=ok}"] == 2


def test_the_text_format_escapes_label_values_and_converts_milliseconds_to_seconds() -> None:
    metrics = Metrics(labels={"job_name": 'a"b\\c', "task": "t\n1"})
    metrics.record("commit.sync.ms", 1500)
    metrics.increment("thirdparty.widgets", 2)  # not in the catalogue: still exported, as a counter
    samples = _samples(prom.render(metrics.export()))
    labels = {"job_name": 'a"b\\c', "task": "t\n1"}
    assert _value(samples, "statebackend_commit_sync_seconds_sum", **labels) == 1.5
    assert samples[("statebackend_commit_sync_seconds_bucket", frozenset({**labels, "le": "1"}.items()))] == 0
    assert _value(samples, "statebackend_commit_sync_seconds_bucket", le="2.5", **labels) == 1
    assert _value(samples, "statebackend_thirdparty_widgets_total", **labels) == 2


# -- configuration ---------------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("key", "value", "allowed"),
    [
        ("metrics.otel", "maybe", "one of auto, on, off"),
        ("metrics.prometheus.port", "70000", "from 0 to 65535"),
        ("metrics.prometheus.textfile.dir", "", "a non-empty directory path"),
        ("metrics.prometheus.push.url", "http://user:pw@gateway:9091", "http://host:port"),
    ],
)
def test_a_wrong_metrics_value_names_the_key_and_what_is_allowed(
    tmp_path: Path, key: str, value: str, allowed: str
) -> None:
    with pytest.raises(ConfigError) as caught:
        TaskStorage.open(_config(tmp_path, **{key: value}), "task-0")
    assert key in str(caught.value) and allowed in str(caught.value)
    assert "pw" not in str(caught.value)


def test_a_misspelled_metrics_key_is_reported_with_the_right_one(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match="did you mean metrics.prometheus.port"):
        TaskStorage.open(_config(tmp_path, **{"metrics.prometheus.prot": "9000"}), "task-0")


# -- Prometheus ------------------------------------------------------------------------------------------------


def test_the_textfile_holds_the_tasks_metrics_after_commits_and_a_restore(tmp_path: Path) -> None:
    textfiles = tmp_path / "textfiles"
    config = _config(tmp_path, **{"metrics.prometheus.textfile.dir": str(textfiles)})
    _run(config, commits=3)
    shutil.rmtree(tmp_path / "state")  # the next open restores in full from the blob store
    _run(config, commits=2)
    path = textfiles / f"statebackend-{config['job.name']}-task-0.prom"
    samples = _samples(path.read_text())
    mine = {"job_name": config["job.name"], "task": "task-0"}
    assert _value(samples, "statebackend_commits_total", **mine) == 5  # both opens, merged in the process
    assert _value(samples, "statebackend_commit_sync_seconds_count", **mine) == 5
    assert _value(samples, "statebackend_commit_uploaded_bytes_total", **mine) > 0
    assert _value(samples, "statebackend_restore_stores_full_total", **mine) == 1
    assert _value(samples, "statebackend_restore_downloaded_bytes_total", **mine) > 0
    assert _value(samples, "statebackend_restore_seconds_count", **mine) == 2
    assert [p.name for p in textfiles.iterdir()] == [path.name]  # no temp file left
    # the per-store series say which store and which backend: both backends upload the one store, one restores it
    uploaded = {
        (ls["store"], ls["backend"])
        for (n, labels), v in samples.items()
        if n == "statebackend_commit_uploaded_bytes_total" and v > 0
        for ls in [dict(labels)]
    }
    assert uploaded == {("counts", "changelog"), ("counts", "blobsnapshot")}
    restored = {
        (ls["store"], ls["backend"])
        for (n, labels), v in samples.items()
        if n == "statebackend_restore_downloaded_bytes_total" and v > 0
        for ls in [dict(labels)]
    }
    assert len(restored) == 1 and restored <= uploaded
    assert _value(samples, "statebackend_restore_store_seconds_count", store="counts", **mine) == 1


def test_the_textfile_follows_every_durable_commit_of_a_task_that_stays_open(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The textfile is rewritten after each durable commit, on the commit pool: the commit does not wait for it (the
    first write is held here while the commit returns), and commits landing while a write waits share that write."""
    textfiles = tmp_path / "textfiles"
    config = _config(tmp_path, **{"metrics.prometheus.textfile.dir": str(textfiles)})
    path = textfiles / f"statebackend-{config['job.name']}-task-0.prom"
    mine = {"job_name": config["job.name"], "task": "task-0"}
    real_write = prom.write_textfile
    writers: list[str] = []
    entered, release = threading.Event(), threading.Event()
    released_in_time: list[bool] = []

    def held_write(*args: Any) -> str:
        writers.append(threading.current_thread().name)
        if len(writers) == 1:  # the first write waits until the test has made two more commits
            entered.set()
            released_in_time.append(release.wait(timeout=120))  # a commit waiting for it would never release it
        return real_write(*args)

    monkeypatch.setattr(prom, "write_textfile", held_write)
    with TaskStorage.open(config, "task-0") as task:
        counts = task.store("counts")
        counts.put("a", 1)
        task.commit_durably({"n": "1"})
        assert entered.wait(timeout=120)  # the write of commit 1 started, on the commit pool
        for n in (2, 3):  # durable while that write is held: the second queues a write, the third shares it
            counts.put("a", n)
            task.commit_durably({"n": str(n)})
        release.set()
        wait(list(task.commit_manager._cleanups))  # the textfile's writes are among the commit's background work
        assert released_in_time == [True] and len(writers) == 2
        assert threading.current_thread().name not in writers
        samples = _samples(path.read_text())  # the task is still open
        assert _value(samples, "statebackend_commits_total", **mine) == 3
        assert _value(samples, "statebackend_commit_duration_seconds_count", **mine) == 3  # counted once durable
        assert [p.name for p in textfiles.iterdir()] == [path.name]


def test_two_commits_of_an_open_task_show_in_its_textfile(tmp_path: Path) -> None:
    textfiles = tmp_path / "textfiles"
    config = _config(tmp_path, **{"metrics.prometheus.textfile.dir": str(textfiles)})
    path = textfiles / f"statebackend-{config['job.name']}-task-0.prom"
    mine = {"job_name": config["job.name"], "task": "task-0"}
    task = TaskStorage.open(config, "task-0")
    try:
        for n in (1, 2):
            task.store("counts").put("a", n)
            task.commit_durably({"n": str(n)})
            wait(list(task.commit_manager._cleanups))
            samples = _samples(path.read_text())
            assert _value(samples, "statebackend_commits_total", **mine) == n
            assert _value(samples, "statebackend_commit_duration_seconds_count", **mine) == n
    finally:
        task.close()


@pytest.mark.slow
def test_the_endpoint_serves_every_task_of_the_process_after_real_commits(tmp_path: Path) -> None:
    config = _config(tmp_path, **{"metrics.prometheus.port": 0})
    _run(config, commits=2, task="task-0")
    with TaskStorage.open(config, "task-1") as live:  # a live task is read at scrape time
        live.store("counts").put("x", 1)
        live.commit_durably({"n": "1"})
        server = prom.serve("127.0.0.1", 0)  # the one the first open started
        with urllib.request.urlopen(server.url, timeout=10) as response:
            assert response.headers["Content-Type"].startswith("text/plain; version=0.0.4")
            samples = _samples(response.read().decode())
    job = config["job.name"]
    assert _value(samples, "statebackend_commits_total", job_name=job, task="task-0") == 2
    assert _value(samples, "statebackend_commits_total", job_name=job, task="task-1") == 1
    assert _value(samples, "statebackend_commit_duration_seconds_count", job_name=job) == 3
    assert _value(samples, "statebackend_changelog_delta_uploads_total", job_name=job) == 3
    assert _value(samples, "statebackend_blobsnapshot_indexes_uploaded_total", job_name=job) == 3
    with pytest.raises(urllib.error.HTTPError, match="404"):
        urllib.request.urlopen(server.url.replace("/metrics", "/other"), timeout=10)


@pytest.mark.slow
def test_a_port_that_cannot_be_bound_is_logged_and_the_task_runs(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        with caplog.at_level(logging.WARNING, logger="statebackend.exporters"):
            _run(_config(tmp_path, **{"metrics.prometheus.port": port}), commits=1)
    assert any("metrics.prometheus.port" in r.getMessage() for r in caplog.records)


@pytest.mark.slow
def test_a_closing_task_pushes_its_metrics_to_the_gateway(tmp_path: Path) -> None:
    received: list[tuple[str, str, bytes]] = []

    class Gateway(http.server.BaseHTTPRequestHandler):
        def do_PUT(self) -> None:
            body = self.rfile.read(int(self.headers["Content-Length"]))
            received.append((self.path, self.headers["Content-Type"], body))
            self.send_response(200)
            self.end_headers()

        def log_message(self, *args: object) -> None:
            pass

    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Gateway)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    try:
        config = _config(tmp_path, **{"metrics.prometheus.push.url": f"http://127.0.0.1:{server.server_address[1]}"})
        _run(config, commits=2)
    finally:
        server.shutdown()
        server.server_close()
    assert len(received) == 1
    path, content_type, body = received[0]
    assert path == f"/metrics/job/statebackend/job_name/{config['job.name']}/task/task-0"
    assert content_type.startswith("text/plain; version=0.0.4")
    assert _value(_samples(body.decode()), "statebackend_commits_total") == 2


def _remote_config(tmp_path: Path, kind: str, server: Any) -> dict[str, Any]:
    config = _config(
        tmp_path,
        **{"metrics.prometheus.textfile.dir": str(tmp_path / "textfiles"), "blob.store.part.size.bytes": "5MiB"},
    )
    config["stores.counts.backup.factories"] = "changelog"
    config["stores.counts.msg.serde"] = "bytes"
    if kind == "s3":
        config["blob.store.url"] = f"s3://t-{uuid.uuid4().hex[:20]}/state"
        config["blob.store.endpoint.url"] = server.endpoint
    else:
        config["blob.store.url"] = f"az://t{uuid.uuid4().hex[:20]}/state"
        config["blob.store.connection.string"] = server
    return config


@pytest.fixture(params=["s3", "azure"])
def remote(request: pytest.FixtureRequest) -> Iterator[tuple[str, Any]]:
    if request.param == "s3":
        yield "s3", request.getfixturevalue("s3_server")
    else:
        yield "azure", request.getfixturevalue("azurite_connection")


@pytest.mark.slow
@pytest.mark.s3
@pytest.mark.azure
def test_blob_store_request_and_byte_counters_move_on_a_real_server(
    tmp_path: Path, remote: tuple[str, ServerProcess | str]
) -> None:
    kind, server = remote
    config = _remote_config(tmp_path, kind, server)
    big = os.urandom(6 << 20)  # one incompressible 6 MiB value: its delta goes up in two parts
    with TaskStorage.open(config, "task-0") as task:
        task.store("counts").put("big", big)
        task.commit_durably({"n": "1"})
        counted = task.metrics
        assert counted.counter("blob_store.bytes.sent") >= len(big)
    shutil.rmtree(tmp_path / "state")
    with TaskStorage.open(config, "task-0") as task:
        assert task.store("counts").get("big") == big
        assert task.metrics.counter("blob_store.bytes.received") >= len(big)
    textfile = tmp_path / "textfiles" / f"statebackend-{config['job.name']}-task-0.prom"
    samples = _samples(textfile.read_text())
    part = "upload_part" if kind == "s3" else "stage_block"
    delta_bytes = _value(samples, "statebackend_changelog_delta_bytes_sum")
    assert len(big) < delta_bytes < len(big) + (64 << 10)  # the value and the delta's framing
    assert _value(samples, "statebackend_blob_store_requests_total", operation=part, outcome="ok") == 2
    assert _value(samples, "statebackend_blob_store_sent_bytes_total", operation=part) == delta_bytes
    assert _value(samples, "statebackend_blob_store_requests_total", operation="put", outcome="ok") >= 1
    assert _value(samples, "statebackend_blob_store_sent_bytes_total", operation="put") > 0  # the checkpoint
    assert _value(samples, "statebackend_blob_store_received_bytes_total", operation="get") >= delta_bytes
    assert _value(samples, "statebackend_blob_store_request_seconds_count", operation="list") >= 2
    assert _value(samples, "statebackend_blob_store_attempts_per_request_count") == _value(
        samples, "statebackend_blob_store_requests_total"
    )
    assert _value(samples, "statebackend_restore_stores_full_total") == 1


# -- OpenTelemetry ---------------------------------------------------------------------------------------------


@pytest.fixture
def otel_reader() -> Iterator[InMemoryMetricReader]:
    reader = InMemoryMetricReader()
    provider = MeterProvider(metric_readers=[reader])
    sb_otel.set_meter_provider(provider)
    try:
        yield reader
    finally:
        sb_otel.set_meter_provider(None)
        provider.shutdown()


def _points(reader: InMemoryMetricReader) -> dict[str, list[Any]]:
    data = reader.get_metrics_data()
    out: dict[str, list[Any]] = {}
    for resource in data.resource_metrics if data is not None else ():
        for scope in resource.scope_metrics:
            for metric in scope.metrics:
                out.setdefault(metric.name, []).extend(metric.data.data_points)
                out.setdefault(f"{metric.name}:unit", []).append(metric.unit)
    return out


def test_opentelemetry_receives_the_metrics_of_commits_and_a_restore(
    tmp_path: Path, otel_reader: InMemoryMetricReader
) -> None:
    config = _config(tmp_path)
    _run(config, commits=3)
    shutil.rmtree(tmp_path / "state")
    _run(config, commits=1)
    points = _points(otel_reader)
    mine = {"job_name": config["job.name"], "task": "task-0"}
    commits = [p for p in points["statebackend.commit.count"] if dict(p.attributes) == mine]
    assert sum(p.value for p in commits) == 4
    assert sum(p.value for p in points["statebackend.restore.stores.full"] if dict(p.attributes) == mine) == 1
    assert sum(p.value for p in points["statebackend.restore.bytes"]) > 0
    sync = [p for p in points["statebackend.commit.sync.ms"] if dict(p.attributes) == mine]
    assert len(sync) == 1 and isinstance(sync[0], HistogramDataPoint)
    assert sync[0].count == 4 and tuple(sync[0].explicit_bounds) == MS_BUCKETS  # the catalogue's mergeable buckets
    assert points["statebackend.commit.sync.ms:unit"] == ["ms"]
    assert sum(p.count for p in points["statebackend.restore.ms"] if dict(p.attributes) == mine) == 2


def test_metrics_otel_off_mirrors_nothing(tmp_path: Path, otel_reader: InMemoryMetricReader) -> None:
    _run(_config(tmp_path, **{"metrics.otel": "off"}), commits=2)
    assert "statebackend.commit.count" not in _points(otel_reader)


def test_a_registry_given_without_labels_is_exported_under_the_task_it_counted_for(tmp_path: Path) -> None:
    config = _config(tmp_path, **{"metrics.prometheus.textfile.dir": str(tmp_path / "textfiles")})
    mine = Metrics()
    with TaskStorage.open(config, "task-7", metrics=mine) as task:
        task.store("counts").put("a", 1)
        task.commit_durably({"n": "1"})
    assert mine.counter("commit.count") == 1
    text = (tmp_path / "textfiles" / f"statebackend-{config['job.name']}-task-7.prom").read_text()
    assert _value(_samples(text), "statebackend_commits_total", job_name=config["job.name"], task="task-7") == 1


# -- the blob store's requests (the resilience layer, without a server) --------------------------------------------


def test_retries_hedges_failures_and_bytes_are_counted_per_operation() -> None:
    from statebackend.blobstores.memory import MemoryBlobStore
    from statebackend.blobstores.resilience import ResilientBlobStore
    from statebackend.errors import NotFoundError, TransientStorageError
    from tests.faults import ScriptedBlobStore

    scripted = ScriptedBlobStore(MemoryBlobStore())
    failures = iter([TransientStorageError("503"), TransientStorageError("reset")])
    release = threading.Event()

    def before(operation: str, name: str) -> None:
        if operation == "put":
            failure = next(failures, None)
            if failure is not None:
                raise failure
        if operation == "get" and name == "slow" and not release.is_set():
            release.set()
            threading.Event().wait(0.5)  # the first get of "slow" hangs long enough for one hedge to answer

    scripted.before = before
    store = ResilientBlobStore(scripted, base_delay_s=0, hedge_after_s=0.05, request_timeout_s=30)
    metrics = Metrics()
    store.use_metrics(metrics)
    store.put("blob", b"12345")  # two transient failures, then success
    store.put("slow", b"ab")
    assert store.get("slow") == b"ab"  # answered by the hedge
    with pytest.raises(NotFoundError):
        store.get("absent")
    store.use_metrics(None)
    store.put("uncounted", b"x")
    store.close()
    assert metrics.counter("blob_store.retries", operation="put") == 2
    assert metrics.counter("blob_store.requests", operation="put", outcome="ok") == 2
    assert metrics.counter("blob_store.bytes.sent", operation="put") == 7
    assert metrics.counter("blob_store.hedges", operation="get") == 1
    assert metrics.counter("blob_store.bytes.received", operation="get") == 2
    assert metrics.counter("blob_store.requests", operation="get", outcome="error") == 1
    assert metrics.counter("blob_store.failed_requests", operation="get") == 1
    attempts = metrics.histogram("blob_store.attempts_per_request", operation="put")
    assert attempts is not None and attempts.sum == 4 and attempts.count == 2
    latency = metrics.histogram("blob_store.latency_s")
    assert latency is not None and latency.count == 4


def test_opentelemetry_data_points_carry_the_requests_own_labels(otel_reader: InMemoryMetricReader) -> None:
    from statebackend.blobstores.memory import MemoryBlobStore
    from statebackend.blobstores.resilience import ResilientBlobStore

    store = ResilientBlobStore(MemoryBlobStore())
    task = {"job_name": "j", "task": "t"}
    store.use_metrics(Metrics(labels=task, sink=sb_otel.otel_sink(task)))
    store.put("a", b"xyz")
    assert store.get("a") == b"xyz"
    store.close()
    points = _points(otel_reader)
    requests = {
        (p.attributes["operation"], p.attributes["outcome"]): p.value
        for p in points["statebackend.blob_store.requests"]
        if p.attributes["job_name"] == "j"
    }
    assert requests == {("put", "ok"): 1, ("get", "ok"): 1}
    received = [p for p in points["statebackend.blob_store.bytes.received"] if p.attributes["task"] == "t"]
    assert [(p.attributes["operation"], p.value) for p in received] == [("get", 3)]
    assert points["statebackend.blob_store.latency_s:unit"] == ["s"]


# -- dashboards ------------------------------------------------------------------------------------------------


def _dashboard_queries() -> list[tuple[str, str]]:
    """(panel title, PromQL) of every target of docs/dashboards/statebackend.json."""
    dashboard = json.loads((ROOT / "docs" / "dashboards" / "statebackend.json").read_text())
    return [(panel["title"], target["expr"]) for panel in dashboard["panels"] for target in panel["targets"]]


def test_the_dashboard_is_built_from_exactly_the_queries_operations_md_lists() -> None:
    text = (ROOT / "docs" / "operations.md").read_text()
    section = text.split("\n## Dashboards\n", 1)[1].split("\n## ", 1)[0]
    listed = re.findall(r"^\| ([^|`]+?) \| `([^`]+)` \|$", section, re.MULTILINE)
    assert len(listed) >= 15
    assert listed == _dashboard_queries()


def test_every_dashboard_query_reads_metrics_of_the_catalogue_with_their_labels() -> None:
    dashboard = json.loads((ROOT / "docs" / "dashboards" / "statebackend.json").read_text())
    families = {spec.prometheus: spec for spec in CATALOGUE.values()}
    variables = [v["query"]["query"] for v in dashboard["templating"]["list"] if v["type"] == "query"]
    queries = [expr for _, expr in _dashboard_queries()] + variables
    for query in queries:
        names = re.findall(r"\b(statebackend_[a-z_]+)", query)
        assert names, f"no statebackend metric in {query}"
        for name in names:
            family = re.sub(r"_(bucket|sum|count)$", "", name)
            spec = families.get(name) or families.get(family)
            assert spec is not None, f"{name} in {query} is not a metric of statebackend/metrics/catalogue.py"
            assert (name == spec.prometheus) == (spec.kind == "counter"), f"{name}: a {spec.kind} is read as {name}"
            for group in re.findall(r"by \(([^)]*)\)", query):
                allowed = (
                    {"job_name", "task", "le", *spec.labels}
                    if spec.kind == "histogram"
                    else {"job_name", "task", *spec.labels}
                )
                if spec.name.startswith("spark."):  # the driver's own: no task
                    allowed -= {"task"}
                extra = {label.strip() for label in group.split(",")} - allowed
                assert not extra, f"{query} groups {name} by {extra}, labels it does not have"
