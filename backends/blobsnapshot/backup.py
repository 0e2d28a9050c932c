"""Backup side of the blob-snapshot backend (seed 002).

Per commit and store:

- ``snapshot()`` (task thread, O(1)): opens an LMDB read transaction on the version the commit just flushed and
  names the index this commit will write. The change set is not needed: the whole environment is the snapshot.
- ``upload()`` (commit pool): copies that read view into a staging dir (a compacted LMDB copy, consistent while
  processing goes on), cuts each file into fixed-size chunks named by their blake2b-256, uploads on a private
  bounded pool only the chunks the blob store lacks (an in-memory set of known chunks, seeded from the restored
  index; ``head()`` for the rest, which must show the chunk's length; create-only writes, where "already exists"
  means present once a ``head()`` shows that length), then writes the index create-only. The marker is the index's
  name.
- ``cleanup()`` (commit pool, after the checkpoint is durable): removes the expiry of the index and of its chunks
  (seed 002's remove-TTL), then deletes the indexes that fell out of the last ``task.checkpoint.retained`` and the
  chunks only they referenced. Idempotent; an absent blob is success.

Garbage of failed or abandoned uploads (chunks with no index, indexes with no checkpoint) is removed by a
mark-and-sweep (:meth:`BlobSnapshotBackupManager.sweep`, at init and every ``gc.interval.commits`` cleanups): the
mark is every index a checkpoint in the checkpoint log names plus the ones this manager holds; the sweep deletes
unreferenced blobs older than the grace period (``created_at`` metadata), already expired (``expires_at``), or made
durable once and since dropped. Where the blob store keeps no metadata, age is the time a sweep first saw the blob.

Why fixed-size chunks: a compacted LMDB copy is a sequence of 4 KiB pages in tree order, so an update in place
changes only the chunks holding the touched pages, and a measured single insert mid-file changed 2 of 22 chunks;
content-defined chunking in pure Python would cost more CPU per byte than it saves here (docs/formats-blobsnapshot.md).

Uploads, cleanups and sweeps of a store are serialized by a per-store lock, so a sweep never deletes a chunk that an
upload has just decided to reuse. ``snapshot()`` takes only a short lock, never that one.
"""

from __future__ import annotations

import logging
import shutil
import threading
import time
from collections import deque
from collections.abc import Callable, Iterator, Mapping
from concurrent.futures import FIRST_COMPLETED, Future, ThreadPoolExecutor, wait
from contextlib import contextmanager
from pathlib import Path

import attrs
from statebackend.backends.blobsnapshot.format import (
    ChunkRef,
    FileEntry,
    SnapshotIndex,
    check_index_binding,
    chunk_hash,
    chunk_name,
    chunks_prefix,
    index_prefix,
    new_hasher,
    parse_index_name,
)
from statebackend.backends.blobsnapshot.format import index_name as make_index_name
from statebackend.checkpoint import CheckpointId, CheckpointLog, CheckpointV2

from statebackend.blobstores.base import BlobStore
from statebackend.concurrency import LazyPool
from statebackend.contracts import BackendContext, StoreMarkers, TaskBackupManager
from statebackend.crashpoints import crashpoint
from statebackend.errors import (
    AlreadyExistsError,
    CorruptDataError,
    IncompatibleFormatError,
    NotFoundError,
    StateBackendError,
)
from statebackend.store import LocalStore, LocalVersion, ReadView

__all__ = ["STAGING_DIR", "BlobSnapshotBackupManager", "SweepReport", "read_index"]

log = logging.getLogger(__name__)

STAGING_DIR = "blobsnapshot-staging"
#: metadata keys on chunks and indexes (seconds since the epoch, as decimal strings)
CREATED_AT = "created_at"
EXPIRES_AT = "expires_at"
DURABLE_AT = "durable_at"


def read_index(blob_store: BlobStore, name: str, *, job: str, task: str, store: str) -> SnapshotIndex:
    """Read and verify index blob ``name``: intact (checksum) and bound to its name (job, task, store, seq, token;
    see :func:`check_index_binding`). :class:`NotFoundError` / :class:`CorruptDataError` name it."""
    try:
        data = blob_store.get(name)
    except NotFoundError as exc:
        raise NotFoundError(
            f"store {store}: index blob {name} is missing from {blob_store.describe()}; the checkpoint "
            f"cannot be restored from blobsnapshot: restore an older checkpoint or from another backend's marker"
        ) from exc
    index = SnapshotIndex.decode(data, name=name)
    check_index_binding(index, name=name, job=job, task=task, store=store)
    return index


@attrs.frozen
class SweepReport:
    """What one mark-and-sweep deleted (and whether it had to skip chunks because a live index was unreadable)."""

    indexes_deleted: int = 0
    chunks_deleted: int = 0
    chunks_skipped: bool = False


@attrs.define(eq=False)
class _StoreState:
    """The backup state of one store."""

    name: str
    store: LocalStore
    prefix: str
    staging: Path
    seq: int = 0
    #: chunk hashes known to be in the blob store
    known: set[str] = attrs.field(factory=set)
    #: chunk hashes whose expiry was removed (referenced by a durable index)
    durable_chunks: set[str] = attrs.field(factory=set)
    #: the last index written: the base of the next index's added/removed lists
    previous: SnapshotIndex | None = None
    previous_name: str | None = None
    #: read views taken by snapshot(), by marker, until upload() copies them
    views: dict[str, Future[ReadView]] = attrs.field(factory=dict)
    #: indexes written whose checkpoint is not (yet) known durable
    pending: dict[str, SnapshotIndex] = attrs.field(factory=dict)
    #: durable indexes, oldest first, at most ``retained``
    retained: deque[tuple[str, SnapshotIndex]] = attrs.field(factory=deque)
    cleanups: int = 0
    last_durable_seq: int = 0
    #: first time a sweep saw a blob, for blob stores without metadata
    first_seen: dict[str, float] = attrs.field(factory=dict)
    #: guards the quick fields above (seq, views); held only briefly
    state_lock: threading.Lock = attrs.field(factory=threading.Lock)
    #: serializes upload, cleanup and sweep of this store
    io_lock: threading.Lock = attrs.field(factory=threading.Lock)

    def live_indexes(self, *, suspect_pending: bool = True) -> dict[str, SnapshotIndex]:
        """Indexes this manager must keep. ``suspect_pending=False`` leaves out the pending ones older than the
        newest durable one: their commit failed, or their cleanup is late (then the checkpoint log names them)."""
        live = dict(self.retained)
        live.update((name, index) for name, index in self.pending.items()
                    if suspect_pending or index.seq > self.last_durable_seq)
        if self.previous is not None and self.previous_name is not None:
            live[self.previous_name] = self.previous
        return live


@attrs.define(eq=False)
class BlobSnapshotBackupManager(TaskBackupManager):
    context: BackendContext
    chunk_size: int
    upload_concurrency: int
    retained: int
    grace_period_ms: int
    ttl_ms: int
    gc_interval_commits: int
    gc_on_init: bool = False
    #: wall clock (seconds since the epoch) for blob ages; tests may replace it
    clock: Callable[[], float] = time.time
    _states: dict[str, _StoreState] = attrs.field(init=False, factory=dict)
    _pool: LazyPool = attrs.field(init=False)
    _init_sweep: Future[SweepReport] | None = attrs.field(init=False, default=None)
    _closed: bool = attrs.field(init=False, default=False)

    # -- contract -----------------------------------------------------------------------------------------------

    def init(self, checkpoint: CheckpointV2 | None) -> None:
        markers = checkpoint.markers_for(self.context.factory_name) if checkpoint is not None else {}
        for name, store in self.context.stores.items():
            staging = Path(store.path) / STAGING_DIR
            staging.mkdir(exist_ok=True)
            for stale in staging.iterdir():  # copies of a crashed process (never referenced), not the copy of an
                _remove_unless_in_flight(stale)  # upload of an earlier open in this process whose close timed out
            state = _StoreState(name=name, store=store, prefix=self.context.blob_prefix(name), staging=staging)
            marker = markers.get(name)
            if marker is not None:
                parsed = parse_index_name(marker)
                state.seq = parsed[0] if parsed is not None else 0
                self._adopt_restored_index(state, marker)
            self._states[name] = state
        if self.gc_on_init and self._states:
            self._init_sweep = self.context.executor.submit(self.sweep)

    def snapshot(self, checkpoint_id: CheckpointId, changes: Mapping[str, object]) -> StoreMarkers:
        markers: StoreMarkers = {}
        for name, state in self._states.items():
            change = changes[name]
            version = change.version  # type: ignore[attr-defined]
            # O(1) and non-blocking: a read transaction on exactly this version, opened by the store's applier as
            # soon as the flushed batch is in LMDB; upload() waits for it on the commit pool
            view = change.read_view()  # type: ignore[attr-defined]
            with state.state_lock:
                state.seq += 1
                marker = make_index_name(state.prefix, state.seq, version.token)
                state.views[marker] = view
            markers[name] = marker
        return markers

    def upload(self, checkpoint_id: CheckpointId, markers: StoreMarkers) -> Future[StoreMarkers]:
        futures = {name: self.context.executor.submit(self._upload_store, self._states[name], marker)
                   for name, marker in markers.items()}
        return _gather(futures)

    def cleanup(self, checkpoint_id: CheckpointId, markers: StoreMarkers) -> Future[None]:
        return self.context.executor.submit(self._cleanup, dict(markers))

    def abort(self, checkpoint_id: CheckpointId) -> None:
        """The commit's sync part failed after our snapshot(): close the views it opened (they pin LMDB pages)."""
        for state in self._states.values():
            with state.state_lock:
                views, state.views = list(state.views.values()), {}
            for view in views:
                _close_when_ready(view)

    def close(self) -> None:
        if self._closed:
            return
        self._closed = True
        if self._init_sweep is not None:
            try:
                self._init_sweep.exception()
            except BaseException:  # noqa: BLE001, S110 - a cancelled sweep
                pass
        for state in self._states.values():
            with state.state_lock:
                views, state.views = list(state.views.values()), {}
            for view in views:
                _close_when_ready(view)
        self._pool.close(wait=True)

    # -- garbage collection -------------------------------------------------------------------------------------

    def sweep(self, now: float | None = None) -> SweepReport:
        """Mark-and-sweep every store's blobs (see the module docstring). Safe to call at any time."""
        total = SweepReport()
        for state in self._states.values():
            with state.io_lock:
                report = self._sweep_store(state, self.clock() if now is None else now)
            total = SweepReport(
                total.indexes_deleted + report.indexes_deleted,
                total.chunks_deleted + report.chunks_deleted,
                total.chunks_skipped or report.chunks_skipped,
            )
        return total

    # -- init ---------------------------------------------------------------------------------------------------

    def _adopt_restored_index(self, state: _StoreState, marker: str) -> None:
        try:
            index = self._read_index(marker, state.name)
        except (NotFoundError, CorruptDataError, IncompatibleFormatError) as exc:
            # The store was restored some other way (fallback) or the index is gone: start over, upload in full.
            log.warning("store %s: cannot read the checkpoint's blobsnapshot index (%s); the next snapshot uploads "
                        "every chunk the blob store lacks", state.name, exc)
            return
        state.previous, state.previous_name = index, marker
        state.known = index.chunk_hashes()
        state.retained.append((marker, index))
        # A crash between the checkpoint write and cleanup leaves the expiry on a durable index: remove it now.
        if self.context.blob_store.supports_metadata:
            try:
                metadata = self.context.blob_store.head(marker).metadata
            except NotFoundError:
                metadata = {}
            if EXPIRES_AT in metadata:
                self._make_durable(state, marker, index)
            else:
                state.durable_chunks = set(state.known)

    def _read_index(self, marker: str, store: str) -> SnapshotIndex:
        context = self.context
        return read_index(context.blob_store, marker, job=context.job_name, task=context.task_name, store=store)

    # -- upload -------------------------------------------------------------------------------------------------

    def _upload_store(self, state: _StoreState, marker: str) -> str:
        with state.state_lock:
            view_future = state.views.pop(marker, None)
            parsed = parse_index_name(marker)
            stale = [m for m in state.views if (parse_index_name(m) or (0, ""))[0] < (parsed or (0, ""))[0]]
            stale_views = [state.views.pop(m) for m in stale]
        for old in stale_views:  # snapshots whose upload never started (their commit failed before upload)
            _close_when_ready(old)
        if view_future is None:
            raise StateBackendError(f"store {state.name}: no snapshot was taken for {marker}; call snapshot() first")
        view = view_future.result()
        version = view.version
        assert version is not None and parsed is not None
        staging = state.staging / Path(marker).stem
        with _staging_in_flight(staging):
            return self._upload_staged(state, marker, staging, view, version, parsed[0])

    def _upload_staged(self, state: _StoreState, marker: str, staging: Path, view: ReadView, version: LocalVersion,
                       seq: int) -> str:
        try:
            shutil.rmtree(staging, ignore_errors=True)
            view.copy_to(staging)
        except BaseException:
            shutil.rmtree(staging, ignore_errors=True)
            raise
        finally:
            view.close()
        crashpoint("blobsnapshot.upload.staged")
        try:
            with state.io_lock:
                files = [self._upload_file(state, path) for path in sorted(staging.iterdir()) if path.is_file()]
                crashpoint("blobsnapshot.upload.chunks_uploaded")
                index = SnapshotIndex.build(
                    job=self.context.job_name,
                    task=self.context.task_name,
                    store=state.name,
                    version=version,
                    seq=seq,
                    chunk_size=self.chunk_size,
                    files=files,
                    previous=state.previous,
                    previous_name=state.previous_name,
                )
                self._put_index(marker, index)
                crashpoint("blobsnapshot.upload.index_written")
                state.known.update(index.chunk_hashes())
                state.previous, state.previous_name = index, marker
                state.pending[marker] = index
        finally:
            shutil.rmtree(staging, ignore_errors=True)
        return marker

    def _upload_file(self, state: _StoreState, path: Path) -> FileEntry:
        pool = self._private_pool()
        metrics = self.context.metrics
        file_hasher = new_hasher()
        chunks: list[ChunkRef] = []
        size = 0
        reused = 0
        seen: set[str] = set()
        inflight: set[Future[int]] = set()
        window = 2 * self.upload_concurrency  # bounds memory: at most this many chunks held at once
        uploaded = 0
        try:
            with open(path, "rb") as source:
                while True:
                    data = source.read(self.chunk_size)
                    if not data:
                        break
                    file_hasher.update(data)
                    digest = chunk_hash(data)
                    chunks.append(ChunkRef(digest, len(data)))
                    size += len(data)
                    if digest in state.known or digest in seen:
                        reused += len(data)
                        continue
                    seen.add(digest)
                    while len(inflight) >= window:
                        done, inflight = _wait_some(inflight)
                        uploaded += sum(f.result() for f in done)
                    inflight.add(pool.submit(self._put_chunk, state, digest, data))
            done, _ = wait(inflight)
            inflight = set()
            uploaded += sum(f.result() for f in done)
        finally:
            for future in inflight:
                future.cancel()
        # chunks found present by head() (or by a lost create-only race) count as reused too
        not_written = size - uploaded - reused
        metrics.increment("commit.bytes.reused", reused + not_written)
        metrics.increment("blobsnapshot.chunks.total", len(chunks))
        return FileEntry(name=path.name, size=size, hash=file_hasher.hexdigest(), chunks=tuple(chunks))

    def _put_chunk(self, state: _StoreState, digest: str, data: bytes) -> int:
        """Upload one chunk unless present; returns the bytes written.

        The index that will name this chunk is written only after this returns, so "present" needs evidence about
        *this* chunk: a ``head()`` that finds a blob of the chunk's length under its content-addressed name. A bare
        "exists" is not enough: a reply that answers some other request (a 200 with no length, seen as a HEAD's
        answer on a desynced connection) would make the index name a chunk that was never written. A create-only
        write refused as "already exists" is checked the same way; a blob of another length under the name (cut
        short, or the refusal was not about it) is overwritten with the chunk's bytes, the only bytes the name can
        hold."""
        blob_store = self.context.blob_store
        name = chunk_name(state.prefix, digest)
        if self._holds_chunk(name, len(data)):
            self.context.metrics.increment("blobsnapshot.chunks.reused")
            return 0
        try:
            blob_store.put(name, data, create_only=True, metadata=self._new_metadata())
        except AlreadyExistsError:
            if self._holds_chunk(name, len(data)):
                self.context.metrics.increment("blobsnapshot.chunks.reused")
                return 0  # same name, same content: someone (an earlier try) wrote it first
            log.warning("store %s: chunk %s was reported taken but holds no blob of its length; writing it again",
                        state.name, name)
            blob_store.put(name, data, metadata=self._new_metadata())
        crashpoint("blobsnapshot.upload.chunk_uploaded")
        metrics = self.context.metrics
        metrics.increment("blobsnapshot.chunks.uploaded")
        metrics.increment("commit.bytes.uploaded", len(data))
        metrics.increment("commit.files.uploaded")
        return len(data)

    def _holds_chunk(self, name: str, size: int) -> bool:
        """Whether the blob store holds a blob of ``size`` bytes under the chunk name ``name``."""
        try:
            info = self.context.blob_store.head(name)
        except NotFoundError:
            return False
        if info.size != size:
            log.warning("chunk %s: the blob store reports %d bytes where the chunk has %d; not taken as present",
                        name, info.size, size)
            return False
        return True

    def _put_index(self, marker: str, index: SnapshotIndex) -> None:
        data = index.encode()
        blob_store = self.context.blob_store
        try:
            blob_store.put(marker, data, create_only=True, metadata=self._new_metadata())
        except AlreadyExistsError:
            # the name carries the flush's random token: only an earlier try of this very upload can have written it
            try:
                existing = blob_store.get(marker)
            except NotFoundError:
                existing = None
            if existing != data:
                raise StateBackendError(
                    f"index blob {marker} already exists with other content in {blob_store.describe()}; another "
                    f"attempt of task {self.context.task_name} wrote it: restore from the latest checkpoint"
                ) from None
        metrics = self.context.metrics
        metrics.increment("commit.bytes.uploaded", len(data))
        metrics.increment("commit.files.uploaded")
        metrics.increment("blobsnapshot.indexes.uploaded")

    def _new_metadata(self) -> dict[str, str] | None:
        if not self.context.blob_store.supports_metadata:
            return None
        now = self.clock()
        return {CREATED_AT: f"{now:.3f}", EXPIRES_AT: f"{now + self.ttl_ms / 1000.0:.3f}"}

    @_pool.default
    def _new_pool(self) -> LazyPool:
        return LazyPool(self.upload_concurrency, "blobsnapshot-upload")

    def _private_pool(self) -> ThreadPoolExecutor:
        return self._pool.get()

    # -- cleanup ------------------------------------------------------------------------------------------------

    def _cleanup(self, markers: dict[str, str]) -> None:
        for name, marker in markers.items():
            state = self._states[name]
            with state.io_lock:
                self._cleanup_store(state, marker)
                state.cleanups += 1
                # by the checkpoint's sequence number, not by cleanups in this process: a job that opens its task
                # for each batch (the Spark driver) sweeps every gc.interval.commits commits all the same
                parsed = parse_index_name(marker)
                seq = parsed[0] if parsed is not None else state.cleanups
                if self.gc_interval_commits and seq % self.gc_interval_commits == 0:
                    self._sweep_store(state, self.clock())

    def _cleanup_store(self, state: _StoreState, marker: str) -> None:
        retained = dict(state.retained)
        index = state.pending.pop(marker, None) or retained.get(marker)
        if index is None:
            try:
                index = self._read_index(marker, state.name)
            except NotFoundError:
                # a late cleanup of a checkpoint that already fell out of retention: nothing left to do
                log.debug("store %s: cleanup of %s found it gone already", state.name, marker)
                return
        self._make_durable(state, marker, index)
        crashpoint("blobsnapshot.cleanup.expiry_removed")
        state.last_durable_seq = max(state.last_durable_seq, index.seq)
        if marker not in retained:
            state.retained.append((marker, index))
        self._settle_older_pending(state, index.seq)
        # cleanups may finish out of order on a pool: keep the window ordered by seq, newest last
        state.retained = deque(sorted(state.retained, key=lambda item: item[1].seq))
        dropped: list[tuple[str, SnapshotIndex]] = []
        while len(state.retained) > max(1, self.retained):
            dropped.append(state.retained.popleft())
        if not dropped:
            return
        live = state.live_indexes()
        keep = {digest for live_index in live.values() for digest in live_index.chunk_hashes()}
        garbage = sorted({digest for _, i in dropped for digest in i.chunk_hashes()} - keep)
        blob_store = self.context.blob_store
        for digest in garbage:
            blob_store.delete(chunk_name(state.prefix, digest))
            crashpoint("blobsnapshot.cleanup.deleted")
            state.known.discard(digest)
            state.durable_chunks.discard(digest)
        for name, _ in dropped:
            if name not in live:
                blob_store.delete(name)
                crashpoint("blobsnapshot.cleanup.deleted")
        self.context.metrics.increment("blobsnapshot.chunks.deleted", len(garbage))
        self.context.metrics.increment("blobsnapshot.indexes.deleted", len(dropped))

    def _settle_older_pending(self, state: _StoreState, seq: int) -> None:
        """Indexes written before ``seq`` whose commit never got a cleanup: their checkpoint write failed, or it
        landed with its reply lost (the framework then builds on it, without a cleanup for it). Once a later
        checkpoint is durable their outcome is settled, and the checkpoint log tells which: one it lists is durable
        (its expiry is removed and it joins the retention window, so neither a TTL nor retention drops it while the
        log still holds it); one it does not list is garbage the sweep collects."""
        older = sorted((m for m, i in state.pending.items() if i.seq < seq), key=lambda m: state.pending[m].seq)
        if not older:
            return
        in_log = self._markers_in_checkpoint_log(state.name)
        for marker in older:
            index = state.pending.pop(marker)
            if marker in in_log:
                log.info("store %s: index %s belongs to a checkpoint that landed although its write was reported "
                         "failed; kept as durable", state.name, marker)
                self._make_durable(state, marker, index)
                state.retained.append((marker, index))
                self.context.metrics.increment("blobsnapshot.indexes.landed.after.failure")
            else:
                log.info("store %s: index %s belongs to a commit whose checkpoint never landed; the sweep deletes "
                         "it after the grace period", state.name, marker)

    def _make_durable(self, state: _StoreState, marker: str, index: SnapshotIndex) -> None:
        """Seed 002's remove-TTL: a durable checkpoint's index and chunks never expire."""
        blob_store = self.context.blob_store
        if not blob_store.supports_metadata:
            return
        durable = {DURABLE_AT: f"{self.clock():.3f}"}
        for digest in sorted(index.chunk_hashes() - state.durable_chunks):
            try:
                blob_store.set_metadata(chunk_name(state.prefix, digest), durable)
            except NotFoundError:
                self.context.metrics.increment("blobsnapshot.chunks.missing")
                log.error("store %s: chunk %s of durable index %s is missing; that checkpoint cannot be restored "
                          "from blobsnapshot", state.name, chunk_name(state.prefix, digest), marker)
                state.known.discard(digest)  # so the next snapshot holding these bytes writes the chunk again
                continue
            except StateBackendError as exc:
                # not fatal to retention: the chunk stays out of durable_chunks and the next index using it retries
                self.context.metrics.increment("blobsnapshot.ttl.failures")
                log.warning("store %s: could not remove the expiry of chunk %s: %s", state.name,
                            chunk_name(state.prefix, digest), exc)
                continue
            state.durable_chunks.add(digest)
            self.context.metrics.increment("blobsnapshot.ttl.removed")
        try:
            blob_store.set_metadata(marker, durable)
        except NotFoundError:
            log.error("store %s: durable index %s is missing", state.name, marker)
        except StateBackendError as exc:
            self.context.metrics.increment("blobsnapshot.ttl.failures")
            log.warning("store %s: could not remove the expiry of index %s: %s", state.name, marker, exc)

    # -- mark and sweep -----------------------------------------------------------------------------------------

    def _sweep_store(self, state: _StoreState, now: float) -> SweepReport:
        blob_store = self.context.blob_store
        live: dict[str, SnapshotIndex | None] = dict(state.live_indexes(suspect_pending=False))
        for marker in self._markers_in_checkpoint_log(state.name):
            live.setdefault(marker, state.pending.get(marker))
        referenced: set[str] = set()
        complete = True
        kept_seqs = [parsed[0] for m, _ in state.retained if (parsed := parse_index_name(m)) is not None]
        oldest_kept = min(kept_seqs) if kept_seqs else None
        for marker, index in list(live.items()):
            if index is None:
                try:
                    index = self._read_index(marker, state.name)
                except NotFoundError:
                    parsed = parse_index_name(marker)
                    if oldest_kept is not None and parsed is not None and parsed[0] < oldest_kept:
                        # deleted by this manager's retention while the checkpoint log still lists it (the log is
                        # trimmed concurrently): no longer live, its chunks were released with it
                        del live[marker]
                        continue
                    complete = False
                    log.warning("store %s: sweep cannot find live index %s; chunks are left alone", state.name,
                                marker)
                    continue
                except (CorruptDataError, IncompatibleFormatError) as exc:
                    complete = False  # its chunks are unknown: deleting "unreferenced" chunks could hurt it
                    log.warning("store %s: sweep cannot read live index %s (%s); chunks are left alone",
                                state.name, marker, exc)
                    continue
            referenced |= index.chunk_hashes()
        indexes_deleted = 0
        for name in list(blob_store.list(index_prefix(state.prefix))):
            if name not in live and self._old_enough(state, name, now):
                blob_store.delete(name)
                crashpoint("blobsnapshot.sweep.deleted")
                state.pending.pop(name, None)
                indexes_deleted += 1
        chunks_deleted = 0
        if complete:
            for name in list(blob_store.list(chunks_prefix(state.prefix))):
                digest = name.rsplit("/", 1)[-1]
                if digest not in referenced and self._old_enough(state, name, now):
                    blob_store.delete(name)
                    crashpoint("blobsnapshot.sweep.deleted")
                    state.known.discard(digest)
                    state.durable_chunks.discard(digest)
                    state.first_seen.pop(name, None)
                    chunks_deleted += 1
        metrics = self.context.metrics
        metrics.increment("blobsnapshot.sweeps")
        metrics.increment("blobsnapshot.sweep.chunks.deleted", chunks_deleted)
        metrics.increment("blobsnapshot.sweep.indexes.deleted", indexes_deleted)
        if chunks_deleted or indexes_deleted:
            log.info("store %s: sweep deleted %d unreferenced chunks and %d indexes", state.name, chunks_deleted,
                     indexes_deleted)
        return SweepReport(indexes_deleted, chunks_deleted, not complete)

    def _checkpoint_log(self) -> CheckpointLog:
        """The task's log (its listings never show less than the newest checkpoint the task knows durable, so a
        short listing cannot make live indexes look unreferenced)."""
        return self.context.checkpoint_log

    def _markers_in_checkpoint_log(self, store_name: str) -> set[str]:
        """Index names that a checkpoint still in the checkpoint log needs: never garbage, whatever their age."""
        checkpoint_log = self._checkpoint_log()
        names = set()
        for entry in checkpoint_log.entries():
            if isinstance(entry.checkpoint, CheckpointV2):
                marker = entry.checkpoint.markers_for(self.context.factory_name).get(store_name)
                if marker is not None:
                    names.add(marker)
        return names

    def _old_enough(self, state: _StoreState, name: str, now: float) -> bool:
        """Whether an unreferenced blob may go: past its grace period, expired, or durable once and since dropped."""
        grace = self.grace_period_ms / 1000.0
        blob_store = self.context.blob_store
        if not blob_store.supports_metadata:
            return now - state.first_seen.setdefault(name, now) >= grace
        try:
            metadata = blob_store.head(name).metadata
        except NotFoundError:
            return False
        try:
            if EXPIRES_AT in metadata and float(metadata[EXPIRES_AT]) <= now:
                return True
            if CREATED_AT in metadata:
                return now - float(metadata[CREATED_AT]) >= grace
        except ValueError:
            log.warning("blob %s has unreadable age metadata %r; treating it as new", name, dict(metadata))
            return False
        if DURABLE_AT in metadata:
            # no age: its expiry was removed when a durable checkpoint used it, and no retained one does any more
            return True
        # no metadata we know (a reply whose metadata headers were cut, or a blob another tool wrote): its age is
        # unknown, so it is counted from when this manager first saw it, like a store that keeps no metadata
        return now - state.first_seen.setdefault(name, now) >= grace


#: staging dirs of uploads running in this process, by absolute path: the init of a later open of the same store
#: (its previous open's close timed out while an upload ran) must not delete them
_in_flight_lock = threading.Lock()
_in_flight: set[str] = set()


@contextmanager
def _staging_in_flight(staging: Path) -> Iterator[None]:
    with _in_flight_lock:
        _in_flight.add(str(staging))
    try:
        yield
    finally:
        with _in_flight_lock:
            _in_flight.discard(str(staging))


def _remove_unless_in_flight(path: Path) -> None:
    with _in_flight_lock:
        if str(path) in _in_flight:
            return
        if path.is_dir():
            shutil.rmtree(path, ignore_errors=True)
        else:
            path.unlink(missing_ok=True)


def _wait_some(futures: set[Future[int]]) -> tuple[set[Future[int]], set[Future[int]]]:
    done, not_done = wait(futures, return_when=FIRST_COMPLETED)
    return done, not_done


def _gather(futures: Mapping[str, Future[str]]) -> Future[StoreMarkers]:
    """One future for a dict of futures (resolved by callbacks: nobody waits on a pool thread)."""
    result: Future[StoreMarkers] = Future()
    if not futures:
        result.set_result({})
        return result
    lock = threading.Lock()
    remaining = [len(futures)]

    def one_done(_: Future[str]) -> None:
        with lock:
            remaining[0] -= 1
            if remaining[0]:
                return
        errors = [f.exception() for f in futures.values() if f.exception() is not None]
        if errors:
            result.set_exception(errors[0])
        else:
            result.set_result({name: f.result() for name, f in futures.items()})

    for future in futures.values():
        future.add_done_callback(one_done)
    return result


def _close_when_ready(view: Future[ReadView]) -> None:
    """Close a read view that may not be open yet (its flush still being applied)."""

    def close(done: Future[ReadView]) -> None:
        if not done.cancelled() and done.exception() is None:
            done.result().close()

    view.add_done_callback(close)
