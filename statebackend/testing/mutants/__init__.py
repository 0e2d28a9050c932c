"""Deliberately broken backends and blob stores that the contract suites must fail, kept beside the suites so a
third party can see what the suites catch and run them on their own suites' variants (docs/contract-suites.md).

- :mod:`statebackend.testing.mutants.backends`: broken state backends, each a small change to the reference backend
  (:mod:`statebackend.testing.reference`); the backend contract suite must fail each.
- :mod:`statebackend.testing.mutants.blobstores`: broken blob stores, each a small change to
  :class:`~statebackend.blobstores.memory.MemoryBlobStore`; the blob store contract suite must fail each.

:data:`BACKEND_MUTANTS` and :data:`BLOB_STORE_MUTANTS` list them by name with the dotted path that names each (a
backend's ``backup.factories`` value, or a blob store's class). Never use one for real data.
"""

from __future__ import annotations

import attrs

from statebackend.testing.mutants import backends, blobstores

__all__ = ["BACKEND_MUTANTS", "BLOB_STORE_MUTANTS", "Mutant"]


@attrs.frozen
class Mutant:
    """One broken variant: its name, the dotted path ``module:Class`` that names it, and what it gets wrong."""

    name: str
    target: str
    breaks: str


def _mutants(module: object, names: list[str]) -> tuple[Mutant, ...]:
    found = []
    for name in names:
        cls = getattr(module, name)
        found.append(Mutant(name, f"{cls.__module__}:{name}", " ".join((cls.__doc__ or "").split())))
    return tuple(found)


#: the broken backends, each a small change to the reference backend
BACKEND_MUTANTS = _mutants(backends, backends.__all__)
#: the broken blob stores, each a small change to the in-memory store
BLOB_STORE_MUTANTS = _mutants(blobstores, blobstores.__all__)
