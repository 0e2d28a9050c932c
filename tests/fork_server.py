"""A fork server for the crash child (tests/crash_child.py): one interpreter imports it once, then forks a child per
run, so tests that start many children (tests/test_random_kills.py: 13 or 14 a test; tests/test_crash.py and
tests/test_crash_blobsnapshot.py: 4 or 5 a test, through ``crash_child.run_child``) pay the interpreter's start and
the imports once instead of per child (about 0.5 s each here, more on a loaded machine).

A forked child is a real process of its own: it runs ``tests.crash_child.main`` with the arguments and environment
given (exactly that environment, nothing of the server's), in the repository, with stdin and stdout on the null
device and stderr to a file; SIGKILL takes it as it takes a child started by ``subprocess``. Its environment is set
before it runs anything; the crash point (``STATEBACKEND_CRASH_AT``, which :mod:`statebackend.crashpoints` reads at
import) is read again in the child. It ends as a fresh interpreter would (by ``SystemExit``: threads and pool workers
joined, atexit handlers run), never returning to the server's loop. The server is single-threaded (checked before
each fork), and :mod:`random` reseeds itself in a forked child. Only the server can wait for its children:
:class:`ForkedChild` asks it (``poll`` and ``wait``), the server answers with the exit code as :mod:`subprocess` gives
it (``-9`` for SIGKILL)."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
from collections.abc import Mapping
from pathlib import Path

import attrs

__all__ = ["REPO", "ForkServer", "ForkedChild", "run_to_end"]

#: the repository root: the server and its children run there, with it on their path
REPO = Path(__file__).resolve().parent.parent

SERVER = r"""
import json, os, sys, threading, time
import tests.crash_child
import statebackend.crashpoints as crashpoints
for module in sys.argv[1:]:
    __import__(module)


def child(request):
    # never back into the server's loop: a failure before main runs ends the child too, and main's end (or an
    # exception) leaves by SystemExit, so the child exits as a fresh interpreter would (non-daemon threads and pool
    # workers joined, atexit handlers run, stderr flushed) with main's exit code
    try:
        null = os.open(os.devnull, os.O_RDWR)
        err = os.open(request["stderr"], os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
        os.dup2(null, 0)
        os.dup2(null, 1)
        os.dup2(err, 2)
        os.close(null)
        os.close(err)
        os.chdir(request["cwd"])
        os.environ.clear()
        os.environ.update(request["env"])
        crashpoints._target, crashpoints._nth = crashpoints._parse(os.environ.get(crashpoints.ENV_VAR))
        crashpoints._hits = 0
        sys.argv = ["tests.crash_child", *request["argv"]]
        code = tests.crash_child.main(sys.argv)
    except SystemExit:
        raise
    except BaseException:
        import traceback

        traceback.print_exc()
        code = 1
    raise SystemExit(code)


def status(pid, timeout):
    deadline = time.monotonic() + timeout
    while True:
        done, raw = os.waitpid(pid, os.WNOHANG)
        if done:
            return os.waitstatus_to_exitcode(raw)
        if time.monotonic() >= deadline:
            return None
        time.sleep(0.005)


for line in sys.stdin:
    request = json.loads(line)
    if request["op"] == "spawn":
        assert threading.active_count() == 1, "the fork server runs threads: a fork would copy their locks"
        sys.stdout.flush()
        pid = os.fork()
        if pid == 0:
            child(request)
        reply = {"pid": pid}
    else:
        reply = {"code": status(request["pid"], request["timeout"])}
    sys.stdout.write(json.dumps(reply) + "\n")
    sys.stdout.flush()
"""


class ForkServer:
    """The server process; :meth:`spawn` forks a crash child. Use it as a context manager (it stops the server and
    kills any child still running)."""

    def __init__(self, preload: tuple[str, ...] = ()) -> None:
        env = dict(os.environ)
        env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(REPO), env.get("PYTHONPATH")]))
        self._process = subprocess.Popen(
            [sys.executable, "-c", SERVER, *preload],
            cwd=REPO,
            env=env,
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            text=True,
        )
        self._children: list[ForkedChild] = []

    def ask(self, request: dict[str, object]) -> dict[str, object]:
        """One request, its answer."""
        assert self._process.stdin is not None and self._process.stdout is not None
        self._process.stdin.write(json.dumps(request) + "\n")
        self._process.stdin.flush()
        line = self._process.stdout.readline()
        assert line, f"the fork server ended (exit code {self._process.poll()})"
        answer: dict[str, object] = json.loads(line)
        return answer

    def spawn(self, argv: list[str], env: Mapping[str, str], stderr: Path) -> ForkedChild:
        """A crash child running ``python -m tests.crash_child <argv>`` in the repository with exactly ``env``."""
        answer = self.ask({"op": "spawn", "argv": argv, "env": dict(env), "cwd": str(REPO), "stderr": str(stderr)})
        child = ForkedChild(self, int(answer["pid"]), stderr)  # type: ignore[call-overload]
        self._children.append(child)
        return child

    def __enter__(self) -> ForkServer:
        return self

    def __exit__(self, *exc: object) -> None:
        try:
            for child in self._children:
                if child.poll() is None:
                    child.kill()
                    child.wait(30)
        finally:
            assert self._process.stdin is not None
            self._process.stdin.close()
            try:
                self._process.wait(timeout=30)
            except subprocess.TimeoutExpired:
                self._process.kill()
                self._process.wait()


@attrs.define(eq=False)
class ForkedChild:
    """A child of the fork server, as much of :class:`subprocess.Popen` as the kill tests use."""

    server: ForkServer
    pid: int
    stderr_path: Path
    returncode: int | None = None

    def poll(self) -> int | None:
        if self.returncode is None:
            code = self.server.ask({"op": "wait", "pid": self.pid, "timeout": 0})["code"]
            self.returncode = None if code is None else int(code)  # type: ignore[call-overload]
        return self.returncode

    def wait(self, timeout: float) -> int:
        """The exit code, once the child ended; :class:`subprocess.TimeoutExpired` after ``timeout`` seconds."""
        if self.returncode is None:
            code = self.server.ask({"op": "wait", "pid": self.pid, "timeout": timeout})["code"]
            if code is None:
                raise subprocess.TimeoutExpired(f"crash child {self.pid}", timeout)
            self.returncode = int(code)  # type: ignore[call-overload]
        return self.returncode

    def send_signal(self, sig: int) -> None:
        if self.returncode is None:
            os.kill(self.pid, sig)

    def kill(self) -> None:
        self.send_signal(signal.SIGKILL)

    @property
    def stderr(self) -> str:
        """What the child wrote to stderr (so far)."""
        return self.stderr_path.read_text(errors="replace") if self.stderr_path.exists() else ""


def run_to_end(
    server: ForkServer, argv: list[str], env: Mapping[str, str], stderr: Path, timeout: float
) -> ForkedChild:
    """A child run to its end (``timeout`` guards a hang: the child is killed and :class:`AssertionError` raised)."""
    child = server.spawn(argv, env, stderr)
    try:
        child.wait(timeout)
    except subprocess.TimeoutExpired:
        child.kill()
        child.wait(30)
        raise AssertionError(f"the crash child {argv} ran past {timeout:.0f} s:\n{child.stderr[-3000:]}") from None
    return child
