"""The design of record stays true to the code."""

from __future__ import annotations

import importlib.util
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


def _imports_module():  # type: ignore[no-untyped-def]
    spec = importlib.util.spec_from_file_location("docs_imports", ROOT / "docs" / "imports.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_the_import_diagram_in_architecture_md_is_generated_from_the_code() -> None:
    imports = _imports_module()
    text = (ROOT / "docs" / "architecture.md").read_text()
    assert imports.block() in text, "docs/architecture.md is out of date: run python docs/imports.py --write"


def test_no_import_cycle_between_parts() -> None:
    assert _imports_module().diagram().endswith("cycles between parts: none")


def test_nothing_in_the_repository_refers_to_a_design_file_outside_it() -> None:
    for folder in ("statebackend", "backends", "checkpoint", "docs", "tests", "bench", "examples"):
        for path in (ROOT / folder).rglob("*"):
            if path.suffix in {".py", ".md"} and path.name != "test_docs.py":
                assert "DESIGN.md" not in path.read_text(), path
    assert "DESIGN.md" not in (ROOT / "README.md").read_text()
