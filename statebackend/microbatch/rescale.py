"""A rescaled batch (``num_tasks`` changed): a task fills its empty stores with the keys of the key groups it owns now,
read from the old tasks' checkpoints of the previous batch."""

from __future__ import annotations

import logging
import shutil
import time
import uuid
from collections.abc import Callable
from pathlib import Path
from typing import Any

import attrs

from statebackend.blobstores.base import BlobStore
from statebackend.config import Settings
from statebackend.errors import ConfigError
from statebackend.microbatch.batches import RESCALE_DIR, Plan, task_name
from statebackend.microbatch.keygroups import key_group_range, spark_hash
from statebackend.microbatch.timers import TIMERS_STORE, timer_key_columns
from statebackend.restore import restored_stores
from statebackend.serdes import get_serde
from statebackend.store.kinds import user_key_of
from statebackend.task import TaskStorage

__all__ = ["MIN_RETAINED_FOR_RESCALE", "KeyRouting", "take_key_groups"]

log = logging.getLogger(__name__)

#: the smallest task.checkpoint.retained a change of num_tasks runs with: a task commits a rescaled batch, and
#: perhaps a replay of it, while other tasks still read its checkpoint of the previous batch
MIN_RETAINED_FOR_RESCALE = 3


@attrs.frozen
class KeyRouting:
    """How the job routes keys to tasks: ``num_tasks`` tasks over ``key_groups`` key groups, the Spark type names of
    the key columns, and ``key_of`` mapping (store name, decoded stored key) to the key column value(s) (None: the
    stored key itself)."""

    num_tasks: int
    key_groups: int
    key_types: tuple[str, ...]
    key_of: Callable[[str, Any], Any] | None = None

    def key_columns(self, store_name: str, key: Any) -> tuple[Any, ...]:
        """The key column values of a stored key (a timer record holds its key's own, whatever ``key_of``)."""
        if store_name == TIMERS_STORE:
            return timer_key_columns(key)
        value = self.key_of(store_name, key) if self.key_of is not None else key
        if len(self.key_types) == 1:
            if isinstance(value, bytes) and self.key_types[0] == "string":
                value = value.decode("utf-8")
            return (value,)
        if not isinstance(value, (tuple, list)) or len(value) != len(self.key_types):
            raise ConfigError(
                f"rescaling store {store_name!r}: its key {key!r} is not a tuple of the {len(self.key_types)} key "
                "column values: give StatefulForeachBatch(key_of=...) mapping a stored key to them"
            )
        return tuple(value)


def take_key_groups(
    storage: TaskStorage, settings: Settings, blob_store: BlobStore, plan: Plan, index: int, routing: KeyRouting
) -> None:
    """Fill the task's empty stores with the keys of the key groups it owns now, read from the old tasks'
    checkpoints of the previous batch (``plan.sources``; each restored read-only into a scratch dir, then dropped).
    Values are copied as stored (a TTL store's expiries included). A list or map store's record goes with its user
    key (:func:`~statebackend.store.kinds.user_key_of`), never its element seq or sub-key: a key's records stay
    together."""
    mine = key_group_range(index, routing.num_tasks, routing.key_groups)
    previous = plan.previous
    assert previous is not None
    started, copied = time.monotonic(), 0
    for old_name, entry in plan.sources:
        old_index = int(old_name.rsplit("-", 1)[1])
        # what the old task was routed: its key groups, or (state before key groups) hash modulo its num_tasks
        held = (
            key_group_range(old_index, previous.tasks, previous.key_groups) if previous.key_groups is not None else None
        )
        scratch = Path(settings.local_dir) / RESCALE_DIR / uuid.uuid4().hex
        try:
            # the entry the plan's listing showed: restored as it is, with no listing of the old task's log
            with restored_stores(
                attrs.evolve(settings, local_dir=scratch), old_name, blob_store=blob_store, checkpoint=entry
            ) as old:
                storage.adopt_values(old.checkpoint, f"{old_name}'s checkpoint #{entry.seq}")  # values copied as stored
                for store_name, source in old.stores.items():
                    key_serde = get_serde(settings.stores[store_name].key_serde)
                    kinded = settings.stores[store_name].kind != "value"
                    keys: list[bytes] = []
                    values: list[bytes] = []
                    last: tuple[bytes, bool] | None = None  # a list's or map's records come together: hash once
                    for key, value in source.items():
                        if kinded:
                            user_key = user_key_of(key, store=store_name)
                            if last is not None and last[0] == user_key:
                                if last[1]:
                                    keys.append(key)
                                    values.append(value)
                                continue
                        decoded = key_serde.from_bytes(user_key if kinded else key)
                        columns = routing.key_columns(store_name, decoded)
                        try:
                            hashed = spark_hash(columns, routing.key_types)
                        except (TypeError, ConfigError) as exc:
                            raise ConfigError(
                                f"{task_name(index)}: rescaling store {store_name!r}: its key {decoded!r} does not "
                                f"hash as the key columns ({', '.join(routing.key_types)}): {exc}. A store's keys "
                                "must be the key column value (a tuple for several), or give "
                                "StatefulForeachBatch(key_of=...) mapping them to it"
                            ) from exc
                        group = hashed % routing.key_groups
                        if (group not in held) if held is not None else hashed % previous.tasks != old_index:
                            # the old task was never routed this key's rows: the store is not keyed by the key
                            # columns (or key_of maps it wrong); each old task may hold its own such key, and
                            # taking them into one new task would keep one and drop the others silently
                            raise ConfigError(
                                f"{task_name(index)}: rescaling store {store_name!r}: its key {decoded!r} is held "
                                f"by {old_name}, but its key columns ({', '.join(routing.key_types)}) hash to key "
                                f"group {group}, which {old_name} does not own under {previous}: the rows of this "
                                "key never went to that task. A store's keys must be the key column value (a "
                                "tuple for several), or give StatefulForeachBatch(key_of=...) mapping them to it"
                            )
                        if kinded:
                            last = (user_key, group in mine)
                        if group in mine:
                            keys.append(key)
                            values.append(value)
                    if keys:
                        storage.stores[store_name].put_many(keys, values)
                        copied += len(keys)
        finally:
            shutil.rmtree(scratch, ignore_errors=True)
    log.info(
        "%s: took %d keys of key groups %d..%d from %s (%s) in %.0f ms",
        task_name(index),
        copied,
        mine.start,
        mine.stop - 1,
        ", ".join(n for n, _ in plan.sources),
        previous,
        (time.monotonic() - started) * 1000.0,
    )
