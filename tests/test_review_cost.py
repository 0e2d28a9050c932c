"""Adversarial checks of the request-cost changes: retention batches, delete_many, blob-snapshot runs."""

from __future__ import annotations

import base64
import hashlib
import shutil
import threading
import time
import uuid
from pathlib import Path
from typing import Any

import pytest
from statebackend.backends.blobsnapshot.backup import BlobSnapshotBackupManager
from statebackend.backends.changelog.backup import ChangelogBackupManager
from statebackend.checkpoint import CheckpointLog

from statebackend.blobstores.memory import MemoryBlobStore
from statebackend.blobstores.s3 import S3BlobStore
from statebackend.errors import CommitError
from statebackend.task import TaskStorage
from statebackend.testing.backend_contract import contents, write_round
from tests.servers import ServerProcess
from tests.test_delete_many import server_store
from tests.test_retention_batches import blobs_named_by, settle

#: names a service or SDK must escape (XML in S3's DeleteObjects, a URL path in each Azure sub-request); each beside
#: a decoy its wrong decoding would hit
_ODD = [
    "sp ace/a",
    "pct%20x",
    "plus+x",
    "hash#x",
    "q?x=1",
    "amp&x",
    "lt<x>",
    "quote'\"x",
    "é/ü",
    "semi;x",
    "tilde~x",
    "pct%2Fx",
    "colon:x",
    "at@x",
]
_DECOYS = ["pct x", "plus x", "hash", "q", "pct/x"]


@pytest.mark.parametrize(
    "cloud", [pytest.param("s3", marks=pytest.mark.s3), pytest.param("azure", marks=pytest.mark.azure)]
)
def test_delete_many_deletes_exactly_names_that_need_escaping(cloud: str, request: pytest.FixtureRequest) -> None:
    server = request.getfixturevalue("s3_server" if cloud == "s3" else "azurite")
    bucket = f"r{uuid.uuid4().hex[:12]}"
    store = server_store(cloud, server, bucket, "p")
    sibling = server_store(cloud, server, bucket, "p2")  # same names under another root: none of its business
    try:
        odd = [f"odd/{name}" for name in _ODD]
        for name in [*odd, *(f"odd/{decoy}" for decoy in _DECOYS)]:
            store.put(name, b"x")
            sibling.put(name, b"x")
        store.delete_many(odd)
        assert sorted(store.list("odd/")) == sorted(f"odd/{n}" for n in _DECOYS)
        assert sorted(sibling.list("odd/")) == sorted([*odd, *(f"odd/{n}" for n in _DECOYS)])
    finally:
        store.close()
        sibling.close()


# -- two attempts of one task: retention batches, the close's trim and sweeps from the older one --------------------

RETAINED = 2
INTERVAL = 3
PREFIX = "job/task-0/counts/"


def _config(local: Path, url: str, factories: str) -> dict[str, Any]:
    return {
        "job.name": "job",
        "state.local.dir": str(local),
        "blob.store.url": url,
        "stores.counts.backup.factories": factories,
        "task.checkpoint.retained": RETAINED,
        "changelog.snapshot.interval.commits": 3,
        "changelog.snapshot.interval.ratio": 0,
        "blobsnapshot.compaction.fanout": 2,
        "blobsnapshot.compaction.full.min.bytes": 0,
        "blobsnapshot.gc.interval.commits": 0,
        "changelog.gc.interval.commits": 0,
        # the harshest sweeps: whatever a sweep does not mark goes at once
        "blobsnapshot.gc.grace.period.ms": 0,
        "changelog.gc.grace.period.ms": 0,
        "blobsnapshot.ttl.ms": 1,
    }


def _assert_log_keeps_its_blobs(inner: MemoryBlobStore, when: str) -> None:
    present = set(inner.list(PREFIX))
    for entry in CheckpointLog(inner, "job", "task-0").entries():
        missing = blobs_named_by(inner, entry) - present
        assert not missing, f"{when}: checkpoint #{entry.seq} the log holds lost {missing}"


@pytest.mark.parametrize("factories", ["changelog", "blobsnapshot"])
@pytest.mark.parametrize("older_commits_again", [False, True])
def test_an_older_attempts_close_and_sweep_keep_every_blob_of_the_new_owners_checkpoints(
    tmp_path: Path, factories: str, older_commits_again: bool
) -> None:
    inner = MemoryBlobStore()
    url = f"memory://{uuid.uuid4().hex}"
    model: dict[bytes, bytes] = {}
    older = TaskStorage.open(_config(tmp_path / "older", url, factories), "task-0", blob_store=inner)
    older.checkpoint_log.retention_interval = INTERVAL
    for round_no in range(8):  # a full window, garbage, and a retention batch or two
        write_round(older, round_no, model)
        older.commit_durably({"input": str(round_no)})
        settle(older)
    with TaskStorage.open(_config(tmp_path / "owner", url, factories), "task-0", blob_store=inner) as owner:
        owner.checkpoint_log.retention_interval = INTERVAL
        for round_no in range(8, 20):
            write_round(owner, round_no, model)
            owner.commit_durably({"input": str(round_no)})
            settle(owner)
            _assert_log_keeps_its_blobs(inner, f"owner round {round_no}")
        expected = dict(model)
        # the older attempt, unaware, sweeps (its mark reads the log) ...
        orphan = PREFIX + (
            "changelog/delta/000000000001-00000000deadbeef.delta"
            if factories == "changelog"
            else "blobsnapshot/runs/" + "ab" * 32
        )
        inner.put(orphan, b"x", metadata={"created_at": "1000.000"})
        for binding in older.commit_manager.backups:
            assert isinstance(binding.manager, (ChangelogBackupManager, BlobSnapshotBackupManager))
            binding.manager.sweep()
        assert not inner.exists(orphan), "the sweep ran: it took what nothing names"
        _assert_log_keeps_its_blobs(inner, "after the older attempt's sweep")
        if older_commits_again:
            write_round(older, 99, {})
            with pytest.raises(CommitError):
                older.commit_durably({"input": "older"})
        # ... and closes (not a handover: it trims on its last listing, now stale)
        older.close()
        _assert_log_keeps_its_blobs(inner, "after the older attempt's close")
        write_round(owner, 20, model)
        owner.commit_durably({"input": "20"})
        expected = dict(model)
        settle(owner)
        _assert_log_keeps_its_blobs(inner, "after the owner's next commit")
    _assert_log_keeps_its_blobs(inner, "after the owner's close")
    shutil.rmtree(tmp_path / "owner")
    with TaskStorage.open(_config(tmp_path / "check", url, factories), "task-0", blob_store=inner) as check:
        assert contents(check) == expected


@pytest.mark.s3
def test_s3_delete_objects_carries_a_content_md5(s3_server: ServerProcess) -> None:
    """DeleteObjects is the one S3 request that must carry a body checksum. botocore (1.36 on) sends only a CRC32
    header; S3-compatible servers that follow the older rule refuse it ("MissingContentMD5"), and there every delete
    of retention, the sweeps and a fenced write's clean-up would fail (a per-name DELETE needed none). The request
    carries the Content-MD5 of its body as well, which S3 itself accepts."""
    store = server_store("s3", s3_server, f"r{uuid.uuid4().hex[:12]}", "p")
    seen: list[tuple[Any, Any]] = []

    def capture(request: Any, **_: Any) -> None:
        seen.append((request.headers.get("Content-MD5"), request.body))

    inner = store.inner if hasattr(store, "inner") else store
    assert isinstance(inner, S3BlobStore)
    inner._client.meta.events.register("before-send.s3.DeleteObjects", capture)
    try:
        store.put("a", b"x")
        store.delete_many(["a", "b"])
        assert list(store.list("")) == []
        assert len(seen) == 1
        md5, body = seen[0]
        body = body if isinstance(body, bytes) else body.encode() if isinstance(body, str) else body.read()
        assert md5 is not None, "DeleteObjects sent without Content-MD5"
        md5 = md5.decode() if isinstance(md5, bytes) else md5
        assert md5 == base64.b64encode(hashlib.md5(body).digest()).decode()
    finally:
        store.close()


# -- a sweep's batch and a writer's refresh ------------------------------------------------------------------------


def test_a_doomed_blob_waits_in_a_sweeps_batch_no_longer_than_the_batch_wait() -> None:
    """A writer names a blob no checkpoint names only after making it young (``GraceRule.may_name``; blob-snapshot
    writes an old run again, same bytes, fresh ``created_at``). The age rule is sound only if the age a sweep acts
    on is the blob's age when it deletes it: one by one, a delete followed its HEAD at once; batched, a doomed blob
    would wait for up to 999 more HEADs, and a refresh in between would be lost with it. So a batch goes once its
    first blob has waited ``SWEEP_BATCH_WAIT_S`` since its judgment: here each HEAD takes 30 ms, and a blob refreshed
    after 8 more HEADs (240 ms, past the wait) survives, while the blobs judged before it were deleted in time."""
    from statebackend.kit import GraceRule, Mark, created_at_metadata, sweep_unreferenced
    from statebackend.kit.gc import SWEEP_BATCH_WAIT_S

    assert SWEEP_BATCH_WAIT_S <= 0.1
    now = 10_000.0
    names = [f"g/run-{i:02d}" for i in range(12)]
    refreshed = names[0]
    deleted_at: dict[str, float] = {}
    judged_at: dict[str, float] = {}
    refreshed_at: list[float] = []

    class Store(MemoryBlobStore):
        supports_conditional_delete = False  # the sweep takes its delete_many path, which this test watches

        def head(self, name: str) -> Any:
            time.sleep(0.03)
            if name == names[9]:  # 8 HEADs after run-00's: the writer refreshes run-00 to name it
                self.put(refreshed, b"a", metadata=created_at_metadata(now))
                refreshed_at.append(time.monotonic())
            info = super().head(name)
            judged_at[name] = time.monotonic()
            return info

        def delete_many(self, batch: Any) -> Any:
            for name in batch:
                deleted_at[name] = time.monotonic()
            return super().delete_many(batch)

    store = Store()
    for name in names:
        store.put(name, b"x", metadata=created_at_metadata(now - 7_200))
    swept = sweep_unreferenced(store, "g/", Mark(frozenset(), at=now), GraceRule(3_600_000), clock=lambda: now, now=now)
    assert store.exists(refreshed), "a blob refreshed to be named was deleted on its old age"
    assert store.get(refreshed) == b"a"
    assert refreshed in swept.deleted and deleted_at[refreshed] < refreshed_at[0], (
        "the old blob's delete went before the writer wrote it again"
    )
    assert set(swept.deleted) == set(names), "every blob judged old was deleted"
    assert len({deleted_at[name] for name in names}) > 1, "the twelve blobs went in more than one batch"
    # each went within the wait, counted in the work done meanwhile rather than in seconds (a loaded machine stalls
    # any thread for longer than the wait): once its wait had passed, at most the HEAD that noticed it ended before
    # its delete, plus one that ended between the judgment's timestamp here and the sweep's own. A sweep that held
    # its batch to the end would see every later HEAD end first
    for name in swept.deleted:
        late = [head for head, at in judged_at.items() if judged_at[name] + SWEEP_BATCH_WAIT_S < at < deleted_at[name]]
        assert len(late) <= 2, f"{name} waited in its batch past the wait, through the HEADs of {late}"


@pytest.mark.parametrize("factories", ["changelog", "blobsnapshot"])
def test_an_older_attempts_close_racing_the_new_owners_commits_keeps_their_blobs(
    tmp_path: Path, factories: str
) -> None:
    """The older attempt's close (its trim on a stale listing, then its backends' garbage) runs while the new owner
    commits and trims: no checkpoint the log holds loses a blob, and the owner's last one restores exactly."""
    inner = MemoryBlobStore()
    url = f"memory://{uuid.uuid4().hex}"
    model: dict[bytes, bytes] = {}
    older = TaskStorage.open(_config(tmp_path / "older", url, factories), "task-0", blob_store=inner)
    older.checkpoint_log.retention_interval = INTERVAL
    for round_no in range(9):
        write_round(older, round_no, model)
        older.commit_durably({"input": str(round_no)})
    settle(older)
    assert older.commit_manager._last_listing is not None, "the close has a trim to make"
    with TaskStorage.open(_config(tmp_path / "owner", url, factories), "task-0", blob_store=inner) as owner:
        owner.checkpoint_log.retention_interval = INTERVAL
        closing = threading.Thread(target=older.close)
        for round_no in range(9, 21):
            if round_no == 10:
                closing.start()
            write_round(owner, round_no, model)
            owner.commit_durably({"input": str(round_no)})
        closing.join(timeout=60)
        settle(owner)
        _assert_log_keeps_its_blobs(inner, "after the race")
    shutil.rmtree(tmp_path / "owner")
    with TaskStorage.open(_config(tmp_path / "check", url, factories), "task-0", blob_store=inner) as check:
        assert contents(check) == model
