"""A task's failure as the driver reports it: the worker's error first, then the user's frame, not Spark's trace.

Spark hands the driver a task's Python exception as text inside its own (a ``Py4JJavaError`` or a captured
``PythonException`` of a hundred lines and more, the Python traceback at the end). :func:`summarized` reads the
worker's traceback out of it and gives a :class:`~statebackend.errors.TaskFailedError` whose message starts with
the error's own last line (a ``SerdeError`` naming store, key and type; an ``OutputSchemaError`` naming the fields;
the user's own exception) and then the innermost frame of the user's code; Spark's exception stays chained."""

from __future__ import annotations

import re
import sysconfig
from pathlib import Path

from statebackend.errors import StateBackendError, TaskFailedError

__all__ = ["summarized", "worker_traceback"]

_TRACEBACK = "Traceback (most recent call last):"
_FRAME = re.compile(r'^\s*File "(?P<path>[^"]+)", line (?P<line>\d+), in (?P<function>.+)$')
_TASK = re.compile(r"Task (\d+) in stage [\d.]+ failed")


def _library_dirs() -> tuple[str, ...]:
    """Where the library (its installed folders: the framework, the backends, the checkpoint package), Python's
    standard library and the engine live: frames there are not the user's."""
    import statebackend.backends
    import statebackend.checkpoint

    own = [Path(__file__).resolve().parents[1], *(Path(p).resolve() for m in (statebackend.backends,
                                                                              statebackend.checkpoint)
                                                   for p in m.__path__)]
    return (*(str(d) for d in own), str(Path(sysconfig.get_paths()["stdlib"]).resolve()), "/pyspark/", "/py4j/")


_LIBRARY = _library_dirs()


def summarized(exc: BaseException, batch_id: int) -> TaskFailedError | None:
    """The driver's summary of a failure of batch ``batch_id``'s tasks (None: ``exc`` carries no worker traceback,
    or is the library's own error raised on the driver, which already says what it is)."""
    if isinstance(exc, StateBackendError):
        return None
    text = worker_traceback(exc)
    if text is None:
        return None
    frames, error = _parse(text)
    if not error:
        return None
    task = _TASK.search(str(exc))
    where = f"task-{task.group(1)} of batch {batch_id}" if task else f"a task of batch {batch_id}"
    lines = [f"{where} failed: {error[0]}", *(f"  {line}" for line in error[1:])]
    user = next((f for f in reversed(frames) if not _is_library(f[0])), None)
    if user is not None:
        path, line, function, code = user
        lines.append(f"  in your code: {path}, line {line}, in {function}" + (f": {code}" if code else ""))
    lines.append("  (the worker's whole traceback is in the chained exception)")
    return TaskFailedError("\n".join(lines))


def worker_traceback(exc: BaseException) -> str | None:
    """The last Python traceback in ``exc``'s text (a Spark exception's carries the worker's), or None."""
    text = str(exc)
    at = text.rfind(_TRACEBACK)
    if at < 0:
        return None
    return text[at:]


def _parse(text: str) -> tuple[list[tuple[str, str, str, str]], list[str]]:
    """The frames (path, line, function, code) of a traceback's text, and its error lines (the exception's line
    and its notes)."""
    frames: list[tuple[str, str, str, str]] = []
    lines = text.splitlines()[1:]
    index = 0
    while index < len(lines):
        match = _FRAME.match(lines[index])
        if match is None:
            break
        code = ""
        index += 1
        while index < len(lines) and lines[index].startswith("    ") and not _FRAME.match(lines[index]):
            stripped = lines[index].strip()
            if stripped and not set(stripped) <= set("^~ "):
                code = code or stripped
            index += 1
        frames.append((match["path"], match["line"], match["function"], code))
    error: list[str] = []
    for line in lines[index:]:
        if not line.strip() or line.startswith(("\tat ", "\t...", "Driver stacktrace", "\tat")):
            break
        if line.startswith(("org.apache.", "java.", "scala.", "\tat")):
            break
        error.append(line.rstrip())
        if len(error) >= 6:
            break
    return frames, error


def _is_library(path: str) -> bool:
    resolved = str(Path(path).resolve()) if path.startswith("/") else path
    return any(part in resolved for part in _LIBRARY) or "site-packages" in resolved or path.startswith("<")
