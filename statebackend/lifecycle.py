"""The open decision of a task: which checkpoint, which backend restores each store, the seq the attempt is fenced
at, and what this machine already holds. Computed once, by :func:`decide_open`, as a frozen :class:`OpenDecision`,
and used by every opener: :meth:`TaskStorage.open <statebackend.task.TaskStorage.open>`, the read-only restore
(:func:`~statebackend.restore.restored_stores`: ``read_state``, ``statebackend restore`` and ``dump``, rescaling's
sources) and the Spark executor, which lists once, plans its batch on the decision and hands it to the open.

Trust (docs/architecture.md, "Fencing" and "Short answers"):

- **Fencing.** The listing that chose the checkpoint also gives the head (the newest seq in the log); the attempt
  may only ever write ``head + 1`` (:attr:`OpenDecision.next_seq`). On a blob store with conditional writes the
  "listing" is one read of the task's checkpoint head, and the checkpoint log object that made the decision keeps
  the head's version: the attempt's first commit swaps exactly that version (a head moved on since refuses it).
  A caller that chose from its own listing (a Spark replay supersedes newer checkpoints on purpose) passes the
  head it saw as ``fence_seq``.
- **Local knowledge bounds the remote.** Each store dir's ``CHECKPOINT-V2`` names the newest checkpoint seq this
  machine saw durable (:attr:`OpenDecision.known_seq`); a listing that shows less is re-listed and then
  :class:`~statebackend.errors.InconsistentStateError`, never an empty start. A decision made before the stores were
  locked is checked again under the lock (:meth:`OpenDecision.confirm`).

A task's checkpoint log is made here too (:func:`task_checkpoint_log`), from the settings, in one way.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Collection, Iterable, Mapping
from pathlib import Path

import attrs

from statebackend.blobstores.base import BlobStore
from statebackend.checkpoint import CheckpointLog, CheckpointV1, CheckpointV2, LogEntry, read_local_checkpoint_binding
from statebackend.config import Settings, StoreSettings
from statebackend.errors import ConfigError, CorruptDataError, IncompatibleFormatError, InconsistentStateError
from statebackend.store.ttl import ENVELOPE
from statebackend.values import base_recorded, value_problems

__all__ = [
    "CheckpointChoice",
    "OpenDecision",
    "decide_open",
    "known_durable_seq",
    "recorded_serdes",
    "task_checkpoint_log",
]

log = logging.getLogger(__name__)

#: which checkpoint to restore: the newest, a log entry, or a predicate over log entries (newest match wins), or
#: ``None`` (start empty, fenced at the log's head)
CheckpointChoice = str | LogEntry | Callable[[LogEntry], bool] | None


@attrs.frozen
class OpenDecision:
    """What an open of ``task_name`` restores and where its commits go. Made by :func:`decide_open`; never built by
    hand (its fields are checked against each other there)."""

    task_name: str
    #: the log entry chosen (``None``: no checkpoint; the stores start empty)
    entry: LogEntry | None
    #: the newest seq of the listing the choice was made from, or the caller's ``fence_seq``: the attempt writes
    #: ``head + 1``, then one more per durable commit
    head: int
    #: the newest seq this machine saw durable when the decision was made (0: none)
    known_seq: int
    #: per store: the backends to restore it from, in order (configured ones first, then any other whose marker the
    #: checkpoint has); empty: the checkpoint holds no state of it and it starts empty
    restore_order: Mapping[str, tuple[str, ...]]

    @property
    def checkpoint(self) -> CheckpointV2 | None:
        """The checkpoint the stores are restored to (``None``: none, or a V1 checkpoint, which holds no state)."""
        if self.entry is None or isinstance(self.entry.checkpoint, CheckpointV1):
            return None
        return self.entry.checkpoint

    @property
    def seq(self) -> int:
        """The seq of the chosen checkpoint (0: none)."""
        return self.entry.seq if self.entry is not None else 0

    @property
    def next_seq(self) -> int:
        """The seq the attempt's first commit writes: the fence, from this decision and never a later listing."""
        return self.head + 1

    @property
    def floor(self) -> int:
        """The newest seq every later listing of the task's log must reach."""
        return max(self.known_seq, self.seq)

    def rebased(self, entry: LogEntry | None, settings: Settings) -> OpenDecision:
        """The same decision (same listing, same head: the fence does not move) restoring ``entry`` instead: a
        caller that plans on the listing (a Spark replay restores the checkpoint before the replayed batch, a
        rescaled batch starts empty). ``entry`` must be one the listing showed (at most the head)."""
        if entry is not None and entry.seq > self.head:
            raise InconsistentStateError(
                f"task {self.task_name}: checkpoint #{entry.seq} is above the head #{self.head} of the listing the "
                "decision was made from: the log moved on since. Decide again"
            )
        return _decided(settings, self.task_name, entry, self.head, self.known_seq, self.restore_order)

    def confirm(self, known_seq: int) -> None:
        """Check the decision against what this machine knows now (read again once the stores are locked): a
        checkpoint known durable above the head means the choice was made on a short answer."""
        if known_seq > self.head:
            raise InconsistentStateError(
                f"task {self.task_name}: checkpoint #{self.seq} was chosen from a listing that ended at #{self.head}, "
                f"but checkpoint #{known_seq} is known to be durable (local CHECKPOINT-V2): the choice was made on a "
                "short answer. Choose again"
            )


def decide_open(
    settings: Settings,
    task_name: str,
    checkpoint_log: CheckpointLog,
    *,
    choice: CheckpointChoice = "latest",
    fence_seq: int | None = None,
    store_names: Iterable[str] | None = None,
    raw_values: Collection[str] = (),
) -> OpenDecision:
    """Decide what an open of ``task_name`` restores, from one listing of ``checkpoint_log`` that reaches what this
    machine knows durable. ``choice``: ``"latest"``, a :class:`LogEntry`, a predicate (the newest matching entry),
    or ``None`` (start empty). ``fence_seq`` (with a LogEntry or ``None`` only): the head the caller saw when it
    chose; without it, a given entry's own seq fences. ``raw_values``: stores whose value serde is not checked
    against the checkpoint's record, for a reader that reads their values as stored bytes and decodes them itself
    from that record (``statebackend dump`` of a store the config lacks); never for an open that writes. Raises the
    log's floor to what it learned."""
    names = list(settings.stores) if store_names is None else list(store_names)
    known = known_durable_seq(settings.local_dir, settings.job_name, task_name, names)
    checkpoint_log.raise_floor(known)
    entry, head = _choose(checkpoint_log, choice, known, fence_seq)
    decision = _decided(settings, task_name, entry, head, known, names, raw_values)
    checkpoint_log.raise_floor(decision.floor)
    return decision


def task_checkpoint_log(settings: Settings, blob_store: BlobStore, task_name: str, *, floor: int = 0) -> CheckpointLog:
    """The checkpoint log of ``task_name``: the one place it is built from settings (versions, retention)."""
    return CheckpointLog(
        blob_store,
        settings.job_name,
        task_name,
        write_versions=settings.checkpoint_write_versions,
        read_versions=settings.checkpoint_read_versions,
        retained=settings.checkpoint_retained,
        floor=floor,
    )


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
            log.warning(
                "store %s of task %s: local checkpoint file ignored: %s",
                name,
                task_name,
                exc,
                extra={"job": job_name, "task": task_name, "store": name},
            )
            continue
        if found is None or found[1] is None:
            continue
        binding = found[1]
        if binding.job == job_name and binding.task == task_name:
            known = max(known, binding.seq)
    return known


def recorded_serdes(store_settings: StoreSettings) -> dict[str, str]:
    """What a checkpoint records of how a store's bytes read, from its settings alone: its serdes, ``envelope: ttl``
    with a TTL and ``kind`` for a list or map store (a task records more: :func:`statebackend.values.plan_values`)."""
    return base_recorded(store_settings)


def _decided(
    settings: Settings,
    task_name: str,
    entry: LogEntry | None,
    head: int,
    known: int,
    store_names: Iterable[str],
    raw_values: Collection[str] = (),
) -> OpenDecision:
    """The decision for ``entry``, checked: a V1 entry below what is known durable as V2, serdes that would read the
    state as garbage."""
    if entry is not None and isinstance(entry.checkpoint, CheckpointV1):
        if known >= entry.seq:
            raise InconsistentStateError(
                f"task {task_name}: checkpoint #{entry.seq} reads as a V1 checkpoint (offsets only, no state), but "
                f"this machine saw checkpoint #{known} durable as a V2 checkpoint with state: its V2 blob is "
                f"missing or unreadable. Nothing was restored or cleared; put the V2 blob back"
            )
        log.warning(
            "checkpoint #%d is a V1 checkpoint (input offsets only): stores start empty",
            entry.seq,
            extra={"seq": entry.seq},
        )
    checkpoint = entry.checkpoint if entry is not None and isinstance(entry.checkpoint, CheckpointV2) else None
    _check_serdes(settings, checkpoint, raw_values)
    order = {name: _restore_order(name, settings.stores[name], checkpoint) for name in store_names}
    return OpenDecision(task_name=task_name, entry=entry, head=head, known_seq=known, restore_order=order)


def _choose(
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


def _restore_order(store_name: str, store_settings: StoreSettings, checkpoint: CheckpointV2 | None) -> tuple[str, ...]:
    """The backends to restore ``store_name`` from, in order: configured ones first, then any other backend whose
    marker the checkpoint has (a migration); only backends with a marker count."""
    if checkpoint is None:
        return ()
    preferred = store_settings.restore_factories
    order = dict.fromkeys((*preferred, *store_settings.backup_factories, *checkpoint.state_checkpoint_markers))
    usable = tuple(f for f in order if store_name in checkpoint.markers_for(f))
    if usable and usable[0] != preferred[0]:
        log.warning(
            "store %s: checkpoint %s has no %s marker; restoring from the %s backend instead",
            store_name,
            checkpoint.checkpoint_id,
            preferred[0],
            usable[0],
            extra={"store": store_name, "checkpoint_id": str(checkpoint.checkpoint_id)},
        )
    return usable


def _check_serdes(settings: Settings, checkpoint: CheckpointV2 | None, raw_values: Collection[str] = ()) -> None:
    """A store's serdes must read what its state was written with: else its bytes would read as garbage. Keys keep
    their serde; values too, unless their record class reads every recorded schema or a declared migration rewrites
    them (statebackend.values)."""
    if checkpoint is None:
        return
    problems = []
    for name, store_settings in settings.stores.items():
        written = checkpoint.serdes.get(name)
        values = [] if name in raw_values else value_problems(name, store_settings, checkpoint)
        if written is None:
            problems += values
            continue
        if "key" in written and written["key"] != store_settings.key_serde:
            problems.append(
                f"stores.{name}.key.serde is {store_settings.key_serde!r} but store {name!r} was written with "
                f"{written['key']!r} (checkpoint {checkpoint.checkpoint_id}); set stores.{name}.key.serde="
                f"{written['key']}, or migrate the data into a new store"
            )
        problems += values
        envelope = written.get("envelope")
        if (envelope == ENVELOPE) != (store_settings.ttl_ms is not None):
            problems.append(
                f"stores.{name}.ttl.ms is set but store {name!r} was written without a TTL (checkpoint "
                f"{checkpoint.checkpoint_id}): its values carry no expiry. Unset stores.{name}.ttl.ms, or copy the "
                "data into a new store that has it"
                if envelope is None
                else f"store {name!r} was written with a TTL (checkpoint {checkpoint.checkpoint_id}): its values carry "
                f"an expiry that reads without stores.{name}.ttl.ms would take for data. Set stores.{name}.ttl.ms "
                "(any duration: the stored expiries stay), or copy the data into a new store"
            )
    if problems:
        raise ConfigError("\n".join(problems))
