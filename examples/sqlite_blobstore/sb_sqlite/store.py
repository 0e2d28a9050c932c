"""The ``sqlite://`` blob store: blobs as rows of one table in one SQLite database file.

Written on statebackend's blob-store base with raw operations only (statebackend's docs/blobstores.md, "Writing a
blob store"): the base's public ``put``, ``get``, ``list``, ... check names, metadata and ranges, check every
listing's prefix and order, and translate and redact errors; this module implements ``_put``, ``_get``,
``_delete``, ``_delete_many``, ``_list``, ``_head`` and ``_set_metadata`` on checked arguments, and maps SQLite's
exceptions in ``_translate_error`` (a busy or locked database is a transient fault, worth a retry).

- One row per blob: ``name`` (the primary key, ``TEXT``), ``data`` (``BLOB``), ``metadata`` (JSON text). A write is
  one statement in its own transaction, so a reader sees the old row or the new one, never a part.
- Create-only writes are a plain ``INSERT``: the primary key refuses a taken name, atomically.
- A listing matches its prefix **literally**: ``substr(name, 1, length(prefix)) = prefix``, never ``LIKE`` or
  ``GLOB``, in which ``%``, ``_``, ``*``, ``?`` and ``[`` are wildcards. SQLite's default ``BINARY`` collation
  compares UTF-8 bytes, which is the order of code points: the order of Python's ``sorted``.
- Thread-safe: one connection per thread, in WAL mode so readers do not wait for a writer. The writers of this
  process take turns on a lock per database file (SQLite's own busy wait sleeps and retries, and under many threads
  one of them can lose every turn); ``blob.store.busy.timeout.ms`` bounds how long a write waits for another
  process's.
"""

from __future__ import annotations

import json
import logging
import sqlite3
import threading
from collections.abc import Iterator, Mapping
from typing import Any, ClassVar
from urllib.parse import unquote, urlsplit

from statebackend.blobstores.base import BlobInfo, BlobStore
from statebackend.errors import (
    AlreadyExistsError,
    ConfigError,
    NotFoundError,
    StateBackendError,
    StorageError,
    TransientStorageError,
)
from statebackend.options import OptionSpec, parse_bool, parse_duration_ms

__all__ = ["SqliteBlobStore"]

logger = logging.getLogger(__name__)

_SCHEMA = "CREATE TABLE IF NOT EXISTS blobs (name TEXT PRIMARY KEY, data BLOB NOT NULL, metadata TEXT NOT NULL)"


class SqliteBlobStore(BlobStore):
    """One SQLite database file of blobs; ``sqlite:///<absolute path>`` opens (or creates) it."""

    #: the ``blob.store.*`` keys this store takes, declared once (statebackend parses them, then ``from_url`` gets
    #: their values)
    options: ClassVar[Mapping[str, OptionSpec]] = {
        "busy.timeout.ms": OptionSpec(
            parse_duration_ms(min=0), 5000, "how long a write waits for another connection's write to end"
        ),
        "create.if.missing": OptionSpec(parse_bool(), True, "create the database file when it does not exist"),
    }

    #: one write lock per database file, shared by every store of this process that opens it
    _write_locks: ClassVar[dict[str, threading.Lock]] = {}
    _write_locks_lock: ClassVar[threading.Lock] = threading.Lock()

    def __init__(self, path: str, *, busy_timeout_ms: int = 5000, create: bool = True) -> None:
        self.path = path
        with SqliteBlobStore._write_locks_lock:
            self._write_lock = SqliteBlobStore._write_locks.setdefault(path, threading.Lock())
        self.busy_timeout_ms = busy_timeout_ms
        self.create = create
        self.url = f"sqlite://{path}"
        self._local = threading.local()
        self._connections: list[sqlite3.Connection] = []
        self._connections_lock = threading.Lock()
        # WAL (readers do not wait for a writer) is a property of the file: set once here, not per connection, where
        # switching it would take a lock that racing new connections do not wait for
        self._reading().execute("PRAGMA journal_mode=WAL").fetchall()
        with self._writing() as connection:
            connection.execute(_SCHEMA)

    @classmethod
    def from_url(cls, url: str, options: Mapping[str, Any]) -> SqliteBlobStore:
        """Open ``sqlite:///<absolute path of the database file>``; ``options`` are the parsed ``blob.store.*``
        options of :attr:`options`."""
        parts = urlsplit(url)
        path = unquote(parts.path)
        if parts.netloc or not path.startswith("/") or path.endswith("/") or parts.query or parts.fragment:
            raise ConfigError(
                f"blob.store.url {url!r} is not sqlite:///<absolute path of the database file> (three slashes, no "
                "host, no query)"
            )
        return cls(path, busy_timeout_ms=options["busy.timeout.ms"], create=options["create.if.missing"])

    # -- raw operations: the base checked every name, metadata mapping and range before calling them -----------------

    def _put(self, name: str, data: bytes, *, create_only: bool, metadata: dict[str, str]) -> None:
        verb = "INSERT" if create_only else "INSERT OR REPLACE"
        try:
            with self._writing() as connection:
                connection.execute(
                    f"{verb} INTO blobs (name, data, metadata) VALUES (?, ?, ?)",
                    (name, data, json.dumps(metadata, sort_keys=True)),
                )
        except sqlite3.IntegrityError:
            raise AlreadyExistsError(f"blob {name!r} already exists in {self.describe()}") from None

    def _get(self, name: str, start: int, end: int | None) -> bytes:
        args: tuple[object, ...]
        if end is None:
            query, args = "SELECT substr(data, ?) FROM blobs WHERE name = ?", (start + 1, name)
        else:  # substr of a BLOB counts bytes, from 1; a length of 0 gives no bytes
            query, args = "SELECT substr(data, ?, ?) FROM blobs WHERE name = ?", (start + 1, max(0, end - start), name)
        row = self._reading().execute(query, args).fetchone()
        if row is None:
            raise NotFoundError(f"blob {name!r} not found in {self.describe()}")
        return bytes(row[0]) if isinstance(row[0], bytes) else b""  # an empty slice may come back as ''

    def _delete(self, name: str) -> None:
        with self._writing() as connection:
            connection.execute("DELETE FROM blobs WHERE name = ?", (name,))

    def _delete_many(self, names: list[str]) -> None:
        """Every name in one transaction: all deleted, or none."""
        with self._writing() as connection:
            connection.executemany("DELETE FROM blobs WHERE name = ?", [(name,) for name in names])

    def _list(self, prefix: str) -> Iterator[str]:
        rows = (
            self._reading()
            .execute("SELECT name FROM blobs WHERE substr(name, 1, ?) = ? ORDER BY name", (len(prefix), prefix))
            .fetchall()
        )
        return iter([row[0] for row in rows])

    def _head(self, name: str) -> BlobInfo:
        row = self._reading().execute("SELECT length(data), metadata FROM blobs WHERE name = ?", (name,)).fetchone()
        if row is None:
            raise NotFoundError(f"blob {name!r} not found in {self.describe()}")
        return BlobInfo(name=name, size=row[0], metadata=json.loads(row[1]))

    def _set_metadata(self, name: str, metadata: dict[str, str]) -> None:
        with self._writing() as connection:
            changed = connection.execute(
                "UPDATE blobs SET metadata = ? WHERE name = ?", (json.dumps(metadata, sort_keys=True), name)
            ).rowcount
        if changed == 0:
            raise NotFoundError(f"blob {name!r} not found in {self.describe()}")

    def _translate_error(self, exc: Exception, operation: str, what: str) -> StateBackendError | None:
        """A busy or locked database is worth a retry; any other SQLite error names the file."""
        if isinstance(exc, sqlite3.OperationalError) and ("locked" in str(exc) or "busy" in str(exc)):
            return TransientStorageError(f"{operation} of {what!r} in {self.describe()}: the database is busy ({exc})")
        if isinstance(exc, sqlite3.Error):
            return StorageError(f"{operation} of {what!r} in {self.describe()} failed: {type(exc).__name__}: {exc}")
        return None

    def validate(self) -> None:
        """The database must be readable and hold the blob table."""
        try:
            self._reading().execute("SELECT count(*) FROM blobs WHERE 0").fetchone()
        except sqlite3.Error as exc:
            raise StorageError(f"{self.describe()} is not usable: {exc}; check the file and its permissions") from None

    def close(self) -> None:
        """Close every thread's connection."""
        with self._connections_lock:
            connections, self._connections = self._connections, []
        for connection in connections:
            connection.close()

    # -- connections ------------------------------------------------------------------------------------------------

    def _reading(self) -> sqlite3.Connection:
        """This thread's connection (autocommit: each statement is its own transaction)."""
        connection: sqlite3.Connection | None = getattr(self._local, "connection", None)
        if connection is None:
            try:
                connection = sqlite3.connect(
                    f"file:{self.path}?mode={'rwc' if self.create else 'rw'}",
                    uri=True,
                    timeout=self.busy_timeout_ms / 1000,
                    isolation_level=None,
                    check_same_thread=False,  # close() may run on another thread
                )
            except sqlite3.Error as exc:
                raise StorageError(
                    f"cannot open {self.describe()}: {exc}; create its directory, or set "
                    f"blob.store.create.if.missing=true"
                ) from None
            self._local.connection = connection
            with self._connections_lock:
                self._connections.append(connection)
            logger.debug("opened a connection to %s", self.describe())
        return connection

    def _writing(self) -> _Transaction:
        return _Transaction(self._reading(), self._write_lock)


class _Transaction:
    """The process's write lock of the file, then ``BEGIN IMMEDIATE`` ... ``COMMIT`` (``ROLLBACK`` on an error): a
    write takes the database's write lock first, so two writers never deadlock upgrading read locks."""

    def __init__(self, connection: sqlite3.Connection, lock: threading.Lock) -> None:
        self.connection = connection
        self.lock = lock

    def __enter__(self) -> sqlite3.Connection:
        self.lock.acquire()
        try:
            self.connection.execute("BEGIN IMMEDIATE")
        except BaseException:
            self.lock.release()
            raise
        return self.connection

    def __exit__(self, kind: type[BaseException] | None, *rest: object) -> None:
        try:
            self.connection.execute("ROLLBACK" if kind is not None else "COMMIT")
        finally:
            self.lock.release()
