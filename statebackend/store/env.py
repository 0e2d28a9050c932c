"""The LMDB environment of a store: its layout, its version record, how it is opened, how records are written.

Contract:

- An environment holds two named dbs: ``data`` (the store's keys and values) and ``meta``, whose ``version`` record
  says which state the data is at (a ``LocalVersion``; absent when fresh or dirty). A transaction that changes the
  data sets or clears that record in the same transaction, so the record never describes other data.
- Keys are at most ``MAX_KEY_SIZE`` (511) bytes, LMDB's compiled-in limit (checked against the environment at open).
- Environments are opened without fsync (``sync=False``, ``metasync=False``): the local store is a cache of the blob
  store; ``directory`` says how a machine crash is detected instead.
- Opening an environment that lacks the two dbs is ``CorruptDataError``; any other LMDB failure at open is
  ``StorageError``.
"""

from __future__ import annotations

import json
import secrets
from collections.abc import Iterable
from pathlib import Path
from typing import Any, cast

import attrs
import lmdb

from statebackend.errors import CorruptDataError, StorageError

#: the longest key a local store holds, in bytes: LMDB's compiled-in limit (checked against the environment at
#: open). A longer key is an :class:`~statebackend.errors.InvalidKeyError`
MAX_KEY_SIZE = 511

DATA_DB = b"data"
META_DB = b"meta"
VERSION_KEY = b"version"


@attrs.frozen
class LocalVersion:
    """Identifies the state a store's data is at: the commit whose flush produced it, and that flush's lineage token."""

    #: the id of the commit whose flush produced the data (``str(CheckpointId)``)
    checkpoint_id: str
    #: a random token of that flush: two flushes for the same checkpoint id (two attempts) have different tokens,
    #: so equal versions mean the same data
    token: str

    @classmethod
    def new(cls, checkpoint_id: object) -> LocalVersion:
        """A version for ``checkpoint_id`` with a fresh random token."""
        return cls(str(checkpoint_id), secrets.token_hex(8))

    def to_bytes(self) -> bytes:
        """The version as the store keeps it in its LMDB meta db (JSON); :meth:`from_bytes` reads it back."""
        return json.dumps({"checkpoint_id": self.checkpoint_id, "token": self.token}, sort_keys=True).encode()

    @classmethod
    def from_bytes(cls, data: bytes) -> LocalVersion:
        """The version :meth:`to_bytes` wrote; :class:`~statebackend.errors.CorruptDataError` if unreadable."""
        try:
            obj = json.loads(bytes(data))
            return cls(str(obj["checkpoint_id"]), str(obj["token"]))
        except (ValueError, KeyError, TypeError) as exc:
            raise CorruptDataError(f"local store meta 'version' is unreadable: {bytes(data)[:100]!r}") from exc


def open_env(directory: Path, map_size: int, *, create: bool = True) -> tuple[lmdb.Environment, Any, Any]:
    """Open the environment in ``directory``: ``(env, data_db, meta_db)``."""
    try:
        env = lmdb.open(
            str(directory),
            map_size=map_size,
            subdir=True,
            max_dbs=2,
            readahead=False,
            create=create,
            max_spare_txns=4,
            sync=False,  # see the module docstring
            metasync=False,
        )
    except lmdb.Error as exc:
        raise StorageError(f"cannot open the LMDB environment in {directory}: {exc}") from exc
    try:
        data_db = env.open_db(DATA_DB, create=create)
        meta_db = env.open_db(META_DB, create=create)
    except lmdb.Error as exc:
        env.close()
        raise CorruptDataError(
            f"the LMDB environment in {directory} lacks the 'data' and 'meta' dbs of a statebackend store: {exc}"
        ) from exc
    return env, data_db, meta_db


def read_version(txn: lmdb.Transaction[bytes], meta_db: Any) -> LocalVersion | None:
    raw = txn.get(VERSION_KEY, db=meta_db)
    return None if raw is None else LocalVersion.from_bytes(raw)


def set_version(txn: lmdb.Transaction[bytes], meta_db: Any, version: LocalVersion | None) -> None:
    if version is None:
        txn.delete(VERSION_KEY, db=meta_db)
    else:
        txn.put(VERSION_KEY, version.to_bytes(), db=meta_db)


def apply_records(txn: lmdb.Transaction[bytes], db: Any, records: Iterable[tuple[bytes, bytes | None]]) -> None:
    """Write put (value) / delete (``None``) records into ``db`` (one record per key, as a change set has them): the
    puts in one ``putmulti`` (in C), then the deletes."""
    records = records if isinstance(records, list) else list(records)
    cursor = txn.cursor(db=db)
    deletes = [key for key, value in records if value is None]
    puts = [record for record in records if record[1] is not None] if deletes else records
    cursor.putmulti(cast("list[tuple[bytes, bytes]]", puts))
    for key in deletes:
        if cursor.set_key(key):
            cursor.delete()
