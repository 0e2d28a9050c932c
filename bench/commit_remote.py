"""Commit latency of the changelog-delta backend on file://, Azurite (az://) and moto's S3 server (s3://), one run.

    python -m bench.commit_remote                       # 250k keys in one task, 10k updates per commit, 20 commits

One task with N keys (bulk-loaded, one durable commit, not counted), then ``--commits`` rounds of U distinct random
updates, each committed durably. Per commit: the sync part (``task.commit()`` returning) and the durable time (until
the checkpoint is in the checkpoint log); then a restore from the blob store alone (local dir wiped). The servers are
started on loopback ports by the same code the tests use (tests/servers.py) and stopped at the end. Loopback servers
measure the client path and the emulators, not a cloud service's latency.
"""

from __future__ import annotations

if __package__ in (None, ""):  # run as a script: make the repository root importable
    import sys as _sys
    from pathlib import Path as _Path

    _sys.path.insert(0, str(_Path(__file__).resolve().parent.parent))

import argparse
import os
import random
import shutil
import sys
import tempfile
import time
import uuid
from pathlib import Path
from typing import Any

from bench.common import format_table, machine_info, p50_p95, write_result
from statebackend.task import TaskStorage
from tests.servers import azurite_connection_string, start_azurite, start_moto


def run_store(
    label: str, blob_keys: dict[str, Any], workdir: Path, keys: int, updates: int, commits: int
) -> dict[str, Any]:
    local = workdir / f"local-{label}"
    config: dict[str, Any] = {
        "job.name": "bench",
        "state.local.dir": str(local),
        **blob_keys,
        "blob.store.create.if.missing": True,
        "stores.counts.backup.factories": "changelog",
    }
    rng = random.Random(7)
    sync_ms: list[float] = []
    durable_ms: list[float] = []
    with TaskStorage.open(config, "task-0") as task:
        store = task.store("counts")
        store.put_all((f"key:{i:012d}".encode(), os.urandom(12).hex().encode()) for i in range(keys))
        task.commit_durably({"round": "load"})
        for round_no in range(commits):
            for index in rng.sample(range(keys), updates):
                store.put(f"key:{index:012d}".encode(), os.urandom(12).hex().encode())
            started = time.perf_counter()
            pending = task.commit({"round": str(round_no)})
            sync_ms.append((time.perf_counter() - started) * 1000.0)
            assert pending is not None
            pending.result(timeout=300)
            durable_ms.append((time.perf_counter() - started) * 1000.0)
    shutil.rmtree(local)
    started = time.perf_counter()
    with TaskStorage.open(config, "task-0") as task:
        restored = task.store("counts").count()
    restore_ms = (time.perf_counter() - started) * 1000.0
    assert restored == keys, f"{label}: restored {restored} keys, expected {keys}"
    s50, s95 = p50_p95(sync_ms)
    d50, d95 = p50_p95(durable_ms)
    return {
        "store": label,
        "sync_p50_ms": s50,
        "sync_p95_ms": s95,
        "durable_p50_ms": d50,
        "durable_p95_ms": d95,
        "restore_ms": restore_ms,
    }


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--keys", type=int, default=250_000)
    parser.add_argument("--updates", type=int, default=10_000)
    parser.add_argument("--commits", type=int, default=20)
    args = parser.parse_args(argv)
    workdir = Path(tempfile.mkdtemp(prefix="bench-commit-remote-"))
    (workdir / "azurite").mkdir()
    (workdir / "moto").mkdir()
    azurite = start_azurite(workdir / "azurite")
    moto = start_moto(workdir / "moto")
    os.environ.setdefault("AWS_ACCESS_KEY_ID", "testing")
    os.environ.setdefault("AWS_SECRET_ACCESS_KEY", "testing")
    os.environ.setdefault("AWS_DEFAULT_REGION", "us-east-1")
    try:
        stores = {
            "file://": {"blob.store.url": f"file://{workdir / 'blobs'}"},
            "Azurite (az://)": {
                "blob.store.url": f"az://b{uuid.uuid4().hex[:12]}/state",
                "blob.store.connection.string": azurite_connection_string(azurite.port),
            },
            "moto S3 (s3://)": {
                "blob.store.url": f"s3://b-{uuid.uuid4().hex[:12]}/state",
                "blob.store.endpoint.url": moto.endpoint,
            },
        }
        rows = [
            run_store(label, keys, workdir, args.keys, args.updates, args.commits) for label, keys in stores.items()
        ]
    finally:
        azurite.stop()
        moto.stop()
        shutil.rmtree(workdir, ignore_errors=True)
    print(f"{args.keys:,} keys in one task, {args.updates:,} distinct updates per commit, {args.commits} commits")
    print(
        format_table(
            ["store", "sync p50 ms", "sync p95 ms", "durable p50 ms", "durable p95 ms", "restore (wiped) ms"],
            [
                [
                    r["store"],
                    f"{r['sync_p50_ms']:.1f}",
                    f"{r['sync_p95_ms']:.1f}",
                    f"{r['durable_p50_ms']:.1f}",
                    f"{r['durable_p95_ms']:.1f}",
                    f"{r['restore_ms']:.0f}",
                ]
                for r in rows
            ],
        )
    )
    path = write_result("commit-remote", {"args": vars(args), "machine": machine_info(), "rows": rows})
    print(f"result: {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
