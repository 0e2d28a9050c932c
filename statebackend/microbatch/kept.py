"""Tasks kept open between micro-batches in a reused Python worker.

Spark reuses its Python workers (``spark.python.worker.reuse``, on by default), so the process that ran task ``t`` of
batch ``b`` often runs task ``t`` of batch ``b+1`` too. After a durable commit the executor *parks* the task here,
open (LMDB environments, backup managers with their chains and background snapshots, the blob store), instead of
closing it; the next batch of that task in this process takes it back when the checkpoint log confirms it is still
current. Contract:

- A parked task is whole: its write batches are empty, nothing of it runs on the task thread, and its last commit
  is durable or (the driver confirms checkpoints: ``TaskStats.pending_checkpoint_id``) in flight, its upload going
  on while it is parked. Its background work (an upload, a snapshot, cleanups) goes on while it is parked; a
  take-back first waits for the commit the task was parked with (:meth:`KeptTask.settle`).
- Taking one back is allowed only when the listing the executor makes anyway for the batch (the fencing listing,
  docs/architecture.md "Trust") shows that the newest checkpoint is exactly the one this task committed last (same
  sequence number, same checkpoint id, no newer one), the batch's base is that checkpoint (not a replay), and each
  store directory still holds the environment the task has open (same file; a wiped directory is a new one). Else
  the parked task is closed and the batch opens the task afresh (restore), as before. The commit after a take-back
  writes ``head + 1`` exactly as a fresh open fenced at that head would: fencing is unchanged.
- A parked task holds its stores' locks. Another process of this machine that needs the task (Spark ran it in
  another worker) finds ``PARKED`` in the task directory naming a live process, writes ``HANDOVER`` there, and waits
  (up to ``HANDOVER_TIMEOUT_S``) for the lock: a watcher thread in the parking process closes the parked task (without
  syncing its stores: ``UNSYNCED`` stays, as after a process exit) and so releases it. A task that is not parked (an
  attempt running) is never handed over: the requester then works in a private directory, as before.
- At most ``MAX_PARKED`` tasks are parked per process (each holds its stores' environments and locks); parking one
  more closes the one parked longest ago.
- Everything parked dies with the process: that is a process exit without close, which the stores and backends
  already survive (``UNSYNCED`` under the same boot id is fine; staged files are swept at the next open).
- ``PARKED`` goes with its task: when it is taken back, handed over or closed, and at a normal interpreter exit
  (``atexit``; a worker ended by ``os._exit`` or a signal runs none). One left behind is harmless: it counts only
  while the pid it names is alive *and* that process started before the file was written (a pid the system reused
  for a younger process is not the writer); the same holds for ``HANDOVER``.
  ``release_all()`` closes every parked task of this process (for tests, and for code that wants to open a parked
  task's stores itself in the same process).
"""

from __future__ import annotations

import atexit
import contextlib
import logging
import os
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import attrs

from statebackend.blobstores.base import BlobStore
from statebackend.commit import PendingCommit
from statebackend.errors import StateBackendError
from statebackend.lifecycle import OpenDecision
from statebackend.metrics import HistogramData, Metrics, MetricsSnapshot
from statebackend.store.directory import DATA_DIR
from statebackend.task import TaskStorage

__all__ = ["HANDOVER_TIMEOUT_S", "KeptTask", "export_since", "park", "release_all", "request_handover", "take"]

log = logging.getLogger(__name__)

PARKED_FILE = "PARKED"
HANDOVER_FILE = "HANDOVER"
#: how long an opener waits for another process to hand a parked task over before it works in a private directory
HANDOVER_TIMEOUT_S = 10.0
#: how often the watcher looks for handover requests (one stat per parked task)
WATCH_INTERVAL_S = 0.005
#: at most this many tasks parked per process; parking one more closes the one parked longest ago
MAX_PARKED = 64
#: the watcher thread ends after this long with nothing parked
WATCH_IDLE_EXIT_S = 30.0


@attrs.define(eq=False)
class KeptTask:
    """A task parked after a durable commit, and what proves it is still current."""

    storage: TaskStorage
    blob_store: BlobStore
    #: the configuration it was opened with (a batch with another configuration never takes it)
    fingerprint: str
    #: the checkpoint it committed last: its sequence number and id
    seq: int
    checkpoint_id: str
    #: per store directory, (device, inode) of the LMDB data file the task has open
    files: dict[str, tuple[int, int]]
    task_dir: Path
    #: the task's metrics as last handed to the driver (a batch hands on only what happened since)
    exported: MetricsSnapshot | None = None

    @classmethod
    def after_commit(
        cls,
        storage: TaskStorage,
        blob_store: BlobStore,
        fingerprint: str,
        task_dir: Path,
        exported: MetricsSnapshot | None = None,
        *,
        pending: PendingCommit | None = None,
    ) -> KeptTask:
        """The task after its batch's commit: durable, or ``pending`` (its upload goes on while the task is parked;
        the driver confirms it, and the next take-back settles it first)."""
        if pending is not None:
            seq, checkpoint_id = pending.seq, str(pending.checkpoint_id)
        else:
            last = storage.last_checkpoint
            assert last is not None  # parked only after a commit
            seq, checkpoint_id = storage.committed_seq, str(last.checkpoint_id)
        return cls(
            storage=storage,
            blob_store=blob_store,
            fingerprint=fingerprint,
            seq=seq,
            checkpoint_id=checkpoint_id,
            files={str(s.path): _data_file(s.path) for s in storage.stores.values()},
            task_dir=task_dir,
            exported=exported,
        )

    def settle(self, timeout: float) -> None:
        """Wait for the commit the task was parked with, however it ends (a failure is logged, not raised): the
        take-back's :meth:`is_current` then sees whether it became durable (the log's newest, and the next seq)."""
        try:
            self.storage.wait_for_commit(timeout, raise_failure=False)
        except StateBackendError as exc:
            log.warning(
                "%s: the commit the task was parked with did not become durable: %s", self.storage.task_name, exc
            )

    def is_current(self, listed: OpenDecision, decision: OpenDecision) -> bool:
        """Whether the batch may go on with this task as it is (see the module docstring): ``listed`` is the
        attempt's decision from its listing (the newest checkpoint, the head), ``decision`` the one the batch opens
        on (its base)."""
        latest, base, head = listed.entry, decision.entry, listed.head
        if latest is None or base is None or base.seq != latest.seq or head != latest.seq or latest.seq != self.seq:
            return False
        if str(getattr(latest.checkpoint, "checkpoint_id", None)) != self.checkpoint_id:
            return False
        if self.storage.committed_seq != head:
            return False
        if not self.storage.idle:
            return False
        return all(_data_file(Path(path)) == ident for path, ident in self.files.items())

    def close(self, *, sync_local: bool = True, handover: bool = False) -> None:
        try:
            self.storage.close(sync_local=sync_local, handover=handover)
        finally:
            try:
                self.blob_store.close()
            finally:
                with _lock:  # another task of this process parked in the same directory keeps the marker
                    shared = any(other is not self and other.task_dir == self.task_dir for other in _parked.values())
                if not shared:
                    _remove_own_marker(self.task_dir)


_lock = threading.Lock()
_parked: dict[tuple[str, str, str], KeptTask] = {}
_watcher: threading.Thread | None = None
_exit_hook = False  # the atexit hook that removes this process's PARKED files is registered


def task_key(local_dir: str | Path, job_name: str, task_name: str) -> tuple[str, str, str]:
    return (str(Path(local_dir).resolve()), job_name, task_name)


def take(key: tuple[str, str, str]) -> KeptTask | None:
    """Take the task parked under ``key`` out of the registry (the caller owns it now), or ``None``."""
    with _lock:
        kept = _parked.pop(key, None)
    if kept is not None:
        with contextlib.suppress(OSError):
            (kept.task_dir / PARKED_FILE).unlink()
    return kept


def park(key: tuple[str, str, str], kept: KeptTask) -> None:
    """Park ``kept`` (the caller gives it up); a task already parked under ``key`` is closed."""
    global _watcher, _exit_hook
    with contextlib.suppress(OSError):
        (kept.task_dir / PARKED_FILE).write_text(str(os.getpid()))
    with _lock:
        if not _exit_hook:
            atexit.register(_remove_markers_at_exit)
            _exit_hook = True
        evicted = [_parked.pop(key)] if key in _parked else []
        while len(_parked) >= MAX_PARKED:  # oldest first: dicts keep insertion order
            evicted.append(_parked.pop(next(iter(_parked))))
        _parked[key] = kept
        if _watcher is None or not _watcher.is_alive():
            _watcher = threading.Thread(target=_watch, name="statebackend-kept-tasks", daemon=True)
            _watcher.start()
    for previous in evicted:
        if previous is not kept:
            with contextlib.suppress(OSError):
                if previous.task_dir != kept.task_dir:
                    (previous.task_dir / PARKED_FILE).unlink()
            _close_quietly(previous)


def release_all() -> int:
    """Close every task parked by this process; returns how many."""
    with _lock:
        kept = list(_parked.values())
        _parked.clear()
    for task in kept:
        with contextlib.suppress(OSError):
            (task.task_dir / PARKED_FILE).unlink()
        _close_quietly(task)
    return len(kept)


def parked_elsewhere(task_dir: Path) -> bool:
    """Whether another live process of this machine has the task parked (so a handover can be asked for)."""
    pid = _writer(task_dir / PARKED_FILE)
    return pid is not None and pid != os.getpid()


@contextlib.contextmanager
def request_handover(task_dir: Path) -> Iterator[None]:
    """Ask the process that has the task parked to close it; the request is withdrawn when the block ends."""
    request = task_dir / HANDOVER_FILE
    with contextlib.suppress(OSError):
        request.write_text(str(os.getpid()))
    try:
        yield
    finally:
        with contextlib.suppress(OSError):
            request.unlink()


def _watch() -> None:
    """Close a parked task another process asked for (``HANDOVER`` from a live process), until nothing has been parked
    for ``WATCH_IDLE_EXIT_S`` (a task is taken out and parked again every batch: starting a thread each time cost
    milliseconds per task and batch)."""
    idle_since: float | None = None
    while True:
        time.sleep(WATCH_INTERVAL_S)
        with _lock:
            if not _parked:
                now = time.monotonic()
                if idle_since is None:
                    idle_since = now
                if now - idle_since >= WATCH_IDLE_EXIT_S:
                    global _watcher
                    _watcher = None
                    return
                continue
            idle_since = None
            wanted = [key for key, kept in _parked.items() if _handover_asked(kept.task_dir)]
            released = [_parked.pop(key) for key in wanted]
        for kept in released:
            with contextlib.suppress(OSError):
                (kept.task_dir / PARKED_FILE).unlink()
            log.info("%s: handing the parked task over to another process", kept.storage.task_name)
            # the next opener is waiting: no sync (UNSYNCED stays), and a background snapshot stops (the new owner
            # snapshots when due) instead of being waited for
            _close_quietly(kept, sync_local=False, handover=True)


def _handover_asked(task_dir: Path) -> bool:
    pid = _writer(task_dir / HANDOVER_FILE)
    return pid is not None and pid != os.getpid()


def _writer(marker: Path) -> int | None:
    """The pid a ``PARKED`` or ``HANDOVER`` file names, when that process is alive and is the one that wrote it;
    ``None`` for a missing, unreadable or stale file (its process is gone, or the pid now belongs to a process
    started after the file was written)."""
    try:
        pid = int(marker.read_text().strip() or "0")
        written = marker.stat().st_mtime
    except (OSError, ValueError):
        return None
    if not _alive(pid):
        return None
    started = _started_at(pid)
    if started is not None and started > written + _START_SLACK_S:
        log.debug("%s names pid %d, which started after the file was written: stale, ignored", marker, pid)
        return None
    return pid


#: seconds of doubt in a process's start time (the boot time is whole seconds; a small clock step): a pid is taken
#: for the writer unless its process started this much after the file was written
_START_SLACK_S = 2.0


def _started_at(pid: int) -> float | None:
    """When process ``pid`` started (unix seconds), from /proc; ``None`` where that cannot be read (another OS)."""
    try:
        after_name = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
        ticks = int(after_name[19])  # field 22, starttime: clock ticks after boot (fields 3.. follow the name)
        boot = next(
            int(line.split()[1]) for line in Path("/proc/stat").read_text().splitlines() if line.startswith("btime ")
        )
        return boot + ticks / os.sysconf("SC_CLK_TCK")
    except (OSError, ValueError, IndexError, StopIteration):
        return None


def _remove_own_marker(task_dir: Path) -> None:
    """Remove ``PARKED`` from ``task_dir`` if it names this process (another process may have parked it since)."""
    marker = task_dir / PARKED_FILE
    with contextlib.suppress(OSError, ValueError):
        if int(marker.read_text().strip() or "0") == os.getpid():
            marker.unlink()


def _remove_markers_at_exit() -> None:
    """At interpreter exit: the ``PARKED`` files of the tasks this process still has parked (they die with it)."""
    with _lock:
        dirs = {kept.task_dir for kept in _parked.values()}
    for task_dir in dirs:
        _remove_own_marker(task_dir)


def _alive(pid: int) -> bool:
    if pid <= 0:
        return False
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def export_since(
    metrics: Metrics, previous: MetricsSnapshot | None, current: MetricsSnapshot | None = None
) -> MetricsSnapshot:
    """What ``metrics`` gained since the snapshot ``previous`` (all of it when ``None``): counters and histogram counts
    and sums subtracted; a histogram's min and max are those of its whole life (the interval's cannot be known).
    The driver adds up the tasks' snapshots of each batch, so a task kept open must not hand on the same counts
    twice."""
    now = current if current is not None else metrics.export()
    if previous is None:
        return now
    out = MetricsSnapshot()
    for key, value in now.counters.items():
        gained = value - previous.counters.get(key, 0)
        if gained:
            out.counters[key] = gained
    for key, histogram in now.histograms.items():
        before = previous.histograms.get(key)
        if before is None or before.bounds != histogram.bounds:
            out.histograms[key] = histogram.copy()
            continue
        if histogram.count == before.count:
            continue
        out.histograms[key] = HistogramData(
            histogram.bounds,
            [a - b for a, b in zip(histogram.counts, before.counts, strict=True)],
            histogram.count - before.count,
            histogram.sum - before.sum,
            histogram.min,
            histogram.max,
        )
    return out


def _data_file(store_dir: Path) -> tuple[int, int]:
    try:
        st = (store_dir / DATA_DIR / "data.mdb").stat()
    except OSError:
        return (-1, -1)
    return (st.st_dev, st.st_ino)


def _close_quietly(kept: KeptTask, *, sync_local: bool = True, handover: bool = False) -> None:
    try:
        kept.close(sync_local=sync_local, handover=handover)
    except Exception as exc:  # noqa: BLE001 - a parked task's close only releases; its commits are durable
        log.warning("%s: closing a parked task failed: %s", kept.storage.task_name, exc)
