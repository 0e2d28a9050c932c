"""The one error tree of statebackend.

::

    StateBackendError
    ├── ConfigError (ValueError)                 a key or value is wrong; the message names the key
    ├── NotFoundError (FileNotFoundError)        a blob, checkpoint or store is absent
    ├── AlreadyExistsError (FileExistsError)     a create-only write found the name taken
    │   └── PreconditionFailedError              a conditional write found another version (or none) than given
    ├── StorageError                             the blob store failed; says which store and how to fix it
    │   └── TransientStorageError                throttling, 5xx, resets, timeouts: worth a retry
    ├── CorruptDataError                         a blob or file failed its checksum or is cut short
    ├── IncompatibleFormatError                  a format version this release cannot read
    ├── StoreLockedError                         another process holds the local store
    ├── LocalDirError (OSError)                  state.local.dir cannot be created, written or locked; says how to fix
    ├── SerdeError (ValueError, TypeError)       a key or value its serde cannot encode (a wrong type, a Decimal in
    │                                            JSON, a lone surrogate); names the store, serde, key, value type
    ├── InvalidKeyError (ValueError)             a key the local store cannot hold (empty, over LMDB's limit), or keys
    │                                            out of order for a bulk load
    ├── ClosedError (ValueError)                 a store, read view, change set or spill run used after it was closed
    ├── UsageError (ValueError)                  an operation its contract does not allow here (the statebackend
    │                                            command's malformed arguments: exit code 2)
    │   └── KindError (AttributeError)           an operation of another kind of store (put on a list store);
    │                                            names the store, its kind and what it offers
    ├── ConfirmationError                        the Spark driver cannot read a checkpoint it must confirm
    ├── OutputSchemaError (TypeError)            a task's output does not fit the output schema (found before the
    │                                            commit: the batch's checkpoint is not made)
    ├── TaskFailedError                          a batch's task failed on a worker: the driver's summary (the error
    │                                            first, then the user's frame), the engine's error chained
    ├── InconsistentStateError                   the blob store contradicts what is known to be durable (a
    │                                            short listing, a deleted newest checkpoint): never "start empty"
    ├── RestoreInterrupted (InterruptedError)    a restore stopped at interrupt(); the store is at a step the next
    │                                            restore continues from
    ├── BackgroundWorkCancelled                  a backend's background snapshot or compaction stopped at
    │                                            cancel_background(); nothing of it was uploaded or named
    └── CommitError                              a commit failed (wraps the cause) or timed out
        ├── CommitTimeoutError (TimeoutError)
        └── CommitConflictError                  another attempt of the task committed first: this one is fenced

SDK exceptions are translated at the blob store boundary (``raise X from exc``); none reaches a caller raw. In a
translated error's chain, :class:`RedactedError` (outside the tree: it is never raised) stands in for the SDK's
exception, with its type name and scrubbed text.
Each error also inherits the matching builtin so callers can catch either.
"""

from __future__ import annotations

__all__ = [
    "AlreadyExistsError",
    "BackgroundWorkCancelled",
    "ClosedError",
    "CommitConflictError",
    "CommitError",
    "CommitTimeoutError",
    "ConfigError",
    "ConfirmationError",
    "CorruptDataError",
    "IncompatibleFormatError",
    "InconsistentStateError",
    "InvalidKeyError",
    "KindError",
    "LocalDirError",
    "NotFoundError",
    "OutputSchemaError",
    "PreconditionFailedError",
    "RedactedError",
    "RestoreInterrupted",
    "SerdeError",
    "StateBackendError",
    "StorageError",
    "StoreLockedError",
    "TaskFailedError",
    "TransientStorageError",
    "UsageError",
]


class StateBackendError(Exception):
    """Root of every error statebackend raises."""


class ConfigError(StateBackendError, ValueError):
    """A configuration key or value is wrong. The message names the key and what is allowed."""


class NotFoundError(StateBackendError, FileNotFoundError):
    """A blob, checkpoint or store does not exist."""


class AlreadyExistsError(StateBackendError, FileExistsError):
    """A create-only write found the name already taken (S3 412, Azure 409, O_EXCL on a file)."""


class PreconditionFailedError(AlreadyExistsError):
    """A conditional write (:meth:`BlobStore.put_if <statebackend.blobstores.base.BlobStore.put_if>`) found the blob
    at another version than the one given, or present where absent was required (S3 and Azure 412, or 404 for an
    ``If-Match`` on an absent blob): nothing was written. A subclass of :class:`AlreadyExistsError` because a
    create-only conditional write is one."""


class StorageError(StateBackendError, OSError):
    """The blob store failed in a way a retry will not fix (permissions, missing container, bad endpoint)."""


class TransientStorageError(StorageError):
    """The blob store failed in a way a retry may fix: throttling, 5xx, connection resets, timeouts."""


class CorruptDataError(StateBackendError):
    """A blob or local file failed its checksum, has a bad magic number, or is cut short. Never loaded."""


class IncompatibleFormatError(StateBackendError):
    """A format version (checkpoint, delta file, index blob) that this release cannot read."""


class InconsistentStateError(StateBackendError):
    """The blob store shows less than is known to be durable: a listing without the checkpoint this task restored or
    that its local ``CHECKPOINT-V2`` names, or a newest checkpoint that was deleted. Raised after retries; nothing
    is cleared or written on the strength of such an answer."""


class InvalidKeyError(StateBackendError, ValueError):
    """A key the local store cannot hold (empty, or over LMDB's key limit: hash or shorten it), or keys not strictly
    ascending where a bulk load needs them so. Nothing was changed."""


class ClosedError(StateBackendError, ValueError):
    """A store, read view, change set or spill run was used after it was closed (or its store reopened)."""


class UsageError(StateBackendError, ValueError):
    """An operation its contract does not allow here: the statebackend command's malformed arguments (exit code 2),
    a restore-only context asked to commit, changes applied over unflushed writes."""


class KindError(UsageError, AttributeError):
    """An operation of another kind of store (``put`` on a list store): names the store, its kind and what it
    offers. Also an ``AttributeError``, as a missing method always was."""


class ConfirmationError(StateBackendError):
    """The Spark driver cannot read the task checkpoints it must confirm (its access to the blob store, or the log's
    versions), as opposed to a checkpoint not being there."""


class OutputSchemaError(StateBackendError, TypeError):
    """A task's output (of the user's function or of ``on_timers``) does not fit the job's output schema: raised in
    the task before its commit, so no checkpoint holds a batch whose output cannot be written."""


class TaskFailedError(StateBackendError):
    """A task of a micro-batch failed on a worker. Raised on the driver with a summary of the worker's error (its
    last line first, then the innermost frame of the user's code) in place of the engine's long trace, which is
    chained (``__cause__``)."""


class RedactedError(Exception):
    """Stands in for an SDK or stdlib exception in a chain: its qualified type name and its scrubbed text. It keeps
    the original's traceback (code lines only are printed), never the original object. Never raised itself: it is
    only ever the ``__cause__`` of one of ours, so it is not part of the tree."""

    def __init__(self, type_name: str, message: str) -> None:
        super().__init__(f"{type_name}: {message}" if message else type_name)
        #: the qualified name of the exception it stands in for (``botocore.exceptions.ClientError``)
        self.type_name = type_name


class LocalDirError(StateBackendError, OSError):
    """The local state directory cannot be created, written or locked (permissions, a read-only or full disk)."""


class SerdeError(StateBackendError, ValueError, TypeError):
    """A key or value its store's serde cannot encode: a Python type the serde does not take (also a ``TypeError``,
    as such refusals always were), or a value of that type it cannot represent. Raised at the ``put`` (or ``get``,
    ``delete``, ...) of the offending key, before anything of the call is written. The message names the store, the
    serde, the key, the type and how to fix it; the same is in the fields (``None`` where unknown, e.g. a serde
    called outside a store): ``store``, ``serde`` (its name), ``key`` (the key's repr, cut to about 80 characters),
    ``value_type`` (the qualified name of the type that was given), ``role`` (``"key"``, ``"value"``, ``"prefix"``,
    ...: what could not be encoded) and ``reason`` (what the serde said, with the fix)."""

    def __init__(
        self,
        message: str,
        *,
        store: str | None = None,
        serde: str | None = None,
        key: str | None = None,
        value_type: str | None = None,
        role: str | None = None,
        reason: str | None = None,
    ) -> None:
        super().__init__(message)
        #: the store whose serde refused (``None``: a serde called outside a store)
        self.store = store
        #: the serde's name
        self.serde = serde
        #: the key's repr, cut to about 80 characters
        self.key = key
        #: the qualified name of the type that was given
        self.value_type = value_type
        #: what could not be encoded: ``"key"``, ``"value"``, ``"prefix"``, ...
        self.role = role
        #: what the serde said, with the fix
        self.reason = reason


class StoreLockedError(StateBackendError, BlockingIOError):
    """Another process (or another open handle in this one) holds the local store."""


class RestoreInterrupted(StateBackendError, InterruptedError):
    """A restore manager's ``restore()`` stopped because ``interrupt()`` was called. Each store is at a version of the
    checkpoint's chain (or as it was), never half a step: the next restore continues from there."""


class BackgroundWorkCancelled(StateBackendError):
    """A backup manager's background work (the changelog backend's snapshot, the blob-snapshot backend's compaction)
    stopped because ``cancel_background()`` was called (the task was handed to another opener); nothing of it was
    uploaded or named, and the task's next owner does that work again when it is due."""


class CommitError(StateBackendError):
    """A commit failed; ``__cause__`` holds what failed."""


class CommitTimeoutError(CommitError, TimeoutError):
    """A commit blocked on the previous upload for longer than ``task.commit.timeout.ms``."""


class CommitConflictError(CommitError):
    """Another attempt of the task committed past the checkpoint this attempt restored (a retried, speculative or
    zombie attempt): this attempt is fenced and wrote nothing. Reopen the task to restore the newer checkpoint."""
