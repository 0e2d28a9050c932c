"""Garbage collection of a backend's blobs: the one age rule, and mark-and-sweep over what checkpoints reference.

A backend writes blobs before the checkpoint that names them is durable, and a commit may fail in between, so blobs
no checkpoint names pile up (a failed commit's delta or run, a snapshot never adopted, a blob of a store dropped from
the config). Collecting them is a **mark** (every blob a retained checkpoint's marker references, plus what the
collector itself holds) and a **sweep** (delete what is listed under the backend's prefix and not marked). Another
writer may be between its upload and its checkpoint write at any time (a failover owner, a Spark replay), and its
blobs are not marked yet. So a blob is never deleted for being unmarked alone: it must also be older than a **grace
period**. That age is decided by one rule, here, for every collector (the backends' sweeps and ``statebackend gc``):

**The age rule.**

1. A blob's age is ``now - created_at``, where ``created_at`` (:data:`CREATED_AT`) is the blob metadata its writer put
   on it at upload, in unix seconds as a decimal string (:func:`created_at_metadata`), taken *before* the upload
   starts so no collector ever sees a blob younger than it is. A ``created_at`` in the future (the writer's clock is
   ahead of the collector's) counts as age 0: clock skew makes a blob look younger, never older. The grace period
   must therefore cover the skew the other way: a writer whose clock lags the collector's by ``d`` has its blobs look
   ``d`` older.
2. When the age cannot be read (the blob store keeps no metadata, the blob has no ``created_at``, or its value is not
   a number), the age is **unknown** and is counted from the first time this collector saw the blob unmarked
   (:class:`FirstSeen`): a blob existed at least since it was first listed, so that count never exceeds its true age,
   and an unknown-age blob is collected one grace period after a collector first met it, never sooner. A collector
   that keeps no memory between runs (``statebackend gc``, one process per run) sees every such blob for the first
   time now, and keeps it, whatever the grace period; it reports it as of unknown age.
3. A blob is **old enough** to delete when its age (known, or counted from the first sighting) is at least the grace
   period. With a grace period of 0 the guard is off: every unmarked blob a collector with memory sees goes.
4. A blob the collector cannot find any more (deleted meanwhile) is never "old enough": nothing is deleted on the
   strength of a reply about another blob.

Two bounds make the grace period a guarantee for a writer that names a blob no durable checkpoint names yet (a delta
of a failed commit reused later, a found run): a sweep stops deleting once a quarter of the grace period has passed
since its mark (:meth:`GraceRule.sweep_deadline`: its marks may be stale by then), and a writer names such a blob only
while it is younger than half the grace period (:meth:`GraceRule.may_name`), so a checkpoint written within a
quarter of the grace period of that check is never swept from under it.

**A blob written again is not swept.** A writer may write an old blob again (the same content, a fresh age) to
name it (blob-snapshot's content-addressed runs, an adopted compaction; changelog's deltas re-sent after an earlier
try landed long ago), possibly just after a sweep judged the old version by its ``head``. Where the blob store can
(:attr:`~statebackend.blobstores.base.BlobStore.supports_conditional_delete`: memory, ``file://``, Azure, S3), the
sweep deletes each blob on condition that it is still the version its ``head`` saw
(:meth:`~statebackend.blobstores.base.BlobStore.delete_if_unchanged`): the rewrite is kept, whenever it lands. On a
store whose version is a digest of the bytes (``versions_follow_bytes``: S3, whose ETag is their MD5) that holds
because every write of a name that may be written again carries bytes of its own: the framework's formats end in a
nonce trailer (``statebackend.recordfile.nonce``) that every rewrite renews, so a rewrite has a new ETag and the
race is closed there as on Azure. A writer that writes the same bytes again under one name (a backend of its own,
such as a content-addressed one; a local copy an older release wrote without the trailer) is still not told apart
there, so on such a store a doomed blob also waits at most :data:`SWEEP_BATCH_WAIT_S` in its batch (free on S3,
whose conditional deletes are one request a name anyway), as does every blob deleted plainly (a store without
metadata, which gets no ``head``; a blob whose ``head`` gives no version): that bounds those races without closing
them.

The mark is only as good as the listing of checkpoints it came from: build it from the task's
:class:`~statebackend.checkpoint.CheckpointLog`, whose listings never show less than the newest checkpoint the task
knows durable (a short listing is an error there, never "nothing is referenced"); a marker whose blobs cannot be read
makes the mark incomplete, and an incomplete mark sweeps nothing (:func:`sweep_unreferenced`).
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable, Collection, Iterable, Mapping
from typing import TYPE_CHECKING, TypeVar

import attrs

from statebackend.errors import CorruptDataError, IncompatibleFormatError, NotFoundError

if TYPE_CHECKING:
    from statebackend.blobstores.base import BlobStore
    from statebackend.contracts import StateBackendAdmin

__all__ = [
    "CREATED_AT",
    "SWEEP_BATCH",
    "SWEEP_BATCH_WAIT_S",
    "FirstSeen",
    "GraceRule",
    "Mark",
    "Swept",
    "created_at_metadata",
    "mark_referenced",
    "read_created_at",
    "referenced_by_admin",
    "sweep_unreferenced",
]

log = logging.getLogger(__name__)

M = TypeVar("M")

#: blob metadata key: unix time (seconds, a decimal string) at which the blob's upload started (see the age rule)
CREATED_AT = "created_at"

#: blobs a sweep deletes with one ``delete_many`` (S3 takes 1,000 a request, Azure 256: a store splits a bigger one)
SWEEP_BATCH = 1000
#: seconds a doomed blob may wait in a sweep's batch after the ``head`` that judged it, on a blob store without
#: conditional deletes (or for a blob whose ``head`` gave no version): a writer may write an old blob again (fresh
#: age) to name it, and a delete sent later than its judgment would take the fresh blob with it; the wait keeps that
#: window this short (plus the request's own time). Where the store deletes on condition that the blob is unchanged
#: (``supports_conditional_delete``), a rewrite is kept however late the batch goes, so such a batch does not wait
#: on this: it goes when full, or at the end of the listing (the deadline is checked before each batch either way);
#: except where versions follow the bytes (S3): the framework's rewrites carry a fresh nonce, so a new ETag, but a
#: writer that writes the same bytes again (a backend of its own, a copy an older release wrote) is not told apart
SWEEP_BATCH_WAIT_S = 0.1


def created_at_metadata(now: float) -> dict[str, str]:
    """The metadata a writer puts on a blob it uploads at ``now`` (unix seconds, read *before* the upload starts):
    ``{CREATED_AT: "<now with 3 decimals>"}``. Merge a backend's own keys into it; pass nothing to a blob store whose
    ``supports_metadata`` is false."""
    return {CREATED_AT: f"{now:.3f}"}


def read_created_at(metadata: Mapping[str, str]) -> float | None:
    """A blob's ``created_at`` in unix seconds, or ``None`` when the metadata has none or an unreadable one (logged:
    the blob's age is then unknown, rule 2)."""
    value = metadata.get(CREATED_AT)
    if value is None:
        return None
    try:
        return float(value)
    except ValueError:
        log.warning("blob metadata %s=%r is not a time; the blob's age is unknown", CREATED_AT, value)
        return None


class FirstSeen:
    """When a collector first saw each blob whose age it could not read (rule 2 of the age rule). Thread-safe; one
    per collector that lives across sweeps (a backup manager), shared by its sweeps, never by two collectors."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._seen: dict[str, float] = {}

    def since(self, name: str, now: float) -> float:
        """When ``name`` was first seen; ``now`` if this is the first time (then remembered)."""
        with self._lock:
            return self._seen.setdefault(name, now)

    def forget(self, name: str) -> None:
        """Forget ``name`` (deleted, or found to have a readable age)."""
        with self._lock:
            self._seen.pop(name, None)

    def forget_missing(self, prefix: str, listed: Collection[str]) -> None:
        """Forget the blobs under ``prefix`` that a whole listing of it no longer shows (gone meanwhile). Should the
        listing have been short, a blob forgotten here is counted from its next sighting: later, never sooner."""
        with self._lock:
            for name in [n for n in self._seen if n.startswith(prefix) and n not in listed]:
                del self._seen[name]

    def __len__(self) -> int:
        with self._lock:
            return len(self._seen)


@attrs.frozen
class GraceRule:
    """The age rule (module docstring) with one grace period, for one collector.

    ``first_seen`` is the collector's memory of blobs of unknown age; ``None`` for a collector without memory
    between runs, which then never finds such a blob old enough."""

    #: the grace period in milliseconds: an unmarked blob younger than this is left alone (0 turns the guard off)
    grace_ms: int
    #: the collector's first sightings of blobs of unknown age (``None``: a collector without memory)
    first_seen: FirstSeen | None = None

    @property
    def grace_s(self) -> float:
        """The grace period in seconds."""
        return self.grace_ms / 1000.0

    def age(self, name: str, metadata: Mapping[str, str] | None, now: float) -> float | None:
        """The age of blob ``name`` at ``now`` in seconds, never negative: from its ``created_at`` in ``metadata``
        (``None``: the blob store keeps no metadata), else from this collector's first sighting of it, else (no
        memory) ``None``: unknown."""
        created = read_created_at(metadata) if metadata is not None else None
        if created is None:
            if self.first_seen is None:
                return None
            created = self.first_seen.since(name, now)
        return max(0.0, now - created)

    def old_enough(self, name: str, metadata: Mapping[str, str] | None, now: float) -> bool:
        """Whether an unmarked blob may be deleted: its age is known (or counted from its first sighting) and at
        least the grace period."""
        age = self.age(name, metadata, now)
        return age is not None and age >= self.grace_s

    def sweep_deadline(self, marked_at: float) -> float | None:
        """The time after which a sweep whose mark was taken at ``marked_at`` must stop deleting: a quarter of the
        grace period later (a checkpoint written since may name blobs that are old by now). ``None``: no grace
        period, no deadline."""
        return marked_at + self.grace_s / 4 if self.grace_ms > 0 else None

    def may_name(self, created_at: float | None, now: float) -> bool:
        """Whether a writer may name, in a new checkpoint, a blob that no checkpoint it knows durable names (so that
        any sweep may take it for garbage) and whose upload started at ``created_at``: only while its age is known
        and below half the grace period. Sweeps stop a quarter of the grace period after their mark, so a checkpoint
        written within a quarter of it after this check is safe. No grace period: always (the guard is off)."""
        if self.grace_ms <= 0:
            return True
        return created_at is not None and max(0.0, now - created_at) < self.grace_s / 2


@attrs.frozen
class Mark:
    """The blobs that checkpoints reference as of one moment, and whether that is all of them."""

    #: every blob name marked live
    blobs: frozenset[str]
    #: the clock (unix seconds) before the checkpoints were listed: the marks show them as of then, at the latest
    at: float
    #: ``False``: the blobs of some marker could not be told (unreadable, or its backend does not say), so any
    #: unmarked blob may be one of them: nothing may be swept on the strength of this mark
    complete: bool = True

    def plus(self, blobs: Iterable[str]) -> Mark:
        """The same mark with ``blobs`` marked too (what the collector holds itself: its chain, work in progress)."""
        return attrs.evolve(self, blobs=self.blobs | frozenset(blobs))


def mark_referenced(
    markers: Iterable[M], referenced: Callable[[M], Iterable[str] | None], *, at: float, also: Iterable[str] = ()
) -> Mark:
    """The mark of ``markers`` (those of every checkpoint still in the log, and any the collector holds itself):
    the union of ``referenced(marker)`` for each, plus the blobs in ``also`` (its own chain, work in progress).
    ``referenced`` returning ``None`` (the marker's blobs cannot be told) makes the mark incomplete, and no further
    marker is read (an incomplete mark sweeps nothing); an exception it raises propagates (a marker that does not
    decode is an error to report, not a reason to sweep). ``at``: the clock before the markers were listed."""
    blobs = set(also)
    for marker in markers:
        named = referenced(marker)
        if named is None:
            return Mark(frozenset(blobs), at=at, complete=False)
        blobs.update(named)
    return Mark(frozenset(blobs), at=at)


def referenced_by_admin(admin: StateBackendAdmin | None, store: str) -> Callable[[str], set[str] | None]:
    """``referenced`` for :func:`mark_referenced` from a backend's admin
    (:meth:`~statebackend.contracts.StateBackendAdmin.referenced_blobs`): ``None`` (mark incomplete) when there is
    no admin, when it does not say, or when the marker does not decode or is of a format this release cannot read."""

    def referenced(marker: str) -> set[str] | None:
        if admin is None:
            return None
        try:
            return admin.referenced_blobs(store, marker)
        except (CorruptDataError, IncompatibleFormatError):
            return None

    return referenced


@attrs.frozen
class Swept:
    """What one :func:`sweep_unreferenced` did."""

    #: the blobs it deleted, in the order it deleted them
    deleted: tuple[str, ...] = ()
    #: it stopped at its deadline (a quarter of the grace period after the mark) before the end of the listing
    stopped: bool = False
    #: every name its listing of the prefix showed (none when it made no listing): a backend may check its own live
    #: blobs against it without listing again
    listed: frozenset[str] = frozenset()
    #: blobs it judged old but kept because they were written again since its ``head`` (a conditional delete found
    #: them changed): a writer refreshed them to name them
    kept: tuple[str, ...] = ()


def sweep_unreferenced(
    blob_store: BlobStore,
    prefix: str,
    mark: Mark,
    rule: GraceRule,
    *,
    clock: Callable[[], float],
    now: float | None = None,
    spare: Callable[[str], bool] | None = None,
    expired: Callable[[Mapping[str, str], float], bool] | None = None,
    confirm: Callable[[str], bool] | None = None,
    on_deleted: Callable[[str], None] | None = None,
    batch: int = SWEEP_BATCH,
    batch_wait_s: float = SWEEP_BATCH_WAIT_S,
) -> Swept:
    """Delete the blobs listed under ``prefix`` that ``mark`` does not hold and that are old enough by ``rule``.

    - An incomplete mark sweeps nothing (not even a listing is made).
    - ``spare(name)`` true keeps a blob the backend knows more about (a seq beyond the newest checkpoint's); asked
      once per unmarked name listed, before anything else is read of it.
    - Before each candidate the deadline is checked (:meth:`GraceRule.sweep_deadline` of ``mark.at`` against
      ``clock()``): once past, the sweep stops (``Swept.stopped``); sweep again with a new mark.
    - A candidate's metadata is read with ``head`` where the blob store keeps metadata (a blob gone meanwhile is
      skipped); ``expired(metadata, now)`` true (a backend's own expiry) deletes it whatever its age; otherwise the
      age rule decides, at ``now`` (``None``: ``clock()`` at each blob).
    - The doomed blobs are deleted ``batch`` at a time in one request on the services that batch deletes. Where
      the blob store supports it and ``head`` gave the blob's version, with
      :meth:`~BlobStore.delete_if_unchanged`: a blob written again since its ``head`` (to be named) is kept
      (``Swept.kept``, logged at debug), and such a batch goes when full or at the end (on a store whose versions
      follow the bytes, within ``batch_wait_s`` as below: the framework's own rewrites carry a fresh nonce, a
      writer's rewrite of the same bytes does not). Otherwise with
      :meth:`~BlobStore.delete_many`, and a batch goes as soon as its first blob has waited ``batch_wait_s``
      since the ``head`` that judged it (:data:`SWEEP_BATCH_WAIT_S`). Just before each batch goes, the deadline
      is checked again (past it, the batch is dropped and the sweep stops), then ``confirm(name)`` is asked once
      for each blob of the batch, on the sweeping thread: ``False`` keeps that blob (not deleted, not reported:
      the next sweep judges it again), ``True`` lets it go. It exists because the mark is old by then: a caller
      whose running work may adopt a blob after the mark (a chain that names an unmarked blob again, an upload
      that refreshed it) answers from what that work holds *now* (the collector reads the backend's
      :meth:`~statebackend.contracts.BlobLifetime.held_blobs` again). The sweep holds no lock of its own while it
      asks (the caller may hold one around the whole sweep: the collector holds the lifetime's ``guard``); do not
      block in it (the deadline runs on). ``None``: every doomed blob goes.
    - After each batch, each deleted blob's first sighting is forgotten and ``on_deleted(name)`` runs (on the
      sweeping thread). After a whole pass the first sightings of blobs no longer listed under ``prefix`` are
      forgotten.
    """
    if not mark.complete:
        return Swept()
    deadline = rule.sweep_deadline(mark.at)
    listed = list(blob_store.list(prefix))
    shown = frozenset(listed)
    # a version that is a digest of the bytes (S3's ETag) tells apart every rewrite of the framework's formats (each
    # carries a fresh nonce: statebackend.recordfile.nonce), but not a writer's rewrite of the same bytes (a backend
    # of its own; a copy an older release wrote): the batch wait still bounds that race (free on S3: one request a
    # name either way)
    conditional = blob_store.supports_conditional_delete
    follows_bytes = conditional and blob_store.versions_follow_bytes
    deleted: list[str] = []
    kept: list[str] = []
    doomed: dict[str, str | None] = {}  # name -> the version its head saw (None: deleted unconditionally)
    first_judged = 0.0  # time.monotonic() of the judgment of the batch's first blob bound by the wait
    waiting = False  # the batch holds a blob deleted unconditionally (or on a version that follows the bytes)

    def delete_doomed() -> bool:
        """Delete the doomed batch; False (nothing deleted) when the deadline passed meanwhile."""
        nonlocal waiting
        if deadline is not None and clock() > deadline:
            return False
        batch = {name: version for name, version in doomed.items() if confirm is None or confirm(name)}
        doomed.clear()
        waiting = False
        versions = {name: version for name, version in batch.items() if version is not None}
        changed = blob_store.delete_if_unchanged(versions) if versions else frozenset()
        plain = [name for name, version in batch.items() if version is None]
        if plain or not versions:
            blob_store.delete_many(plain)
        if changed:
            log.debug(
                "sweep of %r kept %d blobs written again since they were judged: %s",
                prefix,
                len(changed),
                sorted(changed),
            )
        for name in batch:
            if name in changed:
                kept.append(name)
                continue
            if rule.first_seen is not None:
                rule.first_seen.forget(name)
            if on_deleted is not None:
                on_deleted(name)
            deleted.append(name)
        return True

    def stop() -> Swept:
        return Swept(tuple(deleted), stopped=True, listed=shown, kept=tuple(kept))

    for name in listed:
        if name in mark.blobs or (spare is not None and spare(name)):
            continue
        if deadline is not None and clock() > deadline:
            return stop()
        if waiting and time.monotonic() - first_judged >= batch_wait_s and not delete_doomed():
            return stop()
        metadata: Mapping[str, str] | None = None
        version: str | None = None
        if blob_store.supports_metadata:
            try:
                info = blob_store.head(name)
            except NotFoundError:
                continue  # gone already (rule 4)
            metadata = info.metadata
            version = info.etag if conditional else None
        at = clock() if now is None else now
        if not (
            (expired is not None and metadata is not None and expired(metadata, at))
            or rule.old_enough(name, metadata, at)
        ):
            continue
        if (version is None or follows_bytes) and not waiting:
            first_judged = time.monotonic()
            waiting = True
        doomed[name] = version
        if len(doomed) >= batch and not delete_doomed():
            return stop()
    if doomed and not delete_doomed():
        return stop()
    if rule.first_seen is not None:
        rule.first_seen.forget_missing(prefix, shown)
    return Swept(tuple(deleted), listed=shown, kept=tuple(kept))
