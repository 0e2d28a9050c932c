"""What a backend's managers hold and read off their :class:`~statebackend.contracts.BackendContext` again and again,
written once: the one state a backup manager shares with the helpers it holds (:class:`ManagerState`), the key fields
of a log record, and the markers of one store in the task's checkpoint log. The built-in backends use them; a
third-party backend should too, rather than copy them."""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import TYPE_CHECKING, Generic, TypeVar

import attrs

from statebackend.kit.background import Cancellation

if TYPE_CHECKING:
    from statebackend.contracts import BackendContext

__all__ = ["ManagerState", "log_extra", "markers_in_log"]

SettingsT = TypeVar("SettingsT")
StoreT = TypeVar("StoreT")


@attrs.define(eq=False)
class ManagerState(Generic[SettingsT, StoreT]):
    """The one state a backup manager shares with the small helpers it holds (an uploader, a compactor, its blob
    lifetime), in the way of composition rather than mixins: the manager makes each helper with this object (and the
    other helpers it uses), so no ``self`` spans files and each helper says what it reads. A backend subclasses it
    for its own settings and per-store state, and adds what its helpers ask of both."""

    #: the job, task, stores, blob store, checkpoint log and metrics the factory gave the manager
    context: BackendContext
    #: the manager's options, as its factory validated them
    settings: SettingsT
    #: wall clock (seconds since the epoch) for blob ages; tests may replace it
    clock: Callable[[], float] = time.time
    #: per store of the context, its backup state (made at ``init``)
    stores: dict[str, StoreT] = attrs.field(factory=dict)
    #: the manager was closed: no background work starts
    closed: bool = False
    #: background work stops at its next check (``cancel_background``)
    cancellation: Cancellation = attrs.field(factory=Cancellation)


def log_extra(context: BackendContext, store: str | None = None, **fields: object) -> dict[str, object]:
    """The key fields of a log record about ``store`` (``extra=`` of a ``logging`` call), for structured handlers:
    ``job``, ``task``, ``store`` and any ``fields`` given."""
    return {"job": context.job_name, "task": context.task_name, "store": store, **fields}


def markers_in_log(context: BackendContext, store: str) -> set[str]:
    """The markers of this backend (``context.factory_name``) for ``store`` in every checkpoint the task's
    checkpoint log still holds, of any attempt. The log's listings never show less than the newest checkpoint the task
    knows durable, so a marker missing here is one no retained checkpoint has: a backend tells by it whether the
    checkpoint of a commit whose write was reported failed landed all the same. The log's own checkpoints are not read
    back (``cached``)."""
    from statebackend.checkpoint import CheckpointV2

    markers = set()
    for entry in context.checkpoint_log.entries(cached=True):
        if isinstance(entry.checkpoint, CheckpointV2):
            marker = entry.checkpoint.markers_for(context.factory_name).get(store)
            if marker is not None:
                markers.add(marker)
    return markers
