"""sb_sqlite: an example third-party blob store for statebackend on another substrate (``sqlite://``).

Blobs are rows of one table in one SQLite database file, read and written with the standard library's ``sqlite3``.
It is found by the entry point ``sqlite`` in group ``statebackend.blobstores`` (see pyproject.toml): configure
``blob.store.url=sqlite:///<absolute path of the database file>``. statebackend itself never names it.
"""

from sb_sqlite.store import SqliteBlobStore

__all__ = ["SqliteBlobStore"]
