"""A backup manager's background work: read views held for work that runs later, and stopping that work when the
task is handed over.

- :func:`close_when_ready`: a store's ``ChangeSet.read_view()`` is a future (the view opens once the flushed batch
  is in LMDB); work that will not run after all (an aborted commit, a close) must still close it, without waiting.
- :class:`Cancellation`: the flag behind :meth:`~statebackend.contracts.TaskBackupManager.cancel_background`.
  Background work that reads the local store (a snapshot, a compaction) reads its records through
  :meth:`Cancellation.records`, which checks the flag between chunks of
  :data:`~statebackend.concurrency.CANCEL_CHUNK` records, and checks again (:meth:`Cancellation.check`) before it
  uploads or names anything; it then ends with
  :class:`~statebackend.errors.BackgroundWorkCancelled`, having uploaded and named nothing.
"""

from __future__ import annotations

import threading
from collections.abc import Iterable, Iterator
from concurrent.futures import Future
from typing import Protocol, TypeVar

from statebackend.concurrency import until_cancelled
from statebackend.errors import BackgroundWorkCancelled

__all__ = ["Cancellation", "Closeable", "close_when_ready"]

T = TypeVar("T")


class Closeable(Protocol):
    """What :func:`close_when_ready` closes (a ``ReadView``)."""

    def close(self) -> None:
        """Release what it holds (a read view's LMDB read transaction)."""


C = TypeVar("C", bound=Closeable)


def close_when_ready(view: Future[C]) -> None:
    """Close what ``view`` resolves to, now if it has, else as soon as it does (from the thread resolving it); a
    view that failed to open or was cancelled needs nothing. Never waits."""

    def close(done: Future[C]) -> None:
        if not done.cancelled() and done.exception() is None:
            done.result().close()

    view.add_done_callback(close)


class Cancellation:
    """Whether a backup manager's background work must stop (set once, by ``cancel_background``; never cleared: a
    manager is closed right after). Thread-safe."""

    def __init__(self) -> None:
        self._event = threading.Event()

    def cancel(self) -> None:
        """Ask the work to stop (from ``cancel_background``, any thread); idempotent. The work stops at its next
        :meth:`check` or chunk of :meth:`records`; this never waits for it."""
        self._event.set()

    @property
    def cancelled(self) -> bool:
        """Whether :meth:`cancel` was called."""
        return self._event.is_set()

    def error(self, what: str) -> BackgroundWorkCancelled:
        """The error that ends ``what`` (``"background snapshot <blob>"``, ``"store s: compaction"``)."""
        return BackgroundWorkCancelled(f"{what} stopped: the task was handed to another opener")

    def check(self, what: str) -> None:
        """Raise :meth:`error` once cancelled (before work starts, and before it uploads or names anything)."""
        if self.cancelled:
            raise self.error(what)

    def records(self, records: Iterable[T], what: str) -> Iterator[T]:
        """``records``, raising :meth:`error` at the next chunk once cancelled."""
        return until_cancelled(records, lambda: self.cancelled, lambda: self.error(what))
