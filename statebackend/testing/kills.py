"""Random SIGKILLs of a committing process: the deterministic data such a process commits, the process itself, and
the parent's rounds of kills and checks. The backend contract suite runs them on the backend under test
(``test_sigkilled_commits_restore_exactly_the_newest_durable_checkpoint``); the project's own crash tests share the
data (tests/crash_child.py).

**The data** is a function of the commit number alone: commit ``n`` applies :func:`operations` ``(n)`` and commits
with input offsets ``{"input": str(n)}``, so the state of a checkpoint at input ``n`` is :func:`expected_state`
``(n)`` whatever happened to the process that wrote it. No model file is needed.

**The child** (``python -m statebackend.testing.kills <spec.json> <rundir>``) opens the task of the spec's config
(the backend resolved by its name, as a job would: short name, entry point or dotted path; ``imports`` are imported
first), which restores the newest durable checkpoint; writes what it restored to ``<rundir>/report.json``; then
commits ``commits`` times, appending each acknowledged commit's number to ``<rundir>/durable.log`` (unbuffered: the
line survives a SIGKILL), and closes.

**The parent** (:func:`kill_rounds`) commits a few times itself and closes cleanly, then runs the child again and
again on one local dir and one blob store: each round starts a child on the local dir the previous one left (flushed
but uncommitted data, a half-applied restore: whatever a kill left), kills it with SIGKILL at a random instant (in its
commits, once it logged the first, or, for the last round, right after it starts on a wiped local dir: in its
restore), and checks:

1. the newest checkpoint of the log is at or past the last commit the child acknowledged, and at most the commit in
   flight past it;
2. the next child (at the end, the parent) restored exactly the newest durable checkpoint, on the local dir the kill
   left;
3. a restore in the parent, in a fresh local dir, gives exactly that checkpoint's state.

The blob store must be shared by processes (``file://`` or a real service): the in-memory store is not.
"""

from __future__ import annotations

import importlib
import json
import os
import random
import shutil
import signal
import subprocess
import sys
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import attrs

from statebackend.blobstores.base import known_blob_store_schemes, open_blob_store, register_blob_store
from statebackend.config import Settings
from statebackend.lifecycle import task_checkpoint_log
from statebackend.registry import known_factories, register_factory
from statebackend.task import TaskStorage
from statebackend.testing.deadline import scaled

__all__ = [
    "DEFAULT_VALUE_REPEAT",
    "KEY_SPACE",
    "OPERATIONS_PER_COMMIT",
    "KillSpec",
    "expected_state",
    "kill_rounds",
    "operations",
    "run_commits",
]

#: the number of distinct keys the commits write (``key00000`` ... ``key00399``)
KEY_SPACE = 400
#: writes per commit (puts and deletes of distinct keys)
OPERATIONS_PER_COMMIT = 80
#: how many times a value's text is repeated (larger values: more bytes per commit)
DEFAULT_VALUE_REPEAT = 3


def operations(n: int, value_repeat: int = DEFAULT_VALUE_REPEAT) -> list[tuple[bytes, bytes | None]]:
    """The writes of commit ``n``: (key, value) puts and (key, None) deletes, distinct keys."""
    result: list[tuple[bytes, bytes | None]] = []
    for i in range(OPERATIONS_PER_COMMIT):
        key = f"key{(i * 37 + n * 101) % KEY_SPACE:05d}".encode()  # 37 is prime to 400: no key twice per commit
        result.append((key, None) if (i * 3 + n) % 7 == 0 else (key, f"value-{n}-{i}".encode() * value_repeat))
    return result


def expected_state(n: int, value_repeat: int = DEFAULT_VALUE_REPEAT) -> dict[bytes, bytes]:
    """The store's contents at checkpoint ``n`` (0: no checkpoint, empty)."""
    state: dict[bytes, bytes] = {}
    for commit in range(1, n + 1):
        for key, value in operations(commit, value_repeat):
            if value is None:
                state.pop(key, None)
            else:
                state[key] = value
    return state


@attrs.frozen
class KillSpec:
    """What a child runs: the task's whole config (JSON values only: it crosses a process boundary), the task and
    store it writes, the modules it imports first (a backend registered at import), and how many commits."""

    #: the task's whole config (JSON values only)
    config: dict[str, Any]
    #: the task the child opens
    task: str = "task-0"
    #: the store it writes (:func:`operations`)
    store: str = "counts"
    #: modules the child imports before it opens the task (a backend registered at import)
    imports: tuple[str, ...] = ()
    #: commits the child makes unless killed first
    commits: int = 1_000_000
    #: the checkpoint log's ``retention_interval`` in the child: retention (and the backends' deletes with it) every
    #: few commits, so kills land in them too
    retention_interval: int = 2
    #: backend names (``register_factory``) and blob store schemes (``register_blob_store``) -> their targets, as the
    #: parent resolves them: the child registers those it resolves otherwise (a backend a test registered in its
    #: own process at run time), so it runs the very backend the parent tests
    backends: dict[str, str] = attrs.field(factory=dict)
    #: blob store schemes -> their targets, as ``backends`` (:func:`kill_rounds` fills both)
    schemes: dict[str, str] = attrs.field(factory=dict)

    def write(self, path: Path) -> None:
        """Write the spec as JSON to ``path``, for the child (:meth:`read`)."""
        path.write_text(json.dumps(attrs.asdict(self)))

    @classmethod
    def read(cls, path: Path) -> KillSpec:
        """The spec :meth:`write` wrote to ``path``."""
        raw = json.loads(path.read_text())
        return cls(**{**raw, "imports": tuple(raw["imports"])})


def kill_rounds(spec: KillSpec, workdir: Path, *, rounds: int = 3, seed: object = 0, wait_s: float = 30.0) -> int:
    """Commit a few times in this process and close cleanly, then run ``rounds`` children killed at random instants
    (``seed`` picks them), checking after each what the module docstring says; at the end this process restores on
    what the last kill left. Raises :class:`AssertionError` saying what was lost or torn. Returns the newest durable
    input number."""
    rng = random.Random(str(seed))
    workdir.mkdir(parents=True, exist_ok=True)
    spec = attrs.evolve(spec, backends=dict(known_factories()), schemes=dict(known_blob_store_schemes()))
    spec_path = workdir / "spec.json"
    spec.write(spec_path)
    local = Path(str(spec.config["state.local.dir"]))
    _, _ = run_commits(spec, 3, None)  # a clean run first: what a kill leaves then follows a clean close
    durable_before = _durable(spec)
    for round_no in range(rounds):
        if round_no == rounds - 1:
            shutil.rmtree(local, ignore_errors=True)  # the last kill lands in a full restore, or just after it
        run = workdir / f"round-{round_no}"
        run.mkdir()
        child = subprocess.Popen(
            [sys.executable, "-m", "statebackend.testing.kills", str(spec_path), str(run)],
            env=_child_env(),
            stdout=subprocess.DEVNULL,
            stderr=subprocess.PIPE,
            text=True,
        )
        where = f"round {round_no} (seed {seed!r})"
        try:
            _wait_for(child, run / "started", wait_s, where)
            if round_no < rounds - 1:  # kill once it committed: in a later commit, an upload, a cleanup
                _wait_for(child, run / "durable.log", wait_s, where, nonempty=True)
            time.sleep(rng.uniform(0.0, 0.25))
            child.send_signal(signal.SIGKILL)
            _, stderr = child.communicate(timeout=scaled(wait_s))
            assert child.returncode == -signal.SIGKILL, f"{where}: the child ended by itself:\n{stderr[-4000:]}"
        finally:
            if child.poll() is None:
                child.kill()
                child.wait()
        if (run / "report.json").exists():  # it got past its open: it restored the previous round's durable state
            report = json.loads((run / "report.json").read_text())
            restored = {bytes.fromhex(k): bytes.fromhex(v) for k, v in report["contents"].items()}
            _check_restored(
                f"{where}: the child, on the local dir the last kill left,",
                report["restored"],
                restored,
                durable_before,
            )
        acknowledged = _acknowledged(run / "durable.log", durable_before)
        durable = _durable(spec)
        assert durable >= acknowledged, f"{where}: commit {acknowledged} was acknowledged, the log holds {durable}"
        assert durable <= acknowledged + 1, f"{where}: checkpoint {durable} is durable, {acknowledged} acknowledged"
        fresh = attrs.evolve(spec, config=dict(spec.config, **{"state.local.dir": str(workdir / f"fresh-{round_no}")}))
        _check_restored(f"{where}: a fresh local dir", *run_commits(fresh, 0, None), durable)
        shutil.rmtree(workdir / f"fresh-{round_no}", ignore_errors=True)
        durable_before = durable
    _check_restored("at the end: the local dir the last kill left", *run_commits(spec, 0, None), durable_before)
    return durable_before


def run_commits(spec: KillSpec, commits: int, run: Path | None) -> tuple[int, dict[bytes, bytes]]:
    """Open the spec's task (it restores), then commit ``commits`` times and close. With ``run`` (a child's run
    dir), report what was restored there and log every acknowledged commit. Returns the input number restored and
    the store's contents then."""
    with TaskStorage.open(spec.config, spec.task) as task:
        task.checkpoint_log.retention_interval = spec.retention_interval
        store = task.store(spec.store, typed=False)
        restored = 0 if task.restored is None else int(task.restored.input_offsets["input"])
        contents = dict(store.items())
        if run is None:
            durable_log = None
        else:
            partial = run / "report.json.partial"  # whole or absent: the parent reads an existing report
            partial.write_text(
                json.dumps(
                    {"restored": restored, "contents": {key.hex(): value.hex() for key, value in contents.items()}}
                )
            )
            os.replace(partial, run / "report.json")
            durable_log = os.open(run / "durable.log", os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o644)
        try:
            for n in range(restored + 1, restored + commits + 1):
                for key, value in operations(n):
                    if value is None:
                        store.delete(key)
                    else:
                        store.put(key, value)
                task.commit_durably({"input": str(n)}, timeout=scaled(60))
                if durable_log is not None:
                    os.write(durable_log, f"{n}\n".encode())
        finally:
            if durable_log is not None:
                os.close(durable_log)
    return restored, contents


# -- the child ------------------------------------------------------------------------------------------------------


def main(argv: Sequence[str]) -> int:
    """``python -m statebackend.testing.kills <spec.json> <rundir>``: see the module docstring."""
    if len(argv) != 3:
        print(__doc__, file=sys.stderr)
        return 2
    spec, run = KillSpec.read(Path(argv[1])), Path(argv[2])
    for module in spec.imports:
        importlib.import_module(module)
    _register_as_the_parent(spec)
    (run / "started").write_text(str(os.getpid()))
    run_commits(spec, spec.commits, run)
    return 0


def _register_as_the_parent(spec: KillSpec) -> None:
    """Register every backend name and blob store scheme this process resolves otherwise than the parent did."""
    known = known_factories()
    for name, target in spec.backends.items():
        if known.get(name) != target:
            register_factory(name, target, replace=True)
    schemes = known_blob_store_schemes()
    for scheme, target in spec.schemes.items():
        if schemes.get(scheme) != target:
            register_blob_store(scheme, target, replace=True)


# -- the parent's checks --------------------------------------------------------------------------------------------


def _child_env() -> dict[str, str]:
    """This process's environment, with its import path: whatever the parent imports, the child can."""
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join(path for path in sys.path if path)
    env.pop("STATEBACKEND_CRASH_AT", None)
    return env


def _wait_for(child: subprocess.Popen[str], path: Path, wait_s: float, where: str, *, nonempty: bool = False) -> None:
    """Until the child wrote ``path`` (``nonempty``: and something in it: the durable log, once the child logged its
    first acknowledged commit; the child creates the file before its first commit): a hang guard of ``wait_s`` on an
    idle machine, stretched by its load (a loaded machine starts the interpreter and restores in many times the idle
    time)."""
    wait_s = scaled(wait_s)
    deadline = time.monotonic() + wait_s
    what = f"anything in {path.name}" if nonempty else path.name
    while not path.exists() or (nonempty and path.stat().st_size == 0):
        if child.poll() is not None:
            _, stderr = child.communicate()
            raise AssertionError(f"{where}: the child ended before it wrote {what}:\n{stderr[-4000:]}")
        assert time.monotonic() < deadline, f"{where}: the child did not write {what} within {wait_s:.0f} s"
        time.sleep(0.005)


def _acknowledged(durable_log: Path, before: int) -> int:
    if not durable_log.exists():
        return before
    lines = [line for line in durable_log.read_text().split("\n") if line.strip()]
    return int(lines[-1]) if lines else before


def _durable(spec: KillSpec) -> int:
    """The input number of the newest checkpoint in the task's log (0: none)."""
    settings = Settings.from_config(spec.config)
    with open_blob_store(settings.blob_store_url, settings.blob_store_options) as store:
        entry = task_checkpoint_log(settings, store, spec.task).latest()
    return 0 if entry is None else int(entry.checkpoint.input_offsets["input"])


def _check_restored(who: str, restored: int, got: dict[bytes, bytes], durable: int) -> None:
    assert restored == durable, f"{who} restored checkpoint {restored}; the newest durable one is {durable}"
    expected = expected_state(durable)
    assert got == expected, f"{who} restored other state than checkpoint {durable} ({_diff(got, expected)})"


def _diff(got: dict[bytes, bytes], expected: dict[bytes, bytes]) -> str:
    missing = sorted(set(expected) - set(got))
    extra = sorted(set(got) - set(expected))
    changed = sorted(key for key in set(got) & set(expected) if got[key] != expected[key])
    return f"{len(missing)} keys missing, {len(extra)} extra, {len(changed)} with other values"


if __name__ == "__main__":
    sys.exit(main(sys.argv))
