"""What a restore manager needs beside its own format.

- :class:`InterruptFlag`: the flag behind :meth:`~statebackend.contracts.TaskRestoreManager.interrupt`; ``restore()``
  checks it before each step it cannot take back (a download it is about to apply, an LMDB transaction) and stops
  with :class:`~statebackend.errors.RestoreInterrupted`.
- :func:`puts_only`: the first file a restore applies onto the empty store (a chain that began on the empty store has
  no snapshot: its first delta or run stands in for one) is bulk-loaded in append mode, which takes puts only; its
  deletes are no-ops on an empty store and are dropped.
"""

from __future__ import annotations

import threading
from collections.abc import Iterable, Iterator

from statebackend.errors import RestoreInterrupted

__all__ = ["InterruptFlag", "puts_only"]


class InterruptFlag:
    """Set once by ``interrupt()`` (any thread), checked by ``restore()`` between its steps. Thread-safe."""

    def __init__(self) -> None:
        self._event = threading.Event()

    def set(self) -> None:
        """Raise the flag (what a restore manager's ``interrupt()`` does): from any thread, at any time, any number
        of times; never waits for the restore. A restore that has not started stops at its first :meth:`check`."""
        self._event.set()

    @property
    def is_set(self) -> bool:
        """Whether :meth:`set` was called (the flag is never lowered: a restore manager restores once)."""
        return self._event.is_set()

    def check(self, store: str, *, before: str | None = None) -> None:
        """Raise :class:`~statebackend.errors.RestoreInterrupted` naming ``store`` (and the step it did not take,
        ``before``) once set. Call it only where the store is at a step a later restore continues from."""
        if self._event.is_set():
            where = f" before {before}" if before is not None else ""
            raise RestoreInterrupted(
                f"restore of store {store} interrupted{where}; the next restore continues from here"
            )


def puts_only(records: Iterable[tuple[bytes, bytes | None]]) -> Iterator[tuple[bytes, bytes]]:
    """``records`` without their deletes (``value is None``), for a bulk load onto the empty store."""
    for key, value in records:
        if value is not None:
            yield key, value
