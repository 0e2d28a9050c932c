"""Micro benchmark of the changelog file format: records/s for encode and decode of 1M records.

Run from the repository root: ``python -m bench.format [record_count]``. Keys are ~20 bytes, values ~10 bytes
(the brief's reference shape). Decode is timed three ways: bytes with the verify-first pass iter_records does by
default, bytes already verified, and a stream (one pass, checked while reading).
"""

from __future__ import annotations

import gc
import io
import sys
import time

from backends.changelog.format import FileHeader, encode, iter_records, verify


def main(record_count: int = 1_000_000) -> None:
    records = [(b"user:%015d" % (i * 7), b"v%09d" % i) for i in range(record_count)]
    header = FileHeader(kind="snapshot", job="bench", task="0", store="counts", checkpoint_id="0-0", token="t",
                        seq=1, base_seq=1)
    gc.disable()  # the consumer decides about GC; 1M result tuples would otherwise time the collector, not us
    for compression in ("zstd", "none"):
        start = time.perf_counter()
        data = encode(header, records, compression=compression)
        encode_s = time.perf_counter() - start

        def timed(label: str, run: object) -> None:
            start = time.perf_counter()
            count = sum(1 for _ in run())  # type: ignore[operator]
            elapsed = time.perf_counter() - start
            assert count == record_count
            print(f"  decode {label:<24} {elapsed:6.3f} s  {record_count / elapsed:12,.0f} records/s")

        print(f"{compression}: {record_count:,} records, {len(data):,} bytes")
        print(f"  encode {'':<24} {encode_s:6.3f} s  {record_count / encode_s:12,.0f} records/s")
        start = time.perf_counter()
        verify(data, name="bench")
        verify_s = time.perf_counter() - start
        print(f"  verify {'':<24} {verify_s:6.3f} s  {record_count / verify_s:12,.0f} records/s")
        timed("bytes (verify first)", lambda: iter_records(data, name="bench"))
        timed("bytes, verified=True", lambda: iter_records(data, name="bench", verified=True))
        timed("stream", lambda: iter_records(io.BytesIO(data), name="bench"))
    gc.enable()


if __name__ == "__main__":
    main(int(sys.argv[1]) if len(sys.argv) > 1 else 1_000_000)
