"""Thread pools and waiting for futures, written once.

- :class:`SharedPools`: process-wide pools, one per size, created on first use; every user asking for one size
  shares its pool, which bounds them together (the commit pool, the part pool of large transfers, the LMDB appliers,
  the maintenance thread).
- :class:`LazyPool`: a private pool created on first use and shut down by its owner (the resilience layer's attempt
  threads, a backup's upload threads). Restores use a plain ``with ThreadPoolExecutor(...)``: private and short-lived.
- :func:`when_all`: a callback once every future is done, without a thread waiting (commit steps are chained so).
- :func:`gather`: one future for a dict of futures (a backup manager's per-store uploads), resolved by callbacks.
- :func:`run_all`: run tasks on a pool, wait for all, return results in order; the first failure is raised once all
  have ended.
- :func:`until_cancelled`: a stream of records that background work (a snapshot, a compaction) reads, stopping with an
  error at the next chunk once the work is cancelled.
"""

from __future__ import annotations

import concurrent.futures
import threading
from collections.abc import Callable, Iterable, Iterator, Mapping
from concurrent.futures import Future, ThreadPoolExecutor
from itertools import chain, islice
from typing import Any, TypeVar

__all__ = ["CANCEL_CHUNK", "LazyPool", "SharedPools", "gather", "run_all", "until_cancelled", "when_all"]

T = TypeVar("T")
K = TypeVar("K")


class SharedPools:
    """Process-wide pools of one kind (one thread name prefix), one per size, created on first use."""

    def __init__(self, thread_name_prefix: str) -> None:
        #: the name prefix of every thread of these pools
        self.thread_name_prefix = thread_name_prefix
        self._lock = threading.Lock()
        self._pools: dict[int, ThreadPoolExecutor] = {}

    def get(self, size: int) -> ThreadPoolExecutor:
        """The pool of ``size`` threads (the same object for every caller asking for this size)."""
        with self._lock:
            pool = self._pools.get(size)
            if pool is None:
                pool = ThreadPoolExecutor(max_workers=size, thread_name_prefix=self.thread_name_prefix)
                self._pools[size] = pool
            return pool


class LazyPool:
    """A private pool of ``size`` threads, created on first :meth:`get` and shut down by :meth:`close` (a later
    :meth:`get` makes a new one)."""

    def __init__(self, size: int, thread_name_prefix: str) -> None:
        #: the number of threads of the pool
        self.size = size
        #: the name prefix of its threads
        self.thread_name_prefix = thread_name_prefix
        self._lock = threading.Lock()
        self._pool: ThreadPoolExecutor | None = None

    def get(self) -> ThreadPoolExecutor:
        """The pool, created now if there is none (the first call, or the first after :meth:`close`)."""
        with self._lock:
            if self._pool is None:
                self._pool = ThreadPoolExecutor(max_workers=self.size, thread_name_prefix=self.thread_name_prefix)
            return self._pool

    def close(self, *, wait: bool = True, cancel_futures: bool = False) -> None:
        """Shut the pool down (``wait`` for its tasks; ``cancel_futures``: drop those not started), if there is
        one; idempotent."""
        with self._lock:
            pool, self._pool = self._pool, None
        if pool is not None:
            pool.shutdown(wait=wait, cancel_futures=cancel_futures)


def when_all(futures: list[Future[Any]], then: Callable[[], None]) -> None:
    """Call ``then`` once every future is done, from the thread that finished the last one (at once if none)."""
    if not futures:
        then()
        return
    remaining = [len(futures)]
    lock = threading.Lock()

    def one_done(_: Future[Any]) -> None:
        with lock:
            remaining[0] -= 1
            last = remaining[0] == 0
        if last:
            then()

    for future in futures:
        future.add_done_callback(one_done)


def gather(futures: Mapping[K, Future[T]]) -> Future[dict[K, T]]:
    """One future for the dict ``futures``: its results by key once all are done, or the exception of the first
    failed (or cancelled) one, in the dict's order, once all are done. Resolved by callbacks, from the thread that
    finishes the last one: nobody waits on a pool thread (at once for an empty dict)."""
    result: Future[dict[K, T]] = Future()

    def then() -> None:
        errors = [concurrent.futures.CancelledError() if f.cancelled() else f.exception() for f in futures.values()]
        errors = [error for error in errors if error is not None]
        if errors:
            result.set_exception(errors[0])
        else:
            result.set_result({key: f.result() for key, f in futures.items()})

    when_all(list(futures.values()), then)
    return result


def run_all(pool: concurrent.futures.Executor, tasks: Iterable[Callable[[], T]]) -> list[T]:
    """Run all ``tasks`` on ``pool`` and return their results in order; the first failure is raised after all have
    ended (none is left running behind the caller's back)."""
    futures = [pool.submit(task) for task in tasks]
    concurrent.futures.wait(futures)
    return [future.result() for future in futures]


#: records background work reads between two checks that it was not cancelled (a close that cancels it waits for at
#: most about this many records to be processed)
CANCEL_CHUNK = 8192


def until_cancelled(
    records: Iterable[T], cancelled: Callable[[], bool], error: Callable[[], BaseException]
) -> Iterator[T]:
    """``records``, taken :data:`CANCEL_CHUNK` at a time, raising ``error()`` before a chunk once ``cancelled()``
    (one check per chunk: the records themselves flow through C)."""
    source = iter(records)

    def chunks() -> Iterator[list[T]]:
        while True:
            if cancelled():
                raise error()
            chunk = list(islice(source, CANCEL_CHUNK))
            if not chunk:
                return
            yield chunk

    return chain.from_iterable(chunks())
