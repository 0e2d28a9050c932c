"""Configuration (DESIGN section 11): flat Samza-style keys parsed once into typed, validated :class:`Settings`.

Contract:

- Every key statebackend owns is declared once here as an :class:`OptionSpec` (parser, default, one-line doc); a
  backend declares its own keys in ``StateBackendFactory.options`` and they are read under
  ``<canonical-factory-name>.<option>`` (only for factories some store names, so a missing optional backend never
  breaks a config that does not use it).
- Values may be strings (as a properties file or Spark conf gives them) or already-typed Python values; a ``None``
  value counts as unset. A bool is never accepted where a number is expected.
- A wrong value names the key, the bad value and what is allowed. An unknown key under a prefix statebackend owns
  (``job.``, ``state.``, ``blob.store.``, ``stores.<name>.``, ``task.``, ``<used-factory>.``) is an error with a
  "did you mean" for typos, so a misspelled key never silently falls back to its default. Keys under other prefixes
  (``spark.*``, another system's) are kept in ``raw`` and ignored, except a near miss of one of our keys
  (``tsak.commit.ms``), which is reported as a typo.
- All problems are collected and raised as one :class:`~statebackend.errors.ConfigError`: its first line is the
  first problem, and each problem has its own line, so a user fixes everything in one go.
- Settings are immutable and picklable (they travel to Spark executors); their repr hides credentials.

The reference of every key is docs/configuration.md; tests/test_config.py checks it lists every key declared here.
"""

from __future__ import annotations

import difflib
import logging
import os
import re
from collections.abc import Callable, Iterator, Mapping, Sequence
from decimal import Decimal, InvalidOperation
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit

import attrs

from statebackend.blobstore import known_blob_store_schemes
from statebackend.errors import ConfigError
from statebackend.redact import redact
from statebackend.registry import ResolvedFactory, known_factories, resolve_factory

__all__ = [
    "BLOB_STORE_OPTIONS",
    "GLOBAL_OPTIONS",
    "NAME_PATTERN",
    "SERDES",
    "STORE_OPTIONS",
    "OptionSpec",
    "Parser",
    "Settings",
    "StoreSettings",
    "parse_bool",
    "parse_bytes",
    "parse_choice",
    "parse_duration_ms",
    "parse_int",
    "parse_list",
    "parse_object",
    "parse_path",
    "parse_str",
]

_log = logging.getLogger(__name__)

#: (key, raw value) -> parsed value; raises ConfigError naming the key
Parser = Callable[[str, Any], Any]

#: job and store names: they become parts of blob names and directory names
NAME_PATTERN = r"[A-Za-z0-9][A-Za-z0-9._-]*"

SERDES = ("bytes", "string", "integer", "json", "pickle")


@attrs.frozen
class OptionSpec:
    """One configuration key: how to parse it, its default and a one-line meaning.

    ``default`` goes through ``parse`` too, so it may be written raw (``"8MiB"``) or typed (``8388608``); ``None``
    means "unset" (the key is then absent from option mappings). ``secret`` keeps the value out of reprs.
    """

    parse: Parser
    default: Any = None
    doc: str = ""
    secret: bool = False

    def default_value(self, key: str) -> Any:
        """The parsed default (``None`` when the key has no default)."""
        return None if self.default is None else self.parse(key, self.default)


# -- parsers ----------------------------------------------------------------------------------------------------


def parse_int(min: int | None = None, max: int | None = None) -> Parser:  # shadows min/max: the names read best
    """An integer from an int or a decimal string, within ``[min, max]``."""
    allowed = _range_text("an integer", min, max)

    def parse(key: str, raw: Any) -> int:
        value = _to_int(key, raw, allowed)
        _check_range(key, raw, value, min, max, allowed)
        return value

    return parse


def parse_bool() -> Parser:
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
        raise _value_error(key, raw, "not a boolean", allowed)

    return parse


def parse_bytes(min: int | None = 0, max: int | None = None) -> Parser:
    """A byte count from an int or a string: ``"100"``, ``"512KiB"``, ``"64MiB"``, ``"1.5GiB"``, ``"1TiB"`` (binary
    units), ``"10MB"`` (decimal units), case-insensitive, optional space before the unit."""
    allowed = _range_text("a byte count such as 100, 512KiB, 64MiB, 1GiB", min, max)
    return _scaled_parser("byte count", _BYTE_UNITS, allowed, min, max)


def parse_duration_ms(min: int | None = 0, max: int | None = None) -> Parser:
    """A duration in milliseconds from an int (milliseconds) or a string: ``"1500"``, ``"250ms"``, ``"30s"``,
    ``"5m"``/``"5min"``, ``"1h"``."""
    allowed = _range_text("milliseconds, such as 30000, 250ms, 30s, 5min, 1h", min, max)
    return _scaled_parser("duration", _DURATION_UNITS, allowed, min, max)


def _scaled_parser(
    what: str, units: Mapping[str, int], allowed: str, low: int | None, high: int | None
) -> Parser:
    """An int, or a string of a number and one of ``units`` (bytes, durations), within [low, high]."""

    def parse(key: str, raw: Any) -> int:
        if isinstance(raw, bool):
            raise _value_error(key, raw, f"a boolean is not a {what}", allowed)
        if isinstance(raw, int):
            value = raw
        elif isinstance(raw, str):
            value = _scaled(key, raw, units, allowed)
        else:
            raise _value_error(key, raw, f"a {type(raw).__name__} is not a {what}", allowed)
        _check_range(key, raw, value, low, high, allowed)
        return value

    return parse


def parse_choice(*allowed_values: str) -> Parser:
    """One of ``allowed_values`` (exact, after trimming)."""
    if not allowed_values:
        raise ValueError("parse_choice needs at least one allowed value")
    allowed = "one of " + ", ".join(allowed_values)

    def parse(key: str, raw: Any) -> str:
        if isinstance(raw, str) and raw.strip() in allowed_values:
            return raw.strip()
        near = difflib.get_close_matches(str(raw).strip(), allowed_values, n=1) if isinstance(raw, str) else []
        problem = f"not an allowed value (did you mean {near[0]}?)" if near else "not an allowed value"
        raise _value_error(key, raw, problem, allowed)

    return parse


def parse_list(item_parser: Parser | None = None) -> Parser:
    """A non-empty tuple from a comma-separated string (items trimmed, none empty) or a list/tuple; each item goes
    through ``item_parser`` (default: a non-empty string)."""
    parse_item = item_parser or parse_str()

    def parse(key: str, raw: Any) -> tuple[Any, ...]:
        allowed = "a comma-separated list of non-empty items"
        if isinstance(raw, str):
            items: Sequence[Any] = [item.strip() for item in raw.split(",")]
            if raw.strip() == "":
                raise _value_error(key, raw, "the list is empty", allowed)
            for position, item in enumerate(items, start=1):
                if item == "":
                    raise _value_error(key, raw, f"item {position} is empty", allowed)
        elif isinstance(raw, (list, tuple)):
            items = raw
            if not items:
                raise _value_error(key, raw, "the list is empty", allowed)
        else:
            raise _value_error(key, raw, f"a {type(raw).__name__} is not a list", allowed)
        return tuple(parse_item(key, item) for item in items)

    return parse


def parse_str(pattern: str | None = None) -> Parser:
    """A non-empty string (trimmed; an int is taken as its decimal string), matching ``pattern`` in full if given."""
    compiled = re.compile(pattern) if pattern is not None else None
    allowed = f"a string matching {pattern}" if pattern is not None else "a non-empty string"

    def parse(key: str, raw: Any) -> str:
        if isinstance(raw, bool) or not isinstance(raw, (str, int)):
            raise _value_error(key, raw, f"a {type(raw).__name__} is not a string", allowed)
        value = str(raw).strip()
        if value == "":
            raise _value_error(key, raw, "the value is empty", allowed)
        if compiled is not None and not compiled.fullmatch(value):
            raise _value_error(key, raw, "it does not match the allowed pattern", allowed)
        return value

    return parse


def parse_path() -> Parser:
    """A filesystem path from a non-empty string or path-like; ``~`` is expanded, nothing is touched on disk."""

    def parse(key: str, raw: Any) -> Path:
        if isinstance(raw, os.PathLike):
            raw = os.fspath(raw)
        if not isinstance(raw, str) or raw.strip() == "":
            raise _value_error(key, raw, "not a path", "a non-empty directory path")
        return Path(raw.strip()).expanduser()

    return parse


def parse_object() -> Parser:
    """Any value, passed through (a non-empty string is trimmed): for SDK objects such as an Azure credential."""

    def parse(key: str, raw: Any) -> Any:
        if isinstance(raw, str):
            if raw.strip() == "":
                raise _value_error(key, "<empty>", "the value is empty", "a non-empty string or a credential object")
            return raw.strip()
        return raw

    return parse


# -- settings ---------------------------------------------------------------------------------------------------


@attrs.frozen
class StoreSettings:
    """The settings of one store (``stores.<name>.*``), factory names already canonical."""

    name: str
    backup_factories: tuple[str, ...]
    #: backends to restore from, in order of preference; the next is tried when a restore fails on a missing or
    #: damaged blob (only those whose marker the checkpoint has count)
    restore_factories: tuple[str, ...]
    key_serde: str
    msg_serde: str
    write_batch_max_bytes: int
    map_size: int

    @property
    def restore_factory(self) -> str:
        """The preferred restore backend (the first of :attr:`restore_factories`)."""
        return self.restore_factories[0]


def _redacted_repr(mapping: Mapping[str, Any]) -> str:
    shown = {
        key: ("<redacted>" if _is_secret_key(key) else redact(value) if isinstance(value, str) else value)
        for key, value in mapping.items()
    }
    return repr(shown)


def _redacted_nested_repr(mapping: Mapping[str, Mapping[str, Any]]) -> str:
    return "{" + ", ".join(f"{name!r}: {_redacted_repr(opts)}" for name, opts in mapping.items()) + "}"


@attrs.frozen
class Settings:
    """The whole parsed configuration. Build it with :meth:`from_config`."""

    job_name: str
    local_dir: Path
    blob_store_url: str = attrs.field(repr=lambda url: repr(redact(url)))  # userinfo, SAS query
    #: parsed ``blob.store.*`` keys other than url, without the prefix; unset keys without a default are absent
    blob_store_options: Mapping[str, Any] = attrs.field(repr=_redacted_repr)
    stores: Mapping[str, StoreSettings]
    commit_ms: int
    commit_max_delay_ms: int
    commit_timeout_ms: int
    commit_async_failures_tolerated: int
    commit_pool_size: int
    checkpoint_write_versions: tuple[int, ...]
    checkpoint_read_versions: tuple[int, ...]
    checkpoint_retained: int
    #: canonical factory name -> its parsed options, defaults filled, for every factory some store names
    backend_options: Mapping[str, Mapping[str, Any]] = attrs.field(repr=_redacted_nested_repr)
    #: the configuration as given, every key, including the ones other systems own (values as given)
    raw: Mapping[str, Any] = attrs.field(repr=_redacted_repr)

    @classmethod
    def from_config(cls, config: Mapping[str, Any]) -> Settings:
        """Parse and validate ``config``; raise one ConfigError listing every problem."""
        return _SettingsParser(config).parse()

    def backend_options_for(self, name: str) -> Mapping[str, Any]:
        """The options of a state backend, by canonical name (or any name that resolves to it).

        A backend no store names is resolved now and its ``<name>.*`` keys are validated against its schema.
        """
        if name in self.backend_options:
            return self.backend_options[name]
        resolved = resolve_factory(name)
        if resolved.canonical_name in self.backend_options:
            return self.backend_options[resolved.canonical_name]
        options, problems = _parse_backend_options(resolved, self.raw)
        if problems:
            raise ConfigError("\n".join(problems))
        return options


# -- parsing ----------------------------------------------------------------------------------------------------


class _SettingsParser:
    """One pass over a config: collects every problem, then builds Settings or raises them all."""

    def __init__(self, config: Mapping[str, Any]) -> None:
        if not isinstance(config, Mapping):
            raise ConfigError(f"the configuration must be a mapping of key -> value, not a {type(config).__name__}")
        self.config = config
        self.problems: list[str] = []
        self.unknown_keys: list[str] = []
        #: keys under no prefix we own, left for backend options and the typo check
        self.other_keys: list[str] = []
        #: store name -> option -> raw value
        self.store_keys: dict[str, dict[str, Any]] = {}
        self.resolved: dict[str, ResolvedFactory | None] = {}

    def parse(self) -> Settings:
        self._classify_keys()
        url = self.config.get("blob.store.url")
        if url is None or (isinstance(url, str) and url.strip() == ""):
            # Missing is the commonest first-run mistake: say it first, with the three forms a URL takes.
            self.problems.append(_missing_url_message(self.config))
        values = {key: self._value(key, spec) for key, spec in GLOBAL_OPTIONS.items() if key != "blob.store.url"}
        if url is not None and not (isinstance(url, str) and url.strip() == ""):
            values["blob.store.url"] = self._url()
        blob_store_options = {}
        for option, spec in BLOB_STORE_OPTIONS.items():
            value = self._value("blob.store." + option, spec)
            if value is not None:
                blob_store_options[option] = value
        self._undeclared_stores()
        stores = {name: self._store(name) for name in sorted(self.store_keys)}
        backend_options = self._backend_options()
        self._report_unknown_keys(stores, backend_options)
        if self.problems:
            raise ConfigError("\n".join(self.problems))
        return Settings(
            job_name=values["job.name"],
            local_dir=values["state.local.dir"],
            blob_store_url=values["blob.store.url"],
            blob_store_options=_ReadOnlyMapping(blob_store_options),
            stores=_ReadOnlyMapping({name: store for name, store in stores.items() if store is not None}),
            commit_ms=values["task.commit.ms"],
            commit_max_delay_ms=values["task.commit.max.delay.ms"],
            commit_timeout_ms=values["task.commit.timeout.ms"],
            commit_async_failures_tolerated=values["task.commit.async.failures.tolerated"],
            commit_pool_size=values["task.commit.pool.size"],
            checkpoint_write_versions=values["task.checkpoint.write.versions"],
            checkpoint_read_versions=values["task.checkpoint.read.versions"],
            checkpoint_retained=values["task.checkpoint.retained"],
            backend_options=_ReadOnlyMapping(backend_options),
            raw=_ReadOnlyMapping(dict(self.config)),
        )

    def _classify_keys(self) -> None:
        for key in self.config:
            if not isinstance(key, str):
                self.problems.append(f"configuration key {key!r} is a {type(key).__name__}; keys must be strings")
                continue
            if key in GLOBAL_OPTIONS:
                continue
            if key.startswith("blob.store."):
                if key[len("blob.store.") :] not in BLOB_STORE_OPTIONS:
                    self.unknown_keys.append(key)
            elif key.startswith("stores."):
                self._classify_store_key(key)
            elif key.startswith(_OWNED_PREFIXES):
                self.unknown_keys.append(key)
            else:
                self.other_keys.append(key)

    def _classify_store_key(self, key: str) -> None:
        rest = key[len("stores.") :]
        for option in STORE_OPTIONS:
            if rest.endswith("." + option):
                name = rest[: -len(option) - 1]
                if not re.fullmatch(NAME_PATTERN, name):
                    self.problems.append(
                        f"{key}: store name {name!r} is not valid; allowed: letters, digits, '.', '_', '-', "
                        "starting with a letter or digit"
                    )
                    return
                self.store_keys.setdefault(name, {})[option] = self.config[key]
                return
        self.unknown_keys.append(key)

    def _undeclared_stores(self) -> None:
        """A store exists when its backup factories are set; any other key of an undeclared store is a typo (it
        would otherwise silently create a second store with default settings)."""
        declared = sorted(name for name, keys in self.store_keys.items() if "backup.factories" in keys)
        for name in [n for n in self.store_keys if n not in declared]:
            options = self.store_keys.pop(name)
            for option in sorted(options):
                key = f"stores.{name}.{option}"
                near = difflib.get_close_matches(name, declared, n=1, cutoff=0.6)
                hint = (f"did you mean stores.{near[0]}.{option}?" if near else
                        f"declare it with stores.{name}.backup.factories=changelog (or another backend)")
                self.problems.append(
                    f"{key}: store {name!r} is not declared (a store exists when stores.<name>.backup.factories is "
                    f"set; declared stores: {', '.join(declared) or 'none'}); {hint}"
                )

    def _value(self, key: str, spec: OptionSpec) -> Any:
        value, problem = _parse_one(key, spec, self.config.get(key))
        if problem is not None:
            self.problems.append(problem)
        return value

    def _url(self) -> str | None:
        url = self._value("blob.store.url", GLOBAL_OPTIONS["blob.store.url"])
        if url is None:
            return None
        scheme = urlsplit(url).scheme
        schemes = known_blob_store_schemes()
        if "://" not in url or scheme not in schemes:
            known = ", ".join(f"{s}://" for s in schemes)
            self.problems.append(
                f"blob.store.url={redact(url)!r} is not valid: unknown scheme {scheme!r}; allowed: a URL starting with {known}"
            )
            return None
        return url

    def _store(self, name: str) -> StoreSettings | None:
        keys = self.store_keys[name]
        prefix = f"stores.{name}."
        parsed = {
            option: self._value(prefix + option, spec)
            for option, spec in STORE_OPTIONS.items()
        }
        backups: list[str] = []
        for factory_name in parsed["backup.factories"]:
            resolved = self._resolve(prefix + "backup.factories", factory_name)
            if resolved is None:
                continue
            if resolved.canonical_name in backups:
                self.problems.append(
                    f"{prefix}backup.factories={keys.get('backup.factories')!r} is not valid: "
                    f"{resolved.canonical_name!r} is listed twice; allowed: each backend once"
                )
                continue
            backups.append(resolved.canonical_name)
        restore_names = parsed["restore.factories"]
        alias = parsed["restore.factory"]
        if alias is not None:
            if restore_names is not None and list(restore_names) != [alias]:
                self.problems.append(
                    f"{prefix}restore.factory={alias!r} and {prefix}restore.factories="
                    f"{keys.get('restore.factories')!r} are both set and differ; allowed: one of them "
                    f"(restore.factory is an alias of a one-backend restore.factories)"
                )
                return None
            restore_names = [alias]
        restores: list[str] = []
        key = prefix + ("restore.factories" if parsed["restore.factories"] is not None else "restore.factory")
        for restore_name in restore_names if restore_names is not None else []:
            resolved = self._resolve(key, restore_name)
            if resolved is None:
                continue
            if resolved.canonical_name in restores:
                self.problems.append(
                    f"{key}={keys.get(key[len(prefix):])!r} is not valid: {resolved.canonical_name!r} is listed "
                    f"twice; allowed: each backend once"
                )
                continue
            restores.append(resolved.canonical_name)
        if restore_names is None:
            restores = list(backups)
        elif not restores:
            return None
        if not backups:
            return None
        return StoreSettings(
            name=name,
            backup_factories=tuple(backups),
            restore_factories=tuple(restores),
            key_serde=parsed["key.serde"],
            msg_serde=parsed["msg.serde"],
            write_batch_max_bytes=parsed["write.batch.max.bytes"],
            map_size=parsed["lmdb.map.size"],
        )

    def _resolve(self, key: str, name: str) -> ResolvedFactory | None:
        if name not in self.resolved:
            try:
                self.resolved[name] = resolve_factory(name)
            except ConfigError as exc:
                self.resolved[name] = None
                self.problems.append(f"{key}: {exc}")
        return self.resolved[name]

    def _backend_options(self) -> dict[str, Mapping[str, Any]]:
        by_canonical = {r.canonical_name: r for r in self.resolved.values() if r is not None}
        backend_options: dict[str, Mapping[str, Any]] = {}
        for canonical, resolved in by_canonical.items():
            options, problems = _parse_backend_options(resolved, self.config)
            backend_options[canonical] = options
            self.problems.extend(problems)
        aliases = {name: r.canonical_name for name, r in self.resolved.items() if r and name != r.canonical_name}
        registered = set(known_factories())
        remaining = []
        for key in self.other_keys:
            if any(key.startswith(canonical + ".") for canonical in by_canonical):
                continue
            alias = next((a for a in aliases if key.startswith(a + ".")), None)
            if alias is not None:
                option = key[len(alias) + 1 :]
                self.problems.append(
                    f"{key}: options of backend {alias!r} are read under its canonical name; "
                    f"write it as {aliases[alias]}.{option}"
                )
                continue
            first = key.split(".", 1)[0]
            if first in registered:
                _log.warning("config key %s configures state backend %r, which no store uses; ignored", key, first)
            remaining.append(key)
        self.other_keys = remaining
        return backend_options

    def _report_unknown_keys(
        self, stores: Mapping[str, StoreSettings | None], backend_options: Mapping[str, Mapping[str, Any]]
    ) -> None:
        known = [*GLOBAL_OPTIONS, *("blob.store." + option for option in BLOB_STORE_OPTIONS)]
        known += [f"stores.{name}.{option}" for name in stores for option in STORE_OPTIONS]
        for canonical, resolved in ((r.canonical_name, r) for r in self.resolved.values() if r is not None):
            known += [f"{canonical}.{option}" for option in resolved.factory.options]
        for key in sorted(self.unknown_keys):
            candidates = known + _store_key_candidates(key)
            near = difflib.get_close_matches(key, candidates, n=1, cutoff=0.8)
            self.problems.append(f"{key}: unknown key; " + (f"did you mean {near[0]}?" if near else _known_under(key)))
        for key in sorted(self.other_keys):
            # A near miss of one of our keys outside our prefixes (tsak.commit.ms) would otherwise be ignored.
            near = difflib.get_close_matches(key, known + _store_key_candidates(key, any_prefix=True), n=1, cutoff=0.9)
            if near:
                self.problems.append(f"{key}: unknown key; did you mean {near[0]}?")


def _parse_backend_options(resolved: ResolvedFactory, config: Mapping[str, Any]) -> tuple[Mapping[str, Any], list[str]]:
    """Validate ``<canonical>.*`` keys against the factory's ``options`` schema; fill defaults."""
    canonical, schema = resolved.canonical_name, resolved.factory.options
    problems: list[str] = []
    for option, spec in schema.items():
        if not isinstance(spec, OptionSpec):
            problems.append(
                f"state backend {canonical!r} declares option {option!r} as {spec!r}, not a "
                "statebackend.config.OptionSpec; fix the backend's options"
            )
    if problems:
        return _ReadOnlyMapping({}), problems
    prefix = canonical + "."
    options: dict[str, Any] = {}
    for option, spec in schema.items():
        key = prefix + option
        value, problem = _parse_one(key, spec, config.get(key))
        if problem is not None:
            problems.append(problem)
        elif value is not None:
            options[option] = value
    known = [prefix + option for option in schema]
    for key in sorted(k for k in config if isinstance(k, str) and k.startswith(prefix)):
        if key[len(prefix) :] not in schema:
            near = difflib.get_close_matches(key, known, n=1, cutoff=0.8)
            if near:
                problems.append(f"{key}: unknown key; did you mean {near[0]}?")
            else:
                allowed = ", ".join(known) if known else f"none (backend {canonical!r} has no options)"
                problems.append(f"{key}: unknown key; known keys of backend {canonical!r}: {allowed}")
    return _ReadOnlyMapping(options), problems


def _parse_one(key: str, spec: OptionSpec, raw: Any) -> tuple[Any, str | None]:
    """(value, None) or (default, problem); a secret's value never enters the problem text."""
    try:
        return (spec.default_value(key) if raw is None else spec.parse(key, raw)), None
    except ConfigError as exc:
        problem = str(exc)
        if spec.secret and " is not valid:" in problem:
            problem = f"{key}=<redacted> is not valid:" + problem.split(" is not valid:", 1)[1]
        return spec.default_value(key), problem


def _store_key_candidates(key: str, *, any_prefix: bool = False) -> list[str]:
    """Store keys this key could have meant, for every way of reading a store name out of it (names may hold dots)."""
    segments = key.split(".")
    if not any_prefix and segments[0] != "stores":
        return []
    candidates = []
    for end in range(2, len(segments)):
        name = ".".join(segments[1:end])
        candidates += [f"stores.{name}.{option}" for option in STORE_OPTIONS]
    return candidates


def _known_under(key: str) -> str:
    """What may be written under the key's prefix, for an unknown key with no close match."""
    if key.startswith("stores."):
        return "allowed: stores.<name>.<option> with <option> one of " + ", ".join(STORE_OPTIONS)
    first = key.split(".", 1)[0] + "."
    known = [k for k in (*GLOBAL_OPTIONS, *("blob.store." + o for o in BLOB_STORE_OPTIONS)) if k.startswith(first)]
    return "known keys: " + ", ".join(known) + " (see docs/configuration.md)"


def _missing_url_message(config: Mapping[str, Any]) -> str:
    message = "blob.store.url is missing: set it to file:///path, az://container/prefix or s3://bucket/prefix"
    near = difflib.get_close_matches("blob.store.url", [k for k in config if isinstance(k, str)], n=1, cutoff=0.8)
    return message + (f" (is {near[0]} a misspelling of it?)" if near else "")


# -- helpers ----------------------------------------------------------------------------------------------------

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
_SECRET_KEY_RE = re.compile(r"(password|secret|token|credential|connection\.string|sas|account\.key)", re.IGNORECASE)


def _value_error(key: str, raw: Any, problem: str, allowed: str) -> ConfigError:
    shown = repr(raw)
    if len(shown) > 80:
        shown = shown[:77] + "..."
    return ConfigError(f"{key}={shown} is not valid: {problem}; allowed: {allowed}")


def _is_secret_key(key: str) -> bool:
    return bool(_SECRET_KEY_RE.search(key))


def _range_text(what: str, low: int | None, high: int | None) -> str:
    if low is not None and high is not None:
        return f"{what} (from {low} to {high})"
    if low is not None:
        return f"{what} (at least {low})"
    if high is not None:
        return f"{what} (at most {high})"
    return what


def _to_int(key: str, raw: Any, allowed: str) -> int:
    if isinstance(raw, bool):
        raise _value_error(key, raw, "a boolean is not an integer", allowed)
    if isinstance(raw, int):
        return raw
    if isinstance(raw, str) and re.fullmatch(r"[+-]?[0-9]+", raw.strip()):
        return int(raw.strip())
    raise _value_error(key, raw, "not an integer", allowed)


def _check_range(key: str, raw: Any, value: int, low: int | None, high: int | None, allowed: str) -> None:
    if (low is not None and value < low) or (high is not None and value > high):
        raise _value_error(key, raw, "out of range", allowed)


def _scaled(key: str, raw: str, units: Mapping[str, int], allowed: str) -> int:
    match = _SCALED_RE.fullmatch(raw.strip())
    unit = match.group(2).lower() if match else ""
    if match is None or unit not in units:
        problem = f"unknown unit {match.group(2)!r}" if match else "not a number with an optional unit"
        raise _value_error(key, raw, problem, allowed)
    try:
        number = Decimal(match.group(1))
    except InvalidOperation as exc:  # the regex admits only decimals, so this is a guard
        raise _value_error(key, raw, "not a number", allowed) from exc
    return int(number * units[unit])


class _ReadOnlyMapping(Mapping[str, Any]):
    """A read-only dict view that, unlike MappingProxyType, pickles (Settings travel to Spark executors)."""

    __slots__ = ("_data",)

    def __init__(self, data: Mapping[str, Any]) -> None:
        self._data = dict(data)

    def __getitem__(self, key: str) -> Any:
        return self._data[key]

    def __iter__(self) -> Iterator[str]:
        return iter(self._data)

    def __len__(self) -> int:
        return len(self._data)

    def __repr__(self) -> str:
        return repr(self._data)

    def __reduce__(self) -> tuple[Any, ...]:
        return (_ReadOnlyMapping, (self._data,))


# -- the keys statebackend owns ---------------------------------------------------------------------------------
# Declared last: building the tables calls the parsers, which need the helpers above.


def _parse_versions(key: str, raw: Any) -> tuple[int, ...]:
    versions = parse_list(parse_int(min=1, max=2))(key, raw)
    if len(set(versions)) != len(versions):
        raise _value_error(key, raw, "a version is listed twice", "a comma-separated list of 1 and 2, no repeats")
    return versions


_DEFAULT_POOL_SIZE = min(32, 4 * (os.cpu_count() or 1))

#: full key -> spec, for the keys outside ``blob.store.*`` and ``stores.<name>.*``
GLOBAL_OPTIONS: Mapping[str, OptionSpec] = {
    "job.name": OptionSpec(
        parse_str(NAME_PATTERN), "job", "name of the streaming application; the first part of every blob name"
    ),
    "state.local.dir": OptionSpec(
        parse_path(), "./state", "local directory for the stores: <dir>/<job>/<task>/<store>/"
    ),
    "blob.store.url": OptionSpec(
        parse_str(), None, "where backups and checkpoints go: file:///path, az://container/prefix, s3://bucket/prefix"
    ),
    "task.commit.ms": OptionSpec(parse_duration_ms(min=0), 60000, "interval between two commits of a task"),
    "task.commit.max.delay.ms": OptionSpec(
        parse_duration_ms(min=0),
        60000,
        "a commit whose previous upload started less than this ago is skipped; after it, processing blocks",
    ),
    "task.commit.timeout.ms": OptionSpec(
        parse_duration_ms(min=1), 1800000, "longest a commit blocks on the previous upload before it fails"
    ),
    "task.commit.async.failures.tolerated": OptionSpec(
        parse_int(min=0), 0, "failed asynchronous commit parts counted and passed over before a commit raises"
    ),
    "task.commit.pool.size": OptionSpec(
        parse_int(min=1, max=1024),
        _DEFAULT_POOL_SIZE,
        "threads of the commit pool shared by the tasks of a process (default min(32, 4 x CPUs))",
    ),
    "task.checkpoint.write.versions": OptionSpec(
        _parse_versions, "2", "checkpoint formats written at each commit, any of 1, 2"
    ),
    "task.checkpoint.read.versions": OptionSpec(
        _parse_versions, "2,1", "checkpoint formats read on restore, in order of preference"
    ),
    "task.checkpoint.retained": OptionSpec(
        parse_int(min=1), 10, "checkpoints kept in the checkpoint log; older ones and what only they need are deleted"
    ),
}

#: ``blob.store.<key>`` -> spec; the parsed values (minus url) become ``Settings.blob_store_options``
BLOB_STORE_OPTIONS: Mapping[str, OptionSpec] = {
    "connection.string": OptionSpec(parse_str(), None, "Azure storage connection string", secret=True),
    "account.url": OptionSpec(parse_str(), None, "Azure account URL, https://<account>.blob.core.windows.net"),
    "credential": OptionSpec(
        parse_object(), None, "Azure credential: an account key, a SAS token or a credential object", secret=True
    ),
    "endpoint.url": OptionSpec(parse_str(), None, "S3 endpoint URL, for S3-compatible servers"),
    "region": OptionSpec(parse_str(), None, "S3 region"),
    "profile": OptionSpec(parse_str(), None, "AWS profile name for credentials"),
    "max.concurrency": OptionSpec(parse_int(min=1, max=1024), 8, "concurrent requests per blob store"),
    "request.timeout.ms": OptionSpec(parse_duration_ms(min=1), 30000, "timeout of one request attempt"),
    "retry.max.attempts": OptionSpec(
        parse_int(min=1), 5, "attempts for a request that fails transiently (1: no retry)"
    ),
    "retry.base.delay.ms": OptionSpec(parse_duration_ms(min=0), 100, "first retry backoff; doubles each retry"),
    "retry.max.delay.ms": OptionSpec(parse_duration_ms(min=0), 5000, "upper bound of a retry backoff"),
    "hedge.after.ms": OptionSpec(
        parse_duration_ms(min=0), 0, "start a second attempt when the first is slower than this (0: off)"
    ),
    "hedge.max": OptionSpec(parse_int(min=1, max=8), 2, "most hedged attempts started for one request"),
    "part.size.bytes": OptionSpec(parse_bytes(min=1), "8MiB", "part size of parallel uploads and downloads"),
    "create.if.missing": OptionSpec(parse_bool(), False, "create the container, bucket or directory when missing"),
}

#: ``stores.<name>.<key>`` -> spec
STORE_OPTIONS: Mapping[str, OptionSpec] = {
    "backup.factories": OptionSpec(
        parse_list(), None, "state backends the store is backed up to at every commit, in order; setting it declares "
        "the store (required)"
    ),
    "restore.factories": OptionSpec(
        parse_list(),
        None,
        "state backends the store is restored from, in order: the first whose marker the checkpoint has; when its "
        "restore fails on a missing or damaged blob, the next (default: the backup factories; may name backends "
        "the store no longer backs up to, for a migration)",
    ),
    "restore.factory": OptionSpec(
        parse_str(), None, "alias of restore.factories with one backend (kept for existing configs)"
    ),
    "key.serde": OptionSpec(parse_choice(*SERDES), "bytes", "how keys are encoded: " + ", ".join(SERDES)),
    "msg.serde": OptionSpec(parse_choice(*SERDES), "bytes", "how values are encoded: " + ", ".join(SERDES)),
    "write.batch.max.bytes": OptionSpec(
        parse_bytes(min=1), "64MiB", "memory bound of the write batch between two commits; a larger batch spills"
    ),
    "lmdb.map.size": OptionSpec(parse_bytes(min=1 << 20), "1TiB", "LMDB map size: the largest the store can grow"),
}

_OWNED_PREFIXES = ("job.", "state.", "blob.store.", "stores.", "task.")
