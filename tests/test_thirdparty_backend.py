"""The example third-party backend (examples/thirdparty_backend, entry point ``fullcopy``) plugs in with no edit to
the framework: the registry finds it through its entry point, and a store configured with it commits and restores
exactly through TaskStorage. ``./dev test`` installs it; its own contract-suite tests run in the same pytest run
(testpaths in pyproject.toml)."""

from __future__ import annotations

import importlib.metadata
import shutil
from pathlib import Path

import pytest

from statebackend.blobstores.memory import MemoryBlobStore
from statebackend.registry import _REGISTRY, ENTRY_POINT_GROUP, known_factories, resolve_factory
from statebackend.task import TaskStorage
from statebackend.testing.backend_contract import contents
from tests.backend_helpers import commit_round, task_config

ROOT = Path(__file__).resolve().parent.parent
EXAMPLE = ROOT / "examples" / "thirdparty_backend"
TARGET = "sb_fullcopy.factory:FullCopyStateBackendFactory"


@pytest.fixture(scope="module", autouse=True)
def example_installed() -> None:
    try:
        importlib.metadata.distribution("statebackend-fullcopy")
    except importlib.metadata.PackageNotFoundError:
        pytest.fail(
            "the example backend is not installed: pip install -e examples/thirdparty_backend (./dev test does it)"
        )


def test_the_registry_finds_it_by_its_short_name_through_the_entry_point() -> None:
    (entry_point,) = [ep for ep in importlib.metadata.entry_points(group=ENTRY_POINT_GROUP) if ep.name == "fullcopy"]
    assert entry_point.value == TARGET
    assert entry_point.dist is not None and entry_point.dist.name == "statebackend-fullcopy"
    assert "fullcopy" not in _REGISTRY  # not a built-in short name: only the entry point knows it
    assert known_factories()["fullcopy"] == TARGET
    resolved = resolve_factory("fullcopy")
    assert resolved.canonical_name == "fullcopy"
    assert type(resolved.factory).__module__ == "sb_fullcopy.factory"
    # the dotted path of the same class records the short name, so checkpoints never split between spellings
    assert resolve_factory(TARGET).canonical_name == "fullcopy"


def test_a_store_backed_up_by_it_commits_and_restores_exactly_through_task_storage(tmp_path: Path) -> None:
    config = task_config(tmp_path / "local", "fullcopy", **{"task.checkpoint.retained": 2})
    blobs = MemoryBlobStore()
    model: dict[bytes, bytes] = {}
    with TaskStorage.open(config, "task-0", blob_store=blobs) as task:
        for round_no in range(4):
            checkpoint = commit_round(task, round_no, model)
        marker = checkpoint.markers_for("fullcopy")["counts"]
        assert marker.startswith("job/task-0/counts/fullcopy/") and blobs.exists(marker)
    shutil.rmtree(tmp_path / "local")
    with TaskStorage.open(config, "task-0", blob_store=blobs) as task:
        assert contents(task) == model
        assert task.restored is not None and task.restored.input_offsets == {"input": "3"}
        assert task.metrics.counter("restore.stores.full") == 1


def test_the_framework_needed_no_edit_to_know_it() -> None:
    for folder in ("statebackend", "backends", "checkpoint"):
        for path in (ROOT / folder).rglob("*.py"):
            text = path.read_text()
            assert "fullcopy" not in text and "sb_fullcopy" not in text, path
    assert "fullcopy" not in (ROOT / "pyproject.toml").read_text()  # statebackend's own entry points
    assert (EXAMPLE / "pyproject.toml").read_text().count('[project.entry-points."statebackend.backends"]') == 1
