"""Checkpoint values: what a commit makes durable.

- :class:`CheckpointV1`: the task's input offsets only (the pre-SEP-28 form; still read, optionally written).
- :class:`CheckpointV2`: checkpoint id, input offsets, and the state checkpoint markers of every state backend
  (canonical factory name -> {store name -> marker}).

Both are immutable values compared by value and hashable: their mappings are converted to a read-only, hashable
mapping (:class:`FrozenMap`) of ``str`` to ``str`` (markers: ``str`` to a ``FrozenMap``). A wrong key or value type is
a :class:`TypeError` at construction, so no checkpoint with a non-string offset ever reaches the serde.
"""

from __future__ import annotations

from collections.abc import Iterator, Mapping
from typing import Any, ClassVar

import attrs
from statebackend.checkpoint.id import CheckpointId

__all__ = ["CheckpointV1", "CheckpointV2", "FrozenMap"]


class FrozenMap(Mapping[str, Any]):
    """A read-only, hashable mapping. Equal to any mapping with the same items (a plain dict included)."""

    __slots__ = ("_hash", "_items")

    def __init__(self, items: Mapping[str, Any] | None = None) -> None:
        self._items: dict[str, Any] = dict(items or {})
        self._hash: int | None = None

    def __getitem__(self, key: str) -> Any:
        return self._items[key]

    def __iter__(self) -> Iterator[str]:
        return iter(self._items)

    def __len__(self) -> int:
        return len(self._items)

    def __hash__(self) -> int:
        if self._hash is None:
            self._hash = hash(frozenset(self._items.items()))
        return self._hash

    def __repr__(self) -> str:
        return f"{type(self).__name__}({self._items!r})"


def _string_map(what: str, value: Mapping[str, str]) -> FrozenMap:
    if not isinstance(value, Mapping):
        raise TypeError(f"{what} must be a mapping of str to str, got {type(value).__name__}")
    for key, item in value.items():
        if not isinstance(key, str) or not isinstance(item, str):
            raise TypeError(f"{what} must map str to str; got {key!r}: {item!r}")
    return value if isinstance(value, FrozenMap) else FrozenMap(value)


# Named functions, not closures: mypy's attrs plugin reads a converter's type only from a def, a type or a lambda.
def _offsets(value: Mapping[str, str]) -> FrozenMap:
    return _string_map("input_offsets", value)


def _store_markers(value: Mapping[str, str]) -> FrozenMap:
    return _string_map("state checkpoint markers of a factory", value)


def _markers(value: Mapping[str, Mapping[str, str]]) -> FrozenMap:
    if not isinstance(value, Mapping):
        raise TypeError(f"state_checkpoint_markers must be a mapping factory -> {{store: marker}}, got {value!r}")
    converted: dict[str, FrozenMap] = {}
    for factory, stores in value.items():
        if not isinstance(factory, str):
            raise TypeError(f"state_checkpoint_markers keys must be factory names (str), got {factory!r}")
        converted[factory] = _store_markers(stores)
    return FrozenMap(converted)


_EMPTY = FrozenMap()


@attrs.frozen
class CheckpointV1:
    """Input offsets only: system-stream-partition (or source) name -> offset."""

    version: ClassVar[int] = 1

    input_offsets: Mapping[str, str] = attrs.field(converter=_offsets)


@attrs.frozen
class CheckpointV2:
    """A commit's result: its id, the input position, and where every backend put each store's state."""

    version: ClassVar[int] = 2

    checkpoint_id: CheckpointId = attrs.field(validator=attrs.validators.instance_of(CheckpointId))
    input_offsets: Mapping[str, str] = attrs.field(converter=_offsets)
    state_checkpoint_markers: Mapping[str, Mapping[str, str]] = attrs.field(factory=dict, converter=_markers)
    #: store -> {"key": serde name, "msg": serde name} the state was written with (empty in older checkpoints)
    serdes: Mapping[str, Mapping[str, str]] = attrs.field(factory=dict, converter=_markers)

    def markers_for(self, factory: str) -> Mapping[str, str]:
        """``{store: marker}`` written by ``factory`` (its canonical name); empty if it wrote none."""
        return self.state_checkpoint_markers.get(factory, _EMPTY)

    def to_v1(self) -> CheckpointV1:
        """The V1 form of this checkpoint (its input offsets), for ``task.checkpoint.write.versions`` with 1."""
        return CheckpointV1(self.input_offsets)
