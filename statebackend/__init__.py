"""statebackend: durable keyed state for stream processing.

The public API, importable from here::

    from statebackend import TaskStorage, open_blob_store, StateBackendError

Spark's driver lives in :mod:`statebackend.spark` (it needs the ``spark`` extra); backends subclass the contracts of
:mod:`statebackend.contracts`. Names are loaded on first use, so ``import statebackend`` stays light.
"""

from __future__ import annotations

import importlib
from importlib import metadata
from typing import TYPE_CHECKING, Any

try:
    __version__ = metadata.version("statebackend")
except metadata.PackageNotFoundError:  # pragma: no cover - running from a source tree that was never installed
    __version__ = "0+unknown"

#: public name -> the module that defines it
_EXPORTS = {
    "TaskStorage": "statebackend.task",
    "PendingCommit": "statebackend.commit",
    "Settings": "statebackend.config",
    "load_config": "statebackend.config",
    "Metrics": "statebackend.metrics",
    "BlobStore": "statebackend.blobstores.base",
    "BlobInfo": "statebackend.blobstores.base",
    "open_blob_store": "statebackend.blobstores.base",
    "TaskBackupManager": "statebackend.contracts",
    "TaskRestoreManager": "statebackend.contracts",
    "StateBackendAdmin": "statebackend.contracts",
    "StateBackendFactory": "statebackend.contracts",
    "BackendContext": "statebackend.contracts",
    "StateBackendError": "statebackend.errors",
    "ConfigError": "statebackend.errors",
    "NotFoundError": "statebackend.errors",
    "AlreadyExistsError": "statebackend.errors",
    "StorageError": "statebackend.errors",
    "TransientStorageError": "statebackend.errors",
    "CorruptDataError": "statebackend.errors",
    "IncompatibleFormatError": "statebackend.errors",
    "InconsistentStateError": "statebackend.errors",
    "LocalDirError": "statebackend.errors",
    "SerdeError": "statebackend.errors",
    "StoreLockedError": "statebackend.errors",
    "CommitError": "statebackend.errors",
    "CommitTimeoutError": "statebackend.errors",
    "CommitConflictError": "statebackend.errors",
    "RestoreInterrupted": "statebackend.errors",
    "BackgroundWorkCancelled": "statebackend.errors",
}

__all__ = [
    "AlreadyExistsError",
    "BackendContext",
    "BackgroundWorkCancelled",
    "BlobInfo",
    "BlobStore",
    "CommitConflictError",
    "CommitError",
    "CommitTimeoutError",
    "ConfigError",
    "CorruptDataError",
    "IncompatibleFormatError",
    "InconsistentStateError",
    "LocalDirError",
    "Metrics",
    "NotFoundError",
    "PendingCommit",
    "RestoreInterrupted",
    "SerdeError",
    "Settings",
    "StateBackendAdmin",
    "StateBackendError",
    "StateBackendFactory",
    "StorageError",
    "StoreLockedError",
    "TaskBackupManager",
    "TaskRestoreManager",
    "TaskStorage",
    "TransientStorageError",
    "__version__",
    "load_config",
    "open_blob_store",
]

if TYPE_CHECKING:
    from statebackend.blobstores.base import BlobInfo, BlobStore, open_blob_store
    from statebackend.commit import PendingCommit
    from statebackend.config import Settings, load_config
    from statebackend.contracts import (
        BackendContext,
        StateBackendAdmin,
        StateBackendFactory,
        TaskBackupManager,
        TaskRestoreManager,
    )
    from statebackend.errors import (
        AlreadyExistsError,
        BackgroundWorkCancelled,
        CommitConflictError,
        CommitError,
        CommitTimeoutError,
        ConfigError,
        CorruptDataError,
        IncompatibleFormatError,
        InconsistentStateError,
        LocalDirError,
        NotFoundError,
        RestoreInterrupted,
        SerdeError,
        StateBackendError,
        StorageError,
        StoreLockedError,
        TransientStorageError,
    )
    from statebackend.metrics import Metrics
    from statebackend.task import TaskStorage


def __getattr__(name: str) -> Any:
    module = _EXPORTS.get(name)
    if module is None:
        raise AttributeError(f"module 'statebackend' has no attribute {name!r}")
    value = getattr(importlib.import_module(module), name)
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    return sorted({*globals(), *_EXPORTS})
