"""Checkpoints as releases before inline markers wrote them: the blob-snapshot marker is the name of an index blob.

:func:`as_index_blob_markers` rewrites the checkpoints in a blob store so (each index put as its blob, the checkpoint
re-encoded with its binding), so tests of the older form (a missing, damaged or foreign index blob; a history mixing
both forms) run against exactly what an older release left."""

from __future__ import annotations

import time
from collections.abc import Callable

import attrs
from statebackend.backends.blobsnapshot.blobs import read_marker
from statebackend.backends.blobsnapshot.format import index_name, is_inline_marker
from statebackend.checkpoint import CheckpointV2
from statebackend.checkpoint.serde import decode_bound_checkpoint, encode_checkpoint

from statebackend.blobstores.base import BlobStore
from statebackend.kit import created_at_metadata

FACTORY = "blobsnapshot"


def as_index_blob_markers(
    blobs: BlobStore, job: str, task: str, *, seqs: Callable[[int], bool] = lambda seq: True
) -> dict[int, dict[str, str]]:
    """Rewrite the checkpoints of ``job``/``task`` whose log seq passes ``seqs``: each inline blob-snapshot marker
    becomes an index blob (its index, encoded) and its name. Returns the new markers by checkpoint seq."""

    def to_blob(store: str, marker: str) -> str:
        if not is_inline_marker(marker):
            return marker
        index = read_marker(blobs, marker, job=job, task=task, store=store)
        blob = index_name(f"{job}/{task}/{store}/{FACTORY}/", index.seq, index.token)
        # with its age, as an older release wrote it (a sweep judges unreferenced ones by it)
        blobs.put(blob, index.encode(), metadata=created_at_metadata(time.time()) if blobs.supports_metadata else None)
        return blob

    return rewrite_markers(blobs, job, task, to_blob, seqs=seqs)


def rewrite_markers(
    blobs: BlobStore,
    job: str,
    task: str,
    change: Callable[[str, str], str],
    *,
    seqs: Callable[[int], bool] = lambda seq: True,
) -> dict[int, dict[str, str]]:
    """Replace each blob-snapshot marker of the checkpoints of ``job``/``task`` whose log seq passes ``seqs`` by
    ``change(store, marker)``, the checkpoint re-encoded with its binding (as if written so). Returns the new markers
    by checkpoint seq."""
    rewritten: dict[int, dict[str, str]] = {}
    for name in list(blobs.list(f"{job}/{task}/checkpoints/")):
        checkpoint, binding = decode_bound_checkpoint(blobs.get(name), source=name)
        if not isinstance(checkpoint, CheckpointV2) or binding is None or not seqs(binding.seq):
            continue
        markers = {
            store: change(store, marker)
            for store, marker in checkpoint.state_checkpoint_markers.get(FACTORY, {}).items()
        }
        all_markers = {**checkpoint.state_checkpoint_markers, FACTORY: markers}
        blobs.put(name, encode_checkpoint(attrs.evolve(checkpoint, state_checkpoint_markers=all_markers), binding))
        rewritten[binding.seq] = markers
    return rewritten
