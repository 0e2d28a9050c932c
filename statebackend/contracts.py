"""The state backend contracts (docs/architecture.md, after Samza SEP-28).

A state backend is a :class:`StateBackendFactory` that gives, for one task, a :class:`TaskBackupManager`, a
:class:`TaskRestoreManager` and a :class:`StateBackendAdmin`. The :class:`~statebackend.commit.TaskCommitManager`
drives the backup managers; :class:`~statebackend.task.TaskStorage` drives the restore managers.

One deliberate difference from SEP-28: ``snapshot`` receives the change sets the commit's flush produced
(``{store: ChangeSet}``). Every backend of a store in a dual commit sees the same immutable change set, and a
backend that does not need it (blob-snapshot) ignores it. See docs/architecture.md.

**Blob lifetime is the framework's.** A backup manager states, through :meth:`TaskBackupManager.blob_lifetime`, a
:class:`BlobLifetime`: which blobs each marker references, where its blobs live, what its running work holds. The
framework (:mod:`statebackend.kit.lifetime`) then keeps every blob a retained checkpoint names and deletes the rest
after the grace period; the backend writes no sweep code and hears of each checkpoint through
:meth:`TaskBackupManager.checkpoint_completed` and :meth:`TaskBackupManager.checkpoint_aborted`. A backend written to
the earlier contract (no ``blob_lifetime``, its own ``cleanup``) keeps working unchanged: see ``cleanup``.
"""

from __future__ import annotations

import abc
import contextlib
import time
from collections.abc import Iterable, Mapping, Sequence
from concurrent.futures import Executor, Future
from typing import TYPE_CHECKING, Any

import attrs

if TYPE_CHECKING:
    from statebackend.blobstores.base import BlobStore
    from statebackend.checkpoint import CheckpointId, CheckpointLog, CheckpointV2
    from statebackend.metrics import Metrics
    from statebackend.store import ChangeSet, LocalStore

__all__ = [
    "DEFAULT_GRACE_MS",
    "BackendContext",
    "BlobLifetime",
    "LifetimeSweep",
    "StateBackendAdmin",
    "StateBackendFactory",
    "StoreMarkers",
    "TaskBackupManager",
    "TaskRestoreManager",
]

#: store name -> marker (a backend's string that locates the store's state for one checkpoint)
StoreMarkers = dict[str, str]

#: the grace period of a :class:`BlobLifetime` that does not choose one: an hour (the built-ins' default too)
DEFAULT_GRACE_MS = 3_600_000


@attrs.frozen
class BackendContext:
    """Everything a backend gets for one task. Built by the framework; backends never build it themselves."""

    #: canonical factory name, as written into checkpoints (``changelog``, ``blobsnapshot``, or a dotted path)
    factory_name: str
    #: the job's name (``job.name``): the first segment of every blob prefix
    job_name: str
    #: the task's name within the job: the second segment of every blob prefix
    task_name: str
    #: the stores of this task that this backend backs up or restores, by store name
    stores: Mapping[str, LocalStore]
    #: the job's blob store, shared by the task's backends and its checkpoint log: the backend's blobs go under
    #: :meth:`blob_prefix`
    blob_store: BlobStore
    #: the task's checkpoint log: its retention (``retained``) bounds what backends keep; its listings never show less
    #: than the newest checkpoint the task knows durable (its ``floor``), so in a backend's mark phase a short
    #: listing is a fault, never "nothing is referenced"
    checkpoint_log: CheckpointLog
    #: the commit pool: bounded, shared by the tasks of the process. An ``upload`` queues its work here; the framework
    #: writes checkpoints, sends notices and collects garbage here. Never wait on a future of this pool from a task
    #: of it (chain callbacks instead): that can deadlock a full pool
    executor: Executor
    #: the task's metrics, to count into with names from :mod:`statebackend.metrics.catalogue` (labels ``store`` and
    #: ``backend`` where the catalogue has them)
    metrics: Metrics
    #: this backend's own ``<factory>.*`` settings, already validated by the factory's ``options`` schema
    options: Mapping[str, Any] = attrs.field(factory=dict)
    #: which backend restored each store at open, by store name; ``None`` means the store started empty. Set for
    #: backup managers. A backend whose own restore failed (another one's marker was used instead) must not build on
    #: its lineage.
    restored_by: Mapping[str, str | None] = attrs.field(factory=dict)
    #: per store, the backends whose restore of it failed at open (then another backend's marker was used). Set for
    #: backup managers. A backend that failed must not continue its lineage; one that was not tried (another came
    #: first in ``restore.factories``) may, when the store's version is the one its marker describes.
    restore_failures: Mapping[str, tuple[str, ...]] = attrs.field(factory=dict)

    def blob_prefix(self, store_name: str) -> str:
        """Where this backend keeps one store's blobs: ``<job>/<task>/<store>/<factory>/``."""
        return f"{self.job_name}/{self.task_name}/{store_name}/{self.factory_name}/"


@attrs.frozen
class LifetimeSweep:
    """What one sweep of one store did."""

    #: the store swept
    store: str
    #: the blobs it deleted
    deleted: tuple[str, ...] = ()
    #: blobs it judged old but kept: written again since its ``head`` (a conditional delete found them changed)
    kept: tuple[str, ...] = ()
    #: per prefix it listed, every name the listing showed
    listed: dict[str, frozenset[str]] = attrs.field(factory=dict)
    #: it stopped at its deadline (a quarter of the grace period after its mark); the next sweep marks anew
    stopped: bool = False
    #: ``False``: a marker's blobs could not be told, so nothing was listed nor deleted
    complete: bool = True


class BlobLifetime(abc.ABC):
    """What a backend states about its blobs, so that the framework owns their lifetime (docs/architecture.md, "Blob
    lifetime"). The framework keeps every blob that a marker of a retained checkpoint of any attempt names (and what
    this manager's running work holds), and deletes the rest of the blobs under the store's :meth:`prefixes` once
    they are older than the grace period, on condition that they are unchanged where the blob store can. A backend
    implements :meth:`referenced_blobs`; the other methods have defaults. It never lists, judges ages or deletes.

    Two paths delete, both the framework's (:class:`statebackend.kit.lifetime.BlobCollector`):

    - **release**, when the task's checkpoint log lets its old checkpoints go (:attr:`CheckpointLog.trims
      <statebackend.checkpoint.CheckpointLog.trims>`): the blobs that the checkpoints this process completed and that
      left the last ``retained`` named, and that no later one names nor :meth:`held_blobs` holds, in one request;
    - **sweep**, every :attr:`sweep_interval_commits` checkpoints (:meth:`sweep_due`) and at init with
      :attr:`sweep_on_init`: the mark is what every checkpoint in the task's log names plus :meth:`held_blobs`; every
      blob listed under :meth:`prefixes` and not marked goes once old enough by the age rule
      (:class:`statebackend.kit.GraceRule`), or :meth:`expired`; never one :meth:`spare` keeps.

    **Shared blobs.** Blobs under :meth:`shared_prefixes` may be named by markers of several stores or tasks of the
    job: no task's collector deletes them (a release or a sweep of one task cannot see the others' checkpoints); the
    job-level collector (``statebackend gc``, :func:`statebackend.kit.lifetime.sweep_shared`) marks from every task.

    **Threads.** The framework calls these methods on the commit pool (:attr:`BackendContext.executor`): after each
    durable checkpoint (release, and the sweep when due), at start (the sweep of :attr:`sweep_on_init`) and at close.
    Two calls may run at once (two completions on the pool), so a method that reads the manager's running state takes
    its lock. What marks, deletes and reports for a store runs under :meth:`guard` of that store.
    """

    def __init__(
        self,
        context: BackendContext,
        *,
        grace_ms: int = DEFAULT_GRACE_MS,
        sweep_interval_commits: int = 100,
        sweep_on_init: bool = False,
    ) -> None:
        #: the manager's context: its stores, blob store, checkpoint log, metrics
        self.context = context
        #: an unmarked blob younger than this is kept: another attempt may be between its upload and its checkpoint
        #: write (0: the guard is off). A writer names a blob no durable checkpoint names only while it is younger than
        #: half of it (:meth:`statebackend.kit.GraceRule.may_name`)
        self.grace_ms = grace_ms
        #: sweep after every checkpoint whose seq is a multiple of this (0: never after a commit)
        self.sweep_interval_commits = sweep_interval_commits
        #: sweep once when the manager starts (:meth:`statebackend.kit.lifetime.BlobCollector.start`)
        self.sweep_on_init = sweep_on_init

    @abc.abstractmethod
    def referenced_blobs(self, store: str, marker: str) -> Iterable[str] | None:
        """The names of every blob ``marker`` (this backend's, of ``store``) needs to restore: its chain, its index
        and the runs it lists, the blob that is the marker itself. ``None``: cannot tell (then nothing is swept). A
        marker that does not decode raises :class:`~statebackend.errors.CorruptDataError` (nothing is swept)."""

    def stores(self) -> Sequence[str]:
        """The stores whose blobs this lifetime covers: the context's."""
        return list(self.context.stores)

    def prefixes(self, store: str) -> Sequence[str]:
        """Where the blobs of ``store`` that the framework may delete live: the context's ``blob_prefix(store)``.
        A backend with several (an index prefix, a runs prefix) lists each: they are swept in this order, and a
        sweep that stops early leaves the rest for the next one."""
        return (self.context.blob_prefix(store),)

    def shared_prefixes(self) -> Sequence[str]:
        """Prefixes of blobs shared across checkpoints of several stores or tasks (see the class docstring). Default:
        none."""
        return ()

    def held_blobs(self, store: str) -> Iterable[str]:
        """Blobs of ``store`` this manager's running work holds and no durable checkpoint may name yet: the chain the
        next commit extends, an upload or a background snapshot or compaction in progress, what it remembers as
        retained. Read at the mark, and again just before each batch of deletions (work may have adopted a blob
        meanwhile). Default: none."""
        return ()

    def spare(self, store: str, blob: str, head: CheckpointV2 | None) -> bool:
        """Whether a sweep keeps ``blob`` although unmarked and old, on what the backend knows (a seq beyond that of
        ``head``, the newest checkpoint in the log). Default: ``False``."""
        return False

    def expired(self, metadata: Mapping[str, str], now: float) -> bool:
        """Whether an unmarked blob goes whatever its age, by its metadata (an expiry its writer set). Default:
        ``False``."""
        return False

    def sweep_due(self, seq: int, markers: StoreMarkers) -> bool:
        """Whether to sweep after checkpoint ``seq`` (``markers``: this manager's in it): every
        :attr:`sweep_interval_commits` seqs."""
        return bool(self.sweep_interval_commits) and seq % self.sweep_interval_commits == 0

    def now(self) -> float:
        """The wall clock for ages and the sweep's deadline (unix seconds); a backend may give its own (tests)."""
        return time.time()

    def guard(self, store: str) -> contextlib.AbstractContextManager[object]:
        """Held while the framework marks, deletes and reports for ``store`` (a lock the backend's uploads take).
        Default: none."""
        return contextlib.nullcontext()

    def released(self, store: str, blobs: Sequence[str], *, swept: bool) -> None:  # noqa: B027 - optional notice
        """Notice: the framework deleted ``blobs`` of ``store`` (``swept``: by a sweep, else by a release). Forget
        them (they are no longer uploaded); count them. Default: nothing."""

    def swept(self, store: str, sweep: LifetimeSweep) -> None:  # noqa: B027 - optional notice
        """Notice: a sweep of ``store`` ended (what it listed, deleted, kept; whether it stopped early or found its
        mark incomplete). A backend may check its own chain against the listing without listing again. Default:
        nothing."""


class TaskBackupManager(abc.ABC):
    """Backs up a task's stores at every commit."""

    @abc.abstractmethod
    def init(self, checkpoint: CheckpointV2 | None) -> None:
        """Called once, on the opening thread, after restore, with the checkpoint the stores were restored to.

        ``None``: no durable checkpoint yet. The framework has emptied the stores first (local data that no
        checkpoint holds is never kept), so the first commit must back up everything from nothing: a backend never
        builds on blobs it finds under its prefix (an earlier attempt's uploads whose checkpoint never landed), and
        never reads the store's local version as a step of its lineage. Otherwise take this backend's markers
        (``checkpoint.markers_for(context.factory_name)``) as where each lineage continues, but only for a store this
        backend restored (:attr:`BackendContext.restored_by`); a store restored by another backend, or that started
        empty, starts a lineage of its own."""

    @abc.abstractmethod
    def snapshot(self, checkpoint_id: CheckpointId, changes: Mapping[str, ChangeSet]) -> StoreMarkers:
        """Prepare the upload of this commit. Runs on the task's thread, exclusive with processing, and MUST cost
        O(change since the last commit), never O(state). Returns preliminary markers for ``upload``.

        ``changes`` holds, per store of this manager, the immutable change set the commit's flush made: exactly the
        puts and deletes since the last commit, sorted on first use. Back up *that*, never the live store: writes
        made after this call (the task goes on while ``upload`` runs) belong to the next commit, and a checkpoint
        that holds them would restore keys that were never committed. A backend that keeps a full copy reads it
        from a :class:`~statebackend.store.ReadView` opened here (a consistent snapshot), not later.

        **Preliminary markers** are the manager's own business: the framework hands them, unchanged, to this
        manager's ``upload`` of the same checkpoint and nowhere else (they are never written into a checkpoint, never
        shown to another backend). They must be a ``{store: str}`` dict; what they hold is free (the marker the upload
        will return, a placeholder, or ``{}`` when the manager keeps what it prepared itself). If a snapshot of this
        commit raises, ``upload`` is not called and :meth:`abort` is."""

    @abc.abstractmethod
    def upload(self, checkpoint_id: CheckpointId, markers: StoreMarkers) -> Future[StoreMarkers]:
        """Make the snapshot durable. Called on the task's thread right after ``snapshot`` (``markers``: what it
        returned), it must return at once: queue the work on the commit pool (:attr:`BackendContext.executor`), where
        it runs concurrent with processing, and return its future. The future's markers are written into the
        checkpoint, one per store of this manager (a store without one restores empty); everything they reference
        MUST be durable when it resolves: resolve it
        only after every put it depends on returned (a put that failed fails the future; a marker that names a
        blob not yet written makes a checkpoint that restores nothing). Never wait on another future of the same
        pool (chain callbacks instead). A failure is raised by the framework at the next commit; it must not
        poison later commits. Count ``commit.bytes.uploaded`` and ``commit.files.uploaded`` for what was sent
        (``commit.bytes.reused`` for what a marker names without sending it again)."""

    def cleanup(self, checkpoint_id: CheckpointId, markers: StoreMarkers) -> Future[None]:
        """The earlier contract's garbage collection, kept so backends written to it work unchanged: called after
        ``checkpoint_id`` is durable, on the commit pool thread that wrote the checkpoint (and once more at close, on
        the closing thread, for the last checkpoint), it must return at once with the future of work it queued on
        the commit pool. Idempotent.

        A backend whose :meth:`blob_lifetime` states its blobs (every built-in does) leaves this alone: the default
        does nothing, and the framework deletes what no retained checkpoint names. A backend that overrides it
        (returning ``None`` from :meth:`blob_lifetime`) must keep every blob a marker of any checkpoint the task's log
        still holds names (``context.checkpoint_log``, its retention ``retained``), and every blob an upload of this
        or another attempt may still name (younger than the grace period: :class:`statebackend.kit.GraceRule`); a
        listing that shows less than the task knows durable is a fault, never "nothing is referenced"."""
        done: Future[None] = Future()
        done.set_result(None)
        return done

    def blob_lifetime(self) -> BlobLifetime | None:
        """What this manager states about its blobs so that the framework owns their lifetime (the same object for
        the manager's whole life: its collector remembers between sweeps). ``None`` (the default): the manager
        collects its own garbage in :meth:`cleanup`, as backends written to the earlier contract do."""
        return None

    def checkpoint_completed(  # noqa: B027 - an optional hook: the default does nothing
        self, checkpoint_id: CheckpointId, markers: StoreMarkers
    ) -> None:
        """Notice: the checkpoint holding ``markers`` (this manager's, from its ``upload``) is durable. Runs on the
        commit pool (a task of its own, queued after the checkpoint write) before the framework collects garbage after
        it, and may run again for the same checkpoint (at close): be idempotent. Notices of two checkpoints may run
        at once or out of order. What a backend does here is bookkeeping (its chain's blobs may now be named again
        whatever their age); it deletes nothing. As Flink's ``notifyCheckpointComplete``. The default does
        nothing."""

    def checkpoint_aborted(  # noqa: B027 - an optional hook: the default does nothing
        self, checkpoint_id: CheckpointId, markers: StoreMarkers
    ) -> None:
        """Notice: the upload of ``checkpoint_id`` succeeded (``markers`` are what it returned) but its checkpoint
        write failed. The write may still have landed (its reply lost), so what the markers name is neither durable
        nor garbage yet: build nothing on it that needs it durable; the framework's sweep deletes it after the
        grace period if no checkpoint names it. Runs on the commit pool thread whose checkpoint write failed, before
        the commit's failure is reported. As Flink's ``notifyCheckpointAborted``.
        The default does nothing."""

    def abort(self, checkpoint_id: CheckpointId) -> None:  # noqa: B027 - an optional hook: the default does nothing
        """The sync part of commit ``checkpoint_id`` failed after this manager's ``snapshot()`` may have run (another
        backend's snapshot raised): forget what it prepared, so the next commit starts clean. Called on the task's
        thread; ``upload`` is not called for this checkpoint. Its change sets are closed by the framework."""

    def cancel_background(self) -> None:  # noqa: B027 - an optional hook: the default does nothing
        """Called just before ``close()`` when another opener of the task waits for it (a parked task handed to
        another process of the machine): stop background work ``close()`` would wait for (a snapshot, a compaction)
        as soon as possible, uploading and naming nothing half done; the task's next owner does that work again when
        it is due. A manager may decline (its chain too long to put off a snapshot again). The default does
        nothing."""

    def close(self) -> None:  # noqa: B027 - an optional hook: the default does nothing
        """Release resources (background threads, open read transactions)."""


class TaskRestoreManager(abc.ABC):
    """Rebuilds a task's stores to exactly one checkpoint's state."""

    @abc.abstractmethod
    def init(self, checkpoint: CheckpointV2 | None) -> None:
        """The checkpoint to restore to, before :meth:`restore`, on the opening thread. ``None``: no durable
        checkpoint yet; then (and for a store this backend has no marker of in ``checkpoint``) ``restore`` must leave
        the store empty, clearing whatever local data it holds (``store.replace_contents([], None)``): local data no
        checkpoint holds is never kept. (When it opens a task the framework empties such stores itself, without
        calling the restore manager; a restore manager does not rely on that.)"""

    @abc.abstractmethod
    def restore(self) -> None:
        """Rebuild every store to exactly the checkpoint's state, reusing local data that already is that state.
        Interruptible between steps (:meth:`interrupt`); never waits on futures it queued on the shared commit
        pool.

        What it MUST do, which the shipped suite (:class:`statebackend.testing.backend_contract.BackendContract`)
        checks:

        - **Exactly that checkpoint.** The state the marker of *this* checkpoint names (``init``'s argument), not
          the newest the backend has: a Spark replay restores an older retained checkpoint on purpose. Local data
          is reused only when its :attr:`LocalStore.version <statebackend.store.LocalStore.version>` is the one the
          marker names (or a step the marker builds on); anything else (a version of another lineage, uncommitted
          changes) is replaced.
        - **Whole or nothing per step.** Each bulk load records the version it reaches in the same LMDB transaction
          (``replace_contents``, ``apply_changes``, ``apply_change_sets``), so a crash or a failure leaves a store
          at a version of the chain or as it was.
        - **Never load what does not verify.** Every blob is checked (checksum, the lineage it names: job, task,
          store, seq) before any of it reaches LMDB.
        - **Errors.** A blob that is absent raises :class:`~statebackend.errors.NotFoundError` naming it; damaged,
          cut short or of another lineage: :class:`~statebackend.errors.CorruptDataError`; a format version this
          release cannot read: :class:`~statebackend.errors.IncompatibleFormatError`; a blob store that fails:
          :class:`~statebackend.errors.StorageError`. These four make the framework fall back to the next backend
          with a marker in the checkpoint (dual commit), so raise nothing else for them.
        - **Metrics** (into ``context.metrics``, names from :mod:`statebackend.metrics.catalogue`): per store
          restored, exactly one of ``restore.stores.reused`` (local data already was the checkpoint: nothing
          downloaded) or ``restore.stores.full`` (downloaded from the blob store; ``restore.stores.caught.up`` for
          one brought forward from an older local version instead); ``restore.bytes`` for every byte downloaded.
          The framework times the whole restore (``restore.ms``) and logs it."""

    def interrupt(self) -> None:  # noqa: B027 - an optional hook: the default does nothing
        """Ask a running (or later) ``restore()`` to stop at its next step, raising
        :class:`~statebackend.errors.RestoreInterrupted` from ``restore()``. It MUST leave nothing half-restored
        that a later restore would take as whole: every store is at a version of the checkpoint's chain (a step
        whose data and version were written in one LMDB transaction, as each step of a restore must be) or as it
        was, so the next restore continues from there or starts over. May be called from any thread, at any time
        (before ``restore()``, during it, after it), any number of times; it never waits for the restore. The
        default does nothing: ``restore()`` then runs to its end (:class:`statebackend.kit.InterruptFlag`
        implements the flag)."""

    def close(self) -> None:  # noqa: B027 - an optional hook: the default does nothing
        """Release resources."""


class StateBackendAdmin(abc.ABC):
    """Creates and validates what a backend needs on the blob store; describes and checks its markers for the
    ``statebackend`` command (``inspect``, ``verify``, ``gc``).

    The three marker methods have conservative defaults, so a backend that does not implement them still works with
    every command: ``None`` means "this backend does not say". The command then says so plainly (``inspect`` shows
    the raw marker, ``verify`` exits with its "cannot verify" code) and ``gc`` keeps every blob under the backend's
    prefix of that store, since it cannot tell which of them a checkpoint needs.
    """

    @abc.abstractmethod
    def create_resources(self) -> None:
        """Create what is missing (container, bucket, root directory)."""

    @abc.abstractmethod
    def validate_resources(self) -> None:
        """Raise :class:`~statebackend.errors.StorageError` or :class:`~statebackend.errors.ConfigError` saying
        what to fix when the container/bucket is missing, credentials fail or the endpoint is unreachable."""

    def describe_marker(self, store: str, marker: str) -> dict[str, Any] | None:
        """What ``marker`` (this backend's marker of ``store`` in one checkpoint of the context's task) holds, as a
        JSON-able dict for people and scripts: its kind, its parts (a recipe's steps, an index's runs), the blobs it
        names with their sizes (``None`` for a missing blob) and a ``bytes`` total. May read blob metadata (sizes);
        never downloads whole blobs and never writes. A marker that does not decode raises
        :class:`~statebackend.errors.CorruptDataError`. Default ``None``: this backend does not describe its markers."""
        return None

    def referenced_blobs(self, store: str, marker: str) -> set[str] | None:
        """The names of every blob ``marker`` needs to restore ``store``, from the marker alone (or the blobs it
        names, such as an index). A job-level garbage collection keeps these and may delete other blobs under
        ``blob_prefix(store)`` that no checkpoint references. A marker that does not decode raises
        :class:`~statebackend.errors.CorruptDataError`. Default ``None``: unknown, so garbage collection keeps every
        blob under this backend's prefix of the store."""
        return None

    def verify_marker(self, store: str, marker: str) -> list[str] | None:
        """Download and check every blob ``marker`` needs (presence, checksum, lineage, record count), without
        applying anything to a local store and without writing. Returns the problems found, one line each naming
        the blob and what is wrong (empty: the marker restores). Default ``None``: this backend cannot verify its
        markers."""
        return None


class StateBackendFactory(abc.ABC):
    """Entry point of a state backend; registered by short name, dotted path or entry point."""

    #: keys this backend accepts under ``<factory-name>.`` with their defaults and parsers; see config.OptionSpec
    options: Mapping[str, Any] = {}

    @abc.abstractmethod
    def backup_manager(self, context: BackendContext) -> TaskBackupManager:
        """A new backup manager for one task's stores in ``context`` (those this backend backs up), made once per
        open of the task, before :meth:`TaskBackupManager.init`. Cheap: start no work and touch no blob here."""

    @abc.abstractmethod
    def restore_manager(self, context: BackendContext) -> TaskRestoreManager:
        """A new restore manager for the stores in ``context`` (those this backend restores at this open, maybe a
        subset of the task's), used for one :meth:`TaskRestoreManager.restore` and closed. Cheap: download nothing
        here."""

    @abc.abstractmethod
    def admin(self, context: BackendContext) -> StateBackendAdmin:
        """The admin of this backend for ``context``, made by the ``statebackend`` command (``validate``,
        ``inspect``, ``verify``, ``gc``). There the context has no stores and its executor refuses work (a command
        runs no commits): an admin reads and writes the blob store on the calling thread."""
