"""The backend contract suite on real servers: both backends (changelog-delta, blob-snapshot) backing up to Azurite
and to moto's S3 server exactly as they do to the in-memory fake (issue 4: "both backends' full
backup/restore suites pass against Azurite and the S3 server")."""

from __future__ import annotations

import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any, ClassVar

import pytest

from statebackend.blobstores.base import BlobStore, open_blob_store
from statebackend.testing.backend_contract import BackendContract
from tests.servers import ServerProcess


def azure_blobs(connection: str) -> BlobStore:
    store = open_blob_store(
        f"az://t{uuid.uuid4().hex[:20]}/state", {"connection.string": connection, "create.if.missing": True}
    )
    store.create_resources()  # type: ignore[attr-defined]
    return store


def s3_blobs(endpoint: str) -> BlobStore:
    store = open_blob_store(
        f"s3://t-{uuid.uuid4().hex[:20]}/state", {"endpoint.url": endpoint, "create.if.missing": True}
    )
    store.create_resources()  # type: ignore[attr-defined]
    return store


@pytest.mark.azure
@pytest.mark.slow
class TestChangelogOnAzurite(BackendContract):
    backup_factories: ClassVar[str] = "changelog"
    extra_config: ClassVar[dict[str, Any]] = {"changelog.snapshot.interval.commits": 3}

    @pytest.fixture
    def blobs(self, azurite_connection: str) -> Iterator[BlobStore]:
        with azure_blobs(azurite_connection) as store:
            yield store


@pytest.mark.s3
@pytest.mark.slow
class TestChangelogOnS3Server(BackendContract):
    backup_factories: ClassVar[str] = "changelog"
    extra_config: ClassVar[dict[str, Any]] = {"changelog.snapshot.interval.commits": 3}

    @pytest.fixture
    def blobs(self, s3_server: ServerProcess) -> Iterator[BlobStore]:
        with s3_blobs(s3_server.endpoint) as store:
            yield store


_BLOBSNAPSHOT_CONFIG: dict[str, Any] = {
    "stores.counts.restore.factory": "blobsnapshot",
    "blobsnapshot.compaction.fanout": 2,
    "blobsnapshot.compaction.full.min.bytes": 0,
}


@pytest.mark.azure
@pytest.mark.slow
class TestBlobSnapshotOnAzurite(BackendContract):
    backup_factories: ClassVar[str] = "blobsnapshot"
    extra_config: ClassVar[dict[str, Any]] = _BLOBSNAPSHOT_CONFIG

    @pytest.fixture
    def blobs(self, azurite_connection: str) -> Iterator[BlobStore]:
        with azure_blobs(azurite_connection) as store:
            yield store


@pytest.mark.s3
@pytest.mark.slow
class TestBlobSnapshotOnS3Server(BackendContract):
    backup_factories: ClassVar[str] = "blobsnapshot"
    extra_config: ClassVar[dict[str, Any]] = _BLOBSNAPSHOT_CONFIG

    @pytest.fixture
    def blobs(self, s3_server: ServerProcess) -> Iterator[BlobStore]:
        with s3_blobs(s3_server.endpoint) as store:
            yield store


@pytest.mark.s3
@pytest.mark.slow
def test_s3_store_is_opened_from_config_keys_alone(s3_server: ServerProcess, tmp_path: Path) -> None:
    """blob.store.* keys reach the S3 store through Settings: a task commits and restores with no store object."""
    from statebackend.task import TaskStorage

    config = {
        "job.name": "job",
        "state.local.dir": str(tmp_path / "local"),
        "blob.store.url": f"s3://t-{uuid.uuid4().hex[:20]}/state",
        "blob.store.endpoint.url": s3_server.endpoint,
        "blob.store.create.if.missing": "true",
        "blob.store.hedge.after.ms": "2000",
        "stores.counts.backup.factories": "changelog",
    }
    with TaskStorage.open(config, "task-0") as task:
        task.store("counts").put(b"k", b"v")
        task.commit_durably({"input": "1"})
    import shutil

    shutil.rmtree(tmp_path / "local")
    with TaskStorage.open(config, "task-0") as task:
        assert dict(task.store("counts").items()) == {b"k": b"v"}


@pytest.mark.azure
@pytest.mark.slow
def test_azure_store_is_opened_from_config_keys_alone(azurite_connection: str, tmp_path: Path) -> None:
    from statebackend.task import TaskStorage

    config = {
        "job.name": "job",
        "state.local.dir": str(tmp_path / "local"),
        "blob.store.url": f"az://t{uuid.uuid4().hex[:20]}/state",
        "blob.store.connection.string": azurite_connection,
        "blob.store.create.if.missing": True,
        "stores.counts.backup.factories": "changelog",
    }
    with TaskStorage.open(config, "task-0") as task:
        task.store("counts").put(b"k", b"v")
        task.commit_durably({"input": "1"})
    import shutil

    shutil.rmtree(tmp_path / "local")
    with TaskStorage.open(config, "task-0") as task:
        assert dict(task.store("counts").items()) == {b"k": b"v"}
