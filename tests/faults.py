"""Fault injection for the blob store tests.

:class:`FaultProxy` is a loopback TCP proxy in front of a real server (Azurite, moto) that, for a seeded-random
fraction of HTTP requests, resets the connection before the request reaches the server, resets it after the server
handled it (the response is lost: the client cannot know whether its write landed), or holds the request back for a
delay. It sits on the wire rather than in an SDK's transport so both SDKs meet real resets and real slowness through
their real code paths (urllib3/requests errors, connection pools, partial reads), and one tool serves both.

A request starts when the client sends bytes after the server last spoke (or first on a connection): the HTTP/1.1
clients of both SDKs never pipeline. A ``100-continue`` body counts as its own request, which only adds draws.

:class:`ScriptedBlobStore` wraps a real store and runs a test's hook before each operation, for unit tests of the
retry logic that need exact control (events, not sleeps).
"""

from __future__ import annotations

import random
import selectors
import socket
import struct
import threading
from collections import Counter
from collections.abc import Callable, Iterator, Mapping
from typing import Self

from statebackend.blobstore import BlobInfo, BlobStore

__all__ = ["FaultProxy", "ScriptedBlobStore"]

RESET_BEFORE = "reset_before"
RESET_AFTER = "reset_after"
DELAY = "delay"


class FaultProxy:
    """Forwards ``127.0.0.1:<port>`` to ``target``; see the module docstring. Bounded: at most ``max_connections``
    connections (one thread each); ``stop()`` closes everything and joins the threads."""

    def __init__(
        self,
        target_host: str,
        target_port: int,
        *,
        failure_rate: float = 0.0,
        delay_rate: float = 0.0,
        delay_s: float = 1.0,
        seed: int = 0,
        max_connections: int = 64,
    ) -> None:
        self.target = (target_host, target_port)
        self.failure_rate = failure_rate
        self.delay_rate = delay_rate
        self.delay_s = delay_s
        self.stats: Counter[str] = Counter()
        self._rng = random.Random(seed)
        self._lock = threading.Lock()
        self._stopped = threading.Event()
        self._slots = threading.BoundedSemaphore(max_connections)
        self._listener = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        self._listener.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        self._listener.bind(("127.0.0.1", 0))
        self._listener.listen(128)
        self._listener.settimeout(0.2)
        self.port = int(self._listener.getsockname()[1])
        self._threads: list[threading.Thread] = []
        self._sockets: set[socket.socket] = set()
        self._acceptor = threading.Thread(target=self._accept_loop, name="fault-proxy-accept", daemon=True)

    @property
    def endpoint(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def start(self) -> Self:
        self._acceptor.start()
        return self

    def stop(self) -> None:
        self._stopped.set()
        self._acceptor.join(timeout=5)
        with self._lock:
            sockets = list(self._sockets)
        for sock in sockets:
            _close(sock)
        for thread in list(self._threads):
            thread.join(timeout=5)
        self._listener.close()

    def __enter__(self) -> Self:
        return self.start()

    def __exit__(self, *exc_info: object) -> None:
        self.stop()

    def _draw(self) -> str | None:
        with self._lock:
            self.stats["requests"] += 1
            roll = self._rng.random()
            if roll < self.failure_rate:
                fate = RESET_BEFORE if self._rng.random() < 0.5 else RESET_AFTER
            elif roll < self.failure_rate + self.delay_rate:
                fate = DELAY
            else:
                return None
            self.stats[fate] += 1
            return fate

    def _accept_loop(self) -> None:
        while not self._stopped.is_set():
            if not self._slots.acquire(timeout=0.2):
                continue
            try:
                client, _ = self._listener.accept()
            except (TimeoutError, OSError):
                self._slots.release()
                continue
            thread = threading.Thread(target=self._serve, args=(client,), name="fault-proxy-conn", daemon=True)
            self._threads = [t for t in self._threads if t.is_alive()] + [thread]
            thread.start()

    def _serve(self, client: socket.socket) -> None:
        upstream: socket.socket | None = None
        try:
            upstream = socket.create_connection(self.target, timeout=10)
            with self._lock:
                self._sockets.update((client, upstream))
            self._pump(client, upstream)
        except OSError:
            pass  # a peer went away: the connection simply ends
        finally:
            for sock in (client, upstream):
                if sock is not None:
                    with self._lock:
                        self._sockets.discard(sock)
                    _close(sock)
            self._slots.release()

    def _pump(self, client: socket.socket, upstream: socket.socket) -> None:
        selector = selectors.DefaultSelector()
        selector.register(client, selectors.EVENT_READ, "client")
        selector.register(upstream, selectors.EVENT_READ, "server")
        last_speaker = "server"
        fate: str | None = None
        try:
            while not self._stopped.is_set():
                for key, _ in selector.select(timeout=0.2):
                    data = key.fileobj.recv(65536)  # type: ignore[union-attr]
                    if not data:
                        return
                    if key.data == "client":
                        if last_speaker == "server":
                            fate = self._draw()
                            if fate == RESET_BEFORE:
                                _reset(client)
                                return
                            if fate == DELAY and self._stopped.wait(self.delay_s):
                                return
                        last_speaker = "client"
                        upstream.sendall(data)
                    else:
                        if fate == RESET_AFTER:
                            _reset(client)  # the server did the work; the client never hears of it
                            return
                        last_speaker = "server"
                        client.sendall(data)
        finally:
            selector.close()


def _reset(sock: socket.socket) -> None:
    """Close with SO_LINGER 0 so the peer gets a TCP RST, as a crashed middlebox would send."""
    try:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
    except OSError:
        pass
    _close(sock)


def _close(sock: socket.socket) -> None:
    try:
        sock.close()
    except OSError:
        pass


class ScriptedBlobStore(BlobStore):
    """Wraps a real store; ``before(operation, name)`` runs before each core operation and may raise, or wait on
    an event, to script a failure or a slow answer. ``after_put(name)`` runs after a put has written."""

    def __init__(self, inner: BlobStore) -> None:
        self.inner = inner
        self.url = inner.url
        self.before: Callable[[str, str], None] = lambda operation, name: None
        self.after_put: Callable[[str], None] = lambda name: None
        self.calls: Counter[str] = Counter()
        self._lock = threading.Lock()

    def _enter(self, operation: str, name: str) -> None:
        with self._lock:
            self.calls[operation] += 1
        self.before(operation, name)

    def put(
        self, name: str, data: bytes, *, create_only: bool = False, metadata: Mapping[str, str] | None = None
    ) -> None:
        self._enter("put", name)
        self.inner.put(name, data, create_only=create_only, metadata=metadata)
        self.after_put(name)

    def get(self, name: str, *, start: int | None = None, end: int | None = None) -> bytes:
        self._enter("get", name)
        return self.inner.get(name, start=start, end=end)

    def delete(self, name: str) -> None:
        self._enter("delete", name)
        self.inner.delete(name)

    def list(self, prefix: str = "") -> Iterator[str]:
        self._enter("list", prefix)
        return self.inner.list(prefix)

    def head(self, name: str) -> BlobInfo:
        self._enter("head", name)
        return self.inner.head(name)
