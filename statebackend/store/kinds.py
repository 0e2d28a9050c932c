"""Typed state per key: the list and map stores (``stores.<name>.kind = list | map``; ``value`` is ``TypedStore``).

Contract:

- **Encoding** (what LMDB, the write batch, deltas, runs and snapshots hold: plain records, so every backend backs
  them up and restores them as any other). Every record of a user key starts with the key's *prefix*: the length of
  the encoded user key (2 bytes, big-endian) and the encoded key itself, so no key's prefix is a prefix of another
  key's and a key's records are one contiguous range. :func:`user_key_of` gives the encoded user key of any record:
  the key group of a record (rescale) and the key column of ``read_state`` come from it alone.

  - list: a head record ``prefix + 00`` holding ``head`` and ``next`` (8 bytes big-endian each) and one record per
    element ``prefix + 01 + seq`` (8 bytes big-endian). The elements are the seqs ``head <= seq < next``, in append
    order. An append reads the head record (one key, whatever the list's length) and writes the element and the head
    record: its cost does not grow with the list. Seqs are the list's own count, so a replayed batch, which starts
    from the same restored state, gives its appends the same keys.
  - map: one record per entry, ``prefix + encoded sub-key`` (``stores.<name>.subkey.serde``), so the entries of a key
    iterate and range in sub-key byte order.

- **TTL** (``stores.<name>.ttl.ms``): every record carries the envelope of :mod:`statebackend.store.ttl`, an element
  or entry its own expiry (the store's TTL, or ``ttl_ms=`` of the call), the head record of a list the latest of its
  elements'. Expired elements and entries are invisible at once, the sweep reclaims them as any key. ``len`` of a
  list is its head record's count without a TTL, a scan of the list with one.
- Values (elements, map values) go through the store's value serde (a record serde reads every recorded schema, as
  for value stores). Keys, sub-keys and values are encoded at the call, before anything is written; a bad one raises
  the :class:`SerdeError` a value store raises. A call of another kind's operation (``put`` on a list store,
  ``append`` on a map store) raises :class:`KindError` naming the store, its kind and what it offers.
"""

from __future__ import annotations

import struct
from collections.abc import Iterable, Iterator, Mapping
from typing import TYPE_CHECKING, Any

import attrs

from statebackend.errors import ConfigError, CorruptDataError, KindError
from statebackend.serdes import Serde
from statebackend.serdes.builtin import short_repr
from statebackend.store.ttl import unwrap, wrap

if TYPE_CHECKING:
    from statebackend.store.local import LocalStore
    from statebackend.store.ttl import TtlStore

__all__ = [
    "KIND",
    "KINDS",
    "KindError",
    "ListStore",
    "MapStore",
    "is_list_head",
    "key_prefix",
    "sub_key_of",
    "user_key_of",
    "wrong_kind",
]

#: the kinds a store may be of (``stores.<name>.kind``)
KINDS = ("value", "list", "map")
#: what checkpoints record of a list or map store under ``serdes[store]`` (a value store records nothing new: its
#: checkpoints stay as they were)
KIND = "kind"

_LENGTH = struct.Struct(">H")
_SEQ = struct.Struct(">Q")
_HEAD = struct.Struct(">QQ")
_HEAD_TAG = b"\x00"
_ELEMENT_TAG = b"\x01"
_ELEMENTS_END = b"\x02"

#: per kind: what its stores offer (the error of a wrong call lists it)
OPERATIONS: Mapping[str, tuple[str, ...]] = {
    "value": (
        "get",
        "contains",
        "put",
        "delete",
        "put_all",
        "delete_all",
        "get_many",
        "put_many",
        "delete_many",
        "update_many",
        "iter_prefix",
        "iter_range",
        "items",
        "count",
    ),
    "list": ("append", "extend", "get", "values", "len", "contains", "trim", "replace", "clear", "user_keys", "lists"),
    "map": (
        "get",
        "contains",
        "put",
        "update",
        "delete",
        "items",
        "keys",
        "range",
        "len",
        "clear",
        "user_keys",
        "maps",
    ),
}
_SIGNATURES = {
    ("list", "append"): "append(key, value)",
    ("list", "trim"): "trim(key, keep_last=n)",
    ("map", "put"): "put(key, sub_key, value)",
    ("map", "get"): "get(key, sub_key)",
    ("map", "range"): "range(key, start, end)",
    ("value", "put"): "put(key, value)",
}
_KNOWN = frozenset(op for ops in OPERATIONS.values() for op in ops)


def wrong_kind(store: str, kind: str, operation: str) -> AttributeError:
    """The error of ``operation`` asked of store ``store`` of ``kind``: a :class:`KindError` when another kind has
    it, else the plain ``AttributeError`` of a missing attribute."""
    if operation.startswith("_") or operation not in _KNOWN:
        return AttributeError(f"{kind} store {store!r} has no attribute {operation!r}")
    has = [k for k, ops in OPERATIONS.items() if operation in ops and k != kind]
    their = ", ".join(f"{k} stores ({_SIGNATURES.get((k, operation), operation)})" for k in has)
    return KindError(
        f"store {store!r} is a {kind} store (stores.{store}.kind={kind}): it has no {operation}, which {their} "
        f"have; a {kind} store offers {', '.join(OPERATIONS[kind])}. Use them, or declare another store with "
        f"stores.<name>.kind={has[0] if has else kind}"
    )


def key_prefix(user_key: bytes) -> bytes:
    """The prefix of every record of the user key encoded as ``user_key``."""
    return _LENGTH.pack(len(user_key)) + user_key


def user_key_of(record_key: bytes, *, store: str = "?") -> bytes:
    """The encoded user key of a list or map store's record ``record_key``."""
    if len(record_key) >= 2:
        (length,) = _LENGTH.unpack_from(record_key)
        if len(record_key) >= 2 + length:
            return record_key[2 : 2 + length]
    raise CorruptDataError(
        f"store {store!r}: a record key of {len(record_key)} bytes does not start with a user key's length and bytes: "
        "the store holds records written as another kind (stores.<name>.kind must stay what the store was created "
        "with)"
    )


def is_list_head(record_key: bytes, *, store: str = "?") -> bool:
    """Whether ``record_key`` of a list store is a list's head record (not one of its elements)."""
    user_key = user_key_of(record_key, store=store)
    return record_key[2 + len(user_key) :] == _HEAD_TAG


def sub_key_of(record_key: bytes, *, store: str = "?") -> bytes:
    """The encoded sub-key of a map store's entry record ``record_key``."""
    return record_key[2 + len(user_key_of(record_key, store=store)) :]


def _prefix_end(prefix: bytes) -> bytes:
    """The least key above every key starting with ``prefix`` (a key prefix's first byte is at most 0x01)."""
    stripped = prefix.rstrip(b"\xff")
    return stripped[:-1] + bytes([stripped[-1] + 1])


@attrs.define(eq=False)
class _KindStore:
    """What list and map stores share: the serdes, the TTL envelope, the errors."""

    _store: LocalStore = attrs.field(alias="store")
    key_serde: Serde
    value_serde: Serde
    #: the store's TTL view (its clock and TTL); None: the store has no TTL
    _ttl: TtlStore | None = attrs.field(alias="ttl", default=None)

    kind = "?"

    @property
    def name(self) -> str:
        return self._store.name

    def __repr__(self) -> str:
        return f"{type(self).__name__}({self.name!r})"

    def __getattr__(self, operation: str) -> Any:
        if operation.startswith("_"):  # an unset slot (during init), copy's and pickle's probes
            raise AttributeError(operation)
        raise wrong_kind(self._store.name, self.kind, operation)

    # -- encoding ---------------------------------------------------------------------------------------------------

    def _prefix(self, key: Any) -> bytes:
        from statebackend.store.typed import _encode_error

        try:
            return key_prefix(self.key_serde.to_bytes(key))
        except Exception as exc:
            raise _encode_error(self.name, self.key_serde, "key", key, key, exc) from exc

    def _value(self, key: Any, value: Any) -> bytes:
        from statebackend.store.typed import _encode_error

        try:
            return self.value_serde.to_bytes(value)
        except Exception as exc:
            raise _encode_error(self.name, self.value_serde, "value", key, value, exc) from exc

    def _decode_value(self, key: Any, data: bytes) -> Any:
        from statebackend.store.typed import _decode_error

        try:
            return self.value_serde.from_bytes(data)
        except Exception as exc:
            raise _decode_error(self.name, self.value_serde, short_repr(key), exc) from exc

    def _decode_key(self, data: bytes) -> Any:
        from statebackend.store.typed import _decode_error

        try:
            return self.key_serde.from_bytes(data)
        except Exception as exc:
            raise _decode_error(self.name, self.key_serde, short_repr(data), exc, "key") from exc

    # -- the envelope -----------------------------------------------------------------------------------------------

    def _expiry(self, ttl_ms: int | None) -> int | None:
        """The expiry a write gets now (None: the store has no TTL)."""
        if self._ttl is None:
            if ttl_ms is not None:
                raise ConfigError(
                    f"store {self.name!r} ({self.kind} store) has no TTL, so its values carry no expiry: ttl_ms= "
                    f"needs stores.{self.name}.ttl.ms set when the store is created (the default of the calls "
                    "without ttl_ms)"
                )
            return None
        return self._ttl.expiry(ttl_ms)

    def _now(self) -> int:
        return self._ttl.now_ms() if self._ttl is not None else 0

    def _wrap(self, data: bytes, expiry: int | None) -> bytes:
        return data if expiry is None else wrap(data, expiry)

    def _open(self, raw: bytes, now: int) -> bytes | None:
        """The payload of stored ``raw`` if visible at ``now``."""
        if self._ttl is None:
            return raw
        expiry, payload = unwrap(raw, store=self.name)
        return payload if now < expiry else None


@attrs.define(eq=False, repr=False)
class ListStore(_KindStore):
    """A list of values per key (``stores.<name>.kind = list``); see the module docstring."""

    kind = "list"

    def append(self, key: Any, value: Any, *, ttl_ms: int | None = None) -> None:
        """Add ``value`` at the end of ``key``'s list, without reading the list."""
        self.extend(key, (value,), ttl_ms=ttl_ms)

    def extend(self, key: Any, values: Iterable[Any], *, ttl_ms: int | None = None) -> None:
        """Add ``values`` at the end of ``key``'s list, in order, without reading the list; nothing is written when
        one of them does not encode."""
        prefix = self._prefix(key)
        encoded = [self._value(key, value) for value in values]
        expiry = self._expiry(ttl_ms)
        if not encoded:
            return
        head, after, head_expiry = self._head(prefix)
        element = prefix + _ELEMENT_TAG
        self._store.put_many(
            [element + _SEQ.pack(after + i) for i in range(len(encoded))],
            [self._wrap(data, expiry) for data in encoded],
        )
        self._put_head(prefix, head, after + len(encoded), max(head_expiry, expiry) if expiry is not None else None)

    def replace(self, key: Any, values: Iterable[Any], *, ttl_ms: int | None = None) -> None:
        """Make ``key``'s list ``values`` (empty: no list)."""
        values = list(values)
        for value in values:
            self._value(key, value)  # a bad value raises before the clear
        self.clear(key)
        self.extend(key, values, ttl_ms=ttl_ms)

    def get(self, key: Any) -> list[Any]:
        """``key``'s list in append order (empty when it has none)."""
        return list(self.values(key))

    def values(self, key: Any) -> Iterator[Any]:
        """``key``'s values in append order (a snapshot, as every iteration)."""
        prefix = self._prefix(key)
        head, after, _ = self._head(prefix)
        for _, data in self._elements(prefix, head, after):
            yield self._decode_value(key, data)

    def len(self, key: Any) -> int:
        """The length of ``key``'s list: its head record's count, or (with a TTL) a scan of its live elements."""
        prefix = self._prefix(key)
        head, after, _ = self._head(prefix)
        if self._ttl is None:
            return after - head
        return sum(1 for _ in self._elements(prefix, head, after))

    def contains(self, key: Any) -> bool:
        """Whether ``key`` has a non-empty list."""
        prefix = self._prefix(key)
        head, after, _ = self._head(prefix)
        if self._ttl is None:
            return after > head
        return next(self._elements(prefix, head, after), None) is not None

    def trim(self, key: Any, *, keep_last: int) -> int:
        """Keep the last ``keep_last`` values of ``key``'s list, deleting the older ones; returns how many were
        deleted. Without a TTL its cost is that of the deletes (one per append when trimmed after each)."""
        if type(keep_last) is not int or keep_last < 0:
            raise ValueError(f"store {self.name!r}: trim's keep_last must be an int >= 0, got {keep_last!r}")
        prefix = self._prefix(key)
        head, after, expiry = self._head(prefix)
        element = prefix + _ELEMENT_TAG
        if self._ttl is None:
            cut = max(head, after - keep_last)
            doomed = [element + _SEQ.pack(seq) for seq in range(head, cut)]
            removed = len(doomed)
        else:
            now = self._now()
            seqs = [
                (_SEQ.unpack_from(k, len(element))[0], self._open(raw, now) is not None)
                for k, raw in self._store.iter_range(element + _SEQ.pack(head), element + _SEQ.pack(after))
            ]
            live = [seq for seq, visible in seqs if visible]
            if len(live) <= keep_last:
                return 0
            cut = live[-keep_last] if keep_last else after
            doomed = [element + _SEQ.pack(seq) for seq, _ in seqs if seq < cut]
            removed = sum(1 for seq in live if seq < cut)
        if not doomed:
            return 0
        self._store.delete_many(doomed)
        if cut == after:
            self._store.delete(prefix + _HEAD_TAG)
        else:
            self._put_head(prefix, cut, after, expiry if self._ttl is not None else None)
        return removed

    def clear(self, key: Any) -> None:
        """Delete ``key``'s list."""
        prefix = self._prefix(key)
        self._store.delete_many([k for k, _ in self._store.iter_prefix(prefix)])

    def user_keys(self) -> Iterator[Any]:
        """The keys with a non-empty list (in the byte order of their length, then of their bytes)."""
        for key, _ in self.lists():
            yield key

    def lists(self) -> Iterator[tuple[Any, list[Any]]]:
        """Every key with its non-empty list (a scan of the whole store)."""
        for raw_key, values in self.raw_lists():
            key = self._decode_key(raw_key)
            yield key, [self._decode_value(key, v) for v in values]

    def raw_lists(self) -> Iterator[tuple[bytes, list[bytes]]]:
        """Every encoded key with its encoded values, as :meth:`lists` (``read_state`` converts them itself)."""
        now = self._now()
        current: bytes | None = None
        bounds = (0, 0)
        values: list[bytes] = []
        for record, raw in self._store.items():
            user_key = user_key_of(record, store=self.name)
            if user_key != current:
                if current is not None and values:
                    yield current, values
                current, values, bounds = user_key, [], (0, 0)
            tag_at = 2 + len(user_key)
            tag = record[tag_at : tag_at + 1]
            if tag == _HEAD_TAG:
                payload = self._open(raw, now)
                bounds = _HEAD.unpack(payload) if payload is not None else (0, 0)
            elif tag == _ELEMENT_TAG:
                seq = _SEQ.unpack_from(record, tag_at + 1)[0]
                payload = self._open(raw, now)
                if payload is not None and bounds[0] <= seq < bounds[1]:
                    values.append(payload)
        if current is not None and values:
            yield current, values

    # -- internals --------------------------------------------------------------------------------------------------

    def _head(self, prefix: bytes) -> tuple[int, int, int]:
        """(head, next, expiry) of the list at ``prefix``; a list whose head expired is empty, its seqs go on."""
        raw = self._store.get(prefix + _HEAD_TAG)
        if raw is None:
            return 0, 0, 0
        if self._ttl is None:
            head, after = _HEAD.unpack(raw)
            return head, after, 0
        expiry, payload = unwrap(raw, store=self.name)
        head, after = _HEAD.unpack(payload)
        if self._ttl.now_ms() >= expiry:
            return after, after, 0
        return head, after, expiry

    def _put_head(self, prefix: bytes, head: int, after: int, expiry: int | None) -> None:
        self._store.put(prefix + _HEAD_TAG, self._wrap(_HEAD.pack(head, after), expiry))

    def _elements(self, prefix: bytes, head: int, after: int) -> Iterator[tuple[bytes, bytes]]:
        """The live elements ``head <= seq < next`` as (record key, payload)."""
        if after <= head:
            return
        element = prefix + _ELEMENT_TAG
        now = self._now()
        for record, raw in self._store.iter_range(element + _SEQ.pack(head), element + _SEQ.pack(after)):
            payload = self._open(raw, now)
            if payload is not None:
                yield record, payload


@attrs.define(eq=False, repr=False)
class MapStore(_KindStore):
    """A map of sub-keys to values per key (``stores.<name>.kind = map``); see the module docstring."""

    subkey_serde: Serde = attrs.field(kw_only=True)

    kind = "map"

    def get(self, key: Any, sub_key: Any) -> Any:
        """The value under ``sub_key`` of ``key``'s map, or ``None``."""
        raw = self._store.get(self._entry(key, sub_key))
        payload = None if raw is None else self._open(raw, self._now())
        return None if payload is None else self._decode_value(key, payload)

    def contains(self, key: Any, sub_key: Any) -> bool:
        raw = self._store.get(self._entry(key, sub_key))
        return raw is not None and self._open(raw, self._now()) is not None

    def put(self, key: Any, sub_key: Any, value: Any, *, ttl_ms: int | None = None) -> None:
        """Set ``sub_key`` of ``key``'s map to ``value``."""
        entry = self._entry(key, sub_key)
        data = self._value(key, value)
        self._store.put(entry, self._wrap(data, self._expiry(ttl_ms)))

    def update(self, key: Any, entries: Mapping[Any, Any], *, ttl_ms: int | None = None) -> None:
        """Set each sub-key of ``entries`` in ``key``'s map; nothing is written when one does not encode."""
        pairs = [(self._entry(key, sub), self._value(key, value)) for sub, value in entries.items()]
        expiry = self._expiry(ttl_ms)
        if pairs:
            self._store.put_many([k for k, _ in pairs], [self._wrap(v, expiry) for _, v in pairs])

    def delete(self, key: Any, sub_key: Any) -> None:
        self._store.delete(self._entry(key, sub_key))

    def items(self, key: Any) -> Iterator[tuple[Any, Any]]:
        """(sub-key, value) of ``key``'s map in sub-key byte order."""
        prefix = self._prefix(key)
        return self._decoded(key, prefix, self._store.iter_prefix(prefix))

    def keys(self, key: Any) -> Iterator[Any]:
        """The sub-keys of ``key``'s map in byte order."""
        return (sub for sub, _ in self.items(key))

    def range(self, key: Any, start: Any | None, end: Any | None) -> Iterator[tuple[Any, Any]]:
        """(sub-key, value) of ``key``'s map with ``start <= sub-key < end`` in byte order (``None``: unbounded)."""
        prefix = self._prefix(key)
        lower = prefix if start is None else prefix + self._sub(start, "range start")
        upper = _prefix_end(prefix) if end is None else prefix + self._sub(end, "range end")
        return self._decoded(key, prefix, self._store.iter_range(lower, upper))

    def len(self, key: Any) -> int:
        """The number of entries of ``key``'s map (a scan of it)."""
        return sum(1 for _ in self.items(key))

    def clear(self, key: Any) -> None:
        """Delete ``key``'s map."""
        prefix = self._prefix(key)
        self._store.delete_many([k for k, _ in self._store.iter_prefix(prefix)])

    def user_keys(self) -> Iterator[Any]:
        """The keys with a non-empty map."""
        for key, _ in self.raw_maps():
            yield self._decode_key(key)

    def maps(self) -> Iterator[tuple[Any, dict[Any, Any]]]:
        """Every key with its non-empty map, in sub-key byte order (a scan of the whole store)."""
        for raw_key, entries in self.raw_maps():
            key = self._decode_key(raw_key)
            yield key, {self._decode_sub(sub): self._decode_value(key, v) for sub, v in entries}

    def raw_maps(self) -> Iterator[tuple[bytes, list[tuple[bytes, bytes]]]]:
        """Every encoded key with its encoded (sub-key, value) entries, as :meth:`maps`."""
        now = self._now()
        current: bytes | None = None
        entries: list[tuple[bytes, bytes]] = []
        for record, raw in self._store.items():
            user_key = user_key_of(record, store=self.name)
            if user_key != current:
                if current is not None and entries:
                    yield current, entries
                current, entries = user_key, []
            payload = self._open(raw, now)
            if payload is not None:
                entries.append((record[2 + len(user_key) :], payload))
        if current is not None and entries:
            yield current, entries

    # -- internals --------------------------------------------------------------------------------------------------

    def _entry(self, key: Any, sub_key: Any) -> bytes:
        return self._prefix(key) + self._sub(sub_key, "sub-key")

    def _sub(self, sub_key: Any, role: str) -> bytes:
        from statebackend.store.typed import _encode_error

        try:
            return self.subkey_serde.to_bytes(sub_key)
        except Exception as exc:
            raise _encode_error(self.name, self.subkey_serde, role, sub_key, sub_key, exc) from exc

    def _decode_sub(self, data: bytes) -> Any:
        from statebackend.store.typed import _decode_error

        try:
            return self.subkey_serde.from_bytes(data)
        except Exception as exc:
            raise _decode_error(self.name, self.subkey_serde, short_repr(data), exc, "key") from exc

    def _decoded(self, key: Any, prefix: bytes, records: Iterator[tuple[bytes, bytes]]) -> Iterator[tuple[Any, Any]]:
        now, cut = self._now(), len(prefix)
        for record, raw in records:
            payload = self._open(raw, now)
            if payload is not None:
                yield self._decode_sub(record[cut:]), self._decode_value(key, payload)
