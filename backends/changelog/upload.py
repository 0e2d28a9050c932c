"""The upload of a commit's recipe (:class:`ChangelogUpload`, the uploader the changelog backup manager holds; its
``upload()`` runs on the commit pool): a re-base snapshot when the chain starts anew, then this commit's deltas, each
staged whole on local disk first and sent create-only; deltas of earlier commits whose upload failed are sent again
from their staged files. The background snapshots stage and send their snapshots through it too."""

from __future__ import annotations

import logging
from collections.abc import Callable, Iterable
from pathlib import Path

import attrs
from statebackend.backends.changelog.lineage import ChangelogShared, Lineage
from statebackend.backends.changelog.marker import Recipe, Step

from statebackend.envbase import write_env_base
from statebackend.errors import AlreadyExistsError, CommitError, CorruptDataError, NotFoundError
from statebackend.fsutil import atomic_write
from statebackend.kit import IN_FLIGHT, created_at_metadata, read_created_at
from statebackend.recordfile import FileHeader, RecordColumns, check_digest, renew_nonce, write_file
from statebackend.store import ReadView

log = logging.getLogger(__name__)

__all__ = ["ChangelogUpload"]


@attrs.define(eq=False)
class ChangelogUpload:
    """Staging and uploading deltas and snapshots, on the manager's :class:`ChangelogShared` (its context, options and
    clock)."""

    shared: ChangelogShared

    def upload_store(self, lineage: Lineage, marker: str) -> str:
        recipe = Recipe.decode(marker, prefix=lineage.prefix, source=f"store {lineage.name}")
        # every file this upload stages or re-sends is in flight until it returns: cleanup leaves them alone
        with IN_FLIGHT.hold([lineage.staging / Path(name).name for name in recipe.blob_names()]):
            return self._upload_recipe(lineage, recipe, marker)

    def _upload_recipe(self, lineage: Lineage, recipe: Recipe, marker: str) -> str:
        metrics = self.shared.context.metrics
        with lineage.lock:
            view_future, lineage.rebase_view = lineage.rebase_view, None
            to_encode = dict(lineage.to_encode)
            lineage.to_encode.clear()
            lineage.fresh.clear()  # anything staged before this upload is a retry
            # blobs an earlier upload sent that no checkpoint known durable names (a commit whose checkpoint write
            # failed, an adopted snapshot): their age is checked below, they may be garbage to another sweep by now
            durable = set(lineage.retained[-1].blob_names()) if lineage.retained else set()
            reused = [n for n in recipe.blob_names() if n in lineage.uploaded and n not in durable]
        view: ReadView | None = None
        try:
            if view_future is not None:
                view = view_future.result()  # waits for the store's applier, never for this pool
            if view is not None and recipe.snapshot is not None and recipe.snapshot.name not in lineage.uploaded:
                step = recipe.snapshot
                assert step.name is not None
                staged = self.stage_base(lineage, step, view, step.name)
                with lineage.lock:
                    lineage.fresh.discard(step.name)
                self.upload_staged_file(lineage, staged, step.name, "snapshot")
                with lineage.lock:
                    lineage.uploaded.add(step.name)
            # Stage this commit's deltas before uploading anything: a failed upload below then leaves every delta
            # staged, and the next commit retries them instead of re-basing on a full snapshot.
            for step in recipe.deltas:
                change = to_encode.pop(step.name, None) if step.name is not None else None
                if change is not None and step.name is not None:
                    self.stage(lineage, step, "delta", change.columns() or iter(change), step.name)
            for step in recipe.deltas:
                if step.name is None or step.name in lineage.uploaded:
                    continue
                staged = lineage.staging / Path(step.name).name
                if step.name in lineage.fresh and staged.exists():  # staged just above
                    self.upload_staged_file(lineage, staged, step.name, "delta")
                    with lineage.lock:
                        lineage.fresh.discard(step.name)
                elif staged.exists():  # a previous commit's delta whose upload failed: upload it now
                    try:
                        check_digest(staged.read_bytes(), name=str(staged))
                    except CorruptDataError:
                        staged.unlink(missing_ok=True)  # not staged any more: the failure below re-bases
                        raise
                    # its earlier try may have landed: this write carries bytes of its own (a fresh nonce)
                    self._fresh_nonce(lineage, staged, step.name)
                    self._put_staged(lineage, staged, step.name)
                    metrics.increment("changelog.delta.reuploads")
                else:
                    raise CommitError(
                        f"store {lineage.name}: delta {step.name} is neither uploaded nor staged; the next commit "
                        f"re-bases on a fresh snapshot"
                    )
                with lineage.lock:
                    lineage.uploaded.add(step.name)
            with lineage.lock:
                old = [n for n in reused if not self.shared.young_enough(lineage.uploaded_at.get(n))]
                if old:
                    lineage.commits_since_snapshot = -1  # re-base next commit: fresh blobs only
            if old:
                self.shared.context.metrics.increment("changelog.rebase.old.blobs")
                raise CommitError(
                    f"store {lineage.name}: this commit would name {old[0]} (and {len(old) - 1} more), uploaded more "
                    f"than half of changelog.gc.grace.period.ms ago and named by no checkpoint known durable: a sweep "
                    f"of another attempt may delete it. The next commit re-bases on a fresh snapshot"
                )
        except BaseException:
            with lineage.lock:
                missing = [
                    s
                    for s in recipe.deltas
                    if s.name is not None
                    and s.name not in lineage.uploaded
                    and not (lineage.staging / Path(s.name).name).exists()
                ]
                if missing or (
                    recipe.snapshot is not None
                    and recipe.snapshot.name not in lineage.uploaded
                    and view_future is not None
                ):
                    lineage.commits_since_snapshot = -1  # chain cannot be completed: re-base next commit
            raise
        finally:
            if view is not None:
                view.close()
        return marker

    def stage(
        self,
        lineage: Lineage,
        step: Step,
        kind: str,
        records: Iterable[tuple[bytes, bytes | None]] | RecordColumns,
        name: str,
    ) -> Path:
        """Write the file for ``step`` into the staging dir (aside, then renamed: a staged file is always whole)."""
        header = FileHeader(
            kind=kind,
            job=self.shared.context.job_name,
            task=self.shared.context.task_name,
            store=lineage.name,
            checkpoint_id=step.checkpoint_id,
            token=step.token,
            seq=step.seq,
            base_seq=step.seq - 1 if kind == "delta" else step.seq,
        )
        staged = lineage.staging / Path(name).name
        # written aside and renamed when complete: a staged file is always a whole one (a later commit re-uploads
        # staged files whose upload failed, and must never send a half-written one)
        partial = staged.with_name(staged.name + ".partial")
        with atomic_write(staged, temp_name=partial.name, fsync=False) as out:
            write_file(
                out,
                header,
                records,
                compression=self.shared.settings.compression,
                level=self.shared.settings.compression_level,
            )
        with lineage.lock:
            lineage.fresh.add(name)
        return staged

    def stage_base(
        self, lineage: Lineage, step: Step, view: ReadView, name: str, check: Callable[[], None] | None = None
    ) -> Path:
        """Write the snapshot of ``step`` (``view`` is at its version) into the staging dir as an environment-file
        base (``statebackend.envbase``: a cold restore streams it into place, no record re-inserted); aside, then
        renamed, like every staged file. ``check`` is called between frames (a background snapshot's
        cancellation)."""
        header = FileHeader(
            kind="snapshot",
            job=self.shared.context.job_name,
            task=self.shared.context.task_name,
            store=lineage.name,
            checkpoint_id=step.checkpoint_id,
            token=step.token,
            seq=step.seq,
            base_seq=step.seq,
        )
        staged = lineage.staging / Path(name).name
        partial = staged.with_name(staged.name + ".partial")
        with atomic_write(staged, temp_name=partial.name, fsync=False) as out:
            write_env_base(
                view,
                out,
                header,
                scratch=lineage.staging,
                compression=self.shared.settings.compression,
                level=self.shared.settings.compression_level,
                check=check,
            )
        with lineage.lock:
            lineage.fresh.add(name)
        return staged

    def upload_staged_file(self, lineage: Lineage, staged: Path, name: str, kind: str) -> None:
        size = staged.stat().st_size
        self._put_staged(lineage, staged, name)
        metrics = self.shared.context.metrics
        metrics.increment(f"changelog.{kind}.uploads")
        labels = {"store": lineage.name, "backend": self.shared.context.factory_name}
        metrics.increment("commit.bytes.uploaded", size, **labels)
        metrics.increment("commit.files.uploaded", 1, **labels)
        metrics.record(f"changelog.{kind}.bytes", size)

    def _landed_at(self, name: str) -> float | None:
        """The ``created_at`` of blob ``name`` as the blob store holds it (``None``: absent, or no readable age)."""
        try:
            return read_created_at(self.shared.context.blob_store.head(name).metadata)
        except NotFoundError:
            return None

    def _fresh_nonce(self, lineage: Lineage, staged: Path, name: str) -> None:
        """Give a staged file a nonce of its own before it is written again under ``name``
        (``statebackend.recordfile.nonce``: the content stays). One staged in a format without the trailer (by an
        older release) cannot have one: it is written again with the same bytes, as that release did (on a store
        whose versions follow the bytes, the sweep's batch wait bounds that race; statebackend.kit.gc)."""
        if not renew_nonce(staged):
            log.debug(
                "store %s: %s staged by an older release without a nonce: written again as is", lineage.name, name
            )

    def _put_staged(self, lineage: Lineage, staged: Path, name: str) -> None:
        blob_store = self.shared.context.blob_store
        created_at = self.shared.clock()  # before the put: a sweep never sees the blob younger than it is
        metadata = created_at_metadata(created_at) if blob_store.supports_metadata else None
        size = staged.stat().st_size
        try:
            blob_store.put_file(name, staged, create_only=True, metadata=metadata)
        except AlreadyExistsError:
            # names carry the flush's unique token: only an earlier try of this very upload can have written it
            # (a retry after a timeout whose first attempt had landed, maybe long ago); the content is the same
            # bytes. It is as old as that try: named only while young enough, else written again with a fresh age
            # (a sweep of another attempt could otherwise take it for garbage while a checkpoint names it)
            if blob_store.supports_metadata:
                landed = self._landed_at(name)
                if not self.shared.young_enough(landed):
                    # bytes of its own (a fresh nonce): a sweep that judged the earlier write by its version (on S3
                    # the MD5 of the bytes) cannot take this one
                    self._fresh_nonce(lineage, staged, name)
                    created_at = self.shared.clock()
                    blob_store.put_file(name, staged, metadata=created_at_metadata(created_at))
                    self.shared.context.metrics.increment("changelog.blobs.refreshed")
                elif landed is not None:
                    created_at = landed
        with lineage.lock:
            lineage.uploaded_at[name] = created_at
            lineage.blob_bytes[name] = size
        staged.unlink(missing_ok=True)
