"""The URL registry of blob stores (fsspec style): URL scheme -> ``package.module:Class``, imported lazily, with an
install hint when a package is missing. A distribution declares its stores as entry points in group
:data:`ENTRY_POINT_GROUP` (statebackend's own four too, in its pyproject.toml); an application may register one at run
time with :func:`register_blob_store`. :func:`open_blob_store` opens the store of a ``blob.store.url``. Import these
from :mod:`statebackend.blobstores.base`, which re-exports them; how to write and register a store:
docs/blobstores.md."""

from __future__ import annotations

import re
import types
from collections.abc import Mapping
from typing import TYPE_CHECKING, Any
from urllib.parse import urlsplit

from statebackend.errors import ConfigError
from statebackend.options import OptionSpec
from statebackend.plugins import entry_points, load_target
from statebackend.redact import redact

if TYPE_CHECKING:
    from statebackend.blobstores.base import BlobStore

__all__ = [
    "ENTRY_POINT_GROUP",
    "blob_store_class",
    "blob_store_option_schemas",
    "known_blob_store_schemes",
    "open_blob_store",
    "register_blob_store",
]

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
    from statebackend.blobstores.base import BlobStore  # here, not at the top: base re-exports this module

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
