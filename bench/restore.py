"""Cold restore at scale, against the machine's limit measured in the same run, for both backends, on ``file://``.

Not a test; run by hand. Per ``--keys`` size N and per backend (``changelog``, ``blobsnapshot``):

1. load N integer keys (8-byte big-endian keys, 8-byte values) in one commit and commit ``--deltas`` commits of
   ``--updates`` random updates (about 1 in 20 a delete); then make a base of that state (the changelog backend's
   snapshot, the blob-snapshot backend's base run after a full compaction; both environment-file bases,
   statebackend/envbase.py) and commit ``--deltas`` more such commits above it: the state a restore meets in the
   middle of a history;
2. wipe the local dir and restore it in a fresh process (``TaskStorage.open`` timed inside it, so the interpreter's
   start is not counted): seconds, MB/s of blob bytes read, keys/s, the process's peak RSS and its peak anonymous
   memory (sampled every 5 ms: RSS also counts LMDB's file pages mapped in, which the page cache holds anyway);
   the key count and a sample of values are checked. The same process then wipes the local dir and restores
   again: the second time ("warm") the process has restored before (its memory touched, its modules imported), what
   a task restored on a reused worker process pays; the first time adds what a new process pays once (imports,
   plugin scans, first-touch memory: docs/benchmarks.md);
3. the limit, in the same run, on the same data: (a) py-lmdb's bulk append (``putmulti(append=True)`` in one write
   transaction, into a fresh environment) of the same sorted pairs from memory (read back from the restored store a
   million at a time; only the appends are timed), and (b) reading the same blobs from the blob store (every blob
   of the checkpoint's marker, sequentially, in 4 MiB reads). The restore is reported as a multiple of each and of
   the larger. Restore and limits are measured in turns ``--repeat`` times (default 3), and the best of each kept.

``--after-load`` measures instead the cold restore right after a bulk load (issue 32's independent check): N keys
put and committed durably in one commit, then ``--commits`` (5) commits of ``--updates`` (here 100,000) random
updates, then a cold restore in a fresh process, for the changelog backend, the blob-snapshot backend as it uploads
a bulk load now (an environment-file base: ``blobsnapshot.upload.base.*``) and the blob-snapshot backend with that
off (``upload.base.min.records`` above N: the first run a run of records, as before), in one run, in turns. It
reports each restore and its ratio to the changelog backend's, and the load average.

Usage: ``python -m bench.restore --keys 1000000 --keys 10000000 [--keys 50000000 --repeat 1] [--deltas 10]
[--updates 10000] [--repeat 3] [--workdir DIR] [--plot]``; ``python -m bench.restore --after-load --keys 1000000
--keys 10000000 [--commits 5] [--updates 100000] [--repeat 3]``. (``python -m bench.blobsnapshot --restore-scale ...``
runs the same.) Prints a markdown table, writes ``bench/results/restore-<UTC time>.json``; ``--plot`` (matplotlib, the
``bench`` extra) draws docs/img/restore-scale.png from the newest result of every (backend, keys) under
bench/results/.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import shutil
import struct
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import lmdb
from statebackend.backends.blobsnapshot.blobs import read_marker
from statebackend.backends.blobsnapshot.format import is_inline_marker, run_name
from statebackend.backends.changelog.marker import Recipe
from statebackend.checkpoint import CheckpointLog, CheckpointV2

from bench.common import RESULTS_DIR, format_table, machine_info, write_result
from statebackend.blobstores.file import FileBlobStore
from statebackend.envbase import is_env_base
from statebackend.task import TaskStorage

_KEY = struct.Struct(">Q")
_VALUE = struct.Struct(">q")
CHUNK = 1_000_000
FIGURE = Path(__file__).resolve().parent.parent / "docs" / "img" / "restore-scale.png"
BACKENDS = ("changelog", "blobsnapshot")


def make_config(workdir: Path, backend: str, **options: object) -> dict[str, Any]:
    return {
        "job.name": "bench",
        "state.local.dir": str(workdir / "local"),
        "blob.store.url": f"file://{workdir / 'blobs'}",
        "stores.counts.backup.factories": backend,
        "stores.counts.lmdb.map.size": "256GiB",
        "task.checkpoint.retained": 2,
        "task.commit.timeout.ms": 3_600_000,
        **options,
    }


def value_of(key: int, version: int) -> bytes:
    return _VALUE.pack((key * 2654435761 + version) % 1_000_003)


def build(backend: str, keys: int, deltas: int, updates: int, workdir: Path, seed: int) -> dict[str, Any]:
    """The history of step 1; returns what the check needs (the keys' versions, as a sparse overlay)."""
    shutil.rmtree(workdir, ignore_errors=True)
    workdir.mkdir(parents=True)
    rng = random.Random(seed)
    config = make_config(workdir, backend)
    started = time.perf_counter()
    with TaskStorage.open(config, "task-0") as task:
        store = task.store("counts")
        for start in range(0, keys, CHUNK):
            numbers = range(start, min(keys, start + CHUNK))
            store.put_many([_KEY.pack(i) for i in numbers], [value_of(i, 0) for i in numbers])
        task.commit_durably({"p": "1"})
    load_s = time.perf_counter() - started
    changed: dict[int, int] = {}
    seq = 1

    def history(count: int) -> None:
        nonlocal seq
        with TaskStorage.open(config, "task-0") as task:
            store = task.store("counts")
            for _ in range(count):
                seq += 1
                for key in sorted(rng.sample(range(keys), updates)):
                    if rng.random() < 0.05 and changed.get(key, 0) >= 0:
                        store.delete(_KEY.pack(key))
                        changed[key] = -1
                    else:
                        store.put(_KEY.pack(key), value_of(key, seq))
                        changed[key] = seq
                task.commit_durably({"p": str(seq)})

    history(deltas)
    # a base of the state so far: the blob-snapshot backend's full compaction (a tiny ratio starts it, close waits
    # for it, the next open's commit adopts it); the changelog backend's snapshot (due at every commit here, written
    # in the background, close waits for it, the next open adopts it)
    forcing = (
        {"blobsnapshot.compaction.full.ratio": "0.05", "blobsnapshot.compaction.full.min.bytes": "0"}
        if backend == "blobsnapshot"
        else {"changelog.snapshot.interval.commits": 1}
    )
    started = time.perf_counter()
    for attempt in range(8):
        with TaskStorage.open(make_config(workdir, backend, **forcing), "task-0") as task:
            seq += 1
            changed[0] = seq
            task.store("counts").put(_KEY.pack(0), value_of(0, seq))
            if attempt:  # a full compaction needs runs above the bottom of a twentieth of its size
                for key in rng.sample(range(1, keys), min(keys - 1, max(updates, keys // 50))):
                    if changed.get(key, 0) >= 0:
                        task.store("counts").put(_KEY.pack(key), value_of(key, seq))
                        changed[key] = seq
            task.commit_durably({"p": str(seq)})
        if attempt and base_blob(workdir, backend) is not None:
            break
    else:
        raise RuntimeError("no base was made")
    base_s = time.perf_counter() - started
    history(deltas)  # the history above the base that a restore applies
    return {
        "load_s": load_s,
        "base_s": base_s,
        "changed": changed,
        "expected_count": keys - sum(1 for v in changed.values() if v < 0),
    }


def restore_in_child(workdir: Path, backend: str, expected_count: int, sample: dict[int, int]) -> dict[str, Any]:
    shutil.rmtree(workdir / "local", ignore_errors=True)
    args = {"workdir": str(workdir), "backend": backend, "expected_count": expected_count, "sample": sample}
    done = subprocess.run(
        [sys.executable, "-m", "bench.restore", "--child", json.dumps(args)],
        capture_output=True,
        text=True,
        check=False,
        cwd=Path(__file__).resolve().parent.parent,
    )
    if done.returncode != 0:
        raise RuntimeError(f"the restoring process failed:\n{done.stderr[-4000:]}")
    return dict(json.loads(done.stdout.strip().splitlines()[-1]))


def child(spec: str) -> None:
    """The restoring process: restore, check, print one JSON line. It restores twice: first as a fresh process
    (what a new worker process pays), then, after wiping the local dir again, as a process that has restored before
    (what a task restored on a reused worker pays)."""
    args = json.loads(spec)
    workdir = Path(args["workdir"])
    config = make_config(workdir, args["backend"])
    peak_anon = [0]
    done = threading.Event()

    def sample() -> None:  # anonymous memory (the process's own), not LMDB's file pages mapped into it
        while not done.wait(0.005):
            with open("/proc/self/status") as status:
                for line in status:
                    if line.startswith("RssAnon:"):
                        peak_anon[0] = max(peak_anon[0], int(line.split()[1]))

    sampler = threading.Thread(target=sample, daemon=True)
    sampler.start()
    seconds: list[float] = []
    for turn in range(2):
        if turn:
            shutil.rmtree(workdir / "local", ignore_errors=True)
        started = time.perf_counter()
        with TaskStorage.open(config, "task-0") as task:
            seconds.append(time.perf_counter() - started)
            store = task.store("counts")
            count = store.count()
            if count != args["expected_count"]:
                raise AssertionError(f"restored {count} keys, expected {args['expected_count']}")
            for key, version in args["sample"].items():
                found = store.get(_KEY.pack(int(key)))
                wanted = None if version < 0 else value_of(int(key), version)
                if found != wanted:
                    raise AssertionError(f"key {key}: restored {found!r}, expected {wanted!r}")
            if not turn:
                metrics = {k: v for k, v in task.metrics.snapshot().items() if k.startswith("restore")}
    done.set()
    # VmHWM, not getrusage's ru_maxrss: that one is kept across exec, so it would report the benchmark's own peak
    with open("/proc/self/status") as status:
        hwm_kib = next(int(line.split()[1]) for line in status if line.startswith("VmHWM:"))
    print(
        json.dumps(
            {
                "seconds": seconds[0],
                "warm_seconds": seconds[1],
                "peak_rss_mib": hwm_kib / 1024,
                "peak_anon_mib": peak_anon[0] / 1024,
                "metrics": metrics,
            }
        )
    )


def marker_blobs(workdir: Path, backend: str) -> list[str]:
    """The blobs the newest checkpoint's marker names (what a cold restore reads)."""
    blobs = FileBlobStore(str(workdir / "blobs"), create=False)
    entry = CheckpointLog(blobs, "bench", "task-0").latest()
    assert entry is not None and isinstance(entry.checkpoint, CheckpointV2)
    marker = entry.checkpoint.markers_for(backend)["counts"]
    prefix = f"bench/task-0/counts/{backend}/"
    if backend == "changelog":
        return list(Recipe.decode(marker, prefix=prefix).blob_names())
    index = read_marker(blobs, marker, job="bench", task="task-0", store="counts")
    runs = [run_name(prefix, run.hash) for run in index.runs]
    return runs if is_inline_marker(marker) else [marker, *runs]


def base_blob(workdir: Path, backend: str) -> str | None:
    """The environment-file base the newest checkpoint's marker starts from, if it starts from one."""
    blobs = FileBlobStore(str(workdir / "blobs"), create=False)
    names = [name for name in marker_blobs(workdir, backend) if "/index/" not in name]  # an index blob: not data
    first = names[0] if names else None
    if first is None or (backend == "changelog" and "/snapshot/" not in first):
        return None
    return first if is_env_base(blobs.get(first, start=0, end=8)) else None


def read_limit(workdir: Path, names: list[str]) -> tuple[float, int]:
    """Seconds to read ``names`` from the blob store, sequentially in 4 MiB reads; and their bytes."""
    blobs = FileBlobStore(str(workdir / "blobs"), create=False)
    started = time.perf_counter()
    total = 0
    for name in names:
        for chunk in blobs.iter_bytes(name, 4 << 20):
            total += len(chunk)
    return time.perf_counter() - started, total


def append_limit(workdir: Path, backend: str) -> float:
    """Seconds of py-lmdb bulk appends of the restored store's sorted pairs into a fresh environment (one write
    transaction, its commit included), a million pairs at a time read back first: only the appends are timed."""
    config = make_config(workdir, backend)
    target = workdir / "limit-env"
    shutil.rmtree(target, ignore_errors=True)
    env = lmdb.open(str(target), map_size=256 << 30, max_dbs=2, sync=False, metasync=False, readahead=False)
    db = env.open_db(b"data")
    timed = 0.0
    with TaskStorage.open(config, "task-0") as task:
        pairs = task.store("counts").items()
        txn = env.begin(write=True)
        cursor = txn.cursor(db=db)
        while True:
            chunk = [pair for _, pair in zip(range(CHUNK), pairs, strict=False)]
            if not chunk:
                break
            started = time.perf_counter()
            cursor.putmulti(chunk, append=True)
            timed += time.perf_counter() - started
        started = time.perf_counter()
        txn.commit()
        timed += time.perf_counter() - started
    env.close()
    shutil.rmtree(target, ignore_errors=True)
    return timed


def run(
    backend: str, keys: int, deltas: int, updates: int, workdir: Path, seed: int, repeat: int = 3
) -> dict[str, Any]:
    built = build(backend, keys, deltas, updates, workdir, seed)
    rng = random.Random(seed + 1)
    sample = {k: v for k, v in built["changed"].items() if k}
    sample = dict(rng.sample(sorted(sample.items()), min(2000, len(sample))))
    sample.update({k: 0 for k in rng.sample(range(keys), 2000) if k not in built["changed"]})
    base = base_blob(workdir, backend)
    assert base is not None, "the restore would not start from an environment-file base"
    names = marker_blobs(workdir, backend)
    # restore and limits in turns, best of each (the machine is shared: its load moves within a run)
    samples: dict[str, list[float]] = {"restore": [], "warm": [], "read": [], "append": []}
    for _ in range(repeat):
        restored = restore_in_child(workdir, backend, built["expected_count"], sample)
        samples["restore"].append(restored["seconds"])
        samples["warm"].append(restored["warm_seconds"])
        read_s, read_bytes = read_limit(workdir, names)
        samples["read"].append(read_s)
        samples["append"].append(append_limit(workdir, backend))
    seconds, read_s, append_s = min(samples["restore"]), min(samples["read"]), min(samples["append"])
    warm_s = min(samples["warm"])
    data_mib = sum(f.stat().st_size for f in (workdir / "local").rglob("data.mdb")) / 2**20
    return {
        "backend": backend,
        "keys": keys,
        "deltas": deltas,
        "updates": updates,
        "load_s": built["load_s"],
        "base_s": built["base_s"],
        "restore_s": seconds,
        "warm_restore_s": warm_s,
        "x_limit_warm": warm_s / max(read_s, append_s),
        "peak_rss_mib": restored["peak_rss_mib"],
        "peak_anon_mib": restored["peak_anon_mib"],
        "metrics": restored["metrics"],
        "blob_bytes": read_bytes,
        "blobs": len(names),
        "lmdb_mib": data_mib,
        "mb_per_s": read_bytes / 1e6 / seconds,
        "keys_per_s": built["expected_count"] / seconds,
        "limit_read_s": read_s,
        "limit_append_s": append_s,
        "samples": samples,
        "x_limit": seconds / max(read_s, append_s),
        "x_append": seconds / append_s,
        "x_read": seconds / read_s,
        "load_average": [round(x, 2) for x in os.getloadavg()],
    }


#: the variants ``--after-load`` compares: (label, backend, backup options)
AFTER_LOAD_VARIANTS: tuple[tuple[str, str, dict[str, object]], ...] = (
    ("changelog", "changelog", {}),
    ("blobsnapshot, bulk load as a base (after)", "blobsnapshot", {}),
    ("blobsnapshot, bulk load as a run (before)", "blobsnapshot", {"blobsnapshot.upload.base.min.records": 1 << 62}),
)


def build_after_load(
    backend: str, keys: int, commits: int, updates: int, workdir: Path, seed: int, options: dict[str, object]
) -> dict[str, Any]:
    """The independent check's history: ``keys`` keys put and committed durably in one commit, then ``commits``
    commits of ``updates`` random updates (no deletes), all in one open task. Returns the timings and what the
    check needs."""
    shutil.rmtree(workdir, ignore_errors=True)
    workdir.mkdir(parents=True)
    rng = random.Random(seed)
    changed: dict[int, int] = {}
    with TaskStorage.open(make_config(workdir, backend, **options), "task-0") as task:
        store = task.store("counts")
        started = time.perf_counter()
        for start in range(0, keys, CHUNK):
            numbers = range(start, min(keys, start + CHUNK))
            store.put_many([_KEY.pack(i) for i in numbers], [value_of(i, 0) for i in numbers])
        put_s = time.perf_counter() - started
        task.commit_durably({"p": "1"})
        load_s = time.perf_counter() - started
        started = time.perf_counter()
        for seq in range(2, commits + 2):
            chosen = sorted(rng.sample(range(keys), min(keys, updates)))
            store.put_many([_KEY.pack(k) for k in chosen], [value_of(k, seq) for k in chosen])
            changed.update(dict.fromkeys(chosen, seq))
            task.commit_durably({"p": str(seq)})
        updates_s = time.perf_counter() - started
        base_runs = task.metrics.counter("blobsnapshot.base.runs")
    return {
        "put_s": put_s,
        "load_commit_s": load_s - put_s,
        "updates_s": updates_s,
        "base_runs": base_runs,
        "changed": changed,
        "expected_count": keys,
    }


def run_after_load(
    keys: int, commits: int, updates: int, workdir: Path, seed: int, repeat: int
) -> list[dict[str, Any]]:
    """Every variant of :data:`AFTER_LOAD_VARIANTS` on the same history, restored in fresh processes in turns (best
    of ``repeat`` each: the machine is shared, its load moves within a run)."""
    built: dict[str, dict[str, Any]] = {}
    for label, backend, options in AFTER_LOAD_VARIANTS:
        print(f"  building: {label}", flush=True)
        built[label] = build_after_load(backend, keys, commits, updates, workdir / _slug(label), seed, options)
    rng = random.Random(seed + 1)
    changed = built[AFTER_LOAD_VARIANTS[0][0]]["changed"]
    sample = dict(rng.sample(sorted(changed.items()), min(2000, len(changed))))
    sample.update({k: 0 for k in rng.sample(range(keys), 2000) if k not in changed})
    restores: dict[str, list[dict[str, Any]]] = {label: [] for label, _, _ in AFTER_LOAD_VARIANTS}
    loads: list[float] = []
    for _ in range(repeat):
        for label, backend, _options in AFTER_LOAD_VARIANTS:
            restores[label].append(
                restore_in_child(workdir / _slug(label), backend, built[label]["expected_count"], sample)
            )
            loads.append(os.getloadavg()[0])
    rows = []
    for label, backend, options in AFTER_LOAD_VARIANTS:
        best = min(restores[label], key=lambda r: r["seconds"])
        rows.append(
            {
                "variant": label,
                "backend": backend,
                "options": options,
                "keys": keys,
                "commits": commits,
                "updates": updates,
                "put_s": built[label]["put_s"],
                "load_commit_s": built[label]["load_commit_s"],
                "updates_s": built[label]["updates_s"],
                "base_runs": built[label]["base_runs"],
                "restore_s": best["seconds"],
                "warm_restore_s": min(r["warm_seconds"] for r in restores[label]),
                "samples": [r["seconds"] for r in restores[label]],
                "metrics": best["metrics"],
                "peak_rss_mib": best["peak_rss_mib"],
                "load_1min_during_restores": loads,
                "load_average": [round(x, 2) for x in os.getloadavg()],
            }
        )
    changelog_s = rows[0]["restore_s"]
    for row in rows:
        row["x_changelog"] = row["restore_s"] / changelog_s
    for label, _, _ in AFTER_LOAD_VARIANTS:
        shutil.rmtree(workdir / _slug(label), ignore_errors=True)
    return rows


def _slug(label: str) -> str:
    return "".join(c if c.isalnum() else "-" for c in label)


def main_after_load(args: argparse.Namespace) -> None:
    base = args.workdir or Path(tempfile.mkdtemp(prefix="bench-restore-load-"))
    results: list[dict[str, Any]] = []
    for keys in args.keys or [1_000_000]:
        print(f"# after a bulk load: {keys:,} keys, {args.commits} commits of {args.updates:,} updates", flush=True)
        results.extend(run_after_load(keys, args.commits, args.updates, base / str(keys), args.seed, args.repeat))
    rows = [
        [
            f"{r['keys']:,}",
            r["variant"],
            f"{r['load_commit_s']:.2f}",
            f"{r['restore_s']:.3f}",
            " ".join(f"{x:.2f}" for x in r["samples"]),
            f"{r['warm_restore_s']:.3f}",
            f"{r['x_changelog']:.2f}",
            f"{min(r['load_1min_during_restores']):.1f}-{max(r['load_1min_during_restores']):.1f}",
        ]
        for r in results
    ]
    print()
    print(
        format_table(
            [
                "keys",
                "variant",
                "bulk commit s",
                "cold restore s (best)",
                "restores s",
                "warm s",
                "x changelog",
                "load (1 min)",
            ],
            rows,
        )
    )
    path = write_result(
        "restore-after-load",
        {"machine": machine_info(), "commits": args.commits, "updates": args.updates, "results": results},
    )
    print(f"\nraw results: {path}")


def plot(path: Path = FIGURE) -> Path:
    """Restore time against keys per backend (and per history above the base), with the measured limits beside
    it, from the newest result of each (backend, deltas, keys) under bench/results/."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    newest: dict[tuple[str, int, int], dict[str, Any]] = {}
    for result_file in sorted(RESULTS_DIR.glob("restore-*.json")):
        for row in json.loads(result_file.read_text())["results"]:
            newest[(row["backend"], row["deltas"], row["keys"])] = row
    fig, ax = plt.subplots(figsize=(8, 5))
    colors = {"changelog": "tab:blue", "blobsnapshot": "tab:orange"}
    for backend in BACKENDS:
        for deltas in sorted({d for b, d, _ in newest if b == backend}):
            rows = sorted(
                (r for (b, d, _), r in newest.items() if (b, d) == (backend, deltas)), key=lambda r: r["keys"]
            )
            xs = [r["keys"] for r in rows]
            # the commit that adopted the base is above it too
            above = f"base + {deltas + 1} commits above" if deltas else "base + the commit that adopted it"
            ax.plot(
                xs,
                [r["restore_s"] for r in rows],
                marker="o" if deltas else "s",
                color=colors[backend],
                linestyle="-" if deltas else "-.",
                label=f"{backend}: cold restore, {above}",
            )
            if deltas == max(d for b, d, _ in newest if b == backend):
                ax.plot(
                    xs,
                    [r["limit_append_s"] for r in rows],
                    linestyle="--",
                    color=colors[backend],
                    alpha=0.6,
                    label=f"{backend} run: limit, LMDB bulk append of the state",
                )
                ax.plot(
                    xs,
                    [r["limit_read_s"] for r in rows],
                    linestyle=":",
                    color=colors[backend],
                    alpha=0.6,
                    label=f"{backend} run: limit, reading its blobs",
                )
    ax.plot(
        [1e6, 1e7],
        [0.25, 2.0],
        linestyle="none",
        marker="*",
        markersize=12,
        color="tab:green",
        label="targets (1M: 0.25 s, 10M: 2 s)",
    )
    ax.set_xscale("log")
    ax.set_yscale("log")
    ax.set_xlabel("keys (8-byte keys, 8-byte values)")
    ax.set_ylabel("seconds")
    ax.set_title("Cold restore from file:// against the limit measured in the same run")
    ax.grid(True, which="both", alpha=0.3)
    ax.legend(fontsize=7)
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


def main(argv: Sequence[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--keys", type=int, action="append")
    parser.add_argument("--deltas", type=int, default=10)
    parser.add_argument("--updates", type=int, default=10_000)
    parser.add_argument("--backend", action="append", choices=BACKENDS)
    parser.add_argument("--workdir", type=Path)
    parser.add_argument("--seed", type=int, default=7)
    parser.add_argument("--repeat", type=int, default=3, help="restores and limit measurements, in turns; best of each")
    parser.add_argument("--plot", action="store_true", help="draw docs/img/restore-scale.png afterwards")
    parser.add_argument(
        "--after-load", action="store_true", help="the cold restore right after a bulk load and a few update commits"
    )
    parser.add_argument("--commits", type=int, default=5, help="--after-load: update commits after the load")
    parser.add_argument("--child", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.child:
        child(args.child)
        return
    if args.after_load:
        if args.updates == parser.get_default("updates"):
            args.updates = 100_000
        main_after_load(args)
        return
    base = args.workdir or Path(tempfile.mkdtemp(prefix="bench-restore-"))
    results = []
    for keys in args.keys or [1_000_000]:
        for backend in args.backend or BACKENDS:
            print(f"# {backend}, {keys:,} keys", flush=True)
            workdir = base / f"{backend}-{keys}"
            results.append(run(backend, keys, args.deltas, args.updates, workdir, args.seed, args.repeat))
            shutil.rmtree(workdir, ignore_errors=True)
            row = results[-1]
            print(
                f"  restore {row['restore_s']:.3f} s (a process that restored before: {row['warm_restore_s']:.3f} s), "
                f"limit append {row['limit_append_s']:.3f} s, "
                f"read {row['limit_read_s']:.3f} s, peak RSS {row['peak_rss_mib']:.0f} MiB",
                flush=True,
            )
    rows = [
        [
            f"{r['keys']:,}",
            r["backend"],
            f"{r['restore_s']:.3f}",
            f"{r['warm_restore_s']:.3f}",
            f"{r['limit_append_s']:.3f}",
            f"{r['limit_read_s']:.3f}",
            f"{r['x_limit']:.2f}",
            f"{r['x_limit_warm']:.2f}",
            f"{r['blob_bytes'] / 2**20:.1f}",
            f"{r['lmdb_mib']:.0f}",
            f"{r['mb_per_s']:.0f}",
            f"{r['keys_per_s'] / 1e6:.1f}",
            f"{r['peak_rss_mib']:.0f} / {r['peak_anon_mib']:.0f}",
            " ".join(f"{x:.1f}" for x in r["load_average"]),
        ]
        for r in results
    ]
    print()
    print(
        format_table(
            [
                "keys",
                "backend",
                "restore s",
                "warm s",
                "limit: append s",
                "limit: read s",
                "x limit",
                "warm x limit",
                "blobs read MiB",
                "LMDB MiB",
                "MB/s",
                "M keys/s",
                "peak RSS / anon MiB",
                "load",
            ],
            rows,
        )
    )
    path = write_result(
        "restore", {"machine": machine_info(), "deltas": args.deltas, "updates": args.updates, "results": results}
    )
    print(f"\nraw results: {path}")
    if args.plot:
        print(f"figure: {plot()}")


if __name__ == "__main__":
    main()
