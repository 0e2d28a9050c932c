"""Writing and uploading runs (:class:`RunUpload`, the uploader the backup manager holds): a run is encoded into the
cache dir under the hash of its content (its bytes without the nonce trailer) and uploaded unless the blob store
already holds that run young enough to be named (the index goes into the checkpoint's marker, backup.py); a write of
a name written before carries a fresh nonce. Used by the commit's upload and by the compactor."""

from __future__ import annotations

import logging
import os
import uuid
from collections.abc import Callable, Iterable
from pathlib import Path
from typing import BinaryIO, cast

import attrs
from statebackend.backends.blobsnapshot.format import RunEntry, new_hasher, run_name
from statebackend.backends.blobsnapshot.state import BASE_LEVEL, BlobSnapshotShared, StoreState

from statebackend.crashpoints import crashpoint
from statebackend.envbase import write_env_base
from statebackend.errors import AlreadyExistsError, CommitError, NotFoundError
from statebackend.kit import log_extra, read_created_at
from statebackend.recordfile import KIND_RUN, TRAILER_SIZE, FileHeader, renew_nonce, write_file
from statebackend.recordfile.nonce import ends_in_trailer
from statebackend.store import LocalVersion, ReadView

__all__ = ["HashingWriter", "RunUpload"]

log = logging.getLogger(__name__)


@attrs.define(eq=False)
class RunUpload:
    """Runs, from records to blobs, on the manager's :class:`BlobSnapshotShared` (its context, options and clock)."""

    shared: BlobSnapshotShared

    def write_run(
        self,
        state: StoreState,
        records: Iterable[tuple[bytes, bytes | None]],
        *,
        first_seq: int,
        last_seq: int,
        version: LocalVersion,
        level: int,
        base: bool,
    ) -> RunEntry:
        """Encode ``records`` (sorted) as a run file in the cache dir, named by its hash."""
        header = FileHeader(
            kind=KIND_RUN,
            job=self.shared.context.job_name,
            task=self.shared.context.task_name,
            store=state.name,
            checkpoint_id=version.checkpoint_id,
            token=version.token,
            seq=last_seq,
            base_seq=first_seq - 1,
        )
        partial = state.staging / f"{uuid.uuid4().hex}.partial"
        try:
            with open(partial, "wb") as raw:
                out = HashingWriter(raw)
                stats = write_file(cast("BinaryIO", out), header, records, level=self.shared.settings.compression_level)
            digest = out.hexdigest()
            os.replace(partial, state.cache / digest)
        except BaseException:
            partial.unlink(missing_ok=True)
            raise
        return RunEntry(
            hash=digest,
            size=stats.file_bytes,
            records=stats.record_count,
            level=level,
            base=base,
            first_seq=first_seq,
            last_seq=last_seq,
            checkpoint_id=version.checkpoint_id,
            token=version.token,
        )

    def write_base(
        self,
        state: StoreState,
        view: ReadView,
        *,
        last_seq: int,
        version: LocalVersion,
        check: Callable[[], None] | None = None,
    ) -> RunEntry:
        """Write a base run of the whole store at ``version`` (which ``view`` must be at) into the cache dir, named by
        its hash: an environment-file base (``statebackend.envbase``), so a cold restore streams it into place with
        no re-insertion."""
        header = FileHeader(
            kind=KIND_RUN,
            job=self.shared.context.job_name,
            task=self.shared.context.task_name,
            store=state.name,
            checkpoint_id=version.checkpoint_id,
            token=version.token,
            seq=last_seq,
            base_seq=0,
        )
        partial = state.staging / f"{uuid.uuid4().hex}.partial"
        try:
            with open(partial, "wb") as raw:
                out = HashingWriter(raw)
                stats = write_env_base(
                    view,
                    cast("BinaryIO", out),
                    header,
                    scratch=state.staging,
                    level=self.shared.settings.compression_level,
                    check=check,
                )
            digest = out.hexdigest()
            os.replace(partial, state.cache / digest)
        except BaseException:
            partial.unlink(missing_ok=True)
            raise
        return RunEntry(
            hash=digest,
            size=stats.file_bytes,
            records=stats.records,
            level=BASE_LEVEL,
            base=True,
            first_seq=1,
            last_seq=last_seq,
            checkpoint_id=version.checkpoint_id,
            token=version.token,
        )

    def ensure_uploaded(self, state: StoreState, run: RunEntry) -> None:
        """Make sure the blob store holds ``run``. A run this manager uploaded that no durable index names and that
        is older than half the grace period is written again (a sweep of another attempt could take it for
        garbage); the same bytes under the same name, with a fresh age."""
        if run.hash in state.uploaded:
            uploaded_at = state.uploaded_at.get(run.hash)
            if run.hash in state.durable_runs or self.shared.young_enough(uploaded_at):
                return
            if not self.shared.context.blob_store.supports_metadata:
                return  # no age on the blob store: a sweep counts it from when it first saw it, nothing to refresh
            if not state.cached(run).exists():
                state.needs_base = True
                raise CommitError(
                    f"store {state.name}: run {run_name(state.prefix, run.hash)} was uploaded more than half of "
                    f"blobsnapshot.gc.grace.period.ms ago and no durable checkpoint names it; it is not cached "
                    f"locally to refresh it. The next commit uploads a base run"
                )
        path = state.cached(run)
        if not path.exists():
            state.needs_base = True
            raise CommitError(
                f"store {state.name}: run {run_name(state.prefix, run.hash)} is neither uploaded nor staged; the next "
                f"commit uploads a base run"
            )
        written = self.put_run(state, run, path)
        metrics = self.shared.context.metrics
        labels = {"store": state.name, "backend": self.shared.context.factory_name}
        if written:
            metrics.increment("commit.bytes.uploaded", run.size, **labels)
            metrics.increment("commit.files.uploaded", 1, **labels)
            metrics.increment("blobsnapshot.runs.uploaded")
        else:
            metrics.increment("commit.bytes.reused", run.size, **labels)
            metrics.increment("blobsnapshot.runs.reused")
        state.uploaded.add(run.hash)

    def put_run(self, state: StoreState, run: RunEntry, path: Path) -> bool:
        """Upload one run unless the blob store holds exactly its bytes and an index may name them; whether it was
        written.

        A run never tried before is written create-only with no ``head()`` first: a content-addressed name almost
        never exists yet, so asking first would cost a request per run for nothing. A run whose earlier upload failed
        (its reply may have been lost after it landed) is looked up first, so it is not sent twice. "Present" needs
        evidence about *this* run: a ``head()`` that finds a blob of its length under its name, never a refusal
        ("already exists") alone; a blob of another length under the name is overwritten with the run's bytes, the
        only bytes the name can hold. A present blob is reused only when no sweep can take it before a checkpoint
        names it: a retained durable index names it, or it is younger than half the grace period. Otherwise (a run
        whose upload reply was lost long ago, an identical run of a checkpoint retention dropped) the same bytes are
        written again, with a fresh age and a fresh nonce (:meth:`_fresh_nonce`): every write after the first of a
        name carries bytes of its own."""
        blob_store = self.shared.context.blob_store
        name = run_name(state.prefix, run.hash)
        refresh = run.hash in state.uploaded  # an old upload no durable index names: write it again, same bytes
        created_at = self.shared.clock()
        if not refresh and run.hash in state.attempted:
            found, age = self._present(state, name, run)
            if found == "reusable":
                self._found_at(state, run, age)
                state.attempted.discard(run.hash)
                return False
            refresh = found == "too old"
        try:
            if refresh or run.hash in state.attempted:
                # a write of a name written before: bytes of its own (a fresh nonce), so a sweep that judged the
                # earlier write by its version (on S3 the MD5 of the bytes) cannot take this one
                self._fresh_nonce(state, run, path)
            if refresh:
                blob_store.put_file(name, path, metadata=self.shared.new_metadata(created_at))
            else:
                try:
                    blob_store.put_file(name, path, create_only=True, metadata=self.shared.new_metadata(created_at))
                except AlreadyExistsError:
                    found, age = self._present(state, name, run)
                    if found == "reusable":
                        self._found_at(state, run, age)
                        state.attempted.discard(run.hash)
                        return False  # same name, same content: an earlier try (or an identical run) wrote it
                    if found == "absent":
                        log.warning(
                            "store %s: run %s was reported taken but holds no blob of its length; writing it again",
                            state.name,
                            name,
                            extra=log_extra(self.shared.context, state.name),
                        )
                    self._fresh_nonce(state, run, path)
                    blob_store.put_file(name, path, metadata=self.shared.new_metadata(created_at))
        except BaseException:
            state.attempted.add(run.hash)  # it may have landed: the next try looks it up before sending it again
            raise
        state.attempted.discard(run.hash)
        state.uploaded_at[run.hash] = created_at
        crashpoint("blobsnapshot.upload.run_uploaded")
        return True

    def _fresh_nonce(self, state: StoreState, run: RunEntry, path: Path) -> None:
        """Give the cached run a nonce of its own before it is written again under its name (the content, and so the
        name, stay; ``statebackend.recordfile.nonce``). A run cached in a format without the trailer (by an older
        release) cannot have one: it is written again with the same bytes, as that release did (on a store whose
        versions follow the bytes, the sweep's batch wait bounds that race; statebackend.kit.gc)."""
        if not renew_nonce(path, aside=state.staging):
            log.debug(
                "run %s: cached by an older release without a nonce: written again with the same bytes",
                run_name(state.prefix, run.hash),
                extra=log_extra(self.shared.context, state.name),
            )

    def _present(self, state: StoreState, name: str, run: RunEntry) -> tuple[str, float | None]:
        """``"absent"`` (no blob of the run's length under ``name``), ``"reusable"`` or ``"too old"`` (see
        :meth:`put_run`), with the blob's age (its ``created_at``) when known."""
        blob_store = self.shared.context.blob_store
        try:
            info = blob_store.head(name)
        except NotFoundError:
            return "absent", None
        if info.size != run.size:
            log.warning(
                "run %s: the blob store reports %d bytes where the run has %d; not taken as present",
                name,
                info.size,
                run.size,
                extra=log_extra(self.shared.context, state.name),
            )
            return "absent", None
        created = read_created_at(info.metadata)  # None: no age we can read (written by another tool)
        if run.hash in state.durable_runs or not blob_store.supports_metadata:
            return "reusable", created
        return ("reusable", created) if self.shared.young_enough(created) else ("too old", created)

    def _found_at(self, state: StoreState, run: RunEntry, created: float | None) -> None:
        """A run found present is as old as its blob: a later index names it only while that age allows (else it is
        written again), as for a run this manager uploaded."""
        if created is not None:
            state.uploaded_at[run.hash] = created
        else:
            state.uploaded_at.pop(run.hash, None)


class HashingWriter:
    """A write-only file wrapper that hashes what passes through: the run's name is the hash of its content, its bytes
    without the nonce trailer they end in (``statebackend.recordfile.nonce``), so every write of the run (each with a
    nonce of its own) keeps the name. The last TRAILER_SIZE bytes are held back from the hash until the end."""

    def __init__(self, out: BinaryIO) -> None:
        self._out = out
        self._hasher = new_hasher()
        self._held = b""

    def write(self, data: bytes) -> int:
        if len(data) >= TRAILER_SIZE:
            self._hasher.update(self._held)
            self._hasher.update(memoryview(data)[: len(data) - TRAILER_SIZE])
            self._held = bytes(data[len(data) - TRAILER_SIZE :])
        else:
            joined = self._held + bytes(data)
            self._hasher.update(joined[: max(0, len(joined) - TRAILER_SIZE)])
            self._held = joined[-TRAILER_SIZE:]
        return self._out.write(data)

    def hexdigest(self) -> str:
        """The hash of the content: every byte written but a nonce trailer at the end (all of them without one)."""
        if len(self._held) == TRAILER_SIZE and ends_in_trailer(self._held):
            return str(self._hasher.hexdigest())
        hasher = self._hasher.copy()
        hasher.update(self._held)
        return str(hasher.hexdigest())
