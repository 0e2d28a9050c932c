"""Sphinx configuration of the API reference: the objects a backend or blob-store author touches, from docstrings.

Built by ``./dev docs`` (warnings are errors); nothing here is fetched from the network."""

from __future__ import annotations

import html
import re
from collections.abc import Iterator
from pathlib import Path
from typing import Any

project = "statebackend"
author = "the statebackend developers"
# no napoleon: the docstrings have no Google sections, and napoleon read an attribute's "for backup managers: ..." as a
# type ("Type: for backup managers") cut from its text
extensions = ["sphinx.ext.autodoc"]
# statebackend.spark needs pyspark only where the API reference does not go
autodoc_mock_imports = ["pyspark"]
autodoc_default_options = {"members": True, "show-inheritance": True, "member-order": "bysource"}
autodoc_typehints = "description"
autodoc_class_signature = "separated"
# the docstrings say which of these are optional hooks: attrs' generated dunders are not part of the contract
autodoc_inherit_docstrings = True
exclude_patterns = ["_build"]
html_theme = "alabaster"
html_static_path: list[str] = []
# docstrings use ``double backticks`` for literals and :class: roles for our own names
default_role = "literal"
suppress_warnings = ["ref.python"]  # a short name found in two modules (an alias re-exported): the first wins


#: the builtin types whose docstring autodoc shows for an attribute without a doc of its own (the first words of each)
_TYPE_DOCS = tuple(
    " ".join((t.__doc__ or "").split()[:8])
    for t in (int, str, bytes, float, bool, dict, list, tuple, set, frozenset, type(None), object, type)
    if (t.__doc__ or "").strip()
)

_ENTRY = re.compile(
    r'<dl class="py (attribute|data)">\s*<dt class="sig sig-object py" id="([^"]+)">.*?</dt>\s*<dd>(.*?)</dd>\s*</dl>',
    re.S,
)


_TYPE_FIELD = re.compile(r'<dt class="field-\w+">Type<span class="colon">')


def _rendered_entries(page: str) -> Iterator[tuple[str, str, str, bool]]:
    """(kind, id, text of the description, whether it has a ``Type`` field) of every attribute and data entry of a
    built page."""
    for match in _ENTRY.finditer(page):
        text = html.unescape(re.sub(r"<[^>]+>", " ", match.group(3)))
        yield match.group(1), match.group(2), " ".join(text.split()), bool(_TYPE_FIELD.search(match.group(3)))


def garbled_entries(build: Path) -> list[str]:
    """The attributes of a built reference that render garbled: with their type's docstring (an attribute or
    constant without a ``#:`` doc comment), with a ``Type:`` field cut out of their own text, or with no text."""
    problems = []
    for page in sorted(build.glob("*.html")):
        for kind, ident, text, type_field in _rendered_entries(page.read_text(encoding="utf-8")):
            if any(doc in text for doc in _TYPE_DOCS):
                problems.append(f"{page.name}: {ident} ({kind}) shows its type's docstring: {text[:80]!r}")
            elif type_field:
                problems.append(f"{page.name}: {ident} ({kind}) has a Type field cut from its text: {text[:80]!r}")
            elif not text:
                problems.append(f"{page.name}: {ident} ({kind}) has no description")
    return problems


def _check_rendered(app: Any, exception: BaseException | None) -> None:
    """After an HTML build: warn (an error under ``-W``) for every garbled attribute (tests/test_api_reference.py)."""
    if exception is not None or app.builder.format != "html":
        return
    from sphinx.util import logging

    log = logging.getLogger(__name__)
    for problem in garbled_entries(Path(app.outdir)):
        log.warning("garbled in the API reference: %s", problem)


def _check_docstring(app: Any, what: str, name: str, obj: Any, options: Any, lines: list[str]) -> None:
    """While autodoc reads: warn for an attribute or constant whose text is its value's type's docstring (the
    rendered check sees only the builtin types' docstrings; this one sees every type's)."""
    if what not in ("attribute", "data") or not lines or isinstance(obj, type) or callable(obj):
        return
    type_doc = type(obj).__doc__
    if type_doc and " ".join(" ".join(lines).split()) == " ".join(type_doc.split()):
        from sphinx.util import logging

        logging.getLogger(__name__).warning(
            "garbled in the API reference: %s shows the docstring of its type %s: give it a #: doc comment where "
            "the reference imports it from",
            name,
            type(obj).__qualname__,
        )


def setup(app: Any) -> dict[str, Any]:
    """Sphinx's hook: the docstring check while autodoc reads, the rendered check after every build."""
    app.connect("autodoc-process-docstring", _check_docstring)
    app.connect("build-finished", _check_rendered)
    return {"parallel_read_safe": True}
