"""The head layout of the checkpoint log, on a blob store with conditional writes: one blob,
``<job>/<task>/checkpoints/HEAD.v3.json``, holding the retained checkpoints, each commit one compare-and-swap of it.

Its jobs for :class:`~statebackend.checkpoint.log.CheckpointLog` (whose module docstring is the contract): reading the
head (again while it is below what is known durable), swapping it at a commit (fenced by the version this writer saw;
a refusal whose write was this writer's own, its reply lost, is told by the entry's nonce), and the first head write
of a task, which moves a per-seq log to the head behind a move marker.
"""

from __future__ import annotations

import logging
import secrets
import threading
import time
from typing import TYPE_CHECKING

from statebackend.checkpoint.checkpoint import CheckpointV2
from statebackend.checkpoint.log_perseq import LogEntry, _PerSeqLog
from statebackend.checkpoint.serde import (
    HEAD_FORMAT,
    CheckpointHead,
    HeadEntry,
    decode_head,
    encode_head,
    encode_moved_marker,
)

from statebackend.errors import AlreadyExistsError, InconsistentStateError, NotFoundError, PreconditionFailedError

if TYPE_CHECKING:
    from statebackend.checkpoint.log import Listing

__all__ = ["HEAD_BLOB"]

# the checkpoint log module's logger: a layout's records keep the name operators configure (docs/operations.md)
log = logging.getLogger("statebackend.checkpoint.log")

#: the name of the checkpoint head under a task's ``checkpoints/`` (stores with conditional writes)
HEAD_BLOB = f"HEAD.v{HEAD_FORMAT}.json"


class _HeadLog(_PerSeqLog):
    """The head layout's part of :class:`~statebackend.checkpoint.log.CheckpointLog` (a base class of it, over the
    per-seq part it moves from: the fields and the public methods named below are the log's)."""

    if not TYPE_CHECKING:  # no instance dict, as the slotted log has none (mypy would refuse its fields here)
        __slots__ = ()
    if TYPE_CHECKING:
        _seen: tuple[str, CheckpointHead, bool] | None
        _nonces: dict[int, set[str]]
        _dropped: set[int]
        _state_lock: threading.Lock

        @property
        def head_name(self) -> str: ...

    def _fenced(self, seq: int, found: int, cause: str = "") -> AlreadyExistsError:
        return AlreadyExistsError(
            f"checkpoint {seq} of task {self.task_name!r} in job {self.job_name!r}: the checkpoint head "
            f"{self.head_name} in {self.blob_store.describe()} is at checkpoint #{found}, not #{seq - 1} as this "
            f"attempt's restore decision saw it; another attempt of the task committed past the state this attempt "
            f"restored, so this attempt's commit is refused (nothing of it is in the log){cause}"
        )

    def _observe(self, version: str, head: CheckpointHead, *, written: bool = False) -> None:
        """Remember the newest head seen (a later read never replaces it with an older one)."""
        with self._state_lock:
            if self._seen is None or head.seq >= self._seen[1].seq:
                self._seen = (version, head, written)

    def _get_head(self) -> tuple[str, CheckpointHead] | None:
        """One GET of the head with its version (None: no head), remembered."""
        try:
            data, version = self.blob_store.get_versioned(self.head_name)
        except NotFoundError:
            return None
        head = decode_head(
            data, source=f"{self.head_name} in {self.blob_store.describe()}", job=self.job_name, task=self.task_name
        )
        self._observe(version, head)
        return version, head

    def _read_head(self, at_least: int = 0) -> CheckpointHead | None:
        """The head (None: the log has none yet: per-seq blobs, or empty), one GET. When it is below ``at_least``
        (or the floor), read again after ``recheck_delays``, then :class:`InconsistentStateError`."""
        at_least = max(at_least, self.floor)
        found = self._get_head()
        for delay in self.recheck_delays:
            if found is None or found[1].seq >= at_least:
                break
            log.warning(
                "checkpoint head %s in %s is at #%d but #%d is known to be durable; reading again in %.1f s",
                self.head_name,
                self.blob_store.describe(),
                found[1].seq,
                at_least,
                delay,
                extra=self._log_extra(at_least),
            )
            time.sleep(delay)
            found = self._get_head()
        if found is None or found[1].seq >= at_least:
            return None if found is None else found[1]
        raise InconsistentStateError(
            f"checkpoint head {self.head_name} in {self.blob_store.describe()} is at checkpoint #{found[1].seq}, but "
            f"checkpoint #{at_least} of this task is known to be durable (the task's local CHECKPOINT-V2 file, the "
            f"checkpoint it restored or its own commit says so). Either the blob store answers stale (retry later), "
            f"or the head was put back from an older copy. Nothing was restored, cleared or written"
        )

    def _state_for(self, previous: int) -> tuple[str, CheckpointHead] | None:
        """The head at seq ``previous`` with its version, which the write of ``previous + 1`` swaps: the one this
        object saw (at its restore decision or its own last commit), else one GET. None: there is no head yet.
        A head past ``previous``: this writer is fenced."""
        with self._state_lock:
            seen = self._seen
        if seen is None or seen[1].seq < previous:
            found = self._get_head()
            if found is None:
                return None
            seen = (found[0], found[1], False)
        if seen[1].seq > previous:
            raise self._fenced(previous + 1, seen[1].seq)
        if seen[1].seq < previous:
            raise InconsistentStateError(
                f"checkpoint head {self.head_name} in {self.blob_store.describe()} is at checkpoint #{seen[1].seq}, "
                f"but this attempt writes #{previous + 1} after #{previous}, which it knows durable: the head was put "
                f"back from an older copy, or the blob store answers stale. Nothing was written"
            )
        return seen[0], seen[1]

    def _new_nonce(self, seq: int) -> str:
        nonce = secrets.token_hex(8)
        with self._state_lock:
            self._nonces.setdefault(seq, set()).add(nonce)
            for old in [s for s in self._nonces if s <= seq - self.retained - self.retention_interval]:
                del self._nonces[old]
        return nonce

    def _ours(self, head: CheckpointHead, seq: int, checkpoint: CheckpointV2) -> bool:
        entry = head.entry(seq)
        with self._state_lock:
            nonces = set(self._nonces.get(seq, ()))
        return entry is not None and entry.nonce in nonces and entry.checkpoint == checkpoint

    def _write_head(self, seq: int, checkpoint: CheckpointV2) -> Listing:
        """Make ``checkpoint`` durable as ``seq`` with one conditional write of the head, swapping the head at
        ``seq - 1`` this writer saw; or, for a log without a head, move the log to one (:meth:`_move_to_head`)."""
        state = self._state_for(seq - 1)
        if state is None:
            return self._move_to_head(seq, checkpoint)
        version, previous = state
        entries = (*previous.entries, HeadEntry(seq, self._new_nonce(seq), checkpoint))
        kept = entries[-self.retained :]
        head = CheckpointHead(self.job_name, self.task_name, kept, previous.moved_at)
        new_version, head = self._swap_head(seq, checkpoint, head, version)
        self._observe(new_version, head, written=True)
        with self._state_lock:
            self._dropped.update(e.seq for e in entries if e.seq < kept[0].seq)
        self._remember(seq, checkpoint)
        log.debug("wrote checkpoint %d into the head %s", seq, self.head_name, extra=self._log_extra(seq))
        return self._head_listing(head)

    def _swap_head(
        self, seq: int, checkpoint: CheckpointV2, head: CheckpointHead, version: str | None
    ) -> tuple[str, CheckpointHead]:
        """One conditional write of ``head`` (which adds ``checkpoint`` as ``seq``) over the head at ``version``
        (None: create it where none is): the new version and the head written. A refusal means another writer
        swapped the head first, unless it was this writer's own earlier attempt whose reply was lost: the head is
        read back once, and the nonce of the entry decides; another writer's head fences this one."""
        try:
            return self.blob_store.put_if(self.head_name, encode_head(head), version=version), head
        except PreconditionFailedError as exc:
            found = self._get_head()
            if found is None or found[1].seq != seq or not self._ours(found[1], seq, checkpoint):
                raise self._fenced(seq, 0 if found is None else found[1].seq, f" ({exc})") from None
            return found

    def _move_to_head(self, seq: int, checkpoint: CheckpointV2) -> Listing:
        """The first head write of a task: its per-seq blob of ``seq`` as a move marker (create-only, fenced by a
        listing as a per-seq commit, so the seq is this writer's), then the head created (``If-None-Match``) with
        the retained per-seq checkpoints imported, then the per-seq blobs below the marker deleted. The marker
        stays: a release without the head refuses it, never restoring the per-seq log left behind in silence."""
        name = self.blob_name(seq, 2)
        marker = encode_moved_marker(checkpoint, self.binding(seq), HEAD_BLOB)
        try:
            self.blob_store.put(name, marker, create_only=True)
        except AlreadyExistsError:
            if not self._holds(name, marker):
                raise self._lost_race(seq, name) from None
        listing = self._list_fence(seq)
        imported = [
            HeadEntry(entry.seq, "imported", entry.checkpoint)
            for entry in self._newest_first({s: v for s, v in listing.items() if s < seq}, cached=True)
        ][: self.retained - 1]
        entries = (*reversed(imported), HeadEntry(seq, self._new_nonce(seq), checkpoint))
        head = CheckpointHead(self.job_name, self.task_name, tuple(entries), seq)
        version, head = self._swap_head(seq, checkpoint, head, None)
        self._observe(version, head, written=True)
        legacy = [self.blob_name(s, v) for s, versions in listing.items() if s < seq for v in sorted(versions)]
        try:
            self.blob_store.delete_many(legacy)
        except Exception as exc:  # noqa: BLE001 - the marker above them is what older releases find first
            log.warning("checkpoint log %s: per-seq blobs left after the move to the head: %s", self.prefix, exc)
        self._remember(seq, checkpoint)
        # a conversion of an existing per-seq log is worth INFO; a new task's first commit is routine
        log.log(
            logging.INFO if imported else logging.DEBUG,
            "checkpoint log %s moved to the head %s at checkpoint #%d (%d checkpoints imported)",
            self.prefix,
            HEAD_BLOB,
            seq,
            len(imported),
            extra=self._log_extra(seq),
        )
        return self._head_listing(head)

    def _head_listing(self, head: CheckpointHead) -> Listing:
        """The head's seqs and those it let go that no retention batch counted yet, as a listing (for
        :meth:`retention_due` and :meth:`retain`: the backends delete their garbage in batches, as before)."""
        with self._state_lock:
            dropped = set(self._dropped)
        return {s: {HEAD_FORMAT} for s in (*dropped, *(e.seq for e in head.entries))}

    def _head_entries(self, head: CheckpointHead) -> list[LogEntry]:
        return [LogEntry(e.seq, e.checkpoint) for e in head.entries]
