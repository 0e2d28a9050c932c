"""The contract suites catch the mutants: each suite runs against its correct base (the reference backend, the
in-memory blob store), which must pass every test, and against every mutant of statebackend.testing.mutants, each of
which must fail at least one test. The backend suite also runs, with the settings of the content-addressed example
backend (``sb_dedup.suite.DedupSuite``), on that backend and its mutants (``sb_dedup.mutants``, the ``dedup`` rows).
The table of which tests killed which mutant is printed (``-s``) and, when
``STATEBACKEND_KILL_TABLE`` names a file, written there as JSON (docs/contract-suites.md was made from it).

Each suite runs in pytest processes of its own on generated modules with one test class per mutant (the backend suite in
two: its correct base in one, its mutants in the other); all start at once. In the mutant runs a test waits at most
``wait_s`` = 5 s for a commit, a close at most 6 s (``task.commit.timeout.ms``), and fails after ``test_timeout_s`` = 20
s (stretched by the machine's load), so a mutant that hangs costs bounded time; the correct base runs with the suite's
own, longer waits, so a loaded machine never fails it. Once a test has killed a mutant, the rest of that mutant's tests
are skipped (one kill is what this test needs); with ``STATEBACKEND_KILL_TABLE`` set every test runs against every
mutant, so the table lists every test that kills each one. The correct base always runs whole.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path
from xml.etree import ElementTree

import attrs
import pytest
from sb_dedup import mutants as dedup_mutants

from statebackend.testing.mutants import BACKEND_MUTANTS, BLOB_STORE_MUTANTS, Mutant

pytestmark = [pytest.mark.slow, pytest.mark.timeout(900)]

BACKEND_MODULE = """
from typing import Any, ClassVar
from statebackend.testing.backend_contract import BackendContract
from statebackend.testing.reference import REFERENCE_BACKEND


class _Fast(BackendContract):
    wait_s: ClassVar[float] = 5.0
    test_timeout_s: ClassVar[float] = 20.0
    extra_config: ClassVar[dict[str, Any]] = {"task.commit.timeout.ms": 6_000}


"""

BACKEND_BASE = """

class TestBase(BackendContract):  # the suite's own waits: a correct backend passes however loaded the machine is
    backup_factories: ClassVar[str] = REFERENCE_BACKEND
"""

BACKEND_CLASS = """

class TestMutant_{name}(_Fast):
    backup_factories: ClassVar[str] = "{target}"
"""

DEDUP_MODULE = """
from typing import Any, ClassVar
from sb_dedup.suite import DedupSuite


class _Fast(DedupSuite):
    wait_s: ClassVar[float] = 5.0
    test_timeout_s: ClassVar[float] = 20.0
    extra_config: ClassVar[dict[str, Any]] = {"task.commit.timeout.ms": 6_000}


class TestBase(DedupSuite):  # the suite's own waits: a correct backend passes however loaded the machine is
    pass
"""

#: the content-addressed example backend's mutants, each a small change to it
DEDUP_MUTANTS = tuple(
    Mutant(name, f"{dedup_mutants.__name__}:{name}", " ".join((getattr(dedup_mutants, name).__doc__ or "").split()))
    for name in dedup_mutants.__all__
)

BLOB_STORE_MODULE = """
from collections.abc import Iterator
import pytest
from statebackend.blobstores.memory import MemoryBlobStore
from statebackend.testing.blobstore_contract import BlobStoreContract
{imports}


class _Memory(BlobStoreContract):
    store_class: type[MemoryBlobStore] = MemoryBlobStore
    test_timeout_s = 60.0

    @pytest.fixture
    def store(self) -> Iterator[MemoryBlobStore]:
        with self.store_class() as store:
            yield store

    def raw_get(self, store, name):
        entry = store._blobs.get(name)
        return None if entry is None else entry[0]


class TestBase(_Memory):
    pass
"""

BLOB_STORE_CLASS = """

class TestMutant_{name}(_Memory):
    store_class = {name}
"""


STOP_AT_FIRST_KILL = """
import pytest

_killed: set[str] = set()


def pytest_runtest_setup(item):
    if item.cls is not None and item.cls.__name__ in _killed:
        pytest.skip("this mutant is already killed by an earlier test")


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_makereport(item, call):
    outcome = yield
    report = outcome.get_result()
    if report.failed and item.cls is not None and item.cls.__name__.startswith("TestMutant_"):
        _killed.add(item.cls.__name__)
"""


@attrs.frozen
class SuiteRun:
    """One suite's pytest process on its generated module: its outcome per class and test."""

    suite: str
    processes: tuple[tuple[subprocess.Popen[str], Path], ...]

    def outcomes(self) -> dict[str, dict[str, str]]:
        """class -> test -> "passed" / "failed" (a failure or an error), once the processes ended."""
        results: dict[str, dict[str, str]] = {}
        for process, report in self.processes:
            output, _ = process.communicate(timeout=840)
            assert report.exists(), f"the {self.suite} suite run wrote no report:\n{output[-5000:]}"
            results.update(_outcomes(report))
        return results


def _outcomes(report: Path) -> dict[str, dict[str, str]]:
    """class -> test -> outcome from a junit report (a skip is its own outcome: the base must not have any)."""
    results: dict[str, dict[str, str]] = {}
    for case in ElementTree.parse(report).getroot().iter("testcase"):
        cls = case.get("classname", "").rpartition(".")[2]
        failed = any(child.tag in ("failure", "error") for child in case)
        skipped = any(child.tag == "skipped" for child in case)
        results.setdefault(cls, {})[case.get("name", "")] = "failed" if failed else "skipped" if skipped else "passed"
    return results


def _start(tmp: Path, suite: str, sources: list[str]) -> SuiteRun:
    """One pytest process per module source, all started now."""
    processes = []
    for part, source in enumerate(sources):
        folder = tmp / f"{suite}-{part}"
        folder.mkdir()
        module = folder / f"test_{suite}_mutants_{part}.py"
        module.write_text(source)
        if not os.environ.get("STATEBACKEND_KILL_TABLE"):
            (folder / "conftest.py").write_text(STOP_AT_FIRST_KILL)
        report = folder / "report.xml"
        command = [
            sys.executable,
            "-m",
            "pytest",
            str(module),
            "-q",
            "-p",
            "no:cacheprovider",
            "-o",
            "addopts=",
            "--junitxml",
            str(report),
            "--basetemp",
            str(folder / "tmp"),
        ]
        processes.append(
            (subprocess.Popen(command, cwd=folder, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True), report)
        )
    return SuiteRun(suite, tuple(processes))


@pytest.fixture(scope="module")
def runs(tmp_path_factory: pytest.TempPathFactory) -> Iterator[dict[str, SuiteRun]]:
    tmp = tmp_path_factory.mktemp("mutants")
    # the backend suite in two processes: the correct base (every test) beside the mutants (each until a test kills it)
    backend = [
        BACKEND_MODULE + BACKEND_BASE,
        BACKEND_MODULE + "".join(BACKEND_CLASS.format(name=m.name, target=m.target) for m in BACKEND_MUTANTS),
    ]
    imports = "\n".join(f"from {m.target.partition(':')[0]} import {m.name}" for m in BLOB_STORE_MUTANTS)
    blob = BLOB_STORE_MODULE.format(imports=imports) + "".join(
        BLOB_STORE_CLASS.format(name=m.name) for m in BLOB_STORE_MUTANTS
    )
    dedup = DEDUP_MODULE + "".join(BACKEND_CLASS.format(name=m.name, target=m.target) for m in DEDUP_MUTANTS)
    started = {
        "backend": _start(tmp, "backend", backend),
        "blobstore": _start(tmp, "blobstore", [blob]),
        "dedup": _start(tmp, "dedup", [dedup]),
    }
    try:
        yield started
    finally:
        for run in started.values():
            for process, _ in run.processes:
                if process.poll() is None:
                    process.kill()
                    process.wait()


def _kill_table(suite: str, mutants: tuple[Mutant, ...], outcomes: dict[str, dict[str, str]]) -> dict[str, object]:
    base = outcomes.get("TestBase", {})
    table = {
        m.name: sorted(
            test for test, outcome in outcomes.get(f"TestMutant_{m.name}", {}).items() if outcome == "failed"
        )
        for m in mutants
    }
    killed = sum(1 for tests in table.values() if tests)
    print(
        f"\n{suite} suite: {killed} of {len(mutants)} mutants killed; the correct base: "
        f"{sum(o == 'passed' for o in base.values())} of {len(base)} tests passed"
    )
    for mutant in mutants:
        print(f"  {mutant.name:24} {', '.join(table[mutant.name]) or 'SURVIVED'}")
    return {
        "suite": suite,
        "base": base,
        "killed_by": table,
        "breaks": {m.name: m.breaks for m in mutants},
        "tests": len(base),
    }


def _record(entry: dict[str, object]) -> None:
    out = os.environ.get("STATEBACKEND_KILL_TABLE")
    if not out:
        return
    path = Path(out)
    tables = json.loads(path.read_text()) if path.exists() else {}
    tables[str(entry["suite"])] = entry
    path.write_text(json.dumps(tables, indent=2, sort_keys=True))


@pytest.mark.parametrize(
    ("suite", "mutants"), [("backend", BACKEND_MUTANTS), ("blobstore", BLOB_STORE_MUTANTS), ("dedup", DEDUP_MUTANTS)]
)
def test_the_suite_passes_its_correct_base_and_kills_every_mutant(
    runs: dict[str, SuiteRun], suite: str, mutants: tuple[Mutant, ...]
) -> None:
    outcomes = runs[suite].outcomes()
    entry = _kill_table(suite, mutants, outcomes)
    _record(entry)
    base = outcomes.get("TestBase", {})
    assert len(base) >= 20, f"the {suite} suite ran only {len(base)} tests on its correct base"
    assert {test: o for test, o in base.items() if o != "passed"} == {}, (
        f"the {suite} suite does not pass its correct base"
    )
    for mutant in mutants:
        ran = outcomes.get(f"TestMutant_{mutant.name}", {})
        assert len(ran) == len(base), f"{mutant.name}: ran {len(ran)} of the suite's {len(base)} tests"
    survivors = [m.name for m in mutants if not entry["killed_by"][m.name]]  # type: ignore[index]
    assert survivors == [], f"the {suite} suite passes these broken variants: {survivors}"


def test_every_mutant_is_a_small_named_variant_of_its_base() -> None:
    from sb_dedup import DedupStateBackendFactory

    from statebackend.blobstores.memory import MemoryBlobStore
    from statebackend.registry import resolve_factory
    from statebackend.testing.reference import ReferenceBackendFactory

    assert len(BACKEND_MUTANTS) >= 12 and len(BLOB_STORE_MUTANTS) >= 8 and len(DEDUP_MUTANTS) >= 4
    for mutants, base in ((BACKEND_MUTANTS, ReferenceBackendFactory), (DEDUP_MUTANTS, DedupStateBackendFactory)):
        for mutant in mutants:
            factory = resolve_factory(mutant.target).factory
            assert isinstance(factory, base) and type(factory) is not base
            assert mutant.breaks, f"{mutant.name} does not say what it breaks"
    for mutant in BLOB_STORE_MUTANTS:
        module, _, name = mutant.target.partition(":")
        cls = getattr(sys.modules[module], name)
        assert issubclass(cls, MemoryBlobStore) and cls is not MemoryBlobStore and mutant.breaks
