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
import re
import secrets
import threading
import time
from collections.abc import Callable, Iterator, Mapping
from typing import Any

import attrs
from statebackend.checkpoint.checkpoint import CheckpointV1, CheckpointV2
from statebackend.checkpoint.serde import (
    HEAD_FORMAT,
    READABLE_VERSIONS,
    WRITABLE_VERSIONS,
    Binding,
    CheckpointHead,
    HeadEntry,
    decode_bound_checkpoint,
    decode_head,
    encode_checkpoint,
    encode_head,
    encode_moved_marker,
)

from statebackend.blobstores.base import BlobStore
from statebackend.errors import (
    AlreadyExistsError,
    ConfigError,
    CorruptDataError,
    InconsistentStateError,
    NotFoundError,
    PreconditionFailedError,
)

__all__ = ["HEAD_BLOB", "MAX_SEQ", "CheckpointLog", "Listing", "LogEntry"]

#: the name of the checkpoint head under a task's ``checkpoints/`` (stores with conditional writes)
HEAD_BLOB = f"HEAD.v{HEAD_FORMAT}.json"

#: seq -> format versions present, from one listing
Listing = dict[int, set[int]]

log = logging.getLogger(__name__)

#: the largest seq that fits the fixed-width name (12 digits)
MAX_SEQ = 10**12 - 1

#: default delays (seconds) before each re-listing of a short listing: about 2.6 s in all before giving up
RECHECK_DELAYS: tuple[float, ...] = (0.1, 0.5, 2.0)

_NAME_RE = re.compile(r"^([0-9]{12})\.v([1-9][0-9]{0,5})\.json$")


@attrs.frozen
class LogEntry:
    """One checkpoint of the log: its seq and the checkpoint read in the preferred version."""

    seq: int
    checkpoint: CheckpointV1 | CheckpointV2


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
class CheckpointLog:
    """A task's checkpoint history on a blob store. See the module docstring for the contract."""

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

    def _log_extra(self, seq: int | None = None) -> dict[str, object]:
        """Fields for structured log handlers (``extra``): job, task and the seq concerned."""
        return {"job": self.job_name, "task": self.task_name, "seq": seq}

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
        first = self.commit_point_version
        order = [first, *(v for v in self.write_versions if v != first)]
        binding = self.binding(seq)
        for index, version in enumerate(order):
            name = self.blob_name(seq, version)
            data = encode_checkpoint(checkpoint if version == 2 else checkpoint.to_v1(), binding)
            if index > 0:
                self.blob_store.put(name, data)
                continue
            try:
                self.blob_store.put(name, data, create_only=True)
            except AlreadyExistsError:
                if not self.holds(seq, checkpoint):
                    raise AlreadyExistsError(
                        f"checkpoint {seq} of task {self.task_name!r} in job {self.job_name!r} was already committed "
                        f"by another writer ({name} in {self.blob_store.describe()}); this attempt lost the race "
                        f"and must not claim its commit: restore from the latest checkpoint and redo"
                    ) from None
                log.info(
                    "checkpoint %s already holds this exact checkpoint; treating the write as a retry",
                    name,
                    extra=self._log_extra(seq),
                )
        listing = self.fence(seq)
        self._remember(seq, checkpoint)
        log.debug("wrote checkpoint %d (versions %s) under %s", seq, order, self.prefix, extra=self._log_extra(seq))
        return listing

    def _remember(self, seq: int, checkpoint: CheckpointV2) -> None:
        """Keep what this writer put under ``seq``, for the listings that show it again (:meth:`entries`)."""
        self._written[seq] = checkpoint
        for old in [s for s in self._written if s <= seq - self.retained - self.retention_interval]:
            del self._written[old]

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

    def _list_fence(self, seq: int) -> Listing:
        """:meth:`fence` by one listing of the per-seq blobs."""
        listing = self._listing(at_least=seq)
        newer = sorted(s for s in listing if s > seq)
        if newer:
            self.blob_store.delete_many([self.blob_name(seq, version) for version in self.write_versions])
            raise AlreadyExistsError(
                f"checkpoint {seq} of task {self.task_name!r} in job {self.job_name!r}: the log already holds newer "
                f"checkpoints {newer[:3]}{'...' if len(newer) > 3 else ''} under {self.prefix} in "
                f"{self.blob_store.describe()}; another attempt of the task committed past the state this attempt "
                f"restored, so this attempt's commit is refused (what it wrote was removed again)"
            )
        return listing

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

    def _holds(self, name: str, data: bytes) -> bool:
        try:
            return self.blob_store.get(name) == data
        except NotFoundError:
            return False

    # -- the head (stores with conditional writes) ------------------------------------------------------------

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
        try:
            new_version = self.blob_store.put_if(self.head_name, encode_head(head), version=version)
        except PreconditionFailedError as exc:
            # a stale version: another writer swapped the head first; unless it was this writer's own earlier
            # attempt whose reply was lost (read back once, decided by the nonce)
            found = self._get_head()
            if found is None or found[1].seq != seq or not self._ours(found[1], seq, checkpoint):
                raise self._fenced(seq, 0 if found is None else found[1].seq, f" ({exc})") from None
            new_version, head = found
        self._observe(new_version, head, written=True)
        with self._state_lock:
            self._dropped.update(e.seq for e in entries if e.seq < kept[0].seq)
        self._remember(seq, checkpoint)
        log.debug("wrote checkpoint %d into the head %s", seq, self.head_name, extra=self._log_extra(seq))
        return self._head_listing(head)

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
                raise AlreadyExistsError(
                    f"checkpoint {seq} of task {self.task_name!r} in job {self.job_name!r} was already committed "
                    f"by another writer ({name} in {self.blob_store.describe()}); this attempt lost the race and "
                    f"must not claim its commit: restore from the latest checkpoint and redo"
                ) from None
        listing = self._list_fence(seq)
        imported = [
            HeadEntry(entry.seq, "imported", entry.checkpoint)
            for entry in self._newest_first({s: v for s, v in listing.items() if s < seq}, cached=True)
        ][: self.retained - 1]
        entries = (*reversed(imported), HeadEntry(seq, self._new_nonce(seq), checkpoint))
        head = CheckpointHead(self.job_name, self.task_name, tuple(entries), seq)
        try:
            version = self.blob_store.put_if(self.head_name, encode_head(head), version=None)
        except PreconditionFailedError as exc:
            found = self._get_head()
            if found is None or found[1].seq != seq or not self._ours(found[1], seq, checkpoint):
                raise self._fenced(seq, 0 if found is None else found[1].seq, f" ({exc})") from None
            version, head = found
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

    # -- helpers ------------------------------------------------------------------------------------------------

    def _listing(self, at_least: int = 0) -> Listing:
        """seq -> versions present. When ``at_least`` is above what a listing shows, re-list after
        ``recheck_delays``; :class:`InconsistentStateError` if it never reaches it."""
        at_least = max(at_least, self.floor)
        listing = self._list_once()
        for delay in self.recheck_delays:
            if max(listing, default=0) >= at_least:
                return listing
            log.warning(
                "checkpoint log %s in %s: the listing shows checkpoints up to #%d but #%d is known to be durable; "
                "listing again in %.1f s",
                self.prefix,
                self.blob_store.describe(),
                max(listing, default=0),
                at_least,
                delay,
                extra=self._log_extra(at_least),
            )
            time.sleep(delay)
            listing = self._list_once()
        if max(listing, default=0) >= at_least:
            return listing
        raise InconsistentStateError(
            f"checkpoint log {self.prefix} in {self.blob_store.describe()} shows checkpoints up to "
            f"#{max(listing, default=0)}, but checkpoint #{at_least} of this task is known to be durable (the task's "
            f"local CHECKPOINT-V2 file, the checkpoint it restored or its own commit says so). Either the blob store "
            f"answers short (retry later), or checkpoints were deleted or the blob store URL points at another copy. "
            f"Nothing was restored, cleared or written. If the state was removed on purpose, delete the task's local "
            f"dir too"
        )

    def _list_once(self) -> Listing:
        prefix = self.prefix
        listing: Listing = {}
        for name in self.blob_store.list(prefix):
            match = _NAME_RE.match(name[len(prefix) :]) if name.startswith(prefix) else None
            if match is None:
                log.debug("checkpoint log %s: ignoring foreign blob %s", prefix, name)
                continue
            seq = int(match.group(1))
            if seq == 0:
                log.debug("checkpoint log %s: ignoring blob %s with seq 0", prefix, name)
                continue
            listing.setdefault(seq, set()).add(int(match.group(2)))
        return listing

    def _newest_first(self, listing: Listing, *, cached: bool = False) -> Iterator[LogEntry]:
        readable = sorted((seq for seq in listing if listing[seq] & set(self.read_versions)), reverse=True)
        for index, seq in enumerate(readable):
            entry = self._read_entry(seq, listing[seq], cached=cached)
            if entry is not None:
                yield entry
                continue
            if index > 0:
                # An older entry deleted by retention between the listing and this read: newer ones were seen.
                log.debug(
                    "checkpoint log %s: checkpoint %d was deleted by retention while being read",
                    self.prefix,
                    seq,
                    extra=self._log_extra(seq),
                )
                continue
            # The newest readable checkpoint vanished between the listing and its read. Retention never deletes the
            # newest, so either newer checkpoints arrived (and retention ran) or it was deleted: look again.
            relisted = self._listing(at_least=seq)
            newer = {s: v for s, v in relisted.items() if s > seq}
            if newer and any(v & set(self.read_versions) for v in newer.values()):
                yield from self._newest_first(relisted, cached=cached)
                return
            raise InconsistentStateError(
                f"checkpoint {self.blob_name(seq, max(listing[seq]))} in {self.blob_store.describe()} was listed as "
                f"the newest checkpoint of task {self.task_name!r} but cannot be read, and no newer one exists: it "
                f"was deleted, or the blob store answers inconsistently. Not falling back to an older checkpoint "
                f"(that would roll the task back). Put the blob back, or delete it everywhere on purpose"
            )
        unreadable = sorted(seq for seq in listing if not listing[seq] & set(self.read_versions))
        for seq in unreadable:
            if seq > (readable[0] if readable else 0):
                log.warning(
                    "checkpoint log %s: checkpoint %d exists only in versions %s, none of read versions %s; "
                    "passing over it",
                    self.prefix,
                    seq,
                    sorted(listing[seq]),
                    self.read_versions,
                    extra=self._log_extra(seq),
                )

    def _read_entry(self, seq: int, versions: set[int], *, cached: bool = False) -> LogEntry | None:
        """The entry in its preferred listed version, or None when that blob vanished since the listing (never a
        fall back to a less preferred version of the same seq: a V1 twin holds no state). ``cached``: a version 2
        this log object wrote itself under ``seq`` (create-only, fenced) is not read again, its bytes being the ones
        it encoded, bound to the name. For a collector's mark only: had retention freed the seq and another writer
        taken it since, the mark would miss only that writer's young blobs, which the grace period keeps (and the
        newest seq is never freed)."""
        for version in self.read_versions:
            if version not in versions:
                continue
            written = self._written.get(seq) if cached else None
            if version == 2 and written is not None:
                return LogEntry(seq, written)
            name = self.blob_name(seq, version)
            try:
                data = self.blob_store.get(name)
            except NotFoundError:
                # Deleted (by retention, or otherwise) between the listing and this read: the caller decides.
                return None
            source = f"{name} in {self.blob_store.describe()}"
            checkpoint, binding = decode_bound_checkpoint(data, source=source, moved_ok=self.head_mode)
            expected = self.binding(seq)
            if binding is not None and binding != expected:
                raise CorruptDataError(
                    f"checkpoint {source} is {binding.describe()}, not {expected.describe()} as its name says: the "
                    f"blob was copied, renamed or put back from another place or time. It is not used; restore the "
                    f"right blob or delete this one (the task then restores the newest remaining checkpoint)"
                )
            if binding is None and self.floor and seq >= self.floor:
                raise CorruptDataError(
                    f"checkpoint {source} is unbound (blob format 1, no checksum) but this task knows checkpoint "
                    f"#{self.floor} as a bound format 2 checkpoint: it was put back from before the upgrade or "
                    f"written by an older release after this one. It is not used; restore the right blob"
                )
            if checkpoint.version != version:
                raise CorruptDataError(
                    f"checkpoint {source} holds a version {checkpoint.version} checkpoint but its name says version "
                    f"{version}; the blob was renamed or overwritten by a foreign writer"
                )
            return LogEntry(seq, checkpoint)
        return None


def _check_seq(seq: int) -> None:
    if type(seq) is not int or not 1 <= seq <= MAX_SEQ:
        raise ConfigError(f"checkpoint seq must be an int in [1, {MAX_SEQ}], got {seq!r}")
