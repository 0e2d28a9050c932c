"""The per-seq layout of the checkpoint log: one blob per seq and format version,
``<job>/<task>/checkpoints/<seq:012d>.v<version>.json``, the one layout of a blob store without conditional writes.

Its jobs for :class:`~statebackend.checkpoint.log.CheckpointLog` (whose module docstring is the contract): the
create-only commit point of a write and its fencing by one listing, the listing itself (re-listed while it shows
less than is known durable), and reading entries newest first, each checked against the name it was read under.
"""

from __future__ import annotations

import logging
import re
import time
from collections.abc import Iterator
from typing import TYPE_CHECKING

import attrs
from statebackend.checkpoint.checkpoint import CheckpointV1, CheckpointV2
from statebackend.checkpoint.serde import Binding, decode_bound_checkpoint, encode_checkpoint

from statebackend.errors import AlreadyExistsError, CorruptDataError, InconsistentStateError, NotFoundError

if TYPE_CHECKING:
    from statebackend.checkpoint.log import Listing

    from statebackend.blobstores.base import BlobStore

__all__ = ["LogEntry"]

# the checkpoint log module's logger: a layout's records keep the name operators configure (docs/operations.md)
log = logging.getLogger("statebackend.checkpoint.log")

_NAME_RE = re.compile(r"^([0-9]{12})\.v([1-9][0-9]{0,5})\.json$")


@attrs.frozen
class LogEntry:
    """One checkpoint of the log: its seq and the checkpoint read in the preferred version."""

    seq: int
    checkpoint: CheckpointV1 | CheckpointV2


class _PerSeqLog:
    """The per-seq layout's part of :class:`~statebackend.checkpoint.log.CheckpointLog` (a base class of it: the
    fields and the public methods named below are the log's)."""

    if not TYPE_CHECKING:  # no instance dict, as the slotted log has none (mypy would refuse its fields here)
        __slots__ = ()
    if TYPE_CHECKING:
        blob_store: BlobStore
        job_name: str
        task_name: str
        write_versions: tuple[int, ...]
        read_versions: tuple[int, ...]
        retained: int
        retention_interval: int
        floor: int
        recheck_delays: tuple[float, ...]
        _written: dict[int, CheckpointV2]

        @property
        def head_mode(self) -> bool: ...

        @property
        def prefix(self) -> str: ...

        @property
        def commit_point_version(self) -> int: ...

        def blob_name(self, seq: int, version: int) -> str: ...

        def binding(self, seq: int) -> Binding: ...

        def fence(self, seq: int) -> Listing: ...

        def holds(self, seq: int, checkpoint: CheckpointV2) -> bool: ...

    def _log_extra(self, seq: int | None = None) -> dict[str, object]:
        """Fields for structured log handlers (``extra``): job, task and the seq concerned."""
        return {"job": self.job_name, "task": self.task_name, "seq": seq}

    def _remember(self, seq: int, checkpoint: CheckpointV2) -> None:
        """Keep what this writer put under ``seq``, for the listings that show it again (:meth:`entries`)."""
        self._written[seq] = checkpoint
        for old in [s for s in self._written if s <= seq - self.retained - self.retention_interval]:
            del self._written[old]

    def _write_per_seq(self, seq: int, checkpoint: CheckpointV2) -> Listing:
        """:meth:`~statebackend.checkpoint.log.CheckpointLog.write` in the per-seq layout: every version of
        ``write_versions``, the commit point first and create-only, then the fencing listing."""
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
                    raise self._lost_race(seq, name) from None
                log.info(
                    "checkpoint %s already holds this exact checkpoint; treating the write as a retry",
                    name,
                    extra=self._log_extra(seq),
                )
        listing = self.fence(seq)
        self._remember(seq, checkpoint)
        log.debug("wrote checkpoint %d (versions %s) under %s", seq, order, self.prefix, extra=self._log_extra(seq))
        return listing

    def _lost_race(self, seq: int, name: str) -> AlreadyExistsError:
        """The refusal of a create-only commit point that another writer took with a different checkpoint."""
        return AlreadyExistsError(
            f"checkpoint {seq} of task {self.task_name!r} in job {self.job_name!r} was already committed "
            f"by another writer ({name} in {self.blob_store.describe()}); this attempt lost the race "
            f"and must not claim its commit: restore from the latest checkpoint and redo"
        )

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

    def _holds(self, name: str, data: bytes) -> bool:
        """Whether blob ``name`` holds exactly ``data`` (False: absent)."""
        try:
            return self.blob_store.get(name) == data
        except NotFoundError:
            return False

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
