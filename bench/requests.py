"""Blob store requests per commit, idle commit, restore and GC sweep, per backend and blob store, with their price.

    python -m bench.requests                                  # S3 (moto) and Azurite, the three backend setups
    python -m bench.requests --stores file                    # no server: a file:// store counted the same way
    python -m bench.requests --stores s3 --backends changelog --changed 40 --idle 40

Per blob store and backend setup (``changelog``, ``blobsnapshot``, both in one commit), one task with one store
of ``--keys`` keys (loaded by one durable commit, not counted), then ``--changed`` durable commits that each update
``--updates`` of its keys, then ``--idle`` durable commits that change nothing (only the input position moves), then
one mark-and-sweep of every backend (``sweep()`` of each backup manager), a close, a warm open (local state intact)
and a cold open (local state wiped, everything read from the blob store).

Requests are counted by the library's own ``blob_store.requests`` metric (every request the resilience layer sends,
by operation; a part of a large transfer is one request), read from the task's metrics. After each commit the
harness waits until the commit's cleanup, retention and any background snapshot or compaction are over, so each
request is counted in the phase that caused it: *to durable* (the upload, the checkpoint write and its fencing) and
*after durable* (cleanup, retention, the sweeps due every ``gc.interval.commits``, background snapshots and
compactions). The servers are started on loopback ports by the test setup's own code (tests/servers.py).

The price columns apply the list prices of :data:`PRICES` (stated with their date in docs/cost.md) to the measured
requests per commit, for one task committing once a second, once every 10 s and once a minute (30-day month). A
result file with every count goes to bench/results/.
"""

from __future__ import annotations

if __package__ in (None, ""):  # run as a script: make the repository root importable
    import sys as _sys
    from pathlib import Path as _Path

    _sys.path.insert(0, str(_Path(__file__).resolve().parent.parent))

import argparse
import json
import os
import random
import shutil
import sys
import tempfile
import uuid
from collections.abc import Callable, Iterator, Mapping
from concurrent.futures import wait
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import attrs

from bench.common import format_table, machine_info, write_result
from statebackend.blobstores.base import BlobStore
from statebackend.blobstores.file import FileBlobStore
from statebackend.blobstores.resilience import ResilientBlobStore
from statebackend.metrics import Metrics
from statebackend.task import TaskStorage

__all__ = ["PRICES", "Price", "billed", "main", "measure", "monthly_cost"]

#: the backend setups measured: the value of ``stores.<name>.backup.factories``
BACKENDS = ("changelog", "blobsnapshot", "changelog,blobsnapshot")

#: commits per 30-day month at the three rates priced
RATES = {"1/s": 30 * 24 * 3600, "1/10 s": 30 * 24 * 360, "1/min": 30 * 24 * 60}


@attrs.frozen
class Price:
    """A service's request prices in US dollars per 1,000 requests, by billing class, and which class each operation
    of the ``blob_store.requests`` metric is billed as."""

    service: str
    per_1000: Mapping[str, float]
    classes: Mapping[str, str]

    def cost(self, requests: Mapping[str, float]) -> float:
        """Dollars for ``requests`` (operation -> count)."""
        return sum(count * self.per_1000[self.classes.get(op, "other")] / 1000.0 for op, count in requests.items())


#: List prices used for the cost columns (docs/cost.md states their source and date). S3 Standard, us-east-1: PUT,
#: COPY, POST and LIST $0.005 per 1,000; GET, HEAD and other $0.0004 per 1,000; DELETE free (DeleteObjects is a
#: POST: counted at the PUT price here, the conservative reading). Azure Blob Storage hot tier, LRS, East US: write
#: and list operations $0.055 per 10,000, read and other $0.0044 per 10,000, Delete Blob free (a Blob Batch is one
#: "other" operation plus its sub-requests, which are deletes here: free).
PRICES: dict[str, Price] = {
    "s3": Price(
        "S3 Standard (us-east-1)",
        {"put": 0.005, "get": 0.0004, "free": 0.0, "other": 0.0004},
        {
            "put": "put",
            "put_if": "put",
            "set_metadata": "put",
            "list": "put",
            "create_multipart_upload": "put",
            "upload_part": "put",
            "complete_multipart_upload": "put",
            "delete_many": "put",
            "create_resources": "put",
            "get": "get",
            "get_versioned": "get",
            "get_range": "get",
            "head": "get",
            "abandoned_uploads": "put",
            "delete": "free",
            "remove_abandoned_upload": "free",
        },
    ),
    "az": Price(
        "Azure Blob hot LRS (East US)",
        {"put": 0.0055, "get": 0.00044, "free": 0.0, "other": 0.00044},
        {
            "put": "put",
            "put_if": "put",
            "set_metadata": "put",
            "stage_block": "put",
            "commit_block_list": "put",
            "list": "put",
            "create_resources": "put",
            "get": "get",
            "get_versioned": "get",
            "get_range": "get",
            "head": "get",
            "delete_many": "other",
            "delete": "free",
        },
    ),
}


def billed(requests: Mapping[str, float], price: Price, cls: str = "put") -> float:
    """How many of ``requests`` are billed in class ``cls`` of ``price`` (``put``: PUT, COPY, POST, LIST / write and
    list operations)."""
    return sum(count for op, count in requests.items() if price.classes.get(op, "other") == cls)


def monthly_cost(requests_per_commit: Mapping[str, float], price: Price) -> dict[str, float]:
    """Dollars a month for one task at each rate of :data:`RATES`."""
    return {rate: price.cost(requests_per_commit) * commits for rate, commits in RATES.items()}


def requests_by_operation(metrics: Metrics, counter: str = "blob_store.requests") -> dict[str, float]:
    """The ``blob_store.requests`` counter (or another one labelled by operation, such as
    ``blob_store.bytes.sent``), summed over outcomes, by operation."""
    counts: dict[str, float] = {}
    for (name, labels), value in metrics.export().counters.items():
        if name != counter:
            continue
        operation = dict(labels).get("operation", "?")
        counts[operation] = counts.get(operation, 0.0) + value
    return counts


def minus(after: Mapping[str, float], before: Mapping[str, float], per: int = 1) -> dict[str, float]:
    """``(after - before) / per`` by operation, zeros left out."""
    out = {op: (after.get(op, 0.0) - before.get(op, 0.0)) / per for op in set(after) | set(before)}
    return {op: round(value, 4) for op, value in sorted(out.items()) if value}


def settle(task: TaskStorage) -> None:
    """Wait until everything a durable commit started is over: its cleanups and retention, then the process's
    background snapshot and compaction threads (each one thread, FIFO: a no-op queued behind them ends after them),
    then cleanups again (a background job may have queued none, but a late cleanup is counted where it belongs)."""
    from statebackend.backends.blobsnapshot.compaction import _compaction_pools
    from statebackend.backends.changelog.snapshots import maintenance_pool

    for _ in range(2):
        wait(list(task.commit_manager._cleanups), timeout=120)  # the commit's own futures, read for counting only
        maintenance_pool().submit(lambda: None).result(timeout=120)
        _compaction_pools.get(1).submit(lambda: None).result(timeout=120)


@contextmanager
def counted_open(
    config: Mapping[str, Any],
    make_store: Callable[[], BlobStore],
    metrics: Metrics,
) -> Iterator[TaskStorage]:
    """A task on a fresh client of the blob store whose requests count into ``metrics``."""
    store = make_store()
    store.use_metrics(metrics)
    try:
        with TaskStorage.open(config, "task-0", blob_store=store, metrics=metrics) as task:
            yield task
    finally:
        store.close()


def measure(
    store_label: str,
    make_store: Callable[[], BlobStore],
    backend: str,
    workdir: Path,
    *,
    keys: int,
    updates: int,
    changed: int,
    idle: int,
) -> dict[str, Any]:
    """Run the scenario of the module docstring for one blob store and backend setup; counts by phase."""
    local = workdir / f"local-{uuid.uuid4().hex[:8]}"
    config: dict[str, Any] = {
        "job.name": f"bench-{uuid.uuid4().hex[:8]}",
        "state.local.dir": str(local),
        "blob.store.url": "memory://unused",  # the store is given to the task; the URL only names the scheme
        "stores.counts.backup.factories": backend,
    }
    rng = random.Random(7)
    metrics = Metrics()
    phases: dict[str, dict[str, float]] = {}
    to_durable: dict[str, float] = {}
    after_durable: dict[str, float] = {}
    bytes_sent: dict[str, float] = {}  # payload bytes written per commit, by phase

    def add(into: dict[str, float], delta: Mapping[str, float]) -> None:
        for op, value in delta.items():
            into[op] = into.get(op, 0.0) + value

    with counted_open(config, make_store, metrics) as task:
        phases["open, empty"] = requests_by_operation(metrics)
        store = task.store("counts", typed=False)
        for i in range(keys):
            store.put(f"key:{i:09d}".encode(), os.urandom(12).hex().encode())
        task.commit_durably({"offset": "load"})
        settle(task)
        round_no = 0

        def commit_rounds(count: int, change: bool) -> dict[str, float]:
            nonlocal round_no, to_durable, after_durable
            start = requests_by_operation(metrics)
            bytes_start = sum(requests_by_operation(metrics, "blob_store.bytes.sent").values())
            before = start
            for _ in range(count):
                if change:
                    for index in rng.sample(range(keys), updates):
                        store.put(f"key:{index:09d}".encode(), os.urandom(12).hex().encode())
                round_no += 1
                task.commit_durably({"offset": str(round_no)})
                durable = requests_by_operation(metrics)
                settle(task)
                settled = requests_by_operation(metrics)
                add(to_durable, minus(durable, before))
                add(after_durable, minus(settled, durable))
                before = settled
            sent = sum(requests_by_operation(metrics, "blob_store.bytes.sent").values()) - bytes_start
            bytes_sent["changed commit" if change else "idle commit"] = round(sent / count, 1)
            return minus(requests_by_operation(metrics), start, per=count)

        to_durable, after_durable = {}, {}
        phases["changed commit"] = commit_rounds(changed, True)
        phases["changed commit, to durable"] = {op: round(v / changed, 4) for op, v in sorted(to_durable.items())}
        phases["changed commit, after durable"] = {op: round(v / changed, 4) for op, v in sorted(after_durable.items())}
        to_durable, after_durable = {}, {}
        phases["idle commit"] = commit_rounds(idle, False)
        phases["idle commit, to durable"] = {op: round(v / idle, 4) for op, v in sorted(to_durable.items())}
        phases["idle commit, after durable"] = {op: round(v / idle, 4) for op, v in sorted(after_durable.items())}
        before = requests_by_operation(metrics)
        for binding in task.commit_manager.backups:
            binding.manager.sweep()  # type: ignore[attr-defined]  # both built-in managers have one
        phases["GC sweep"] = minus(requests_by_operation(metrics), before)
        before = requests_by_operation(metrics)
    phases["close"] = minus(requests_by_operation(metrics), before)
    for label, wipe in (("restore, warm", False), ("restore, cold", True)):
        if wipe:
            shutil.rmtree(local)
        opened = Metrics()
        with counted_open(config, make_store, opened) as task:
            assert task.store("counts", typed=False).count() == keys, f"{label}: wrong key count"
            phases[label] = requests_by_operation(opened)
    shutil.rmtree(local, ignore_errors=True)
    return {"store": store_label, "backend": backend, "phases": phases, "bytes_sent": bytes_sent}


def report(rows: list[dict[str, Any]]) -> str:
    """The tables: requests per changed and idle commit by operation, billed ones, restores, sweep, cost."""
    lines = []
    for row in rows:
        phases = row["phases"]
        lines.append(f"\n### {row['backend']} on {row['store']}\n")
        table = []
        for phase, counts in phases.items():
            detail = ", ".join(f"{op} {value:g}" for op, value in counts.items()) or "-"
            table.append([phase, round(sum(counts.values()), 2), detail])
        lines.append(format_table(["phase", "requests", "by operation"], table))
    lines.append("\n### requests per commit and their price\n")
    summary = []
    for row in rows:
        price = PRICES.get(row["kind"])
        changed, idle = row["phases"]["changed commit"], row["phases"]["idle commit"]
        cells: list[Any] = [row["backend"], row["store"], round(sum(changed.values()), 2)]
        cells.append(round(billed(changed, price), 2) if price else "-")
        cells.append(round(sum(idle.values()), 2))
        cells.append(round(billed(idle, price), 2) if price else "-")
        sent = row.get("bytes_sent", {})
        cells.append(f"{sent['changed commit']:,.0f} / {sent['idle commit']:,.0f}" if sent else "-")
        if price is not None:
            cells.extend(f"${value:,.2f}" for value in monthly_cost(changed, price).values())
        else:
            cells.extend("-" for _ in RATES)
        summary.append(cells)
    lines.append(
        format_table(
            [
                "backend",
                "store",
                "req/changed",
                "billed PUT-class",
                "req/idle",
                "billed PUT-class (idle)",
                "bytes sent/commit (changed / idle)",
                *(f"$/month at {rate} (changed)" for rate in RATES),
            ],
            summary,
        )
    )
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--stores", default="s3,az", help="comma-separated: s3, az, file")
    parser.add_argument(
        "--backends",
        default=";".join(BACKENDS),
        help="semicolon-separated backend setups (values of stores.<name>.backup.factories)",
    )
    parser.add_argument("--keys", type=int, default=100, help="keys in the store")
    parser.add_argument("--updates", type=int, default=10, help="keys each changed commit updates")
    parser.add_argument("--changed", type=int, default=20, help="durable commits that change the store")
    parser.add_argument("--idle", type=int, default=20, help="durable commits that change nothing")
    parser.add_argument("--label", default="", help="a word for the result file name (e.g. before, after)")
    parser.add_argument(
        "--figure",
        type=Path,
        default=None,
        help="draw requests and bytes per commit per backend into this PNG (needs the bench extra)",
    )
    parser.add_argument(
        "--before", type=Path, default=None, help="a result file of an earlier run, drawn beside this one in --figure"
    )
    parser.add_argument(
        "--redraw", type=Path, default=None, help="measure nothing: draw --figure from this result file (and --before)"
    )
    args = parser.parse_args(argv)
    if args.redraw is not None:
        if args.figure is None:
            parser.error("--redraw needs --figure")
        result = json.loads(args.redraw.read_text())
        run = result["args"]
        before = json.loads(args.before.read_text())["rows"] if args.before is not None else None
        draw(
            result["rows"],
            before,
            args.figure,
            f"{run['changed']} changed + {run['idle']} idle commits, {run['keys']:,} keys",
        )
        print(f"figure: {args.figure}")
        return 0
    kinds = [kind.strip() for kind in args.stores.split(",") if kind.strip()]
    backends = [backend.strip() for backend in args.backends.split(";") if backend.strip()]
    workdir = Path(tempfile.mkdtemp(prefix="bench-requests-"))
    servers = []
    makers: dict[str, tuple[str, Callable[[], BlobStore]]] = {}
    try:
        if "s3" in kinds:
            from statebackend.blobstores.s3 import S3BlobStore
            from tests.servers import start_moto

            (workdir / "moto").mkdir()
            moto = start_moto(workdir / "moto")
            servers.append(moto)
            os.environ.setdefault("AWS_ACCESS_KEY_ID", "testing")
            os.environ.setdefault("AWS_SECRET_ACCESS_KEY", "testing")
            os.environ.setdefault("AWS_DEFAULT_REGION", "us-east-1")
            s3_url = f"s3://b-{uuid.uuid4().hex[:12]}/state"
            s3_options = {"endpoint.url": moto.endpoint, "create.if.missing": True}
            S3BlobStore.from_url(s3_url, S3BlobStore.parse_options(s3_options)).create_resources()
            makers["s3"] = ("S3 (moto)", lambda: S3BlobStore.from_url(s3_url, S3BlobStore.parse_options(s3_options)))
        if "az" in kinds:
            from statebackend.blobstores.azure import AzureBlobStore
            from tests.servers import azurite_connection_string, start_azurite

            (workdir / "azurite").mkdir()
            azurite = start_azurite(workdir / "azurite")
            servers.append(azurite)
            az_url = f"az://b{uuid.uuid4().hex[:12]}/state"
            az_options = {"connection.string": azurite_connection_string(azurite.port), "create.if.missing": True}
            AzureBlobStore.from_url(az_url, AzureBlobStore.parse_options(az_options)).create_resources()
            makers["az"] = (
                "Azurite",
                lambda: AzureBlobStore.from_url(az_url, AzureBlobStore.parse_options(az_options)),
            )
        if "file" in kinds:
            root = workdir / "blobs"
            makers["file"] = ("file:// (counted)", lambda: ResilientBlobStore(FileBlobStore(root)))
        rows = []
        for kind, (label, make) in makers.items():
            for backend in backends:
                row = measure(
                    label,
                    make,
                    backend,
                    workdir,
                    keys=args.keys,
                    updates=args.updates,
                    changed=args.changed,
                    idle=args.idle,
                )
                row["kind"] = kind
                rows.append(row)
                print(f"measured {backend} on {label}", file=sys.stderr)
    finally:
        for server in servers:
            server.stop()
        shutil.rmtree(workdir, ignore_errors=True)
    print(
        f"one task, one store of {args.keys:,} keys; {args.changed} durable commits updating {args.updates} keys "
        f"each, then {args.idle} idle durable commits"
    )
    print(report(rows))
    name = "requests" + (f"-{args.label}" if args.label else "")
    path = write_result(
        name,
        {
            "args": {k: str(v) if isinstance(v, Path) else v for k, v in vars(args).items()},
            "machine": machine_info(),
            "rows": rows,
            "prices": {k: attrs.asdict(v) for k, v in PRICES.items()},
        },
    )
    print(f"\nresult: {path}")
    if args.figure is not None:
        before = json.loads(args.before.read_text())["rows"] if args.before is not None else None
        draw(rows, before, args.figure, f"{args.changed} changed + {args.idle} idle commits, {args.keys:,} keys")
        print(f"figure: {args.figure}")
    return 0


def draw(rows: list[dict[str, Any]], before: list[dict[str, Any]] | None, path: Path, subtitle: str) -> None:
    """Requests per changed and idle commit per backend setup, stacked by operation (this run beside ``before`` when
    given), and payload bytes sent per commit, for the first blob store of the run."""
    from bench.figures import pyplot

    plt = pyplot()
    store = rows[0]["store"]
    mine = [row for row in rows if row["store"] == store]
    earlier = {row["backend"]: row for row in before or [] if row["store"] == store}
    operations = sorted(
        {
            op
            for row in [*mine, *earlier.values()]
            for phase in ("changed commit", "idle commit")
            for op in row["phases"][phase]
        }
    )
    fig, (left, right) = plt.subplots(1, 2, figsize=(12, 5.6), gridspec_kw={"width_ratios": [3, 1.3]})
    labels, stacks = [], []
    for row in mine:
        for phase in ("changed commit", "idle commit"):
            short = phase.split()[0]
            if row["backend"] in earlier:
                labels.append(f"{row['backend']}, {short}, before")
                stacks.append(earlier[row["backend"]]["phases"][phase])
            labels.append(f"{row['backend']}, {short}" + (", after" if earlier else ""))
            stacks.append(row["phases"][phase])
    bottoms = [0.0] * len(stacks)
    for op in operations:
        heights = [stack.get(op, 0.0) for stack in stacks]
        left.bar(range(len(stacks)), heights, bottom=bottoms, label=op)
        bottoms = [b + h for b, h in zip(bottoms, heights, strict=True)]
    for x, total in enumerate(bottoms):
        left.text(x, total + 0.05, f"{total:.2f}", ha="center", fontsize=8)
    left.set_xticks(range(len(stacks)), labels, fontsize=7, rotation=35, ha="right")
    left.set_ylabel("requests per commit")
    left.set_title(f"requests per commit on {store}")
    left.legend(fontsize=8)
    names = [row["backend"] for row in mine]
    width = 0.38
    for offset, phase in ((-width / 2, "changed commit"), (width / 2, "idle commit")):
        values = [row.get("bytes_sent", {}).get(phase, 0.0) / 1024 for row in mine]
        right.bar([i + offset for i in range(len(mine))], values, width, label=phase)
    right.set_xticks(range(len(mine)), names, fontsize=7, rotation=35, ha="right")
    right.set_ylabel("KiB sent per commit")
    right.set_title("payload bytes per commit")
    right.legend(fontsize=8)
    fig.suptitle(subtitle, fontsize=9)
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110)
    plt.close(fig)


if __name__ == "__main__":
    sys.exit(main())
