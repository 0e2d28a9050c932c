"""Backup side of the changelog-delta backend (seeds 000 and 001).

Per commit and store, ``snapshot()`` (sync, O(1) besides bookkeeping) appends a step to the store's recipe and
``upload()`` (async) encodes the commit's change set into one delta file and uploads it create-only. Every
``snapshot.interval.commits`` commits or ``snapshot.interval.bytes`` delta bytes, a background job materializes a
snapshot of a committed version from an LMDB read transaction (processing goes on meanwhile); the next commit after
it is durable starts its recipe from that snapshot, which lets older deltas go.

Garbage that retention cannot see (deltas of commits that died before their checkpoint write, snapshots never
adopted, files only checkpoints of an earlier process needed) is removed by a mark-and-sweep every
``gc.interval.commits`` commits: the mark is every blob named by a changelog marker of a checkpoint in the checkpoint
log plus this manager's own chain. An unmarked blob is deleted only when both hold:

- its sequence number is at or below the seq of the **newest** checkpoint's recipe (the log's head; not the highest
  seq of any entry: after a replay, superseded checkpoints carry higher seqs than the head's chain);
- it is older than ``gc.grace.period.ms`` (age from its ``created_at`` metadata, written at upload; where the blob
  store keeps no metadata, from the time this manager's sweep first saw it).

The grace period is the general guard: another attempt of the task (a failover owner, a Spark replay that builds on
an older checkpoint, below the head's seq) may be between its upload and its checkpoint write, and its blobs are
young. Both sides keep to a bound so that holds however long a sweep or a chain lives: a sweep stops deleting once
``grace / 4`` has passed since its mark (its marks may be stale), and a commit never names a blob it did not upload
itself that no checkpoint it knows durable names, unless the blob is younger than ``grace / 2``: such a blob (a
delta of a commit whose checkpoint write failed, reused much later; a finished snapshot adopted late) fails the
commit, and the next one re-bases on a fresh snapshot. A finished snapshot older than that is not adopted.

Failure handling: a delta whose upload failed stays staged on local disk and is uploaded again by the next commit,
whose recipe still lists it. If a delta could not even be encoded, the chain is broken and the next commit re-bases
on a fresh snapshot of its own version. Retention: ``cleanup`` keeps the blobs that the last
``task.checkpoint.retained`` durable checkpoints need and deletes what only older ones needed.
"""

from __future__ import annotations

import logging
import threading
import time
from collections import Counter, deque
from collections.abc import Callable, Iterable, Iterator, Mapping
from concurrent.futures import Future, ThreadPoolExecutor
from contextlib import ExitStack, contextmanager
from pathlib import Path

import attrs
from statebackend.backends.changelog.marker import Recipe, Step, check_blob_binding, delta_name, snapshot_name
from statebackend.checkpoint import CheckpointId, CheckpointLog, CheckpointV2

from statebackend.concurrency import SharedPools, until_cancelled
from statebackend.contracts import BackendContext, StoreMarkers, TaskBackupManager
from statebackend.crashpoints import crashpoint
from statebackend.errors import (
    AlreadyExistsError,
    CorruptDataError,
    IncompatibleFormatError,
    NotFoundError,
    StateBackendError,
)
from statebackend.fsutil import atomic_write
from statebackend.recordfile import (
    FOOTER_SIZE,
    HEADER_PREFIX_SIZE,
    KIND_SNAPSHOT,
    FileHeader,
    RecordColumns,
    check_digest,
    header_size,
    read_frame,
    write_file,
)
from statebackend.store import ChangeSet, LocalStore, ReadView

__all__ = ["ChangelogBackupManager", "delta_name", "snapshot_name"]

log = logging.getLogger(__name__)

STAGING_DIR = "changelog-staging"

#: the snapshot interval in commits while the sizes the ratio weighs are unknown
UNKNOWN_SIZES_INTERVAL_COMMITS = 20


class SnapshotCancelled(StateBackendError):
    """A background snapshot stopped because the task was handed to another opener; nothing of it was uploaded."""


_maintenance_pools = SharedPools("statebackend-maintenance")


def maintenance_pool() -> ThreadPoolExecutor:
    """The process-wide maintenance thread for background snapshots (kept apart from the commit pool so a long
    snapshot never delays a commit)."""
    return _maintenance_pools.get(1)


#: blob metadata key: unix time (seconds, a decimal string) at which the upload of a delta or snapshot started
CREATED_AT = "created_at"

#: staged files being written or uploaded, by absolute path, process-wide: a cleanup, or the init of a later open of
#: the same store while an upload of an earlier open still runs (its close timed out), never deletes them. A counter:
#: the same file may be in two hands. Registered before the file exists, so a file listed is either in here or not.
_in_flight_lock = threading.Lock()
_in_flight: Counter[str] = Counter()


@contextmanager
def _staged_in_flight(paths: list[Path]) -> Iterator[None]:
    keys = [str(path) for path in paths]
    with _in_flight_lock:
        _in_flight.update(keys)
    try:
        yield
    finally:
        with _in_flight_lock:
            _in_flight.subtract(keys)
            for key in keys:
                if _in_flight[key] <= 0:
                    del _in_flight[key]


def _unlink_unless_in_flight(path: Path) -> None:
    with _in_flight_lock:
        if _in_flight[str(path)] == 0:
            path.unlink(missing_ok=True)


def _seq_of(blob: str) -> int | None:
    """The sequence number in a delta or snapshot name (``.../<seq:012d>-<token>.<ext>``), or None."""
    stem = blob.rsplit("/", 1)[-1]
    digits, sep, _ = stem.partition("-")
    return int(digits) if sep and digits.isdigit() else None


@attrs.define(eq=False)
class _Lineage:
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
    #: blob name -> when a sweep of this manager first saw it unmarked (its age where the store keeps no metadata)
    first_seen: dict[str, float] = attrs.field(factory=dict)
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
    #: blobs no retained checkpoint needs that are not deleted yet
    garbage: set[str] = attrs.field(factory=set)
    lock: threading.Lock = attrs.field(factory=threading.Lock)

    def recipe(self) -> Recipe:
        return Recipe(snapshot=self.base, deltas=tuple(self.deltas))


@attrs.define(eq=False)
class ChangelogBackupManager(TaskBackupManager):
    context: BackendContext
    snapshot_interval_commits: int
    snapshot_interval_bytes: int
    compression: str
    compression_level: int
    retained: int
    #: a snapshot is due once the delta files after the base hold this many times the base's bytes (0: off)
    snapshot_interval_ratio: float = 1.0
    gc_interval_commits: int = 20
    gc_grace_period_ms: int = 3_600_000
    #: wall clock (seconds since the epoch) for blob ages and the sweep's time bound; tests may replace it
    clock: Callable[[], float] = time.time
    _lineages: dict[str, _Lineage] = attrs.field(init=False, factory=dict)
    _closed: bool = attrs.field(init=False, default=False)
    #: background snapshots stop at their next check (:meth:`cancel_background`)
    _cancelled: bool = attrs.field(init=False, default=False)

    def init(self, checkpoint: CheckpointV2 | None) -> None:
        markers = checkpoint.markers_for(self.context.factory_name) if checkpoint is not None else {}
        for name, store in self.context.stores.items():
            staging = Path(store.path) / STAGING_DIR
            staging.mkdir(exist_ok=True)
            for stale in staging.iterdir():  # left by a crashed process (its commits never became durable), not in
                _unlink_unless_in_flight(stale)  # flight for an earlier open in this process whose close timed out
            lineage = _Lineage(name=name, store=store, prefix=self.context.blob_prefix(name), staging=staging)
            recipe = (Recipe.decode(markers[name], prefix=lineage.prefix, source=f"store {name}") if name in markers
                      else None)
            head = recipe.head if recipe is not None else None
            # which backend restored the store at open (absent: a context built outside TaskStorage, taken as this
            # one). Restored by another backend (this one's restore failed: a blob of the chain may be missing), the
            # store's version equals the recipe head's, yet the chain must not be continued.
            restorer = self.context.restored_by.get(name, self.context.factory_name)
            ours = restorer == self.context.factory_name
            if ours and recipe is not None and head is not None and head.version == store.version:
                lineage.seq, lineage.base, lineage.deltas = recipe.seq, recipe.snapshot, list(recipe.deltas)
                lineage.uploaded.update(recipe.blob_names())
                lineage.retained.append(recipe)
                lineage.commits_since_snapshot = len(recipe.deltas)
                self._adopt_finished_snapshot(lineage)
                self._look_up_sizes(lineage)
            elif store.version is None and store.count() == 0 and (recipe is None or recipe.seq == 0):
                lineage.seq = 0  # an empty store and no chain yet: the chain starts empty, its first delta at seq 1
            else:
                # Restored by another backend (migration, or a fallback after this backend's restore failed) or the
                # marker is for other data: start a new chain from a snapshot of the state at the first commit. So
                # too for an empty store whose recipe is past seq 0: deltas after seq 1 without a snapshot are what a
                # recipe whose snapshot was removed looks like, and restore refuses them.
                if recipe is not None and not ours:
                    log.warning("store %s: restored by the %s backend, not from this backend's recipe; the changelog "
                                "chain starts anew from a snapshot at the next commit", name, restorer,
                                extra=self._log_extra(name))
                    self.context.metrics.increment("changelog.rebase.after.fallback")
                lineage.seq = recipe.seq if recipe is not None else 0
                lineage.base = None
                lineage.deltas = []
                lineage.rebase_view = None
                lineage.commits_since_snapshot = -1  # forces a re-base at the first commit
            self._lineages[name] = lineage

    def _adopt_finished_snapshot(self, lineage: _Lineage) -> None:
        """Start the chain from a background snapshot an earlier manager finished but could not adopt (it closed
        first: a job that opens its task for each batch, like the Spark driver, closes after every commit). Its
        name is deterministic (the step's seq and token), and a create-only upload is whole or absent."""
        if not lineage.deltas:
            return
        finished = set(self.context.blob_store.list(lineage.prefix + "snapshot/"))
        for step in reversed(lineage.deltas):
            name = snapshot_name(lineage.prefix, step.seq, step.token)
            if name in finished:
                snapshot = Step(step.seq, step.checkpoint_id, step.token, name)
                created_at = self._whole_and_bound(lineage, snapshot)
                if created_at is False:
                    continue
                if not self._young_enough(created_at):
                    # a sweep of another attempt may delete it any time now: naming it in a checkpoint is unsafe
                    self.context.metrics.increment("changelog.snapshot.too.old")
                    log.info("store %s: not adopting finished snapshot %s: older than half the gc grace period "
                             "(or its age is unknown)", lineage.name, name, extra=self._log_extra(lineage.name))
                    continue
                lineage.base = snapshot
                lineage.deltas = [d for d in lineage.deltas if d.seq > step.seq]
                lineage.uploaded.add(name)
                if created_at is not None:
                    lineage.uploaded_at[name] = created_at
                lineage.commits_since_snapshot = len(lineage.deltas)
                lineage.bytes_since_snapshot = 0
                self.context.metrics.increment("changelog.snapshot.adopted")
                return

    def _look_up_sizes(self, lineage: _Lineage) -> None:
        """In the background, the sizes the snapshot interval ratio needs of a chain this manager did not write: the
        base's (a snapshot, or the first delta on the empty store) and the newest delta's, which stands for the
        deltas of unknown size. Until they are known, the chain is bounded by UNKNOWN_SIZES_INTERVAL_COMMITS."""
        if self.snapshot_interval_ratio <= 0:
            return
        names = [step.name for step in lineage.recipe().steps() if step.name is not None]
        wanted = [name for name in dict.fromkeys(names[:1] + names[-1:]) if name not in lineage.blob_bytes]
        if not wanted or self._closed:
            return

        def look_up() -> None:
            for name in wanted:
                try:
                    size = self.context.blob_store.head(name).size
                except Exception as exc:  # noqa: BLE001 - only an estimate is lost; restore checks every blob
                    log.debug("store %s: size of %s unknown: %s", lineage.name, name, exc,
                              extra=self._log_extra(lineage.name))
                    return
                with lineage.lock:
                    lineage.blob_bytes.setdefault(name, size)

        maintenance_pool().submit(look_up)

    def _whole_and_bound(self, lineage: _Lineage, snapshot: Step) -> float | None | bool:
        """Whether the blob ``snapshot`` names is whole (header, end marker, body length: two ranged reads) and is
        that snapshot (its header's lineage). Adopting a blob that is not would make every later checkpoint name it;
        restore would then refuse them all. ``False`` when it is not; else its ``created_at`` (None: unknown)."""
        blob_store = self.context.blob_store
        name = snapshot.name
        assert name is not None
        try:
            info = blob_store.head(name)
            size = info.size
            prefix = blob_store.get(name, start=0, end=HEADER_PREFIX_SIZE)
            head = blob_store.get(name, start=0, end=header_size(prefix, name=name))
            tail = blob_store.get(name, start=max(0, size - FOOTER_SIZE), end=size)
            header = read_frame(head, tail, size, name=name)
            check_blob_binding(header, snapshot, kind=KIND_SNAPSHOT, job=self.context.job_name,
                               task=self.context.task_name, store=lineage.name)
        except (NotFoundError, CorruptDataError, IncompatibleFormatError) as exc:
            self.context.metrics.increment("changelog.snapshot.rejected")
            log.warning("store %s: not adopting finished snapshot %s: %s", lineage.name, name, exc,
                        extra=self._log_extra(lineage.name))
            return False
        return _created_at(info.metadata)

    def _young_enough(self, created_at: float | None) -> bool:
        """Whether a blob no durable checkpoint is known to name may still be named by a new one: younger than half
        the grace period (a sweep deletes unmarked blobs past the whole period, and stops ``grace / 4`` after its
        mark, so a checkpoint written within ``grace / 4`` of this check is safe). No grace period: always."""
        if self.gc_grace_period_ms <= 0:
            return True
        if created_at is None:
            return False
        return self.clock() - created_at < self.gc_grace_period_ms / 2000.0

    def snapshot(self, checkpoint_id: CheckpointId, changes: Mapping[str, ChangeSet]) -> StoreMarkers:
        markers: StoreMarkers = {}
        for name, lineage in self._lineages.items():
            change = changes[name]
            with lineage.lock:
                self._adopt_background_snapshot(lineage)
                lineage.seq += 1
                version = change.version
                if lineage.commits_since_snapshot < 0:
                    # re-base: the recipe is one snapshot of this very version, written by upload()
                    lineage.rebase_view = change.read_view()  # future: opened once the flush is applied
                    step = Step(lineage.seq, version.checkpoint_id, version.token,
                                snapshot_name(lineage.prefix, lineage.seq, version.token))
                    lineage.base, lineage.deltas = step, []
                    lineage.commits_since_snapshot = 0
                    lineage.bytes_since_snapshot = 0
                else:
                    name_or_none = delta_name(lineage.prefix, lineage.seq, version.token) if len(change) else None
                    step = Step(lineage.seq, version.checkpoint_id, version.token, name_or_none)
                    lineage.deltas.append(step)
                    if name_or_none is not None:
                        lineage.to_encode[name_or_none] = change
                    lineage.commits_since_snapshot += 1
                    lineage.bytes_since_snapshot += change.raw_bytes
                    self._maybe_start_background_snapshot(lineage, change)
                markers[name] = lineage.recipe().encode(prefix=lineage.prefix)
        return markers

    def upload(self, checkpoint_id: CheckpointId, markers: StoreMarkers) -> Future[StoreMarkers]:
        futures = {name: self.context.executor.submit(self._upload_store, self._lineages[name], marker)
                   for name, marker in markers.items()}
        result: Future[StoreMarkers] = Future()

        def gather(_: Future) -> None:
            if all(f.done() for f in futures.values()) and not result.done():
                errors = [f.exception() for f in futures.values() if f.exception() is not None]
                try:
                    if errors:
                        result.set_exception(errors[0])
                    else:
                        result.set_result({name: f.result() for name, f in futures.items()})
                except Exception:  # noqa: BLE001 - another callback resolved it first
                    return

        for future in futures.values():
            future.add_done_callback(gather)
        if not futures:
            result.set_result({})
        return result

    def cleanup(self, checkpoint_id: CheckpointId, markers: StoreMarkers) -> Future[None]:
        return self.context.executor.submit(self._cleanup, markers)

    def sweep(self) -> int:
        """Mark-and-sweep every store's blobs (see the module docstring). Returns the number of blobs deleted."""
        marked: dict[str, set[str]] = {name: set() for name in self._lineages}
        # the seq of the head checkpoint's recipe, per store (0: the head has none, nothing is deleted). Not the
        # highest seq of any entry: after a replay (a task restored an older checkpoint and wrote head + 1) the
        # superseded checkpoints carry higher seqs than the chain the head and its next owner build on.
        newest_seq: dict[str, int] = {name: 0 for name in self._lineages}
        marked_at = self.clock()  # before the listing: the marks show the log as of then, at the latest
        entries = self._checkpoint_log().entries()
        for entry in entries:
            if not isinstance(entry.checkpoint, CheckpointV2):
                continue
            for name, marker in entry.checkpoint.markers_for(self.context.factory_name).items():
                if name in marked:
                    recipe = Recipe.decode(marker, prefix=self._lineages[name].prefix,
                                           source=f"store {name} in checkpoint #{entry.seq}")
                    marked[name].update(recipe.blob_names())
        head = entries[-1] if entries else None
        if head is not None and isinstance(head.checkpoint, CheckpointV2):
            for name, marker in head.checkpoint.markers_for(self.context.factory_name).items():
                if name in newest_seq:
                    newest_seq[name] = Recipe.decode(marker, prefix=self._lineages[name].prefix,
                                                     source=f"store {name} in checkpoint #{head.seq}").seq
        grace = self.gc_grace_period_ms / 1000.0
        deleted = 0
        stale = False
        for name, lineage in self._lineages.items():
            with lineage.lock:
                marked[name].update(lineage.recipe().blob_names())
                marked[name].update(n for r in lineage.retained for n in r.blob_names())
                if lineage.background_name is not None:
                    marked[name].add(lineage.background_name)
                limit = newest_seq[name]
            listed: set[str] = set()
            for kind in ("delta/", "snapshot/"):
                for blob in list(self.context.blob_store.list(lineage.prefix + kind)):
                    listed.add(blob)
                    seq = _seq_of(blob)
                    if blob in marked[name] or seq is None or seq > limit:
                        continue
                    if grace > 0 and self.clock() - marked_at > grace / 4:
                        stale = True  # a checkpoint written since the mark may name blobs that are old by now
                        break
                    if not self._past_grace(lineage, blob):
                        continue
                    with lineage.lock:  # checked again: a snapshot may have been adopted or started meanwhile
                        if blob in lineage.recipe().blob_names() or blob == lineage.background_name:
                            continue
                    self.context.blob_store.delete(blob)
                    with lineage.lock:
                        lineage.first_seen.pop(blob, None)
                    deleted += 1
                if stale:
                    break
            if stale:
                log.warning("task %s: changelog sweep ran longer than a quarter of the gc grace period since its "
                            "mark; stopped (the next sweep marks anew)", self.context.task_name,
                            extra=self._log_extra())
                self.context.metrics.increment("changelog.sweep.stopped")
                break
            with lineage.lock:  # forget blobs gone meanwhile
                for gone in [b for b in lineage.first_seen if b not in listed]:
                    del lineage.first_seen[gone]
        self.context.metrics.increment("changelog.sweeps")
        if deleted:
            self.context.metrics.increment("changelog.sweep.deleted", deleted)
            log.debug("task %s: changelog sweep deleted %d unreferenced blobs", self.context.task_name, deleted,
                      extra=self._log_extra())
        return deleted

    def _past_grace(self, lineage: _Lineage, blob: str) -> bool:
        """Whether the unmarked ``blob`` is older than the grace period: from its ``created_at`` metadata, else from
        the time a sweep of this manager first saw it."""
        grace = self.gc_grace_period_ms / 1000.0
        if grace <= 0:
            return True
        now = self.clock()
        created_at: float | None = None
        if self.context.blob_store.supports_metadata:
            try:
                created_at = _created_at(self.context.blob_store.head(blob).metadata)
            except NotFoundError:
                return False  # gone already
        if created_at is None:
            with lineage.lock:
                created_at = lineage.first_seen.setdefault(blob, now)
        return now - created_at >= grace

    def _drop_abandoned_staged_files(self, lineage: _Lineage, durable: Recipe) -> None:
        """Staged deltas a re-base or an adopted snapshot left behind: at or below the durable head and not in its
        recipe, no future commit uploads them (files above the head may belong to the commit now running). A file in
        flight (being written or uploaded: a background snapshot's, whose seq is below the head while it uploads on
        a slow network) is never deleted."""
        needed = {Path(name).name for name in durable.blob_names()}
        for staged in list(lineage.staging.iterdir()):
            seq = _seq_of(staged.name)
            if staged.name.endswith(".partial") or seq is None or seq > durable.seq or staged.name in needed:
                continue
            _unlink_unless_in_flight(staged)

    def _checkpoint_log(self) -> CheckpointLog:
        """The task's log (its listings never show less than the newest checkpoint the task knows durable, so a
        short listing cannot make live blobs look unreferenced)."""
        return self.context.checkpoint_log

    def abort(self, checkpoint_id: CheckpointId) -> None:
        """A snapshot of this commit failed (another backend's, before or after ours ran): the commit flushed every
        store, but the change sets are closed, so the chain cannot get this commit's delta (nor, when ours never
        ran, even a step for it). Re-base on a fresh snapshot at the next commit."""
        for lineage in self._lineages.values():
            with lineage.lock:
                lineage.to_encode.clear()
                if lineage.rebase_view is not None:
                    _close_when_ready(lineage.rebase_view)
                    lineage.rebase_view = None
                lineage.commits_since_snapshot = -1

    def _log_extra(self, store: str | None = None) -> dict[str, object]:
        """Fields for structured log handlers (``extra``): job, task and the store concerned."""
        return {"job": self.context.job_name, "task": self.context.task_name, "store": store}

    def close(self) -> None:
        if self._closed:
            return
        self._closed = True
        for lineage in self._lineages.values():
            background = lineage.background
            if background is not None:
                try:
                    background.exception()  # the read view must not outlive the store
                except BaseException:  # noqa: BLE001, S110 - a cancelled job
                    pass
            if lineage.rebase_view is not None:
                _close_when_ready(lineage.rebase_view)
                lineage.rebase_view = None

    # -- upload -------------------------------------------------------------------------------------------------

    def _upload_store(self, lineage: _Lineage, marker: str) -> str:
        recipe = Recipe.decode(marker, prefix=lineage.prefix, source=f"store {lineage.name}")
        # every file this upload stages or re-sends is in flight until it returns: cleanup leaves them alone
        with _staged_in_flight([lineage.staging / Path(name).name for name in recipe.blob_names()]):
            return self._upload_recipe(lineage, recipe, marker)

    def _upload_recipe(self, lineage: _Lineage, recipe: Recipe, marker: str) -> str:
        metrics = self.context.metrics
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
                self._write_and_upload(lineage, step, "snapshot", view.items(), step.name)
                with lineage.lock:
                    lineage.uploaded.add(step.name)
            # Stage this commit's deltas before uploading anything: a failed upload below then leaves every delta
            # staged, and the next commit retries them instead of re-basing on a full snapshot.
            for step in recipe.deltas:
                change = to_encode.pop(step.name, None) if step.name is not None else None
                if change is not None and step.name is not None:
                    self._stage(lineage, step, "delta", change.columns() or iter(change), step.name)
            for step in recipe.deltas:
                if step.name is None or step.name in lineage.uploaded:
                    continue
                staged = lineage.staging / Path(step.name).name
                if step.name in lineage.fresh and staged.exists():  # staged just above
                    self._upload_staged_file(lineage, staged, step.name, "delta")
                    with lineage.lock:
                        lineage.fresh.discard(step.name)
                elif staged.exists():  # a previous commit's delta whose upload failed: upload it now
                    try:
                        check_digest(staged.read_bytes(), name=str(staged))
                    except CorruptDataError:
                        staged.unlink(missing_ok=True)  # not staged any more: the failure below re-bases
                        raise
                    self._put_staged(lineage, staged, step.name)
                    metrics.increment("changelog.delta.reuploads")
                else:
                    raise StateBackendError(
                        f"store {lineage.name}: delta {step.name} is neither uploaded nor staged; the next commit "
                        f"re-bases on a fresh snapshot"
                    )
                with lineage.lock:
                    lineage.uploaded.add(step.name)
            with lineage.lock:
                old = [n for n in reused if not self._young_enough(lineage.uploaded_at.get(n))]
                if old:
                    lineage.commits_since_snapshot = -1  # re-base next commit: fresh blobs only
            if old:
                self.context.metrics.increment("changelog.rebase.old.blobs")
                raise StateBackendError(
                    f"store {lineage.name}: this commit would name {old[0]} (and {len(old) - 1} more), uploaded more "
                    f"than half of changelog.gc.grace.period.ms ago and named by no checkpoint known durable: a sweep "
                    f"of another attempt may delete it. The next commit re-bases on a fresh snapshot"
                )
        except BaseException:
            with lineage.lock:
                missing = [s for s in recipe.deltas if s.name is not None and s.name not in lineage.uploaded
                           and not (lineage.staging / Path(s.name).name).exists()]
                if missing or (recipe.snapshot is not None and recipe.snapshot.name not in lineage.uploaded
                               and view_future is not None):
                    lineage.commits_since_snapshot = -1  # chain cannot be completed: re-base next commit
            raise
        finally:
            if view is not None:
                view.close()
        return marker

    def _write_and_upload(
        self, lineage: _Lineage, step: Step, kind: str, records: Iterable[tuple[bytes, bytes | None]], name: str
    ) -> None:
        staged = self._stage(lineage, step, kind, records, name)
        with lineage.lock:
            lineage.fresh.discard(name)
        self._upload_staged_file(lineage, staged, name, kind)

    def _stage(
        self, lineage: _Lineage, step: Step, kind: str,
        records: Iterable[tuple[bytes, bytes | None]] | RecordColumns, name: str,
    ) -> Path:
        """Write the file for ``step`` into the staging dir (aside, then renamed: a staged file is always whole)."""
        header = FileHeader(
            kind=kind,
            job=self.context.job_name,
            task=self.context.task_name,
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
            write_file(out, header, records, compression=self.compression, level=self.compression_level)
        with lineage.lock:
            lineage.fresh.add(name)
        return staged

    def _upload_staged_file(self, lineage: _Lineage, staged: Path, name: str, kind: str) -> None:
        size = staged.stat().st_size
        self._put_staged(lineage, staged, name)
        metrics = self.context.metrics
        metrics.increment(f"changelog.{kind}.uploads")
        metrics.increment("commit.bytes.uploaded", size)
        metrics.increment("commit.files.uploaded")
        metrics.record(f"changelog.{kind}.bytes", size)

    def _put_staged(self, lineage: _Lineage, staged: Path, name: str) -> None:
        blob_store = self.context.blob_store
        created_at = self.clock()  # before the put: a sweep never sees the blob younger than it is
        metadata = {CREATED_AT: f"{created_at:.3f}"} if blob_store.supports_metadata else None
        size = staged.stat().st_size
        try:
            blob_store.put_file(name, staged, create_only=True, metadata=metadata)
        except AlreadyExistsError:
            # names carry the flush's unique token: only an earlier try of this very upload can have written it
            # (a retry after a timeout whose first attempt had landed); the content is the same bytes.
            pass
        with lineage.lock:
            lineage.uploaded_at[name] = created_at
            lineage.blob_bytes[name] = size
        staged.unlink(missing_ok=True)

    # -- background snapshots ----------------------------------------------------------------------------------

    def _ratio_due(self, lineage: _Lineage) -> bool | None:
        """Whether the delta files after the base (estimated where their sizes are unknown) hold
        ``snapshot.interval.ratio`` times the base's bytes; None when no estimate can be made yet (the base's size,
        or every delta's, unknown: a manager that inherited the chain before its look-up at open answered).
        Without a snapshot, the chain's first delta (loaded in bulk onto the empty store at restore, as a snapshot
        is) is the base. A restore downloads and applies at most the base plus that ratio of it, and the snapshots'
        bytes, amortized, follow the change: about the deltas' bytes over the ratio per commit, where a fixed commit
        interval costs the whole state's."""
        ratio = self.snapshot_interval_ratio
        if ratio <= 0:
            return False
        names = [step.name for step in lineage.deltas if step.name is not None]
        if lineage.base is not None:
            base, chain = lineage.base.name, names
        elif names:
            base, chain = names[0], names[1:]
        else:
            return False
        if not chain:
            return False
        base_bytes = lineage.blob_bytes.get(base) if base is not None else None
        known = [lineage.blob_bytes[name] for name in chain if name in lineage.blob_bytes]
        if base_bytes is None or not known:
            return None
        estimate = sum(known) + sum(known) / len(known) * (len(chain) - len(known))
        return estimate >= ratio * base_bytes

    def _maybe_start_background_snapshot(self, lineage: _Lineage, change: ChangeSet) -> None:
        by_ratio = self._ratio_due(lineage)
        due = (lineage.commits_since_snapshot >= self.snapshot_interval_commits
               or lineage.bytes_since_snapshot >= self.snapshot_interval_bytes
               or by_ratio is True
               # sizes unknown (a task opened for each batch whose look-up has not answered yet): the fixed
               # interval of the first releases, not the cap, bounds the chain
               or (by_ratio is None and lineage.commits_since_snapshot >= UNKNOWN_SIZES_INTERVAL_COMMITS))
        if not due or lineage.background is not None or self._closed or self._cancelled:
            return
        view = change.read_view()  # a future: an LMDB read transaction on this version, once it is applied
        step = lineage.deltas[-1]
        name = snapshot_name(lineage.prefix, step.seq, step.token)
        lineage.background_name = name
        lineage.background = maintenance_pool().submit(self._background_snapshot, lineage, view, step, name)

    def _background_snapshot(self, lineage: _Lineage, view_future: Future[ReadView], step: Step, name: str) -> Step:
        """Write and upload a snapshot of ``step``'s version from a read view. It stops (``SnapshotCancelled``) once
        :meth:`cancel_background` was called: a parked task handed to another process that waits for it then waits
        for at most a chunk of records, not the whole snapshot (the next owner of the chain snapshots when due)."""
        self._raise_if_cancelled(name)  # queued behind another task's snapshot while this one closed
        view = view_future.result()
        try:
            # in flight while it is written and uploaded: on a slow network, commits past its seq become durable
            # meanwhile, and their cleanups must not take it for a file a re-base left behind
            with _staged_in_flight([lineage.staging / Path(name).name]):
                staged = self._stage(lineage, step, "snapshot", self._until_cancelled(view.items(), name), name)
                with lineage.lock:
                    lineage.fresh.discard(name)
                view.close()  # the LMDB read transaction ends here, not after the upload
                try:
                    self._raise_if_cancelled(name)
                except SnapshotCancelled:
                    staged.unlink(missing_ok=True)
                    raise
                self._upload_staged_file(lineage, staged, name, "snapshot")
            crashpoint("changelog.background_snapshot.uploaded")
        finally:
            view.close()
        with lineage.lock:
            lineage.uploaded.add(name)
        return Step(step.seq, step.checkpoint_id, step.token, name)

    def _until_cancelled(self, records: Iterator[tuple[bytes, bytes]], name: str) -> Iterator[tuple[bytes, bytes]]:
        """``records``, stopping with :class:`SnapshotCancelled` at the next chunk once the snapshot is cancelled."""
        return until_cancelled(records, lambda: self._cancelled, lambda: self._cancellation(name))

    def _raise_if_cancelled(self, name: str) -> None:
        if self._cancelled:
            raise self._cancellation(name)

    @staticmethod
    def _cancellation(name: str) -> SnapshotCancelled:
        return SnapshotCancelled(f"background snapshot {name} stopped: the task was handed to another opener")

    def cancel_background(self) -> None:
        """Stop the background snapshots (see the contract), unless a chain has reached
        ``snapshot.interval.commits`` (the cap): then its snapshot has been put off long enough and close waits for
        it, so handovers that keep interrupting snapshots cannot let a chain grow without bound."""
        with ExitStack() as held:
            for lineage in self._lineages.values():
                held.enter_context(lineage.lock)
            if all(lineage.commits_since_snapshot < self.snapshot_interval_commits
                   for lineage in self._lineages.values()):
                self._cancelled = True

    def _adopt_background_snapshot(self, lineage: _Lineage) -> None:
        background = lineage.background
        if background is None or not background.done():
            return
        lineage.background = None
        lineage.background_name = None  # adopted below (then in the recipe) or dropped (then garbage)
        exc = background.exception()
        if exc is not None:
            self.context.metrics.increment("changelog.snapshot.failures")
            log.warning("store %s: background snapshot failed (retried later): %s", lineage.name, exc,
                        extra=self._log_extra(lineage.name))
            return
        snapshot = background.result()
        assert snapshot.name is not None
        if not self._young_enough(lineage.uploaded_at.get(snapshot.name)):
            self.context.metrics.increment("changelog.snapshot.too.old")
            log.warning("store %s: not adopting background snapshot %s: it was uploaded more than half of "
                        "changelog.gc.grace.period.ms ago (raise it above twice the longest snapshot upload)",
                        lineage.name, snapshot.name, extra=self._log_extra(lineage.name))
            return
        if lineage.commits_since_snapshot < 0:
            return  # the chain broke after this snapshot started: the pending re-base replaces it (keep the flag)
        if lineage.base is not None and snapshot.seq <= lineage.base.seq:
            return
        if not any(d.seq == snapshot.seq and d.token == snapshot.token for d in lineage.deltas):
            return  # the chain was re-based meanwhile; this snapshot belongs to an abandoned one
        lineage.base = snapshot
        lineage.deltas = [d for d in lineage.deltas if d.seq > snapshot.seq]
        lineage.commits_since_snapshot = len(lineage.deltas)
        lineage.bytes_since_snapshot = 0
        self.context.metrics.increment("changelog.snapshot.adopted")

    # -- retention ----------------------------------------------------------------------------------------------

    def _cleanup(self, markers: StoreMarkers) -> None:
        for name, marker in markers.items():
            lineage = self._lineages[name]
            recipe = Recipe.decode(marker, prefix=lineage.prefix, source=f"store {name}")
            with lineage.lock:
                # idempotent and order-proof: a repeated or late cleanup must not take a slot of the window (that
                # would drop a recipe a retained checkpoint still needs); the window is ordered by seq, newest last
                if recipe not in lineage.retained:
                    lineage.retained.append(recipe)
                    lineage.retained = deque(sorted(lineage.retained, key=lambda r: r.seq))
                dropped: list[Recipe] = []
                while len(lineage.retained) > max(1, self.retained):
                    dropped.append(lineage.retained.popleft())
                keep = {n for r in lineage.retained for n in r.blob_names()}
                keep.update(lineage.recipe().blob_names())
                # garbage a failed cleanup left behind is tried again here (delete is idempotent)
                lineage.garbage.update(n for r in dropped for n in r.blob_names())
                lineage.garbage.difference_update(keep)
                garbage = sorted(lineage.garbage)
            for blob in garbage:
                self.context.blob_store.delete(blob)
                with lineage.lock:
                    lineage.garbage.discard(blob)
                crashpoint("changelog.cleanup.deleted")
                with lineage.lock:
                    lineage.uploaded.discard(blob)
                    lineage.uploaded_at.pop(blob, None)
                    lineage.blob_bytes.pop(blob, None)
            if garbage:
                self.context.metrics.increment("changelog.blobs.deleted", len(garbage))
            self._drop_abandoned_staged_files(lineage, recipe)
        heads = [Recipe.decode(marker, prefix=self._lineages[name].prefix, source=f"store {name}").seq
                 for name, marker in markers.items()]
        if heads and self.gc_interval_commits and max(heads) % self.gc_interval_commits == 0:
            self.sweep()


def _created_at(metadata: Mapping[str, str]) -> float | None:
    """A blob's ``created_at`` (unix seconds), or None when it has none or an unreadable one."""
    value = metadata.get(CREATED_AT)
    if value is None:
        return None
    try:
        return float(value)
    except ValueError:
        log.warning("blob metadata %s=%r is not a time; the blob's age is unknown", CREATED_AT, value)
        return None


def _close_when_ready(view: Future[ReadView]) -> None:
    """Close a read view that may not be open yet (its flush still being applied)."""

    def close(done: Future[ReadView]) -> None:
        if not done.cancelled() and done.exception() is None:
            done.result().close()

    view.add_done_callback(close)
