"""The reference backend: a compact, correct state backend that passes the backend contract suite, kept beside it
as the base of the suite's mutants (:mod:`statebackend.testing.mutants`) and as a second example to read.

Name it by its dotted path: ``stores.<name>.backup.factories=statebackend.testing.reference:ReferenceBackendFactory``
(:data:`REFERENCE_BACKEND`). It uses only the backend contract (:mod:`statebackend.contracts`), the local store's
public methods and the blob store; nothing of the built-in backends.

How it works, per store:

- **Backup.** Each commit adds one step to a *chain*: a ``delta`` blob holding the commit's change set (puts and
  deletes), written from the change set ``snapshot()`` receives. A chain starts at a ``full`` blob (the store's whole
  content at that commit, read from the change set's read view, which is exactly the flushed version) or, for a
  store that started empty, at nothing. A full copy starts a new chain when the chain reaches :data:`CHAIN_STEPS`
  steps, after an upload failed or a commit was aborted (the chain lost a step), and when another backend restored
  the store (this backend's chain does not describe it). ``snapshot()`` only names the step and keeps the change set
  (O(1)); ``upload()`` encodes and writes it create-only on the commit pool.
- **Marker.** The chain: a JSON list of the blob names, oldest first.
- **Restore.** When the store's local version is the chain's last step, nothing is downloaded. Otherwise every blob
  of the chain is downloaded and verified (digest, then the header bound to its name, job, task and store, the
  record count and the key order) before anything is loaded; then the result replaces the store's contents in one
  transaction. A missing blob is :class:`NotFoundError`, a damaged or misplaced one :class:`CorruptDataError`, both
  naming the blob.
- **Blob lifetime.** The framework's (:class:`ReferenceLifetime`): this backend states that a marker references the
  blobs of its chain, and that the chain the next commit extends and the steps being written are held; it writes no
  cleanup. Each blob carries ``created_at`` metadata (where the blob store keeps metadata) for the grace rule.

Blob: ``MAGIC``, a 4-byte header length, the header (UTF-8 JSON: kind, job, task, store, checkpoint_id, token,
records), the records (a flag byte 0 put / 1 delete, 4-byte key length, key, and for a put 4-byte value length,
value; keys strictly ascending), then the SHA-256 of everything before it. Names:
``<prefix><sortable checkpoint id>-<token>.<kind>``.

It is O(state) in memory at restore (the chain is merged in a dict): a reference for tests, not for large state.
"""

from __future__ import annotations

import hashlib
import json
import re
import struct
import threading
from collections.abc import Iterable, Mapping
from concurrent.futures import Future
from typing import ClassVar

import attrs

from statebackend.checkpoint import CheckpointId, CheckpointV2
from statebackend.contracts import (
    BackendContext,
    BlobLifetime,
    StateBackendAdmin,
    StateBackendFactory,
    StoreMarkers,
    TaskBackupManager,
    TaskRestoreManager,
)
from statebackend.errors import (
    AlreadyExistsError,
    CorruptDataError,
    InconsistentStateError,
    NotFoundError,
)
from statebackend.kit import created_at_metadata
from statebackend.store import ChangeSet, LocalStore, LocalVersion, ReadView

__all__ = [
    "CHAIN_STEPS",
    "REFERENCE_BACKEND",
    "BlobHeader",
    "Record",
    "ReferenceAdmin",
    "ReferenceBackendFactory",
    "ReferenceBackupManager",
    "ReferenceLifetime",
    "ReferenceRestoreManager",
    "Step",
    "decode_blob",
    "decode_marker",
    "encode_blob",
    "parse_blob_name",
]

#: the dotted path that names this backend in a config
REFERENCE_BACKEND = "statebackend.testing.reference:ReferenceBackendFactory"
#: a chain this long starts over at a full copy
CHAIN_STEPS = 8

MAGIC = b"SBREF001"
_DIGEST_SIZE = 32
_U32 = struct.Struct(">I")
_NAME_RE = re.compile(r"(\d{15})-(\d{6})-([0-9a-f]+)\.(full|delta)")
#: a change record: ``(key, value)``, ``value`` ``None`` for a delete
Record = tuple[bytes, bytes | None]


class ReferenceBackendFactory(StateBackendFactory):
    """The reference backend. Subclasses (the mutants) swap in their own manager classes."""

    backup_class: type[ReferenceBackupManager]
    restore_class: type[ReferenceRestoreManager]

    def backup_manager(self, context: BackendContext) -> TaskBackupManager:
        return self.backup_class(context=context)

    def restore_manager(self, context: BackendContext) -> TaskRestoreManager:
        return self.restore_class(context=context)

    def admin(self, context: BackendContext) -> StateBackendAdmin:
        return ReferenceAdmin(context=context)


# -- the blob -------------------------------------------------------------------------------------------------------


@attrs.frozen
class BlobHeader:
    """What a blob says it is."""

    kind: str
    job: str
    task: str
    store: str
    checkpoint_id: str
    token: str
    records: int = 0


def blob_name(prefix: str, kind: str, version: LocalVersion) -> str:
    return f"{prefix}{CheckpointId.parse(version.checkpoint_id).sortable()}-{version.token}.{kind}"


def parse_blob_name(prefix: str, name: str) -> tuple[str, LocalVersion] | None:
    """``(kind, version)`` of one of this backend's blob names under ``prefix``, else ``None``."""
    match = _NAME_RE.fullmatch(name[len(prefix) :]) if name.startswith(prefix) else None
    if match is None:
        return None
    return match.group(4), LocalVersion(str(CheckpointId(int(match.group(1)), int(match.group(2)))), match.group(3))


def encode_blob(header: BlobHeader, records: Iterable[Record]) -> bytes:
    """The blob of ``records`` (sorted by key; ``None`` deletes); ``header.records`` is counted here."""
    body = bytearray()
    count = 0
    for key, value in records:
        if value is None:
            body += b"\x01" + _U32.pack(len(key)) + key
        else:
            body += b"\x00" + _U32.pack(len(key)) + key + _U32.pack(len(value)) + value
        count += 1
    head = json.dumps(attrs.asdict(attrs.evolve(header, records=count)), sort_keys=True).encode()
    data = MAGIC + _U32.pack(len(head)) + head + bytes(body)
    return data + hashlib.sha256(data).digest()


def decode_blob(data: bytes, *, name: str, expected: BlobHeader | None, verify: bool = True) -> list[Record]:
    """The records of blob ``name``, verified whole: :class:`CorruptDataError` naming it on any damage, and when its
    header is not ``expected`` (its name, job, task and store). ``verify=False`` skips the digest and
    ``expected=None`` the binding: the reference never does either; they are the switches of two mutants."""
    if len(data) < len(MAGIC) + _U32.size + _DIGEST_SIZE or not data.startswith(MAGIC):
        raise CorruptDataError(f"blob {name} is not a reference-backend blob (bad magic or cut short)")
    payload = data[:-_DIGEST_SIZE]
    if verify and hashlib.sha256(payload).digest() != data[-_DIGEST_SIZE:]:
        raise CorruptDataError(f"blob {name} failed its SHA-256 check: damaged or cut short; nothing was loaded")
    try:
        (head_len,) = _U32.unpack_from(payload, len(MAGIC))
        offset = len(MAGIC) + _U32.size
        header = BlobHeader(**json.loads(payload[offset : offset + head_len]))
        offset += head_len
        records: list[Record] = []
        while offset < len(payload):
            flag = payload[offset]
            (size,) = _U32.unpack_from(payload, offset + 1)
            key = payload[offset + 5 : offset + 5 + size]
            offset += 5 + size
            value: bytes | None = None
            if flag == 0:
                (size,) = _U32.unpack_from(payload, offset)
                value = payload[offset + 4 : offset + 4 + size]
                offset += 4 + size
            if offset > len(payload) or flag > 1 or (records and key <= records[-1][0]):
                raise CorruptDataError(f"blob {name}: a record is damaged or out of order")
            records.append((key, value))
    except (ValueError, TypeError, struct.error, IndexError) as exc:
        raise CorruptDataError(f"blob {name}: unreadable ({exc})") from exc
    if expected is not None and attrs.evolve(header, records=0) != expected:
        raise CorruptDataError(f"blob {name} says it is {header}, not {expected}: copied or renamed; not loaded")
    if header.records != len(records):
        raise CorruptDataError(f"blob {name} holds {len(records)} records, its header says {header.records}")
    return records


def decode_marker(marker: str, prefix: str) -> list[str]:
    """The chain a marker names; :class:`CorruptDataError` when it is not a chain of this store's blobs."""
    try:
        chain = json.loads(marker)
    except ValueError:
        chain = None
    if not isinstance(chain, list) or not chain or not all(isinstance(name, str) for name in chain):
        raise CorruptDataError(f"reference marker {marker!r} is not a JSON list of blob names")
    kinds = [parse_blob_name(prefix, name) for name in chain]
    if any(kind is None for kind in kinds) or any(kind[0] != "delta" for kind in kinds[1:] if kind is not None):
        raise CorruptDataError(f"reference marker {marker!r} is not a chain of blobs under {prefix}")
    return chain


def _expected(context: BackendContext, store: str, name: str) -> BlobHeader:
    parsed = parse_blob_name(context.blob_prefix(store), name)
    assert parsed is not None  # decode_marker checked it
    kind, version = parsed
    return BlobHeader(kind, context.job_name, context.task_name, store, version.checkpoint_id, version.token)


# -- backup ---------------------------------------------------------------------------------------------------------


@attrs.define(eq=False)
class Step:
    """One store's step of a commit, named by ``snapshot()`` and written by ``upload()``."""

    change: ChangeSet
    view: Future[ReadView] | None  # a full copy's read view; None for a delta
    blob: str
    chain: list[str]


@attrs.define(eq=False)
class ReferenceBackupManager(TaskBackupManager):
    """Backs up each store as a chain of deltas on a full copy (see the module docstring)."""

    context: BackendContext
    #: store -> the chain the next step extends (``None``: the next step is a full copy)
    _chains: dict[str, list[str] | None] = attrs.field(init=False, factory=dict)
    _prepared: dict[str, Step] = attrs.field(init=False, factory=dict)
    #: the steps being written now, per store (held from the blob store's sweeps)
    _writing: dict[str, str] = attrs.field(init=False, factory=dict)
    _lock: threading.Lock = attrs.field(init=False, factory=threading.Lock)
    _lifetime: ReferenceLifetime = attrs.field(init=False)

    @_lifetime.default
    def _make_lifetime(self) -> ReferenceLifetime:
        return ReferenceLifetime(self)

    def init(self, checkpoint: CheckpointV2 | None) -> None:
        markers = checkpoint.markers_for(self.context.factory_name) if checkpoint is not None else {}
        for name in self.context.stores:
            restored_by = self.context.restored_by.get(name)
            if restored_by is None:  # started empty: a chain may start with a delta
                self._chains[name] = []
            elif restored_by == self.context.factory_name and name in markers:
                self._chains[name] = decode_marker(markers[name], self.context.blob_prefix(name))
            else:  # restored by another backend: this chain does not describe the store
                self._chains[name] = None

    def snapshot(self, checkpoint_id: CheckpointId, changes: Mapping[str, ChangeSet]) -> StoreMarkers:
        prepared: dict[str, Step] = {}
        for name in self.backed_up_stores():
            change = changes[name]
            chain = self._chains.get(name)
            full = self.full_copy_due(chain)
            blob = blob_name(self.context.blob_prefix(name), "full" if full else "delta", change.version)
            prepared[name] = Step(
                change, change.read_view() if full else None, blob, [blob] if full or chain is None else [*chain, blob]
            )
        with self._lock:
            abandoned, self._prepared = self._prepared, prepared
        _close_views(abandoned)
        return {name: json.dumps(step.chain) for name, step in prepared.items()}

    def full_copy_due(self, chain: list[str] | None) -> bool:
        """Whether the next step starts a new chain at a full copy: no chain to extend, or a long one."""
        return chain is None or len(chain) >= CHAIN_STEPS

    def backed_up_stores(self) -> list[str]:
        """The stores this manager backs up: all of its context's."""
        return list(self.context.stores)

    def upload(self, checkpoint_id: CheckpointId, markers: StoreMarkers) -> Future[StoreMarkers]:
        with self._lock:
            prepared, self._prepared = self._prepared, {}
        return self.context.executor.submit(self._upload_all, prepared, dict(markers))

    def _upload_all(self, prepared: dict[str, Step], markers: StoreMarkers) -> StoreMarkers:
        with self._lock:
            self._writing.update({name: step.blob for name, step in prepared.items()})
        try:
            for name, step in prepared.items():
                self.write_step(name, step)
        except BaseException:
            with self._lock:  # the chain lost this step: the next commit starts over at a full copy
                self._chains.update(dict.fromkeys(prepared))
            raise
        finally:
            _close_views(prepared)
            with self._lock:
                for name in prepared:
                    self._writing.pop(name, None)
        with self._lock:
            self._chains.update({name: step.chain for name, step in prepared.items()})
        return markers

    def held_blobs(self, store: str) -> list[str]:
        """The chain the next commit extends and the step being written (what no checkpoint may name yet)."""
        with self._lock:
            held = list(self._chains.get(store) or [])
            writing = self._writing.get(store)
        return held if writing is None else [*held, writing]

    def write_step(self, name: str, step: Step) -> None:
        """Encode one store's step and write it create-only (a retry that finds its own bytes is fine)."""
        version = step.change.version
        header = BlobHeader(
            "full" if step.view is not None else "delta",
            self.context.job_name,
            self.context.task_name,
            name,
            version.checkpoint_id,
            version.token,
        )
        data = encode_blob(header, self.step_records(name, step))
        blob_store = self.context.blob_store
        metadata = created_at_metadata(self._lifetime.now()) if blob_store.supports_metadata else None
        try:
            self.context.blob_store.put(step.blob, data, create_only=True, metadata=metadata)
        except AlreadyExistsError:
            if self.context.blob_store.get(step.blob) != data:
                raise
        self.context.metrics.increment(
            "commit.bytes.uploaded", len(data), store=name, backend=self.context.factory_name
        )

    def step_records(self, name: str, step: Step) -> Iterable[Record]:
        """A full copy's records from the read view of exactly the flushed version; a delta's from the change set."""
        if step.view is None:
            return list(step.change)
        view = step.view.result()
        if view.version != step.change.version:
            raise InconsistentStateError(f"store {name}: the read view is at {view.version}, not {step.change.version}")
        return list(view.items())

    def blob_lifetime(self) -> BlobLifetime | None:
        return self._lifetime

    def abort(self, checkpoint_id: CheckpointId) -> None:
        with self._lock:
            abandoned, self._prepared = self._prepared, {}
            self._chains.update(dict.fromkeys(self._chains))  # the aborted flush is in no step: start over
        _close_views(abandoned)

    def close(self) -> None:
        with self._lock:
            abandoned, self._prepared = self._prepared, {}
        _close_views(abandoned)


class ReferenceLifetime(BlobLifetime):
    """The reference backend's blobs, for the framework's collector: a marker references its chain; the manager holds
    the chain the next commit extends and the steps being written. The grace period and the sweep interval are the
    framework's defaults."""

    def __init__(self, manager: ReferenceBackupManager) -> None:
        super().__init__(manager.context)
        self.manager = manager

    def referenced_blobs(self, store: str, marker: str) -> list[str]:
        return decode_marker(marker, self.context.blob_prefix(store))

    def held_blobs(self, store: str) -> list[str]:
        return self.manager.held_blobs(store)


def _close_views(steps: Mapping[str, Step]) -> None:
    """Close the read views of steps that will not be written (a view may still be opening)."""
    for step in steps.values():
        if step.view is not None:
            step.view.add_done_callback(_close_view)


def _close_view(done: Future[ReadView]) -> None:
    if not done.cancelled() and done.exception() is None:
        done.result().close()


# -- restore --------------------------------------------------------------------------------------------------------


@attrs.define(eq=False)
class ReferenceRestoreManager(TaskRestoreManager):
    """Restores each store from its chain (see the module docstring)."""

    context: BackendContext
    _markers: dict[str, str] = attrs.field(init=False, factory=dict)
    #: check each blob's SHA-256 before anything of it is loaded (only a mutant turns it off)
    verify_digest: ClassVar[bool] = True

    def init(self, checkpoint: CheckpointV2 | None) -> None:
        markers = checkpoint.markers_for(self.context.factory_name) if checkpoint is not None else {}
        self._markers = {name: markers[name] for name in self.context.stores if name in markers}

    def restore(self) -> None:
        for name, store in self.context.stores.items():
            marker = self._markers.get(name)
            if marker is None:
                store.replace_contents([], None)
            else:
                self.restore_store(name, store, decode_marker(marker, self.context.blob_prefix(name)))

    def restore_store(self, name: str, store: LocalStore, chain: list[str]) -> None:
        parsed = parse_blob_name(self.context.blob_prefix(name), chain[-1])
        assert parsed is not None
        head = parsed[1]
        if self.reusable(store, head):
            self.count("restore.stores.reused")
            return
        state: dict[bytes, bytes] = {}
        for _blob, records in self.verified_chain(name, chain):
            for key, value in records:
                if value is None:
                    state.pop(key, None)
                else:
                    state[key] = value
        store.replace_contents(sorted(state.items()), head)
        self.count("restore.stores.full")

    def count(self, counter: str) -> None:
        """Count one store's restore in ``counter`` (``restore.stores.reused`` or ``restore.stores.full``)."""
        self.context.metrics.increment(counter)

    def expected(self, name: str, blob: str) -> BlobHeader | None:
        """What blob ``blob`` of store ``name`` must say it is: its name's kind and version, this job, task, store."""
        return _expected(self.context, name, blob)

    def reusable(self, store: LocalStore, head: LocalVersion) -> bool:
        """The local data already is the chain's last step."""
        return store.version == head

    def verified_chain(self, name: str, chain: list[str]) -> list[tuple[str, list[Record]]]:
        """Every blob of the chain, downloaded and verified before anything is loaded."""
        verified = []
        for blob in chain:
            try:
                data = self.context.blob_store.get(blob)
            except NotFoundError as exc:
                raise NotFoundError(
                    f"store {name}: blob {blob} that the checkpoint names is missing from "
                    f"{self.context.blob_store.describe()}"
                ) from exc
            self.context.metrics.increment("restore.bytes", len(data), store=name, backend=self.context.factory_name)
            verified.append(
                (blob, decode_blob(data, name=blob, expected=self.expected(name, blob), verify=self.verify_digest))
            )
        return verified


# -- admin ----------------------------------------------------------------------------------------------------------


@attrs.define
class ReferenceAdmin(StateBackendAdmin):
    """The blob store is this backend's only resource; a marker's blobs are its chain."""

    context: BackendContext

    def create_resources(self) -> None:
        self.context.blob_store.create_resources()

    def validate_resources(self) -> None:
        self.context.blob_store.validate()

    def referenced_blobs(self, store: str, marker: str) -> set[str] | None:
        return set(decode_marker(marker, self.context.blob_prefix(store)))


ReferenceBackendFactory.backup_class = ReferenceBackupManager
ReferenceBackendFactory.restore_class = ReferenceRestoreManager
