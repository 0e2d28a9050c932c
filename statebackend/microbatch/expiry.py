"""The expiry sweep of a batch with ``on_expiry``: each TTL store's expired keys among the next ones from the cursor
its base checkpoint recorded, deleted, as the :class:`Expired` the callback gets, and the cursors the commit records.
The task attempt (:mod:`statebackend.microbatch.attempt`, which re-exports these names) calls the callback."""

from __future__ import annotations

from typing import Any

import attrs

from statebackend.microbatch.batches import Plan
from statebackend.microbatch.timers import TIMERS_STORE
from statebackend.store.kinds import is_list_head, sub_key_of, user_key_of
from statebackend.task import TaskStorage

__all__ = ["EXPIRY_FROM_OFFSET", "Expired", "sweep_expired"]

#: the input offset prefix under which a checkpoint records where the next expiry sweep of a store starts (the hex of
#: a key; empty: the first key): ``on_expiry``'s sweep is deterministic, a replay finds the keys its first run found
EXPIRY_FROM_OFFSET = "ttl.expiry.from."


@attrs.frozen
class Expired:
    """A key of a TTL store found expired by a batch's sweep and deleted: the store, the key and its last value (read
    through the store's serdes), and when it expired (ms since the epoch)."""

    store: str
    key: Any
    value: Any
    expired_at_ms: int


def _expired(serde: Any, data: bytes) -> Any:
    return serde.from_bytes(data) if serde is not None else data


def _expired_of(name: str, kind: str, typed: Any, found: list[tuple[bytes, int, bytes]]) -> list[Expired]:
    """The callbacks' :class:`Expired` of the records ``found`` expired in store ``name`` of ``kind``, read through
    the store's serdes (``typed``: its view): a value store's per key; a list's per element and a map's per entry,
    keyed by the user key (see :func:`sweep_expired`)."""
    key_serde, value_serde = getattr(typed, "key_serde", None), getattr(typed, "value_serde", None)
    if kind == "value":
        return [Expired(name, _expired(key_serde, k), _expired(value_serde, v), at_ms) for k, at_ms, v in found]
    expired = []
    for record, at_ms, value in found:
        if kind == "list" and is_list_head(record, store=name):
            continue  # the list's bounds, no value of its own
        key = _expired(key_serde, user_key_of(record, store=name))
        if kind == "list":
            expired.append(Expired(name, key, _expired(value_serde, value), at_ms))
        else:
            sub_key = _expired(getattr(typed, "subkey_serde", None), sub_key_of(record, store=name))
            expired.append(Expired(name, key, (sub_key, _expired(value_serde, value)), at_ms))
    return expired


def sweep_expired(storage: TaskStorage, plan: Plan) -> tuple[list[Expired], dict[str, str]]:
    """Each TTL store's expired keys among its next ``ttl.sweep.keys`` keys, from the cursor the batch's base
    checkpoint recorded (a rescale starts from the first key), deleted from ``storage``, in store then key order; and
    the cursors for the commit's offsets. The store's own sweep at the commit is off, so every key deleted for expiry
    gets its callback.

    A list or map store expires per element or entry (each carries its own expiry): one :class:`Expired` per
    expired element (``key`` the user key, ``value`` the element) or entry (``value`` the pair ``(sub_key,
    value)``), in the list's append order, the map's sub-key order. A list's head record is deleted with its
    last element but gets no callback of its own (it holds no value)."""
    base = plan.base.checkpoint.input_offsets if plan.base is not None else {}
    cursors: dict[str, str] = {}
    expired: list[Expired] = []
    for name in sorted(storage.settings.stores):
        store_settings = storage.settings.stores[name]
        if name == TIMERS_STORE or store_settings.ttl_ms is None or store_settings.ttl_sweep_keys <= 0:
            continue
        view = storage.ttl_view(name)  # the TTL view the task's reads and writes go through
        view.swept_elsewhere = True
        start = base.get(EXPIRY_FROM_OFFSET + name) or ""
        found, next_from = view.expired_from(bytes.fromhex(start) if start else None, store_settings.ttl_sweep_keys)
        cursors[EXPIRY_FROM_OFFSET + name] = next_from.hex() if next_from is not None else ""
        if not found:
            continue
        view.delete_many([key for key, _, _ in found])
        typed = storage.view(name)
        expired += _expired_of(name, store_settings.kind, typed, found)
        storage.metrics.increment("ttl.keys.expired", len(found))
    return expired, cursors
