"""The backend kit: support code every state backend needs, written once (the built-in backends use it, and a
third-party backend should too, rather than copy it).

- :mod:`statebackend.kit.gc`: the one age rule for garbage collection (``created_at`` metadata; a blob of unknown
  age counted from a collector's first sighting, and kept by a collector without memory), and mark-and-sweep over
  the blobs checkpoints reference;
- :mod:`statebackend.kit.lifetime`: the framework's collector of a backend's blobs (release after retention, the
  sweep), driven by what the backend states in its :class:`~statebackend.contracts.BlobLifetime`;
- :mod:`statebackend.kit.context`: the state a backup manager shares with the helpers it holds, the key fields of a
  log record, and one store's markers in the task's checkpoint log;
- :mod:`statebackend.kit.inflight`: the registry of staged files that running work holds, so no cleanup deletes them;
- :mod:`statebackend.kit.background`: closing a read view that is not open yet, and cancelling background work;
- :mod:`statebackend.kit.restore`: the interrupt flag of a restore, and the puts-only filter of a bulk load.

The kit imports the framework's contracts, blob stores, errors and concurrency helpers, never a backend or the task.
The rules behind it: docs/architecture.md, "The backend kit".
"""

from __future__ import annotations

from statebackend.kit.background import Cancellation, Closeable, close_when_ready
from statebackend.kit.context import ManagerState, log_extra, markers_in_log
from statebackend.kit.gc import (
    CREATED_AT,
    FirstSeen,
    GraceRule,
    Mark,
    Swept,
    created_at_metadata,
    mark_referenced,
    read_created_at,
    referenced_by_admin,
    sweep_unreferenced,
)
from statebackend.kit.inflight import IN_FLIGHT, InFlightRegistry
from statebackend.kit.lifetime import BlobCollector, LifetimeSweep, collector_of, mark_markers, sweep_shared
from statebackend.kit.restore import InterruptFlag, puts_only

__all__ = [
    "CREATED_AT",
    "IN_FLIGHT",
    "BlobCollector",
    "Cancellation",
    "Closeable",
    "FirstSeen",
    "GraceRule",
    "InFlightRegistry",
    "InterruptFlag",
    "LifetimeSweep",
    "collector_of",
    "ManagerState",
    "Mark",
    "Swept",
    "close_when_ready",
    "created_at_metadata",
    "log_extra",
    "mark_markers",
    "mark_referenced",
    "markers_in_log",
    "puts_only",
    "read_created_at",
    "referenced_by_admin",
    "sweep_shared",
    "sweep_unreferenced",
]
