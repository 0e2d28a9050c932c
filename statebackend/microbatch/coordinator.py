"""The driver's side of a micro-batch: the batch's coordination around the engine's run of its tasks.

:class:`BatchCoordinator` owns what happens on the driver between "run the tasks" and "hand the output on": which
tasks may hand their output on before their checkpoint is durable, the confirmation of those checkpoints in the
tasks' logs (:mod:`statebackend.microbatch.confirm`), the run again with every task waiting when one is not there, the
tasks that reported nothing, and what an operator sees: one INFO line per batch (:meth:`BatchReport.line`), the
attempts' warnings logged again on the driver, the metrics of every attempt merged into the driver's registry with
their task labels, and the ``on_batch`` listener. It needs no Spark: the engine adapter gives it a function that
runs the batch's tasks once (``run_tasks(confirm_on_driver)``).
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable, Sequence
from typing import Any, Self

import attrs

from statebackend.blobstores.base import BlobStore, open_blob_store
from statebackend.config import Settings
from statebackend.errors import ConfirmationError
from statebackend.metrics import Metrics
from statebackend.microbatch.confirm import unconfirmed_checkpoints
from statebackend.microbatch.protocol import BatchReport, TaskStats

__all__ = ["BatchCoordinator", "RunResult"]

log = logging.getLogger(__name__)

#: what one run of a batch's tasks gives back: a function that frees the held output, the output, the reports
RunResult = tuple[Callable[[], None], Any, list[TaskStats]]


@attrs.define(eq=False)
class BatchCoordinator:
    """The coordination of a job's batches on the driver (see the module docstring)."""

    settings: Settings
    num_tasks: int
    metrics: Metrics
    #: ``confirm_on_driver`` as the user gave it (None: on for a remote store) and its bound
    confirm_on_driver: bool | None = None
    confirm_timeout_s: float = 60.0
    on_replay: str = "redo"
    #: called with every batch's :class:`BatchReport` after the batch (its exception is logged, not raised)
    on_batch: Callable[[BatchReport], Any] | None = None
    #: a batch still running after this long says so on the driver, and again at every such interval (None: never)
    progress_every_s: float | None = 30.0
    last_report: BatchReport | None = attrs.field(init=False, default=None)
    history: list[TaskStats] = attrs.field(init=False, factory=list)
    last_confirm_ms: float = attrs.field(init=False, default=0.0)
    #: why the driver stopped confirming checkpoints (it could not read one), or None
    _confirm_off: str | None = attrs.field(init=False, default=None)
    _confirm_store: BlobStore | None = attrs.field(init=False, default=None)

    def confirms(self, *, speculation: bool) -> bool:
        """Whether this batch's tasks may hand their output on before their checkpoint is durable: wanted (by default
        on a remote store, whose uploads wait on the network) and a run again possible (a replay:
        ``on_replay="redo"`` and the previous batch's checkpoint kept through a run again and a retry in it:
        ``task.checkpoint.retained >= 3``), not with speculation (two attempts of a task would both hand output
        on), and not after the driver failed to read a checkpoint."""
        wanted = self.confirm_on_driver
        if wanted is None:
            wanted = self.settings.blob_store_url.startswith(("az:", "s3:"))
        if not wanted or self._confirm_off is not None:
            return False
        if self.on_replay != "redo" or self.settings.checkpoint_retained < 3:
            return False
        return not speculation

    def run(
        self,
        batch_id: int,
        run_tasks: Callable[[bool], RunResult],
        *,
        confirming: bool,
    ) -> tuple[Callable[[], None], Any, BatchReport]:
        """Run batch ``batch_id`` to its end: its tasks (``run_tasks``), the confirmation of checkpoints tasks did
        not wait for, and the run again when one is missing. Returns what frees the output, the output, and the
        batch's report (logged, and handed to ``on_batch``)."""
        started = time.monotonic()
        if self.last_report is None:
            log.info(
                "batch %d: the first batch of this query: each of the %d tasks opens its stores, restoring from "
                "the blob store what is not already on the executor's local disk",
                batch_id,
                self.num_tasks,
            )
        with _StillRunning(batch_id, self.num_tasks, self.progress_every_s):
            release, output, stats = run_tasks(confirming)
        try:
            problems = self._confirm(stats)
        except BaseException:
            release()
            raise
        missing = self._without_stats(stats, batch_id, confirming)
        if missing and confirming:
            # Such a task's output may come from an attempt that failed after handing it on, its checkpoint unknown
            problems.append(
                f"no statistics came back from task(s) {missing}: their output may be that of a failed "
                "attempt, cached before it failed, whose checkpoint cannot be confirmed"
            )
        reruns = 0
        if problems:
            # A checkpoint a task did not wait for is not in its log (its upload failed, its worker died with it, or
            # another attempt wrote there): nothing of this run reaches the sink. The batch runs again with every
            # task waiting for its own checkpoint: a replay (tasks whose checkpoint landed redo the batch from the
            # previous batch's).
            self.metrics.increment("spark.batch.reruns")
            log.warning(
                "batch %d: %d task checkpoint(s) not confirmed durable (%s); running the batch again with "
                "every task waiting for its checkpoint",
                batch_id,
                len(problems),
                "; ".join(problems),
            )
            discarded = sorted(stats, key=lambda s: (s.task_index, s.attempt))
            self.history.extend(discarded)
            self._merge_metrics(discarded)
            release()
            release, output, stats = run_tasks(False)
            self._without_stats(stats, batch_id, False)
            reruns = 1
        try:
            report = BatchReport.of(batch_id, stats, (time.monotonic() - started) * 1000.0, reruns)
            self.history.extend(report.tasks)
            self._merge_metrics(report.tasks, report.batch_ms)
            self.last_report = report
            self._tell(report)
        except BaseException:
            release()
            raise
        return release, output, report

    def carry_on_from(self, earlier: BatchCoordinator) -> None:
        """Go on from ``earlier`` (the coordinator of the job before its configuration changed): its history, its last
        report, and a confirmation it turned off for good (a driver that cannot read a checkpoint still cannot)."""
        self.history.extend(earlier.history)
        self.last_report = earlier.last_report
        self._confirm_off = earlier._confirm_off

    def close(self) -> None:
        if self._confirm_store is not None:
            self._confirm_store.close()
            self._confirm_store = None

    def _tell(self, report: BatchReport) -> None:
        """What an operator sees of the batch: its warnings from the tasks, its line, the listener."""
        for task in report.tasks:
            for warning in task.warnings:
                log.warning(
                    "batch %d %s (attempt %d): %s [%s]",
                    report.batch_id,
                    task.task,
                    task.attempt,
                    warning.message,
                    warning.logger,
                )
        log.info("%s", report.line())
        if self.on_batch is not None:
            try:
                self.on_batch(report)
            except Exception:
                log.exception("batch %d: the on_batch listener failed", report.batch_id)

    def _merge_metrics(self, stats: Sequence[TaskStats], batch_ms: float | None = None) -> None:
        """The attempts' metrics into the driver's registry, each series keeping its task (and store, backend)
        labels: the driver's endpoint has one series per task; job-wide figures are a ``sum`` in the query.
        ``batch_ms``: the wall time of the batch that counts (``spark.batch.ms``; not of a discarded run)."""
        self.metrics.merge_batch((s.metrics for s in stats), batch_ms=batch_ms, job_name=self.settings.job_name)

    def _without_stats(self, stats: Sequence[TaskStats], batch_id: int, confirming: bool) -> list[int]:
        """The tasks of the run that reported nothing. Spark counts a task as done when its output partition is in
        the executor's block manager, and a task attempt that failed after its output was stored (its Python worker
        killed right after the task, say) leaves it there: the attempt that follows reads that block and runs no
        task function, so neither reports. When every task waited for its checkpoint before handing its output on,
        such output is of a durable checkpoint, and only the report is lost; when tasks may have handed it on
        before (``confirming``), the caller runs the batch again."""
        missing = sorted(set(range(self.num_tasks)) - {s.task_index for s in stats})
        if missing:
            self.metrics.increment("spark.task.stats.missing", len(missing))
            log.warning(
                "batch %d: no statistics came back from task(s) %s of %d (their output was read from a block "
                "a failed attempt stored)%s",
                batch_id,
                missing,
                self.num_tasks,
                "; the batch runs again" if confirming else "",
            )
        return missing

    def _confirm(self, stats: Sequence[TaskStats]) -> list[str]:
        """Why the checkpoints of tasks that did not wait for them are not confirmed durable (empty: all are). A
        checkpoint the driver cannot read at all (no access to the blob store from the driver, say) is reported once
        and turns the confirmation off for good: the batch then runs again, and every later batch's tasks wait."""
        if not any(s.pending_checkpoint_id for s in stats):
            return []
        started = time.monotonic()
        try:
            if self._confirm_store is None:
                self._confirm_store = open_blob_store(self.settings.blob_store_url, self.settings.blob_store_options)
            problems = unconfirmed_checkpoints(self._confirm_store, self.settings, stats, self.confirm_timeout_s)
        except ConfirmationError as exc:
            log.error(
                "the driver cannot confirm task checkpoints (%s); from now on every task waits for its own "
                "checkpoint (StatefulForeachBatch(confirm_on_driver=False) says so from the start)",
                exc,
            )
            self._confirm_off = str(exc)
            problems = [str(exc)]
        self.last_confirm_ms = (time.monotonic() - started) * 1000.0
        self.metrics.record("spark.confirm.ms", self.last_confirm_ms)
        return problems


class _StillRunning:
    """While a batch's tasks run: a line on the driver every ``every_s`` seconds saying the batch is still at it (a
    first batch or a moved task restores state; a large batch processes), so a long batch is never silent."""

    def __init__(self, batch_id: int, num_tasks: int, every_s: float | None) -> None:
        self.batch_id, self.num_tasks, self.every_s = batch_id, num_tasks, every_s
        self._done = threading.Event()
        self._thread: threading.Thread | None = None

    def __enter__(self) -> Self:
        if self.every_s is not None:
            self._thread = threading.Thread(target=self._watch, name=f"statebackend-batch-{self.batch_id}", daemon=True)
            self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._done.set()
        if self._thread is not None:
            self._thread.join()

    def _watch(self) -> None:
        assert self.every_s is not None
        started = time.monotonic()
        while not self._done.wait(self.every_s):
            log.info(
                "batch %d: still running after %.0f s (%d tasks opening their stores (restoring what is not on "
                "local disk), running the function and committing; the executors' logs say more)",
                self.batch_id,
                time.monotonic() - started,
                self.num_tasks,
            )
