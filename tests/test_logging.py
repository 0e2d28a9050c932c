"""Logging: every logger under ``statebackend.``; a restore logs its start and end at INFO with bytes and time; routine
commits, retention and sweeps log nothing at INFO; key fields reach structured handlers as ``extra``."""

from __future__ import annotations

import importlib
import logging
import pkgutil
import shutil
from pathlib import Path
from typing import Any

import pytest
from statebackend.checkpoint import CheckpointId, CheckpointLog, CheckpointV2

import statebackend
from statebackend import TaskStorage
from statebackend.blobstores.memory import MemoryBlobStore
from statebackend.testing.conditional_put_contract import PerSeqMemoryBlobStore
from tests.backend_helpers import counts_config


def _all_modules() -> list[str]:
    import statebackend.backends
    import statebackend.checkpoint

    names = ["statebackend.checkpoint"]
    found = [
        *pkgutil.walk_packages(statebackend.__path__, prefix="statebackend."),
        *pkgutil.walk_packages(statebackend.backends.__path__, prefix="statebackend.backends."),
        *pkgutil.walk_packages(statebackend.checkpoint.__path__, prefix="statebackend.checkpoint."),
    ]
    for info in found:
        if info.name.startswith("statebackend.spark") or info.name.endswith(".__main__"):
            continue  # spark needs pyspark (checked by its source below); a __main__ runs the command
        names.append(info.name)
    return names


def test_every_logger_is_under_statebackend() -> None:
    modules = _all_modules()
    assert "statebackend.backends.changelog.backup" in modules and "statebackend.checkpoint.log" in modules
    loggers = {}
    for name in modules:
        module = importlib.import_module(name)
        for attribute, value in vars(module).items():
            if isinstance(value, logging.Logger):
                loggers[f"{name}.{attribute}"] = value.name
    assert len(loggers) >= 10
    outside = {where: name for where, name in loggers.items() if not name.startswith("statebackend.")}
    assert outside == {}
    spark = Path(statebackend.__file__).parent / "spark"
    for source in spark.glob("*.py"):
        text = source.read_text()
        assert "getLogger(" not in text or "getLogger(__name__)" in text, source


def _config(tmp_path: Path, **extra: Any) -> dict[str, Any]:
    return counts_config(tmp_path, job="clicks", local="state", **extra)


def _fields(record: logging.LogRecord) -> dict[str, Any]:
    return {key: getattr(record, key, None) for key in ("job", "task", "store", "checkpoint_id", "seq", "bytes", "ms")}


def test_restore_start_and_end_at_info_with_bytes_time_and_fields(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    config = _config(tmp_path)
    with TaskStorage.open(config, "task-0") as task:
        counts = task.store("counts")
        for i in range(500):
            counts.put(f"user-{i}", i)
        checkpoint = task.commit_durably({"clicks": "500"})
    shutil.rmtree(tmp_path / "state")  # a new machine: a full restore
    caplog.clear()
    with caplog.at_level(logging.INFO, logger="statebackend"), TaskStorage.open(config, "task-0") as task:
        downloaded = int(task.metrics.counter("restore.bytes"))
    restore_records = [r for r in caplog.records if r.name == "statebackend.restore" and "restor" in r.getMessage()]
    start, end = restore_records
    assert start.levelno == end.levelno == logging.INFO
    assert "restoring checkpoint #1" in start.getMessage()
    assert f"{downloaded} bytes downloaded" in end.getMessage() and downloaded > 0
    assert _fields(start) == {
        "job": "clicks",
        "task": "task-0",
        "store": None,
        "checkpoint_id": str(checkpoint.checkpoint_id),
        "seq": 1,
        "bytes": None,
        "ms": None,
    }
    fields = _fields(end)
    assert fields["bytes"] == downloaded and isinstance(fields["ms"], int) and fields["ms"] >= 0
    assert fields["seq"] == 1 and fields["task"] == "task-0"


@pytest.mark.parametrize("layout", ["head", "per-seq"])
def test_routine_commits_retention_and_sweeps_log_nothing_at_info(
    tmp_path: Path, caplog: pytest.LogCaptureFixture, layout: str
) -> None:
    """On both checkpoint log layouts: the file store's head (conditional writes), and per-seq blobs (a store
    without them), where retention deletes blobs and says so at DEBUG."""
    config = _config(
        tmp_path,
        **{
            "task.checkpoint.retained": 2,
            "changelog.snapshot.interval.commits": 2,
            "changelog.gc.interval.commits": 1,
            "changelog.gc.grace.period.ms": 0,
        },
    )
    blobs = PerSeqMemoryBlobStore() if layout == "per-seq" else None
    with TaskStorage.open(config, "task-0", blob_store=blobs) as task:
        assert task.checkpoint_log.head_mode is (layout == "head")
        task.checkpoint_log.retention_interval = 2  # retention's batches within the commits below
        counts = task.store("counts")
        counts.put("user-0", 0)
        task.commit_durably({"clicks": "0"})
        # a blob no checkpoint names (an attempt's leftover): the next sweep deletes it
        task.blob_store.put("clicks/task-0/counts/changelog/delta/000000000001-0123456789abcdef.delta", b"x")
        caplog.clear()
        trims = task.checkpoint_log.trims
        with caplog.at_level(logging.DEBUG, logger="statebackend"):
            for i in range(1, 12):
                counts.put(f"user-{i % 3}", i)
                task.commit_durably({"clicks": str(i)})
            task.commit_manager.wait()
        deleted = task.metrics.counter("changelog.sweep.deleted")
        retention_batches = task.checkpoint_log.trims - trims
        kept = task.checkpoint_log.seqs()
    routine_info = [r for r in caplog.records if r.levelno >= logging.INFO]
    assert routine_info == []
    # the routine work did happen, and was logged at DEBUG
    assert deleted > 0
    # retained 2, deleted in batches of 2 (per-seq): between 2 and 4 of the 12 checkpoints are left
    assert retention_batches > 0 and kept == list(range(13 - len(kept), 13)) and 2 <= len(kept) <= 4
    debug = [r.getMessage() for r in caplog.records if r.levelno == logging.DEBUG]
    assert any("changelog sweep deleted" in m for m in debug)
    sweep = next(r for r in caplog.records if "changelog sweep deleted" in r.getMessage())
    assert _fields(sweep)["job"] == "clicks" and _fields(sweep)["task"] == "task-0"
    # retention: per-seq, the deletes of old checkpoints' blobs; in the head, each write lets the oldest go
    said = "deleted old checkpoints" if layout == "per-seq" else "into the head"
    retention = next(r for r in caplog.records if r.levelno == logging.DEBUG and said in r.getMessage())
    assert _fields(retention)["job"] == "clicks" and _fields(retention)["task"] == "task-0"


def _checkpoint(n: int) -> CheckpointV2:
    return CheckpointV2(CheckpointId(1_700_000_000_000 + n, 0), {"input": str(n)}, {"changelog": {"s": str(n)}})


def test_the_move_to_the_head_is_info_only_when_it_imports_checkpoints(caplog: pytest.LogCaptureFixture) -> None:
    """A new task's first commit on a store with conditional writes moves its (empty) log to the head: routine, at
    DEBUG. A per-seq log of an earlier release converted (its checkpoints imported) is said at INFO."""
    moved = "moved to the head"
    fresh = MemoryBlobStore()
    with caplog.at_level(logging.DEBUG, logger="statebackend"):
        CheckpointLog(fresh, "clicks", "task-0").write(1, _checkpoint(1))
    said = [r for r in caplog.records if moved in r.getMessage()]
    assert [(r.levelno, "(0 checkpoints imported)" in r.getMessage()) for r in said] == [(logging.DEBUG, True)]
    assert _fields(said[0])["task"] == "task-0" and _fields(said[0])["seq"] == 1

    per_seq = PerSeqMemoryBlobStore()
    for seq in (1, 2):
        CheckpointLog(per_seq, "clicks", "task-0").write(seq, _checkpoint(seq))
    upgraded = MemoryBlobStore()
    for name in per_seq.list(""):
        upgraded.put(name, per_seq.get(name))
    caplog.clear()
    with caplog.at_level(logging.DEBUG, logger="statebackend"):
        CheckpointLog(upgraded, "clicks", "task-0").write(3, _checkpoint(3))
    said = [r for r in caplog.records if moved in r.getMessage()]
    assert [(r.levelno, "(2 checkpoints imported)" in r.getMessage()) for r in said] == [(logging.INFO, True)]
    assert [e.seq for e in CheckpointLog(upgraded, "clicks", "task-0").entries()] == [1, 2, 3]


def test_a_fallback_warning_names_the_store(tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    config = _config(
        tmp_path,
        **{"stores.counts.backup.factories": "changelog,blobsnapshot", "stores.counts.restore.factory": "changelog"},
    )
    with TaskStorage.open(config, "task-0") as task:
        task.store("counts").put("ada", 1)
        task.commit_durably({"clicks": "1"})
    shutil.rmtree(tmp_path / "state")
    for delta in (tmp_path / "blobs").rglob("*.delta"):
        delta.unlink()  # the changelog restore fails; blob-snapshot takes over
    with caplog.at_level(logging.INFO, logger="statebackend"), TaskStorage.open(config, "task-0") as task:
        assert task.store("counts").get("ada") == 1
    (fallback,) = [r for r in caplog.records if r.levelno == logging.ERROR and "falling back" in r.getMessage()]
    assert _fields(fallback)["store"] == "counts" and _fields(fallback)["job"] == "clicks"
