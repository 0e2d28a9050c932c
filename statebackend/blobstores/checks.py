"""The arguments and values of the blob store contract (:mod:`statebackend.blobstores.base`): the checks every store
makes before anything is sent (a blob name, a byte range, user metadata, a listing prefix), the same on every store,
and the values ``head`` and ``abandoned_uploads`` give (:class:`BlobInfo`, :class:`AbandonedUpload`). Kept apart so
that the base module holds the contract's class. Import these from :mod:`statebackend.blobstores.base`, which
re-exports them."""

from __future__ import annotations

import re
import types
from collections.abc import Mapping

import attrs

from statebackend.errors import ConfigError

__all__ = [
    "AbandonedUpload",
    "BlobInfo",
    "check_blob_name",
    "check_metadata",
    "check_range",
    "prefix_can_match",
]


def _frozen_metadata(metadata: Mapping[str, str]) -> Mapping[str, str]:
    """A read-only copy: a ``BlobInfo`` is a value, its metadata cannot change under its holder."""
    return types.MappingProxyType(dict(metadata))


@attrs.frozen
class BlobInfo:
    """What ``head`` tells about a blob."""

    #: the blob's name
    name: str
    #: its size in bytes
    size: int
    #: its metadata, read-only (empty where the store keeps none: :attr:`BlobStore.supports_metadata`)
    metadata: Mapping[str, str] = attrs.field(factory=dict, converter=_frozen_metadata)
    #: the version of the blob this ``head`` saw, for :meth:`BlobStore.delete_if_unchanged`: opaque, and different
    #: after every write of the name (the same bytes written again too; ``set_metadata`` may change it as well).
    #: ``None`` where the store cannot tell (its :attr:`BlobStore.supports_conditional_delete` is false, or for a blob
    #: whose version it cannot vouch for, such as ``file://`` on a filesystem that keeps whole seconds: a collector
    #: deletes such a blob with :meth:`BlobStore.delete_many`, as on a store without conditional deletes)
    etag: str | None = None


@attrs.frozen
class AbandonedUpload:
    """A write that never finished and that no reader sees: a temp file of a ``file://`` store, an incomplete S3
    multipart upload. Found by :meth:`BlobStore.abandoned_uploads`, removed by
    :meth:`BlobStore.remove_abandoned_upload`."""

    #: what it is, for people: ``temp file``, ``multipart upload``
    kind: str
    #: the blob name it was written for (a temp file: its path under the root)
    name: str
    #: seconds since it was started or last written (``None``: unknown)
    age_s: float | None
    #: bytes it holds (``None``: unknown)
    size: int | None
    #: the store's own handle (an upload id, a path)
    handle: str


_BAD_SEGMENTS = {"", ".", ".."}
#: characters no blob name holds on any store: NUL and the other control characters (a listing's XML cannot carry
#: them), and the backslash (a path separator on some filesystems and SDKs)
_UNHOLDABLE_RE = re.compile(r"[\x00-\x1f\x7f\\]")


def _encodable(text: str) -> bool:
    """Whether ``text`` is valid Unicode for UTF-8 (no lone surrogate), as every store's wire or disk needs."""
    try:
        text.encode("utf-8")
    except UnicodeEncodeError:
        return False
    return True


def check_blob_name(name: str) -> str:
    """Return ``name`` if it is a safe relative blob name, else raise :class:`ConfigError`. The same names are
    refused on every store: empty ones, absolute ones, ones with an empty, ``.`` or ``..`` segment, and ones with a
    character no store holds (NUL and other control characters, backslash, a lone surrogate). Every other
    character, ``%``, ``_``, ``*``, ``?``, ``[`` and ``]`` included, is an ordinary character of a name."""
    if not isinstance(name, str) or not name:
        raise ConfigError(f"blob name must be a non-empty string, got {name!r}")
    if name.startswith("/"):
        raise ConfigError(f"blob name {name!r} must be relative ('/'-separated, not starting with '/')")
    bad = _UNHOLDABLE_RE.search(name)
    if bad is not None:
        raise ConfigError(
            f"blob name {name!r} has the character {bad.group()!r}, which no blob store holds: names are printable, "
            f"without control characters or backslash ('/' separates segments)"
        )
    if not _encodable(name):
        raise ConfigError(f"blob name {name!r} is not valid Unicode (a lone surrogate); names are UTF-8 text")
    if any(segment in _BAD_SEGMENTS for segment in name.split("/")):
        raise ConfigError(f"blob name {name!r} has an empty, '.' or '..' segment; it could escape the store root")
    return name


def check_range(start: int | None, end: int | None) -> tuple[int, int | None]:
    """``(start, end)`` of a ranged read with ``start`` defaulted to 0, or a :class:`ConfigError` for a negative
    bound (it would slice from the end in Python, and means nothing to a service's byte range)."""
    if (start is not None and start < 0) or (end is not None and end < 0):
        raise ConfigError(f"byte range [{start}, {end}) must not be negative")
    return start or 0, end


_METADATA_KEY_RE = re.compile(r"^[a-z][a-z0-9_]{0,62}$")


def check_metadata(metadata: Mapping[str, str] | None) -> dict[str, str]:
    """Return ``metadata`` as a dict if every key is portable across services (lowercase letter, then lowercase
    letters, digits or ``_``; at most 63 characters: what S3, Azure and a file all keep as given) and every value a
    printable ASCII string; else raise :class:`ConfigError` before anything is written."""
    checked: dict[str, str] = {}
    for key, value in (metadata or {}).items():
        if not isinstance(key, str) or not _METADATA_KEY_RE.match(key):
            raise ConfigError(
                f"blob metadata key {key!r} is not portable: use a lowercase letter, then lowercase letters, digits "
                f"or '_' (Azure refuses '-', S3 lowercases keys)"
            )
        if not isinstance(value, str) or not value.isascii() or not value.isprintable():
            raise ConfigError(f"blob metadata value of {key!r} must be a printable ASCII string, got {value!r}")
        checked[key] = value
    return checked


def prefix_can_match(prefix: str) -> bool:
    """Whether some valid blob name (:func:`check_blob_name`) starts with ``prefix``. A listing under a prefix that
    cannot match is empty, never an error: a prefix is a plain string filter, not a name. The base's
    :meth:`BlobStore.list` answers such a listing without asking the store; a store that overrides ``list`` may use
    this to do the same. A prefix that is not a string is a :class:`ConfigError`."""
    if not isinstance(prefix, str):
        raise ConfigError(f"blob listing prefix must be a string, got {prefix!r}")
    if not prefix:
        return True
    if prefix.startswith("/") or _UNHOLDABLE_RE.search(prefix) or not _encodable(prefix):
        return False
    complete = prefix.split("/")[:-1]  # the last segment may still grow into any valid one ("." into ".x")
    return not any(segment in _BAD_SEGMENTS for segment in complete)
