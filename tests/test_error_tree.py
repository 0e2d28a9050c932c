"""One error tree: every exception class of the library lives in statebackend/errors.py, and the library raises a
specific error a caller can act on, never the bare root."""

from __future__ import annotations

import ast
from pathlib import Path

from statebackend import errors

ROOT = Path(__file__).resolve().parents[1]
LIBRARY = [ROOT / "statebackend", ROOT / "backends", ROOT / "checkpoint"]


def _modules() -> list[tuple[Path, ast.Module]]:
    return [(path, ast.parse(path.read_text())) for folder in LIBRARY for path in sorted(folder.rglob("*.py"))]


def _exception_names() -> set[str]:
    names = {
        name for name, value in vars(errors).items() if isinstance(value, type) and issubclass(value, BaseException)
    }
    return names | {"Exception", "BaseException", "ValueError", "OSError", "InterruptedError", "TimeoutError"}


def test_every_exception_class_of_the_library_is_defined_in_errors_py() -> None:
    known = _exception_names()
    outside = []
    for path, tree in _modules():
        if path == ROOT / "statebackend" / "errors.py":
            continue
        for node in ast.walk(tree):
            if isinstance(node, ast.ClassDef):
                bases = {base.id if isinstance(base, ast.Name) else getattr(base, "attr", "") for base in node.bases}
                if bases & known:
                    outside.append(f"{path.relative_to(ROOT)}:{node.lineno} {node.name}")
    assert outside == []


def test_every_error_in_errors_py_is_exported_and_drawn_in_the_tree() -> None:
    defined = {
        name
        for name, value in vars(errors).items()
        if isinstance(value, type) and issubclass(value, BaseException) and value.__module__ == errors.__name__
    }
    assert defined == set(errors.__all__)
    doc = errors.__doc__ or ""
    assert [name for name in sorted(defined) if name not in doc] == []


def test_the_library_never_raises_the_bare_root() -> None:
    bare = []
    for path, tree in _modules():
        for node in ast.walk(tree):
            if isinstance(node, ast.Raise) and isinstance(node.exc, ast.Call):
                func = node.exc.func
                if isinstance(func, ast.Name) and func.id == "StateBackendError":
                    bare.append(f"{path.relative_to(ROOT)}:{node.lineno}")
    assert bare == []
