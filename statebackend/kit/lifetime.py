"""The framework's blob lifetime: the one collector of every backend's blobs (docs/architecture.md, "Blob lifetime").

A backend states its blobs in a :class:`~statebackend.contracts.BlobLifetime` (which blobs a marker references,
where its blobs live, what its running work holds); :class:`BlobCollector` does the rest, with the age rule and the
mark-and-sweep of :mod:`statebackend.kit.gc`:

- **release** (:meth:`BlobCollector.completed`, after each durable checkpoint, on the commit pool): the collector
  remembers what the last ``retained`` checkpoints this process completed name. What a checkpoint that falls out of
  that window named, and no later one names nor the backend holds, is garbage, deleted in one request per store when
  the checkpoint log lets its old checkpoints go (:attr:`CheckpointLog.trims
  <statebackend.checkpoint.CheckpointLog.trims>`), so no checkpoint the log still holds loses a blob. No listing, no
  age: these blobs were named by durable checkpoints of this very writer.
- **sweep** (:meth:`BlobCollector.sweep`, when :meth:`~statebackend.contracts.BlobLifetime.sweep_due`, and at start
  with ``sweep_on_init``): what retention cannot see (the uploads of commits whose checkpoint never landed, of other
  attempts, of earlier processes). The mark is every blob a marker of any checkpoint in the task's log names (any
  attempt's: the log is the task's), plus what the backend holds; each prefix of the store is listed, and an unmarked
  blob goes once old enough by the grace rule (or expired), with a conditional delete where the blob store has one,
  and never after a quarter of the grace period since the mark (:func:`~statebackend.kit.gc.sweep_unreferenced`).
  Just before each batch the backend's holdings are read again, so a blob its work adopted meanwhile stays.

Blobs under a lifetime's ``shared_prefixes`` are never deleted by a task's collector: :func:`sweep_shared` marks
them from the checkpoints of every task of the job (``statebackend gc``).
"""

from __future__ import annotations

import logging
import threading
import weakref
from collections.abc import Callable, Iterable, Sequence
from concurrent.futures import Future
from typing import TYPE_CHECKING, TypeVar

from statebackend.contracts import LifetimeSweep
from statebackend.errors import CorruptDataError, IncompatibleFormatError
from statebackend.kit.gc import FirstSeen, GraceRule, Mark, Swept, mark_referenced, sweep_unreferenced

if TYPE_CHECKING:
    from statebackend.blobstores.base import BlobStore
    from statebackend.checkpoint import CheckpointV2
    from statebackend.contracts import BlobLifetime, StoreMarkers

__all__ = ["BlobCollector", "LifetimeSweep", "collector_of", "mark_markers", "sweep_shared"]

log = logging.getLogger(__name__)

M = TypeVar("M")


class BlobCollector:
    """The collector of one :class:`~statebackend.contracts.BlobLifetime` (one backup manager's blobs); see the
    module docstring. Thread-safe: the commit pool may run two completions at once."""

    def __init__(self, lifetime: BlobLifetime) -> None:
        #: what the backend states about its blobs (the collector asks it at every release and sweep)
        self.lifetime = lifetime
        #: when this collector first saw each unmarked blob of unknown age (rule 2 of the age rule)
        self.first_seen = FirstSeen()
        self._lock = threading.Lock()
        #: (seq, {store: blobs}) of the checkpoints completed (or adopted) last, ascending, at most ``retained``
        self._window: list[tuple[int, dict[str, frozenset[str]]]] = []
        #: per store, what checkpoints that left the window named: deleted at the next trim unless named again
        self._garbage: dict[str, set[str]] = {}
        self._trims_seen = 0
        self._started: Future[object] | None = None

    @property
    def grace(self) -> GraceRule:
        """The age rule with the lifetime's grace period and this collector's first sightings."""
        return GraceRule(self.lifetime.grace_ms, self.first_seen)

    def may_name(self, created_at: float | None) -> bool:
        """Whether the backend may name, in a new checkpoint, a blob no checkpoint it knows durable names and whose
        upload started at ``created_at`` (:meth:`GraceRule.may_name`, now)."""
        return self.grace.may_name(created_at, self.lifetime.now())

    # -- notices from the framework ----------------------------------------------------------------------------------

    def start(self) -> Future[object] | None:
        """Once the manager is initialised: the sweep at start (``sweep_on_init``), queued on the commit pool; its
        future (``None``: none due). Called by the framework; idempotent."""
        lifetime = self.lifetime
        if self._started is not None or not lifetime.sweep_on_init or not lifetime.stores():
            return self._started
        self._started = lifetime.context.executor.submit(self.sweep)
        return self._started

    def adopt(self, seq: int, markers: StoreMarkers) -> None:
        """Remember checkpoint ``seq`` (its markers of this backend) as completed: the one a manager restored, so its
        blobs are released once later checkpoints push it out of the window."""
        self._remember(seq, markers)

    def completed(self, seq: int, markers: StoreMarkers) -> None:
        """Checkpoint ``seq``, whose markers of this manager are ``markers``, is durable and the backend has been told
        (``checkpoint_completed``): remember it, release at a trim, sweep when due. Called by the framework on the
        commit pool; idempotent."""
        self._remember(seq, markers)
        trims = self.lifetime.context.checkpoint_log.trims
        with self._lock:
            trimming = trims != self._trims_seen  # the log lets its old checkpoints go now: their blobs go with them
            self._trims_seen = trims
        if trimming:
            self.release()
        if self.lifetime.sweep_due(seq, markers):
            self.sweep()

    # -- release ------------------------------------------------------------------------------------------------------

    def _remember(self, seq: int, markers: StoreMarkers) -> None:
        named = {store: frozenset(self._referenced(store, marker) or ()) for store, marker in markers.items()}
        retained = max(1, self.lifetime.context.checkpoint_log.retained)
        with self._lock:
            if any(known == seq for known, _ in self._window):
                return  # a repeated notice must not take a slot of the window
            self._window.append((seq, named))
            self._window.sort(key=lambda item: item[0])  # completions may end out of order on a pool
            while len(self._window) > retained:
                _, dropped = self._window.pop(0)
                for store, blobs in dropped.items():
                    self._garbage.setdefault(store, set()).update(blobs)

    def release(self) -> list[str]:
        """Delete the garbage the window let go (see the module docstring): per store, in one request, what no
        checkpoint of the window names and the backend does not hold. Returns what it deleted."""
        lifetime = self.lifetime
        shared = tuple(lifetime.shared_prefixes())
        deleted: list[str] = []
        for store in lifetime.stores():
            with lifetime.guard(store):
                with self._lock:
                    garbage = self._garbage.get(store)
                    if not garbage:
                        continue
                    keep = {blob for _, named in self._window for blob in named.get(store, ())}
                keep.update(lifetime.held_blobs(store))
                with self._lock:
                    garbage -= keep
                    # shared blobs may be named by other tasks' checkpoints: only the job-level sweep decides
                    garbage -= {blob for blob in garbage if shared and blob.startswith(shared)}
                    doomed = sorted(garbage)
                if not doomed:
                    continue
                lifetime.context.blob_store.delete_many(doomed)
                with self._lock:
                    garbage.difference_update(doomed)
                lifetime.released(store, doomed, swept=False)
                deleted.extend(doomed)
        return deleted

    # -- sweep --------------------------------------------------------------------------------------------------------

    def sweep(self, now: float | None = None) -> dict[str, LifetimeSweep]:
        """Mark-and-sweep every store's blobs (see the module docstring); per store, what it did. ``now``: the time
        at which ages are judged (``None``: the lifetime's clock at each blob). Safe to call at any time."""
        from statebackend.checkpoint import CheckpointV2

        lifetime = self.lifetime
        context = lifetime.context
        marked_at = lifetime.now()  # before the listing: the marks show the log as of then, at the latest
        entries = context.checkpoint_log.entries(cached=True)  # its own checkpoints are not read back
        by_store: dict[str, list[str]] = {store: [] for store in lifetime.stores()}
        for entry in entries:
            if isinstance(entry.checkpoint, CheckpointV2):
                for store, marker in entry.checkpoint.markers_for(context.factory_name).items():
                    if store in by_store:
                        by_store[store].append(marker)
        head = entries[-1].checkpoint if entries and isinstance(entries[-1].checkpoint, CheckpointV2) else None
        results: dict[str, LifetimeSweep] = {}
        for store, markers in by_store.items():
            with lifetime.guard(store):
                result = self._sweep_store(store, markers, marked_at, now, head)
                lifetime.swept(store, result)
            results[store] = result
            if result.stopped:
                log.warning(
                    "task %s: %s sweep ran longer than a quarter of the grace period since its mark; stopped (the "
                    "next sweep marks anew)",
                    context.task_name,
                    context.factory_name,
                    extra={"job": context.job_name, "task": context.task_name, "store": store},
                )
                break
        return results

    def _sweep_store(
        self, store: str, markers: Sequence[str], marked_at: float, now: float | None, head: CheckpointV2 | None
    ) -> LifetimeSweep:
        lifetime = self.lifetime
        shared = tuple(lifetime.shared_prefixes())
        mark = mark_markers(
            markers,
            lambda marker: lifetime.referenced_blobs(store, marker),
            at=marked_at,
            also=lifetime.held_blobs(store),
            what=f"store {store}: a marker of the {lifetime.context.factory_name} backend",
        )
        if not mark.complete:
            return LifetimeSweep(store, complete=False)

        def spare(blob: str) -> bool:
            return bool(shared and blob.startswith(shared)) or lifetime.spare(store, blob, head)

        def confirm(blob: str) -> bool:  # still unmarked: work may have adopted it since the mark
            return blob not in set(lifetime.held_blobs(store))

        deleted: list[str] = []
        kept: list[str] = []
        listed: dict[str, frozenset[str]] = {}
        stopped = False
        for prefix in lifetime.prefixes(store):
            gone: list[str] = []
            swept: Swept = sweep_unreferenced(
                lifetime.context.blob_store,
                prefix,
                mark,
                self.grace,
                clock=lifetime.now,
                now=now,
                spare=spare,
                expired=lifetime.expired,
                confirm=confirm,
                on_deleted=gone.append,
            )
            if gone:
                lifetime.released(store, gone, swept=True)
            deleted += swept.deleted
            kept += swept.kept
            listed[prefix] = swept.listed
            if swept.stopped:
                stopped = True
                break
        if deleted:
            log.debug(
                "task %s: %s sweep of store %s deleted %d unreferenced blobs",
                lifetime.context.task_name,
                lifetime.context.factory_name,
                store,
                len(deleted),
                extra={"job": lifetime.context.job_name, "task": lifetime.context.task_name, "store": store},
            )
        return LifetimeSweep(store, tuple(deleted), tuple(kept), listed, stopped=stopped)

    def _referenced(self, store: str, marker: str) -> Iterable[str] | None:
        """The lifetime's ``referenced_blobs``; ``None`` (the mark is incomplete) for a marker that does not decode."""
        return _told(
            lambda: self.lifetime.referenced_blobs(store, marker),
            f"store {store}: a marker of the {self.lifetime.context.factory_name} backend",
        )


def mark_markers(
    markers: Iterable[M],
    referenced: Callable[[M], Iterable[str] | None],
    *,
    at: float,
    also: Iterable[str] = (),
    what: str = "a marker",
) -> Mark:
    """The mark every collector of the framework takes: a task's :class:`BlobCollector` (over its lifetime's
    ``referenced_blobs``) and ``statebackend gc`` (over each backend's admin's). It is
    :func:`~statebackend.kit.gc.mark_referenced`, except that a marker that does not decode, or is of a format this
    release cannot read, makes the mark incomplete (logged, as ``what``) rather than failing the collector: nothing
    is swept on an incomplete mark."""
    return mark_referenced(markers, lambda marker: _told(lambda: referenced(marker), what), at=at, also=also)


def _told(referenced: Callable[[], Iterable[str] | None], what: str) -> Iterable[str] | None:
    """``referenced()``; ``None`` (cannot tell) when the marker does not decode or is of an unreadable format."""
    try:
        return referenced()
    except (CorruptDataError, IncompatibleFormatError) as exc:
        log.warning("%s cannot be read (%s); its blobs are left alone", what, exc)
        return None


def sweep_shared(
    blob_store: BlobStore,
    prefix: str,
    markers: Iterable[tuple[str, str]],
    referenced: Callable[[str, str], Iterable[str] | None],
    rule: GraceRule,
    *,
    marked_at: float,
    clock: Callable[[], float],
) -> Swept:
    """The job-level sweep of blobs shared across stores or tasks (a lifetime's ``shared_prefixes``): ``markers``
    are ``(store, marker)`` of every checkpoint of every task of the job, listed after ``marked_at`` (the clock read
    before the first task's log was listed); ``referenced(store, marker)`` the backend's admin's
    ``referenced_blobs``. An unmarked blob under ``prefix`` goes once old enough by ``rule``, and nothing goes when a
    marker's blobs cannot be told."""
    mark = mark_referenced(list(markers), lambda item: referenced(*item), at=marked_at)
    return sweep_unreferenced(blob_store, prefix, mark, rule, clock=clock)


_collectors: weakref.WeakKeyDictionary[BlobLifetime, BlobCollector] = weakref.WeakKeyDictionary()
_collectors_lock = threading.Lock()


def collector_of(lifetime: BlobLifetime) -> BlobCollector:
    """The framework's collector of ``lifetime``'s blobs: one per lifetime, made on first use (the commit manager's
    calls and a backend's own ``sweep()`` share it, with its first sightings of unmarked blobs)."""
    with _collectors_lock:
        collector = _collectors.get(lifetime)
        if collector is None:
            collector = _collectors[lifetime] = BlobCollector(lifetime)
        return collector
