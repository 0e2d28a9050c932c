"""A long run of commits through a loopback proxy that fails 10% of requests (resets before and after the server
handled them), on Azurite and on moto's S3 server, with both backends in a dual commit: nothing is lost, and the
state restored from the blob store alone is exactly the model at the last durable checkpoint (issue 4)."""

from __future__ import annotations

import shutil
import uuid
from pathlib import Path

import pytest

from statebackend.errors import CommitError
from statebackend.task import TaskStorage
from statebackend.testing.backend_contract import contents, write_round
from tests.faults import FaultProxy
from tests.servers import ServerProcess, azurite_connection_string
from tests.waiting import scaled

COMMITS = 30


@pytest.fixture(params=[pytest.param("s3", marks=pytest.mark.s3), pytest.param("azure", marks=pytest.mark.azure)])
def server(request: pytest.FixtureRequest) -> tuple[str, ServerProcess]:
    fixture = "s3_server" if request.param == "s3" else "azurite"
    return request.param, request.getfixturevalue(fixture)


def blob_store_keys(kind: str, process: ServerProcess, port: int) -> dict[str, object]:
    container = f"t{uuid.uuid4().hex[:16]}"
    if kind == "s3":
        return {"blob.store.url": f"s3://{container}/state", "blob.store.endpoint.url": f"http://127.0.0.1:{port}"}
    return {
        "blob.store.url": f"az://{container}/state",
        "blob.store.connection.string": azurite_connection_string(port),
    }


@pytest.mark.slow
def test_commits_through_ten_percent_injected_failures_lose_nothing_and_restore_exactly(
    server: tuple[str, ServerProcess], tmp_path: Path
) -> None:
    kind, process = server
    with FaultProxy(process.host, process.port, failure_rate=0.10, seed=20261122) as proxy:
        keys = blob_store_keys(kind, process, proxy.port)
        config: dict[str, object] = {
            "job.name": "job",
            "state.local.dir": str(tmp_path / "local"),
            **keys,
            "blob.store.create.if.missing": True,
            "blob.store.retry.base.delay.ms": 5,
            "blob.store.retry.max.delay.ms": 50,
            "blob.store.retry.max.attempts": 8,
            # the faults are resets: none waits on a timeout, which only guards a hang (a slow server on a loaded
            # machine is not a fault)
            "blob.store.request.timeout.ms": 120_000,
            "stores.counts.backup.factories": "changelog,blobsnapshot",
            "changelog.snapshot.interval.commits": 5,
            "blobsnapshot.compaction.fanout": 3,
            "blobsnapshot.compaction.full.min.bytes": 0,
            "task.checkpoint.retained": 3,
            "task.commit.async.failures.tolerated": COMMITS,
        }
        model: dict[bytes, bytes] = {}
        durable: dict[bytes, bytes] = {}
        failed_commits = 0
        with TaskStorage.open(config, "task-0") as task:
            for round_no in range(COMMITS):
                write_round(task, round_no, model, keys=120)
                try:
                    task.commit_durably({"input": str(round_no)}, timeout=scaled(120))
                    durable = dict(model)
                except CommitError:
                    failed_commits += 1  # nothing is lost: the next commit carries these changes
        assert proxy.stats["reset_before"] > 0 and proxy.stats["reset_after"] > 0
        assert failed_commits <= COMMITS // 10, f"{failed_commits} commits failed despite retries"
    # restore from the blob store alone, straight to the server, by each backend
    direct = blob_store_keys(kind, process, process.port)
    for restore_factory in ("changelog", "blobsnapshot"):
        shutil.rmtree(tmp_path / "local", ignore_errors=True)
        restore_config = {
            **config,
            **direct,
            "blob.store.url": keys["blob.store.url"],
            "stores.counts.restore.factory": restore_factory,
        }
        with TaskStorage.open(restore_config, "task-0") as task:
            assert task.restored is not None
            assert contents(task) == durable
