"""Micro benchmark of the changelog file format: records/s for encode and decode, every format version in one run.

Run from the repository root: ``python -m bench.format [record_count]`` (1M by default). Three record shapes: the
reference one (keys of 20 bytes, values of 10 bytes, as the brief; every block has uniform lengths), a varied one
(keys of 14-30 bytes, values of 0-39 bytes) and counters (keys ``k00012345`` of the ``string`` serde, values of the
``integer`` serde, 8 bytes, small random counts: the store of the bytes benchmark in docs/benchmarks.md). Decode is
timed three ways: bytes with the verify-first pass iter_records does by default, bytes already verified, and a
stream (one pass, checked while reading); then the stream is loaded into a fresh LMDB store with
``LocalStore.replace_contents`` (putmulti in append mode), as a full restore does.
"""

from __future__ import annotations

import gc
import io
import random
import sys
import tempfile
import time
from collections.abc import Callable, Iterable

import attrs

from statebackend.recordfile import SUPPORTED_FORMAT_VERSIONS, FileHeader, encode, iter_records, verify
from statebackend.store import LocalStore, LocalVersion


def reference_records(record_count: int) -> list[tuple[bytes, bytes | None]]:
    return [(b"user:%015d" % (i * 7), b"v%09d" % i) for i in range(record_count)]


def varied_records(record_count: int) -> list[tuple[bytes, bytes | None]]:
    rnd = random.Random(3)
    return sorted(
        (b"user:%09d:%s" % (i * 7, b"x" * rnd.randrange(16)), b"v" * rnd.randrange(40)) for i in range(record_count)
    )


def counter_records(record_count: int) -> list[tuple[bytes, bytes | None]]:
    rnd = random.Random(5)
    # the integer serde: 8 bytes big-endian with the sign bit flipped, so bytes sort as numbers
    return [(b"k%08d" % (i * 4), ((1 << 63) + rnd.randrange(1, 60)).to_bytes(8, "big")) for i in range(record_count)]


def main(record_count: int = 1_000_000) -> None:
    header = FileHeader(
        kind="snapshot", job="bench", task="0", store="counts", checkpoint_id="0-0", token="t", seq=1, base_seq=1
    )
    gc.disable()  # the consumer decides about GC; 1M result tuples would otherwise time the collector, not us
    for shape, make in (("reference", reference_records), ("varied", varied_records), ("counters", counter_records)):
        records = make(record_count)
        for compression in ("zstd", "none"):
            for version in SUPPORTED_FORMAT_VERSIONS:
                run_one(
                    attrs.evolve(header, format_version=version),
                    records,
                    shape,
                    compression,
                    load=compression == "zstd",
                )
    gc.enable()


def run_one(
    header: FileHeader, records: list[tuple[bytes, bytes | None]], shape: str, compression: str, *, load: bool
) -> None:
    count = len(records)
    start = time.perf_counter()
    data = encode(header, records, compression=compression)
    encode_s = time.perf_counter() - start

    def row(label: str, seconds: float) -> None:
        print(f"  {label:<32} {seconds:6.3f} s  {count / seconds:12,.0f} records/s")

    def timed(label: str, run: Callable[[], Iterable[object]]) -> None:
        start = time.perf_counter()
        found = 0
        for _ in run():
            found += 1
        elapsed = time.perf_counter() - start
        assert found == count
        row(label, elapsed)

    print(f"v{header.format_version} {shape} {compression}: {count:,} records, {len(data):,} bytes")
    row("encode", encode_s)
    start = time.perf_counter()
    verify(data, name="bench")
    row("verify", time.perf_counter() - start)
    timed("decode bytes (verify first)", lambda: iter_records(data, name="bench"))
    timed("decode bytes, verified=True", lambda: iter_records(data, name="bench", verified=True))
    timed("decode stream", lambda: iter_records(io.BytesIO(data), name="bench"))
    if load:
        with tempfile.TemporaryDirectory(prefix="bench-format-") as tmp:
            store = LocalStore.open(tmp, name="bench")
            try:
                start = time.perf_counter()
                loaded = store.replace_contents(
                    iter_records(io.BytesIO(data), name="bench"),  # type: ignore[arg-type]
                    LocalVersion("1-1", "t"),
                )
                elapsed = time.perf_counter() - start
            finally:
                store.close()
            assert loaded == count
            row("stream into replace_contents", elapsed)


if __name__ == "__main__":
    main(int(sys.argv[1]) if len(sys.argv) > 1 else 1_000_000)
