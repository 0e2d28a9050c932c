"""What the commands share: the run (settings, blob store, output), exit codes, formatting, checkpoint choice, the
backends' admins, and the layout of a job on the blob store."""

from __future__ import annotations

import argparse
import datetime
import json
import re
import sys
from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence
from concurrent.futures import Executor, Future
from typing import Any, Self, TypeVar

import attrs

from statebackend.blobstores.base import BlobStore, open_blob_store
from statebackend.checkpoint import CheckpointLog, LogEntry
from statebackend.config import Settings
from statebackend.contracts import BackendContext, BlobLifetime, StateBackendAdmin, StateBackendFactory
from statebackend.errors import ConfigError, NotFoundError, UsageError
from statebackend.lifecycle import task_checkpoint_log
from statebackend.metrics import Metrics
from statebackend.redact import redact
from statebackend.registry import resolve_factory

EXIT_OK = 0
EXIT_FAILURE = 1
EXIT_USAGE = 2
EXIT_CONFIG = 3
EXIT_NOT_FOUND = 4
EXIT_VERIFY_FAILED = 5
EXIT_UNVERIFIED = 6
EXIT_INTERRUPTED = 130
EXIT_PIPE = 141

T = TypeVar("T")

#: ``<job>/<task>/checkpoints/<seq:012d>.v<version>.json``
#: a blob of a task's checkpoint log: a per-seq checkpoint (or move marker), or the head (stores with conditional
#: writes); a listing finds the tasks by them, the log's API counts and reads the checkpoints
CHECKPOINT_NAME = re.compile(r"^([^/]+)/([^/]+)/checkpoints/(?:[0-9]{12}|HEAD)\.v[1-9][0-9]*\.json$")
_CHECKPOINT_ID = re.compile(r"^[0-9]{1,19}-[0-9]{1,6}$")


@attrs.define(eq=False)
class Run:
    """One invocation: parsed arguments, settings, the open blob store, and the output."""

    args: argparse.Namespace
    settings: Settings
    blob_store: BlobStore
    config: dict[str, Any]

    @classmethod
    def open(cls, args: argparse.Namespace, config: dict[str, Any]) -> Run:
        settings = Settings.from_config(config)
        blob_store = open_blob_store(settings.blob_store_url, settings.blob_store_options)
        return cls(args=args, settings=settings, blob_store=blob_store, config=config)

    def __enter__(self) -> Self:
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.blob_store.close()

    @property
    def job(self) -> str:
        return str(getattr(self.args, "job", None) or self.settings.job_name)

    @property
    def json(self) -> bool:
        return bool(getattr(self.args, "json", False))

    def print(self, line: str = "") -> None:
        """One line on stdout, redacted."""
        sys.stdout.write(redact(line) + "\n")

    def print_json(self, value: Any) -> None:
        self.print(json.dumps(value, sort_keys=False, default=str))

    def warn(self, line: str) -> None:
        print(redact(line), file=sys.stderr)

    def progress(self, items: Iterable[T], *, total: int | None = None, desc: str = "") -> Iterator[T]:
        """``items``, with a progress bar on stderr when it is a terminal and --no-progress was not given."""
        enabled = sys.stderr.isatty() and not getattr(self.args, "no_progress", False)
        if not enabled:
            yield from items
            return
        from tqdm import tqdm

        yield from tqdm(items, total=total, desc=desc, file=sys.stderr, leave=False, unit="")

    def log(self, task: str, job: str | None = None) -> CheckpointLog:
        """The checkpoint log of ``task`` of ``job`` (default: the job of this run)."""
        job = self.job if job is None else job
        settings = self.settings if job == self.settings.job_name else attrs.evolve(self.settings, job_name=job)
        return task_checkpoint_log(settings, self.blob_store, task)

    def admin(self, task: str, factory_name: str) -> StateBackendAdmin | None:
        """The admin of backend ``factory_name`` (as a checkpoint names it) for ``task``; ``None`` when the backend
        is not installed here."""
        backend = self.backend(task, factory_name)
        return backend[0].admin(backend[1]) if backend is not None else None

    def blob_lifetime(self, task: str, factory_name: str) -> BlobLifetime | None:
        """What backend ``factory_name`` states about the blobs of ``task`` (its ``shared_prefixes``, say), from a
        backup manager of no store that is never started; ``None`` when the backend is not installed here or states
        nothing (a backend of the earlier contract)."""
        backend = self.backend(task, factory_name)
        return backend[0].backup_manager(backend[1]).blob_lifetime() if backend is not None else None

    def backend(self, task: str, factory_name: str) -> tuple[StateBackendFactory, BackendContext] | None:
        """The factory of backend ``factory_name`` and a context of ``task`` with no store (nothing is opened); ``None``
        when the backend is not installed here."""
        try:
            factory = resolve_factory(factory_name).factory
        except ConfigError:
            return None
        context = BackendContext(
            factory_name=factory_name,
            job_name=self.job,
            task_name=task,
            stores={},
            blob_store=self.blob_store,
            checkpoint_log=self.log(task),
            executor=NoExecutor(),
            metrics=Metrics(),
            options=self.settings.backend_options_for(factory_name),
        )
        return factory, context

    def choose(self, task: str, choice: str) -> LogEntry:
        """The checkpoint ``choice`` names: ``latest``, a seq, or a checkpoint id."""
        log = self.log(task)
        entry: LogEntry | None
        if choice == "latest":
            entry = log.latest()
            if entry is None:
                raise NotFoundError(self.no_checkpoints(task))
            return entry
        if choice.lstrip("#").isdigit():
            seq = int(choice.lstrip("#"))
            if seq < 1:
                raise UsageError(f"--checkpoint {choice}: a seq is 1 or more")
            return log.read(seq)
        if _CHECKPOINT_ID.match(choice):
            entry = log.find(lambda e: str(getattr(e.checkpoint, "checkpoint_id", "")) == choice)
            if entry is None:
                raise NotFoundError(
                    f"task {task} of job {self.job} has no checkpoint with id {choice} under "
                    f"{log.prefix} in {self.blob_store.describe()} (`statebackend checkpoints` "
                    f"lists them)"
                )
            return entry
        raise UsageError(
            f"--checkpoint {choice!r}: give a seq (e.g. 12), a checkpoint id (e.g. 1700000000000-123456) or 'latest'"
        )

    def no_checkpoints(self, task: str) -> str:
        tasks = sorted(self.tasks_with_checkpoints())
        shown = ", ".join(tasks[:10]) + (f" ... ({len(tasks)} in all)" if len(tasks) > 10 else "")
        return (
            f"task {task!r} of job {self.job!r} has no checkpoint under {self.job}/{task}/checkpoints/ in "
            f"{self.blob_store.describe()}; tasks of this job with checkpoints: {shown or 'none'}"
        )

    def tasks_with_checkpoints(self) -> set[str]:
        return {m.group(2) for m in map(CHECKPOINT_NAME.match, self.blob_store.list(f"{self.job}/")) if m}


class NoExecutor(Executor):
    """Admins of the command submit no work."""

    def submit(self, fn: Callable[..., Any], /, *args: Any, **kwargs: Any) -> Future[Any]:
        raise UsageError("the statebackend command runs no commits, uploads or cleanups")


def checkpoint_time(millis: int) -> str:
    """A checkpoint id's wall-clock part as UTC, to the millisecond: ``2026-11-23T22:30:00.123Z``."""
    moment = datetime.datetime.fromtimestamp(millis / 1000.0, tz=datetime.UTC)
    return moment.strftime("%Y-%m-%dT%H:%M:%S.") + f"{millis % 1000:03d}Z"


def human_bytes(size: int | None) -> str:
    if size is None:
        return "?"
    value = float(size)
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if value < 1024 or unit == "TiB":
            return f"{int(value)} B" if unit == "B" else f"{value:.1f} {unit}"
        value /= 1024
    return f"{size} B"  # pragma: no cover


def human_age(seconds: float | None) -> str:
    if seconds is None:
        return "?"
    for unit, size in (("d", 86400), ("h", 3600), ("m", 60)):
        if seconds >= size:
            return f"{seconds / size:.1f}{unit}"
    return f"{seconds:.0f}s"


def table(run: Run, rows: Sequence[Mapping[str, Any]], columns: list[tuple[str, str]]) -> None:
    """Rows as aligned columns under a header (or, with --json, as one JSON array of the rows)."""
    if run.json:
        run.print_json(list(rows))
        return
    cells = [[header for _, header in columns]]
    cells += [["" if row.get(key) is None else str(row[key]) for key, _ in columns] for row in rows]
    widths = [max(len(line[i]) for line in cells) for i in range(len(columns))]
    for line in cells:
        run.print("  ".join(cell.ljust(width) for cell, width in zip(line, widths, strict=True)).rstrip())
