"""Broken state backends: each a small change to the reference backend (:mod:`statebackend.testing.reference`),
made the way a backend author gets it wrong. The backend contract suite must fail every one of them
(tests/test_mutants.py checks it; docs/contract-suites.md has the table of which test catches which).

Each factory is named by its dotted path, e.g.
``stores.counts.backup.factories=statebackend.testing.mutants.backends:KeepsNewestN``. Never use one for real data.
"""

from __future__ import annotations

import hashlib
import json
import logging
import threading
import time
from collections.abc import Iterable, Mapping
from concurrent.futures import Future

from statebackend.checkpoint import CheckpointId, CheckpointV2
from statebackend.contracts import DEFAULT_GRACE_MS, StoreMarkers
from statebackend.kit import read_created_at
from statebackend.store import ChangeSet, LocalStore, LocalVersion
from statebackend.testing.reference import (
    BlobHeader,
    Record,
    ReferenceBackendFactory,
    ReferenceBackupManager,
    ReferenceRestoreManager,
    Step,
    _close_views,
    decode_marker,
    parse_blob_name,
)

__all__ = [
    "ArchivesLiveStore",
    "BuildsOnAFailedRestore",
    "CatchesUpByCheckpointOrder",
    "ChainsOnAFailedUpload",
    "CleanupDeletesUploadsInFlight",
    "CleanupIgnoresTheLog",
    "CleanupSparesOnlyItsOwnUploads",
    "DropsAStore",
    "EmptyBlobIsEmpty",
    "HangsOnAFailedUpload",
    "IgnoresDeletes",
    "IgnoresTheMarker",
    "KeepsNewestN",
    "LoadsStepByStep",
    "NeverCountsFull",
    "NeverCountsReused",
    "ReportsTheFirstStoresFailure",
    "ResolvesBeforeThePut",
    "ResolvesEarlyWhenBusy",
    "ResolvesEarlyWhenLarge",
    "RestoresAStaleSnapshot",
    "ReusesAnyLocalVersion",
    "SkipsBindingCheck",
    "SkipsStepsWithTheSameKeys",
    "SkipsVerification",
    "SnapshotReadsTheState",
    "SweepsWhatTheNewestDoesNotName",
    "UploadsTheWholeState",
]


# -- restore ----------------------------------------------------------------------------------------------------------


log = logging.getLogger(__name__)


class _IgnoresTheMarker(ReferenceRestoreManager):
    def init(self, checkpoint: CheckpointV2 | None) -> None:
        newest = self.context.checkpoint_log.latest()
        if newest is not None and isinstance(newest.checkpoint, CheckpointV2):
            checkpoint = newest.checkpoint  # the newest state, whatever checkpoint was asked
        super().init(checkpoint)


class IgnoresTheMarker(ReferenceBackendFactory):
    """Restores the newest checkpoint's state whatever checkpoint it is asked for (a replay gets the future)."""

    restore_class = _IgnoresTheMarker


class _RestoresAStaleSnapshot(ReferenceRestoreManager):
    def verified_chain(self, name: str, chain: list[str]) -> list[tuple[str, list[Record]]]:
        return super().verified_chain(name, chain[:-1])  # the chain without its newest step


class RestoresAStaleSnapshot(ReferenceBackendFactory):
    """Restores the chain without its newest step, labelled as the newest version."""

    restore_class = _RestoresAStaleSnapshot


class _SkipsVerification(ReferenceRestoreManager):
    verify_digest = False


class SkipsVerification(ReferenceBackendFactory):
    """Loads blobs without checking their SHA-256: a damaged blob is loaded as it is."""

    restore_class = _SkipsVerification


class _SkipsBindingCheck(ReferenceRestoreManager):
    def expected(self, name: str, blob: str) -> BlobHeader | None:
        return None


class SkipsBindingCheck(ReferenceBackendFactory):
    """Loads an intact blob without checking it is the one its name promises (an older blob put back)."""

    restore_class = _SkipsBindingCheck


class _ReusesAnyLocalVersion(ReferenceRestoreManager):
    def reusable(self, store: LocalStore, head: LocalVersion) -> bool:
        return store.version is not None  # any committed version, not the checkpoint's


class ReusesAnyLocalVersion(ReferenceBackendFactory):
    """Reuses local data of any version as if it were the checkpoint's."""

    restore_class = _ReusesAnyLocalVersion


class _NeverCountsReused(ReferenceRestoreManager):
    def count(self, counter: str) -> None:
        if counter != "restore.stores.reused":
            super().count(counter)


class NeverCountsReused(ReferenceBackendFactory):
    """Reuses local data without counting it in ``restore.stores.reused``."""

    restore_class = _NeverCountsReused


class _NeverCountsFull(ReferenceRestoreManager):
    def count(self, counter: str) -> None:
        if counter != "restore.stores.full":
            super().count(counter)


class NeverCountsFull(ReferenceBackendFactory):
    """Restores from the blob store without counting it in ``restore.stores.full``."""

    restore_class = _NeverCountsFull


# -- backup -----------------------------------------------------------------------------------------------------------


class _OwnCleanup(ReferenceBackupManager):
    """The reference backend written to the earlier contract: no blob lifetime stated, its own ``cleanup()`` (a
    backend may still be written so: the suite must catch such a cleanup's mistakes). Correct as it stands; each
    mutant below breaks one part of it."""

    def blob_lifetime(self) -> None:
        return None

    def cleanup(self, checkpoint_id: CheckpointId, markers: StoreMarkers) -> Future[None]:
        return self.context.executor.submit(self._cleanup, checkpoint_id, dict(markers))

    def _cleanup(self, checkpoint_id: CheckpointId, markers: StoreMarkers) -> None:
        referenced = self.referenced(markers)
        for name in markers:
            prefix = self.context.blob_prefix(name)
            for blob in self.doomed(prefix, list(self.context.blob_store.list(prefix)), referenced, checkpoint_id):
                self.context.blob_store.delete(blob)

    def referenced(self, markers: StoreMarkers) -> set[str]:
        """Every blob the commit's chains and the chains of the checkpoints in the log name."""
        chains = list(markers.items())
        for entry in self.context.checkpoint_log.entries():
            if isinstance(entry.checkpoint, CheckpointV2):
                chains += [
                    (name, marker)
                    for name, marker in entry.checkpoint.markers_for(self.context.factory_name).items()
                    if name in self.context.stores
                ]
        return {blob for name, marker in chains for blob in decode_marker(marker, self.context.blob_prefix(name))}

    def doomed(self, prefix: str, blobs: list[str], referenced: set[str], checkpoint_id: CheckpointId) -> list[str]:
        """The blobs to delete: ours, older than the commit (a newer one is a later upload's), named by no chain."""
        doomed = []
        for blob in blobs:
            parsed = parse_blob_name(prefix, blob)
            if (
                parsed is not None
                and blob not in referenced
                and CheckpointId.parse(parsed[1].checkpoint_id) < checkpoint_id
            ):
                doomed.append(blob)
        return doomed


class _KeepsNewestN(_OwnCleanup):
    def doomed(self, prefix: str, blobs: list[str], referenced: set[str], checkpoint_id: CheckpointId) -> list[str]:
        ours = [blob for blob in blobs if parse_blob_name(prefix, blob) is not None]
        return ours[: -self.context.checkpoint_log.retained]  # the newest N blobs, whatever the checkpoints name


class KeepsNewestN(ReferenceBackendFactory):
    """Cleanup keeps the newest ``task.checkpoint.retained`` blobs, though retained checkpoints name older ones."""

    backup_class = _KeepsNewestN


class _CleanupIgnoresTheLog(_OwnCleanup):
    def referenced(self, markers: StoreMarkers) -> set[str]:
        return {
            blob for name, marker in markers.items() for blob in decode_marker(marker, self.context.blob_prefix(name))
        }  # the log's checkpoints ignored


class CleanupIgnoresTheLog(ReferenceBackendFactory):
    """Cleanup keeps only what the newest commit names, deleting the blobs of the other retained checkpoints."""

    backup_class = _CleanupIgnoresTheLog


class _ArchivesLiveStore(ReferenceBackupManager):
    def full_copy_due(self, chain: list[str] | None) -> bool:
        return True

    def step_records(self, name: str, step: Step) -> Iterable[Record]:
        with self.context.stores[name].read_view() as view:  # the store as it is now, not as it was flushed
            return list(view.items())


class ArchivesLiveStore(ReferenceBackendFactory):
    """Archives the live store at upload time instead of the flushed change set: later writes leak in."""

    backup_class = _ArchivesLiveStore


class _IgnoresDeletes(ReferenceBackupManager):
    def step_records(self, name: str, step: Step) -> Iterable[Record]:
        return [(key, value) for key, value in super().step_records(name, step) if value is not None]


class IgnoresDeletes(ReferenceBackendFactory):
    """Leaves the deletes out of its deltas: deleted keys come back at restore."""

    backup_class = _IgnoresDeletes


class _DropsAStore(ReferenceBackupManager):
    def backed_up_stores(self) -> list[str]:
        return sorted(self.context.stores)[:1]


class DropsAStore(ReferenceBackendFactory):
    """Backs up only the first store of a multi-store task."""

    backup_class = _DropsAStore


class _ResolvesBeforeThePut(ReferenceBackupManager):
    def upload(self, checkpoint_id: CheckpointId, markers: StoreMarkers) -> Future[StoreMarkers]:
        super().upload(checkpoint_id, markers)  # the writes go on in the background
        done: Future[StoreMarkers] = Future()
        done.set_result(dict(markers))
        return done


class ResolvesBeforeThePut(ReferenceBackendFactory):
    """Resolves the upload (so the checkpoint is written) before its blobs are written."""

    backup_class = _ResolvesBeforeThePut


class _ChainsOnAFailedUpload(ReferenceBackupManager):
    def _upload_all(self, prepared: dict[str, Step], markers: StoreMarkers) -> StoreMarkers:
        try:
            return super()._upload_all(prepared, markers)
        finally:
            with self._lock:  # the step is kept in the chain even when its write failed
                self._chains.update({name: step.chain for name, step in prepared.items()})


class ChainsOnAFailedUpload(ReferenceBackendFactory):
    """Builds the next delta on a step whose upload failed: later checkpoints name a blob that never landed."""

    backup_class = _ChainsOnAFailedUpload


class _HangsOnAFailedUpload(ReferenceBackupManager):
    def upload(self, checkpoint_id: CheckpointId, markers: StoreMarkers) -> Future[StoreMarkers]:
        with self._lock:
            prepared, self._prepared = self._prepared, {}
        result: Future[StoreMarkers] = Future()

        def run() -> None:
            result.set_result(self._upload_all(prepared, dict(markers)))  # a failure never reaches ``result``

        self.context.executor.submit(run)
        return result


class HangsOnAFailedUpload(ReferenceBackendFactory):
    """Never resolves an upload whose write failed: the commit (and whoever waits for it) hangs."""

    backup_class = _HangsOnAFailedUpload


class _SnapshotReadsTheState(ReferenceBackupManager):
    def snapshot(self, checkpoint_id: CheckpointId, changes: Mapping[str, ChangeSet]) -> StoreMarkers:
        for name in self.backed_up_stores():
            records = sum(1 for _ in self.context.stores[name].items())  # "just to log the state's size"
            log.debug("store %s holds %d records", name, records)
        return super().snapshot(checkpoint_id, changes)


class SnapshotReadsTheState(ReferenceBackendFactory):
    """Reads the whole store on the task's thread at every snapshot: each commit stalls for O(state)."""

    backup_class = _SnapshotReadsTheState


class _UploadsTheWholeState(ReferenceBackupManager):
    def full_copy_due(self, chain: list[str] | None) -> bool:
        return True


class UploadsTheWholeState(ReferenceBackendFactory):
    """Uploads a full copy at every commit while declaring O(change) uploads (the suite's default)."""

    backup_class = _UploadsTheWholeState


# -- found by reading the contract as an attacker: the suite's later tests kill them (docs/contract-suites.md) -------


_uploads_in_flight = [0]
_in_flight_lock = threading.Lock()


class _ResolvesEarlyWhenBusy(ReferenceBackupManager):
    def _upload_all(self, prepared: dict[str, Step], markers: StoreMarkers) -> StoreMarkers:
        with _in_flight_lock:
            _uploads_in_flight[0] += 1
            busy = _uploads_in_flight[0] > 1
        try:
            if busy:  # "under load, keep commits fast": the writes go on in the background
                threading.Thread(target=super()._upload_all, args=(prepared, markers), daemon=True).start()
                return markers
            return super()._upload_all(prepared, markers)
        finally:
            with _in_flight_lock:
                _uploads_in_flight[0] -= 1


class ResolvesEarlyWhenBusy(ReferenceBackendFactory):
    """Resolves the upload before its blobs are written when another upload of the process is in flight (under
    load): a crash then leaves a durable checkpoint naming blobs that never landed."""

    backup_class = _ResolvesEarlyWhenBusy


class _ResolvesEarlyWhenLarge(ReferenceBackupManager):
    def _upload_all(self, prepared: dict[str, Step], markers: StoreMarkers) -> StoreMarkers:
        if sum(len(step.change) for step in prepared.values()) > 1_000:  # a big commit: write it in the background
            threading.Thread(target=super()._upload_all, args=(prepared, markers), daemon=True).start()
            return markers
        return super()._upload_all(prepared, markers)


class ResolvesEarlyWhenLarge(ReferenceBackendFactory):
    """Resolves the upload of a large change set (over 1,000 records) before its blobs are written."""

    backup_class = _ResolvesEarlyWhenLarge


class _CleanupDeletesUploadsInFlight(_OwnCleanup):
    def doomed(self, prefix: str, blobs: list[str], referenced: set[str], checkpoint_id: CheckpointId) -> list[str]:
        # every blob no checkpoint names, a later upload's included (its checkpoint is not written yet)
        return [blob for blob in blobs if parse_blob_name(prefix, blob) is not None and blob not in referenced]


class CleanupDeletesUploadsInFlight(ReferenceBackendFactory):
    """Cleanup deletes every blob no checkpoint names, also those a later upload just wrote and its checkpoint is
    about to name (the race of a cleanup with the next commit)."""

    backup_class = _CleanupDeletesUploadsInFlight


class _LoadsStepByStep(ReferenceRestoreManager):
    def restore_store(self, name: str, store: LocalStore, chain: list[str]) -> None:
        parsed = parse_blob_name(self.context.blob_prefix(name), chain[-1])
        assert parsed is not None
        head = parsed[1]
        if self.reusable(store, head):
            self.count("restore.stores.reused")
            return
        for index, blob in enumerate(chain):  # one transaction per step, each labelled with the target version
            ((_, records),) = self.verified_chain(name, [blob])
            if index == 0:
                store.replace_contents([(key, value) for key, value in records if value is not None], head)
            else:
                store.apply_changes(records, head)
        self.count("restore.stores.full")


class LoadsStepByStep(ReferenceBackendFactory):
    """Loads the chain one blob at a time, labelling each step with the checkpoint's version: a restore that fails
    (or dies) half-way leaves a store that says it is the checkpoint, and the next restore reuses it."""

    restore_class = _LoadsStepByStep


class _EmptyBlobIsEmpty(ReferenceRestoreManager):
    def verified_chain(self, name: str, chain: list[str]) -> list[tuple[str, list[Record]]]:
        verified: list[tuple[str, list[Record]]] = []
        for blob in chain:
            if self.context.blob_store.head(blob).size == 0:  # "an upload that died before writing anything"
                verified.append((blob, []))
            else:
                verified += super().verified_chain(name, [blob])
        return verified


class EmptyBlobIsEmpty(ReferenceBackendFactory):
    """Takes an empty blob (a write torn before its first byte) for a step with no changes instead of damage."""

    restore_class = _EmptyBlobIsEmpty


class _ReportsTheFirstStoresFailure(ReferenceBackupManager):
    def _upload_all(self, prepared: dict[str, Step], markers: StoreMarkers) -> StoreMarkers:
        for name, step in prepared.items():  # every store written, "so one bad store does not hold up the others"
            try:
                self.write_step(name, step)
            except Exception as exc:  # the mutant's mistake: only the first store's failure fails the upload
                if name == next(iter(prepared)):
                    with self._lock:
                        self._chains.update(dict.fromkeys(prepared))
                    raise
                log.warning("store %s: upload failed (%s); going on", name, exc)
        _close_views(prepared)
        with self._lock:
            self._chains.update({name: step.chain for name, step in prepared.items()})
        return markers


class ReportsTheFirstStoresFailure(ReferenceBackendFactory):
    """Writes every store's step but fails the upload only when the first store's write failed: a later store's
    failed write is logged, and the checkpoint names its blob that never landed."""

    backup_class = _ReportsTheFirstStoresFailure


class _CleanupSparesOnlyItsOwnUploads(_OwnCleanup):
    def _upload_all(self, prepared: dict[str, Step], markers: StoreMarkers) -> StoreMarkers:
        with self._lock:
            self._own_writing = {step.blob for step in prepared.values()}
        return super()._upload_all(prepared, markers)

    def doomed(self, prefix: str, blobs: list[str], referenced: set[str], checkpoint_id: CheckpointId) -> list[str]:
        with self._lock:  # what this manager is writing now is spared; another attempt's uploads are not
            writing = set(getattr(self, "_own_writing", ()))
        return [
            blob
            for blob in blobs
            if parse_blob_name(prefix, blob) is not None and blob not in referenced and blob not in writing
        ]


class CleanupSparesOnlyItsOwnUploads(ReferenceBackendFactory):
    """Cleanup spares the blobs no checkpoint names only while this manager's own upload writes them: the blobs
    another attempt of the task (a retried or speculative task) just wrote are deleted before its checkpoint
    names them."""

    backup_class = _CleanupSparesOnlyItsOwnUploads


class _CatchesUpByCheckpointOrder(ReferenceRestoreManager):
    def restore_store(self, name: str, store: LocalStore, chain: list[str]) -> None:
        prefix = self.context.blob_prefix(name)
        steps = [(blob, parsed[1]) for blob in chain if (parsed := parse_blob_name(prefix, blob)) is not None]
        local = store.version
        if local is not None and local != steps[-1][1]:
            order = CheckpointId.parse(local.checkpoint_id)
            # "the chain is in checkpoint order": the local copy sits after the newest step not newer than it
            older = [i for i, (_, version) in enumerate(steps) if CheckpointId.parse(version.checkpoint_id) <= order]
            if older and order < CheckpointId.parse(steps[-1][1].checkpoint_id):
                for blob, records in self.verified_chain(name, [blob for blob, _ in steps[older[-1] + 1 :]]):
                    parsed = parse_blob_name(prefix, blob)
                    assert parsed is not None
                    store.apply_changes(records, parsed[1])
                self.count("restore.stores.full")
                return
        super().restore_store(name, store, chain)


class CatchesUpByCheckpointOrder(ReferenceBackendFactory):
    """Brings an older local copy forward by applying the chain's steps newer than it, placing it in the chain by
    checkpoint order instead of by its exact version: after a replay, a local copy of a superseded checkpoint gets
    the replayed steps on top of changes the replay undid."""

    restore_class = _CatchesUpByCheckpointOrder


# -- designs unlike ours (issue 31): each killed only by the suite's addition named in docs/contract-suites.md ---------


class _SweepsWhatTheNewestDoesNotName(_OwnCleanup):
    def doomed(self, prefix: str, blobs: list[str], referenced: set[str], checkpoint_id: CheckpointId) -> list[str]:
        # "the newest checkpoint names everything that matters; the grace period covers the uploads in flight"
        newest = self.newest_named
        doomed = []
        for blob in blobs:
            if parse_blob_name(prefix, blob) is None or blob in newest:
                continue
            created = read_created_at(self.context.blob_store.head(blob).metadata)
            if created is not None and time.time() - created >= DEFAULT_GRACE_MS / 1000:
                doomed.append(blob)
        return doomed

    def referenced(self, markers: StoreMarkers) -> set[str]:
        self.newest_named = {
            blob for name, marker in markers.items() for blob in decode_marker(marker, self.context.blob_prefix(name))
        }
        return self.newest_named


class SweepsWhatTheNewestDoesNotName(ReferenceBackendFactory):
    """Its own sweep keeps what the newest checkpoint names and deletes every other blob older than the grace
    period (an hour): the blobs of older retained checkpoints go once the hour has passed, which a suite that
    cannot move the clock never sees."""

    backup_class = _SweepsWhatTheNewestDoesNotName


class _BuildsOnAFailedRestore(ReferenceBackupManager):
    def init(self, checkpoint: CheckpointV2 | None) -> None:
        markers = checkpoint.markers_for(self.context.factory_name) if checkpoint is not None else {}
        for name in self.context.stores:
            if name in markers:  # "our marker is in the checkpoint: go on from it" (whoever restored the store)
                self._chains[name] = decode_marker(markers[name], self.context.blob_prefix(name))
            elif self.context.restored_by.get(name) is None:
                self._chains[name] = []
            else:
                self._chains[name] = None


class BuildsOnAFailedRestore(ReferenceBackendFactory):
    """Continues its chain from its marker in the checkpoint even when its own restore of that chain failed and
    another backend restored the store: later checkpoints extend a chain with a damaged blob."""

    backup_class = _BuildsOnAFailedRestore


class _SkipsStepsWithTheSameKeys(ReferenceBackupManager):
    def _upload_all(self, prepared: dict[str, Step], markers: StoreMarkers) -> StoreMarkers:
        for name, step in list(prepared.items()):
            chain = step.chain
            ids = getattr(self, "_ids", {})
            self._ids = ids
            # "a step's content id": a digest of its keys, to skip uploading a step identical to the one before
            content_id = hashlib.sha256(b"\0".join(key for key, _ in step.change)).hexdigest()
            if step.view is None and len(chain) >= 2 and ids.get(chain[-2]) == content_id:
                chain[-1] = chain[-2]  # the same step again: name the blob already written
                markers[name] = json.dumps(chain)
                del prepared[name]
                with self._lock:
                    self._chains[name] = chain
                continue
            ids[step.blob] = content_id
        return super()._upload_all(prepared, markers)


class SkipsStepsWithTheSameKeys(ReferenceBackendFactory):
    """Takes a delta whose keys are those of the delta before it for the same step (a content id computed from the
    keys only) and names the earlier blob again: values changed under unchanged keys are lost."""

    backup_class = _SkipsStepsWithTheSameKeys
