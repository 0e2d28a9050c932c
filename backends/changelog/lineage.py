"""The state of the changelog backend's backup manager: its options, and per store the chain of the recipe (the
:class:`Lineage`). The parts of the manager (upload.py, snapshots.py, and the manager itself in backup.py) all build
on :class:`ChangelogManagerState`; what it states about its blobs for the framework's collector is lifetime.py."""

from __future__ import annotations

import threading
import time
from collections import deque
from collections.abc import Callable
from concurrent.futures import Future
from pathlib import Path
from typing import TYPE_CHECKING

import attrs
from statebackend.backends.changelog.marker import Recipe, Step
from statebackend.checkpoint import CheckpointLog

from statebackend.contracts import BackendContext
from statebackend.kit import Cancellation
from statebackend.store import ChangeSet, LocalStore, ReadView

if TYPE_CHECKING:
    from statebackend.backends.changelog.lifetime import ChangelogLifetime

__all__ = ["STAGING_DIR", "ChangelogManagerState", "Lineage", "seq_of"]

#: the dir in each store dir where deltas and snapshots are written before their upload
STAGING_DIR = "changelog-staging"


def seq_of(blob: str) -> int | None:
    """The sequence number in a delta or snapshot name (``.../<seq:012d>-<token>.<ext>``), or None."""
    stem = blob.rsplit("/", 1)[-1]
    digits, sep, _ = stem.partition("-")
    return int(digits) if sep and digits.isdigit() else None


@attrs.define(eq=False)
class Lineage:
    """The backup state of one store."""

    name: str
    store: LocalStore
    prefix: str
    staging: Path
    seq: int = 0
    base: Step | None = None
    deltas: list[Step] = attrs.field(factory=list)
    uploaded: set[str] = attrs.field(factory=set)
    #: when the upload of a blob in ``uploaded`` started (its ``created_at``), for blobs whose age is known
    uploaded_at: dict[str, float] = attrs.field(factory=dict)
    #: change sets of this commit, by delta name, until upload() encodes them
    to_encode: dict[str, ChangeSet] = attrs.field(factory=dict)
    #: staged files written by this commit's upload and not sent yet (a staged file not in here is a retry)
    fresh: set[str] = attrs.field(factory=set)
    #: a future read view to re-base on at this commit (chain broken or first backup of restored state)
    rebase_view: Future[ReadView] | None = None
    commits_since_snapshot: int = 0
    bytes_since_snapshot: int = 0
    #: file bytes of blobs of this store whose size this manager knows (it uploaded them, or looked them up at
    #: init): the snapshot interval ratio weighs the deltas since the base against the base
    blob_bytes: dict[str, int] = attrs.field(factory=dict)
    background: Future[Step] | None = None
    #: the blob the running background snapshot writes (never swept while it runs)
    background_name: str | None = None
    retained: deque[Recipe] = attrs.field(factory=deque)
    lock: threading.Lock = attrs.field(factory=threading.Lock)

    def recipe(self) -> Recipe:
        return Recipe(snapshot=self.base, deltas=tuple(self.deltas))


@attrs.define(eq=False)
class ChangelogManagerState:
    """The backup manager's options and state, shared by its parts."""

    context: BackendContext
    snapshot_interval_commits: int
    snapshot_interval_bytes: int
    compression: str
    compression_level: int
    retained: int
    #: a snapshot is due once the delta files after the base hold this many times the base's bytes (0: off)
    snapshot_interval_ratio: float = 1.0
    #: ... and at least this many bytes: a small state's snapshots would otherwise cost a PUT every few commits
    snapshot_ratio_min_bytes: int = 1 << 20
    gc_interval_commits: int = 100
    gc_grace_period_ms: int = 3_600_000
    #: wall clock (seconds since the epoch) for blob ages and the sweep's time bound; tests may replace it
    clock: Callable[[], float] = time.time
    _lineages: dict[str, Lineage] = attrs.field(init=False, factory=dict)
    _closed: bool = attrs.field(init=False, default=False)
    #: background snapshots stop at their next check (``cancel_background``)
    _cancellation: Cancellation = attrs.field(init=False, factory=Cancellation)
    #: what this manager states about its blobs; the framework's collector of them hangs off it
    _lifetime: ChangelogLifetime = attrs.field(init=False)

    @_lifetime.default
    def _make_lifetime(self) -> ChangelogLifetime:
        from statebackend.backends.changelog.lifetime import ChangelogLifetime

        return ChangelogLifetime(self)

    def _young_enough(self, created_at: float | None) -> bool:
        """Whether a blob no durable checkpoint is known to name may still be named by a new one
        (:meth:`~statebackend.kit.GraceRule.may_name`: younger than half the grace period; no grace period: always)."""
        return self._lifetime.collector.may_name(created_at)

    def _checkpoint_log(self) -> CheckpointLog:
        """The task's log (its listings never show less than the newest checkpoint the task knows durable, so a
        short listing cannot make live blobs look unreferenced)."""
        return self.context.checkpoint_log

    def _log_extra(self, store: str | None = None) -> dict[str, object]:
        """Fields for structured log handlers (``extra``): job, task and the store concerned."""
        return {"job": self.context.job_name, "task": self.context.task_name, "store": store}
