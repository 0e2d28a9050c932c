"""Benchmark of the blob-snapshot backend on a ``file://`` blob store (not a test; run by hand, once).

Measures, per ``--keys`` size:

1. restore throughput: load N keys, commit once, wipe the local dir, time ``TaskStorage.open`` (MB/s of data.mdb);
2. bytes uploaded per snapshot (``commit.bytes.uploaded``) for update-in-place and insert-heavy workloads, against
   the snapshot's full size: how much chunk reuse saves;
3. restore time of this backend against the changelog backend on the same history (dual commit, then a wiped
   restore through each backend's marker).

Usage: ``python -m bench.blobsnapshot --keys 1000000 [--keys 10000000] [--workdir DIR]``. The history and workload
sections run at the first size only; larger sizes measure restore throughput only. Prints markdown tables and writes
a JSON result under bench/results/.
"""

from __future__ import annotations

import argparse
import random
import shutil
import tempfile
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from bench.common import format_table, machine_info, write_result
from statebackend.task import TaskStorage

VALUE_SIZE = 32


def key_of(index: int) -> bytes:
    return b"key-%012d" % index


def value_of(rng: random.Random) -> bytes:
    return rng.randbytes(VALUE_SIZE)


def make_config(workdir: Path, backup: str, restore: str) -> dict[str, Any]:
    changelog = {"changelog.snapshot.interval.commits": 20} if "changelog" in backup else {}
    return {**changelog,
        "job.name": "bench",
        "state.local.dir": str(workdir / "local"),
        "blob.store.url": f"file://{workdir / 'blobs'}",
        "stores.counts.backup.factories": backup,
        "stores.counts.restore.factory": restore,
        "task.checkpoint.retained": 2,
        "task.commit.timeout.ms": 3_600_000,
    }


def load(task: TaskStorage, keys: int, rng: random.Random) -> None:
    store = task.store("counts")
    step = 200_000
    for start in range(0, keys, step):
        store.put_all((key_of(i), value_of(rng)) for i in range(start, min(keys, start + step)))


def data_size(workdir: Path) -> int:
    """Size of the live data.mdb (LMDB keeps freed pages in the file, so it exceeds the compacted snapshot)."""
    return (workdir / "local" / "bench" / "task-0" / "counts" / "data" / "data.mdb").stat().st_size


def snapshot_size(task: TaskStorage) -> int:
    """Size of the compacted data.mdb the last snapshot holds, from its index."""
    from statebackend.backends.blobsnapshot.format import SnapshotIndex

    last = task.commit_manager.last_checkpoint
    assert last is not None
    marker = last.markers_for("blobsnapshot")["counts"]
    return SnapshotIndex.decode(task.blob_store.get(marker), name=marker).files[0].size


def timed_restore(config: dict[str, Any], workdir: Path) -> tuple[float, dict[str, Any]]:
    shutil.rmtree(workdir / "local", ignore_errors=True)
    started = time.perf_counter()
    with TaskStorage.open(config, "task-0") as task:
        seconds = time.perf_counter() - started
        count = task.stores["counts"].count()
        metrics = {"keys": count, "restore.bytes": task.metrics.counter("restore.bytes")}
    return seconds, metrics


def restore_throughput(keys: int, root: Path) -> dict[str, Any]:
    workdir = Path(tempfile.mkdtemp(dir=root, prefix=f"restore-{keys}-"))
    try:
        config = make_config(workdir, "blobsnapshot", "blobsnapshot")
        rng = random.Random(1)
        with TaskStorage.open(config, "task-0") as task:
            started = time.perf_counter()
            load(task, keys, rng)
            load_s = time.perf_counter() - started
            started = time.perf_counter()
            task.commit_durably({"input": "load"})
            commit_s = time.perf_counter() - started
            uploaded = task.metrics.counter("commit.bytes.uploaded")
        size = data_size(workdir)
        seconds, metrics = timed_restore(config, workdir)
        assert metrics["keys"] == keys, metrics
        restored = data_size(workdir)
        return {
            "keys": keys,
            "load_s": load_s,
            "first_commit_s": commit_s,
            "snapshot_bytes": uploaded,
            "restored_file_bytes": restored,
            "live_file_bytes": size,
            "restore_s": seconds,
            "restore_mb_s": restored / seconds / 1e6,
        }
    finally:
        shutil.rmtree(workdir, ignore_errors=True)


def workloads(keys: int, root: Path, commits: int) -> list[dict[str, Any]]:
    """Bytes uploaded per snapshot for update-in-place and insert-heavy workloads on ``keys`` keys."""
    workdir = Path(tempfile.mkdtemp(dir=root, prefix="workloads-"))
    rows: list[dict[str, Any]] = []
    try:
        config = make_config(workdir, "blobsnapshot", "blobsnapshot")
        rng = random.Random(2)
        with TaskStorage.open(config, "task-0") as task:
            load(task, keys, rng)
            task.commit_durably({"input": "load"})
            store = task.store("counts")
            next_key = keys
            plans = [
                ("update in place, random keys", 1_000),
                ("update in place, random keys", 10_000),
                ("update in place, random keys", 50_000),
                ("update in place, one key range", 10_000),
                ("insert new keys, random positions", 10_000),
                ("insert new keys, appended at the end", 10_000),
            ]
            for label, count in plans:
                samples = []
                for _ in range(commits):
                    if label.startswith("update in place, random"):
                        for i in rng.sample(range(keys), count):
                            store.put(key_of(i), value_of(rng))
                    elif label.startswith("update in place, one key range"):
                        start = rng.randrange(keys - count)
                        store.put_all((key_of(i), value_of(rng)) for i in range(start, start + count))
                    elif "random positions" in label:
                        # keys between existing ones: a suffix sorts them inside the loaded range
                        for i in rng.sample(range(keys), count):
                            store.put(key_of(i) + b"+%06d" % next_key, value_of(rng))
                            next_key += 1
                    else:
                        store.put_all((key_of(i), value_of(rng)) for i in range(next_key, next_key + count))
                        next_key += count
                    before = task.metrics.counter("commit.bytes.uploaded")
                    task.commit_durably({"input": f"{label}-{len(samples)}"})
                    samples.append(task.metrics.counter("commit.bytes.uploaded") - before)
                size = snapshot_size(task)
                mean = sum(samples) / len(samples)
                rows.append({
                    "workload": label, "changed_keys": count, "commits": commits,
                    "uploaded_per_commit_bytes": mean, "file_bytes": size, "uploaded_fraction": mean / size,
                })
    finally:
        shutil.rmtree(workdir, ignore_errors=True)
    return rows


def versus_changelog(keys: int, root: Path, commits: int, updates: int) -> dict[str, Any]:
    """Same history backed up by both (dual commit); restore it wiped through each backend's marker."""
    workdir = Path(tempfile.mkdtemp(dir=root, prefix="versus-"))
    try:
        dual = make_config(workdir, "changelog,blobsnapshot", "blobsnapshot")
        rng = random.Random(3)
        with TaskStorage.open(dual, "task-0") as task:
            load(task, keys, rng)
            task.commit_durably({"input": "load"})
            store = task.store("counts")
            for round_no in range(commits):
                for i in rng.sample(range(keys), updates):
                    store.put(key_of(i), value_of(rng))
                task.commit_durably({"input": str(round_no)})
            task.commit_manager.wait()
        result: dict[str, Any] = {"keys": keys, "commits": commits, "updates_per_commit": updates}
        for backend in ("blobsnapshot", "changelog"):
            config = make_config(workdir, "changelog,blobsnapshot", backend)
            seconds, metrics = timed_restore(config, workdir)
            assert metrics["keys"] == keys, metrics
            result[f"{backend}_restore_s"] = seconds
            result[f"{backend}_restore_bytes"] = metrics["restore.bytes"]
        return result
    finally:
        shutil.rmtree(workdir, ignore_errors=True)


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--keys", type=int, action="append", help="state size(s); default 1000000")
    parser.add_argument("--commits", type=int, default=3, help="commits per workload row")
    parser.add_argument("--workdir", type=Path, default=None, help="where to put the local dir and the blob store")
    args = parser.parse_args(argv)
    sizes = args.keys or [1_000_000]
    root = args.workdir or Path(tempfile.gettempdir())
    root.mkdir(parents=True, exist_ok=True)
    result: dict[str, Any] = {"machine": machine_info(), "restore": [], "workloads": [], "versus": None}
    for keys in sizes:
        result["restore"].append(restore_throughput(keys, root))
        print(format_table(
            ["keys", "data.mdb MB", "first snapshot MB", "restore s", "restore MB/s"],
            [[r["keys"], r["restored_file_bytes"] / 1e6, r["snapshot_bytes"] / 1e6, r["restore_s"], r["restore_mb_s"]]
             for r in result["restore"][-1:]],
        ), flush=True)
    first = sizes[0]
    result["workloads"] = workloads(first, root, args.commits)
    print(format_table(
        ["workload", "changed keys/commit", "uploaded MB/commit", "snapshot MB", "uploaded %"],
        [[w["workload"], w["changed_keys"], w["uploaded_per_commit_bytes"] / 1e6, w["file_bytes"] / 1e6,
          100.0 * w["uploaded_fraction"]] for w in result["workloads"]],
    ), flush=True)
    versus = versus_changelog(first, root, commits=10, updates=50_000)
    result["versus"] = versus
    print(format_table(
        ["keys", "commits x updates", "blobsnapshot restore s", "changelog restore s"],
        [[versus["keys"], f"{versus['commits']} x {versus['updates_per_commit']}", versus["blobsnapshot_restore_s"],
          versus["changelog_restore_s"]]],
    ), flush=True)
    print("result:", write_result("blobsnapshot", result))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
