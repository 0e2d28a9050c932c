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
    "decode_many",
    "encode_many",
    "named_serde",
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
            raise TypeError(f"bytes serde takes bytes, got {type(obj).__name__}")
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
            raise TypeError(f"string serde takes str, got {type(obj).__name__}")
        # surrogatepass would let lone surrogates in; strict keeps the stored bytes valid UTF-8 for every reader.
        try:
            return obj.encode("utf-8")
        except UnicodeEncodeError as exc:
            raise SerdeError(
                f"string serde: {obj[max(0, exc.start - 10):exc.end + 10]!r} has a lone surrogate at position "
                f"{exc.start} ({obj[exc.start]!r}); strings must be valid Unicode to be stored as UTF-8. Decode the "
                f"input with errors='replace', or use the bytes serde for raw data"
            ) from None

    def from_bytes(self, data: bytes) -> str:
        try:
            return bytes(data).decode("utf-8")
        except UnicodeDecodeError as exc:
            raise CorruptDataError(f"string serde: stored bytes are not valid UTF-8 ({exc})") from exc

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


@attrs.frozen
class IntegerSerde:
    """Signed 64-bit integers, 8 bytes big-endian with the sign bit flipped: byte order == numeric order."""

    name: ClassVar[str] = "integer"
    prefix_preserving: ClassVar[bool] = False

    def to_bytes(self, obj: Any) -> bytes:
        # bool is an int subclass; accepting it would make True and 1 the same key silently.
        if not isinstance(obj, int) or isinstance(obj, bool):
            raise TypeError(f"integer serde takes int, got {type(obj).__name__}")
        if not -_SIGN_BIT <= obj < _SIGN_BIT:
            raise SerdeError(
                f"integer serde: {obj} is outside the signed 64-bit range [-2**63, 2**63); "
                "use the json or string serde for larger numbers"
            )
        return _INT64.pack(obj + _SIGN_BIT)

    def from_bytes(self, data: bytes) -> int:
        if len(data) != 8:
            raise CorruptDataError(f"integer serde: expected 8 bytes, got {len(data)}")
        return int(_INT64.unpack(data)[0]) - _SIGN_BIT

    def to_bytes_many(self, objs: Any) -> list[bytes]:
        items = _as_list(objs)
        if not items:
            return []
        if not (set(map(type, items)) <= {int} and -_SIGN_BIT <= min(items) and max(items) < _SIGN_BIT):
            return [self.to_bytes(obj) for obj in items]  # raises for the first bad item
        packed = struct.pack(f">{len(items)}Q", *[obj + _SIGN_BIT for obj in items])
        return [packed[i:i + 8] for i in range(0, len(packed), 8)]

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
        except (ValueError, UnicodeEncodeError) as exc:  # NaN/Infinity, a circular reference, a lone surrogate
            raise SerdeError(f"json serde: cannot encode a {type(obj).__name__} as JSON ({exc})") from None

    def from_bytes(self, data: bytes) -> Any:
        try:
            return json.loads(bytes(data).decode("utf-8"))
        except (UnicodeDecodeError, json.JSONDecodeError) as exc:
            raise CorruptDataError(f"json serde: stored bytes are not valid JSON ({exc})") from exc


@attrs.frozen
class PickleSerde:
    """Pickle (protocol 5). Opt-in only: unpickling runs code; use for state only this job writes."""

    name: ClassVar[str] = "pickle"
    prefix_preserving: ClassVar[bool] = False

    def to_bytes(self, obj: Any) -> bytes:
        try:
            return pickle.dumps(obj, protocol=5)
        except (pickle.PicklingError, TypeError, AttributeError) as exc:
            raise SerdeError(f"pickle serde: cannot pickle a {type(obj).__name__} ({exc})") from None

    def from_bytes(self, data: bytes) -> Any:
        try:
            return pickle.loads(data)
        except Exception as exc:  # pickle raises many types for bad input; all mean the same to the caller
            raise CorruptDataError(f"pickle serde: stored bytes do not unpickle ({exc!r})") from exc


_SERDES: dict[str, Serde] = {
    s.name: s for s in (BytesSerde(), StringSerde(), IntegerSerde(), JsonSerde(), PickleSerde())
}

#: the serde names, the one list: ``stores.<name>.key.serde`` / ``msg.serde`` take exactly these
#: (statebackend.config.SERDES is this tuple)
SERDE_NAMES: tuple[str, ...] = tuple(_SERDES)


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


def named_serde(name: str) -> Serde:
    """The serde called ``name`` (one of ``SERDE_NAMES``); ``ConfigError`` listing the allowed names otherwise."""
    try:
        return _SERDES[name]
    except (KeyError, TypeError):
        raise ConfigError(
            f"unknown serde {name!r}; allowed: {', '.join(SERDE_NAMES)}, or record:<module>:<Class> for values "
            "(pickle only when named explicitly)"
        ) from None
