"""Blob store wrappers that let a test hold back or fail chosen operations, under the test's control (events, not
sleeps). They wrap a real store, so everything not held or failed behaves exactly like it."""

from __future__ import annotations

import threading
from collections.abc import Callable, Iterator, Mapping

from statebackend.blobstores.base import BlobInfo, BlobStore
from statebackend.errors import TransientStorageError


class ControlledBlobStore(BlobStore):
    """Wraps ``inner``. Writes whose name matches ``hold`` wait for ``release``; writes matching ``fail`` raise
    :class:`TransientStorageError` while ``failures_left`` > 0."""

    def __init__(self, inner: BlobStore) -> None:
        self.inner = inner
        self.url = inner.url
        self.supports_metadata = inner.supports_metadata
        self.hold: Callable[[str], bool] = lambda name: False
        self.release = threading.Event()
        self.held = threading.Event()  # set when a write starts waiting
        self.fail: Callable[[str], bool] = lambda name: False
        self.failures_left = 0
        self._lock = threading.Lock()
        self.put_names: list[str] = []
        #: writes matching ``lose_reply`` land, then raise :class:`TransientStorageError` (the reply was lost) while
        #: ``replies_to_lose`` > 0
        self.lose_reply: Callable[[str], bool] = lambda name: False
        self.replies_to_lose = 0

    def _before_write(self, name: str) -> None:
        with self._lock:
            self.put_names.append(name)
            failing = self.fail(name) and self.failures_left > 0
            if failing:
                self.failures_left -= 1
        if failing:
            raise TransientStorageError(f"injected failure writing {name}")
        if self.hold(name):
            self.held.set()
            if not self.release.wait(timeout=60):
                raise TransientStorageError(f"test never released {name}")

    def _after_write(self, name: str) -> None:
        with self._lock:
            losing = self.lose_reply(name) and self.replies_to_lose > 0
            if losing:
                self.replies_to_lose -= 1
        if losing:
            raise TransientStorageError(f"injected: {name} was written but the reply was lost")

    def put(self, name: str, data: bytes, *, create_only: bool = False,
            metadata: Mapping[str, str] | None = None) -> None:
        self._before_write(name)
        self.inner.put(name, data, create_only=create_only, metadata=metadata)
        self._after_write(name)

    def put_file(self, name, path, *, create_only=False, metadata=None) -> None:  # type: ignore[no-untyped-def]
        self._before_write(name)
        self.inner.put_file(name, path, create_only=create_only, metadata=metadata)
        self._after_write(name)

    def set_metadata(self, name: str, metadata: Mapping[str, str]) -> None:
        """Metadata updates (expiry removal in cleanup) are not uploads: never held or failed here."""
        self.inner.set_metadata(name, metadata)

    def get(self, name: str, *, start: int | None = None, end: int | None = None) -> bytes:
        return self.inner.get(name, start=start, end=end)

    def delete(self, name: str) -> None:
        self.inner.delete(name)

    def list(self, prefix: str = "") -> Iterator[str]:
        return self.inner.list(prefix)

    def head(self, name: str) -> BlobInfo:
        return self.inner.head(name)
