"""Which checkpoint is which micro-batch: the input offsets the driver writes, task names, and the choice of the
checkpoint a batch starts from (its base), replays included."""

from __future__ import annotations

import logging
from collections.abc import Callable

import attrs

from statebackend.checkpoint import CheckpointLog, LogEntry
from statebackend.errors import ConfigError, InconsistentStateError, NotFoundError
from statebackend.store.ttl import CLOCK_OFFSET

log = logging.getLogger(__name__)

#: input offset keys of every checkpoint the driver writes
BATCH_OFFSET = "batch"
TASKS_OFFSET = "tasks"
#: the batch's clock (ms since the epoch), chosen by the driver when the batch first ran: TTL stores read and write at
#: it, and a replay of the batch reads it back from the task's checkpoint of that batch, so it sees the same keys
NOW_OFFSET = CLOCK_OFFSET
#: event time (``statebackend.microbatch.watermark``): the watermark the batch fired event-time timers at, and the
#: largest event time seen up to and including the batch (of every task's batches before it, and of this task's input)
WATERMARK_OFFSET = "watermark.ms"
EVENT_MAX_OFFSET = "event.max.ms"
#: a random token per task attempt and commit: two attempts may issue the same checkpoint id (ids follow the
#: restored checkpoint's when the clock is behind it), the driver's confirmation tells them apart by this
ATTEMPT_OFFSET = "attempt"
#: under ``state.local.dir``: private directories of concurrent attempts of a task on one machine
ATTEMPTS_DIR = ".attempts"
#: under ``state.local.dir``: scratch restores of old tasks' checkpoints while a rescaled batch takes its key groups
RESCALE_DIR = ".rescale"

MODES = ("rows", "arrow", "pandas")
ON_REPLAY = ("redo", "skip")


def task_name(index: int) -> str:
    """The task name of partition ``index``: ``task-<index>``."""
    return f"task-{index}"


KEY_GROUPS_OFFSET = "key_groups"


@attrs.frozen
class Layout:
    """How a batch's keys were spread over tasks: ``tasks`` tasks over ``key_groups`` key groups (None: state written
    before key groups, hashed modulo ``tasks``)."""

    tasks: int
    key_groups: int | None

    def __str__(self) -> str:
        groups = "hash modulo num_tasks" if self.key_groups is None else f"{self.key_groups} key groups"
        return f"num_tasks={self.tasks} ({groups})"


def batch_of(entry: LogEntry, name: str, num_tasks: int | None = None) -> int:
    """The batch id a checkpoint the driver wrote holds (``num_tasks`` is not checked: see :func:`layout_of`)."""
    offsets = entry.checkpoint.input_offsets
    batch = offsets.get(BATCH_OFFSET)
    if batch is None or not (str(batch).isdigit() or batch == "-1"):  # -1: an initial-state load before batch 0
        raise ConfigError(
            f"{name}: checkpoint #{entry.seq} has no {BATCH_OFFSET!r} input offset ({dict(offsets)}); this state was "
            "not written by the Spark driver: give the Spark job its own job.name"
        )
    return int(batch)


def layout_of(entry: LogEntry, name: str) -> Layout:
    offsets = entry.checkpoint.input_offsets
    tasks, groups = offsets.get(TASKS_OFFSET), offsets.get(KEY_GROUPS_OFFSET)
    if tasks is None or not str(tasks).isdigit() or (groups is not None and not str(groups).isdigit()):
        raise ConfigError(
            f"{name}: checkpoint #{entry.seq} does not say how its batch was spread over tasks ({dict(offsets)}); "
            "this state was not written by the Spark driver: give the Spark job its own job.name"
        )
    return Layout(int(tasks), None if groups is None else int(groups))


@attrs.frozen
class Plan:
    """Where task ``name`` of batch ``batch_id`` starts from: its own ``base`` checkpoint (None: empty), or, when the
    previous batch ran with another layout, the checkpoints of the old tasks holding its key groups (``sources``)."""

    base: LogEntry | None
    sources: tuple[tuple[str, LogEntry], ...] = ()
    previous: Layout | None = None

    @property
    def rescaled(self) -> bool:
        return self.previous is not None


def plan_batch(
    checkpoint_log: CheckpointLog,
    latest: LogEntry | None,
    name: str,
    batch_id: int,
    layout: Layout,
    open_log: Callable[[str], CheckpointLog],
    *,
    previous_seen: bool = False,
) -> Plan:
    """Where a task of ``batch_id`` under ``layout`` starts from (``open_log(task)``: another task's checkpoint log).

    The layout of the previous batch is that of task-0's newest checkpoint below ``batch_id`` (task-0 runs in every
    layout, and every task commits every batch). When it is this batch's layout, the task restores its own newest
    checkpoint below ``batch_id``; otherwise the batch is *rescaled* for this task: it starts from the old tasks'
    checkpoints of the previous batch, keeping the keys of the key groups it owns now.

    A task's own checkpoint of the previous batch in this layout may be of an abandoned attempt (the batch failed,
    and was replayed with another num_tasks that this task is not part of): only task-0's log tells. It is read
    unless ``previous_seen``: the driver itself ran the previous batch to its end with this layout."""
    zero = task_name(0)
    own = _newest_below(checkpoint_log, latest, name, batch_id)
    if (
        own is not None
        and batch_of(own, name) == batch_id - 1
        and layout_of(own, name) == layout
        and (previous_seen or name == zero)
    ):
        return Plan(own)  # the normal case: the previous batch ran with this layout
    if name == zero:
        first = own
    else:
        zero_log = open_log(zero)
        first = _newest_below(zero_log, zero_log.latest(), zero, batch_id)
    if first is None:
        if own is not None:
            raise InconsistentStateError(
                f"{name}: checkpoint #{own.seq} (batch {batch_of(own, name)}) exists but {zero} has no checkpoint "
                f"below batch {batch_id}: the job's checkpoints of {zero} are missing from the blob store (deleted, "
                "or the store was restored from an older copy), or two queries share job.name"
            )
        return Plan(None)  # the job's first batch
    previous_batch = batch_of(first, zero)
    _check_no_gap(first, zero, previous_batch, batch_id, checkpoint_log)
    previous = layout_of(first, zero)
    if previous == layout:
        if own is None or batch_of(own, name) != previous_batch or layout_of(own, name) != layout:
            raise InconsistentStateError(
                f"{name}: batch {previous_batch} ran with {layout} ({zero}'s checkpoint #{first.seq}) but this "
                f"task's newest checkpoint below batch {batch_id} is "
                f"{'none' if own is None else f'#{own.seq} (batch {batch_of(own, name)}, {layout_of(own, name)})'}:"
                " its checkpoints are missing from the blob store (deleted, or the store was restored from an older "
                "copy)"
            )
        return Plan(own)
    if previous.key_groups is not None and layout.key_groups != previous.key_groups:
        raise ConfigError(
            f"{name}: the state is spread over key_groups={previous.key_groups} but this query uses "
            f"key_groups={layout.key_groups}: the number of key groups is fixed for the life of the state; set "
            f"key_groups={previous.key_groups} (num_tasks may change, up to it), or start a new job.name"
        )
    sources = []
    for old in _old_tasks_holding(name, layout, previous):
        old_name = task_name(old)
        old_log = checkpoint_log if old_name == name else open_log(old_name)
        entry = _newest_below(old_log, old_log.latest(), old_name, batch_id)
        if entry is None or batch_of(entry, old_name) != previous_batch or layout_of(entry, old_name) != previous:
            raise InconsistentStateError(
                f"{name}: rescaling from {previous} to {layout} needs {old_name}'s checkpoint of batch "
                f"{previous_batch}, but its newest below batch {batch_id} is "
                f"{'none' if entry is None else f'#{entry.seq} (batch {batch_of(entry, old_name)})'}: its "
                "checkpoints are missing from the blob store"
            )
        sources.append((old_name, entry))
    log.info(
        "%s: batch %d runs with %s, batch %d ran with %s: restoring this task's key groups from %s",
        name,
        batch_id,
        layout,
        previous_batch,
        previous,
        ", ".join(n for n, _ in sources),
    )
    return Plan(None, tuple(sources), previous)


def _old_tasks_holding(name: str, layout: Layout, previous: Layout) -> list[int]:
    """The tasks of the previous layout that may hold keys of this task's key groups now."""
    if previous.key_groups is None or layout.key_groups is None:
        return list(range(previous.tasks))  # hashed modulo num_tasks: any old task may hold any key group
    from statebackend.microbatch.keygroups import key_group_range, task_of_group

    mine = key_group_range(int(name.rsplit("-", 1)[1]), layout.tasks, layout.key_groups)
    if not mine:
        return []
    first = task_of_group(mine.start, previous.tasks, previous.key_groups)
    last = task_of_group(mine.stop - 1, previous.tasks, previous.key_groups)
    return list(range(first, last + 1))


def _newest_below(checkpoint_log: CheckpointLog, latest: LogEntry | None, name: str, batch_id: int) -> LogEntry | None:
    if latest is None:
        return None
    if batch_of(latest, name) < batch_id:
        return latest
    newest_batch = batch_of(latest, name)
    if newest_batch > batch_id:
        raise InconsistentStateError(
            f"{name}: Spark runs batch {batch_id} but the state already committed batch {newest_batch} (checkpoint "
            f"#{latest.seq} in {checkpoint_log.blob_store.describe()}); Spark only re-runs its last batch, so its "
            "checkpoint location was reset or another query uses the same job.name. Restore the Spark checkpoint, "
            "or start over with a new job.name (or delete the old state)"
        )
    base = checkpoint_log.find(lambda entry: batch_of(entry, name) < batch_id)
    if base is None and min(checkpoint_log.seqs(), default=1) > 1:
        raise NotFoundError(
            f"{name}: batch {batch_id} is replayed but the checkpoint before it was deleted by retention "
            f"(task.checkpoint.retained); raise task.checkpoint.retained so a batch can be replayed that often"
        )
    if base is not None:
        log.info(
            "%s: batch %d is replayed; restoring checkpoint #%d (batch %s) and redoing it",
            name,
            batch_id,
            base.seq,
            base.checkpoint.input_offsets.get(BATCH_OFFSET),
        )
    return base


def _check_no_gap(entry: LogEntry, name: str, newest_batch: int, batch_id: int, checkpoint_log: CheckpointLog) -> None:
    if newest_batch < batch_id - 1:
        # Spark starts batch B only once B-1 has finished, and every task commits every batch: a newest checkpoint
        # older than B-1 means the checkpoints after it are gone (deleted, or the blob store was rolled back).
        # Restoring it would silently drop acknowledged batches.
        raise InconsistentStateError(
            f"{name}: Spark runs batch {batch_id} but the newest checkpoint of this task is of batch {newest_batch} "
            f"(checkpoint #{entry.seq} in {checkpoint_log.blob_store.describe()}): the checkpoints of batches "
            f"{newest_batch + 1}..{batch_id - 1} are missing from the blob store (deleted, or the store was restored "
            "from an older copy). Refusing to restore older state: bring the missing checkpoints back, or start over "
            "with a new job.name and a new Spark checkpoint location"
        )


def at_or_below(name: str, batch_id: int, num_tasks: int) -> Callable[[LogEntry], bool]:
    def choose(entry: LogEntry) -> bool:
        return batch_of(entry, name, num_tasks) <= batch_id

    return choose
