"""Carrying out an :class:`~statebackend.lifecycle.OpenDecision`: each store restored through the first backend of
its restore order, falling back to the next one with a marker in the same checkpoint when a restore fails on a
missing, damaged or unreachable blob (logged at ERROR); a store the checkpoint holds nothing of starts empty.

Also the read-only restore, :func:`restored_stores`: the same decision and the same restore, with no backup manager,
so nothing is swept, cleaned up or written to the blob store (``statebackend restore`` and ``dump``, ``read_state``'s
scratch copies, a rescaled Spark batch reading the old tasks' checkpoints).

Whether a store's local data is reused (whole, or as the start that only the missing deltas or runs are applied
on) is each restoring backend's call: only its marker's format says which versions it builds on, so its restore
manager compares the store's :attr:`LocalStore.version <statebackend.store.LocalStore.version>` with its marker.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Collection, Iterator, Mapping
from concurrent.futures import Executor, Future
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import attrs

from statebackend.blobstores.base import BlobStore, open_blob_store
from statebackend.checkpoint import LogEntry
from statebackend.config import Settings, check_name
from statebackend.contracts import BackendContext
from statebackend.errors import (
    ConfigError,
    CorruptDataError,
    IncompatibleFormatError,
    NotFoundError,
    StorageError,
    UsageError,
)
from statebackend.lifecycle import CheckpointChoice, OpenDecision, decide_open, task_checkpoint_log
from statebackend.metrics import Metrics
from statebackend.registry import resolve_factory
from statebackend.store import LocalStore

__all__ = [
    "FALLBACK_ERRORS",
    "RestoredStores",
    "group_by_options",
    "open_local_stores",
    "options_of_group",
    "restore_stores",
    "restored_stores",
]

log = logging.getLogger(__name__)

#: restore failures that fall back to the next backend: a blob missing, damaged, unreadable or unreachable
FALLBACK_ERRORS = (NotFoundError, CorruptDataError, IncompatibleFormatError, StorageError)

#: (factory name, store names) -> the context a backend gets for those stores
ContextFactory = Callable[[str, list[str]], BackendContext]


def group_by_options(settings: Settings, factory_name: str, store_names: list[str]) -> list[list[str]]:
    """``store_names`` split into groups with equal options of backend ``factory_name`` (a store's
    ``stores.<name>.<backend>.*`` keys over the job-wide ones: ``Settings.backend_options_for``), in order of first
    appearance. The framework gives a backend one manager per group, so each manager's ``BackendContext.options``
    are exactly its stores' options and a backend needs no code of its own for per-store options."""
    groups: list[tuple[Mapping[str, Any], list[str]]] = []
    for name in store_names:
        options = settings.backend_options_for(factory_name, store=name)
        group = next((names for group_options, names in groups if group_options == options), None)
        if group is None:
            groups.append((options, [name]))
        else:
            group.append(name)
    return [names for _, names in groups]


def options_of_group(settings: Settings, factory_name: str, store_names: list[str]) -> Mapping[str, Any]:
    """The options of backend ``factory_name`` for a group of stores made by :func:`group_by_options` (the job-wide
    ones for no store). Stores whose options differ are refused: one manager would otherwise apply one store's
    options to another."""
    if not store_names:
        return settings.backend_options_for(factory_name)
    options = settings.backend_options_for(factory_name, store=store_names[0])
    differing = [name for name in store_names[1:] if settings.backend_options_for(factory_name, store=name) != options]
    if differing:
        raise UsageError(
            f"backend {factory_name}: stores {store_names[0]} and {', '.join(differing)} have different options and "
            "cannot share one manager; group them with statebackend.restore.group_by_options"
        )
    return options


def open_local_stores(settings: Settings, task_name: str, names: list[str]) -> dict[str, LocalStore]:
    """Open (locking) the local stores ``names`` of ``task_name`` under ``state.local.dir``; on a failure the ones
    already open are closed."""
    stores: dict[str, LocalStore] = {}
    try:
        for name in names:
            store_settings = settings.stores[name]
            stores[name] = LocalStore.open(
                Path(settings.local_dir) / settings.job_name / task_name / name,
                name=name,
                max_batch_bytes=store_settings.write_batch_max_bytes,
                map_size=store_settings.map_size,
            )
    except BaseException:
        for store in stores.values():
            store.close()
        raise
    return stores


def restore_stores(
    settings: Settings,
    decision: OpenDecision,
    stores: Mapping[str, LocalStore],
    context: ContextFactory,
    metrics: Metrics,
    failed: dict[str, list[str]] | None = None,
) -> dict[str, str | None]:
    """Restore every store of ``stores`` to the decision's checkpoint; returns which backend restored each (``None``:
    it starts empty). ``failed`` gets, per store, the backends whose restore of it failed. Logged at INFO when it
    starts and ends (bytes downloaded, time taken) and timed into ``restore.ms``; job, task, checkpoint id and seq
    go into each record's ``extra``."""
    checkpoint, entry, task_name = decision.checkpoint, decision.entry, decision.task_name
    extra = {
        "job": settings.job_name,
        "task": task_name,
        "checkpoint_id": str(checkpoint.checkpoint_id) if checkpoint is not None else None,
        "seq": entry.seq if entry is not None else None,
    }
    what = (
        f"checkpoint #{entry.seq} ({checkpoint.checkpoint_id})"
        if entry is not None and checkpoint is not None
        else "no checkpoint (stores start empty)"
    )
    log.info(
        "task %s of job %s: restoring %s into stores %s",
        task_name,
        settings.job_name,
        what,
        ", ".join(stores) or "(none)",
        extra=extra,
    )
    bytes_before = metrics.counter("restore.bytes")
    started = time.monotonic()
    try:
        restored_by = _restore(settings, decision, stores, context, failed)
    except BaseException as exc:
        log.info(
            "task %s of job %s: restore of %s failed after %.0f ms: %s",
            task_name,
            settings.job_name,
            what,
            (time.monotonic() - started) * 1000.0,
            exc,
            extra=extra,
        )
        raise
    elapsed_ms = (time.monotonic() - started) * 1000.0
    metrics.record("restore.ms", elapsed_ms)
    downloaded = int(metrics.counter("restore.bytes") - bytes_before)
    by = ", ".join(f"{name} from {factory or 'nothing (empty)'}" for name, factory in restored_by.items())
    log.info(
        "task %s of job %s: restored %s in %.0f ms, %d bytes downloaded (%s)",
        task_name,
        settings.job_name,
        what,
        elapsed_ms,
        downloaded,
        by or "no stores",
        extra=dict(extra, bytes=downloaded, ms=round(elapsed_ms)),
    )
    return restored_by


@attrs.frozen
class RestoredStores:
    """What :func:`restored_stores` gives: the decision carried out, the open local stores and which backend
    restored each (``None``: it started empty)."""

    decision: OpenDecision
    stores: Mapping[str, LocalStore]
    restored_by: Mapping[str, str | None]
    metrics: Metrics

    @property
    def entry(self) -> LogEntry | None:
        """The log entry restored (``None``: none)."""
        return self.decision.entry

    @property
    def checkpoint(self) -> Any:
        """The checkpoint restored (``None``: none, or a V1 checkpoint)."""
        return self.decision.checkpoint


@contextmanager
def restored_stores(
    config: Settings | Mapping[str, Any],
    task_name: str,
    *,
    store_names: list[str] | None = None,
    blob_store: BlobStore | None = None,
    checkpoint: CheckpointChoice = "latest",
    metrics: Metrics | None = None,
    raw_values: Collection[str] = (),
) -> Iterator[RestoredStores]:
    """Restore stores of ``task_name`` (all configured ones, or ``store_names``) under ``state.local.dir`` to a
    checkpoint, by the same decision and restore as :meth:`TaskStorage.open <statebackend.task.TaskStorage.open>`,
    and nothing more: no backup manager is created, so nothing is swept, cleaned up or written to the blob store.
    The stores are closed when the block ends. ``raw_values``: stores whose values the caller reads as stored bytes
    and decodes from the checkpoint's record (their value serde is not checked: :func:`decide_open
    <statebackend.lifecycle.decide_open>`)."""
    settings = config if isinstance(config, Settings) else Settings.from_config(config)
    check_name("task name", task_name)
    names = list(settings.stores) if store_names is None else store_names
    unknown = [name for name in names if name not in settings.stores]
    if unknown:
        raise ConfigError(
            f"no store {', '.join(map(repr, unknown))} in the config; configured stores: "
            f"{', '.join(sorted(settings.stores)) or 'none'}"
        )
    metrics = metrics or Metrics()
    owns = blob_store is None
    blob_store = blob_store or open_blob_store(settings.blob_store_url, settings.blob_store_options)
    stores: dict[str, LocalStore] = {}
    try:
        stores = open_local_stores(settings, task_name, names)
        checkpoint_log = task_checkpoint_log(settings, blob_store, task_name)
        decision = decide_open(
            settings, task_name, checkpoint_log, choice=checkpoint, store_names=names, raw_values=raw_values
        )

        def context(factory_name: str, group: list[str]) -> BackendContext:
            return BackendContext(
                factory_name=factory_name,
                job_name=settings.job_name,
                task_name=task_name,
                stores={name: stores[name] for name in group},
                blob_store=blob_store,
                executor=_NoPool(),
                metrics=metrics,
                options=options_of_group(settings, factory_name, group),
                checkpoint_log=checkpoint_log,
            )

        restored_by = restore_stores(settings, decision, stores, context, metrics)
        yield RestoredStores(decision, stores, restored_by, metrics)
    finally:
        for store in stores.values():
            store.close()
        if owns:
            blob_store.close()


class _NoPool(Executor):
    """The executor of a restore-only context: restore managers download on their own pool, never on this one."""

    def submit(self, fn: Callable[..., Any], /, *args: Any, **kwargs: Any) -> Future[Any]:
        raise UsageError(
            "a restore-only open runs no commits, uploads or cleanups: open the task with TaskStorage.open to commit"
        )


def _restore(
    settings: Settings,
    decision: OpenDecision,
    stores: Mapping[str, LocalStore],
    context: ContextFactory,
    failed: dict[str, list[str]] | None = None,
) -> dict[str, str | None]:
    checkpoint = decision.checkpoint
    restored_by: dict[str, str | None] = {}
    candidates: dict[str, list[str]] = {}
    for name in stores:
        order = list(decision.restore_order.get(name, ()))
        if not order:
            if stores[name].version is not None or stores[name].count() > 0:
                log.info(
                    "store %s: no state in the checkpoint; clearing local data",
                    name,
                    extra={"job": settings.job_name, "store": name},
                )
            stores[name].replace_contents([], None)
            restored_by[name] = None
            continue
        candidates[name] = order
    failures: dict[str, list[str]] = {name: [] for name in candidates}
    while candidates:
        # each store by the first backend of its order, then by that backend's options for it
        by_factory: dict[str, list[str]] = {}
        for name, order in candidates.items():
            by_factory.setdefault(order[0], []).append(name)
        groups = [
            (factory_name, group)
            for factory_name, names in by_factory.items()
            for group in group_by_options(settings, factory_name, names)
        ]
        next_round: dict[str, list[str]] = {}
        for factory_name, store_names in groups:
            # A group restores together (one download pool); when it fails, each of its stores is retried on its
            # own, so one store's missing blob never fails a sibling this backend can restore.
            batches = [store_names]
            while batches:
                batch = batches.pop()
                try:
                    _restore_with(factory_name, batch, decision, context)
                except FALLBACK_ERRORS as exc:
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
                        "backend",
                        name,
                        checkpoint.checkpoint_id if checkpoint else None,
                        factory_name,
                        exc,
                        rest[0],
                        extra={
                            "job": settings.job_name,
                            "store": name,
                            "checkpoint_id": str(checkpoint.checkpoint_id) if checkpoint else None,
                        },
                    )
                    next_round[name] = rest
                    continue
                for name in batch:
                    restored_by[name] = factory_name
        candidates = next_round
    return restored_by


def _restore_with(factory_name: str, store_names: list[str], decision: OpenDecision, context: ContextFactory) -> None:
    manager = resolve_factory(factory_name).factory.restore_manager(context(factory_name, store_names))
    try:
        manager.init(decision.checkpoint)
        manager.restore()
    finally:
        manager.close()
