"""The state backend contracts (docs/architecture.md, after Samza SEP-28).

A state backend is a :class:`StateBackendFactory` that gives, for one task, a :class:`TaskBackupManager`, a
:class:`TaskRestoreManager` and a :class:`StateBackendAdmin`. The :class:`~statebackend.commit.TaskCommitManager`
drives the backup managers; :class:`~statebackend.task.TaskStorage` drives the restore managers.

One deliberate difference from SEP-28: ``snapshot`` receives the change sets the commit's flush produced
(``{store: ChangeSet}``). Every backend of a store in a dual commit sees the same immutable change set, and a
backend that does not need it (blob-snapshot) ignores it. See docs/architecture.md.
"""

from __future__ import annotations

import abc
from collections.abc import Mapping
from concurrent.futures import Executor, Future
from typing import TYPE_CHECKING, Any

import attrs

if TYPE_CHECKING:
    from statebackend.blobstores.base import BlobStore
    from statebackend.checkpoint import CheckpointId, CheckpointLog, CheckpointV2
    from statebackend.metrics import Metrics
    from statebackend.store import ChangeSet, LocalStore

__all__ = [
    "BackendContext",
    "StateBackendAdmin",
    "StateBackendFactory",
    "StoreMarkers",
    "TaskBackupManager",
    "TaskRestoreManager",
]

#: store name -> marker (a backend's string that locates the store's state for one checkpoint)
StoreMarkers = dict[str, str]


@attrs.frozen
class BackendContext:
    """Everything a backend gets for one task. Built by the framework; backends never build it themselves."""

    #: canonical factory name, as written into checkpoints (``changelog``, ``blobsnapshot``, or a dotted path)
    factory_name: str
    job_name: str
    task_name: str
    #: the stores of this task that this backend backs up or restores, by store name
    stores: Mapping[str, LocalStore]
    blob_store: BlobStore
    #: the task's checkpoint log: its retention (``retained``) bounds what backends keep; its listings never show less
    #: than the newest checkpoint the task knows durable (its ``floor``), so in a backend's mark phase a short
    #: listing is a fault, never "nothing is referenced"
    checkpoint_log: CheckpointLog
    #: the bounded pool shared by the tasks of the process; uploads and cleanups run here
    executor: Executor
    metrics: Metrics
    #: this backend's own ``<factory>.*`` settings, already validated by the factory's ``options`` schema
    options: Mapping[str, Any] = attrs.field(factory=dict)
    #: for backup managers: which backend restored each of its stores at open (``None``: the store started empty).
    #: A backend whose own restore failed (another one's marker was used instead) must not build on its lineage.
    restored_by: Mapping[str, str | None] = attrs.field(factory=dict)
    #: for backup managers: per store, the backends whose restore of it failed at open (then another backend's marker
    #: was used). A backend that failed must not continue its lineage; one that was not tried (another came first in
    #: ``restore.factories``) may, when the store's version is the one its marker describes.
    restore_failures: Mapping[str, tuple[str, ...]] = attrs.field(factory=dict)

    def blob_prefix(self, store_name: str) -> str:
        """Where this backend keeps one store's blobs: ``<job>/<task>/<store>/<factory>/``."""
        return f"{self.job_name}/{self.task_name}/{store_name}/{self.factory_name}/"


class TaskBackupManager(abc.ABC):
    """Backs up a task's stores at every commit."""

    @abc.abstractmethod
    def init(self, checkpoint: CheckpointV2 | None) -> None:
        """Called once, after restore, with the checkpoint the stores were restored to (``None``: fresh)."""

    @abc.abstractmethod
    def snapshot(self, checkpoint_id: CheckpointId, changes: Mapping[str, ChangeSet]) -> StoreMarkers:
        """Prepare the upload of this commit. Runs on the task's thread, exclusive with processing, and MUST cost
        O(change since the last commit), never O(state). Returns preliminary markers for ``upload``.

        ``changes`` holds, per store of this manager, the immutable change set the commit's flush made: exactly the
        puts and deletes since the last commit, sorted on first use. Back up *that*, never the live store: writes
        made after this call (the task goes on while ``upload`` runs) belong to the next commit, and a checkpoint
        that holds them would restore keys that were never committed. A backend that keeps a full copy reads it
        from a :class:`~statebackend.store.ReadView` opened here (a consistent snapshot), not later."""

    @abc.abstractmethod
    def upload(self, checkpoint_id: CheckpointId, markers: StoreMarkers) -> Future[StoreMarkers]:
        """Make the snapshot durable. Runs on the commit pool, concurrent with processing. The future's markers
        are written into the checkpoint; everything they reference MUST be durable when it resolves: resolve it
        only after every put it depends on returned (a put that failed fails the future; a marker that names a
        blob not yet written makes a checkpoint that restores nothing). Never wait on another future of the same
        pool (chain callbacks instead). A failure is raised by the framework at the next commit; it must not
        poison later commits. Count ``commit.bytes.uploaded`` and ``commit.files.uploaded`` for what was sent
        (``commit.bytes.reused`` for what a marker names without sending it again)."""

    @abc.abstractmethod
    def cleanup(self, checkpoint_id: CheckpointId, markers: StoreMarkers) -> Future[None]:
        """Delete what no retained checkpoint needs any more. Idempotent; called only after ``checkpoint_id`` is
        durable.

        "Retained" is every checkpoint the task's log still holds (``context.checkpoint_log``, its retention
        ``retained``), not only the newest: any of them may be restored (a Spark replay). Keep every blob a marker
        of any of them names, and every blob an upload of this or another attempt may still name (younger than the
        grace period: :class:`statebackend.kit.GraceRule`, :func:`statebackend.kit.sweep_unreferenced`). A listing
        that shows less than the task knows durable is a fault, never "nothing is referenced"."""

    def abort(self, checkpoint_id: CheckpointId) -> None:  # noqa: B027 - an optional hook: the default does nothing
        """The sync part of commit ``checkpoint_id`` failed after this manager's ``snapshot()`` may have run (another
        backend's snapshot raised): forget what it prepared, so the next commit starts clean. Its change sets are
        closed by the framework."""

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
        """The checkpoint to restore to (``None``: no durable checkpoint yet, the stores start empty)."""

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
    def backup_manager(self, context: BackendContext) -> TaskBackupManager: ...

    @abc.abstractmethod
    def restore_manager(self, context: BackendContext) -> TaskRestoreManager: ...

    @abc.abstractmethod
    def admin(self, context: BackendContext) -> StateBackendAdmin: ...
