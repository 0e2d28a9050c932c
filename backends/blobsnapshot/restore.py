"""Restore side of the blob-snapshot backend.

For each store, the marker carries an index (or, written by older releases, names an index blob): the live runs,
oldest first, from the empty store to the index's version. Restore decodes or reads and verifies the index
(checksum, binding to its marker), then does the least work the local store's
version allows (its LMDB meta holds the version of the last flush: a checkpoint id plus a random token, written in
the same transaction as the data):

- **reuse** when the local version is the index's: nothing is read, copied or hashed (a warm open costs nothing
  here, or the index blob's read for an older marker, whatever the state size);
- **catch-up** when the local version is the version a run of the index ends at (the store is an older version of
  this chain): only the runs after it are applied;
- **full** otherwise: every run is downloaded in parallel on a private pool (never the shared commit pool), each
  verified (size, content hash, header lineage) before any of it is applied. A base run written as an environment
  file (``statebackend.envbase``) is streamed into the store dir in ranged reads, verified, and swapped in as the
  store's environment: no record re-inserted, never held whole in memory. A first run of sorted records (an older
  base run, or the first run of a chain that began on the empty store) is bulk-loaded in one LMDB transaction in
  append mode (which drops what the store held). The later runs are applied in bulk in ONE transaction that also
  records the version the last one ends at (each page they touch copied once).

Each step is atomic and records its version, so a restore killed or failed half-way leaves the store at a version
of this chain (the first run's, or the last's; never a mix), and the next restore continues from it. After the last run
the key count is checked against the index's; then the index's own version is recorded. A missing run or index raises
:class:`NotFoundError`, a damaged one :class:`CorruptDataError`; both name the blob.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Iterable, Iterator
from concurrent.futures import Future, ThreadPoolExecutor
from pathlib import Path
from typing import TYPE_CHECKING, cast

import attrs
from statebackend.backends.blobsnapshot.blobs import read_marker, read_run
from statebackend.backends.blobsnapshot.format import (
    RunEntry,
    RunIndex,
    check_run_binding,
    index_prefix,
    is_inline_marker,
    marker_label,
    new_hasher,
    run_name,
)
from statebackend.backends.blobsnapshot.state import CACHE_DIR
from statebackend.checkpoint import CheckpointV2

from statebackend.contracts import BackendContext, TaskRestoreManager
from statebackend.envbase import (
    HEAD_BYTES,
    BaseSource,
    BlobSource,
    EnvBaseHeader,
    FileSource,
    is_env_base,
    load_env_base,
    remove_abandoned,
)
from statebackend.errors import CorruptDataError, NotFoundError
from statebackend.kit import InterruptFlag, log_extra, puts_only
from statebackend.recordfile import RecordReader, iter_records
from statebackend.store import LocalStore

if TYPE_CHECKING:
    from statebackend.blobstores.base import BlobStore

__all__ = ["BlobSnapshotRestoreManager"]

log = logging.getLogger(__name__)


@attrs.define(eq=False)
class BlobSnapshotRestoreManager(TaskRestoreManager):
    context: BackendContext
    download_concurrency: int = 8
    _markers: dict[str, str] = attrs.field(init=False, factory=dict)
    _interrupted: InterruptFlag = attrs.field(init=False, factory=InterruptFlag)
    #: base sources whose first bytes were read to tell their format, kept for the read that follows
    _sources: dict[str, BaseSource] = attrs.field(init=False, factory=dict)

    def init(self, checkpoint: CheckpointV2 | None) -> None:
        markers = checkpoint.markers_for(self.context.factory_name) if checkpoint is not None else {}
        self._markers = {name: markers[name] for name in self.context.stores if name in markers}

    def interrupt(self) -> None:
        """Ask a running restore to stop before its next run (see the contract); the store stays at a version of the
        chain."""
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
                self.context.metrics.record(
                    "restore.store.ms",
                    (time.monotonic() - started) * 1000.0,
                    store=name,
                    backend=self.context.factory_name,
                )

    # -- internals ---------------------------------------------------------------------------------------------

    def _restore_store(self, pool: ThreadPoolExecutor, name: str, store: LocalStore, marker: str) -> None:
        context = self.context
        metrics = context.metrics
        remove_abandoned(Path(store.path))  # what a restore killed mid-way left, whatever this one does next
        prefix = context.blob_prefix(name)
        if not is_inline_marker(marker) and not marker.startswith(index_prefix(prefix)):
            raise CorruptDataError(
                f"store {name}: the checkpoint's blobsnapshot marker {marker!r} is neither an inline index nor an "
                f"index blob of this store (expected under {index_prefix(prefix)}); restore an older checkpoint or "
                f"from another backend's marker"
            )
        # intact and bound to its marker: (job, task, store, seq, token), so no other index can stand in for it
        index = read_marker(context.blob_store, marker, job=context.job_name, task=context.task_name, store=name)
        marker = marker_label(marker)  # from here on, only messages name it
        local = store.version
        if local == index.version:
            metrics.increment("restore.stores.reused")
            log.info("store %s: local state already is %s", name, marker, extra=log_extra(self.context, name))
            return
        start = next((i + 1 for i in range(len(index.runs) - 1, -1, -1) if index.runs[i].version == local), None)
        to_apply = list(index.runs[start:]) if start is not None else list(index.runs)
        # a base run written as an environment file is streamed into place, never held whole; the others are
        # downloaded in parallel meanwhile
        env_base = (
            start is None
            and bool(to_apply)
            and to_apply[0].base
            and self._is_env_base(name, prefix, to_apply[0], marker, store)
        )
        applied = len(to_apply)
        # what the restore re-inserts into LMDB, record by record (an environment-file base is opened, not inserted):
        # its report says so, and what a restore costs is mostly this
        inserted = sum(run.records for run in to_apply[1 if env_base else 0 :])
        downloads: dict[RunEntry, Future[bytes]] = {
            run: pool.submit(self._download, name, prefix, run, marker, store)
            for run in to_apply[1 if env_base else 0 :]
        }
        try:
            if start is None:
                metrics.increment("restore.stores.full")
                if not to_apply:
                    store.replace_contents([], None)  # an index of an empty store: whatever was here goes
            else:
                metrics.increment("restore.stores.caught.up")
            if start is None and to_apply:
                # the first run on the empty store: one bulk load in append mode (deletes are no-ops there; a base
                # run has none, and goes straight from the decoder into LMDB)
                first = to_apply.pop(0)
                if env_base:
                    self._load_env_base(pool, name, prefix, first, marker, store)
                else:
                    records = self._records(name, prefix, first, downloads.pop(first))
                    puts = cast("Iterable[tuple[bytes, bytes]]", records) if first.base else puts_only(records)
                    store.replace_contents(puts, first.version)
                metrics.increment("restore.runs.applied")
            if to_apply:
                # every later run in bulk, in ONE transaction that records the version the last ends at (each LMDB
                # page they touch copied once, not once per run); a bad run, or an interrupt, aborts them all and
                # the store stays at the version before them, a version of this chain
                def change_sets() -> Iterator[Iterable[tuple[bytes, bytes | None]]]:
                    for run in to_apply:
                        self._interrupted.check(name)
                        yield self._records(name, prefix, run, downloads.pop(run))  # the reader checks the order

                store.apply_change_sets(change_sets(), to_apply[-1].version)
                metrics.increment("restore.runs.applied", len(to_apply))
        finally:
            for future in downloads.values():
                future.cancel()
        self._finish(name, store, index, marker)
        log.info(
            "store %s: restored from %s (%d of %d runs applied, %s, %d records re-inserted)",
            name,
            marker,
            applied,
            len(index.runs),
            "the base opened as an environment file" if env_base else "no environment-file base",
            inserted,
            extra=log_extra(self.context, name, runs_applied=applied, env_base=env_base, inserted=inserted),
        )

    def _records(self, name: str, prefix: str, run: RunEntry, download: Future[bytes]) -> RecordReader:
        data = download.result()  # raises the run's NotFoundError / CorruptDataError
        self.context.metrics.increment("restore.bytes", len(data), store=name, backend=self.context.factory_name)
        # verified (size, hash, digest, lineage) before this; order and count are checked while it is read
        return iter_records(data, name=run_name(prefix, run.hash), verified=True)

    def _finish(self, name: str, store: LocalStore, index: RunIndex, marker: str) -> None:
        """Check the key count the index recorded, then record the index's version."""
        count = store.count()
        if count != index.key_count:
            # never leave data that claims a version of this chain when it is not that version
            store.replace_contents([], None)
            raise CorruptDataError(
                f"store {name}: the runs of index {marker} rebuilt {count} keys where the index records "
                f"{index.key_count}; nothing was kept: restore an older checkpoint or from another backend's marker"
            )
        if store.version != index.version:
            store.apply_changes([], index.version)  # commits after the last run changed nothing

    def _download(self, name: str, prefix: str, run: RunEntry, marker: str, store: LocalStore) -> bytes:
        self._interrupted.check(name, before=f"run {run_name(prefix, run.hash)}")
        context = self.context
        # a run this machine wrote or merged may still be cached in the store dir: read, verified, not downloaded
        local = Path(store.path) / CACHE_DIR / run.hash
        return read_run(
            context.blob_store,
            prefix,
            run,
            index=marker,
            job=context.job_name,
            task=context.task_name,
            store=name,
            local=local,
        )

    def _base_source(
        self, name: str, prefix: str, run: RunEntry, marker: str, store: LocalStore, *, cached: bool = True
    ) -> BaseSource:
        """Where the base run is read from: the store dir's run cache when it holds a file of the run's size, else
        the blob store (a missing blob names itself and the index)."""
        local = Path(store.path) / CACHE_DIR / run.hash
        if cached and local.is_file() and local.stat().st_size == run.size:
            return FileSource(local, str(local))
        return _NamedBlobSource(self.context.blob_store, run_name(prefix, run.hash), run.size, index=marker)

    def _is_env_base(self, name: str, prefix: str, run: RunEntry, marker: str, store: LocalStore) -> bool:
        """Whether the base run is an environment file (written by this release) rather than sorted records. A
        blob store's first read is kept for the restore that follows, so the question costs no request."""
        source = self._base_source(name, prefix, run, marker, store)
        if isinstance(source, FileSource) and not is_env_base(source.read(0, min(run.size, HEAD_BYTES))):
            # a cached copy is not verified yet: one whose first bytes were damaged must not decide the format (an
            # intact environment-file base would be read as records, and refused); the blob store's copy decides
            source = self._base_source(name, prefix, run, marker, store, cached=False)
        self._sources[run.hash] = source
        return is_env_base(source.read(0, min(run.size, HEAD_BYTES)))

    def _load_env_base(
        self, pool: ThreadPoolExecutor, name: str, prefix: str, run: RunEntry, marker: str, store: LocalStore
    ) -> None:
        """Stream the base run into the store dir, verified (size, content hash, header lineage, digest, frames)
        before it replaces the store's environment; a damaged cached copy is read again from the blob store."""
        context = self.context
        source = self._sources.pop(run.hash, None) or self._base_source(name, prefix, run, marker, store)
        blob = run_name(prefix, run.hash)

        def check(header: EnvBaseHeader) -> None:
            check_run_binding(
                header.lineage, run, name=blob, index=marker, job=context.job_name, task=context.task_name, store=name
            )

        def load(source: BaseSource) -> None:
            hasher = new_hasher()

            def check_hash() -> None:
                if source.size != run.size or hasher.hexdigest() != run.hash:
                    raise CorruptDataError(
                        f"run {blob} that index {marker} lists failed its hash check ({source.size} bytes, expected "
                        f"{run.size}); it was damaged and was not loaded"
                    )

            load_env_base(
                store, source, run.version, check=check, pool=pool, content_hasher=hasher, after_read=check_hash
            )

        try:
            load(source)
        except CorruptDataError:
            if not isinstance(source, FileSource):
                raise
            log.warning(
                "store %s: the cached copy of base run %s is damaged; reading it from the blob store",
                name,
                blob,
                extra=log_extra(self.context, name),
            )
            load(self._base_source(name, prefix, run, marker, store, cached=False))
        context.metrics.increment("restore.bytes", run.size, store=name, backend=context.factory_name)


class _NamedBlobSource(BlobSource):
    """A base run in the blob store; a missing blob says which index lists it and what to do."""

    def __init__(self, blob_store: BlobStore, name: str, size: int, *, index: str) -> None:
        super().__init__(blob_store, name, size)
        self._index = index

    def read(self, start: int, end: int) -> bytes:
        try:
            return super().read(start, end)
        except NotFoundError as exc:
            raise NotFoundError(
                f"run {self.name} that index {self._index} lists is missing from {self.blob_store.describe()}; this "
                f"checkpoint cannot be restored from blobsnapshot: restore an older checkpoint or from another "
                f"backend's marker"
            ) from exc
