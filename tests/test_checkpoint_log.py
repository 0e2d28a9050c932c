"""The checkpoint log on a blob store, and the local checkpoint file in a store dir."""

from __future__ import annotations

import json
import os
import threading
from pathlib import Path
from typing import Any

import pytest
from statebackend.checkpoint import (
    LOCAL_CHECKPOINT_FILE,
    CheckpointId,
    CheckpointLog,
    CheckpointV1,
    CheckpointV2,
    LogEntry,
    encode_checkpoint,
    read_local_checkpoint,
    remove_local_checkpoint,
    write_local_checkpoint,
)

from statebackend.blobstores.memory import MemoryBlobStore
from statebackend.errors import (
    AlreadyExistsError,
    ConfigError,
    CorruptDataError,
    IncompatibleFormatError,
    NotFoundError,
)
from statebackend.testing.conditional_put_contract import PerSeqMemoryBlobStore

PREFIX = "job/task-0/checkpoints/"


def checkpoint(n: int, batch: str | None = None) -> CheckpointV2:
    """The n-th checkpoint of a task: id and offsets follow n."""
    return CheckpointV2(
        CheckpointId(1_000 + n, n),
        {"batch": batch if batch is not None else str(n)},
        {"changelog": {"counts": f"marker-{n}"}},
    )


@pytest.fixture
def store() -> MemoryBlobStore:
    return PerSeqMemoryBlobStore()


@pytest.fixture
def log(store: MemoryBlobStore) -> CheckpointLog:
    return CheckpointLog(store, "job", "task-0")


# -- writing and reading --------------------------------------------------------------------------------------


def test_empty_log_has_no_latest_and_starts_at_seq_1(log: CheckpointLog) -> None:
    assert log.latest() is None
    assert log.seqs() == [] and log.entries() == []
    assert log.next_seq() == 1


def test_written_checkpoints_read_back_in_the_documented_layout(log: CheckpointLog, store: MemoryBlobStore) -> None:
    for n in (1, 2, 3):
        log.write(n, checkpoint(n))
    assert list(store.list()) == [f"{PREFIX}00000000000{n}.v2.json" for n in (1, 2, 3)]
    assert store.get(f"{PREFIX}000000000002.v2.json") == encode_checkpoint(checkpoint(2), log.binding(2))
    assert log.latest() == LogEntry(3, checkpoint(3))
    assert log.read(2) == LogEntry(2, checkpoint(2))
    assert log.seqs() == [1, 2, 3]
    assert [entry.seq for entry in log.entries()] == [1, 2, 3]
    assert log.next_seq() == 4


def test_read_of_an_absent_seq_is_not_found(log: CheckpointLog) -> None:
    log.write(1, checkpoint(1))
    with pytest.raises(NotFoundError, match="checkpoint 7 of task 'task-0'"):
        log.read(7)


def test_second_writer_of_a_seq_gets_already_exists_and_the_first_checkpoint_stays(log: CheckpointLog) -> None:
    log.write(1, checkpoint(1))
    competing = CheckpointLog(log.blob_store, "job", "task-0")
    with pytest.raises(AlreadyExistsError, match="already committed by another writer"):
        competing.write(1, checkpoint(99))
    assert log.latest() == LogEntry(1, checkpoint(1))


def test_racing_writers_of_one_seq_have_exactly_one_winner(store: MemoryBlobStore) -> None:
    start = threading.Event()
    outcomes: dict[int, str] = {}

    def attempt(n: int) -> None:
        start.wait()
        try:
            CheckpointLog(store, "job", "task-0").write(1, checkpoint(n))
            outcomes[n] = "won"
        except AlreadyExistsError:
            outcomes[n] = "lost"

    threads = [threading.Thread(target=attempt, args=(n,)) for n in range(8)]
    for thread in threads:
        thread.start()
    start.set()
    for thread in threads:
        thread.join()
    winners = [n for n, outcome in outcomes.items() if outcome == "won"]
    assert len(outcomes) == 8 and len(winners) == 1
    assert CheckpointLog(store, "job", "task-0").latest() == LogEntry(1, checkpoint(winners[0]))


def test_retrying_the_identical_write_succeeds(log: CheckpointLog) -> None:
    """A write whose answer was lost can be repeated: same bytes under the same seq is not a competing writer."""
    log.write(1, checkpoint(1))
    log.write(1, checkpoint(1))
    assert log.seqs() == [1]


def test_for_input_offsets_and_find_return_the_newest_match(log: CheckpointLog) -> None:
    log.write(1, checkpoint(1, batch="a"))
    log.write(2, checkpoint(2, batch="b"))
    log.write(3, checkpoint(3, batch="a"))  # a replayed batch
    assert log.for_input_offsets({"batch": "a"}) == LogEntry(3, checkpoint(3, batch="a"))
    assert log.for_input_offsets({"batch": "b"}) == LogEntry(2, checkpoint(2, batch="b"))
    assert log.for_input_offsets({"batch": "c"}) is None
    assert log.for_input_offsets({"batch": "a", "other": "1"}) is None
    found = log.find(lambda entry: entry.seq < 3)
    assert found is not None and found.seq == 2
    assert log.find(lambda entry: False) is None


# -- versions -------------------------------------------------------------------------------------------------


def test_both_versions_are_written_and_read_in_the_order_of_read_versions(store: MemoryBlobStore) -> None:
    CheckpointLog(store, "job", "task-0", write_versions=(1, 2)).write(1, checkpoint(1))
    assert sorted(store.list()) == [f"{PREFIX}000000000001.v1.json", f"{PREFIX}000000000001.v2.json"]
    prefers_v2 = CheckpointLog(store, "job", "task-0", read_versions=(2, 1))
    prefers_v1 = CheckpointLog(store, "job", "task-0", read_versions=(1, 2))
    assert prefers_v2.latest() == LogEntry(1, checkpoint(1))
    assert prefers_v1.latest() == LogEntry(1, CheckpointV1({"batch": "1"}))


def test_v2_blob_is_the_create_only_commit_point_even_when_v1_is_listed_first(store: MemoryBlobStore) -> None:
    writer = CheckpointLog(store, "job", "task-0", write_versions=(1, 2))
    writer.write(1, checkpoint(1))
    with pytest.raises(AlreadyExistsError):
        writer.write(1, checkpoint(2))
    # The loser wrote nothing: the v1 blob still agrees with the v2 blob.
    assert CheckpointLog(store, "job", "task-0", read_versions=(1,)).latest() == LogEntry(1, checkpoint(1).to_v1())


def test_v1_only_history_is_read_when_read_versions_is_1(store: MemoryBlobStore) -> None:
    writer = CheckpointLog(store, "job", "task-0", write_versions=(1,))
    writer.write(1, checkpoint(1))
    writer.write(2, checkpoint(2))
    assert list(store.list()) == [f"{PREFIX}000000000001.v1.json", f"{PREFIX}000000000002.v1.json"]
    reader = CheckpointLog(store, "job", "task-0", read_versions=(1,))
    assert reader.latest() == LogEntry(2, CheckpointV1({"batch": "2"}))
    assert CheckpointLog(store, "job", "task-0", read_versions=(2,)).latest() is None


def test_latest_passes_over_a_newest_seq_without_a_readable_version(store: MemoryBlobStore) -> None:
    """A crash between the v2 commit point and the v1 put leaves seq 2 without v1: a v1 reader sees seq 1."""
    CheckpointLog(store, "job", "task-0", write_versions=(2, 1)).write(1, checkpoint(1))
    CheckpointLog(store, "job", "task-0", write_versions=(2,)).write(2, checkpoint(2))
    reader = CheckpointLog(store, "job", "task-0", read_versions=(1,))
    assert reader.latest() == LogEntry(1, CheckpointV1({"batch": "1"}))
    assert reader.seqs() == [1]
    assert reader.next_seq() == 3  # seq 2 is taken even though this reader cannot read it


def test_a_blob_of_an_unknown_version_is_incompatible(store: MemoryBlobStore, log: CheckpointLog) -> None:
    store.put(f"{PREFIX}000000000001.v2.json", b'{"version":7,"input_offsets":{}}')
    with pytest.raises(IncompatibleFormatError, match="000000000001.v2.json"):
        log.latest()


def test_a_blob_whose_content_version_disagrees_with_its_name_is_corrupt(
    store: MemoryBlobStore, log: CheckpointLog
) -> None:
    store.put(f"{PREFIX}000000000001.v2.json", encode_checkpoint(checkpoint(1).to_v1()))
    with pytest.raises(CorruptDataError, match="name says version 2"):
        log.latest()


@pytest.mark.parametrize(
    "kwargs",
    [
        {"write_versions": ()},
        {"write_versions": (3,)},
        {"read_versions": (2, 2)},
        {"read_versions": (0,)},
        {"retained": 0},
        {"write_versions": 2},
        {"read_versions": "21"},
    ],
)
def test_invalid_settings_are_config_errors(store: MemoryBlobStore, kwargs: dict[str, object]) -> None:
    with pytest.raises(ConfigError):
        CheckpointLog(store, "job", "task-0", **kwargs)  # type: ignore[arg-type]


@pytest.mark.parametrize("name", ["", "a/b", "..", "."])
def test_job_and_task_names_that_would_break_the_layout_are_rejected(store: MemoryBlobStore, name: str) -> None:
    with pytest.raises(ConfigError):
        CheckpointLog(store, "job", name)
    with pytest.raises(ConfigError):
        CheckpointLog(store, name, "task-0")


@pytest.mark.parametrize("seq", [0, -1, 10**12, True])
def test_write_rejects_seqs_outside_the_name_width(log: CheckpointLog, seq: int) -> None:
    with pytest.raises(ConfigError):
        log.write(seq, checkpoint(1))


# -- corruption and foreign names -----------------------------------------------------------------------------


@pytest.mark.parametrize("damage", [b"", b"{not json", b'{"version":2,"checkpoint_id":"1-2"}'])
def test_corrupt_latest_blob_is_an_error_naming_the_blob_not_a_rollback(
    store: MemoryBlobStore, log: CheckpointLog, damage: bytes
) -> None:
    log.write(1, checkpoint(1))
    store.put(f"{PREFIX}000000000002.v2.json", damage)
    with pytest.raises(CorruptDataError, match=f"{PREFIX}000000000002.v2.json"):
        log.latest()
    with pytest.raises(CorruptDataError):
        log.for_input_offsets({"batch": "1"})  # a scan never skips the damaged entry either


def test_foreign_names_under_the_prefix_are_ignored(store: MemoryBlobStore, log: CheckpointLog) -> None:
    log.write(1, checkpoint(1))
    for foreign in (
        f"{PREFIX}000000000009.v2.json.tmp",
        f"{PREFIX}.000000000009.v2.json",
        f"{PREFIX}9.v2.json",
        f"{PREFIX}000000000009.v2.JSON",
        f"{PREFIX}000000000000.v2.json",
        f"{PREFIX}sub/000000000009.v2.json",
        f"{PREFIX}README",
        "job/task-0/checkpointsX/000000000009.v2.json",
        "job/task-01/checkpoints/000000000009.v2.json",
    ):
        store.put(foreign, b"garbage")
    assert log.seqs() == [1]
    assert log.latest() == LogEntry(1, checkpoint(1))
    assert log.next_seq() == 2
    assert log.retain() == []


# -- retention ------------------------------------------------------------------------------------------------


def test_retain_deletes_every_version_of_old_seqs_and_keeps_the_newest(store: MemoryBlobStore) -> None:
    log = CheckpointLog(store, "job", "task-0", write_versions=(2, 1), retained=3)
    for n in range(1, 7):
        log.write(n, checkpoint(n))
    store.put(f"{PREFIX}notes.txt", b"foreign")
    assert log.retain() == [1, 2, 3]
    assert log.seqs() == [4, 5, 6]
    assert sorted(store.list()) == sorted(
        [f"{PREFIX}00000000000{n}.v{v}.json" for n in (4, 5, 6) for v in (1, 2)] + [f"{PREFIX}notes.txt"]
    )
    assert log.retain() == []  # idempotent
    assert log.latest() == LogEntry(6, checkpoint(6))


def test_retain_never_deletes_the_newest_readable_entry(store: MemoryBlobStore) -> None:
    CheckpointLog(store, "job", "task-0", write_versions=(1,)).write(1, checkpoint(1))
    for n in (2, 3):
        CheckpointLog(store, "job", "task-0", write_versions=(2,)).write(n, checkpoint(n))
    v1_reader = CheckpointLog(store, "job", "task-0", read_versions=(1,), retained=1)
    assert v1_reader.retain() == [2]
    assert v1_reader.latest() == LogEntry(1, CheckpointV1({"batch": "1"}))


def test_tasks_and_jobs_have_separate_logs(store: MemoryBlobStore) -> None:
    CheckpointLog(store, "job", "task-0").write(1, checkpoint(1))
    CheckpointLog(store, "job", "task-1").write(1, checkpoint(2))
    CheckpointLog(store, "other", "task-0").write(1, checkpoint(3))
    assert CheckpointLog(store, "job", "task-0").latest() == LogEntry(1, checkpoint(1))
    assert CheckpointLog(store, "job", "task-1").latest() == LogEntry(1, checkpoint(2))
    assert CheckpointLog(store, "other", "task-0").latest() == LogEntry(1, checkpoint(3))


# -- local checkpoint file ------------------------------------------------------------------------------------


def test_local_checkpoint_file_round_trips_and_is_replaced(tmp_path: Path) -> None:
    write_local_checkpoint(tmp_path, checkpoint(1))
    write_local_checkpoint(str(tmp_path), checkpoint(2))
    assert read_local_checkpoint(tmp_path) == checkpoint(2)
    assert (tmp_path / LOCAL_CHECKPOINT_FILE).read_bytes() == encode_checkpoint(checkpoint(2))
    assert sorted(os.listdir(tmp_path)) == [LOCAL_CHECKPOINT_FILE]  # no temp file left behind


def test_absent_local_checkpoint_reads_as_none_and_removal_is_idempotent(tmp_path: Path) -> None:
    assert read_local_checkpoint(tmp_path) is None
    write_local_checkpoint(tmp_path, checkpoint(1))
    remove_local_checkpoint(tmp_path)
    assert read_local_checkpoint(tmp_path) is None
    remove_local_checkpoint(tmp_path)
    remove_local_checkpoint(tmp_path / "no-such-store")


@pytest.mark.parametrize(
    "content",
    [b"", b'{"version":2,"checkpoint_id":"1-', encode_checkpoint(CheckpointV1({"p": "1"}))],
)
def test_corrupt_local_checkpoint_is_an_error_naming_the_path(tmp_path: Path, content: bytes) -> None:
    (tmp_path / LOCAL_CHECKPOINT_FILE).write_bytes(content)
    with pytest.raises(CorruptDataError, match=str(tmp_path / LOCAL_CHECKPOINT_FILE)):
        read_local_checkpoint(tmp_path)


def test_local_checkpoint_into_a_missing_store_dir_is_not_found(tmp_path: Path) -> None:
    with pytest.raises(NotFoundError, match="no-such-store"):
        write_local_checkpoint(tmp_path / "no-such-store", checkpoint(1))


def test_local_checkpoint_file_is_the_canonical_json(tmp_path: Path) -> None:
    write_local_checkpoint(tmp_path, checkpoint(4))
    document = json.loads((tmp_path / LOCAL_CHECKPOINT_FILE).read_text("utf-8"))
    assert document["version"] == 2 and document["checkpoint_id"] == "1004-4"


def test_a_newest_checkpoint_that_vanishes_under_a_newer_one_gives_that_one_and_a_head_that_reaches_it(
    store: MemoryBlobStore,
) -> None:
    """A zombie's checkpoint #3 is listed, then removed by its own fencing while #4 lands: the re-list finds #4, and
    the head handed out with it is at least #4 (a head below the chosen entry made the next writer's fence fail as a
    bad argument)."""
    writer = CheckpointLog(store, "job", "task-0")
    for n in (1, 2, 3):
        writer.write(n, checkpoint(n))
    zombie = writer.blob_name(3, 2)

    class Racing(PerSeqMemoryBlobStore):
        def get(self, name: str, *, start: int | None = None, end: int | None = None) -> bytes:
            if name == zombie:  # between the listing and this read: #3 removed, #4 written
                store.delete(zombie)
                CheckpointLog(store, "job", "task-0").write(4, checkpoint(4))
                raise NotFoundError(f"blob {name!r} not found")
            return store.get(name, start=start, end=end)

        def list(self, prefix: str = "") -> Any:
            return store.list(prefix)

    reader = CheckpointLog(Racing(), "job", "task-0")
    entry, head = reader.latest_and_head()
    assert entry is not None and entry.seq == 4 and entry.checkpoint == checkpoint(4)
    assert head >= entry.seq
