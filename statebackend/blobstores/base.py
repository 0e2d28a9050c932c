"""The blob store contract and the URL registry that opens one.

A blob store is remote (or remote-like) object storage addressed by ``/``-separated names relative to its root.
Every implementation behaves the same way, proven by one contract suite
(``statebackend/testing/blobstore_contract.py``):

- ``put`` replaces atomically: a reader sees the old blob or the new one, never a part. With ``create_only=True``
  it raises :class:`AlreadyExistsError` when the name is taken (S3 412, Azure 409, ``O_EXCL``) and writes nothing.
- ``get`` of an absent name raises :class:`NotFoundError`. A byte range ``[start, end)`` is clamped to the blob.
- ``delete`` is idempotent: an absent name is success. ``delete_many`` deletes a batch of names the same way, in
  one request where the service has one (S3 DeleteObjects, Azure Blob Batch).
- ``delete_if_unchanged`` (where ``supports_conditional_delete``) deletes a blob only while it is still the version
  ``head`` saw (:attr:`BlobInfo.etag`, which changes on every write of the name, the same bytes written again too):
  a blob written again since is kept and reported, never lost (Azure ``If-Match``; the memory and ``file://``
  stores check their own version). A garbage collector uses it so that a writer that writes an old blob again to
  name it is never robbed of it by a sweep that judged the old version.
- ``put_if`` and ``get_versioned`` (where ``supports_conditional_put``): a compare-and-swap on one name. ``put_if``
  writes only if the blob is still the version given (``None``: only if absent) and returns the new version; else
  :class:`PreconditionFailedError` and nothing is written. ``get_versioned`` reads the bytes and their version in
  one request. Every write of the name changes the version, also one of the same bytes (the checkpoint head, its
  one user, puts a per-write nonce in its bytes anyway, so an S3 ETag, the MD5 of the bytes, changes too). S3 and
  Azure ``If-Match`` / ``If-None-Match: *``; the memory store under its lock; ``file://`` under a lock file.
- ``list(prefix)`` yields the names under ``prefix``, sorted. The prefix is a plain string matched literally (``%``,
  ``_``, ``*``, ``?``, ``[`` are characters, never wildcards), not a name: any string is allowed, and a prefix no
  valid name can have (``/a``, ``a//``, ``../``, one with a backslash or a control character) gives an empty
  listing, not a :class:`ConfigError` (:func:`prefix_can_match`). Only a prefix that is not a string is one.
- ``head`` gives size and metadata, or :class:`NotFoundError`.
- names that are empty, absolute, contain ``..`` or ``.`` segments or empty segments, or a character no store holds
  (NUL and the other control characters, backslash, a lone surrogate) are rejected with :class:`ConfigError` before
  anything is sent, the same on every store, so no name escapes the root (:func:`check_blob_name`). Every other
  character is an ordinary one.

The public operations are templates that do this checking, and error translation and redaction, once; a store
implements the raw operations they call (``_put``, ``_get``, ...; see :class:`BlobStore`), or overrides a public
operation and does the work itself (:func:`translate_errors`, and the ``check_*`` helpers).

Implementations are thread-safe: the commit pool calls one store from many threads.

A store declares the ``blob.store.*`` options it takes once, in :attr:`BlobStore.options` (specs without the
prefix), and they are parsed once, by :meth:`BlobStore.parse_options`: config parses a URL's options against its
scheme's schema (``Settings.blob_store_options``), and every later consumer (``open_blob_store``, ``from_url``, the
resilience layer) uses those values; parsing them again returns them unchanged. ``from_url`` receives them parsed,
defaults filled, as :class:`~statebackend.options.ParsedOptions`.

Optional capabilities (``validate``, ``create_resources``, ``use_resilience``, ``use_metrics``, ``supports_metadata``,
``supports_conditional_delete``, ``supports_conditional_put``) are part of the contract with defaults that do nothing; a
store overrides what it has to do.

Scheme registry (fsspec style): URL scheme -> dotted path, imported lazily, with an install hint when a package is
missing. A distribution declares its stores as entry points in group ``statebackend.blobstores`` (statebackend's own
four too, in its pyproject.toml); an application may register one at run time with :func:`register_blob_store`.
:func:`known_blob_store_schemes` is a read-only view of both. How to write and register a store: docs/blobstores.md.
"""

from __future__ import annotations

import abc
import builtins
import functools
import os
import re
import shutil
import types
from collections.abc import Callable, Iterator, Mapping
from typing import TYPE_CHECKING, Any, BinaryIO, ClassVar, Self, TypeVar, cast
from urllib.parse import urlsplit

import attrs

from statebackend.errors import ConfigError, NotFoundError, StateBackendError, StorageError
from statebackend.fsutil import atomic_write
from statebackend.options import OptionSpec, ParsedOptions, parse_options
from statebackend.plugins import entry_points, load_target
from statebackend.redact import redact, sanitized, scrub_chain

if TYPE_CHECKING:
    from statebackend.blobstores.resilience import Resilience
    from statebackend.metrics import Metrics

__all__ = [
    "ENTRY_POINT_GROUP",
    "AbandonedUpload",
    "BlobInfo",
    "BlobStore",
    "blob_store_class",
    "blob_store_option_schemas",
    "check_blob_name",
    "check_metadata",
    "check_range",
    "known_blob_store_schemes",
    "open_blob_store",
    "prefix_can_match",
    "register_blob_store",
    "translate_errors",
]

T = TypeVar("T")

_COPY_BUFFER = 4 * 1024 * 1024


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


#: the five core operations: public template -> the raw operation a store implements (or it overrides the public one)
_CORE_OPERATIONS: Mapping[str, str] = types.MappingProxyType(
    {"put": "_put", "get": "_get", "delete": "_delete", "list": "_list", "head": "_head"}
)

F = TypeVar("F", bound=Callable[..., Any])


def _template(method: F) -> F:
    """Marks a public method of :class:`BlobStore` as a template: it checks, then calls the raw operation."""
    method.__blob_store_template__ = True  # type: ignore[attr-defined]
    return method


def _is_template(method: object) -> bool:
    return bool(getattr(method, "__blob_store_template__", False))


def _raw_default(method: F) -> F:
    """Marks the base's stand-in for a core raw operation: a class that keeps it and the template is abstract."""
    method.__blob_store_raw_default__ = True  # type: ignore[attr-defined]
    return method


class _BlobStoreMeta(abc.ABCMeta):
    """ABCMeta that asks of each core operation either the raw method (``_put``) or a public override (``put``,
    today's contract): a class that keeps both the base's template and the base's stand-in for the raw method is
    abstract (it cannot be instantiated). Done here, not with ``abc.abstractmethod`` on the raw methods, so that a
    type checker does not call a store that overrides the public methods abstract."""

    def __new__(mcls, name: str, bases: tuple[type, ...], namespace: dict[str, Any], **kwargs: Any) -> _BlobStoreMeta:
        cls = super().__new__(mcls, name, bases, namespace, **kwargs)
        abstract = set(cls.__abstractmethods__)
        for public, raw in _CORE_OPERATIONS.items():
            if _is_template(getattr(cls, public, None)) and getattr(
                getattr(cls, raw, None), "__blob_store_raw_default__", False
            ):
                abstract.add(raw)
        cls.__abstractmethods__ = frozenset(abstract)
        return cls


def _translated(store: BlobStore, operation: str, what: str, exc: Exception) -> StateBackendError:
    """What leaves a store for ``exc`` raised by its ``operation`` on ``what``: a statebackend error with its chain
    scrubbed; any other exception as the store's :meth:`BlobStore._translate_error` maps it, chained to a sanitized
    stand-in, or as a :class:`StorageError` "unexpected" (not retried)."""
    secrets = store.redaction_secrets()
    if isinstance(exc, StateBackendError):
        return scrub_chain(exc, secrets)
    error = store._translate_error(exc, operation, what)
    if error is None:
        error = StorageError(
            f"unexpected {type(exc).__name__} from {operation} in {store.describe()}: "
            f"{redact(exc, secrets)}; not retried (please report it with this message)"
        )
    error.__cause__ = sanitized(exc, secrets)
    error.__suppress_context__ = True
    return scrub_chain(error, secrets)


def translate_errors(method: F) -> F:
    """Decorates a public method of a store that overrides it (today's contract, and the built-in ``az://`` and
    ``s3://`` stores): a statebackend error leaves with its chain scrubbed of the store's
    :meth:`~BlobStore.redaction_secrets` (no raw exception, no secret in ``__cause__``/``__context__``); any other
    exception leaves as :meth:`~BlobStore._translate_error` maps it, or as a :class:`StorageError` "unexpected",
    chained to a sanitized stand-in. The base's templates do the same around every raw operation, so a store that
    implements raw operations needs no decorator."""

    @functools.wraps(method)
    def wrapper(self: BlobStore, *args: Any, **kwargs: Any) -> Any:
        try:
            return method(self, *args, **kwargs)
        except Exception as exc:  # noqa: BLE001 - translated below, outside the handler (no raw __context__)
            error = _translated(self, method.__name__, str(args[0]) if args else "", exc)
        raise error

    return cast(F, wrapper)


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


class BlobStore(abc.ABC, metaclass=_BlobStoreMeta):
    """Remote object storage for backups and checkpoints. See the module docstring for the contract.

    **Writing a store: raw operations.** The public operations are templates that do the common work once: they
    check names (:func:`check_blob_name`), metadata (:func:`check_metadata`), byte ranges and batches before
    anything is sent, turn bytes-like data into ``bytes``, check a listing's order and prefix, translate errors and
    redact them. A store implements only the raw operations they call, on checked arguments:

    - ``_put(name, data, *, create_only, metadata)``: write ``data`` (``bytes``) atomically; ``metadata`` is a checked
      ``dict``; ``create_only`` on a taken name raises :class:`AlreadyExistsError` and writes nothing;
    - ``_get(name, start, end)``: bytes ``[start, end)`` (``start`` >= 0, ``end`` >= 0 or ``None``: to the end),
      clamped to the blob; absent -> :class:`NotFoundError`;
    - ``_delete(name)``: idempotent;
    - ``_list(prefix)``: the names starting with ``prefix`` **literally** (no wildcard: ``%``, ``_``, ``*``, ``?``,
      ``[`` are characters like any other), sorted; never called for a prefix no valid name can have;
    - ``_head(name)``: a :class:`BlobInfo`; absent -> :class:`NotFoundError`;
    - optional, with defaults built on the public operations: ``_set_metadata(name, metadata)`` (default: read and
      write back), ``_delete_many(names)`` (default: ``delete`` each), and, with their capability flags,
      ``_delete_if_unchanged(versions)``, ``_put_if(name, data, version)``, ``_get_versioned(name)``;
    - :meth:`_translate_error` maps the substrate's own exceptions (a lost connection -> a
      :class:`TransientStorageError`); anything left unmapped leaves as a :class:`StorageError` "unexpected".

    **Today's contract still works.** A store may instead override a public operation (``put``, ``get``, ...), as
    stores written before the templates do: the base then never calls the raw one (the class need not define it) and
    the store does its own checks, as :class:`~statebackend.blobstores.resilience.ResilientBlobStore` and the
    built-in ``file://``, ``az://`` and ``s3://`` stores do. :func:`translate_errors` gives such a method the
    templates' error translation and redaction. Per operation, whichever the class defines wins: a public override
    always, else the template around the raw method. The names ``_put``, ``_get``, ``_delete``, ``_list``,
    ``_head``, ``_set_metadata``, ``_delete_many``, ``_delete_if_unchanged``, ``_put_if``, ``_get_versioned`` and
    ``_translate_error`` are reserved for these meanings."""

    #: the URL this store was opened from, e.g. ``file:///var/state`` (never holds a credential)
    url: str = ""
    #: whether ``put(..., metadata=...)`` and :meth:`set_metadata` keep user metadata
    supports_metadata: bool = True
    #: whether :meth:`delete_if_unchanged` works: ``head`` gives every blob an :attr:`BlobInfo.etag` that changes on
    #: every write, and a delete can be made conditional on it. False (the default): callers use
    #: :meth:`delete_many` and bound the race themselves; such a store is never asked for a conditional delete
    supports_conditional_delete: bool = False
    #: whether a blob's version is a digest of its bytes (S3: the ETag is their MD5), so that a rewrite of the same
    #: bytes keeps it: a conditional delete then tells apart only a rewrite of other bytes, and callers keep
    #: bounding the race for same-bytes rewrites. False (the default): every write gets a new version
    versions_follow_bytes: bool = False
    #: whether :meth:`put_if` and :meth:`get_versioned` work (a compare-and-swap on one name). False (the default,
    #: so a third-party store keeps the checkpoint log's create-only write and its listing): never asked for them
    supports_conditional_put: bool = False
    #: the ``blob.store.*`` options this store takes (keys without the prefix), declared once: config validates
    #: ``blob.store.*`` against the schema of the URL's scheme, and ``from_url`` receives the values parsed
    options: ClassVar[Mapping[str, OptionSpec]] = {}

    @classmethod
    def from_url(cls, url: str, options: Mapping[str, Any]) -> BlobStore:
        """Open the store for ``url`` (a ``blob.store.url`` of the store's scheme) with its options parsed against
        :attr:`options`, defaults filled: use them as they are. Every store that a scheme names overrides this
        classmethod; the base's raises :class:`ConfigError` (and :func:`blob_store_class` refuses a class that does
        not override it)."""
        raise ConfigError(
            f"blob store {cls.__module__}.{cls.__qualname__} has no from_url(url, options) classmethod, which opens "
            f"it from blob.store.url ({redact(url)!r})"
        )

    @classmethod
    def parse_options(cls, options: Mapping[str, Any]) -> ParsedOptions:
        """``options`` parsed against :attr:`options`, defaults filled; an undeclared key or a bad value is a
        :class:`ConfigError` naming ``blob.store.<key>``. Options this schema already parsed are returned as they
        are, so each value is parsed once whoever asks first (config, or an entry point given raw options)."""
        owner = next(klass for klass in cls.__mro__ if "options" in vars(klass))
        name = f"{owner.__module__}:{owner.__qualname__}.options"
        return parse_options(cls.options, options, name=name, prefix="blob.store.")

    # -- the core: templates around the raw operations ------------------------------------------------------------

    @_template
    def put(
        self, name: str, data: bytes, *, create_only: bool = False, metadata: Mapping[str, str] | None = None
    ) -> None:
        """Write ``data`` under ``name`` atomically. ``create_only`` -> :class:`AlreadyExistsError` if taken.
        Template: checks the name and metadata, then calls the store's ``_put``."""
        check_blob_name(name)
        checked = check_metadata(metadata)
        payload = bytes(data)
        self._call("put", name, lambda: self._put(name, payload, create_only=create_only, metadata=checked))

    @_template
    def get(self, name: str, *, start: int | None = None, end: int | None = None) -> bytes:
        """Read the blob, or bytes ``[start, end)`` of it. Absent -> :class:`NotFoundError`. Template: checks the
        name and the range (a negative bound is a :class:`ConfigError`), then calls the store's ``_get``."""
        check_blob_name(name)
        first, stop = check_range(start, end)
        return self._call("get", name, lambda: bytes(self._get(name, first, stop)))

    @_template
    def delete(self, name: str) -> None:
        """Delete the blob; an absent blob is success (idempotent). Template: checks the name, then calls the
        store's ``_delete``."""
        check_blob_name(name)
        self._call("delete", name, lambda: self._delete(name))

    @_template
    def list(self, prefix: str = "") -> Iterator[str]:
        """Yield the names that start with ``prefix`` (a plain string: no character is a wildcard), sorted. A
        prefix no valid name can have (``/a``, ``a//``, ``../``, one with a backslash or NUL) gives an empty
        listing, never an error. Template: calls the store's ``_list`` and checks what it yields (each name under
        the prefix, strictly ascending: anything else is a :class:`StorageError`, never a wrong listing)."""
        if not prefix_can_match(prefix):
            return
        names = self._call("list", prefix, lambda: iter(self._list(prefix)))
        previous: str | None = None
        while True:
            name = self._call("list", prefix, lambda: next(names, None))
            if name is None:
                return
            if not isinstance(name, str) or not name.startswith(prefix):
                raise StorageError(
                    f"{self.describe()} listed {name!r} under the prefix {prefix!r}, which it does not start with "
                    f"(a listing matches the prefix literally: no character is a wildcard)"
                )
            if previous is not None and name <= previous:
                raise StorageError(
                    f"{self.describe()} listed {name!r} after {previous!r} under the prefix {prefix!r}: a listing "
                    f"is sorted, each name once"
                )
            previous = name
            yield name

    @_template
    def head(self, name: str) -> BlobInfo:
        """Size and metadata of the blob. Absent -> :class:`NotFoundError`. Template: checks the name, then calls
        the store's ``_head``."""
        check_blob_name(name)
        return self._call("head", name, lambda: self._head(name))

    # -- raw operations: what a store implements (or it overrides the public operation above) ----------------------

    @_raw_default
    def _put(self, name: str, data: bytes, *, create_only: bool, metadata: dict[str, str]) -> None:
        """Raw write of checked arguments (see the class docstring)."""
        raise NotImplementedError(f"{type(self).__qualname__} implements neither put nor _put")

    @_raw_default
    def _get(self, name: str, start: int, end: int | None) -> bytes:
        """Raw read of ``[start, end)``, clamped to the blob (see the class docstring)."""
        raise NotImplementedError(f"{type(self).__qualname__} implements neither get nor _get")

    @_raw_default
    def _delete(self, name: str) -> None:
        """Raw idempotent delete of a checked name."""
        raise NotImplementedError(f"{type(self).__qualname__} implements neither delete nor _delete")

    @_raw_default
    def _list(self, prefix: str) -> Iterator[str]:
        """Raw listing: the names starting with ``prefix`` literally, sorted."""
        raise NotImplementedError(f"{type(self).__qualname__} implements neither list nor _list")

    @_raw_default
    def _head(self, name: str) -> BlobInfo:
        """Raw head of a checked name."""
        raise NotImplementedError(f"{type(self).__qualname__} implements neither head nor _head")

    def _set_metadata(self, name: str, metadata: dict[str, str]) -> None:
        """Raw metadata replacement; the default reads the blob and writes it back with ``metadata``."""
        self.put(name, self.get(name), metadata=metadata)

    def _delete_many(self, names: builtins.list[str]) -> None:
        """Raw batch delete of checked names; the default deletes them one by one."""
        for name in names:
            self.delete(name)

    def _delete_if_unchanged(self, versions: dict[str, str]) -> frozenset[str]:
        """Raw conditional delete of checked names; the default refuses (no capability)."""
        raise StorageError(
            f"{self.describe()} cannot delete a blob on condition that it is unchanged (supports_conditional_delete "
            f"is false); use delete_many ({len(versions)} names asked)"
        )

    def _put_if(self, name: str, data: bytes, version: str | None) -> str:
        """Raw compare-and-swap write; the default refuses (no capability)."""
        raise StorageError(
            f"{self.describe()} cannot write a blob on condition of its version (supports_conditional_put is false); "
            f"blob {name!r} was not written"
        )

    def _get_versioned(self, name: str) -> tuple[bytes, str]:
        """Raw read of the bytes and their version; the default refuses (no capability)."""
        raise StorageError(
            f"{self.describe()} cannot read a blob with its version (supports_conditional_put is false); "
            f"blob {name!r} was not read"
        )

    def _translate_error(self, exc: Exception, operation: str, what: str) -> StateBackendError | None:
        """The statebackend error for ``exc``, an exception that is not one, raised by the raw ``operation`` on
        ``what`` (a name or prefix), or ``None`` to let it leave as a :class:`StorageError` "unexpected" (not
        retried). Override it to map the substrate's exceptions: a timeout or lost connection to
        :class:`~statebackend.errors.TransientStorageError` (retried by the resilience layer), a refusal to a
        :class:`StorageError` saying what to fix. The base chains the result to a sanitized stand-in of ``exc`` and
        redacts it; the default maps nothing."""
        return None

    def redaction_secrets(self) -> tuple[str, ...]:
        """The secrets this store holds (keys, tokens, SAS), scrubbed from every error leaving it (with the ones
        registered in :mod:`statebackend.redact`). Default: none."""
        return ()

    def _call(self, operation: str, what: str, call: Callable[[], T]) -> T:
        """``call()`` with its errors translated and redacted (:func:`translate_errors`'s rules)."""
        try:
            return call()
        except Exception as exc:  # noqa: BLE001 - translated below, outside the handler (no raw __context__)
            error = _translated(self, operation, what, exc)
        raise error

    # -- concrete defaults, overridden where a service does better --------------------------------------------

    @_template
    def set_metadata(self, name: str, metadata: Mapping[str, str]) -> None:
        """Replace the blob's user metadata (used for the expiry / remove-expiry of garbage collection). Absent ->
        :class:`NotFoundError`. Template: checks the name and metadata, then calls ``_set_metadata``."""
        check_blob_name(name)
        checked = check_metadata(metadata)
        self._call("set_metadata", name, lambda: self._set_metadata(name, checked))

    def exists(self, name: str) -> bool:
        """Whether a blob of this name exists (a ``head`` that did not raise :class:`NotFoundError`)."""
        try:
            self.head(name)
        except NotFoundError:
            return False
        return True

    def put_file(
        self,
        name: str,
        path: str | os.PathLike[str],
        *,
        create_only: bool = False,
        metadata: Mapping[str, str] | None = None,
    ) -> None:
        """Upload a local file. Services override this to upload large files in parallel parts."""
        with open(path, "rb") as f:
            self.put(name, f.read(), create_only=create_only, metadata=metadata)

    def get_file(self, name: str, path: str | os.PathLike[str]) -> int:
        """Download the blob to ``path`` atomically (temp file, fsync, rename). Returns the byte count."""
        with atomic_write(path, prefix=".download-", mode=0o600) as out:
            return self.get_into(name, out)

    def get_into(self, name: str, out: BinaryIO) -> int:
        """Write the blob's bytes into an open binary file. Returns the byte count."""
        data = self.get(name)
        out.write(data)
        return len(data)

    def iter_bytes(self, name: str, chunk_size: int = _COPY_BUFFER) -> Iterator[bytes]:
        """Stream the blob in chunks of at most ``chunk_size`` bytes (ranged reads)."""
        size = self.head(name).size
        offset = 0
        while offset < size:
            chunk = self.get(name, start=offset, end=min(size, offset + chunk_size))
            if not chunk:
                break
            offset += len(chunk)
            yield chunk

    @_template
    def delete_many(self, names: builtins.list[str]) -> None:  # builtins: ``list`` here is the method above
        """Delete every blob in ``names``; absent ones are success (idempotent, like :meth:`delete`), wherever they
        are among present ones: every present name is deleted. A store that deletes many names in one request
        implements ``_delete_many`` (S3 DeleteObjects, Azure Blob Batch: a retention of many blobs is then one
        request, not one each). A failure raises the error of :meth:`delete` naming what was not deleted; the other
        names may be gone (retrying the whole call is safe). Template: checks every name before anything is deleted,
        then calls ``_delete_many`` (default: :meth:`delete` one by one)."""
        checked = [check_blob_name(name) for name in names]
        if checked:
            self._call("delete_many", checked[0], lambda: self._delete_many(checked))

    @_template
    def delete_if_unchanged(self, versions: Mapping[str, str]) -> frozenset[str]:
        """Delete each blob of ``versions`` (name -> the :attr:`BlobInfo.etag` its ``head`` gave) only if it is still
        that version, in one request per batch where the service batches (like :meth:`delete_many`). Returns the
        names **kept** because they were written (or changed) since: not an error, the caller judged an older
        version. An absent name is success (deleted, not kept). Every name is checked before anything is deleted; a
        failure raises the error of :meth:`delete` and retrying the whole call is safe (a blob a lost reply deleted
        is absent now: success). Only for a store whose :attr:`supports_conditional_delete` is true; the default
        ``_delete_if_unchanged`` raises :class:`StorageError`."""
        checked = {check_blob_name(name): version for name, version in versions.items()}
        return self._call("delete_if_unchanged", next(iter(checked), ""), lambda: self._delete_if_unchanged(checked))

    @_template
    def put_if(self, name: str, data: bytes, *, version: str | None) -> str:
        """Write ``data`` under ``name`` only if the blob is still ``version`` (as :meth:`get_versioned` or an earlier
        :meth:`put_if` gave it), or, with ``version=None``, only if there is no blob of that name; return the new
        version. Otherwise :class:`~statebackend.errors.PreconditionFailedError` and nothing is written. No user
        metadata. Only for a store whose :attr:`supports_conditional_put` is true; the default ``_put_if`` raises
        :class:`StorageError`."""
        check_blob_name(name)
        payload = bytes(data)
        return self._call("put_if", name, lambda: self._put_if(name, payload, version))

    @_template
    def get_versioned(self, name: str) -> tuple[bytes, str]:
        """The blob's bytes and their version (for :meth:`put_if`), in one request. Absent ->
        :class:`NotFoundError`. Only where :attr:`supports_conditional_put`; the default ``_get_versioned`` raises
        :class:`StorageError`."""
        check_blob_name(name)
        return self._call("get_versioned", name, lambda: self._get_versioned(name))

    # -- optional capabilities: defaults that do nothing, overridden where a store has something to do ----------

    def abandoned_uploads(self, prefix: str = "") -> builtins.list[AbandonedUpload] | None:
        """Writes under ``prefix`` that never finished (a crashed writer's temp files, incomplete multipart
        uploads), for a garbage collection. Default ``None``: this store cannot list them (Azure discards
        uncommitted blocks by itself after 7 days; the memory store has none)."""
        return None

    def remove_abandoned_upload(self, upload: AbandonedUpload) -> None:
        """Remove one of :meth:`abandoned_uploads` (idempotent). Default: the store lists none, so there is none to
        remove."""
        raise StorageError(f"{self.describe()} has no abandoned uploads to remove ({upload.kind} {upload.name!r})")

    def validate(self) -> None:  # noqa: B027 - optional: the default has nothing to check
        """Check that the store is usable (its container, bucket or directory exists, the credentials work);
        raise :class:`~statebackend.errors.StorageError` saying what to fix. Default: nothing to check."""

    def create_resources(self) -> None:  # noqa: B027 - optional: the default has nothing to create
        """Create what the store needs (container, bucket, directory) when missing; success if it exists.
        Default: nothing to create."""

    def use_resilience(self, resilience: Resilience) -> bool:
        """Offered by :class:`~statebackend.blobstores.resilience.ResilientBlobStore`: a store that issues several
        requests per operation (parts of large transfers) keeps ``resilience`` to retry and hedge each request on its
        own and returns True; the default returns False (the wrapper then retries whole operations)."""
        return False

    def use_metrics(self, metrics: Metrics | None) -> None:  # noqa: B027 - optional: no requests to count
        """Count this store's requests (attempts, retries, hedges, bytes, latency) into ``metrics`` from now on
        (``None``: stop). Stores whose requests go through the resilience layer (az://, s3://) count them; the
        default (file://, memory://) has no requests to count."""

    def describe(self) -> str:
        """How this store names itself in error messages."""
        return f"{type(self).__name__}({self.url})"

    def close(self) -> None:  # noqa: B027 - optional: a store without handles has nothing to close
        """Release network clients and file handles."""

    def __enter__(self) -> Self:
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.close()


# -- registry -------------------------------------------------------------------------------------------------

#: the entry-point group in which a distribution declares its blob stores: URL scheme -> ``package.module:Class``.
#: statebackend's own (``file``, ``memory``, ``az``, ``s3``) are declared there too, in its pyproject.toml
ENTRY_POINT_GROUP = "statebackend.blobstores"


def register_blob_store(scheme: str, target: str, install_hint: str | None = None, *, replace: bool = False) -> None:
    """Register ``scheme`` -> ``"package.module:Class"`` at run time (nothing is imported until the scheme is
    opened); ``install_hint`` is what the error says to run when the import fails. The class is a
    :class:`BlobStore` with a ``from_url(url, options)`` classmethod. A scheme already known (registered, or an
    entry point of an installed distribution) is an error unless ``replace=True``; a registration shadows an entry
    point of the same scheme. Prefer an entry point in a package's metadata (docs/blobstores.md); this is for
    applications that define a store in their own code."""
    if not isinstance(scheme, str) or not _SCHEME_RE.match(scheme):
        raise ConfigError(
            f"blob store scheme {scheme!r} is not a valid URL scheme: use a lowercase letter, then lowercase letters, "
            "digits, '+', '.' or '-'"
        )
    if not isinstance(target, str) or not _TARGET_RE.fullmatch(target):
        raise ConfigError(f"blob store target {target!r} for {scheme}:// is not a dotted path 'package.module:Class'")
    known = known_blob_store_schemes()
    if scheme in known and not replace:
        raise ConfigError(
            f"blob store scheme {scheme!r} is already registered to {known[scheme]}; pass replace=True to override it"
        )
    _SCHEMES[scheme] = (target, install_hint)


def known_blob_store_schemes() -> Mapping[str, str]:
    """Read-only view: scheme -> dotted path, for the entry points of the installed distributions and the schemes
    registered at run time (which win)."""
    known = {scheme: declared[0].target for scheme, declared in entry_points(ENTRY_POINT_GROUP).items()}
    known.update({scheme: target for scheme, (target, _hint) in _SCHEMES.items()})
    return types.MappingProxyType(dict(sorted(known.items())))


def blob_store_class(scheme: str) -> type[BlobStore]:
    """The store class of ``scheme``, imported now. An unknown scheme (naming the known ones), a scheme two
    distributions declare differently, a package that is not installed (with its install hint) or a target that is
    no :class:`BlobStore` with ``from_url`` is a :class:`ConfigError`."""
    target, hint, source = _locate(scheme)
    try:
        cls = load_target(target)
    except ImportError as exc:
        advice = f"; install it with: {hint}" if hint else ""
        raise ConfigError(
            f"blob store {scheme}:// needs a package that is not installed ({exc}){advice} ({source})"
        ) from exc
    except Exception as exc:  # any error the module raises while it is imported, or a missing attribute
        raise ConfigError(
            f"blob store {scheme}:// could not be loaded from {target!r}: {type(exc).__name__}: {exc} ({source})"
        ) from exc
    if not (isinstance(cls, type) and issubclass(cls, BlobStore)):
        raise ConfigError(
            f"blob store {scheme}://: {target!r} is {cls!r}, not a subclass of "
            f"statebackend.blobstores.base.BlobStore ({source})"
        )
    from_url = getattr(cls, "from_url", None)
    if not callable(from_url) or getattr(from_url, "__func__", None) is getattr(BlobStore.from_url, "__func__", 0):
        raise ConfigError(
            f"blob store {scheme}://: {target} has no from_url(url, options) classmethod, which opens it from "
            f"blob.store.url ({source})"
        )
    return cls


def blob_store_option_schemas() -> dict[str, Mapping[str, OptionSpec]]:
    """Scheme -> the ``blob.store.*`` options its store takes, for every known scheme whose package is installed
    (a scheme whose package is missing or does not load is left out)."""
    schemas: dict[str, Mapping[str, OptionSpec]] = {}
    for scheme in known_blob_store_schemes():
        try:
            schemas[scheme] = blob_store_class(scheme).options
        except ConfigError:
            continue
    return schemas


def open_blob_store(url: str, options: Mapping[str, Any] | None = None) -> BlobStore:
    """Open the blob store for ``url`` (``file:///dir``, ``memory://name``, ``az://container/prefix``,
    ``s3://bucket/prefix``, or a scheme an installed distribution declares). ``options`` are the ``blob.store.*``
    settings other than the URL (without the prefix): ``Settings.blob_store_options``, used as they are, or raw ones,
    parsed against the scheme's :attr:`BlobStore.options` before the store sees them."""
    if not isinstance(url, str) or not url:
        raise ConfigError("blob.store.url is missing: set it, e.g. blob.store.url=file:///var/lib/statebackend")
    scheme = urlsplit(url).scheme
    if scheme not in known_blob_store_schemes():
        raise ConfigError(f"blob.store.url {redact(url)!r} has an unknown scheme {scheme!r}; {_known_list()}")
    cls = blob_store_class(scheme)
    return cls.from_url(url, cls.parse_options(options or {}))


#: schemes registered at run time by :func:`register_blob_store`: scheme -> (dotted path, install hint or None)
_SCHEMES: dict[str, tuple[str, str | None]] = {}

_SCHEME_RE = re.compile(r"^[a-z][a-z0-9+.-]*$")
_IDENTIFIER = r"[A-Za-z_][A-Za-z0-9_]*"
_TARGET_RE = re.compile(rf"{_IDENTIFIER}(\.{_IDENTIFIER})*:{_IDENTIFIER}(\.{_IDENTIFIER})*")
#: the distribution whose metadata declares the built-in schemes
_OWN_DISTRIBUTION = "statebackend"


def _locate(scheme: str) -> tuple[str, str | None, str]:
    """(dotted path, install hint, where it was declared) of ``scheme``, or a ConfigError naming the known ones."""
    registered = _SCHEMES.get(scheme)
    if registered is not None:
        return registered[0], registered[1], "registered by register_blob_store"
    declared = entry_points(ENTRY_POINT_GROUP).get(scheme, ())
    if not declared:
        raise ConfigError(f"blob store scheme {scheme!r} is unknown; {_known_list()}")
    if len({d.target for d in declared}) > 1:
        # Two stores for one scheme: which one would hold the state is an accident of sys.path order. Refuse.
        by = "; ".join(f"{d.distribution or 'an unnamed distribution'} -> {d.target}" for d in declared)
        raise ConfigError(
            f"blob store scheme {scheme!r} is declared by more than one installed distribution ({by}); uninstall "
            f"one, or choose with statebackend.blobstores.base.register_blob_store({scheme!r}, target, replace=True)"
        )
    entry = declared[0]
    hint = entry.install_hint() if entry.extras else None
    return entry.target, hint, f"entry point {scheme!r} of distribution {entry.distribution!r}"


def _known_list() -> str:
    """The known schemes, for an error; says how to get statebackend's own back when its metadata lacks them."""
    known = ", ".join(f"{scheme}://" for scheme in known_blob_store_schemes()) or "none"
    own = [
        d
        for declared in entry_points(ENTRY_POINT_GROUP).values()
        for d in declared
        if d.distribution == _OWN_DISTRIBUTION
    ]
    if own:
        return f"known: {known}"
    return (
        f"known: {known}. statebackend's own schemes (file://, memory://, az://, s3://) are declared as entry "
        f"points in group {ENTRY_POINT_GROUP!r} of its installed metadata, and none was found: reinstall it "
        "(pip install --force-reinstall statebackend, or pip install -e . in a checkout)"
    )


def copy_stream(source: BinaryIO, target: BinaryIO) -> int:
    """Copy an open binary stream into another; returns the byte count."""
    before = target.tell() if target.seekable() else 0
    shutil.copyfileobj(source, target, _COPY_BUFFER)
    return (target.tell() - before) if target.seekable() else 0
