"""Creating and validating what a blob store needs, shared by the backends' admins.

A store checks itself (``BlobStore.validate()``: container/bucket/directory exists, credentials work, endpoint
answers); every store is then probed with a small create-only write, a read back and a delete under the backend's
prefix, so a read-only credential or a full disk shows up before the first commit, with the store's name and what to
fix. :class:`BlobStoreBackendAdmin` is the admin of a backend whose only resource is the blob store (both of ours).
"""

from __future__ import annotations

import secrets
from typing import Protocol

import attrs

from statebackend.blobstores.base import BlobStore
from statebackend.errors import StateBackendError, StorageError

__all__ = ["BlobStoreBackendAdmin", "create_blob_store_resources", "validate_blob_store"]


def create_blob_store_resources(blob_store: BlobStore) -> None:
    """Create the container, bucket or directory the store needs (nothing for a store that needs none)."""
    blob_store.create_resources()


def validate_blob_store(blob_store: BlobStore, *, probe_prefix: str) -> None:
    blob_store.validate()
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


class TaskBlobStore(Protocol):
    """What the admin reads of a ``statebackend.contracts.BackendContext`` (named structurally: the contracts
    import the blob stores, not the other way round)."""

    @property
    def blob_store(self) -> BlobStore: ...

    @property
    def job_name(self) -> str: ...

    @property
    def task_name(self) -> str: ...


@attrs.define
class BlobStoreBackendAdmin:
    """The admin of a backend whose only resource is the blob store: it must exist and accept create-only writes,
    reads and deletes under the task's prefix. A backend's admin is this and ``StateBackendAdmin``::

        @attrs.define
        class ChangelogAdmin(BlobStoreBackendAdmin, StateBackendAdmin):
            context: BackendContext
    """

    context: TaskBlobStore

    def create_resources(self) -> None:
        create_blob_store_resources(self.context.blob_store)

    def validate_resources(self) -> None:
        validate_blob_store(self.context.blob_store, probe_prefix=f"{self.context.job_name}/{self.context.task_name}/")
