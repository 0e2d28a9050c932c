"""The background applier: writes a store's flushed batches into LMDB off the task thread, in flush order.

Contract:

- "Pending" means exactly this here and everywhere in the package: a batch that was flushed (its change set handed
  out) and is not yet in LMDB. ``submit`` queues one and returns at once; two process-wide threads apply them, one
  store's applies in order, each in ONE write transaction that also records the batch's version. A batch may be
  submitted held back (``start=False``): the commit holds its flush's batch until its upload is done, so the LMDB
  write (CPU, page copies, I/O) does not run beside the encoding and fsyncs the commit waits for; a read view of it,
  ``start``, or any later apply releases it.
- Readers take ``pending`` (a tuple, replaced and never mutated) before they read LMDB; an entry leaves it only after
  its transaction committed. So a reader sees a pending batch in the overlay or in LMDB (or both, equal), never in
  neither.
- ``apply_all`` applies whatever is pending now and waits for it (whoever must see LMDB at a version calls it). A
  failed apply is kept: every later ``apply_all`` and ``raise_error`` raise ``StorageError`` with it as the cause,
  and every waiting view request fails with it; the store must be reopened.
- ``view_at(batch)`` is a future read view of exactly that batch's version, opened under the apply lock right after
  its transaction commits (nothing writes in between), or at once when it already has.
- Two locks: ``lock`` is held while LMDB is written and while the views asked of a just-applied version are opened;
  the state lock guards only the bookkeeping (the pending tuple, view requests, the error), so submitting and asking
  a view never wait for an apply.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor
from pathlib import Path
from typing import Any

import attrs

from statebackend.concurrency import SharedPools
from statebackend.errors import StateBackendError, StorageError
from statebackend.store.batch import SortedBatch
from statebackend.store.env import LocalVersion
from statebackend.store.view import ReadView

log = logging.getLogger("statebackend.store")


@attrs.define(eq=False)
class PendingBatch:
    """A flushed batch on its way into LMDB: its records (sorted on first use), the batch dict itself (the overlay reads
    it) and the view requests waiting for it."""

    version: LocalVersion
    sorted_batch: SortedBatch
    index: dict[bytes, Any]
    applied: bool = False
    view_requests: list[Future[ReadView]] = attrs.field(factory=list)

    @property
    def records(self) -> list[tuple[bytes, bytes | None]]:
        return self.sorted_batch.records()


_applier_pools = SharedPools("statebackend-apply")


#: threads of the process-wide applier pool
APPLIER_THREADS = 2


def _applier_pool() -> ThreadPoolExecutor:
    """The process-wide threads that apply flushed batches to LMDB (one store's applies are serialized by its lock)."""
    return _applier_pools.get(APPLIER_THREADS)


class Applier:
    """The pending batches of one store and their way into LMDB. See the module docstring."""

    def __init__(
        self,
        name: str,
        path: Path,
        write: Callable[[PendingBatch], None],
        open_view: Callable[[], ReadView],
    ) -> None:
        self.name = name
        self.path = path
        self._write = write  # one write transaction: the batch's records and its version
        self._open_view = open_view
        #: pending batches, oldest first; replaced (never mutated) so readers can take it unlocked
        self.pending: tuple[PendingBatch, ...] = ()
        #: serializes applies with every other LMDB write of the store
        self.lock = threading.RLock()
        #: guards pending, each batch's applied flag and view requests, error and closed; never held across LMDB I/O
        self._state_lock = threading.Lock()
        self.error: BaseException | None = None
        self.closed = False

    def submit(self, batch: PendingBatch, *, start: bool = True) -> None:
        """Queue ``batch`` behind the pending ones and have the background threads apply it; with ``start=False`` it
        waits (in the overlay) for :meth:`start`, for a read view of it, or for anything that applies what is
        pending (a later submit, ``apply_all``, a spill, close)."""
        with self._state_lock:
            self.pending = (*self.pending, batch)
        if start:
            self.start()

    def start(self) -> None:
        """Have the background threads apply whatever is pending (nothing to do when nothing is)."""
        _applier_pool().submit(self._apply_in_background)

    def apply_all(self) -> None:
        """Apply every pending batch, in order (normally done in the background; calling it waits for that). Raises
        the error of an apply that failed."""
        with self.lock:
            while True:
                with self._state_lock:
                    self.raise_error()
                    if self.closed or not self.pending:
                        return
                    batch = self.pending[0]
                try:
                    self._write(batch)
                except BaseException as exc:
                    with self._state_lock:
                        self.error = exc
                        self._fail_view_requests(exc)  # every waiting batch: none of them can be applied now
                    raise
                with self._state_lock:  # bookkeeping first: a view failing to open below cannot re-apply the batch
                    batch.applied = True
                    self.pending = self.pending[1:]
                    requests, batch.view_requests = batch.view_requests, []
                for request in requests:  # still under the lock: nothing has written since, exactly this version
                    try:
                        request.set_result(self._open_view())
                    except BaseException as exc:  # noqa: BLE001 - handed to the waiter, not lost
                        request.set_exception(exc)

    def settle(self) -> None:
        """Before the whole contents are replaced: apply what is pending (so a failed replace leaves the flushed
        state), or, when that apply fails, forget it (the replace overwrites it anyway)."""
        try:
            self.apply_all()
        except StateBackendError:
            self.drop()

    def drop(self) -> None:
        """Forget the pending batches and a failed apply's error."""
        with self.lock, self._state_lock:
            self._fail_view_requests(StateBackendError(f"store {self.name!r} was replaced"))
            self.pending = ()
            self.error = None

    def close(self) -> None:
        """No apply after this; waiting view requests fail."""
        with self.lock, self._state_lock:
            self.closed = True
            self._fail_view_requests(StateBackendError(f"store {self.name!r} was closed"))

    def view_at(self, batch: PendingBatch) -> Future[ReadView]:
        future: Future[ReadView] = Future()
        future.set_running_or_notify_cancel()  # cannot be cancelled: the applier always resolves it
        with self._state_lock:
            if self.closed or self.error is not None or (not batch.applied and batch not in self.pending):
                future.set_exception(
                    StateBackendError(
                        f"store {self.name!r}: no read view of {batch.version}: the store is closed, was replaced, or "
                        f"its flushed batch could not be applied"
                    )
                )
                return future
            waiting = not batch.applied
            if waiting:
                batch.view_requests.append(future)
        if waiting:
            self.start()  # a batch held back from the applier is applied once a view of it is asked for
            return future
        # Already applied. Asked during the sync part of its commit, as documented, nothing can have written since;
        # the version check below catches a caller that asked too late.
        view = self._open_view()
        if view.version != batch.version:
            view.close()
            future.set_exception(
                StateBackendError(
                    f"store {self.name!r}: a read view of {batch.version} was asked after the store moved on"
                )
            )
        else:
            future.set_result(view)
        return future

    def raise_error(self) -> None:
        error = self.error
        if error is not None:
            raise StorageError(
                f"store {self.name!r} at {self.path}: a flushed batch could not be applied to LMDB ({error}); reopen "
                f"the store (restore rebuilds it)"
            ) from error

    def _fail_view_requests(self, exc: BaseException) -> None:
        """Fail every waiting view request (call with the state lock held)."""
        for batch in self.pending:
            requests, batch.view_requests = batch.view_requests, []
            for request in requests:
                if not request.done():
                    request.set_exception(exc)

    def _apply_in_background(self) -> None:
        try:
            self.apply_all()
        except BaseException as exc:  # noqa: BLE001 - kept in error, raised by the store's next operation
            log.error("store %s: applying a flushed batch to LMDB failed: %s", self.name, exc)
