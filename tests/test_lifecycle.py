"""The one open decision (statebackend.lifecycle): made once, as a value, and the fence every opener writes at."""

from __future__ import annotations

import ast
import uuid
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import attrs
import pytest
from statebackend.checkpoint import CheckpointLog

from statebackend.blobstores.base import BlobStore, open_blob_store
from statebackend.config import Settings
from statebackend.errors import CommitConflictError, ConfigError, InconsistentStateError
from statebackend.lifecycle import OpenDecision, decide_open, task_checkpoint_log
from statebackend.restore import restored_stores
from statebackend.task import TaskStorage

ROOT = Path(__file__).resolve().parents[1]


def config_for(local: Path, **extra: Any) -> dict[str, Any]:
    return {
        "job.name": "job",
        "state.local.dir": str(local),
        "blob.store.url": f"memory://{uuid.uuid4().hex}",
        "stores.counts.backup.factories": "changelog",
        "stores.other.backup.factories": "changelog,blobsnapshot",
        "stores.other.restore.factories": "blobsnapshot,changelog",
        **extra,
    }


def commit_rounds(config: dict[str, Any], rounds: int) -> None:
    with TaskStorage.open(config, "task-0") as task:
        for i in range(rounds):
            task.store("counts", typed=False).put(b"k", str(i).encode())
            task.store("other", typed=False).put(b"k", str(i).encode())
            task.commit_durably({"input": str(i)})


@attrs.frozen
class Committed:
    """Task-0 after some commits: its settings, its blob store, its checkpoint log and the open decision made on
    it."""

    settings: Settings
    blobs: BlobStore
    log: CheckpointLog
    decision: OpenDecision


@contextmanager
def committed(tmp_path: Path, rounds: int) -> Iterator[Committed]:
    """Commit ``rounds`` rounds in ``tmp_path/a``, then decide how to open task-0 (its blob store open for the
    block)."""
    config = config_for(tmp_path / "a")
    commit_rounds(config, rounds)
    settings = Settings.from_config(config)
    with open_blob_store(settings.blob_store_url) as blobs:
        log = task_checkpoint_log(settings, blobs, "task-0")
        yield Committed(settings, blobs, log, decide_open(settings, "task-0", log))


def test_the_decision_chooses_the_newest_checkpoint_and_fences_at_the_head(tmp_path: Path) -> None:
    with committed(tmp_path, 3) as done:
        decision = done.decision
    assert decision.seq == 3 and decision.head == 3 and decision.next_seq == 4
    assert decision.known_seq == 3  # the local CHECKPOINT-V2 of the stores
    assert decision.checkpoint is not None and decision.checkpoint.input_offsets == {"input": "2"}
    assert dict(decision.restore_order) == {"counts": ("changelog",), "other": ("blobsnapshot", "changelog")}
    with pytest.raises(attrs.exceptions.FrozenInstanceError):
        decision.head = 9  # type: ignore[misc]


def test_a_decision_rebased_on_an_older_checkpoint_keeps_its_fence_and_the_open_writes_there(tmp_path: Path) -> None:
    with committed(tmp_path, 3) as done:
        settings, blobs, checkpoint_log, listed = done.settings, done.blobs, done.log, done.decision
        older = checkpoint_log.read(1)
        replay = listed.rebased(older, settings)
        assert (replay.seq, replay.head, replay.next_seq) == (1, 3, 4)
        with TaskStorage.open(settings, "task-0", blob_store=blobs, decision=replay) as task:
            assert task.store("counts", typed=False).get(b"k") == b"0"  # the state of checkpoint #1
            assert task.committed_seq == 3
            task.store("counts", typed=False).put(b"k", b"redo")
            task.commit_durably({"input": "redo"})
            assert task.committed_seq == 4  # head + 1, never #2 over the newer history
        assert checkpoint_log.latest() is not None and checkpoint_log.latest().seq == 4  # type: ignore[union-attr]


def test_an_entry_above_the_listing_head_cannot_be_rebased_on(tmp_path: Path) -> None:
    config = config_for(tmp_path / "a")
    commit_rounds(config, 2)
    settings = attrs.evolve(Settings.from_config(config), local_dir=tmp_path / "elsewhere")
    with open_blob_store(settings.blob_store_url) as blobs:
        checkpoint_log = task_checkpoint_log(settings, blobs, "task-0")
        stale = decide_open(settings, "task-0", checkpoint_log, choice=checkpoint_log.read(1))
        with pytest.raises(InconsistentStateError, match="above the head"):
            stale.rebased(checkpoint_log.read(2), settings)


def test_a_decision_made_before_another_commit_is_refused_at_open(tmp_path: Path) -> None:
    """A caller decided, then this machine saw a newer checkpoint durable before the stores were locked: the open
    refuses the stale decision instead of restoring old state under a fence another attempt owns."""
    with committed(tmp_path, 1) as done:
        settings, blobs, decision = done.settings, done.blobs, done.decision
        with TaskStorage.open(settings, "task-0", blob_store=blobs) as other:  # another opener commits meanwhile
            other.store("counts", typed=False).put(b"k", b"newer")
            other.commit_durably({"input": "newer"})
        with pytest.raises(InconsistentStateError, match="short answer"):
            TaskStorage.open(settings, "task-0", blob_store=blobs, decision=decision)


def test_two_attempts_opened_on_one_decision_cannot_both_commit(tmp_path: Path) -> None:
    """The fence comes from the decision: two opens of the same decision (a retry beside a first attempt, each in
    its own directory) target the same seq, and the checkpoint log lets exactly one create it."""
    with committed(tmp_path, 1) as done:
        settings, blobs, decision = done.settings, done.blobs, done.decision
        second = attrs.evolve(settings, local_dir=tmp_path / "b")
        with (
            TaskStorage.open(settings, "task-0", blob_store=blobs, decision=decision) as one,
            TaskStorage.open(second, "task-0", blob_store=blobs, decision=decision) as two,
        ):
            one.store("counts", typed=False).put(b"k", b"one")
            one.commit_durably({"input": "one"})
            two.store("counts", typed=False).put(b"k", b"two")
            with pytest.raises(CommitConflictError):
                two.commit_durably({"input": "two"})


def test_the_open_takes_a_decision_or_a_choice_never_both(tmp_path: Path) -> None:
    with committed(tmp_path, 1) as done:
        settings, blobs, decision = done.settings, done.blobs, done.decision
        with pytest.raises(ConfigError, match="not both"):
            TaskStorage.open(settings, "task-0", blob_store=blobs, decision=decision, fence_seq=1)
        with pytest.raises(ConfigError, match="of task task-0, not task-1"):
            TaskStorage.open(settings, "task-1", blob_store=blobs, decision=decision)


def test_the_read_only_restore_carries_out_the_same_decision(tmp_path: Path) -> None:
    config = config_for(tmp_path / "a")
    commit_rounds(config, 2)
    with restored_stores({**config, "state.local.dir": str(tmp_path / "scratch")}, "task-0") as restored:
        assert isinstance(restored.decision, OpenDecision)
        assert restored.entry is not None and restored.entry.seq == 2
        assert dict(restored.restored_by) == {"counts": "changelog", "other": "blobsnapshot"}
        assert restored.stores["other"].get(b"k") == b"1"


def test_the_task_reports_what_the_spark_side_needs_through_public_methods(tmp_path: Path) -> None:
    config = config_for(tmp_path / "a")
    with TaskStorage.open(config, "task-0") as task:
        assert task.committed_seq == 0 and task.last_checkpoint is None and task.idle
        task.store("counts", typed=False).put(b"k", b"v")
        assert not task.idle  # a write waits to be committed
        pending = task.commit_now({"input": "1"})
        assert task.idle  # flushed into the commit
        pending.result()
        assert task.wait_for_commit() is not None
        assert task.committed_seq == 1 and task.last_checkpoint is not None
        assert not task.write_outcome_unknown


def test_the_checkpoint_log_of_a_task_is_built_in_one_place() -> None:
    """Every CheckpointLog the library makes comes from lifecycle.task_checkpoint_log (the same versions and
    retention everywhere); none is built from settings by hand elsewhere."""
    built = []
    for folder in ("statebackend", "backends"):
        for path in (ROOT / folder).rglob("*.py"):
            for node in ast.walk(ast.parse(path.read_text())):
                if isinstance(node, ast.Call) and isinstance(node.func, ast.Name) and node.func.id == "CheckpointLog":
                    built.append(str(path.relative_to(ROOT)))
    assert built == ["statebackend/lifecycle.py"]


def test_the_spark_side_reaches_into_no_commit_manager() -> None:
    for path in (ROOT / "statebackend" / "spark").glob("*.py"):
        text = path.read_text()
        assert "commit_manager" not in text and "spill_runs" not in text, path.name


@pytest.mark.parametrize("name", ["_x", ".hidden", "-opt", "täsk", "a/b", "x" * 256])
def test_task_names_follow_the_one_name_rule_of_the_config(tmp_path: Path, name: str) -> None:
    config = config_for(tmp_path / "a")
    with pytest.raises(ConfigError, match="task name .* is not valid"):
        TaskStorage.open(config, name)
    with pytest.raises(ConfigError, match="task name .* is not valid"), restored_stores(config, name):
        pass
