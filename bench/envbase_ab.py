"""Bytes per commit (bases included) and cold restore at the end of a long history, one version of the library.

Run with a checkout's own interpreter, the script from anywhere: ``<checkout>/.venv/bin/python bench/envbase_ab.py
--label after [--keys 1000000] [--updates 10000] [--commits 150] [--shapes int,random]``. It imports only
``statebackend`` (the installed checkout's), so the same script measures two versions in the same run: the
before/after comparison of environment-file bases in docs/benchmarks.md alternates the two.

Per backend (changelog, blobsnapshot; default options: changelog.snapshot.interval.ratio 1 / .commits 100,
blobsnapshot.compaction.full.ratio 1) and key/value shape: load ``--keys`` keys in one commit, then ``--commits``
commits of ``--updates`` random updates each, durable before the next (the load's uploads not counted). Every byte
written to the ``file://`` blob store is logged with the commit it came during; bases are told apart by kind
(changelog: ``/snapshot/`` blobs) or by the index (blobsnapshot: a new bottom run). Then the local dir is wiped and
the store restored cold (best of ``--repeat``), the state checked by its key count.

Shapes: ``int`` (8-byte big-endian integer keys 0..N-1 and 8-byte counts 1..255: compresses very well, the
blob-snapshot benchmark's shape), ``kfmt`` (``k%08d`` keys, one in four of the key space, 8-byte counts: the bytes
benchmark's key shape) and ``random`` (16-byte random keys, 32-byte random values: does not compress).
"""

from __future__ import annotations

import argparse
import itertools
import json
import os
import random
import shutil
import struct
import tempfile
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from datetime import UTC, datetime
from pathlib import Path
from typing import Any, BinaryIO

import statebackend
from statebackend import TaskStorage
from statebackend.blobstores import file as file_blobs

_U64 = struct.Struct(">Q")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--label", required=True)
    parser.add_argument("--keys", type=int, default=1_000_000)
    parser.add_argument("--updates", type=int, default=10_000)
    parser.add_argument("--commits", type=int, default=150)
    parser.add_argument("--shapes", default="int,random")
    parser.add_argument("--backends", default="changelog,blobsnapshot")
    parser.add_argument("--repeat", type=int, default=2)
    parser.add_argument("--option", action="append", default=[], metavar="KEY=VALUE")
    parser.add_argument("--out", type=Path, default=Path("bench/results"))
    args = parser.parse_args()
    options = dict(item.split("=", 1) for item in args.option)
    result: dict[str, Any] = {
        "label": args.label,
        "library": statebackend.__file__,
        "loadavg_start": os.getloadavg(),
        "keys": args.keys,
        "updates": args.updates,
        "commits": args.commits,
        "options": options,
        "runs": [],
    }
    for shape in args.shapes.split(","):
        for backend in args.backends.split(","):
            row = run(backend, shape, args.keys, args.updates, args.commits, args.repeat, options)
            result["runs"].append(row)
            print(json.dumps({k: v for k, v in row.items() if k not in ("writes", "bases")}), flush=True)
    result["loadavg_end"] = os.getloadavg()
    stamp = datetime.now(UTC).strftime("%Y%m%dT%H%M%SZ")
    args.out.mkdir(parents=True, exist_ok=True)
    path = args.out / f"envbase-ab-{args.label}-{stamp}.json"
    path.write_text(json.dumps(result, indent=1))
    print(f"raw numbers: {path}")


def run(
    backend: str, shape: str, keys: int, updates: int, commits: int, repeat: int, options: dict[str, str]
) -> dict[str, Any]:
    root = Path(tempfile.mkdtemp(prefix="bench-envbase-ab-"))
    rng = random.Random(11)
    settings = {
        **{k: v for k, v in options.items() if k.startswith(backend + ".")},
        "job.name": "j",
        "state.local.dir": str(root / "local"),
        "blob.store.url": (root / "blobs").as_uri(),
        "blob.store.create.if.missing": True,
        "stores.counts.backup.factories": backend,
        "task.commit.timeout.ms": 3_600_000,
    }
    key_of, value_of = shapes(shape, keys, rng)
    counts = [rng.randrange(1, 256) for _ in range(keys)]
    bottoms: list[dict[str, Any]] = []
    try:
        with counting_writes() as (writes, now), TaskStorage.open(settings, "task-0") as task:
            store = task.store("counts")
            step = 200_000
            for start in range(0, keys, step):
                store.put_all((key_of(i), value_of(i, counts[i])) for i in range(start, min(keys, start + step)))
            task.commit_durably({"p": "0"})
            background_done()  # the load's background uploads are over; count from here
            bottom = bottom_run(root) if backend == "blobsnapshot" else None
            now[0] = 1
            started = time.perf_counter()
            for commit in range(1, commits + 1):
                now[0] = commit
                for i in rng.sample(range(keys), updates):
                    counts[i] = counts[i] % 255 + 1
                    store.put(key_of(i), value_of(i, counts[i]))
                task.commit_durably({"p": str(commit)})
                if backend == "blobsnapshot":
                    seen = bottom_run(root)
                    if seen and seen != bottom:
                        bottoms.append({"commit": commit, **seen})
                        bottom = seen
                time.sleep(0.02)  # the gap between batches, where a background base runs
            history_s = time.perf_counter() - started
        # what close waits for (a base still being written) is logged at the last commit and counted too
        samples, metrics = [], {}
        for _ in range(repeat):
            shutil.rmtree(root / "local")
            started = time.perf_counter()
            with TaskStorage.open(settings, "task-0") as task:
                samples.append(time.perf_counter() - started)
                if task.store("counts").count() != keys:
                    raise AssertionError(f"restored {task.store('counts').count()} keys, expected {keys}")
                metrics = {
                    k: v
                    for k, v in task.metrics.snapshot().items()
                    if k.startswith("restore") and isinstance(v, (int, float))
                }
        last_index = last_runs(root) if backend == "blobsnapshot" else None
    finally:
        shutil.rmtree(root, ignore_errors=True)
    if backend == "changelog":
        bases = [{"commit": c, "size": size} for c, name, size in writes if "/snapshot/" in name]
    else:
        bases = bottoms
    total = sum(size for _, _, size in writes)
    base_bytes = sum(base["size"] for base in bases)
    base_commits = [base["commit"] for base in bases]
    return {
        "backend": backend,
        "shape": shape,
        "keys": keys,
        "updates": updates,
        "commits": commits,
        "history_s": history_s,
        "total_per_commit": total / commits,
        "base_per_commit": base_bytes / commits,
        "rest_per_commit": (total - base_bytes) / commits,
        "bases": bases,
        "base_sizes": [base["size"] for base in bases],
        "base_commits": base_commits,
        "commits_between_bases": [b - a for a, b in itertools.pairwise(base_commits)],
        "commits_since_last_base": commits - base_commits[-1] if base_commits else commits,
        "restore_s": samples,
        "restore_s_best": min(samples),
        "restore_metrics": metrics,
        "last_index": last_index,
        "writes": writes,
    }


def shapes(shape: str, keys: int, rng: random.Random) -> tuple[Callable[[int], bytes], Callable[[int, int], bytes]]:
    if shape == "int":
        return _U64.pack, lambda i, count: _U64.pack(count)
    if shape == "kfmt":
        return lambda i: b"k%08d" % (i * 4), lambda i, count: _U64.pack(count)
    if shape == "random":
        raw = rng.randbytes(16 * keys)
        return (lambda i: raw[16 * i : 16 * i + 16]), (lambda i, count: rng.randbytes(32))
    raise SystemExit(f"unknown shape {shape!r}: int, kfmt or random")


def background_done() -> None:
    """Wait until the process's background snapshot and compaction threads have finished what was queued (each is one
    thread, FIFO: a no-op queued behind the work ends after it)."""
    from statebackend.backends.blobsnapshot.compaction import _compaction_pools
    from statebackend.backends.changelog.snapshots import maintenance_pool

    maintenance_pool().submit(lambda: None).result(timeout=600)
    _compaction_pools.get(1).submit(lambda: None).result(timeout=600)


@contextmanager
def counting_writes() -> Iterator[tuple[list[tuple[int, str, int]], list[int]]]:
    """Log (commit, name, bytes) of every blob and metadata sidecar FileBlobStore writes while ``now[0]`` > 0."""
    writes: list[tuple[int, str, int]] = []
    now = [0]
    original_write = file_blobs.FileBlobStore._write
    original_metadata = file_blobs.FileBlobStore._write_metadata

    def write(self: Any, name: str, body: Callable[[BinaryIO], None], **kwargs: Any) -> None:
        def counted(out: BinaryIO) -> None:
            start = out.tell()
            body(out)
            if now[0]:
                writes.append((now[0], name, out.tell() - start))

        original_write(self, name, counted, **kwargs)

    def write_metadata(self: Any, name: str, inode: int, metadata: dict[str, str]) -> None:
        if now[0]:
            writes.append(
                (
                    now[0],
                    name + "#metadata",
                    len(json.dumps({"name": name, "metadata": metadata}, sort_keys=True).encode()),
                )
            )
        original_metadata(self, name, inode, metadata)

    file_blobs.FileBlobStore._write = write  # type: ignore[method-assign]
    file_blobs.FileBlobStore._write_metadata = write_metadata  # type: ignore[method-assign]
    try:
        yield writes, now
    finally:
        file_blobs.FileBlobStore._write = original_write  # type: ignore[method-assign]
        file_blobs.FileBlobStore._write_metadata = original_metadata  # type: ignore[method-assign]


def _newest_index(root: Path) -> dict[str, Any] | None:
    indexes = [p for p in (root / "blobs").rglob("index/*.json") if not p.name.startswith(".")]
    return json.loads(max(indexes).read_text()) if indexes else None


def bottom_run(root: Path) -> dict[str, Any] | None:
    index = _newest_index(root)
    if not index or not index["runs"]:
        return None
    run = index["runs"][0]
    return {"hash": run.get("hash"), "size": run["size"]}


def last_runs(root: Path) -> dict[str, Any] | None:
    index = _newest_index(root)
    if not index:
        return None
    return {
        "runs": len(index["runs"]),
        "bottom_bytes": index["runs"][0]["size"],
        "above_bytes": sum(run["size"] for run in index["runs"][1:]),
    }


if __name__ == "__main__":
    main()
