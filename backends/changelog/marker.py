"""The changelog-delta backend's marker: the recipe that rebuilds one store at one checkpoint.

A marker is compact JSON. Format 2 (written since the compact recipe) gives each step its checkpoint id and flush
token only; the blob of a step is named by its seq and token under the store's blob prefix (:func:`delta_name`,
:func:`snapshot_name`), so the name is derived, not stored::

    {"format": 2,
     "snapshot": [40, "<checkpoint id>", "<token>"] | null,
     "seq": 41,
     "deltas": [["<checkpoint id>", "<token>"], ["<checkpoint id>", "<token>", 0], ...]}

``snapshot`` is the newest materialized snapshot the recipe starts from (``null``: the empty store); ``deltas`` are
the per-commit change files after it, in order, one per commit, their seqs consecutive from ``seq`` (present when
there are deltas; with a snapshot, always the snapshot's seq + 1). A commit that changed nothing has a step with a
third element ``0``: no blob, so the chain of versions stays complete and a local store at that version is still
recognised. The last step (delta, else snapshot) is the version the recipe rebuilds.

Format 1 (still read) spelled every step out, blob name included::

    {"format": 1,
     "snapshot": {"seq": 40, "checkpoint_id": "...", "token": "...", "name": "<blob>"} | null,
     "deltas": [{"seq": 41, "checkpoint_id": "...", "token": "...", "name": "<blob>" | null}, ...]}

The marker travels as a JSON string inside the checkpoint, so each of its quotes costs two bytes there: format 1 paid
about 170 bytes per step, format 2 about 45 (docs/formats-checkpoint.md).
"""

from __future__ import annotations

import json
from collections.abc import Iterator

import attrs

from statebackend.errors import CorruptDataError, IncompatibleFormatError, UsageError
from statebackend.recordfile import KIND_DELTA, FileHeader
from statebackend.store import LocalVersion

__all__ = [
    "MARKER_FORMAT",
    "READ_MARKER_FORMATS",
    "Recipe",
    "Step",
    "check_blob_binding",
    "delta_name",
    "snapshot_name",
]

#: the marker format this release writes
MARKER_FORMAT = 2
#: every marker format this release reads; a stored sample of each lives in tests/data/changelog/
READ_MARKER_FORMATS = (1, 2)
#: the third element of a format 2 delta step that has no blob (the commit changed nothing)
_NO_BLOB = 0


def delta_name(prefix: str, seq: int, token: str) -> str:
    """The blob of the delta at ``seq`` with flush token ``token``, under the store's blob prefix."""
    return f"{prefix}delta/{seq:012d}-{token}.delta"


def snapshot_name(prefix: str, seq: int, token: str) -> str:
    """The blob of the snapshot at ``seq`` with flush token ``token``, under the store's blob prefix."""
    return f"{prefix}snapshot/{seq:012d}-{token}.snap"


@attrs.frozen
class Step:
    """One version in a store's lineage: a snapshot or a delta, and the blob holding it (``None``: empty delta)."""

    seq: int
    checkpoint_id: str
    token: str
    name: str | None

    @property
    def version(self) -> LocalVersion:
        return LocalVersion(checkpoint_id=self.checkpoint_id, token=self.token)

    @classmethod
    def from_json(cls, data: object, source: str) -> Step:
        """A format 1 step (an object with its blob name)."""
        if not isinstance(data, dict):
            raise CorruptDataError(f"changelog marker {source}: a step is not an object")
        try:
            step = cls(
                seq=int(data["seq"]),
                checkpoint_id=str(data["checkpoint_id"]),
                token=str(data["token"]),
                name=None if data.get("name") is None else str(data["name"]),
            )
        except (KeyError, TypeError, ValueError) as exc:
            raise CorruptDataError(f"changelog marker {source}: bad step {data!r}: {exc}") from exc
        return step


@attrs.frozen
class Recipe:
    """Snapshot (or nothing) plus the deltas after it."""

    snapshot: Step | None
    deltas: tuple[Step, ...] = ()

    @property
    def head(self) -> Step | None:
        """The version this recipe rebuilds (``None``: the empty store)."""
        if self.deltas:
            return self.deltas[-1]
        return self.snapshot

    @property
    def seq(self) -> int:
        head = self.head
        return head.seq if head is not None else 0

    def blob_names(self) -> Iterator[str]:
        """Every blob the recipe needs."""
        if self.snapshot is not None and self.snapshot.name is not None:
            yield self.snapshot.name
        for delta in self.deltas:
            if delta.name is not None:
                yield delta.name

    def steps(self) -> Iterator[Step]:
        if self.snapshot is not None:
            yield self.snapshot
        yield from self.deltas

    def encode(self, *, prefix: str) -> str:
        """The format 2 marker. ``prefix`` is the store's blob prefix: every step's blob must be the one its seq and
        token name under it (a delta without a blob: ``None``), and the deltas' seqs consecutive after the snapshot,
        or the marker could not name exactly these blobs; anything else is a bug, raised as UsageError."""
        snapshot: list[object] | None = None
        if self.snapshot is not None:
            step = self.snapshot
            if step.name != snapshot_name(prefix, step.seq, step.token):
                raise UsageError(
                    f"changelog recipe: snapshot {step.name!r} at seq {step.seq} is not "
                    f"{snapshot_name(prefix, step.seq, step.token)!r}, the name format 2 derives"
                )
            snapshot = [step.seq, step.checkpoint_id, step.token]
        document: dict[str, object] = {"format": MARKER_FORMAT, "snapshot": snapshot}
        deltas: list[list[object]] = []
        if self.deltas:
            first = self.deltas[0].seq
            if self.snapshot is not None and first != self.snapshot.seq + 1:
                raise UsageError(
                    f"changelog recipe: the first delta has seq {first}, the snapshot "
                    f"{self.snapshot.seq}; format 2 needs consecutive seqs"
                )
            document["seq"] = first
            for index, step in enumerate(self.deltas):
                if step.seq != first + index:
                    raise UsageError(
                        f"changelog recipe: delta seq {step.seq} follows "
                        f"{first + index - 1}; format 2 needs consecutive seqs"
                    )
                if step.name is None:
                    deltas.append([step.checkpoint_id, step.token, _NO_BLOB])
                    continue
                if step.name != delta_name(prefix, step.seq, step.token):
                    raise UsageError(
                        f"changelog recipe: delta {step.name!r} at seq {step.seq} is not "
                        f"{delta_name(prefix, step.seq, step.token)!r}, the name format 2 "
                        "derives"
                    )
                deltas.append([step.checkpoint_id, step.token])
        document["deltas"] = deltas
        return json.dumps(document, separators=(",", ":"), ensure_ascii=False)

    @classmethod
    def decode(cls, marker: str, *, prefix: str, source: str = "<marker>") -> Recipe:
        """The recipe of a format 1 or 2 marker. ``prefix`` is the store's blob prefix
        (``BackendContext.blob_prefix``), under which format 2 steps name their blobs; format 1 markers carry their
        names."""
        try:
            data = json.loads(marker)
        except (TypeError, ValueError) as exc:
            raise CorruptDataError(f"changelog marker {source} is not valid JSON: {exc}") from exc
        if not isinstance(data, dict):
            raise CorruptDataError(f"changelog marker {source} is not a JSON object")
        version = data.get("format")
        if version == 2:
            return cls._decode_format_2(data, prefix=prefix, source=source)
        if version != 1:
            raise IncompatibleFormatError(
                f"changelog marker {source} has format {version!r}; this release reads formats "
                f"{list(READ_MARKER_FORMATS)}"
            )
        deltas = data.get("deltas")
        if not isinstance(deltas, list):
            raise CorruptDataError(f"changelog marker {source}: 'deltas' is not a list")
        snapshot = data.get("snapshot")
        return cls(
            snapshot=None if snapshot is None else Step.from_json(snapshot, source),
            deltas=tuple(Step.from_json(d, source) for d in deltas),
        )

    @classmethod
    def _decode_format_2(cls, data: dict[str, object], *, prefix: str, source: str) -> Recipe:
        snapshot_data = data.get("snapshot", ())
        deltas_data = data.get("deltas")
        if not isinstance(deltas_data, list):
            raise CorruptDataError(f"changelog marker {source}: 'deltas' is not a list")
        snapshot: Step | None = None
        if snapshot_data is not None:
            if not (
                isinstance(snapshot_data, list)
                and len(snapshot_data) == 3
                and _is_seq(snapshot_data[0])
                and _are_strings(snapshot_data[1:])
            ):
                raise CorruptDataError(
                    f"changelog marker {source}: the snapshot {snapshot_data!r} is not [seq, checkpoint id, token]"
                )
            seq, checkpoint_id, token = snapshot_data
            snapshot = Step(seq, checkpoint_id, token, snapshot_name(prefix, seq, token))
        first = data.get("seq")
        if not deltas_data:
            if first is not None:
                raise CorruptDataError(f"changelog marker {source}: 'seq' {first!r} without deltas")
            return cls(snapshot=snapshot)
        if not _is_seq(first) or (snapshot is not None and first != snapshot.seq + 1):
            after = f"the snapshot's seq + 1 ({snapshot.seq + 1})" if snapshot is not None else "a seq (1 or more)"
            raise CorruptDataError(f"changelog marker {source}: the first delta's 'seq' is {first!r}, not {after}")
        assert isinstance(first, int)
        deltas = []
        for index, step in enumerate(deltas_data):
            if not (
                isinstance(step, list)
                and (len(step) == 2 or (len(step) == 3 and _is_no_blob(step[2])))
                and _are_strings(step[:2])
            ):
                raise CorruptDataError(
                    f"changelog marker {source}: delta {index} {step!r} is not [checkpoint id, "
                    f"token] or [checkpoint id, token, {_NO_BLOB}] (no blob)"
                )
            seq = first + index
            checkpoint_id, token = step[0], step[1]
            deltas.append(Step(seq, checkpoint_id, token, None if len(step) == 3 else delta_name(prefix, seq, token)))
        return cls(snapshot=snapshot, deltas=tuple(deltas))


def _is_seq(value: object) -> bool:
    return type(value) is int and value >= 1  # not a bool, not a float


def _is_no_blob(value: object) -> bool:
    return type(value) is int and value == _NO_BLOB


def _are_strings(values: list[object]) -> bool:
    return all(isinstance(value, str) and value for value in values)


def check_blob_binding(header: FileHeader, step: Step, *, kind: str, job: str, task: str, store: str) -> None:
    """Raise :class:`CorruptDataError` unless a delta or snapshot file's header says it is the blob ``step`` names:
    the same kind, job, task, store, sequence number (and base), checkpoint id and flush token. A checksum proves a
    file intact; this proves it is the right one (not an older blob of the store, nor another task's or store's,
    written over the name)."""
    base_seq = step.seq - 1 if kind == KIND_DELTA else step.seq
    fields = "(kind, job, task, store, seq, base_seq, checkpoint_id, token)"
    expected = (kind, job, task, store, step.seq, base_seq, step.checkpoint_id, step.token)
    found = (
        header.kind,
        header.job,
        header.task,
        header.store,
        header.seq,
        header.base_seq,
        header.checkpoint_id,
        header.token,
    )
    if expected != found:
        raise CorruptDataError(
            f"blob {step.name} is intact but is not the {kind} the checkpoint names: expected {fields}={expected}, "
            f"found {found}; another file (an older one of this store, or another task's or store's) was written "
            f"over it. Nothing of it was applied: restore an older checkpoint or from another backend's marker"
        )
