"""The commands that read: validate, jobs, tasks, stores, checkpoints, inspect, verify; restore and dump, which
restore into a local directory and write nothing to the blob store. ``gc`` lives in :mod:`statebackend.cli.gc`."""

from __future__ import annotations

import base64
import json
import tempfile
import time
from collections.abc import Callable, Iterator
from typing import Any

from statebackend.checkpoint import CheckpointLog, CheckpointV2, LogEntry
from statebackend.cli._common import (
    CHECKPOINT_NAME,
    EXIT_OK,
    EXIT_UNVERIFIED,
    EXIT_VERIFY_FAILED,
    Run,
    checkpoint_time,
    human_bytes,
    table,
)
from statebackend.config import Settings, StoreSettings
from statebackend.errors import ConfigError, CorruptDataError, IncompatibleFormatError, NotFoundError
from statebackend.metrics import Metrics
from statebackend.restore import restored_stores
from statebackend.serdes import RECORD, Serde, get_serde, is_record
from statebackend.serdes.record import RecordDicts, schemas_from_text
from statebackend.store import LocalStore
from statebackend.store.kinds import KIND, ListStore, MapStore
from statebackend.store.ttl import ENVELOPE, TtlStore, batch_clock, unwrap
from statebackend.values import MSG_SCHEMAS

__all__ = ["COMMANDS"]


def validate(run: Run) -> int:
    settings = run.settings
    factories = sorted({f for s in settings.stores.values() for f in (*s.backup_factories, s.restore_factory)})
    results = []
    for factory_name in factories:
        admin = run.admin("validate", factory_name)
        if admin is None:
            raise ConfigError(f"state backend {factory_name!r} is not installed here")
        admin.validate_resources()
        results.append({"backend": factory_name, "result": "OK", "blob_store": run.blob_store.describe()})
    if run.json:
        run.print_json(results)
    else:
        for result in results:
            run.print(f"{result['backend']}: OK ({result['blob_store']})")
    return EXIT_OK


def jobs(run: Run) -> int:
    found: dict[str, dict[str, Any]] = {}
    for name in run.progress(run.blob_store.list(""), desc="listing"):
        job = name.split("/", 1)[0]
        row = found.setdefault(job, {"job": job, "tasks": set(), "checkpoints": 0, "blobs": 0})
        row["blobs"] += 1
        match = CHECKPOINT_NAME.match(name)
        if match:
            row["tasks"].add(match.group(2))
    for job, row in sorted(found.items()):
        # counted by the log, not by blob names: a task on the head keeps its checkpoints in one blob
        for task in run.progress(sorted(row["tasks"]), total=len(row["tasks"]), desc=f"{job} checkpoints"):
            row["checkpoints"] += len(run.log(task, job).seqs())
    rows = [
        dict(row, tasks=len(row["tasks"]), configured=job == run.settings.job_name)
        for job, row in sorted(found.items())
    ]
    table(run, rows, [("job", "JOB"), ("tasks", "TASKS"), ("checkpoints", "CHECKPOINTS"), ("blobs", "BLOBS")])
    return EXIT_OK


def tasks(run: Run) -> int:
    found: dict[str, dict[str, Any]] = {}
    for name in run.progress(run.blob_store.list(f"{run.job}/"), desc="listing"):
        parts = name.split("/")
        if len(parts) < 3:
            continue
        row = found.setdefault(parts[1], {"task": parts[1], "has_log": False, "stores": set(), "blobs": 0})
        row["blobs"] += 1
        if CHECKPOINT_NAME.match(name):
            row["has_log"] = True
        elif len(parts) >= 4:
            row["stores"].add(parts[2])
    if not found:
        raise NotFoundError(
            f"job {run.job!r} has no blobs in {run.blob_store.describe()} (`statebackend jobs` lists the jobs there)"
        )
    rows = []
    for task, row in run.progress(sorted(found.items()), total=len(found), desc="tasks"):
        log = run.log(task)
        # counted by the log, not by blob names: a task on the head keeps its checkpoints in one blob
        count = len(log.seqs()) if row["has_log"] else 0
        entry = log.latest() if count else None
        rows.append(
            {
                "task": task,
                "checkpoints": count,
                "newest_seq": entry.seq if entry else None,
                "newest_time": checkpoint_time(entry.checkpoint.checkpoint_id.millis)
                if entry and isinstance(entry.checkpoint, CheckpointV2)
                else None,
                "stores": sorted(row["stores"]),
                "blobs": row["blobs"],
            }
        )
    if run.json:
        run.print_json(rows)
        return EXIT_OK
    table(
        run,
        [
            dict(r, stores=",".join(r["stores"]) or "-", newest_seq=f"#{r['newest_seq']}" if r["newest_seq"] else "-")
            for r in rows
        ],
        [
            ("task", "TASK"),
            ("checkpoints", "CHECKPOINTS"),
            ("newest_seq", "NEWEST"),
            ("newest_time", "TIME (UTC)"),
            ("stores", "STORES"),
            ("blobs", "BLOBS"),
        ],
    )
    return EXIT_OK


def stores(run: Run) -> int:
    task = run.args.task
    prefix = f"{run.job}/{task}/"
    on_store: dict[str, dict[str, int]] = {}
    checkpoints = 0
    for name in run.progress(run.blob_store.list(prefix), desc="listing"):
        if CHECKPOINT_NAME.match(name):
            checkpoints += 1
            continue
        parts = name[len(prefix) :].split("/")
        if len(parts) >= 3:
            counts = on_store.setdefault(parts[0], {})
            counts[parts[1]] = counts.get(parts[1], 0) + 1
    entry = run.log(task).latest() if checkpoints else None
    if not on_store and entry is None:
        raise NotFoundError(run.no_checkpoints(task))
    markers: dict[str, list[str]] = {}
    if entry is not None and isinstance(entry.checkpoint, CheckpointV2):
        for factory, by_store in entry.checkpoint.state_checkpoint_markers.items():
            for store in by_store:
                markers.setdefault(store, []).append(factory)
    rows: list[dict[str, Any]] = []
    for store in sorted(set(on_store) | set(markers) | set(run.settings.stores)):
        counts = on_store.get(store, {})
        rows.append(
            {
                "store": store,
                "configured": store in run.settings.stores,
                "in_newest_checkpoint": sorted(markers.get(store, [])),
                "backends_on_blob_store": sorted(counts),
                "blobs": sum(counts.values()),
            }
        )
    if run.json:
        run.print_json(rows)
        return EXIT_OK
    table(
        run,
        [
            dict(
                r,
                configured="yes" if r["configured"] else "no",
                in_newest_checkpoint=",".join(r["in_newest_checkpoint"]) or "-",
                backends_on_blob_store=",".join(r["backends_on_blob_store"]) or "-",
            )
            for r in rows
        ],
        [
            ("store", "STORE"),
            ("configured", "CONFIGURED"),
            ("in_newest_checkpoint", "NEWEST CHECKPOINT"),
            ("backends_on_blob_store", "BLOBS OF"),
            ("blobs", "BLOBS"),
        ],
    )
    return EXIT_OK


def checkpoints(run: Run) -> int:
    task = run.args.task
    log = run.log(task)
    entries = log.entries()
    if not entries:
        raise NotFoundError(run.no_checkpoints(task))
    sizes: dict[str, int | None] = {}
    rows = []
    for entry in run.progress(entries, total=len(entries), desc="sizes"):
        rows.append(_checkpoint_row(run, task, entry, sizes))
    if run.json:
        run.print_json(rows)
        return EXIT_OK
    table(
        run,
        [
            dict(
                r,
                seq=f"#{r['seq']}",
                size=human_bytes(r["bytes"]),
                backends=",".join(r["backends"]) or "-",
                offsets=",".join(f"{k}={v}" for k, v in r["input_offsets"].items()),
            )
            for r in rows
        ],
        [
            ("seq", "SEQ"),
            ("checkpoint_id", "CHECKPOINT ID"),
            ("time", "TIME (UTC)"),
            ("size", "SIZE"),
            ("backends", "BACKENDS"),
            ("offsets", "INPUT OFFSETS"),
        ],
    )
    return EXIT_OK


def _checkpoint_row(run: Run, task: str, entry: LogEntry, sizes: dict[str, int | None]) -> dict[str, Any]:
    """One checkpoint for a listing. ``bytes``: the total size of the blobs its markers need (each counted once),
    ``None`` when a backend does not say which blobs they are."""
    cp = entry.checkpoint
    offsets = dict(sorted(cp.input_offsets.items()))
    if not isinstance(cp, CheckpointV2):
        return {
            "seq": entry.seq,
            "version": 1,
            "checkpoint_id": None,
            "time": None,
            "bytes": None,
            "backends": [],
            "input_offsets": offsets,
        }
    blobs: set[str] | None = set()
    for factory, by_store in sorted(cp.state_checkpoint_markers.items()):
        admin = run.admin(task, factory)
        for store, marker in by_store.items():
            named = None
            if admin is not None:
                try:
                    named = admin.referenced_blobs(store, marker)
                except (CorruptDataError, IncompatibleFormatError):
                    named = None
            if named is None or blobs is None:
                blobs = None
            else:
                blobs |= named
    total: int | None = None
    if blobs is not None:
        total = 0
        for name in sorted(blobs):
            if name not in sizes:
                try:
                    sizes[name] = run.blob_store.head(name).size
                except NotFoundError:
                    sizes[name] = None
            size = sizes[name]
            total += size or 0
    return {
        "seq": entry.seq,
        "version": 2,
        "checkpoint_id": str(cp.checkpoint_id),
        "time": checkpoint_time(cp.checkpoint_id.millis),
        "bytes": total,
        "backends": sorted(cp.state_checkpoint_markers),
        "input_offsets": offsets,
    }


def inspect(run: Run) -> int:
    task = run.args.task
    entry = run.choose(task, run.args.checkpoint)
    cp = entry.checkpoint
    out: dict[str, Any] = {
        "job": run.job,
        "task": task,
        "seq": entry.seq,
        "version": cp.version,
        "blob": _blob_of(run, run.log(task), entry),
        "input_offsets": dict(sorted(cp.input_offsets.items())),
    }
    if isinstance(cp, CheckpointV2):
        out["checkpoint_id"] = str(cp.checkpoint_id)
        out["time"] = checkpoint_time(cp.checkpoint_id.millis)
        out["serdes"] = {store: dict(serdes) for store, serdes in cp.serdes.items()}
        markers: dict[str, dict[str, Any]] = {}
        for factory, by_store in sorted(cp.state_checkpoint_markers.items()):
            admin = run.admin(task, factory)
            for store, marker in sorted(by_store.items()):
                described: dict[str, Any] | None = None
                note = None
                if admin is None:
                    note = f"the {factory} backend is not installed here"
                else:
                    try:
                        described = admin.describe_marker(store, marker)
                    except (CorruptDataError, IncompatibleFormatError) as exc:
                        note = f"the marker does not decode: {exc}"
                    if described is None and note is None:
                        note = f"the {factory} backend does not describe its markers"
                markers.setdefault(factory, {})[store] = {"marker": marker, "description": described, "note": note}
        out["markers"] = markers
        out["bytes"] = _checkpoint_row(run, task, entry, {})["bytes"]
    if run.json:
        run.print_json(out)
        return EXIT_OK
    run.print(f"checkpoint #{entry.seq} of task {task} in job {run.job} ({out['blob']})")
    if "checkpoint_id" in out:
        run.print(f"  id        {out['checkpoint_id']}  ({out['time']})")
    run.print(f"  offsets   {', '.join(f'{k}={v}' for k, v in out['input_offsets'].items()) or '-'}")
    if cp.version == 1:
        run.print("  a V1 checkpoint: input offsets only, no state")
        return EXIT_OK
    run.print(f"  size      {human_bytes(out['bytes'])} in the blobs its markers need")
    for factory, by_store in out["markers"].items():
        for store, item in by_store.items():
            serdes = out["serdes"].get(store, {})
            run.print(f"  {factory}/{store}  (key {serdes.get('key', '?')}, value {serdes.get('msg', '?')})")
            for line in _describe_lines(item):
                run.print(f"    {line}")
    return EXIT_OK


def _blob_of(run: Run, log: CheckpointLog, entry: LogEntry) -> str:
    """The blob ``entry`` was read from: the task's head when its log is on one (every checkpoint it holds is in
    that blob), else its per-seq blob."""
    if log.head_mode:
        try:
            run.blob_store.head(log.head_name)
            return str(log.head_name)
        except NotFoundError:
            pass  # a log not moved to the head yet (an older release's): its per-seq blobs
    return str(log.blob_name(entry.seq, entry.checkpoint.version))


def _describe_lines(item: dict[str, Any]) -> list[str]:
    described = item["description"]
    if described is None:
        return [f"{item['note']}; its marker: {item['marker']}"]
    lines = []
    head = {k: v for k, v in described.items() if not isinstance(v, (list, dict))}
    lines.append("  ".join(f"{k}={human_bytes(v) if k == 'bytes' else v}" for k, v in head.items()))
    for key, value in described.items():
        if isinstance(value, list):
            for part in value:
                if isinstance(part, dict):
                    lines.append(
                        "- " + "  ".join(f"{k}={human_bytes(v) if k == 'bytes' else v}" for k, v in part.items())
                    )
                else:
                    lines.append(f"- {key}: {part}")
        elif isinstance(value, dict):
            lines.append(f"{key}: {json.dumps(value, default=str)}")
    return lines


def verify(run: Run) -> int:
    task = run.args.task
    try:
        entry = run.choose(task, run.args.checkpoint)  # reading it checks its own checksum and binding
    except (CorruptDataError, IncompatibleFormatError) as exc:
        if run.json:
            run.print_json(
                {
                    "job": run.job,
                    "task": task,
                    "checkpoint": run.args.checkpoint,
                    "result": "failed",
                    "problems": [str(exc)],
                    "markers": [],
                }
            )
        else:
            run.print(f"FAILED      checkpoint {run.args.checkpoint} of task {task}")
            run.print(f"            {exc}")
        return EXIT_VERIFY_FAILED
    cp = entry.checkpoint
    wanted = set(run.args.store or [])
    results: list[dict[str, Any]] = []
    if isinstance(cp, CheckpointV2):
        pairs = [
            (factory, store, marker)
            for factory, by_store in sorted(cp.state_checkpoint_markers.items())
            for store, marker in sorted(by_store.items())
            if not wanted or store in wanted
        ]
        found_stores = {store for _, store, _ in pairs}
        missing = sorted(wanted - found_stores)
        if missing:
            raise NotFoundError(
                f"checkpoint #{entry.seq} of task {task} has no marker for store(s) {', '.join(missing)}"
            )
        for factory, store, marker in run.progress(pairs, total=len(pairs), desc="verify"):
            admin = run.admin(task, factory)
            problems = admin.verify_marker(store, marker) if admin is not None else None
            if problems is None:
                status = "unverified"
                problems = [
                    f"the {factory} backend is not installed here"
                    if admin is None
                    else f"the {factory} backend does not verify its markers"
                ]
            else:
                status = "failed" if problems else "ok"
            results.append({"backend": factory, "store": store, "status": status, "problems": problems})
    failed = [r for r in results if r["status"] == "failed"]
    unverified = [r for r in results if r["status"] == "unverified"]
    code = EXIT_VERIFY_FAILED if failed else EXIT_UNVERIFIED if unverified else EXIT_OK
    summary = {
        "job": run.job,
        "task": task,
        "seq": entry.seq,
        "checkpoint_id": str(getattr(cp, "checkpoint_id", "")) or None,
        "result": "failed" if failed else "unverified" if unverified else "ok",
        "markers": results,
    }
    if run.json:
        run.print_json(summary)
        return code
    for result in results:
        run.print(f"{result['status'].upper():10}  {result['backend']}/{result['store']}")
        for problem in result["problems"]:
            run.print(f"            {problem}")
    if failed:
        verdict = f"FAILED: {len(failed)} of {len(results)} markers have problems"
    elif unverified:
        verdict = (
            f"NOT VERIFIED: {len(unverified)} of {len(results)} markers could not be checked (the others are sound)"
        )
    else:
        verdict = f"OK: {len(results)} markers, every blob present and sound"
    run.print(f"checkpoint #{entry.seq} of task {task}: {verdict}")
    return code


def restore(run: Run) -> int:
    task = run.args.task
    entry = run.choose(task, run.args.checkpoint)
    config = dict(run.config, **{"state.local.dir": run.args.directory})
    started = time.monotonic()
    metrics = Metrics()
    stores: dict[str, dict[str, Any]] = {}
    names = list(run.settings.stores)
    # one store at a time, so the progress bar moves; each restores exactly as opening the task would
    for name in run.progress(names, total=len(names), desc="restore"):
        with restored_stores(
            config, task, store_names=[name], blob_store=run.blob_store, checkpoint=_seq_is(entry.seq), metrics=metrics
        ) as restored:
            stores[name] = {"restored_by": restored.restored_by[name], "keys": restored.stores[name].count()}
    cp = entry.checkpoint
    result = {
        "job": run.job,
        "task": task,
        "seq": entry.seq,
        "directory": run.args.directory,
        "checkpoint_id": str(cp.checkpoint_id) if isinstance(cp, CheckpointV2) else None,
        "stores": stores,
        "bytes_downloaded": int(metrics.counter("restore.bytes")),
        "ms": round((time.monotonic() - started) * 1000.0),
    }
    if run.json:
        run.print_json(result)
        return EXIT_OK
    run.print(
        f"restored checkpoint #{entry.seq} ({result['checkpoint_id']}) of task {task} into "
        f"{run.args.directory} in {result['ms']} ms, {human_bytes(result['bytes_downloaded'])} downloaded"
    )
    for name, item in result["stores"].items():
        run.print(f"  {name}: {item['keys']} keys, from {item['restored_by'] or 'nothing (empty)'}")
    return EXIT_OK


def dump(run: Run) -> int:
    task, store = run.args.task, run.args.store
    entry = run.choose(task, run.args.checkpoint)
    config = dict(run.config)
    dropped = store not in run.settings.stores
    if dropped:
        config.update(_store_of_checkpoint(run, entry, store))
    settings = Settings.from_config(config)
    store_settings = settings.stores[store]
    with tempfile.TemporaryDirectory(prefix="statebackend-dump-") as tmp:
        config["state.local.dir"] = tmp
        with restored_stores(
            config,
            task,
            store_names=[store],
            blob_store=run.blob_store,
            checkpoint=entry,
            raw_values=[store] if dropped else (),
        ) as restored:
            local = restored.stores[store]
            key_serde = get_serde(store_settings.key_serde)
            value_serde = None if run.args.raw else _value_reader(entry, store, store_settings.msg_serde)
            ttl = store_settings.ttl_ms is not None
            now = batch_clock(entry.checkpoint)
            if store_settings.kind != "value" and value_serde is not None:
                for grouped in _grouped(local, store_settings, key_serde, value_serde, now):
                    run.print(json.dumps(grouped, ensure_ascii=False))
                return EXIT_OK
            for key, value in run.progress(local.items(), total=local.count(), desc="dump"):
                if run.args.raw:  # the stored bytes (with a TTL: the envelope, expired keys included)
                    record: dict[str, Any] = {"key_base64": _b64(key), "value_base64": _b64(value)}
                else:
                    expiry = None
                    if ttl:  # keys expired at the checkpoint's batch clock are left out, as reads do
                        expiry, value = unwrap(value, store=store)
                        if expiry <= now:
                            continue
                    assert value_serde is not None
                    record = {
                        **_field("key", key_serde.from_bytes(key)),
                        **_field("value", value_serde.from_bytes(value)),
                    }
                    if expiry is not None:
                        record["expires_at_ms"] = expiry
                run.print(json.dumps(record, ensure_ascii=False))
    return EXIT_OK


def _grouped(
    local: LocalStore, store_settings: StoreSettings, key_serde: Serde, value_serde: Any, now: int
) -> Iterator[dict[str, Any]]:
    """A list or map store's records as ``dump`` shows them: per user key, ``{"key", "elements": [{"value"}, ...]}``
    (a list, in append order) or ``{"key", "entries": [{"sub_key", "value"}, ...]}`` (a map, in sub-key byte order),
    not the composite record keys they are stored under; with a TTL, what is visible at the checkpoint's batch clock
    (``--raw`` shows the records as stored)."""
    raw = get_serde("bytes")
    ttl = None if store_settings.ttl_ms is None else TtlStore(local, store_settings.ttl_ms, lambda: now)
    if store_settings.kind == "list":
        for key, values in ListStore(local, raw, raw, ttl).raw_lists():
            yield {
                **_field("key", key_serde.from_bytes(key)),
                "elements": [_field("value", value_serde.from_bytes(value)) for value in values],
            }
        return
    subkey_serde = get_serde(store_settings.subkey_serde)
    for key, entries in MapStore(local, raw, raw, ttl, subkey_serde=raw).raw_maps():
        yield {
            **_field("key", key_serde.from_bytes(key)),
            "entries": [
                {**_field("sub_key", subkey_serde.from_bytes(sub)), **_field("value", value_serde.from_bytes(value))}
                for sub, value in entries
            ],
        }


def _value_reader(entry: LogEntry, store: str, msg_serde: str) -> Any:
    """How ``dump`` reads a store's values: its serde, except for a record store, whose values are read as dicts of
    the fields of whichever schema the checkpoint recorded each was written with (JSON, and readable whether or not
    the class still has those fields)."""
    recorded = entry.checkpoint.serdes.get(store, {}) if isinstance(entry.checkpoint, CheckpointV2) else {}
    if (is_record(msg_serde) or recorded.get("msg") == RECORD) and MSG_SCHEMAS in recorded:
        return RecordDicts(schemas_from_text(recorded[MSG_SCHEMAS], where=f"checkpoint #{entry.seq}, store {store!r}"))
    if recorded.get("msg") == RECORD:
        raise CorruptDataError(
            f"checkpoint #{entry.seq} records record values for store {store!r} but not their "
            "schemas: they cannot be decoded; dump them with --raw"
        )
    return get_serde(msg_serde)


def _store_of_checkpoint(run: Run, entry: LogEntry, store: str) -> dict[str, str]:
    """Config keys for a store the config lacks but the checkpoint has (a dropped store): its backends from the
    checkpoint's markers, its serdes from what the checkpoint recorded (``bytes`` when it recorded none)."""
    cp = entry.checkpoint
    backends = (
        sorted(f for f, by_store in cp.state_checkpoint_markers.items() if store in by_store)
        if isinstance(cp, CheckpointV2)
        else []
    )
    if not backends:
        raise NotFoundError(
            f"store {store!r} is neither in the config (configured: "
            f"{', '.join(sorted(run.settings.stores)) or 'none'}) nor in checkpoint #{entry.seq} of "
            f"task {run.args.task}"
        )
    serdes = cp.serdes.get(store, {}) if isinstance(cp, CheckpointV2) else {}
    msg = serdes.get("msg", "bytes")
    if msg == RECORD:  # no class to name: the values are read as stored, decoded with the recorded schemas
        msg = "bytes"
    keys = {
        f"stores.{store}.backup.factories": ",".join(backends),
        f"stores.{store}.key.serde": serdes.get("key", "bytes"),
        f"stores.{store}.msg.serde": msg,
    }
    if serdes.get(KIND, "value") != "value":  # its records read only as that kind (a map's sub-keys as bytes)
        keys[f"stores.{store}.kind"] = serdes[KIND]
    if serdes.get("envelope") == ENVELOPE:  # its values carry an expiry; the duration does not matter to a reader
        keys[f"stores.{store}.ttl.ms"] = "1"
    return keys


def _seq_is(seq: int) -> Callable[[LogEntry], bool]:
    return lambda entry: entry.seq == seq


def _b64(data: bytes) -> str:
    return base64.b64encode(data).decode("ascii")


def _field(name: str, value: Any) -> dict[str, Any]:
    """``{name: value}`` when the value is JSON; bytes as ``{name_base64: ...}`` (also a record's bytes field, inside
    its object), anything else as ``{name_repr: ...}``."""
    if isinstance(value, (bytes, bytearray, memoryview)):
        return {f"{name}_base64": _b64(bytes(value))}
    if isinstance(value, dict) and any(isinstance(v, bytes) for v in value.values()):
        value = {k: v for field, item in value.items() for k, v in _field(field, item).items()}
    try:
        json.dumps(value)
    except (TypeError, ValueError):
        return {f"{name}_repr": repr(value)}
    return {name: value}


COMMANDS: dict[str, Callable[[Run], int]] = {
    "validate": validate,
    "jobs": jobs,
    "tasks": tasks,
    "stores": stores,
    "checkpoints": checkpoints,
    "inspect": inspect,
    "verify": verify,
    "restore": restore,
    "dump": dump,
}
