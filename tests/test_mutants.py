"""The contract suites catch the mutants: each suite runs against every mutant of statebackend.testing.mutants, each
of which must fail at least one test, and its correct base (the reference backend, the in-memory blob store) must pass
every test. The backend suite also runs, with the settings of the content-addressed example backend
(``sb_dedup.suite.DedupSuite``), on that backend's mutants (``sb_dedup.mutants``, the ``dedup`` rows). The table of
which tests killed which mutant is printed (``-s``) and, when ``STATEBACKEND_KILL_TABLE`` names a file, written there
as JSON (docs/contract-suites.md was made from it).

Each suite runs in a pytest process of its own on a generated module with one test class per mutant and a
``TestBase`` class of the correct base; all start at once. The correct bases run in the main suite with the very
settings of these ``TestBase`` classes (tests/test_backend_reference.py ``TestReferenceBackend``,
tests/test_blobstore_memory.py, tests/test_dedup_backend.py ``TestDedupBackend``; checked here): here ``TestBase`` is
only collected and skipped, which counts the suite's tests, and each mutant class must have run (or skipped after its
kill) every one of them. In the mutant runs a test waits at most ``wait_s`` = 5 s for a commit, a close at most 6 s
(``task.commit.timeout.ms``), and fails after ``test_timeout_s`` = 20 s (stretched by the machine's load), so a mutant
that hangs costs bounded time; that deadline fails a test only inside its phases, never in pytest's own reporting
between them, where it would end the whole run and leave the later mutants unrun. Each run is waited for as long
as it keeps reporting tests, and must end as a finished pytest session. Once a test has killed a mutant, the rest of
that mutant's tests are skipped (one kill is what this test needs), and each mutant's tests run in the order of
``tests/mutant_kills.json``: the tests that killed it in the last kill table run, fastest first, then the others in the
suite's order (a stale hint only costs time: every test still runs until one kills it). With ``STATEBACKEND_KILL_TABLE``
set every test runs against every mutant, so the table lists every test that kills each one, the correct bases run here
too (with the suite's own, longer waits, in a process of their own for the backend suite), and
``tests/mutant_kills.json`` is written anew.
"""

from __future__ import annotations

import inspect
import json
import os
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from xml.etree import ElementTree

import attrs
import pytest
from sb_dedup import mutants as dedup_mutants

from statebackend.testing.deadline import scaled
from statebackend.testing.mutants import BACKEND_MUTANTS, BLOB_STORE_MUTANTS, Mutant
from tests.crash_child import crash_workdir

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


#: the tests that killed each mutant in the last kill table run, fastest first: suite -> mutant -> tests
KILL_HINTS = Path(__file__).with_name("mutant_kills.json")

#: where the main suite runs each suite's correct base (with the settings of the generated ``TestBase``)
BASE_IN_MAIN_SUITE = {
    "backend": "tests/test_backend_reference.py::TestReferenceBackend",
    "blobstore": "tests/test_blobstore_memory.py::TestMemoryBlobStore",
    "dedup": "tests/test_dedup_backend.py::TestDedupBackend",
}

CONFTEST = """
import json
from pathlib import Path

import pytest

EVERY_TEST = {every_test}  # a kill table run: every test against every mutant, and the correct base runs too
_hints = json.loads((Path(__file__).parent / "hints.json").read_text())  # class -> the tests that killed it
_killed = set()


def _class(item):
    return item.cls.__name__ if item.cls is not None else ""


def pytest_collection_modifyitems(items):
    # each class stays where it is; within it, the tests that killed it last time first, in the hints' order
    classes = {{}}
    for item in items:
        classes.setdefault(_class(item), len(classes))

    def rank(pair):
        index, item = pair
        hints = _hints.get(_class(item), [])
        return classes[_class(item)], hints.index(item.name) if item.name in hints else len(hints), index

    items[:] = [item for _, item in sorted(enumerate(items), key=rank)]


@pytest.hookimpl(tryfirst=True)
def pytest_runtest_setup(item):
    if _class(item) == "TestBase" and not EVERY_TEST:
        pytest.skip("counted only: the correct base runs in the main suite, {base}")
    if _class(item) in _killed:
        pytest.skip("this mutant is already killed by an earlier test")


@pytest.hookimpl(wrapper=True, tryfirst=True)
def pytest_runtest_makereport(item, call):
    report = yield
    if report.failed and _class(item).startswith("TestMutant_") and not EVERY_TEST:
        _killed.add(_class(item))
    return report
"""


@attrs.frozen
class Case:
    """One test's outcome in a suite run: "passed", "failed" (a failure or an error) or "skipped", and its seconds."""

    outcome: str
    seconds: float


@attrs.frozen
class SuiteRun:
    """One suite's pytest processes on its generated modules: its outcome per class and test."""

    suite: str
    processes: tuple[tuple[subprocess.Popen[bytes], Path], ...]

    def cases(self) -> dict[str, dict[str, Case]]:
        """class -> test -> its case, once the processes ended, each a finished pytest session."""
        results: dict[str, dict[str, Case]] = {}
        for process, report in self.processes:
            _wait_while_it_reports(process, report.parent / "output.txt", self.suite)
            output = (report.parent / "output.txt").read_text(errors="replace")
            # 0: every test passed, 1: some failed; anything else (an internal error, an interrupt) ended the session
            # early, and its report holds only the tests before that
            assert process.returncode in (0, 1), (
                f"the {self.suite} suite run ended with exit code {process.returncode}, not as a finished pytest "
                f"session:\n{output[-8000:]}"
            )
            assert report.exists(), f"the {self.suite} suite run wrote no report:\n{output[-5000:]}"
            results.update(_cases(report))
        return results


#: seconds (on an idle machine; stretched by the load) a suite run may go without reporting a test before it counts
#: as hung: more than any one test takes, up to its deadline (``test_timeout_s``, 120 s for a correct base) and the
#: deadline's backstop (statebackend.testing.deadline.BACKSTOP_S)
IDLE_S = 300.0


def _wait_while_it_reports(process: subprocess.Popen[bytes], output: Path, suite: str) -> None:
    """Wait for ``process`` to end as long as it keeps reporting tests (its output grows): a loaded machine makes the
    run longer, never a failure; a run that reports nothing for ``scaled(IDLE_S)`` is hung, and is killed."""
    size, since = -1, time.monotonic()
    while process.poll() is None:
        now = output.stat().st_size if output.exists() else 0
        if now != size:
            size, since = now, time.monotonic()
        elif time.monotonic() - since > scaled(IDLE_S):
            process.kill()
            process.wait()
            tail = output.read_text(errors="replace")[-5000:]
            pytest.fail(f"the {suite} suite run reported no test for {scaled(IDLE_S):.0f} s: hung, killed\n{tail}")
        time.sleep(0.5)


def _cases(report: Path) -> dict[str, dict[str, Case]]:
    """class -> test -> case from a junit report."""
    results: dict[str, dict[str, Case]] = {}
    for case in ElementTree.parse(report).getroot().iter("testcase"):
        cls = case.get("classname", "").rpartition(".")[2]
        failed = any(child.tag in ("failure", "error") for child in case)
        skipped = any(child.tag == "skipped" for child in case)
        outcome = "failed" if failed else "skipped" if skipped else "passed"
        results.setdefault(cls, {})[case.get("name", "")] = Case(outcome, float(case.get("time") or 0))
    return results


def _every_test() -> bool:
    """A kill table run: every test against every mutant, and the correct bases here too."""
    return bool(os.environ.get("STATEBACKEND_KILL_TABLE"))


def _hints(suite: str) -> dict[str, list[str]]:
    """TestMutant_<name> -> the tests that killed mutant <name> in the last kill table run, fastest first."""
    tables = json.loads(KILL_HINTS.read_text()) if KILL_HINTS.exists() else {}
    return {f"TestMutant_{name}": list(tests) for name, tests in tables.get(suite, {}).items()}


def _start(tmp: Path, suite: str, sources: list[str]) -> SuiteRun:
    """One pytest process per module source, all started now."""
    processes = []
    for part, source in enumerate(sources):
        folder = tmp / f"{suite}-{part}"
        folder.mkdir()
        module = folder / f"test_{suite}_mutants_{part}.py"
        module.write_text(source)
        (folder / "conftest.py").write_text(CONFTEST.format(every_test=_every_test(), base=BASE_IN_MAIN_SUITE[suite]))
        (folder / "hints.json").write_text(json.dumps(_hints(suite)))
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
        # its output to a file, never a pipe: a pipe nobody reads until another suite's run ends blocks the run
        with open(folder / "output.txt", "wb") as output:
            processes.append((subprocess.Popen(command, cwd=folder, stdout=output, stderr=subprocess.STDOUT), report))
    return SuiteRun(suite, tuple(processes))


def _sources() -> dict[str, list[str]]:
    """suite -> the sources of its generated modules, one pytest process each."""
    backend_mutants = "".join(BACKEND_CLASS.format(name=m.name, target=m.target) for m in BACKEND_MUTANTS)
    # a kill table run runs the backend suite's correct base whole: in a process of its own, beside the mutants
    backend = (
        [BACKEND_MODULE + BACKEND_BASE, BACKEND_MODULE + backend_mutants]
        if _every_test()
        else [BACKEND_MODULE + BACKEND_BASE + backend_mutants]
    )
    imports = "\n".join(f"from {m.target.partition(':')[0]} import {m.name}" for m in BLOB_STORE_MUTANTS)
    blob = BLOB_STORE_MODULE.format(imports=imports) + "".join(
        BLOB_STORE_CLASS.format(name=m.name) for m in BLOB_STORE_MUTANTS
    )
    dedup = DEDUP_MODULE + "".join(BACKEND_CLASS.format(name=m.name, target=m.target) for m in DEDUP_MUTANTS)
    return {"backend": backend, "blobstore": [blob], "dedup": [dedup]}


@pytest.fixture(scope="module")
def runs() -> Iterator[dict[str, SuiteRun]]:
    # in RAM where possible: no process of these runs dies but the kill test's children, whose deaths fsyncs do not
    # change; on a shared disk the suites' fsyncs are most of their time
    with crash_workdir("statebackend-mutants-") as tmp:
        started = {suite: _start(tmp, suite, sources) for suite, sources in _sources().items()}
        try:
            yield started
        finally:
            for run in started.values():
                for process, _ in run.processes:
                    if process.poll() is None:
                        process.kill()
                        process.wait()


def _kill_table(suite: str, mutants: tuple[Mutant, ...], cases: dict[str, dict[str, Case]]) -> dict[str, object]:
    base = {test: case.outcome for test, case in cases.get("TestBase", {}).items()}
    table = {
        m.name: sorted(test for test, case in cases.get(f"TestMutant_{m.name}", {}).items() if case.outcome == "failed")
        for m in mutants
    }
    killed = sum(1 for tests in table.values() if tests)
    where = "here" if _every_test() else f"in the main suite ({BASE_IN_MAIN_SUITE[suite]})"
    print(
        f"\n{suite} suite: {killed} of {len(mutants)} mutants killed; the correct base ({where}): "
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


def _fastest_kills_first(mutants: tuple[Mutant, ...], cases: dict[str, dict[str, Case]]) -> dict[str, list[str]]:
    """mutant -> the tests that killed it, fastest first (the hints of the next runs)."""
    order = {}
    for mutant in mutants:
        ran = cases.get(f"TestMutant_{mutant.name}", {})
        kills = [test for test, case in ran.items() if case.outcome == "failed"]
        order[mutant.name] = sorted(kills, key=lambda test: (ran[test].seconds, test))
    return order


def _record(entry: dict[str, object], hints: dict[str, list[str]]) -> None:
    """A kill table run: its table into ``STATEBACKEND_KILL_TABLE``, its kills as the hints of the next runs."""
    out = os.environ.get("STATEBACKEND_KILL_TABLE")
    if not out:
        return
    path = Path(out)
    tables = json.loads(path.read_text()) if path.exists() else {}
    tables[str(entry["suite"])] = entry
    path.write_text(json.dumps(tables, indent=2, sort_keys=True))
    known = json.loads(KILL_HINTS.read_text()) if KILL_HINTS.exists() else {}
    known[str(entry["suite"])] = hints
    KILL_HINTS.write_text(json.dumps(known, indent=1, sort_keys=True) + "\n")


# no wall-clock bound: a suite run is waited for as long as it keeps reporting tests (_wait_while_it_reports), and
# a kill table run on a loaded machine takes many minutes
@pytest.mark.timeout(0)
@pytest.mark.parametrize(
    ("suite", "mutants"), [("backend", BACKEND_MUTANTS), ("blobstore", BLOB_STORE_MUTANTS), ("dedup", DEDUP_MUTANTS)]
)
def test_the_suite_passes_its_correct_base_and_kills_every_mutant(
    runs: dict[str, SuiteRun], suite: str, mutants: tuple[Mutant, ...]
) -> None:
    cases = runs[suite].cases()
    entry = _kill_table(suite, mutants, cases)
    base = {test: case.outcome for test, case in cases.get("TestBase", {}).items()}
    assert len(base) >= 20, f"the {suite} suite collected only {len(base)} tests on its correct base"
    # counted only (skipped) unless this is a kill table run: the main suite runs it (the next test checks that)
    expected = "passed" if _every_test() else "skipped"
    assert {test: o for test, o in base.items() if o != expected} == {}, (
        f"the {suite} suite does not pass its correct base"
        if _every_test()
        else f"the {suite} suite ran tests of its correct base, which the main suite runs"
    )
    for mutant in mutants:
        ran = cases.get(f"TestMutant_{mutant.name}", {})
        assert len(ran) == len(base), f"{mutant.name}: ran {len(ran)} of the suite's {len(base)} tests"
    # only a whole run makes the table and the hints: one cut short would record its unrun mutants as unkilled
    _record(entry, _fastest_kills_first(mutants, cases))
    survivors = [m.name for m in mutants if not entry["killed_by"][m.name]]  # type: ignore[index]
    assert survivors == [], f"the {suite} suite passes these broken variants: {survivors}"


def _settings(cls: type) -> dict[str, object]:
    """What a suite class runs its tests with: every attribute, inherited ones too, but its tests."""
    return {name: inspect.getattr_static(cls, name) for name in dir(cls) if not name.startswith(("test_", "__"))}


def _generated_base(source: str) -> type:
    """The ``TestBase`` class a generated module defines."""
    namespace: dict[str, object] = {}
    exec(compile(source, "<generated>", "exec"), namespace)  # noqa: S102 - this module's own template
    base = namespace["TestBase"]
    assert isinstance(base, type)
    return base


def test_the_correct_bases_run_in_the_main_suite_with_the_same_settings() -> None:
    """The mutant runs only count the correct bases' tests: the main suite runs them. That holds only while the main
    suite's classes run with the settings of the generated ``TestBase`` classes (the same suite class and backend,
    the same fixtures and hooks); a blob store base's deadline may only be longer there."""
    from sb_dedup.suite import DedupSuite

    from statebackend.blobstores.memory import MemoryBlobStore
    from statebackend.testing.backend_contract import BackendContract
    from statebackend.testing.blobstore_contract import BlobStoreContract
    from tests.test_backend_reference import TestReferenceBackend
    from tests.test_blobstore_memory import TestMemoryBlobStore
    from tests.test_dedup_backend import TestDedupBackend

    sources = _sources()
    for suite, main, contract in (
        ("backend", TestReferenceBackend, BackendContract),
        ("dedup", TestDedupBackend, DedupSuite),
    ):
        assert BASE_IN_MAIN_SUITE[suite].endswith(f"::{main.__name__}")
        generated = _generated_base(sources[suite][0])
        assert main.__bases__ == generated.__bases__ == (contract,), suite
        assert _settings(main) == _settings(generated), f"{suite}: {main.__name__} runs with other settings"

    generated = _generated_base(sources["blobstore"][0])
    main_settings, generated_settings = _settings(TestMemoryBlobStore), _settings(generated)
    own = {"store", "raw_get", "test_timeout_s", "store_class"}
    assert {k: v for k, v in main_settings.items() if k not in own} == {
        k: v for k, v in generated_settings.items() if k not in own
    }, "blobstore: TestMemoryBlobStore runs with other settings"
    assert TestMemoryBlobStore.__bases__ == (BlobStoreContract,)
    assert TestMemoryBlobStore.test_timeout_s >= generated.test_timeout_s  # type: ignore[attr-defined]
    for cls in (TestMemoryBlobStore, generated):  # the same store, read the same way
        contract = cls()
        fixture = next(klass.__dict__["store"] for klass in cls.__mro__ if "store" in klass.__dict__)
        opened = fixture.__wrapped__(contract)
        store = next(opened)
        assert type(store) is MemoryBlobStore
        store.put("blob", b"bytes")
        assert (contract.raw_get(store, "blob"), contract.raw_get(store, "absent")) == (b"bytes", None)
        opened.close()


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
