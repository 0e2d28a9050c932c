"""Blob store and executor wrappers that let a test hold back or fail chosen operations, under the test's control
(events, not sleeps). They wrap a real store or pool, so everything not held or failed behaves exactly like it.

- :class:`ControlledBlobStore`: holds, fails or loses the reply of chosen writes, and counts the bytes written per
  name (what a backend uploads for a commit).
- :class:`GatedExecutor`: a pool whose tasks wait at a gate the test opens (an upload that has not started yet).
"""

from __future__ import annotations

import os
import threading
from collections.abc import Callable, Iterator, Mapping
from concurrent.futures import Executor, Future, ThreadPoolExecutor
from typing import Any

from statebackend.blobstores.base import BlobInfo, BlobStore
from statebackend.errors import TransientStorageError

__all__ = ["ControlledBlobStore", "GatedExecutor"]


class ControlledBlobStore(BlobStore):
    """Wraps ``inner``. Writes whose name matches ``hold`` wait for ``release`` (then fail instead of writing when
    ``fail_held`` is set: a write that never lands); writes matching ``fail`` raise :class:`TransientStorageError`
    while ``failures_left`` > 0. ``write_sizes`` records ``(name, bytes)`` of every write that landed; ``held_names``
    the names of the writes waiting now. Reads whose name matches ``fail_read`` raise :class:`TransientStorageError`
    (a restore that fails half-way). Listings whose prefix matches ``hold_listing`` wait for ``listing_release``
    (``listing_held`` is set when one starts waiting): a cleanup held between its decision and its deletes."""

    def __init__(self, inner: BlobStore) -> None:
        #: the blob store wrapped: every operation ends there
        self.inner = inner
        self.url = inner.url
        self.supports_metadata = inner.supports_metadata
        #: ``hold(name)`` true: a write of ``name`` waits for :attr:`release` (default: none)
        self.hold: Callable[[str], bool] = lambda name: False
        #: set by the test to let held writes go (the backend suite sets it when a test ends)
        self.release = threading.Event()
        #: set when a write starts waiting
        self.held = threading.Event()
        #: how long a held write waits for ``release`` before it fails (a test that forgot to release)
        self.hold_timeout_s = 60.0
        #: held writes raise :class:`TransientStorageError` once released instead of writing
        self.fail_held = False
        #: ``fail(name)`` true: a write of ``name`` raises :class:`TransientStorageError` while :attr:`failures_left`
        #: > 0, writing nothing (default: none)
        self.fail: Callable[[str], bool] = lambda name: False
        #: how many more writes matching :attr:`fail` fail (each failure takes one)
        self.failures_left = 0
        self._lock = threading.Lock()
        #: the name of every write tried, in order (those that failed too)
        self.put_names: list[str] = []
        #: ``(name, bytes)`` of every write that landed, in order
        self.write_sizes: list[tuple[str, int]] = []
        #: writes matching ``lose_reply`` land, then raise :class:`TransientStorageError` (the reply was lost) while
        #: ``replies_to_lose`` > 0
        self.lose_reply: Callable[[str], bool] = lambda name: False
        #: how many more replies of writes matching :attr:`lose_reply` are lost
        self.replies_to_lose = 0
        #: the names of the writes waiting for :attr:`release` now
        self.held_names: list[str] = []
        #: ``fail_read(name)`` true: a read of ``name`` raises :class:`TransientStorageError` (default: none)
        self.fail_read: Callable[[str], bool] = lambda name: False
        #: ``hold_listing(prefix)`` true: a listing of ``prefix`` waits for :attr:`listing_release` (default: none)
        self.hold_listing: Callable[[str], bool] = lambda prefix: False
        #: set by the test to let held listings go
        self.listing_release = threading.Event()
        #: set when a listing starts waiting
        self.listing_held = threading.Event()
        #: the threads whose listing was held, oldest first
        self.listing_threads: list[threading.Thread] = []

    def bytes_written(self, prefix: str = "") -> int:
        """Bytes of every write that landed under ``prefix`` so far."""
        with self._lock:
            return sum(size for name, size in self.write_sizes if name.startswith(prefix))

    def _before_write(self, name: str) -> None:
        with self._lock:
            self.put_names.append(name)
            failing = self.fail(name) and self.failures_left > 0
            if failing:
                self.failures_left -= 1
        if failing:
            raise TransientStorageError(f"injected failure writing {name}")
        if self.hold(name):
            with self._lock:
                self.held_names.append(name)
            self.held.set()
            released = self.release.wait(timeout=self.hold_timeout_s)
            with self._lock:
                self.held_names.remove(name)
            if not released:
                raise TransientStorageError(f"test never released {name}")
            if self.fail_held:
                raise TransientStorageError(f"injected failure writing {name} (held, then failed)")

    def _after_write(self, name: str, size: int) -> None:
        with self._lock:
            self.write_sizes.append((name, size))
            losing = self.lose_reply(name) and self.replies_to_lose > 0
            if losing:
                self.replies_to_lose -= 1
        if losing:
            raise TransientStorageError(f"injected: {name} was written but the reply was lost")

    def put(
        self, name: str, data: bytes, *, create_only: bool = False, metadata: Mapping[str, str] | None = None
    ) -> None:
        self._before_write(name)
        self.inner.put(name, data, create_only=create_only, metadata=metadata)
        self._after_write(name, len(data))

    def put_file(
        self,
        name: str,
        path: str | os.PathLike[str],
        *,
        create_only: bool = False,
        metadata: Mapping[str, str] | None = None,
    ) -> None:
        self._before_write(name)
        self.inner.put_file(name, path, create_only=create_only, metadata=metadata)
        self._after_write(name, os.path.getsize(path))

    def set_metadata(self, name: str, metadata: Mapping[str, str]) -> None:
        """Metadata updates (expiry removal in cleanup) are not uploads: never held or failed here."""
        self.inner.set_metadata(name, metadata)

    def get(self, name: str, *, start: int | None = None, end: int | None = None) -> bytes:
        if self.fail_read(name):
            raise TransientStorageError(f"injected failure reading {name}")
        return self.inner.get(name, start=start, end=end)

    def delete(self, name: str) -> None:
        self.inner.delete(name)

    def list(self, prefix: str = "") -> Iterator[str]:
        if self.hold_listing(prefix):
            with self._lock:
                self.listing_threads.append(threading.current_thread())
            self.listing_held.set()
            if not self.listing_release.wait(timeout=self.hold_timeout_s):
                raise TransientStorageError(f"test never released the listing of {prefix}")
        return self.inner.list(prefix)

    def head(self, name: str) -> BlobInfo:
        return self.inner.head(name)


class GatedExecutor(Executor):
    """A thread pool whose tasks, once :attr:`gate` is cleared, wait for it to be set again before they run.
    ``waiting`` is set when a task starts waiting. Use it as a task's executor (``TaskStorage.open(executor=...)``)
    to keep a commit's upload from starting while the test writes, or to wait until the task a thread runs ended
    (:meth:`task_ended`); close it with :meth:`shutdown`."""

    def __init__(self, workers: int = 4, *, gate_timeout_s: float = 60.0) -> None:
        self._pool = ThreadPoolExecutor(workers, thread_name_prefix="gated")
        #: open (set) at first; a test clears it to hold the tasks that start running while it is clear, and sets it
        #: to let them run
        self.gate = threading.Event()
        self.gate.set()
        #: set when a task starts waiting at the closed gate
        self.waiting = threading.Event()
        #: how long a task waits at the closed gate before it fails with :class:`TransientStorageError` instead of
        #: running (a test that forgot to open it)
        self.gate_timeout_s = gate_timeout_s
        self._running: set[threading.Thread] = set()
        self._changed = threading.Condition()

    def submit(self, fn: Callable[..., Any], /, *args: Any, **kwargs: Any) -> Future[Any]:
        """Run ``fn`` on the inner pool once the gate is open (``waiting`` is set while it waits)."""

        def gated() -> Any:
            with self._changed:
                self._running.add(threading.current_thread())
            try:
                if not self.gate.is_set():
                    self.waiting.set()
                    if not self.gate.wait(self.gate_timeout_s):
                        raise TransientStorageError("the test never opened the executor's gate")
                return fn(*args, **kwargs)
            finally:
                with self._changed:
                    self._running.discard(threading.current_thread())
                    self._changed.notify_all()

        return self._pool.submit(gated)

    def task_ended(self, thread: threading.Thread, timeout: float = 60.0) -> bool:
        """Wait until ``thread`` runs no task of this pool (the one it ran returned); False on timeout."""
        with self._changed:
            return self._changed.wait_for(lambda: thread not in self._running, timeout)

    def shutdown(self, wait: bool = True, *, cancel_futures: bool = False) -> None:
        self.gate.set()
        self._pool.shutdown(wait=wait, cancel_futures=cancel_futures)
