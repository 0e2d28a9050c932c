"""Local files that uploads and background work are writing or sending, so that no cleanup deletes them.

A backend stages what it uploads in the store dir (a delta, a run, a snapshot), and removes what a crashed process
or an abandoned chain left there: at open (every file of its staging dir) and after a durable commit (files no future
commit uploads). Both can meet a file that is still in use in this very process: an upload of an earlier open of the
same store whose ``close()`` timed out while the upload ran, or a background snapshot still uploading on a slow
network while later commits become durable. Deleting it fails that work, every time on a slow enough network.

So work that writes or sends staged files holds them in the process-wide registry (:data:`IN_FLIGHT`) for as long as
it runs, and cleanups remove files only through it. Hold the paths **before** the files exist: a file a cleanup
lists is then either held or abandoned, never in between.
"""

from __future__ import annotations

import shutil
import threading
from collections import Counter
from collections.abc import Iterable, Iterator
from contextlib import contextmanager
from pathlib import Path

__all__ = ["IN_FLIGHT", "InFlightRegistry"]


class InFlightRegistry:
    """Paths (files, or dirs and everything under them) held by running work, with a use count: the same path may be
    held by two pieces of work at once, and stays held until both let go. Paths are compared as spelled: hold and
    remove with the same spelling (both from the store dir's path). Thread-safe."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._held: Counter[str] = Counter()

    @contextmanager
    def hold(self, paths: Iterable[Path]) -> Iterator[None]:
        """Hold ``paths`` (files or dirs) while the ``with`` block runs."""
        keys = [str(path) for path in paths]
        with self._lock:
            self._held.update(keys)
        try:
            yield
        finally:
            with self._lock:
                self._held.subtract(keys)
                for key in keys:
                    if self._held[key] <= 0:
                        del self._held[key]

    def is_held(self, path: Path) -> bool:
        """Whether ``path`` or a dir above it is held."""
        with self._lock:
            return self._held_locked(path)

    def remove_unless_held(self, path: Path) -> bool:
        """Remove ``path`` (a file, or a dir with everything in it; absent is fine) unless it or a dir above it is
        held; whether it was removed. The check and the removal happen under one lock, so no work can take hold of
        it in between."""
        with self._lock:
            if self._held_locked(path):
                return False
            if path.is_dir() and not path.is_symlink():
                shutil.rmtree(path, ignore_errors=True)
            else:
                path.unlink(missing_ok=True)
            return True

    def _held_locked(self, path: Path) -> bool:
        return any(self._held[str(p)] > 0 for p in (path, *path.parents))


#: the registry of this process, shared by every backend (its keys are absolute paths in the stores' dirs)
IN_FLIGHT = InFlightRegistry()
