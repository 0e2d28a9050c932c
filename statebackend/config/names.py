"""The one rule for the names statebackend turns into paths: job, task and store names.

A job name is the first segment of every blob name and a directory under ``state.local.dir``; a task name is the
next segment and directory; a store name is the directory below it and the ``<name>`` of its ``stores.<name>.*``
keys. One rule covers all three, so a name valid in one place is valid in every place it lands:

- 1 to :data:`NAME_MAX_LENGTH` characters (a directory name's limit on common file systems);
- ASCII letters, digits, ``.``, ``_`` and ``-`` only (:data:`NAME_PATTERN`): no ``/`` or ``\\`` to split a path, no
  space or control character, and no letters beyond ASCII, whose normalized forms differ between file systems and
  services, so a directory listed back could fail to equal the name that made it;
- starting with a letter or digit: never ``.`` or ``..``, never a hidden directory, never an option to a command line.

Dots are allowed (store names have always taken them, and stores on disk and in checkpoints carry such names). A
``stores.<name>.<option>`` key still reads one way only: config reads the option off the key's end, and no store option
is a dotted suffix of another (tests/test_one_source.py keeps it so). Code that picks one store's keys must do the same,
not match the prefix ``stores.<name>.``, which the keys of store ``<name>.x`` share. A per-store backend option
``stores.<name>.<backend>.<option>`` is read by its ``<backend>``, which must be one of the backends of a declared
store ``<name>``; a key that reads as an option of two stores is an error (statebackend.config.backend_keys).
"""

from __future__ import annotations

import re
from typing import Any

from statebackend.errors import ConfigError
from statebackend.options import Parser, parse_str, value_error

__all__ = ["NAME_ALLOWED", "NAME_MAX_LENGTH", "NAME_PATTERN", "check_name", "parse_name"]

#: the characters of a job, task or store name (its length is bounded by :data:`NAME_MAX_LENGTH`)
NAME_PATTERN = r"[A-Za-z0-9][A-Za-z0-9._-]*"

#: the longest name: one directory name
NAME_MAX_LENGTH = 255

#: the rule in words, for error messages and the reference
NAME_ALLOWED = f"1 to {NAME_MAX_LENGTH} ASCII letters, digits, '.', '_' or '-', starting with a letter or digit"


def check_name(what: str, name: Any) -> None:
    """Raise :class:`ConfigError` unless ``name`` follows the rule of this module; the message names ``what``
    (``"task name"``, ``"store name"``), what is wrong and what is allowed."""
    problem = _problem(name)
    if problem is not None:
        raise ConfigError(f"{what} {name!r} is not valid: {problem}; allowed: {NAME_ALLOWED}")


def parse_name() -> Parser[str]:
    """A parser for a configuration key that holds a name (``job.name``): a non-empty string that follows the rule
    of this module, trimmed."""
    parse_text = parse_str()

    def parse(key: str, raw: Any) -> str:
        value: str = parse_text(key, raw)
        problem = _problem(value)
        if problem is not None:
            raise value_error(key, raw, problem, NAME_ALLOWED)
        return value

    return parse


_NAME_RE = re.compile(NAME_PATTERN)


def _problem(name: Any) -> str | None:
    """What is wrong with ``name``, or None."""
    if not isinstance(name, str):
        return f"a {type(name).__name__} is not a name"
    if name == "":
        return "it is empty"
    if len(name) > NAME_MAX_LENGTH:
        return f"it does not match the allowed pattern: it is longer than {NAME_MAX_LENGTH} characters"
    if _NAME_RE.fullmatch(name) is None:
        if not _NAME_RE.match(name[0]):
            return f"it does not match the allowed pattern: it starts with {name[0]!r}"
        bad = next(char for char in name if not re.fullmatch(r"[A-Za-z0-9._-]", char))
        return f"it does not match the allowed pattern: {bad!r} is not allowed"
    return None
