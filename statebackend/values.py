"""A store's values across deployments: what every checkpoint records of how they read, the open's check of the
configured value serde against it, and migrations, which rewrite a store's values once.

Contract:

- **Recorded** (:func:`plan_values`, ``CheckpointV2.serdes[store]``, strings only, so every release reads it):
  ``key`` and ``msg`` (the serde names; ``record`` for a record class), ``envelope: ttl`` with a TTL, and:

  - ``msg.schemas`` (record stores): every schema the store's values may have been written with, by fingerprint
    (:func:`~statebackend.serdes.record.schemas_to_text`). It grows by one schema when the class changes compatibly
    (old values are read as they are: nothing is rewritten) and starts over at the class's one schema after a
    migration, which rewrote every value.
  - ``msg.migration``: the name of the last migration the store's values went through.
  - ``initial``: the store started from an initial-state load (the Spark driver's ``initial_state``); carried on.

- **The open's check** (:func:`value_problems`, from :func:`statebackend.lifecycle.decide_open`): the configured
  value serde must read what the checkpoint recorded: the same named serde, or a record class that reads every
  recorded schema (:func:`~statebackend.serdes.record.read_problems`). Otherwise the open fails with a
  :class:`ConfigError` naming the store and the field, unless a migration is declared that the checkpoint does not
  record: then the old values only need to be readable as they were written.
- **A migration** (``stores.<name>.migration.id`` and ``.function``) runs at an open whose checkpoint does not record
  its name and that has state of the store: every value is read as it was written (a record value as a dict of its
  fields), given to ``function(key, value)``, and its result written back (``None`` deletes the key; a TTL store's
  expiry is kept) through the write batch, before the task's code sees the store. Its writes and its name travel in
  the task's next commit, together, as every write does: until that checkpoint is durable the old one is still the
  newest, and an open (after a crash, a replay, a retry) starts from it and runs the migration again from the old
  values; once it is durable no open runs it again. So the store is migrated exactly once and never half: the
  function must depend on its arguments only (it may run again after a crash, its result lands once). An open with
  no state of the store records the name without running anything.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Iterable, Mapping
from typing import Any

import attrs

from statebackend.checkpoint import CheckpointV2
from statebackend.config import Settings, StoreSettings
from statebackend.errors import ConfigError, CorruptDataError
from statebackend.metrics import Metrics
from statebackend.serdes import RECORD, SERDE_NAMES, RecordSerde, Serde, get_serde, is_record, record_class
from statebackend.serdes.record import RecordDicts, import_named, read_problems, schemas_from_text, schemas_to_text
from statebackend.store import LocalStore
from statebackend.store.kinds import KIND
from statebackend.store.ttl import ENVELOPE, unwrap, wrap

__all__ = [
    "INITIAL",
    "MSG_MIGRATION",
    "MSG_SCHEMAS",
    "Migration",
    "StoreValues",
    "adopted",
    "base_recorded",
    "plan_values",
    "run_migration",
    "value_problems",
    "with_initial",
]

log = logging.getLogger(__name__)

MSG_SCHEMAS = "msg.schemas"
MSG_MIGRATION = "msg.migration"
INITIAL = "initial"
_CHUNK = 10_000
_EVOLVING = 'docs/configuration.md, "Evolving values"'


@attrs.frozen
class Migration:
    """A migration to run at this open: its name, its function, and how the store's old values read."""

    id: str
    function: Callable[[Any, Any], Any]
    old_values: Serde | RecordDicts


@attrs.frozen
class StoreValues:
    """How one store's values read and what the task's checkpoints record of them, decided at open from the
    configuration and the restored checkpoint (:func:`plan_values`)."""

    name: str
    #: what every commit of the task records under ``serdes[store]``
    recorded: Mapping[str, str]
    #: the value serde of the store's typed view (a record serde knows every recorded schema)
    value_serde: Serde
    #: the migration this open runs, or None
    migration: Migration | None = None


def base_recorded(store_settings: StoreSettings) -> dict[str, str]:
    """What a checkpoint records of how a store's bytes read, from its settings alone: its serdes, ``envelope: ttl``
    with a TTL, and ``kind`` for a list or map store (its records read only as that kind; a value store records no
    kind, so its checkpoints stay as they were). The one place these are decided: task commits, the command and
    tools all record them through here."""
    msg = RECORD if is_record(store_settings.msg_serde) else store_settings.msg_serde
    recorded = {"key": store_settings.key_serde, "msg": msg}
    if store_settings.ttl_ms is not None:
        recorded["envelope"] = ENVELOPE
    if store_settings.kind != "value":
        recorded[KIND] = store_settings.kind
    return recorded


def value_problems(name: str, store_settings: StoreSettings, checkpoint: CheckpointV2) -> list[str]:
    """Why the configured value serde of store ``name`` cannot read the values ``checkpoint`` holds (empty: it can,
    or a declared migration rewrites them), one line each naming the key, the store and, for a record, the field."""
    written = checkpoint.serdes.get(name)
    migration = store_settings.migration_id
    where = f"checkpoint {checkpoint.checkpoint_id}"
    if written is None or "msg" not in written:
        if migration is None or not _has_state(name, checkpoint):
            return []
        return [
            (
                f"stores.{name}.migration.id={migration!r}: {where} does not record how store {name!r}'s values "
                "were written (a release before serdes were recorded), so a migration cannot read them: commit once "
                "with this release without the migration, then add it"
            )
        ]
    old = written["msg"]
    if migration is not None and written.get(MSG_MIGRATION) != migration:
        if old == RECORD:
            schemas_from_text(written.get(MSG_SCHEMAS, ""), where=f"{where}, store {name!r}")  # damaged: raises
        elif old not in SERDE_NAMES:
            return [
                (
                    f"stores.{name}.migration.id={migration!r}: store {name!r} was written with serde {old!r}, "
                    "which this release cannot read to migrate"
                )
            ]
        return []
    configured = store_settings.msg_serde
    remedy = (
        f"or declare a migration that rewrites its values once: stores.{name}.migration.id and "
        f"stores.{name}.migration.function ({_EVOLVING})"
    )
    if is_record(configured) and old == RECORD:
        reader = record_class(configured)
        problems = []
        for schema in schemas_from_text(written.get(MSG_SCHEMAS, ""), where=f"{where}, store {name!r}"):
            found = read_problems(schema, reader)
            if found:
                problems.append(
                    f"stores.{name}.msg.serde: {reader.cls.__qualname__} cannot read the values of store "
                    f"{name!r} written with {schema.text} (schema {schema.fingerprint.hex()}, {where}): "
                    f"{'; '.join(found)}. Change the class back, {remedy}"
                )
        return problems
    if old == configured:
        return []
    back = "record:<module>:<Class>" if old == RECORD else old
    return [
        (
            f"stores.{name}.msg.serde is {configured!r} but store {name!r} was written with "
            f"{'record values' if old == RECORD else repr(old)} ({where}); set stores.{name}.msg.serde={back}, "
            f"{remedy}"
        )
    ]


def plan_values(settings: Settings, checkpoint: CheckpointV2 | None) -> dict[str, StoreValues]:
    """Per store: what commits record, the value serde, and the migration to run, given the restored ``checkpoint``
    (None: the stores start empty). Assumes :func:`value_problems` found nothing (the open's decision checked it)."""
    return {name: _plan(name, store_settings, checkpoint) for name, store_settings in settings.stores.items()}


def run_migration(
    store: LocalStore, values: StoreValues, key_serde: Serde, *, ttl: bool, metrics: Metrics | None = None
) -> int:
    """Rewrite every value of ``store`` (the task's local store, restored and not yet written) with ``values``'
    migration, through the write batch; returns the number of keys rewritten or deleted, also counted in ``metrics``
    (``migration.runs``, ``migration.values.rewritten``, ``migration.values.deleted``). An exception of the function
    (or of the new serde for what it returned) propagates with a note naming the migration, the store and the key:
    nothing of the migration is committed (nor counted)."""
    migration = values.migration
    assert migration is not None
    started = time.monotonic()
    keys: list[bytes] = []
    data: list[bytes] = []
    gone: list[bytes] = []
    done = deleted = 0
    for key, raw in store.items():  # a snapshot: the writes below are not seen by it
        expiry, payload = unwrap(raw, store=store.name) if ttl else (0, raw)
        decoded = key_serde.from_bytes(key)
        try:
            new = migration.function(decoded, migration.old_values.from_bytes(payload))
            if new is None:
                gone.append(key)
            else:
                encoded = values.value_serde.to_bytes(new)
                keys.append(key)
                data.append(wrap(encoded, expiry) if ttl else encoded)
        except Exception as exc:
            exc.add_note(f"in migration {migration.id!r} of store {store.name!r}, at key {decoded!r}")
            raise
        if len(keys) + len(gone) >= _CHUNK:
            deleted += len(gone)
            done += _write(store, keys, data, gone)
    deleted += len(gone)
    done += _write(store, keys, data, gone)
    if metrics is not None:
        metrics.increment("migration.runs")
        metrics.increment("migration.values.rewritten", done - deleted)
        metrics.increment("migration.values.deleted", deleted)
    log.info(
        "store %s: migration %s rewrote %d values in %.0f ms; they are committed with the next commit",
        store.name,
        migration.id,
        done,
        (time.monotonic() - started) * 1000.0,
        extra={"store": store.name, "migration": migration.id},
    )
    return done


def adopted(values: StoreValues, written: Mapping[str, str] | None, source: str) -> StoreValues:
    """``values`` once the store holds values copied as they were stored from a checkpoint that recorded ``written``
    (``source`` names it): a record store then also knows the schemas recorded there, and an initial load recorded
    there is carried on. :class:`ConfigError` when those values are not in this store's format (written with another
    serde, or before a migration this task's store went through)."""
    if written is None or "msg" not in written:
        return values
    recorded = dict(values.recorded)
    mine = recorded.get(MSG_MIGRATION)
    if written["msg"] != recorded["msg"] or (mine is not None and written.get(MSG_MIGRATION) != mine):
        raise ConfigError(
            f"store {values.name!r}: the values of {source} were written with {written['msg']!r}"
            f"{' after migration ' + repr(written[MSG_MIGRATION]) if MSG_MIGRATION in written else ''}, but this "
            f"task's store holds {recorded['msg']!r}{' after migration ' + repr(mine) if mine else ''}: change "
            "num_tasks in a run before or after the one that changes the store's values, not in the same run"
        )
    if MSG_MIGRATION in written:
        recorded[MSG_MIGRATION] = written[MSG_MIGRATION]
    if INITIAL in written:
        recorded.setdefault(INITIAL, written[INITIAL])
    serde = values.value_serde
    if isinstance(serde, RecordSerde):
        theirs = schemas_from_text(written.get(MSG_SCHEMAS, ""), where=f"{source}, store {values.name!r}")
        problems = [p for schema in theirs for p in read_problems(schema, serde.record)]
        if problems:
            raise ConfigError(
                f"store {values.name!r}: {serde.name} cannot read the values of {source}: " + "; ".join(problems)
            )
        serde = serde.with_schemas(theirs)
        recorded[MSG_SCHEMAS] = schemas_to_text(serde.schemas.values())
    return attrs.evolve(values, recorded=recorded, value_serde=serde)


def with_initial(values: StoreValues, label: str) -> StoreValues:
    """``values`` recording that the store started from initial-state load ``label``."""
    return attrs.evolve(values, recorded={**values.recorded, INITIAL: label})


def _plan(name: str, store_settings: StoreSettings, checkpoint: CheckpointV2 | None) -> StoreValues:
    written = checkpoint.serdes.get(name) if checkpoint is not None else None
    recorded = base_recorded(store_settings)
    serde = get_serde(store_settings.msg_serde)
    migration = None
    history: Iterable[Any] = ()
    if written is not None and "msg" in written:
        if INITIAL in written:
            recorded[INITIAL] = written[INITIAL]
        done = written.get(MSG_MIGRATION)
        if store_settings.migration_id is not None and done != store_settings.migration_id:
            assert store_settings.migration_function is not None  # config requires both
            migration = Migration(
                store_settings.migration_id,
                import_named(store_settings.migration_function, "migration function"),
                _old_values(name, written),
            )
        else:
            if done is not None:
                recorded[MSG_MIGRATION] = done
            if isinstance(serde, RecordSerde) and written["msg"] == RECORD:
                history = schemas_from_text(written.get(MSG_SCHEMAS, ""), where=f"store {name!r}")
    if store_settings.migration_id is not None:
        recorded[MSG_MIGRATION] = store_settings.migration_id  # runs now, ran before, or nothing to migrate
    if isinstance(serde, RecordSerde):
        serde = serde.with_schemas(history)
        recorded[MSG_SCHEMAS] = schemas_to_text(serde.schemas.values())
    return StoreValues(name, recorded, serde, migration)


def _old_values(name: str, written: Mapping[str, str]) -> Serde | RecordDicts:
    """How the values a checkpoint recorded as ``written`` read: their named serde, or as dicts of their schema."""
    if written["msg"] == RECORD:
        return RecordDicts(schemas_from_text(written.get(MSG_SCHEMAS, ""), where=f"store {name!r}"))
    try:
        return get_serde(written["msg"])
    except ConfigError:
        raise CorruptDataError(
            f"store {name!r} was written with serde {written['msg']!r}, which this release cannot read"
        ) from None


def _has_state(name: str, checkpoint: CheckpointV2) -> bool:
    return any(name in markers for markers in checkpoint.state_checkpoint_markers.values())


def _write(store: LocalStore, keys: list[bytes], data: list[bytes], gone: list[bytes]) -> int:
    """Write what a migration made so far and empty the lists; returns how many keys it was."""
    count = len(keys) + len(gone)
    if keys:
        store.put_many(keys, data)
    if gone:
        store.delete_many(gone)
    keys.clear()
    data.clear()
    gone.clear()
    return count
