"""TaskStorage: a task's stores, restored to a durable checkpoint and committed through its state backends.

This is the object a job holds per task::

    with TaskStorage.open(config, "task-0") as task:
        counts = task.store("counts")
        counts.put(b"k", b"1")
        task.commit({"input": "42"}).result()      # durable when result() returns

Opening restores: it reads the newest checkpoint from the checkpoint log (or the one asked for), picks per store the
backend named by ``stores.<name>.restore.factory`` (falling back, logged, to another backend whose marker the
checkpoint has), and lets each restore manager rebuild its stores, reusing local data that already is that state.
A store the checkpoint knows nothing of starts empty.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Mapping
from concurrent.futures import Executor
from pathlib import Path
from typing import Any, Self

import attrs

from checkpoint import CheckpointIdGenerator, CheckpointLog, CheckpointV1, CheckpointV2, LogEntry
from statebackend.blobstore import BlobStore, open_blob_store
from statebackend.commit import BackupBinding, PendingCommit, TaskCommitManager, shared_commit_pool
from statebackend.config import Settings
from statebackend.contracts import BackendContext
from statebackend.errors import ConfigError, StateBackendError
from statebackend.metrics import Metrics
from statebackend.registry import resolve_factory
from statebackend.resources import create_blob_store_resources
from statebackend.serdes import get_serde
from statebackend.store import LocalStore

__all__ = ["TaskStorage"]

log = logging.getLogger(__name__)

#: which checkpoint to restore: the newest, a log entry, or a predicate over log entries (newest match wins)
CheckpointChoice = str | LogEntry | Callable[[LogEntry], bool] | None


@attrs.define
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
    ) -> TaskStorage:
        """Open (and restore) the stores of ``task_name``. ``checkpoint``: ``"latest"`` (default), a
        :class:`LogEntry`, or a predicate choosing the newest matching entry (e.g. by input offsets)."""
        settings = config if isinstance(config, Settings) else Settings.from_config(config)
        _check_name("task name", task_name)
        metrics = metrics or Metrics()
        owns = blob_store is None
        blob_store = blob_store or open_blob_store(settings.blob_store_url, settings.blob_store_options)
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
            entry = _choose_checkpoint(checkpoint_log, checkpoint)
            restored = _as_v2(entry)

            def context(factory_name: str, store_names: list[str]) -> BackendContext:
                return BackendContext(
                    factory_name=factory_name,
                    job_name=settings.job_name,
                    task_name=task_name,
                    stores={name: stores[name] for name in store_names},
                    blob_store=blob_store,
                    settings=settings,
                    executor=executor,
                    metrics=metrics,
                    options=settings.backend_options_for(factory_name),
                )

            started = time.monotonic()
            _restore(settings, stores, restored, context)
            metrics.record("restore.ms", (time.monotonic() - started) * 1000.0)

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
                next_seq=checkpoint_log.next_seq(),
                id_generator=id_generator,
                last_checkpoint=restored,
            )
        except BaseException:
            for binding in backups:  # background work started by init() must not outlive the stores
                binding.manager.close()
            for store in stores.values():
                store.close()
            if owns:
                blob_store.close()
            raise
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

    def store(self, name: str, *, typed: bool = True) -> Any:
        """The store ``name``: a typed view per its serdes, or the raw bytes store with ``typed=False``."""
        try:
            store = self.stores[name]
        except KeyError:
            raise ConfigError(
                f"no store {name!r} in this task; configured stores: {', '.join(sorted(self.stores)) or 'none'}"
            ) from None
        store_settings = self.settings.stores[name]
        if not typed or (store_settings.key_serde == "bytes" and store_settings.msg_serde == "bytes"):
            return store
        return store.typed(get_serde(store_settings.key_serde), get_serde(store_settings.msg_serde))

    def commit(self, input_offsets: Mapping[str, str]) -> PendingCommit | None:
        """Commit every store with ``input_offsets`` (see :class:`TaskCommitManager`)."""
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
        """Commit and wait until the checkpoint is durable, blocking on a previous upload if one runs."""
        self.commit_manager.wait(timeout)
        pending = self.commit_manager.commit(input_offsets)
        if pending is None:  # cannot happen after wait(); kept so a skip is never silently taken for durable
            raise StateBackendError(f"task {self.task_name}: commit was skipped")
        return pending.result(timeout)

    def close(self) -> None:
        if self._closed:
            return
        self._closed = True
        try:
            self.commit_manager.close()
            for binding in self.commit_manager.backups:
                binding.manager.close()
        finally:
            for store in self.stores.values():
                store.close()
            if self._owns_blob_store:
                self.blob_store.close()

    def __enter__(self) -> Self:
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.close()


def _check_name(what: str, name: str) -> None:
    if not name or "/" in name or name in {".", ".."} or not name.replace("-", "").replace("_", "").replace(
        ".", ""
    ).isalnum():
        raise ConfigError(f"{what} {name!r} must be letters, digits, '.', '_' or '-'")


def _choose_checkpoint(checkpoint_log: CheckpointLog, choice: CheckpointChoice) -> LogEntry | None:
    if choice is None:
        return None
    if choice == "latest":
        return checkpoint_log.latest()
    if isinstance(choice, LogEntry):
        return choice
    if callable(choice):
        return checkpoint_log.find(choice)
    raise ConfigError(f"checkpoint choice {choice!r}: use 'latest', a LogEntry, a predicate or None")


def _as_v2(entry: LogEntry | None) -> CheckpointV2 | None:
    if entry is None:
        return None
    if isinstance(entry.checkpoint, CheckpointV1):
        log.warning("checkpoint #%d is a V1 checkpoint (input offsets only): stores start empty", entry.seq)
        return None
    return entry.checkpoint


def _backup_groups(settings: Settings) -> dict[str, list[str]]:
    groups: dict[str, list[str]] = {}
    for name, store_settings in settings.stores.items():
        for factory_name in store_settings.backup_factories:
            groups.setdefault(factory_name, []).append(name)
    return groups


def _restore(
    settings: Settings,
    stores: Mapping[str, LocalStore],
    checkpoint: CheckpointV2 | None,
    context: Callable[[str, list[str]], BackendContext],
) -> None:
    groups: dict[str, list[str]] = {}
    for name, store_settings in settings.stores.items():
        factory_name = _restore_factory_for(name, store_settings.restore_factory, store_settings.backup_factories,
                                            checkpoint)
        if factory_name is None:
            if stores[name].version is not None or stores[name].count() > 0:
                log.info("store %s: no state in the checkpoint; clearing local data", name)
            stores[name].replace_contents([], None)
            continue
        groups.setdefault(factory_name, []).append(name)
    for factory_name, store_names in groups.items():
        manager = resolve_factory(factory_name).factory.restore_manager(context(factory_name, store_names))
        try:
            manager.init(checkpoint)
            manager.restore()
        finally:
            manager.close()


def _restore_factory_for(
    store_name: str, preferred: str, backup_factories: tuple[str, ...], checkpoint: CheckpointV2 | None
) -> str | None:
    if checkpoint is None:
        return None
    if store_name in checkpoint.markers_for(preferred):
        return preferred
    others = [f for f in (*backup_factories, *checkpoint.state_checkpoint_markers) if f != preferred]
    for other in dict.fromkeys(others):
        if store_name in checkpoint.markers_for(other):
            log.warning(
                "store %s: checkpoint %s has no %s marker; restoring from the %s backend instead",
                store_name, checkpoint.checkpoint_id, preferred, other,
            )
            return other
    return None
