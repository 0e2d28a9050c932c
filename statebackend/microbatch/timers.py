"""Per-key timers of the Spark driver's tasks: registered by the task's function, fired by the batch that reaches
their time, kept as state in a store of the task that the framework manages.

Contract:

- A timer is ``(key, at_ms, kind)``: ``key`` is the key column value of a row the task got (a tuple of them for
  several key columns), ``at_ms`` ms since the epoch, ``kind`` :data:`PROCESSING` (due once the batch clock, the
  ``now.ms`` TTL stores use, reaches it) or :data:`EVENT` (due once the batch's watermark reaches it:
  ``statebackend.microbatch.watermark``). Registering the same timer twice keeps one.
- Timers live in the task's store :data:`TIMERS_STORE`, declared by the driver with the backends of the job's own
  stores (:func:`with_timer_store`), restored and committed with them: a timer fired by a batch is deleted in the
  same commit as the state its handler changed, so a replay or a retry (which restores the checkpoint before the
  batch) fires it again with the same clock and watermark, and a batch that committed fired it once.
- Each batch, after the task's function, every due timer is taken out of the store and the handler gets them in
  time order (then kind, then key bytes: a replay sees the same order). Timers the handler registers are due at the
  next batch at the earliest.
- Records (bytes): ``b"D" kind time key`` orders timers by time for firing, ``b"K" len key kind time`` finds a key's
  timers; ``key`` is a tagged encoding of the key column values normalized by their Spark types, so a timer's key
  reads back as the values that hash to its key group (a rescale moves both records with their key group).
"""

from __future__ import annotations

import builtins
import datetime
import json
import math
import struct
from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence
from typing import Any

import attrs

from statebackend.config import Settings
from statebackend.errors import ConfigError
from statebackend.microbatch.keygroups import _epoch_micros, key_group_range, spark_hash, task_of_group

__all__ = [
    "EVENT",
    "KINDS",
    "PROCESSING",
    "TIMERS_STORE",
    "Timer",
    "Timers",
    "key_text",
    "owner_check",
    "refuse_dropping_timers",
    "stored_timers",
    "take_due",
    "timer_key_columns",
    "with_timer_store",
]

#: the reserved store of a task's timers; ``stores.statebackend-timers.*`` may set its options, not its serdes or TTL
TIMERS_STORE = "statebackend-timers"
PROCESSING = "processing"
EVENT = "event"
KINDS = (PROCESSING, EVENT)

#: the timer store's options the framework fixes
_FIXED_OPTIONS = ("key.serde", "msg.serde", "ttl.ms", "ttl.sweep.keys")
_KIND_BYTES = {PROCESSING: b"p", EVENT: b"e"}
_KIND_NAMES = {value: name for name, value in _KIND_BYTES.items()}
_DUE, _BY_KEY = b"D", b"K"
_TIME = struct.Struct(">Q")
_LENGTH = struct.Struct(">H")
#: times beyond +-2**62 ms (146 million years) are refused: the encoding adds 2**63 and the due bound adds one
_TIME_LIMIT = 1 << 62
#: the store's key limit (LMDB, 511 bytes) less the longest record's own bytes
_MAX_KEY_BYTES = 511 - 1 - _LENGTH.size - 1 - _TIME.size


@attrs.frozen
class Timer:
    """One timer: the key it was registered for (the key column value, a tuple for several key columns), its time in
    ms since the epoch, and its kind (:data:`PROCESSING` or :data:`EVENT`)."""

    key: Any
    at_ms: int
    kind: str

    @property
    def at(self) -> datetime.datetime:
        """The time as an aware UTC datetime."""
        return datetime.datetime(1970, 1, 1, tzinfo=datetime.UTC) + datetime.timedelta(milliseconds=self.at_ms)


class Timers:
    """A task's timers for its function and its timer handler (``stores.timers``).

    ``key``: the key column value of a row this task got (a tuple for several key columns). ``at``: ms since the
    epoch (int), or a datetime (aware: its instant; naive: local time of the executor's process, as Python's
    ``datetime.timestamp()`` and PySpark's ``Row`` timestamps have it). ``kind``: ``"processing"`` (the batch clock,
    ``stores.now_ms``) or ``"event"`` (the watermark, ``stores.watermark_ms``)."""

    #: timers this object added (registering one that exists adds none) and deleted (not by firing): the executor
    #: reports them as the metrics ``timers.registered`` and ``timers.deleted``
    registered: int
    deleted: int

    def __init__(
        self,
        store: Any | None,
        *,
        key_types: Sequence[str] = (),
        check_owner: Callable[[Any, tuple[Any, ...]], None] | None = None,
    ) -> None:
        self._store = store
        self._key_types = tuple(key_types)
        self._check_owner = check_owner
        self.registered = 0
        self.deleted = 0

    def register(self, key: Any, at: Any, *, kind: str = PROCESSING) -> None:
        """A timer for ``key`` at ``at``, of ``kind``; registering one that exists changes nothing."""
        store, encoded, kind_byte, at_ms = self._parts(key, at, kind)
        due = _due_record(kind_byte, at_ms, encoded)
        if store.contains(due):
            return
        store.put_many([due, _key_record(encoded, kind_byte, at_ms)], [b"", b""])
        self.registered += 1

    def delete(self, key: Any, at: Any, *, kind: str = PROCESSING) -> bool:
        """Delete ``key``'s timer at ``at`` of ``kind``; whether there was one."""
        store, encoded, kind_byte, at_ms = self._parts(key, at, kind)
        due = _due_record(kind_byte, at_ms, encoded)
        if not store.contains(due):
            return False
        store.delete_many([due, _key_record(encoded, kind_byte, at_ms)])
        self.deleted += 1
        return True

    def register_many(self, keys: Iterable[Any], at: Any, *, kind: str = PROCESSING) -> int:
        """A timer for each of ``keys`` at ``at`` (one time for all, or a sequence of times, one per key), of
        ``kind``: one encoding pass, one read and one write of the store. Timers that exist (or come twice) are
        kept once; returns how many were added."""
        dues, records = self._records_many(keys, at, kind, "register_many")
        if not dues:
            return 0
        store = self._writable()
        new = {
            due: record for due, record, found in zip(dues, records, store.get_many(dues), strict=True) if found is None
        }
        if new:
            store.put_many([*new, *new.values()], [b""] * (2 * len(new)))
        self.registered += len(new)
        return len(new)

    def delete_many(self, keys: Iterable[Any], at: Any, *, kind: str = PROCESSING) -> int:
        """Delete the timer of each of ``keys`` at ``at`` (one time for all, or a sequence, one per key), of
        ``kind``, as :meth:`register_many` reads them; returns how many there were."""
        dues, records = self._records_many(keys, at, kind, "delete_many")
        if not dues:
            return 0
        store = self._writable()
        found = {
            due: record
            for due, record, value in zip(dues, records, store.get_many(dues), strict=True)
            if value is not None
        }
        if found:
            store.delete_many([*found, *found.values()])
        self.deleted += len(found)
        return len(found)

    def _records_many(self, keys: Iterable[Any], at: Any, kind: str, call: str) -> tuple[list[bytes], list[bytes]]:
        """The due and by-key records of ``keys`` at ``at`` (one time, or one per key), each timer once."""
        self._writable()
        kind_byte = _kind_byte(kind)
        keys = builtins.list(keys)
        if isinstance(at, (int, datetime.datetime)) or (hasattr(at, "item") and not hasattr(at, "__len__")):
            times = [to_ms(at)] * len(keys)
        else:
            try:
                times = [to_ms(value) for value in at]
            except TypeError:
                raise ConfigError(
                    f"Timers.{call}: at must be a time (ms since the epoch, or a datetime) or a sequence of them, "
                    f"one per key; got {at!r}"
                ) from None
            if len(times) != len(keys):
                raise ConfigError(
                    f"Timers.{call}: {len(keys)} keys but {len(times)} times; give one time for all the keys, "
                    "or one per key"
                )
        seen: dict[bytes, bytes] = {}
        for key, at_ms in zip(keys, times, strict=True):
            encoded, _ = self._encode(key)
            seen.setdefault(_due_record(kind_byte, at_ms, encoded), _key_record(encoded, kind_byte, at_ms))
        return builtins.list(seen), builtins.list(seen.values())

    def delete_all(self, key: Any, *, kind: str | None = None) -> int:
        """Delete every timer of ``key`` (of ``kind``, or of both kinds); how many there were."""
        timers = self._records_of(key, kind)
        records = [record for timer in timers for record in timer[2]]
        if records:
            self._writable().delete_many(records)
        self.deleted += len(timers)
        return len(timers)

    def pending(self) -> int:
        """How many timers the store holds now (each is two records): O(1), plus O(writes not yet committed)."""
        return int(self._writable().count()) // 2

    def list(self, key: Any, *, kind: str | None = None) -> builtins.list[Timer]:
        """``key``'s timers (of ``kind``, or of both kinds) in time order."""
        return [timer for timer, _, _ in sorted(self._records_of(key, kind), key=lambda t: (t[0].at_ms, t[1]))]

    def _records_of(self, key: Any, kind: str | None) -> builtins.list[tuple[Timer, bytes, tuple[bytes, bytes]]]:
        store = self._writable()
        encoded, _ = self._encode(key)
        prefix = _BY_KEY + _LENGTH.pack(len(encoded)) + encoded
        if kind is not None:
            prefix += _kind_byte(kind)
        found = []
        for record, _ in store.iter_prefix(prefix):
            kind_byte, at_ms = bytes(record[-9:-8]), _time_of(record[-8:])
            found.append(
                (
                    Timer(_key_of(decode_key(encoded)), at_ms, _KIND_NAMES[kind_byte]),
                    kind_byte,
                    (_due_record(kind_byte, at_ms, encoded), bytes(record)),
                )
            )
        return found

    def _parts(self, key: Any, at: Any, kind: str) -> tuple[Any, bytes, bytes, int]:
        store = self._writable()
        kind_byte = _kind_byte(kind)
        encoded, _ = self._encode(key)
        return store, encoded, kind_byte, to_ms(at)

    def _encode(self, key: Any) -> tuple[bytes, tuple[Any, ...]]:
        columns = normalize_key(key, self._key_types)
        if self._check_owner is not None:
            self._check_owner(key, columns)
        encoded = encode_key(columns)
        if len(encoded) > _MAX_KEY_BYTES:
            raise ConfigError(
                f"timer key {key!r} takes {len(encoded)} bytes encoded; a timer's key may take at most "
                f"{_MAX_KEY_BYTES} (the store's key limit less the timer's own bytes)"
            )
        return encoded, columns

    def _writable(self) -> Any:
        if self._store is None:
            raise ConfigError(
                "this job has no timers: give StatefulForeachBatch(on_timers=...), the function the "
                "due timers are handed to, to register timers"
            )
        return self._store


def take_due(timers: Timers, now_ms: int, watermark_ms: int | None) -> list[Timer]:
    """Every processing-time timer of ``timers`` at or before ``now_ms`` and event-time timer at or before
    ``watermark_ms`` (none without a watermark), deleted from the store, in time order (then kind, then key bytes):
    what the executor hands to ``on_timers``."""
    store = timers._writable()
    found: list[tuple[int, bytes, bytes]] = []
    for kind_byte, bound in ((_KIND_BYTES[PROCESSING], now_ms), (_KIND_BYTES[EVENT], watermark_ms)):
        if bound is None:
            continue
        prefix = _DUE + kind_byte
        end = prefix + _time_bytes(min(max(bound, -_TIME_LIMIT), _TIME_LIMIT) + 1)
        for record, _ in store.iter_range(prefix, end):
            found.append((_time_of(record[2:10]), kind_byte, bytes(record[10:])))
    if not found:
        return []
    found.sort()
    store.delete_many(
        [
            record
            for at_ms, kind_byte, encoded in found
            for record in (_due_record(kind_byte, at_ms, encoded), _key_record(encoded, kind_byte, at_ms))
        ]
    )
    return [Timer(_key_of(decode_key(encoded)), at_ms, _KIND_NAMES[kind_byte]) for at_ms, kind_byte, encoded in found]


def to_ms(at: Any) -> int:
    """ms since the epoch of ``at``: an int, or a datetime (aware: its instant; naive: local time)."""
    if hasattr(at, "item") and not isinstance(at, (int, datetime.datetime)):
        at = at.item()  # a numpy scalar
    if isinstance(at, datetime.datetime):
        value = _epoch_micros(at, local=True) // 1000
    elif isinstance(at, int) and not isinstance(at, bool):
        value = at
    else:
        raise ConfigError(f"a timer's time must be ms since the epoch (an int) or a datetime, got {at!r}")
    if not -_TIME_LIMIT <= value <= _TIME_LIMIT:
        raise ConfigError(f"a timer's time must be within +-2**62 ms of the epoch, got {value}")
    return value


def normalize_key(key: Any, key_types: Sequence[str]) -> tuple[Any, ...]:
    """The key column values of ``key`` (one column: the value; several: a tuple or list of them), each normalized
    to the Python type its Spark type reads as, so equal keys encode alike (``key_types`` empty: as given)."""
    columns = len(key_types)
    if columns > 1 or (columns == 0 and isinstance(key, tuple)):
        if not isinstance(key, (tuple, builtins.list)) or (columns and len(key) != columns):
            raise ConfigError(f"timer key {key!r} must be a tuple of the {columns} key column values")
        values = tuple(key)
    elif isinstance(key, tuple) and len(key) == 1:
        values = key
    else:
        values = (key,)
    types = key_types or ("",) * len(values)
    return tuple(_normalize(key, value, type_name) for value, type_name in zip(values, types, strict=True))


_INTEGRAL = ("byte", "short", "integer", "long")


def _normalize(key: Any, value: Any, type_name: str) -> Any:
    if value is not None and hasattr(value, "item") and not isinstance(value, (str, bytes, datetime.date)):
        value = value.item()  # a numpy scalar
    if isinstance(value, datetime.datetime) and type(value) is not datetime.datetime:  # a pandas Timestamp
        value = datetime.datetime(
            value.year,
            value.month,
            value.day,
            value.hour,
            value.minute,
            value.second,
            value.microsecond,
            tzinfo=value.tzinfo,
            fold=value.fold,
        )
    if value is None or not type_name:
        return value
    wanted: tuple[type, ...]
    if type_name in _INTEGRAL:
        wanted = (int,)
    elif type_name in ("float", "double"):
        if isinstance(value, (int, float)) and not isinstance(value, bool):
            number = float(value)
            return float("nan") if math.isnan(number) else number + 0.0  # -0.0 is 0.0, as Spark hashes it
        wanted = (float,)
    elif type_name == "string":
        wanted = (str,)
    elif type_name == "binary":
        if isinstance(value, (bytearray, memoryview)):
            return bytes(value)
        wanted = (bytes,)
    elif type_name == "boolean":
        wanted = (bool,)
    elif type_name == "date":
        if isinstance(value, datetime.date) and not isinstance(value, datetime.datetime):
            return value
        wanted = (datetime.date,)
    elif type_name in ("timestamp", "timestamp_ntz"):
        wanted = (datetime.datetime,)
    else:
        return value
    if not isinstance(value, wanted) or (isinstance(value, bool) and bool not in wanted):
        raise ConfigError(
            f"timer key {key!r}: {value!r} is not a value of a {type_name} key column; a timer's key "
            "is the key column value of a row (a tuple of them for several key columns)"
        )
    return value


def encode_key(values: tuple[Any, ...]) -> bytes:
    """The tagged bytes of normalized key column values (each tag orders values of one type by their bytes)."""
    parts: builtins.list[bytes] = []
    for value in values:
        if value is None:
            parts.append(b"\x00")
        elif isinstance(value, bool):
            parts.append(b"\x01\x01" if value else b"\x01\x00")
        elif isinstance(value, int):
            if not -(1 << 63) <= value < 1 << 63:
                raise ConfigError(f"timer key value {value} does not fit a 64-bit key column")
            parts.append(b"\x02" + struct.pack(">q", value))
        elif isinstance(value, float):
            parts.append(b"\x03" + struct.pack(">d", value))
        elif isinstance(value, str):
            data = value.encode("utf-8")
            parts.append(b"\x04" + _LENGTH.pack(len(data)) + data)
        elif isinstance(value, bytes):
            parts.append(b"\x05" + _LENGTH.pack(len(value)) + value)
        elif isinstance(value, datetime.datetime):
            aware = value.tzinfo is not None and value.utcoffset() is not None
            parts.append((b"\x08" if aware else b"\x07") + struct.pack(">q", _epoch_micros(value, local=False)))
        elif isinstance(value, datetime.date):
            parts.append(b"\x06" + struct.pack(">i", (value - datetime.date(1970, 1, 1)).days))
        else:
            raise ConfigError(
                f"a timer key value of type {type(value).__name__} ({value!r}) cannot be stored; key "
                "columns of type string, binary, boolean, integral, float, double, date or timestamp"
            )
    return b"".join(parts)


_EPOCH = datetime.datetime(1970, 1, 1)


def decode_key(data: bytes) -> tuple[Any, ...]:
    """The key column values :func:`encode_key` encoded."""
    values: builtins.list[Any] = []
    position = 0
    while position < len(data):
        tag = data[position]
        position += 1
        if tag == 0:
            values.append(None)
        elif tag == 1:
            values.append(data[position] == 1)
            position += 1
        elif tag in (2, 3, 7, 8):
            (number,) = struct.unpack_from(">d" if tag == 3 else ">q", data, position)
            position += 8
            if tag == 7:
                number = _EPOCH + datetime.timedelta(microseconds=number)
            elif tag == 8:
                number = (_EPOCH + datetime.timedelta(microseconds=number)).replace(tzinfo=datetime.UTC)
            values.append(number)
        elif tag in (4, 5):
            (length,) = _LENGTH.unpack_from(data, position)
            position += _LENGTH.size
            raw = bytes(data[position : position + length])
            position += length
            values.append(raw.decode("utf-8") if tag == 4 else raw)
        elif tag == 6:
            (days,) = struct.unpack_from(">i", data, position)
            position += 4
            values.append(datetime.date(1970, 1, 1) + datetime.timedelta(days=days))
        else:
            raise ConfigError(f"a timer record holds an unknown key tag {tag}: written by a newer statebackend?")
    return tuple(values)


def timer_key_columns(record: bytes) -> tuple[Any, ...]:
    """The key column values of a timer store record (either index): how a rescale routes it."""
    record = bytes(record)
    if record[:1] == _DUE:
        return decode_key(record[10:])
    if record[:1] == _BY_KEY:
        (length,) = _LENGTH.unpack_from(record, 1)
        return decode_key(record[1 + _LENGTH.size : 1 + _LENGTH.size + length])
    raise ConfigError(f"the timer store holds a record that is no timer ({record[:16]!r}...)")


def stored_timers(store: Any) -> Iterator[Timer]:
    """Every timer of a task's timer store (its raw bytes view), by kind, then time."""
    for record, _ in store.iter_prefix(_DUE):
        record = bytes(record)
        yield Timer(_key_of(decode_key(record[10:])), _time_of(record[2:10]), _KIND_NAMES[record[1:2]])


def key_text(key: Any) -> str:
    """A timer's key as ``read_state`` shows it: a string key as itself, any other key as JSON (a tuple as an array,
    bytes as hex, dates and timestamps in ISO 8601)."""
    if isinstance(key, str):
        return key

    def plain(value: Any) -> Any:
        if isinstance(value, bytes):
            return value.hex()
        if isinstance(value, (datetime.date, datetime.datetime)):
            return value.isoformat()
        raise TypeError(type(value).__name__)

    return json.dumps(list(key) if isinstance(key, tuple) else key, default=plain, separators=(",", ":"))


def owner_check(
    index: int, num_tasks: int, key_groups: int, key_types: Sequence[str]
) -> Callable[[Any, tuple[Any, ...]], None]:
    """What refuses a timer whose key task ``index`` does not own: a key that does not hash as the key columns, or
    whose key group is another task's (its rows never come here, and a rescale would refuse it later)."""
    mine = key_group_range(index, num_tasks, key_groups)

    def check(key: Any, columns: tuple[Any, ...]) -> None:
        try:
            group = spark_hash(columns, key_types) % key_groups
        except (TypeError, ConfigError) as exc:
            raise ConfigError(
                f"timer key {key!r} does not hash as the key columns ({', '.join(key_types)}): {exc}. "
                "A timer's key is the key column value of a row (a tuple of them for several)"
            ) from exc
        if group not in mine:
            raise ConfigError(
                f"timer key {key!r} is of key group {group}, owned by "
                f"task-{task_of_group(group, num_tasks, key_groups)}, not task-{index}: a task registers timers for "
                "the keys of its own rows only (the key column value, a tuple of them for several)"
            )

    return check


def refuse_dropping_timers(name: str, starts: Sequence[Any]) -> None:
    """A job without ``on_timers`` whose state holds a timer store (the checkpoints a batch starts from name it) is
    refused: its commit would drop every pending timer."""
    if any(entry is not None and TIMERS_STORE in getattr(entry.checkpoint, "serdes", {}) for entry in starts):
        raise ConfigError(
            f"{name}: the state holds timers (store {TIMERS_STORE!r}) but StatefulForeachBatch has no on_timers: "
            "committing without it would drop every pending timer. Give on_timers (a handler that ignores the timers "
            "it gets fires and deletes them)"
        )


def with_timer_store(config: Mapping[str, Any], parsed: Settings | None = None) -> dict[str, Any]:
    """``config`` with the timer store declared: bytes keys and values, no TTL, backed up to the backends of the
    job's own stores (all of them, in the order the stores name them, sorted by store name) and restored from
    theirs, unless ``stores.statebackend-timers.backup.factories`` / ``restore.factories`` say otherwise.
    ``parsed``: ``config`` without the timer store's keys, already parsed (its stores are read from it instead of
    parsing again). Declaring it in a configuration that already declares it gives the same configuration."""
    prefix = f"stores.{TIMERS_STORE}."
    own = {key[len(prefix) :]: value for key, value in config.items() if key.startswith(prefix)}
    # a configuration this function already declared the timer store in keeps its serdes (the same ones)
    fixed = sorted(
        option
        for option in own
        if option in _FIXED_OPTIONS and not (option in ("key.serde", "msg.serde") and own[option] == "bytes")
    )
    if fixed:
        raise ConfigError(
            f"{', '.join(prefix + option for option in fixed)}: the timer store's serdes and TTL are "
            "fixed by statebackend; remove the key(s) (its other options, e.g. lmdb.map.size or "
            "backup.factories, may be set)"
        )
    declared = dict(config)
    if "backup.factories" not in own:
        settings = (
            parsed
            if parsed is not None
            else Settings.from_config({key: value for key, value in config.items() if not key.startswith(prefix)})
        )
        if not settings.stores:
            raise ConfigError(
                f"timers are kept in the store {TIMERS_STORE!r}, backed up by the backends of the job's "
                "stores, but the config declares no store: declare one (stores.<name>.backup.factories)"
                f", or set {prefix}backup.factories"
            )
        backups: builtins.list[str] = []
        restores: builtins.list[str] = []
        for name in sorted(settings.stores):
            store = settings.stores[name]
            backups += [factory for factory in store.backup_factories if factory not in backups]
            restores += [factory for factory in store.restore_factories if factory not in restores]
        declared[prefix + "backup.factories"] = ",".join(backups)
        if "restore.factories" not in own and "restore.factory" not in own:
            declared[prefix + "restore.factories"] = ",".join(restores)
    declared[prefix + "key.serde"] = "bytes"
    declared[prefix + "msg.serde"] = "bytes"
    return declared


def _key_of(values: tuple[Any, ...]) -> Any:
    return values[0] if len(values) == 1 else values


def _kind_byte(kind: str) -> bytes:
    try:
        return _KIND_BYTES[kind]
    except (KeyError, TypeError):
        raise ConfigError(f"a timer's kind must be {PROCESSING!r} or {EVENT!r}, got {kind!r}") from None


def _time_bytes(at_ms: int) -> bytes:
    return _TIME.pack(at_ms + (1 << 63))


def _time_of(data: bytes) -> int:
    return int(_TIME.unpack(bytes(data))[0]) - (1 << 63)


def _due_record(kind_byte: bytes, at_ms: int, encoded: bytes) -> bytes:
    return _DUE + kind_byte + _time_bytes(at_ms) + encoded


def _key_record(encoded: bytes, kind_byte: bytes, at_ms: int) -> bytes:
    return _BY_KEY + _LENGTH.pack(len(encoded)) + encoded + kind_byte + _time_bytes(at_ms)
