"""Plugins found through entry points, fsspec style: the one scan of the installed distributions' metadata that the
state backend registry (group ``statebackend.backends``, :mod:`statebackend.registry`) and the blob store registry
(group ``statebackend.blobstores``, :mod:`statebackend.blobstores.base`) share, and the lazy import of a
``package.module:Attr`` target they name.

A distribution declares a plugin in its ``pyproject.toml``::

    [project.entry-points."statebackend.blobstores"]
    mystore = "my_package.store:MyBlobStore"
    fast = "my_package.fast:FastBlobStore [fast]"   # needs the distribution's extra "fast" (named by the hint)

Nothing is imported by a scan: a target is imported when it is first used (:func:`load_target`), so a plugin whose
optional dependency is missing breaks only the configurations that use it, and the error carries its install hint
(:meth:`EntryPointTarget.install_hint`, from the extras the entry point names).

Scanning every installed distribution's metadata costs milliseconds (a Spark task parses its config every batch), so
a scan is kept while ``sys.path`` and the modification times of its directories are unchanged: installing or removing
a package changes its directory's time, so newly installed plugins are still seen.
"""

from __future__ import annotations

import importlib
import importlib.metadata
import os
import re
import sys
import threading

import attrs

__all__ = ["EntryPointTarget", "entry_points", "load_target"]


@attrs.frozen
class EntryPointTarget:
    """One entry point of a group: its name, what it points at and who declares it."""

    #: the entry point's name: a backend's short name, a blob store's URL scheme
    name: str
    #: ``package.module:Attr`` (or a bare module)
    target: str
    #: the distribution that declares it (``None``: unknown, e.g. metadata without a name)
    distribution: str | None
    #: the distribution's extras the target needs (``[azure]`` after the target in the entry point)
    extras: tuple[str, ...] = ()

    def install_hint(self) -> str:
        """What to run when the target cannot be imported: install the extras it names, else reinstall the
        distribution that declares it."""
        if self.distribution is None:
            return "reinstall the package that declares it"
        if self.extras:
            return f"pip install '{self.distribution}[{','.join(self.extras)}]'"
        return (
            f"it is declared by the distribution {self.distribution!r}; reinstall it "
            f"(pip install --force-reinstall {self.distribution})"
        )


def entry_points(group: str) -> dict[str, tuple[EntryPointTarget, ...]]:
    """Entry-point name -> every distinct declaration of it in ``group``, in the order the metadata lists them (two
    distributions may declare one name: the caller decides whether that is an error)."""
    key = _path_state()
    with _LOCK:
        cached = _CACHE.get(key)
    if cached is None:
        cached = _scan()
        with _LOCK:
            _CACHE.clear()  # one sys.path state at a time: an older scan is never asked for again
            _CACHE[key] = cached
    return dict(cached.get(group, {}))


def _scan() -> dict[str, dict[str, tuple[EntryPointTarget, ...]]]:
    """Every group's entry points in one pass over the installed distributions' metadata (the backends' and the blob
    stores' groups are both asked for by the first open of a process: one scan serves both)."""
    everything = importlib.metadata.entry_points()  # one pass; .select and .groups on every Python >= 3.11
    groups: dict[str, dict[str, tuple[EntryPointTarget, ...]]] = {}
    for group in sorted(g for g in everything.groups if g.startswith(_OWN_GROUPS)):
        found = groups.setdefault(group, {})
        for ep in everything.select(group=group):
            dist = ep.dist.name if ep.dist is not None else None
            module_attr = f"{ep.module}:{ep.attr}" if ep.attr else ep.module
            target = EntryPointTarget(ep.name, module_attr, dist, tuple(ep.extras))
            if target not in found.get(ep.name, ()):  # one distribution seen twice on sys.path declares it once
                found[ep.name] = (*found.get(ep.name, ()), target)
    return groups


def load_target(target: str) -> object:
    """Import ``package.module:Attr`` (attributes may be dotted) and return the object. Raises ``ValueError`` for a
    target that is not of that form, whatever the module raises while it is imported (an ``ImportError`` for a
    missing package), and ``AttributeError`` naming what the module lacks."""
    if not _TARGET_RE.fullmatch(target):
        raise ValueError(f"{target!r} is not a dotted path 'package.module:Class'")
    module_name, _, attr_path = target.partition(":")
    obj: object = importlib.import_module(module_name)
    for part in attr_path.split("."):
        try:
            obj = getattr(obj, part)
        except AttributeError:
            raise AttributeError(f"module {module_name!r} has no attribute {attr_path!r} (from {target!r})") from None
    return obj


# -- internals --------------------------------------------------------------------------------------------------

_IDENTIFIER = r"[A-Za-z_][A-Za-z0-9_]*"
_TARGET_RE = re.compile(rf"{_IDENTIFIER}(\.{_IDENTIFIER})*:{_IDENTIFIER}(\.{_IDENTIFIER})*")

_LOCK = threading.Lock()

#: the groups a scan keeps: this project's (``statebackend.backends``, ``statebackend.blobstores``, ...)
_OWN_GROUPS = "statebackend."

#: the state of sys.path a scan was made under -> group -> its scan
_CACHE: dict[tuple[tuple[str, int], ...], dict[str, dict[str, tuple[EntryPointTarget, ...]]]] = {}


def _path_state() -> tuple[tuple[str, int], ...]:
    state = []
    for entry in sys.path:
        try:
            state.append((entry, os.stat(entry or ".").st_mtime_ns))
        except OSError:
            state.append((entry, -1))
    return tuple(state)
