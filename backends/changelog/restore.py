"""Restore side of the changelog-delta backend.

For each store, the marker is a recipe: a snapshot (or the empty store) and the deltas after it. Restore finds where
the local store already is in that lineage (its LMDB meta holds the version of the last flush, a checkpoint id plus a
random token) and does the least work:

- local version == the recipe's head: nothing to download (the common restart);
- local version is a step of the recipe: apply only the deltas after it (catch-up);
- otherwise: load the snapshot, then apply the deltas. A snapshot written as an environment file
  (``statebackend.envbase``) is streamed into the store dir in ranged reads, verified, and swapped in as the store's
  environment, with no record re-inserted; a snapshot of sorted records (earlier releases) is loaded in one bulk
  LMDB transaction (append mode).

The snapshot loads in one LMDB transaction and the deltas after it apply in one more, each recording the version
it reaches, so a crash mid-restore leaves a store at a step of the recipe that the next restore recognises and
continues from. Applying the deltas together copies each LMDB page they touch once instead of once per delta: a
replay's cost is mostly those copies (random updates), so a long chain restores several times faster. Every blob is
verified (magic, lineage, checksum, record count) before anything of it is applied; a snapshot is streamed inside
the loading transaction, which aborts on a failed check; its download waits in a temporary dir in the store dir, and
the next restore of the store removes one that a killed restore left there. Downloads run on a private pool, never on
the shared commit pool.
"""

from __future__ import annotations

import itertools
import logging
import shutil
import tempfile
import time
from collections.abc import Iterable, Iterator
from concurrent.futures import Future, ThreadPoolExecutor
from pathlib import Path
from typing import Any, cast

import attrs
from statebackend.backends.changelog.marker import Recipe, Step, check_blob_binding
from statebackend.checkpoint import CheckpointV2

from statebackend.contracts import BackendContext, TaskRestoreManager
from statebackend.envbase import (
    HEAD_BYTES,
    BlobSource,
    EnvBaseHeader,
    is_env_base,
    load_env_base,
    remove_abandoned,
)
from statebackend.errors import CorruptDataError, NotFoundError
from statebackend.kit import InterruptFlag, puts_only
from statebackend.recordfile import (
    KIND_DELTA,
    KIND_SNAPSHOT,
    FileHeader,
    RecordReader,
    check_digest,
    iter_records,
)
from statebackend.store import LocalStore

__all__ = ["ChangelogRestoreManager"]

log = logging.getLogger(__name__)

#: the temporary dir (in the store dir) a snapshot is downloaded into during a restore
_DOWNLOAD_PREFIX = ".restore-"


@attrs.define(eq=False)
class ChangelogRestoreManager(TaskRestoreManager):
    context: BackendContext
    download_concurrency: int = 8
    _recipes: dict[str, Recipe] = attrs.field(init=False, factory=dict)
    _interrupted: InterruptFlag = attrs.field(init=False, factory=InterruptFlag)

    def init(self, checkpoint: CheckpointV2 | None) -> None:
        markers = checkpoint.markers_for(self.context.factory_name) if checkpoint is not None else {}
        for name in self.context.stores:
            if name in markers:
                assert checkpoint is not None
                recipe = Recipe.decode(markers[name], prefix=self.context.blob_prefix(name), source=f"store {name}")
                _check_recipe(recipe, str(checkpoint.checkpoint_id), name, markers[name])
                self._recipes[name] = recipe

    def interrupt(self) -> None:
        """Ask a running restore to stop at its next step (see the contract): before the first delta's bulk load onto
        the empty store, or before the next delta of the one transaction that replays them (which then aborts)."""
        self._interrupted.set()

    def restore(self) -> None:
        with ThreadPoolExecutor(self.download_concurrency, thread_name_prefix="changelog-restore") as pool:
            for name, store in self.context.stores.items():
                recipe = self._recipes.get(name)
                started = time.monotonic()
                if recipe is None or recipe.head is None:
                    store.replace_contents([], None)
                else:
                    self._restore_store(pool, name, store, recipe)
                self.context.metrics.record(
                    "restore.store.ms",
                    (time.monotonic() - started) * 1000.0,
                    store=name,
                    backend=self.context.factory_name,
                )

    # -- internals ---------------------------------------------------------------------------------------------

    def _restore_store(self, pool: ThreadPoolExecutor, name: str, store: LocalStore, recipe: Recipe) -> None:
        metrics = self.context.metrics
        # what a restore killed mid-way left (as big as the state), whatever this restore does next (reuse too)
        _remove_abandoned_downloads(Path(store.path))
        remove_abandoned(Path(store.path))
        steps = list(recipe.steps())
        local = store.version
        start_index = None
        if local is not None:
            for index in range(len(steps) - 1, -1, -1):
                if steps[index].version == local:
                    start_index = index
                    break
        if start_index == len(steps) - 1:
            metrics.increment("restore.stores.reused")
            log.info(
                "store %s: local state already is checkpoint version %s",
                name,
                local,
                extra={"job": self.context.job_name, "task": self.context.task_name, "store": name},
            )
            return
        to_apply = steps[start_index + 1 :] if start_index is not None else list(recipe.deltas)
        # prefetch every delta in parallel while the snapshot (if any) loads
        downloads: dict[str, Future[bytes]] = {
            step.name: pool.submit(self._get, name, step.name, KIND_DELTA)
            for step in to_apply
            if step.name is not None and step is not recipe.snapshot
        }
        first_delta = recipe.deltas[0] if recipe.deltas else None
        try:
            if start_index is None:
                metrics.increment("restore.stores.full")
                self._load_snapshot(pool, store, name, recipe.snapshot)
            else:
                metrics.increment("restore.stores.caught.up")
            steps = [step for step in to_apply if step is not recipe.snapshot]
            if (
                steps
                and start_index is None
                and recipe.snapshot is None
                and steps[0] is first_delta
                and first_delta.name is not None
            ):
                # the first delta on the empty store: a bulk load in append mode (its deletes are no-ops)
                self._interrupted.check(name)
                store.replace_contents(
                    puts_only(self._verified_records(name, first_delta, downloads)), first_delta.version
                )
                metrics.increment("restore.deltas.replayed")
                steps = steps[1:]
            if steps:
                # every delta after it in ONE LMDB transaction (each page it touches copied once, not once per
                # delta); a bad delta, or an interrupt, aborts them all and the store stays at the step before
                def change_sets() -> Iterator[Iterable[tuple[bytes, bytes | None]]]:
                    for step in steps:
                        self._interrupted.check(name)
                        if step.name is not None:  # else a commit that changed nothing: its version passes by
                            yield self._verified_records(name, step, downloads)

                store.apply_change_sets(change_sets(), steps[-1].version)
                metrics.increment("restore.deltas.replayed", sum(1 for step in steps if step.name is not None))
        finally:
            for future in downloads.values():
                future.cancel()

    def _verified_records(self, store: str, step: Step, downloads: dict[str, Future[bytes]]) -> RecordReader:
        """The records of the delta ``step`` names, once downloaded: digest and lineage checked first; records,
        order and count are checked while they are read, inside the LMDB transaction that applies them and aborts on
        any failure (a bad delta is never applied, and is parsed only once)."""
        assert step.name is not None
        data = downloads[step.name].result()
        self.context.metrics.increment("restore.bytes", len(data), store=store, backend=self.context.factory_name)
        _check_lineage(check_digest(data, name=step.name), step, store, self.context, kind=KIND_DELTA)
        return iter_records(data, name=step.name, verified=True)

    def _load_snapshot(self, pool: ThreadPoolExecutor, store: LocalStore, name: str, snapshot: Step | None) -> None:
        if snapshot is None or snapshot.name is None:
            store.replace_contents([], None)
            return
        _remove_abandoned_downloads(Path(store.path))
        base = self._snapshot_source(name, snapshot.name)
        if is_env_base(base.read(0, min(base.size, HEAD_BYTES))):
            # an environment-file base: streamed into the store dir, verified, swapped in; nothing re-inserted
            def check(header: EnvBaseHeader) -> None:
                _check_lineage(header.lineage, snapshot, name, self.context, kind=KIND_SNAPSHOT)

            load_env_base(store, base, snapshot.version, check=check, pool=pool)
            self.context.metrics.increment("restore.bytes", base.size, store=name, backend=self.context.factory_name)
            return
        # a snapshot of sorted records (written by earlier releases)
        with tempfile.TemporaryDirectory(dir=Path(store.path), prefix=_DOWNLOAD_PREFIX) as tmp:
            local_copy = Path(tmp) / "snapshot"
            size = self._get(name, snapshot.name, KIND_SNAPSHOT, into=local_copy)
            self.context.metrics.increment("restore.bytes", size, store=name, backend=self.context.factory_name)
            with open(local_copy, "rb") as source:
                reader = iter_records(source, name=snapshot.name)
                _check_lineage(reader.header, snapshot, name, self.context, kind=KIND_SNAPSHOT)
                # streamed inside one transaction: a failed checksum at the end aborts it, nothing is loaded
                # the reader refuses deletes in a snapshot: every value is bytes
                store.replace_contents(cast("Iterable[tuple[bytes, bytes]]", reader), snapshot.version)

    def _snapshot_source(self, store: str, blob: str) -> BlobSource:
        """The snapshot blob as a base source (its size looked up first); a missing blob names itself."""
        blob_store = self.context.blob_store
        try:
            return BlobSource(blob_store, blob, blob_store.head(blob).size)
        except NotFoundError as exc:
            raise NotFoundError(
                f"store {store}: {KIND_SNAPSHOT} {blob} that the checkpoint's changelog recipe names is missing from "
                f"{blob_store.describe()}; this checkpoint cannot be restored from changelog: restore an older "
                f"checkpoint or from another backend's marker"
            ) from exc

    def _get(self, store: str, blob: str, kind: str, *, into: Path | None = None) -> Any:
        """The bytes of ``blob`` (or its size, downloaded into ``into``); a missing blob names itself and what to do."""
        blob_store = self.context.blob_store
        try:
            return blob_store.get(blob) if into is None else blob_store.get_file(blob, into)
        except NotFoundError as exc:
            raise NotFoundError(
                f"store {store}: {kind} {blob} that the checkpoint's changelog recipe names is missing from "
                f"{blob_store.describe()}; this checkpoint cannot be restored from changelog: restore an older "
                f"checkpoint or from another backend's marker"
            ) from exc


def _remove_abandoned_downloads(store_dir: Path) -> None:
    """Delete the snapshot downloads a restore killed mid-way (SIGKILL: no ``finally`` ran) left in the store dir.
    Each is as big as the state, and a task killed again and again while it restores would pile them up until the
    disk is full. The caller holds the store's lock, so no other restore is downloading into this dir."""
    for leftover in store_dir.glob(f"{_DOWNLOAD_PREFIX}*"):
        if leftover.is_dir() and not leftover.is_symlink():
            shutil.rmtree(leftover, ignore_errors=True)


def _check_recipe(recipe: Recipe, checkpoint_id: str, store: str, marker: str) -> None:
    """Refuse, before anything is loaded, a recipe that would restore other state than its checkpoint's, though each
    blob it names is intact and the one its step names:

    - a gap in the versions (a format 1 marker spells every seq out, so it can skip one; format 2 cannot): the state
      would miss a commit's changes;
    - a last step that is not this checkpoint's version: every commit appends its own version to the recipe it writes
      into its checkpoint, so a recipe ending anywhere else had steps dropped from its end or is another
      checkpoint's;
    - deltas without a snapshot that do not start at seq 1: the first delta applies on the version before it, which
      only the empty store is when that is version 0 (a ``"snapshot": null`` edited into a recipe would replay the
      deltas on an empty store, without what the snapshot held). A chain that starts on an empty store at a later
      seq is not written: the backup manager re-bases it on a snapshot;
    - a snapshot step without a blob (format 1 can spell it; no release wrote it): it would load the empty store.

    A delta step marked as having no blob (a commit that changed nothing) cannot be told from one whose blob was
    dropped from the recipe: nothing else records that the commit changed something (docs/formats-changelog.md,
    "Known limit")."""
    for before, after in itertools.pairwise(recipe.steps()):
        if after.seq != before.seq + 1:
            raise CorruptDataError(
                f"store {store}: the changelog recipe of checkpoint {checkpoint_id} jumps from seq {before.seq} to "
                f"seq {after.seq}; a delta of the chain is missing from the marker and the state would miss its "
                f"changes. Nothing was restored from it: restore an older checkpoint or from another backend's marker"
            )
    snapshot = recipe.snapshot
    if snapshot is not None and snapshot.name is None:
        raise CorruptDataError(
            f"store {store}: the changelog recipe of checkpoint {checkpoint_id} has a snapshot at seq {snapshot.seq} "
            f"that names no blob; a snapshot step always names its file, so the marker was altered, and the empty "
            f"store would stand in for the snapshot. Nothing was restored from it: restore an older checkpoint or "
            f"from another backend's marker"
        )
    if snapshot is None and recipe.deltas and recipe.deltas[0].seq != 1:
        first = recipe.deltas[0].seq
        raise CorruptDataError(
            f"store {store}: the changelog recipe of checkpoint {checkpoint_id} starts at seq {first} without a "
            f"snapshot: its first delta applies on version {first - 1}, not on the empty store (version 0), and the "
            f"state would miss what version {first - 1} held (a snapshot removed from the marker?). Nothing was "
            f"restored from it: restore an older checkpoint or from another backend's marker"
        )
    head = recipe.head
    if head is None or head.checkpoint_id != checkpoint_id:
        ends = f"ends at the version of checkpoint {head.checkpoint_id}" if head is not None else "has no step"
        raise CorruptDataError(
            f"store {store}: the changelog recipe of checkpoint {checkpoint_id} {ends}, not at the checkpoint's own "
            f"version: the marker was altered or belongs to another checkpoint, and would restore other state. "
            f"Nothing was restored from it: restore an older checkpoint or from another backend's marker "
            f"(marker: {marker[:200]})"
        )


def _check_lineage(header: FileHeader, step: Step, store: str, context: BackendContext, *, kind: str) -> None:
    check_blob_binding(header, step, kind=kind, job=context.job_name, task=context.task_name, store=store)
