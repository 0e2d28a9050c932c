"""Broken variants of the dedup backend, each one mistake an author of a content-addressed backend makes: the
backend contract suite (run with this backend's settings, :class:`sb_dedup.suite.DedupSuite`) must fail every one
of them (tests/test_mutants.py; docs/contract-suites.md has the kill table). Each is named by its dotted path, e.g.
``stores.counts.backup.factories=sb_dedup.mutants:SkipsAMissingChunk``. Never use one for real data.
"""

from __future__ import annotations

import bisect
import hashlib
import logging
import threading
from collections.abc import Iterable

from sb_dedup.backup import DedupBackupManager
from sb_dedup.factory import DedupStateBackendFactory
from sb_dedup.format import ChunkRef, Item
from sb_dedup.restore import DedupRestoreManager
from statebackend.errors import NotFoundError
from statebackend.store import ReadView

__all__ = ["NamesChunksByTheirKeys", "RechunksOnlyTheFirstRange", "ResolvesBeforeItsChunksLand", "SkipsAMissingChunk"]

log = logging.getLogger(__name__)


class _ResolvesBeforeItsChunksLand(DedupBackupManager):
    def put(self, store: str, name: str, data: bytes, *, create_only: bool = False) -> None:
        if "/chunks/" not in name:
            super().put(store, name, data, create_only=create_only)
            return
        # "chunks are immutable and named by their content: write them in parallel, the manifest is what counts"
        writer = threading.Thread(target=self._put_quietly, args=(store, name, data), daemon=True)
        writer.start()

    def _put_quietly(self, store: str, name: str, data: bytes) -> None:
        try:
            super().put(store, name, data)
        except Exception as exc:
            log.warning("chunk %s: write failed (%s); the next commit writes it again", name, exc)


class ResolvesBeforeItsChunksLand(DedupStateBackendFactory):
    """Writes its chunks on threads of their own and awaits only the manifest's write: a chunk write that fails
    while the manifest's lands leaves a durable checkpoint naming a chunk that never landed."""

    backup_class = _ResolvesBeforeItsChunksLand


class _SkipsAMissingChunk(DedupRestoreManager):
    def read_chunk(self, name: str, blob: str) -> list[Item] | None:
        try:
            return super().read_chunk(name, blob)
        except NotFoundError:  # "a chunk is gone: its records were deleted since, most likely"
            log.warning("store %s: chunk %s is missing; skipped", name, blob)
            return None


class SkipsAMissingChunk(DedupStateBackendFactory):
    """Skips a chunk that is missing under an intact manifest (taking it for records deleted since) instead of
    failing the restore: its records are lost without an error."""

    restore_class = _SkipsAMissingChunk


def _keys_id(items: Iterable[Item]) -> str:
    return hashlib.sha256(b"\0".join(key for key, _ in items)).hexdigest()


class _KeysBackup(DedupBackupManager):
    def content_id(self, items: list[Item]) -> str:
        return _keys_id(items)  # "the chunk's identity is the key range it holds"


class _KeysRestore(DedupRestoreManager):
    def content_id(self, items: list[Item]) -> str:
        return _keys_id(items)


class NamesChunksByTheirKeys(DedupStateBackendFactory):
    """Computes a chunk's content id from its keys only: a chunk whose values changed under the same keys gets the
    name of the one its last manifest already names, so it is never written again and the old values come back."""

    backup_class = _KeysBackup
    restore_class = _KeysRestore


class _RechunksOnlyTheFirstRange(DedupBackupManager):
    def rechunk(
        self, view: ReadView, change: Iterable[tuple[bytes, bytes | None]], old: list[ChunkRef] | None
    ) -> tuple[list[ChunkRef], dict[str, list[Item]]]:
        if not old:
            return super().rechunk(view, change, old)
        firsts = [ref.first for ref in old]
        touched = {max(0, bisect.bisect_right(firsts, key) - 1) for key, _ in change}
        if not touched:
            return list(old), {}
        # "a commit touches one neighbourhood of keys": cut again the chunk of its first changed key and those
        # after it up to the next chunk no change falls in; one range only
        first = end = min(touched)
        while end + 1 in touched:
            end += 1
        fresh: dict[str, list[Item]] = {}
        low = None if first == 0 else old[first].first
        high = old[end + 1].first if end + 1 < len(old) else None
        return [*old[:first], *self.cut(view, low, high, fresh), *old[end + 1 :]], fresh


class RechunksOnlyTheFirstRange(DedupStateBackendFactory):
    """Cuts again only the first run of chunks a commit touched: a commit whose changes fall in two chunks apart
    leaves the second one's old content in the manifest. With one chunk per store (the default chunk size and the
    suite's few hundred keys) nothing shows; the suite's small chunks do."""

    backup_class = _RechunksOnlyTheFirstRange
