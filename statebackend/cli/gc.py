"""``statebackend gc``: a job's garbage on its blob store, reported (a dry run) or deleted (``--apply``).

What is garbage, per task of the job (``<job>/<task>/``):

- **orphaned task**: blobs under a task that has no checkpoint at all (its first commit never landed, or its log
  was removed): nothing can restore from them;
- **orphaned store**: blobs of a store under a backend's prefix (``<job>/<task>/<store>/<backend>/``) for which no
  checkpoint in the task's log has a marker of that backend (a dropped store, a backend migrated away from);
- **unreferenced blob**: a blob under a backend's prefix of a store that no checkpoint in the log needs (a commit
  attempt that never became durable, blobs retention left behind), as the backend's admin says
  (``referenced_blobs``). A backend that does not say keeps every blob under its prefix;
- **dropped task**: every blob of a task named by ``--drop-task`` (a job that now runs fewer tasks), checkpoints
  included, whatever its age: the operator decided;
- **abandoned upload**: writes that never finished (temp files of a ``file://`` store, incomplete S3 multipart
  uploads), where the blob store can list them;
- **unreferenced shared**: a blob under a prefix that a backend shares across stores or tasks (its blob lifetime's
  ``shared_prefixes``; the built-in backends share none) that no checkpoint of *any* task of the job needs. No task's
  collector deletes such blobs (each sees only its own task's log): this command is their collector. It marks them
  from every task's checkpoints and deletes them by the job-level sweep, :func:`statebackend.kit.sweep_shared` (the
  same age rule, conditional deletes, and a deadline a quarter of ``--grace`` after the mark). They are judged as a
  whole for the job, never as a task's blobs.

Only what is older than ``--grace`` goes, by the age rule of :mod:`statebackend.kit.gc`: a blob's age comes from its
``created_at`` metadata (both built-in backends write it at upload); this command keeps no memory between runs, so a
blob of unknown age is kept and reported. The marks are the ones a task's own collector takes,
:func:`statebackend.kit.mark_markers` (:mod:`statebackend.kit.lifetime`), over the backends' admins'
``referenced_blobs``: a marker that does not decode leaves every blob its backend has under that store.
The checkpoint logs themselves are never touched (retention owns them), nor anything whose layout is not recognised.

**Running writers.** The mark holds what durable checkpoints name, never what a running writer holds in memory: a
commit in flight (its deltas or runs are uploaded before its checkpoint is written), or a finished background
snapshot or compaction the next commit adopts. Such a blob is unmarked and young, and the writers keep to the
backends' rule for it (``<backend>.gc.grace.period.ms``, "g"): they name an unmarked blob only while it is younger
than g/2 and write the checkpoint within g/4. So this command is safe beside a running job when ``--grace`` is at
least the largest g of the config's backends (the *safe grace*) and each blob is deleted within g/4 (the smallest g)
of the listing of its task's checkpoints: a task's garbage is deleted right after its own mark, and what is left
past that deadline is kept and reported (run again). A ``--grace`` of 0 or below the safe grace is warned about; the
dry run then flags each blob younger than the safe grace, and ``--apply`` refuses unless ``--force`` (for a job
whose writers are all stopped). Where the blob store can, a blob is deleted only if it is still the version its
``head`` saw (a writer may write an old blob again to name it), as the backends' own sweeps do.

**What happened** is printed exactly: every item with its action (DELETE in a dry run, DELETED, KEEP with the
reason, FAILED), then one line of counts. A failed delete stops the deleting (the blob store refused: the rest
would fail alike); the report still lists what was deleted before it, and the exit code is 1.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterable
from typing import Any

import attrs

from statebackend.checkpoint import CheckpointV2
from statebackend.cli._common import EXIT_FAILURE, EXIT_OK, Run, human_age, human_bytes
from statebackend.contracts import StateBackendAdmin
from statebackend.errors import ConfigError, NotFoundError, StateBackendError, UsageError
from statebackend.kit import CREATED_AT, GraceRule, Mark, Swept, mark_markers, referenced_by_admin, sweep_shared
from statebackend.options import parse_duration_ms

__all__ = ["SafeGrace", "gc", "safe_grace"]

#: the backends' option whose value is the age below which their writers may still name an unreferenced blob
GRACE_OPTION = "gc.grace.period.ms"


@attrs.define
class Item:
    kind: str  # orphaned task | dropped task | orphaned store | unreferenced blob | abandoned upload | kept
    task: str | None
    blob: str
    age_s: float | None
    size: int | None
    action: str  # delete | deleted | keep | failed
    reason: str
    handle: Any = None
    #: the version its ``head`` saw (deleted only while unchanged, where the blob store can)
    version: str | None = None

    def to_json(self) -> dict[str, Any]:
        return {
            "kind": self.kind,
            "task": self.task,
            "blob": self.blob,
            "age_s": self.age_s,
            "bytes": self.size,
            "action": self.action,
            "reason": self.reason,
        }


@attrs.frozen
class SafeGrace:
    """What the config's backends need of a collector beside a running job (module docstring, "Running writers")."""

    #: the largest ``gc.grace.period.ms`` of the config's stores' backends (0: none declares one)
    floor_ms: int
    #: the smallest positive one (None: none): a task's deletions end this long / 4 after its mark
    window_ms: int | None
    #: the key that sets the largest, for messages (``changelog.gc.grace.period.ms (store counts)``)
    source: str | None


def safe_grace(run: Run) -> SafeGrace:
    """The safe grace of the job as its config describes it (``-D`` overrides included): over every store's backup
    backends, the job-wide or per-store ``gc.grace.period.ms`` each declares."""
    found: list[tuple[int, str]] = []
    for store in sorted(run.settings.stores):
        for factory in run.settings.stores[store].backup_factories:
            value = run.settings.backend_options_for(factory, store=store).get(GRACE_OPTION)
            if isinstance(value, int) and not isinstance(value, bool):
                found.append((value, f"{factory}.{GRACE_OPTION} (store {store})"))
    if not found:
        return SafeGrace(0, None, None)
    floor_ms, source = max(found)
    positive = [ms for ms, _ in found if ms > 0]
    return SafeGrace(floor_ms, min(positive) if positive else None, source)


def duration_text(ms: int) -> str:
    """``ms`` as a ``--grace`` value (the largest unit that divides it): ``1h``, ``90min``, ``30s``, ``250ms``."""
    for unit, size in (("h", 3_600_000), ("min", 60_000), ("s", 1000)):
        if ms and ms % size == 0:
            return f"{ms // size}{unit}"
    return f"{ms}ms"


def gc(run: Run) -> int:
    try:
        grace_ms = parse_duration_ms(min=0)("--grace", run.args.grace)
    except ConfigError as exc:
        raise UsageError(str(exc)) from exc
    rule = GraceRule(grace_ms)  # no first sightings: one run
    grace_s = rule.grace_s
    safe = safe_grace(run)
    warning = _unsafe_warning(grace_ms, safe)
    if warning is not None:
        run.warn(f"statebackend gc: warning: {warning}")
        if run.args.apply and not run.args.force:
            suggestion = f"give --grace {duration_text(safe.floor_ms)} or more, or " if safe.floor_ms else ""
            raise UsageError(
                f"gc --apply refused, nothing deleted: --grace {run.args.grace} is unsafe beside a "
                f"running job; {suggestion}stop every writer of job {run.job} (the streaming query and "
                f"its tasks) and run again with --force"
            )
    # past the safe grace, a blob younger than it is flagged in the report (the dry run shows what is at risk)
    risky_below_s = safe.floor_ms / 1000.0 if warning is not None and grace_ms < safe.floor_ms else None
    window_s = (safe.window_ms if safe.window_ms is not None else grace_ms) / 4000.0 or None
    job = run.job
    by_task: dict[str, list[str]] = {}
    for name in run.progress(run.blob_store.list(f"{job}/"), desc="listing"):
        parts = name.split("/")
        if len(parts) >= 3:
            by_task.setdefault(parts[1], []).append(name)
    dropped = set(run.args.drop_task or [])
    unknown = sorted(dropped - set(by_task))
    if unknown:
        raise NotFoundError(
            f"--drop-task {', '.join(unknown)}: no such task of job {job!r} in "
            f"{run.blob_store.describe()} (`statebackend tasks` lists them)"
        )
    # blobs several tasks share are judged once for the job, from every task's checkpoints, never as one task's
    shared = _shared_prefixes(run, sorted(by_task))
    if shared:
        by_task = {task: [n for n in names if not n.startswith(tuple(shared))] for task, names in by_task.items()}
        by_task = {task: names for task, names in by_task.items() if names}
    items: list[Item] = []
    deleting = _Deleting(run) if run.args.apply else None
    for task, names in run.progress(sorted(by_task.items()), total=len(by_task), desc="tasks"):
        if task in dropped:
            task_items = [
                Item(
                    "dropped task",
                    task,
                    name,
                    None,
                    None,
                    "delete",
                    f"task {task} named by --drop-task: its checkpoints and state go",
                )
                for name in names
            ]
            deadline = None  # the operator decided: whatever its age, whatever the log says now
        else:
            marked_at = time.time()
            task_items = _task_items(run, task, names, rule, risky_below_s)
            deadline = marked_at + window_s if window_s is not None else None
        items.extend(task_items)
        if deleting is not None:
            deleting.delete(task_items, deadline)
    if shared:
        shared_items, sweeps = _shared_items(
            run, shared, [t for t in sorted(by_task) if t not in dropped], rule, risky_below_s
        )
        items.extend(shared_items)
        if deleting is not None:
            deleting.sweep_shared(sweeps, shared_items, rule)
    uploads = run.blob_store.abandoned_uploads(f"{job}/")
    upload_note = None
    if uploads is None:
        upload_note = (
            f"{run.blob_store.describe()} cannot list abandoned uploads (Azure discards uncommitted "
            f"blocks by itself after 7 days)"
        )
    upload_items = []
    for upload in uploads or []:
        old = upload.age_s is not None and upload.age_s >= grace_s
        reason = (
            f"{upload.kind} never finished"
            if old
            else f"{upload.kind} younger than the grace period (may still be running)"
        )
        if old and risky_below_s is not None and upload.age_s is not None and upload.age_s < risky_below_s:
            reason += f"; younger than the safe grace {human_age(risky_below_s)}: it may still be running"
        upload_items.append(
            Item(
                "abandoned upload",
                None,
                upload.name,
                upload.age_s,
                upload.size,
                "delete" if old else "keep",
                reason,
                handle=upload,
            )
        )
    items.extend(upload_items)
    if deleting is not None:
        deleting.delete(upload_items, None)  # judged by their own age just now
    notes = [note for note in (warning, upload_note) if note]
    report = _report(run, job, items, grace_s, safe, notes)
    if run.json:
        run.print_json(report)
    else:
        _print_report(run, report, items)
    if deleting is not None and deleting.failure is not None:
        run.warn(f"statebackend: gc stopped deleting after a failure: {deleting.failure}")
        return EXIT_FAILURE
    return EXIT_OK


def _unsafe_warning(grace_ms: int, safe: SafeGrace) -> str | None:
    """Why ``--grace`` is unsafe beside a running job, or ``None`` when it is not."""
    at_risk = (
        "unreferenced blobs a commit in flight or the next commit may name (a delta or run uploaded before "
        "its checkpoint is written, a finished background snapshot or compaction about to be adopted) could "
        "be deleted, and that commit then fails or its checkpoint names a missing blob"
    )
    if grace_ms < safe.floor_ms:
        return (
            f"--grace {duration_text(grace_ms) if grace_ms else '0'} is below the safe grace "
            f"{duration_text(safe.floor_ms)} (the largest backend gc grace period of the config: {safe.source}): "
            f"{at_risk}"
        )
    if grace_ms == 0:
        return f"--grace 0 turns the age guard off: {at_risk}"
    return None


class _Deleting:
    """Deletes what a task's items mark ``delete``, right after that task's mark; stops for good at a failure."""

    def __init__(self, run: Run) -> None:
        self.run = run
        self.failure: str | None = None

    def delete(self, items: list[Item], deadline: float | None) -> None:
        doomed = [item for item in items if item.action == "delete"]
        store = self.run.blob_store
        conditional = store.supports_conditional_delete
        for item in self.run.progress(doomed, total=len(doomed), desc="deleting"):
            if self.failure is not None:
                item.action = "keep"
                item.reason += "; not deleted: gc stopped at an earlier failure"
                continue
            if deadline is not None and time.time() > deadline:
                item.action = "keep"
                item.reason += (
                    "; not deleted: judged too long ago (a commit since may name it; past a quarter of "
                    "the backends' smallest gc grace period since its task's checkpoints were read), "
                    "run gc again"
                )
                continue
            try:
                if item.kind == "abandoned upload":
                    store.remove_abandoned_upload(item.handle)
                elif conditional and item.version is not None:
                    if item.blob in store.delete_if_unchanged({item.blob: item.version}):
                        item.action = "keep"
                        item.reason += "; not deleted: written again since it was judged (a writer refreshed it)"
                        continue
                else:
                    store.delete(item.blob)
            except StateBackendError as exc:
                self.failure = f"{item.blob}: {type(exc).__name__}: {exc}"
                item.action = "failed"
                item.reason += f"; the delete failed ({type(exc).__name__}: {exc}); it may or may not be gone"
                continue
            item.action = "deleted"

    def sweep_shared(self, sweeps: list[_SharedSweep], items: list[Item], rule: GraceRule) -> None:
        """Delete the shared blobs no task's checkpoint needs, by the job-level sweep
        (:func:`statebackend.kit.sweep_shared`: the same mark, the age rule, conditional deletes, and a deadline a
        quarter of the grace period after the mark), then say in ``items`` what became of each."""
        for sweep in sweeps:
            if self.failure is not None:
                _mark_unswept(items, sweep.prefix, None, "gc stopped at an earlier failure")
                continue
            try:
                swept = sweep_shared(
                    self.run.blob_store,
                    sweep.prefix,
                    sweep.markers,
                    sweep.referenced,
                    rule,
                    marked_at=sweep.marked_at,
                    clock=time.time,
                )
            except StateBackendError as exc:
                self.failure = f"{sweep.prefix}: {type(exc).__name__}: {exc}"
                for item in items:
                    if item.blob.startswith(sweep.prefix) and item.action == "delete":
                        item.action = "failed"
                        item.reason += f"; the sweep failed ({type(exc).__name__}: {exc}); it may or may not be gone"
                continue
            judged = {item.blob for item in items}
            items += [
                Item(
                    "unreferenced shared",
                    None,
                    name,
                    None,
                    None,
                    "delete",
                    f"shared under {sweep.prefix}; judged old and unneeded by the sweep",
                )
                for name in swept.deleted
                if name not in judged
            ]
            _mark_unswept(items, sweep.prefix, swept, None)


def _mark_unswept(items: list[Item], prefix: str, swept: Swept | None, failure: str | None) -> None:
    """The items under ``prefix`` after the job-level sweep: what it deleted, what it kept, and why the rest of what
    the report doomed stayed."""
    deleted = set(swept.deleted) if swept is not None else set()
    kept = set(swept.kept) if swept is not None else set()
    for item in items:
        if not item.blob.startswith(prefix) or item.action != "delete":
            continue
        if item.blob in deleted:
            item.action = "deleted"
        elif failure is not None:
            item.action = "keep"
            item.reason += f"; not deleted: {failure}"
        else:
            item.action = "keep"
            item.reason += (
                "; not deleted: written again since it was judged (a writer refreshed it)"
                if item.blob in kept
                else "; not deleted by the job-level sweep (named by a checkpoint since, or judged too long ago), "
                "run gc again"
            )


def _referenced_by(admin: StateBackendAdmin | None, store: str) -> Callable[[str], set[str] | None]:
    """What the markers of ``store`` need, as the backend's admin says (``None``: not installed here, or it does not
    say). A marker that does not decode raises, and :func:`~statebackend.kit.mark_markers` takes that as "cannot
    tell"."""
    return lambda marker: admin.referenced_blobs(store, marker) if admin is not None else None


def _shared_prefixes(run: Run, tasks: list[str]) -> dict[str, str]:
    """The prefixes of blobs that several stores or tasks share, each with its backend, as the backends the tasks'
    checkpoints name declare them (their blob lifetimes' ``shared_prefixes``; the built-in backends share none)."""
    found: dict[str, str] = {}
    for task in tasks:
        factories = {
            factory
            for entry in run.log(task).entries()
            if isinstance(entry.checkpoint, CheckpointV2)
            for factory in entry.checkpoint.state_checkpoint_markers
        }
        for factory in sorted(factories):
            lifetime = run.blob_lifetime(task, factory)
            for prefix in lifetime.shared_prefixes() if lifetime is not None else ():
                found.setdefault(prefix, factory)
    return found


@attrs.frozen
class _SharedSweep:
    """What the job-level sweep of one shared prefix needs: every task's markers of its backend as of ``marked_at``,
    and what each needs."""

    prefix: str
    markers: list[tuple[str, str]]
    referenced: Callable[[str, str], Iterable[str] | None]
    marked_at: float


def _shared_items(
    run: Run, shared: dict[str, str], tasks: list[str], rule: GraceRule, risky_below_s: float | None
) -> tuple[list[Item], list[_SharedSweep]]:
    """The shared blobs no checkpoint of any task of the job needs (the same mark as the job-level sweep,
    :func:`statebackend.kit.sweep_shared`), judged by the age rule; and, per prefix whose mark is complete, what that
    sweep needs to delete them."""
    marked_at = time.time()  # before the first task's log is listed: the marks show the logs as of then, at the latest
    owners: dict[str, dict[tuple[str, str], list[str]]] = {}  # backend -> (store, marker) -> the tasks naming it
    for task in tasks:
        for entry in run.log(task).entries():
            if isinstance(entry.checkpoint, CheckpointV2):
                for factory, by_store in entry.checkpoint.state_checkpoint_markers.items():
                    for store, marker in by_store.items():
                        owners.setdefault(factory, {}).setdefault((store, marker), []).append(task)
    items: list[Item] = []
    sweeps: list[_SharedSweep] = []
    for prefix, factory in sorted(shared.items()):
        named_by = owners.get(factory, {})
        found, sweep = _shared_prefix_items(run, prefix, factory, named_by, marked_at, rule, risky_below_s)
        items += found
        sweeps += [sweep] if sweep is not None else []
    return items, sweeps


def _shared_prefix_items(
    run: Run,
    prefix: str,
    factory: str,
    named_by: dict[tuple[str, str], list[str]],
    marked_at: float,
    rule: GraceRule,
    risky_below_s: float | None,
) -> tuple[list[Item], _SharedSweep | None]:
    """The items of one shared prefix (every blob the listing shows that no marker of ``factory`` needs; all of them
    kept when the mark is incomplete), and what its sweep needs (``None``: incomplete, nothing may go)."""
    referenced = _shared_referenced(run, factory, named_by)
    markers = sorted(named_by)
    mark = mark_markers(
        markers, lambda item: referenced(*item), at=marked_at, what=f"a marker of the {factory} backend"
    )
    names = list(run.blob_store.list(prefix))
    if not mark.complete:
        reason = f"shared by tasks; the {factory} backend does not say which blobs its markers need"
        return [Item("kept", None, name, None, None, "keep", reason) for name in names], None
    reason = f"shared under {prefix}; no checkpoint of any task of job {run.job} needs it"
    items = [
        _candidate(run, "unreferenced shared", None, name, rule, reason, risky_below_s)
        for name in names
        if name not in mark.blobs
    ]
    return items, _SharedSweep(prefix, markers, referenced, marked_at)


def _shared_referenced(
    run: Run, factory: str, named_by: dict[tuple[str, str], list[str]]
) -> Callable[[str, str], set[str] | None]:
    """``referenced(store, marker)`` of the job-level sweep: what the marker needs as the admin of each task whose
    checkpoints name it says; ``None`` (cannot tell) when one of them cannot, or the marker does not decode."""
    admins: dict[str, StateBackendAdmin | None] = {}

    def referenced(store: str, marker: str) -> set[str] | None:
        blobs: set[str] = set()
        for task in named_by.get((store, marker), ()):
            if task not in admins:
                admins[task] = run.admin(task, factory)
            named = referenced_by_admin(admins[task], store)(marker)
            if named is None:
                return None
            blobs |= named
        return blobs

    return referenced


def _task_items(run: Run, task: str, names: list[str], rule: GraceRule, risky_below_s: float | None) -> list[Item]:
    prefix = f"{run.job}/{task}/"
    data_blobs = [n for n in names if not n.startswith(prefix + "checkpoints/")]
    if not any(True for _ in run.blob_store.list(prefix + "checkpoints/")):  # listed now: the job listing is older
        return [
            _candidate(run, "orphaned task", task, name, rule, f"task {task} has no checkpoint", risky_below_s)
            for name in data_blobs
        ]
    marked_at = time.time()
    entries = run.log(task).entries()
    if not entries:
        return [
            Item(
                "kept",
                task,
                name,
                None,
                None,
                "keep",
                "the task's checkpoints are all in versions this release does not read",
            )
            for name in data_blobs
        ]
    # (backend, store) -> its markers in the task's checkpoints, then what they need (incomplete: the backend does
    # not say, or a marker does not decode)
    markers: dict[tuple[str, str], list[str]] = {}
    for entry in entries:
        cp = entry.checkpoint
        if not isinstance(cp, CheckpointV2):
            continue
        for factory, by_store in cp.state_checkpoint_markers.items():
            for store, marker in by_store.items():
                markers.setdefault((factory, store), []).append(marker)
    marks: dict[tuple[str, str], Mark] = {
        (factory, store): mark_markers(
            found,
            _referenced_by(run.admin(task, factory), store),
            at=marked_at,
            what=f"task {task} store {store}: a marker of the {factory} backend",
        )
        for (factory, store), found in markers.items()
    }
    items = []
    for name in data_blobs:
        parts = name[len(prefix) :].split("/")
        if len(parts) < 3:
            items.append(
                Item(
                    "kept",
                    task,
                    name,
                    None,
                    None,
                    "keep",
                    "not in a backend's layout (<job>/<task>/<store>/<backend>/...)",
                )
            )
            continue
        store, factory = parts[0], parts[1]
        mark = marks.get((factory, store))
        if mark is None:
            items.append(
                _candidate(
                    run,
                    "orphaned store",
                    task,
                    name,
                    rule,
                    f"no checkpoint of task {task} has a {factory} marker for store {store}",
                    risky_below_s,
                )
            )
        elif not mark.complete:
            items.append(
                Item(
                    "kept",
                    task,
                    name,
                    None,
                    None,
                    "keep",
                    f"the {factory} backend does not say which blobs its markers need",
                )
            )
        elif name not in mark.blobs:
            items.append(
                _candidate(
                    run, "unreferenced blob", task, name, rule, f"no checkpoint of task {task} needs it", risky_below_s
                )
            )
    return items


def _candidate(
    run: Run, kind: str, task: str | None, name: str, rule: GraceRule, reason: str, risky_below_s: float | None
) -> Item:
    """A garbage candidate: deleted when old enough by the age rule (this command keeps no memory between runs, so a
    blob of unknown age is kept), else kept. Old enough only by an unsafe ``--grace``: flagged in its reason."""
    try:
        info = run.blob_store.head(name)
    except NotFoundError:
        return Item(kind, task, name, None, None, "keep", "gone already")
    now = time.time()
    age = rule.age(name, info.metadata, now)
    if age is None:
        return Item(
            kind,
            task,
            name,
            None,
            info.size,
            "keep",
            f"{reason}; but its age is unknown (no {CREATED_AT} metadata), so it is kept",
        )
    if not rule.old_enough(name, info.metadata, now):
        return Item(kind, task, name, age, info.size, "keep", f"{reason}; but younger than the grace period")
    if risky_below_s is not None and age < risky_below_s:
        reason += f"; younger than the safe grace {human_age(risky_below_s)}: a running or next commit may name it"
    return Item(kind, task, name, age, info.size, "delete", reason, version=info.etag)


def _counts(items: list[Item]) -> dict[str, int]:
    counts = {"delete": 0, "deleted": 0, "keep": 0, "failed": 0}
    for item in items:
        counts[item.action] += 1
    return counts


def _report(run: Run, job: str, items: list[Item], grace_s: float, safe: SafeGrace, notes: list[str]) -> dict[str, Any]:
    summary: dict[str, dict[str, int]] = {}
    for item in items:
        group = summary.setdefault(f"{item.kind}: {item.action}", {"count": 0, "bytes": 0})
        group["count"] += 1
        group["bytes"] += item.size or 0
    deleted_bytes = sum(item.size or 0 for item in items if item.action in ("delete", "deleted"))
    return {
        "job": job,
        "blob_store": run.blob_store.describe(),
        "applied": bool(run.args.apply),
        "grace_s": grace_s,
        "safe_grace_s": safe.floor_ms / 1000.0,
        "counts": _counts(items),
        "deleted_bytes" if run.args.apply else "delete_bytes": deleted_bytes,
        "summary": summary,
        "notes": notes,
        "items": [item.to_json() for item in items],
    }


def _print_report(run: Run, report: dict[str, Any], items: list[Item]) -> None:
    mode = "--apply" if report["applied"] else "dry run, nothing deleted"
    run.print(f"gc of job {report['job']} in {report['blob_store']} ({mode}; grace {human_age(report['grace_s'])})")
    labels = {"deleted": "DELETED", "delete": "DELETE", "keep": "KEEP", "failed": "FAILED"}
    for item in items:
        run.print(
            f"{labels[item.action]:8} {item.kind:18} {item.blob}  ({human_bytes(item.size)}, age "
            f"{human_age(item.age_s)}): {item.reason}"
        )
    for note in report["notes"]:
        run.print(f"note: {note}")
    for group, counts in sorted(report["summary"].items()):
        run.print(f"total {group}: {counts['count']} ({human_bytes(counts['bytes'])})")
    run.print(outcome_line(report))
    if not report["applied"] and report["counts"]["delete"]:
        run.print("run again with --apply to delete what is marked DELETE")


def outcome_line(report: dict[str, Any]) -> str:
    """One line saying exactly what the run did (or, dry, would do): how many blobs deleted, kept, failed."""
    counts = report["counts"]
    kept = f"kept {counts['keep']}" + (" (each listed above with its reason)" if counts["keep"] else "")
    if not report["applied"]:
        if not counts["delete"]:
            return f"nothing to delete; {kept}"
        return f"would delete {counts['delete']} ({human_bytes(report['delete_bytes'])}); {kept}; nothing deleted yet"
    if not counts["deleted"] and not counts["failed"]:
        return f"nothing deleted: nothing to delete; {kept}"
    done = f"deleted {counts['deleted']} ({human_bytes(report['deleted_bytes'])})"
    if counts["failed"]:
        done += f"; failed {counts['failed']} (stopped there)"
    return f"{done}; {kept}"
