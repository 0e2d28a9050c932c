"""The views users get of a store: the user operations only, over bytes (``BytesStore``) or typed keys and values
(``TypedStore``). The backend-only operations of ``LocalStore`` (flush, bulk loads, environment swaps, ...) stay
with the backends.

Contract:

- Both views offer ``get``, ``contains``, ``put``, ``delete``, ``put_all``, ``delete_all``, ``iter_prefix``,
  ``iter_range``, ``items``, ``count`` and ``name``, with the store's semantics (the write batch is seen; iterations
  are snapshots), and the vectorized ``get_many``, ``put_many``, ``delete_many`` and ``update_many``, which give
  exactly what the per-key calls give in a loop, and nothing else public.
- The vectorized calls take sequences (lists, tuples) or, on ``TypedStore``, Arrow arrays of the serde's type;
  ``update_many(keys, fn)`` reads every key once, calls ``fn`` with their values (``None`` where absent) and writes
  what it returns (``None`` deletes), encoding the keys once. A bad key or value raises before anything of the call
  is written.
- ``BytesStore`` passes calls through unchanged: the same bytes, results and errors as the store.
- ``TypedStore`` converts keys and values with its two serdes. ``iter_prefix`` needs a key serde that keeps prefixes
  (``bytes``, ``string``), else ``ConfigError``; ``iter_range`` follows byte order, which equals the object order for
  bytes, string (code points) and integer.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Iterator, Sequence
from typing import Any, Protocol

import attrs

from statebackend.errors import ConfigError
from statebackend.serdes import Serde, decode_many, encode_many


class StoreOps(Protocol):
    """The user operations of a bytes store (``LocalStore`` has them)."""

    @property
    def name(self) -> str: ...
    def get(self, key: bytes) -> bytes | None: ...
    def contains(self, key: bytes) -> bool: ...
    def put(self, key: bytes, value: bytes) -> None: ...
    def delete(self, key: bytes) -> None: ...
    def put_all(self, items: Iterable[tuple[bytes, bytes]]) -> None: ...
    def delete_all(self, keys: Iterable[bytes]) -> None: ...
    def get_many(self, keys: Sequence[bytes]) -> list[bytes | None]: ...
    def put_many(self, keys: Sequence[bytes], values: Sequence[bytes]) -> None: ...
    def delete_many(self, keys: Sequence[bytes]) -> None: ...
    def write_many(self, keys: Sequence[bytes], values: Sequence[bytes | None]) -> None: ...
    def iter_prefix(self, prefix: bytes) -> Iterator[tuple[bytes, bytes]]: ...
    def iter_range(self, start: bytes | None, end: bytes | None) -> Iterator[tuple[bytes, bytes]]: ...
    def items(self) -> Iterator[tuple[bytes, bytes]]: ...
    def count(self) -> int: ...


class BytesStore:
    """A store's user operations over ``bytes`` keys and values, passed through unchanged."""

    __slots__ = ("_store",)

    def __init__(self, store: StoreOps) -> None:
        self._store = store

    def __repr__(self) -> str:
        return f"BytesStore({self._store.name!r})"

    @property
    def name(self) -> str:
        return self._store.name

    def get(self, key: bytes) -> bytes | None:
        """The value of ``key``, or ``None``."""
        return self._store.get(key)

    def contains(self, key: bytes) -> bool:
        return self._store.contains(key)

    def put(self, key: bytes, value: bytes) -> None:
        self._store.put(key, value)

    def delete(self, key: bytes) -> None:
        self._store.delete(key)

    def put_all(self, items: Iterable[tuple[bytes, bytes]]) -> None:
        """Put each item in order. Not atomic: a bad item raises after the items before it were written."""
        self._store.put_all(items)

    def delete_all(self, keys: Iterable[bytes]) -> None:
        self._store.delete_all(keys)

    def get_many(self, keys: Sequence[bytes]) -> list[bytes | None]:
        """The values of ``keys`` (``None`` where absent), in their order, in one call."""
        return self._store.get_many(keys)

    def put_many(self, keys: Sequence[bytes], values: Sequence[bytes]) -> None:
        """``put(keys[i], values[i])`` for each ``i``, in one call; nothing is written when a key or value is bad."""
        self._store.put_many(keys, values)

    def delete_many(self, keys: Sequence[bytes]) -> None:
        self._store.delete_many(keys)

    def update_many(self, keys: Sequence[bytes], fn: Callable[[list[bytes | None]], Sequence[bytes | None]]) -> None:
        """Read ``keys``, write ``fn(values)`` (``None`` deletes); see the module docstring."""
        _update_many(self._store, list(keys), fn, None)

    def iter_prefix(self, prefix: bytes) -> Iterator[tuple[bytes, bytes]]:
        """Records whose key starts with ``prefix``, in key order."""
        return self._store.iter_prefix(prefix)

    def iter_range(self, start: bytes | None, end: bytes | None) -> Iterator[tuple[bytes, bytes]]:
        """Records with ``start <= key < end`` (``None`` = unbounded), in key order."""
        return self._store.iter_range(start, end)

    def items(self) -> Iterator[tuple[bytes, bytes]]:
        return self._store.items()

    def count(self) -> int:
        """Number of keys."""
        return self._store.count()


@attrs.define(eq=False)
class TypedStore:
    """A store's user operations over typed keys and values, converted by the two serdes.

    ``iter_prefix`` needs a key serde that keeps prefixes (``bytes``, ``string``); with other key serdes (integer,
    json, pickle) a prefix of the object is not a prefix of the bytes, so use ``iter_range``. ``iter_range`` follows
    byte order, which equals the object order for bytes, string (code points) and integer.
    """

    _store: StoreOps = attrs.field(alias="store")
    key_serde: Serde
    value_serde: Serde

    @property
    def name(self) -> str:
        return self._store.name

    def get(self, key: Any) -> Any:
        raw = self._store.get(self.key_serde.to_bytes(key))
        return None if raw is None else self.value_serde.from_bytes(raw)

    def contains(self, key: Any) -> bool:
        return self._store.contains(self.key_serde.to_bytes(key))

    def put(self, key: Any, value: Any) -> None:
        self._store.put(self.key_serde.to_bytes(key), self.value_serde.to_bytes(value))

    def delete(self, key: Any) -> None:
        self._store.delete(self.key_serde.to_bytes(key))

    def put_all(self, items: Iterable[tuple[Any, Any]]) -> None:
        to_key, to_value = self.key_serde.to_bytes, self.value_serde.to_bytes
        self._store.put_all((to_key(k), to_value(v)) for k, v in items)

    def delete_all(self, keys: Iterable[Any]) -> None:
        self._store.delete_all(self.key_serde.to_bytes(k) for k in keys)

    def get_many(self, keys: Sequence[Any] | Any) -> list[Any]:
        """The values of ``keys`` (``None`` where absent), in their order, in one call."""
        raw = self._store.get_many(encode_many(self.key_serde, keys))
        return _decode_values(self.value_serde, raw)

    def put_many(self, keys: Sequence[Any] | Any, values: Sequence[Any] | Any) -> None:
        """``put(keys[i], values[i])`` for each ``i``, in one call; nothing is written when a key or value is bad."""
        self._store.put_many(encode_many(self.key_serde, keys), encode_many(self.value_serde, values))

    def delete_many(self, keys: Sequence[Any] | Any) -> None:
        self._store.delete_many(encode_many(self.key_serde, keys))

    def update_many(self, keys: Sequence[Any] | Any, fn: Callable[[list[Any]], Sequence[Any]]) -> None:
        """Read ``keys``, write ``fn(values)`` (``None`` deletes), encoding the keys once; see the module docstring."""
        _update_many(self._store, encode_many(self.key_serde, keys), fn, self.value_serde)

    def iter_prefix(self, prefix: Any) -> Iterator[tuple[Any, Any]]:
        if not getattr(self.key_serde, "prefix_preserving", False):
            raise ConfigError(
                f"store {self._store.name!r}: iter_prefix needs a key serde that keeps prefixes (bytes, string), "
                f"this store's key serde is {self.key_serde.name!r}; use iter_range instead"
            )
        return self._decode(self._store.iter_prefix(self.key_serde.to_bytes(prefix)))

    def iter_range(self, start: Any | None, end: Any | None) -> Iterator[tuple[Any, Any]]:
        to_key = self.key_serde.to_bytes
        return self._decode(
            self._store.iter_range(None if start is None else to_key(start), None if end is None else to_key(end))
        )

    def items(self) -> Iterator[tuple[Any, Any]]:
        return self._decode(self._store.items())

    def count(self) -> int:
        return self._store.count()

    def _decode(self, records: Iterator[tuple[bytes, bytes]]) -> Iterator[tuple[Any, Any]]:
        from_key, from_value = self.key_serde.from_bytes, self.value_serde.from_bytes
        for key, value in records:
            yield from_key(key), from_value(value)


def _decode_values(serde: Serde, raw: list[bytes | None]) -> list[Any]:
    """Decode the present values in one call; ``None`` stays ``None``."""
    present = [v for v in raw if v is not None]
    decoded = iter(decode_many(serde, present))
    if len(present) == len(raw):
        return list(decoded)
    return [None if v is None else next(decoded) for v in raw]


def _update_many(store: StoreOps, keys: list[bytes], fn: Callable[[list[Any]], Sequence[Any]],
                 serde: Serde | None) -> None:
    """Read ``keys`` once, write ``fn``'s values (``None`` deletes) in order. ``fn`` sees the values as they were
    before the call, also for a key given twice."""
    raw = store.get_many(keys)
    new = list(fn(raw if serde is None else _decode_values(serde, raw)))
    if len(new) != len(keys):
        raise ValueError(f"store {store.name!r}: update_many's function returned {len(new)} values for {len(keys)} keys")
    if serde is None:
        store.write_many(keys, new)
        return
    present = [v for v in new if v is not None]
    encoded = encode_many(serde, present)
    if len(present) == len(keys):
        store.put_many(keys, encoded)
        return
    values = iter(encoded)
    store.write_many(keys, [None if v is None else next(values) for v in new])
