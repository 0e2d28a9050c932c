"""Checkpoints as releases before inline markers wrote them: the blob-snapshot marker is the name of an index blob.

:func:`as_index_blob_markers` rewrites the checkpoints in a blob store so (each index put as its blob, the checkpoint
re-encoded with its binding), so tests of the older form (a missing, damaged or foreign index blob; a history mixing
both forms) run against exactly what an older release left.

Both checkpoint log layouts: on a store without ``supports_conditional_put`` the per-seq blobs are rewritten; on one
with it (the log is one head blob, ``checkpoints/HEAD.v3.json``) the head's entries are, in a compare-and-swap of the
head: the form in which a task meets an older release's checkpoints once its log moved to the head (imported). The
move marker is left as written (it is read only when the head is missing)."""

from __future__ import annotations

import time
from collections.abc import Callable

import attrs
from statebackend.backends.blobsnapshot.blobs import read_marker
from statebackend.backends.blobsnapshot.format import index_name, is_inline_marker
from statebackend.checkpoint import CheckpointV2
from statebackend.checkpoint.log import HEAD_BLOB
from statebackend.checkpoint.serde import decode_bound_checkpoint, decode_head, encode_checkpoint, encode_head

from statebackend.blobstores.base import BlobStore
from statebackend.errors import NotFoundError
from statebackend.kit import created_at_metadata

FACTORY = "blobsnapshot"

#: ``change(store, marker)``: the marker to write instead of ``marker``
Change = Callable[[str, str], str]


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
    change: Change,
    *,
    seqs: Callable[[int], bool] = lambda seq: True,
) -> dict[int, dict[str, str]]:
    """Replace each blob-snapshot marker of the checkpoints of ``job``/``task`` whose log seq passes ``seqs`` by
    ``change(store, marker)``, the checkpoint re-encoded with its binding (as if written so): in the head where the
    log has one, else in its per-seq blobs. Returns the new markers by checkpoint seq."""
    if blobs.supports_conditional_put:
        rewritten = _rewrite_head(blobs, job, task, change, seqs)
        if rewritten is not None:
            return rewritten
    rewritten = {}
    for name in list(blobs.list(f"{job}/{task}/checkpoints/")):
        checkpoint, binding = decode_bound_checkpoint(blobs.get(name), source=name)
        if not isinstance(checkpoint, CheckpointV2) or binding is None or not seqs(binding.seq):
            continue
        changed, markers = _changed(checkpoint, change)
        blobs.put(name, encode_checkpoint(changed, binding))
        rewritten[binding.seq] = markers
    return rewritten


def _rewrite_head(
    blobs: BlobStore, job: str, task: str, change: Change, seqs: Callable[[int], bool]
) -> dict[int, dict[str, str]] | None:
    """:func:`rewrite_markers` on the head of the log (None: the log has no head), swapped on the version read."""
    name = f"{job}/{task}/checkpoints/{HEAD_BLOB}"
    try:
        data, version = blobs.get_versioned(name)
    except NotFoundError:
        return None
    head = decode_head(data, source=name, job=job, task=task)
    rewritten: dict[int, dict[str, str]] = {}
    entries = []
    for entry in head.entries:
        if isinstance(entry.checkpoint, CheckpointV2) and seqs(entry.seq):
            changed, rewritten[entry.seq] = _changed(entry.checkpoint, change)
            entry = attrs.evolve(entry, checkpoint=changed)
        entries.append(entry)
    blobs.put_if(name, encode_head(attrs.evolve(head, entries=tuple(entries))), version=version)
    return rewritten


def _changed(checkpoint: CheckpointV2, change: Change) -> tuple[CheckpointV2, dict[str, str]]:
    """``checkpoint`` with its blob-snapshot markers changed, and those markers."""
    markers = {
        store: change(store, marker) for store, marker in checkpoint.state_checkpoint_markers.get(FACTORY, {}).items()
    }
    all_markers = {**checkpoint.state_checkpoint_markers, FACTORY: markers}
    return attrs.evolve(checkpoint, state_checkpoint_markers=all_markers), markers
