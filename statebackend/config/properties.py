"""Reading a job's config file (``job.properties``): the one reader for Python code and the ``statebackend`` command.

The format: one ``key=value`` per line, UTF-8; blank lines and lines starting with ``#`` or ``!`` are comments; the
key and the value are stripped of surrounding blanks; a value may contain ``=``; a key given twice keeps its last
value. The keys are the same flat keys as a Python config dict (docs/configuration.md): the result goes to
``TaskStorage.open``, ``Settings.from_config`` or ``StatefulForeachBatch`` as it is.
"""

from __future__ import annotations

import os
from pathlib import Path

from statebackend.errors import ConfigError
from statebackend.redact import redact

__all__ = ["load_config"]


def load_config(path: str | os.PathLike[str]) -> dict[str, str]:
    """The config dict of the ``key=value`` file at ``path`` (values are strings, typed later by the settings).

    Raises :class:`~statebackend.errors.ConfigError` naming the file when it cannot be read (missing, a directory,
    no permission, not UTF-8: with the line of the first bad byte), and naming the file and the line number of a
    line that is not ``key=value`` (no ``=``, or an empty key). The quoted line goes through redaction, so a
    misformatted secret is not echoed."""
    where = os.fspath(path)
    try:
        data = Path(where).read_bytes()
    except OSError as exc:
        raise ConfigError(f"cannot read config file {where}: {exc.strerror or exc}") from None
    try:
        text = data.decode("utf-8")
    except UnicodeDecodeError as exc:
        bad = data.count(b"\n", 0, exc.start) + 1
        raise ConfigError(f"cannot read config file {where}: line {bad} is not UTF-8 (byte {exc.start})") from None
    config: dict[str, str] = {}
    for number, line in enumerate(text.splitlines(), start=1):
        stripped = line.strip()
        if not stripped or stripped.startswith(("#", "!")):
            continue
        key, sep, value = stripped.partition("=")
        if not sep or not key.strip():
            problem = "no '='" if not sep else "an empty key"
            raise ConfigError(
                f"{where}:{number}: expected key=value (a '#' line is a comment), got {problem}: {redact(stripped)!r}"
            )
        config[key.strip()] = value.strip()
    return config
