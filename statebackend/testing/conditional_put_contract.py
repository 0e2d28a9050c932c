"""The conditional write part of the blob store contract suite, mixed into
:class:`~statebackend.testing.blobstore_contract.BlobStoreContract` (kept apart for its size).

A store whose :attr:`~statebackend.blobstores.base.BlobStore.supports_conditional_put` is true must make
:meth:`~statebackend.blobstores.base.BlobStore.put_if` a compare-and-swap: a create (``version=None``) only where
no blob is, an overwrite only while the blob is the version given, a new version returned, and a refusal
(:class:`~statebackend.errors.PreconditionFailedError`) that writes nothing, however many writers race.
:meth:`~statebackend.blobstores.base.BlobStore.get_versioned` gives the bytes and the version a later ``put_if``
compares. Through the resilience layer, a conditional write whose reply was lost is decided by reading the blob back:
landed is success with its version, not landed leaves the error. A store that does not claim the capability is
checked to decline honestly: asked anyway, it raises :class:`~statebackend.errors.StorageError` and writes nothing.
"""

from __future__ import annotations

import threading
from collections.abc import Iterator, Mapping

import pytest

from statebackend.blobstores.base import BlobInfo, BlobStore
from statebackend.blobstores.memory import MemoryBlobStore
from statebackend.blobstores.resilience import ResilientBlobStore
from statebackend.errors import NotFoundError, PreconditionFailedError, StorageError, TransientStorageError

__all__ = ["ConditionalPutContract", "LostReplyStore", "PerSeqMemoryBlobStore"]


class LostReplyStore(BlobStore):
    """Wraps a store; the next ``put_if`` loses its reply: ``landed=True`` writes and then raises a transient error,
    ``landed=False`` raises before writing. Everything else passes through."""

    def __init__(self, inner: BlobStore) -> None:
        self.inner = inner
        self.url = inner.url
        self.supports_conditional_put = inner.supports_conditional_put
        self.lose_next: bool | None = None  # None: answer normally; True/False: lose the reply, landed or not

    def put_if(self, name: str, data: bytes, *, version: str | None) -> str:
        landed, self.lose_next = self.lose_next, None
        if landed is False:
            raise TransientStorageError(f"lost the request of put_if {name!r} (test)")
        written = self.inner.put_if(name, data, version=version)
        if landed:
            raise TransientStorageError(f"lost the reply of put_if {name!r} (test)")
        return written

    def get_versioned(self, name: str) -> tuple[bytes, str]:
        return self.inner.get_versioned(name)

    def put(
        self, name: str, data: bytes, *, create_only: bool = False, metadata: Mapping[str, str] | None = None
    ) -> None:
        self.inner.put(name, data, create_only=create_only, metadata=metadata)

    def get(self, name: str, *, start: int | None = None, end: int | None = None) -> bytes:
        return self.inner.get(name, start=start, end=end)

    def delete(self, name: str) -> None:
        self.inner.delete(name)

    def list(self, prefix: str = "") -> Iterator[str]:
        return self.inner.list(prefix)

    def head(self, name: str) -> BlobInfo:
        return self.inner.head(name)

    def describe(self) -> str:
        return self.inner.describe()


class ConditionalPutContract:
    """Mixed into :class:`~statebackend.testing.blobstore_contract.BlobStoreContract`."""

    #: writers racing one conditional write
    conditional_put_racers: int = 8

    def _declines_put_if(self, store: BlobStore) -> bool:
        """True (and checked) when the store does not claim conditional writes: asked anyway, it refuses with a
        :class:`StorageError` and writes nothing."""
        if store.supports_conditional_put:
            return False
        with pytest.raises(StorageError):
            store.put_if("cas/declined", b"x", version=None)
        with pytest.raises(NotFoundError):
            store.get("cas/declined")
        return True

    def test_put_if_creates_only_where_no_blob_is(self, store: BlobStore) -> None:
        if self._declines_put_if(store):
            return
        version = store.put_if("cas/create", b"first", version=None)
        assert isinstance(version, str) and version
        with pytest.raises(PreconditionFailedError):
            store.put_if("cas/create", b"second", version=None)
        assert store.get_versioned("cas/create") == (b"first", version)

    def test_put_if_overwrites_only_the_version_given(self, store: BlobStore) -> None:
        if self._declines_put_if(store):
            return
        first = store.put_if("cas/swap", b"one", version=None)
        second = store.put_if("cas/swap", b"two", version=first)
        assert second != first
        assert store.get_versioned("cas/swap") == (b"two", second)
        with pytest.raises(PreconditionFailedError):
            store.put_if("cas/swap", b"stale", version=first)  # a zombie's stale version
        assert store.get_versioned("cas/swap") == (b"two", second)
        with pytest.raises(PreconditionFailedError):
            store.put_if("cas/absent", b"x", version=second)  # a version of a blob that is not there
        with pytest.raises(NotFoundError):
            store.get_versioned("cas/absent")

    def test_get_versioned_of_an_absent_blob_is_not_found(self, store: BlobStore) -> None:
        if self._declines_put_if(store):
            return
        with pytest.raises(NotFoundError):
            store.get_versioned("cas/none")

    @pytest.mark.parametrize("create", [True, False], ids=["create", "swap"])
    def test_exactly_one_of_racing_conditional_writes_wins(self, store: BlobStore, create: bool) -> None:
        if self._declines_put_if(store):
            return
        base = None if create else store.put_if("cas/race", b"base", version=None)
        barrier = threading.Barrier(self.conditional_put_racers)
        outcomes: dict[int, str | BaseException] = {}

        def race(index: int) -> None:
            barrier.wait()
            try:
                outcomes[index] = store.put_if("cas/race", f"writer {index}".encode(), version=base)
            except BaseException as exc:  # noqa: BLE001 - each outcome is checked below
                outcomes[index] = exc

        threads = [threading.Thread(target=race, args=(i,)) for i in range(self.conditional_put_racers)]
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join()
        won = [i for i, outcome in outcomes.items() if isinstance(outcome, str)]
        lost = [outcome for outcome in outcomes.values() if isinstance(outcome, BaseException)]
        assert len(won) == 1, f"winners {won}, outcomes {outcomes}"
        assert all(isinstance(exc, PreconditionFailedError) for exc in lost), lost
        assert store.get_versioned("cas/race") == (f"writer {won[0]}".encode(), outcomes[won[0]])

    @pytest.mark.parametrize("landed", [True, False], ids=["landed", "not-landed"])
    def test_a_lost_reply_is_decided_by_reading_back(self, store: BlobStore, landed: bool) -> None:
        if self._declines_put_if(store):
            return
        lossy = LostReplyStore(store)
        resilient = ResilientBlobStore(lossy, max_attempts=1, base_delay_s=0.0, max_delay_s=0.0)
        try:
            first = store.put_if("cas/lost", b"before", version=None)
            lossy.lose_next = landed
            if landed:
                version = resilient.put_if("cas/lost", b"after, nonce 1", version=first)
                assert store.get_versioned("cas/lost") == (b"after, nonce 1", version)
            else:
                with pytest.raises(TransientStorageError):
                    resilient.put_if("cas/lost", b"after, nonce 2", version=first)
                assert store.get_versioned("cas/lost") == (b"before", first)
                # the error left the precondition as it was: the same write goes through now
                assert resilient.put_if("cas/lost", b"after, nonce 2", version=first) != first
        finally:
            resilient.close()

    def test_a_retried_conditional_write_that_landed_is_ours(self, store: BlobStore) -> None:
        """The first attempt landed and lost its reply; the retry is refused (412): the read-back says ours."""
        if self._declines_put_if(store):
            return
        lossy = LostReplyStore(store)
        resilient = ResilientBlobStore(lossy, max_attempts=2, base_delay_s=0.0, max_delay_s=0.0)
        try:
            lossy.lose_next = True
            version = resilient.put_if("cas/retried", b"created, nonce 3", version=None)
            assert store.get_versioned("cas/retried") == (b"created, nonce 3", version)
            other = store.put_if("cas/retried", b"someone else", version=version)
            with pytest.raises(PreconditionFailedError):
                resilient.put_if("cas/retried", b"stale", version=version)
            assert store.get_versioned("cas/retried") == (b"someone else", other)
        finally:
            resilient.close()


class PerSeqMemoryBlobStore(MemoryBlobStore):
    """A memory store without the conditional put: a checkpoint log on it keeps the per-seq blobs and their listing
    fence, as on a third-party store that does not claim :attr:`~BlobStore.supports_conditional_put`."""

    supports_conditional_put = False
