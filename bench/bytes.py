"""Bytes uploaded per commit by the changelog backend, by kind, and what the snapshot interval costs at restore.

Run from the repository root: ``python -m bench.bytes [--updates 2500,12500] [--commits 60] [--policies 20:0,100:1]
[--restore]``. One task of the Spark benchmark's state (250,000 keys ``k%08d`` of the ``string`` serde, ``integer``
values: 1M keys in 4 tasks), on a ``file://`` blob store; each commit increments U random keys (2,500 and 12,500 per
task are the Spark benchmark's 10k and 50k updates per batch). Every byte written to the blob store is counted by
kind, blobs deleted later included: delta, checkpoint, snapshot (background, amortized over the commits) and the
file store's metadata sidecars (``created_at``; other blob stores keep it in the blob's own metadata).

``--restore``: for each chain length (``--chains``), the store is loaded, committed, updated by that many commits
with no snapshot in between (the longest chain ``snapshot.interval.commits`` = length + 1 leaves), wiped locally
and restored; the best ``restore.ms`` of ``--repeat`` restores is reported, for one task's 250k keys and for a
single store of 1M keys (``--restore-keys``). Raw numbers go to ``bench/results/bytes-<UTC time>.json``.
"""

from __future__ import annotations

import argparse
import collections
import json
import random
import shutil
import tempfile
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any, BinaryIO

from bench.common import machine_info, write_result
from statebackend import TaskStorage
from statebackend.blobstores import file as file_blobs

KINDS = ("delta", "checkpoint", "snapshot", "metadata")


def kind_of(name: str) -> str:
    for kind, part in (("checkpoint", "/checkpoints/"), ("delta", "/delta/"), ("snapshot", "/snapshot/")):
        if part in name:
            return kind
    return "other"


@contextmanager
def counting_uploads() -> Iterator[tuple[collections.Counter[str], collections.Counter[str], list[bool]]]:
    """Count the bytes and blobs FileBlobStore writes, by kind, while the yielded flag's first item is True."""
    written: collections.Counter[str] = collections.Counter()
    blobs: collections.Counter[str] = collections.Counter()
    on = [False]
    original_write = file_blobs.FileBlobStore._write
    original_metadata = file_blobs.FileBlobStore._write_metadata

    def write(self: Any, name: str, body: Callable[[BinaryIO], None], **kwargs: Any) -> None:
        def counted(out: BinaryIO) -> None:
            start = out.tell()
            body(out)
            if on[0]:
                written[kind_of(name)] += out.tell() - start
                blobs[kind_of(name)] += 1

        original_write(self, name, counted, **kwargs)

    def write_metadata(self: Any, name: str, inode: int, metadata: dict[str, str]) -> None:
        if on[0]:  # the sidecar's body, as FileBlobStore._write_metadata encodes it
            written["metadata"] += len(json.dumps({"name": name, "metadata": metadata}, sort_keys=True).encode())
            blobs["metadata"] += 1
        original_metadata(self, name, inode, metadata)

    file_blobs.FileBlobStore._write = write  # type: ignore[method-assign]
    file_blobs.FileBlobStore._write_metadata = write_metadata  # type: ignore[method-assign]
    try:
        yield written, blobs, on
    finally:
        file_blobs.FileBlobStore._write = original_write  # type: ignore[method-assign]
        file_blobs.FileBlobStore._write_metadata = original_metadata  # type: ignore[method-assign]


def config(root: Path, interval: int, ratio: float = 0.0) -> dict[str, Any]:
    return {
        "job.name": "j",
        "state.local.dir": str(root / "local"),
        "blob.store.url": (root / "blobs").as_uri(),
        "blob.store.create.if.missing": True,
        "stores.counts.backup.factories": "changelog",
        "stores.counts.key.serde": "string",
        "stores.counts.msg.serde": "integer",
        "changelog.snapshot.interval.commits": interval,
        "changelog.snapshot.interval.ratio": ratio,
        "changelog.snapshot.interval.bytes": 1 << 62,
    }


#: the key of index i: "regular" (every 4th key of 1M, as before 2026-11-25: sorted planes compress to almost nothing)
#: or "spark" (the Spark benchmark's: one task's share of 1M keys picked by hash, so the gaps are irregular)
KEY_SHAPES = ("spark", "regular")
_shape = ["spark"]
_spark_keys: list[int] = []


def keys_of(indexes: Iterator[int] | range | list[int]) -> list[str]:
    if _shape[0] == "regular":
        return [f"k{i * 4:08d}" for i in indexes]
    if not _spark_keys:
        _spark_keys.extend(sorted(random.Random(7).sample(range(1_000_000), 250_000)))
    return [f"k{_spark_keys[i % len(_spark_keys)] + 1_000_000 * (i // len(_spark_keys)):08d}" for i in indexes]


def bytes_per_commit(keys: int, updates: int, commits: int, interval: int, ratio: float = 0.0) -> dict[str, Any]:
    """Bytes per commit by kind, the initial load not counted."""
    root = Path(tempfile.mkdtemp(prefix="bench-bytes-"))
    rng = random.Random(1)
    try:
        with (
            counting_uploads() as (written, blobs, on),
            TaskStorage.open(config(root, interval, ratio), "task-0") as task,
        ):
            store = task.store("counts")
            store.put_many(keys_of(range(keys)), [1] * keys)
            task.commit_durably({"batch": "0"})
            time.sleep(0.5)  # the load's uploads are done; count from here
            on[0] = True
            for commit in range(1, commits + 1):
                batch = sorted(keys_of(rng.sample(range(keys), updates)))
                store.put_many(batch, [value + 1 for value in store.get_many(batch)])
                task.commit_durably({"batch": str(commit)})
                time.sleep(0.02)  # lets a background snapshot run, as the gap between batches does
            time.sleep(1.0)
            on[0] = False
    finally:
        shutil.rmtree(root, ignore_errors=True)
    per_commit = {kind: written[kind] / commits for kind in KINDS}
    return {
        "keys": keys,
        "updates": updates,
        "commits": commits,
        "interval": interval,
        "ratio": ratio,
        "bytes_per_commit": per_commit,
        "total_per_commit": sum(per_commit.values()),
        "blobs": {kind: blobs[kind] for kind in KINDS},
        "bytes_per_blob": {kind: written[kind] / blobs[kind] for kind in KINDS if blobs[kind]},
    }


def restore_ms(keys: int, updates: int, chain: int, repeat: int) -> dict[str, Any]:
    """Best restore.ms of ``repeat`` wiped restores of a store loaded and then updated by ``chain`` commits."""
    root = Path(tempfile.mkdtemp(prefix="bench-bytes-restore-"))
    rng = random.Random(1)
    settings = config(root, 1_000_000)
    try:
        with TaskStorage.open(settings, "task-0") as task:
            store = task.store("counts")
            store.put_many(keys_of(range(keys)), [1] * keys)
            task.commit_durably({"batch": "0"})
            for commit in range(1, chain + 1):
                batch = sorted(keys_of(rng.sample(range(keys), updates)))
                store.put_many(batch, [value + 1 for value in store.get_many(batch)])
                task.commit_durably({"batch": str(commit)})
        samples = []
        for _ in range(repeat):
            shutil.rmtree(root / "local")
            with TaskStorage.open(settings, "task-0") as task:
                if task.store("counts").count() != keys:
                    raise AssertionError(f"restored {task.store('counts').count()} keys, expected {keys}")
                samples.append(task.metrics.samples("restore.ms")[0])
                replayed = int(task.metrics.counter("restore.deltas.replayed"))
    finally:
        shutil.rmtree(root, ignore_errors=True)
    return {
        "keys": keys,
        "updates": updates,
        "deltas_after_load": chain,
        "deltas_replayed": replayed,
        "restore_ms_best": min(samples),
        "restore_ms": samples,
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--keys", type=int, default=250_000)
    parser.add_argument("--updates", default="2500,12500")
    parser.add_argument("--commits", type=int, default=60)
    parser.add_argument(
        "--policies",
        default="20:0,100:1",
        help="snapshot policies, each "
        "changelog.snapshot.interval.commits:changelog.snapshot.interval.ratio (default: the old "
        "fixed interval of 20, and the defaults since 2026-11-25)",
    )
    parser.add_argument("--key-shape", choices=KEY_SHAPES, default="spark")
    parser.add_argument("--restore", action="store_true", help="also time restores after chains of deltas")
    parser.add_argument("--chains", default="0,19,39,59")
    parser.add_argument("--restore-keys", type=int, default=1_000_000)
    parser.add_argument("--repeat", type=int, default=3)
    parser.add_argument(
        "--restore-scale",
        type=int,
        action="append",
        metavar="KEYS",
        help="instead: cold restore of KEYS keys (repeatable: 1000000, 10000000, 50000000) against "
        "the limit measured in the same run, both backends (bench/restore.py)",
    )
    args = parser.parse_args()
    if args.restore_scale:
        from bench import restore

        restore.main([f"--keys={keys}" for keys in args.restore_scale])
        return
    _shape[0] = args.key_shape
    updates = [int(u) for u in args.updates.split(",")]
    result: dict[str, Any] = {"machine": machine_info(), "bytes": [], "restore": []}
    for policy in args.policies.split(","):
        interval, ratio = int(policy.split(":")[0]), float(policy.split(":")[1])
        for count in updates:
            row = bytes_per_commit(args.keys, count, args.commits, interval, ratio)
            result["bytes"].append(row)
            parts = "  ".join(f"{kind} {row['bytes_per_commit'][kind]:,.0f}" for kind in KINDS)
            snapshot_blob = row["bytes_per_blob"].get("snapshot", 0)
            print(
                f"interval {interval:>3} ratio {ratio:g}, {count:>6,} updates/commit: {parts}  total "
                f"{row['total_per_commit']:,.0f} B/commit (snapshot blob {snapshot_blob:,.0f} B)",
                flush=True,
            )
    if args.restore:
        chains = [int(c) for c in args.chains.split(",")]
        for keys, per_commit in [(args.keys, count) for count in updates] + [
            (args.restore_keys, count * 4) for count in updates
        ]:
            for chain in chains:
                row = restore_ms(keys, per_commit, chain, args.repeat)
                result["restore"].append(row)
                print(
                    f"restore {keys:,} keys + {chain} deltas of {per_commit:,} updates: best "
                    f"{row['restore_ms_best']:,.0f} ms of {[round(ms) for ms in row['restore_ms']]}",
                    flush=True,
                )
    print(f"raw numbers: {write_result('bytes', result)}")


if __name__ == "__main__":
    main()
