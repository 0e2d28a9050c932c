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
  uploads), where the blob store can list them.

Only what is older than ``--grace`` goes, by the age rule of :mod:`statebackend.kit.gc`: a blob's age comes from its
``created_at`` metadata (both built-in backends write it at upload); this command keeps no memory between runs, so a
blob of unknown age is kept and reported. The marks are :func:`statebackend.kit.mark_referenced` over the backends'
``referenced_blobs``. The checkpoint logs themselves are never touched (retention owns them), nor anything whose
layout is not recognised.
"""

from __future__ import annotations

import time
from typing import Any

import attrs

from statebackend.checkpoint import CheckpointV2
from statebackend.cli._common import EXIT_OK, Run, UsageError, human_age, human_bytes
from statebackend.errors import ConfigError, NotFoundError
from statebackend.kit import CREATED_AT, GraceRule, Mark, mark_referenced, referenced_by_admin
from statebackend.options import parse_duration_ms

__all__ = ["gc"]


@attrs.define
class Item:
    kind: str  # orphaned task | dropped task | orphaned store | unreferenced blob | abandoned upload | kept
    task: str | None
    blob: str
    age_s: float | None
    size: int | None
    action: str  # delete | deleted | keep
    reason: str
    handle: Any = None

    def to_json(self) -> dict[str, Any]:
        return {"kind": self.kind, "task": self.task, "blob": self.blob, "age_s": self.age_s, "bytes": self.size,
                "action": self.action, "reason": self.reason}


def gc(run: Run) -> int:
    try:
        rule = GraceRule(parse_duration_ms(min=0)("--grace", run.args.grace))  # no first sightings: one run
    except ConfigError as exc:
        raise UsageError(str(exc)) from exc
    grace_s = rule.grace_s
    job = run.job
    by_task: dict[str, list[str]] = {}
    for name in run.progress(run.blob_store.list(f"{job}/"), desc="listing"):
        parts = name.split("/")
        if len(parts) >= 3:
            by_task.setdefault(parts[1], []).append(name)
    dropped = set(run.args.drop_task or [])
    unknown = sorted(dropped - set(by_task))
    if unknown:
        raise NotFoundError(f"--drop-task {', '.join(unknown)}: no such task of job {job!r} in "
                            f"{run.blob_store.describe()} (`statebackend tasks` lists them)")
    items: list[Item] = []
    for task, names in run.progress(sorted(by_task.items()), total=len(by_task), desc="tasks"):
        if task in dropped:
            items.extend(Item("dropped task", task, name, None, None, "delete",
                              f"task {task} named by --drop-task: its checkpoints and state go") for name in names)
            continue
        items.extend(_task_items(run, task, names, rule))
    uploads = run.blob_store.abandoned_uploads(f"{job}/")
    upload_note = None
    if uploads is None:
        upload_note = (f"{run.blob_store.describe()} cannot list abandoned uploads (Azure discards uncommitted "
                       f"blocks by itself after 7 days)")
    for upload in uploads or []:
        old = upload.age_s is not None and upload.age_s >= grace_s
        items.append(Item("abandoned upload", None, upload.name, upload.age_s, upload.size,
                          "delete" if old else "keep",
                          f"{upload.kind} never finished" if old else f"{upload.kind} younger than the grace period "
                          f"(may still be running)", handle=upload))
    if run.args.apply:
        _apply(run, items)
    report = _report(run, job, items, grace_s, upload_note)
    if run.json:
        run.print_json(report)
    else:
        _print_report(run, report, items)
    return EXIT_OK


def _task_items(run: Run, task: str, names: list[str], rule: GraceRule) -> list[Item]:
    prefix = f"{run.job}/{task}/"
    checkpoint_blobs = [n for n in names if n.startswith(prefix + "checkpoints/")]
    data_blobs = [n for n in names if not n.startswith(prefix + "checkpoints/")]
    if not checkpoint_blobs:
        return [_candidate(run, "orphaned task", task, name, rule, f"task {task} has no checkpoint")
                for name in data_blobs]
    marked_at = time.time()
    entries = run.log(task).entries()
    if not entries:
        return [Item("kept", task, name, None, None, "keep",
                     "the task's checkpoints are all in versions this release does not read") for name in data_blobs]
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
        (factory, store): mark_referenced(found, referenced_by_admin(run.admin(task, factory), store), at=marked_at)
        for (factory, store), found in markers.items()
    }
    items = []
    for name in data_blobs:
        parts = name[len(prefix):].split("/")
        if len(parts) < 3:
            items.append(Item("kept", task, name, None, None, "keep", "not in a backend's layout "
                              "(<job>/<task>/<store>/<backend>/...)"))
            continue
        store, factory = parts[0], parts[1]
        mark = marks.get((factory, store))
        if mark is None:
            items.append(_candidate(run, "orphaned store", task, name, rule,
                                    f"no checkpoint of task {task} has a {factory} marker for store {store}"))
        elif not mark.complete:
            items.append(Item("kept", task, name, None, None, "keep",
                              f"the {factory} backend does not say which blobs its markers need"))
        elif name not in mark.blobs:
            items.append(_candidate(run, "unreferenced blob", task, name, rule,
                                    f"no checkpoint of task {task} needs it"))
    return items


def _candidate(run: Run, kind: str, task: str, name: str, rule: GraceRule, reason: str) -> Item:
    """A garbage candidate: deleted when old enough by the age rule (this command keeps no memory between runs, so a
    blob of unknown age is kept), else kept."""
    try:
        info = run.blob_store.head(name)
    except NotFoundError:
        return Item(kind, task, name, None, None, "keep", "gone already")
    now = time.time()
    age = rule.age(name, info.metadata, now)
    if age is None:
        return Item(kind, task, name, None, info.size, "keep", f"{reason}; but its age is unknown (no {CREATED_AT} "
                    f"metadata), so it is kept")
    if not rule.old_enough(name, info.metadata, now):
        return Item(kind, task, name, age, info.size, "keep", f"{reason}; but younger than the grace period")
    return Item(kind, task, name, age, info.size, "delete", reason)


def _apply(run: Run, items: list[Item]) -> None:
    doomed = [item for item in items if item.action == "delete"]
    for item in run.progress(doomed, total=len(doomed), desc="deleting"):
        if item.kind == "abandoned upload":
            run.blob_store.remove_abandoned_upload(item.handle)
        else:
            run.blob_store.delete(item.blob)
        item.action = "deleted"


def _report(run: Run, job: str, items: list[Item], grace_s: float, upload_note: str | None) -> dict[str, Any]:
    summary: dict[str, dict[str, int]] = {}
    for item in items:
        group = summary.setdefault(f"{item.kind}: {item.action}", {"count": 0, "bytes": 0})
        group["count"] += 1
        group["bytes"] += item.size or 0
    return {"job": job, "blob_store": run.blob_store.describe(), "applied": bool(run.args.apply),
            "grace_s": grace_s, "summary": summary, "notes": [upload_note] if upload_note else [],
            "items": [item.to_json() for item in items]}


def _print_report(run: Run, report: dict[str, Any], items: list[Item]) -> None:
    mode = "deleted" if report["applied"] else "dry run, nothing deleted"
    run.print(f"gc of job {report['job']} in {report['blob_store']} ({mode}; grace {human_age(report['grace_s'])})")
    for item in items:
        what = "DELETED" if item.action == "deleted" else "DELETE" if item.action == "delete" else "KEEP"
        run.print(f"{what:8} {item.kind:18} {item.blob}  ({human_bytes(item.size)}, age {human_age(item.age_s)}): "
                  f"{item.reason}")
    for note in report["notes"]:
        run.print(f"note: {note}")
    if not items:
        run.print("nothing to collect")
    for group, counts in sorted(report["summary"].items()):
        run.print(f"total {group}: {counts['count']} ({human_bytes(counts['bytes'])})")
    if not report["applied"] and any(item.action == "delete" for item in items):
        run.print("run again with --apply to delete what is marked DELETE")
