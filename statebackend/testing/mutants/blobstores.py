"""Broken blob stores: each a small change to the in-memory store (:class:`MemoryBlobStore`), made the way a
blob store author gets it wrong (most after a real service's pitfall: pages, ranges, conditional writes). The blob
store contract suite must fail every one of them (tests/test_mutants.py; docs/contract-suites.md).

The last four are written the way an outsider writes a store on another substrate, on the base's raw operations
(``_list``, ``_get``, ``_delete_many``): a listing by SQL ``LIKE`` or by a glob, a batch delete that stops at the
first absent name, a read cache that an overwrite does not invalidate."""

from __future__ import annotations

import fnmatch
import os
import re
import threading
from collections.abc import Iterator, Mapping

from statebackend.blobstores.base import check_blob_name, check_metadata
from statebackend.blobstores.memory import MemoryBlobStore
from statebackend.errors import AlreadyExistsError, NotFoundError

__all__ = [
    "AbsentReadsAsEmpty",
    "ConditionalDeleteChecksThenDeletes",
    "ConditionalDeleteIgnoresTheVersion",
    "CreateOnlyIsNotAtomic",
    "CreateOnlyOverwrites",
    "DeleteManyDeletesTheFirst",
    "DeleteRemovesSiblings",
    "DeleteManyStopsAtTheFirstAbsent",
    "DropsLargePuts",
    "IgnoresRanges",
    "ListsByGlob",
    "ListsByLike",
    "ListsOnePage",
    "ListsUnsorted",
    "LosesFileMetadata",
    "PutFileKeepsTheVersion",
    "ReadCacheMissesOverwrites",
    "TruncatesLargeReads",
    "VersionRestartsAfterDelete",
]

#: the page size of :class:`ListsOnePage` (S3's)
PAGE = 1000
#: :class:`TruncatesLargeReads` returns at most this much of a whole-blob read (one "chunk")
CHUNK = 4 * 1024 * 1024


class CreateOnlyOverwrites(MemoryBlobStore):
    """A create-only write on a taken name overwrites it (the conditional header was never sent)."""

    def put(
        self, name: str, data: bytes, *, create_only: bool = False, metadata: Mapping[str, str] | None = None
    ) -> None:
        super().put(name, data, metadata=metadata)


class CreateOnlyIsNotAtomic(MemoryBlobStore):
    """Create-only checks, then writes, without holding anything in between: racing writers both win."""

    def put(
        self, name: str, data: bytes, *, create_only: bool = False, metadata: Mapping[str, str] | None = None
    ) -> None:
        if create_only:
            if self.exists(name):
                raise AlreadyExistsError(f"blob {name!r} already exists in {self.describe()}")
            threading.Event().wait(0.005)  # the window a round trip opens between the check and the write
        super().put(name, data, metadata=metadata)


class ListsOnePage(MemoryBlobStore):
    """A listing returns the first page only (the continuation token is ignored): a short listing."""

    def list(self, prefix: str = "") -> Iterator[str]:
        return iter(list(super().list(prefix))[:PAGE])


class ListsUnsorted(MemoryBlobStore):
    """A listing comes in the order the names were written, not sorted."""

    def list(self, prefix: str = "") -> Iterator[str]:
        with self._lock:
            return iter([name for name in self._blobs if name.startswith(prefix)])


class TruncatesLargeReads(MemoryBlobStore):
    """A whole-blob read returns only its first chunk (the rest of a multi-part download is dropped)."""

    def get(self, name: str, *, start: int | None = None, end: int | None = None) -> bytes:
        data = super().get(name, start=start, end=end)
        return data[:CHUNK] if start is None and end is None else data


class DropsLargePuts(MemoryBlobStore):
    """A put larger than a chunk fails (its multi-part upload is never completed) and is reported as done."""

    def put(
        self, name: str, data: bytes, *, create_only: bool = False, metadata: Mapping[str, str] | None = None
    ) -> None:
        if len(data) > CHUNK:
            check_blob_name(name)
            return
        super().put(name, data, create_only=create_only, metadata=metadata)


class IgnoresRanges(MemoryBlobStore):
    """A ranged read returns the whole blob (the Range header was dropped)."""

    def get(self, name: str, *, start: int | None = None, end: int | None = None) -> bytes:
        super().get(name, start=start, end=end)  # the same checks and errors
        return super().get(name)


class LosesFileMetadata(MemoryBlobStore):
    """An upload from a file drops its metadata (the file path forgot to pass it on)."""

    def put_file(
        self,
        name: str,
        path: str | os.PathLike[str],
        *,
        create_only: bool = False,
        metadata: Mapping[str, str] | None = None,
    ) -> None:
        check_metadata(metadata)
        super().put_file(name, path, create_only=create_only)


class DeleteRemovesSiblings(MemoryBlobStore):
    """A delete removes every name that starts with the name (a prefix delete)."""

    def delete(self, name: str) -> None:
        check_blob_name(name)
        with self._lock:
            for other in [other for other in self._blobs if other.startswith(name)]:
                del self._blobs[other]


class DeleteManyDeletesTheFirst(MemoryBlobStore):
    """A batch delete deletes the batch's first name and reports the whole batch done (a batch reply read as all
    deleted, though it accounted for one name)."""

    def delete_many(self, names: list[str]) -> None:
        for name in names[:1]:
            self.delete(name)


class AbsentReadsAsEmpty(MemoryBlobStore):
    """A read of an absent blob returns no bytes instead of :class:`NotFoundError` (a 404 body taken for data)."""

    def get(self, name: str, *, start: int | None = None, end: int | None = None) -> bytes:
        try:
            return super().get(name, start=start, end=end)
        except NotFoundError:
            return b""


class ConditionalDeleteIgnoresTheVersion(MemoryBlobStore):
    """A conditional delete deletes whatever version is there and reports nothing kept (the If-Match header was
    never sent): a blob written again since its ``head`` is lost."""

    def delete_if_unchanged(self, versions: Mapping[str, str]) -> frozenset[str]:
        self.delete_many(list(versions))
        return frozenset()


class ConditionalDeleteChecksThenDeletes(MemoryBlobStore):
    """A conditional delete compares the version, then deletes in a second request (a HEAD, then an unconditional
    DELETE): a rewrite landing between the two is lost."""

    def delete_if_unchanged(self, versions: Mapping[str, str]) -> frozenset[str]:
        for name in versions:
            check_blob_name(name)
        kept = set()
        for name, version in versions.items():
            with self._lock:
                blob = self._blobs.get(name)
            if blob is not None and blob[2] != version:
                kept.add(name)
            elif blob is not None:
                threading.Event().wait(0.005)  # the round trip between the check and the delete
                self.delete(name)
        return frozenset(kept)


class VersionRestartsAfterDelete(MemoryBlobStore):
    """A blob's version counts the writes of its name since the name was created, so a name deleted and written
    again repeats an old version (as a file's inode handed out again would): a conditional delete takes the rewrite."""

    def __init__(self, name: str | None = None) -> None:
        super().__init__(name)
        self._writes: dict[str, int] = {}

    def put(
        self, name: str, data: bytes, *, create_only: bool = False, metadata: Mapping[str, str] | None = None
    ) -> None:
        super().put(name, data, create_only=create_only, metadata=metadata)
        with self._lock:
            self._writes[name] = self._writes.get(name, 0) + 1
            payload, checked, _ = self._blobs[name]
            self._blobs[name] = (payload, checked, f"w{self._writes[name]}")

    def delete(self, name: str) -> None:
        super().delete(name)
        with self._lock:
            self._writes.pop(name, None)

    def delete_many(self, names: list[str]) -> None:
        for name in names:
            self.delete(name)

    def delete_if_unchanged(self, versions: Mapping[str, str]) -> frozenset[str]:
        kept = super().delete_if_unchanged(versions)
        with self._lock:
            for name in versions.keys() - kept:
                self._writes.pop(name, None)
        return kept


class PutFileKeepsTheVersion(MemoryBlobStore):
    """An upload from a file of the bytes already there keeps the blob's version (an upload path, such as one in
    parts, that never gets a new one): a sweep deletes a run a writer refreshed with ``put_file``."""

    def put_file(
        self,
        name: str,
        path: str | os.PathLike[str],
        *,
        create_only: bool = False,
        metadata: Mapping[str, str] | None = None,
    ) -> None:
        with self._lock:
            before = self._blobs.get(name)
        super().put_file(name, path, create_only=create_only, metadata=metadata)
        with self._lock:
            payload, checked, version = self._blobs[name]
            if before is not None and before[0] == payload:
                version = before[2]
            self._blobs[name] = (payload, checked, version)


class ListsByLike(MemoryBlobStore):
    """A listing by SQL ``name LIKE prefix || '%'`` without escaping the prefix (an SQL-backed store's first try):
    ``%`` and ``_`` in a prefix are wildcards, so ``list("a_")`` also lists ``ab``."""

    def _list(self, prefix: str) -> Iterator[str]:
        pattern = "".join(".*" if c == "%" else "." if c == "_" else re.escape(c) for c in prefix + "%")
        like = re.compile(pattern, re.DOTALL)
        with self._lock:
            return iter(sorted(name for name in self._blobs if like.fullmatch(name)))


class ListsByGlob(MemoryBlobStore):
    """A listing by a glob, ``prefix + "*"`` (a store on a filesystem or SQLite's ``GLOB``): ``*``, ``?`` and ``[``
    in a prefix are wildcards."""

    def _list(self, prefix: str) -> Iterator[str]:
        with self._lock:
            return iter(sorted(name for name in self._blobs if fnmatch.fnmatchcase(name, prefix + "*")))


class DeleteManyStopsAtTheFirstAbsent(MemoryBlobStore):
    """A batch delete stops at the first absent name and reports success (a loop that breaks on "not found"): the
    present names after it are never deleted."""

    def _delete_many(self, names: list[str]) -> None:
        with self._lock:
            for name in names:
                if self._blobs.pop(name, None) is None:
                    return


class ReadCacheMissesOverwrites(MemoryBlobStore):
    """Whole-blob reads are cached by name; a delete drops the cached blob, an overwrite does not (the cache was
    thought of as "blobs are immutable"): a read after an overwrite returns the old bytes."""

    def __init__(self, name: str | None = None) -> None:
        super().__init__(name)
        self._cache: dict[str, bytes] = {}

    def _get(self, name: str, start: int, end: int | None) -> bytes:
        if name not in self._cache:
            self._cache[name] = super()._get(name, 0, None)
        return self._cache[name][start:end]

    def _delete(self, name: str) -> None:
        self._cache.pop(name, None)
        super()._delete(name)

    def _delete_many(self, names: list[str]) -> None:
        for name in names:
            self._cache.pop(name, None)
        super()._delete_many(names)
