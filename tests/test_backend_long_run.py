"""The backend suite's stateful test under its long-run Hypothesis profile (many long histories of puts, overwrites,
deletes, commits, failed commits, restarts and restores), on the reference backend: what a few short histories
miss. CI runs it with the slow tests; about a minute."""

from __future__ import annotations

from collections.abc import Iterator
from typing import ClassVar

import pytest

from statebackend.testing.backend_designs import LONG_PROFILE, PROFILE_ENV, StatefulTests
from statebackend.testing.reference import REFERENCE_BACKEND

pytestmark = pytest.mark.slow


class TestReferenceBackendLongRun(StatefulTests):
    backup_factories: ClassVar[str] = REFERENCE_BACKEND
    test_timeout_s: ClassVar[float] = 240.0

    @pytest.fixture(autouse=True)
    def _long_profile(self, monkeypatch: pytest.MonkeyPatch) -> Iterator[None]:
        monkeypatch.setenv(PROFILE_ENV, LONG_PROFILE)
        yield
