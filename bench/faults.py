"""The fault matrix: durable commits and cold restores through injected faults, per blob store and backend.

For each blob store (file://, Azurite, moto's S3 server), backend (changelog, blobsnapshot, dual) and fault rate, one
task commits ``--commits`` rounds durably, then ``--restores`` fresh machines restore through the same faults, and one
more restores without faults to check the result. Faults:

- az:// and s3://: a loopback proxy (tests/faults.py) gives a ``rate`` fraction of HTTP requests one fault, drawn
  uniformly from every kind it knows: a reset before the request reaches the server, a reset after the server acted
  (the reply is lost), a reply cut in its status line, its headers or its body, a 5xx with a partial body.
- file://: a wrapper behind the same retry layer fails a ``rate`` fraction of operations before they act or after a
  write landed (a local disk has no cut replies).

Counted per cell: commits acknowledged, failed (a clear CommitError; the next commit carries the changes), **lost**
(acknowledged, but the restored state or checkpoint is older, or the restore without faults fails: must be 0), **raw**
exceptions (anything not a StateBackendError: must be 0), **false conflicts** (CommitConflictError with one attempt
only: must be 0), restores that succeeded exactly / failed with a clear error / came back **wrong** (must be 0), and
p50/p95 of the durable commit.

Run from the repository root::

    .venv/bin/python bench/faults.py                      # the full matrix (a few minutes on 2 cores)
    .venv/bin/python bench/faults.py --stores file --rates 0,0.1 --commits 10
"""

from __future__ import annotations

import argparse
import os
import random
import shutil
import sys
import tempfile
import threading
import time
import uuid
from collections.abc import Iterator, Mapping
from contextlib import ExitStack
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from bench.common import format_table, machine_info, p50_p95, write_result
from statebackend.blobstores.base import BlobInfo, BlobStore
from statebackend.blobstores.file import FileBlobStore
from statebackend.blobstores.resilience import ResilientBlobStore
from statebackend.errors import CommitConflictError, StateBackendError, TransientStorageError
from statebackend.task import TaskStorage
from tests.faults import FAULT_KINDS, FaultProxy
from tests.servers import ServerProcess, azurite_connection_string, start_azurite, start_moto

BACKENDS = {"changelog": "changelog", "blobsnapshot": "blobsnapshot", "dual": "changelog,blobsnapshot"}
RETRY = {
    "blob.store.retry.base.delay.ms": 20,
    "blob.store.retry.max.delay.ms": 200,
    "blob.store.request.timeout.ms": 5000,
}


class FaultyFileStore(BlobStore):
    """A file:// store that fails a ``rate`` fraction of operations before they act, or after a write landed."""

    def __init__(self, inner: BlobStore, rate: float, seed: int) -> None:
        self.inner = inner
        self.url = inner.url
        self.supports_metadata = inner.supports_metadata
        self.rate = rate
        self._rng = random.Random(seed)
        self._lock = threading.Lock()
        self.injected = 0

    def _fate(self) -> str | None:
        with self._lock:
            if self._rng.random() >= self.rate:
                return None
            self.injected += 1
            return "before" if self._rng.random() < 0.5 else "after"

    def put(
        self, name: str, data: bytes, *, create_only: bool = False, metadata: Mapping[str, str] | None = None
    ) -> None:
        fate = self._fate()
        if fate == "before":
            raise TransientStorageError(f"injected fault before writing {name}")
        self.inner.put(name, data, create_only=create_only, metadata=metadata)
        if fate == "after":
            raise TransientStorageError(f"injected fault: the reply of the write of {name} was lost")

    def get(self, name: str, *, start: int | None = None, end: int | None = None) -> bytes:
        if self._fate() is not None:
            raise TransientStorageError(f"injected fault reading {name}")
        return self.inner.get(name, start=start, end=end)

    def delete(self, name: str) -> None:
        fate = self._fate()
        if fate == "before":
            raise TransientStorageError(f"injected fault before deleting {name}")
        self.inner.delete(name)
        if fate == "after":
            raise TransientStorageError(f"injected fault: the reply of the delete of {name} was lost")

    def list(self, prefix: str = "") -> Iterator[str]:
        if self._fate() is not None:
            raise TransientStorageError(f"injected fault listing {prefix}")
        return self.inner.list(prefix)

    def head(self, name: str) -> BlobInfo:
        if self._fate() is not None:
            raise TransientStorageError(f"injected fault reading the head of {name}")
        return self.inner.head(name)

    def set_metadata(self, name: str, metadata: Mapping[str, str]) -> None:
        if self._fate() is not None:
            raise TransientStorageError(f"injected fault setting metadata of {name}")
        self.inner.set_metadata(name, metadata)


def write_round(task: TaskStorage, round_no: int, model: dict[bytes, bytes], keys: int = 200) -> None:
    store = task.store("counts", typed=False)
    rng = random.Random(round_no)
    for _ in range(keys):
        key = b"k%05d" % rng.randrange(5000)
        if rng.random() < 0.1:
            store.delete(key)
            model.pop(key, None)
        else:
            value = b"v%d-%d" % (round_no, rng.randrange(10**9))
            store.put(key, value)
            model[key] = value


class Cell:
    def __init__(self) -> None:
        self.acknowledged = 0
        self.failed = 0
        self.lost = 0
        self.raw = 0
        self.false_conflicts = 0
        self.restored = 0
        self.restore_failed = 0
        self.restore_wrong = 0
        self.latencies_ms: list[float] = []
        self.first_errors: list[str] = []
        self.injected = 0

    def note(self, exc: BaseException) -> None:
        if len(self.first_errors) < 3:
            self.first_errors.append(f"{type(exc).__name__}: {str(exc)[:200]}")


def run_cell(
    store_kind: str,
    backend: str,
    rate: float,
    servers: Mapping[str, ServerProcess],
    commits: int,
    restores: int,
    seed: int,
    work: Path,
) -> Cell:
    cell = Cell()
    container = f"f{uuid.uuid4().hex[:12]}"
    with ExitStack() as stack:
        blob_store: BlobStore | None = None
        base: dict[str, Any] = {
            "job.name": "job",
            "stores.counts.backup.factories": BACKENDS[backend],
            "task.checkpoint.retained": 3,
        }
        if store_kind != "file":  # file:// takes no retry keys: its fault wrapper gets them through the retry layer
            base.update(RETRY)
        if "changelog" in BACKENDS[backend]:
            base["changelog.snapshot.interval.commits"] = 5
        if "blobsnapshot" in BACKENDS[backend]:
            base["blobsnapshot.compaction.fanout"] = 3  # merges and base runs under faults too
            base["blobsnapshot.compaction.full.min.bytes"] = 0
        if store_kind == "file":
            root = work / container
            base["blob.store.url"] = root.as_uri()
            base["blob.store.create.if.missing"] = True
            faulty = FaultyFileStore(FileBlobStore.from_url(root.as_uri(), {"create.if.missing": True}), rate, seed)
            blob_store = ResilientBlobStore.wrap(faulty, {k[len("blob.store.") :]: v for k, v in RETRY.items()})
            stack.callback(lambda: setattr(cell, "injected", faulty.injected))
            direct: dict[str, Any] = dict(base)
        else:
            server = servers[store_kind]
            proxy = stack.enter_context(
                FaultProxy(server.host, server.port, failure_rate=rate, seed=seed, kinds=FAULT_KINDS)
            )
            stack.callback(lambda: setattr(cell, "injected", sum(proxy.stats[k] for k in FAULT_KINDS)))
            base.update(_remote_keys(store_kind, container, proxy.port))
            direct = {**base, **_remote_keys(store_kind, container, server.port)}
        model: dict[bytes, bytes] = {}
        models: dict[int, dict[bytes, bytes]] = {}  # round -> the state its checkpoint must restore
        acked_after: list[int] = []  # round numbers acknowledged, in order
        local = work / f"{container}-local"
        config = {**base, "state.local.dir": str(local)}
        try:
            task = TaskStorage.open(config, "task-0", blob_store=blob_store)
        except StateBackendError as exc:
            cell.note(exc)
            cell.failed = commits
            return cell
        with task:
            for round_no in range(commits):
                write_round(task, round_no, model)
                models[round_no] = dict(model)
                started = time.perf_counter()
                try:
                    task.commit_durably({"input": str(round_no)}, timeout=120)
                except CommitConflictError as exc:
                    cell.false_conflicts += 1
                    cell.note(exc)
                    break  # a fenced task refuses every later commit
                except StateBackendError as exc:
                    cell.failed += 1
                    cell.note(exc)
                    continue
                except Exception as exc:  # noqa: BLE001 - counted: no raw exception may reach a caller
                    cell.raw += 1
                    cell.note(exc)
                    continue
                cell.latencies_ms.append((time.perf_counter() - started) * 1000.0)
                cell.acknowledged += 1
                acked_after.append(round_no)
        # cold restores through the faults, then one without
        for attempt in range(restores + 1):
            faulted = attempt < restores
            restore_config = {**(base if faulted else direct), "state.local.dir": str(work / f"{container}-r{attempt}")}
            try:
                with TaskStorage.open(restore_config, "task-0", blob_store=blob_store if faulted else None) as restored:
                    offsets = dict(restored.restored.input_offsets) if restored.restored else None
                    state = dict(restored.store("counts", typed=False).items())
            except StateBackendError as exc:
                cell.restore_failed += 1
                cell.note(exc)
                if not faulted and acked_after:
                    cell.lost = max(cell.lost, 1)  # acknowledged state that cannot be restored: lost (at least 1)
                continue
            except Exception as exc:  # noqa: BLE001 - counted
                cell.raw += 1
                cell.note(exc)
                continue
            last_acked = acked_after[-1] if acked_after else None
            if offsets is None:
                if last_acked is None and state == {}:
                    cell.restored += 1
                else:
                    cell.lost = max(cell.lost, len(acked_after))
                    cell.restore_wrong += 1
                continue
            round_no = int(offsets["input"])
            if state != models.get(round_no):
                cell.restore_wrong += 1  # a state that is not its checkpoint's
            elif last_acked is not None and round_no < last_acked:
                cell.lost = max(cell.lost, sum(1 for r in acked_after if r > round_no))
                cell.restore_wrong += 1
            else:
                # the last acknowledged checkpoint, or a newer one: a commit reported failed whose checkpoint landed
                cell.restored += 1
        if store_kind == "file":
            shutil.rmtree(work / container, ignore_errors=True)
        for path in work.glob(f"{container}-*"):
            shutil.rmtree(path, ignore_errors=True)
    return cell


def _remote_keys(kind: str, container: str, port: int) -> dict[str, Any]:
    if kind == "s3":
        return {
            "blob.store.url": f"s3://{container}/state",
            "blob.store.endpoint.url": f"http://127.0.0.1:{port}",
            "blob.store.create.if.missing": True,
        }
    return {
        "blob.store.url": f"az://{container}/state",
        "blob.store.connection.string": azurite_connection_string(port),
        "blob.store.create.if.missing": True,
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--stores", default="file,az,s3")
    parser.add_argument("--backends", default="changelog,blobsnapshot,dual")
    parser.add_argument("--rates", default="0,0.1,0.3")
    parser.add_argument("--commits", type=int, default=30)
    parser.add_argument("--restores", type=int, default=3)
    parser.add_argument("--seed", type=int, default=20261123)
    args = parser.parse_args()
    stores = args.stores.split(",")
    rates = [float(r) for r in args.rates.split(",")]
    rows = []
    results = []
    with tempfile.TemporaryDirectory(prefix="statebackend-faults-") as tmp, ExitStack() as stack:
        work = Path(tmp)
        servers: dict[str, ServerProcess] = {}
        if "az" in stores:
            (work / "azurite").mkdir()
            servers["az"] = start_azurite(work / "azurite")
            stack.callback(servers["az"].stop)
        if "s3" in stores:
            for key, value in {
                "AWS_ACCESS_KEY_ID": "testing",
                "AWS_SECRET_ACCESS_KEY": "testing",
                "AWS_DEFAULT_REGION": "us-east-1",
            }.items():
                os.environ.setdefault(key, value)  # moto's server takes any credentials; boto3 wants some
            (work / "moto").mkdir()
            servers["s3"] = start_moto(work / "moto")
            stack.callback(servers["s3"].stop)
        for store_kind in stores:
            for backend in args.backends.split(","):
                for index, rate in enumerate(rates):
                    cell = run_cell(
                        store_kind, backend, rate, servers, args.commits, args.restores, args.seed + index, work
                    )
                    p50, p95 = p50_p95(cell.latencies_ms) if cell.latencies_ms else (0.0, 0.0)
                    row = [
                        store_kind,
                        backend,
                        f"{rate:.0%}",
                        cell.injected,
                        cell.acknowledged,
                        cell.failed,
                        cell.lost,
                        cell.raw,
                        cell.false_conflicts,
                        f"{cell.restored}/{cell.restore_failed}/{cell.restore_wrong}",
                        p50,
                        p95,
                    ]
                    rows.append(row)
                    results.append({"store": store_kind, "backend": backend, "rate": rate, **vars(cell)})
                    print(format_table(HEADERS, [row]).splitlines()[-1], flush=True)
                    for error in cell.first_errors:
                        print(f"    e.g. {error}", flush=True)
    print()
    print(format_table(HEADERS, rows))
    path = write_result("faults", {"machine": machine_info(), "args": vars(args), "cells": results})
    print(f"\nresult: {path}")


HEADERS = [
    "store",
    "backend",
    "faults",
    "injected",
    "acked",
    "failed",
    "lost",
    "raw",
    "false conflicts",
    "restores ok/failed/wrong",
    "commit p50 ms",
    "commit p95 ms",
]

if __name__ == "__main__":
    main()
