"""The state of the changelog backend's backup manager: its options (:class:`ChangelogSettings`), per store the chain of
the recipe (the :class:`Lineage`), and the one object the manager and its helpers share (:class:`ChangelogShared`).
The manager (backup.py) holds the helpers: the uploader (upload.py), the background snapshots (snapshots.py) and what
it states about its blobs for the framework's collector (lifetime.py)."""

from __future__ import annotations

import threading
from collections import deque
from concurrent.futures import Future
from pathlib import Path

import attrs
from statebackend.backends.changelog.marker import Recipe, Step

from statebackend.kit import GraceRule, ManagerState
from statebackend.store import ChangeSet, LocalStore, ReadView

__all__ = ["STAGING_DIR", "ChangelogSettings", "ChangelogShared", "Lineage", "seq_of"]

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


@attrs.frozen
class ChangelogSettings:
    """The backup manager's options, as the factory validated them."""

    snapshot_interval_commits: int
    snapshot_interval_bytes: int
    compression: str
    compression_level: int
    #: durable recipes kept per store (the checkpoint log's ``retained``)
    retained: int
    #: a snapshot is due once the delta files after the base hold this many times the base's bytes (0: off)
    snapshot_interval_ratio: float = 1.0
    #: ... and at least this many bytes: a small state's snapshots would otherwise cost a PUT every few commits
    snapshot_ratio_min_bytes: int = 1 << 20
    gc_interval_commits: int = 100
    gc_grace_period_ms: int = 3_600_000


@attrs.define(eq=False)
class ChangelogShared(ManagerState[ChangelogSettings, Lineage]):
    """The one state the backup manager and the helpers it holds (the uploader, the background snapshots, the
    lifetime) share: the context, the options, the clock, each store's :class:`Lineage`, and whether background work
    must stop (:class:`~statebackend.kit.ManagerState`); and what the helpers ask of them."""

    def young_enough(self, created_at: float | None) -> bool:
        """Whether a blob no durable checkpoint is known to name may still be named by a new one
        (:meth:`~statebackend.kit.GraceRule.may_name`: younger than half the grace period; no grace period: always)."""
        return GraceRule(self.settings.gc_grace_period_ms).may_name(created_at, self.clock())
