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

This module holds the contract's class, :class:`BlobStore`, and is where every name of the contract is imported from:
the checks and values are defined in :mod:`statebackend.blobstores.checks`, the registry in
:mod:`statebackend.blobstores.registry`, and both are re-exported here.
"""

from __future__ import annotations

import abc
import builtins
import functools
import os
import shutil
import types
from collections.abc import Callable, Iterator, Mapping
from typing import TYPE_CHECKING, Any, BinaryIO, ClassVar, Self, TypeVar, cast

from statebackend.blobstores import registry as _registry
from statebackend.blobstores.checks import (
    AbandonedUpload,
    BlobInfo,
    check_blob_name,
    check_metadata,
    check_range,
    prefix_can_match,
)
from statebackend.blobstores.registry import (
    blob_store_class,
    blob_store_option_schemas,
    known_blob_store_schemes,
    open_blob_store,
    register_blob_store,
)
from statebackend.errors import ConfigError, NotFoundError, StateBackendError, StorageError
from statebackend.fsutil import atomic_write
from statebackend.options import OptionSpec, ParsedOptions, parse_options
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

#: the entry-point group in which a distribution declares its blob stores: URL scheme -> ``package.module:Class``.
#: statebackend's own (``file``, ``memory``, ``az``, ``s3``) are declared there too, in its pyproject.toml (the
#: registry, :mod:`statebackend.blobstores.registry`, reads it)
ENTRY_POINT_GROUP = _registry.ENTRY_POINT_GROUP


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


def copy_stream(source: BinaryIO, target: BinaryIO) -> int:
    """Copy an open binary stream into another; returns the byte count."""
    before = target.tell() if target.seekable() else 0
    shutil.copyfileobj(source, target, _COPY_BUFFER)
    return (target.tell() - before) if target.seekable() else 0
