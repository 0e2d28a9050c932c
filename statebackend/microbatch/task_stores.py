"""What a task attempt's user code gets: :class:`TaskStores` (the task's stores by name, where it runs, the batch's
times and its timers), the counted input, and the shape of the work over it. Kept apart from the attempt's state
machine (:mod:`statebackend.microbatch.attempt`, which re-exports these names)."""

from __future__ import annotations

from collections.abc import Callable, Iterator, Mapping
from typing import Any

from statebackend.errors import ConfigError
from statebackend.microbatch.held import HeldOutput
from statebackend.microbatch.timers import TIMERS_STORE, Timers
from statebackend.store.kinds import ListStore, MapStore
from statebackend.task import TaskStorage, ValueStore

__all__ = ["Counted", "TaskStores", "Work"]


class TaskStores(Mapping[str, Any]):
    """What the user function and the timer handler get: the task's stores by name (typed views per their serdes),
    where it runs, the batch's times (``now_ms``: the batch clock; ``watermark_ms``: the event-time watermark, None
    without one) and the task's :class:`~statebackend.microbatch.timers.Timers`. The timer store is not among the
    stores."""

    def __init__(
        self,
        storage: TaskStorage,
        task_index: int,
        batch_id: int,
        *,
        timers: Timers | None = None,
        now_ms: int | None = None,
        watermark_ms: int | None = None,
        event_ms: Callable[[Any], int] | None = None,
    ) -> None:
        self.storage = storage
        self.task_index = task_index
        self.task_name = storage.task_name
        self.batch_id = batch_id
        self.timers = timers if timers is not None else Timers(None)
        self.now_ms = now_ms if now_ms is not None else storage.now_ms()
        self.watermark_ms = watermark_ms
        self._event_ms = event_ms

    def is_late(self, event_time: Any) -> bool:
        """Whether a row with ``event_time`` (as the event-time column holds it: a datetime, or ms since the epoch)
        is late: below the batch's watermark, as Spark drops it (a row at the watermark is on time). False while
        there is no watermark; None (a null event time) is never late."""
        if self._event_ms is None:
            raise ConfigError(
                "stores.is_late needs an event-time column: give StatefulForeachBatch(event_time=..., "
                "watermark_delay=...)"
            )
        if event_time is None or self.watermark_ms is None:
            return False
        return self._event_ms(event_time) < self.watermark_ms

    def __getitem__(self, name: str) -> Any:
        if name not in self.storage.stores or name == TIMERS_STORE:
            raise KeyError(name)
        return self.storage.view(name)

    def store(self, name: str) -> ValueStore:
        """The value store ``name``, typed (see :meth:`TaskStorage.store`): a list or map store is a
        :class:`~statebackend.errors.KindError` naming the accessor that gives it."""
        return self.storage.store(self._user_store(name))

    def list_store(self, name: str) -> ListStore:
        """The list store ``name``, typed (see :meth:`TaskStorage.list_store`)."""
        return self.storage.list_store(self._user_store(name))

    def map_store(self, name: str) -> MapStore:
        """The map store ``name``, typed (see :meth:`TaskStorage.map_store`)."""
        return self.storage.map_store(self._user_store(name))

    def _user_store(self, name: str) -> str:
        """``name``, unless it is the timer store: the function reaches timers through ``stores.timers``."""
        if name == TIMERS_STORE:
            raise ConfigError(
                f"store {name!r} holds the task's timers: use stores.timers; the stores are "
                f"{', '.join(sorted(self)) or 'none'}"
            )
        return name

    def __iter__(self) -> Iterator[str]:
        return (name for name in self.storage.stores if name != TIMERS_STORE)

    def __len__(self) -> int:
        return sum(1 for _ in self)


class Counted:
    """An iterator that counts what passes through it (rows, or rows of batches)."""

    def __init__(self, inner: Iterator[Any], size: Callable[[Any], int] | None = None) -> None:
        self.inner = inner
        self.size = size
        self.count = 0

    def __iter__(self) -> Iterator[Any]:
        return self

    def __next__(self) -> Any:
        item = next(self.inner)
        self.count += 1 if self.size is None else self.size(item)
        return item


#: the user's work over the task's input: ``work(stores, held)`` puts the function's (converted, checked) output
#: into ``held`` and returns it
Work = Callable[[TaskStores], HeldOutput]
