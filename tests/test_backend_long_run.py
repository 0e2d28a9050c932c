"""The backend suite's stateful test over long runs (many long histories of puts, overwrites, deletes, commits,
failed commits, restarts and restores), on the reference backend: what a few short histories miss. With the slow
tests it runs the ``statebackend-ci`` Hypothesis profile (100 histories of up to 60 steps, about 10 s);
``STATEBACKEND_HYPOTHESIS_PROFILE=statebackend-long`` runs the full long run here (300 of up to 60 steps, about
20 s), and any other profile the variable names. The histories' local dirs are in RAM where the machine has one
(/dev/shm): no process dies here, so fsyncs change nothing the test observes, and on a shared disk they were most of
its time (300 histories took 40 s on disk)."""

from __future__ import annotations

import os
from collections.abc import Iterator
from pathlib import Path
from typing import ClassVar

import pytest

from statebackend.testing.backend_designs import CI_PROFILE, PROFILE_ENV, StatefulTests
from statebackend.testing.reference import REFERENCE_BACKEND
from tests.crash_child import crash_workdir

pytestmark = pytest.mark.slow


class TestReferenceBackendLongRun(StatefulTests):
    backup_factories: ClassVar[str] = REFERENCE_BACKEND
    test_timeout_s: ClassVar[float] = 240.0

    @pytest.fixture
    def tmp_path(self) -> Iterator[Path]:
        """The histories' local dirs in RAM where possible: no process dies here, so LMDB's fsyncs change nothing
        the test can observe, and on a shared disk they are most of its time."""
        with crash_workdir("long-run-") as path:
            yield path

    @pytest.fixture(autouse=True)
    def _long_profile(self, monkeypatch: pytest.MonkeyPatch) -> Iterator[None]:
        """The CI-sized long run unless the environment names a profile (``statebackend-long``: the full one)."""
        monkeypatch.setenv(PROFILE_ENV, os.environ.get(PROFILE_ENV) or CI_PROFILE)
        yield
