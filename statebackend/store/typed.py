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
- A key or value its serde cannot encode raises :class:`SerdeError` at the call that gave it (``put``, ``get``, ...;
  for a vectorized call, the first bad item), before anything of that call is written: the store's contents and its
  pending writes stay as they were. The message names the store, the serde, the key (its repr, cut to 80
  characters), the type given and the fix; the serde's own error is chained. Stored bytes the value serde cannot
  decode raise ``CorruptDataError`` naming the store, the serde and the key. Encoding is at the call, never
  deferred to a flush or commit; the error handling costs nothing unless something fails (a ``try`` is free).
- These are the views of value stores (``stores.<name>.kind = value``, the default; list and map stores have theirs
  in ``statebackend.store.kinds``). ``put`` and ``put_many`` take ``ttl_ms=``, the time to live of what they write
  instead of the store's ``ttl.ms`` (a store without ``ttl.ms`` refuses it: its values carry no expiry). A list or
  map operation (``append``, ``range``, ...) raises ``KindError`` naming the store, its kind and what it offers.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Iterator, Sequence
from typing import Any, Protocol

import attrs

from statebackend.errors import ConfigError, CorruptDataError, SerdeError, StateBackendError
from statebackend.serdes import Serde, decode_many, encode_many
from statebackend.serdes.builtin import as_list, described, short_repr, type_name
from statebackend.store.ttl import TtlStore


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

    def __getattr__(self, operation: str) -> Any:
        return _missing(self._store, operation)

    @property
    def name(self) -> str:
        return self._store.name

    def get(self, key: bytes) -> bytes | None:
        """The value of ``key``, or ``None``."""
        return self._store.get(key)

    def contains(self, key: bytes) -> bool:
        return self._store.contains(key)

    def put(self, key: bytes, value: bytes, *, ttl_ms: int | None = None) -> None:
        if ttl_ms is None:
            self._store.put(key, value)
        else:
            _ttl_ops(self._store).put(key, value, ttl_ms)

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

    def put_many(self, keys: Sequence[bytes], values: Sequence[bytes], *, ttl_ms: int | None = None) -> None:
        """``put(keys[i], values[i])`` for each ``i``, in one call; nothing is written when a key or value is bad."""
        if ttl_ms is None:
            self._store.put_many(keys, values)
        else:
            _ttl_ops(self._store).put_many(keys, values, ttl_ms)

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

    def __getattr__(self, operation: str) -> Any:
        return _missing(self._store, operation)

    # The per-key calls are the statements they always were inside a ``try`` (free in Python 3.11+ until something
    # raises): which part failed (the key's encoding, the value's, or the store itself) is found out in the handler
    # only, by encoding again; the store's own errors are raised as they were.

    def get(self, key: Any) -> Any:
        try:
            raw = self._store.get(self.key_serde.to_bytes(key))
        except Exception as exc:
            error = _encode_failure(self, key, _NOTHING, exc)
            if error is None:
                raise
            raise error from exc
        try:
            return None if raw is None else self.value_serde.from_bytes(raw)
        except Exception as exc:
            raise _decode_error(self._store.name, self.value_serde, short_repr(key), exc) from exc

    def contains(self, key: Any) -> bool:
        try:
            return self._store.contains(self.key_serde.to_bytes(key))
        except Exception as exc:
            error = _encode_failure(self, key, _NOTHING, exc)
            if error is None:
                raise
            raise error from exc

    def put(self, key: Any, value: Any, *, ttl_ms: int | None = None) -> None:
        if ttl_ms is not None:
            _ttl_ops(self._store).put(self._key(key), self._value(key, value), ttl_ms)
            return
        try:
            self._store.put(self.key_serde.to_bytes(key), self.value_serde.to_bytes(value))
        except Exception as exc:
            error = _encode_failure(self, key, value, exc)
            if error is None:
                raise
            raise error from exc

    def delete(self, key: Any) -> None:
        try:
            self._store.delete(self.key_serde.to_bytes(key))
        except Exception as exc:
            error = _encode_failure(self, key, _NOTHING, exc)
            if error is None:
                raise
            raise error from exc

    def put_all(self, items: Iterable[tuple[Any, Any]]) -> None:
        """Put each item in order. Not atomic: a bad item raises after the items before it were written."""
        self._store.put_all(self._encoded_items(items))

    def delete_all(self, keys: Iterable[Any]) -> None:
        self._store.delete_all(self._encoded_keys(keys))

    def get_many(self, keys: Sequence[Any] | Any) -> list[Any]:
        """The values of ``keys`` (``None`` where absent), in their order, in one call."""
        raw = self._store.get_many(self._keys(keys))
        try:
            return _decode_values(self.value_serde, raw)
        except Exception as exc:
            raise _decode_many_error(self._store.name, self.value_serde, keys, raw, exc) from exc

    def put_many(self, keys: Sequence[Any] | Any, values: Sequence[Any] | Any, *, ttl_ms: int | None = None) -> None:
        """``put(keys[i], values[i])`` for each ``i``, in one call; nothing is written when a key or value is bad."""
        ops = self._store if ttl_ms is None else _ttl_ops(self._store)
        encoded_keys = self._keys(keys)
        try:
            encoded_values = encode_many(self.value_serde, values)
        except Exception as exc:
            raise _encode_many_error(self._store.name, self.value_serde, "value", keys, values, exc) from exc
        if ttl_ms is None:
            ops.put_many(encoded_keys, encoded_values)
        else:
            assert isinstance(ops, TtlStore)
            ops.put_many(encoded_keys, encoded_values, ttl_ms)

    def delete_many(self, keys: Sequence[Any] | Any) -> None:
        self._store.delete_many(self._keys(keys))

    def update_many(self, keys: Sequence[Any] | Any, fn: Callable[[list[Any]], Sequence[Any]]) -> None:
        """Read ``keys``, write ``fn(values)`` (``None`` deletes), encoding the keys once; see the module docstring."""
        _update_many(self._store, self._keys(keys), fn, self.value_serde, keys)

    def iter_prefix(self, prefix: Any) -> Iterator[tuple[Any, Any]]:
        if not getattr(self.key_serde, "prefix_preserving", False):
            raise ConfigError(
                f"store {self._store.name!r}: iter_prefix needs a key serde that keeps prefixes (bytes, string), "
                f"this store's key serde is {self.key_serde.name!r}; use iter_range instead"
            )
        return self._decode(self._store.iter_prefix(self._key(prefix, "prefix")))

    def iter_range(self, start: Any | None, end: Any | None) -> Iterator[tuple[Any, Any]]:
        return self._decode(
            self._store.iter_range(
                None if start is None else self._key(start, "range start"),
                None if end is None else self._key(end, "range end"),
            )
        )

    def items(self) -> Iterator[tuple[Any, Any]]:
        return self._decode(self._store.items())

    def count(self) -> int:
        return self._store.count()

    def _key(self, key: Any, role: str = "key") -> bytes:
        try:
            return self.key_serde.to_bytes(key)
        except Exception as exc:
            raise _encode_error(self._store.name, self.key_serde, role, key, key, exc) from exc

    def _value(self, key: Any, value: Any) -> bytes:
        try:
            return self.value_serde.to_bytes(value)
        except Exception as exc:
            raise _encode_error(self._store.name, self.value_serde, "value", key, value, exc) from exc

    def _keys(self, keys: Sequence[Any] | Any) -> list[bytes]:
        try:
            return encode_many(self.key_serde, keys)
        except Exception as exc:
            raise _encode_many_error(self._store.name, self.key_serde, "key", keys, keys, exc) from exc

    # The generators below hold a ``try`` around their ``yield``: only the encoding or decoding can raise an
    # ``Exception`` there (closing a generator is a GeneratorExit, not caught).

    def _encoded_keys(self, keys: Iterable[Any]) -> Iterator[bytes]:
        to_key = self.key_serde.to_bytes
        for key in keys:
            try:
                yield to_key(key)
            except Exception as exc:
                raise _encode_error(self._store.name, self.key_serde, "key", key, key, exc) from exc

    def _encoded_items(self, items: Iterable[tuple[Any, Any]]) -> Iterator[tuple[bytes, bytes]]:
        to_key, to_value = self.key_serde.to_bytes, self.value_serde.to_bytes
        for key, value in items:
            try:
                yield to_key(key), to_value(value)
            except Exception as exc:
                error = _encode_failure(self, key, value, exc)
                if error is None:
                    raise
                raise error from exc

    def _decode(self, records: Iterator[tuple[bytes, bytes]]) -> Iterator[tuple[Any, Any]]:
        from_key, from_value = self.key_serde.from_bytes, self.value_serde.from_bytes
        for key, value in records:
            try:
                yield from_key(key), from_value(value)
            except Exception as exc:
                raise _record_decode_error(self, key, exc) from exc


def _ttl_ops(store: StoreOps) -> TtlStore:
    """``store`` as the TTL view a call with ``ttl_ms=`` needs; ``ConfigError`` when the store has no TTL."""
    if isinstance(store, TtlStore):
        return store
    raise ConfigError(
        f"store {store.name!r} has no TTL, so its values carry no expiry: ttl_ms= needs stores.{store.name}.ttl.ms "
        "set when the store is created (the default of the calls without ttl_ms)"
    )


def _missing(store: StoreOps, operation: str) -> Any:
    """``getattr`` of a value store's view for what it lacks: a list or map operation raises ``KindError``."""
    if operation.startswith("_"):  # an unset slot (during init), copy's and pickle's probes
        raise AttributeError(operation)
    from statebackend.store.kinds import wrong_kind

    raise wrong_kind(store.name, "value", operation)


# -- errors: only ever called once something failed --------------------------------------------------------------


#: a per-key call without a value
_NOTHING = object()


def _encode_failure(view: TypedStore, key: Any, value: Any, exc: Exception) -> SerdeError | None:
    """The :class:`SerdeError` of a per-key call that raised ``exc``: the key's encoding or else the value's (unless
    ``value`` is ``_NOTHING``) is done again to find out which failed; ``None`` when both encode, so ``exc`` is the
    store's own error. ``exc`` is what the message reports: the first failure, not the second run's."""
    name = view.name
    try:
        view.key_serde.to_bytes(key)
    except Exception:  # noqa: BLE001 - only finding out which part failed; exc is the error reported
        return _encode_error(name, view.key_serde, "key", key, key, exc)
    if value is _NOTHING:
        return None
    try:
        view.value_serde.to_bytes(value)
    except Exception:  # noqa: BLE001 - as above
        return _encode_error(name, view.value_serde, "value", key, value, exc)
    return None


def _record_decode_error(view: TypedStore, key: bytes, exc: Exception) -> CorruptDataError:
    """The error of an iteration's record that does not decode: its key's (decoded again to find out) or else its
    value's, named by its key."""
    try:
        decoded = view.key_serde.from_bytes(key)
    except Exception:  # noqa: BLE001 - only finding out which part failed; exc is the error reported
        return _decode_error(view.name, view.key_serde, short_repr(key), exc, "key")
    return _decode_error(view.name, view.value_serde, short_repr(decoded), exc)


def _serde_name(serde: Serde) -> str:
    return str(getattr(serde, "name", type(serde).__name__))


def _encode_error(store: str, serde: Serde, role: str, key: Any, obj: Any, exc: BaseException) -> SerdeError:
    """The :class:`SerdeError` of ``serde`` failing to encode ``obj`` (the ``role`` of ``key``: the key itself, its
    value, a prefix, a range bound) in ``store``: the serde's reason, or (a serde of another library's making) its
    exception's text."""
    name = _serde_name(serde)
    value_type = type_name(obj)
    reason = exc.reason if isinstance(exc, SerdeError) and exc.reason else f"{type(exc).__name__}: {exc}"
    key_text = short_repr(key)
    what = f"the value of key {key_text}" if role == "value" else f"the {role} {key_text}"
    return SerdeError(
        f"store {store!r}: the {name} serde cannot encode {what} ({described(value_type)}): {reason}",
        store=store,
        serde=name,
        key=key_text,
        value_type=value_type,
        role=role,
        reason=reason,
    )


def _encode_many_error(store: str, serde: Serde, role: str, keys: Any, objs: Any, exc: BaseException) -> SerdeError:
    """The error of a vectorized call's encoding: :func:`_encode_error` of its first item that does not encode (the
    whole-array calls raise what the per-item call does), or of the whole call when each item encodes alone."""
    key_list = as_list(keys)
    for index, obj in enumerate(as_list(objs)):
        try:
            serde.to_bytes(obj)
        except Exception as item_exc:  # noqa: BLE001 - the item's own error, as the per-item call raises it
            key = key_list[index] if index < len(key_list) else f"#{index}"
            return _encode_error(store, serde, role, key, obj, item_exc)
    return _encode_error(store, serde, role, "(one of the call's)", objs, exc)


def _decode_error(store: str, serde: Serde, key_text: str, exc: Exception, role: str = "value") -> CorruptDataError:
    """The ``CorruptDataError`` of stored bytes ``serde`` cannot decode: the serde's, with the store and the key in
    front. An error of our tree other than ``CorruptDataError`` (a record class that cannot read an old schema) is
    raised again as it is."""
    if isinstance(exc, StateBackendError) and not isinstance(exc, CorruptDataError):
        raise exc
    name = _serde_name(serde)
    what = f"the stored value of key {key_text}" if role == "value" else f"the stored key {key_text}"
    detail = str(exc).removeprefix(f"the {name} serde cannot decode the stored bytes: ")
    return CorruptDataError(
        f"store {store!r}: the {name} serde cannot decode {what}: {detail}. Was the store "
        "written with another serde? Its serdes must stay the ones its checkpoints record"
    )


def _decode_many_error(
    store: str, serde: Serde, keys: Any, raw: list[bytes | None], exc: Exception
) -> CorruptDataError:
    """:func:`_decode_error` of the first stored value of a ``get_many`` that does not decode."""
    for key, data in zip(as_list(keys), raw, strict=False):
        if data is not None:
            try:
                serde.from_bytes(data)
            except Exception as item_exc:  # noqa: BLE001 - the item's own error, as the per-item call raises it
                return _decode_error(store, serde, short_repr(key), item_exc)
    return _decode_error(store, serde, "(one of the call's)", exc)


def _decode_values(serde: Serde, raw: list[bytes | None]) -> list[Any]:
    """Decode the present values in one call; ``None`` stays ``None``."""
    present = [v for v in raw if v is not None]
    decoded = iter(decode_many(serde, present))
    if len(present) == len(raw):
        return list(decoded)
    return [None if v is None else next(decoded) for v in raw]


def _update_many(
    store: StoreOps,
    keys: list[bytes],
    fn: Callable[[list[Any]], Sequence[Any]],
    serde: Serde | None,
    key_objs: Any = None,
) -> None:
    """Read ``keys`` once, write ``fn``'s values (``None`` deletes) in order. ``fn`` sees the values as they were
    before the call, also for a key given twice. ``key_objs``: the keys as given to a typed view (errors name them)."""
    raw = store.get_many(keys)
    if serde is None:
        decoded: list[Any] = raw
    else:
        try:
            decoded = _decode_values(serde, raw)
        except Exception as exc:
            raise _decode_many_error(store.name, serde, key_objs, raw, exc) from exc
    new = list(fn(decoded))
    if len(new) != len(keys):
        raise ValueError(
            f"store {store.name!r}: update_many's function returned {len(new)} values for {len(keys)} keys"
        )
    if serde is None:
        store.write_many(keys, new)
        return
    present = [v for v in new if v is not None]
    try:
        encoded = encode_many(serde, present)
    except Exception as exc:
        given = [(k, v) for k, v in zip(as_list(key_objs), new, strict=True) if v is not None]
        raise _encode_many_error(store.name, serde, "value", [k for k, _ in given], [v for _, v in given], exc) from exc
    if len(present) == len(keys):
        store.put_many(keys, encoded)
        return
    values = iter(encoded)
    store.write_many(keys, [None if v is None else next(values) for v in new])
