"""Random kills: SIGKILL a committing process at random moments, again and again, and check after every kill that no
acknowledged commit was lost and that what restores is exactly a durable checkpoint.

tests/test_crash.py kills at each named step of the commit protocol; a kill at a random moment also lands inside
LMDB writes, renames, background snapshots, compactions, sweeps and restores, wherever the process happens to be.
The child is tests/crash_child.py (deterministic data: the state of checkpoint ``n`` is ``expected_state(n)``). Per
backend a chain of rounds runs on one work dir: each round starts a child on the kept local dir (it restores, then
commits until killed), kills it a random delay after a moment of its work (below), and checks:

1. the newest checkpoint in the log is at or past the last commit the child acknowledged (``durable.log``);
2. the local ``CHECKPOINT-V2`` never claims more than the log holds;
3. what the child restored at its start (its report) was exactly the durable checkpoint of the round before;
4. every other round, a fresh process on a copy with the local dir wiped restores exactly the durable checkpoint.

It runs on the file:// store (the crash child's own) for each backend, and on moto's S3 server and Azurite with both
backends. The delays come from a seeded generator: ``STATEBACKEND_KILL_SEED`` replays another sequence (the default is
fixed, so a failure reproduces).

The kill instants follow the child's work, not the wall clock: in even rounds the delay counts from the child's start
of work (its imports done), so kills land in its open and restore as well as in its commits; in odd rounds it counts
from the child's first acknowledged commit of the round, so kills land in later commits, uploads, background
snapshots, compactions and sweeps, and the chain of rounds moves on however slow the machine is. Every wait for the
child is a hang guard only (tests/waiting.py ``scaled``).

The children are forked by a fork server (tests/fork_server.py) that imported the crash child (and the remote
store's module) once: a test starts 13 or 14 of them, and each fresh interpreter's start and imports cost about half
a second of CPU. A forked child is a process of its own, killed by SIGKILL as any; its kill delays count from the
same marks of its work.
"""

from __future__ import annotations

import functools
import json
import os
import random
import shutil
import signal
import time
import uuid
from collections.abc import Callable
from pathlib import Path

import pytest
from statebackend.checkpoint import CheckpointLog, read_local_checkpoint

from statebackend.blobstores.base import open_blob_store
from tests.crash_child import (
    BACKUP_FACTORIES_ENV,
    BLOB_CONFIG_ENV,
    REPO,
    STARTED_FILE,
    STORE,
    TASK,
    expected_state,
    read_report,
    report_contents,
    reported_durable,
)
from tests.crash_child import durable_commit as file_durable_commit
from tests.fork_server import ForkedChild, ForkServer, run_to_end
from tests.test_crash import work
from tests.waiting import scaled

__all__ = ["work"]  # the RAM-backed temp dir fixture of tests/test_crash.py

ROUNDS = 8
SEED = int(os.environ.get("STATEBACKEND_KILL_SEED", "20261124"))


@pytest.mark.slow
@pytest.mark.parametrize("backends", ["changelog", "blobsnapshot", "changelog,blobsnapshot"])
def test_random_sigkills_never_lose_an_acknowledged_commit(work: Path, backends: str) -> None:
    _kill_rounds(work, backends, None)


@pytest.mark.slow
@pytest.mark.s3
def test_random_sigkills_on_the_s3_server(work: Path, s3_server: object) -> None:
    """The same on moto's S3 server: kills also land between a multipart upload's parts and its completion."""
    _kill_rounds(
        work,
        "changelog,blobsnapshot",
        {
            "blob.store.url": f"s3://t-{uuid.uuid4().hex[:20]}/state",
            "blob.store.endpoint.url": s3_server.endpoint,  # type: ignore[attr-defined]
            "blob.store.create.if.missing": True,
        },
    )


@pytest.mark.slow
@pytest.mark.azure
def test_random_sigkills_on_azurite(work: Path, azurite_connection: str) -> None:
    _kill_rounds(
        work,
        "changelog,blobsnapshot",
        {
            "blob.store.url": f"az://t{uuid.uuid4().hex[:20]}/state",
            "blob.store.connection.string": azurite_connection,
            "blob.store.create.if.missing": True,
        },
    )


def _kill_rounds(work: Path, backends: str, blob_config: dict[str, object] | None) -> None:
    rng = random.Random(f"{SEED}-{backends}-{blob_config is not None}")
    workdir = work / "run"
    workdir.mkdir()
    env = {key: value for key, value in os.environ.items() if key != "STATEBACKEND_CRASH_AT"}
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(REPO), env.get("PYTHONPATH")]))
    env[BACKUP_FACTORIES_ENV] = backends
    if blob_config is not None:
        env[BLOB_CONFIG_ENV] = json.dumps(blob_config)

    def durable_commit(directory: Path) -> int:
        if blob_config is None:
            return file_durable_commit(directory)
        options = {key[len("blob.store.") :]: value for key, value in blob_config.items() if key != "blob.store.url"}
        with open_blob_store(str(blob_config["blob.store.url"]), options) as store:
            entry = CheckpointLog(store, "job", TASK).latest()
        return 0 if entry is None else int(entry.checkpoint.input_offsets["input"])

    preload = () if blob_config is None else (_STORE_MODULES[str(blob_config["blob.store.url"]).partition(":")[0]],)
    with ForkServer(preload) as server:
        _rounds(work, workdir, env, rng, durable_commit, server, backends, blob_config is not None)


#: the module of each remote store, imported once by the fork server (its children would each import it)
_STORE_MODULES = {"s3": "statebackend.blobstores.s3", "az": "statebackend.blobstores.azure"}


def _rounds(
    work: Path,
    workdir: Path,
    env: dict[str, str],
    rng: random.Random,
    durable_commit: Callable[[Path], int],
    server: ForkServer,
    backends: str,
    remote: bool,
) -> None:
    """The chain of kill rounds on ``workdir`` (see the module docstring), each child forked by ``server``."""

    def run_child(directory: Path, report: Path) -> ForkedChild:
        """A child that restores and commits nothing, run to its end."""
        return run_to_end(server, [str(directory), str(report), "0"], env, report.with_suffix(".err"), scaled(90))

    if remote:  # a first child creates the bucket or container (a kill may come before it can)
        first = run_child(workdir, work / "first.json")
        assert first.returncode == 0, first.stderr[-3000:]
        assert read_report(work / "first.json")["restored"] == 0
    durable_before = 0
    killed_with_commits = 0
    for round_number in range(ROUNDS):
        report_path = work / f"round-{round_number}.json"
        after_a_commit = round_number % 2 == 1
        delay = rng.uniform(0.0, 1.0) if after_a_commit else rng.uniform(0.2, 2.5)
        (workdir / STARTED_FILE).unlink(missing_ok=True)
        child = server.spawn([str(workdir), str(report_path), "100000"], env, work / f"round-{round_number}.err")
        try:
            _wait_until(child, lambda: (workdir / STARTED_FILE).exists(), "started its work")
            if after_a_commit:
                _wait_until(child, functools.partial(_committed_past, workdir, durable_before), "acknowledged a commit")
            time.sleep(delay)
            acknowledged_before_kill = reported_durable(workdir)
            child.send_signal(signal.SIGKILL)
            child.wait(scaled(60))
            stderr = child.stderr
        finally:
            if child.poll() is None:
                child.kill()
                child.wait(scaled(60))
        moment = "its first commit" if after_a_commit else "its start"
        where = f"{backends}, round {round_number}, seed {SEED}, killed {delay:.2f} s after {moment}"
        assert child.returncode == -signal.SIGKILL, f"{where}: the child exited by itself:\n{stderr[-3000:]}"

        reported = reported_durable(workdir)
        durable = durable_commit(workdir)
        assert reported >= acknowledged_before_kill
        assert durable >= reported, f"{where}: commit {reported} was acknowledged, the log holds only {durable}"
        assert reported <= durable <= reported + 1, f"{where}: more than the commit in flight landed unreported"
        local = read_local_checkpoint(workdir / "local" / "job" / TASK / STORE)
        if local is not None:
            assert int(local.input_offsets["input"]) <= durable, f"{where}: CHECKPOINT-V2 claims more than the log"
        if report_path.exists():  # the child got past its open: it restored the previous round's durable state
            report = read_report(report_path)
            assert report["restored"] == durable_before, where
            assert report_contents(report) == expected_state(durable_before), f"{where}: restored state differs"
        if after_a_commit:
            assert durable > durable_before, f"{where}: an acknowledged commit of the round is not durable"
        killed_with_commits += durable > durable_before

        if round_number % 2 == 1:
            wiped = work / f"wiped-{round_number}"
            shutil.copytree(workdir, wiped)
            shutil.rmtree(wiped / "local")
            wiped_env_child = run_child(wiped, work / f"wiped-{round_number}.json")
            assert wiped_env_child.returncode == 0, f"{where}: wiped restore failed:\n{wiped_env_child.stderr[-3000:]}"
            report = read_report(work / f"wiped-{round_number}.json")
            assert report["restored"] == durable, f"{where}: a wiped local dir restored another checkpoint"
            assert report_contents(report) == expected_state(durable), (
                f"{where}: a wiped local dir restored other state"
            )
            shutil.rmtree(wiped)
        durable_before = durable

    final = run_child(workdir, work / "final.json")
    assert final.returncode == 0, final.stderr[-3000:]
    assert read_report(work / "final.json")["restored"] == durable_before
    assert report_contents(read_report(work / "final.json")) == expected_state(durable_before)
    # the chain moved on: every round killed after a commit made one durable (checked per round above)
    assert killed_with_commits >= ROUNDS // 2, f"only {killed_with_commits} of {ROUNDS} rounds committed anything"


def _committed_past(workdir: Path, before: int) -> bool:
    """The child acknowledged a commit past ``before`` (its ``durable.log``)."""
    return reported_durable(workdir) > before


def _wait_until(child: ForkedChild, condition: Callable[[], bool], what: str) -> None:
    """Until ``condition`` holds (the child wrote a marker): the kill's delay counts from there, so a loaded machine,
    where the interpreter, its imports and a restore take many times as long, does not turn the rounds into kills
    before the moment they are meant for. Fails if the child exits first; the bound (120 s on an idle machine,
    stretched by its load) only guards a hang."""
    bound = scaled(120)
    deadline = time.monotonic() + bound
    while not condition():
        if child.poll() is not None:
            raise AssertionError(f"the child exited before it {what}:\n{child.stderr[-3000:]}")
        assert time.monotonic() < deadline, f"the child had not {what} after {bound:.0f} s"
        time.sleep(0.01)
