"""The names and listings part of the blob store contract suite, mixed into
:class:`~statebackend.testing.blobstore_contract.BlobStoreContract` (which re-exports :data:`BAD_NAMES` and
:data:`SPECIAL_CHARACTERS`): listings sorted, by any prefix and past a service's page; characters a listing must take
literally; names that could escape the root, refused before anything is written.
"""

from __future__ import annotations

from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from typing import TYPE_CHECKING

import pytest

from statebackend.blobstores.base import BlobStore
from statebackend.errors import ConfigError

__all__ = ["BAD_NAMES", "SPECIAL_CHARACTERS", "NamesAndListingContract"]

#: names that must be rejected with ConfigError before anything is written
BAD_NAMES = [
    "",
    "/abs",
    "/",
    "..",
    "../escape",
    "a/../../escape",
    "a/..",
    ".",
    "./a",
    "a/./b",
    "a//b",
    "a/",
    "a\x00b",
    "a\\..\\b",
    # characters no store holds, refused alike on every store (check_blob_name)
    "a\\b",
    "back\\",
    "a\tb",
    "a\nb",
    "a\x7fb",
    "lone\udc80surrogate",
]

#: characters that are ordinary in a name and a prefix: a listing must match them literally (SQL LIKE takes ``%`` and
#: ``_`` as wildcards, a glob ``*``, ``?`` and ``[``)
SPECIAL_CHARACTERS = ["%", "_", "*", "?", "[", "]"]


class NamesAndListingContract:
    """Mixed into :class:`~statebackend.testing.blobstore_contract.BlobStoreContract` (which gives ``raw_get`` and
    the sizes below)."""

    if TYPE_CHECKING:
        threads: int
        listing_names: int

        def raw_get(self, store: BlobStore, name: str) -> bytes | None: ...

    # -- list ---------------------------------------------------------------------------------------------------

    def test_list_of_an_empty_store_is_empty(self, store: BlobStore) -> None:
        assert list(store.list()) == []
        assert list(store.list("any/prefix")) == []

    def test_list_yields_every_name_sorted(self, store: BlobStore) -> None:
        names = ["b", "a/z", "a.b", "a-b", "a0", "a/b/c", "c/d/e/f", "A", "a/b.c", "a/b-c"]
        for name in names:
            store.put(name, b"")
        assert list(store.list()) == sorted(names)

    def test_list_filters_by_prefix_and_sorts(self, store: BlobStore) -> None:
        names = ["job/1/idx", "job/1/delta/0002", "job/1/delta/0001", "job/2/idx", "jobs", "other"]
        for name in names:
            store.put(name, b"x")
        assert list(store.list("job/1/")) == ["job/1/delta/0001", "job/1/delta/0002", "job/1/idx"]
        assert list(store.list("job/1/delta/")) == ["job/1/delta/0001", "job/1/delta/0002"]
        assert list(store.list("job")) == sorted(names[:5])
        assert list(store.list("job/")) == sorted(names[:4])
        assert list(store.list("other")) == ["other"]
        assert list(store.list("nothing")) == []

    def test_list_prefix_may_end_inside_a_segment(self, store: BlobStore) -> None:
        for name in ["a/bc/x", "a/b/y", "a/bd", "a/c", "ab"]:
            store.put(name, b"x")
        assert list(store.list("a/b")) == ["a/b/y", "a/bc/x", "a/bd"]
        assert list(store.list("a/bc/")) == ["a/bc/x"]
        assert list(store.list("a/bc/x")) == ["a/bc/x"]
        assert list(store.list("a/bc/xy")) == []

    def test_list_returns_every_name_past_a_page(self, store: BlobStore) -> None:
        """A listing longer than a service's page (1,000 names on S3, 5,000 on Azure) is followed to its end: a store
        that returns the first page only gives a short listing, which would make a task's checkpoints, or a
        backend's blobs, look fewer than they are."""
        names = [f"paged/{i:05d}" for i in range(self.listing_names)]
        with ThreadPoolExecutor(self.threads) as pool:
            list(pool.map(lambda name: store.put(name, b""), names))
        store.put("paged0", b"")  # sorts after every paged/ name
        assert list(store.list("paged/")) == names
        assert list(store.list()) == [*names, "paged0"]

    def test_list_with_a_prefix_no_name_can_have_is_empty(self, store: BlobStore) -> None:
        store.put("a/b", b"x")
        for prefix in ["/a", "a//", "../", "a/../", "./a", "a\\", "\\", "a/\\b", "a\x00", "a\x01", "a\n"]:
            assert list(store.list(prefix)) == [], prefix

    # -- characters a listing must take literally ---------------------------------------------------------------

    @pytest.mark.parametrize("char", SPECIAL_CHARACTERS)
    def test_names_with_special_characters_round_trip_and_list_literally(self, store: BlobStore, char: str) -> None:
        """``%``, ``_``, ``*``, ``?``, ``[`` and ``]`` are characters like any other, in names and in prefixes: a
        listing that takes them as wildcards (SQL LIKE, a glob, a regular expression) lists names that do not start
        with the prefix, or misses ones that do."""
        c = char
        names = [f"sp/a{c}", f"sp/a{c}b", f"sp/a{c}{c}", "sp/ab", "sp/axb", "sp/a", f"sp/{c}x", "sp/x", f"d{c}/y"]
        names += ["dx/y", f"sp/a{c}{c}{c}b"]
        for name in names:
            store.put(name, name.encode(), metadata={"kind": "special"})
        for name in names:
            assert store.get(name) == name.encode()
            assert self.raw_get(store, name) == name.encode()
            assert store.head(name).size == len(name.encode())
        assert list(store.list()) == sorted(names)
        for prefix in [f"sp/a{c}", f"sp/a{c}{c}", f"sp/{c}", f"d{c}", f"d{c}/", f"sp/a{c}b", c, "sp/a", f"{c}{c}"]:
            assert list(store.list(prefix)) == sorted(n for n in names if n.startswith(prefix)), prefix
        store.delete(f"sp/a{c}")
        assert not store.exists(f"sp/a{c}")
        assert store.get(f"sp/a{c}b") == f"sp/a{c}b".encode()
        store.delete_many([f"sp/a{c}{c}", f"sp/{c}absent"])
        remaining = sorted(n for n in names if n not in {f"sp/a{c}", f"sp/a{c}{c}"})
        assert list(store.list()) == remaining

    # -- names that could escape the root ----------------------------------------------------------------------

    @pytest.mark.parametrize("name", BAD_NAMES, ids=repr)
    def test_bad_names_are_rejected_and_nothing_is_written(
        self, store: BlobStore, name: str, tmp_path_factory: pytest.TempPathFactory
    ) -> None:
        local = tmp_path_factory.mktemp("local") / "file"
        local.write_bytes(b"data")
        attempts: list[Callable[[], object]] = [
            lambda: store.put(name, b"data"),
            lambda: store.put(name, b"data", create_only=True),
            lambda: store.put_file(name, local),
            lambda: store.get(name),
            lambda: store.head(name),
            lambda: store.delete(name),
            lambda: store.set_metadata(name, {"kind": "x"}),
            lambda: store.get_file(name, local.parent / "out"),
        ]
        for attempt in attempts:
            with pytest.raises(ConfigError):
                attempt()
        assert list(store.list()) == []
        assert not (local.parent / "out").exists()
