"""The keys of state backends' options: job-wide ``<backend>.<option>`` and per store
``stores.<name>.<backend>.<option>``, both validated by the backend's ``options`` schema with one parser.

A per-store key overrides the job-wide key for that store alone; the store's backend then gets the job-wide options
with the store's own on top (``Settings.backend_options_for(backend, store=name)``), and the framework gives one
backend context per group of a task's stores with equal options, so a backend needs no code of its own for it.

Store names may hold dots and backend names may too (a dotted path ``package.module:Class``, an entry point's name),
so a per-store key is read only where it reads one way (statebackend.config.names): ``<backend>`` must be the name of
one of the store's own backup or restore backends (:func:`read_store_backend_key` finds every such reading), and a
key that also reads as an option of another declared store (``stores.<name>.<option>``) is an error naming both.
"""

from __future__ import annotations

import difflib
from collections.abc import Iterable, Mapping
from typing import Any

import attrs

from statebackend.options import OptionSpec, parse_one
from statebackend.registry import ResolvedFactory

__all__ = ["StoreBackendKey", "parse_backend_options", "read_store_backend_key", "store_backend_prefix"]


@attrs.frozen
class StoreBackendKey:
    """One reading of a ``stores.<name>.<backend>.<option>`` key."""

    key: str
    store: str
    #: the backend's canonical name (the prefix its options are read under)
    backend: str
    option: str
    #: how the key spells the backend: the canonical name, or another name of it (an error: options are read under
    #: the canonical name only, as job-wide)
    spelled: str


def store_backend_prefix(store: str, backend: str) -> str:
    """``stores.<store>.<backend>.``: what one store's options of one backend are written under."""
    return f"stores.{store}.{backend}."


def read_store_backend_key(
    key: str, store_backends: Mapping[str, Iterable[str]], spellings: Mapping[str, str]
) -> list[StoreBackendKey]:
    """Every way ``key`` reads as ``stores.<store>.<backend>.<option>``: ``<store>`` a declared store (of
    ``store_backends``: store -> the canonical names of its backup and restore backends), ``<backend>`` one of that
    store's backends by its canonical name or by a name of it in ``spellings`` (name -> canonical), ``<option>`` not
    empty. More than one reading is ambiguous; none: the key is not a per-store backend option."""
    readings: list[StoreBackendKey] = []
    for store, backends in store_backends.items():
        head = f"stores.{store}."
        if not key.startswith(head):
            continue
        rest = key[len(head) :]
        canonical_names = set(backends)
        names = {name: name for name in canonical_names}
        names.update({name: canonical for name, canonical in spellings.items() if canonical in canonical_names})
        for spelled, canonical in names.items():
            if rest.startswith(spelled + ".") and len(rest) > len(spelled) + 1:
                readings.append(StoreBackendKey(key, store, canonical, rest[len(spelled) + 1 :], spelled))
    return readings


def parse_backend_options(
    resolved: ResolvedFactory,
    given: Mapping[str, Any],
    *,
    prefix: str,
    inherited: Mapping[str, Any] | None = None,
) -> tuple[dict[str, Any], list[str]]:
    """Validate a backend's options against its factory's ``options`` schema: ``given`` maps option -> raw value, as
    written under ``prefix`` (``changelog.`` job-wide, ``stores.counts.changelog.`` for one store). Returns the parsed
    options and the problems (each naming its key as written, with a "did you mean" for a misspelled option).

    Without ``inherited`` (job-wide), unset options take the schema's defaults. With it (one store), the result is
    ``inherited`` (the job-wide options) with the given options on top."""
    canonical, schema = resolved.canonical_name, resolved.factory.options
    problems: list[str] = []
    for option, spec in schema.items():
        if not isinstance(spec, OptionSpec):
            problems.append(
                f"state backend {canonical!r} declares option {option!r} as {spec!r}, not a "
                "statebackend.config.OptionSpec; fix the backend's options"
            )
    if problems:
        return {}, problems
    options: dict[str, Any] = dict(inherited) if inherited is not None else {}
    for option, spec in schema.items():
        if inherited is not None and given.get(option) is None:
            continue  # unset for this store: the job-wide value stands
        value, problem = parse_one(prefix + option, spec, given.get(option))
        if problem is not None:
            problems.append(problem)
        elif value is not None:
            options[option] = value
    # a typo is looked for in the job-wide spelling, so a store's long prefix never makes distant options look close
    job_wide = {f"{canonical}.{option}": option for option in schema}
    for option in sorted(given):
        if option in schema:
            continue
        key = prefix + option
        near = difflib.get_close_matches(f"{canonical}.{option}", list(job_wide), n=1, cutoff=0.8)
        if near:
            problems.append(f"{key}: unknown key; did you mean {prefix}{job_wide[near[0]]}?")
        else:
            known = ", ".join(prefix + option for option in schema) or f"none (backend {canonical!r} has no options)"
            problems.append(f"{key}: unknown key; known keys of backend {canonical!r}: {known}")
    return options, problems
