"""The base of the backend contract suite (:class:`statebackend.testing.backend_contract.BackendContract`): its
settings (the class attributes a backend's test module sets), its fixtures and the helpers its tests share. Kept apart
so the suite's tests can live in more than one module; import the suite from ``backend_contract``."""

from __future__ import annotations

import logging
import shutil
import time
import uuid
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any, ClassVar

import pytest

from statebackend.blobstores.base import BlobStore
from statebackend.blobstores.memory import MemoryBlobStore
from statebackend.contracts import DEFAULT_GRACE_MS
from statebackend.task import TaskStorage
from statebackend.testing.backend_support import contents, write_round
from statebackend.testing.controlled import ControlledBlobStore
from statebackend.testing.deadline import deadline, scaled

__all__ = ["BackendContractBase", "SuiteClock"]


class SuiteClock:
    """The wall clock (``time.time``) as the process reads it while a test runs, moved forward by the test: ages of
    blobs, grace periods and ``created_at`` metadata all follow it, so a test can pass a grace period of an hour in
    no time. Installed by the ``clock`` fixture of :class:`BackendContractBase`; never moves backward."""

    def __init__(self, real: Callable[[], float]) -> None:
        self._real = real
        #: seconds added to the real clock
        self.offset_s = 0.0

    def __call__(self) -> float:
        return self._real() + self.offset_s

    def advance(self, seconds: float) -> None:
        """Move the clock forward by ``seconds`` (>= 0)."""
        if seconds < 0:
            raise ValueError(f"SuiteClock.advance takes seconds >= 0, got {seconds!r}")
        self.offset_s += seconds


class BackendContractBase:
    """The suite's settings, fixtures and shared helpers (see :mod:`statebackend.testing.backend_contract`)."""

    #: the backend under test, as ``stores.<name>.backup.factories`` takes it: its factory name (or dotted path)
    #: first. Set it in the subclass
    backup_factories: ClassVar[str] = "changelog"
    #: settings added to every test's config (the backend's own ``<factory>.*`` options, say), before
    #: :meth:`backend_settings` and what the test sets
    extra_config: ClassVar[dict[str, Any]] = {}
    #: a built-in backend committed beside the one under test (a dual commit); ``None``: the backend alone
    dual_with: ClassVar[str | None] = None
    #: the backend uploads a whole copy of each store per commit (O(state), allowed but bounded by one copy)
    uploads_whole_state: ClassVar[bool] = False
    #: seconds a test may run on an idle machine before it fails (a hung backend fails, it does not hang the run;
    #: stretched by the machine's load, statebackend.testing.deadline.scaled); 0: no deadline
    test_timeout_s: ClassVar[float] = 120.0
    #: seconds a test waits for one commit or one held write before it fails
    wait_s: ClassVar[float] = 30.0
    #: the grace period of the backend's blob lifetime in the suite's config (ms): the clock tests move time past it
    grace_ms: ClassVar[int] = DEFAULT_GRACE_MS

    def backend_settings(self, test: str) -> dict[str, object]:
        """The hook for settings of the backend under test in every test (``test``: the test's name), applied after
        ``extra_config`` and before what the test itself sets: small chunks, small records, a short sweep interval,
        so that the suite's few hundred keys exercise what a large state would. Default: none."""
        return {}

    def is_index_blob(self, name: str) -> bool:
        """Whether blob ``name`` is an index (a manifest, a marker blob) rather than data: the write-fault tests fail
        data writes but not index writes. Default: every blob is data."""
        return False

    @pytest.fixture
    def clock(self, monkeypatch: pytest.MonkeyPatch) -> SuiteClock:
        """The process's wall clock, under the test's control (:class:`SuiteClock`). A backend that reads its time
        elsewhere than ``time.time`` overrides :meth:`move_clock`."""
        moved = SuiteClock(time.time)
        monkeypatch.setattr(time, "time", moved)
        return moved

    def move_clock(self, clock: SuiteClock, seconds: float) -> None:
        """Move the time the backend under test sees forward by ``seconds``."""
        clock.advance(seconds)

    @pytest.fixture(autouse=True)
    def _contract_deadline(self, request: pytest.FixtureRequest) -> Iterator[None]:
        self._controlled: list[ControlledBlobStore] = []
        self._current_test = request.node.name
        try:
            with deadline(scaled(self.test_timeout_s), request.node.nodeid):  # stretched on a loaded machine
                yield
        finally:
            for store in self._controlled:  # a failed test must not leave writes held on the shared commit pool
                store.release.set()

    def controlled(self, blobs: BlobStore) -> ControlledBlobStore:
        """``blobs`` wrapped to hold or fail chosen writes; every hold is released when the test ends."""
        store = ControlledBlobStore(blobs)
        store.hold_timeout_s = 2 * self.wait_s
        self._controlled.append(store)
        return store

    @pytest.fixture
    def blobs(self) -> Iterator[BlobStore]:
        """The blob store of each test: a new in-memory store. Override it to run the suite on another store
        (``file://`` in ``tmp_path``, a server)."""
        with MemoryBlobStore() as store:
            yield store

    @property
    def backend(self) -> str:
        """The backend under test: the first of ``backup_factories``."""
        return self.backup_factories.split(",")[0].strip()

    def backend_prefix(self, store: str = "counts") -> str:
        """Where the backend under test keeps the blobs of ``store`` in the suite's job (its context's
        ``blob_prefix``)."""
        return f"job/task-0/{store}/{self.backend}/"

    def is_commit_upload(self, name: str) -> bool:
        """Whether a write is the backend's upload for a commit (a background snapshot's is not)."""
        return name.startswith(self.backend_prefix()) and "/snapshot/" not in name

    def store_config(self, store: str) -> dict[str, object]:
        """The settings that declare ``store`` backed up by the backend under test (and ``dual_with``)."""
        if self.dual_with is None:
            return {f"stores.{store}.backup.factories": self.backup_factories}
        both = f"{self.backup_factories},{self.dual_with}"
        return {f"stores.{store}.backup.factories": both, f"stores.{store}.restore.factories": both}

    def make_config(self, tmp_path: Path, **extra: object) -> dict[str, object]:
        """The config of a test's task: a job with the store ``counts`` backed up by the backend under test, its
        local dir in ``tmp_path``, then :attr:`extra_config`, :meth:`backend_settings` and ``extra``, in that
        order (the last wins)."""
        config: dict[str, object] = {
            "job.name": "job",
            "state.local.dir": str(tmp_path / "local"),
            "blob.store.url": f"memory://{uuid.uuid4().hex}",
            "task.checkpoint.retained": 2,
            **self.store_config("counts"),
        }
        config.update(self.extra_config)
        config.update(self.backend_settings(self._test_name))
        config.update(extra)
        return config

    @property
    def _test_name(self) -> str:
        return getattr(self, "_current_test", "")

    def restore_after_damage(
        self,
        blobs: BlobStore,
        tmp_path: Path,
        caplog: pytest.LogCaptureFixture,
        *,
        rounds: int,
        damage: Callable[[BlobStore, list[str]], list[str]],
        errors: type[BaseException] | tuple[type[BaseException], ...],
        after_commit: Callable[[BlobStore, int], None] | None = None,
    ) -> tuple[list[str], str]:
        """Commit ``rounds`` rounds, ``damage`` the backend's blobs (it gets their names and returns the ones it
        damaged), wipe the local dir and restore. Alone, the restore must raise one of ``errors``; in a dual commit
        it must fall back to ``dual_with`` (logged at ERROR) and give the exact state. ``after_commit(blobs, round)``
        runs after each commit. Returns the damaged names and the error's text (alone) or the fallback's log lines
        (dual)."""
        config = self.make_config(tmp_path)
        model: dict[bytes, bytes] = {}
        with TaskStorage.open(config, "task-0", blob_store=blobs) as task:
            for round_no in range(rounds):
                write_round(task, round_no, model)
                task.commit_durably({"input": str(round_no)})
                if after_commit is not None:
                    after_commit(blobs, round_no)
        names = list(blobs.list(self.backend_prefix()))
        assert names, "the backend wrote no blobs under its prefix"
        victims = damage(blobs, names)
        shutil.rmtree(tmp_path / "local")
        if self.dual_with is None:
            with pytest.raises(errors) as excinfo:
                TaskStorage.open(config, "task-0", blob_store=blobs).close()
            return victims, str(excinfo.value)
        with (
            caplog.at_level(logging.ERROR, logger="statebackend"),
            TaskStorage.open(config, "task-0", blob_store=blobs) as task,
        ):
            assert contents(task) == model, f"the fallback to {self.dual_with} did not give the exact state"
        fallbacks = [
            record.getMessage()
            for record in caplog.records
            if "falling back" in record.getMessage() and self.backend in record.getMessage()
        ]
        assert fallbacks, f"the restore did not fall back from {self.backend} to {self.dual_with}"
        return victims, "\n".join(fallbacks)
