"""The named serdes (``bytes``, ``string``, ``integer``, ``json``, ``pickle``) and the whole-array calls; the package
docstring (:mod:`statebackend.serdes`) is their contract.
"""

from __future__ import annotations

import json
import pickle
import struct
from collections.abc import Sequence
from typing import Any, ClassVar, Protocol, runtime_checkable

import attrs

from statebackend.errors import ConfigError, CorruptDataError, SerdeError

__all__ = [
    "SERDE_NAMES",
    "BytesSerde",
    "IntegerSerde",
    "JsonSerde",
    "PickleSerde",
    "Serde",
    "StringSerde",
    "as_list",
    "cannot_encode",
    "decode_many",
    "described",
    "encode_many",
    "json_reason",
    "named_serde",
    "short_repr",
    "type_name",
]


@runtime_checkable
class Serde(Protocol):
    """Turns objects into bytes and back. ``from_bytes(to_bytes(x)) == x``."""

    @property
    def name(self) -> str:  # read-only: the serdes here declare it as a ClassVar of a frozen class
        ...

    def to_bytes(self, obj: Any) -> bytes: ...

    def from_bytes(self, data: bytes) -> Any: ...


@attrs.frozen
class BytesSerde:
    """Identity: the store's own bytes."""

    name: ClassVar[str] = "bytes"
    prefix_preserving: ClassVar[bool] = True

    def to_bytes(self, obj: Any) -> bytes:
        if not isinstance(obj, bytes):
            raise cannot_encode(
                self.name,
                obj,
                "it takes bytes only: convert the value to bytes first (a str: "
                ".encode()), or use the string, integer, json or pickle serde for this type",
            )
        return obj

    def from_bytes(self, data: bytes) -> bytes:
        return bytes(data)

    def to_bytes_many(self, objs: Any) -> list[bytes]:
        if _is_arrow(objs) and _arrow_type(objs) in ("binary", "large_binary") and not objs.null_count:
            return list(objs.to_pylist())
        items = _as_list(objs)
        if not set(map(type, items)) <= {bytes}:
            return [self.to_bytes(obj) for obj in items]  # raises for the first bad item
        return items

    def from_bytes_many(self, datas: Sequence[bytes]) -> list[bytes]:
        return [bytes(d) for d in datas]


@attrs.frozen
class StringSerde:
    """UTF-8 text."""

    name: ClassVar[str] = "string"
    prefix_preserving: ClassVar[bool] = True

    def to_bytes(self, obj: Any) -> bytes:
        if not isinstance(obj, str):
            raise cannot_encode(
                self.name,
                obj,
                "it takes str only: convert the value to str first, or use the "
                "integer, json or pickle serde for this type",
            )
        # surrogatepass would let lone surrogates in; strict keeps the stored bytes valid UTF-8 for every reader.
        try:
            return obj.encode("utf-8")
        except UnicodeEncodeError as exc:
            raise cannot_encode(self.name, obj, _surrogate_reason(obj, exc)) from exc

    def from_bytes(self, data: bytes) -> str:
        try:
            return bytes(data).decode("utf-8")
        except UnicodeDecodeError as exc:
            raise CorruptDataError(f"the string serde cannot decode the stored bytes: not valid UTF-8 ({exc})") from exc

    def to_bytes_many(self, objs: Any) -> list[bytes]:
        if _is_arrow(objs) and _arrow_type(objs) in ("string", "large_string") and not objs.null_count:
            return list(objs.cast("binary").to_pylist())  # Arrow strings are valid UTF-8 already: no re-encoding
        items = _as_list(objs)
        if set(map(type, items)) <= {str}:
            try:
                return [obj.encode("utf-8") for obj in items]
            except UnicodeEncodeError:
                pass  # the per-item call below raises the SerdeError naming the bad string
        return [self.to_bytes(obj) for obj in items]

    def from_bytes_many(self, datas: Sequence[bytes]) -> list[str]:
        try:
            return [d.decode("utf-8") for d in datas]
        except (UnicodeDecodeError, AttributeError):
            return [self.from_bytes(d) for d in datas]


_INT64 = struct.Struct(">Q")
_SIGN_BIT = 1 << 63
_INTEGER_TYPE = (
    "it takes int only (signed 64-bit): convert it with int(...), or use the string, json or pickle serde for this type"
)
_INTEGER_BOOL = (
    "it takes int only, not bool (True and 1 would be the same key): convert it with int(...), or use the json serde"
)


@attrs.frozen
class IntegerSerde:
    """Signed 64-bit integers, 8 bytes big-endian with the sign bit flipped: byte order == numeric order."""

    name: ClassVar[str] = "integer"
    prefix_preserving: ClassVar[bool] = False

    def to_bytes(self, obj: Any) -> bytes:
        # bool is an int subclass; accepting it would make True and 1 the same key silently.
        if not isinstance(obj, int) or isinstance(obj, bool):
            raise cannot_encode(self.name, obj, _INTEGER_BOOL if isinstance(obj, bool) else _INTEGER_TYPE)
        if not -_SIGN_BIT <= obj < _SIGN_BIT:
            raise cannot_encode(
                self.name,
                obj,
                f"{short_repr(obj)} is outside the signed 64-bit range "
                "[-2**63, 2**63); use the json or string serde for larger numbers",
            )
        return _INT64.pack(obj + _SIGN_BIT)

    def from_bytes(self, data: bytes) -> int:
        if len(data) != 8:
            raise CorruptDataError(
                f"the integer serde cannot decode the stored bytes: expected 8 bytes, got {len(data)}"
            )
        return int(_INT64.unpack(data)[0]) - _SIGN_BIT

    def to_bytes_many(self, objs: Any) -> list[bytes]:
        items = _as_list(objs)
        if not items:
            return []
        if not (set(map(type, items)) <= {int} and min(items) >= -_SIGN_BIT and max(items) < _SIGN_BIT):
            return [self.to_bytes(obj) for obj in items]  # raises for the first bad item
        packed = struct.pack(f">{len(items)}Q", *[obj + _SIGN_BIT for obj in items])
        return [packed[i : i + 8] for i in range(0, len(packed), 8)]

    def from_bytes_many(self, datas: Sequence[bytes]) -> list[int]:
        datas = list(datas)
        if not datas:
            return []
        joined = b"".join(datas)
        if len(joined) != 8 * len(datas) or min(map(len, datas)) != 8:
            return [self.from_bytes(d) for d in datas]  # raises for the first bad item
        return [v - _SIGN_BIT for v in struct.unpack(f">{len(datas)}Q", joined)]


@attrs.frozen
class JsonSerde:
    """JSON, compact with sorted keys so equal values give equal bytes."""

    name: ClassVar[str] = "json"
    prefix_preserving: ClassVar[bool] = False

    def to_bytes(self, obj: Any) -> bytes:
        try:
            text = json.dumps(obj, sort_keys=True, separators=(",", ":"), ensure_ascii=False, allow_nan=False)
            return text.encode("utf-8")
        # a type JSON has no form for (Decimal, set, datetime, bytes), NaN/Infinity, a circular reference, a lone
        # surrogate, nesting too deep
        except (TypeError, ValueError, RecursionError) as exc:
            raise cannot_encode(self.name, obj, json_reason(obj, exc)) from exc

    def from_bytes(self, data: bytes) -> Any:
        try:
            return json.loads(bytes(data).decode("utf-8"))
        except (UnicodeDecodeError, json.JSONDecodeError) as exc:
            raise CorruptDataError(f"the json serde cannot decode the stored bytes: not valid JSON ({exc})") from exc


@attrs.frozen
class PickleSerde:
    """Pickle (protocol 5). Opt-in only: unpickling runs code; use for state only this job writes."""

    name: ClassVar[str] = "pickle"
    prefix_preserving: ClassVar[bool] = False

    def to_bytes(self, obj: Any) -> bytes:
        try:
            return pickle.dumps(obj, protocol=5)
        except Exception as exc:  # pickling runs the object's own __reduce__ / __getstate__: any error
            raise cannot_encode(
                self.name,
                obj,
                f"{type(exc).__name__}: {exc}. Pickle cannot hold lambdas, local "
                "classes, open files, locks, sockets or generators: store their data instead (a "
                "dict, or a record class), or make the object picklable",
            ) from exc

    def from_bytes(self, data: bytes) -> Any:
        try:
            return pickle.loads(data)
        except Exception as exc:  # pickle raises many types for bad input; all mean the same to the caller
            raise CorruptDataError(
                f"the pickle serde cannot decode the stored bytes: they do not unpickle ({exc!r})"
            ) from exc


_SERDES: dict[str, Serde] = {
    s.name: s for s in (BytesSerde(), StringSerde(), IntegerSerde(), JsonSerde(), PickleSerde())
}

#: the serde names, the one list: ``stores.<name>.key.serde`` / ``msg.serde`` take exactly these
#: (statebackend.config.SERDES is this tuple)
SERDE_NAMES: tuple[str, ...] = tuple(_SERDES)


#: how much of a key's or value's repr an error shows
REPR_LIMIT = 80


def type_name(obj: Any) -> str:
    """The qualified name of ``obj``'s type, without ``builtins.``: ``str``, ``decimal.Decimal``."""
    cls = type(obj)
    module = getattr(cls, "__module__", None)
    name = getattr(cls, "__qualname__", cls.__name__)
    return name if module in (None, "builtins") else f"{module}.{name}"


def described(name: str) -> str:
    """A type name with its article: ``a decimal.Decimal``, ``an int``; ``None`` for ``NoneType``."""
    if name == "NoneType":
        return "None"
    return f"{'an' if name[:1].lower() in 'aeiou' else 'a'} {name}"


def short_repr(obj: Any, limit: int = REPR_LIMIT) -> str:
    """``repr(obj)`` cut to ``limit`` characters (``...`` marks the cut); never raises."""
    try:
        text = repr(obj)
    except Exception:  # noqa: BLE001 - a user type's broken __repr__ must not hide the error being reported
        text = f"<{type_name(obj)} object>"
    return text if len(text) <= limit else text[: limit - 3] + "..."


def cannot_encode(serde: str, obj: Any, reason: str) -> SerdeError:
    """The error of a serde that cannot encode ``obj``: it names the serde and ``obj``'s type, and gives ``reason``
    (what is wrong and how to fix it). A typed store view adds the store and the key (``SerdeError`` fields)."""
    value_type = type_name(obj)
    return SerdeError(
        f"the {serde} serde cannot encode {described(value_type)}: {reason}",
        serde=serde,
        value_type=value_type,
        reason=reason,
    )


#: what to turn a type JSON cannot hold into (by its qualified name)
_JSON_FIXES = {
    "decimal.Decimal": "convert it to str (exact) or float",
    "set": "convert it to a list (sorted(...) keeps the bytes deterministic)",
    "frozenset": "convert it to a list (sorted(...) keeps the bytes deterministic)",
    "bytes": "convert it to str (.decode(), or base64)",
    "bytearray": "convert it to str (.decode(), or base64)",
    "datetime.datetime": "convert it to a str (.isoformat()) or a number (a timestamp)",
    "datetime.date": "convert it to a str (.isoformat())",
    "datetime.time": "convert it to a str (.isoformat())",
    "datetime.timedelta": "convert it to a number (.total_seconds())",
    "uuid.UUID": "convert it to a str",
    "complex": "store its real and imaginary parts",
}
_JSON_TYPES = (str, int, float, bool, type(None))


def json_reason(obj: Any, exc: BaseException) -> str:
    """What :class:`JsonSerde` says when ``json`` refused ``obj`` with ``exc``: which part JSON cannot hold and what
    to convert it to, or to use the pickle or record serde. Only called on the error path (it walks ``obj``)."""
    if isinstance(exc, RecursionError):
        return "it is nested too deeply for JSON; flatten it, or use the pickle serde"
    if isinstance(exc, UnicodeEncodeError) and isinstance(exc.object, str):
        return _surrogate_reason(exc.object, exc)
    text = str(exc)
    if "Circular reference" in text:
        return "it contains itself (a circular reference), which JSON cannot hold; use the pickle serde"
    if "Out of range float" in text:
        return "NaN and infinities are not JSON; store None or a string instead, or use the pickle serde"
    found = _json_culprit(obj)
    if found is None:
        if "not supported between instances" in text:  # sort_keys over keys of mixed types
            return (
                f"{text}: its object keys are of mixed types, which cannot be sorted (sorted keys make equal "
                "values equal bytes); make them all str, or use the pickle serde"
            )
        return f"{text}; use the pickle or record serde"
    where, culprit, is_key = found
    name = type_name(culprit)
    owner = "it" if where == "" else f"its item {where}"
    if is_key:
        of = "" if where == "" else f" of {owner}"
        return (
            f"{text}: the key {short_repr(culprit, 40)}{of} is {described(name)}, and JSON object keys are str, "
            "int, float, bool or None; convert the keys to str, or use the pickle serde"
        )
    fix = _JSON_FIXES.get(name, "convert it to str, int, float, bool, None, a list or a dict")
    return (
        f"{text}: {owner} is {described(name)}, which JSON has no type for; {fix} first, or use the pickle or record "
        "serde"
    )


def _json_culprit(obj: Any) -> tuple[str, Any, bool] | None:
    """The first thing in ``obj`` JSON cannot hold: where it is (``"['a'][0]"``; ``""`` for ``obj`` itself), it, and
    whether it is an object key; ``None`` when there is none."""
    seen: set[int] = set()
    stack: list[tuple[str, Any]] = [("", obj)]
    while stack:
        where, item = stack.pop()
        if isinstance(item, _JSON_TYPES):
            continue
        if isinstance(item, (list, tuple)):
            if id(item) not in seen:
                seen.add(id(item))
                stack.extend((f"{where}[{i}]", v) for i, v in reversed(list(enumerate(item))))
            continue
        if isinstance(item, dict):
            if id(item) not in seen:
                seen.add(id(item))
                for key in item:
                    if not isinstance(key, _JSON_TYPES):
                        return where, key, True
                stack.extend((f"{where}[{short_repr(k, 40)}]", v) for k, v in reversed(list(item.items())))
            continue
        return where, item, False
    return None


def _surrogate_reason(text: str, exc: UnicodeEncodeError) -> str:
    return (
        f"{text[max(0, exc.start - 10) : exc.end + 10]!r} has a lone surrogate at position {exc.start} "
        f"({text[exc.start]!r}); strings must be valid Unicode to be stored as UTF-8. Decode the input with "
        "errors='replace', or use the bytes serde for raw data"
    )


def _is_arrow(objs: Any) -> bool:
    return hasattr(objs, "to_pylist") and hasattr(objs, "null_count")


def _arrow_type(objs: Any) -> str:
    return str(getattr(objs, "type", ""))


def _as_list(objs: Any) -> list[Any]:
    """A list of the items of a sequence, an iterable or an Arrow array (a null becomes ``None``)."""
    if isinstance(objs, list):
        return objs
    if hasattr(objs, "to_pylist"):
        return list(objs.to_pylist())
    if hasattr(objs, "tolist"):  # numpy arrays, pandas Series: their items as Python objects
        return list(objs.tolist())
    return list(objs)


def encode_many(serde: Serde, objs: Any) -> list[bytes]:
    """``[serde.to_bytes(o) for o in objs]`` in one call (see the module docstring)."""
    many = getattr(serde, "to_bytes_many", None)
    if many is not None:
        return list(many(objs))
    return [serde.to_bytes(obj) for obj in _as_list(objs)]


def decode_many(serde: Serde, datas: Sequence[bytes]) -> list[Any]:
    """``[serde.from_bytes(d) for d in datas]`` in one call (see the module docstring)."""
    many = getattr(serde, "from_bytes_many", None)
    if many is not None:
        return list(many(datas))
    return [serde.from_bytes(data) for data in datas]


def as_list(objs: Any) -> list[Any]:
    """The items of a sequence, an iterable or an Arrow array as a list, as ``encode_many`` sees them."""
    return _as_list(objs)


def named_serde(name: str) -> Serde:
    """The serde called ``name`` (one of ``SERDE_NAMES``); ``ConfigError`` listing the allowed names otherwise."""
    try:
        return _SERDES[name]
    except (KeyError, TypeError):
        raise ConfigError(
            f"unknown serde {name!r}; allowed: {', '.join(SERDE_NAMES)}, or record:<module>:<Class> for values "
            "(pickle only when named explicitly)"
        ) from None
