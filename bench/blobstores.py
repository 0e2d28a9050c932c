"""Blob store benchmark (not a test): throughput and put latency on file://, Azurite and moto's S3 server in one run,
and hedging on vs off under injected slow requests. Writes docs/benchmarks-blobstores.md.

    /tmp/venv/bin/python -m bench.blobstores [--small-puts 1000] [--out docs/benchmarks-blobstores.md]

Starts Azurite and moto on loopback itself (tests/servers.py) and stops them at the end.
"""

from __future__ import annotations

import argparse
import os
import platform
import sys
import tempfile
import time
import uuid
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))  # the repository: bench and tests import from it

from statebackend.blobstores.base import BlobStore, open_blob_store
from statebackend.metrics import percentile
from tests.faults import FaultProxy
from tests.servers import azurite_connection_string, start_azurite, start_moto

REPO = Path(__file__).resolve().parent.parent
MiB = 1 << 20


def throughput(store: BlobStore, size: int, workdir: Path, repeats: int) -> tuple[float, float]:
    """MB/s for put_file and get_file of one ``size``-byte file (best of ``repeats``)."""
    source = workdir / f"source-{size}"
    source.write_bytes(os.urandom(size))
    up, down = 0.0, 0.0
    for i in range(repeats):
        name = f"bench/tp-{size}-{i}"
        started = time.perf_counter()
        store.put_file(name, source)
        up = max(up, size / MiB / (time.perf_counter() - started))
        started = time.perf_counter()
        store.get_file(name, workdir / "target")
        down = max(down, size / MiB / (time.perf_counter() - started))
        store.delete(name)
    return up, down


def put_latencies(store: BlobStore, count: int, size: int = 1024) -> list[float]:
    data = os.urandom(size)
    samples = []
    for i in range(count):
        started = time.perf_counter()
        store.put(f"bench/small/{i:06d}", data)
        samples.append(time.perf_counter() - started)
    return samples


def hedging(server_port: int, connection: str | None, count: int, delay_s: float, rate: float) -> dict[str, Any]:
    """get latency through a proxy that delays ``rate`` of requests by ``delay_s``, hedging off vs on."""
    out: dict[str, Any] = {}
    for hedged in (False, True):
        with FaultProxy("127.0.0.1", server_port, delay_rate=rate, delay_s=delay_s, seed=3) as proxy:
            options: dict[str, Any] = {"create.if.missing": True}
            if hedged:
                options.update({"hedge.after.ms": 50, "hedge.max": 2})
            if connection is None:
                store = open_blob_store(
                    f"s3://bench-{uuid.uuid4().hex[:12]}/h", {**options, "endpoint.url": proxy.endpoint}
                )
            else:
                store = open_blob_store(
                    f"az://bench{uuid.uuid4().hex[:12]}/h",
                    {**options, "connection.string": azurite_connection_string(proxy.port)},
                )
            store.create_resources()  # type: ignore[attr-defined]
            store.put("blob", b"x" * 4096)
            samples = []
            for _ in range(count):
                started = time.perf_counter()
                store.get("blob")
                samples.append(time.perf_counter() - started)
            store.close()
        out["on" if hedged else "off"] = samples
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--small-puts", type=int, default=1000)
    parser.add_argument("--large-mib", type=int, default=64)
    parser.add_argument("--hedge-requests", type=int, default=300)
    parser.add_argument("--out", default=str(REPO / "docs" / "benchmarks-blobstores.md"))
    args = parser.parse_args()

    work = Path(tempfile.mkdtemp(prefix="bench-blobstores-"))
    azurite = start_azurite(work)
    moto = start_moto(work)
    os.environ.setdefault("AWS_ACCESS_KEY_ID", "bench")
    os.environ.setdefault("AWS_SECRET_ACCESS_KEY", "bench")
    os.environ.setdefault("AWS_DEFAULT_REGION", "us-east-1")
    try:
        stores = {
            "file://": open_blob_store(f"file://{work / 'file-store'}", {}),
            "Azurite (az://)": open_blob_store(
                f"az://bench{uuid.uuid4().hex[:12]}/b",
                {"connection.string": azurite_connection_string(azurite.port), "create.if.missing": True},
            ),
            "moto S3 (s3://)": open_blob_store(
                f"s3://bench-{uuid.uuid4().hex[:12]}/b", {"endpoint.url": moto.endpoint, "create.if.missing": True}
            ),
        }
        rows = []
        for label, store in stores.items():
            create = getattr(store, "create_resources", None)
            if callable(create):
                create()
            up1, down1 = throughput(store, MiB, work, repeats=5)
            upl, downl = throughput(store, args.large_mib * MiB, work, repeats=2)
            lat = put_latencies(store, args.small_puts)
            rows.append((label, up1, down1, upl, downl, lat))
            print(
                label, f"{up1:.0f} {down1:.0f} {upl:.0f} {downl:.0f} MB/s", f"p50 {percentile(lat, 0.5) * 1e3:.2f} ms"
            )
            store.close()
        hedge_rows = []
        for label, port, connection in [
            ("moto S3", moto.port, None),
            ("Azurite", azurite.port, azurite_connection_string(azurite.port)),
        ]:
            result = hedging(port, connection, args.hedge_requests, delay_s=0.5, rate=0.05)
            hedge_rows.append((label, result))
            print(label, {k: percentile(v, 0.99) for k, v in result.items()})
    finally:
        azurite.stop()
        moto.stop()

    def ms(samples: list[float], q: float) -> str:
        return f"{percentile(samples, q) * 1e3:.2f}"

    lines = [
        "# Blob store benchmarks",
        "",
        (
            f"Command: `/tmp/venv/bin/python -m bench.blobstores --small-puts {args.small_puts} "
            f"--large-mib {args.large_mib} --hedge-requests {args.hedge_requests}`"
        ),
        "",
        (
            f"Machine: 2 cores (shared with other work), Linux {platform.release()}, "
            f"Python {platform.python_version()}; servers on loopback (Azurite 3 in memory, moto's server). "
            "Loopback servers measure the client's overhead and the emulators, not a cloud service."
        ),
        "",
        "## Throughput (MB/s, best of runs) and small put latency (1 KiB, sequential)",
        "",
        (
            f"| store | put 1 MiB | get 1 MiB | put {args.large_mib} MiB | get {args.large_mib} MiB "
            "| put p50 ms | put p99 ms | put p99.9 ms |"
        ),
        "|---|---|---|---|---|---|---|---|",
    ]
    for label, up1, down1, upl, downl, lat in rows:
        lines.append(
            f"| {label} | {up1:.0f} | {down1:.0f} | {upl:.0f} | {downl:.0f} | {ms(lat, 0.5)} | {ms(lat, 0.99)} "
            f"| {ms(lat, 0.999)} |"
        )
    lines += [
        "",
        (
            f"## Hedging under injected slow requests ({args.hedge_requests} sequential 4 KiB gets; the fault proxy "
            "delays 5% of requests by 500 ms; hedge after 50 ms, at most 2 hedges)"
        ),
        "",
        "| server | hedging | p50 ms | p99 ms | p99.9 ms | max ms |",
        "|---|---|---|---|---|---|",
    ]
    for label, result in hedge_rows:
        for key in ("off", "on"):
            samples = result[key]
            lines.append(
                f"| {label} | {key} | {ms(samples, 0.5)} | {ms(samples, 0.99)} | {ms(samples, 0.999)} "
                f"| {max(samples) * 1e3:.2f} |"
            )
        off, on = result["off"], result["on"]
        lines.append(
            f"| {label} | ratio on/off | | {percentile(on, 0.99) / percentile(off, 0.99):.2f} "
            f"| {percentile(on, 0.999) / percentile(off, 0.999):.2f} | |"
        )
    Path(args.out).write_text("\n".join(lines) + "\n")
    print("wrote", args.out)


if __name__ == "__main__":
    main()
