"""The backend contract suite's tests that bite on designs unlike the built-ins (issue 31): a clock moved past the
grace period, write faults on a chosen subset of an upload's writes, one missing blob under an intact index, what a
backend builds on after its restore failed, changed values under unchanged keys, and a stateful test of random
histories. Part of :class:`statebackend.testing.backend_contract.BackendContract` (import the suite from there); each
test's docstring says the data loss it catches.

The stateful test runs under the Hypothesis profile that ``STATEBACKEND_HYPOTHESIS_PROFILE`` names:
:data:`SUITE_PROFILE` (the default: a few short histories), :data:`CI_PROFILE` (a third of the long run's histories,
as long: what tests/test_backend_long_run.py runs in every full test run) or :data:`LONG_PROFILE` (many long ones).
"""

from __future__ import annotations

import os
import shutil
import uuid
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
from hypothesis import HealthCheck, settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, rule, run_state_machine_as_test

from statebackend.blobstores.base import BlobStore
from statebackend.checkpoint import LogEntry
from statebackend.errors import CommitError, CorruptDataError, NotFoundError
from statebackend.task import TaskStorage
from statebackend.testing.backend_base import BackendContractBase, SuiteClock
from statebackend.testing.backend_support import contents, flood, incompressible, write_round

__all__ = ["CI_PROFILE", "LONG_PROFILE", "PROFILE_ENV", "SUITE_PROFILE", "DesignTests", "StatefulTests"]

#: the environment variable that names the Hypothesis profile of the suite's stateful test
PROFILE_ENV = "STATEBACKEND_HYPOTHESIS_PROFILE"
#: the default profile: a few short histories (seconds)
SUITE_PROFILE = "statebackend-suite"
#: the long-run profile: many long histories (on the reference backend about 20 s with its local dirs in RAM, a
#: minute on a shared disk)
LONG_PROFILE = "statebackend-long"
#: the long run of every full test run (tests/test_backend_long_run.py): a third of :data:`LONG_PROFILE`'s
#: histories, each as long (about 10 s on the reference backend with its local dirs in RAM)
CI_PROFILE = "statebackend-ci"

_COMMON: dict[str, Any] = {"deadline": None, "suppress_health_check": list(HealthCheck), "derandomize": False}
settings.register_profile(SUITE_PROFILE, max_examples=6, stateful_step_count=12, **_COMMON)
settings.register_profile(LONG_PROFILE, max_examples=300, stateful_step_count=60, **_COMMON)
settings.register_profile(CI_PROFILE, max_examples=100, stateful_step_count=60, **_COMMON)


class StatefulTests(BackendContractBase):
    """The stateful test of the suite, apart so that a long run can take it alone."""

    def test_random_histories_restore_exactly(self, blobs: BlobStore, tmp_path: Path) -> None:
        """Catches what no scripted test thought of: random histories of puts, overwrites, deletes, durable
        commits, commits whose every backend write fails, restarts on the local dir and restores on a wiped one,
        checked against a model of the store and of its last durable checkpoint after every step. Few short
        histories by default; ``STATEBACKEND_HYPOTHESIS_PROFILE=statebackend-long`` runs many long ones."""
        suite = self
        controlled = self.controlled(blobs)
        profile = settings.get_profile(os.environ.get(PROFILE_ENV, SUITE_PROFILE))
        keys = st.sampled_from([f"key{i:02d}".encode() for i in range(24)])

        class History(RuleBasedStateMachine):
            def __init__(self) -> None:
                super().__init__()
                self.dir = tmp_path / uuid.uuid4().hex[:12]
                self.config = suite.make_config(self.dir, **{"job.name": f"job-{uuid.uuid4().hex[:8]}"})
                self.prefix = f"{self.config['job.name']}/task-0/counts/{suite.backend}/"
                self.task = TaskStorage.open(self.config, "task-0", blob_store=controlled)
                self.model: dict[bytes, bytes] = {}
                self.durable: dict[bytes, bytes] = {}
                self.offset = 0

            @rule(key=keys, size=st.integers(0, 300), seed=st.integers(0, 10_000))
            def put(self, key: bytes, size: int, seed: int) -> None:
                value = incompressible((key, seed), size)
                self.task.store("counts", typed=False).put(key, value)
                self.model[key] = value

            @rule(key=keys)
            def delete(self, key: bytes) -> None:
                self.task.store("counts", typed=False).delete(key)
                self.model.pop(key, None)

            @rule()
            def commit(self) -> None:
                self.offset += 1
                self.task.commit_durably({"input": str(self.offset)})
                self.durable = dict(self.model)

            @rule()
            def failed_commit(self) -> None:
                self.offset += 1
                controlled.fail, controlled.failures_left = (lambda name: name.startswith(self.prefix)), 1_000_000
                try:
                    pending = self.task.commit({"input": str(self.offset)})
                    if pending is not None:
                        pending.result(timeout=suite.wait_s)
                    # a backend with nothing to write for this commit made it durable: so every restore must show
                    self.durable = dict(self.model)
                except CommitError:
                    pass  # flushed to LMDB but in no checkpoint: the next open must go back to the last durable one
                finally:
                    controlled.failures_left = 0
                self.reopen(wipe=False)

            @rule(wipe=st.booleans())
            def restart(self, wipe: bool) -> None:
                self.reopen(wipe=wipe)

            def reopen(self, *, wipe: bool) -> None:
                self.task.close()
                if wipe:
                    shutil.rmtree(self.dir / "local", ignore_errors=True)
                self.task = TaskStorage.open(self.config, "task-0", blob_store=controlled)
                self.model = dict(self.durable)

            @invariant()
            def shows_the_model(self) -> None:
                assert contents(self.task) == self.model

            def teardown(self) -> None:
                self.task.close()

        run_state_machine_as_test(History, settings=profile)


class DesignTests(StatefulTests):
    """The tests that bite on designs unlike the built-ins (see the module docstring)."""

    # -- a clock moved past the grace period -----------------------------------------------------------------------

    def test_every_retained_checkpoint_restores_once_the_grace_period_has_passed(
        self, blobs: BlobStore, tmp_path: Path, clock: SuiteClock
    ) -> None:
        """Catches a sweep that keeps only what the newest checkpoint names, hidden by the grace period (an hour by
        default) in every test that does not move the clock: here the clock moves past the grace period before
        every commit, a replay leaves retained checkpoints whose blobs the newest does not name, and every retained
        checkpoint must still restore exactly in a fresh local dir."""
        retained = 4
        config = self.make_config(tmp_path, **{"task.checkpoint.retained": retained})
        past_grace = 2 * self.grace_ms / 1000 + 60
        models: dict[int, dict[bytes, bytes]] = {}
        model: dict[bytes, bytes] = {}
        with TaskStorage.open(config, "task-0", blob_store=blobs) as task:
            for round_no in range(6):
                self.move_clock(clock, past_grace)
                write_round(task, round_no, model)
                task.commit_durably({"input": str(round_no)})
                models[task.committed_seq] = dict(model)
            head = task.committed_seq
            base = task.checkpoint_log.entries()[-3]
        model = dict(models[base.seq])
        with TaskStorage.open(config, "task-0", blob_store=blobs, checkpoint=base, fence_seq=head) as task:
            for round_no in (40,):  # the superseded checkpoints stay retained: the newest does not name their blobs
                self.move_clock(clock, past_grace)
                write_round(task, round_no, model)
                task.commit_durably({"input": f"replay-{round_no}"})
                models[task.committed_seq] = dict(model)
            self.move_clock(clock, past_grace)
            task.commit_durably({"input": "last"})  # one more cleanup, past the grace of everything above
            models[task.committed_seq] = dict(model)
            entries = task.checkpoint_log.entries()
        assert len(entries) >= 2
        for entry in entries:
            fresh = dict(config, **{"state.local.dir": str(tmp_path / f"fresh-{entry.seq}")})
            with TaskStorage.open(fresh, "task-0", blob_store=blobs, checkpoint=entry) as task:
                assert contents(task) == models[entry.seq], (
                    f"retained checkpoint {entry.seq} did not restore exactly once the grace period had passed"
                )

    # -- write faults on a chosen subset of an upload's writes ----------------------------------------------------

    @pytest.mark.parametrize("pattern", ["one_of_n", "data_not_index", "after_the_first"])
    def test_an_upload_with_some_writes_failed_never_makes_a_checkpoint_that_misses_them(
        self, blobs: BlobStore, tmp_path: Path, pattern: str
    ) -> None:
        """Catches an upload that resolves before some of its writes landed, which a fault on every write (or none)
        hides: an awaited index (manifest) write masks data (chunk) writes that are not awaited. Each commit's
        upload writes a large change set; a chosen subset of its writes fails: the second only (``one_of_n``),
        every data write but no index write (``data_not_index``, :meth:`is_index_blob`), every write after the
        first (``after_the_first``). The commit either fails (the task then restores its last durable checkpoint)
        or succeeds, and then its checkpoint must restore exactly; a later commit must too."""
        blobs = self.controlled(blobs)
        config = self.make_config(tmp_path)
        prefix = self.backend_prefix()
        model: dict[bytes, bytes] = {}
        seen = {"n": 0}

        def chosen(name: str) -> bool:
            if not self.is_commit_upload(name):
                return False
            seen["n"] += 1
            if pattern == "one_of_n":
                return seen["n"] == 2
            if pattern == "data_not_index":
                return not self.is_index_blob(name)
            return seen["n"] > 1

        with TaskStorage.open(config, "task-0", blob_store=blobs) as task:
            write_round(task, 0, model)
            task.commit_durably({"input": "0"})
            durable = dict(model)
            flood(task, "faults", model, keys=1_500)
            blobs.fail, blobs.failures_left = chosen, 1_000_000
            pending = task.commit({"input": "1"})
            assert pending is not None
            try:
                pending.result(timeout=self.wait_s)
                durable = dict(model)
            except CommitError:
                model = dict(durable)  # the failed commit's changes are in no checkpoint: reopen below
            finally:
                blobs.failures_left = 0
        assert any(name.startswith(prefix) for name in blobs.put_names)
        shutil.rmtree(tmp_path / "local")
        with TaskStorage.open(config, "task-0", blob_store=blobs) as task:
            assert contents(task) == durable, f"{pattern}: the newest checkpoint does not hold exactly its state"
            write_round(task, 1, model)
            task.commit_durably({"input": "2"})
        shutil.rmtree(tmp_path / "local")
        with TaskStorage.open(config, "task-0", blob_store=blobs) as task:
            assert contents(task) == model, f"{pattern}: the commit after the faults does not restore exactly"

    # -- one missing blob under an intact index --------------------------------------------------------------------

    def test_each_missing_blob_alone_is_an_error_naming_it_or_not_needed(
        self, blobs: BlobStore, tmp_path: Path
    ) -> None:
        """Catches a restore that skips a missing data blob (a chunk) whose index (a manifest) is intact: the other
        missing-blob test deletes every blob, so the index is missing first. Each of the backend's blobs in turn
        (up to 16) is deleted alone and the newest checkpoint restored in a fresh local dir: it must give exactly
        the state (a blob no retained checkpoint needs; in a dual commit, the fallback) or, alone, raise an error
        that names the blob."""
        config = self.make_config(tmp_path)
        model: dict[bytes, bytes] = {}
        with TaskStorage.open(config, "task-0", blob_store=blobs) as task:
            for round_no in range(3):
                write_round(task, round_no, model)
                flood(task, f"more{round_no}", model, keys=120)
                task.commit_durably({"input": str(round_no)})
        names = sorted(blobs.list(self.backend_prefix()))
        assert names, "the backend wrote no blobs under its prefix"
        step = max(1, len(names) // 16)
        errors = 0
        for index, name in enumerate(names[::step][:16]):
            data = blobs.get(name)
            blobs.delete(name)
            fresh = dict(config, **{"state.local.dir": str(tmp_path / f"fresh-{index}")})
            try:
                with TaskStorage.open(fresh, "task-0", blob_store=blobs) as task:
                    assert contents(task) == model, f"with {name} missing the restore gave other state, no error"
            except (NotFoundError, CorruptDataError) as exc:
                assert self.dual_with is None, f"with {name} missing the restore did not fall back: {exc}"
                assert name in str(exc), f"with {name} missing the restore's error does not name it: {exc}"
                errors += 1
            finally:
                blobs.put(name, data)
        if self.dual_with is None:
            assert errors, "no blob of the backend was needed by the newest checkpoint"

    # -- restore failures, and what a backend may build on after one ----------------------------------------------

    def test_a_backend_whose_restore_failed_never_builds_on_that_lineage(
        self, blobs: BlobStore, tmp_path: Path
    ) -> None:
        """Catches a backend that builds on a lineage whose restore failed. In a dual commit (the backend under test
        first, ``dual_with`` or another built-in second) the blobs of the newest commit are damaged; the restore of the
        backend under test fails and the task falls back to the other one. The commits that follow must not name
        the damaged blobs: after them, the backend under test alone must restore the newest checkpoint exactly."""
        other = self.dual_with or ("blobsnapshot" if self.backend == "changelog" else "changelog")
        both = f"{self.backup_factories},{other}"
        config = self.make_config(
            tmp_path, **{"stores.counts.backup.factories": both, "stores.counts.restore.factories": both}
        )
        config.pop("stores.counts.restore.factory", None)  # its one-backend alias, from extra_config
        model: dict[bytes, bytes] = {}
        prefix = self.backend_prefix()
        with TaskStorage.open(config, "task-0", blob_store=blobs) as task:
            for round_no in range(3):
                before = set(blobs.list(prefix))
                write_round(task, round_no, model)
                task.commit_durably({"input": str(round_no)})
            task.wait_for_commit()
        newest = sorted(set(blobs.list(prefix)) - before)
        assert newest, "the backend wrote no blob in its newest commit"
        for name in newest:
            data = bytearray(blobs.get(name))
            if data:
                data[len(data) // 2] ^= 0x01
            blobs.put(name, bytes(data))
        shutil.rmtree(tmp_path / "local")
        with TaskStorage.open(config, "task-0", blob_store=blobs) as task:
            assert contents(task) == model, f"the fallback to {other} did not give the exact state"
            for round_no in (3, 4):
                write_round(task, round_no, model)
                task.commit_durably({"input": str(round_no)})
        shutil.rmtree(tmp_path / "local")
        blobs.delete_many(list(blobs.list(f"job/task-0/counts/{other}/")))  # no fallback now: the backend alone
        with TaskStorage.open(config, "task-0", blob_store=blobs) as task:
            assert contents(task) == model, "the backend does not restore alone what it committed after a fallback"

    # -- changed values under unchanged keys ---------------------------------------------------------------------

    def test_changed_values_under_unchanged_keys_restore_exactly(self, blobs: BlobStore, tmp_path: Path) -> None:
        """Catches content ids computed from the keys only (a chunk, a step or a run taken for unchanged because
        its keys are): every other test changes the key set of each commit. The same keys get new values commit
        after commit (all of them, then a few, then one, then back to an earlier value), and every checkpoint
        must restore exactly."""
        config = self.make_config(tmp_path, **{"task.checkpoint.retained": 8})
        keys = [f"same{i:04d}".encode() for i in range(120)]
        model: dict[bytes, bytes] = {}
        models: dict[str, dict[bytes, bytes]] = {}
        plan: list[tuple[str, list[bytes], Callable[[bytes], bytes]]] = [
            ("all", keys, lambda key: b"first-" + key),
            ("again", keys, lambda key: b"second-" + key),
            ("few", keys[::17], lambda key: b"third-" + key),
            ("one", keys[60:61], lambda key: b"fourth"),
            ("back", keys[60:61], lambda key: b"third-" + key),
        ]
        with TaskStorage.open(config, "task-0", blob_store=blobs) as task:
            store = task.store("counts", typed=False)
            for offset, chosen, value in plan:
                for key in chosen:
                    store.put(key, value(key))
                    model[key] = value(key)
                task.commit_durably({"input": offset})
                models[offset] = dict(model)
        for offset, expected in models.items():
            fresh = dict(config, **{"state.local.dir": str(tmp_path / f"fresh-{offset}")})
            with TaskStorage.open(fresh, "task-0", blob_store=blobs, checkpoint=_with_input(offset)) as task:
                assert contents(task) == expected, f"checkpoint {offset}: values changed under the same keys lost"


def _with_input(offset: str) -> Callable[[LogEntry], bool]:
    """Chooses the newest checkpoint whose input offset is ``offset``."""
    return lambda entry: dict(entry.checkpoint.input_offsets) == {"input": offset}
