"""Restore side of the blob-snapshot backend.

For each store, the marker names an index. Restore reads and verifies it, then:

- **reuse**: when the local store's version (checkpoint id + flush token) equals the index's AND a compacted copy of
  the local environment hashes to the index's file hash, the local data already is the checkpoint: nothing is
  downloaded or swapped. The version alone is never trusted, nor a size: the bytes are hashed.
- **rebuild** otherwise: the target file is assembled in a temp dir inside the store dir. A chunk whose hash the
  local copy also has (cut at the same chunk size) is taken from local disk; every other chunk is downloaded in
  parallel on a private bounded pool, its length and hash verified as it arrives, and written at its offset. The file
  is then hashed whole, fsynced, and swapped in with ``LocalStore.replace_environment`` (two renames), so a failed or
  interrupted restore leaves the previous local state exactly as it was.

A missing index or chunk raises :class:`NotFoundError`, a damaged one :class:`CorruptDataError`; both name the blob
and nothing is swapped in.
"""

from __future__ import annotations

import logging
import os
import shutil
import tempfile
import threading
import time
from collections.abc import Mapping
from concurrent.futures import FIRST_COMPLETED, Future, ThreadPoolExecutor, wait
from pathlib import Path

import attrs
from statebackend.backends.blobsnapshot.backup import read_index
from statebackend.backends.blobsnapshot.format import (
    ChunkRef,
    FileEntry,
    SnapshotIndex,
    chunk_hash,
    chunk_name,
    index_prefix,
    new_hasher,
)
from statebackend.checkpoint import CheckpointV2

from statebackend.contracts import BackendContext, TaskRestoreManager
from statebackend.errors import CorruptDataError, NotFoundError, StateBackendError
from statebackend.fsutil import fsync_dir
from statebackend.store import LocalStore

__all__ = ["BlobSnapshotRestoreManager", "RestoreInterrupted"]

log = logging.getLogger(__name__)

TEMP_PREFIX = ".blobsnapshot-restore-"
_READ_BUFFER = 4 << 20


class RestoreInterrupted(StateBackendError, InterruptedError):
    """``interrupt()`` was called; nothing was swapped in, the store holds its previous state."""


@attrs.frozen
class _LocalChunks:
    """Chunks of a compacted copy of the local environment: hash -> (file, offset, size); whole-file hashes."""

    chunks: Mapping[str, tuple[Path, int, int]]
    file_hashes: Mapping[str, str]


@attrs.define(eq=False)
class BlobSnapshotRestoreManager(TaskRestoreManager):
    context: BackendContext
    download_concurrency: int = 8
    _markers: dict[str, str] = attrs.field(init=False, factory=dict)
    _interrupted: threading.Event = attrs.field(init=False, factory=threading.Event)

    def init(self, checkpoint: CheckpointV2 | None) -> None:
        markers = checkpoint.markers_for(self.context.factory_name) if checkpoint is not None else {}
        self._markers = {name: markers[name] for name in self.context.stores if name in markers}

    def interrupt(self) -> None:
        """Ask a running restore to stop before its next chunk; nothing is swapped in."""
        self._interrupted.set()

    def restore(self) -> None:
        with ThreadPoolExecutor(self.download_concurrency, thread_name_prefix="blobsnapshot-restore") as pool:
            for name, store in self.context.stores.items():
                marker = self._markers.get(name)
                started = time.monotonic()
                if marker is None:
                    store.replace_contents([], None)
                else:
                    self._restore_store(pool, name, store, marker)
                self.context.metrics.record("restore.store.ms", (time.monotonic() - started) * 1000.0)

    # -- internals ---------------------------------------------------------------------------------------------

    def _restore_store(self, pool: ThreadPoolExecutor, name: str, store: LocalStore, marker: str) -> None:
        context = self.context
        metrics = context.metrics
        if not marker.startswith(index_prefix(context.blob_prefix(name))):
            raise CorruptDataError(
                f"store {name}: the checkpoint's blobsnapshot marker {marker!r} is not an index blob of this store "
                f"(expected under {index_prefix(context.blob_prefix(name))}); restore an older checkpoint or from "
                f"another backend's marker"
            )
        # intact and bound to its name: (job, task, store, seq, token), so no other index can stand in for it
        index = read_index(context.blob_store, marker, job=context.job_name, task=context.task_name, store=name)
        for stale in Path(store.path).glob(TEMP_PREFIX + "*"):  # left by a crashed restore
            shutil.rmtree(stale, ignore_errors=True)
        tmp = Path(tempfile.mkdtemp(dir=store.path, prefix=TEMP_PREFIX))
        try:
            local = self._local_chunks(store, tmp / "local", index)
            if store.version == index.version and all(
                local.file_hashes.get(entry.name) == entry.hash for entry in index.files
            ):
                metrics.increment("restore.stores.reused")
                log.info("store %s: local state already is %s (content hash verified)", name, marker)
                return
            target = tmp / "env"
            target.mkdir()
            for entry in index.files:
                self._assemble(pool, entry, target / entry.name, local, marker, context.blob_prefix(name))
            fsync_dir(target)
            self._check_interrupt(name)
            store.replace_environment(target)
            metrics.increment("restore.stores.full")
            log.info("store %s: restored from %s", name, marker)
        finally:
            shutil.rmtree(tmp, ignore_errors=True)

    def _local_chunks(self, store: LocalStore, directory: Path, index: SnapshotIndex) -> _LocalChunks:
        if store.version is None and store.count() == 0:
            return _LocalChunks({}, {})
        store.copy_environment(directory)
        chunks: dict[str, tuple[Path, int, int]] = {}
        file_hashes: dict[str, str] = {}
        for path in sorted(directory.iterdir()):
            if not path.is_file():
                continue
            whole = new_hasher()
            offset = 0
            with open(path, "rb") as source:
                while data := source.read(index.chunk_size):
                    whole.update(data)
                    chunks.setdefault(chunk_hash(data), (path, offset, len(data)))
                    offset += len(data)
            file_hashes[path.name] = whole.hexdigest()
        return _LocalChunks(chunks, file_hashes)

    def _assemble(
        self,
        pool: ThreadPoolExecutor,
        entry: FileEntry,
        path: Path,
        local: _LocalChunks,
        marker: str,
        store_prefix: str,
    ) -> None:
        metrics = self.context.metrics
        window = 2 * self.download_concurrency  # bounds memory: at most this many chunks held at once
        inflight: dict[Future[bytes], int] = {}
        downloaded = reused = 0
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
        try:
            os.ftruncate(fd, entry.size)
            for offset, chunk in entry.offsets():
                self._check_interrupt(entry.name)
                source = local.chunks.get(chunk.hash)
                if source is not None and source[2] == chunk.size:
                    _pwrite_all(fd, _pread_exact(source[0], source[1], source[2]), offset)
                    reused += chunk.size
                    continue
                while len(inflight) >= window:
                    downloaded += self._write_done(fd, inflight)
                inflight[pool.submit(self._download_chunk, chunk, marker, store_prefix)] = offset
            while inflight:
                downloaded += self._write_done(fd, inflight)
            os.fsync(fd)
        finally:
            for future in inflight:
                future.cancel()
            os.close(fd)
        metrics.increment("restore.bytes", downloaded)
        metrics.increment("restore.bytes.reused", reused)
        whole = new_hasher()
        with open(path, "rb") as written:
            while data := written.read(_READ_BUFFER):
                whole.update(data)
        if whole.hexdigest() != entry.hash:
            raise CorruptDataError(
                f"index blob {marker}: {entry.name} assembled from verified chunks does not match the file hash; "
                f"the index is inconsistent and was not loaded"
            )

    def _write_done(self, fd: int, inflight: dict[Future[bytes], int]) -> int:
        done, _ = wait(list(inflight), return_when=FIRST_COMPLETED)
        written = 0
        for future in done:
            offset = inflight.pop(future)
            data = future.result()  # raises the chunk's NotFoundError / CorruptDataError
            _pwrite_all(fd, data, offset)
            written += len(data)
        return written

    def _download_chunk(self, chunk: ChunkRef, marker: str, store_prefix: str) -> bytes:
        blob_store = self.context.blob_store
        name = chunk_name(store_prefix, chunk.hash)
        if self._interrupted.is_set():
            raise RestoreInterrupted(f"restore interrupted before chunk {name}")
        try:
            data = blob_store.get(name)
        except NotFoundError as exc:
            raise NotFoundError(
                f"chunk {name} that index {marker} lists is missing from {blob_store.describe()}; this checkpoint "
                f"cannot be restored from blobsnapshot: restore an older checkpoint or from another backend's marker"
            ) from exc
        if len(data) != chunk.size or chunk_hash(data) != chunk.hash:
            raise CorruptDataError(
                f"chunk {name} that index {marker} lists failed its hash check ({len(data)} bytes, expected "
                f"{chunk.size}); it was damaged in the blob store and was not loaded"
            )
        return data

    def _check_interrupt(self, what: str) -> None:
        if self._interrupted.is_set():
            raise RestoreInterrupted(f"restore of {what} interrupted; the store keeps its previous state")


def _pread_exact(path: Path, offset: int, size: int) -> bytes:
    with open(path, "rb") as source:
        source.seek(offset)
        data = source.read(size)
    if len(data) != size:
        raise StateBackendError(f"local copy {path} is shorter than expected")
    return data


def _pwrite_all(fd: int, data: bytes, offset: int) -> None:
    view = memoryview(data)
    while view:
        written = os.pwrite(fd, view, offset)
        view = view[written:]
        offset += written
