"""The state backend registry (docs/architecture.md, fsspec style).

A store names its backends in ``stores.<name>.backup.factories`` / ``stores.<name>.restore.factory`` by one of:

- a **short name** registered here (built-ins: ``changelog``, ``blobsnapshot``; more via :func:`register_factory`);
- the name of an **entry point** in group ``statebackend.backends`` that an installed distribution declares;
- a **dotted path** ``package.module:Class``.

So adding a backend needs no edit to the framework: ship a package with an entry point, or name its class by path.

:func:`resolve_factory` imports lazily and gives a :class:`ResolvedFactory` whose ``canonical_name`` is what
checkpoints record, so it MUST stay stable across releases: the short name for a registered name or an entry point,
the dotted path otherwise. A dotted path that is exactly the target of a short name or entry point canonicalizes to
that short name, so the two spellings of one backend never split a checkpoint's markers.

Lookup order: registered short names, then entry points, then dotted paths; a registered short name shadows an entry
point of the same name (the built-ins are also declared as entry points by statebackend's own distribution). The
entry points are scanned by :mod:`statebackend.plugins`, which the blob store registry shares.

Factories are instantiated with no arguments, once per canonical name (they are stateless descriptions of a backend;
per-task state lives in the managers they create). Every failure is a :class:`~statebackend.errors.ConfigError` that
names the backend and says how to fix it.
"""

from __future__ import annotations

import importlib
import re
import threading
import types
from collections.abc import Mapping

import attrs

from statebackend.contracts import StateBackendFactory
from statebackend.errors import ConfigError
from statebackend.plugins import EntryPointTarget, entry_points

__all__ = [
    "ENTRY_POINT_GROUP",
    "ResolvedFactory",
    "known_factories",
    "register_factory",
    "resolve_factory",
]

#: the entry-point group third-party packages declare their factories in
ENTRY_POINT_GROUP = "statebackend.backends"


@attrs.frozen
class ResolvedFactory:
    """A backend factory and the name checkpoints record for it."""

    canonical_name: str
    factory: StateBackendFactory


def resolve_factory(name: str) -> ResolvedFactory:
    """Resolve a short name, entry-point name or ``package.module:Class`` to its (cached) factory instance.

    Raises :class:`ConfigError` when the name is unknown (listing the known ones), when the import fails (with the
    cause and an install hint), or when the object is not a :class:`StateBackendFactory` subclass.
    """
    if not isinstance(name, str) or not name.strip():
        raise ConfigError(f"state backend name {name!r} is empty; known backends: {_known_list()}")
    name = name.strip()
    canonical, target, hint = _locate(name)
    with _LOCK:
        cached = _INSTANCES.get(canonical)
        if cached is not None and cached[0] == target:
            return ResolvedFactory(canonical, cached[1])
    factory = _instantiate(canonical, target, hint)
    with _LOCK:
        # Two threads may race to the first resolution; keep the first instance so everyone shares one.
        cached = _INSTANCES.get(canonical)
        if cached is not None and cached[0] == target:
            return ResolvedFactory(canonical, cached[1])
        _INSTANCES[canonical] = (target, factory)
    return ResolvedFactory(canonical, factory)


def register_factory(short_name: str, target: str, *, replace: bool = False) -> None:
    """Register ``short_name`` -> ``"package.module:Class"``. Nothing is imported until the name is resolved.

    Re-registering a name is an error unless ``replace=True`` (then the cached instance is dropped). Prefer an entry
    point in a package's metadata; this is for applications that define a backend in their own code.
    """
    if not isinstance(short_name, str) or not _SHORT_NAME_RE.fullmatch(short_name):
        raise ConfigError(
            f"state backend short name {short_name!r} is not valid: use letters, digits, '_' and '-', "
            "starting with a letter (it prefixes the backend's config keys)"
        )
    if short_name in _RESERVED_PREFIXES:
        raise ConfigError(
            f"state backend short name {short_name!r} is taken by statebackend's own config keys "
            f"({short_name}.*); pick another name"
        )
    if not isinstance(target, str) or not _DOTTED_PATH_RE.fullmatch(target):
        raise ConfigError(
            f"state backend target {target!r} for {short_name!r} is not a dotted path 'package.module:Class'"
        )
    with _LOCK:
        if short_name in _REGISTRY and not replace:
            raise ConfigError(
                f"state backend {short_name!r} is already registered to {_REGISTRY[short_name][0]}; "
                "pass replace=True to override it"
            )
        _REGISTRY[short_name] = (target, None)
        _INSTANCES.pop(short_name, None)


def known_factories() -> Mapping[str, str]:
    """Read-only view: short name -> dotted path, for registered names and installed entry points."""
    known = {name: entry_point.target for name, entry_point in _entry_points().items()}
    with _LOCK:
        known.update({short: target for short, (target, _hint) in _REGISTRY.items()})
    return types.MappingProxyType(dict(sorted(known.items())))


# -- internals --------------------------------------------------------------------------------------------------

_REINSTALL_HINT = "reinstall statebackend (pip install --force-reinstall statebackend)"

#: short name -> (dotted path, install hint or None)
_REGISTRY: dict[str, tuple[str, str | None]] = {
    "changelog": ("statebackend.backends.changelog.factory:ChangelogStateBackendFactory", _REINSTALL_HINT),
    "blobsnapshot": ("statebackend.backends.blobsnapshot.factory:BlobSnapshotStateBackendFactory", _REINSTALL_HINT),
}

#: canonical name -> (dotted path it was built from, instance); the target is kept so a replaced registration or a
#: changed entry point is not served from a stale cache entry
_INSTANCES: dict[str, tuple[str, StateBackendFactory]] = {}
_LOCK = threading.Lock()

_SHORT_NAME_RE = re.compile(r"[A-Za-z][A-Za-z0-9_-]*")
_IDENTIFIER = r"[A-Za-z_][A-Za-z0-9_]*"
_DOTTED_PATH_RE = re.compile(rf"{_IDENTIFIER}(\.{_IDENTIFIER})*:{_IDENTIFIER}(\.{_IDENTIFIER})*")
# First segments of the framework's own keys; a backend with one of these names could not be configured.
_RESERVED_PREFIXES = frozenset({"job", "state", "blob", "stores", "task"})


def _locate(name: str) -> tuple[str, str, str | None]:
    """(canonical name, dotted path, install hint) for ``name``, or ConfigError listing the known names."""
    with _LOCK:
        registered = _REGISTRY.get(name)
    if registered is not None:
        return name, registered[0], registered[1]
    declared = _entry_points().get(name)
    if declared is not None:
        return name, declared.target, declared.install_hint()
    if ":" in name:
        if not _DOTTED_PATH_RE.fullmatch(name):
            raise ConfigError(
                f"state backend {name!r} is not a valid dotted path: write 'package.module:Class'; "
                f"known backends: {_known_list()}"
            )
        # The same class spelled by path gets the short name, so checkpoints record one name per backend.
        for short, target in known_factories().items():
            if target == name:
                return short, name, None
        return name, name, f"make sure the package that provides {name.partition(':')[0]!r} is installed"
    raise ConfigError(
        f"unknown state backend {name!r}; known backends: {_known_list()}. A backend can also be named by its "
        "dotted path 'package.module:Class' or declared as an entry point in group "
        f"{ENTRY_POINT_GROUP!r}"
    )


def _instantiate(canonical: str, target: str, hint: str | None) -> StateBackendFactory:
    module_name, _, attr_path = target.partition(":")
    if not attr_path:
        raise ConfigError(f"state backend {canonical!r}: {target!r} names a module, not a class 'package.module:Class'")
    try:
        module = importlib.import_module(module_name)
    except Exception as exc:  # an ImportError, or any error the module raises while it is imported
        advice = f"; {hint}" if hint else ""
        raise ConfigError(
            f"state backend {canonical!r} could not be imported from {target!r}: {type(exc).__name__}: {exc}{advice}"
        ) from exc
    obj: object = module
    for part in attr_path.split("."):
        try:
            obj = getattr(obj, part)
        except AttributeError as exc:
            raise ConfigError(
                f"state backend {canonical!r}: module {module_name!r} has no attribute {attr_path!r} "
                f"(from {target!r}); check the class name"
            ) from exc
    if not (isinstance(obj, type) and issubclass(obj, StateBackendFactory)):
        raise ConfigError(
            f"state backend {canonical!r}: {target!r} is {obj!r}, not a subclass of "
            "statebackend.contracts.StateBackendFactory"
        )
    try:
        return obj()
    except Exception as exc:  # abstract methods left unimplemented, or a constructor that needs arguments
        raise ConfigError(
            f"state backend {canonical!r}: {target!r} could not be instantiated with no arguments: "
            f"{type(exc).__name__}: {exc}"
        ) from exc


def _entry_points() -> dict[str, EntryPointTarget]:
    """Entry-point name -> its target (the first declaration, when two distributions declare one name)."""
    return {name: targets[0] for name, targets in entry_points(ENTRY_POINT_GROUP).items()}


def _known_list() -> str:
    names = list(known_factories())
    return ", ".join(names) if names else "(none)"
