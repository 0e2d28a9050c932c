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
_GROUP_LINE = re.compile(r"^\s*\| ")
_REPEATED = re.compile(r"^\s*\[Previous line repeated \d+ more times?\]$")
_TASK = re.compile(r"Task (\d+) in stage [\d.]+ failed")


def _library_dirs() -> tuple[str, ...]:
    """Where the library (its installed folders: the framework, the backends, the checkpoint package), Python's
    standard library and the engine live: frames there are not the user's."""
    import statebackend.backends
    import statebackend.checkpoint

    own = [
        Path(__file__).resolve().parents[1],
        *(Path(p).resolve() for m in (statebackend.backends, statebackend.checkpoint) for p in m.__path__),
    ]
    # the package's own folder names too: executors may load the library from elsewhere (a zip, another venv)
    return (
        *(str(d) for d in own),
        str(Path(sysconfig.get_paths()["stdlib"]).resolve()),
        "/pyspark/",
        "/py4j/",
        "/statebackend/spark/",
        "/statebackend/microbatch/",
        "/statebackend/store/",
        "/statebackend/serdes/",
        "/statebackend/blobstores/",
    )


_LIBRARY = _library_dirs()


def summarized(exc: BaseException, batch_id: int) -> TaskFailedError | None:
    """The driver's summary of a failure of batch ``batch_id``'s tasks (None: ``exc`` carries no worker traceback,
    or is the library's own error raised on the driver, which already says what it is)."""
    if isinstance(exc, StateBackendError):
        return None
    try:
        return _summary(exc, str(exc), batch_id)
    except Exception:  # noqa: BLE001 - a summary never replaces the failure it summarizes (a JVM gone, odd text)
        return None


def _summary(exc: BaseException, whole: str, batch_id: int) -> TaskFailedError | None:
    text = _last_traceback(whole)
    if text is None:
        return None
    frames, error = _parse(text)
    if not error:
        return None
    task = _TASK.search(whole)
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
    return _last_traceback(str(exc))


def _last_traceback(text: str) -> str | None:
    """The last top-level Python traceback in ``text`` (not one nested in an exception group's ``|`` lines)."""
    at = len(text)
    while True:
        at = text.rfind(_TRACEBACK, 0, at)
        if at < 0:
            return None
        line_start = text.rfind("\n", 0, at) + 1
        if "|" not in text[line_start:at]:  # a Spark message may lead the line; a group's nested one has "|"
            return text[at:]


def _parse(text: str) -> tuple[list[tuple[str, str, str, str]], list[str]]:
    """The frames (path, line, function, code) of a traceback's text, and its error lines (the exception's line
    and its notes)."""
    frames: list[tuple[str, str, str, str]] = []
    lines = text.splitlines()[1:]
    if lines and _GROUP_LINE.match(lines[0]):  # an exception group's own traceback: its lines carry "  | "
        lines = [
            _GROUP_LINE.sub("", line, count=1)
            for line in lines[: next((i for i, line in enumerate(lines) if line.lstrip().startswith("+-")), len(lines))]
        ]
    index = 0
    while index < len(lines):
        if _REPEATED.match(lines[index]):
            index += 1
            continue
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
