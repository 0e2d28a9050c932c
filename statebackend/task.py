"""TaskStorage: a task's stores, restored to a durable checkpoint and committed through its state backends.

This is the object a job holds per task::

    with TaskStorage.open(config, "task-0") as task:
        counts = task.store("counts")
        counts.put(b"k", b"1")
        task.commit({"input": "42"}).result()      # durable when result() returns

Opening decides what to restore once (:func:`statebackend.lifecycle.decide_open`: which checkpoint, which backend
restores each store, the seq this attempt is fenced at), then carries the decision out
(:func:`statebackend.restore.restore_stores`: each store through the first backend of
``stores.<name>.restore.factories`` whose marker the checkpoint has, falling back to the next on a missing or damaged
blob) and starts the backup managers and the commit manager at the decision's fence. A caller that listed the log itself
(the Spark executor) passes its decision in, and the open checks it again once the stores are locked.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence
from concurrent.futures import Executor
from typing import Any, Literal, Protocol, Self, overload

import attrs

from statebackend.blobstores.admin import create_blob_store_resources
from statebackend.blobstores.base import BlobStore, open_blob_store
from statebackend.checkpoint import CheckpointIdGenerator, CheckpointLog, CheckpointV2
from statebackend.commit import BackupBinding, PendingCommit, TaskCommitManager, shared_commit_pool
from statebackend.config import Settings, check_name
from statebackend.contracts import BackendContext
from statebackend.errors import CommitError, ConfigError, KindError
from statebackend.exporters import export_on_close, start_exporters, task_metrics, textfile_after_commit
from statebackend.lifecycle import CheckpointChoice, OpenDecision, decide_open, known_durable_seq, task_checkpoint_log
from statebackend.metrics import Metrics
from statebackend.process import shorten_thread_switch_interval
from statebackend.registry import resolve_factory
from statebackend.restore import group_by_options, open_local_stores, options_of_group, restore_stores
from statebackend.serdes import get_serde
from statebackend.store import BytesStore, LocalStore, TypedStore
from statebackend.store.kinds import KIND, ListStore, MapStore
from statebackend.store.ttl import TtlStore, wall_clock_ms
from statebackend.values import StoreValues, adopted, plan_values, run_migration, with_initial

__all__ = ["TaskStorage", "ValueStore", "check_kinds"]

log = logging.getLogger(__name__)

#: the accessor of each kind of store, as errors name it
_ACCESSORS = {"value": "task.store(name)", "list": "task.list_store(name)", "map": "task.map_store(name)"}


class ValueStore(Protocol):
    """What :meth:`TaskStorage.store` gives: a value store's user operations, keys and values as its serdes take
    them. Both its views have them: :class:`TypedStore` (typed serdes) and :class:`BytesStore` (``bytes`` serdes, or
    ``typed=False``); which one a store gets depends on its configuration, so code is typed against this."""

    @property
    def name(self) -> str: ...
    def get(self, key: Any) -> Any: ...
    def contains(self, key: Any) -> bool: ...
    def put(self, key: Any, value: Any, *, ttl_ms: int | None = None) -> None: ...
    def delete(self, key: Any) -> None: ...
    def put_all(self, items: Iterable[tuple[Any, Any]]) -> None: ...
    def delete_all(self, keys: Iterable[Any]) -> None: ...
    def get_many(self, keys: Sequence[Any]) -> list[Any]: ...
    def put_many(self, keys: Sequence[Any], values: Sequence[Any], *, ttl_ms: int | None = None) -> None: ...
    def delete_many(self, keys: Sequence[Any]) -> None: ...
    def update_many(self, keys: Sequence[Any], fn: Callable[[list[Any]], Sequence[Any]]) -> None: ...
    def iter_prefix(self, prefix: Any) -> Iterator[tuple[Any, Any]]: ...
    def iter_range(self, start: Any | None, end: Any | None) -> Iterator[tuple[Any, Any]]: ...
    def items(self) -> Iterator[tuple[Any, Any]]: ...
    def count(self) -> int: ...


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
    #: what the open restored and where its commits go (its checkpoint is :attr:`restored`)
    decision: OpenDecision
    _owns_blob_store: bool = False
    _closed: bool = attrs.field(init=False, default=False)
    _last_commit: float = attrs.field(init=False, factory=time.monotonic)
    #: the time (ms since the epoch) TTL stores read and write at; None: the wall clock at each call. The Spark
    #: executor fixes it per batch, so a replayed batch sees the keys its first run saw
    ttl_now_ms: int | None = attrs.field(init=False, default=None)
    _ttl_views: dict[str, TtlStore] = attrs.field(init=False, factory=dict)
    #: per store: how its values read and what commits record of them (statebackend.values)
    _values: dict[str, StoreValues] = attrs.field(factory=dict, alias="values")

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
        decision: OpenDecision | None = None,
    ) -> TaskStorage:
        """Open (and restore) the stores of ``task_name``. ``checkpoint``: ``"latest"`` (default), a
        :class:`LogEntry`, or a predicate choosing the newest matching entry (e.g. by input offsets).

        ``fence_seq`` (only with a :class:`LogEntry` or ``None``): the newest seq the caller saw when it chose; this
        task then writes ``fence_seq + 1`` (a deliberate replay that supersedes newer checkpoints). Without it, a
        given entry's own seq fences.

        ``decision``: a decision the caller made itself with :func:`~statebackend.lifecycle.decide_open` (and perhaps
        :meth:`~statebackend.lifecycle.OpenDecision.rebased`) on the same blob store; it replaces ``checkpoint`` and
        ``fence_seq`` and is checked again against the local stores once they are locked."""
        settings = config if isinstance(config, Settings) else Settings.from_config(config)
        check_name("task name", task_name)
        if decision is not None and (checkpoint != "latest" or fence_seq is not None):
            raise ConfigError("TaskStorage.open: give a decision, or checkpoint/fence_seq, not both")
        if decision is not None and decision.task_name != task_name:
            raise ConfigError(f"TaskStorage.open: the decision is of task {decision.task_name}, not {task_name}")
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
            stores = open_local_stores(settings, task_name, list(settings.stores))
            checkpoint_log = task_checkpoint_log(settings, blob_store, task_name)
            if decision is None:
                decision = decide_open(settings, task_name, checkpoint_log, choice=checkpoint, fence_seq=fence_seq)
            else:
                # made before the stores were locked: what this machine knows durable may have moved since
                decision.confirm(known_durable_seq(settings.local_dir, settings.job_name, task_name, list(stores)))
                checkpoint_log.raise_floor(decision.floor)
            restored = decision.checkpoint
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
                    options=options_of_group(settings, factory_name, store_names),
                    checkpoint_log=checkpoint_log,
                    restored_by={name: restored_by.get(name) for name in store_names},
                    restore_failures={name: tuple(restore_failures.get(name, ())) for name in store_names},
                )

            restored_by.update(restore_stores(settings, decision, stores, context, metrics, restore_failures))

            for factory_name, store_names in _backup_groups(settings):
                manager = resolve_factory(factory_name).factory.backup_manager(context(factory_name, store_names))
                backups.append(BackupBinding(factory_name, manager, tuple(store_names)))
                manager.init(restored)

            check_kinds(settings, restored)
            values = plan_values(settings, restored)
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
                next_seq=decision.next_seq,  # the fence: from the restore decision, never from a later listing
                id_generator=id_generator,
                last_checkpoint=restored,
                serdes={name: plan.recorded for name, plan in values.items()},
                after_durable=textfile_after_commit(settings, task_name, executor),  # the textfile at every commit
            )
            for name, plan in values.items():
                if plan.migration is not None:  # its writes and its name land in the next commit, together
                    store_settings = settings.stores[name]
                    run_migration(
                        stores[name],
                        plan,
                        get_serde(store_settings.key_serde),
                        ttl=store_settings.ttl_ms is not None,
                        metrics=metrics,
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
            decision=decision,
            owns_blob_store=owns,
            values=values,
        )

    @property
    def restored(self) -> CheckpointV2 | None:
        """The checkpoint the stores were restored to (``None``: no durable checkpoint existed)."""
        return self.decision.checkpoint

    @property
    def committed_seq(self) -> int:
        """The seq of the newest checkpoint this task wrote durable, or of the one it was restored to and fenced
        after (its head): the seq its next commit builds on. A commit in flight is not counted until durable."""
        return self.commit_manager.next_seq - 1

    @property
    def last_checkpoint(self) -> CheckpointV2 | None:
        """The newest checkpoint of this task known durable: its last durable commit's, else the restored one."""
        return self.commit_manager.last_checkpoint

    @property
    def write_outcome_unknown(self) -> bool:
        """Whether the last checkpoint write's reply was lost and its read-back has not decided it yet: the seq the
        next commit writes may still move."""
        return self.commit_manager.write_outcome_unknown

    @property
    def idle(self) -> bool:
        """Whether nothing of the task waits to be committed: every store's write batch is empty and nothing is
        spilled (a commit's upload may still run: see :meth:`wait_for_commit`)."""
        return not any(store.batch_bytes or store.spill_runs for store in self.stores.values())

    def wait_for_commit(self, timeout: float | None = None, *, raise_failure: bool = True) -> CheckpointV2 | None:
        """Wait until the commit in flight (if any) ends; returns the newest durable checkpoint. Its failure is
        raised unless ``raise_failure=False`` (then it is kept for the next commit to report)."""
        return self.commit_manager.wait(timeout, raise_failure=raise_failure)

    @overload
    def store(self, name: str, *, typed: Literal[False]) -> BytesStore: ...

    @overload
    def store(self, name: str, *, typed: bool = True) -> ValueStore: ...

    def store(self, name: str, *, typed: bool = True) -> ValueStore:
        """The value store ``name`` for the task's code: a typed view per its serdes, or a bytes view
        (:class:`BytesStore`) with ``typed=False`` (also when both serdes are ``bytes``). Either has the user
        operations only; backends get the :class:`LocalStore` itself (``stores``) through their context. A list or map
        store (``stores.<name>.kind``) is a :class:`KindError` naming the accessor that gives it (:meth:`list_store`,
        :meth:`map_store`); :meth:`view` gives a store of any kind."""
        return self._view(name, "value", typed=typed)

    def list_store(self, name: str, *, typed: bool = True) -> ListStore:
        """The list store ``name`` (``stores.<name>.kind=list``), over bytes with ``typed=False``; another kind of
        store is a :class:`KindError` naming the accessor that gives it."""
        return self._view(name, "list", typed=typed)

    def map_store(self, name: str, *, typed: bool = True) -> MapStore:
        """The map store ``name`` (``stores.<name>.kind=map``), over bytes with ``typed=False``; another kind of
        store is a :class:`KindError` naming the accessor that gives it."""
        return self._view(name, "map", typed=typed)

    def view(self, name: str, *, typed: bool = True) -> ValueStore | ListStore | MapStore:
        """Store ``name`` as its kind gives it (:meth:`store`, :meth:`list_store` or :meth:`map_store`): for code that
        serves every kind (a Spark function's ``stores[name]``, reading the state back)."""
        return self._view(name, None, typed=typed)

    @overload
    def _view(self, name: str, kind: Literal["value"], *, typed: bool) -> ValueStore: ...

    @overload
    def _view(self, name: str, kind: Literal["list"], *, typed: bool) -> ListStore: ...

    @overload
    def _view(self, name: str, kind: Literal["map"], *, typed: bool) -> MapStore: ...

    @overload
    def _view(self, name: str, kind: None, *, typed: bool) -> ValueStore | ListStore | MapStore: ...

    def _view(self, name: str, kind: str | None, *, typed: bool) -> ValueStore | ListStore | MapStore:
        """Store ``name``'s view; ``kind``: the kind the caller's accessor gives (None: any)."""
        try:
            store = self.stores[name]
        except KeyError:
            raise ConfigError(
                f"no store {name!r} in this task; configured stores: {', '.join(sorted(self.stores)) or 'none'}"
            ) from None
        store_settings = self.settings.stores[name]
        if kind is not None and store_settings.kind != kind:
            raise KindError(
                f"store {name!r} is a {store_settings.kind} store (stores.{name}.kind={store_settings.kind}): "
                f"{_ACCESSORS[kind]} gives {kind} stores only; use {_ACCESSORS[store_settings.kind]} for it"
            )
        if store_settings.kind != "value":
            return self._kind_view(name, typed=typed)
        ops: LocalStore | TtlStore = store if store_settings.ttl_ms is None else self.ttl_view(name)
        if not typed or (store_settings.key_serde == "bytes" and store_settings.msg_serde == "bytes"):
            return BytesStore(ops)
        return TypedStore(ops, get_serde(store_settings.key_serde), self._values[name].value_serde)

    def _kind_view(self, name: str, *, typed: bool) -> ListStore | MapStore:
        store_settings = self.settings.stores[name]
        ttl = None if store_settings.ttl_ms is None else self.ttl_view(name)
        raw = get_serde("bytes")
        key_serde = get_serde(store_settings.key_serde) if typed else raw
        value_serde = self._values[name].value_serde if typed else raw
        if store_settings.kind == "list":
            return ListStore(self.stores[name], key_serde, value_serde, ttl)
        subkey_serde = get_serde(store_settings.subkey_serde) if typed else raw
        return MapStore(self.stores[name], key_serde, value_serde, ttl, subkey_serde=subkey_serde)

    @property
    def recorded_serdes(self) -> Mapping[str, Mapping[str, str]]:
        """Per store, what this task's commits record of how its bytes read (``CheckpointV2.serdes``)."""
        return {name: plan.recorded for name, plan in self._values.items()}

    def adopt_values(self, checkpoint: CheckpointV2 | None, source: str) -> None:
        """The stores take values copied as they were stored from ``checkpoint`` (``source`` names it: a rescale
        copies another task's keys): a record store then reads the schemas recorded there too, and later commits
        record them. :class:`ConfigError` when those values are in another format than this task's stores (another
        serde, or written before a migration these stores went through); nothing is changed then."""
        if checkpoint is None:
            return
        planned = {name: adopted(plan, checkpoint.serdes.get(name), source) for name, plan in self._values.items()}
        self._values.update(planned)
        self.commit_manager.serdes = self.recorded_serdes

    def mark_initial_load(self, store_names: Iterable[str], label: str) -> None:
        """Record in this and every later checkpoint that the stores ``store_names`` started from the initial-state
        load ``label`` (the Spark driver's ``initial_state``), so a restart knows the state is that load's."""
        for name in store_names:
            self._values[name] = with_initial(self._values[name], label)
        self.commit_manager.serdes = self.recorded_serdes

    def now_ms(self) -> int:
        """The time TTL stores read and write at: :attr:`ttl_now_ms`, or the wall clock."""
        return wall_clock_ms() if self.ttl_now_ms is None else self.ttl_now_ms

    def ttl_view(self, name: str) -> TtlStore:
        """The TTL view of store ``name`` (whose ``stores.<name>.ttl.ms`` is set) that the task's reads and writes go
        through: one per store, on the task's clock (:meth:`now_ms`)."""
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
                deleted = self.ttl_view(name).sweep(store_settings.ttl_sweep_keys)
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
            raise CommitError(f"task {self.task_name}: commit was skipped")
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
                        log.warning(
                            "task %s: %s could not cancel its background work: %s",
                            self.task_name,
                            binding.factory_name,
                            exc,
                        )
            self.commit_manager.close(handover=handover)
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


def _backup_groups(settings: Settings) -> list[tuple[str, list[str]]]:
    """(backend, stores) for each backup manager of a task: the stores each backend backs up, split by the options
    the backend has for each store (:func:`~statebackend.restore.group_by_options`), so every manager's context
    holds exactly its stores' options. A backend then has one manager per group; each writes its own stores' markers
    into the checkpoint under the backend's name."""
    by_factory: dict[str, list[str]] = {}
    for name, store_settings in settings.stores.items():
        for factory_name in store_settings.backup_factories:
            by_factory.setdefault(factory_name, []).append(name)
    return [
        (factory_name, group)
        for factory_name, names in by_factory.items()
        for group in group_by_options(settings, factory_name, names)
    ]


def check_kinds(settings: Settings, checkpoint: CheckpointV2 | None) -> None:
    """:class:`ConfigError` when a store's configured kind is not the one ``checkpoint`` recorded (its records would
    read as garbage), one line per store."""
    if checkpoint is None:
        return
    problems = []
    for name, store_settings in settings.stores.items():
        written = checkpoint.serdes.get(name)
        if written is None or "key" not in written:
            continue  # a release before serdes were recorded: nothing to check against
        was = written.get(KIND, "value")
        if was != store_settings.kind:
            problems.append(
                f"stores.{name}.kind is {store_settings.kind!r} but store {name!r} was written as a {was} store "
                f"(checkpoint {checkpoint.checkpoint_id}): its records read only as that kind. Set "
                f"stores.{name}.kind={was}, or copy the data into a new store of the kind you want"
            )
    if problems:
        raise ConfigError("\n".join(problems))
