"""Record classes and migration functions the value tests name in their configs (``record:tests.record_values:...``,
``tests.record_values:...``): module level, so Spark's executors import them as the driver does."""

from __future__ import annotations

import dataclasses
import datetime
from typing import Any, NamedTuple

import attrs

#: every call of a migration function in this process: (migration, key)
CALLS: list[tuple[str, Any]] = []


@attrs.frozen
class CountV1:
    """A word's count and the first batch it was seen in."""

    count: int
    first: str


@attrs.frozen
class CountV2:
    """CountV1 one deployment later: ``first`` dropped, ``last`` added with a default, ``count`` widened to float."""

    count: float
    last: str = ""


@attrs.frozen
class CountBadType:
    """CountV1 with ``first`` changed from str to int: its old values cannot be read."""

    count: int
    first: int


@attrs.frozen
class CountNoDefault:
    """CountV1 with a field added without a default: old values have nothing to fill it with."""

    count: int
    first: str
    seen: int


@attrs.frozen
class CountV3:
    """What migration ``split-first`` makes of a CountV1 value: ``first`` becomes an int, the text goes to a tag."""

    count: int
    first: int
    tag: str = ""


@dataclasses.dataclass(frozen=True)
class Every:
    """A dataclass with a field of every type a record stores, optional ones included."""

    i: int
    f: float
    b: bool
    s: str
    raw: bytes
    items: list[Any]
    note: str | None = None
    n: int | None = None
    props: dict[str, Any] | None = None


class Pair(NamedTuple):
    """A NamedTuple record."""

    left: int
    right: str = "r"


@attrs.frozen
class WithADate:
    """A field type records do not store."""

    when: datetime.date


def split_first(key: Any, old: dict[str, Any]) -> CountV3:
    """Migration ``split-first``: CountV1 (as a dict of its fields) -> CountV3."""
    CALLS.append(("split-first", key))
    text = old["first"]
    return CountV3(count=old["count"], first=int(text.lstrip("b") or 0), tag=text)


def drop_small(key: Any, old: Any) -> Any:
    """A migration of json values: counts below 2 are deleted, the others doubled."""
    CALLS.append(("drop-small", key))
    return None if old < 2 else old * 2


def fail_at_k5(key: Any, old: dict[str, Any]) -> CountV3:
    """A migration that fails part way (at key ``k5``), after rewriting the keys before it."""
    if key == "k5":
        raise RuntimeError("injected failure in the migration")
    return split_first(key, old)


NOT_A_FUNCTION = 42
