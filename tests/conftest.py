"""Session fixtures shared by the test suite. Keep them generic; add new ones, never remove.

``azurite`` and ``s3_server`` start a real server once per session on an ephemeral loopback port (tests/servers.py)
and stop it by process id at the end. A server that cannot start fails the tests that need it (never a skip).
"""

from __future__ import annotations

import os
import time
from collections.abc import Iterator
from pathlib import Path
from typing import TYPE_CHECKING, Any

import pytest

from tests.servers import ServerProcess, azurite_connection_string, start_azurite, start_moto

if TYPE_CHECKING:
    from tests.script_runs import ScriptRuns


def _pyspark_major() -> int | None:
    """The installed pyspark's major version (None without pyspark), read from its metadata (no import)."""
    from importlib.metadata import PackageNotFoundError, version

    try:
        return int(version("pyspark").split(".")[0])
    except PackageNotFoundError:
        return None


_PYSPARK_MAJOR = _pyspark_major()

#: bench/spark_tws.py and bench/tws_state.py import the StatefulProcessor of transformWithStateInPandas, new in
#: PySpark 4.0: the benches compare with it, so their test modules cannot be imported on PySpark 3.5 (./dev
#: spark-matrix), where there is nothing to compare with
collect_ignore = (
    ["test_bench_tws.py", "test_bench_tws_state.py"] if _PYSPARK_MAJOR is not None and _PYSPARK_MAJOR < 4 else []
)


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    """Tests marked ``connect`` start a local Spark Connect server: PySpark 3.5 ships none (its pyspark has no
    spark-connect jar, and the server's package would be fetched from a Maven repository at start), and the
    ``connect`` extra needs PySpark 4.0. They are skipped there, saying so."""
    if _PYSPARK_MAJOR is None or _PYSPARK_MAJOR >= 4:
        return
    skip = pytest.mark.skip(
        reason=f"Spark Connect needs PySpark 4.0+ (a local Connect server); this is PySpark {_PYSPARK_MAJOR}.x"
    )
    for item in items:
        if item.get_closest_marker("connect") is not None:
            item.add_marker(skip)


@pytest.fixture(scope="session")
def azurite(tmp_path_factory: pytest.TempPathFactory) -> Iterator[ServerProcess]:
    """Azurite's blob service; its dev account's connection string is ``azurite_connection_string(port)``."""
    server = start_azurite(tmp_path_factory.mktemp("azurite"))
    try:
        yield server
    finally:
        server.stop()


@pytest.fixture(scope="session")
def azurite_connection(azurite: ServerProcess) -> str:
    """The connection string of Azurite's well-known development account."""
    return azurite_connection_string(azurite.port)


@pytest.fixture(scope="session")
def s3_server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[ServerProcess]:
    """moto's S3 server. Sets dummy AWS credentials and region in the environment for the session when none are
    set (moto accepts any; boto3 refuses to sign without some)."""
    defaults = {"AWS_ACCESS_KEY_ID": "testing", "AWS_SECRET_ACCESS_KEY": "testing", "AWS_DEFAULT_REGION": "us-east-1"}
    added = {k: v for k, v in defaults.items() if k not in os.environ}
    os.environ.update(added)
    server = start_moto(tmp_path_factory.mktemp("moto"))
    try:
        yield server
    finally:
        server.stop()
        for key in added:
            os.environ.pop(key, None)


class _TimeWithoutPauses:
    """``time`` for azure-storage-blob's ``_download`` module, whose ``sleep`` returns at once."""

    def __getattr__(self, name: str) -> Any:
        return getattr(time, name)

    @staticmethod
    def sleep(seconds: float) -> None:
        pass


@pytest.fixture(scope="session", autouse=True)
def _azure_download_retries_without_fixed_pause() -> Iterator[None]:
    """azure-storage-blob reads the body of a download again after a hard-coded ``time.sleep(1)`` when the reply was
    cut (``azure.storage.blob._download``; not its retry policy, which the Azure store turns off, and not
    configurable). The fault tests cut download replies on purpose, hundreds of times; the fault proxy's faults do
    not depend on time, so the pause changes no outcome, it only costs a second each. The SDK's requests, its
    re-reads and their number are unchanged."""
    from azure.storage.blob import _download

    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(_download, "time", _TimeWithoutPauses())
        yield


@pytest.fixture(scope="session", autouse=True)
def _botocore_reads_its_models_once() -> Iterator[None]:
    """Every S3 store opens its own boto3 session (statebackend.blobstores.s3), and each new session's data loader
    reads and parses botocore's bundled JSON models (the S3 service model, endpoint rules, partitions) again: about
    0.1 s per store, and the suite opens hundreds. Here the sessions share one loader per data path, which caches
    what it has parsed; the models are read-only files, so the clients, their requests and every outcome are the
    same."""
    from botocore import session as botocore_session

    create_loader = botocore_session.create_loader
    loaders: dict[Any, Any] = {}

    def shared_loader(search_paths_string: Any = None) -> Any:
        if search_paths_string not in loaders:
            loaders[search_paths_string] = create_loader(search_paths_string)
        return loaders[search_paths_string]

    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(botocore_session, "create_loader", shared_loader)
        yield


@pytest.fixture(scope="session")
def script_runs(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> Iterator[ScriptRuns]:
    """The scripts the selected tests run in fresh interpreters (tests/script_runs.py), all started in the
    background when the session starts, at most two at a time; those still running at the end are killed."""
    from tests.script_runs import ScriptRuns

    runs = ScriptRuns.of_session(request.session.items, tmp_path_factory.mktemp("script-runs"))
    try:
        yield runs
    finally:
        runs.stop()


@pytest.fixture(scope="session", autouse=True)
def _scripts_started_with_the_session(request: pytest.FixtureRequest) -> None:
    """Start the scripts of the selected tests (``script_runs``) with the session, not when the first test that
    needs one comes up: they run in the background while the tests before theirs run, and are done or nearly so
    when those come (``test_bench_*`` comes early)."""
    if any("script_runs" in getattr(item, "fixturenames", ()) for item in request.session.items):
        request.getfixturevalue("script_runs")


@pytest.fixture
def fast_rechecks(monkeypatch: pytest.MonkeyPatch) -> None:
    """No waiting between re-listings of a short checkpoint listing (the number of re-listings stays the default)."""
    import statebackend.checkpoint.log as checkpoint_log_module

    monkeypatch.setattr(checkpoint_log_module, "RECHECK_DELAYS", (0.0, 0.0, 0.0), raising=False)


@pytest.fixture
def job(tmp_path: Path) -> Iterator[tuple[Path, dict[str, Any], dict[str, dict]]]:
    """A job of the ``statebackend`` command tests on a file:// blob store: its properties file, its config, and the
    state of store ``counts`` per task after each of its runs (two tasks, five runs each)."""
    from tests.backend_helpers import base_config, make_job, write_config

    config = base_config(tmp_path, (tmp_path / "blobs").as_uri())
    states = make_job(config)
    yield write_config(tmp_path / "job.properties", config), config, states
