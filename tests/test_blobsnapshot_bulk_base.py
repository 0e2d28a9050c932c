"""A bulk load becomes an environment-file base (issue 32): a blob-snapshot commit whose change holds
``upload.base.min.records`` records and ``upload.base.ratio`` of the store's keys is uploaded as a base run of the
whole store (an LMDB environment file), not as a run of its records, so a cold restore right after it opens the
base instead of re-inserting every key; smaller commits stay runs; the runs a bulk base replaces are collected by
the usual lifetime rules; and a SIGKILL at each step of such a commit, or of the cold restore of its base, restores
exactly the last durable checkpoint (tests/bulk_base_child.py is the killed process)."""

from __future__ import annotations

import logging
import os
import shutil
import signal
import subprocess
import sys
from pathlib import Path
from typing import Any

import attrs
import pytest
from statebackend.backends.blobsnapshot.backup import read_marker
from statebackend.backends.blobsnapshot.format import RunIndex, run_name, runs_prefix
from statebackend.backends.blobsnapshot.state import BASE_LEVEL
from statebackend.checkpoint import CheckpointLog, CheckpointV2

from statebackend.blobstores.file import FileBlobStore
from statebackend.envbase import is_env_base
from statebackend.errors import ConfigError
from statebackend.task import TaskStorage
from tests.bulk_base_child import KEYS, REBULK, STORE, TASK, config, expected_state, operations
from tests.waiting import scaled

REPO = Path(__file__).resolve().parent.parent
PREFIX = f"job/{TASK}/{STORE}/blobsnapshot/"
RESTORE_LOGGER = "statebackend.backends.blobsnapshot.restore"


def _commit(task: Any, n: int) -> None:
    store = task.store(STORE)
    for key, value in operations(n):
        if value is None:
            store.delete(key)
        else:
            store.put(key, value)
    task.commit_durably({"input": str(n)})


def _contents(task: Any) -> dict[bytes, bytes]:
    return dict(task.store(STORE).items())


def _latest_index(workdir: Path) -> RunIndex:
    blob_store = FileBlobStore(str(workdir / "blobs"), create=False)
    entry = CheckpointLog(blob_store, "job", TASK).latest()
    assert entry is not None and isinstance(entry.checkpoint, CheckpointV2)
    marker = entry.checkpoint.markers_for("blobsnapshot")[STORE]
    return read_marker(blob_store, marker, job="job", task=TASK, store=STORE)


def _is_env_base_blob(workdir: Path, run_hash: str) -> bool:
    blob_store = FileBlobStore(str(workdir / "blobs"), create=False)
    return is_env_base(blob_store.get(run_name(PREFIX, run_hash), start=0, end=8))


def _restore_report(caplog: pytest.LogCaptureFixture) -> dict[str, Any]:
    """The blob-snapshot restore's report of the store: the fields of its INFO record (runs applied, whether the
    base was opened as an environment file, records re-inserted)."""
    records = [vars(r) for r in caplog.records if r.name == RESTORE_LOGGER and hasattr(r, "inserted")]
    assert len(records) == 1, [r.getMessage() for r in caplog.records if r.name == RESTORE_LOGGER]
    return records[0]


# -- in one process ------------------------------------------------------------------------------------------------


def test_a_bulk_first_commit_is_a_base_and_a_cold_restore_after_updates_opens_it(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """The independent check, small: a bulk load committed durably, then update commits, then a cold restore."""
    with TaskStorage.open(config(tmp_path), TASK) as task:
        _commit(task, 1)
        assert task.metrics.counter("blobsnapshot.base.runs") == 1
        index = _latest_index(tmp_path)
        assert [(run.base, run.level, run.records) for run in index.runs] == [(True, BASE_LEVEL, KEYS)]
        assert _is_env_base_blob(tmp_path, index.runs[0].hash)
        for n in (2, 3):
            _commit(task, n)
        # an update commit is a run of its change, on top of the base
        index = _latest_index(tmp_path)
        assert [run.base for run in index.runs] == [True, False, False]
        assert [run.records for run in index.runs[1:]] == [len(operations(2)), len(operations(3))]
        assert task.metrics.counter("blobsnapshot.base.runs") == 1
    shutil.rmtree(tmp_path / "local")
    caplog.set_level(logging.INFO, logger=RESTORE_LOGGER)
    with TaskStorage.open(config(tmp_path), TASK) as task:
        assert _contents(task) == expected_state(3)
        report = _restore_report(caplog)
        assert report["env_base"] is True
        assert report["runs_applied"] == 3
        # only the two update runs were re-inserted, never the bulk load's keys
        assert report["inserted"] == len(operations(2)) + len(operations(3))


def test_with_the_bulk_base_off_the_same_history_re_inserts_the_bulk_load(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """The control: ``upload.base.min.records`` above the load keeps the first run a run of records, re-inserted
    at every cold restore (what the bulk base saves)."""
    settings = {**config(tmp_path), "blobsnapshot.upload.base.min.records": 10 * KEYS}
    with TaskStorage.open(settings, TASK) as task:
        for n in (1, 2, 3):
            _commit(task, n)
        assert task.metrics.counter("blobsnapshot.base.runs") == 0
    assert [run.base for run in _latest_index(tmp_path).runs] == [False, False, False]
    shutil.rmtree(tmp_path / "local")
    caplog.set_level(logging.INFO, logger=RESTORE_LOGGER)
    with TaskStorage.open(settings, TASK) as task:
        assert _contents(task) == expected_state(3)
        report = _restore_report(caplog)
        assert report["env_base"] is False
        assert report["inserted"] >= KEYS


def test_a_bulk_commit_over_a_chain_replaces_it_with_a_base_and_its_runs_are_collected(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """A second bulk commit (every key rewritten) over base + runs: a new base, the chain restarts there, and once
    the checkpoints that named the old chain leave retention its blobs are deleted (and none a retained checkpoint
    names)."""
    with TaskStorage.open(config(tmp_path), TASK) as task:
        task.checkpoint_log.retention_interval = 2
        for n in range(1, REBULK):
            _commit(task, n)
        old_chain = {run.hash for run in _latest_index(tmp_path).runs}
        _commit(task, REBULK)
        index = _latest_index(tmp_path)
        assert len(index.runs) == 1 and index.runs[0].base and index.runs[0].hash not in old_chain
        assert task.metrics.counter("blobsnapshot.base.runs") == 2
        for n in range(REBULK + 1, REBULK + 6):
            _commit(task, n)
    blob_store = FileBlobStore(str(tmp_path / "blobs"), create=False)
    stored = set(blob_store.list(runs_prefix(PREFIX)))
    needed = _runs_named_by_the_log(tmp_path)
    assert needed <= stored, f"runs a retained checkpoint names are gone: {sorted(needed - stored)}"
    assert not {run_name(PREFIX, h) for h in old_chain} & stored, "the chain the bulk base replaced was not collected"
    shutil.rmtree(tmp_path / "local")
    caplog.set_level(logging.INFO, logger=RESTORE_LOGGER)
    with TaskStorage.open(config(tmp_path), TASK) as task:
        assert _contents(task) == expected_state(REBULK + 5)
        assert _restore_report(caplog)["env_base"] is True


@pytest.mark.parametrize(("ratio", "base"), [(0.5, False), (0.3, True)])
def test_a_commit_is_a_base_only_when_it_holds_the_configured_share_of_the_store(
    tmp_path: Path, ratio: float, base: bool
) -> None:
    """1,200 changes over a 3,000-key store: at least ``upload.base.min.records`` (1,000), and 40% of the keys: a run
    at ratio 0.5, a base at 0.3."""
    settings = {**config(tmp_path), "blobsnapshot.upload.base.ratio": ratio}
    with TaskStorage.open(settings, TASK) as task:
        _commit(task, 1)
        store = task.store(STORE)
        for i in range(0, 1_200):
            store.put(f"key{i:06d}".encode(), b"changed")
        task.commit_durably({"input": "2"})
        assert task.metrics.counter("blobsnapshot.base.runs") == 1 + int(base)
    index = _latest_index(tmp_path)
    assert [run.base for run in index.runs] == ([True] if base else [True, False])


@pytest.mark.parametrize(
    ("key", "value", "allowed"),
    [
        ("blobsnapshot.upload.base.ratio", 1.5, "1"),
        ("blobsnapshot.upload.base.min.records", 0, "1"),
    ],
)
def test_bad_bulk_base_options_are_refused_naming_the_key(
    tmp_path: Path, key: str, value: object, allowed: str
) -> None:
    with pytest.raises(ConfigError) as raised:
        TaskStorage.open({**config(tmp_path), key: value}, TASK)
    assert key in str(raised.value) and allowed in str(raised.value)


# -- killed processes ----------------------------------------------------------------------------------------------

COMMITS = 7  # commits the crashing child attempts
MORE = 2  # commits each restoring child adds


@attrs.frozen
class Durable:
    """The durable commit a crash must leave: in [low, high]; and whether the commit in flight landed (the child's
    own log of durable commits is then exact: it cannot record a commit it died in), ``None`` for a point off the
    task's thread."""

    low: int
    high: int
    landed: bool | None = False


#: crash point -> the durable checkpoint it implies. Commit 1 is the bulk load, commit REBULK (4) the bulk commit over
#: a chain; every commit uploads one blob (no compaction at these sizes), so the nth run upload is commit n's.
CRASH_POINTS: dict[str, Durable] = {
    # the bulk load's base written into the run cache, nothing uploaded
    "blobsnapshot.upload.run_staged:1": Durable(0, 0),
    # the base half written in the blob store (a torn temp file) is not a case of this store: file:// renames; the
    # base uploaded, then death
    "blobsnapshot.upload.run_uploaded:1": Durable(0, 0),
    # the index naming the base made, no checkpoint carries it
    "blobsnapshot.upload.index_written:1": Durable(0, 0),
    # the bulk load durable, nothing after
    "commit.after_checkpoint_write:1": Durable(1, 1, landed=True),
    # the same steps for the bulk commit over the chain (base + 2 runs)
    "blobsnapshot.upload.run_staged:4": Durable(3, 3),
    "blobsnapshot.upload.run_uploaded:4": Durable(3, 3),
    "blobsnapshot.upload.index_written:4": Durable(3, 3),
    "commit.after_checkpoint_write:4": Durable(4, 4, landed=True),
    # retention's first delete of runs out of every retained checkpoint (the chain the second base replaced)
    "blobsnapshot.cleanup.deleted:1": Durable(4, COMMITS, landed=None),
}


@pytest.mark.slow
@pytest.mark.parametrize("crash_at", list(CRASH_POINTS))
def test_sigkill_at_a_step_of_a_bulk_base_commit_restores_exactly(tmp_path: Path, crash_at: str) -> None:
    run_dir = tmp_path / "run"
    run_dir.mkdir()
    crashed = _child(run_dir, tmp_path / "crashing.json", COMMITS, crash_at=crash_at)
    assert crashed.returncode == -signal.SIGKILL, (
        f"the child was to die at {crash_at} but exited with {crashed.returncode}:\n{crashed.stderr[-3000:]}"
    )
    wanted = CRASH_POINTS[crash_at]
    durable = _durable_commit(run_dir)
    assert wanted.low <= durable <= wanted.high, f"{crash_at}: durable commit {durable}"
    reported = _reported_durable(run_dir)
    if wanted.landed is not None:
        assert durable == reported + int(wanted.landed), f"{crash_at}: durable {durable}, the child saw {reported}"
    else:
        assert reported <= durable <= reported + 1
    _assert_retained_runs_present(run_dir)
    _restore_and_go_on(tmp_path, durable)


@pytest.mark.slow
@pytest.mark.parametrize("crash_at", ["envbase.restore.written:1", "envbase.restore.verified:1"])
def test_sigkill_in_the_cold_restore_of_a_bulk_base_restores_exactly_next_time(tmp_path: Path, crash_at: str) -> None:
    """A cold restore killed while it streams the bulk base into the store dir (every frame written, the digest not
    checked; and verified, not swapped in): the next restore is exact, and leaves no abandoned copy behind."""
    run_dir = tmp_path / "run"
    run_dir.mkdir()
    done = _child(run_dir, tmp_path / "first.json", 3)
    assert done.returncode == 0, done.stderr[-3000:]
    shutil.rmtree(run_dir / "local")
    killed = _child(run_dir, tmp_path / "killed.json", 0, crash_at=crash_at)
    assert killed.returncode == -signal.SIGKILL, f"exited with {killed.returncode}:\n{killed.stderr[-3000:]}"
    assert not (tmp_path / "killed.json").exists(), "the restore was to die before the task opened"
    again = _child(run_dir, tmp_path / "again.json", 0)
    assert again.returncode == 0, again.stderr[-3000:]
    report = _read_report(tmp_path / "again.json")
    assert report["restored"] == 3
    assert report["contents"] == expected_state(3)
    store_dir = run_dir / "local" / "job" / TASK / STORE
    assert not list(store_dir.glob(".envbase-*")), "the killed restore's copy was left behind"


# -- helpers -------------------------------------------------------------------------------------------------------


def _restore_and_go_on(work: Path, durable: int) -> None:
    """Fresh processes with the local dir kept and wiped restore exactly ``durable`` and commit on; then a wiped
    restore of the result is exact, and the blob store holds only what the log's checkpoints name."""
    run_dir = work / "run"
    wiped = work / "wiped"
    shutil.copytree(run_dir, wiped)
    shutil.rmtree(wiped / "local")
    for label, directory in (("kept", run_dir), ("wiped", wiped)):
        resumed = _child(directory, work / f"{label}.json", MORE)
        assert resumed.returncode == 0, f"local dir {label}:\n{resumed.stderr[-3000:]}"
        report = _read_report(work / f"{label}.json")
        assert report["restored"] == durable, f"local dir {label}"
        assert report["contents"] == expected_state(durable), f"local dir {label}: restored state differs"
        assert _durable_commit(directory) == durable + MORE
        _assert_retained_runs_present(directory)
    shutil.rmtree(run_dir / "local")
    final = _child(run_dir, work / "final.json", 0)
    assert final.returncode == 0, final.stderr[-3000:]
    report = _read_report(work / "final.json")
    assert report["restored"] == durable + MORE
    assert report["contents"] == expected_state(durable + MORE)
    stored = set(FileBlobStore(str(run_dir / "blobs"), create=False).list(runs_prefix(PREFIX)))
    assert stored == _runs_named_by_the_log(run_dir), "runs no checkpoint names were left (or needed ones deleted)"


def _child(
    workdir: Path, report: Path, commits: int, *, crash_at: str | None = None
) -> subprocess.CompletedProcess[str]:
    env = {key: value for key, value in os.environ.items() if key != "STATEBACKEND_CRASH_AT"}
    if crash_at is not None:
        env["STATEBACKEND_CRASH_AT"] = crash_at
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(REPO), env.get("PYTHONPATH")]))
    return subprocess.run(
        [sys.executable, "-m", "tests.bulk_base_child", str(workdir), str(report), str(commits)],
        cwd=REPO,
        env=env,
        capture_output=True,
        text=True,
        timeout=scaled(120),
        check=False,  # a hang guard
    )


def _read_report(path: Path) -> dict[str, Any]:
    import json

    document = json.loads(path.read_text())
    contents = {bytes.fromhex(k): bytes.fromhex(v) for k, v in document["contents"].items()}
    return {"restored": document["restored"], "contents": contents}


def _checkpoint_log(workdir: Path) -> CheckpointLog:
    return CheckpointLog(FileBlobStore(str(workdir / "blobs"), create=False), "job", TASK)


def _durable_commit(workdir: Path) -> int:
    entry = _checkpoint_log(workdir).latest()
    return 0 if entry is None else int(entry.checkpoint.input_offsets["input"])


def _reported_durable(workdir: Path) -> int:
    log = workdir / "durable.log"
    lines = log.read_text().split() if log.exists() else []
    return int(lines[-1]) if lines else 0


def _runs_named_by_the_log(workdir: Path) -> set[str]:
    blob_store = FileBlobStore(str(workdir / "blobs"), create=False)
    names: set[str] = set()
    for entry in _checkpoint_log(workdir).entries():
        assert isinstance(entry.checkpoint, CheckpointV2)
        marker = entry.checkpoint.markers_for("blobsnapshot")[STORE]
        names |= read_marker(blob_store, marker, job="job", task=TASK, store=STORE).blob_names(PREFIX)
    return names


def _assert_retained_runs_present(workdir: Path) -> None:
    """Every run the log's checkpoints name is in the blob store at its size."""
    blob_store = FileBlobStore(str(workdir / "blobs"), create=False)
    for entry in _checkpoint_log(workdir).entries():
        assert isinstance(entry.checkpoint, CheckpointV2)
        marker = entry.checkpoint.markers_for("blobsnapshot")[STORE]
        index = read_marker(blob_store, marker, job="job", task=TASK, store=STORE)
        for run in index.runs:
            name = run_name(PREFIX, run.hash)
            assert blob_store.exists(name) and blob_store.head(name).size == run.size, (
                f"checkpoint #{entry.seq} names {name}, which is missing or cut"
            )
