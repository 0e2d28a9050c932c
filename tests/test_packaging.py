"""Everything installs under the statebackend namespace: a user's own modules never shadow ours."""

from __future__ import annotations

import copy
import logging
import subprocess
import sys
import textwrap
from pathlib import Path

import statebackend
from statebackend.task import TaskStorage

SCRIPT = textwrap.dedent("""
    import tempfile
    from pathlib import Path

    import checkpoint, backends  # the user's own modules, first on sys.path
    from statebackend import TaskStorage

    assert checkpoint.MINE and backends.MINE
    root = Path(tempfile.mkdtemp())
    config = {"job.name": "j", "state.local.dir": str(root / "state"), "blob.store.url": (root / "b").as_uri(),
              "blob.store.create.if.missing": True, "stores.s.backup.factories": "changelog,blobsnapshot"}
    with TaskStorage.open(config, "task-0") as task:
        task.store("s").put(b"k", b"v")
        task.commit_durably({"input": "1"})
    with TaskStorage.open(config, "task-0") as task:
        print(dict(task.store("s").items()))
""")


def test_a_users_own_checkpoint_and_backends_modules_do_not_shadow_ours(tmp_path: Path) -> None:
    # seen: a user's checkpoint.py gave an ImportError from inside statebackend, and a user's backends/ package
    # "could not be imported ... reinstall statebackend"
    (tmp_path / "checkpoint.py").write_text("MINE = True\n")
    (tmp_path / "backends").mkdir()
    (tmp_path / "backends" / "__init__.py").write_text("MINE = True\n")
    (tmp_path / "job.py").write_text(SCRIPT)
    result = subprocess.run(
        [sys.executable, "job.py"], cwd=tmp_path, capture_output=True, text=True, timeout=120, check=False
    )
    assert result.returncode == 0, result.stderr[-3000:]
    assert result.stdout.strip() == "{b'k': b'v'}"


def test_the_package_is_typed_and_versioned() -> None:
    assert (Path(statebackend.__file__).parent / "py.typed").is_file()
    assert statebackend.__version__.count(".") >= 2


def test_every_log_record_comes_from_a_statebackend_logger(tmp_path: Path, caplog: object) -> None:
    import pytest

    assert isinstance(caplog, pytest.LogCaptureFixture)
    config = {
        "job.name": "j",
        "state.local.dir": str(tmp_path / "state"),
        "blob.store.url": "memory://packaging",
        "stores.s.backup.factories": "changelog,blobsnapshot",
        "changelog.snapshot.interval.commits": 1,
    }
    with caplog.at_level(logging.DEBUG):
        for n in range(3):
            with TaskStorage.open(config, "task-0") as task:
                task.store("s").put(b"k%d" % n, b"v")
                task.commit_durably({"input": str(n)})
    ours = {record.name for record in caplog.records if not record.name.startswith(("azure", "botocore", "urllib3"))}
    assert ours, "the run logged nothing at DEBUG: the test proves nothing"
    assert all(name == "statebackend" or name.startswith("statebackend.") for name in ours), ours


def test_objects_that_hold_resources_compare_by_identity(tmp_path: Path) -> None:
    # attrs' value equality on a TaskStorage compared every store, pool and log field by field, and made two open
    # handles of the same task "equal"
    config = {
        "job.name": "j",
        "state.local.dir": str(tmp_path / "state"),
        "blob.store.url": "memory://identity",
        "stores.s.backup.factories": "changelog",
    }
    with TaskStorage.open(config, "task-0") as task:
        # a shallow copy holds the very same fields: equal by value, not the same object
        assert copy.copy(task) != task
        assert copy.copy(task.commit_manager) != task.commit_manager
        assert copy.copy(task.checkpoint_log) != task.checkpoint_log
        assert len({task, task.stores["s"], task.checkpoint_log}) == 3  # hashable, by identity
