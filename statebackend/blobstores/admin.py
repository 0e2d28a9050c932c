"""Creating and validating what a blob store needs, shared by the backends' admins.

A store that knows how to check itself (``validate()``: container/bucket exists, credentials work, endpoint
answers) is asked to; every store is then probed with a small create-only write, a read back and a delete under
the backend's prefix, so a read-only credential or a full disk shows up before the first commit, with the store's
name and what to fix.
"""

from __future__ import annotations

import secrets

from statebackend.blobstores.base import BlobStore
from statebackend.errors import StateBackendError, StorageError

__all__ = ["create_blob_store_resources", "validate_blob_store"]


def create_blob_store_resources(blob_store: BlobStore) -> None:
    create = getattr(blob_store, "create_resources", None)
    if callable(create):
        create()


def validate_blob_store(blob_store: BlobStore, *, probe_prefix: str) -> None:
    validate = getattr(blob_store, "validate", None)
    if callable(validate):
        validate()
    name = f"{probe_prefix}.validate-{secrets.token_hex(8)}"
    payload = b"statebackend validate_resources probe"
    try:
        blob_store.put(name, payload, create_only=True)
        if blob_store.get(name) != payload:
            raise StorageError(f"{blob_store.describe()}: a probe blob read back different bytes than were written")
        blob_store.delete(name)
    except StateBackendError as exc:
        raise StorageError(
            f"{blob_store.describe()} failed a write/read/delete probe under {probe_prefix!r}: {exc}. Check that the "
            f"location exists and the credentials may write, read and delete there (create_resources() creates a "
            f"missing container, bucket or directory)"
        ) from exc
