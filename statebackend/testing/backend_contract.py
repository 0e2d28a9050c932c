"""The backup/restore contract suite: what every state backend must do, end to end through TaskStorage and the
commit protocol on real LMDB. Each test's docstring says the data loss (or the stall) it catches; the mutants in
:mod:`statebackend.testing.mutants` are broken backends it must fail (docs/contract-suites.md).

A backend's test module subclasses :class:`BackendContract` and sets:

- ``backup_factories``: the backend under test (its short name, entry point or dotted path);
- ``dual_with`` (optional): a second backend, e.g. ``"changelog"``, committed beside it in a dual commit. The backend
  under test comes first in the restore order; the damage tests then expect the restore to fall back to the other
  backend and still give the exact state, instead of an error;
- ``extra_config`` (optional): more settings;
- ``uploads_whole_state`` (optional): True for a backend that uploads a whole copy of the store at each commit (an
  O(state) upload, like the example third-party backend); the upload-size test then only bounds it by one copy;
- ``test_timeout_s``: the per-test deadline (:mod:`statebackend.testing.deadline`); a hung test fails;
- ``backend_settings(test)``, ``is_index_blob(name)``, ``grace_ms``, ``move_clock`` (optional): the backend's own
  settings in every test (small chunks, small records), which of its blobs are an index (the write-fault tests fail
  data writes but not index writes), its grace period and how the suite moves its clock past it
  (:class:`~statebackend.testing.backend_base.BackendContractBase`);
- ``child_imports``, ``kill_rounds`` (optional): modules the kill test's child process imports first (a backend
  registered at import), and how many times it kills (3). The child resolves the backend by its name, as a job does,
  with this process's import path; ``extra_config`` must then hold JSON values only.

The blob store is the in-memory fake by default (it passes the blob store contract suite); override the ``blobs``
fixture to run the suite on Azurite or S3. Only the public API of :class:`TaskStorage` is used. Helpers shared with
other suites (``contents``, ``write_round``, ``flood``, ``task_thread_calls``) are in
:mod:`statebackend.testing.backend_support`.
"""

from __future__ import annotations

import shutil
import threading
from collections.abc import Callable
from pathlib import Path

import pytest

from statebackend.blobstores.base import BlobStore
from statebackend.checkpoint import LogEntry
from statebackend.errors import CommitError, CommitTimeoutError, CorruptDataError, NotFoundError
from statebackend.task import TaskStorage
from statebackend.testing.backend_designs import DesignTests
from statebackend.testing.backend_faults import FaultTests
from statebackend.testing.backend_support import (
    contents,
    flood,
    incompressible,
    restore_counts,
    task_thread_calls,
    write_round,
)
from statebackend.testing.controlled import GatedExecutor

__all__ = ["BackendContract", "contents", "write_round"]


class BackendContract(DesignTests, FaultTests):
    """The suite (see the module docstring); its settings and fixtures are in
    :class:`~statebackend.testing.backend_base.BackendContractBase`, its fault tests in
    :class:`~statebackend.testing.backend_faults.FaultTests`, the tests that bite on designs unlike the built-ins
    (a moved clock, partial write faults, one missing blob, a failed restore, changed values, random histories) in
    :class:`~statebackend.testing.backend_designs.DesignTests`."""

    # -- restart and restore --------------------------------------------------------------------------------------

    def test_restart_reuses_local_state_without_download(self, blobs: BlobStore, tmp_path: Path) -> None:
        """Catches a restore that never reuses the local copy (or never says so in ``restore.stores.reused``)."""
        config = self.make_config(tmp_path)
        model: dict[bytes, bytes] = {}
        with TaskStorage.open(config, "task-0", blob_store=blobs) as task:
            for round_no in range(5):
                write_round(task, round_no, model)
                task.commit_durably({"input": str(round_no)})
        with TaskStorage.open(config, "task-0", blob_store=blobs) as task:
            assert contents(task) == model
            assert task.metrics.counter("restore.stores.reused") == 1
            assert task.metrics.counter("restore.stores.full") == 0
            assert task.restored is not None and task.restored.input_offsets == {"input": "4"}

    def test_wiped_local_dir_restores_exactly_from_snapshot_and_deltas(self, blobs: BlobStore, tmp_path: Path) -> None:
        """Catches a restore that loads a stale or partial state (a snapshot without its newest deltas)."""
        config = self.make_config(tmp_path)
        model: dict[bytes, bytes] = {}
        with TaskStorage.open(config, "task-0", blob_store=blobs) as task:
            for round_no in range(10):
                write_round(task, round_no, model)
                task.commit_durably({"input": str(round_no)})
            task.wait_for_commit()
        shutil.rmtree(tmp_path / "local")
        with TaskStorage.open(config, "task-0", blob_store=blobs) as task:
            assert contents(task) == model
            assert task.metrics.counter("restore.stores.full") == 1

    def test_older_local_copy_is_brought_to_the_newest_checkpoint(self, blobs: BlobStore, tmp_path: Path) -> None:
        """Catches reuse of local data of another version as if it were the checkpoint's."""
        config = self.make_config(tmp_path)
        model: dict[bytes, bytes] = {}
        with TaskStorage.open(config, "task-0", blob_store=blobs) as task:
            for round_no in range(3):
                write_round(task, round_no, model)
                task.commit_durably({"input": str(round_no)})
        shutil.copytree(tmp_path / "local", tmp_path / "older")
        with TaskStorage.open(config, "task-0", blob_store=blobs) as task:
            for round_no in range(3, 7):
                write_round(task, round_no, model)
                task.commit_durably({"input": str(round_no)})
        shutil.rmtree(tmp_path / "local")
        shutil.move(tmp_path / "older", tmp_path / "local")
        with TaskStorage.open(config, "task-0", blob_store=blobs) as task:
            assert contents(task) == model
            assert task.metrics.counter("restore.stores.reused") == 0

    def test_uncommitted_local_changes_are_discarded_on_restore(self, blobs: BlobStore, tmp_path: Path) -> None:
        """Catches reuse of local data that is ahead of every durable checkpoint (flushed, never committed)."""
        blobs = self.controlled(blobs)
        config = self.make_config(tmp_path)
        model: dict[bytes, bytes] = {}
        task = TaskStorage.open(config, "task-0", blob_store=blobs)
        write_round(task, 0, model)
        task.commit_durably({"input": "0"})
        durable = dict(model)
        write_round(task, 1, model)
        # flushed to LMDB by a commit whose checkpoint never lands: local data is ahead of every durable checkpoint
        blobs.fail, blobs.failures_left = (lambda name: "/checkpoints/" in name), 10
        pending = task.commit({"input": "1"})
        assert pending is not None
        with pytest.raises(CommitError):
            pending.result(timeout=self.wait_s)
        task.close()
        blobs.failures_left = 0
        with TaskStorage.open(config, "task-0", blob_store=blobs) as again:
            assert contents(again) == durable
            assert again.metrics.counter("restore.stores.reused") == 0

    def test_every_retained_checkpoint_restores_exactly_after_cleanups_and_a_replay(
        self, blobs: BlobStore, tmp_path: Path
    ) -> None:
        """Catches a cleanup that deletes what a retained checkpoint still names (keeping the newest N blobs, say), a
        restore that ignores the checkpoint it is given (the newest state whatever is asked), and reuse of a newer
        local state for an older checkpoint. A Spark replay restores an older retained checkpoint and commits past
        it; a crashed task may be sent back to any retained one. Every retained checkpoint, superseded ones
        included, is restored in a fresh local dir after the cleanups ran and compared with the model kept for it."""
        retained = 4
        config = self.make_config(tmp_path, **{"task.checkpoint.retained": retained})
        models: dict[int, tuple[str, dict[bytes, bytes]]] = {}
        model: dict[bytes, bytes] = {}

        def commit(task: TaskStorage, offset: str) -> None:
            task.commit_durably({"input": offset})
            models[task.committed_seq] = (offset, dict(model))

        with TaskStorage.open(config, "task-0", blob_store=blobs) as task:
            for round_no in range(7):
                write_round(task, round_no, model)
                commit(task, str(round_no))
                if round_no == 4:
                    commit(task, "4-again")  # a commit with no change
            head = task.committed_seq
            base = task.checkpoint_log.entries()[-3]
        model = dict(models[base.seq][1])
        with TaskStorage.open(config, "task-0", blob_store=blobs, checkpoint=base, fence_seq=head) as task:
            assert contents(task) == model, "the replay's open did not restore the older checkpoint it was given"
            for round_no in range(20, 22):
                write_round(task, round_no, model)
                commit(task, f"replay-{round_no}")
            checkpoint_log = task.checkpoint_log
        entries = checkpoint_log.entries()  # close() waited for the cleanups and the log's retention
        assert [entry.seq for entry in entries] == sorted(models)[-retained:]
        for entry in entries:
            offset, expected = models[entry.seq]
            fresh = dict(config, **{"state.local.dir": str(tmp_path / f"fresh-{entry.seq}")})
            with TaskStorage.open(fresh, "task-0", blob_store=blobs, checkpoint=entry) as task:
                assert contents(task) == expected, f"retained checkpoint #{entry.seq} ({offset}) restored wrong"
                assert task.restored is not None and task.restored.input_offsets == {"input": offset}
                assert restore_counts(task) == {"restore.stores.full": 1}

    def test_every_store_of_the_task_is_backed_up_and_counted(self, blobs: BlobStore, tmp_path: Path) -> None:
        """Catches a backend that drops a store of a multi-store task (the checkpoint then restores it empty), and
        one that does not count each store's restore in ``restore.stores.reused`` / ``restore.stores.full``."""
        config = self.make_config(tmp_path, **self.store_config("totals"))
        models: dict[str, dict[bytes, bytes]] = {"counts": {}, "totals": {}}
        with TaskStorage.open(config, "task-0", blob_store=blobs) as task:
            for round_no in range(4):
                write_round(task, round_no, models["counts"])
                write_round(task, round_no + 50, models["totals"], store="totals")
                task.commit_durably({"input": str(round_no)})
        for wiped in (False, True):
            if wiped:
                shutil.rmtree(tmp_path / "local")
            with TaskStorage.open(config, "task-0", blob_store=blobs) as task:
                assert {name: contents(task, name) for name in models} == models
                counter = "restore.stores.full" if wiped else "restore.stores.reused"
                assert restore_counts(task) == {counter: 2}, f"each store counted once in {counter}"

    def test_empty_commits_and_deleting_everything_restore_exactly(self, blobs: BlobStore, tmp_path: Path) -> None:
        """Catches lost deletes and empty commits that lose the state before them."""
        config = self.make_config(tmp_path)
        model: dict[bytes, bytes] = {}
        with TaskStorage.open(config, "task-0", blob_store=blobs) as task:
            write_round(task, 0, model)
            task.commit_durably({"input": "0"})
            task.commit_durably({"input": "1"})  # no change
            store = task.store("counts")
            for key in list(model):
                store.delete(key)
            model.clear()
            task.commit_durably({"input": "2"})
        shutil.rmtree(tmp_path / "local")
        with TaskStorage.open(config, "task-0", blob_store=blobs) as task:
            assert contents(task) == model == {}
            assert task.restored is not None and task.restored.input_offsets == {"input": "2"}

    # -- uploads --------------------------------------------------------------------------------------------------

    def test_failed_upload_surfaces_at_next_commit_and_does_not_poison_later_ones(
        self, blobs: BlobStore, tmp_path: Path
    ) -> None:
        """Catches a failed upload reported as durable, and a later commit that builds on the blob that never
        landed (its checkpoint then names a missing blob)."""
        blobs = self.controlled(blobs)
        config = self.make_config(tmp_path)
        model: dict[bytes, bytes] = {}
        with TaskStorage.open(config, "task-0", blob_store=blobs) as task:
            write_round(task, 0, model)
            task.commit_durably({"input": "0"})
            # the commit's own upload fails; a background snapshot (changelog) must not take the injected failure
            blobs.fail = self.is_commit_upload
            blobs.failures_left = 1
            write_round(task, 1, model)
            failed = task.commit({"input": "1"})
            assert failed is not None
            with pytest.raises(CommitError):
                failed.result(timeout=self.wait_s)
            # reported once, through result(): the next commit commits anew instead of raising it again
            again = task.commit({"input": "1b"})
            assert again is not None and again.result(timeout=self.wait_s).input_offsets == {"input": "1b"}
            # a failure nobody saw is raised once by the next commit, then the one after commits
            blobs.failures_left = 1
            write_round(task, 2, model)
            unseen = task.commit({"input": "2a"})
            assert unseen is not None
            assert unseen.future.exception(timeout=self.wait_s) is not None
            with pytest.raises(CommitError, match="previous commit failed|injected"):
                task.commit({"input": "2b"})
            checkpoint = task.commit_durably({"input": "2"})
            assert checkpoint.input_offsets == {"input": "2"}
            assert task.metrics.counter("commit.failures") == 2
        shutil.rmtree(tmp_path / "local")
        with TaskStorage.open(config, "task-0", blob_store=blobs) as task:
            assert contents(task) == model

    def test_upload_resolves_only_once_its_blobs_are_written(self, blobs: BlobStore, tmp_path: Path) -> None:
        """Catches an upload whose future (and so the checkpoint naming its blobs) resolves before the blobs are
        written: a crash, or a write that then fails, leaves a durable checkpoint naming a blob that never landed.
        The backend's writes are held, then fail: the commit must stay pending while they are held and then fail,
        and the task must restore its last durable checkpoint."""
        blobs = self.controlled(blobs)
        config = self.make_config(tmp_path)
        model: dict[bytes, bytes] = {}
        with TaskStorage.open(config, "task-0", blob_store=blobs) as task:
            write_round(task, 0, model)
            task.commit_durably({"input": "0"})
            durable_seq, durable = task.committed_seq, dict(model)
            blobs.hold, blobs.fail_held = self.is_commit_upload, True
            write_round(task, 1, model)
            pending = task.commit({"input": "1"})
            assert pending is not None and blobs.held.wait(self.wait_s)
            assert not pending.done() and task.committed_seq == durable_seq, (
                "the commit was durable while the backend's upload was still held"
            )
            blobs.release.set()
            with pytest.raises(CommitError) as failed:
                pending.result(timeout=self.wait_s)
            assert not isinstance(failed.value, CommitTimeoutError), "the failed write was never reported"
            assert task.committed_seq == durable_seq
        shutil.rmtree(tmp_path / "local")
        with TaskStorage.open(config, "task-0", blob_store=blobs) as task:
            assert contents(task) == durable
            assert task.restored is not None and task.restored.input_offsets == {"input": "0"}

    def test_writes_during_an_upload_never_reach_its_checkpoint(self, blobs: BlobStore, tmp_path: Path) -> None:
        """Catches a backend that archives the live store at upload time instead of the flushed change set (or a
        read view of exactly the flushed version): its checkpoint then holds keys that were never committed. The
        task writes (and spills to LMDB: a small ``write.batch.max.bytes``) while the commit's upload waits to
        start and again while its write is held; the checkpoint must restore exactly the committed state."""
        blobs = self.controlled(blobs)
        config = self.make_config(
            tmp_path, **{"stores.counts.write.batch.max.bytes": 2048, "task.commit.max.delay.ms": 3_600_000}
        )
        pool = GatedExecutor(gate_timeout_s=2 * self.wait_s)
        model: dict[bytes, bytes] = {}
        try:
            with TaskStorage.open(config, "task-0", blob_store=blobs, executor=pool) as task:
                write_round(task, 0, model)
                task.commit_durably({"input": "0"})
                write_round(task, 1, model)
                pool.gate.clear()
                blobs.hold = self.is_commit_upload
                pending = task.commit({"input": "1"})
                assert pending is not None and pool.waiting.wait(self.wait_s)
                committed = dict(model)
                flood(task, "while-queued", model)
                pool.gate.set()
                assert blobs.held.wait(self.wait_s)
                flood(task, "while-held", model)
                blobs.release.set()
                assert pending.result(timeout=self.wait_s).input_offsets == {"input": "1"}
                task.commit_durably({"input": "2"})
            for offset, expected in (("1", committed), ("2", model)):
                fresh = dict(config, **{"state.local.dir": str(tmp_path / f"fresh-{offset}")})
                with TaskStorage.open(fresh, "task-0", blob_store=blobs, checkpoint=_with_input(offset)) as task:
                    assert contents(task) == expected, f"checkpoint {offset} does not hold exactly its state"
        finally:
            pool.shutdown()

    def test_commit_is_skipped_while_upload_runs_within_max_delay(self, blobs: BlobStore, tmp_path: Path) -> None:
        """Catches changes of a skipped commit that never reach a later checkpoint."""
        blobs = self.controlled(blobs)
        config = self.make_config(tmp_path, **{"task.commit.max.delay.ms": 3_600_000})
        model: dict[bytes, bytes] = {}
        with TaskStorage.open(config, "task-0", blob_store=blobs) as task:
            prefix = self.backend_prefix()
            blobs.hold = lambda name: name.startswith(prefix)
            write_round(task, 0, model)
            first = task.commit({"input": "0"})
            assert first is not None
            assert blobs.held.wait(self.wait_s)
            write_round(task, 1, model)
            assert task.commit({"input": "1"}) is None
            assert task.metrics.counter("commit.skips") == 1
            blobs.release.set()
            assert first.result(timeout=self.wait_s).input_offsets == {"input": "0"}
            # the skipped commit's changes ride with the next one
            task.commit_durably({"input": "2"})
        shutil.rmtree(tmp_path / "local")
        with TaskStorage.open(config, "task-0", blob_store=blobs) as task:
            assert contents(task) == model

    def test_commit_blocks_past_max_delay_then_times_out(self, blobs: BlobStore, tmp_path: Path) -> None:
        """Catches a backend whose upload cannot be waited for (the commit's timeout never fires)."""
        blobs = self.controlled(blobs)
        config = self.make_config(tmp_path, **{"task.commit.max.delay.ms": 0, "task.commit.timeout.ms": 50})
        model: dict[bytes, bytes] = {}
        with TaskStorage.open(config, "task-0", blob_store=blobs) as task:
            prefix = self.backend_prefix()
            blobs.hold = lambda name: name.startswith(prefix)
            write_round(task, 0, model)
            first = task.commit({"input": "0"})
            assert first is not None and blobs.held.wait(self.wait_s)
            with pytest.raises(CommitTimeoutError, match="task.commit.timeout.ms"):
                task.commit({"input": "1"})
            assert task.metrics.counter("commit.blocks") == 1
            assert task.metrics.counter("commit.timeouts") == 1
            blobs.release.set()
            first.result(timeout=self.wait_s)

    def test_blocked_commit_proceeds_when_the_upload_ends(self, blobs: BlobStore, tmp_path: Path) -> None:
        """Catches an upload that never resolves once its held write ends."""
        blobs = self.controlled(blobs)
        config = self.make_config(tmp_path, **{"task.commit.max.delay.ms": 0, "task.commit.timeout.ms": 60_000})
        model: dict[bytes, bytes] = {}
        with TaskStorage.open(config, "task-0", blob_store=blobs) as task:
            calls = {"n": 0}

            def hold_first_delta(name: str) -> bool:
                if name.startswith(self.backend_prefix()):
                    calls["n"] += 1
                    return calls["n"] == 1
                return False

            blobs.hold = hold_first_delta
            write_round(task, 0, model)
            first = task.commit({"input": "0"})
            assert first is not None and blobs.held.wait(self.wait_s)

            # the manager's clock says the upload is past max delay; release it only once the commit is blocking
            def release_when_blocked() -> None:
                while task.metrics.counter("commit.blocks") == 0:
                    threading.Event().wait(0.005)
                blobs.release.set()

            releaser = threading.Thread(target=release_when_blocked)
            releaser.start()
            write_round(task, 1, model)
            second = task.commit({"input": "1"})
            releaser.join()
            assert second is not None
            assert second.result(timeout=self.wait_s).input_offsets == {"input": "1"}
            assert task.metrics.counter("commit.blocks") == 1
            assert task.metrics.counter("commit.skips") == 0

    # -- cost: O(change), not O(state) ----------------------------------------------------------------------------

    def test_snapshot_costs_the_change_not_the_state(self, blobs: BlobStore, tmp_path: Path) -> None:
        """Catches a ``snapshot()`` that reads the store (or copies it) on the task's thread: every commit would
        stop processing for a time that grows with the state. Counted, not timed: the Python calls the task's
        thread makes in a commit of one changed key, at 1,000 keys and at 40,000 keys of state, must not grow with
        the state (a pass over 40,000 records makes at least 40,000 calls)."""
        config = self.make_config(tmp_path)
        with TaskStorage.open(config, "task-0", blob_store=blobs) as task:
            model: dict[bytes, bytes] = {}
            flood(task, "small", model, keys=1_000)
            task.commit_durably({"input": "small"})
            small = min(task_thread_calls(task, f"s{i}".encode()) for i in range(3))
            flood(task, "large", model, keys=40_000)
            task.commit_durably({"input": "large"})
            large = min(task_thread_calls(task, f"l{i}".encode()) for i in range(3))
        assert large <= 2 * small + 1_000, (
            f"a commit of one key made {large} calls on the task's thread at 41,000 keys of state and {small} at "
            f"1,000: snapshot() must cost O(change), never O(state)"
        )

    def test_commit_uploads_the_change_not_the_state(self, blobs: BlobStore, tmp_path: Path) -> None:
        """Catches a backend that uploads the whole state at each commit (its bytes, and a restore's work, grow with
        the state, not the change); counted through a wrapping blob store. With ``uploads_whole_state`` (an
        O(state) backend by design) the commit must still upload no more than about one copy of the state."""
        blobs = self.controlled(blobs)
        config = self.make_config(tmp_path)
        prefix = self.backend_prefix()
        with TaskStorage.open(config, "task-0", blob_store=blobs) as task:
            store = task.store("counts")
            for i in range(20_000):
                store.put(f"key{i:06d}".encode(), incompressible(i, 48))
            task.commit_durably({"input": "state"})
            state_bytes = blobs.bytes_written(prefix)
            for i in range(3):  # settle what follows a large first commit (a snapshot of it)
                store.put(b"settle", str(i).encode())
                task.commit_durably({"input": f"settle-{i}"})
            per_commit = []
            for i in range(5):
                task.wait_for_commit()
                before = blobs.bytes_written(prefix)
                store.put(b"key000007", incompressible(i + 100_000, 48))
                task.commit_durably({"input": f"one-{i}"})
                per_commit.append(blobs.bytes_written(prefix) - before)
        assert state_bytes > 20_000 * 48, "the first commit uploaded less than the state it holds"
        bound = 2 * state_bytes + 65_536 if self.uploads_whole_state else 32_768
        assert min(per_commit) <= bound, (
            f"commits of one changed key uploaded {per_commit} bytes (a state of {state_bytes} bytes): "
            + ("more than a copy of the state" if self.uploads_whole_state else "O(state), not O(change)")
        )

    # -- damage -----------------------------------------------------------------------------------------------------

    @pytest.mark.parametrize("where", ["middle", "last"])
    def test_flipped_byte_in_backend_blobs_is_detected_and_never_applied(
        self, blobs: BlobStore, tmp_path: Path, caplog: pytest.LogCaptureFixture, where: str
    ) -> None:
        """Catches a restore that skips verification and loads a damaged blob: one bit flipped in the middle of
        every blob of the backend (its records, most likely), then in its last byte (a checksum, most likely)."""

        def flip_a_byte(store: BlobStore, names: list[str]) -> list[str]:
            for name in names:
                data = bytearray(store.get(name))
                data[len(data) // 2 if where == "middle" else -1] ^= 0x01
                store.put(name, bytes(data))
            return names

        victims, text = self.restore_after_damage(
            blobs, tmp_path, caplog, rounds=3, damage=flip_a_byte, errors=CorruptDataError
        )
        assert any(victim in text for victim in victims)

    def test_truncated_backend_blobs_are_detected(
        self, blobs: BlobStore, tmp_path: Path, caplog: pytest.LogCaptureFixture
    ) -> None:
        """Catches a restore that loads what a cut-short blob still holds."""

        def cut_short(store: BlobStore, names: list[str]) -> list[str]:
            for name in names:
                store.put(name, store.get(name)[: len(store.get(name)) // 3])
            return names

        victims, text = self.restore_after_damage(
            blobs, tmp_path, caplog, rounds=3, damage=cut_short, errors=CorruptDataError
        )
        assert any(victim in text for victim in victims)

    def test_missing_backend_blob_is_an_error_naming_it(
        self, blobs: BlobStore, tmp_path: Path, caplog: pytest.LogCaptureFixture
    ) -> None:
        """Catches a restore that takes a missing blob for an empty store."""

        def delete(store: BlobStore, names: list[str]) -> list[str]:
            store.delete_many(names)
            return names

        victims, text = self.restore_after_damage(
            blobs, tmp_path, caplog, rounds=1, damage=delete, errors=(NotFoundError, CorruptDataError)
        )
        assert any(victim in text for victim in victims)

    def test_an_older_blob_under_a_newer_name_is_refused(
        self, blobs: BlobStore, tmp_path: Path, caplog: pytest.LogCaptureFixture
    ) -> None:
        """Catches a restore that trusts a blob without checking that it is the one its name (and the marker)
        promises: an intact, older blob of the same task put back under a newer name would roll the state back
        silently. Every blob written after the second commit is replaced by the bytes of one written before."""
        older: dict[str, bytes] = {}

        def keep_older(store: BlobStore, round_no: int) -> None:
            if round_no == 1:
                older.update({name: store.get(name) for name in store.list(self.backend_prefix())})

        def put_older_back(store: BlobStore, names: list[str]) -> list[str]:
            assert older, "the backend wrote no blobs in its first two commits"
            victims = [name for name in names if name not in older]
            for name in victims:
                folder = name.rpartition("/")[0]
                source = next((o for o in older if o.rpartition("/")[0] == folder), next(iter(older)))
                store.put(name, older[source])
            return victims

        victims, text = self.restore_after_damage(
            blobs, tmp_path, caplog, rounds=4, damage=put_older_back, errors=CorruptDataError, after_commit=keep_older
        )
        assert victims and any(victim in text for victim in victims)

    # -- fencing ----------------------------------------------------------------------------------------------------

    def test_second_attempt_committing_the_same_checkpoint_is_detected(self, blobs: BlobStore, tmp_path: Path) -> None:
        """Catches a backend that lets two attempts of one task both claim a commit."""
        config_a = self.make_config(tmp_path / "a")
        config_b = dict(config_a, **{"state.local.dir": str(tmp_path / "b" / "local")})
        model: dict[bytes, bytes] = {}
        with TaskStorage.open(config_a, "task-0", blob_store=blobs) as task:
            write_round(task, 0, model)
            task.commit_durably({"input": "0"})
        attempt_a = TaskStorage.open(config_a, "task-0", blob_store=blobs)
        attempt_b = TaskStorage.open(config_b, "task-0", blob_store=blobs)
        try:
            write_round(attempt_a, 1, {})
            write_round(attempt_b, 2, {})
            attempt_a.commit_durably({"input": "1"})
            with pytest.raises(CommitError, match="another attempt"):
                attempt_b.commit_durably({"input": "1"})
        finally:
            attempt_a.close()
            attempt_b.close()


def _with_input(offset: str) -> Callable[[LogEntry], bool]:
    """Chooses the newest checkpoint whose input offset is ``offset``."""
    return lambda entry: dict(entry.checkpoint.input_offsets) == {"input": offset}
