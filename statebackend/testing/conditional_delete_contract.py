"""The conditional delete part of the blob store contract suite, mixed into
:class:`~statebackend.testing.blobstore_contract.BlobStoreContract` (kept apart for its size).

A store whose :attr:`~statebackend.blobstores.base.BlobStore.supports_conditional_delete` is true must give every
blob a version (:attr:`~statebackend.blobstores.base.BlobInfo.etag`) that changes on every put (the same bytes
written again too), and :meth:`~statebackend.blobstores.base.BlobStore.delete_if_unchanged` must delete exactly the
blobs still at the version given, keep (and report) the ones written since, and take an absent one for success. A
store that does not claim it is checked to decline honestly: asked anyway, it raises
:class:`~statebackend.errors.StorageError` and deletes nothing (a garbage collector never asks it; it would rather
fall back to ``delete_many`` than have a "conditional" delete that is not).
"""

from __future__ import annotations

import threading
import uuid

import pytest

from statebackend.blobstores.base import BlobStore
from statebackend.errors import ConfigError, NotFoundError, StorageError

__all__ = ["ConditionalDeleteContract"]


class ConditionalDeleteContract:
    """Mixed into :class:`~statebackend.testing.blobstore_contract.BlobStoreContract` (which gives ``raw_get``)."""

    #: rounds of the race between a rewrite and a conditional delete
    conditional_delete_races: int = 30
    #: size of the large ``put_file`` (BlobStoreContract's: larger than a part, so uploads in parts run)
    large_size: int

    def raw_get(self, store: BlobStore, name: str) -> bytes | None:  # pragma: no cover - BlobStoreContract's wins
        """The blob's bytes read without the store under test, or ``None`` if absent (see
        :meth:`BlobStoreContract.raw_get <statebackend.testing.blobstore_contract.BlobStoreContract.raw_get>`,
        which this suite's tests use)."""
        raise NotImplementedError

    def _declines(self, store: BlobStore) -> bool:
        """True (and checked) when the store does not claim conditional deletes: asked anyway, it refuses with a
        :class:`StorageError` and keeps the blob."""
        if store.supports_conditional_delete:
            return False
        store.put("cond/declined", b"x")
        with pytest.raises(StorageError):
            store.delete_if_unchanged({"cond/declined": store.head("cond/declined").etag or "any"})
        assert store.get("cond/declined") == b"x"
        return True

    @staticmethod
    def again(store: BlobStore, data: bytes) -> bytes:
        """The bytes a writer puts to write ``data`` again under its name: the same bytes, or, on a store whose
        versions follow the bytes (``versions_follow_bytes``: S3, whose ETag is the MD5 of the bytes), bytes of
        their own, as every writer of a name that may be written again makes them there (a per-write nonce)."""
        if store.versions_follow_bytes:
            return data + b" again " + uuid.uuid4().hex.encode()
        return data

    def test_a_version_that_follows_the_bytes_is_declared(self, store: BlobStore) -> None:
        """A store whose version survives a rewrite of the same bytes must say so (``versions_follow_bytes``): a
        sweep then still bounds that race; one that does not say so must give a new version."""
        if self._declines(store):
            return
        store.put("cond/same", b"same", metadata={"created_at": "1"})
        first = store.head("cond/same").etag
        store.put("cond/same", b"same", metadata={"created_at": "2"})
        repeated = store.head("cond/same").etag == first
        assert repeated == store.versions_follow_bytes

    def test_head_gives_a_version_that_changes_on_every_put(self, store: BlobStore) -> None:
        """A version that survives a rewrite of the same bytes would let a sweep delete the rewrite."""
        if self._declines(store):
            return
        store.put("cond/v", b"same", metadata={"created_at": "1"})
        first = store.head("cond/v").etag
        assert first is not None and store.head("cond/v").etag == first, "no write, no new version"
        seen = {first}
        rewrites = [
            (self.again(store, b"same"), {"created_at": "1"}),
            (self.again(store, b"same"), {"created_at": "2"}),
        ]
        for data, metadata in [*rewrites, (b"other", {})]:
            store.put("cond/v", data, metadata=metadata)
            version = store.head("cond/v").etag
            assert version is not None and version not in seen, f"a put of {data!r} kept an earlier version"
            seen.add(version)

    def test_every_write_path_gives_a_new_version(
        self, store: BlobStore, tmp_path_factory: pytest.TempPathFactory
    ) -> None:
        """A writer refreshes a blob with ``put_file`` (the backends' uploads), a large one in parts where the store
        uploads in parts: each path must give a new version, the same bytes written again too."""
        if self._declines(store):
            return
        local = tmp_path_factory.mktemp("cond")
        small, large = local / "small", local / "large"
        small.write_bytes(b"same")
        large.write_bytes(bytes(range(256)) * (self.large_size // 256 + 1))
        for name, path in [("cond/pf-small", small), ("cond/pf-large", large)]:
            seen: set[str] = set()
            for round_no in range(2):
                path.write_bytes(self.again(store, path.read_bytes()))
                store.put_file(name, path, metadata={"created_at": "1"})
                version = store.head(name).etag
                assert version is not None and version not in seen, (
                    f"put_file of {name} (round {round_no}) kept an earlier version"
                )
                seen.add(version)
            judged = store.head(name).etag or ""
            path.write_bytes(self.again(store, path.read_bytes()))
            store.put_file(name, path, metadata={"created_at": "2"})
            assert store.delete_if_unchanged({name: judged}) == {name}, f"a put_file rewrite of {name} was not kept"
            assert self.raw_get(store, name) == path.read_bytes()

    @pytest.mark.parametrize("delete", ["delete", "delete_many", "delete_if_unchanged"])
    def test_a_version_never_comes_back_after_a_delete(self, store: BlobStore, delete: str) -> None:
        """A blob deleted (by another collector) and written again, the same bytes under the same name, is a new
        version: a conditional delete naming the version before the delete keeps it. (A version counted per name
        from its creation, or a file's inode that the filesystem hands out again, would repeat.)"""
        if self._declines(store):
            return
        for round_no in range(4):
            name = f"cond/again{round_no % 2}"
            store.put(name, b"same")
            judged = store.head(name).etag or ""
            if delete == "delete":
                store.delete(name)
            elif delete == "delete_many":
                store.delete_many([name])
            else:
                assert store.delete_if_unchanged({name: judged}) == frozenset()
            data = self.again(store, b"same")
            store.put(name, data)
            assert store.head(name).etag != judged, f"round {round_no}: the version before the delete came back"
            assert store.delete_if_unchanged({name: judged}) == {name}, f"round {round_no}: the rewrite was deleted"
            assert self.raw_get(store, name) == data

    def test_conditional_delete_of_an_unchanged_blob_deletes_it(self, store: BlobStore) -> None:
        if self._declines(store):
            return
        store.put("cond/old", b"x", metadata={"created_at": "1"})
        assert store.delete_if_unchanged({"cond/old": store.head("cond/old").etag or ""}) == frozenset()
        assert self.raw_get(store, "cond/old") is None
        with pytest.raises(NotFoundError):
            store.head("cond/old")

    @pytest.mark.parametrize("rewrite", [b"x", b"new"], ids=["same-bytes", "other-bytes"])
    def test_conditional_delete_of_a_rewritten_blob_keeps_the_new_version(
        self, store: BlobStore, rewrite: bytes
    ) -> None:
        if self._declines(store):
            return
        store.put("cond/refreshed", b"x", metadata={"created_at": "1"})
        judged = store.head("cond/refreshed").etag or ""
        rewrite = self.again(store, rewrite) if rewrite == b"x" else rewrite
        store.put("cond/refreshed", rewrite, metadata={"created_at": "2"})
        assert store.delete_if_unchanged({"cond/refreshed": judged}) == {"cond/refreshed"}
        assert self.raw_get(store, "cond/refreshed") == rewrite
        assert dict(store.head("cond/refreshed").metadata) == {"created_at": "2"}

    def test_conditional_delete_of_an_absent_blob_is_success(self, store: BlobStore) -> None:
        if self._declines(store):
            return
        store.put("cond/gone", b"x")
        version = store.head("cond/gone").etag or ""
        store.delete("cond/gone")
        assert store.delete_if_unchanged({"cond/gone": version, "cond/never": version}) == frozenset()
        assert list(store.list("cond/")) == []

    def test_a_conditional_batch_deletes_the_unchanged_and_keeps_the_rewritten(self, store: BlobStore) -> None:
        if self._declines(store):
            return
        names = [f"cond/b{i:02d}" for i in range(12)]
        for name in names:
            store.put(name, b"x")
        versions = {name: store.head(name).etag or "" for name in names}
        rewritten = set(names[1::3])
        written = {name: self.again(store, b"x") for name in rewritten}
        for name in rewritten:
            store.put(name, written[name])  # the same bytes (where versions do not follow them): only the version tells
        for name in names[2::3]:
            store.delete(name)
        versions["cond/absent"] = versions[names[0]]
        assert store.delete_if_unchanged(versions) == rewritten
        assert list(store.list("cond/")) == sorted(rewritten)
        assert all(self.raw_get(store, name) == written[name] for name in rewritten)

    def test_a_conditional_delete_refuses_a_bad_name_before_deleting_anything(self, store: BlobStore) -> None:
        if self._declines(store):
            return
        store.put("cond/keep", b"x")
        with pytest.raises(ConfigError):
            store.delete_if_unchanged({"cond/keep": store.head("cond/keep").etag or "", "../escape": "v"})
        assert store.get("cond/keep") == b"x"

    def test_a_rewrite_racing_a_conditional_delete_is_never_lost(self, store: BlobStore) -> None:
        """The rewrite comes after the ``head`` whose version the delete names, so however the two interleave the
        name must end up holding the rewrite: deleted before it and written again, or found changed and kept."""
        if self._declines(store):
            return
        for round_no in range(self.conditional_delete_races):
            name = f"cond/race{round_no % 3}"
            store.put(name, b"old")
            judged = store.head(name).etag or ""
            start = threading.Barrier(2)

            def rewrite(target: str = name, start: threading.Barrier = start) -> None:
                start.wait()
                store.put(target, b"fresh")

            writer = threading.Thread(target=rewrite)
            writer.start()
            start.wait()
            kept = store.delete_if_unchanged({name: judged})
            writer.join()
            assert store.get(name) == b"fresh", f"round {round_no}: the rewrite was lost (kept={set(kept)})"
