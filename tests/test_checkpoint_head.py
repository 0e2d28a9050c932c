"""The checkpoint head: on a blob store with conditional writes, a task's checkpoint log is one blob written by
compare-and-swap (checkpoint/log.py, docs/formats-checkpoint.md). Fencing, lost replies, racing attempts and the
move of a per-seq log to the head, on memory, file://, Azurite and moto's S3."""

from __future__ import annotations

import json
import threading
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from statebackend.checkpoint import CheckpointId, CheckpointLog, CheckpointV2
from statebackend.checkpoint.log import HEAD_BLOB

from statebackend.blobstores.base import BlobStore, open_blob_store
from statebackend.blobstores.file import FileBlobStore
from statebackend.blobstores.memory import MemoryBlobStore
from statebackend.blobstores.resilience import ResilientBlobStore
from statebackend.errors import (
    AlreadyExistsError,
    CommitConflictError,
    IncompatibleFormatError,
    StorageError,
    TransientStorageError,
)
from statebackend.metrics import Metrics
from statebackend.task import TaskStorage
from statebackend.testing.backend_contract import contents, write_round
from statebackend.testing.conditional_put_contract import LostReplyStore, PerSeqMemoryBlobStore
from tests.backend_helpers import commit_round
from tests.servers import ServerProcess

PREFIX = "job/task-0/checkpoints/"
RETAINED = 4


def checkpoint(n: int, writer: str = "a") -> CheckpointV2:
    return CheckpointV2(CheckpointId(1_700_000_000_000 + n, 0), {"input": f"{writer}{n}"}, {"changelog": {"s": str(n)}})


@pytest.fixture(params=["memory", "file", "s3", "az"])
def store(request: pytest.FixtureRequest, tmp_path: Path) -> Iterator[BlobStore]:
    kind = request.param
    if kind == "memory":
        yield MemoryBlobStore()
        return
    if kind == "file":
        yield FileBlobStore(str(tmp_path / "blobs"))
        return
    name = f"b{uuid.uuid4().hex[:20]}"
    if kind == "s3":
        server: ServerProcess = request.getfixturevalue("s3_server")
        options: dict[str, Any] = {"endpoint.url": server.endpoint, "create.if.missing": True}
        url = f"s3://{name}/p"
    else:
        options = {"connection.string": request.getfixturevalue("azurite_connection"), "create.if.missing": True}
        url = f"az://{name}/p"
    with open_blob_store(url, options) as opened:
        opened.create_resources()
        yield opened


def log_on(store: BlobStore, **kwargs: Any) -> CheckpointLog:
    return CheckpointLog(store, "job", "task-0", retained=RETAINED, recheck_delays=(), **kwargs)


class Hiding(LostReplyStore):
    """The same blobs through a store that does not claim conditional writes: how a release without the head (or a
    third-party store) sees the log."""

    def __init__(self, inner: BlobStore) -> None:
        super().__init__(inner)
        self.supports_conditional_put = False

    def delete_many(self, names: list[str]) -> None:
        self.inner.delete_many(names)


def test_a_commit_is_one_conditional_write_of_the_head_and_retention_is_implicit(store: BlobStore) -> None:
    log = log_on(store)
    assert log.head_mode and log.latest_and_head() == (None, 0)
    for n in range(1, 12):
        log.write(n, checkpoint(n))
    assert sorted(store.list(PREFIX)) == [f"{PREFIX}000000000001.v2.json", PREFIX + HEAD_BLOB]
    reader = log_on(store)
    entry, head = reader.latest_and_head()
    assert head == 11 and entry is not None and entry.checkpoint == checkpoint(11)
    assert reader.seqs() == list(range(12 - RETAINED, 12))
    assert [e.seq for e in reader.entries()] == list(range(12 - RETAINED, 12))
    assert reader.read(9).checkpoint == checkpoint(9)
    found = reader.for_input_offsets({"input": "a9"})
    assert found is not None and found.seq == 9  # Spark's replay of an older batch finds its checkpoint
    document = json.loads(store.get(PREFIX + HEAD_BLOB))
    assert document["format"] == 3 and document["seq"] == 11 and len({e["nonce"] for e in document["entries"]}) == 4


def test_a_zombie_with_a_stale_version_is_fenced_and_nothing_of_it_is_visible(store: BlobStore) -> None:
    owner, zombie = log_on(store), log_on(store)
    owner.write(1, checkpoint(1))
    assert zombie.latest_and_head()[1] == 1  # the zombie's restore decision
    owner.latest_and_head()
    owner.write(2, checkpoint(2, "owner"))
    with pytest.raises(AlreadyExistsError):
        zombie.write(2, checkpoint(2, "zombie"))
    entry = log_on(store).latest()
    assert entry is not None and entry.checkpoint == checkpoint(2, "owner")


def test_a_zombie_that_restored_before_a_retention_is_fenced(store: BlobStore) -> None:
    owner, zombie = log_on(store), log_on(store)
    owner.write(1, checkpoint(1))
    assert zombie.latest_and_head()[1] == 1
    for n in range(2, 2 + 3 * RETAINED):  # the window moved far past the seq the zombie writes
        owner.write(n, checkpoint(n, "owner"))
    with pytest.raises(AlreadyExistsError):
        zombie.write(2, checkpoint(2, "zombie"))
    reader = log_on(store)
    assert reader.head() == 1 + 3 * RETAINED
    assert all(e.checkpoint.input_offsets["input"].startswith("owner") for e in reader.entries())


@pytest.mark.parametrize("empty", [True, False], ids=["empty-task", "after-a-commit"])
def test_racing_attempts_have_exactly_one_winner(store: BlobStore, empty: bool) -> None:
    """Two attempts that restored the same head (or started at once on an empty task) write the same seq at once."""
    if not empty:
        log_on(store).write(1, checkpoint(1))
    attempts = [log_on(store) for _ in range(2)]
    heads = [attempt.latest_and_head()[1] for attempt in attempts]
    assert heads == [0, 0] if empty else heads == [1, 1]
    seq = heads[0] + 1
    barrier = threading.Barrier(2)
    outcomes: dict[int, object] = {}

    def commit(index: int) -> None:
        barrier.wait()
        try:
            attempts[index].write(seq, checkpoint(seq, f"w{index}"))
            outcomes[index] = "ok"
        except BaseException as exc:  # noqa: BLE001 - each outcome is checked below
            outcomes[index] = exc

    threads = [threading.Thread(target=commit, args=(i,)) for i in range(2)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    winners = [i for i, outcome in outcomes.items() if outcome == "ok"]
    assert len(winners) == 1, outcomes
    assert all(isinstance(o, AlreadyExistsError) for i, o in outcomes.items() if i not in winners), outcomes
    entry = log_on(store).latest()
    assert entry is not None and entry.seq == seq and entry.checkpoint == checkpoint(seq, f"w{winners[0]}")


@pytest.mark.parametrize("landed", [True, False], ids=["landed", "not-landed"])
def test_a_lost_reply_is_resolved_by_reading_the_head_back(store: BlobStore, landed: bool) -> None:
    """Without the resilience layer the error reaches the log's writer (as after every retry failed): the next
    commit reads the head back once (``holds``) and decides by its nonce."""
    lossy = LostReplyStore(store)
    log = log_on(lossy)
    log.write(1, checkpoint(1))
    log.write(2, checkpoint(2))
    lossy.lose_next = landed
    with pytest.raises(TransientStorageError):
        log.write(3, checkpoint(3))
    assert log.holds(3, checkpoint(3)) is landed
    other = log_on(store)  # a writer that did not write it never claims it, identical checkpoint or not
    other.latest_and_head()
    assert not other.holds(3, checkpoint(3))
    if landed:
        log.fence(3)
        log.write(4, checkpoint(4))
        assert log_on(store).head() == 4
    else:
        log.write(3, checkpoint(3))  # the seq is still free: the same write goes through
        assert log_on(store).head() == 3


@pytest.mark.parametrize("landed", [True, False], ids=["landed", "not-landed"])
def test_the_resilience_layer_reads_a_lost_head_write_back(store: BlobStore, landed: bool) -> None:
    lossy = LostReplyStore(store)
    resilient = ResilientBlobStore(lossy, max_attempts=1, base_delay_s=0.0, max_delay_s=0.0)
    try:
        log = log_on(resilient)
        log.write(1, checkpoint(1))
        lossy.lose_next = landed
        if landed:
            log.write(2, checkpoint(2))  # landed: the read-back finds its bytes, the write succeeds
        else:
            with pytest.raises(TransientStorageError):
                log.write(2, checkpoint(2))
        assert log_on(store).head() == (2 if landed else 1)
    finally:
        resilient.close()


def test_an_older_releases_per_seq_log_opens_and_moves_to_the_head_at_the_first_commit(store: BlobStore) -> None:
    old = log_on(Hiding(store))
    for n in range(1, 8):
        old.write(n, checkpoint(n))
    log = log_on(store)
    entry, head = log.latest_and_head()
    assert head == 7 and entry is not None and entry.checkpoint == checkpoint(7)
    log.write(8, checkpoint(8))
    assert sorted(store.list(PREFIX)) == [f"{PREFIX}000000000008.v2.json", PREFIX + HEAD_BLOB]
    reader = log_on(store)
    assert [e.seq for e in reader.entries()] == list(range(9 - RETAINED, 9))
    assert [e.checkpoint for e in reader.entries()] == [checkpoint(n) for n in range(9 - RETAINED, 9)]
    log.write(9, checkpoint(9))
    # rollback: a release without the head finds the move marker first and refuses it, never the stale log
    with pytest.raises(IncompatibleFormatError, match="head"):
        log_on(Hiding(store)).latest()
    marker = json.loads(store.get(f"{PREFIX}000000000008.v2.json"))
    assert marker["format"] == 3 and marker["version"] == 3  # refused by blob format 2 readers and older ones too


def test_a_move_whose_head_write_failed_is_finished_by_the_next_commit(store: BlobStore) -> None:
    class HeadFails(LostReplyStore):
        def put_if(self, name: str, data: bytes, *, version: str | None) -> str:
            raise StorageError("the head write failed (test)")

    old = log_on(Hiding(store))
    for n in range(1, 4):
        old.write(n, checkpoint(n))
    with pytest.raises(StorageError):
        log_on(HeadFails(store)).write(4, checkpoint(4))
    log = log_on(store)
    entry, head = log.latest_and_head()  # the marker holds checkpoint 4: durable as a per-seq commit
    assert head == 4 and entry is not None and entry.checkpoint == checkpoint(4)
    log.write(5, checkpoint(5))
    assert [e.seq for e in log_on(store).entries()] == [2, 3, 4, 5]


def config_for(local: Path) -> dict[str, Any]:
    return {
        "job.name": "job",
        "state.local.dir": str(local),
        "blob.store.url": "memory://unused",
        "stores.counts.backup.factories": "changelog",
        "task.checkpoint.retained": RETAINED,
    }


def test_a_zombie_task_is_fenced_with_commit_conflict_and_the_owner_goes_on(tmp_path: Path) -> None:
    blobs = MemoryBlobStore()
    model: dict[bytes, bytes] = {}
    with TaskStorage.open(config_for(tmp_path / "first"), "task-0", blob_store=blobs) as task:
        commit_round(task, 0, model)
    zombie = TaskStorage.open(config_for(tmp_path / "zombie"), "task-0", blob_store=blobs)
    try:
        owner_model = dict(model)
        with TaskStorage.open(config_for(tmp_path / "owner"), "task-0", blob_store=blobs) as owner:
            for round_no in range(1, 2 + 2 * RETAINED):
                commit_round(owner, round_no, owner_model)
        write_round(zombie, 99, dict(model))
        with pytest.raises(CommitConflictError):
            zombie.commit_durably({"input": "zombie"})
    finally:
        zombie.close()
    with TaskStorage.open(config_for(tmp_path / "later"), "task-0", blob_store=blobs) as task:
        assert task.restored is not None and task.restored.input_offsets == {"input": str(1 + 2 * RETAINED)}
        assert contents(task) == owner_model


def test_an_older_releases_task_converts_at_its_first_commit_and_restores_exactly(tmp_path: Path) -> None:
    name = uuid.uuid4().hex
    model: dict[bytes, bytes] = {}
    with TaskStorage.open(config_for(tmp_path / "old"), "task-0", blob_store=PerSeqMemoryBlobStore(name)) as task:
        for round_no in range(3):
            commit_round(task, round_no, model)
    blobs = MemoryBlobStore(name)
    with TaskStorage.open(config_for(tmp_path / "new"), "task-0", blob_store=blobs) as task:
        assert task.restored is not None and task.restored.input_offsets == {"input": "2"}
        assert contents(task) == model
        commit_round(task, 3, model)
    assert blobs.exists(PREFIX + HEAD_BLOB)
    with TaskStorage.open(config_for(tmp_path / "cold"), "task-0", blob_store=blobs) as task:
        assert task.restored is not None and task.restored.input_offsets == {"input": "3"}
        assert contents(task) == model


def test_an_idle_commit_is_one_request_and_a_warm_open_one(tmp_path: Path) -> None:
    metrics = Metrics()
    blobs = ResilientBlobStore(MemoryBlobStore(), metrics=metrics)
    model: dict[bytes, bytes] = {}

    def requests() -> float:
        return sum(v for (n, _), v in metrics.export().counters.items() if n == "blob_store.requests")

    with TaskStorage.open(config_for(tmp_path / "a"), "task-0", blob_store=blobs) as task:
        commit_round(task, 0, model)
        commit_round(task, 1, model)
        before = requests()
        task.commit_durably({"input": "2"})
        task.commit_manager.wait()
        assert requests() - before == 1  # the conditional write of the head, nothing else
    before = requests()
    with TaskStorage.open(config_for(tmp_path / "a"), "task-0", blob_store=blobs) as task:
        assert task.restored is not None
        assert requests() - before <= 2  # a warm open: one read of the head (and the backend's own, if any)
        assert contents(task) == model
