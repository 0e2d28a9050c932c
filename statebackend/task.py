"""TaskStorage: a task's stores, restored to a durable checkpoint and committed through its state backends.

This is the object a job holds per task::

    with TaskStorage.open(config, "task-0") as task:
        counts = task.store("counts")
        counts.put(b"k", b"1")
        task.commit({"input": "42"}).result()      # durable when result() returns

Opening restores: it reads the newest checkpoint from the checkpoint log (or the one asked for), and restores each
store through the first backend of ``stores.<name>.restore.factories`` whose marker the checkpoint has, reusing
local data that already is that state. When that restore fails on a missing or damaged blob, the next backend with a
marker in the same checkpoint is tried (logged at ERROR); the open fails only when every one failed, naming each
cause. A store the checkpoint knows nothing of starts empty.

Trust (docs/architecture.md, "Fencing" and "Short answers"):

- **Fencing.** The listing that chose the checkpoint to restore also gives the head (the newest seq in the log); this
  task may only ever write ``head + 1``. Another attempt that committed meanwhile owns that seq, so this attempt's
  commit fails with :class:`CommitConflictError` and writes nothing.
- **Local knowledge bounds the remote.** Each store dir's ``CHECKPOINT-V2`` names the newest checkpoint seq this
  machine saw durable; a listing that shows less is re-listed and then :class:`InconsistentStateError`, never an
  empty start, and local data is never cleared on the strength of it.
"""

from __future__ import annotations

import logging
import sys
import time
from collections.abc import Callable, Iterator, Mapping
from concurrent.futures import Executor, Future
from contextlib import contextmanager
from pathlib import Path
from typing import Any, Self

import attrs

from statebackend.blobstores.admin import create_blob_store_resources
from statebackend.blobstores.base import BlobStore, open_blob_store
from statebackend.checkpoint import (
    CheckpointIdGenerator,
    CheckpointLog,
    CheckpointV1,
    CheckpointV2,
    LogEntry,
    read_local_checkpoint_binding,
)
from statebackend.commit import BackupBinding, PendingCommit, TaskCommitManager, shared_commit_pool
from statebackend.config import Settings, StoreSettings
from statebackend.contracts import BackendContext
from statebackend.errors import (
    ConfigError,
    CorruptDataError,
    IncompatibleFormatError,
    InconsistentStateError,
    NotFoundError,
    StateBackendError,
    StorageError,
)
from statebackend.metrics import Metrics
from statebackend.metrics import prometheus as prom
from statebackend.metrics.otel import otel_sink
from statebackend.redact import redact
from statebackend.registry import resolve_factory
from statebackend.serdes import get_serde
from statebackend.store import BytesStore, LocalStore, TypedStore
from statebackend.store.ttl import ENVELOPE, TtlStore, wall_clock_ms

__all__ = [
    "RestoredStores",
    "TaskStorage",
    "export_on_close",
    "known_durable_seq",
    "restored_stores",
    "start_exporters",
    "task_metrics",
]

log = logging.getLogger(__name__)

#: which checkpoint to restore: the newest, a log entry, or a predicate over log entries (newest match wins)
CheckpointChoice = str | LogEntry | Callable[[LogEntry], bool] | None


@attrs.define(eq=False)
class TaskStorage:
    """A task's stores plus the machinery that restores and commits them. Use :meth:`open`."""

    settings: Settings
    task_name: str
    blob_store: BlobStore
    stores: dict[str, LocalStore]
    commit_manager: TaskCommitManager
    checkpoint_log: CheckpointLog
    metrics: Metrics
    #: the checkpoint the stores were restored to (``None``: no durable checkpoint existed)
    restored: CheckpointV2 | None
    _owns_blob_store: bool = False
    _closed: bool = attrs.field(init=False, default=False)
    _last_commit: float = attrs.field(init=False, factory=time.monotonic)
    #: the time (ms since the epoch) TTL stores read and write at; None: the wall clock at each call. The Spark
    #: executor fixes it per batch, so a replayed batch sees the keys its first run saw
    ttl_now_ms: int | None = attrs.field(init=False, default=None)
    _ttl_views: dict[str, TtlStore] = attrs.field(init=False, factory=dict)

    @classmethod
    def open(
        cls,
        config: Settings | Mapping[str, Any],
        task_name: str,
        *,
        blob_store: BlobStore | None = None,
        executor: Executor | None = None,
        checkpoint: CheckpointChoice = "latest",
        metrics: Metrics | None = None,
        fence_seq: int | None = None,
    ) -> TaskStorage:
        """Open (and restore) the stores of ``task_name``. ``checkpoint``: ``"latest"`` (default), a
        :class:`LogEntry`, or a predicate choosing the newest matching entry (e.g. by input offsets).

        ``fence_seq`` (only with a :class:`LogEntry` or ``None``): the newest seq the caller saw when it chose; this
        task then writes ``fence_seq + 1`` (a deliberate replay that supersedes newer checkpoints). Without it, a
        given entry's own seq fences."""
        settings = config if isinstance(config, Settings) else Settings.from_config(config)
        _check_name("task name", task_name)
        shorten_thread_switch_interval(settings.thread_switch_interval_us)
        metrics = metrics or task_metrics(settings, task_name)
        owns = blob_store is None
        blob_store = blob_store or open_blob_store(settings.blob_store_url, settings.blob_store_options)
        if owns:
            blob_store.use_metrics(metrics)  # a store the caller gave counts where the caller said
        if owns and settings.blob_store_options.get("create.if.missing"):
            create_blob_store_resources(blob_store)  # before the first read: listing a missing bucket fails
        executor = executor or shared_commit_pool(settings.commit_pool_size)
        stores: dict[str, LocalStore] = {}
        backups: list[BackupBinding] = []
        try:
            for name, store_settings in settings.stores.items():
                stores[name] = LocalStore.open(
                    Path(settings.local_dir) / settings.job_name / task_name / name,
                    name=name,
                    max_batch_bytes=store_settings.write_batch_max_bytes,
                    map_size=store_settings.map_size,
                )
            checkpoint_log = CheckpointLog(
                blob_store,
                settings.job_name,
                task_name,
                write_versions=settings.checkpoint_write_versions,
                read_versions=settings.checkpoint_read_versions,
                retained=settings.checkpoint_retained,
            )
            known = known_durable_seq(settings.local_dir, settings.job_name, task_name, list(stores))
            checkpoint_log.raise_floor(known)
            entry, head = _choose_checkpoint(checkpoint_log, checkpoint, known, fence_seq)
            if entry is not None and isinstance(entry.checkpoint, CheckpointV1) and known >= entry.seq:
                raise InconsistentStateError(
                    f"task {task_name}: checkpoint #{entry.seq} reads as a V1 checkpoint (offsets only, no state), but "
                    f"this machine saw checkpoint #{known} durable as a V2 checkpoint with state: its V2 blob is "
                    f"missing or unreadable. Nothing was restored or cleared; put the V2 blob back"
                )
            restored = _as_v2(entry)
            _check_serdes(settings, restored)
            checkpoint_log.raise_floor(max(known, entry.seq if entry is not None else 0))

            restored_by: dict[str, str | None] = {}
            restore_failures: dict[str, list[str]] = {}

            def context(factory_name: str, store_names: list[str]) -> BackendContext:
                return BackendContext(
                    factory_name=factory_name,
                    job_name=settings.job_name,
                    task_name=task_name,
                    stores={name: stores[name] for name in store_names},
                    blob_store=blob_store,
                    executor=executor,
                    metrics=metrics,
                    options=settings.backend_options_for(factory_name),
                    checkpoint_log=checkpoint_log,
                    restored_by={name: restored_by.get(name) for name in store_names},
                    restore_failures={name: tuple(restore_failures.get(name, ())) for name in store_names},
                )

            restored_by.update(
                _logged_restore(settings, task_name, stores, entry, restored, context, metrics, restore_failures)
            )

            for factory_name, store_names in _backup_groups(settings).items():
                manager = resolve_factory(factory_name).factory.backup_manager(context(factory_name, store_names))
                backups.append(BackupBinding(factory_name, manager, tuple(store_names)))
                manager.init(restored)

            id_generator = CheckpointIdGenerator()
            if restored is not None:
                id_generator.observe(restored.checkpoint_id)
            commit_manager = TaskCommitManager(
                task_name=task_name,
                stores=stores,
                backups=backups,
                checkpoint_log=checkpoint_log,
                executor=executor,
                metrics=metrics,
                max_delay_ms=settings.commit_max_delay_ms,
                timeout_ms=settings.commit_timeout_ms,
                async_failures_tolerated=settings.commit_async_failures_tolerated,
                next_seq=head + 1,  # the fence: from the restore decision, never from a later listing
                id_generator=id_generator,
                last_checkpoint=restored,
                serdes={name: recorded_serdes(s) for name, s in settings.stores.items()},
            )
        except BaseException:
            for binding in backups:  # background work started by init() must not outlive the stores
                binding.manager.close()
            for store in stores.values():
                store.close()
            if owns:
                blob_store.close()
            raise
        start_exporters(settings, metrics, task_name)
        return cls(
            settings=settings,
            task_name=task_name,
            blob_store=blob_store,
            stores=stores,
            commit_manager=commit_manager,
            checkpoint_log=checkpoint_log,
            metrics=metrics,
            restored=restored,
            owns_blob_store=owns,
        )

    def store(self, name: str, *, typed: bool = True) -> BytesStore | TypedStore:
        """The store ``name`` for the task's code: a typed view per its serdes, or a bytes view with ``typed=False``
        (also when both serdes are ``bytes``). Either has the user operations only; backends get the
        :class:`LocalStore` itself (``stores``) through their context."""
        try:
            store = self.stores[name]
        except KeyError:
            raise ConfigError(
                f"no store {name!r} in this task; configured stores: {', '.join(sorted(self.stores)) or 'none'}"
            ) from None
        store_settings = self.settings.stores[name]
        ops: LocalStore | TtlStore = store if store_settings.ttl_ms is None else self._ttl_view(name)
        if not typed or (store_settings.key_serde == "bytes" and store_settings.msg_serde == "bytes"):
            return BytesStore(ops)
        return TypedStore(ops, get_serde(store_settings.key_serde), get_serde(store_settings.msg_serde))

    def now_ms(self) -> int:
        """The time TTL stores read and write at: :attr:`ttl_now_ms`, or the wall clock."""
        return wall_clock_ms() if self.ttl_now_ms is None else self.ttl_now_ms

    def _ttl_view(self, name: str) -> TtlStore:
        view = self._ttl_views.get(name)
        if view is None:
            ttl_ms = self.settings.stores[name].ttl_ms
            assert ttl_ms is not None
            view = self._ttl_views[name] = TtlStore(self.stores[name], ttl_ms, self.now_ms)
        return view

    def _sweep_expired(self) -> None:
        """Before a commit: each TTL store's sweep deletes the expired keys among the next ``ttl.sweep.keys``."""
        for name, store_settings in self.settings.stores.items():
            if store_settings.ttl_ms is not None and store_settings.ttl_sweep_keys > 0:
                deleted = self._ttl_view(name).sweep(store_settings.ttl_sweep_keys)
                if deleted:
                    self.metrics.increment("ttl.keys.expired", deleted)

    def commit(self, input_offsets: Mapping[str, str]) -> PendingCommit | None:
        """Commit every store with ``input_offsets`` (see :class:`TaskCommitManager`)."""
        self._sweep_expired()
        return self.commit_manager.commit(input_offsets)

    def commit_if_due(self, input_offsets: Mapping[str, str]) -> PendingCommit | None:
        """Commit when ``task.commit.ms`` has passed since the last commit (for record-at-a-time loops)."""
        now = time.monotonic()
        if (now - self._last_commit) * 1000.0 < self.settings.commit_ms:
            return None
        pending = self.commit(input_offsets)
        if pending is not None:
            self._last_commit = now
        return pending

    def commit_durably(self, input_offsets: Mapping[str, str], timeout: float | None = None) -> CheckpointV2:
        """Commit and wait until the checkpoint is durable, blocking on a previous upload if one runs. A failure of
        an earlier commit is not raised here (it is logged once if nobody saw it): this commit includes its changes."""
        return self.commit_now(input_offsets, timeout).result(timeout)

    def commit_now(self, input_offsets: Mapping[str, str], timeout: float | None = None) -> PendingCommit:
        """Commit, never skipped: wait for a previous upload if one runs (its failure is not raised, as in
        :meth:`commit_durably`), then run the sync part and return the pending commit, whose upload goes on beside
        whatever the caller does next."""
        self.commit_manager.wait(timeout, raise_failure=False)
        self._sweep_expired()
        pending = self.commit_manager.commit(input_offsets)
        if pending is None:  # cannot happen after wait(); kept so a skip is never silently taken for durable
            raise StateBackendError(f"task {self.task_name}: commit was skipped")
        return pending

    def close(self, *, sync_local: bool = True, handover: bool = False) -> None:
        """Wait for the commit in flight and its cleanups, close the backends and the stores. ``sync_local=False``
        leaves the local stores unsynced (``LocalStore.close(sync=False)``): for a task handed straight to another
        process of this machine. ``handover``: another opener waits for this close, so the backends first cancel
        their background work (``TaskBackupManager.cancel_background``) instead of having close wait for it."""
        if self._closed:
            return
        self._closed = True
        try:
            if handover:
                for binding in self.commit_manager.backups:
                    try:
                        binding.manager.cancel_background()
                    except Exception as exc:  # noqa: BLE001 - close then waits for the work, as without handover
                        log.warning("task %s: %s could not cancel its background work: %s", self.task_name,
                                    binding.factory_name, exc)
            self.commit_manager.close()
            for binding in self.commit_manager.backups:
                binding.manager.close()
        finally:
            for store in self.stores.values():
                store.close(sync=sync_local)
            if self._owns_blob_store:
                self.blob_store.close()
            export_on_close(self.settings, self.task_name, self.metrics)

    def __enter__(self) -> Self:
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.close()


def shorten_thread_switch_interval(microseconds: int) -> None:
    """Lower the process's GIL switch interval to ``microseconds`` (0, or an interval already shorter: unchanged).

    A task's background threads (commit uploads and checkpoint writes, the appliers, a parked task's handover) make
    many short system calls beside CPU-bound processing on the task thread. Python's default interval (5 ms) is how
    long a thread coming back from a system call may wait for the GIL while another thread runs Python: with CPU-bound
    processing beside it, a durable commit's few dozen calls each waited up to that (``python -m bench.contention``:
    durable p50 216 ms at 5 ms, 31 ms at 200 us, 7 ms with no thread beside it; a handover's close 16.1 ms
    against 1.3 ms). The setting is process-wide and only ever lowered."""
    if microseconds <= 0:
        return
    wanted = microseconds / 1_000_000
    if sys.getswitchinterval() > wanted:
        sys.setswitchinterval(wanted)


@attrs.frozen
class RestoredStores:
    """What :func:`restored_stores` gives: the chosen log entry, the checkpoint restored, the open local stores and
    which backend restored each (``None``: it started empty)."""

    entry: LogEntry | None
    checkpoint: CheckpointV2 | None
    stores: Mapping[str, LocalStore]
    restored_by: Mapping[str, str | None]
    metrics: Metrics


@contextmanager
def restored_stores(
    config: Settings | Mapping[str, Any],
    task_name: str,
    *,
    store_names: list[str] | None = None,
    blob_store: BlobStore | None = None,
    checkpoint: CheckpointChoice = "latest",
    metrics: Metrics | None = None,
) -> Iterator[RestoredStores]:
    """Restore stores of ``task_name`` (all configured ones, or ``store_names``) under ``state.local.dir`` to a
    checkpoint, exactly as :meth:`TaskStorage.open` does, and nothing more: no backup manager is created, so nothing
    is swept, cleaned up or written to the blob store. For reading a checkpoint's state (``statebackend dump``) and
    pre-warming a machine (``statebackend restore``). The stores are closed when the block ends."""
    settings = config if isinstance(config, Settings) else Settings.from_config(config)
    _check_name("task name", task_name)
    names = list(settings.stores) if store_names is None else store_names
    unknown = [name for name in names if name not in settings.stores]
    if unknown:
        raise ConfigError(f"no store {', '.join(map(repr, unknown))} in the config; configured stores: "
                          f"{', '.join(sorted(settings.stores)) or 'none'}")
    metrics = metrics or Metrics()
    owns = blob_store is None
    blob_store = blob_store or open_blob_store(settings.blob_store_url, settings.blob_store_options)
    stores: dict[str, LocalStore] = {}
    try:
        for name in names:
            store_settings = settings.stores[name]
            stores[name] = LocalStore.open(
                Path(settings.local_dir) / settings.job_name / task_name / name, name=name,
                max_batch_bytes=store_settings.write_batch_max_bytes, map_size=store_settings.map_size,
            )
        checkpoint_log = CheckpointLog(blob_store, settings.job_name, task_name,
                                       read_versions=settings.checkpoint_read_versions,
                                       retained=settings.checkpoint_retained)
        known = known_durable_seq(settings.local_dir, settings.job_name, task_name, list(stores))
        checkpoint_log.raise_floor(known)
        entry, _ = _choose_checkpoint(checkpoint_log, checkpoint, known, None)
        if entry is not None and isinstance(entry.checkpoint, CheckpointV1) and known >= entry.seq:
            raise InconsistentStateError(
                f"task {task_name}: checkpoint #{entry.seq} reads as a V1 checkpoint (offsets only, no state), but "
                f"this machine saw checkpoint #{known} durable as a V2 checkpoint with state: its V2 blob is missing "
                f"or unreadable. Nothing was restored or cleared; put the V2 blob back"
            )
        restored = _as_v2(entry)
        _check_serdes(settings, restored)

        def context(factory_name: str, group: list[str]) -> BackendContext:
            return BackendContext(
                factory_name=factory_name, job_name=settings.job_name, task_name=task_name,
                stores={name: stores[name] for name in group}, blob_store=blob_store, executor=_NoPool(),
                metrics=metrics, options=settings.backend_options_for(factory_name), checkpoint_log=checkpoint_log,
            )

        restored_by = _logged_restore(settings, task_name, stores, entry, restored, context, metrics)
        yield RestoredStores(entry, restored, stores, restored_by, metrics)
    finally:
        for store in stores.values():
            store.close()
        if owns:
            blob_store.close()


class _NoPool(Executor):
    """The executor of a restore-only context: restore managers download on their own pool, never on this one."""

    def submit(self, fn: Callable[..., Any], /, *args: Any, **kwargs: Any) -> Future[Any]:
        raise StateBackendError("a restore-only open runs no commits, uploads or cleanups")


def task_metrics(settings: Settings, task_name: str) -> Metrics:
    """A fresh registry for one open of a task: labelled ``job_name`` and ``task``, mirrored into OpenTelemetry
    unless ``metrics.otel=off`` (a no-op when the API is not installed or no SDK is)."""
    labels = {"job_name": settings.job_name, "task": task_name}
    sink = otel_sink(labels) if settings.metrics_otel != "off" else None
    return Metrics(labels=labels, sink=sink)


def _exports_prometheus(settings: Settings) -> bool:
    return (settings.metrics_prometheus_port is not None or settings.metrics_prometheus_textfile_dir is not None
            or settings.metrics_prometheus_push_url is not None)


def start_exporters(settings: Settings, metrics: Metrics, task_name: str | None = None) -> None:
    """With a Prometheus exporter configured: register ``metrics`` with the process collector (labelled with the job
    and ``task_name`` when it has no labels of its own) and start the endpoint (once per process). Never fails the
    task: an endpoint that cannot bind is logged."""
    if not _exports_prometheus(settings):
        return
    labels = {"job_name": settings.job_name, "task": task_name} if task_name and not metrics.labels else None
    prom.PROCESS.register(metrics, labels)
    port = settings.metrics_prometheus_port
    if port is not None:
        try:
            prom.serve(settings.metrics_prometheus_host, port)
        except OSError as exc:
            log.warning("metrics endpoint not started on %s:%d (metrics.prometheus.host, metrics.prometheus.port): "
                        "%s", settings.metrics_prometheus_host, port, exc)


def export_on_close(settings: Settings, task_name: str, metrics: Metrics) -> None:
    """A task closed: keep its series in the process collector and write or push them where configured. Never
    fails the close: a failure is logged."""
    if not _exports_prometheus(settings):
        return
    prom.PROCESS.retire(metrics)
    export_now(settings, task_name)


def export_now(settings: Settings, task_name: str) -> None:
    """Write or push the task's series where configured (a task kept open between batches does so after each batch,
    since it is not closed). Never fails: a failure is logged."""
    if settings.metrics_prometheus_textfile_dir is None and settings.metrics_prometheus_push_url is None:
        return
    series = prom.PROCESS.collect(job_name=settings.job_name, task=task_name)
    if settings.metrics_prometheus_textfile_dir is not None:
        try:
            prom.write_textfile(settings.metrics_prometheus_textfile_dir, settings.job_name, task_name, series)
        except OSError as exc:
            log.warning("task %s: metrics textfile not written to %s (metrics.prometheus.textfile.dir): %s",
                        task_name, settings.metrics_prometheus_textfile_dir, exc)
    if settings.metrics_prometheus_push_url is not None:
        try:
            prom.push(settings.metrics_prometheus_push_url, settings.job_name, task_name, series)
        except OSError as exc:
            log.warning("task %s: metrics not pushed to %s (metrics.prometheus.push.url): %s", task_name,
                        redact(settings.metrics_prometheus_push_url), redact(str(exc)))


def _check_name(what: str, name: str) -> None:
    if not name or "/" in name or name in {".", ".."} or not name.replace("-", "").replace("_", "").replace(
        ".", ""
    ).isalnum():
        raise ConfigError(f"{what} {name!r} must be letters, digits, '.', '_' or '-'")


def known_durable_seq(
    local_dir: str | Path, job_name: str, task_name: str, store_names: list[str] | None = None
) -> int:
    """The newest checkpoint seq of the task that this machine saw durable: the highest seq named by a store dir's
    ``CHECKPOINT-V2`` (0 when none names one). A damaged file is logged and passed over."""
    task_dir = Path(local_dir) / job_name / task_name
    if store_names is None:
        try:
            store_names = sorted(p.name for p in task_dir.iterdir() if p.is_dir())
        except FileNotFoundError:
            return 0
    known = 0
    for name in store_names:
        try:
            found = read_local_checkpoint_binding(task_dir / name)
        except (CorruptDataError, IncompatibleFormatError, OSError) as exc:
            log.warning("store %s of task %s: local checkpoint file ignored: %s", name, task_name, exc,
                        extra={"job": job_name, "task": task_name, "store": name})
            continue
        if found is None or found[1] is None:
            continue
        binding = found[1]
        if binding.job == job_name and binding.task == task_name:
            known = max(known, binding.seq)
    return known


def _choose_checkpoint(
    checkpoint_log: CheckpointLog, choice: CheckpointChoice, known: int, fence_seq: int | None
) -> tuple[LogEntry | None, int]:
    """The entry to restore and the head to fence on, from one listing that reaches ``known``."""
    if fence_seq is not None and not (choice is None or isinstance(choice, LogEntry)):
        raise ConfigError("fence_seq is given with a LogEntry (or None) checkpoint choice only")
    if choice is None and fence_seq is None:
        return None, checkpoint_log.head(at_least=known)
    if choice is None or isinstance(choice, LogEntry):
        chosen = 0 if choice is None else choice.seq
        head = chosen if fence_seq is None else fence_seq
        if head < chosen:
            raise ConfigError(f"fence_seq={fence_seq} is below the chosen checkpoint #{chosen}")
        if known > head:
            shown = checkpoint_log.head(at_least=known)
            raise InconsistentStateError(
                f"task {checkpoint_log.task_name}: checkpoint #{chosen} was chosen from a listing that ended at "
                f"#{head}, but checkpoint #{known} is known to be durable (local CHECKPOINT-V2) and the log now "
                f"shows #{shown}: the choice was made on a short answer. Choose again"
            )
        return choice, head
    if choice == "latest":
        return checkpoint_log.latest_and_head(at_least=known)
    if callable(choice):
        return checkpoint_log.find_and_head(choice, at_least=known)
    raise ConfigError(f"checkpoint choice {choice!r}: use 'latest', a LogEntry, a predicate or None")


def recorded_serdes(store_settings: StoreSettings) -> dict[str, str]:
    """What a checkpoint records of how a store's bytes read: its serdes, and ``envelope: ttl`` with a TTL."""
    recorded = {"key": store_settings.key_serde, "msg": store_settings.msg_serde}
    if store_settings.ttl_ms is not None:
        recorded["envelope"] = ENVELOPE
    return recorded


def _check_serdes(settings: Settings, checkpoint: CheckpointV2 | None) -> None:
    """A store's serdes must be those its state was written with: else its bytes would read as garbage."""
    if checkpoint is None:
        return
    problems = []
    for name, store_settings in settings.stores.items():
        written = checkpoint.serdes.get(name)
        if written is None:
            continue
        for part, configured in (("key", store_settings.key_serde), ("msg", store_settings.msg_serde)):
            if part in written and written[part] != configured:
                problems.append(
                    f"stores.{name}.{part}.serde is {configured!r} but store {name!r} was written with "
                    f"{written[part]!r} (checkpoint {checkpoint.checkpoint_id}); set stores.{name}.{part}.serde="
                    f"{written[part]}, or migrate the data into a new store"
                )
        envelope = written.get("envelope")
        if (envelope == ENVELOPE) != (store_settings.ttl_ms is not None):
            problems.append(
                f"stores.{name}.ttl.ms is set but store {name!r} was written without a TTL (checkpoint "
                f"{checkpoint.checkpoint_id}): its values carry no expiry. Unset stores.{name}.ttl.ms, or copy the "
                "data into a new store that has it"
                if envelope is None else
                f"store {name!r} was written with a TTL (checkpoint {checkpoint.checkpoint_id}): its values carry "
                f"an expiry that reads without stores.{name}.ttl.ms would take for data. Set stores.{name}.ttl.ms "
                "(any duration: the stored expiries stay), or copy the data into a new store"
            )
    if problems:
        raise ConfigError("\n".join(problems))


def _as_v2(entry: LogEntry | None) -> CheckpointV2 | None:
    if entry is None:
        return None
    if isinstance(entry.checkpoint, CheckpointV1):
        log.warning("checkpoint #%d is a V1 checkpoint (input offsets only): stores start empty", entry.seq,
                    extra={"seq": entry.seq})
        return None
    return entry.checkpoint


def _backup_groups(settings: Settings) -> dict[str, list[str]]:
    groups: dict[str, list[str]] = {}
    for name, store_settings in settings.stores.items():
        for factory_name in store_settings.backup_factories:
            groups.setdefault(factory_name, []).append(name)
    return groups


def _logged_restore(
    settings: Settings,
    task_name: str,
    stores: Mapping[str, LocalStore],
    entry: LogEntry | None,
    checkpoint: CheckpointV2 | None,
    context: Callable[[str, list[str]], BackendContext],
    metrics: Metrics,
    failed: dict[str, list[str]] | None = None,
) -> dict[str, str | None]:
    """:func:`_restore`, logged at INFO when it starts and ends (with the bytes downloaded and the time taken), and
    timed into ``restore.ms``. Job, task, checkpoint id and seq go into each record's ``extra``."""
    extra = {"job": settings.job_name, "task": task_name,
             "checkpoint_id": str(checkpoint.checkpoint_id) if checkpoint is not None else None,
             "seq": entry.seq if entry is not None else None}
    what = (f"checkpoint #{entry.seq} ({checkpoint.checkpoint_id})" if entry is not None and checkpoint is not None
            else "no checkpoint (stores start empty)")
    log.info("task %s of job %s: restoring %s into stores %s", task_name, settings.job_name, what,
             ", ".join(stores) or "(none)", extra=extra)
    bytes_before = metrics.counter("restore.bytes")
    started = time.monotonic()
    try:
        restored_by = _restore(settings, stores, checkpoint, context, failed)
    except BaseException as exc:
        log.info("task %s of job %s: restore of %s failed after %.0f ms: %s", task_name, settings.job_name, what,
                 (time.monotonic() - started) * 1000.0, exc, extra=extra)
        raise
    elapsed_ms = (time.monotonic() - started) * 1000.0
    metrics.record("restore.ms", elapsed_ms)
    downloaded = int(metrics.counter("restore.bytes") - bytes_before)
    by = ", ".join(f"{name} from {factory or 'nothing (empty)'}" for name, factory in restored_by.items())
    log.info("task %s of job %s: restored %s in %.0f ms, %d bytes downloaded (%s)", task_name, settings.job_name,
             what, elapsed_ms, downloaded, by or "no stores", extra=dict(extra, bytes=downloaded, ms=round(elapsed_ms)))
    return restored_by


#: restore failures that fall back to the next backend: a blob missing, damaged, unreadable or unreachable
_FALLBACK_ERRORS = (NotFoundError, CorruptDataError, IncompatibleFormatError, StorageError)


def _restore(
    settings: Settings,
    stores: Mapping[str, LocalStore],
    checkpoint: CheckpointV2 | None,
    context: Callable[[str, list[str]], BackendContext],
    failed: dict[str, list[str]] | None = None,
) -> dict[str, str | None]:
    """Restore every store; returns which backend restored each (``None``: it starts empty). ``failed`` gets, per
    store, the backends whose restore of it failed."""
    restored_by: dict[str, str | None] = {}
    candidates: dict[str, list[str]] = {}
    for name in stores:
        store_settings = settings.stores[name]
        order = _restore_candidates(name, store_settings.restore_factories, store_settings.backup_factories,
                                    checkpoint)
        if not order:
            if stores[name].version is not None or stores[name].count() > 0:
                log.info("store %s: no state in the checkpoint; clearing local data", name,
                         extra={"job": settings.job_name, "store": name})
            stores[name].replace_contents([], None)
            restored_by[name] = None
            continue
        candidates[name] = order
    failures: dict[str, list[str]] = {name: [] for name in candidates}
    while candidates:
        groups: dict[str, list[str]] = {}
        for name, order in candidates.items():
            groups.setdefault(order[0], []).append(name)
        next_round: dict[str, list[str]] = {}
        for factory_name, store_names in groups.items():
            # A group restores together (one download pool); when it fails, each of its stores is retried on its
            # own, so one store's missing blob never fails a sibling this backend can restore.
            batches = [store_names]
            while batches:
                batch = batches.pop()
                try:
                    _restore_with(factory_name, batch, checkpoint, context)
                except _FALLBACK_ERRORS as exc:
                    if len(batch) > 1:
                        batches.extend([name] for name in batch)
                        continue
                    name = batch[0]
                    failures[name].append(f"{factory_name}: {exc}")
                    if failed is not None:
                        failed.setdefault(name, []).append(factory_name)
                    rest = candidates[name][1:]
                    if not rest:
                        if len(failures[name]) == 1:
                            raise
                        raise type(exc)(
                            f"store {name}: every backend with a marker in checkpoint "
                            f"{checkpoint.checkpoint_id if checkpoint else None} failed to restore it: "
                            f"{'; '.join(failures[name])}"
                        ) from exc
                    log.error(
                        "store %s: restore of checkpoint %s from the %s backend failed (%s); falling back to the %s "
                        "backend", name, checkpoint.checkpoint_id if checkpoint else None, factory_name, exc, rest[0],
                        extra={"job": settings.job_name, "store": name,
                               "checkpoint_id": str(checkpoint.checkpoint_id) if checkpoint else None},
                    )
                    next_round[name] = rest
                    continue
                for name in batch:
                    restored_by[name] = factory_name
        candidates = next_round
    return restored_by


def _restore_with(
    factory_name: str, store_names: list[str], checkpoint: CheckpointV2 | None,
    context: Callable[[str, list[str]], BackendContext],
) -> None:
    manager = resolve_factory(factory_name).factory.restore_manager(context(factory_name, store_names))
    try:
        manager.init(checkpoint)
        manager.restore()
    finally:
        manager.close()


def _restore_candidates(
    store_name: str, preferred: tuple[str, ...], backup_factories: tuple[str, ...], checkpoint: CheckpointV2 | None
) -> list[str]:
    """The backends to restore ``store_name`` from, in order: configured ones first, then any other backend whose
    marker the checkpoint has (a migration); only backends with a marker count."""
    if checkpoint is None:
        return []
    order = list(dict.fromkeys((*preferred, *backup_factories, *checkpoint.state_checkpoint_markers)))
    usable = [f for f in order if store_name in checkpoint.markers_for(f)]
    if usable and usable[0] != preferred[0]:
        log.warning(
            "store %s: checkpoint %s has no %s marker; restoring from the %s backend instead",
            store_name, checkpoint.checkpoint_id, preferred[0], usable[0],
            extra={"store": store_name, "checkpoint_id": str(checkpoint.checkpoint_id)},
        )
    return usable
