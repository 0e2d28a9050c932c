"""The one blob store contract suite (zarr-python's ``StoreTests`` pattern).

Every implementation subclasses :class:`BlobStoreContract` in its own test module and provides:

- a ``store`` fixture giving an empty store (function scope; override it with your own fixtures, e.g. a server
  started once per session and a fresh container, bucket or prefix per test);
- optionally :meth:`BlobStoreContract.raw_get`, which reads a blob *bypassing the store under test* (the file on
  disk, the dict, a plain SDK client), so the store is checked against the storage and not only against itself.

Only the public :class:`BlobStore` API and ``raw_get`` are used here; nothing assumes a local filesystem. Metadata keys
are lowercase identifiers and values short ASCII, which every service (S3, Azure) keeps as given. Class attributes
let slow services shrink the sizes and example counts.

This module holds the suite's class, its settings and most of its tests; its names and listings tests are in
:mod:`~statebackend.testing.blobstore_contract_listing` (:data:`BAD_NAMES` and :data:`SPECIAL_CHARACTERS` are
re-exported here), the dict model the stateful test runs in :mod:`~statebackend.testing.blobstore_contract_model`.
"""

from __future__ import annotations

import io
import os
import threading
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor

import pytest
from hypothesis import HealthCheck, settings
from hypothesis.stateful import run_state_machine_as_test

from statebackend.blobstores.base import BlobInfo, BlobStore
from statebackend.errors import AlreadyExistsError, ConfigError, NotFoundError
from statebackend.testing.blobstore_contract_listing import BAD_NAMES, SPECIAL_CHARACTERS, NamesAndListingContract
from statebackend.testing.blobstore_contract_model import _BlobStoreMachine
from statebackend.testing.conditional_delete_contract import ConditionalDeleteContract
from statebackend.testing.conditional_put_contract import ConditionalPutContract
from statebackend.testing.deadline import deadline, scaled

__all__ = ["BAD_NAMES", "LONG_RUN_PROFILE", "PROFILE_ENV", "SPECIAL_CHARACTERS", "BlobStoreContract"]

#: the Hypothesis profile of the long run of the stateful test (many examples, long runs): selected for every
#: store's ``test_store_behaves_like_a_dict`` when the environment variable :data:`PROFILE_ENV` names it, and run by
#: statebackend's CI on the memory store (tests/test_blobstore_memory.py)
LONG_RUN_PROFILE = "statebackend-long"
#: the environment variable that selects :data:`LONG_RUN_PROFILE`:
#: ``STATEBACKEND_HYPOTHESIS_PROFILE=statebackend-long``
PROFILE_ENV = "STATEBACKEND_HYPOTHESIS_PROFILE"

settings.register_profile(
    LONG_RUN_PROFILE,
    max_examples=300,
    stateful_step_count=60,
    deadline=None,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.function_scoped_fixture],
)

_BINARY = bytes(range(256)) * 3


def _payload(size: int, seed: int = 0) -> bytes:
    """Deterministic, non-repeating-looking bytes (so a misplaced range is caught)."""
    block = bytes((i * 131 + seed * 7 + (i >> 8)) & 0xFF for i in range(65536))
    return (block * (size // len(block) + 1))[:size]


class MetadataPortabilityContract:
    """Mixed into :class:`BlobStoreContract`: metadata keys every service keeps as given, refused uniformly."""

    @pytest.mark.parametrize("key", ["expires-at", "Upper", "1digit", "", "a b", "x" * 64])
    def test_non_portable_metadata_key_is_refused_before_anything_is_written(self, store: BlobStore, key: str) -> None:
        with pytest.raises(ConfigError, match="metadata"):
            store.put("meta/refused", b"data", metadata={key: "v"})
        assert not store.exists("meta/refused")

    def test_portable_metadata_keys_round_trip(self, store: BlobStore) -> None:
        metadata = {"expires_at": "1795355737", "created_at": "1", "k9": "printable ascii"}
        store.put("meta/kept", b"data", metadata=metadata)
        assert dict(store.head("meta/kept").metadata) == metadata


class BlobStoreContract(
    MetadataPortabilityContract, NamesAndListingContract, ConditionalDeleteContract, ConditionalPutContract
):
    """Behaviour every :class:`BlobStore` implementation has. Subclass it and provide the ``store`` fixture. The
    conditional deletes (:class:`~statebackend.testing.conditional_delete_contract.ConditionalDeleteContract`) are
    checked where the store claims them, and an honest refusal where it does not; names and listings are
    :class:`~statebackend.testing.blobstore_contract_listing.NamesAndListingContract`."""

    #: size of the "large" blob and file round trips; larger than one copy buffer so streaming loops run
    large_size: int = 5 * 1024 * 1024 + 123
    #: threads racing in the concurrency tests
    threads: int = 8
    #: Hypothesis examples and steps for the state machine
    state_machine_examples: int = 25
    #: steps per example of the state machine
    state_machine_steps: int = 25
    #: names written for the paging test: more than one page of a listing (S3 pages by 1,000 names, Azure by
    #: 5,000); a suite whose store lists in smaller pages on request (the built-in S3 and Azure stores'
    #: ``list_page_size``, set by their test fixtures) writes fewer
    listing_names: int = 2_500
    #: seconds a test may run on an idle machine before it fails (a hung store fails its test; stretched by the
    #: machine's load: statebackend.testing.deadline)
    test_timeout_s: float = 300.0

    @pytest.fixture(autouse=True)
    def _contract_deadline(self, request: pytest.FixtureRequest) -> Iterator[None]:
        with deadline(scaled(self.test_timeout_s), request.node.nodeid):  # stretched on a loaded machine
            yield

    @pytest.fixture
    def store(self) -> Iterator[BlobStore]:
        """The store under test, empty, for one test: every subclass provides this fixture (and closes the store
        after the yield)."""
        raise NotImplementedError("a BlobStoreContract subclass must provide the `store` fixture")

    def raw_get(self, store: BlobStore, name: str) -> bytes | None:
        """The blob's bytes read without the store under test, or None if absent. Override it; this fallback
        only asks the store itself."""
        try:
            return store.get(name)
        except NotFoundError:
            return None

    # -- put / get ----------------------------------------------------------------------------------------------

    @pytest.mark.parametrize("data", [b"", b"x", _BINARY, b"\x00" * 1000], ids=["empty", "one", "binary", "nuls"])
    def test_put_then_get_returns_the_same_bytes(self, store: BlobStore, data: bytes) -> None:
        store.put("blob", data)
        assert store.get("blob") == data
        assert self.raw_get(store, "blob") == data

    def test_put_then_get_of_a_large_blob_returns_the_same_bytes(self, store: BlobStore) -> None:
        data = _payload(self.large_size)
        store.put("dir/large", data)
        assert store.get("dir/large") == data
        assert self.raw_get(store, "dir/large") == data

    def test_put_accepts_bytearray_and_memoryview(self, store: BlobStore) -> None:
        # typed as bytes; every store also takes other bytes-like objects, which this pins down
        store.put("from-bytearray", bytearray(b"abc"))  # type: ignore[arg-type]
        store.put("from-memoryview", memoryview(b"defgh")[1:4])  # type: ignore[arg-type]
        assert store.get("from-bytearray") == b"abc"
        assert store.get("from-memoryview") == b"efg"

    def test_put_overwrites_an_existing_blob(self, store: BlobStore) -> None:
        store.put("blob", b"first version, longer")
        store.put("blob", b"second")
        assert store.get("blob") == b"second"
        assert self.raw_get(store, "blob") == b"second"
        assert list(store.list()) == ["blob"]

    def test_a_read_after_an_overwrite_sees_the_new_bytes(
        self, store: BlobStore, tmp_path_factory: pytest.TempPathFactory
    ) -> None:
        """Every read path after every write path: a store that caches what it read (or what it wrote) must drop the
        cached blob when the name is written again, deleted or written through another path."""
        local = tmp_path_factory.mktemp("local")
        store.put("cached", b"first version")
        assert store.get("cached") == b"first version"
        assert store.get("cached", start=6) == b"version"
        assert store.head("cached").size == 13
        store.put("cached", b"second")
        assert store.get("cached") == b"second"
        assert store.get("cached", start=1, end=3) == b"ec"
        assert store.head("cached").size == 6
        assert b"".join(store.iter_bytes("cached", chunk_size=4)) == b"second"
        out = io.BytesIO()
        assert store.get_into("cached", out) == 6 and out.getvalue() == b"second"
        (local / "third").write_bytes(b"third, from a file")
        store.put_file("cached", local / "third")
        assert store.get("cached") == b"third, from a file"
        assert store.get_file("cached", local / "back") == 18
        assert (local / "back").read_bytes() == b"third, from a file"
        store.set_metadata("cached", {"kind": "x"})
        assert store.get("cached") == b"third, from a file"
        store.delete("cached")
        with pytest.raises(NotFoundError):
            store.get("cached")
        assert not store.exists("cached")
        store.put("cached", b"fourth", create_only=True)
        assert store.get("cached") == b"fourth"
        store.delete_many(["cached"])
        with pytest.raises(NotFoundError):
            store.head("cached")
        store.put("cached", b"fifth")
        assert store.get("cached") == b"fifth"
        assert self.raw_get(store, "cached") == b"fifth"

    def test_create_only_writes_a_new_name(self, store: BlobStore) -> None:
        store.put("new", b"data", create_only=True)
        assert store.get("new") == b"data"
        assert self.raw_get(store, "new") == b"data"

    def test_create_only_on_a_taken_name_raises_and_keeps_the_old_blob(self, store: BlobStore) -> None:
        store.put("taken", b"old", metadata={"owner": "first"})
        with pytest.raises(AlreadyExistsError) as caught:
            store.put("taken", b"new", create_only=True, metadata={"owner": "second"})
        assert isinstance(caught.value, FileExistsError)
        assert "taken" in str(caught.value)
        assert store.get("taken") == b"old"
        assert self.raw_get(store, "taken") == b"old"
        assert dict(store.head("taken").metadata) == {"owner": "first"}
        assert list(store.list()) == ["taken"]

    def test_create_only_after_delete_succeeds(self, store: BlobStore) -> None:
        store.put("reused", b"one", create_only=True)
        store.delete("reused")
        store.put("reused", b"two", create_only=True)
        assert store.get("reused") == b"two"

    def test_get_of_an_absent_blob_raises_not_found(self, store: BlobStore) -> None:
        store.put("present", b"x")
        with pytest.raises(NotFoundError) as caught:
            store.get("absent")
        assert isinstance(caught.value, FileNotFoundError)
        assert "absent" in str(caught.value)

    def test_get_of_a_prefix_of_existing_names_raises_not_found(self, store: BlobStore) -> None:
        store.put("dir/child", b"x")
        with pytest.raises(NotFoundError):
            store.get("dir")
        with pytest.raises(NotFoundError):
            store.head("dir")
        assert not store.exists("dir")

    # -- ranged reads -------------------------------------------------------------------------------------------

    @pytest.mark.parametrize(
        ("start", "end", "expected"),
        [
            (None, None, b"0123456789"),
            (3, None, b"3456789"),
            (None, 4, b"0123"),
            (2, 5, b"234"),
            (0, 10, b"0123456789"),
            (7, 100, b"789"),
            (10, None, b""),
            (25, 30, b""),
            (4, 4, b""),
            (6, 2, b""),
            (None, 0, b""),
        ],
    )
    def test_ranged_get_returns_the_clamped_slice(
        self, store: BlobStore, start: int | None, end: int | None, expected: bytes
    ) -> None:
        store.put("digits", b"0123456789")
        assert store.get("digits", start=start, end=end) == expected

    def test_ranged_get_of_an_empty_blob_is_empty(self, store: BlobStore) -> None:
        store.put("empty", b"")
        assert store.get("empty", start=0, end=10) == b""

    def test_ranged_get_of_a_large_blob_returns_the_slice(self, store: BlobStore) -> None:
        data = _payload(self.large_size, seed=3)
        store.put("large", data)
        start, end = 1024 * 1024 - 5, 3 * 1024 * 1024 + 17
        assert store.get("large", start=start, end=end) == data[start:end]

    @pytest.mark.parametrize(("start", "end"), [(-1, None), (None, -1), (-5, -1)])
    def test_negative_range_is_rejected(self, store: BlobStore, start: int | None, end: int | None) -> None:
        store.put("digits", b"0123456789")
        with pytest.raises(ConfigError):
            store.get("digits", start=start, end=end)

    def test_ranged_get_of_an_absent_blob_raises_not_found(self, store: BlobStore) -> None:
        with pytest.raises(NotFoundError):
            store.get("absent", start=1, end=2)

    # -- head, metadata, exists ---------------------------------------------------------------------------------

    def test_head_gives_size_and_metadata(self, store: BlobStore) -> None:
        store.put("blob", b"12345", metadata={"kind": "delta", "expiry": "1700000000"})
        info = store.head("blob")
        assert isinstance(info, BlobInfo)
        assert info.name == "blob"
        assert info.size == 5
        assert dict(info.metadata) == {"kind": "delta", "expiry": "1700000000"}

    def test_head_of_a_blob_without_metadata_has_empty_metadata(self, store: BlobStore) -> None:
        store.put("plain", b"")
        info = store.head("plain")
        assert info.size == 0
        assert dict(info.metadata) == {}

    def test_head_of_an_absent_blob_raises_not_found(self, store: BlobStore) -> None:
        with pytest.raises(NotFoundError):
            store.head("absent")

    def test_overwrite_replaces_the_metadata_too(self, store: BlobStore) -> None:
        store.put("blob", b"one", metadata={"kind": "old"})
        store.put("blob", b"two")
        assert dict(store.head("blob").metadata) == {}
        store.put("blob", b"three", metadata={"kind": "new"})
        assert dict(store.head("blob").metadata) == {"kind": "new"}

    def test_set_metadata_replaces_metadata_and_keeps_the_bytes(self, store: BlobStore) -> None:
        store.put("blob", b"payload", metadata={"kind": "delta", "expiry": "1"})
        store.set_metadata("blob", {"kind": "delta"})
        assert dict(store.head("blob").metadata) == {"kind": "delta"}
        store.set_metadata("blob", {"expiry": "2"})
        assert dict(store.head("blob").metadata) == {"expiry": "2"}
        assert store.get("blob") == b"payload"
        assert self.raw_get(store, "blob") == b"payload"
        assert store.head("blob").size == 7

    def test_set_metadata_to_empty_clears_it(self, store: BlobStore) -> None:
        store.put("blob", b"payload", metadata={"expiry": "1"})
        store.set_metadata("blob", {})
        assert dict(store.head("blob").metadata) == {}
        assert store.get("blob") == b"payload"

    def test_set_metadata_of_an_absent_blob_raises_not_found(self, store: BlobStore) -> None:
        with pytest.raises(NotFoundError):
            store.set_metadata("absent", {"expiry": "1"})
        assert list(store.list()) == []

    def test_exists_tells_present_from_absent(self, store: BlobStore) -> None:
        store.put("present", b"x")
        assert store.exists("present")
        assert not store.exists("absent")

    def test_finished_writes_are_never_listed_as_abandoned_uploads(self, store: BlobStore) -> None:
        """``abandoned_uploads`` is optional (``None``: the store cannot list them); a store that lists them never
        lists a write that finished, so a garbage collection never removes a blob."""
        store.put("done/a", b"x")
        store.put("done/b", b"y" * 1000, create_only=True)
        found = store.abandoned_uploads("done/")
        assert found is None or found == []
        assert sorted(store.list("done/")) == ["done/a", "done/b"]

    # -- delete -------------------------------------------------------------------------------------------------

    def test_delete_then_get_raises_not_found(self, store: BlobStore) -> None:
        store.put("dir/blob", b"x", metadata={"kind": "delta"})
        store.delete("dir/blob")
        with pytest.raises(NotFoundError):
            store.get("dir/blob")
        with pytest.raises(NotFoundError):
            store.head("dir/blob")
        assert self.raw_get(store, "dir/blob") is None
        assert list(store.list()) == []

    def test_delete_of_an_absent_blob_is_success(self, store: BlobStore) -> None:
        store.delete("absent")
        store.delete("never/was/here")
        store.put("blob", b"x")
        store.delete("blob")
        store.delete("blob")
        assert list(store.list()) == []

    def test_delete_leaves_names_sharing_a_prefix(self, store: BlobStore) -> None:
        for name in ["a", "ab", "b/a", "b/ab"]:
            store.put(name, name.encode())
        store.delete("a")
        store.delete("b/a")
        assert list(store.list()) == ["ab", "b/ab"]
        assert store.get("b/ab") == b"b/ab"

    def test_delete_of_a_prefix_of_existing_names_deletes_nothing(self, store: BlobStore) -> None:
        store.put("dir/child", b"x")
        store.delete("dir")
        assert store.get("dir/child") == b"x"

    def test_delete_many_deletes_each_and_tolerates_absent(self, store: BlobStore) -> None:
        for name in ["x/1", "x/2", "x/3"]:
            store.put(name, b"x")
        store.delete_many(["x/1", "x/3", "x/absent"])
        assert list(store.list()) == ["x/2"]

    def test_delete_many_deletes_every_present_name_wherever_the_absent_ones_are(self, store: BlobStore) -> None:
        """Absent names first, between and after present ones: every present one is deleted and no error is raised
        (a batch that stops at the first absent name and reports success leaves blobs a collector thinks gone)."""
        present = [f"p/{i}" for i in range(6)]
        for name in present:
            store.put(name, name.encode())
        store.delete_many(["absent/0", "p/0", "absent/1", "absent/2", "p/2", "p/4", "absent/3"])
        assert list(store.list()) == ["p/1", "p/3", "p/5"]
        assert self.raw_get(store, "p/2") is None
        store.delete_many(["p/1", "p/1", "absent/4", "p/5"])  # a name twice, and an absent one between
        assert list(store.list()) == ["p/3"]
        store.delete_many([])
        store.delete_many(["absent/5", "absent/6"])
        assert list(store.list()) == ["p/3"]
        assert store.get("p/3") == b"p/3"

    def test_delete_many_checks_every_name_before_deleting_any(self, store: BlobStore) -> None:
        store.put("kept/1", b"x")
        store.put("kept/2", b"y")
        with pytest.raises(ConfigError):
            store.delete_many(["kept/1", "../escape", "kept/2"])
        assert list(store.list()) == ["kept/1", "kept/2"]

    # -- files and streams --------------------------------------------------------------------------------------

    def test_put_file_then_get_file_round_trips_a_large_file(
        self, store: BlobStore, tmp_path_factory: pytest.TempPathFactory
    ) -> None:
        local = tmp_path_factory.mktemp("local")
        data = _payload(self.large_size, seed=5)
        (local / "source").write_bytes(data)
        store.put_file("files/large", local / "source", metadata={"kind": "snapshot"})
        assert self.raw_get(store, "files/large") == data
        assert store.head("files/large").size == len(data)
        assert dict(store.head("files/large").metadata) == {"kind": "snapshot"}
        assert store.get_file("files/large", local / "target") == len(data)
        assert (local / "target").read_bytes() == data
        assert sorted(os.listdir(local)) == ["source", "target"]

    def test_put_file_create_only_on_a_taken_name_raises_and_keeps_the_old_blob(
        self, store: BlobStore, tmp_path_factory: pytest.TempPathFactory
    ) -> None:
        local = tmp_path_factory.mktemp("local") / "source"
        local.write_bytes(b"new")
        store.put("taken", b"old")
        with pytest.raises(AlreadyExistsError):
            store.put_file("taken", local, create_only=True)
        assert store.get("taken") == b"old"

    def test_get_file_replaces_an_existing_target(
        self, store: BlobStore, tmp_path_factory: pytest.TempPathFactory
    ) -> None:
        target = tmp_path_factory.mktemp("local") / "target"
        target.write_bytes(b"previous content that is longer")
        store.put("blob", b"fresh")
        assert store.get_file("blob", target) == 5
        assert target.read_bytes() == b"fresh"

    def test_get_file_of_an_absent_blob_leaves_the_target_untouched(
        self, store: BlobStore, tmp_path_factory: pytest.TempPathFactory
    ) -> None:
        local = tmp_path_factory.mktemp("local")
        (local / "target").write_bytes(b"keep me")
        with pytest.raises(NotFoundError):
            store.get_file("absent", local / "target")
        assert (local / "target").read_bytes() == b"keep me"
        assert os.listdir(local) == ["target"]

    def test_get_into_writes_the_bytes_to_a_stream(self, store: BlobStore) -> None:
        data = _payload(100_000, seed=9)
        store.put("blob", data)
        out = io.BytesIO()
        assert store.get_into("blob", out) == len(data)
        assert out.getvalue() == data
        with pytest.raises(NotFoundError):
            store.get_into("absent", io.BytesIO())

    def test_iter_bytes_streams_the_blob_in_bounded_chunks(self, store: BlobStore) -> None:
        data = _payload(10_000, seed=11)
        store.put("blob", data)
        chunks = list(store.iter_bytes("blob", chunk_size=4096))
        assert b"".join(chunks) == data
        assert all(0 < len(chunk) <= 4096 for chunk in chunks)
        assert len(chunks) == 3

    def test_iter_bytes_of_an_empty_blob_yields_nothing(self, store: BlobStore) -> None:
        store.put("empty", b"")
        assert b"".join(store.iter_bytes("empty")) == b""

    def test_iter_bytes_of_an_absent_blob_raises_not_found(self, store: BlobStore) -> None:
        with pytest.raises(NotFoundError):
            list(store.iter_bytes("absent"))

    # -- concurrency --------------------------------------------------------------------------------------------

    def test_concurrent_create_only_on_one_name_has_exactly_one_winner(self, store: BlobStore) -> None:
        start = threading.Barrier(self.threads)

        def attempt(i: int) -> bool:
            start.wait()
            try:
                store.put("contended", f"writer {i}".encode(), create_only=True)
            except AlreadyExistsError:
                return False
            return True

        with ThreadPoolExecutor(self.threads) as pool:
            won = list(pool.map(attempt, range(self.threads)))
        assert won.count(True) == 1
        winner = won.index(True)
        assert store.get("contended") == f"writer {winner}".encode()
        assert self.raw_get(store, "contended") == f"writer {winner}".encode()
        assert list(store.list()) == ["contended"]

    def test_concurrent_puts_of_different_names_all_land(self, store: BlobStore) -> None:
        start = threading.Barrier(self.threads)
        per_thread = 10

        def write(i: int) -> None:
            start.wait()
            for j in range(per_thread):
                store.put(f"t{i}/shared/{j:02d}", f"{i}-{j}".encode())

        with ThreadPoolExecutor(self.threads) as pool:
            list(pool.map(write, range(self.threads)))
        expected = sorted(f"t{i}/shared/{j:02d}" for i in range(self.threads) for j in range(per_thread))
        assert list(store.list()) == expected
        assert store.get("t3/shared/07") == b"3-7"

    def test_readers_see_a_whole_version_while_writers_overwrite(self, store: BlobStore) -> None:
        versions = [_payload(200_000, seed=i) for i in range(4)]
        store.put("hot", versions[0])
        start = threading.Barrier(len(versions) + 2)
        torn: list[int] = []

        def write(i: int) -> None:
            start.wait()
            for _ in range(5):
                store.put("hot", versions[i])

        def read() -> None:
            start.wait()
            for _ in range(20):
                data = store.get("hot")
                if data not in versions:
                    torn.append(len(data))

        with ThreadPoolExecutor(len(versions) + 2) as pool:
            futures = [pool.submit(write, i) for i in range(len(versions))]
            futures += [pool.submit(read) for _ in range(2)]
            for future in futures:
                future.result()
        assert torn == []
        assert store.get("hot") in versions

    def test_concurrent_deletes_and_puts_of_siblings_lose_nothing(self, store: BlobStore) -> None:
        """Deleting the last blob of a directory while a sibling is written into it keeps the sibling."""
        start = threading.Barrier(2)
        rounds = 30

        def churn() -> None:
            start.wait()
            for i in range(rounds):
                store.put(f"d{i}/gone", b"x")
                store.delete(f"d{i}/gone")

        def write() -> None:
            start.wait()
            for i in range(rounds):
                store.put(f"d{i}/kept", b"y")

        with ThreadPoolExecutor(2) as pool:
            for future in [pool.submit(churn), pool.submit(write)]:
                future.result()
        assert list(store.list()) == sorted(f"d{i}/kept" for i in range(rounds))

    # -- against a dict model -----------------------------------------------------------------------------------

    def test_store_behaves_like_a_dict(self, store: BlobStore) -> None:
        """Random operations on the store and on a dict agree: :attr:`state_machine_examples` runs of
        :attr:`state_machine_steps` steps, or the long run of :data:`LONG_RUN_PROFILE` when :data:`PROFILE_ENV`
        selects it."""
        self.run_state_machine(store, long_run=os.environ.get(PROFILE_ENV) == LONG_RUN_PROFILE)

    def run_state_machine(self, store: BlobStore, *, long_run: bool = False) -> None:
        """Run the stateful test on ``store``: the class's example and step counts, or with ``long_run`` the
        :data:`LONG_RUN_PROFILE` (300 runs of 60 steps: what a read cache an overwrite does not invalidate needs,
        besides the direct test)."""
        machine = type("Machine", (_BlobStoreMachine,), {"store": store, "contract": self})
        if long_run:
            chosen = settings.get_profile(LONG_RUN_PROFILE)
        else:
            chosen = settings(
                max_examples=self.state_machine_examples,
                stateful_step_count=self.state_machine_steps,
                deadline=None,
                suppress_health_check=[HealthCheck.too_slow, HealthCheck.function_scoped_fixture],
            )
        run_state_machine_as_test(machine, settings=chosen)
