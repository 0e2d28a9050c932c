"""Option specs and value parsers: how one configuration key is parsed, validated and documented.

Every parser takes ``(key, raw)`` and returns the typed value, or raises :class:`ConfigError` naming the key, the
bad value and what is allowed. Raw values may be strings (a properties file, a Spark conf) or typed Python values;
a bool is never accepted where a number is expected.

This module sits below every part (it imports only the errors): config declares the keys it owns with it, each blob
store declares its ``blob.store.*`` options with it, each state backend its own."""

from __future__ import annotations

import difflib
import math
import os
import re
from collections.abc import Callable, Iterator, Mapping, Sequence
from decimal import Decimal, InvalidOperation
from pathlib import Path
from typing import Any, TypeVar, final, overload

import attrs

from statebackend.errors import ConfigError

T = TypeVar("T")

#: (key, raw value) -> parsed value; raises ConfigError naming the key. ``Parser[int]`` parses to an int.
Parser = Callable[[str, Any], T]


@attrs.frozen
class OptionSpec:
    """One configuration key: how to parse it, its default and a one-line meaning.

    ``default`` goes through ``parse`` too, so it may be written raw (``"8MiB"``) or typed (``8388608``); ``None``
    means "unset" (the key is then absent from option mappings). ``secret`` keeps the value out of reprs.
    """

    #: ``parse(key, raw)``: the typed value, or a :class:`~statebackend.errors.ConfigError` naming the key and
    #: what is allowed (:func:`value_error`)
    parse: Parser[Any]
    #: the value when the key is not set, raw or typed (``None``: no default, the key is absent)
    default: Any = None
    #: the key's one-line meaning, for people reading the schema
    doc: str = ""
    #: a secret (a credential): its value is kept out of reprs
    secret: bool = False

    def default_value(self, key: str) -> Any:
        """The parsed default (``None`` when the key has no default)."""
        return None if self.default is None else self.parse(key, self.default)


@final
class ParsedOptions(Mapping[str, Any]):
    """Options parsed by :func:`parse_options`: typed values, defaults filled, read-only and picklable (they travel to
    Spark executors inside the settings).

    ``schema_name`` names the schema they were parsed against, ``declared`` holds its keys: parsing them again against
    that schema returns them unchanged, and a consumer of part of a schema checks ``declared`` to know the values
    are its own, parsed. The repr hides the values of secret options."""

    __slots__ = ("_values", "declared", "schema_name", "secret")

    def __init__(
        self,
        values: Mapping[str, Any],
        *,
        schema_name: str,
        declared: frozenset[str],
        secret: frozenset[str] = frozenset(),
    ) -> None:
        self._values = dict(values)
        #: the name of the schema they were parsed against (where it is declared)
        self.schema_name = schema_name
        #: every key that schema declares, set or not
        self.declared = declared
        #: the keys whose values are secrets
        self.secret = secret

    def __getitem__(self, key: str) -> Any:
        return self._values[key]

    def __iter__(self) -> Iterator[str]:
        return iter(self._values)

    def __len__(self) -> int:
        return len(self._values)

    def __repr__(self) -> str:
        shown = {key: "<redacted>" if key in self.secret else value for key, value in self._values.items()}
        return f"ParsedOptions({shown!r}, schema_name={self.schema_name!r})"

    def __reduce__(self) -> tuple[Any, ...]:
        return (_rebuild_parsed_options, (self._values, self.schema_name, self.declared, self.secret))


# -- parsers ----------------------------------------------------------------------------------------------------


def parse_int(min: int | None = None, max: int | None = None) -> Parser[int]:  # shadows min/max: the names read best
    """An integer from an int or a decimal string, within ``[min, max]``."""
    allowed = _range_text("an integer", min, max)

    def parse(key: str, raw: Any) -> int:
        value = _to_int(key, raw, allowed)
        _check_range(key, raw, value, min, max, allowed)
        return value

    return parse


def parse_float(min: float | None = None, max: float | None = None) -> Parser[float]:  # shadows min/max, as parse_int
    """A finite number from an int, a float or a decimal string, within ``[min, max]``."""
    allowed = _range_text("a number", min, max)

    def parse(key: str, raw: Any) -> float:
        if isinstance(raw, bool):
            raise value_error(key, raw, "not a number", allowed)
        try:
            value = float(raw.strip() if isinstance(raw, str) else raw)
        except (TypeError, ValueError):
            raise value_error(key, raw, "not a number", allowed) from None
        if not math.isfinite(value):
            raise value_error(key, raw, "not a finite number", allowed)
        _check_range(key, raw, value, min, max, allowed)
        return value

    return parse


def parse_bool() -> Parser[bool]:
    """A bool from a bool or one of true/false, yes/no, on/off, 1/0 (any case)."""
    allowed = "true or false (also yes/no, on/off, 1/0)"

    def parse(key: str, raw: Any) -> bool:
        if isinstance(raw, bool):
            return raw
        if isinstance(raw, str):
            word = raw.strip().lower()
            if word in _TRUE:
                return True
            if word in _FALSE:
                return False
        raise value_error(key, raw, "not a boolean", allowed)

    return parse


def parse_bytes(min: int | None = 0, max: int | None = None) -> Parser[int]:
    """A byte count from an int or a string: ``"100"``, ``"512KiB"``, ``"64MiB"``, ``"1.5GiB"``, ``"1TiB"`` (binary
    units), ``"10MB"`` (decimal units), case-insensitive, optional space before the unit."""
    allowed = _range_text("a byte count such as 100, 512KiB, 64MiB, 1GiB", min, max)
    return _scaled_parser("byte count", _BYTE_UNITS, allowed, min, max)


def parse_duration_ms(min: int | None = 0, max: int | None = None) -> Parser[int]:
    """A duration in milliseconds from an int (milliseconds) or a string: ``"1500"``, ``"250ms"``, ``"30s"``,
    ``"5m"``/``"5min"``, ``"1h"``."""
    allowed = _range_text("milliseconds, such as 30000, 250ms, 30s, 5min, 1h", min, max)
    return _scaled_parser("duration", _DURATION_UNITS, allowed, min, max)


def _scaled_parser(what: str, units: Mapping[str, int], allowed: str, low: int | None, high: int | None) -> Parser[int]:
    """An int, or a string of a number and one of ``units`` (bytes, durations), within [low, high]."""

    def parse(key: str, raw: Any) -> int:
        if isinstance(raw, bool):
            raise value_error(key, raw, f"a boolean is not a {what}", allowed)
        if isinstance(raw, int):
            value = raw
        elif isinstance(raw, str):
            value = _scaled(key, raw, units, allowed)
        else:
            raise value_error(key, raw, f"a {type(raw).__name__} is not a {what}", allowed)
        _check_range(key, raw, value, low, high, allowed)
        return value

    return parse


def parse_choice(*allowed_values: str) -> Parser[str]:
    """One of ``allowed_values`` (exact, after trimming)."""
    if not allowed_values:
        raise ValueError("parse_choice needs at least one allowed value")
    allowed = "one of " + ", ".join(allowed_values)

    def parse(key: str, raw: Any) -> str:
        if isinstance(raw, str) and raw.strip() in allowed_values:
            return raw.strip()
        near = difflib.get_close_matches(str(raw).strip(), allowed_values, n=1) if isinstance(raw, str) else []
        problem = f"not an allowed value (did you mean {near[0]}?)" if near else "not an allowed value"
        raise value_error(key, raw, problem, allowed)

    return parse


@overload
def parse_list() -> Parser[tuple[str, ...]]: ...


@overload
def parse_list(item_parser: Parser[T]) -> Parser[tuple[T, ...]]: ...


def parse_list(item_parser: Parser[Any] | None = None) -> Parser[tuple[Any, ...]]:
    """A non-empty tuple from a comma-separated string (items trimmed, none empty) or a list/tuple; each item goes
    through ``item_parser`` (default: a non-empty string)."""
    parse_item = item_parser or parse_str()

    def parse(key: str, raw: Any) -> tuple[Any, ...]:
        allowed = "a comma-separated list of non-empty items"
        if isinstance(raw, str):
            items: Sequence[Any] = [item.strip() for item in raw.split(",")]
            if raw.strip() == "":
                raise value_error(key, raw, "the list is empty", allowed)
            for position, item in enumerate(items, start=1):
                if item == "":
                    raise value_error(key, raw, f"item {position} is empty", allowed)
        elif isinstance(raw, (list, tuple)):
            items = raw
            if not items:
                raise value_error(key, raw, "the list is empty", allowed)
        else:
            raise value_error(key, raw, f"a {type(raw).__name__} is not a list", allowed)
        return tuple(parse_item(key, item) for item in items)

    return parse


def parse_str(pattern: str | None = None) -> Parser[str]:
    """A non-empty string (trimmed; an int is taken as its decimal string), matching ``pattern`` in full if given."""
    compiled = re.compile(pattern) if pattern is not None else None
    allowed = f"a string matching {pattern}" if pattern is not None else "a non-empty string"

    def parse(key: str, raw: Any) -> str:
        if isinstance(raw, bool) or not isinstance(raw, (str, int)):
            raise value_error(key, raw, f"a {type(raw).__name__} is not a string", allowed)
        value = str(raw).strip()
        if value == "":
            raise value_error(key, raw, "the value is empty", allowed)
        if compiled is not None and not compiled.fullmatch(value):
            raise value_error(key, raw, "it does not match the allowed pattern", allowed)
        return value

    return parse


def parse_path() -> Parser[Path]:
    """A filesystem path from a non-empty string or path-like; ``~`` is expanded, nothing is touched on disk."""

    def parse(key: str, raw: Any) -> Path:
        if isinstance(raw, os.PathLike):
            raw = os.fspath(raw)
        if not isinstance(raw, str) or raw.strip() == "":
            raise value_error(key, raw, "not a path", "a non-empty directory path")
        return Path(raw.strip()).expanduser()

    return parse


def parse_object() -> Parser[Any]:
    """Any value, passed through (a non-empty string is trimmed): for SDK objects such as an Azure credential."""

    def parse(key: str, raw: Any) -> Any:
        if isinstance(raw, str):
            if raw.strip() == "":
                raise value_error(key, "<empty>", "the value is empty", "a non-empty string or a credential object")
            return raw.strip()
        return raw

    return parse


def parse_one(key: str, spec: OptionSpec, raw: Any) -> tuple[Any, str | None]:
    """(value, None) or (default, problem); a secret's value never enters the problem text."""
    try:
        return (spec.default_value(key) if raw is None else spec.parse(key, raw)), None
    except ConfigError as exc:
        problem = str(exc)
        if spec.secret and " is not valid:" in problem:
            problem = f"{key}=<redacted> is not valid:" + problem.split(" is not valid:", 1)[1]
        return spec.default_value(key), problem


def parse_options(
    schema: Mapping[str, OptionSpec],
    options: Mapping[str, Any],
    *,
    name: str,
    prefix: str = "",
    strict: bool = True,
) -> ParsedOptions:
    """Parse ``options`` (keys without ``prefix``) against ``schema``, the schema called ``name``: defaults filled, a
    key unset and without a default left out. Every problem (a bad value; with ``strict``, a key the schema does not
    declare, with a "did you mean") is collected into one :class:`ConfigError`.

    Options already parsed against the schema of that ``name`` are returned as they are: each value is parsed once,
    by whoever parses first (config, or an entry point given raw options), and everyone after uses it."""
    if isinstance(options, ParsedOptions) and options.schema_name == name:
        return options
    problems: list[str] = []
    if strict:
        for key in sorted(k for k in options if k not in schema):
            near = difflib.get_close_matches(str(key), list(schema), n=1, cutoff=0.8)
            known = ", ".join(prefix + k for k in schema) or "none"
            hint = f"did you mean {prefix}{near[0]}?" if near else f"known keys: {known}"
            problems.append(f"{prefix}{key}: unknown key; {hint}")
    parsed: dict[str, Any] = {}
    for key, spec in schema.items():
        value, problem = parse_one(prefix + key, spec, options.get(key))
        if problem is not None:
            problems.append(problem)
        elif value is not None:
            parsed[key] = value
    if problems:
        raise ConfigError("\n".join(problems))
    return ParsedOptions(
        parsed, schema_name=name, declared=frozenset(schema), secret=frozenset(k for k, s in schema.items() if s.secret)
    )


def default_of(schema: Mapping[str, OptionSpec], key: str, *, prefix: str = "") -> Any:
    """The parsed default of ``key`` in ``schema`` (``None`` when it has none): for a value that must also exist
    outside the schema, such as an attribute's default, so the default is still written in one place."""
    return schema[key].default_value(prefix + key)


# -- helpers ----------------------------------------------------------------------------------------------------


def _rebuild_parsed_options(
    values: Mapping[str, Any], schema_name: str, declared: frozenset[str], secret: frozenset[str]
) -> ParsedOptions:
    return ParsedOptions(values, schema_name=schema_name, declared=declared, secret=secret)


_TRUE = frozenset({"true", "yes", "on", "1"})
_FALSE = frozenset({"false", "no", "off", "0"})

_BYTE_UNITS = {
    "": 1,
    "b": 1,
    "kib": 1 << 10,
    "mib": 1 << 20,
    "gib": 1 << 30,
    "tib": 1 << 40,
    "kb": 10**3,
    "mb": 10**6,
    "gb": 10**9,
    "tb": 10**12,
}
_DURATION_UNITS = {"": 1, "ms": 1, "s": 1000, "m": 60_000, "min": 60_000, "h": 3_600_000}
_SCALED_RE = re.compile(r"([+-]?[0-9]+(?:\.[0-9]+)?)\s*([A-Za-z]*)")


def value_error(key: str, raw: Any, problem: str, allowed: str) -> ConfigError:
    """The error a parser raises for a bad value: ``<key>=<value> is not valid: <problem>; allowed: <allowed>``
    (the value's repr cut to 80 characters)."""
    shown = repr(raw)
    if len(shown) > 80:
        shown = shown[:77] + "..."
    return ConfigError(f"{key}={shown} is not valid: {problem}; allowed: {allowed}")


def _range_text(what: str, low: float | None, high: float | None) -> str:
    if low is not None and high is not None:
        return f"{what} (from {low} to {high})"
    if low is not None:
        return f"{what} (at least {low})"
    if high is not None:
        return f"{what} (at most {high})"
    return what


def _to_int(key: str, raw: Any, allowed: str) -> int:
    if isinstance(raw, bool):
        raise value_error(key, raw, "a boolean is not an integer", allowed)
    if isinstance(raw, int):
        return raw
    if isinstance(raw, str) and re.fullmatch(r"[+-]?[0-9]+", raw.strip()):
        return int(raw.strip())
    raise value_error(key, raw, "not an integer", allowed)


def _check_range(key: str, raw: Any, value: float, low: float | None, high: float | None, allowed: str) -> None:
    if (low is not None and value < low) or (high is not None and value > high):
        raise value_error(key, raw, "out of range", allowed)


def _scaled(key: str, raw: str, units: Mapping[str, int], allowed: str) -> int:
    match = _SCALED_RE.fullmatch(raw.strip())
    unit = match.group(2).lower() if match else ""
    if match is None or unit not in units:
        problem = f"unknown unit {match.group(2)!r}" if match else "not a number with an optional unit"
        raise value_error(key, raw, problem, allowed)
    try:
        number = Decimal(match.group(1))
    except InvalidOperation as exc:  # the regex admits only decimals, so this is a guard
        raise value_error(key, raw, "not a number", allowed) from exc
    return int(number * units[unit])
