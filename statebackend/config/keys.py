"""The keys statebackend owns, declared once: ``job.*``, ``state.*``, ``task.*``, ``metrics.*``, ``blob.store.url``
and ``stores.<name>.*``. The other ``blob.store.*`` keys are declared by the blob stores, each in its class's
``options`` (statebackend.blobstores), and validated against the schema of the URL's scheme. Each spec's default is the
key's only default (Settings and StoreSettings take theirs from here). docs/configuration.md lists every key with its
default (tests/test_config.py and tests/test_one_source.py check it)."""

from __future__ import annotations

import os
import re
from collections.abc import Mapping
from typing import Any

from statebackend.config.names import parse_name
from statebackend.errors import ConfigError
from statebackend.options import (
    OptionSpec,
    parse_bool,
    parse_bytes,
    parse_choice,
    parse_duration_ms,
    parse_int,
    parse_list,
    parse_path,
    parse_str,
    value_error,
)
from statebackend.redact import redact
from statebackend.serdes import RECORD_PREFIX, SERDE_NAMES, record_class
from statebackend.serdes.record import import_named

#: the serde names ``stores.<name>.key.serde`` / ``msg.serde`` take: those statebackend.serdes defines (its list);
#: ``msg.serde`` also takes ``record:<module>:<Class>``
SERDES = SERDE_NAMES

_RECORD_ALLOWED = "record:<module>:<Class> (an attrs class, dataclass or NamedTuple; values only)"
_parse_named_serde = parse_choice(*SERDES)


def _parse_key_serde(key: str, raw: Any) -> str:
    """A named serde; a record serde is refused saying why (a key's bytes must never change with a class)."""
    if isinstance(raw, type) or (isinstance(raw, str) and raw.strip().startswith(RECORD_PREFIX)):
        raise value_error(
            key,
            raw,
            "a record serde is for values (msg.serde) only: a key must keep its bytes",
            "one of " + ", ".join(SERDES),
        )
    return _parse_named_serde(key, raw)


def _parse_msg_serde(key: str, raw: Any) -> str:
    """A named serde, or ``record:<module>:<Class>`` (also given as the class itself), imported and checked here:
    a class that cannot be imported or has a field type a record cannot store fails on the driver, naming the key."""
    if isinstance(raw, type):
        spec = f"{RECORD_PREFIX}{raw.__module__}:{raw.__qualname__}"
        try:
            found = record_class(spec).cls
        except ConfigError as exc:
            raise value_error(key, raw, str(exc), _RECORD_ALLOWED) from None
        if found is not raw:
            raise value_error(
                key,
                raw,
                f"{spec} imports another class than the one given (defined in a function, or redefined?)",
                _RECORD_ALLOWED,
            )
        return spec
    if isinstance(raw, str) and raw.strip().startswith(RECORD_PREFIX):
        try:
            record_class(raw.strip())
        except ConfigError as exc:
            raise value_error(key, raw, str(exc), _RECORD_ALLOWED) from None
        return raw.strip()
    try:
        return _parse_named_serde(key, raw)
    except ConfigError as exc:
        raise ConfigError(f"{exc}, or {_RECORD_ALLOWED}") from None


def _parse_function(key: str, raw: Any) -> str:
    """``<module>:<function>``, imported and checked callable here (on the driver, naming the key)."""
    spec = parse_str(r"[A-Za-z_][\w.]*:[A-Za-z_][\w.]*")(key, raw)
    try:
        function = import_named(spec, "function")
    except ConfigError as exc:
        raise value_error(key, raw, str(exc), "<module>:<function>, importable where the tasks run") from None
    if not callable(function):
        raise value_error(
            key,
            raw,
            f"{spec} is a {type(function).__name__}, not a function",
            "<module>:<function>, importable where the tasks run",
        )
    return spec


METRICS_OTEL = ("auto", "on", "off")

#: the values ``stores.<name>.kind`` takes (statebackend.store.kinds)
STORE_KINDS = ("value", "list", "map")


def _parse_versions(key: str, raw: Any) -> tuple[int, ...]:
    versions = parse_list(parse_int(min=1, max=2))(key, raw)
    if len(set(versions)) != len(versions):
        raise value_error(key, raw, "a version is listed twice", "a comma-separated list of 1 and 2, no repeats")
    return versions


def _parse_switch_interval(key: str, raw: Any) -> int:
    value = parse_int(min=0, max=100_000)(key, raw)
    if 0 < value < 50:
        raise value_error(
            key,
            raw,
            "too short: threads would trade the GIL more than they run",
            "0 (leave the interpreter's interval) or 50 to 100000 microseconds",
        )
    return value


def _parse_push_url(key: str, raw: Any) -> str:
    url = parse_str()(key, raw)
    if not re.fullmatch(r"https?://[^\s/@]+(/\S*)?", url):
        raise value_error(
            key, redact(url), "not an http(s) URL without credentials", "http://host:port or https://host:port/path"
        )
    return url


_DEFAULT_POOL_SIZE = min(32, 4 * (os.cpu_count() or 1))

#: full key -> spec, for the keys outside ``blob.store.*`` and ``stores.<name>.*``
GLOBAL_OPTIONS: Mapping[str, OptionSpec] = {
    "job.name": OptionSpec(parse_name(), "job", "name of the streaming application; the first part of every blob name"),
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
    "task.thread.switch.interval.us": OptionSpec(
        _parse_switch_interval,
        200,
        "at most this many microseconds between two GIL handovers of the process while threads compete (Python's "
        "sys.setswitchinterval, only ever lowered; 0: left as it is), so the commit's and the appliers' threads are "
        "not held up by milliseconds at each system call beside CPU-bound processing",
    ),
    "task.gc.freeze": OptionSpec(
        parse_bool(),
        True,
        "at each Spark task's start in a Python worker, collect the process's garbage and move what survives out of "
        "later collections (Python's gc.freeze; everything again every 64 tasks, so nothing frozen leaks for long; "
        "a process that froze objects itself is left alone): PySpark's reused workers run a full collection after "
        "every task, about 45 ms of held GIL with pyspark, pyarrow and pandas loaded, in which a task's upload and "
        "the worker's next task wait",
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
    "metrics.otel": OptionSpec(
        parse_choice(*METRICS_OTEL),
        "auto",
        "mirror metrics into the OpenTelemetry metrics API: auto (when opentelemetry-api is installed), on (required), "
        "off",
    ),
    "metrics.prometheus.port": OptionSpec(
        parse_int(min=0, max=65535),
        None,
        "serve the process's metrics at http://<host>:<port>/metrics (0: a free port; unset: no endpoint)",
    ),
    "metrics.prometheus.host": OptionSpec(
        parse_str(), "127.0.0.1", "address the metrics endpoint binds (0.0.0.0 or :: to be scraped from elsewhere)"
    ),
    "metrics.prometheus.textfile.dir": OptionSpec(
        parse_path(), None, "write each task's metrics to <dir>/statebackend-<job>-<task>.prom when it closes"
    ),
    "metrics.prometheus.push.url": OptionSpec(
        _parse_push_url, None, "PUT each task's metrics to this Pushgateway when it closes"
    ),
}

#: ``stores.<name>.<key>`` -> spec
STORE_OPTIONS: Mapping[str, OptionSpec] = {
    "backup.factories": OptionSpec(
        parse_list(),
        None,
        "state backends the store is backed up to at every commit, in order; setting it declares the store (required)",
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
    "kind": OptionSpec(
        parse_choice(*STORE_KINDS),
        "value",
        "what the store holds per key: value (one value), list (values in append order: append without reading the "
        "list) or map (values under sub-keys, in sub-key byte order); set it when the store is created",
    ),
    "key.serde": OptionSpec(_parse_key_serde, "bytes", "how keys are encoded: " + ", ".join(SERDES)),
    "subkey.serde": OptionSpec(
        _parse_key_serde, "bytes", "how the sub-keys of a map store (kind = map) are encoded: " + ", ".join(SERDES)
    ),
    "msg.serde": OptionSpec(
        _parse_msg_serde,
        "bytes",
        "how values are encoded: " + ", ".join(SERDES) + ", or record:<module>:<Class> (values as instances of an "
        "attrs class, dataclass or NamedTuple whose shape may change between deployments)",
    ),
    "migration.id": OptionSpec(
        parse_name(),
        None,
        "a name for a rewrite of every value of the store by migration.function, run once: at the first open of a "
        "checkpoint that does not record it, its writes and the name landing in one checkpoint; set both or neither",
    ),
    "migration.function": OptionSpec(
        _parse_function,
        None,
        "<module>:<function> called as function(key, old value) for every value of the store at the migration: it "
        "returns the new value (None deletes the key). An old record value comes as a dict of its fields",
    ),
    "write.batch.max.bytes": OptionSpec(
        parse_bytes(min=1), "64MiB", "memory bound of the write batch between two commits; a larger batch spills"
    ),
    "lmdb.map.size": OptionSpec(parse_bytes(min=1 << 20), "1TiB", "LMDB map size: the largest the store can grow"),
    "ttl.ms": OptionSpec(
        parse_duration_ms(min=1),
        None,
        "time to live of a key after its last write (unset: keys live until deleted); expired keys are invisible to "
        "reads and removed by the sweep. Set it when the store is created: it cannot be turned on or off later",
    ),
    "ttl.sweep.keys": OptionSpec(
        parse_int(min=0),
        10_000,
        "keys the TTL sweep examines at each commit, continuing where the last one stopped; expired ones are deleted "
        "(0: never sweep; expired keys stay invisible)",
    ),
}

OWNED_PREFIXES = ("job.", "state.", "blob.store.", "stores.", "task.", "metrics.")
