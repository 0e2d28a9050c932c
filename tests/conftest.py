"""Session fixtures shared by the test suite. Keep them generic; add new ones, never remove.

``azurite`` and ``s3_server`` start a real server once per session on an ephemeral loopback port (tests/servers.py)
and stop it by process id at the end. A server that cannot start fails the tests that need it (never a skip).
"""

from __future__ import annotations

import os
from collections.abc import Iterator

import pytest

from tests.servers import ServerProcess, azurite_connection_string, start_azurite, start_moto


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
