"""The state of the blob-snapshot backend's backup manager: its options (:class:`BlobSnapshotSettings`), per store the
chain of runs and the indexes it knows (:class:`StoreState`), the values its helpers hand each other, and the one
object they all share (:class:`BlobSnapshotShared`). The manager (backup.py) holds the helpers: the uploader
(upload.py), the compactor (compaction.py) and what it states about its blobs (lifetime.py)."""

from __future__ import annotations

import threading
from collections import deque
from collections.abc import Mapping
from concurrent.futures import Future
from pathlib import Path
from typing import Any

import attrs
from statebackend.backends.blobsnapshot.blobs import read_marker
from statebackend.backends.blobsnapshot.format import RunEntry, RunIndex

from statebackend.kit import ManagerState, created_at_metadata
from statebackend.store import ChangeSet, LocalStore, LocalVersion, ReadView

__all__ = [
    "BASE_LEVEL",
    "CACHE_DIR",
    "COMPACTED_FILE",
    "DURABLE_AT",
    "EXPIRES_AT",
    "STAGING_DIR",
    "BlobSnapshotSettings",
    "BlobSnapshotShared",
    "Compacted",
    "Prepared",
    "StoreState",
]

STAGING_DIR = "blobsnapshot-staging"
#: local copies of the chain's non-base runs (what merges read), of base runs until durable and of runs not uploaded
#: yet, named by their hash
CACHE_DIR = "blobsnapshot-runs"
#: a compaction result not yet adopted by an index (the open that made it closed first)
COMPACTED_FILE = "blobsnapshot-compacted.json"
#: metadata keys on runs and indexes beside ``created_at`` (statebackend.kit.CREATED_AT; seconds since the epoch, as
#: decimal strings): when a blob no checkpoint names may be swept whatever its age (written at upload); and when one
#: was made durable (written by releases that removed the expiry at each cleanup, a COPY per blob; read by none)
EXPIRES_AT = "expires_at"
DURABLE_AT = "durable_at"
#: the level of base runs (above every merge level)
BASE_LEVEL = 1 << 16


@attrs.frozen
class Prepared:
    """What ``snapshot()`` took for one commit of one store, until ``upload()`` uses it."""

    seq: int
    version: LocalVersion
    change: ChangeSet | None
    view: Future[ReadView]


@attrs.frozen
class Compacted:
    """A finished compaction: ``output`` replaces the contiguous ``inputs`` in a later index."""

    inputs: tuple[RunEntry, ...]
    output: RunEntry
    generation: int
    uploaded_at: float | None

    def to_json(self) -> dict[str, Any]:
        return {
            "inputs": [run.to_json() for run in self.inputs],
            "output": self.output.to_json(),
            "uploaded_at": self.uploaded_at,
        }

    @classmethod
    def from_json(cls, document: Mapping[str, Any], generation: int) -> Compacted:
        return cls(
            tuple(RunEntry.from_json(item) for item in document["inputs"]),
            RunEntry.from_json(document["output"]),
            generation,
            document.get("uploaded_at"),
        )


@attrs.define(eq=False)
class StoreState:
    """The backup state of one store."""

    name: str
    store: LocalStore
    prefix: str
    staging: Path
    cache: Path
    seq: int = 0
    #: the chain the next index lists, oldest first (runs of failed commits included: their changes are in LMDB)
    runs: list[RunEntry] = attrs.field(factory=list)
    #: the chain does not describe the local data: the next upload writes a base run
    needs_base: bool = True
    #: bumped whenever the chain is replaced by a base run; compactions of an older generation are dropped
    generation: int = 0
    #: run hashes known present in the blob store, and when this manager uploaded them
    uploaded: set[str] = attrs.field(factory=set)
    uploaded_at: dict[str, float] = attrs.field(factory=dict)
    #: run hashes whose upload failed (its reply may have been lost after it landed): looked up before a new try
    attempted: set[str] = attrs.field(factory=set)
    #: run hashes whose expiry was removed (referenced by a durable index)
    durable_runs: set[str] = attrs.field(factory=set)
    prepared: dict[str, Prepared] = attrs.field(factory=dict)
    compaction: Future[Compacted | None] | None = None
    compaction_inputs: tuple[RunEntry, ...] = ()
    compaction_output: str | None = None
    #: the last index made (its marker): the previous index of the next one
    previous: RunIndex | None = None
    previous_name: str | None = None
    #: indexes made whose checkpoint is not (yet) known durable; here and below, keyed by marker (inline, or the name
    #: of an index blob of an older release)
    pending: dict[str, RunIndex] = attrs.field(factory=dict)
    #: durable indexes, oldest first, at most ``retained``
    retained: deque[tuple[str, RunIndex]] = attrs.field(factory=deque)
    #: index blobs (of older releases) retention let go, until the framework deletes them: the checkpoint log may
    #: still hold their checkpoints, which a sweep then marks without reading them again
    released: dict[str, RunIndex] = attrs.field(factory=dict)
    cleanups: int = 0
    last_durable_seq: int = 0
    #: guards the quick fields (seq, prepared, compaction); held only briefly
    state_lock: threading.Lock = attrs.field(factory=threading.Lock)
    #: serializes upload, cleanup and sweep of this store
    io_lock: threading.Lock = attrs.field(factory=threading.Lock)

    def live_indexes(self, *, suspect_pending: bool = True) -> dict[str, RunIndex]:
        """Indexes this manager must keep. ``suspect_pending=False`` leaves out the pending ones older than the
        newest durable one: their commit failed, or their cleanup is late (then the checkpoint log names them)."""
        live = dict(self.retained)
        live.update(
            (name, index)
            for name, index in self.pending.items()
            if suspect_pending or index.seq > self.last_durable_seq
        )
        if self.previous is not None and self.previous_name is not None:
            live[self.previous_name] = self.previous
        return live

    def cached(self, entry: RunEntry) -> Path:
        return self.cache / entry.hash


@attrs.frozen
class BlobSnapshotSettings:
    """The backup manager's options, as the factory validated them."""

    #: durable indexes kept per store (the checkpoint log's ``retained``)
    retained: int
    grace_period_ms: int
    ttl_ms: int
    gc_interval_commits: int
    gc_on_init: bool = False
    compaction_fanout: int = 10
    compaction_full_ratio: float = 1.0
    compaction_full_min_bytes: int = 1 << 20
    compression_level: int = 3
    #: a commit whose change holds at least this many records, and at least ``upload_base_ratio`` of the store's keys,
    #: is uploaded as a base run (an environment file a cold restore opens) instead of a run of its records
    upload_base_min_records: int = 250_000
    upload_base_ratio: float = 0.5


@attrs.define(eq=False)
class BlobSnapshotShared(ManagerState[BlobSnapshotSettings, StoreState]):
    """The one state the backup manager and the helpers it holds (the uploader, the compactor, the lifetime) share:
    the context, the options, the clock, each store's :class:`StoreState`, and whether background work must stop
    (:class:`~statebackend.kit.ManagerState`); and what the helpers ask of them."""

    def read_index(self, marker: str, store: str) -> RunIndex:
        context = self.context
        return read_marker(context.blob_store, marker, job=context.job_name, task=context.task_name, store=store)

    def new_metadata(self, now: float) -> dict[str, str] | None:
        """The metadata of a run written at ``now``: its age, and its expiry (``ttl.ms`` later)."""
        if not self.context.blob_store.supports_metadata:
            return None
        return {**created_at_metadata(now), EXPIRES_AT: f"{now + self.settings.ttl_ms / 1000.0:.3f}"}

    def young_enough(self, uploaded_at: float | None) -> bool:
        """Whether a blob this manager uploaded at ``uploaded_at`` may still be named by a new index: younger than
        half the grace period, so no sweep (whose own deletions stop after a quarter of it) can take it, and younger
        than half its ``ttl.ms``, so it has not expired (a sweep deletes an expired blob whatever its grace)."""
        window = min(self.settings.grace_period_ms, self.settings.ttl_ms) / 2000.0
        return uploaded_at is not None and self.clock() - uploaded_at < window
