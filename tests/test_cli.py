"""The ``statebackend`` command: every command against a file:// blob store, and (slow) against moto's S3 server.

Each test runs ``main([...])`` in-process, as a user would run the command, and checks exit codes, output and what
happened on the blob store. The closed-pipe test runs the installed script in a real shell pipeline."""

from __future__ import annotations

import base64
import io
import json
import subprocess
import sys
import time
import uuid
from pathlib import Path
from typing import Any

import pytest
from statebackend.backends.changelog.marker import Recipe
from statebackend.checkpoint import CheckpointLog, CheckpointV2

from statebackend import TaskStorage
from statebackend.blobstores.file import FileBlobStore
from statebackend.cli import EXIT_CODES, main
from statebackend.cli._common import NoExecutor
from statebackend.config import Settings
from statebackend.contracts import StateBackendAdmin
from statebackend.registry import resolve_factory
from tests.backend_helpers import (
    OLD,
    backend_context,
    base_config,
    blobs_of,
    cli,
    make_job,
    state_of_blob_store,
    write_config,
)
from tests.servers import ServerProcess

# -- basics: version, help, exit codes, options ---------------------------------------------------------------


def test_version_and_help(capsys: pytest.CaptureFixture[str]) -> None:
    code, out, _ = cli(capsys, "--version")
    assert code == 0 and out.startswith("statebackend ")
    module = subprocess.run(
        [sys.executable, "-m", "statebackend.cli", "--version"], capture_output=True, text=True, timeout=60, check=False
    )
    assert module.returncode == 0 and module.stdout == out
    code, out, _ = cli(capsys, "--help")
    assert code == 0 and "checkpoints" in out and "gc" in out and "exit codes" in out


def test_help_lists_each_exit_code_once_with_its_meaning(capsys: pytest.CaptureFixture[str]) -> None:
    """The help's exit codes: one entry per code, at the start of its line, with its whole meaning (wrapped lines
    joined), and nothing else in the section."""
    code, out, _ = cli(capsys, "--help")
    assert code == 0
    section = out.split("\nexit codes:\n", 1)[1].splitlines()
    listed: dict[int, str] = {}
    current: int | None = None
    for line in section:
        head = line.split(maxsplit=1)
        if line.startswith("  ") and not line.startswith("   ") and head and head[0].isdigit():
            current = int(head[0])
            assert current not in listed, f"exit code {current} is listed twice"
            listed[current] = head[1]
        elif line.strip():
            assert current is not None and line.startswith("       "), line
            listed[current] += " " + line.strip()
    assert listed == {code: " ".join(meaning.split()) for code, meaning in EXIT_CODES.items()}


def test_exit_codes_are_distinct_and_documented(
    capsys: pytest.CaptureFixture[str], job: tuple[Path, dict, dict], tmp_path: Path
) -> None:
    path, _, _ = job
    assert cli(capsys, "checkpoints", str(path), "task-0", "--no-such-option")[0] == 2  # usage
    assert cli(capsys, "frobnicate", str(path))[0] == 2
    code, _, err = cli(capsys, "checkpoints", str(tmp_path / "missing.properties"), "task-0")
    assert code == 3 and "cannot read config file" in err  # configuration
    code, _, err = cli(capsys, "checkpoints", str(path), "task-0", "-D", "task.checkpoint.retained=zero")
    assert code == 3 and "task.checkpoint.retained" in err
    code, _, err = cli(capsys, "checkpoints", str(path), "task-0", "-D", "novalue")
    assert code == 2 and "KEY=VALUE" in err
    assert len(set(EXIT_CODES)) == len(EXIT_CODES) and {0, 1, 2, 3, 4, 5, 6} <= set(EXIT_CODES)
    operations = (Path(__file__).parent.parent / "docs" / "operations.md").read_text()
    for code in EXIT_CODES:
        assert f"| {code} |" in operations, f"exit code {code} is not documented in docs/operations.md"


def test_options_are_accepted_before_and_after_the_command(
    capsys: pytest.CaptureFixture[str], job: tuple[Path, dict, dict]
) -> None:
    path, _, _ = job
    code, out, _ = cli(
        capsys, "-D", "job.name=other", "checkpoints", str(path), "task-0", "--json", "-D", "job.name=clicks"
    )
    assert code == 0 and [row["seq"] for row in json.loads(out)] == [1, 2, 3, 4, 5]  # the later -D wins
    code, out, _ = cli(capsys, "--json", "checkpoints", str(path), "task-0")
    assert code == 0 and json.loads(out)[0]["seq"] == 1
    code, _, err = cli(capsys, "checkpoints", str(path), "task-0", "-D", "job.name=other")
    assert code == 4 and "'other'" in err


def test_validate(capsys: pytest.CaptureFixture[str], job: tuple[Path, dict, dict]) -> None:
    path, _, _ = job
    code, out, _ = cli(capsys, "validate", str(path))
    assert code == 0 and out.startswith("changelog: OK (FileBlobStore(")
    code, out, _ = cli(capsys, "validate", str(path), "--json")
    assert code == 0 and json.loads(out) == [
        {"backend": "changelog", "result": "OK", "blob_store": json.loads(out)[0]["blob_store"]}
    ]


# -- listings -------------------------------------------------------------------------------------------------


def test_jobs_tasks_stores(capsys: pytest.CaptureFixture[str], job: tuple[Path, dict, dict]) -> None:
    path, config, _ = job
    code, out, _ = cli(capsys, "jobs", str(path), "--json")
    (row,) = json.loads(out)
    assert code == 0 and row["job"] == "clicks" and row["tasks"] == 2 and row["checkpoints"] == 10
    assert row["configured"] is True
    code, out, _ = cli(capsys, "jobs", str(path))
    assert code == 0 and out.splitlines()[0].split() == ["JOB", "TASKS", "CHECKPOINTS", "BLOBS"]

    code, out, _ = cli(capsys, "tasks", str(path), "--json")
    rows = json.loads(out)
    assert code == 0 and [r["task"] for r in rows] == ["task-0", "task-1"]
    with blobs_of(config) as store:
        newest = CheckpointLog(store, "clicks", "task-1").latest()
    assert newest is not None and isinstance(newest.checkpoint, CheckpointV2)
    assert rows[1]["newest_seq"] == 5 and rows[1]["stores"] == ["counts"]
    assert [r["checkpoints"] for r in rows] == [5, 5]  # counted by the log: the head holds them in one blob
    millis = newest.checkpoint.checkpoint_id.millis
    assert (
        rows[1]["newest_time"]
        == time.strftime("%Y-%m-%dT%H:%M:%S", time.gmtime(millis // 1000)) + f".{millis % 1000:03d}Z"
    )
    code, _, err = cli(capsys, "tasks", str(path), "--job", "nojob")
    assert code == 4 and "nojob" in err

    code, out, _ = cli(capsys, "stores", str(path), "task-0", "--json")
    (store_row,) = json.loads(out)
    assert code == 0 and store_row["store"] == "counts" and store_row["in_newest_checkpoint"] == ["changelog"]
    assert store_row["configured"] is True and store_row["blobs"] > 0
    code, _, err = cli(capsys, "stores", str(path), "task-9")
    assert code == 4 and "task-0, task-1" in err


def test_checkpoints_times_and_sizes(capsys: pytest.CaptureFixture[str], job: tuple[Path, dict, dict]) -> None:
    path, config, _ = job
    code, out, _ = cli(capsys, "checkpoints", str(path), "task-0", "--json")
    rows = json.loads(out)
    assert code == 0 and [r["seq"] for r in rows] == [1, 2, 3, 4, 5]
    with blobs_of(config) as store:
        entry = CheckpointLog(store, "clicks", "task-0").read(5)
        assert isinstance(entry.checkpoint, CheckpointV2)
        marker = entry.checkpoint.markers_for("changelog")["counts"]
        recipe_blobs = list(Recipe.decode(marker, prefix="clicks/task-0/counts/changelog/").blob_names())
        expected = sum(store.head(name).size for name in recipe_blobs)
    assert rows[-1]["bytes"] == expected > 0
    assert rows[-1]["checkpoint_id"] == str(entry.checkpoint.checkpoint_id)
    millis = entry.checkpoint.checkpoint_id.millis
    assert (
        rows[-1]["time"] == time.strftime("%Y-%m-%dT%H:%M:%S", time.gmtime(millis // 1000)) + f".{millis % 1000:03d}Z"
    )
    assert rows[-1]["input_offsets"] == {"clicks": "4"}
    code, out, _ = cli(capsys, "checkpoints", str(path), "task-0")
    lines = out.splitlines()
    assert code == 0 and lines[0].split()[:3] == ["SEQ", "CHECKPOINT", "ID"] and lines[-1].startswith("#5 ")
    assert str(entry.checkpoint.checkpoint_id) in lines[-1] and "clicks=4" in lines[-1]


def test_checkpoints_of_an_unknown_task_is_an_error(
    capsys: pytest.CaptureFixture[str], job: tuple[Path, dict, dict]
) -> None:
    path, _, _ = job
    code, out, err = cli(capsys, "checkpoints", str(path), "task-9")
    assert code == 4 and out == ""
    assert err.startswith("statebackend: not found: task 'task-9'") and "task-0, task-1" in err


# -- inspect and verify -----------------------------------------------------------------------------------------


def test_inspect(capsys: pytest.CaptureFixture[str], job: tuple[Path, dict, dict]) -> None:
    path, _, _ = job
    code, out, _ = cli(capsys, "inspect", str(path), "task-0", "--json")
    data = json.loads(out)
    assert code == 0 and data["seq"] == 5 and data["input_offsets"] == {"clicks": "4"}
    described = data["markers"]["changelog"]["counts"]["description"]
    assert described["kind"] == "changelog recipe" and described["seq"] == 5 and described["missing"] == 0
    assert [s["kind"] for s in described["steps"]] == ["snapshot", "delta"]
    assert described["bytes"] == sum(s["bytes"] for s in described["steps"]) == data["bytes"]
    assert data["serdes"] == {"counts": {"key": "string", "msg": "integer"}}
    assert data["blob"] == "clicks/task-0/checkpoints/HEAD.v3.json"  # a file store keeps the log in its head
    by_id = json.loads(cli(capsys, "inspect", str(path), "task-0", "--json", "-c", data["checkpoint_id"])[1])
    assert by_id["seq"] == 5
    older = json.loads(cli(capsys, "inspect", str(path), "task-0", "--json", "-c", "2")[1])
    assert older["seq"] == 2 and older["input_offsets"] == {"clicks": "1"}
    code, out, _ = cli(capsys, "inspect", str(path), "task-0")
    assert code == 0 and "checkpoint #5 of task task-0" in out and "kind=snapshot" in out and "kind=delta" in out
    assert cli(capsys, "inspect", str(path), "task-0", "-c", "99")[0] == 4
    assert cli(capsys, "inspect", str(path), "task-0", "-c", "1-1")[0] == 4
    assert cli(capsys, "inspect", str(path), "task-0", "-c", "yesterday")[0] == 2


def _recipe_blobs(config: dict[str, Any], task: str, seq: int) -> list[str]:
    with blobs_of(config) as store:
        entry = CheckpointLog(store, "clicks", task).read(seq)
    assert isinstance(entry.checkpoint, CheckpointV2)
    marker = entry.checkpoint.markers_for("changelog")["counts"]
    return list(Recipe.decode(marker, prefix=f"clicks/{task}/counts/changelog/").blob_names())


def test_verify_ok_damaged_and_missing(capsys: pytest.CaptureFixture[str], job: tuple[Path, dict, dict]) -> None:
    path, config, _ = job
    code, out, _ = cli(capsys, "verify", str(path), "task-0")
    assert code == 0 and out.splitlines()[-1].endswith("OK: 1 markers, every blob present and sound")
    snapshot, delta = _recipe_blobs(config, "task-0", 5)
    before = state_of_blob_store(config)
    with blobs_of(config) as store:
        data = bytearray(store.get(delta))
        data[len(data) // 2] ^= 0xFF
        store.put(delta, bytes(data))
    code, out, _ = cli(capsys, "verify", str(path), "task-0", "--json")
    result = json.loads(out)
    assert code == 5 and result["result"] == "failed"
    (problem,) = result["markers"][0]["problems"]
    assert delta in problem
    with blobs_of(config) as store:
        store.delete(snapshot)
    code, out, _ = cli(capsys, "verify", str(path), "task-0")
    assert code == 5 and f"{snapshot}" in out and "missing" in out and "FAILED" in out
    # another checkpoint (task-1) is untouched; verify wrote nothing
    assert cli(capsys, "verify", str(path), "task-1")[0] == 0
    after = state_of_blob_store(config)
    assert set(after) == set(before) - {snapshot}
    assert cli(capsys, "verify", str(path), "task-0", "--store", "nosuch")[0] == 4


def test_verify_a_damaged_checkpoint_blob(capsys: pytest.CaptureFixture[str], job: tuple[Path, dict, dict]) -> None:
    """The head holds every checkpoint of the task: damaged, none of them verifies, and each failure names it."""
    path, config, _ = job
    name = "clicks/task-0/checkpoints/HEAD.v3.json"
    with blobs_of(config) as store:
        store.put(name, store.get(name).replace(b'"clicks"', b'"clickz"'))
    code, out, _ = cli(capsys, "verify", str(path), "task-0")
    assert code == 5 and out.startswith("FAILED      checkpoint latest of task task-0") and name in out
    code, out, _ = cli(capsys, "verify", str(path), "task-0", "-c", "4", "--json")
    assert code == 5 and json.loads(out)["result"] == "failed" and name in json.loads(out)["problems"][0]
    assert cli(capsys, "verify", str(path), "task-1")[0] == 0  # another task's head is untouched


def test_verify_a_damaged_per_seq_checkpoint_blob(capsys: pytest.CaptureFixture[str], tmp_path: Path) -> None:
    """A log an older release left (per-seq blobs, read through a store that has the head): one damaged blob fails
    its own checkpoint only, and the inspect names that blob."""
    config = base_config(tmp_path, (tmp_path / "blobs").as_uri())
    with blobs_of(config) as files:
        per_seq = PerSeqFileBlobStore(files.root)  # type: ignore[attr-defined]
        for run in range(5):
            with TaskStorage.open(config, "task-0", blob_store=per_seq) as storage:
                counts = storage.store("counts")
                counts.put("ada", run)
                storage.commit_durably({"clicks": str(run)})
    path = write_config(tmp_path / "job.properties", config)
    name = "clicks/task-0/checkpoints/000000000005.v2.json"
    code, out, _ = cli(capsys, "inspect", str(path), "task-0", "--json")
    assert code == 0 and json.loads(out)["blob"] == name
    code, out, _ = cli(capsys, "jobs", str(path), "--json")
    assert code == 0 and json.loads(out)[0]["checkpoints"] == 5
    with blobs_of(config) as store:
        store.put(name, store.get(name).replace(b'"clicks"', b'"clickz"'))
    code, out, _ = cli(capsys, "verify", str(path), "task-0")
    assert code == 5 and out.startswith("FAILED      checkpoint latest of task task-0") and name in out
    code, out, _ = cli(capsys, "verify", str(path), "task-0", "-c", "4", "--json")
    assert code == 0 and json.loads(out)["result"] == "ok"


class PerSeqFileBlobStore(FileBlobStore):
    """A file store without the conditional put: the checkpoint log on it keeps per-seq blobs, as older releases
    (and stores without the capability) do."""

    supports_conditional_put = False


def test_verify_a_delta_of_another_task_put_under_the_name(
    capsys: pytest.CaptureFixture[str], job: tuple[Path, dict, dict]
) -> None:
    path, config, _ = job
    _, delta0 = _recipe_blobs(config, "task-0", 5)
    _, delta1 = _recipe_blobs(config, "task-1", 5)
    with blobs_of(config) as store:
        store.put(delta0, store.get(delta1))  # intact, but not the blob task-0's recipe names
    code, out, _ = cli(capsys, "verify", str(path), "task-0")
    assert code == 5 and "is intact but is not the delta the checkpoint names" in out


def _fullcopy_job(tmp_path: Path) -> tuple[Path, dict[str, Any]]:
    config = base_config(tmp_path, (tmp_path / "fc-blobs").as_uri(), **{"stores.counts.backup.factories": "fullcopy"})
    make_job(config, tasks=("task-0",), runs=2)
    return write_config(tmp_path / "fullcopy.properties", config), config


def test_a_backend_that_does_not_describe_or_verify_says_so(capsys: pytest.CaptureFixture[str], tmp_path: Path) -> None:
    path, config = _fullcopy_job(tmp_path)
    code, out, _ = cli(capsys, "verify", str(path), "task-0")
    assert code == 6 and "UNVERIFIED" in out and "the fullcopy backend does not verify its markers" in out
    code, out, _ = cli(capsys, "inspect", str(path), "task-0", "--json")
    item = json.loads(out)["markers"]["fullcopy"]["counts"]
    assert code == 0 and item["description"] is None and "does not describe" in item["note"] and item["marker"]
    code, out, _ = cli(capsys, "checkpoints", str(path), "task-0", "--json")
    assert code == 0 and json.loads(out)[-1]["bytes"] is None  # unknown, never a made-up number
    # gc keeps every blob under that backend's prefix, however old
    with blobs_of(config) as store:
        names = [n for n in store.list("clicks/task-0/counts/fullcopy/")]
        for name in names:
            store.set_metadata(name, {"created_at": OLD})
    code, out, _ = cli(capsys, "gc", str(path), "--grace", "0", "--apply", "--force", "--json")
    report = json.loads(out)
    assert code == 0 and names and all(item["action"] == "keep" for item in report["items"])
    assert {item["blob"] for item in report["items"]} == set(names)
    with blobs_of(config) as store:
        assert list(store.list("clicks/task-0/counts/fullcopy/")) == names


def test_a_dual_commit_job_with_blobsnapshot(capsys: pytest.CaptureFixture[str], tmp_path: Path) -> None:
    """changelog and blobsnapshot side by side: the command works with whatever each backend's admin says."""
    config = base_config(
        tmp_path, (tmp_path / "dual").as_uri(), **{"stores.counts.backup.factories": "changelog,blobsnapshot"}
    )
    states = make_job(config, tasks=("task-0",), runs=3)
    path = write_config(tmp_path / "dual.properties", config)
    with blobs_of(config) as store:
        options = Settings.from_config(config).backend_options_for("blobsnapshot")
        context = backend_context("blobsnapshot", store, job="clicks", executor=NoExecutor(), options=options)
        admin = type(resolve_factory("blobsnapshot").factory.admin(context))
    # whatever the blob-snapshot admin implements (its three methods are optional), the command follows it
    describes = admin.describe_marker is not StateBackendAdmin.describe_marker
    verifies = admin.verify_marker is not StateBackendAdmin.verify_marker
    accounts = admin.referenced_blobs is not StateBackendAdmin.referenced_blobs
    before = state_of_blob_store(config)
    code, out, _ = cli(capsys, "verify", str(path), "task-0", "--json")
    statuses = {m["backend"]: m["status"] for m in json.loads(out)["markers"]}
    assert statuses == {"changelog": "ok", "blobsnapshot": "ok" if verifies else "unverified"}
    assert code == (0 if verifies else 6)
    code, out, _ = cli(capsys, "inspect", str(path), "task-0", "--json")
    item = json.loads(out)["markers"]["blobsnapshot"]["counts"]
    assert code == 0 and (item["description"] is not None) == describes
    rows = json.loads(cli(capsys, "checkpoints", str(path), "task-0", "--json")[1])
    assert (rows[-1]["bytes"] is not None) == accounts
    # dump from each backend's marker gives the same state, and writes nothing
    for backend in ("changelog", "blobsnapshot"):
        code, out, _ = cli(
            capsys, "dump", str(path), "task-0", "counts", "-D", f"stores.counts.restore.factory={backend}"
        )
        assert code == 0
        assert {json.loads(x)["key"]: json.loads(x)["value"] for x in out.splitlines()} == states["task-0"]["history"][
            -1
        ]
    report = json.loads(cli(capsys, "gc", str(path), "--grace", "0", "--json")[1])
    if not accounts:
        kept = [i for i in report["items"] if "/blobsnapshot/" in i["blob"]]
        assert kept and all(i["action"] == "keep" and "does not say" in i["reason"] for i in kept)
    assert cli(capsys, "gc", str(path), "--grace", "0", "--apply", "--force")[0] == 0
    assert (
        cli(capsys, "dump", str(path), "task-0", "counts", "-D", "stores.counts.restore.factory=blobsnapshot")[0] == 0
    )
    assert state_of_blob_store(config).keys() <= before.keys()


def test_progress_bar_on_a_terminal_only(
    capsys: pytest.CaptureFixture[str], job: tuple[Path, dict, dict], monkeypatch: pytest.MonkeyPatch
) -> None:
    path, _, _ = job

    class Terminal(io.StringIO):
        def isatty(self) -> bool:
            return True

    terminal = Terminal()
    monkeypatch.setattr(sys, "stderr", terminal)
    assert main(["verify", str(path), "task-0"]) == 0
    assert "verify:" in terminal.getvalue() and "/1 [" in terminal.getvalue()  # a bar over the one marker
    terminal.truncate(0)
    assert main(["verify", str(path), "task-0", "--no-progress"]) == 0
    assert terminal.getvalue().strip("\x00") == ""


# -- against a real server (moto's S3) ---------------------------------------------------------------------------


def _every_command(capsys: pytest.CaptureFixture[str], config: dict[str, Any], tmp_path: Path) -> Path:
    """Every command on a job of one task on a server; returns the config file."""
    states = make_job(config, tasks=("task-0",), runs=4)
    path = write_config(tmp_path / "server.properties", config)
    assert cli(capsys, "validate", str(path))[0] == 0
    assert json.loads(cli(capsys, "jobs", str(path), "--json")[1])[0]["checkpoints"] == 4
    assert [t["task"] for t in json.loads(cli(capsys, "tasks", str(path), "--json")[1])] == ["task-0"]
    assert json.loads(cli(capsys, "stores", str(path), "task-0", "--json")[1])[0]["store"] == "counts"
    rows = json.loads(cli(capsys, "checkpoints", str(path), "task-0", "--json")[1])
    assert [r["seq"] for r in rows] == [1, 2, 3, 4] and all(r["bytes"] > 0 for r in rows)
    assert cli(capsys, "checkpoints", str(path), "task-5")[0] == 4
    described = json.loads(cli(capsys, "inspect", str(path), "task-0", "--json")[1])
    assert described["markers"]["changelog"]["counts"]["description"]["missing"] == 0
    assert cli(capsys, "verify", str(path), "task-0")[0] == 0
    code, out, _ = cli(capsys, "restore", str(path), "task-0", str(tmp_path / "warm"), "--json")
    assert code == 0 and json.loads(out)["stores"]["counts"]["keys"] == 6
    code, out, _ = cli(capsys, "dump", str(path), "task-0", "counts")
    assert {json.loads(x)["key"]: json.loads(x)["value"] for x in out.splitlines()} == states["task-0"]["history"][-1]
    with blobs_of(config) as store:  # an orphaned store's old blob: gc deletes it, the checkpoints still verify
        store.put("clicks/task-0/dropped/changelog/delta/000000000001-aaaa.delta", b"old", metadata={"created_at": OLD})
    report = json.loads(cli(capsys, "gc", str(path), "--grace", "0", "--json")[1])
    assert {item["kind"]: item["action"] for item in report["items"]}["orphaned store"] == "delete"
    return path


@pytest.mark.azure
@pytest.mark.slow
def test_every_command_against_azurite(
    capsys: pytest.CaptureFixture[str], azurite_connection: str, tmp_path: Path
) -> None:
    config = base_config(
        tmp_path, f"az://t{uuid.uuid4().hex[:20]}/state", **{"blob.store.connection.string": azurite_connection}
    )
    path = _every_command(capsys, config, tmp_path)
    code, out, _ = cli(capsys, "gc", str(path), "--grace", "0", "--apply", "--force", "--json")
    report = json.loads(out)
    assert code == 0 and any("cannot list abandoned uploads" in note for note in report["notes"])
    with blobs_of(config) as store:
        assert not list(store.list("clicks/task-0/dropped/"))
    assert cli(capsys, "verify", str(path), "task-0")[0] == 0
    _, out, _ = cli(capsys, "checkpoints", str(path), "task-0", "--json", "-v")
    assert "AccountKey" not in out and "Eby8vdM02" not in out  # the connection string's key never shows


@pytest.mark.s3
@pytest.mark.slow
def test_every_command_against_the_s3_server(
    capsys: pytest.CaptureFixture[str], s3_server: ServerProcess, tmp_path: Path
) -> None:
    bucket = f"t-{uuid.uuid4().hex[:20]}"
    config = base_config(tmp_path, f"s3://{bucket}/state", **{"blob.store.endpoint.url": s3_server.endpoint})
    import boto3

    client = boto3.client("s3", endpoint_url=s3_server.endpoint)
    path = _every_command(capsys, config, tmp_path)
    # an abandoned multipart upload goes too
    upload = client.create_multipart_upload(Bucket=bucket, Key="state/clicks/task-0/counts/changelog/delta/x.delta")
    assert upload["UploadId"]
    report = json.loads(cli(capsys, "gc", str(path), "--grace", "0", "--json")[1])
    kinds = {item["kind"]: item for item in report["items"]}
    assert kinds["abandoned upload"]["blob"] == "clicks/task-0/counts/changelog/delta/x.delta"
    assert kinds["abandoned upload"]["action"] == "delete" and kinds["orphaned store"]["action"] == "delete"
    assert client.list_multipart_uploads(Bucket=bucket).get("Uploads")  # the dry run left it
    assert cli(capsys, "gc", str(path), "--grace", "0", "--apply", "--force")[0] == 0
    assert not client.list_multipart_uploads(Bucket=bucket).get("Uploads")
    with blobs_of(config) as store:
        assert not list(store.list("clicks/task-0/dropped/"))
    assert cli(capsys, "verify", str(path), "task-0")[0] == 0


def test_dump_of_a_dropped_record_store_reads_it_with_the_recorded_schemas(
    capsys: pytest.CaptureFixture[str], tmp_path: Path
) -> None:
    """A record store the config no longer has, with a TTL: dump reads every value with the schema the checkpoint
    recorded it was written with (no class needed: the config names none); ``--raw`` gives the stored bytes."""
    from tests.record_values import CountV1, CountV2

    config = base_config(
        tmp_path,
        (tmp_path / "blobs").as_uri(),
        **{
            "stores.old.backup.factories": "changelog",
            "stores.old.key.serde": "string",
            "stores.old.msg.serde": "record:tests.record_values:CountV1",
            "stores.old.ttl.ms": str(86_400_000),
        },
    )
    with TaskStorage.open(config, "task-0") as storage:
        storage.store("old").put("ada", CountV1(count=1, first="b0"))
        storage.commit_durably({"clicks": "1"})
    config["stores.old.msg.serde"] = "record:tests.record_values:CountV2"
    with TaskStorage.open(config, "task-0") as storage:
        storage.store("old").put("bob", CountV2(count=2.5, last="b1"))
        storage.commit_durably({"clicks": "2"})
    without = {k: v for k, v in config.items() if not k.startswith("stores.old.")}
    path = write_config(tmp_path / "dropped.properties", without)
    code, out, err = cli(capsys, "dump", str(path), "task-0", "old")
    assert code == 0, err
    records = sorted(map(json.loads, out.splitlines()), key=lambda r: r["key"])
    assert [(r["key"], r["value"]) for r in records] == [
        ("ada", {"count": 1, "first": "b0"}),
        ("bob", {"count": 2.5, "last": "b1"}),
    ]
    assert all(r["expires_at_ms"] > time.time() * 1000 for r in records)
    code, out, _ = cli(capsys, "dump", str(path), "task-0", "old", "--raw")
    assert code == 0 and sorted(base64.b64decode(json.loads(x)["key_base64"]) for x in out.splitlines()) == [
        b"ada",
        b"bob",
    ]


def test_dump_prints_a_record_values_bytes_field_as_base64(capsys: pytest.CaptureFixture[str], tmp_path: Path) -> None:
    from tests.record_values import Every

    config = base_config(
        tmp_path, (tmp_path / "blobs").as_uri(), **{"stores.counts.msg.serde": "record:tests.record_values:Every"}
    )
    with TaskStorage.open(config, "task-0") as storage:
        storage.store("counts").put("ada", Every(1, 0.5, True, "s", b"\x00\xff", [1], props={"k": None}))
        storage.commit_durably({"clicks": "1"})
    code, out, _ = cli(capsys, "dump", str(write_config(tmp_path / "every.properties", config)), "task-0", "counts")
    assert code == 0 and json.loads(out) == {
        "key": "ada",
        "value": {
            "i": 1,
            "f": 0.5,
            "b": True,
            "s": "s",
            "raw_base64": "AP8=",
            "items": [1],
            "note": None,
            "n": None,
            "props": {"k": None},
        },
    }
