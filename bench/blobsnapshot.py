"""Benchmark of the blob-snapshot backend (runs + compaction) against the changelog backend, on ``file://``.

Not a test; run by hand. Per ``--keys`` size and per backend (``blobsnapshot``, ``changelog``), on the same history
(same seed, so the same keys and values):

1. load N integer keys (8-byte big-endian keys, 8-byte counts) in one commit;
2. per ``--updates`` size U, ``--commits`` commits of U random updates each (about 1 in 20 a delete, re-inserted
   later), each made durable before the next; measured per phase: bytes uploaded per commit (commit uploads plus
   every compaction and background snapshot byte of the phase, amortized over its commits), the zstd size of the
   change set itself (keys and values concatenated, level 3) for reference, and the sync part of the commit
   (``TaskStorage.commit`` returning, p50/p95);
3. warm open (local dir kept: ``TaskStorage.open`` end to end) and cold restore (local dir wiped), with the state
   checked against the model after each; for blobsnapshot also the cold restore of the same state right after a
   full compaction (one base run), the best point of the compaction cycle, where the end of the history may be
   near the worst (the runs above the base up to ``compaction.full.ratio`` times its size).

Usage: ``python -m bench.blobsnapshot --keys 1000000 --keys 10000000 [--updates 10000 --updates 50000]
[--commits 20] [--workdir DIR]``. Prints markdown tables and writes a JSON result under bench/results/.

``--restore-scale [--plot]`` runs bench/restore.py instead (cold restore of both backends at each ``--keys``, e.g.
1M, 10M and 50M, against the limit measured in the same run, and its figure).
"""

from __future__ import annotations

import argparse
import json
import random
import shutil
import struct
import tempfile
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import zstandard

from bench.common import format_table, machine_info, p50_p95, write_result
from statebackend.task import TaskStorage

_KEY = struct.Struct(">Q")
_VALUE = struct.Struct(">q")


def make_config(workdir: Path, backend: str, options: dict[str, str] | None = None) -> dict[str, Any]:
    return {
        **(options or {}),
        "job.name": "bench",
        "state.local.dir": str(workdir / "local"),
        "blob.store.url": f"file://{workdir / 'blobs'}",
        "stores.counts.backup.factories": backend,
        "task.checkpoint.retained": 2,
        "task.commit.timeout.ms": 3_600_000,
    }


def counters(task: TaskStorage) -> dict[str, float]:
    return {k: v for k, v in task.metrics.snapshot().items() if isinstance(v, (int, float))}


def phase_bytes(before: dict[str, float], after: dict[str, float]) -> float:
    keys = ("commit.bytes.uploaded", "blobsnapshot.compaction.bytes")
    return sum(after.get(k, 0.0) - before.get(k, 0.0) for k in keys)


def run_backend(
    backend: str, keys: int, updates: Sequence[int], commits: int, workdir: Path, seed: int, options: dict[str, str]
) -> dict[str, Any]:
    shutil.rmtree(workdir, ignore_errors=True)
    workdir.mkdir(parents=True)
    config = make_config(workdir, backend, {k: v for k, v in options.items() if k.startswith(backend + ".")})
    rng = random.Random(seed)
    model = bytearray(keys)  # counts mod 256 are enough to check; 0 = absent
    result: dict[str, Any] = {"backend": backend, "keys": keys, "phases": []}
    seq = 0
    with TaskStorage.open(config, "task-0") as task:
        store = task.store("counts")
        started = time.perf_counter()
        step = 500_000
        # counts as a long-running job has them (1..255), so the first run compresses like the state it stands for
        for i in range(keys):
            model[i] = rng.randrange(1, 256)
        for start in range(0, keys, step):
            store.put_all((_KEY.pack(i), _VALUE.pack(model[i])) for i in range(start, min(keys, start + step)))
        seq += 1
        task.commit_durably({"p": str(seq)})
        result["load_s"] = time.perf_counter() - started
        compressor = zstandard.ZstdCompressor(level=3)
        for size in updates:
            before = counters(task)
            change_zstd = 0
            sync_ms: list[float] = []
            for _ in range(commits):
                picked = rng.sample(range(keys), size)
                picked.sort()
                parts = []
                for key in picked:
                    raw_key = _KEY.pack(key)
                    if rng.random() < 0.05 and model[key]:
                        store.delete(raw_key)
                        model[key] = 0
                        parts.append(raw_key)
                    else:
                        model[key] = (model[key] + 1) % 256 or 1
                        value = _VALUE.pack(model[key])
                        store.put(raw_key, value)
                        parts.append(raw_key + value)
                change_zstd += len(compressor.compress(b"".join(parts)))
                seq += 1
                started = time.perf_counter()
                pending = task.commit({"p": str(seq)})  # returns after the sync part
                sync_ms.append((time.perf_counter() - started) * 1000.0)
                assert pending is not None
                pending.result()  # durable before the next batch: the same history for both backends
            sync_p50, sync_p95 = p50_p95(sync_ms)
            after = counters(task)
            result["phases"].append(
                {
                    "updates": size,
                    "commits": commits,
                    "uploaded_per_commit": phase_bytes(before, after) / commits,
                    "change_zstd_per_commit": change_zstd / commits,
                    "sync_p50_ms": sync_p50,
                    "sync_p95_ms": sync_p95,
                    "after": after,
                }
            )
    # close waited for a running compaction: count its bytes in the last phase
    blob_bytes = sum(p.stat().st_size for p in (workdir / "blobs").rglob("*") if p.is_file())
    result["blob_store_bytes"] = blob_bytes
    if backend == "blobsnapshot":
        index = max((workdir / "blobs").rglob("index/*.json"))
        runs = json.loads(index.read_text())["runs"]
        result["last_index"] = {
            "runs": len(runs),
            "bottom_bytes": runs[0]["size"],
            "above_bytes": sum(run["size"] for run in runs[1:]),
            "records": sum(run["records"] for run in runs),
        }
    started = time.perf_counter()
    with TaskStorage.open(config, "task-0") as task:
        result["warm_open_s"] = time.perf_counter() - started
        check(task, model)
    shutil.rmtree(workdir / "local")
    started = time.perf_counter()
    with TaskStorage.open(config, "task-0") as task:
        result["cold_restore_s"] = time.perf_counter() - started
        result["cold_restore_metrics"] = {k: v for k, v in task.metrics.snapshot().items() if k.startswith("restore")}
        check(task, model)
    if backend == "blobsnapshot":
        # the same state right after a full compaction (one base run): a commit with a run under a tiny ratio
        # starts it, close waits for it, the next open's first commit adopts it
        compact = dict(
            config, **{"blobsnapshot.compaction.full.ratio": "0.05", "blobsnapshot.compaction.full.min.bytes": "0"}
        )
        for _ in range(2):
            with TaskStorage.open(compact, "task-0") as task:
                model[0] = (model[0] + 1) % 256 or 1
                task.store("counts").put(_KEY.pack(0), _VALUE.pack(model[0]))
                seq += 1
                task.commit_durably({"p": str(seq)})
        shutil.rmtree(workdir / "local")
        started = time.perf_counter()
        with TaskStorage.open(config, "task-0") as task:
            result["cold_restore_compacted_s"] = time.perf_counter() - started
            result["compacted_metrics"] = {k: v for k, v in task.metrics.snapshot().items() if k.startswith("restore")}
            check(task, model)
    return result


def check(task: TaskStorage, model: bytearray) -> None:
    store = task.store("counts")
    expected = sum(1 for count in model if count)
    found = 0
    for key, value in store.items():
        index = _KEY.unpack(key)[0]
        if model[index] != _VALUE.unpack(value)[0]:
            raise AssertionError(f"key {index}: restored {_VALUE.unpack(value)[0]}, expected {model[index]}")
        found += 1
    if found != expected:
        raise AssertionError(f"restored {found} keys, expected {expected}")


def main(argv: Sequence[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--keys", type=int, action="append")
    parser.add_argument("--updates", type=int, action="append")
    parser.add_argument("--commits", type=int, default=20)
    parser.add_argument("--workdir", type=Path)
    parser.add_argument("--seed", type=int, default=7)
    parser.add_argument(
        "--option",
        action="append",
        default=[],
        metavar="KEY=VALUE",
        help="a backend option, e.g. blobsnapshot.compaction.full.ratio=0.5",
    )
    parser.add_argument(
        "--restore-scale",
        action="store_true",
        help="instead: cold restore at scale against the limit measured in the same run, both "
        "backends, per --keys (bench/restore.py; --plot draws docs/img/restore-scale.png)",
    )
    parser.add_argument("--plot", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.restore_scale:
        from bench import restore

        restore.main(
            [
                *(f"--keys={k}" for k in args.keys or [1_000_000]),
                *(["--plot"] if args.plot else []),
                *([f"--workdir={args.workdir}"] if args.workdir else []),
            ]
        )
        return
    sizes = args.keys or [1_000_000]
    updates = args.updates or [10_000, 50_000]
    base = args.workdir or Path(tempfile.mkdtemp(prefix="bench-blobsnapshot-"))
    results = []
    for keys in sizes:
        for backend in ("blobsnapshot", "changelog"):
            print(f"# {backend}, {keys:,} keys", flush=True)
            options = dict(item.split("=", 1) for item in args.option)
            results.append(
                run_backend(backend, keys, updates, args.commits, base / f"{backend}-{keys}", args.seed, options)
            )
    rows = []
    for keys in sizes:
        ours = next(r for r in results if r["keys"] == keys and r["backend"] == "blobsnapshot")
        theirs = next(r for r in results if r["keys"] == keys and r["backend"] == "changelog")
        for mine, other in zip(ours["phases"], theirs["phases"], strict=True):
            rows.append(
                [
                    f"{keys:,}",
                    f"{mine['updates']:,}",
                    mine["commits"],
                    f"{mine['change_zstd_per_commit'] / 1024:.0f}",
                    f"{mine['uploaded_per_commit'] / 1024:.0f}",
                    f"{mine['uploaded_per_commit'] / mine['change_zstd_per_commit']:.2f}",
                    f"{other['uploaded_per_commit'] / 1024:.0f}",
                    f"{mine['uploaded_per_commit'] / other['uploaded_per_commit']:.2f}",
                    f"{mine['sync_p50_ms']:.1f} / {mine['sync_p95_ms']:.1f}",
                ]
            )
    print()
    print(
        format_table(
            [
                "keys",
                "updates/commit",
                "commits",
                "change zstd KiB",
                "blobsnapshot KiB/commit",
                "x change",
                "changelog KiB/commit",
                "x changelog",
                "sync p50/p95 ms",
            ],
            rows,
        )
    )
    rows = []
    for r in results:
        last = r.get("last_index")
        shape = (
            f"{last['runs']} runs, {last['bottom_bytes'] / 2**20:.1f} + {last['above_bytes'] / 2**20:.1f} MiB, "
            f"{last['records']:,} records"
            if last
            else ""
        )
        compacted = r.get("cold_restore_compacted_s")
        rows.append(
            [
                f"{r['keys']:,}",
                r["backend"],
                f"{r['load_s']:.1f}",
                f"{r['warm_open_s'] * 1000:.1f}",
                f"{r['cold_restore_s']:.2f}",
                f"{compacted:.2f}" if compacted is not None else "",
                f"{r['blob_store_bytes'] / 2**20:.1f}",
                shape,
            ]
        )
    print()
    print(
        format_table(
            [
                "keys",
                "backend",
                "load s",
                "warm open ms",
                "cold restore s",
                "cold restore, one base run s",
                "blob store MiB",
                "last index (bottom + above)",
            ],
            rows,
        )
    )
    path = write_result(
        "blobsnapshot", {"machine": machine_info(), "commits": args.commits, "options": args.option, "results": results}
    )
    print(f"\nraw results: {path}")


if __name__ == "__main__":
    main()
