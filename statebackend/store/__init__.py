"""The local store: one LMDB environment per (task, store), with a write batch and a sorted change set per flush.

One job per module, each with its contract in its docstring; none imports this package's ``__init__``, and the
imports between them run one way (``local`` at the top, ``env`` and ``directory`` at the bottom):

- ``local``: ``LocalStore``, which ties the parts together (the store's whole contract is in its docstring)
- ``typed``: the views users get, ``BytesStore`` and ``TypedStore`` (user operations only)
- ``bulk``: bulk loads in one transaction, swapping in a whole LMDB environment
- ``applier``: pending batches (flushed, not yet in LMDB) applied in the background
- ``batch``: the write batch, the overlay reads see, the ``ChangeSet`` a flush makes
- ``view``: ``ReadView``, a consistent snapshot of the flushed data; key-range cursors
- ``spill``: the spill-run file format
- ``env``: the LMDB environment's layout, its version record (``LocalVersion``), opening it
- ``directory``: the store dir's layout, its inter-process lock, the ``UNSYNCED`` boot-id guard
"""

from statebackend.store.batch import TOMBSTONE, ChangeSet
from statebackend.store.directory import UNSYNCED_FILE as UNSYNCED_FILE  # tests read the marker's name
from statebackend.store.env import MAX_KEY_SIZE, LocalVersion
from statebackend.store.local import LocalStore
from statebackend.store.typed import BytesStore, TypedStore
from statebackend.store.view import ReadView

__all__ = [
    "MAX_KEY_SIZE",
    "TOMBSTONE",
    "BytesStore",
    "ChangeSet",
    "LocalStore",
    "LocalVersion",
    "ReadView",
    "TypedStore",
]
