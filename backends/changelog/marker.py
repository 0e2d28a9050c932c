"""The changelog-delta backend's marker: the recipe that rebuilds one store at one checkpoint.

A marker is compact JSON::

    {"format": 1,
     "snapshot": {"seq": 40, "checkpoint_id": "...", "token": "...", "name": "<blob>"} | null,
     "deltas": [{"seq": 41, "checkpoint_id": "...", "token": "...", "name": "<blob>" | null}, ...]}

``snapshot`` is the newest materialized snapshot the recipe starts from (``null``: the empty store at seq 0);
``deltas`` are the per-commit change files after it, in order, one per commit. A commit that changed nothing has an
entry with ``name: null`` (no blob), so the chain of versions stays complete and a local store at that version is
still recognised. The last element (delta, else snapshot) is the version the recipe rebuilds.
"""

from __future__ import annotations

import json
from collections.abc import Iterator

import attrs

from statebackend.errors import CorruptDataError, IncompatibleFormatError
from statebackend.recordfile import KIND_DELTA, FileHeader
from statebackend.store import LocalVersion

__all__ = ["MARKER_FORMAT", "Recipe", "Step", "check_blob_binding"]

MARKER_FORMAT = 1


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

    def to_json(self) -> dict[str, object]:
        return {"seq": self.seq, "checkpoint_id": self.checkpoint_id, "token": self.token, "name": self.name}

    @classmethod
    def from_json(cls, data: object, source: str) -> Step:
        if not isinstance(data, dict):
            raise CorruptDataError(f"changelog marker {source}: a step is not an object")
        try:
            step = cls(seq=int(data["seq"]), checkpoint_id=str(data["checkpoint_id"]), token=str(data["token"]),
                       name=None if data.get("name") is None else str(data["name"]))
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

    def encode(self) -> str:
        return json.dumps(
            {
                "format": MARKER_FORMAT,
                "snapshot": None if self.snapshot is None else self.snapshot.to_json(),
                "deltas": [d.to_json() for d in self.deltas],
            },
            separators=(",", ":"),
        )

    @classmethod
    def decode(cls, marker: str, *, source: str = "<marker>") -> Recipe:
        try:
            data = json.loads(marker)
        except (TypeError, ValueError) as exc:
            raise CorruptDataError(f"changelog marker {source} is not valid JSON: {exc}") from exc
        if not isinstance(data, dict):
            raise CorruptDataError(f"changelog marker {source} is not a JSON object")
        version = data.get("format")
        if version != MARKER_FORMAT:
            raise IncompatibleFormatError(
                f"changelog marker {source} has format {version!r}; this release reads format {MARKER_FORMAT}"
            )
        deltas = data.get("deltas")
        if not isinstance(deltas, list):
            raise CorruptDataError(f"changelog marker {source}: 'deltas' is not a list")
        snapshot = data.get("snapshot")
        return cls(
            snapshot=None if snapshot is None else Step.from_json(snapshot, source),
            deltas=tuple(Step.from_json(d, source) for d in deltas),
        )


def check_blob_binding(header: FileHeader, step: Step, *, kind: str, job: str, task: str, store: str) -> None:
    """Raise :class:`CorruptDataError` unless a delta or snapshot file's header says it is the blob ``step`` names:
    the same kind, job, task, store, sequence number (and base), checkpoint id and flush token. A checksum proves a
    file intact; this proves it is the right one (not an older blob of the store, nor another task's or store's,
    written over the name)."""
    base_seq = step.seq - 1 if kind == KIND_DELTA else step.seq
    fields = "(kind, job, task, store, seq, base_seq, checkpoint_id, token)"
    expected = (kind, job, task, store, step.seq, base_seq, step.checkpoint_id, step.token)
    found = (header.kind, header.job, header.task, header.store, header.seq, header.base_seq, header.checkpoint_id,
             header.token)
    if expected != found:
        raise CorruptDataError(
            f"blob {step.name} is intact but is not the {kind} the checkpoint names: expected {fields}={expected}, "
            f"found {found}; another file (an older one of this store, or another task's or store's) was written "
            f"over it. Nothing of it was applied: restore an older checkpoint or from another backend's marker"
        )
