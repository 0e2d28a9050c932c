"""The dedup backend's backup manager and what it states about its blobs (its :class:`DedupLifetime`).

Per store it remembers the chunks of its last durable manifest (their first keys and content ids). ``snapshot()``
keeps the commit's change set and asks for a read view of exactly the flushed version (O(1) on the task's thread);
the upload, on the commit pool, finds the chunks whose key range the change touched, reads those ranges from the
view, cuts them into chunks of at most ``chunk.records`` records, writes the chunks its last manifest does not
already name, then the manifest. After a failed upload, an aborted commit, or a restore by another backend, the next
upload cuts the whole view again (the chunks that did not change keep their content ids: only changed ones are
written).
"""

from __future__ import annotations

import bisect
import contextlib
import threading
from collections.abc import Iterable, Mapping
from concurrent.futures import Future

import attrs
from statebackend.checkpoint import CheckpointId, CheckpointV2

from sb_dedup.format import (
    ChunkRef,
    Item,
    Manifest,
    chunk_name,
    content_id,
    decode_manifest,
    encode_chunk,
    encode_manifest,
    manifest_name,
)
from statebackend.contracts import BackendContext, BlobLifetime, StoreMarkers, TaskBackupManager
from statebackend.errors import AlreadyExistsError, InconsistentStateError, NotFoundError
from statebackend.kit import close_when_ready, created_at_metadata
from statebackend.store import ChangeSet, ReadView

__all__ = ["DedupBackupManager", "DedupLifetime", "Step", "read_manifest", "referenced_blobs"]


def read_manifest(context: BackendContext, store: str, name: str) -> Manifest:
    """Manifest ``name`` of ``store``, downloaded and verified (:class:`NotFoundError` when absent, naming it)."""
    try:
        data = context.blob_store.get(name)
    except NotFoundError as exc:
        raise NotFoundError(
            f"store {store}: manifest {name} that the checkpoint names is missing from {context.blob_store.describe()}"
        ) from exc
    prefix = context.blob_prefix(store)
    return decode_manifest(data, name=name, job=context.job_name, task=context.task_name, store=store, prefix=prefix)


def referenced_blobs(context: BackendContext, store: str, marker: str) -> list[str]:
    """Every blob marker ``marker`` (a manifest's name) needs: the manifest and its chunks."""
    manifest = read_manifest(context, store, marker)
    prefix = context.blob_prefix(store)
    return [marker, *(chunk_name(prefix, ref.cid) for ref in manifest.chunks)]


@attrs.define(eq=False)
class Step:
    """One store's part of a commit: its change set, a read view of the flushed version, its manifest's name."""

    change: ChangeSet
    view: Future[ReadView]
    manifest: str


@attrs.define(eq=False)
class DedupBackupManager(TaskBackupManager):
    """Backs up each store as content-addressed chunks and a manifest per checkpoint (see the module docstring)."""

    context: BackendContext
    chunk_records: int = 256
    grace_ms: int = 3_600_000
    sweep_interval_commits: int = 100
    #: store -> the chunks of its last durable manifest (``None``: the next upload cuts the whole view)
    _chunks: dict[str, list[ChunkRef] | None] = attrs.field(init=False, factory=dict)
    #: store -> its last durable manifest and that manifest's chunk blobs (held from the framework's collector)
    _named: dict[str, set[str]] = attrs.field(init=False, factory=dict)
    #: store -> the blobs the running upload writes or names
    _writing: dict[str, set[str]] = attrs.field(init=False, factory=dict)
    #: store -> every chunk a manifest of this manager named (what the framework's release may delete)
    _ever: dict[str, set[str]] = attrs.field(init=False, factory=dict)
    _prepared: dict[str, Step] = attrs.field(init=False, factory=dict)
    _lock: threading.Lock = attrs.field(init=False, factory=threading.Lock)
    _guards: dict[str, threading.Lock] = attrs.field(init=False, factory=dict)
    _lifetime: DedupLifetime = attrs.field(init=False)

    @_lifetime.default
    def _make_lifetime(self) -> DedupLifetime:
        return DedupLifetime(self)

    def init(self, checkpoint: CheckpointV2 | None) -> None:
        markers = checkpoint.markers_for(self.context.factory_name) if checkpoint is not None else {}
        for name in self.context.stores:
            self._guards[name] = threading.Lock()
            restored_by = self.context.restored_by.get(name)
            self._chunks[name], self._named[name] = None, set()
            if restored_by is None:  # the store started empty
                self._chunks[name] = []
            elif restored_by == self.context.factory_name and name in markers:
                self.adopt(name, markers[name])
            # else: another backend restored the store (ours failed or came later): build on nothing of ours

    def adopt(self, store: str, marker: str) -> None:
        """Build the next commit of ``store`` on manifest ``marker`` (the one this backend restored)."""
        manifest = read_manifest(self.context, store, marker)
        self._chunks[store] = list(manifest.chunks)
        prefix = self.context.blob_prefix(store)
        self._named[store] = {marker, *(chunk_name(prefix, ref.cid) for ref in manifest.chunks)}
        self._ever[store] = set(self._named[store])

    def snapshot(self, checkpoint_id: CheckpointId, changes: Mapping[str, ChangeSet]) -> StoreMarkers:
        prepared = {
            name: Step(change, change.read_view(), manifest_name(self.context.blob_prefix(name), change.version))
            for name, change in changes.items()
            if name in self.context.stores
        }
        with self._lock:
            abandoned, self._prepared = self._prepared, prepared
        _close_views(abandoned)
        return {name: step.manifest for name, step in prepared.items()}

    def upload(self, checkpoint_id: CheckpointId, markers: StoreMarkers) -> Future[StoreMarkers]:
        with self._lock:
            prepared, self._prepared = self._prepared, {}
        return self.context.executor.submit(self._upload_all, prepared, dict(markers))

    def _upload_all(self, prepared: dict[str, Step], markers: StoreMarkers) -> StoreMarkers:
        try:
            for name, step in prepared.items():
                self.upload_store(name, step)
        except BaseException:
            with self._lock:  # the flushed changes are in no manifest: the next upload cuts the whole view
                self._chunks.update(dict.fromkeys(prepared))
            raise
        finally:
            _close_views(prepared)
            with self._lock:
                for name in prepared:
                    self._writing.pop(name, None)
        return markers

    def upload_store(self, name: str, step: Step) -> None:
        """Cut the changed ranges into chunks, write the new ones, then the manifest."""
        view = step.view.result()
        version = step.change.version
        if view.version != version:
            raise InconsistentStateError(f"store {name}: the read view is at {view.version}, not {version}")
        with self._lock:
            old = self._chunks.get(name)
            named = set(self._named.get(name, ()))
        chunks, fresh = self.rechunk(view, step.change, old)
        prefix = self.context.blob_prefix(name)
        blobs = [chunk_name(prefix, ref.cid) for ref in chunks]
        with self._lock:  # held before any write: the framework's sweep reads it again before it deletes
            self._writing[name] = {step.manifest, *blobs}
            # a chunk an older checkpoint of ours named, and the last one does not, may be in a release's garbage
            # right now: registered again under the collector's guard, it is either deleted before we write it or
            # kept
            risky = bool(set(blobs) & (self._ever.get(name, set()) - named))
        if risky:
            with self._guard(name), self._lock:
                self._writing[name] = {step.manifest, *blobs}
        for ref, blob in zip(chunks, blobs, strict=True):
            if blob in named or ref.cid not in fresh:
                continue  # named by the last durable manifest (shared with it): never written again
            self.put(name, blob, encode_chunk(fresh.pop(ref.cid)))
        manifest = Manifest(
            self.context.job_name, self.context.task_name, name, version.checkpoint_id, version.token, tuple(chunks)
        )
        self.put(name, step.manifest, encode_manifest(manifest), create_only=True)
        with self._lock:
            self._chunks[name] = chunks
            self._named[name] = {step.manifest, *blobs}
            self._ever.setdefault(name, set()).update(blobs)

    def rechunk(
        self, view: ReadView, change: Iterable[tuple[bytes, bytes | None]], old: list[ChunkRef] | None
    ) -> tuple[list[ChunkRef], dict[str, list[Item]]]:
        """The store's chunks at the view's version, and the records of those cut now (by content id): ``old`` with
        every chunk whose key range a changed key falls in cut again from the view (``old`` ``None`` or empty: the
        whole view)."""
        fresh: dict[str, list[Item]] = {}
        if not old:
            return self.cut(view, None, None, fresh), fresh
        firsts = [ref.first for ref in old]
        touched = sorted({max(0, bisect.bisect_right(firsts, key) - 1) for key, _ in change})
        chunks: list[ChunkRef] = []
        done = 0
        for start, end in _runs(touched):
            chunks += old[done:start]
            low = None if start == 0 else old[start].first
            high = old[end + 1].first if end + 1 < len(old) else None
            chunks += self.cut(view, low, high, fresh)
            done = end + 1
        return chunks + old[done:], fresh

    def cut(
        self, view: ReadView, low: bytes | None, high: bytes | None, fresh: dict[str, list[Item]]
    ) -> list[ChunkRef]:
        """The chunks of the view's key range ``[low, high)`` (at most ``chunk_records`` records each, as even as
        the range allows); their records go into ``fresh`` by content id."""
        items = list(view.iter_range(low, high))
        if not items:
            return []
        parts = -(-len(items) // self.chunk_records)
        size = -(-len(items) // parts)
        refs = []
        for i in range(0, len(items), size):
            piece = items[i : i + size]
            cid = self.content_id(piece)
            fresh[cid] = piece
            refs.append(ChunkRef(piece[0][0], cid, len(piece)))
        return refs

    def content_id(self, items: list[Item]) -> str:
        """A chunk's content id (:func:`sb_dedup.format.content_id`)."""
        return content_id(items)

    def put(self, store: str, name: str, data: bytes, *, create_only: bool = False) -> None:
        """One write, with ``created_at`` metadata for the grace rule; a create-only write that finds its own bytes
        is fine (a retry)."""
        blob_store = self.context.blob_store
        metadata = created_at_metadata(self._lifetime.now()) if blob_store.supports_metadata else None
        try:
            blob_store.put(name, data, create_only=create_only, metadata=metadata)
        except AlreadyExistsError:
            if blob_store.get(name) != data:
                raise
        self.context.metrics.increment(
            "commit.bytes.uploaded", len(data), store=store, backend=self.context.factory_name
        )
        self.context.metrics.increment("commit.files.uploaded", 1, store=store, backend=self.context.factory_name)

    def held_blobs(self, store: str) -> set[str]:
        """The last durable manifest and its chunks (the next commit names them again), and what the running upload
        writes."""
        with self._lock:
            return set(self._named.get(store, ())) | set(self._writing.get(store, ()))

    def _guard(self, store: str) -> contextlib.AbstractContextManager[object]:
        return self._guards.get(store) or contextlib.nullcontext()

    def blob_lifetime(self) -> BlobLifetime | None:
        return self._lifetime

    def abort(self, checkpoint_id: CheckpointId) -> None:
        with self._lock:
            abandoned, self._prepared = self._prepared, {}
            self._chunks.update(dict.fromkeys(self._chunks))  # the aborted flush is in no manifest
        _close_views(abandoned)

    def close(self) -> None:
        with self._lock:
            abandoned, self._prepared = self._prepared, {}
        _close_views(abandoned)


class DedupLifetime(BlobLifetime):
    """The dedup backend's blobs, for the framework's collector: a marker references its manifest and the chunks it
    lists (a chunk shared by several checkpoints stays while any retained one names it); the manager holds its last
    durable manifest's blobs and those of the running upload. It never lists nor deletes."""

    def __init__(self, manager: DedupBackupManager) -> None:
        super().__init__(
            manager.context, grace_ms=manager.grace_ms, sweep_interval_commits=manager.sweep_interval_commits
        )
        self.manager = manager
        self._cache: dict[tuple[str, str], list[str]] = {}

    def referenced_blobs(self, store: str, marker: str) -> list[str] | None:
        key = (store, marker)
        if key not in self._cache:
            try:
                self._cache[key] = referenced_blobs(self.context, store, marker)
            except NotFoundError:
                return None  # cannot tell what a missing manifest named: nothing is swept
        return self._cache[key]

    def held_blobs(self, store: str) -> set[str]:
        return self.manager.held_blobs(store)

    def guard(self, store: str) -> contextlib.AbstractContextManager[object]:
        return self.manager._guard(store)


def _runs(indices: list[int]) -> Iterable[tuple[int, int]]:
    """Sorted indices as runs of consecutive ones: ``(first, last)``."""
    start = prev = None
    for index in indices:
        if start is None:
            start = prev = index
        elif prev is not None and index == prev + 1:
            prev = index
        else:
            assert prev is not None
            yield start, prev
            start = prev = index
    if start is not None and prev is not None:
        yield start, prev


def _close_views(steps: Mapping[str, Step]) -> None:
    for step in steps.values():
        close_when_ready(step.view)
