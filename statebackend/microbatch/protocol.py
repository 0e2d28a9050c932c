"""The one message between a task attempt and the driver (:class:`TaskStats`), and what the driver makes of a
batch's messages (:class:`BatchReport`).

An attempt sends exactly one :class:`TaskStats` per run of its task function, after its commit (or its skip). How it
travels is the engine adapter's business (``statebackend.spark.stats``: an accumulator on classic Spark, the last
element or one extra row of the task's output otherwise); what it says is fixed here:

- what the attempt did: where it started (``base_seq``), what it committed (``committed_seq``; 0: skipped), rows in
  and out, times of open, function and commit, timers fired and pending, the event-time clock it used;
- whether its checkpoint was durable before its output left it (``pending_checkpoint_id`` empty) or is for the
  driver to confirm (the id and ``attempt_token`` the driver looks for in the task's log);
- what an operator should hear about (``warnings``: retries, a restore that fell back to another backend, a slow
  restore, a skipped or blocked commit, a task moved to a private directory), logged again on the driver;
- its metrics (a mergeable snapshot, labelled with job and task).
"""

from __future__ import annotations

from collections.abc import Sequence

import attrs

from statebackend.metrics import MetricsSnapshot, percentile

__all__ = ["AttemptWarning", "BatchReport", "TaskStats"]


@attrs.frozen
class AttemptWarning:
    """Something a task attempt logged at WARNING or above, carried back to the driver's log: the attempt's logger
    name, level name and message (already formatted, credentials redacted as in every log line)."""

    logger: str
    level: str
    message: str


@attrs.frozen
class TaskStats:
    """What one task attempt did in one batch: the protocol message from a task attempt to the driver.

    Times are milliseconds of wall time in the attempt; ``commit_ms`` is the whole commit when the attempt waited
    for its checkpoint, the sync part only when it handed its output on first (``pending_checkpoint_id``)."""

    batch_id: int
    task_index: int
    #: Spark's attempt number of the task (0: the first)
    attempt: int
    #: sequence number of the checkpoint the attempt started from (0: none), and of the one it committed (0: skipped)
    base_seq: int
    committed_seq: int
    #: open (or take-back) with any restore; the user's function and timers; the commit
    open_ms: float
    process_ms: float
    commit_ms: float
    #: sync part of the commit (flush + snapshot): the part that blocks processing
    commit_sync_ms: float
    input_rows: int
    output_rows: int
    #: the attempt worked in a private directory: another attempt of the task held its local stores
    private_dir: bool
    #: what the attempt counted (commits, restores, blob-store requests), mergeable: the driver adds them up per batch
    metrics: MetricsSnapshot | None = None
    #: the task was kept open from an earlier batch in this worker (no open, no restore, no close)
    kept_open: bool = False
    #: where the attempt ran: ``host:working directory`` of the executor
    executor: str = ""
    #: the id of the checkpoint (``committed_seq``) this attempt committed without waiting for it to be durable: the
    #: driver confirms it in the task's log before the batch ends, with ``attempt_token`` (its input offset
    #: ``attempt``). Empty: the checkpoint was durable before the task handed its output on
    pending_checkpoint_id: str = ""
    attempt_token: str = ""
    #: the driver's token of the run of the batch this attempt belongs to (:attr:`BatchSpec.run_id`)
    run_id: str = ""
    #: timers the attempt fired (handed to ``on_timers``); the watermark its batch used and the largest event time
    #: seen up to and including it (None: no event time)
    timers_fired: int = 0
    watermark_ms: int | None = None
    event_max_ms: int | None = None
    #: timers the task's timer store holds after the batch (None: the job has no timers)
    timers_pending: int | None = None
    #: what the attempt logged at WARNING or above (at most :data:`MAX_WARNINGS`), logged again on the driver
    warnings: tuple[AttemptWarning, ...] = ()

    @property
    def task(self) -> str:
        return f"task-{self.task_index}"

    @property
    def total_ms(self) -> float:
        return self.open_ms + self.process_ms + self.commit_ms

    def counter(self, name: str) -> float:
        """A counter of the attempt's metrics (0 without metrics), summed over its labels."""
        return self.metrics.counter(name) if self.metrics is not None else 0.0


#: warnings an attempt carries back at most (the rest are counted: ``spark.task.warnings.dropped``)
MAX_WARNINGS = 20


@attrs.frozen
class BatchReport:
    """What a batch did, from its tasks' :class:`TaskStats`: the driver logs it as one INFO line and hands it to the
    ``on_batch`` listener. Every field is a plain number or string; ``tasks`` holds the messages themselves."""

    batch_id: int
    #: every task attempt's message of the run whose output was used (sorted by task)
    tasks: tuple[TaskStats, ...]
    #: wall time of the whole batch on the driver (tasks, confirmation, a run again), ms
    batch_ms: float
    #: the batch ran a second time because a checkpoint a task did not wait for was not confirmed
    reruns: int = 0
    input_rows: int = attrs.field(init=False)
    output_rows: int = attrs.field(init=False)
    #: tasks that committed the batch, and those that skipped it (``on_replay="skip"`` of a committed batch)
    committed: int = attrs.field(init=False)
    skipped: int = attrs.field(init=False)
    #: tasks taken back open in their worker, and stores restored: reused as they were on local disk, caught up with
    #: the missing deltas, or restored in full; bytes downloaded by the restores
    kept_open: int = attrs.field(init=False)
    stores_reused: int = attrs.field(init=False)
    stores_caught_up: int = attrs.field(init=False)
    stores_restored: int = attrs.field(init=False)
    restore_bytes: int = attrs.field(init=False)
    #: commit time per task (p50 and max), and the task that took longest in all (open + function + commit)
    commit_p50_ms: float = attrs.field(init=False)
    commit_max_ms: float = attrs.field(init=False)
    slowest_task: str = attrs.field(init=False)
    slowest_ms: float = attrs.field(init=False)
    timers_fired: int = attrs.field(init=False)
    #: requests to the blob store made by the tasks, and bytes they uploaded
    blob_requests: int = attrs.field(init=False)
    uploaded_bytes: int = attrs.field(init=False)
    warnings: int = attrs.field(init=False)

    def __attrs_post_init__(self) -> None:
        tasks = self.tasks
        commits = [t.commit_ms for t in tasks if t.committed_seq]
        slowest = max(tasks, key=lambda t: t.total_ms, default=None)
        values = {
            "input_rows": sum(t.input_rows for t in tasks),
            "output_rows": sum(t.output_rows for t in tasks),
            "committed": sum(1 for t in tasks if t.committed_seq),
            "skipped": sum(1 for t in tasks if not t.committed_seq),
            "kept_open": sum(1 for t in tasks if t.kept_open),
            "stores_reused": int(sum(t.counter("restore.stores.reused") for t in tasks)),
            "stores_caught_up": int(sum(t.counter("restore.stores.caught.up") for t in tasks)),
            "stores_restored": int(sum(t.counter("restore.stores.full") for t in tasks)),
            "restore_bytes": int(sum(t.counter("restore.bytes") for t in tasks)),
            "commit_p50_ms": percentile(commits, 0.5) if commits else 0.0,
            "commit_max_ms": max(commits, default=0.0),
            "slowest_task": slowest.task if slowest is not None else "",
            "slowest_ms": slowest.total_ms if slowest is not None else 0.0,
            "timers_fired": sum(t.timers_fired for t in tasks),
            "blob_requests": int(sum(t.counter("blob_store.requests") for t in tasks)),
            "uploaded_bytes": int(sum(t.counter("commit.bytes.uploaded") for t in tasks)),
            "warnings": sum(len(t.warnings) for t in tasks),
        }
        for name, value in values.items():
            object.__setattr__(self, name, value)

    @classmethod
    def of(cls, batch_id: int, tasks: Sequence[TaskStats], batch_ms: float, reruns: int = 0) -> BatchReport:
        return cls(batch_id, tuple(sorted(tasks, key=lambda t: (t.task_index, t.attempt))), batch_ms, reruns)

    def line(self) -> str:
        """The one line the driver logs at INFO for the batch."""
        restores = f"{self.stores_reused} reused"
        if self.stores_caught_up:
            restores += f", {self.stores_caught_up} caught up"
        if self.stores_restored or self.restore_bytes:
            restores += f", {self.stores_restored} restored ({_bytes(self.restore_bytes)})"
        parts = [
            f"batch {self.batch_id}: {len(self.tasks)} tasks ({self.committed} committed"
            + (f", {self.skipped} skipped" if self.skipped else "")
            + f", {self.kept_open} kept open)",
            f"rows {self.input_rows} in, {self.output_rows} out",
            f"stores {restores}",
            f"commit p50 {self.commit_p50_ms:.0f} ms, max {self.commit_max_ms:.0f} ms",
            f"slowest {self.slowest_task} {self.slowest_ms:.0f} ms",
            f"timers fired {self.timers_fired}",
            f"blob requests {self.blob_requests}, uploaded {_bytes(self.uploaded_bytes)}",
            f"{self.batch_ms:.0f} ms",
        ]
        if self.reruns:
            parts.append(f"ran {1 + self.reruns} times")
        if self.warnings:
            parts.append(f"{self.warnings} warning(s) from tasks")
        return "; ".join(parts)


def _bytes(count: float) -> str:
    for unit in ("B", "KiB", "MiB", "GiB"):
        if count < 1024 or unit == "GiB":
            return f"{count:.0f} {unit}" if unit == "B" else f"{count:.1f} {unit}"
        count /= 1024
    return f"{count:.1f} GiB"
