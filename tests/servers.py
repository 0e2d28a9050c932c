"""Real storage servers on loopback for the integration tests: Azurite (Azure Blob) and moto's S3 server.

Each server runs as a subprocess on 127.0.0.1 on an ephemeral port (bind port 0, read the port, pass it; a start that
loses the port to another process is retried on a new one), is waited for until it answers HTTP, and is stopped by
its process id (terminate, then kill). Azurite is the npm package ``azurite``, installed on first use into
``<repo>/.test-services/``; missing node or npm is an error that says so, never a skip.
"""

from __future__ import annotations

import http.client
import os
import shutil
import socket
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path

import attrs

from statebackend.testing.deadline import scaled

__all__ = [
    "AZURITE_ACCOUNT_KEY",
    "AZURITE_ACCOUNT_NAME",
    "ServerProcess",
    "ServerStartError",
    "azurite_connection_string",
    "free_port",
    "install_azurite",
    "start_azurite",
    "start_moto",
]

REPO_ROOT = Path(__file__).resolve().parent.parent
SERVICES_DIR = REPO_ROOT / ".test-services"

#: Azurite's well-known development account (public, documented; not a secret).
AZURITE_ACCOUNT_NAME = "devstoreaccount1"
AZURITE_ACCOUNT_KEY = "Eby8vdM02xNOcqFlqUwJPLlmEtlCDXJ1OUzFT50uSRZ6IFsuFq2UVErCz4I6tq/K1SZFPTOtr/KBHBeksoGMGw=="

_START_TIMEOUT_S = 60.0
_PORT_ATTEMPTS = 3


class ServerStartError(RuntimeError):
    """A test server could not be installed or started; the message says what to install or look at."""


def azurite_connection_string(port: int, *, account_key: str = AZURITE_ACCOUNT_KEY, host: str = "127.0.0.1") -> str:
    """The connection string for Azurite's dev account on ``host:port`` (``account_key`` to test a wrong key)."""
    return (
        f"DefaultEndpointsProtocol=http;AccountName={AZURITE_ACCOUNT_NAME};AccountKey={account_key};"
        f"BlobEndpoint=http://{host}:{port}/{AZURITE_ACCOUNT_NAME};"
    )


@attrs.define
class ServerProcess:
    """A running server subprocess. ``stop()`` terminates it by pid, then kills it if it does not exit."""

    name: str
    process: subprocess.Popen[bytes]
    host: str
    port: int
    log_path: Path

    @property
    def endpoint(self) -> str:
        return f"http://{self.host}:{self.port}"

    def log_tail(self, limit: int = 4000) -> str:
        try:
            return self.log_path.read_text(errors="replace")[-limit:]
        except OSError:
            return ""

    def stop(self) -> None:
        if self.process.poll() is not None:
            return
        self.process.terminate()
        try:
            self.process.wait(timeout=10)
        except subprocess.TimeoutExpired:
            self.process.kill()
            self.process.wait(timeout=10)


def free_port(host: str = "127.0.0.1") -> int:
    """A port the OS reports free right now (bind to port 0). Another process may take it: callers retry."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind((host, 0))
        return int(sock.getsockname()[1])


def install_azurite(services_dir: Path = SERVICES_DIR) -> Path:
    """Install Azurite 3 into ``services_dir`` unless it is there; return the path of its blob server script."""
    script = services_dir / "node_modules" / "azurite" / "dist" / "src" / "blob" / "main.js"
    if script.exists():
        return script
    npm = shutil.which("npm")
    if shutil.which("node") is None or npm is None:
        raise ServerStartError(
            "the Azure tests need Azurite, which needs Node.js and npm on PATH; install them "
            "(e.g. apt-get install nodejs npm) and run the tests again"
        )
    services_dir.mkdir(parents=True, exist_ok=True)
    result = subprocess.run(
        [npm, "install", "--no-save", "--no-audit", "--no-fund", "--prefix", str(services_dir), "azurite@3"],
        capture_output=True,
        text=True,
        timeout=600,
        check=False,  # a failure is reported below with npm's output
    )
    if result.returncode != 0 or not script.exists():
        raise ServerStartError(
            f"npm install azurite@3 into {services_dir} failed (exit {result.returncode}):\n{result.stderr[-3000:]}"
        )
    return script


def start_azurite(workdir: Path, services_dir: Path = SERVICES_DIR) -> ServerProcess:
    """Start Azurite's blob service in memory on an ephemeral loopback port and wait until it answers."""
    script = install_azurite(services_dir)
    node = shutil.which("node")
    if node is None:
        raise ServerStartError("the Azure tests need Node.js ('node' on PATH) to run Azurite; install it")

    def command(port: int) -> list[str]:
        return [
            node, str(script),
            "--blobHost", "127.0.0.1", "--blobPort", str(port),
            "--inMemoryPersistence", "--disableTelemetry", "--loose", "--skipApiVersionCheck", "--silent",
        ]  # fmt: skip

    return _start("azurite", command, workdir)


def start_moto(workdir: Path) -> ServerProcess:
    """Start moto's S3-compatible server on an ephemeral loopback port and wait until it answers."""

    def command(port: int) -> list[str]:
        return [sys.executable, "-m", "moto.server", "-H", "127.0.0.1", "-p", str(port)]

    return _start("moto", command, workdir)


def _start(name: str, command: Callable[[int], list[str]], workdir: Path) -> ServerProcess:
    last_log = ""
    for attempt in range(_PORT_ATTEMPTS):
        port = free_port()
        log_path = workdir / f"{name}-{attempt}.log"
        with open(log_path, "wb") as log:
            process = subprocess.Popen(
                command(port),
                stdout=log,
                stderr=subprocess.STDOUT,
                stdin=subprocess.DEVNULL,
                cwd=str(workdir),
                env={**os.environ, "PYTHONUNBUFFERED": "1"},
            )
        server = ServerProcess(name=name, process=process, host="127.0.0.1", port=port, log_path=log_path)
        if _wait_until_answers(server):
            return server
        server.stop()
        last_log = server.log_tail()
        if "EADDRINUSE" not in last_log and "Address already in use" not in last_log:
            break
    raise ServerStartError(
        f"{name} did not start and answer on 127.0.0.1 within {scaled(_START_TIMEOUT_S):.0f}s:\n{last_log}"
    )


def _wait_until_answers(server: ServerProcess) -> bool:
    """Poll until the server answers any HTTP response; False if the process exits or time runs out (a hang guard:
    ``_START_TIMEOUT_S`` on an idle machine, stretched by its load)."""
    deadline = time.monotonic() + scaled(_START_TIMEOUT_S)
    delay = 0.05
    while time.monotonic() < deadline:
        if server.process.poll() is not None:
            return False
        connection = http.client.HTTPConnection(server.host, server.port, timeout=2)
        try:
            connection.request("GET", "/")
            connection.getresponse().read()
            return True
        except (OSError, http.client.HTTPException):
            pass  # not listening yet
        finally:
            connection.close()
        time.sleep(delay)  # polling a starting subprocess: there is no event to wait on
        delay = min(0.5, delay * 2)
    return False
