"""What a backend's managers read off their :class:`~statebackend.contracts.BackendContext` again and again, written
once: the key fields of a log record, and the markers of one store in the task's checkpoint log. The built-in
backends use them; a third-party backend should too, rather than copy them."""

from __future__ import annotations

from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from statebackend.contracts import BackendContext

__all__ = ["log_extra", "markers_in_log"]


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
