"""The checkpoint log: where a task's checkpoints are durable, on a blob store.

Layout (docs/formats-checkpoint.md)::

    <job>/<task>/checkpoints/<seq:012d>.v<version>.json

``seq`` numbers a task's checkpoints 1, 2, 3, ... in a linear history. One checkpoint may be written in several format
versions (``task.checkpoint.write.versions``), one blob each.

Commit point: the first blob of a seq (the v2 blob when 2 is written, else the first of ``write_versions``) is
written create-only. Whoever creates it owns the seq: a competing task attempt that writes a different checkpoint
under the same seq gets :class:`AlreadyExistsError` and must not claim its commit. A retry of the very same write
(byte-identical checkpoint) succeeds, so a write whose answer was lost can be repeated. The other versions are plain
puts after the commit point; a crash between them leaves a seq with only the commit-point version, which readers
handle (the highest seq with a version in ``read_versions`` is the latest).

Fencing: the writer says which seq it writes; the seq comes from the restore decision (one above the newest seq the
writer saw when it chose what to restore), never from a later listing. After the create-only write, one listing
checks that no newer seq exists: a writer whose seq was freed by retention after other attempts moved on (a zombie)
removes what it just wrote and gets :class:`AlreadyExistsError`, so its commit is never acknowledged below the head.
The same listing feeds retention.

Every blob is format 2 of :mod:`checkpoint.serde`: checksummed and bound to (job, task, seq); reading a blob under
another name than the one it was written to is :class:`CorruptDataError`.

Short answers: a caller that knows a seq was durable (the task's local ``CHECKPOINT-V2``, the checkpoint it
restored) passes it as ``at_least``; a listing that does not reach it is re-listed after short delays and, if it
still does not, is :class:`InconsistentStateError`, never "no checkpoint". A newest checkpoint that was listed but is
gone when read, with nothing newer, is the same error, never a silent step back to the previous one.

Reads: for a seq, the first version of ``read_versions`` present wins. A blob that does not decode is
:class:`CorruptDataError` naming the blob, never skipped: skipping would silently roll a task back to older state.
Listing parses names strictly and ignores anything else under the prefix (temp files, foreign tools' files).

Thread-safety: a log holds no mutable state of its own; it is as thread-safe as its blob store.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable, Mapping
from typing import Any

import attrs
from statebackend.checkpoint import log_head
from statebackend.checkpoint.checkpoint import CheckpointV2
from statebackend.checkpoint.log_head import _HeadLog
from statebackend.checkpoint.log_perseq import LogEntry
from statebackend.checkpoint.serde import (
    HEAD_FORMAT,
    READABLE_VERSIONS,
    WRITABLE_VERSIONS,
    Binding,
    CheckpointHead,
    encode_checkpoint,
    encode_moved_marker,
)

from statebackend.blobstores.base import BlobStore
from statebackend.errors import ConfigError, NotFoundError

__all__ = ["HEAD_BLOB", "MAX_SEQ", "CheckpointLog", "Listing", "LogEntry"]

#: the name of the checkpoint head under a task's ``checkpoints/`` (stores with conditional writes)
HEAD_BLOB = log_head.HEAD_BLOB

#: seq -> format versions present, from one listing
Listing = dict[int, set[int]]

log = logging.getLogger(__name__)

#: the largest seq that fits the fixed-width name (12 digits)
MAX_SEQ = 10**12 - 1

#: default delays (seconds) before each re-listing of a short listing: about 2.6 s in all before giving up
RECHECK_DELAYS: tuple[float, ...] = (0.1, 0.5, 2.0)


def _versions(what: str, allowed: tuple[int, ...]) -> Callable[[object, attrs.Attribute[Any], object], None]:
    def check(instance: object, attribute: attrs.Attribute[Any], value: object) -> None:
        if (
            not isinstance(value, tuple)
            or not value
            or len(set(value)) != len(value)
            or any(type(v) is not int or v not in allowed for v in value)
        ):
            raise ConfigError(
                f"{what} must be a non-empty list of distinct checkpoint versions among "
                f"{', '.join(map(str, allowed))}; got {value!r}"
            )

    return check


def _as_tuple(value: object) -> object:
    # Lists from parsed config become tuples; anything else is left for the validator to reject with a clear message.
    return tuple(value) if isinstance(value, (list, tuple)) else value


def _name_segment(instance: object, attribute: attrs.Attribute[str], value: str) -> None:
    if not isinstance(value, str) or not value or "/" in value or value in (".", "..") or "\x00" in value:
        raise ConfigError(
            f"checkpoint log {attribute.name} {value!r} must be a non-empty name without '/', NUL, '.' or '..'"
        )


def _positive(instance: object, attribute: attrs.Attribute[int], value: int) -> None:
    if type(value) is not int or value < 1:
        raise ConfigError(f"checkpoint log retention must keep at least 1 checkpoint, got {value!r}")


@attrs.define(eq=False)
class CheckpointLog(_HeadLog):
    """A task's checkpoint history on a blob store. See the module docstring for the contract; the layouts' own
    parts are in :mod:`statebackend.checkpoint.log_perseq` and :mod:`statebackend.checkpoint.log_head`."""

    blob_store: BlobStore
    job_name: str = attrs.field(validator=_name_segment)
    task_name: str = attrs.field(validator=_name_segment)
    write_versions: tuple[int, ...] = attrs.field(
        default=(2,), converter=_as_tuple, validator=_versions("task.checkpoint.write.versions", WRITABLE_VERSIONS)
    )
    read_versions: tuple[int, ...] = attrs.field(
        default=(2, 1), converter=_as_tuple, validator=_versions("task.checkpoint.read.versions", READABLE_VERSIONS)
    )
    retained: int = attrs.field(default=10, validator=_positive)
    #: retention waits until this many seqs are older than the newest ``retained``, then deletes them in one request
    #: (:meth:`retention_due`): a delete request per this many commits instead of one per commit
    retention_interval: int = attrs.field(default=20, validator=_positive, kw_only=True)
    #: how many retention batches the commits through this log object started (:meth:`start_trim`): the built-in
    #: backends delete what their own retention let go with each, so no blob a checkpoint the log still holds names
    #: is deleted before the log lets that checkpoint go
    trims: int = attrs.field(default=0, init=False)
    #: seq -> the checkpoint this log object wrote there (create-only and fenced), newest ``retained +
    #: retention_interval``: a listing's entries it wrote are not read back (a sweep's mark would read each)
    _written: dict[int, CheckpointV2] = attrs.field(factory=dict, init=False, repr=False)
    #: delays (seconds) before re-listing when a listing is shorter than what is known to be durable
    recheck_delays: tuple[float, ...] = attrs.field(factory=lambda: RECHECK_DELAYS)
    #: the newest seq known durable (restored or committed by this task, or named by its local CHECKPOINT-V2):
    #: every listing through this log must reach it (raised by the task as it learns; never lowered)
    floor: int = attrs.field(default=0, kw_only=True)
    #: head mode only: the newest head this object saw (read or written): (version, head, written by this object)
    _seen: tuple[str, CheckpointHead, bool] | None = attrs.field(default=None, init=False, repr=False)
    #: head mode only: seq -> the nonces of this object's writes of it (a read-back tells its own write by them)
    _nonces: dict[int, set[str]] = attrs.field(factory=dict, init=False, repr=False)
    #: head mode only: seqs the head let go that no retention batch has counted yet (see :meth:`retain`)
    _dropped: set[int] = attrs.field(factory=set, init=False, repr=False)
    _state_lock: threading.Lock = attrs.field(factory=threading.Lock, init=False, repr=False)

    @property
    def head_mode(self) -> bool:
        """Whether this log keeps its checkpoints in one head blob, written by compare-and-swap (the blob store
        :attr:`~statebackend.blobstores.base.BlobStore.supports_conditional_put`); else the per-seq blobs."""
        return bool(getattr(self.blob_store, "supports_conditional_put", False))

    @property
    def head_name(self) -> str:
        """The head blob of this task (head mode)."""
        return self.prefix + HEAD_BLOB

    def raise_floor(self, seq: int) -> None:
        """Record that ``seq`` is known durable: later listings that show less are faults."""
        self.floor = max(self.floor, seq)

    @property
    def prefix(self) -> str:
        """The blob name prefix of this task's checkpoints (ends with ``/``)."""
        return f"{self.job_name}/{self.task_name}/checkpoints/"

    def blob_name(self, seq: int, version: int) -> str:
        """The blob that holds checkpoint ``seq`` in format ``version``."""
        _check_seq(seq)
        return f"{self.prefix}{seq:012d}.v{version}.json"

    # -- writing ------------------------------------------------------------------------------------------------

    @property
    def commit_point_version(self) -> int:
        """The version written first, create-only: the blob whose existence makes a checkpoint durable."""
        return 2 if 2 in self.write_versions else self.write_versions[0]

    def binding(self, seq: int) -> Binding:
        """What a blob of checkpoint ``seq`` must say it is."""
        return Binding(self.job_name, self.task_name, seq)

    def write(self, seq: int, checkpoint: CheckpointV2) -> Listing:
        """Make ``checkpoint`` durable as ``seq``: every version of ``write_versions``, commit point first; then check
        that ``seq`` is the newest. Returns that listing (for :meth:`retain`).

        Raises :class:`AlreadyExistsError` when another writer committed a different checkpoint as ``seq``, or when
        the log already holds a newer seq (this writer is fenced; what it wrote is removed again).
        """
        _check_seq(seq)
        if not isinstance(checkpoint, CheckpointV2):
            raise TypeError(f"the checkpoint log writes CheckpointV2, got {type(checkpoint).__name__}")
        if self.head_mode:
            return self._write_head(seq, checkpoint)
        return self._write_per_seq(seq, checkpoint)

    def fence(self, seq: int) -> Listing:
        """Check that ``seq``, which this writer just wrote, is the newest: one listing that must show it. When a
        newer seq exists, this writer's seq was free only because retention removed it after other attempts moved
        on (a zombie): its blobs of ``seq`` are deleted and :class:`AlreadyExistsError` raised. Returns the listing.
        In head mode (a head exists) it checks the head last read instead (no request): past ``seq``, fenced."""
        if self.head_mode:
            with self._state_lock:
                seen = self._seen
            if seen is not None:
                if seen[1].seq > seq:
                    raise self._fenced(seq + 1, seen[1].seq)
                return self._head_listing(seen[1])
        return self._list_fence(seq)

    def holds(self, seq: int, checkpoint: CheckpointV2) -> bool:
        """Whether the commit-point blob of ``seq`` holds exactly ``checkpoint`` (a write of ours that landed). In
        head mode: whether the head (read back once) holds it as ``seq`` with the nonce of one of this object's
        writes; absent there, the per-seq move marker decides (a move whose head write did not land)."""
        if self.head_mode:
            found = self._get_head()
            if found is not None:
                return self._ours(found[1], seq, checkpoint)
            name = self.blob_name(seq, 2)
            return self._holds(name, encode_moved_marker(checkpoint, self.binding(seq), HEAD_BLOB))
        first = 2 if 2 in self.write_versions else self.write_versions[0]
        data = encode_checkpoint(checkpoint if first == 2 else checkpoint.to_v1(), self.binding(seq))
        return self._holds(self.blob_name(seq, first), data)

    # -- reading ------------------------------------------------------------------------------------------------

    def latest(self, at_least: int = 0) -> LogEntry | None:
        """The entry with the highest seq that has a readable version, or None for an empty log. ``at_least``: a seq
        known to be durable; a listing that does not reach it is a fault (see the module docstring)."""
        return self.latest_and_head(at_least)[0]

    def latest_and_head(self, at_least: int = 0) -> tuple[LogEntry | None, int]:
        """:meth:`latest` and the head: the highest seq present in any version (0 for an empty log), from one
        listing. The head is what a writer that restores the entry fences on: it may write only ``head + 1``."""
        return self.find_and_head(lambda entry: True, at_least)

    def find_and_head(self, predicate: Callable[[LogEntry], bool], at_least: int = 0) -> tuple[LogEntry | None, int]:
        """:meth:`find` and the head of the same listing (see :meth:`latest_and_head`). When the newest entry vanished
        between the listing and its read and a re-list found newer ones (a zombie's checkpoint removed by its own
        fencing while the next one landed), the head is at least the entry found: a head below it would fence a writer
        on a log it already knows moved on."""
        if self.head_mode and (blob := self._read_head(at_least)) is not None:
            newest_first = reversed(self._head_entries(blob))
            return next((entry for entry in newest_first if predicate(entry)), None), blob.seq
        listing = self._listing(at_least)
        head = max(listing, default=0)
        found = next((entry for entry in self._newest_first(listing) if predicate(entry)), None)
        if found is not None and found.seq > head:
            head = found.seq
        return found, head

    def head(self, at_least: int = 0) -> int:
        """The highest seq present in any version (0 for an empty log)."""
        if self.head_mode and (blob := self._read_head(at_least)) is not None:
            return int(blob.seq)
        return int(max(self._listing(at_least), default=0))

    def read(self, seq: int) -> LogEntry:
        """Entry ``seq``; :class:`NotFoundError` when no version of ``read_versions`` exists for it."""
        _check_seq(seq)
        if self.head_mode and (blob := self._read_head()) is not None:
            found = blob.entry(seq)
            if found is None:
                raise NotFoundError(
                    f"checkpoint {seq} of task {self.task_name!r} in job {self.job_name!r} not found in the "
                    f"checkpoint head {self.head_name} in {self.blob_store.describe()} (it holds "
                    f"#{blob.entries[0].seq} to #{blob.seq})"
                )
            return LogEntry(seq, found.checkpoint)
        versions = self._listing().get(seq, set())
        entry = self._read_entry(seq, versions)
        if entry is None:
            raise NotFoundError(
                f"checkpoint {seq} of task {self.task_name!r} in job {self.job_name!r} not found in any of the "
                f"read versions {self.read_versions} under {self.prefix} in {self.blob_store.describe()}"
                + (f" (present versions: {sorted(versions)})" if versions else "")
            )
        return entry

    def read_written(self, seq: int) -> LogEntry | None:
        """Entry ``seq`` as this log writes its commit point (:attr:`commit_point_version`), read by name without a
        listing; ``None`` when there is no such blob. For a reader that knows the sequence number a writer took."""
        _check_seq(seq)
        if self.head_mode and (blob := self._read_head()) is not None:
            found = blob.entry(seq)
            return None if found is None else LogEntry(seq, found.checkpoint)
        version = self.commit_point_version
        if version not in self.read_versions:
            raise ConfigError(
                f"task {self.task_name!r}: checkpoints are written as version {version}, which "
                f"task.checkpoint.read.versions {self.read_versions} does not read"
            )
        return self._read_entry(seq, {version})

    def seqs(self) -> list[int]:
        """Seqs that have a readable version, ascending."""
        if self.head_mode and (blob := self._read_head()) is not None:
            return [e.seq for e in blob.entries]
        return sorted(seq for seq, versions in self._listing().items() if versions & set(self.read_versions))

    def entries(self, at_least: int = 0, *, cached: bool = False) -> list[LogEntry]:
        """Every readable entry, ascending by seq. ``cached``: entries this log object wrote itself are not read
        back (a collector's mark: see :meth:`_read_entry`); never for choosing what to restore. In head mode the head
        is read (one GET, like the listing: a mark must see what other attempts committed since)."""
        if self.head_mode and (blob := self._read_head(at_least)) is not None:
            return self._head_entries(blob)
        return list(reversed(list(self._newest_first(self._listing(at_least), cached=cached))))

    def for_input_offsets(self, offsets: Mapping[str, str]) -> LogEntry | None:
        """The newest entry whose input offsets equal ``offsets`` (for Spark: the one of a batch id), or None."""
        wanted = dict(offsets)
        return self.find(lambda entry: dict(entry.checkpoint.input_offsets) == wanted)

    def find(self, predicate: Callable[[LogEntry], bool], at_least: int = 0) -> LogEntry | None:
        """The newest entry for which ``predicate`` is true, or None. Reads newest first and stops at the match."""
        return self.find_and_head(predicate, at_least)[0]

    def next_seq(self) -> int:
        """One above the highest seq present in any version (1 for an empty log).

        Any version counts, readable or not, so a seq taken by a newer release's format is never reused. A writer
        takes its seq from its restore decision (:meth:`latest_and_head`), not from this later listing.
        """
        return self.head() + 1

    # -- retention ----------------------------------------------------------------------------------------------

    def retain(self, listing: Listing | None = None) -> list[int]:
        """Delete every version of the seqs older than the newest ``retained`` ones, in one ``delete_many`` (one
        request where the blob store batches deletes); return those seqs, ascending. ``listing``: one taken just
        before (the one :meth:`write` returns); a short listing only deletes less.

        Idempotent. Never deletes the newest readable entry, even when newer seqs exist only in unreadable versions.
        Deletion order does not matter to fencing: a writer whose seq retention freed finds a newer seq in the
        listing after its write (:meth:`fence`), whatever was deleted first.
        """
        if self.head_mode and (listing is None or any(HEAD_FORMAT in v for v in listing.values())):
            with self._state_lock:
                seen = self._seen
            if listing is None:
                if seen is None:
                    return []  # nothing written or read through this object: nothing it could let go
                listing = self._head_listing(seen[1])
            # the head itself let them go at its writes: only the count is settled here (no request)
            deleted = self._expired(listing)
            with self._state_lock:
                self._dropped.difference_update(deleted)
            return deleted
        listing = self._listing() if listing is None else listing
        deleted = self._expired(listing)
        self.blob_store.delete_many(
            [self.blob_name(seq, version) for seq in deleted for version in sorted(listing[seq])]
        )
        if deleted:
            log.debug("checkpoint log %s: deleted old checkpoints %s", self.prefix, deleted, extra=self._log_extra())
        return deleted

    def retention_due(self, listing: Listing, *, closing: bool = False) -> bool:
        """Whether :meth:`retain` would delete at least ``retention_interval`` seqs of ``listing`` (``closing``: any
        at all, so a closed task leaves exactly ``retained``): retention then runs, in one request, instead of
        deleting one seq at every commit. The log holds between ``retained`` and ``retained + retention_interval -
        1`` seqs in between, and a backend keeps what they name."""
        expired = len(self._expired(listing))
        return expired >= (1 if closing else self.retention_interval)

    def start_trim(self) -> None:
        """Note that a retention batch starts (call before the backends' cleanups of the commit it follows): the
        built-in backends then delete their own garbage in one request too (:attr:`trims`)."""
        self.trims += 1

    def _expired(self, listing: Listing) -> list[int]:
        """The seqs of ``listing`` retention deletes, ascending: all but the newest ``retained`` and the newest
        readable one."""
        ordered = sorted(listing)
        keep = set(ordered[-self.retained :])
        readable = [seq for seq in ordered if listing[seq] & set(self.read_versions)]
        if readable:
            keep.add(readable[-1])
        return [seq for seq in ordered if seq not in keep]


def _check_seq(seq: int) -> None:
    if type(seq) is not int or not 1 <= seq <= MAX_SEQ:
        raise ConfigError(f"checkpoint seq must be an int in [1, {MAX_SEQ}], got {seq!r}")
