"""Random kills: SIGKILL a committing process at random moments, again and again, and check after every kill that no
acknowledged commit was lost and that what restores is exactly a durable checkpoint.

tests/test_crash.py kills at each named step of the commit protocol; a kill at a random moment also lands inside
LMDB writes, renames, background snapshots, compactions, sweeps and restores, wherever the process happens to be.
The child is tests/crash_child.py (deterministic data: the state of checkpoint ``n`` is ``expected_state(n)``). Per
backend a chain of rounds runs on one work dir: each round starts a child on the kept local dir (it restores, then
commits until killed), kills it after a random delay, and checks:

1. the newest checkpoint in the log is at or past the last commit the child acknowledged (``durable.log``);
2. the local ``CHECKPOINT-V2`` never claims more than the log holds;
3. what the child restored at its start (its report) was exactly the durable checkpoint of the round before;
4. every other round, a fresh process on a copy with the local dir wiped restores exactly the durable checkpoint.

The delays come from a seeded generator: ``STATEBACKEND_KILL_SEED`` replays another sequence (the default is fixed,
so a failure reproduces).
"""

from __future__ import annotations

import os
import random
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
from statebackend.checkpoint import read_local_checkpoint

from tests.crash_child import BACKUP_FACTORIES_ENV, STORE, TASK, expected_state
from tests.test_crash import REPO, _contents, _durable_commit, _report, _reported_durable, work

__all__ = ["work"]  # the RAM-backed temp dir fixture of tests/test_crash.py

ROUNDS = 8
SEED = int(os.environ.get("STATEBACKEND_KILL_SEED", "20261124"))


@pytest.mark.slow
@pytest.mark.parametrize("backends", ["changelog", "blobsnapshot", "changelog,blobsnapshot"])
def test_random_sigkills_never_lose_an_acknowledged_commit(work: Path, backends: str) -> None:
    rng = random.Random(f"{SEED}-{backends}")
    workdir = work / "run"
    workdir.mkdir()
    env = {key: value for key, value in os.environ.items() if key != "STATEBACKEND_CRASH_AT"}
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(REPO), env.get("PYTHONPATH")]))
    env[BACKUP_FACTORIES_ENV] = backends
    durable_before = 0
    killed_with_commits = 0
    for round_number in range(ROUNDS):
        report_path = work / f"round-{round_number}.json"
        delay = rng.uniform(0.2, 2.5)
        child = subprocess.Popen(
            [sys.executable, "-m", "tests.crash_child", str(workdir), str(report_path), "100000"],
            cwd=REPO, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True,
        )
        time.sleep(delay)
        acknowledged_before_kill = _reported_durable(workdir)
        child.send_signal(signal.SIGKILL)
        _, stderr = child.communicate(timeout=60)
        where = f"{backends}, round {round_number}, seed {SEED}, killed after {delay:.2f} s"
        assert child.returncode == -signal.SIGKILL, f"{where}: the child exited by itself:\n{stderr[-3000:]}"

        reported = _reported_durable(workdir)
        durable = _durable_commit(workdir)
        assert reported >= acknowledged_before_kill
        assert durable >= reported, f"{where}: commit {reported} was acknowledged, the log holds only {durable}"
        assert reported <= durable <= reported + 1, f"{where}: more than the commit in flight landed unreported"
        local = read_local_checkpoint(workdir / "local" / "job" / TASK / STORE)
        if local is not None:
            assert int(local.input_offsets["input"]) <= durable, f"{where}: CHECKPOINT-V2 claims more than the log"
        if report_path.exists():  # the child got past its open: it restored the previous round's durable state
            report = _report(report_path)
            assert report["restored"] == durable_before, where
            assert _contents(report) == expected_state(durable_before), f"{where}: restored state differs"
        killed_with_commits += durable > durable_before

        if round_number % 2 == 1:
            wiped = work / f"wiped-{round_number}"
            shutil.copytree(workdir, wiped)
            shutil.rmtree(wiped / "local")
            wiped_env_child = _child_with(wiped, work / f"wiped-{round_number}.json", env)
            assert wiped_env_child.returncode == 0, f"{where}: wiped restore failed:\n{wiped_env_child.stderr[-3000:]}"
            report = _report(work / f"wiped-{round_number}.json")
            assert report["restored"] == durable, f"{where}: a wiped local dir restored another checkpoint"
            assert _contents(report) == expected_state(durable), f"{where}: a wiped local dir restored other state"
            shutil.rmtree(wiped)
        durable_before = durable

    final = _child_with(workdir, work / "final.json", env)
    assert final.returncode == 0, final.stderr[-3000:]
    assert _report(work / "final.json")["restored"] == durable_before
    assert _contents(_report(work / "final.json")) == expected_state(durable_before)
    # the delays are long enough that most rounds commit: a chain that never got past its restore tests little
    assert killed_with_commits >= ROUNDS // 2, f"only {killed_with_commits} of {ROUNDS} rounds committed anything"


def _child_with(workdir: Path, report: Path, env: dict[str, str]) -> subprocess.CompletedProcess[str]:
    """A child that restores and commits nothing (0 commits), with the round's environment (its backends)."""
    return subprocess.run(
        [sys.executable, "-m", "tests.crash_child", str(workdir), str(report), "0"],
        cwd=REPO, env=env, capture_output=True, text=True, timeout=90, check=False,
    )
