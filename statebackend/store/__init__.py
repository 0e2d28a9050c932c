"""The local store package: one LMDB environment per (task, store), with a write batch and a sorted change set per
flush. ``LocalStore`` (``local``) ties the parts together; see its module docstring for the contract."""

from statebackend.store.local import MAX_KEY_SIZE, TOMBSTONE, ChangeSet, LocalStore, LocalVersion, ReadView, TypedStore
from statebackend.store.local import UNSYNCED_FILE as UNSYNCED_FILE  # tests read the marker's name

__all__ = ["MAX_KEY_SIZE", "TOMBSTONE", "ChangeSet", "LocalStore", "LocalVersion", "ReadView", "TypedStore"]
