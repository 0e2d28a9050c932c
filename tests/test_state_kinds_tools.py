"""List and map stores (``stores.<name>.kind``) outside a task's own reads and writes: what checkpoints record of
them, where their error class lives, the command's ``dump``, the expiry callback and ``initial_state``."""

from __future__ import annotations

from pathlib import Path

import pytest

from statebackend import errors
from statebackend.config import Settings
from statebackend.lifecycle import recorded_serdes
from statebackend.store import kinds
from statebackend.task import TaskStorage
from statebackend.values import base_recorded
from tests.test_state_kinds import make_config


def test_the_one_place_that_records_a_stores_serdes_records_its_kind(tmp_path: Path) -> None:
    config = make_config(tmp_path, **{"stores.plain.backup.factories": "changelog", "stores.plain.key.serde": "string"})
    settings = Settings.from_config(config)
    for name, kind in (("events", "list"), ("counters", "map")):
        assert base_recorded(settings.stores[name])["kind"] == kind
        assert recorded_serdes(settings.stores[name]) == base_recorded(settings.stores[name])
    assert "kind" not in base_recorded(settings.stores["plain"])  # a value store's checkpoints stay as they were
    with TaskStorage.open(config, "task-0") as task:
        task.commit_durably({"input": "0"})
        assert task.last_checkpoint is not None
        assert {name: dict(task.last_checkpoint.serdes[name]) for name in ("events", "counters", "plain")} == {
            name: base_recorded(settings.stores[name]) for name in ("events", "counters", "plain")
        }


def test_kind_error_lives_in_the_error_tree_and_imports_from_kinds_as_before() -> None:
    assert kinds.KindError is errors.KindError
    assert issubclass(errors.KindError, errors.UsageError) and issubclass(errors.KindError, AttributeError)
    with pytest.raises(errors.KindError, match="store 'events' is a list store"):
        raise kinds.wrong_kind("events", "list", "put")
