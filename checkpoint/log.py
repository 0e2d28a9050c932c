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

Reads: for a seq, the first version of ``read_versions`` present wins. A blob that does not decode is
:class:`CorruptDataError` naming the blob, never skipped: skipping would silently roll a task back to older state.
Listing parses names strictly and ignores anything else under the prefix (temp files, foreign tools' files).

Thread-safety: a log holds no mutable state of its own; it is as thread-safe as its blob store.
"""

from __future__ import annotations

import logging
import re
from collections.abc import Callable, Iterator, Mapping
from typing import Any

import attrs

from checkpoint.checkpoint import CheckpointV1, CheckpointV2
from checkpoint.serde import READABLE_VERSIONS, WRITABLE_VERSIONS, decode_checkpoint, encode_checkpoint
from statebackend.blobstore import BlobStore
from statebackend.errors import AlreadyExistsError, ConfigError, CorruptDataError, NotFoundError

__all__ = ["MAX_SEQ", "CheckpointLog", "LogEntry"]

log = logging.getLogger(__name__)

#: the largest seq that fits the fixed-width name (12 digits)
MAX_SEQ = 10**12 - 1

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


@attrs.define
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

    @property
    def prefix(self) -> str:
        """The blob name prefix of this task's checkpoints (ends with ``/``)."""
        return f"{self.job_name}/{self.task_name}/checkpoints/"

    def blob_name(self, seq: int, version: int) -> str:
        """The blob that holds checkpoint ``seq`` in format ``version``."""
        _check_seq(seq)
        return f"{self.prefix}{seq:012d}.v{version}.json"

    # -- writing ------------------------------------------------------------------------------------------------

    def write(self, seq: int, checkpoint: CheckpointV2) -> None:
        """Make ``checkpoint`` durable as ``seq``: every version of ``write_versions``, commit point first.

        Raises :class:`AlreadyExistsError` when another writer committed a different checkpoint as ``seq``.
        """
        _check_seq(seq)
        if not isinstance(checkpoint, CheckpointV2):
            raise TypeError(f"the checkpoint log writes CheckpointV2, got {type(checkpoint).__name__}")
        first = 2 if 2 in self.write_versions else self.write_versions[0]
        order = [first, *(v for v in self.write_versions if v != first)]
        for index, version in enumerate(order):
            name = self.blob_name(seq, version)
            data = encode_checkpoint(checkpoint if version == 2 else checkpoint.to_v1())
            if index > 0:
                self.blob_store.put(name, data)
                continue
            try:
                self.blob_store.put(name, data, create_only=True)
            except AlreadyExistsError:
                if not self._holds(name, data):
                    raise AlreadyExistsError(
                        f"checkpoint {seq} of task {self.task_name!r} in job {self.job_name!r} was already committed "
                        f"by another writer ({name} in {self.blob_store.describe()}); this attempt lost the race "
                        f"and must not claim its commit: restore from the latest checkpoint and redo"
                    ) from None
                log.info("checkpoint %s already holds this exact checkpoint; treating the write as a retry", name)
        log.debug("wrote checkpoint %d (versions %s) under %s", seq, order, self.prefix)

    def _holds(self, name: str, data: bytes) -> bool:
        try:
            return self.blob_store.get(name) == data
        except NotFoundError:
            return False

    # -- reading ------------------------------------------------------------------------------------------------

    def latest(self) -> LogEntry | None:
        """The entry with the highest seq that has a readable version, or None for an empty log."""
        return next(self._newest_first(), None)

    def read(self, seq: int) -> LogEntry:
        """Entry ``seq``; :class:`NotFoundError` when no version of ``read_versions`` exists for it."""
        _check_seq(seq)
        versions = self._listing().get(seq, set())
        entry = self._read_entry(seq, versions)
        if entry is None:
            raise NotFoundError(
                f"checkpoint {seq} of task {self.task_name!r} in job {self.job_name!r} not found in any of the "
                f"read versions {self.read_versions} under {self.prefix} in {self.blob_store.describe()}"
                + (f" (present versions: {sorted(versions)})" if versions else "")
            )
        return entry

    def seqs(self) -> list[int]:
        """Seqs that have a readable version, ascending."""
        return sorted(seq for seq, versions in self._listing().items() if versions & set(self.read_versions))

    def entries(self) -> list[LogEntry]:
        """Every readable entry, ascending by seq."""
        return list(reversed(list(self._newest_first())))

    def for_input_offsets(self, offsets: Mapping[str, str]) -> LogEntry | None:
        """The newest entry whose input offsets equal ``offsets`` (for Spark: the one of a batch id), or None."""
        wanted = dict(offsets)
        return self.find(lambda entry: dict(entry.checkpoint.input_offsets) == wanted)

    def find(self, predicate: Callable[[LogEntry], bool]) -> LogEntry | None:
        """The newest entry for which ``predicate`` is true, or None. Reads newest first and stops at the match."""
        return next((entry for entry in self._newest_first() if predicate(entry)), None)

    def next_seq(self) -> int:
        """The seq the next commit writes: one above the highest seq present in any version (1 for an empty log).

        Any version counts, readable or not, so a seq taken by a newer release's format is never reused.
        """
        listing = self._listing()
        return max(listing, default=0) + 1

    # -- retention ----------------------------------------------------------------------------------------------

    def retain(self) -> list[int]:
        """Delete every version of the seqs older than the newest ``retained`` ones; return those seqs, ascending.

        Idempotent. Never deletes the newest readable entry, even when newer seqs exist only in unreadable versions.
        """
        listing = self._listing()
        ordered = sorted(listing)
        keep = set(ordered[-self.retained :])
        readable = [seq for seq in ordered if listing[seq] & set(self.read_versions)]
        if readable:
            keep.add(readable[-1])
        deleted = [seq for seq in ordered if seq not in keep]
        for seq in deleted:
            self.blob_store.delete_many([self.blob_name(seq, version) for version in sorted(listing[seq])])
        if deleted:
            log.info("checkpoint log %s: deleted old checkpoints %s", self.prefix, deleted)
        return deleted

    # -- helpers ------------------------------------------------------------------------------------------------

    def _listing(self) -> dict[int, set[int]]:
        """seq -> versions present, from one listing. Names that are not ours are ignored."""
        prefix = self.prefix
        listing: dict[int, set[int]] = {}
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

    def _newest_first(self) -> Iterator[LogEntry]:
        listing = self._listing()
        for seq in sorted(listing, reverse=True):
            entry = self._read_entry(seq, listing[seq])
            if entry is None and set(self.read_versions) & listing[seq]:
                log.debug("checkpoint log %s: checkpoint %d was deleted by retention while being read", self.prefix,
                          seq)
                continue
            if entry is None:
                log.warning(
                    "checkpoint log %s: checkpoint %d exists only in versions %s, none of read versions %s; "
                    "passing over it", self.prefix, seq, sorted(listing[seq]), self.read_versions,
                )
                continue
            yield entry

    def _read_entry(self, seq: int, versions: set[int]) -> LogEntry | None:
        for version in self.read_versions:
            if version not in versions:
                continue
            name = self.blob_name(seq, version)
            try:
                data = self.blob_store.get(name)
            except NotFoundError:
                # Deleted by retention between the listing and this read: the next version or seq decides.
                continue
            source = f"{name} in {self.blob_store.describe()}"
            checkpoint = decode_checkpoint(data, source=source)
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
