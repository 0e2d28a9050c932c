"""The dedup backend's restore manager: the manifest, then every chunk it lists, each verified, loaded in one
transaction."""

from __future__ import annotations

import attrs
from statebackend.checkpoint import CheckpointV2

from sb_dedup.backup import read_manifest
from sb_dedup.format import Item, Manifest, chunk_name, content_id, decode_chunk, parse_manifest_name
from statebackend.contracts import BackendContext, TaskRestoreManager
from statebackend.errors import CorruptDataError, NotFoundError
from statebackend.kit import InterruptFlag

__all__ = ["DedupRestoreManager"]


@attrs.define(eq=False)
class DedupRestoreManager(TaskRestoreManager):
    """Restores each store from its manifest: local data already at the manifest's version is reused; otherwise
    every chunk is downloaded and verified (its digest, that its content is its name's, its first key and record
    count as the manifest says, keys ascending across chunks) before the whole replaces the store in one
    transaction. A missing blob is :class:`NotFoundError` naming it, a damaged or misplaced one
    :class:`CorruptDataError`."""

    context: BackendContext
    _markers: dict[str, str] = attrs.field(init=False, factory=dict)
    _interrupt: InterruptFlag = attrs.field(init=False, factory=InterruptFlag)

    def init(self, checkpoint: CheckpointV2 | None) -> None:
        markers = checkpoint.markers_for(self.context.factory_name) if checkpoint is not None else {}
        self._markers = {name: markers[name] for name in self.context.stores if name in markers}

    def restore(self) -> None:
        for name, store in self.context.stores.items():
            self._interrupt.check(name)
            marker = self._markers.get(name)
            if marker is None:
                store.replace_contents([], None)
                continue
            version = parse_manifest_name(self.context.blob_prefix(name), marker)
            if version is None:
                raise CorruptDataError(f"store {name}: dedup marker {marker!r} is not a manifest's name")
            if store.version == version:
                self.context.metrics.increment("restore.stores.reused")
                continue
            manifest = read_manifest(self.context, name, marker)
            store.replace_contents(self.load(name, manifest), version)
            self.context.metrics.increment("restore.stores.full")

    def load(self, name: str, manifest: Manifest) -> list[Item]:
        """Every record of ``manifest``'s chunks, verified."""
        prefix = self.context.blob_prefix(name)
        items: list[Item] = []
        for ref in manifest.chunks:
            self._interrupt.check(name)
            blob = chunk_name(prefix, ref.cid)
            chunk = self.read_chunk(name, blob)
            if chunk is None:
                continue
            if self.content_id(chunk) != ref.cid or len(chunk) != ref.records or not chunk or chunk[0][0] != ref.first:
                raise CorruptDataError(f"chunk {blob} is not the chunk its name and the manifest promise; not loaded")
            if items and chunk[0][0] <= items[-1][0]:
                raise CorruptDataError(f"chunk {blob}: its keys overlap the chunk before it in the manifest")
            items += chunk
        return items

    def content_id(self, items: list[Item]) -> str:
        """A chunk's content id (:func:`sb_dedup.format.content_id`)."""
        return content_id(items)

    def read_chunk(self, name: str, blob: str) -> list[Item] | None:
        """The records of chunk ``blob``, verified; :class:`NotFoundError` naming it when it is missing."""
        try:
            data = self.context.blob_store.get(blob)
        except NotFoundError as exc:
            raise NotFoundError(
                f"store {name}: chunk {blob} that the checkpoint's manifest names is missing from "
                f"{self.context.blob_store.describe()}"
            ) from exc
        self.context.metrics.increment("restore.bytes", len(data), store=name, backend=self.context.factory_name)
        return decode_chunk(data, name=blob)

    def interrupt(self) -> None:
        self._interrupt.set()
