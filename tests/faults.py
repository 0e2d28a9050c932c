"""Fault injection for the blob store tests.

:class:`FaultProxy` is a loopback TCP proxy in front of a real server (Azurite, moto). For a seeded-random fraction
of HTTP requests (or exactly the requests a ``schedule`` names) it injects one fault kind:

- ``RESET_BEFORE``: reset before the request reaches the server;
- ``RESET_AFTER``: reset after the server handled it (the reply is lost: a write may have landed);
- ``CUT_STATUS_LINE`` / ``CUT_HEADERS`` / ``CUT_HEAD``: the reply is cut inside its head (inside the status line;
  after some whole header lines, which http.client mistakes for the end of the head; at a random byte), then closed;
- ``ERROR_5XX_PARTIAL``: the server handled the request, the client gets a 503 whose body is cut short;
- ``CUT_BODY``: the head arrives whole, the body only half of its Content-Length (or of the first chunk);
- ``DELAY``: the request is held back ``delay_s``.

Every kind but ``RESET_BEFORE`` and ``DELAY`` lets the server act first. The proxy sits on the wire rather than in an
SDK's transport so both SDKs meet real faults through their real code paths (http.client, urllib3/requests,
connection pools, partial reads), and one tool serves both.

A request starts when the client sends bytes after the server last spoke a final reply (or first on a connection):
the HTTP/1.1 clients of both SDKs never pipeline, and an interim ``100 Continue`` does not end the request.

:class:`ScriptedBlobStore` wraps a real store and runs a test's hook before each operation, for unit tests of the
retry logic that need exact control (events, not sleeps).
"""

from __future__ import annotations

import contextlib
import random
import re
import selectors
import socket
import struct
import threading
from collections import Counter
from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence
from typing import Self

from statebackend.blobstores.base import BlobInfo, BlobStore

__all__ = ["FAULT_KINDS", "FaultProxy", "ScriptedBlobStore", "fault_requests"]

RESET_BEFORE = "reset_before"
RESET_AFTER = "reset_after"
DELAY = "delay"
#: the server's reply is cut inside its status line, then the connection is closed (FIN)
CUT_STATUS_LINE = "cut_status_line"
#: only the status line arrives (a 2xx says the server acted), then a clean close: every header is missing
CUT_AFTER_STATUS_LINE = "cut_after_status_line"
#: the status line and some whole header lines arrive, then a clean close: a client that takes EOF for the end
#: of the header block (http.client does) sees a reply with headers missing and an empty body
CUT_HEADERS = "cut_headers"
#: the reply is cut at a seeded-random byte inside its head (status line or headers), then closed
CUT_HEAD = "cut_head"
#: the server handled the request; the client gets ``503`` whose body is cut short of its Content-Length
ERROR_5XX_PARTIAL = "error_5xx_partial"
#: the head arrives whole, the body only half of what Content-Length (or the first chunk) promised, then closed
CUT_BODY = "cut_body"

#: every kind a random or scripted fault can take (DELAY aside)
FAULT_KINDS = (
    RESET_BEFORE,
    RESET_AFTER,
    CUT_STATUS_LINE,
    CUT_AFTER_STATUS_LINE,
    CUT_HEADERS,
    CUT_HEAD,
    ERROR_5XX_PARTIAL,
    CUT_BODY,
)
#: kinds that act on the server's reply, so the server has handled the request (like RESET_AFTER)
_REPLY_FAULTS = frozenset(FAULT_KINDS) - {RESET_BEFORE}

#: ``schedule(request_number, request_head) -> kind or None``: which fault the request gets (number from 1)
Schedule = Callable[[int, bytes], str | None]

_PARTIAL_503 = (
    b"HTTP/1.1 503 Service Unavailable\r\nContent-Type: application/xml\r\nContent-Length: 400\r\n"
    b"x-ms-error-code: ServerBusy\r\n\r\n"
    b'<?xml version="1.0" encoding="UTF-8"?>\n<Error><Code>ServerBu'
)


def fault_requests(kind: str, *, match: bytes = b"", nth: Iterable[int] = (1,)) -> Schedule:
    r"""A schedule that gives ``kind`` to the ``nth`` requests (counted from 1) whose head matches the regular
    expression ``match`` (e.g. ``rb"^GET /bucket\?list-type=2"``), and no fault to any other request."""
    wanted = set(nth)
    pattern = re.compile(match)
    seen = 0
    lock = threading.Lock()

    def schedule(number: int, head: bytes) -> str | None:
        nonlocal seen
        if pattern.search(head) is None:
            return None
        with lock:
            seen += 1
            return kind if seen in wanted else None

    return schedule


class FaultProxy:
    """Forwards ``127.0.0.1:<port>`` to ``target``; see the module docstring. Bounded: at most ``max_connections``
    connections (one thread each); ``stop()`` closes everything and joins the threads.

    Random mode: a ``failure_rate`` fraction of requests gets one of ``kinds`` (uniformly, seeded), a
    ``delay_rate`` fraction is held back ``delay_s``. Scripted mode: ``schedule`` decides per request (exact
    control for unit tests, see :func:`fault_requests`); the random draws are then not made."""

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
        kinds: Sequence[str] = (RESET_BEFORE, RESET_AFTER),
        schedule: Schedule | None = None,
    ) -> None:
        unknown = set(kinds) - set(FAULT_KINDS)
        if unknown or not kinds:
            raise ValueError(f"unknown fault kinds {sorted(unknown)}; known: {FAULT_KINDS}")
        self.target = (target_host, target_port)
        self.failure_rate = failure_rate
        self.delay_rate = delay_rate
        self.delay_s = delay_s
        self.kinds = tuple(kinds)
        self.schedule = schedule
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
        # wake the acceptor blocked in accept() and the connection threads blocked in select() now, rather than at
        # their next 0.2 s timeout (a shut-down socket reads as closed; closing alone wakes neither)
        _shutdown(self._listener)
        self._acceptor.join(timeout=5)
        with self._lock:
            sockets = list(self._sockets)
        for sock in sockets:
            _shutdown(sock)
            _close(sock)
        for thread in list(self._threads):
            thread.join(timeout=5)
        self._listener.close()

    def __enter__(self) -> Self:
        return self.start()

    def __exit__(self, *exc_info: object) -> None:
        self.stop()

    def _draw(self, head: bytes) -> str | None:
        with self._lock:
            self.stats["requests"] += 1
            if self.schedule is not None:
                fate = self.schedule(self.stats["requests"], head)
            else:
                roll = self._rng.random()
                if roll < self.failure_rate:
                    # one draw picks the kind (with the two default kinds: the same draws as before kinds existed)
                    fate = self.kinds[min(int(self._rng.random() * len(self.kinds)), len(self.kinds) - 1)]
                elif roll < self.failure_rate + self.delay_rate:
                    fate = DELAY
                else:
                    fate = None
            if fate is not None:
                self.stats[fate] += 1
            return fate

    def _cut_fraction(self) -> float:
        with self._lock:
            return self._rng.random()

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
        method = b""
        reply = b""  # the server's reply buffered while a reply fault waits for its head
        try:
            while not self._stopped.is_set():
                for key, _ in selector.select(timeout=0.2):
                    data = key.fileobj.recv(65536)  # type: ignore[union-attr]
                    if not data:
                        if key.data == "server" and reply:
                            client.sendall(reply)  # the server ended the reply before the fault could act
                        return
                    if key.data == "client":
                        if last_speaker == "server":
                            method = data.split(b" ", 1)[0]
                            fate = self._draw(data)
                            if fate == RESET_BEFORE:
                                _reset(client)
                                return
                            if fate == DELAY and self._stopped.wait(self.delay_s):
                                return
                        last_speaker = "client"
                        upstream.sendall(data)
                        continue
                    if fate not in _REPLY_FAULTS:
                        last_speaker = "client" if _is_interim(data) else "server"  # 100-continue: same request
                        client.sendall(data)
                        continue
                    if fate == RESET_AFTER:
                        if _is_interim(data):
                            client.sendall(data)
                            continue
                        _reset(client)  # the server did the work; the client never hears of it
                        return
                    reply += data
                    while True:
                        head_end = reply.find(b"\r\n\r\n")
                        if head_end < 0 or not _is_interim(reply):
                            break
                        client.sendall(reply[: head_end + 4])  # an interim 1xx reply passes; the fault waits
                        reply = reply[head_end + 4 :]
                    if reply:
                        acted = self._reply_fault(client, fate, method, reply)
                        if acted:
                            return
                        if acted is None:
                            # passed on whole, unharmed: this request is over and the connection is healthy
                            # again. Keeping the reply buffered (or the fault armed) would replay it as the
                            # answer to the next request: a desync no real network produces
                            fate, reply, last_speaker = None, b"", "server"
        finally:
            selector.close()

    def _reply_fault(self, client: socket.socket, fate: str | None, method: bytes, reply: bytes) -> bool | None:
        """Act on the buffered final reply: True when the connection is done (cut and closed), False to wait for
        more of the reply, None when the fault does not apply and the reply was passed on whole."""
        if fate == ERROR_5XX_PARTIAL:
            client.sendall(_PARTIAL_503)
            _close(client)
            return True
        head_end = reply.find(b"\r\n\r\n")
        if head_end < 0:
            return False  # wait for the whole head
        head = reply[: head_end + 2]  # with the last header line's CRLF, without the blank line
        if fate == CUT_STATUS_LINE:
            status_end = head.find(b"\r\n")
            client.sendall(head[: max(1, status_end // 2)])
        elif fate == CUT_AFTER_STATUS_LINE:
            client.sendall(head[: head.find(b"\r\n") + 2])
        elif fate == CUT_HEADERS:
            lines = head.split(b"\r\n")[:-1]  # status line, header lines
            keep = 1 + max(0, (len(lines) - 1) // 2)
            client.sendall(b"".join(line + b"\r\n" for line in lines[:keep]))
        elif fate == CUT_HEAD:
            client.sendall(head[: 1 + int(self._cut_fraction() * (len(head) - 1))])
        else:  # CUT_BODY
            body = reply[head_end + 4 :]
            length = _content_length(head)
            if method == b"HEAD" or length == 0 or (length is None and b"chunked" not in head.lower()):
                # nothing to cut: pass the reply on whole and treat the rest of the connection as healthy
                self.stats["cut_body_not_applicable"] += 1
                client.sendall(reply)
                return None
            wanted = max(1, (length if length is not None else len(body)) // 2)
            if len(body) < wanted and length is not None:
                return False  # wait for more body
            client.sendall(reply[: head_end + 4] + body[:wanted])
        _close(client)
        return True


def _is_interim(reply: bytes) -> bool:
    return reply.startswith((b"HTTP/1.1 1", b"HTTP/1.0 1"))


def _content_length(head: bytes) -> int | None:
    for line in head.split(b"\r\n")[1:]:
        name, _, value = line.partition(b":")
        if name.strip().lower() == b"content-length":
            try:
                return int(value.strip())
            except ValueError:
                return None
    return None


def _reset(sock: socket.socket) -> None:
    """Close with SO_LINGER 0 so the peer gets a TCP RST, as a crashed middlebox would send."""
    with contextlib.suppress(OSError):
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
    _close(sock)


def _shutdown(sock: socket.socket) -> None:
    with contextlib.suppress(OSError):  # not connected (any more)
        sock.shutdown(socket.SHUT_RDWR)


def _close(sock: socket.socket) -> None:
    with contextlib.suppress(OSError):
        sock.close()


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
