"""The in-memory blob store passes the blob store contract, checked against its dict, also over the long run of
the stateful test (the ``statebackend-long`` Hypothesis profile), which CI runs here."""

from __future__ import annotations

from collections.abc import Iterator

import pytest
from hypothesis import settings

from statebackend.blobstores.base import BlobStore
from statebackend.blobstores.memory import MemoryBlobStore
from statebackend.testing.blobstore_contract import LONG_RUN_PROFILE, BlobStoreContract


class TestMemoryBlobStore(BlobStoreContract):
    @pytest.fixture
    def store(self) -> Iterator[BlobStore]:
        with MemoryBlobStore() as store:
            yield store

    def raw_get(self, store: BlobStore, name: str) -> bytes | None:
        assert isinstance(store, MemoryBlobStore)
        entry = store._blobs.get(name)
        return None if entry is None else entry[0]


@pytest.mark.slow
@pytest.mark.timeout(600)
def test_the_memory_store_behaves_like_a_dict_over_the_long_run() -> None:
    """The stateful test under the long-run profile (300 examples of 60 steps; about half a minute here): what only
    a long run finds, such as a read cache an overwrite does not invalidate, is looked for in every full test run."""
    contract = TestMemoryBlobStore()
    with MemoryBlobStore() as store:
        contract.run_state_machine(store, long_run=True)
    profile = settings.get_profile(LONG_RUN_PROFILE)
    assert (profile.max_examples, profile.stateful_step_count) == (300, 60)


def test_two_opens_of_one_named_store_share_blobs() -> None:
    first = MemoryBlobStore("shared-for-test")
    second = MemoryBlobStore("shared-for-test")
    first.put("blob", b"x")
    assert second.get("blob") == b"x"
    assert list(MemoryBlobStore().list()) == []
    first.delete("blob")
