"""The process tests/test_crash.py kills: a task that restores, then writes deterministic data over several durable
commits on a ``file://`` blob store.

Usage (from the repository root)::

    python -m tests.crash_child <workdir> <report.json> <commits>

It opens ``task-0`` under ``<workdir>`` (local state in ``local/``, blobs in ``blobs/``), which restores the newest
durable checkpoint; writes what it restored to ``<report.json>``; then runs ``<commits>`` more commits, number
``n = restored + 1, ...``, each applying :func:`operations` ``(n)`` and committing durably with input offsets
``{"input": str(n)}``; after each it appends ``n`` to ``<workdir>/durable.log`` (unbuffered, so the line survives a
SIGKILL). With ``STATEBACKEND_CRASH_AT`` set it dies at that crash point (see statebackend/crashpoints.py).

Backends: changelog only, unless ``CRASH_CHILD_BACKUP_FACTORIES`` names others (e.g. ``blobsnapshot`` or
``changelog,blobsnapshot``, see :func:`config`), with ``CRASH_CHILD_RESTORE_FACTORY`` picking the restore backend
and ``CRASH_CHILD_VALUE_REPEAT`` making values longer (bigger blobsnapshot runs). Unset, the child is
the changelog-only one tests/test_crash.py uses.

The data is a function of the commit number alone, so the state of checkpoint ``n`` is :func:`expected_state` ``(n)``
whatever happened to the process that wrote it (both from :mod:`statebackend.testing.kills`, shared with the backend
contract suite's kill test).

Crash points of this module (the blob store's side of an upload, which belongs to no other module): before every
write, a :class:`CrashingFileBlobStore` writes the first half of the blob as a temp file where the real store would
put its own, then calls ``crashpoint("blobstore.put.<kind>")`` with kind ``delta``, ``snapshot`` (a re-base, on a
commit thread), ``background_snapshot`` (on the maintenance thread), ``checkpoint``, or blobsnapshot's ``run`` and
``index``; a process killed there leaves the torn temp file behind, as a real crash mid-write would. Surviving, it
removes the temp and does the real write.
"""

from __future__ import annotations

import json
import os
import secrets
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
from collections.abc import Callable, Iterator, Mapping
from contextlib import contextmanager
from pathlib import Path

from statebackend.checkpoint import CheckpointLog, read_local_checkpoint

from statebackend.blobstores.file import RESERVED_PREFIX, FileBlobStore
from statebackend.crashpoints import crashpoint
from statebackend.task import TaskStorage
from statebackend.testing.deadline import scaled

# the deterministic data, shared with the backend suite's kill test
from statebackend.testing.kills import (  # noqa: F401 - re-exported for the crash tests
    DEFAULT_VALUE_REPEAT,
    expected_state,
    operations,
)
from tests.fork_server import REPO, ForkServer, run_to_end

TASK = "task-0"
STORE = "counts"
#: environment variables choosing the backends (tests/test_crash_blobsnapshot.py); unset: changelog only
BACKUP_FACTORIES_ENV = "CRASH_CHILD_BACKUP_FACTORIES"
RESTORE_FACTORY_ENV = "CRASH_CHILD_RESTORE_FACTORY"
VALUE_REPEAT_ENV = "CRASH_CHILD_VALUE_REPEAT"
#: a JSON object of ``blob.store.*`` keys (a real server's store, e.g. ``s3://`` with its endpoint): the child commits
#: there instead of the crashing ``file://`` store under the work dir (tests/test_random_kills.py)
BLOB_CONFIG_ENV = "CRASH_CHILD_BLOB_CONFIG"
#: set (to anything): after each commit, wait until the background snapshot it may have started is written, so the
#: next commit adopts it (a crash point on retention's deletes needs one adopted within the child's commits; on a
#: loaded machine a snapshot left to race the commits could finish after the last one)
SETTLE_ENV = "CRASH_CHILD_SETTLE_BACKGROUND"
#: the checkpoint log's retention_interval in the child (the default, 10, would batch nothing within its commits)
RETENTION_INTERVAL = 2
#: under the workdir: written once the child has imported everything and starts its work (before it opens the task),
#: so a parent that kills at random moments can count its delay from there, not from an interpreter start whose
#: length depends on the machine's load
STARTED_FILE = "child.started"


def config(workdir: Path, backup_factories: str = "changelog", restore_factory: str | None = None) -> dict[str, object]:
    settings: dict[str, object] = {
        "job.name": "job",
        "state.local.dir": str(workdir / "local"),
        "blob.store.url": f"file://{workdir / 'blobs'}",
        "stores.counts.backup.factories": "changelog",
        # ~4 KiB of writes per commit against a 2 KiB batch: every commit merges a spill run, and a crash between
        # a spill and the next flush leaves LMDB ahead of every checkpoint
        "stores.counts.write.batch.max.bytes": 2048,
        "stores.counts.lmdb.map.size": "64MiB",
        "changelog.snapshot.interval.commits": 3,
        "task.checkpoint.retained": 2,
    }
    if backup_factories != "changelog":
        settings["stores.counts.backup.factories"] = backup_factories
        if "changelog" not in backup_factories.split(","):
            del settings["changelog.snapshot.interval.commits"]  # config warns about a key of an unused backend
        # merges of every 2 runs of a level, a new base run once the runs above it are 3x its size: compactions (and
        # a crash in one) within a few commits; no grace period and a sweep every 2 commits, so garbage is
        # collected (and a crash can hit its collection) within a few commits
        settings["blobsnapshot.compaction.fanout"] = 2
        settings["blobsnapshot.compaction.full.ratio"] = 3.0
        settings["blobsnapshot.compaction.full.min.bytes"] = 0
        settings["blobsnapshot.gc.grace.period.ms"] = 0
        settings["blobsnapshot.gc.interval.commits"] = 2
        settings["blobsnapshot.gc.on.init"] = True
    if restore_factory is not None:
        settings["stores.counts.restore.factory"] = restore_factory
    return settings


def blobs_dir(workdir: Path) -> Path:
    return workdir / "blobs"


class CrashingFileBlobStore(FileBlobStore):
    """A ``file://`` store that can die in the middle of a write, leaving half the blob in a temp file."""

    def put(
        self, name: str, data: bytes, *, create_only: bool = False, metadata: Mapping[str, str] | None = None
    ) -> None:
        self._maybe_crash_midway(name, data)
        super().put(name, data, create_only=create_only, metadata=metadata)

    def put_file(
        self,
        name: str,
        path: str | os.PathLike[str],
        *,
        create_only: bool = False,
        metadata: Mapping[str, str] | None = None,
    ) -> None:
        self._maybe_crash_midway(name, Path(path).read_bytes())
        super().put_file(name, path, create_only=create_only, metadata=metadata)

    def put_if(self, name: str, data: bytes, *, version: str | None) -> str:
        """The head blob's compare-and-swap: the commit point of a store with ``supports_conditional_put``."""
        self._maybe_crash_midway(name, data)
        return super().put_if(name, data, version=version)

    def _maybe_crash_midway(self, name: str, data: bytes) -> None:
        directory = Path(self.root) / os.path.dirname(name)
        directory.mkdir(parents=True, exist_ok=True)
        temp = directory / f"{RESERVED_PREFIX}tmp.{secrets.token_hex(8)}"
        with open(temp, "wb") as out:
            out.write(data[: len(data) // 2])
            out.flush()
            os.fsync(out.fileno())
        crashpoint(f"blobstore.put.{_kind(name)}")
        temp.unlink()


def _kind(name: str) -> str:
    if name.endswith(".delta"):
        return "delta"
    if name.endswith(".snap"):
        on_maintenance = threading.current_thread().name.startswith("statebackend-maintenance")
        return "background_snapshot" if on_maintenance else "snapshot"
    if "/checkpoints/" in name:
        # on a store with conditional puts the commit point is the head blob; a per-seq blob there is the marker a
        # task's first commit writes for older releases (docs/formats-checkpoint.md)
        return "checkpoint" if os.path.basename(name).startswith("HEAD.") else "checkpoint_marker"
    if "/blobsnapshot/runs/" in name:
        return "run"
    if "/blobsnapshot/index/" in name:
        return "index"
    return "other"


def run(workdir: Path, report: Path, commits: int) -> None:
    (workdir / STARTED_FILE).write_text(str(os.getpid()))
    settings = config(
        workdir, os.environ.get(BACKUP_FACTORIES_ENV) or "changelog", os.environ.get(RESTORE_FACTORY_ENV) or None
    )
    blob_config = os.environ.get(BLOB_CONFIG_ENV)
    blob_store: FileBlobStore | None = None
    if blob_config:
        settings.update(json.loads(blob_config))  # TaskStorage opens the configured store itself
    else:
        blob_store = CrashingFileBlobStore(str(blobs_dir(workdir)))
    value_repeat = int(os.environ.get(VALUE_REPEAT_ENV) or DEFAULT_VALUE_REPEAT)
    with TaskStorage.open(settings, TASK, blob_store=blob_store) as task:
        # retention's batches (the log's and the backends' garbage with it) once 2 checkpoints are past the retained
        # ones, not 10: batches, and a crash in one, within a few commits
        task.checkpoint_log.retention_interval = RETENTION_INTERVAL
        store = task.store(STORE)
        restored = 0 if task.restored is None else int(task.restored.input_offsets["input"])
        contents = {key.hex(): value.hex() for key, value in store.items()}
        # whole or absent (written aside, then renamed): a kill may land while it is written, and the parent reads
        # an existing report as "the child got past its open"
        partial = report.with_name(report.name + ".partial")
        partial.write_text(json.dumps({"restored": restored, "contents": contents}))
        os.replace(partial, report)
        durable_log = os.open(workdir / "durable.log", os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o644)
        try:
            for n in range(restored + 1, restored + commits + 1):
                for key, value in operations(n, value_repeat):
                    if value is None:
                        store.delete(key)
                    else:
                        store.put(key, value)
                checkpoint = task.commit_durably({"input": str(n)}, timeout=scaled(60))
                assert checkpoint.input_offsets == {"input": str(n)}
                os.write(durable_log, f"{n}\n".encode())
                if os.environ.get(SETTLE_ENV):
                    from statebackend.backends.changelog.backup import maintenance_pool

                    maintenance_pool().submit(lambda: None).result(scaled(60))  # one thread: after the snapshot
        finally:
            os.close(durable_log)


def main(argv: list[str]) -> int:
    if len(argv) != 4:
        print(__doc__, file=sys.stderr)
        return 2
    run(Path(argv[1]), Path(argv[2]), int(argv[3]))
    return 0


# -- run and read by the tests, in the parent process ------------------------------------------------------------------

#: what a fork server for these children imports once beyond the child itself: the backends' modules, which each child
#: would import when it opens its task (``ForkServer(PRELOAD)``)
PRELOAD = (
    "statebackend.backends.changelog.factory",
    "statebackend.backends.blobsnapshot.factory",
    "statebackend.envbase",
)
#: the crash point variable, which a parent's own environment never passes on unasked
CRASH_AT_ENV = "STATEBACKEND_CRASH_AT"
#: commits a crashing child attempts
CRASH_COMMITS = 8
#: commits each child restoring after a crash adds
MORE_COMMITS = 2


def run_child(
    workdir: Path,
    report: Path,
    commits: int,
    env: Mapping[str, str | None] | None = None,
    *,
    timeout: float = 90,
    server: ForkServer | None = None,
) -> subprocess.CompletedProcess[str]:
    """Run a child to its end (or its death) and return it. Its environment is this process's less
    ``STATEBACKEND_CRASH_AT``, updated by ``env`` (a ``None`` value removes that variable), with the repository on
    its path; it runs in the repository. With ``server`` it is forked by that fork server (tests/fork_server.py: no
    interpreter start nor imports per child; same environment, directory and crash point) and its stderr is kept in
    ``<report>.stderr``; without, it is a fresh interpreter. The timeout (seconds on an idle machine, stretched by its
    load) only guards a hang."""
    child_env = {key: value for key, value in os.environ.items() if key != CRASH_AT_ENV}
    for key, value in (env or {}).items():
        if value is None:
            child_env.pop(key, None)
        else:
            child_env[key] = value
    child_env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(REPO), child_env.get("PYTHONPATH")]))
    argv = [str(workdir), str(report), str(commits)]
    if server is not None:
        stderr = report.with_name(report.name + ".stderr")
        forked = run_to_end(server, argv, child_env, stderr, scaled(timeout))
        assert forked.returncode is not None
        return subprocess.CompletedProcess(["tests.crash_child", *argv], forked.returncode, "", forked.stderr)
    return subprocess.run(
        [sys.executable, "-m", "tests.crash_child", *argv],
        cwd=REPO,
        env=child_env,
        capture_output=True,
        text=True,
        timeout=scaled(timeout),
        check=False,  # a hang guard
    )


@contextmanager
def crash_workdir(prefix: str) -> Iterator[Path]:
    """A temp dir, RAM-backed where possible: SIGKILL takes the process, not the page cache, so the fsyncs of LMDB
    and the file:// store change nothing the crash tests can observe; on a shared disk they only cost seconds."""
    fast = "/dev/shm" if os.path.isdir("/dev/shm") and os.access("/dev/shm", os.W_OK) else None
    path = Path(tempfile.mkdtemp(prefix=prefix, dir=fast))
    try:
        yield path
    finally:
        shutil.rmtree(path, ignore_errors=True)


def checkpoint_log(workdir: Path) -> CheckpointLog:
    """The checkpoint log of the children's task under ``workdir``, read by this process."""
    return CheckpointLog(FileBlobStore(str(blobs_dir(workdir)), create=False), "job", TASK)


def durable_commit(workdir: Path) -> int:
    """The commit number of the newest checkpoint in the checkpoint log (0: none), read by this process. No blob
    store root yet is no checkpoint: a child killed while it still imports never got to create it."""
    if not blobs_dir(workdir).is_dir():
        return 0
    entry = checkpoint_log(workdir).latest()
    return 0 if entry is None else int(entry.checkpoint.input_offsets["input"])


def reported_durable(workdir: Path) -> int:
    """The last commit the child reported durable in ``durable.log`` (0: none)."""
    log = workdir / "durable.log"
    lines = log.read_text().split() if log.exists() else []
    return int(lines[-1]) if lines else 0


def read_report(path: Path) -> dict[str, object]:
    """The JSON report a child wrote at ``path``."""
    report: dict[str, object] = json.loads(path.read_text())
    return report


def report_contents(report: dict[str, object]) -> dict[bytes, bytes]:
    """The store contents a report carries (hex keys and values), as bytes."""
    contents = report["contents"]
    assert isinstance(contents, dict)
    return {bytes.fromhex(key): bytes.fromhex(value) for key, value in contents.items()}


def run_to_crash(
    work: Path,
    crash_at: str,
    env: Mapping[str, str | None] | None = None,
    *,
    commits: int = CRASH_COMMITS,
    server: ForkServer | None = None,
) -> tuple[int, int]:
    """Run a child in ``work/run`` that is to die at ``crash_at`` within ``commits`` commits (forked by ``server``
    if given, see :func:`run_child`). Checks it died by SIGKILL having restored nothing, and that its local
    ``CHECKPOINT-V2`` claims no checkpoint newer than the durable one. Returns the durable commit (the newest in the
    checkpoint log) and the last one the child reported durable."""
    workdir = work / "run"
    workdir.mkdir()
    crashed = run_child(
        workdir, work / "crashing.json", commits, {**(env or {}), CRASH_AT_ENV: crash_at}, server=server
    )
    assert crashed.returncode == -signal.SIGKILL, (
        f"the child was to die at {crash_at} but exited with {crashed.returncode}:\n{crashed.stderr[-3000:]}"
    )
    assert read_report(work / "crashing.json")["restored"] == 0
    durable = durable_commit(workdir)
    local = read_local_checkpoint(workdir / "local" / "job" / TASK / STORE)
    if local is not None:
        assert int(local.input_offsets["input"]) <= durable, "CHECKPOINT-V2 claims a checkpoint that is not durable"
    return durable, reported_durable(workdir)


def restore_kept_and_wiped(
    work: Path,
    durable: int,
    env: Mapping[str, str | None] | None = None,
    *,
    more: int = MORE_COMMITS,
    value_repeat: int = DEFAULT_VALUE_REPEAT,
    check: Callable[[Path], None] | None = None,
    server: ForkServer | None = None,
) -> None:
    """After a crash in ``work/run`` left commit ``durable`` durable: fresh children with its local dir kept and wiped
    (on a copy) restore exactly that state and commit ``more`` times; then one with the local dir wiped restores the
    continued state from the blob store alone, so what the crash left behind did not break the chain. ``check`` runs
    on each directory after its child: a backend's own invariants. ``server``: the fork server the children are forked
    by (see :func:`run_child`)."""
    workdir = work / "run"
    wiped = work / "wiped"
    shutil.copytree(workdir, wiped)
    shutil.rmtree(wiped / "local")
    for label, directory in (("kept", workdir), ("wiped", wiped)):
        resumed = run_child(directory, work / f"{label}.json", more, env, server=server)
        assert resumed.returncode == 0, f"restore with the local dir {label} failed:\n{resumed.stderr[-3000:]}"
        report = read_report(work / f"{label}.json")
        assert report["restored"] == durable, f"local dir {label}"
        assert report_contents(report) == expected_state(durable, value_repeat), (
            f"local dir {label}: restored state differs"
        )
        assert durable_commit(directory) == durable + more
        if check is not None:
            check(directory)
    shutil.rmtree(workdir / "local")
    final = run_child(workdir, work / "final.json", 0, env, server=server)
    assert final.returncode == 0, final.stderr[-3000:]
    assert read_report(work / "final.json")["restored"] == durable + more
    assert report_contents(read_report(work / "final.json")) == expected_state(durable + more, value_repeat)


if __name__ == "__main__":
    sys.exit(main(sys.argv))
