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
- ``list(prefix)`` yields the names under ``prefix`` (plain string prefix), sorted.
- ``head`` gives size and metadata, or :class:`NotFoundError`.
- names that are empty, absolute, contain ``..`` or ``.`` segments, empty segments or NUL are rejected with
  :class:`ConfigError` before anything is sent, so no name escapes the root.

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
import os
import re
import shutil
import types
from collections.abc import Iterator, Mapping
from typing import TYPE_CHECKING, Any, BinaryIO, ClassVar, Self
from urllib.parse import urlsplit

import attrs

from statebackend.errors import ConfigError, NotFoundError, StorageError
from statebackend.fsutil import atomic_write
from statebackend.options import OptionSpec, ParsedOptions, parse_options
from statebackend.plugins import entry_points, load_target
from statebackend.redact import redact

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
    "known_blob_store_schemes",
    "open_blob_store",
    "register_blob_store",
]

_COPY_BUFFER = 4 * 1024 * 1024


def _frozen_metadata(metadata: Mapping[str, str]) -> Mapping[str, str]:
    """A read-only copy: a ``BlobInfo`` is a value, its metadata cannot change under its holder."""
    return types.MappingProxyType(dict(metadata))


@attrs.frozen
class BlobInfo:
    """What ``head`` tells about a blob."""

    name: str
    size: int
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


def check_blob_name(name: str) -> str:
    """Return ``name`` if it is a safe relative blob name, else raise :class:`ConfigError`."""
    if not isinstance(name, str) or not name:
        raise ConfigError(f"blob name must be a non-empty string, got {name!r}")
    if "\x00" in name or "\\" in name or name.startswith("/"):
        raise ConfigError(f"blob name {name!r} must be relative, '/'-separated, without NUL or backslash")
    if any(segment in _BAD_SEGMENTS for segment in name.split("/")):
        raise ConfigError(f"blob name {name!r} has an empty, '.' or '..' segment; it could escape the store root")
    return name


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


class BlobStore(abc.ABC):
    """Remote object storage for backups and checkpoints. See the module docstring for the contract."""

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

    if TYPE_CHECKING:  # declared for the type checker only: a class without one is refused by blob_store_class

        @classmethod
        def from_url(cls, url: str, options: Mapping[str, Any]) -> BlobStore:
            """Open the store for ``url`` with its options parsed against :attr:`options`."""
            ...

    @classmethod
    def parse_options(cls, options: Mapping[str, Any]) -> ParsedOptions:
        """``options`` parsed against :attr:`options`, defaults filled; an undeclared key or a bad value is a
        :class:`ConfigError` naming ``blob.store.<key>``. Options this schema already parsed are returned as they
        are, so each value is parsed once whoever asks first (config, or an entry point given raw options)."""
        owner = next(klass for klass in cls.__mro__ if "options" in vars(klass))
        name = f"{owner.__module__}:{owner.__qualname__}.options"
        return parse_options(cls.options, options, name=name, prefix="blob.store.")

    # -- the abstract core ------------------------------------------------------------------------------------

    @abc.abstractmethod
    def put(
        self, name: str, data: bytes, *, create_only: bool = False, metadata: Mapping[str, str] | None = None
    ) -> None:
        """Write ``data`` under ``name`` atomically. ``create_only`` -> :class:`AlreadyExistsError` if taken."""

    @abc.abstractmethod
    def get(self, name: str, *, start: int | None = None, end: int | None = None) -> bytes:
        """Read the blob, or bytes ``[start, end)`` of it. Absent -> :class:`NotFoundError`."""

    @abc.abstractmethod
    def delete(self, name: str) -> None:
        """Delete the blob; an absent blob is success (idempotent)."""

    @abc.abstractmethod
    def list(self, prefix: str = "") -> Iterator[str]:
        """Yield the names that start with ``prefix``, sorted."""

    @abc.abstractmethod
    def head(self, name: str) -> BlobInfo:
        """Size and metadata of the blob. Absent -> :class:`NotFoundError`."""

    # -- concrete defaults, overridden where a service does better --------------------------------------------

    def set_metadata(self, name: str, metadata: Mapping[str, str]) -> None:
        """Replace the blob's user metadata (used for the expiry / remove-expiry of garbage collection)."""
        data = self.get(name)
        self.put(name, data, metadata=metadata)

    def exists(self, name: str) -> bool:
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

    def delete_many(self, names: builtins.list[str]) -> None:  # builtins: ``list`` here is the method above
        """Delete every blob in ``names``; absent ones are success (idempotent, like :meth:`delete`). A store that
        deletes many names in one request overrides this (S3 DeleteObjects, Azure Blob Batch: a retention of many
        blobs is then one request, not one each). A failure raises the error of :meth:`delete` naming what was not
        deleted; the other names may be gone (retrying the whole call is safe). The default deletes one by one."""
        for name in names:
            self.delete(name)

    def delete_if_unchanged(self, versions: Mapping[str, str]) -> frozenset[str]:
        """Delete each blob of ``versions`` (name -> the :attr:`BlobInfo.etag` its ``head`` gave) only if it is still
        that version, in one request per batch where the service batches (like :meth:`delete_many`). Returns the
        names **kept** because they were written (or changed) since: not an error, the caller judged an older
        version. An absent name is success (deleted, not kept). Every name is checked before anything is deleted; a
        failure raises the error of :meth:`delete` and retrying the whole call is safe (a blob a lost reply deleted
        is absent now: success). Only for a store whose :attr:`supports_conditional_delete` is true; the default
        raises :class:`StorageError`."""
        raise StorageError(
            f"{self.describe()} cannot delete a blob on condition that it is unchanged (supports_conditional_delete "
            f"is false); use delete_many ({len(versions)} names asked)"
        )

    def put_if(self, name: str, data: bytes, *, version: str | None) -> str:
        """Write ``data`` under ``name`` only if the blob is still ``version`` (as :meth:`get_versioned` or an earlier
        :meth:`put_if` gave it), or, with ``version=None``, only if there is no blob of that name; return the new
        version. Otherwise :class:`~statebackend.errors.PreconditionFailedError` and nothing is written. No user
        metadata. Only for a store whose :attr:`supports_conditional_put` is true; the default raises
        :class:`StorageError`."""
        raise StorageError(
            f"{self.describe()} cannot write a blob on condition of its version (supports_conditional_put is false); "
            f"blob {name!r} was not written"
        )

    def get_versioned(self, name: str) -> tuple[bytes, str]:
        """The blob's bytes and their version (for :meth:`put_if`), in one request. Absent ->
        :class:`NotFoundError`. Only where :attr:`supports_conditional_put`; the default raises
        :class:`StorageError`."""
        raise StorageError(
            f"{self.describe()} cannot read a blob with its version (supports_conditional_put is false); "
            f"blob {name!r} was not read"
        )

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
    if not callable(getattr(cls, "from_url", None)):
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
