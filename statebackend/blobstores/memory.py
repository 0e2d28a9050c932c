"""An in-memory blob store: the fake for unit tests. It passes the same contract suite as the real stores.

``memory://name`` opens a process-wide named bucket, so two opens of one URL share blobs (as two clients of one
service would); ``MemoryBlobStore()`` is a private one.

Each write (``put``, ``set_metadata``) stamps the blob with a fresh version from a process-wide counter: its
:attr:`~statebackend.blobstores.base.BlobInfo.etag`, which :meth:`MemoryBlobStore.delete_if_unchanged` checks under
the store's lock, as :meth:`MemoryBlobStore.put_if` does (a compare-and-swap under the same lock).

It implements only the raw operations (``_put``, ``_get``, ``_list``, ...): the base's templates check names,
metadata and ranges, check its listings and translate its errors (:class:`~statebackend.blobstores.base.BlobStore`).
"""

from __future__ import annotations

import builtins
import itertools
import threading
from collections.abc import Iterator, Mapping
from typing import Any, ClassVar
from urllib.parse import urlsplit

from statebackend.blobstores.base import BlobInfo, BlobStore
from statebackend.errors import AlreadyExistsError, NotFoundError, PreconditionFailedError

__all__ = ["MemoryBlobStore"]

#: a blob: its bytes, its metadata, its version (the etag ``head`` gives)
_Blob = tuple[bytes, dict[str, str], str]
#: versions for every write of every memory store in the process (``next`` on it is atomic under the GIL)
_VERSIONS = itertools.count(1)


def _new_version() -> str:
    return f"m{next(_VERSIONS)}"


class MemoryBlobStore(BlobStore):
    """Blobs in a dict guarded by a lock. Thread-safe; not durable across processes."""

    supports_conditional_delete = True
    supports_conditional_put = True
    _named: ClassVar[dict[str, tuple[dict[str, _Blob], threading.Lock]]] = {}
    _named_lock: ClassVar[threading.Lock] = threading.Lock()

    def __init__(self, name: str | None = None) -> None:
        if name is None:
            self._blobs: dict[str, _Blob] = {}
            self._lock = threading.Lock()
            self.url = "memory://"
        else:
            with MemoryBlobStore._named_lock:
                blobs, lock = MemoryBlobStore._named.setdefault(name, ({}, threading.Lock()))
            self._blobs, self._lock = blobs, lock
            self.url = f"memory://{name}"

    @classmethod
    def from_url(cls, url: str, options: Mapping[str, Any]) -> MemoryBlobStore:
        parts = urlsplit(url)
        name = (parts.netloc + parts.path).strip("/")
        return cls(name or "default")

    # raw operations: the base's templates checked names, metadata and ranges before calling them

    def _put(self, name: str, data: bytes, *, create_only: bool, metadata: dict[str, str]) -> None:
        with self._lock:
            if create_only and name in self._blobs:
                raise AlreadyExistsError(f"blob {name!r} already exists in {self.describe()}")
            self._blobs[name] = (data, metadata, _new_version())

    def _put_if(self, name: str, data: bytes, version: str | None) -> str:
        """The version check and the write under the store's lock: one step."""
        with self._lock:
            current = self._blobs.get(name)
            if (current is None) != (version is None) or (current is not None and current[2] != version):
                found = "absent" if current is None else f"version {current[2]}"
                raise PreconditionFailedError(
                    f"blob {name!r} in {self.describe()} is {found}, not "
                    f"{'absent' if version is None else 'version ' + version}: not written"
                )
            new_version = _new_version()
            self._blobs[name] = (data, {}, new_version)
        return new_version

    def _get_versioned(self, name: str) -> tuple[bytes, str]:
        with self._lock:
            try:
                data, _, version = self._blobs[name]
            except KeyError:
                raise NotFoundError(f"blob {name!r} not found in {self.describe()}") from None
        return data, version

    def _get(self, name: str, start: int, end: int | None) -> bytes:
        with self._lock:
            try:
                data = self._blobs[name][0]
            except KeyError:
                raise NotFoundError(f"blob {name!r} not found in {self.describe()}") from None
        return data[start:end]

    def _delete(self, name: str) -> None:
        with self._lock:
            self._blobs.pop(name, None)

    def _delete_many(self, names: builtins.list[str]) -> None:
        """All deleted under one lock: one request's worth, like the services'."""
        with self._lock:
            for name in names:
                self._blobs.pop(name, None)

    def _delete_if_unchanged(self, versions: dict[str, str]) -> frozenset[str]:
        """Each deleted if its version is still the one given, all under one lock."""
        kept: set[str] = set()
        with self._lock:
            for name, version in versions.items():
                blob = self._blobs.get(name)
                if blob is None:
                    continue
                if blob[2] != version:
                    kept.add(name)
                    continue
                del self._blobs[name]
        return frozenset(kept)

    def _list(self, prefix: str) -> Iterator[str]:
        with self._lock:
            names = sorted(n for n in self._blobs if n.startswith(prefix))
        return iter(names)

    def _head(self, name: str) -> BlobInfo:
        with self._lock:
            try:
                data, metadata, version = self._blobs[name]
            except KeyError:
                raise NotFoundError(f"blob {name!r} not found in {self.describe()}") from None
        return BlobInfo(name=name, size=len(data), metadata=metadata, etag=version)

    def _set_metadata(self, name: str, metadata: dict[str, str]) -> None:
        with self._lock:
            try:
                data = self._blobs[name][0]
            except KeyError:
                raise NotFoundError(f"blob {name!r} not found in {self.describe()}") from None
            self._blobs[name] = (data, metadata, _new_version())
