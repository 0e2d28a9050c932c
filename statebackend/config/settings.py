"""Settings: the whole configuration parsed once into typed, validated, immutable values (see the package
docstring for the contract)."""

from __future__ import annotations

import difflib
import importlib.util
import logging
import re
from collections.abc import Iterator, Mapping
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit

import attrs

from statebackend.blobstores.base import (
    BlobStore,
    blob_store_class,
    blob_store_option_schemas,
    known_blob_store_schemes,
)
from statebackend.config.backend_keys import (
    StoreBackendKey,
    parse_backend_options,
    read_store_backend_key,
    store_backend_prefix,
)
from statebackend.config.keys import GLOBAL_OPTIONS, OWNED_PREFIXES, STORE_OPTIONS
from statebackend.config.names import check_name
from statebackend.errors import ConfigError
from statebackend.options import OptionSpec, ParsedOptions, default_of, parse_one, parse_options
from statebackend.redact import redact
from statebackend.registry import ResolvedFactory, known_factories, resolve_factory

_log = logging.getLogger(__name__)


# -- settings ---------------------------------------------------------------------------------------------------

#: the metadata key of an attribute read from one configuration key (a full key for Settings, a store option for
#: StoreSettings): the one place an attribute is tied to its key; :func:`config_keys` lists them
CONFIG_KEY = "statebackend.config.key"


def _key(key: str) -> dict[str, str]:
    """The metadata of an attribute holding the parsed value of ``key``."""
    return {CONFIG_KEY: key}


def _store_option(option: str) -> Any:
    """A StoreSettings attribute holding the parsed value of ``stores.<name>.<option>``, its default the schema's."""
    return attrs.field(default=default_of(STORE_OPTIONS, option, prefix="stores.<name>."), metadata=_key(option))


@attrs.frozen
class StoreSettings:
    """The settings of one store (``stores.<name>.*``), factory names already canonical. The defaults are those of
    the schema (``STORE_OPTIONS``)."""

    name: str
    backup_factories: tuple[str, ...]
    #: backends to restore from, in order of preference; the next is tried when a restore fails on a missing or
    #: damaged blob (only those whose marker the checkpoint has count)
    restore_factories: tuple[str, ...]
    key_serde: str = _store_option("key.serde")
    #: value, list or map (statebackend.store.kinds); ``subkey_serde``: a map store's sub-key serde
    kind: str = _store_option("kind")
    subkey_serde: str = _store_option("subkey.serde")
    msg_serde: str = _store_option("msg.serde")
    write_batch_max_bytes: int = _store_option("write.batch.max.bytes")
    map_size: int = _store_option("lmdb.map.size")
    #: time to live of a key after its last write (None: no TTL); ``ttl_sweep_keys``: keys examined per commit
    ttl_ms: int | None = _store_option("ttl.ms")
    ttl_sweep_keys: int = _store_option("ttl.sweep.keys")
    #: a rewrite of every value, run once (statebackend.values): its name and ``<module>:<function>``, or both None
    migration_id: str | None = _store_option("migration.id")
    migration_function: str | None = _store_option("migration.function")

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


def _url_repr(url: str | None) -> str:
    return repr(redact(url)) if url is not None else "None"  # userinfo, a SAS query


def _redacted_nested_repr(mapping: Mapping[str, Mapping[str, Any]]) -> str:
    return "{" + ", ".join(f"{name!r}: {_redacted_repr(opts)}" for name, opts in mapping.items()) + "}"


def _redacted_per_store_repr(mapping: Mapping[str, Mapping[str, Mapping[str, Any]]]) -> str:
    return "{" + ", ".join(f"{store!r}: {_redacted_nested_repr(backends)}" for store, backends in mapping.items()) + "}"


@attrs.frozen
class Settings:
    """The whole parsed configuration. Build it with :meth:`from_config`: no attribute has a default of its own, each
    one read from a key takes the schema's (``GLOBAL_OPTIONS``) when the key is unset."""

    job_name: str = attrs.field(metadata=_key("job.name"))
    local_dir: Path = attrs.field(metadata=_key("state.local.dir"))
    blob_store_url: str = attrs.field(repr=_url_repr, metadata=_key("blob.store.url"))
    #: parsed ``blob.store.*`` keys other than url, without the prefix, as the URL's scheme declares them (its store
    #: class's ``options``); unset keys without a default are absent. The store and its resilience layer use them as
    #: they are: they are parsed here, once
    blob_store_options: ParsedOptions = attrs.field(repr=_redacted_repr)
    stores: Mapping[str, StoreSettings]
    commit_ms: int = attrs.field(metadata=_key("task.commit.ms"))
    commit_max_delay_ms: int = attrs.field(metadata=_key("task.commit.max.delay.ms"))
    commit_timeout_ms: int = attrs.field(metadata=_key("task.commit.timeout.ms"))
    commit_async_failures_tolerated: int = attrs.field(metadata=_key("task.commit.async.failures.tolerated"))
    commit_pool_size: int = attrs.field(metadata=_key("task.commit.pool.size"))
    checkpoint_write_versions: tuple[int, ...] = attrs.field(metadata=_key("task.checkpoint.write.versions"))
    checkpoint_read_versions: tuple[int, ...] = attrs.field(metadata=_key("task.checkpoint.read.versions"))
    checkpoint_retained: int = attrs.field(metadata=_key("task.checkpoint.retained"))
    #: canonical factory name -> its parsed options, defaults filled, for every factory some store names
    backend_options: Mapping[str, Mapping[str, Any]] = attrs.field(repr=_redacted_nested_repr)
    #: store name -> canonical factory name -> the options that backend has for that store: the job-wide ones with
    #: the store's ``stores.<name>.<backend>.*`` keys on top; only for the stores and backends with such keys (read
    #: them with :meth:`backend_options_for`)
    store_backend_options: Mapping[str, Mapping[str, Mapping[str, Any]]] = attrs.field(repr=_redacted_per_store_repr)
    #: the configuration as given, every key, including the ones other systems own (values as given)
    raw: Mapping[str, Any] = attrs.field(repr=_redacted_repr)
    #: ``metrics.*``: OpenTelemetry mirroring (auto, on, off) and the Prometheus exporters (``None``: off)
    metrics_otel: str = attrs.field(metadata=_key("metrics.otel"))
    metrics_prometheus_port: int | None = attrs.field(metadata=_key("metrics.prometheus.port"))
    metrics_prometheus_host: str = attrs.field(metadata=_key("metrics.prometheus.host"))
    metrics_prometheus_textfile_dir: Path | None = attrs.field(metadata=_key("metrics.prometheus.textfile.dir"))
    metrics_prometheus_push_url: str | None = attrs.field(repr=_url_repr, metadata=_key("metrics.prometheus.push.url"))
    #: ``task.thread.switch.interval.us``: the longest a thread waits for the GIL while another runs Python (0: left
    #: as the interpreter has it)
    thread_switch_interval_us: int = attrs.field(metadata=_key("task.thread.switch.interval.us"))
    #: ``task.gc.freeze``: collect and freeze the survivors at each Spark task's start
    #: (:func:`statebackend.spark.executor.freeze_survivors`)
    gc_freeze: bool = attrs.field(metadata=_key("task.gc.freeze"))

    @classmethod
    def from_config(cls, config: Mapping[str, Any]) -> Settings:
        """Parse and validate ``config``; raise one ConfigError listing every problem."""
        return _SettingsParser(config).parse()

    def backend_options_for(self, name: str, store: str | None = None) -> Mapping[str, Any]:
        """The options of a state backend, by canonical name (or any name that resolves to it): with ``store``, the
        ones it has for that store (its ``stores.<store>.<backend>.*`` keys over the job-wide ``<backend>.*`` ones),
        else the job-wide ones. Defaults are filled.

        A backend no store names is resolved now and its ``<name>.*`` keys are validated against its schema.
        """
        if store is not None and store not in self.stores:
            raise ConfigError(
                f"no store {store!r} in the config; configured stores: {', '.join(sorted(self.stores)) or 'none'}"
            )
        canonical = name if name in self.backend_options else resolve_factory(name).canonical_name
        if store is not None:
            for_store = self.store_backend_options.get(store, {}).get(canonical)
            if for_store is not None:
                return for_store
        if canonical in self.backend_options:
            return self.backend_options[canonical]
        options, problems = _job_wide_backend_options(resolve_factory(name), self.raw)
        if problems:
            raise ConfigError("\n".join(problems))
        return _ReadOnlyMapping(options)


def config_keys(cls: type) -> dict[str, str]:
    """Attribute name -> the configuration key it is read from, for the attributes of :class:`Settings` (full keys)
    or :class:`StoreSettings` (``stores.<name>.*`` options) that hold one key's parsed value."""
    return {field.name: field.metadata[CONFIG_KEY] for field in attrs.fields(cls) if CONFIG_KEY in field.metadata}


# -- parsing ----------------------------------------------------------------------------------------------------


class _SettingsParser:
    """One pass over a config: collects every problem, then builds Settings or raises them all."""

    def __init__(self, config: Mapping[str, Any]) -> None:
        if not isinstance(config, Mapping):
            raise ConfigError(f"the configuration must be a mapping of key -> value, not a {type(config).__name__}")
        self.config = config
        self.problems: list[str] = []
        self.unknown_keys: list[str] = []
        #: ``blob.store.*`` keys other than the url, checked against the schema of the URL's scheme
        self.blob_store_keys: list[str] = []
        #: the ``blob.store.*`` options the URL's scheme takes (every scheme's when the URL is not usable)
        self.blob_store_schema: Mapping[str, OptionSpec] = {}
        #: keys under no prefix we own, left for backend options and the typo check
        self.other_keys: list[str] = []
        #: store name -> option -> raw value
        self.store_keys: dict[str, dict[str, Any]] = {}
        #: ``stores.*`` keys that are no option of a declared store: per-store backend options, or typos; the value
        #: is the problem of the store name the key would have as a store option (None: no such reading)
        self.store_backend_keys: dict[str, str | None] = {}
        #: keys of stores that are not declared (no backup factories): store -> option -> raw value
        self.undeclared: dict[str, dict[str, Any]] = {}
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
        blob_store_options = self._blob_store_options(values.get("blob.store.url"))
        if values["metrics.otel"] == "on" and importlib.util.find_spec("opentelemetry") is None:
            self.problems.append(
                "metrics.otel='on' is not valid: the opentelemetry-api package is not installed; allowed: auto or off, "
                "or install it: pip install 'statebackend[otel]'"
            )
        self._undeclared_stores()
        stores = {name: self._store(name) for name in sorted(self.store_keys)}
        backend_options = self._backend_options()
        store_backend_options = self._store_backend_options(stores, backend_options)
        self._report_unknown_keys(stores)
        if self.problems:
            raise ConfigError("\n".join(self.problems))
        assert blob_store_options is not None  # without them a problem was reported
        return Settings(
            **{name: values[key] for name, key in config_keys(Settings).items()},
            blob_store_options=blob_store_options,
            stores=_ReadOnlyMapping({name: store for name, store in stores.items() if store is not None}),
            backend_options=_ReadOnlyMapping(backend_options),
            store_backend_options=_ReadOnlyMapping(store_backend_options),
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
                self.blob_store_keys.append(key)
            elif key.startswith("stores."):
                self._classify_store_key(key)
            elif key.startswith(OWNED_PREFIXES):
                self.unknown_keys.append(key)
            else:
                self.other_keys.append(key)

    def _classify_store_key(self, key: str) -> None:
        rest = key[len("stores.") :]
        for option in STORE_OPTIONS:
            if rest.endswith("." + option):
                name = rest[: -len(option) - 1]
                try:
                    check_name("store name", name)
                except ConfigError as exc:
                    self.store_backend_keys[key] = f"{key}: {exc}"  # unless it is a backend's option of a store
                    return
                self.store_keys.setdefault(name, {})[option] = self.config[key]
                return
        self.store_backend_keys[key] = None

    def _undeclared_stores(self) -> None:
        """A store exists when its backup factories are set. The keys of undeclared stores are set aside: each is a
        per-store backend option (``stores.counts.tarsnap.ttl.ms`` reads as option ttl.ms of store counts.tarsnap
        too) or a typo, which would otherwise silently create a second store with default settings."""
        declared = {name for name, keys in self.store_keys.items() if "backup.factories" in keys}
        for name in [n for n in self.store_keys if n not in declared]:
            self.undeclared[name] = self.store_keys.pop(name)

    def _report_undeclared(self, name: str, option: str) -> None:
        key = f"stores.{name}.{option}"
        declared = sorted(self.store_keys)
        near = difflib.get_close_matches(name, declared, n=1, cutoff=0.6)
        hint = (
            f"did you mean stores.{near[0]}.{option}?"
            if near
            else f"declare it with stores.{name}.backup.factories=changelog (or another backend)"
        )
        self.problems.append(
            f"{key}: store {name!r} is not declared (a store exists when stores.<name>.backup.factories is "
            f"set; declared stores: {', '.join(declared) or 'none'}); {hint}"
        )

    def _value(self, key: str, spec: OptionSpec) -> Any:
        value, problem = parse_one(key, spec, self.config.get(key))
        if problem is not None:
            self.problems.append(problem)
        return value

    def _url(self) -> str | None:
        url: str | None = self._value("blob.store.url", GLOBAL_OPTIONS["blob.store.url"])
        if url is None:
            return None
        scheme = urlsplit(url).scheme
        schemes = known_blob_store_schemes()
        if "://" not in url or scheme not in schemes:
            known = ", ".join(f"{s}://" for s in schemes)
            self.problems.append(
                f"blob.store.url={redact(url)!r} is not valid: unknown scheme {scheme!r}; allowed: a URL starting "
                f"with {known}"
            )
            return None
        return url

    def _blob_store_options(self, url: str | None) -> ParsedOptions | None:
        """Parse the ``blob.store.*`` keys with the store class of the URL's scheme (its ``parse_options``: the one
        parse of these values); a key another scheme takes is an error naming it. Without a usable URL the keys are
        checked against every scheme's options, for the report."""
        scheme = urlsplit(url).scheme if url else None
        store_class: type[BlobStore] | None = None
        schemas: dict[str, Mapping[str, OptionSpec]] | None = None
        if scheme is not None:
            try:
                store_class = blob_store_class(scheme)
            except ConfigError as exc:
                self.problems.append(f"blob.store.url: {exc}")
                scheme = None
        if store_class is not None:
            self.blob_store_schema = store_class.options
        else:
            schemas = blob_store_option_schemas()
            self.blob_store_schema = {o: spec for schema in schemas.values() for o, spec in schema.items()}
        given: dict[str, Any] = {}
        for key in self.blob_store_keys:
            option = key[len("blob.store.") :]
            if option in self.blob_store_schema:
                given[option] = self.config[key]
                continue
            schemas = schemas if schemas is not None else blob_store_option_schemas()
            takers = [f"{other}://" for other, schema in schemas.items() if option in schema]
            if takers:
                self.problems.append(
                    f"{key}: not an option of {scheme}:// blob stores (blob.store.url is {scheme}://...); it is taken "
                    f"by {', '.join(takers)} only (see docs/configuration.md)"
                )
            else:
                self.unknown_keys.append(key)
        try:
            if store_class is not None:
                return store_class.parse_options(given)
            parse_options(self.blob_store_schema, given, name="every blob store's options", prefix="blob.store.")
        except ConfigError as exc:
            self.problems.extend(str(exc).splitlines())
        return None  # a problem is reported: no Settings are built

    def _store(self, name: str) -> StoreSettings | None:
        keys = self.store_keys[name]
        prefix = f"stores.{name}."
        parsed = {option: self._value(prefix + option, spec) for option, spec in STORE_OPTIONS.items()}
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
                    f"{key}={keys.get(key[len(prefix) :])!r} is not valid: {resolved.canonical_name!r} is listed "
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
        if (keys.get("migration.id") is None) != (keys.get("migration.function") is None):
            given, missing = (
                ("migration.id", "migration.function")
                if keys.get("migration.id") is not None
                else ("migration.function", "migration.id")
            )
            self.problems.append(
                f"{prefix}{given} is set but {prefix}{missing} is not: a migration needs both, its "
                "name (recorded once it ran) and its function"
            )
            return None
        kind = parsed["kind"]
        if keys.get("subkey.serde") is not None and kind != "map":
            self.problems.append(
                f"{prefix}subkey.serde is set but store {name!r} is of kind {kind!r}: sub-keys are a map store's; "
                f"allowed: set {prefix}kind=map, or unset {prefix}subkey.serde"
            )
            return None
        if kind != "value" and keys.get("migration.id") is not None:
            self.problems.append(
                f"{prefix}migration.id is set but store {name!r} is of kind {kind!r}: a migration rewrites the "
                "values of a value store only; allowed: a compatible change of the record class (read as it is), or "
                "a new store"
            )
            return None
        return StoreSettings(
            name=name,
            backup_factories=tuple(backups),
            restore_factories=tuple(restores),
            **{attribute: parsed[option] for attribute, option in config_keys(StoreSettings).items()},
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
            options, problems = _job_wide_backend_options(resolved, self.config)
            backend_options[canonical] = _ReadOnlyMapping(options)
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

    def _store_backend_options(
        self, stores: Mapping[str, StoreSettings | None], backend_options: Mapping[str, Mapping[str, Any]]
    ) -> dict[str, Mapping[str, Mapping[str, Any]]]:
        """Read the ``stores.<name>.<backend>.<option>`` keys (statebackend.config.backend_keys): each one's
        store and backend, then its value by the backend's schema over the job-wide options. A key that reads no way
        is reported as a typo; one that reads two ways, as ambiguous."""
        store_backends = {name: _backends_of(store) for name, store in stores.items() if store is not None}
        spellings = {name: r.canonical_name for name, r in self.resolved.items() if r is not None}
        # the dotted path of a short-named backend: read, to say which name to write instead
        spellings.update({target: short for short, target in known_factories().items() if target not in spellings})
        by_canonical = {r.canonical_name: r for r in self.resolved.values() if r is not None}

        def declared(reading: StoreBackendKey) -> bool:
            return reading.option in by_canonical[reading.backend].factory.options

        for name, options in self.store_keys.items():  # a declared store's option may read as another's backend's
            for option in options:
                key = f"stores.{name}.{option}"
                for reading in filter(declared, read_store_backend_key(key, store_backends, spellings)):
                    self.problems.append(
                        f"{key}: reads two ways: option {option} of store {name!r}, or option {reading.option} of "
                        f"backend {reading.backend!r} of store {reading.store!r}; rename one of the stores"
                    )
        given: dict[tuple[str, str], dict[str, Any]] = {}
        # (key, the problem of its store name read as a store option, (store, option) of an undeclared store's key)
        candidates: list[tuple[str, str | None, tuple[str, str] | None]] = [
            (key, problem, None) for key, problem in self.store_backend_keys.items()
        ]
        candidates += [
            (f"stores.{name}.{option}", None, (name, option))
            for name, options in self.undeclared.items()
            for option in sorted(options)
        ]
        for key, name_problem, undeclared in candidates:
            readings = read_store_backend_key(key, store_backends, spellings)
            if len(readings) > 1 and len(meant := list(filter(declared, readings))) == 1:
                readings = meant  # the one reading that names an option the backend has
            if len(readings) == 1 and readings[0].spelled == readings[0].backend:
                reading = readings[0]
                if self.config[key] is not None:  # None counts as unset, as everywhere
                    given.setdefault((reading.store, reading.backend), {})[reading.option] = self.config[key]
            elif readings:
                self._report_unusable_reading(key, readings)
            elif undeclared is not None:
                self._report_undeclared(*undeclared)
            elif name_problem is not None:
                self.problems.append(name_problem)
            elif not self._report_backend_not_of_the_store(key, store_backends):
                self.unknown_keys.append(key)
        per_store: dict[str, dict[str, Mapping[str, Any]]] = {}
        for (store, backend), options in sorted(given.items()):
            parsed, problems = parse_backend_options(
                by_canonical[backend],
                options,
                prefix=store_backend_prefix(store, backend),
                inherited=backend_options.get(backend, {}),
            )
            self.problems.extend(problems)
            per_store.setdefault(store, {})[backend] = _ReadOnlyMapping(parsed)
        return {store: _ReadOnlyMapping(backends) for store, backends in per_store.items()}

    def _report_unusable_reading(self, key: str, readings: list[StoreBackendKey]) -> None:
        if len(readings) > 1:
            ways = " or ".join(f"option {r.option} of backend {r.backend!r} of store {r.store!r}" for r in readings)
            self.problems.append(f"{key}: reads more than one way: {ways}; rename one of the stores")
            return
        reading = readings[0]
        self.problems.append(
            f"{key}: options of backend {reading.spelled!r} are read under its canonical name; write it as "
            f"{store_backend_prefix(reading.store, reading.backend)}{reading.option}"
        )

    def _report_backend_not_of_the_store(self, key: str, store_backends: Mapping[str, tuple[str, ...]]) -> bool:
        """Report a per-store option of a backend the store does not use (it would never be read); False when the key
        names no known backend after a declared store's name."""
        backends = {*known_factories(), *(r.canonical_name for r in self.resolved.values() if r is not None)}
        for store, own in store_backends.items():
            head = f"stores.{store}."
            if not key.startswith(head):
                continue
            backend = next((b for b in sorted(backends) if key[len(head) :].startswith(b + ".")), None)
            if backend is not None:
                self.problems.append(
                    f"{key}: store {store!r} is not backed up or restored by backend {backend!r} (its backends: "
                    f"{', '.join(own)}); a stores.<name>.<backend>.<option> key sets an option of one of the "
                    f"store's own backends: name it in stores.{store}.backup.factories or restore.factories, or "
                    "remove the key"
                )
                return True
        return False

    def _report_unknown_keys(self, stores: Mapping[str, StoreSettings | None]) -> None:
        known = [*GLOBAL_OPTIONS, *("blob.store." + option for option in self.blob_store_schema)]
        known += [f"stores.{name}.{option}" for name in stores for option in STORE_OPTIONS]
        by_canonical = {r.canonical_name: r for r in self.resolved.values() if r is not None}
        for canonical, resolved in by_canonical.items():
            known += [f"{canonical}.{option}" for option in resolved.factory.options]
        for name, store in stores.items():
            for canonical in _backends_of(store) if store is not None else ():
                prefix = store_backend_prefix(name, canonical)
                known += [prefix + option for option in by_canonical[canonical].factory.options]
        for key in sorted(self.unknown_keys):
            # a key under a declared store's name is that store's: no other reading of a store name is suggested
            # (stores.counts.tarsnap.keep is no typo of option key.serde of a store counts.tarsnap)
            owner = max((name for name in stores if key.startswith(f"stores.{name}.")), key=len, default=None)
            candidates = known if owner is not None else known + _store_key_candidates(key)
            near = difflib.get_close_matches(key, candidates, n=1, cutoff=0.8)
            if near:
                hint = f"did you mean {near[0]}?"
            elif owner is not None:
                hint = _known_of_store(owner, stores[owner])
            else:
                hint = _known_under(key, self.blob_store_schema)
            self.problems.append(f"{key}: unknown key; {hint}")
        for key in sorted(self.other_keys):
            # A near miss of one of our keys outside our prefixes (tsak.commit.ms) would otherwise be ignored.
            near = difflib.get_close_matches(key, known + _store_key_candidates(key, any_prefix=True), n=1, cutoff=0.9)
            if near:
                self.problems.append(f"{key}: unknown key; did you mean {near[0]}?")


def _job_wide_backend_options(resolved: ResolvedFactory, config: Mapping[str, Any]) -> tuple[dict[str, Any], list[str]]:
    """Validate the ``<canonical>.*`` keys of ``config`` against the factory's ``options`` schema; fill defaults."""
    prefix = resolved.canonical_name + "."
    given = {
        key[len(prefix) :]: value for key, value in config.items() if isinstance(key, str) and key.startswith(prefix)
    }
    return parse_backend_options(resolved, given, prefix=prefix)


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


def _backends_of(store: StoreSettings) -> tuple[str, ...]:
    """The canonical names of a store's backends: those it backs up to, then those it only restores from."""
    return tuple(dict.fromkeys((*store.backup_factories, *store.restore_factories)))


def _known_of_store(name: str, store: StoreSettings | None) -> str:
    """What may be written under ``stores.<name>.``, for an unknown key of a declared store."""
    allowed = f"allowed: stores.{name}.<option> with <option> one of {', '.join(STORE_OPTIONS)}"
    if store is None:
        return allowed
    backends = ", ".join(_backends_of(store))
    return (
        f"{allowed}; or stores.{name}.<backend>.<option> with <backend> one of the store's backends ({backends}) "
        "and <option> one of its options (see docs/configuration.md)"
    )


def _known_under(key: str, blob_store_schema: Mapping[str, OptionSpec]) -> str:
    """What may be written under the key's prefix, for an unknown key with no close match."""
    if key.startswith("stores."):
        return (
            "allowed: stores.<name>.<option> with <option> one of " + ", ".join(STORE_OPTIONS) + "; or "
            "stores.<name>.<backend>.<option> for an option of one of the store's backends (see "
            "docs/configuration.md)"
        )
    first = key.split(".", 1)[0] + "."
    known = [k for k in (*GLOBAL_OPTIONS, *("blob.store." + o for o in blob_store_schema)) if k.startswith(first)]
    return "known keys: " + ", ".join(known) + " (see docs/configuration.md)"


def _missing_url_message(config: Mapping[str, Any]) -> str:
    message = "blob.store.url is missing: set it to file:///path, az://container/prefix or s3://bucket/prefix"
    near = difflib.get_close_matches("blob.store.url", [k for k in config if isinstance(k, str)], n=1, cutoff=0.8)
    return message + (f" (is {near[0]} a misspelling of it?)" if near else "")


_SECRET_KEY_RE = re.compile(r"(password|secret|token|credential|connection\.string|sas|account\.key)", re.IGNORECASE)


def _is_secret_key(key: str) -> bool:
    return bool(_SECRET_KEY_RE.search(key))


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
