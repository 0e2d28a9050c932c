"""Helpers shared by the tests: a config for a backend with its own extra keys, a sweep that lets every unreferenced
blob go (blob-snapshot judges age by a clock given to it), a blob store with hooks around reads, writes and listings,
and a task config whose restores read every delta."""

from __future__ import annotations

import hashlib
import shutil
import threading
import time
import uuid
from collections.abc import Callable, Iterator, Mapping
from pathlib import Path
from typing import Any, ClassVar

import pytest
from statebackend.backends.blobsnapshot.backup import BlobSnapshotBackupManager
from statebackend.backends.blobsnapshot.blobs import read_marker
from statebackend.backends.blobsnapshot.format import RunIndex, run_name
from statebackend.backends.changelog.backup import ChangelogBackupManager
from statebackend.checkpoint import LogEntry
from statebackend.checkpoint.checkpoint import CheckpointV2

from statebackend.blobstores.base import BlobInfo, BlobStore, open_blob_store
from statebackend.cli import main
from statebackend.contracts import StateBackendFactory, TaskBackupManager
from statebackend.task import TaskStorage
from statebackend.testing.backend_contract import BackendContract, contents, write_round
from statebackend.testing.controlled import ControlledBlobStore

FAR_FUTURE = 10 * 365 * 86400.0

#: where task-0 of job "job" keeps its checkpoint log
CHECKPOINTS = "job/task-0/checkpoints/"


def make_config(backend: str, tmp_path: Path, extra: Mapping[str, object]) -> dict[str, object]:
    """One task, store ``counts`` on ``backend`` alone, two retained checkpoints, plus ``extra``."""
    config: dict[str, object] = {
        "job.name": "job",
        "state.local.dir": str(tmp_path / "local"),
        "blob.store.url": f"memory://{uuid.uuid4().hex}",
        "stores.counts.backup.factories": backend,
        "stores.counts.restore.factory": backend,
        "task.checkpoint.retained": 2,
    }
    config.update(extra)
    return config


def sweep(manager: TaskBackupManager) -> None:
    if isinstance(manager, BlobSnapshotBackupManager):
        manager.sweep(now=manager.shared.clock() + FAR_FUTURE)
    else:
        assert isinstance(manager, ChangelogBackupManager)
        manager.sweep()


class PassThroughBlobStore(BlobStore):
    """Wraps ``inner`` and passes its core operations through: the base of the tests' wrappers, which override
    the operations they watch or change."""

    def __init__(self, inner: BlobStore) -> None:
        self.inner = inner
        self.url = inner.url
        self.supports_metadata = inner.supports_metadata

    def put(
        self, name: str, data: bytes, *, create_only: bool = False, metadata: Mapping[str, str] | None = None
    ) -> None:
        self.inner.put(name, data, create_only=create_only, metadata=metadata)

    def get(self, name: str, *, start: int | None = None, end: int | None = None) -> bytes:
        return self.inner.get(name, start=start, end=end)

    def delete(self, name: str) -> None:
        self.inner.delete(name)

    def list(self, prefix: str = "") -> Iterator[str]:
        return self.inner.list(prefix)

    def head(self, name: str) -> BlobInfo:
        return self.inner.head(name)


class HookedBlobStore(PassThroughBlobStore):
    """Wraps a store. ``on_get(name)`` / ``on_put(name, landed)`` run around reads and writes and may block or
    raise; ``short_lists`` makes that many listings of the checkpoint log answer empty (a reply cut in its head)."""

    def __init__(self, inner: BlobStore) -> None:
        super().__init__(inner)
        self.on_get: Callable[[str], None] = lambda name: None
        self.on_put: Callable[[str, bool], None] = lambda name, landed: None
        self.short_lists = 0
        self._lock = threading.Lock()

    def put(
        self, name: str, data: bytes, *, create_only: bool = False, metadata: Mapping[str, str] | None = None
    ) -> None:
        self.on_put(name, False)
        self.inner.put(name, data, create_only=create_only, metadata=metadata)
        self.on_put(name, True)

    def get(self, name: str, *, start: int | None = None, end: int | None = None) -> bytes:
        self.on_get(name)
        return self.inner.get(name, start=start, end=end)

    def list(self, prefix: str = "") -> Iterator[str]:
        with self._lock:
            short = self.short_lists > 0 and "/checkpoints/" in prefix
            if short:
                self.short_lists -= 1
        return iter(()) if short else self.inner.list(prefix)

    def set_metadata(self, name: str, metadata: Mapping[str, str]) -> None:
        self.inner.set_metadata(name, metadata)


def task_config(local: Path, factories: str = "changelog", url: str | None = None, /, **extra: Any) -> dict[str, Any]:
    """Task ``task-0`` of job ``job`` with store ``counts`` on ``factories``; deltas only, so a restore reads every
    delta (the tests that damage or hide one see it used)."""
    config: dict[str, Any] = {
        "job.name": "job",
        "state.local.dir": str(local),
        "blob.store.url": url or f"memory://{uuid.uuid4().hex}",
        "stores.counts.backup.factories": factories,
        "changelog.snapshot.interval.commits": 1000,
        "changelog.snapshot.interval.ratio": 0,  # deltas only: a restore reads every delta
    }
    config.update(extra)
    return config


def backend_context(factory: str, blobs: BlobStore, job: str = "job", task: str = "task-0", **fields: Any) -> Any:
    """The ``BackendContext`` a backend of ``factory`` gets for ``task`` of ``job`` on ``blobs``, with its checkpoint
    log: no stores, no executor and fresh metrics unless ``fields`` give them."""
    from statebackend.checkpoint import CheckpointLog

    from statebackend.contracts import BackendContext
    from statebackend.metrics import Metrics

    given: dict[str, Any] = {"stores": {}, "executor": None, "metrics": Metrics(), **fields}
    log = CheckpointLog(blobs, job, task)
    return BackendContext(
        factory_name=factory, job_name=job, task_name=task, blob_store=blobs, checkpoint_log=log, **given
    )


def commit_round(task: TaskStorage, round_no: int, model: dict[bytes, bytes]) -> Any:
    """Write round ``round_no`` (``write_round``, into ``model`` too) and commit it durably at input ``round_no``; the
    checkpoint."""
    write_round(task, round_no, model)
    return task.commit_durably({"input": str(round_no)})


def restored_after_wipe(config: Mapping[str, Any], blobs: BlobStore) -> dict[bytes, bytes]:
    """Delete the config's local dir, reopen task-0 on ``blobs`` alone and return its store ``counts``: the state
    the newest checkpoint restores, with nothing of the local dir."""
    shutil.rmtree(str(config["state.local.dir"]))
    with TaskStorage.open(dict(config), "task-0", blob_store=blobs) as task:
        return contents(task)


def expect_failed_commit(task: TaskStorage, offset: str = "1") -> None:
    """An asynchronous commit at input ``offset`` is accepted and fails: its result raises a CommitError."""
    from statebackend.errors import CommitError

    failed = task.commit({"input": offset})
    assert failed is not None
    with pytest.raises(CommitError):
        failed.result(timeout=30)


def commit_then_fail_next(
    task: TaskStorage,
    blobs: ControlledBlobStore,
    model: dict[bytes, bytes],
    failing: str,
    *,
    keys: int,
    failed_keys: int,
    failed_model: dict[bytes, bytes] | None = None,
) -> None:
    """Commits ``keys`` keys (``fill`` tag "a") durably at input "0", then writes ``failed_keys`` keys from 0 again
    (tag "next", into ``failed_model``, ``model`` unless given) and commits at input "1" while the next write of a
    blob whose name contains ``failing`` fails: that commit fails (``expect_failed_commit``)."""
    fill(task, model, 0, keys, "a")
    task.commit_durably({"input": "0"})
    blobs.fail, blobs.failures_left = naming(failing), 1
    fill(task, model if failed_model is None else failed_model, 0, failed_keys, "next")
    expect_failed_commit(task, "1")


def checkpoint_name(seq: int, version: int = 2) -> str:
    """The blob name of checkpoint ``seq`` of task-0 in format ``version``."""
    return f"{CHECKPOINTS}{seq:012d}.v{version}.json"


def commit_rounds(
    config: Mapping[str, Any], blobs: BlobStore, model: dict[bytes, bytes], rounds: int = 3
) -> CheckpointV2 | None:
    """Opens task-0, writes and durably commits ``rounds`` rounds (input offsets "0", "1", ...) mirrored in
    ``model``, closes it and returns the last checkpoint."""
    latest: CheckpointV2 | None = None
    with TaskStorage.open(dict(config), "task-0", blob_store=blobs) as task:
        for n in range(rounds):
            write_round(task, n, model)
            latest = task.commit_durably({"input": str(n)})
    return latest


# -- the blob-snapshot backend --------------------------------------------------------------------------------------

#: where store ``counts`` of task-0 keeps its blob-snapshot blobs
BLOBSNAPSHOT_PREFIX = "job/task-0/counts/blobsnapshot/"
#: no compaction at all (fanout and size thresholds out of reach)
NEVER = {
    "blobsnapshot.compaction.fanout": 1000,
    "blobsnapshot.compaction.full.ratio": 100.0,
    "blobsnapshot.compaction.full.min.bytes": "1GiB",
}


def blobsnapshot_config(tmp_path: Path, local: str = "local", /, **extra: object) -> dict[str, object]:
    """Task-0's store ``counts`` on blob-snapshot alone, no sweep at init, two retained checkpoints, plus ``extra``."""
    config: dict[str, object] = {
        "job.name": "job",
        "state.local.dir": str(tmp_path / local),
        "blob.store.url": f"memory://{uuid.uuid4().hex}",
        "stores.counts.backup.factories": "blobsnapshot",
        "stores.counts.restore.factory": "blobsnapshot",
        "blobsnapshot.gc.on.init": "false",
        "task.checkpoint.retained": 2,
    }
    config.update(extra)
    return config


def store_contents(task: TaskStorage, name: str = "counts") -> dict[bytes, bytes]:
    """Every key and value of store ``name``."""
    return dict(task.store(name).items())


def at_seq(seq: int) -> Callable[[LogEntry], bool]:
    """A checkpoint choice of ``TaskStorage.open``: the log entry of ``seq``."""
    return lambda entry: entry.seq == seq


def naming(part: str) -> Callable[[str], bool]:
    """A predicate of blob names (a fault store's ``fail``, ``lose_reply``): the names containing ``part``."""
    return lambda name: part in name


def blobsnapshot_manager(task: TaskStorage) -> BlobSnapshotBackupManager:
    """The task's blob-snapshot backup manager."""
    manager = next(b.manager for b in task.commit_manager.backups if b.factory_name == "blobsnapshot")
    assert isinstance(manager, BlobSnapshotBackupManager)
    return manager


def settle(task: TaskStorage) -> None:
    """Wait for store ``counts``'s running compaction, if any (the backend's own future)."""
    compaction = blobsnapshot_manager(task).shared.stores["counts"].compaction
    if compaction is not None:
        compaction.exception(timeout=60)


def latest_index(blobs: BlobStore, task: TaskStorage) -> RunIndex:
    """The run index of store ``counts`` in the task's last checkpoint."""
    checkpoint = task.commit_manager.last_checkpoint
    assert checkpoint is not None
    marker = checkpoint.markers_for("blobsnapshot")["counts"]
    return read_marker(blobs, marker, job="job", task="task-0", store="counts")


#: merges of every two runs of a level; a full compaction only when the runs above the bottom outgrow it
MERGE_EAGER = {"blobsnapshot.compaction.fanout": 2, "blobsnapshot.compaction.full.min.bytes": 0}


def put_all(task: TaskStorage, model: dict[bytes, bytes], items: dict[bytes, bytes]) -> None:
    """Puts ``items`` into store ``counts`` and into ``model``."""
    store = task.store("counts")
    for key, value in items.items():
        store.put(key, value)
        model[key] = value


def base_keys(count: int = 200) -> dict[bytes, bytes]:
    """``count`` keys with values that do not compress (so a few small runs never outgrow the bottom run)."""
    return {f"key-{i:05d}".encode(): hashlib.sha256(b"%d" % i).hexdigest().encode() for i in range(count)}


def missing_runs(blobs: BlobStore, index: RunIndex) -> list[str]:
    """The runs ``index`` names that are not on the blob store."""
    names = [run_name(BLOBSNAPSHOT_PREFIX, run.hash) for run in index.runs]
    present = set(blobs.list(BLOBSNAPSHOT_PREFIX + "runs/"))
    return [name for name in names if name not in present]


class FakeClock:
    """A clock that stands still until a test moves ``now``."""

    def __init__(self) -> None:
        self.now = time.time()

    def __call__(self) -> float:
        return self.now


#: merges of every two runs of a level and full compactions as soon as the runs above the bottom are 30% of it
EAGER_FULL = {
    "blobsnapshot.compaction.fanout": 2,
    "blobsnapshot.compaction.full.min.bytes": 0,
    "blobsnapshot.compaction.full.ratio": 0.3,
}


def churn(task: TaskStorage, model: dict[bytes, bytes], round_no: int, *, writes: int = 50, keys: int = 300) -> None:
    """``writes`` writes into store ``counts`` and ``model`` over ``keys`` keys (distinct unless ``keys`` shares a
    factor with 53), every fifth a delete, the rest updates; different each round."""
    store = task.store("counts")
    for i in range(writes):
        key = f"key-{(i * 53 + round_no * 97) % keys:05d}".encode()
        if i % 5 == 4:
            store.delete(key)
            model.pop(key, None)
        else:
            value = f"r{round_no}-{i}".encode() * 3
            store.put(key, value)
            model[key] = value


#: the blob-snapshot grace period the run-age tests set: 1000 s on a fake clock
GRACE_MS = 1_000_000


def fill(task: TaskStorage, model: dict[bytes, bytes], start: int, count: int, tag: str, name: str = "counts") -> None:
    """Puts keys ``start`` to ``start + count`` with values tagged ``tag`` into store ``name`` and ``model``."""
    store = task.store(name)
    for i in range(start, start + count):
        key = f"k{i:07d}".encode()
        value = f"{tag}-{i}-".encode() * 3
        store.put(key, value)
        model[key] = value


def run_blobs(blobs: BlobStore, prefix: str = BLOBSNAPSHOT_PREFIX) -> set[str]:
    """The run blobs under ``prefix``."""
    return set(blobs.list(prefix + "runs/"))


def index_blobs(blobs: BlobStore, prefix: str = BLOBSNAPSHOT_PREFIX) -> list[str]:
    """The index blobs (markers of older releases) under ``prefix``."""
    return list(blobs.list(prefix + "index/"))


def read_marker_index(blobs: BlobStore, checkpoint: Any) -> RunIndex:
    """The run index of store ``counts`` that ``checkpoint``'s blob-snapshot marker names."""
    marker = checkpoint.markers_for("blobsnapshot")["counts"]
    return read_marker(blobs, marker, job="job", task="task-0", store="counts")


def live_runs(blobs: BlobStore, task: TaskStorage) -> set[str]:
    """The run blobs the checkpoints in the task's log need."""
    live: set[str] = set()
    for entry in task.checkpoint_log.entries():
        marker = entry.checkpoint.markers_for("blobsnapshot")["counts"]  # type: ignore[union-attr]
        live |= read_marker(blobs, marker, job="job", task="task-0", store="counts").blob_names(BLOBSNAPSHOT_PREFIX)
    return live


def drain_cleanup(task: TaskStorage) -> None:
    """Make the last commit's cleanup and the log's retention done now. Both are idempotent, so running them again
    while the commit manager's own queued ones run too is safe (which is itself part of the contract under test)."""
    last = task.commit_manager.last_checkpoint
    assert last is not None
    blobsnapshot_manager(task).cleanup(last.checkpoint_id, dict(last.markers_for("blobsnapshot"))).result(timeout=30)
    task.checkpoint_log.retain()


# -- the changelog backend ------------------------------------------------------------------------------------------

#: the blob prefix of store counts of task-0 (``BackendContext.blob_prefix``), under which its recipe names blobs
CHANGELOG_PREFIX = "job/task-0/counts/changelog/"


class ChangelogContract(BackendContract):
    """The backend contract suite's setup on the changelog backend (a snapshot every three commits); the test module
    that runs the suite subclasses it under a ``Test`` name."""

    backup_factories: ClassVar[str] = "changelog"
    extra_config: ClassVar[dict[str, Any]] = {"changelog.snapshot.interval.commits": 3}


def changelog_config(tmp_path: Path, **extra: object) -> dict[str, object]:
    """The contract suite's config on the changelog backend, plus ``extra``."""
    return ChangelogContract().make_config(tmp_path, **extra)


# -- the statebackend command ---------------------------------------------------------------------------------------

#: a created_at a week ago: past any grace period the command tests use
OLD = f"{time.time() - 7 * 86400:.3f}"


def write_config(path: Path, config: dict[str, Any]) -> Path:
    """Writes ``config`` as a ``key=value`` properties file at ``path``."""
    path.write_text("".join(f"{key}={value}\n" for key, value in config.items()))
    return path


def cli(capsys: pytest.CaptureFixture[str], *args: str) -> tuple[int, str, str]:
    """Runs ``statebackend <args>`` in this process: its exit code, stdout and stderr."""
    code = main(list(args))
    out, err = capsys.readouterr()
    return code, out, err


def make_job(config: dict[str, Any], tasks: tuple[str, ...] = ("task-0", "task-1"), runs: int = 5) -> dict[str, dict]:
    """Commit ``runs`` times per task; returns the expected state of store ``counts`` per task after each run."""
    states: dict[str, dict] = {}
    for task in tasks:
        history = []
        for run in range(runs):
            with TaskStorage.open(config, task) as storage:
                counts = storage.store("counts")
                for user in ("ada", "bob", f"u{run}"):
                    counts.put(user, (counts.get(user) or 0) + 1)
                storage.commit_durably({"clicks": str(run)})
                history.append(dict(counts.items()))
        states[task] = {"history": history}
    return states


def file_job_config(tmp_path: Path, job: str = "job", local: str = "local", /, **settings: Any) -> dict[str, Any]:
    """Job ``job`` with its local state in ``tmp_path/local`` and its blobs in the file store ``tmp_path/blobs``
    (created if missing), plus ``settings``."""
    config: dict[str, Any] = {"job.name": job, "state.local.dir": str(tmp_path / local)}
    config.update({"blob.store.url": (tmp_path / "blobs").as_uri(), "blob.store.create.if.missing": "true"})
    config.update(settings)
    return config


def counts_config(
    tmp_path: Path,
    msg_serde: str = "integer",
    *,
    job: str = "job",
    local: str = "local",
    key_serde: str = "string",
    factories: str = "changelog",
    **extra: Any,
) -> dict[str, Any]:
    """Job ``job`` with its local state in ``tmp_path/local`` and its blobs in the file store ``tmp_path/blobs``:
    store ``counts`` on ``factories`` with ``key_serde`` keys and ``msg_serde`` values; ``extra`` adds or overrides."""
    config = file_job_config(tmp_path, job, local)
    config.update({"stores.counts.backup.factories": factories, "stores.counts.key.serde": key_serde})
    config.update({"stores.counts.msg.serde": msg_serde, **extra})
    return config


def base_config(tmp_path: Path, url: str, **extra: Any) -> dict[str, Any]:
    """Job ``clicks`` on the blob store ``url``: store ``counts`` (string keys, integer values) on changelog, a
    snapshot every two commits."""
    options = {"blob.store.url": url, "blob.store.create.if.missing": "true", "changelog.snapshot.interval.commits": 2}
    return counts_config(tmp_path, job="clicks", local="state", **{**options, **extra})


def blobs_of(config: dict[str, Any]) -> BlobStore:
    """The blob store ``config`` names, with its ``blob.store.*`` options."""
    return open_blob_store(
        config["blob.store.url"],
        {
            k[len("blob.store.") :]: v
            for k, v in config.items()
            if k.startswith("blob.store.") and k != "blob.store.url"
        },
    )


def state_of_blob_store(config: dict[str, Any]) -> dict[str, tuple[bytes, dict[str, str]]]:
    """Every blob of the store with its data and metadata (to show a command changed nothing)."""
    with blobs_of(config) as store:
        return {name: (store.get(name), dict(store.head(name).metadata)) for name in store.list("")}


class StubFactory(StateBackendFactory):
    """A backend factory whose managers are never built: for tests of the registry and of backend options."""

    def backup_manager(self, context):  # type: ignore[no-untyped-def]
        raise NotImplementedError

    def restore_manager(self, context):  # type: ignore[no-untyped-def]
        raise NotImplementedError

    def admin(self, context):  # type: ignore[no-untyped-def]
        raise NotImplementedError
