"""Reading the blob-snapshot backend's blobs back, verified: a marker's index (inline in the marker, or an index blob
of older releases; intact, and bound to its marker) and a run (its size, content hash and lineage), as restore, the
backup manager, compaction and the admin all read them."""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING

from statebackend.backends.blobsnapshot.format import (
    RunEntry,
    RunIndex,
    check_index_binding,
    check_run_binding,
    content_hash,
    decode_inline_marker,
    is_inline_marker,
    new_hasher,
    run_name,
)

from statebackend.envbase import HEAD_BYTES, BlobSource, EnvBaseHeader, is_env_base, restore_env_base
from statebackend.errors import CorruptDataError, NotFoundError
from statebackend.recordfile import check_digest, content_of

if TYPE_CHECKING:
    from statebackend.blobstores.base import BlobStore

__all__ = ["read_index", "read_marker", "read_run", "verify_env_base_run"]


def read_marker(blob_store: BlobStore, marker: str, *, job: str, task: str, store: str) -> RunIndex:
    """The verified index a checkpoint's marker names, of either form: decoded from the marker itself (no request)
    when it is inline, else read from the index blob it names (:func:`read_index`). The one way every reader (restore,
    backup init, cleanup, sweep, admin) gets an index from a marker. :class:`CorruptDataError` /
    :class:`NotFoundError` name the marker."""
    if is_inline_marker(marker):
        return decode_inline_marker(marker, job=job, task=task, store=store)
    return read_index(blob_store, marker, job=job, task=task, store=store)


def read_index(blob_store: BlobStore, name: str, *, job: str, task: str, store: str) -> RunIndex:
    """Read and verify index blob ``name``: intact (checksum) and bound to its name (job, task, store, seq, token;
    see :func:`check_index_binding`). :class:`NotFoundError` / :class:`CorruptDataError` name it."""
    try:
        data = blob_store.get(name)
    except NotFoundError as exc:
        raise NotFoundError(
            f"store {store}: index blob {name} is missing from {blob_store.describe()}; the checkpoint "
            f"cannot be restored from blobsnapshot: restore an older checkpoint or from another backend's marker"
        ) from exc
    index = RunIndex.decode(data, name=name)
    check_index_binding(index, name=name, job=job, task=task, store=store)
    return index


def read_run(
    blob_store: BlobStore,
    store_prefix: str,
    entry: RunEntry,
    *,
    index: str,
    job: str,
    task: str,
    store: str,
    local: Path | None = None,
) -> bytes:
    """The verified bytes of ``entry``'s run: from ``local`` when that file holds exactly them, else downloaded.
    Size, content hash and header lineage are checked; a missing or damaged run names itself and the index."""
    name = run_name(store_prefix, entry.hash)
    data: bytes | None = None
    if local is not None:
        try:
            data = local.read_bytes()
        except OSError:
            data = None
        if data is not None and (len(data) != entry.size or content_hash(content_of(data)) != entry.hash):
            data = None
    if data is None:
        try:
            data = blob_store.get(name)
        except NotFoundError as exc:
            raise NotFoundError(
                f"run {name} that index {index} lists is missing from {blob_store.describe()}; this checkpoint cannot "
                f"be restored from blobsnapshot: restore an older checkpoint or from another backend's marker"
            ) from exc
        if len(data) != entry.size or content_hash(content_of(data)) != entry.hash:
            raise CorruptDataError(
                f"run {name} that index {index} lists failed its hash check ({len(data)} bytes, expected "
                f"{entry.size}); it was damaged in the blob store and was not loaded"
            )
    header = check_digest(data, name=name)
    check_run_binding(header, entry, name=name, index=index, job=job, task=task, store=store)
    return data


def verify_env_base_run(
    blob_store: BlobStore, store_prefix: str, entry: RunEntry, *, index: str, job: str, task: str, store: str
) -> int | None:
    """For a base run written as an environment file (``statebackend.envbase``): every byte read in ranged reads and
    checked as restore checks it (size, content hash, header lineage, frames, digest), nothing written; returns the
    key count its header records. ``None`` when the run is sorted records (:func:`read_run` reads those)."""
    name = run_name(store_prefix, entry.hash)
    source = BlobSource(blob_store, name, entry.size)
    try:
        if not entry.base or not is_env_base(source.read(0, min(entry.size, HEAD_BYTES))):
            return None
        hasher = new_hasher()

        def check(header: EnvBaseHeader) -> None:
            check_run_binding(header.lineage, entry, name=name, index=index, job=job, task=task, store=store)

        header = restore_env_base(source, None, check=check, content_hasher=hasher)
    except NotFoundError as exc:
        raise NotFoundError(f"run {name} that index {index} lists is missing from {blob_store.describe()}") from exc
    if hasher.hexdigest() != entry.hash:
        raise CorruptDataError(
            f"run {name} that index {index} lists failed its hash check; it was damaged in the blob store"
        )
    return header.records
