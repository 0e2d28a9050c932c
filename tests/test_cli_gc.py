"""The ``statebackend gc`` command: it deletes what no retained checkpoint needs and past the grace period, never a
blob a checkpoint or an upload in flight needs, dry runs delete nothing, against a file:// blob store."""

from __future__ import annotations

import json
import os
import time
from pathlib import Path
from typing import Any

import pytest
from statebackend.backends.changelog.marker import Recipe
from statebackend.checkpoint import CheckpointLog, CheckpointV2

from statebackend import TaskStorage
from tests.backend_helpers import OLD, base_config, blobs_of, cli, state_of_blob_store, write_config
from tests.waiting import wait_until

# -- gc ---------------------------------------------------------------------------------------------------------


def _plant_garbage(config: dict[str, Any], root: Path | None) -> dict[str, str]:
    """Garbage of every kind, old (created_at a week ago), plus a young and an ageless blob that must stay."""
    planted = {
        "orphaned task": "clicks/task-7/counts/changelog/delta/000000000001-aaaa.delta",
        "orphaned store": "clicks/task-0/dropped/changelog/delta/000000000001-bbbb.delta",
        "unreferenced blob": "clicks/task-0/counts/changelog/delta/000000000001-cccc.delta",
        "young": "clicks/task-0/counts/changelog/delta/000000000002-dddd.delta",
        "ageless": "clicks/task-1/counts/changelog/delta/000000000002-eeee.delta",
        "other job": "otherjob/task-0/counts/changelog/delta/000000000001-ffff.delta",
    }
    with blobs_of(config) as store:
        for kind, name in planted.items():
            metadata = (
                {"created_at": f"{time.time():.3f}"}
                if kind == "young"
                else {}
                if kind == "ageless"
                else {"created_at": OLD}
            )
            store.put(name, b"garbage", metadata=metadata)
    if root is not None:
        temp = root / "clicks" / "task-0" / "counts" / "changelog" / "delta" / ".statebackend~tmp.0123456789abcdef"
        temp.write_bytes(b"half a delta")
        os.utime(temp, (time.time() - 7 * 86400, time.time() - 7 * 86400))
        planted["abandoned upload"] = "clicks/task-0/counts/changelog/delta/.statebackend~tmp.0123456789abcdef"
    return planted


def test_gc_dry_run_then_apply(
    capsys: pytest.CaptureFixture[str], job: tuple[Path, dict, dict], tmp_path: Path
) -> None:
    path, config, states = job
    planted = _plant_garbage(config, tmp_path / "blobs")
    before = state_of_blob_store(config)
    code, out, _ = cli(capsys, "gc", str(path), "--grace", "1h", "--json")
    report = json.loads(out)
    assert code == 0 and report["applied"] is False
    by_blob = {item["blob"]: item for item in report["items"]}
    for kind in ("orphaned task", "orphaned store", "unreferenced blob", "abandoned upload"):
        assert by_blob[planted[kind]]["kind"] == kind and by_blob[planted[kind]]["action"] == "delete", kind
    assert by_blob[planted["young"]]["action"] == "keep" and "younger" in by_blob[planted["young"]]["reason"]
    assert by_blob[planted["ageless"]]["action"] == "keep" and "age is unknown" in by_blob[planted["ageless"]]["reason"]
    assert planted["other job"] not in by_blob
    assert all(name in planted.values() for name in by_blob)  # nothing a checkpoint needs is listed
    assert state_of_blob_store(config) == before  # a dry run deletes nothing
    assert (tmp_path / "blobs" / planted["abandoned upload"]).exists()
    assert report["counts"] == {"delete": 4, "deleted": 0, "keep": 2, "failed": 0}
    code, out, _ = cli(capsys, "gc", str(path), "--grace", "1h")
    assert code == 0 and "dry run, nothing deleted" in out and "run again with --apply" in out
    assert "would delete 4 (" in out and "kept 2" in out and "DELETED" not in out

    code, out, _ = cli(capsys, "gc", str(path), "--grace", "1h", "--apply")
    assert code == 0 and "DELETED" in out and "(--apply; grace 1.0h)" in out
    assert out.count("\nDELETED ") + out.startswith("DELETED ") == 4 and out.count("\nKEEP ") == 2
    assert "\ndeleted 4 (" in out and "; kept 2 " in out
    code, out, _ = cli(capsys, "gc", str(path), "--grace", "1h", "--apply", "--json")
    again = json.loads(out)
    assert code == 0 and again["counts"] == {"delete": 0, "deleted": 0, "keep": 2, "failed": 0}
    code, out, _ = cli(capsys, "gc", str(path), "--grace", "1h", "--apply")
    assert code == 0 and "DELETED" not in out and "nothing deleted: nothing to delete; kept 2" in out
    after = state_of_blob_store(config)
    deleted = {planted[k] for k in ("orphaned task", "orphaned store", "unreferenced blob")}
    assert set(after) == set(before) - deleted
    assert not (tmp_path / "blobs" / planted["abandoned upload"]).exists()
    for task in ("task-0", "task-1"):  # every checkpoint still restores
        assert cli(capsys, "verify", str(path), task)[0] == 0
        for seq in (1, 5):
            code, out, _ = cli(capsys, "dump", str(path), task, "counts", "-c", str(seq))
            assert {json.loads(x)["key"]: json.loads(x)["value"] for x in out.splitlines()} == states[task]["history"][
                seq - 1
            ]
    assert cli(capsys, "gc", str(path), "--grace", "nonsense")[0] == 2


def test_gc_drops_a_task_named_by_the_operator(
    capsys: pytest.CaptureFixture[str], job: tuple[Path, dict, dict]
) -> None:
    path, config, states = job
    before = state_of_blob_store(config)
    code, _, err = cli(capsys, "gc", str(path), "--drop-task", "task-9")
    assert code == 4 and "task-9" in err
    code, out, _ = cli(capsys, "gc", str(path), "--drop-task", "task-1", "--json")
    dropped = [i for i in json.loads(out)["items"] if i["kind"] == "dropped task"]
    assert code == 0 and {i["blob"] for i in dropped} == {n for n in before if n.startswith("clicks/task-1/")}
    assert state_of_blob_store(config) == before
    assert cli(capsys, "gc", str(path), "--drop-task", "task-1", "--apply")[0] == 0
    after = state_of_blob_store(config)
    assert set(after) == {n for n in before if not n.startswith("clicks/task-1/")}
    assert cli(capsys, "checkpoints", str(path), "task-1")[0] == 4
    assert cli(capsys, "verify", str(path), "task-0")[0] == 0
    assert [json.loads(x)["key"] for x in cli(capsys, "dump", str(path), "task-0", "counts")[1].splitlines()] == sorted(
        states["task-0"]["history"][-1]
    )


def test_gc_apply_with_no_garbage_says_nothing_was_deleted(
    capsys: pytest.CaptureFixture[str], job: tuple[Path, dict, dict]
) -> None:
    path, config, _ = job
    before = state_of_blob_store(config)
    code, out, _ = cli(capsys, "gc", str(path), "--apply")
    assert code == 0 and state_of_blob_store(config) == before
    assert "DELETED" not in out and "deleted" not in out.replace("nothing deleted", "")
    assert out.splitlines()[-1] == "nothing deleted: nothing to delete; kept 0"
    report = json.loads(cli(capsys, "gc", str(path), "--apply", "--json")[1])
    assert report["applied"] and report["counts"] == {"delete": 0, "deleted": 0, "keep": 0, "failed": 0}


def test_gc_apply_stops_at_a_failed_delete_and_says_what_was_done(
    capsys: pytest.CaptureFixture[str], job: tuple[Path, dict, dict], tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    path, config, _ = job
    planted = _plant_garbage(config, None)
    from statebackend.blobstores.file import FileBlobStore
    from statebackend.errors import StorageError

    calls: list[str] = []
    real_delete = FileBlobStore.delete
    real_conditional = FileBlobStore.delete_if_unchanged

    def failing_second(name: str) -> None:
        calls.append(name)
        if len(calls) == 2:
            raise StorageError(f"the store refused to delete {name}")

    def delete(self: FileBlobStore, name: str) -> None:
        failing_second(name)
        real_delete(self, name)

    def delete_if_unchanged(self: FileBlobStore, versions: dict[str, str]) -> frozenset[str]:
        for name in versions:
            failing_second(name)
        return real_conditional(self, versions)

    monkeypatch.setattr(FileBlobStore, "delete", delete)
    monkeypatch.setattr(FileBlobStore, "delete_if_unchanged", delete_if_unchanged)
    code, out, err = cli(capsys, "gc", str(path), "--grace", "1h", "--apply", "--json")
    report = json.loads(out)
    assert code == 1 and "stopped deleting after a failure" in err and calls[1] in err
    by_blob = {item["blob"]: item for item in report["items"]}
    assert by_blob[calls[0]]["action"] == "deleted" and by_blob[calls[1]]["action"] == "failed"
    assert len(calls) == 2  # nothing was tried after the failure
    doomed = {planted[k] for k in ("orphaned task", "orphaned store", "unreferenced blob")}
    untried = doomed - set(calls)
    assert untried and all(
        by_blob[name]["action"] == "keep" and "stopped at an earlier failure" in by_blob[name]["reason"]
        for name in untried
    )
    assert report["counts"] == {"delete": 0, "deleted": 1, "keep": 2 + len(untried), "failed": 1}
    left = state_of_blob_store(config)
    assert calls[0] not in left and calls[1] in left and untried <= left.keys()


def _open_task_with_an_unadopted_snapshot(config: dict[str, Any]) -> tuple[TaskStorage, str]:
    """A task kept open whose latest background snapshot is uploaded but not adopted yet: no checkpoint names it,
    and the next commit will (changelog.snapshot.interval.commits is 2)."""
    storage = TaskStorage.open(config, "task-0")
    counts = storage.store("counts")
    prefix = "clicks/task-0/counts/changelog/snapshot/"
    with blobs_of(config) as store:
        for run in range(4):
            counts.put(f"k{run}", run)
            storage.commit_durably({"clicks": str(run)})
        named: set[str] = set()
        for entry in CheckpointLog(store, "clicks", "task-0").entries():
            assert isinstance(entry.checkpoint, CheckpointV2)
            for marker in entry.checkpoint.markers_for("changelog").values():
                named.update(Recipe.decode(marker, prefix="clicks/task-0/counts/changelog/").blob_names())

        def unadopted() -> list[str]:
            return [name for name in store.list(prefix) if name not in named]

        wait_until(unadopted)
        return storage, unadopted()[0]


def test_gc_with_grace_0_warns_and_does_not_delete_the_snapshot_the_next_commit_adopts_without_force(
    capsys: pytest.CaptureFixture[str], tmp_path: Path
) -> None:
    config = base_config(tmp_path, (tmp_path / "blobs").as_uri())
    path = write_config(tmp_path / "job.properties", config)
    storage, snapshot = _open_task_with_an_unadopted_snapshot(config)
    try:
        # the dry run shows it as DELETE under --grace 0, flagged, with a warning on stderr and in the report
        code, out, err = cli(capsys, "gc", str(path), "--grace", "0", "--json")
        report = json.loads(out)
        item = {i["blob"]: i for i in report["items"]}[snapshot]
        assert code == 0 and item["action"] == "delete" and "a running or next commit may name it" in item["reason"]
        assert "warning: --grace 0 is below the safe grace 1h" in err and "changelog.gc.grace.period.ms" in err
        assert "commit in flight or the next commit" in err and any("safe grace" in n for n in report["notes"])
        assert report["safe_grace_s"] == 3600
        # --apply refuses it: exit 2, nothing deleted, and the message says what to do
        before = state_of_blob_store(config)
        code, out, err = cli(capsys, "gc", str(path), "--grace", "0", "--apply")
        assert code == 2 and out == "" and "refused, nothing deleted" in err
        assert "--grace 1h or more" in err and "--force" in err
        assert state_of_blob_store(config) == before
        # the default grace keeps it (young), and says so, without a warning
        code, out, err = cli(capsys, "gc", str(path), "--apply", "--json")
        item = {i["blob"]: i for i in json.loads(out)["items"]}[snapshot]
        assert code == 0 and err == "" and item["action"] == "keep" and "younger than the grace" in item["reason"]
        assert snapshot in state_of_blob_store(config)
        # the job goes on: its next commits, and their checkpoints, restore
        counts = storage.store("counts")
        for run in range(4, 6):
            counts.put(f"k{run}", run)
            storage.commit_durably({"clicks": str(run)})
    finally:
        storage.close()
    code, out, _ = cli(capsys, "verify", str(path), "task-0")
    assert code == 0, out
    dumped = {
        json.loads(x)["key"]: json.loads(x)["value"]
        for x in cli(capsys, "dump", str(path), "task-0", "counts")[1].splitlines()
    }
    assert dumped == {f"k{run}": run for run in range(6)}


def test_gc_grace_below_a_backends_grace_period_is_unsafe_and_at_it_is_not(
    capsys: pytest.CaptureFixture[str], job: tuple[Path, dict, dict]
) -> None:
    path, config, _ = job
    planted = _plant_garbage(config, None)
    slower = ("-D", "changelog.gc.grace.period.ms=2h")
    code, out, err = cli(capsys, "gc", str(path), "--grace", "1h", "--apply", *slower)
    assert code == 2 and "--grace 1h is below the safe grace 2h" in err and "--grace 2h or more" in err
    assert planted["unreferenced blob"] in state_of_blob_store(config)
    code, out, err = cli(capsys, "gc", str(path), "--grace", "2h", "--apply", *slower)
    assert code == 0 and err == "" and "warning" not in out
    assert planted["unreferenced blob"] not in state_of_blob_store(config)
    # --force goes ahead, still warning (an old blob is not flagged: it is past the safe grace anyway)
    with blobs_of(config) as store:
        store.put(planted["unreferenced blob"], b"garbage", metadata={"created_at": f"{time.time() - 5400:.3f}"})
    code, out, err = cli(capsys, "gc", str(path), "--grace", "1h", "--apply", "--force", *slower)
    assert code == 0 and "warning: --grace 1h is below the safe grace 2h" in err
    assert f"DELETED  unreferenced blob  {planted['unreferenced blob']}" in out and "may name it" in out
    assert planted["unreferenced blob"] not in state_of_blob_store(config)


def test_gc_deletes_a_tasks_garbage_only_soon_after_reading_its_checkpoints(
    capsys: pytest.CaptureFixture[str], job: tuple[Path, dict, dict], monkeypatch: pytest.MonkeyPatch
) -> None:
    """A commit written after gc read a task's checkpoints may name an old unreferenced blob (a writer names one
    younger than half its grace, then writes its checkpoint within a quarter): past a quarter of the backends' grace
    since the mark, gc keeps what it judged, and says to run again."""
    path, config, _ = job
    planted = _plant_garbage(config, None)
    import statebackend.cli.gc as gc_module

    later = [0.0]

    class Clock:
        @staticmethod
        def time() -> float:
            return time.time() + later[0]

    judged = gc_module._task_items

    def slow_task_items(*args: Any, **kwargs: Any) -> Any:
        items = judged(*args, **kwargs)
        later[0] += 16 * 60  # a quarter of the changelog's 1h grace, and a minute
        return items

    monkeypatch.setattr(gc_module, "time", Clock)
    monkeypatch.setattr(gc_module, "_task_items", slow_task_items)
    before = state_of_blob_store(config)
    code, out, _ = cli(capsys, "gc", str(path), "--grace", "1h", "--apply", "--json")
    report = json.loads(out)
    by_blob = {item["blob"]: item for item in report["items"]}
    assert code == 0 and report["counts"]["deleted"] == 0
    for kind in ("orphaned task", "orphaned store", "unreferenced blob"):
        assert by_blob[planted[kind]]["action"] == "keep" and "run gc again" in by_blob[planted[kind]]["reason"]
    assert state_of_blob_store(config) == before
