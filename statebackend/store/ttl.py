"""Time to live of keys (``stores.<name>.ttl.ms``): the value envelope, the view that hides expired keys, the sweep.

Contract:

- In a store with a TTL every stored value is an **envelope**: the expiry time (milliseconds since the epoch, 8 bytes
  big-endian, unsigned) followed by the value's bytes. The envelope is what LMDB, the write batch, deltas, runs and
  snapshots hold, so a restore brings every key back with its expiry: a restore never resurrects an expired key. A
  store without a TTL keeps plain values, byte for byte; which of the two a store holds is recorded in every
  checkpoint (``serdes[store]["envelope"] == "ttl"``) and a store cannot switch (the bytes could not be told apart).
- :class:`TtlStore` has the user operations of a store (``statebackend.store.typed.StoreOps``) over a
  :class:`~statebackend.store.local.LocalStore`: a write stores ``now + ttl`` as the expiry (every put refreshes
  it); a read sees a key only while ``now < expiry`` (``get``, ``get_many``, ``contains``, the iterations, ``count``,
  ``update_many`` through them), and returns the value without its envelope.
- A write may give its own time to live (``ttl_ms=`` of :meth:`TtlStore.put` and :meth:`TtlStore.put_many`, the
  per-call TTL of the typed views); without it the store's ``ttl_ms``. Either way the envelope is the same.
- ``now`` comes from the clock the task gives (:attr:`TtlStore.now_ms`): under Spark it is fixed per batch and the
  same when the batch is replayed, so a replay sees exactly the keys its first run saw.
- :meth:`TtlStore.sweep` examines at most ``budget`` keys from where the previous sweep stopped (wrapping around) and
  deletes the expired ones through the ordinary write path, so the deletes reach the next commit's delta or run and
  every later snapshot, base run or compaction leaves the keys out. Expired keys are invisible from the moment they
  expire; the sweep only reclaims their space.
"""

from __future__ import annotations

import struct
import time
from collections.abc import Callable, Iterable, Iterator, Sequence
from typing import TYPE_CHECKING

from statebackend.errors import CorruptDataError

if TYPE_CHECKING:
    from statebackend.store.local import LocalStore

__all__ = [
    "CLOCK_OFFSET",
    "ENVELOPE",
    "EXPIRY_BYTES",
    "TtlStore",
    "batch_clock",
    "unwrap",
    "visible_value",
    "wall_clock_ms",
    "wrap",
]

#: the value recorded under ``serdes[store]["envelope"]`` in checkpoints of a store with a TTL
ENVELOPE = "ttl"
EXPIRY_BYTES = 8
_EXPIRY = struct.Struct(">Q")
_MAX_EXPIRY = (1 << 64) - 1


#: the input offset under which a checkpoint records the clock its commit's TTL stores used (the Spark driver writes
#: it at every batch: a replay and a reader of the checkpoint use the same clock)
CLOCK_OFFSET = "now.ms"


def wall_clock_ms() -> int:
    return int(time.time() * 1000)


def batch_clock(checkpoint: object | None) -> int:
    """The clock a checkpoint's commit used (:data:`CLOCK_OFFSET`), else the wall clock: readers of a checkpoint
    (``read_state``, the CLI's ``dump``) see the keys its batch saw."""
    offsets = getattr(checkpoint, "input_offsets", None) or {}
    recorded = offsets.get(CLOCK_OFFSET)
    if recorded is not None and str(recorded).isdigit():
        return int(recorded)
    return wall_clock_ms()


def wrap(value: bytes, expiry_ms: int) -> bytes:
    """The envelope of ``value`` expiring at ``expiry_ms``."""
    return _EXPIRY.pack(min(max(expiry_ms, 0), _MAX_EXPIRY)) + value


def unwrap(raw: bytes, *, store: str = "?") -> tuple[int, bytes]:
    """(expiry in ms, value) of an envelope."""
    if len(raw) < EXPIRY_BYTES:
        raise CorruptDataError(
            f"store {store!r}: a stored value of {len(raw)} bytes is shorter than the TTL envelope's "
            f"{EXPIRY_BYTES}-byte expiry: the store holds values written without stores.{store}.ttl.ms"
        )
    return _EXPIRY.unpack_from(raw)[0], raw[EXPIRY_BYTES:]


def visible_value(raw: bytes | None, now_ms: int, *, store: str = "?") -> bytes | None:
    """The value in envelope ``raw`` if it has not expired at ``now_ms``, else ``None``."""
    if raw is None:
        return None
    expiry, value = unwrap(raw, store=store)
    return value if now_ms < expiry else None


class TtlStore:
    """A store's user operations with a time to live per key (see the module docstring)."""

    __slots__ = ("_store", "_sweep_from", "now_ms", "swept_elsewhere", "ttl_ms")

    def __init__(self, store: LocalStore, ttl_ms: int, now_ms: Callable[[], int] = wall_clock_ms) -> None:
        self._store = store
        self.ttl_ms = ttl_ms
        #: the clock reads and writes use (milliseconds since the epoch)
        self.now_ms = now_ms
        self._sweep_from: bytes | None = None
        #: True: :meth:`sweep` deletes nothing; the owner finds expired keys with :meth:`expired_from` and deletes them
        #: itself (the Spark driver's ``on_expiry``: a callback for each, its cursor recorded in the checkpoint)
        self.swept_elsewhere = False

    def __repr__(self) -> str:
        return f"TtlStore({self._store.name!r}, ttl_ms={self.ttl_ms})"

    @property
    def name(self) -> str:
        return self._store.name

    # -- reads ----------------------------------------------------------------------------------------------------

    def get(self, key: bytes) -> bytes | None:
        return visible_value(self._store.get(key), self.now_ms(), store=self.name)

    def contains(self, key: bytes) -> bool:
        return self.get(key) is not None

    def get_many(self, keys: Sequence[bytes]) -> list[bytes | None]:
        now, name = self.now_ms(), self.name
        return [visible_value(raw, now, store=name) for raw in self._store.get_many(keys)]

    def iter_prefix(self, prefix: bytes) -> Iterator[tuple[bytes, bytes]]:
        return self._visible(self._store.iter_prefix(prefix))

    def iter_range(self, start: bytes | None, end: bytes | None) -> Iterator[tuple[bytes, bytes]]:
        return self._visible(self._store.iter_range(start, end))

    def items(self) -> Iterator[tuple[bytes, bytes]]:
        return self._visible(self._store.items())

    def count(self) -> int:
        """Number of keys not expired: a scan (O(keys)), unlike a store without a TTL."""
        return sum(1 for _ in self.items())

    def _visible(self, records: Iterator[tuple[bytes, bytes]]) -> Iterator[tuple[bytes, bytes]]:
        now, name = self.now_ms(), self.name  # the clock at the call, like the snapshot the iteration is
        for key, raw in records:
            expiry, value = unwrap(raw, store=name)
            if now < expiry:
                yield key, value

    # -- writes ---------------------------------------------------------------------------------------------------

    def expiry(self, ttl_ms: int | None = None) -> int:
        """The expiry a write now gets: ``now + ttl_ms`` (the store's ``ttl_ms`` unless given, ``>= 1``)."""
        if ttl_ms is None:
            return self.now_ms() + self.ttl_ms
        if type(ttl_ms) is not int or ttl_ms < 1:
            raise ValueError(f"store {self.name!r}: ttl_ms must be an int of at least 1 (milliseconds), got {ttl_ms!r}")
        return self.now_ms() + ttl_ms

    def put(self, key: bytes, value: bytes, ttl_ms: int | None = None) -> None:
        """Write ``value`` expiring ``ttl_ms`` (default: the store's) from now."""
        if not isinstance(value, bytes):
            raise TypeError(f"store {self.name!r}: value must be bytes, got {type(value).__name__}")
        self._store.put(key, wrap(value, self.expiry(ttl_ms)))

    def delete(self, key: bytes) -> None:
        self._store.delete(key)

    def put_all(self, items: Iterable[tuple[bytes, bytes]]) -> None:
        for key, value in items:
            self.put(key, value)

    def delete_all(self, keys: Iterable[bytes]) -> None:
        self._store.delete_all(keys)

    def put_many(self, keys: Sequence[bytes], values: Sequence[bytes], ttl_ms: int | None = None) -> None:
        values = list(values)
        bad = next((v for v in values if not isinstance(v, bytes)), None)
        if bad is not None:
            raise TypeError(f"store {self.name!r}: value must be bytes, got {type(bad).__name__}")
        prefix = wrap(b"", self.expiry(ttl_ms))
        self._store.put_many(keys, [prefix + v for v in values])

    def delete_many(self, keys: Sequence[bytes]) -> None:
        self._store.delete_many(keys)

    def write_many(self, keys: Sequence[bytes], values: Sequence[bytes | None]) -> None:
        values = list(values)
        bad = next((v for v in values if v is not None and not isinstance(v, bytes)), None)
        if bad is not None:
            raise TypeError(f"store {self.name!r}: value must be bytes, got {type(bad).__name__}")
        prefix = _EXPIRY.pack(self.now_ms() + self.ttl_ms)
        self._store.write_many(keys, [None if v is None else prefix + v for v in values])

    # -- the sweep ------------------------------------------------------------------------------------------------

    def sweep(self, budget: int) -> int:
        """Examine at most ``budget`` keys from where the last sweep stopped (wrapping around once) and delete the
        expired ones. Returns how many were deleted."""
        if budget <= 0 or self.swept_elsewhere:
            return 0
        now, name = self.now_ms(), self.name
        expired: list[bytes] = []
        examined = 0
        start = self._sweep_from
        next_from: bytes | None = None
        for lower, upper in ((start, None), (None, start)) if start is not None else ((None, None),):
            for key, raw in self._store.iter_range(lower, upper):
                if examined >= budget:
                    next_from = key
                    break
                examined += 1
                if unwrap(raw, store=name)[0] <= now:
                    expired.append(key)
            if next_from is not None:
                break
        self._sweep_from = next_from
        if expired:
            self._store.delete_many(expired)
        return len(expired)

    def expired_from(self, start: bytes | None, budget: int) -> tuple[list[tuple[bytes, int, bytes]], bytes | None]:
        """The expired keys among at most ``budget`` keys from ``start`` (None: the first key), wrapping around once,
        as ``(key, expiry, value)``, and the key the next call starts from (None: the first key). Nothing is deleted:
        a deterministic sweep for a caller that keeps the cursor itself (the same state, clock and cursor give the
        same keys)."""
        found: list[tuple[bytes, int, bytes]] = []
        if budget <= 0:
            return found, start
        now, name = self.now_ms(), self.name
        examined = 0
        next_from: bytes | None = None
        for lower, upper in ((start, None), (None, start)) if start is not None else ((None, None),):
            for key, raw in self._store.iter_range(lower, upper):
                if examined >= budget:
                    next_from = bytes(key)
                    break
                examined += 1
                expiry, value = unwrap(raw, store=name)
                if expiry <= now:
                    found.append((bytes(key), expiry, bytes(value)))
            if next_from is not None:
                break
        return found, next_from
