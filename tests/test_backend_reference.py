"""The reference backend (statebackend.testing.reference), the base of the suite's backend mutants, passes the
backend contract suite alone and in dual commits with each built-in backend."""

from __future__ import annotations

from pathlib import Path
from typing import ClassVar

import pytest

from statebackend.testing.backend_contract import BackendContract
from statebackend.testing.reference import REFERENCE_BACKEND


class TestReferenceBackend(BackendContract):
    backup_factories: ClassVar[str] = REFERENCE_BACKEND


class TestReferenceBackendDualWithChangelog(BackendContract):
    backup_factories: ClassVar[str] = REFERENCE_BACKEND
    dual_with: ClassVar[str | None] = "changelog"


class TestReferenceBackendDualWithBlobSnapshot(BackendContract):
    backup_factories: ClassVar[str] = REFERENCE_BACKEND
    dual_with: ClassVar[str | None] = "blobsnapshot"


def test_the_kill_test_runs_a_backend_registered_only_in_the_testing_process(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A team's test module may register its backend at run time (``register_factory``) instead of declaring an
    entry point: the kill test's child processes never import that module, yet must run the very same backend
    (the registration crosses with the spec), or a correct backend would fail the suite."""
    from statebackend import registry
    from statebackend.registry import register_factory
    from statebackend.testing.kills import KillSpec, kill_rounds

    monkeypatch.setattr(registry, "_REGISTRY", dict(registry._REGISTRY))
    register_factory("team-backend", REFERENCE_BACKEND)
    config = TestReferenceBackend().make_config(
        tmp_path,
        **{
            "blob.store.url": f"file://{tmp_path / 'blobs'}",
            "stores.counts.backup.factories": "team-backend",
            "stores.counts.restore.factory": "team-backend",
        },
    )
    durable = kill_rounds(KillSpec(config=config), tmp_path / "kills", rounds=2, seed="registered", wait_s=30)
    assert durable >= 4  # the parent's 3 commits, then the first child committed: it resolved "team-backend"


def test_a_round_is_killed_only_after_the_childs_first_acknowledged_commit(tmp_path: Path) -> None:
    """``kill_rounds`` kills a non-final round's child once it logged a commit: the child creates ``durable.log``
    before its first commit, so the file's existence alone is not enough (under load, the kill then came before any
    commit). A stand-in child creates the log, then writes its first line 1 s later."""
    import subprocess
    import sys

    from statebackend.testing.kills import _wait_for

    log = tmp_path / "durable.log"
    script = f"import pathlib, time; p = pathlib.Path({str(log)!r}); p.touch(); time.sleep(1); p.write_text('4\\n')"
    child = subprocess.Popen([sys.executable, "-c", script], stderr=subprocess.PIPE, text=True)
    try:
        _wait_for(child, log, 30, "the stand-in", nonempty=True)
        assert log.read_text() == "4\n"
    finally:
        child.wait()
