"""Scripts that tests run in fresh interpreters (the examples, the benches, the Spark Connect children), started in
the background when the session starts (tests/conftest.py), so their JVM start-ups and waits overlap with each other
and with the rest of the suite.

A test module registers each script its tests run (:func:`register`: a name, the tests that need it and the command,
built in a fresh directory of the script's own) when it is imported; the session fixture ``script_runs``
(tests/conftest.py) is created with the session when a selected test asks for it, and starts the scripts of every
*selected* test (collected, not deselected by ``-k`` or ``-m``, not skipped by a marker), in collection order, at most
:data:`AT_ONCE` at a time, the next starting as one ends. A test waits for its own script with
:meth:`ScriptRuns.result` and asserts on what it printed exactly as it would have on a run of its own. The scripts share
nothing but the machine: each has its own directory, and the ones that open ports take ephemeral ones. Their JVMs run
with the options of tests/spark_helpers.py's ``CHILD_JVM_OPTIONS`` (less CPU for a short-lived JVM).
"""

from __future__ import annotations

import logging
import os
import subprocess
import sys
import threading
from collections.abc import Callable, Iterable, Sequence
from pathlib import Path

import attrs
import pytest

from statebackend.testing.deadline import scaled
from tests.spark_helpers import with_child_jvm_options

__all__ = ["AT_ONCE", "REPO", "Finished", "Script", "ScriptRuns", "from_repo", "register", "registered"]

log = logging.getLogger(__name__)

#: scripts running at once: each starts a JVM and waits on it much of its time, so two overlap well on two cores
#: beside the test session (which runs its own tests meanwhile), and more would only compete for them
AT_ONCE = 2

REPO = Path(__file__).resolve().parent.parent

#: the bound on one script's run on an idle machine (stretched by the load when it starts): it only guards a hang
HANG_S = 900.0


#: a script's command: given its directory and the selected tests that need it (``module::test``, a script shared by
#: tests may do only the parts they need), ``(args, cwd)`` of ``python <args>``
Command = Callable[[Path, frozenset[str]], tuple[Sequence[str], Path]]


@attrs.frozen
class Script:
    """A command run as ``python <args>`` in ``cwd``: ``command`` builds both in a fresh directory of its own (the
    script's output files, work dirs, a script file written there). It runs when any of ``tests`` (``(module, test
    name)``, a parametrized test's name with its id) is selected."""

    name: str
    tests: frozenset[tuple[str, str]]
    command: Command


@attrs.frozen
class Finished:
    """A script's run: its exit code (negative: killed by that signal), its stdout and stderr, and its directory."""

    name: str
    args: tuple[str, ...]
    returncode: int
    stdout: str
    stderr: str
    dir: Path


_REGISTERED: dict[str, Script] = {}


def register(name: str, module: str, tests: Iterable[str], command: Command) -> None:
    """Register script ``name``, run for the tests ``tests`` of module ``module`` (its ``__name__``). Modules whose
    tests share one script register it each with the same ``command`` object; another command under a registered name
    is an error that names both."""
    needed = frozenset((module, test) for test in tests)
    if not needed:
        raise ValueError(f"script {name!r} of {module}: no test needs it (give the names of the tests that run it)")
    known = _REGISTERED.get(name)
    if known is not None and known.command is not command:
        modules = sorted({m for m, _ in known.tests} | {module})
        raise ValueError(
            f"script name {name!r} registered with two commands (by {', '.join(modules)}): names are unique"
        )
    _REGISTERED[name] = Script(name, needed | (known.tests if known is not None else frozenset()), command)


def from_repo(*args: str) -> Command:
    """The command of a script that is ``python args`` run from the repository root (its directory unused)."""
    return lambda folder, tests: (args, REPO)


def registered() -> list[Script]:
    """Every registered script, in registration order."""
    return list(_REGISTERED.values())


def selected(items: Sequence[pytest.Item]) -> list[tuple[str, str]]:
    """``(module, test name)`` of the tests of ``items`` that will run, in order: not those skipped by a marker."""
    chosen = []
    for item in items:
        if isinstance(item, pytest.Function) and item.get_closest_marker("skip") is None:
            chosen.append((item.module.__name__, item.name))
    return chosen


class ScriptRuns:
    """The registered scripts of the selected tests, run in the background :data:`AT_ONCE` at a time."""

    def __init__(self, scripts: Iterable[Script], tests: Sequence[tuple[str, str]], base: Path, at_once: int) -> None:
        order = {test: index for index, test in reversed(list(enumerate(tests)))}
        self._selected = {
            script.name: frozenset(f"{module}::{test}" for module, test in script.tests if (module, test) in order)
            for script in scripts
        }
        firsts = {
            script.name: min(order[test] for test in script.tests if test in order)
            for script in scripts
            if self._selected[script.name]
        }
        by_name = {script.name: script for script in scripts}
        self._base = base
        self._at_once = at_once
        self._lock = threading.Lock()
        self._waiting = [by_name[name] for name in sorted(firsts, key=firsts.__getitem__)]
        self._wanted = {script.name for script in self._waiting}
        self._running: dict[str, subprocess.Popen[bytes]] = {}
        self._done: dict[str, Finished] = {}
        self._ended = {name: threading.Event() for name in self._wanted}
        self._stopped = False
        log.info("script runs: %d scripts, %d at a time: %s", len(self._waiting), at_once, sorted(self._wanted))
        with self._lock:
            self._top_up()

    @classmethod
    def of_session(cls, items: Sequence[pytest.Item], base: Path, at_once: int = AT_ONCE) -> ScriptRuns:
        """The runs of the registered scripts that the selected tests among ``items`` need, started."""
        return cls(registered(), selected(items), base, at_once)

    def result(self, name: str) -> Finished:
        """Script ``name``'s run, once it has ended (started now, ahead of the queue, if it is still waiting)."""
        if name not in self._wanted:
            known = ", ".join(sorted(self._wanted)) or "none"
            raise KeyError(
                f"no script {name!r} runs in this session (registered: {sorted(_REGISTERED)}; run: {known}): "
                "register it in the test module, naming the test that runs it"
            )
        with self._lock:
            waiting = next((script for script in self._waiting if script.name == name), None)
            if waiting is not None:
                self._waiting.remove(waiting)
                self._start(waiting)
        self._ended[name].wait()
        return self._done[name]

    def stop(self) -> None:
        """Start nothing more; kill the scripts still running (the session is ending)."""
        with self._lock:
            self._stopped = True
            self._waiting.clear()
            running = list(self._running.values())
        for process in running:
            if process.poll() is None:
                process.kill()
            process.wait()

    def _top_up(self) -> None:
        """Start waiting scripts while fewer than ``at_once`` run (the caller holds the lock)."""
        while self._waiting and len(self._running) < self._at_once and not self._stopped:
            self._start(self._waiting.pop(0))

    def _start(self, script: Script) -> None:
        folder = self._base / script.name
        folder.mkdir(parents=True, exist_ok=True)
        args, cwd = script.command(folder, self._selected[script.name])
        argv = [sys.executable, *args]
        with (folder / "stdout").open("wb") as stdout, (folder / "stderr").open("wb") as stderr:
            env = with_child_jvm_options(os.environ)
            process = subprocess.Popen(argv, cwd=cwd, env=env, stdout=stdout, stderr=stderr)
        log.info("script %s started (pid %d): %s", script.name, process.pid, argv)
        self._running[script.name] = process
        watch = (script.name, tuple(argv), process, folder, scaled(HANG_S))
        threading.Thread(target=self._watch, args=watch, name=f"script-{script.name}", daemon=True).start()

    def _watch(
        self, name: str, argv: tuple[str, ...], process: subprocess.Popen[bytes], folder: Path, bound: float
    ) -> None:
        """Wait for the script to end (killing it past ``bound`` seconds: a hang), record its run, start the next."""
        note = ""
        try:
            process.wait(timeout=bound)
        except subprocess.TimeoutExpired:
            process.kill()
            process.wait()
            note = f"\n[script_runs: {name} ran longer than {bound:.0f} s and was killed]"
        stdout = (folder / "stdout").read_text(errors="replace")
        stderr = (folder / "stderr").read_text(errors="replace") + note
        finished = Finished(name, argv, process.returncode, stdout, stderr, folder)
        log.info("script %s ended with %d", name, process.returncode)
        with self._lock:
            self._done[name] = finished
            del self._running[name]
            self._top_up()
        self._ended[name].set()
