"""The admin contract's marker methods: conservative defaults, and the changelog backend's describe, referenced
blobs and verify on real recipes (the CLI tests run them through the command)."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
from statebackend.backends.changelog.admin import ChangelogAdmin
from statebackend.backends.changelog.marker import Recipe, Step

from statebackend import TaskStorage
from statebackend.blobstores.base import BlobStore, open_blob_store
from statebackend.cli._common import NoExecutor
from statebackend.config import Settings
from statebackend.contracts import StateBackendAdmin
from statebackend.errors import CorruptDataError
from statebackend.registry import resolve_factory
from tests.backend_helpers import backend_context

#: the blob prefix of store s of task t, under which its recipe names blobs
PREFIX = "job/t/s/changelog/"


class _Plain(StateBackendAdmin):
    def create_resources(self) -> None:
        pass

    def validate_resources(self) -> None:
        pass


def test_the_defaults_say_nothing() -> None:
    admin = _Plain()
    assert admin.describe_marker("s", "m") is None
    assert admin.referenced_blobs("s", "m") is None
    assert admin.verify_marker("s", "m") is None


def _job(tmp_path: Path) -> tuple[dict[str, Any], str]:
    config: dict[str, Any] = {
        "job.name": "job",
        "state.local.dir": str(tmp_path / "state"),
        "blob.store.url": (tmp_path / "b").as_uri(),
        "blob.store.create.if.missing": True,
        "stores.s.backup.factories": "changelog",
        "changelog.snapshot.interval.commits": 3,
    }
    for run in range(5):
        with TaskStorage.open(config, "t") as task:
            task.store("s", typed=False).put(f"k{run}".encode(), b"v" * 100)
            checkpoint = task.commit_durably({"in": str(run)})
    return config, checkpoint.markers_for("changelog")["s"]


def _admin(config: dict[str, Any], store: BlobStore) -> ChangelogAdmin:
    options = Settings.from_config(config).backend_options_for("changelog")
    context = backend_context("changelog", store, task="t", executor=NoExecutor(), options=options)
    admin = resolve_factory("changelog").factory.admin(context)
    assert isinstance(admin, ChangelogAdmin)
    return admin


def test_changelog_describes_names_and_verifies_its_recipe(tmp_path: Path) -> None:
    config, marker = _job(tmp_path)
    recipe = Recipe.decode(marker, prefix=PREFIX)
    names = set(recipe.blob_names())
    with open_blob_store(config["blob.store.url"]) as store:
        admin = _admin(config, store)
        assert admin.referenced_blobs("s", marker) == names
        described = admin.describe_marker("s", marker)
        assert described is not None and described["blobs"] == len(names) and described["missing"] == 0
        assert described["bytes"] == sum(store.head(name).size for name in names)
        assert admin.verify_marker("s", marker) == []

        # a recipe with a gap in its chain (format 2 cannot spell one; a format 1 marker can), and one whose delta is
        # gone
        assert recipe.snapshot is not None and recipe.snapshot.seq == 3 and [d.seq for d in recipe.deltas] == [4, 5]
        gapped = {
            "format": 1,
            "snapshot": _format_1_step(recipe.snapshot),
            "deltas": [_format_1_step(recipe.deltas[1])],
        }  # snapshot 3, then delta 5
        assert admin.verify_marker("s", json.dumps(gapped)) == [
            "store s: the recipe jumps from seq 3 to seq 5; a delta of the chain is missing from the marker"
        ]
        last = recipe.deltas[-1].name
        assert last is not None
        store.delete(last)
        described = admin.describe_marker("s", marker)
        assert described is not None and described["missing"] == 1
        assert [s["bytes"] for s in described["steps"] if s["blob"] == last] == [None]
        (problem,) = admin.verify_marker("s", marker)
        assert last in problem and "missing" in problem

        # a marker that does not decode: describe raises, verify reports it
        with pytest.raises(CorruptDataError):
            admin.describe_marker("s", "{not json")
        (problem,) = admin.verify_marker("s", "{not json")
        assert "not valid JSON" in problem


def _format_1_step(step: Step) -> dict[str, object]:
    return {"seq": step.seq, "checkpoint_id": step.checkpoint_id, "token": step.token, "name": step.name}


def test_changelog_verify_names_a_snapshot_of_another_store(tmp_path: Path) -> None:
    """Store s's blobs under store other's names: intact, and refused because their headers say they are s's."""
    config, marker = _job(tmp_path)
    recipe = Recipe.decode(marker, prefix=PREFIX)
    assert recipe.snapshot is not None
    with open_blob_store(config["blob.store.url"]) as store:
        for name in recipe.blob_names():
            store.put(name.replace("/s/", "/other/"), store.get(name))
        admin = _admin(config, store)
        wrong_store = admin.verify_marker("other", marker)  # the blobs say they are store s's
        assert len(wrong_store) == len(list(recipe.blob_names()))
        assert all("is intact but is not the" in p for p in wrong_store)
