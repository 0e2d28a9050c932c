"""The ``mem2://`` blob store: blobs in this process's memory, in named buckets bounded by ``blob.store.max.bytes``.

What makes it a statebackend blob store (statebackend's docs/blobstores.md, "Writing a blob store"):

- it subclasses :class:`~statebackend.blobstores.base.BlobStore` and implements the five abstract operations with the
  contract's meaning: ``put`` replaces atomically and, with ``create_only``, refuses a taken name with
  :class:`AlreadyExistsError` writing nothing; ``get`` and ``head`` of an absent name raise :class:`NotFoundError`;
  ``delete`` is idempotent; ``list`` yields the names under a prefix, sorted. Every operation is thread-safe (the
  commit pool calls one store from many threads);
- it checks every name (``check_blob_name``) and every metadata mapping (``check_metadata``) before anything is
  written, so no name escapes the bucket and metadata stays portable;
- it declares its options once, in :attr:`Mem2BlobStore.options` (specs without the ``blob.store.`` prefix): when a
  job's ``blob.store.url`` is ``mem2://...``, statebackend validates the job's ``blob.store.*`` keys against them and
  hands them to :meth:`Mem2BlobStore.from_url` parsed, defaults filled;
- :meth:`Mem2BlobStore.from_url` opens it from the URL; the entry point ``mem2`` in group ``statebackend.blobstores``
  (pyproject.toml) maps the scheme to this class.

Not durable: the blobs go with the process. An example to copy, and a fake for tests.
"""

from __future__ import annotations

import threading
from collections.abc import Iterator, Mapping
from typing import Any, ClassVar
from urllib.parse import urlsplit

import attrs

from statebackend.blobstores.base import BlobInfo, BlobStore, check_blob_name, check_metadata
from statebackend.config import OptionSpec, default_of, parse_bytes
from statebackend.errors import AlreadyExistsError, ConfigError, NotFoundError, StorageError

__all__ = ["Mem2BlobStore"]


class Mem2BlobStore(BlobStore):
    """One bucket of blobs in memory; ``mem2://<name>`` opens the process-wide bucket ``<name>``."""

    #: the ``blob.store.*`` keys this store takes, declared once (statebackend parses them, then ``from_url`` gets
    #: their values)
    options: ClassVar[Mapping[str, OptionSpec]] = {
        "max.bytes": OptionSpec(
            parse_bytes(min=1), "1GiB", "the most bytes a mem2:// bucket holds; a write beyond it fails"
        ),
    }

    _buckets: ClassVar[dict[str, _Bucket]] = {}
    _buckets_lock: ClassVar[threading.Lock] = threading.Lock()

    def __init__(self, bucket: str, *, max_bytes: int | None = None) -> None:
        with Mem2BlobStore._buckets_lock:
            self._bucket = Mem2BlobStore._buckets.setdefault(bucket, _Bucket())
        self.max_bytes: int = default_of(self.options, "max.bytes") if max_bytes is None else max_bytes
        self.url = f"mem2://{bucket}"

    @classmethod
    def from_url(cls, url: str, options: Mapping[str, Any]) -> Mem2BlobStore:
        """Open ``mem2://<bucket>``; ``options`` are the parsed ``blob.store.*`` options of :attr:`options`."""
        parts = urlsplit(url)
        bucket = (parts.netloc + parts.path).strip("/")
        if not bucket:
            raise ConfigError(f"blob.store.url {url!r} names no bucket: write mem2://<name>")
        return cls(bucket, max_bytes=options["max.bytes"])

    def put(
        self, name: str, data: bytes, *, create_only: bool = False, metadata: Mapping[str, str] | None = None
    ) -> None:
        check_blob_name(name)
        checked = check_metadata(metadata)
        payload = bytes(data)
        bucket = self._bucket
        with bucket.lock:
            old = bucket.blobs.get(name)
            if create_only and old is not None:
                raise AlreadyExistsError(f"blob {name!r} already exists in {self.describe()}")
            size = bucket.size - (len(old[0]) if old is not None else 0) + len(payload)
            if size > self.max_bytes:
                raise StorageError(
                    f"{self.describe()}: writing {name!r} ({len(payload)} bytes) would make the bucket hold {size} "
                    f"bytes, over blob.store.max.bytes={self.max_bytes}; raise it or delete blobs"
                )
            bucket.blobs[name] = (payload, checked)  # one assignment: a reader sees the old blob or the new one
            bucket.size = size

    def get(self, name: str, *, start: int | None = None, end: int | None = None) -> bytes:
        check_blob_name(name)
        if (start is not None and start < 0) or (end is not None and end < 0):
            raise ConfigError(f"byte range [{start}, {end}) must not be negative")
        with self._bucket.lock:
            entry = self._bucket.blobs.get(name)
        if entry is None:
            raise NotFoundError(f"blob {name!r} not found in {self.describe()}")
        return entry[0][start or 0 : end]

    def delete(self, name: str) -> None:
        check_blob_name(name)
        bucket = self._bucket
        with bucket.lock:
            entry = bucket.blobs.pop(name, None)
            if entry is not None:
                bucket.size -= len(entry[0])

    def list(self, prefix: str = "") -> Iterator[str]:
        with self._bucket.lock:
            names = sorted(name for name in self._bucket.blobs if name.startswith(prefix))
        yield from names

    def head(self, name: str) -> BlobInfo:
        check_blob_name(name)
        with self._bucket.lock:
            entry = self._bucket.blobs.get(name)
        if entry is None:
            raise NotFoundError(f"blob {name!r} not found in {self.describe()}")
        return BlobInfo(name=name, size=len(entry[0]), metadata=entry[1])


@attrs.define(eq=False)
class _Bucket:
    """The blobs of one bucket (name -> (bytes, metadata)), their total size and the lock guarding both."""

    blobs: dict[str, tuple[bytes, dict[str, str]]] = attrs.field(factory=dict)
    size: int = 0
    lock: threading.Lock = attrs.field(factory=threading.Lock)
