"""probe_blob_store: the three checks a job's blob store gets when the job is built (exists or can be created,
credentials accepted, writable), each failure naming its check and what to set, never a secret; against file://, a
real Azurite and a real moto S3 server (one of its own with moto's IAM authentication on: the shared one accepts any
key)."""

from __future__ import annotations

import base64
import contextlib
import datetime
import json
import os
import secrets
import shutil
import socket
import stat
import tempfile
import traceback
import urllib.request
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import attrs
import boto3
import pytest
from azure.storage.blob import BlobServiceClient, ContainerSasPermissions, generate_container_sas

from statebackend.config import Settings
from statebackend.errors import StorageError, TransientStorageError
from statebackend.probe import PROBE_MAX_ATTEMPTS, BlobStoreProbeReport, probe_blob_store
from tests.servers import (
    AZURITE_ACCOUNT_KEY,
    AZURITE_ACCOUNT_NAME,
    ServerProcess,
    azurite_connection_string,
    free_port,
    start_moto,
)

JOB = "probejob"


def _settings(url: str, **options: Any) -> Settings:
    return Settings.from_config(
        {"job.name": JOB, "blob.store.url": url, **{f"blob.store.{key}": value for key, value in options.items()}}
    )


def _probe_error(settings: Settings, *, secret: str | None = None) -> StorageError:
    """The probe's error; its message and its printed chain hold no ``secret``."""
    with pytest.raises(StorageError) as caught:
        probe_blob_store(settings)
    if secret is not None:
        printed = "".join(traceback.format_exception(caught.value))
        assert secret not in printed
    return caught.value


def _name() -> str:
    return f"probe-{secrets.token_hex(6)}"


def _assert_checked_everything(report: BlobStoreProbeReport, *, created: bool) -> None:
    assert [step.check for step in report.steps] == [1, 2, 3]
    assert report.steps[0].outcome == ("created" if created else "exists")
    assert report.created is created
    assert report.requests == (5 if created else 4)
    assert report.steps[2].outcome.startswith(f"wrote, read back and deleted '{JOB}/.probe/")
    assert report.steps[2].title == "the store is writable"
    assert report.summary().startswith(f"blob store {report.store} probed: 1 ")


# -- file:// -------------------------------------------------------------------------------------------------------


def test_file_missing_directory_without_create_names_the_key_and_creates_nothing(tmp_path: Path) -> None:
    root = tmp_path / "absent"
    error = _probe_error(_settings(f"file://{root}", **{"create.if.missing": "false"}))
    message = str(error)
    assert "check 1 of 3 (the store exists or can be created)" in message
    assert "does not exist and blob.store.create.if.missing is false" in message
    assert "set blob.store.create.if.missing=true" in message
    assert repr(str(root)) in message
    assert not root.exists()


def test_file_missing_directory_with_create_is_created_and_the_probe_blob_is_gone(tmp_path: Path) -> None:
    root = tmp_path / "made" / "here"
    report = probe_blob_store(_settings(f"file://{root}", **{"create.if.missing": "true"}))
    _assert_checked_everything(report, created=True)
    assert report.steps[1].outcome.startswith("not applicable")
    assert root.is_dir()
    assert list(root.rglob("*")) == []  # the probe blob deleted, its directories pruned


def test_file_existing_directory_takes_four_requests(tmp_path: Path) -> None:
    report = probe_blob_store(_settings(f"file://{tmp_path}", **{"create.if.missing": "false"}))
    _assert_checked_everything(report, created=False)
    assert list(tmp_path.iterdir()) == []


def test_file_directory_that_cannot_be_created_says_so(tmp_path: Path) -> None:
    """A path through a regular file: creation fails for root as for anyone (ENOTDIR)."""
    (tmp_path / "a-file").write_bytes(b"")
    root = tmp_path / "a-file" / "store"
    message = str(_probe_error(_settings(f"file://{root}", **{"create.if.missing": "true"})))
    assert "check 1 of 3" in message
    assert "does not exist and creating it failed" in message
    assert "Not a directory" in message
    assert "every parent must be a directory" in message


def test_file_root_that_is_a_file_says_so(tmp_path: Path) -> None:
    (tmp_path / "a-file").write_bytes(b"kept")
    message = str(_probe_error(_settings(f"file://{tmp_path / 'a-file'}")))
    assert "check 1 of 3" in message
    assert "exists but is not a directory" in message
    assert "point blob.store.url at a directory" in message
    assert (tmp_path / "a-file").read_bytes() == b"kept"


@contextlib.contextmanager
def _as_unprivileged_user() -> Iterator[None]:
    """Permission bits bind the body: as root, it runs with the effective uid and gid of ``nobody`` (root ignores
    mode bits; the real uid stays root, so the effective one is given back after)."""
    if os.geteuid() != 0:
        yield
        return
    import pwd

    nobody = pwd.getpwnam("nobody")
    os.setegid(nobody.pw_gid)
    os.seteuid(nobody.pw_uid)
    try:
        yield
    finally:
        os.seteuid(0)
        os.setegid(0)


def test_file_directory_the_user_may_not_write_fails_the_write_check() -> None:
    """A real EACCES: the directory is mode 0o555, probed as an unprivileged user (as root: effective uid nobody;
    its parent is outside pytest's root-only temp directory so that nobody can reach it)."""
    parent = Path(tempfile.mkdtemp(prefix="statebackend-probe-"))
    try:
        parent.chmod(0o755)
        root = parent / "read-only"
        root.mkdir()
        root.chmod(stat.S_IRUSR | stat.S_IXUSR | stat.S_IRGRP | stat.S_IXGRP | stat.S_IROTH | stat.S_IXOTH)
        with _as_unprivileged_user(), pytest.raises(StorageError) as caught:
            probe_blob_store(_settings(f"file://{root}", **{"create.if.missing": "false"}))
        message = str(caught.value)
        assert "check 3 of 3 (the store is writable)" in message
        assert f"writing the probe blob '{JOB}/.probe/" in message
        assert "Permission denied" in message
        assert f"make {str(root)!r} writable" in message
        assert list(root.iterdir()) == []
    finally:
        shutil.rmtree(parent)


# -- a store the probe knows only by its API (memory://, a plug-in) ------------------------------------------------


def test_store_of_another_scheme_is_checked_by_its_validate_and_the_write_probe() -> None:
    report = probe_blob_store(_settings(f"memory://{_name()}"))
    assert [(step.check, step.outcome) for step in report.steps[:2]] == [
        (1, "validated by the store"),
        (2, "validated with check 1 (the store tells them apart only by its messages)"),
    ]
    assert report.steps[2].outcome.startswith(f"wrote, read back and deleted '{JOB}/.probe/")
    assert report.requests == 4
    assert report.created is False


# -- az:// (Azurite) -----------------------------------------------------------------------------------------------


def test_azure_existing_container_passes_and_leaves_nothing(azurite_connection: str) -> None:
    container = _name()
    service = BlobServiceClient.from_connection_string(azurite_connection)
    service.create_container(container)
    report = probe_blob_store(_settings(f"az://{container}/some/prefix", **{"connection.string": azurite_connection}))
    _assert_checked_everything(report, created=False)
    assert report.steps[1].outcome == "accepted"
    assert list(service.get_container_client(container).list_blob_names()) == []


def test_azure_missing_container_without_create_names_the_key(azurite_connection: str) -> None:
    container = _name()
    error = _probe_error(
        _settings(f"az://{container}/p", **{"connection.string": azurite_connection}), secret=AZURITE_ACCOUNT_KEY
    )
    message = str(error)
    assert "check 1 of 3 (the store exists or can be created)" in message
    assert f"container {container!r} (account {AZURITE_ACCOUNT_NAME}) does not exist" in message
    assert "set blob.store.create.if.missing=true" in message
    service = BlobServiceClient.from_connection_string(azurite_connection)
    assert not service.get_container_client(container).exists()


def test_azure_missing_container_with_create_is_created(azurite_connection: str) -> None:
    container = _name()
    report = probe_blob_store(
        _settings(f"az://{container}", **{"connection.string": azurite_connection, "create.if.missing": "true"})
    )
    _assert_checked_everything(report, created=True)
    service = BlobServiceClient.from_connection_string(azurite_connection)
    assert service.get_container_client(container).exists()


def test_azure_wrong_account_key_is_a_credentials_error_without_the_key(azurite: ServerProcess) -> None:
    wrong_key = base64.b64encode(b"not the key" * 6).decode()
    connection = azurite_connection_string(azurite.port, account_key=wrong_key)
    error = _probe_error(_settings(f"az://{_name()}/p", **{"connection.string": connection}), secret=wrong_key)
    message = str(error)
    assert "check 2 of 3 (the credentials are accepted)" in message
    assert "refused the credentials (403" in message
    assert "blob.store.connection.string" in message
    assert not isinstance(error, TransientStorageError)


def test_azure_read_only_sas_fails_the_write_check(azurite: ServerProcess, azurite_connection: str) -> None:
    container = _name()
    BlobServiceClient.from_connection_string(azurite_connection).create_container(container)
    sas = generate_container_sas(
        AZURITE_ACCOUNT_NAME,
        container,
        account_key=AZURITE_ACCOUNT_KEY,
        permission=ContainerSasPermissions(read=True, list=True),
        expiry=datetime.datetime.now(datetime.UTC) + datetime.timedelta(hours=1),
    )
    settings = _settings(
        f"az://{container}/p", **{"account.url": f"{azurite.endpoint}/{AZURITE_ACCOUNT_NAME}", "credential": sas}
    )
    message = str(_probe_error(settings, secret=sas.split("sig=")[1].split("&")[0]))
    assert "check 3 of 3 (the store is writable)" in message
    assert f"writing the probe blob '{JOB}/.probe/" in message
    assert "a SAS with 'racwdl'" in message


# -- s3:// (moto) --------------------------------------------------------------------------------------------------


def test_s3_existing_bucket_passes_and_leaves_nothing(s3_server: ServerProcess) -> None:
    bucket = _name()
    client = boto3.client("s3", endpoint_url=s3_server.endpoint)
    client.create_bucket(Bucket=bucket)
    report = probe_blob_store(_settings(f"s3://{bucket}/p", **{"endpoint.url": s3_server.endpoint}))
    _assert_checked_everything(report, created=False)
    assert client.list_objects_v2(Bucket=bucket)["KeyCount"] == 0


def test_s3_missing_bucket_without_create_names_the_key(s3_server: ServerProcess) -> None:
    bucket = _name()
    message = str(_probe_error(_settings(f"s3://{bucket}/p", **{"endpoint.url": s3_server.endpoint})))
    assert "check 1 of 3 (the store exists or can be created)" in message
    assert f"bucket {bucket!r} at {s3_server.endpoint} does not exist" in message
    assert "set blob.store.create.if.missing=true" in message


def test_s3_missing_bucket_with_create_is_created(s3_server: ServerProcess) -> None:
    bucket = _name()
    report = probe_blob_store(
        _settings(f"s3://{bucket}", **{"endpoint.url": s3_server.endpoint, "create.if.missing": "true"})
    )
    _assert_checked_everything(report, created=True)
    boto3.client("s3", endpoint_url=s3_server.endpoint).head_bucket(Bucket=bucket)


@attrs.frozen
class _AuthServer:
    """A moto server that checks every request's signature against its IAM users (the shared one accepts any)."""

    server: ServerProcess
    bucket: str
    #: (access key id, secret) of a user allowed everything on S3, and of one that may only list and read
    full: tuple[str, str]
    read_only: tuple[str, str]


@pytest.fixture(scope="module")
def auth_s3(tmp_path_factory: pytest.TempPathFactory) -> Iterator[_AuthServer]:
    server = start_moto(tmp_path_factory.mktemp("moto-auth"))
    try:
        anyone = {
            "endpoint_url": server.endpoint,
            "region_name": "us-east-1",
            "aws_access_key_id": "setup",
            "aws_secret_access_key": "setup",
        }
        iam = boto3.client("iam", **anyone)
        keys = {}
        for user, actions in (("full", ["s3:*"]), ("read-only", ["s3:ListBucket", "s3:GetObject"])):
            iam.create_user(UserName=user)
            policy = {"Version": "2012-10-17", "Statement": [{"Effect": "Allow", "Action": actions, "Resource": "*"}]}
            iam.put_user_policy(UserName=user, PolicyName="s3", PolicyDocument=json.dumps(policy))
            key = iam.create_access_key(UserName=user)["AccessKey"]
            keys[user] = (key["AccessKeyId"], key["SecretAccessKey"])
        bucket = _name()
        boto3.client("s3", **anyone).create_bucket(Bucket=bucket)
        # from now on moto authenticates every request (INITIAL_NO_AUTH_ACTION_COUNT 0)
        request = urllib.request.Request(
            f"{server.endpoint}/moto-api/reset-auth", data=b"0", method="POST", headers={"Content-Type": "text/plain"}
        )  # a form's body is not read
        with urllib.request.urlopen(request, timeout=30) as answer:
            assert json.load(answer)["status"] == "ok"
        yield _AuthServer(server, bucket, keys["full"], keys["read-only"])
    finally:
        server.stop()


def _use_keys(monkeypatch: pytest.MonkeyPatch, access_key: str, secret_key: str) -> None:
    monkeypatch.setenv("AWS_ACCESS_KEY_ID", access_key)
    monkeypatch.setenv("AWS_SECRET_ACCESS_KEY", secret_key)
    for name in ("AWS_SESSION_TOKEN", "AWS_PROFILE", "AWS_ENDPOINT_URL"):
        monkeypatch.delenv(name, raising=False)


def _auth_settings(auth_s3: _AuthServer, bucket: str | None = None) -> Settings:
    return _settings(
        f"s3://{bucket or auth_s3.bucket}/p", **{"endpoint.url": auth_s3.server.endpoint, "region": "us-east-1"}
    )


def test_s3_server_with_authentication_takes_the_right_keys(
    auth_s3: _AuthServer, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The control for the two tests below: with the right keys the same server and bucket pass every check."""
    _use_keys(monkeypatch, *auth_s3.full)
    _assert_checked_everything(probe_blob_store(_auth_settings(auth_s3)), created=False)


def test_s3_wrong_secret_is_a_credentials_error_without_the_secret(
    auth_s3: _AuthServer, monkeypatch: pytest.MonkeyPatch
) -> None:
    access_key, secret_key = auth_s3.full
    wrong_secret = "Wrong" + secret_key[5:]
    _use_keys(monkeypatch, access_key, wrong_secret)
    for bucket in (auth_s3.bucket, _name()):  # a refusal comes before the bucket's existence
        error = _probe_error(_auth_settings(auth_s3, bucket), secret=wrong_secret)
        message = str(error)
        assert "check 2 of 3 (the credentials are accepted)" in message
        assert "refused the credentials (403 SignatureDoesNotMatch)" in message
        assert "AWS_ACCESS_KEY_ID/AWS_SECRET_ACCESS_KEY" in message
        assert secret_key not in message


def test_s3_read_only_policy_fails_the_write_check(auth_s3: _AuthServer, monkeypatch: pytest.MonkeyPatch) -> None:
    _use_keys(monkeypatch, *auth_s3.read_only)
    message = str(_probe_error(_auth_settings(auth_s3), secret=auth_s3.read_only[1]))
    assert "check 3 of 3 (the store is writable)" in message
    assert f"writing the probe blob '{JOB}/.probe/" in message
    assert "AccessDenied" in message
    assert f"allow s3:PutObject, s3:GetObject and s3:DeleteObject on {auth_s3.bucket}/p/*" in message


# -- an endpoint that cannot be reached, or does not answer --------------------------------------------------------


@pytest.fixture
def dummy_aws_keys(monkeypatch: pytest.MonkeyPatch) -> None:
    """Some keys: without any, boto3 refuses to sign and the probe reports missing credentials first."""
    _use_keys(monkeypatch, "dummy-access-key", "dummy-secret-key")


@pytest.mark.usefixtures("dummy_aws_keys")
def test_closed_port_is_unreachable_and_not_a_credentials_problem() -> None:
    port = free_port()
    cases = [
        (
            _settings(f"az://{_name()}/p", **{"connection.string": azurite_connection_string(port)}),
            f"http://127.0.0.1:{port}",
            "blob.store.connection.string (BlobEndpoint)",
        ),
        (
            _settings(f"s3://{_name()}/p", **{"endpoint.url": f"http://127.0.0.1:{port}", "region": "us-east-1"}),
            f"http://127.0.0.1:{port}",
            "blob.store.endpoint.url",
        ),
    ]
    for settings, endpoint, key in cases:
        error = _probe_error(settings, secret=AZURITE_ACCOUNT_KEY)
        message = str(error)
        assert "dummy-secret-key" not in message
        assert "check 1 of 3" in message
        assert f"the endpoint {endpoint}" in message
        assert "is unreachable (no connection" in message
        assert f"{PROBE_MAX_ATTEMPTS} attempts" in message
        assert "this is not a credential problem" in message
        assert key in message
        assert not isinstance(error, TransientStorageError)


@pytest.mark.usefixtures("dummy_aws_keys")
def test_endpoint_that_never_answers_stops_after_the_capped_attempts() -> None:
    """A listening socket that never answers: each attempt ends at blob.store.request.timeout.ms, and the probe
    makes PROBE_MAX_ATTEMPTS of them however many blob.store.retry.max.attempts allows."""
    with socket.socket() as silent:
        silent.bind(("127.0.0.1", 0))
        silent.listen(16)
        endpoint = f"http://127.0.0.1:{silent.getsockname()[1]}"
        settings = _settings(
            f"s3://{_name()}/p",
            **{
                "endpoint.url": endpoint,
                "region": "us-east-1",
                "request.timeout.ms": "200",
                "retry.max.attempts": "20",
            },
        )
        message = str(_probe_error(settings))
    assert "check 1 of 3" in message
    assert f"{endpoint} did not answer (no answer" in message
    assert f"; {PROBE_MAX_ATTEMPTS} attempts)" in message
    assert "this is not a credential problem" in message
    assert "raise blob.store.request.timeout.ms" in message
