"""``statebackend gc`` on blobs a backend shares across tasks (its blob lifetime's ``shared_prefixes``): no task's
collector deletes them, so the command is their collector. It marks them from the checkpoints of every task of the
job and deletes, by the job-level sweep (``statebackend.kit.sweep_shared``), exactly the unmarked ones past the
grace period; its ``--grace`` and ``--force`` rules hold as for a task's own blobs."""

from __future__ import annotations

import json
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from statebackend.backends.changelog.admin import ChangelogAdmin
from statebackend.backends.changelog.lifetime import ChangelogLifetime

from tests.backend_helpers import OLD, blobs_of, cli, state_of_blob_store

SHARED = "clicks/shared/"
#: named by a marker of each task (its own blob), and by the markers of no task
OF_TASK_0 = SHARED + "chunk-of-task-0"
OF_TASK_1 = SHARED + "chunk-of-task-1"
OLD_GARBAGE = SHARED + "chunk-of-task-9"
YOUNG_GARBAGE = SHARED + "chunk-young"
AGELESS_GARBAGE = SHARED + "chunk-ageless"


@pytest.fixture
def shared_chunks(monkeypatch: pytest.MonkeyPatch, job: tuple[Path, dict, dict]) -> Iterator[dict[str, Any]]:
    """The job, its changelog backend declaring ``<job>/shared/`` shared and each task's markers naming that task's
    chunk there, and the chunks planted: every one but the young one a week old (the ageless one has no age)."""
    monkeypatch.setattr(ChangelogLifetime, "shared_prefixes", lambda self: (f"{self.context.job_name}/shared/",))
    own = ChangelogAdmin.referenced_blobs

    def referenced(self: ChangelogAdmin, store: str, marker: str) -> set[str]:
        return own(self, store, marker) | {f"{self.context.job_name}/shared/chunk-of-{self.context.task_name}"}

    monkeypatch.setattr(ChangelogAdmin, "referenced_blobs", referenced)
    path, config, _ = job
    with blobs_of(config) as store:
        for name in (OF_TASK_0, OF_TASK_1, OLD_GARBAGE):
            store.put(name, b"chunk", metadata={"created_at": OLD})
        store.put(YOUNG_GARBAGE, b"chunk", metadata={"created_at": f"{time.time():.3f}"})
        store.put(AGELESS_GARBAGE, b"chunk", metadata={})
    yield {"path": path, "config": config}


def _gc(capsys: pytest.CaptureFixture[str], path: Path, *args: str) -> tuple[int, dict[str, Any]]:
    code, out, _ = cli(capsys, "gc", str(path), "--json", *args)
    return code, json.loads(out) if out else {}


def test_gc_marks_shared_blobs_from_every_task_and_deletes_only_the_old_unneeded_ones(
    capsys: pytest.CaptureFixture[str], shared_chunks: dict[str, Any]
) -> None:
    path, config = shared_chunks["path"], shared_chunks["config"]
    before = state_of_blob_store(config)
    code, report = _gc(capsys, path, "--grace", "1h")
    by_blob = {item["blob"]: item for item in report["items"]}
    assert code == 0 and state_of_blob_store(config) == before  # a dry run deletes nothing
    assert by_blob[OLD_GARBAGE]["kind"] == "unreferenced shared" and by_blob[OLD_GARBAGE]["action"] == "delete"
    assert by_blob[YOUNG_GARBAGE]["action"] == "keep" and "younger" in by_blob[YOUNG_GARBAGE]["reason"]
    assert by_blob[AGELESS_GARBAGE]["action"] == "keep" and "age is unknown" in by_blob[AGELESS_GARBAGE]["reason"]
    # each task's chunk is needed by that task's checkpoints alone, and the shared folder is no task of its own
    assert OF_TASK_0 not in by_blob and OF_TASK_1 not in by_blob
    assert not [item for item in report["items"] if item["task"] == "shared"]

    code, report = _gc(capsys, path, "--grace", "1h", "--apply")
    after = state_of_blob_store(config)
    assert code == 0 and set(before) - set(after) == {OLD_GARBAGE}
    assert {item["blob"] for item in report["items"] if item["action"] == "deleted"} == {OLD_GARBAGE}
    assert {OF_TASK_0, OF_TASK_1, YOUNG_GARBAGE, AGELESS_GARBAGE} <= set(after)
    assert cli(capsys, "verify", str(path), "task-0")[0] == 0 and cli(capsys, "verify", str(path), "task-1")[0] == 0


def test_gc_keeps_shared_blobs_younger_than_its_grace(
    capsys: pytest.CaptureFixture[str], shared_chunks: dict[str, Any]
) -> None:
    path, config = shared_chunks["path"], shared_chunks["config"]
    code, report = _gc(capsys, path, "--grace", "200h", "--apply")  # the planted chunks are a week (168h) old
    by_blob = {item["blob"]: item for item in report["items"]}
    assert code == 0 and by_blob[OLD_GARBAGE]["action"] == "keep" and "younger" in by_blob[OLD_GARBAGE]["reason"]
    assert OLD_GARBAGE in state_of_blob_store(config)


def test_gc_of_shared_blobs_below_the_safe_grace_needs_force(
    capsys: pytest.CaptureFixture[str], shared_chunks: dict[str, Any]
) -> None:
    path, config = shared_chunks["path"], shared_chunks["config"]
    before = state_of_blob_store(config)
    code, out, err = cli(capsys, "gc", str(path), "--grace", "0", "--apply")
    assert code == 2 and "refused, nothing deleted" in err and state_of_blob_store(config) == before
    code, report = _gc(capsys, path, "--grace", "0", "--apply", "--force")
    after = state_of_blob_store(config)
    # the guard is off: the young unneeded chunk goes too; one of unknown age never does (no memory between runs)
    assert code == 0 and set(before) - set(after) == {OLD_GARBAGE, YOUNG_GARBAGE}
    assert {OF_TASK_0, OF_TASK_1, AGELESS_GARBAGE} <= set(after)
    assert {item["blob"] for item in report["items"] if item["action"] == "deleted"} == {OLD_GARBAGE, YOUNG_GARBAGE}
