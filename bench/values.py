"""Micro benchmark of the record serde against the json serde: microseconds per value to encode and decode, bytes
per value, and a read-modify-write of a batch of keys through a typed store.

Run from the repository root: ``python -m bench.values [value_count]`` (100k by default). Two value shapes: a
session (an int, a float, two strings, one optional, and a list of strings) and a counter (one int). The json serde
stores the same values as dicts (sorted keys, compact); the record serde stores instances of an attrs class. "old
schema" decodes values written by an earlier shape of the class (a field since dropped, the int since widened to
float), as a store reads them after a deployment that changed the class. Each figure is the best of five rounds.
The store rows: ``update_many`` over 10,000 keys of a 100,000-key store (get, change one field, put), in the write
batch of an open LocalStore, no commit.
"""

from __future__ import annotations

import gc
import importlib
import sys
import tempfile
import time
from collections.abc import Callable
from typing import Any

import attrs

from bench.common import format_table, machine_info, write_result
from statebackend.serdes import RecordSerde, Serde, decode_many, encode_many, get_serde
from statebackend.store import LocalStore, TypedStore


@attrs.frozen
class Session:
    count: int
    total: float
    first_page: str
    last_page: str | None = None
    tags: list[str] = attrs.Factory(list)


@attrs.frozen
class SessionBefore:
    """Session one deployment earlier: ``count`` was an int, and it had a field since dropped."""

    count: int
    total: float
    first_page: str
    referrer: str
    tags: list[str] = attrs.Factory(list)


@attrs.frozen
class SessionAfter:
    """Session with ``count`` widened to float and ``referrer`` dropped: reads SessionBefore's values."""

    count: float
    total: float
    first_page: str
    last_page: str | None = None
    tags: list[str] = attrs.Factory(list)


@attrs.frozen
class Counter:
    count: int


def sessions(count: int) -> list[Session]:
    return [
        _module().Session(
            i % 97,
            i * 0.25,
            f"/page/{i % 1000}",
            None if i % 3 else f"/checkout/{i % 50}",
            ["mobile", "de"] if i % 2 else ["web"],
        )
        for i in range(count)
    ]


def main(value_count: int = 100_000, rounds: int = 7) -> None:
    this = _module()
    json_serde = get_serde("json")
    values = sessions(value_count)
    as_dicts = [attrs.asdict(v) for v in values]
    before = [this.SessionBefore(v.count, v.total, v.first_page, "https://example.org/", v.tags) for v in values]
    after = get_serde("record:bench.values:SessionAfter")
    assert isinstance(after, RecordSerde)
    reading_old = after.with_schemas([get_serde("record:bench.values:SessionBefore").schema])  # type: ignore[attr-defined]
    counters = [this.Counter(i % 1000) for i in range(value_count)]
    cases = [
        Case("session", "json (dicts)", json_serde, as_dicts),
        Case("session", "record (attrs)", get_serde("record:bench.values:Session"), values),
        Case("session", "record, old schema", get_serde("record:bench.values:SessionBefore"), before, reading_old),
        Case("counter", "json (int)", json_serde, [c.count for c in counters]),
        Case("counter", "integer", get_serde("integer"), [c.count for c in counters]),
        Case("counter", "record (attrs)", get_serde("record:bench.values:Counter"), counters),
    ]
    with tempfile.TemporaryDirectory(prefix="bench-values-") as tmp:
        updates = [
            StoreUpdate.open(f"{tmp}/json", "json (dicts)", "json", lambda v: {**v, "count": v["count"] + 1}, as_dicts),
            StoreUpdate.open(
                f"{tmp}/record",
                "record (attrs)",
                "record:bench.values:Session",
                lambda v: attrs.evolve(v, count=v.count + 1),
                values,
            ),
        ]
        try:
            gc.disable()  # the caller decides about GC; 100k result objects would time the collector, not the serdes
            for _ in range(rounds):  # interleaved, the best of each: a machine shared with other work slows all alike
                for case in cases:
                    case.run()
                for update in updates:
                    update.run()
            gc.enable()
        finally:
            for update in updates:
                update.store.close()
    headers = ["shape", "serde", "encode us/value", "decode us/value", "bytes/value"]
    rows = [case.row() for case in cases]
    store_rows = [[update.label, min(update.times) * 1e3] for update in updates]
    print(format_table(headers, rows))
    print()
    print(format_table(["serde", "update_many 10k keys ms"], store_rows))
    path = write_result(
        "values",
        {
            "machine": machine_info(),
            "value_count": value_count,
            "rounds": rounds,
            "serdes": [dict(zip(headers, row, strict=True)) for row in rows],
            "store": [dict(zip(["serde", "update_many_10k_ms"], row, strict=True)) for row in store_rows],
        },
    )
    print(f"\nresults: {path}")


@attrs.define
class Case:
    """One serde over one list of values: encoded with ``serde``, decoded with ``reader`` (default: ``serde``)."""

    shape: str
    label: str
    serde: Serde
    values: list[Any]
    reader: Serde | None = None
    data: list[bytes] = attrs.field(init=False, factory=list)
    encode_s: list[float] = attrs.field(init=False, factory=list)
    decode_s: list[float] = attrs.field(init=False, factory=list)

    def run(self) -> None:
        reader = self.reader or self.serde
        started = time.perf_counter()
        self.data = encode_many(self.serde, self.values)
        self.encode_s.append(time.perf_counter() - started)
        started = time.perf_counter()
        decoded = decode_many(reader, self.data)
        self.decode_s.append(time.perf_counter() - started)
        if self.reader is None:
            assert decoded[:100] == self.values[:100]

    def row(self) -> list[Any]:
        count = len(self.values)
        encode: Any = "-" if self.reader is not None else min(self.encode_s) * 1e6 / count  # the old class's
        return [
            self.shape,
            self.label,
            encode,
            min(self.decode_s) * 1e6 / count,
            sum(map(len, self.data)) / len(self.data),
        ]


@attrs.define
class StoreUpdate:
    """``update_many`` of 10,000 keys (every tenth) of a store of the values, in an open LocalStore's write batch."""

    label: str
    store: LocalStore
    typed: TypedStore
    batch: list[str]
    change: Callable[[Any], Any]
    times: list[float] = attrs.field(factory=list)

    @classmethod
    def open(
        cls, path: str, label: str, serde_name: str, change: Callable[[Any], Any], values: list[Any]
    ) -> StoreUpdate:
        keys = [f"user:{i:08d}" for i in range(len(values))]
        store = LocalStore.open(path, name="bench")
        typed = TypedStore(store, get_serde("string"), get_serde(serde_name))
        typed.put_many(keys, values)
        return cls(label, store, typed, keys[::10][:10_000], change)

    def run(self) -> None:
        started = time.perf_counter()
        self.typed.update_many(self.batch, lambda old: [self.change(v) for v in old])
        self.times.append(time.perf_counter() - started)


def _module() -> Any:
    """This module as the record specs import it (``python -m`` runs it as ``__main__``, whose classes are others)."""
    return importlib.import_module("bench.values")


if __name__ == "__main__":
    main(int(sys.argv[1]) if len(sys.argv) > 1 else 100_000)
