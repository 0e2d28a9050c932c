"""The ``statebackend`` command's restore and dump: a task's state at a checkpoint into a local dir or as rows, with
serdes and migrations of its config, against a file:// blob store."""

from __future__ import annotations

import base64
import json
import shutil
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

from statebackend import TaskStorage
from tests.backend_helpers import base_config, cli, state_of_blob_store, write_config

# -- restore and dump -------------------------------------------------------------------------------------------


def test_restore_prewarms_a_machine(
    capsys: pytest.CaptureFixture[str], job: tuple[Path, dict, dict], tmp_path: Path
) -> None:
    path, config, states = job
    target = tmp_path / "prewarmed"
    code, out, _ = cli(capsys, "restore", str(path), "task-0", str(target), "--json")
    result = json.loads(out)
    assert code == 0 and result["seq"] == 5 and result["stores"] == {"counts": {"restored_by": "changelog", "keys": 7}}
    assert result["bytes_downloaded"] > 0
    # the task opened on that directory finds its state there and downloads nothing
    with TaskStorage.open(dict(config, **{"state.local.dir": str(target)}), "task-0") as storage:
        assert dict(storage.store("counts").items()) == states["task-0"]["history"][-1]
        assert storage.metrics.counter("restore.stores.reused") == 1
        assert storage.metrics.counter("restore.bytes") == 0
    code, out, _ = cli(capsys, "restore", str(path), "task-0", str(tmp_path / "older"), "-c", "2")
    assert code == 0 and out.startswith("restored checkpoint #2 ")


def test_dump_is_read_only_json_lines(
    capsys: pytest.CaptureFixture[str], job: tuple[Path, dict, dict], monkeypatch: pytest.MonkeyPatch
) -> None:
    path, config, states = job
    before = state_of_blob_store(config)

    def no_task_storage(*args: Any, **kwargs: Any) -> None:
        raise AssertionError("dump must not open a full TaskStorage")

    monkeypatch.setattr(TaskStorage, "open", no_task_storage)
    code, out, _ = cli(
        capsys,
        "dump",
        str(path),
        "task-0",
        "counts",
        "-D",
        "changelog.gc.interval.commits=1",
        "-D",
        "changelog.gc.grace.period.ms=0",
    )
    records = [json.loads(line) for line in out.splitlines()]
    assert code == 0 and {r["key"]: r["value"] for r in records} == states["task-0"]["history"][-1]
    code, out, _ = cli(capsys, "dump", str(path), "task-0", "counts", "-c", "2")
    assert {json.loads(line)["key"]: json.loads(line)["value"] for line in out.splitlines()} == states["task-0"][
        "history"
    ][1]
    code, out, _ = cli(capsys, "dump", str(path), "task-1", "counts", "--raw")
    first = json.loads(out.splitlines()[0])
    assert base64.b64decode(first["key_base64"]) == b"ada" and len(base64.b64decode(first["value_base64"])) == 8
    assert state_of_blob_store(config) == before  # nothing written, swept or deleted
    code, _, err = cli(capsys, "dump", str(path), "task-0", "nosuch")
    assert code == 4 and "nosuch" in err
    assert cli(capsys, "dump", str(path), "task-9", "counts")[0] == 4


def test_dump_of_a_store_the_config_no_longer_has(capsys: pytest.CaptureFixture[str], tmp_path: Path) -> None:
    config = base_config(
        tmp_path,
        (tmp_path / "blobs").as_uri(),
        **{
            "stores.old.backup.factories": "changelog",
            "stores.old.key.serde": "string",
            "stores.old.msg.serde": "json",
        },
    )
    with TaskStorage.open(config, "task-0") as storage:
        storage.store("old").put("ada", {"clicks": [1, 2]})
        storage.commit_durably({"clicks": "1"})
    without = {k: v for k, v in config.items() if not k.startswith("stores.old.")}
    path = write_config(tmp_path / "dropped.properties", without)
    code, out, _ = cli(capsys, "dump", str(path), "task-0", "old")
    assert code == 0 and [json.loads(x) for x in out.splitlines()] == [{"key": "ada", "value": {"clicks": [1, 2]}}]


def test_dump_reads_a_record_store_as_dicts_of_the_schema_each_value_was_written_with(
    capsys: pytest.CaptureFixture[str], tmp_path: Path
) -> None:
    """A record store whose class changed between deployments: dump shows every value as JSON, the old ones with
    the fields they were written with, the new ones with the class's fields (not a repr, not an error)."""
    from tests.record_values import CountV1, CountV2

    config = base_config(
        tmp_path,
        (tmp_path / "blobs").as_uri(),
        **{"stores.counts.key.serde": "string", "stores.counts.msg.serde": "record:tests.record_values:CountV1"},
    )
    with TaskStorage.open(config, "task-0") as storage:
        storage.store("counts").put("ada", CountV1(count=1, first="b0"))
        storage.commit_durably({"clicks": "1"})
    config["stores.counts.msg.serde"] = "record:tests.record_values:CountV2"
    with TaskStorage.open(config, "task-0") as storage:
        storage.store("counts").put("bob", CountV2(count=2.5, last="b1"))
        storage.commit_durably({"clicks": "2"})
    path = write_config(tmp_path / "v2.properties", config)
    code, out, _ = cli(capsys, "dump", str(path), "task-0", "counts")
    assert code == 0
    assert sorted((r["key"], r["value"]) for r in map(json.loads, out.splitlines())) == [
        ("ada", {"count": 1, "first": "b0"}),
        ("bob", {"count": 2.5, "last": "b1"}),
    ]


def test_dump_into_a_closed_pipe_is_quiet(job: tuple[Path, dict, dict], tmp_path: Path) -> None:
    path, config, _ = job
    with TaskStorage.open(config, "task-0") as storage:
        counts = storage.store("counts")
        for i in range(20_000):
            counts.put(f"key-{i:06d}", i)
        storage.commit_durably({"clicks": "5"})
    script = shutil.which("statebackend", path=str(Path(sys.executable).parent))
    assert script is not None
    pipeline = subprocess.run(
        ["bash", "-c", f'set -o pipefail; "{script}" dump "{path}" task-0 counts | head -n 2'],
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
    )
    assert pipeline.stdout.count("\n") == 2 and json.loads(pipeline.stdout.splitlines()[0])["key"] == "ada"
    assert pipeline.stderr == ""
    assert pipeline.returncode == 141
