"""The API reference covers every member a plugin author calls (docs/api, built by ``./dev docs``).

Autodoc leaves out a member without a docstring, and shows an attribute without a doc comment with its value's type's
docstring (``MAX_KEY_SIZE`` showed ``int``'s). So:

- the static check walks the public API a backend or blob-store author uses and fails for any public class,
  function, method, property or attribute (attrs fields, class annotations and ``self.x`` set in a method included)
  without a docstring or a ``#:`` doc comment (or a string literal right after the assignment): what autodoc reads;
- every module it walks is in the reference (an ``automodule`` or ``autoclass`` in docs/api);
- the rendered check builds the reference (Sphinx, the ``docs`` extra) and fails for an attribute that shows its
  type's docstring or a ``Type:`` field cut out of its own text (what napoleon made of "for backup managers: ...").
  ``./dev docs`` runs the same check while it builds (docs/api/conf.py), so CI fails on it even where this test
  cannot build.
"""

from __future__ import annotations

import ast
import functools
import html
import importlib
import importlib.util
import inspect
import re
import subprocess
import sys
import types
import typing
from collections.abc import Iterator
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
DOCS = ROOT / "docs" / "api"

#: the modules whose public names a plugin author uses (their ``__all__``, else what they define without a leading
#: underscore), with, for a module where only some classes are the plugin surface, those classes
PLUGIN_API: dict[str, tuple[str, ...] | None] = {
    "statebackend.contracts": None,
    "statebackend.kit": None,  # what the kit re-exports, whichever module defines it
    "statebackend.kit.background": None,
    "statebackend.kit.gc": None,
    "statebackend.kit.inflight": None,
    "statebackend.kit.lifetime": None,
    "statebackend.kit.restore": None,
    "statebackend.blobstores.base": None,
    "statebackend.testing.backend_contract": None,
    "statebackend.testing.backend_base": None,
    "statebackend.testing.backend_faults": None,
    "statebackend.testing.blobstore_contract": None,
    "statebackend.testing.conditional_delete_contract": None,
    "statebackend.testing.controlled": None,
    "statebackend.testing.kills": None,
    "statebackend.testing.clock": None,
    "statebackend.metrics": ("Metrics", "MetricsSnapshot", "HistogramData"),
    "statebackend.concurrency": None,
    "statebackend.errors": None,
    "statebackend.store": ("ChangeSet", "ReadView", "LocalVersion", "TOMBSTONE", "MAX_KEY_SIZE"),
    "statebackend.options": None,
}


@functools.cache
def _module_source(path: str) -> tuple[ast.Module, tuple[str, ...]]:
    text = Path(path).read_text()
    return ast.parse(text), tuple(text.splitlines())


def _documented(node: ast.stmt, following: ast.stmt | None, lines: tuple[str, ...]) -> bool:
    """Whether an assignment has a doc autodoc reads: ``#:`` on the line above or after the code on its own line,
    or a string literal as the next statement."""
    above = lines[node.lineno - 2].strip() if node.lineno >= 2 else ""
    own = lines[node.lineno - 1]
    if above.startswith("#:") or re.search(r"\s#:(\s|$)", own):
        return True
    return (
        isinstance(following, ast.Expr)
        and isinstance(following.value, ast.Constant)
        and isinstance(following.value.value, str)
    )


def _walk_statements(body: list[ast.stmt]) -> Iterator[tuple[ast.stmt, ast.stmt | None]]:
    """Every statement of ``body`` and of the blocks inside it (not inside nested functions or classes), each with
    the statement after it in its block."""
    for i, node in enumerate(body):
        yield node, body[i + 1] if i + 1 < len(body) else None
        for field in ("body", "orelse", "finalbody", "handlers"):
            inner = getattr(node, field, None)
            if isinstance(inner, list) and not isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef | ast.ClassDef):
                yield from _walk_statements([n for n in inner if isinstance(n, ast.stmt)])
            if field == "handlers" and isinstance(inner, list):
                for handler in inner:
                    yield from _walk_statements(handler.body)


def _targets(node: ast.stmt) -> list[ast.expr]:
    if isinstance(node, ast.Assign):
        return list(node.targets)
    if isinstance(node, ast.AnnAssign):
        return [node.target]
    return []


@functools.cache
def _attribute_docs(path: str) -> dict[tuple[str, str], bool]:
    """(class qualname, or ``""`` for the module; attribute) -> whether any assignment of it is documented."""
    tree, lines = _module_source(path)
    found: dict[tuple[str, str], bool] = {}

    def note(scope: str, name: str, documented: bool) -> None:
        found[(scope, name)] = found.get((scope, name), False) or documented

    def visit_class(cls: ast.ClassDef, scope: str) -> None:
        for node, following in _walk_statements(cls.body):
            for target in _targets(node):
                if isinstance(target, ast.Name):
                    note(scope, target.id, _documented(node, following, lines))
            if isinstance(node, ast.ClassDef):
                visit_class(node, f"{scope}.{node.name}")
            if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef) and node.args.args:
                this = node.args.args[0].arg
                for inner, inner_following in _walk_statements(node.body):
                    for target in _targets(inner):
                        if (
                            isinstance(target, ast.Attribute)
                            and isinstance(target.value, ast.Name)
                            and target.value.id == this
                        ):
                            note(scope, target.attr, _documented(inner, inner_following, lines))

    for node, following in _walk_statements(tree.body):
        for target in _targets(node):
            if isinstance(target, ast.Name):
                note("", target.id, _documented(node, following, lines))
        if isinstance(node, ast.ClassDef):
            visit_class(node, node.name)
    return found


def _public_names(module: types.ModuleType) -> list[str]:
    """The module's ``__all__``, else what it defines (not imports) without a leading underscore."""
    names = getattr(module, "__all__", None)
    if names is not None:
        return list(names)
    assigned = {name for (scope, name) in _attribute_docs(module.__file__ or "") if scope == ""}
    return [
        name
        for name, obj in vars(module).items()
        if not name.startswith("_")
        and (
            getattr(obj, "__module__", None) == module.__name__
            if inspect.isclass(obj) or callable(obj)
            else name in assigned
        )
    ]


def _defining_file(obj: object, fallback: str) -> str:
    try:
        return inspect.getsourcefile(obj) or fallback  # type: ignore[arg-type]
    except TypeError:
        return fallback


def _class_gaps(cls: type, where: str) -> Iterator[str]:
    if not (cls.__doc__ or "").strip() or cls.__doc__ == type(cls).__doc__:
        yield f"{where}: no class docstring"
    path = _defining_file(cls, "")
    docs = _attribute_docs(path) if path.endswith(".py") else {}
    scope = cls.__qualname__
    annotations = cls.__dict__.get("__annotations__", {})
    members = set(vars(cls)) | set(annotations) | {attr for (s, attr) in docs if s == scope}
    for name in sorted(members):
        if name.startswith("_"):
            continue
        raw = cls.__dict__.get(name)
        if isinstance(raw, staticmethod | classmethod):
            raw = raw.__func__
        if isinstance(raw, property | functools.cached_property) or inspect.isfunction(raw):
            if name.startswith("test_"):
                continue  # a suite's test: its name says what it checks (the suites' pages list them by name)
            if not inspect.getdoc(getattr(cls, name, raw)):
                yield f"{where}.{name}: no docstring"
            continue
        if inspect.isclass(raw):
            yield from _class_gaps(raw, f"{where}.{name}")
            continue
        if callable(raw):  # a pytest fixture, a decorated method
            if not inspect.getdoc(raw) or inspect.getdoc(raw) == inspect.getdoc(type(raw)):
                yield f"{where}.{name}: no docstring"
            continue
        if not docs.get((scope, name), False):
            # an attribute declared in a base's body and only assigned here is documented at the base
            if any(docs_of(base).get((base.__qualname__, name), False) for base in cls.__mro__[1:]):
                continue
            yield f"{where}.{name}: an attribute with no #: doc comment (autodoc leaves it out or shows its type's)"


def docs_of(cls: type) -> dict[tuple[str, str], bool]:
    path = _defining_file(cls, "")
    return _attribute_docs(path) if path.endswith(".py") else {}


def _gaps(module_name: str, only: tuple[str, ...] | None) -> Iterator[str]:
    module = importlib.import_module(module_name)
    module_path = module.__file__ or ""
    if not (module.__doc__ or "").strip():
        yield f"{module_name}: no module docstring"
    for name in only if only is not None else _public_names(module):
        obj = getattr(module, name)
        where = f"{module_name}.{name}"
        if isinstance(obj, typing.TypeVar):
            continue
        if inspect.isclass(obj):
            yield from _class_gaps(obj, where)
        elif inspect.isfunction(obj) or inspect.isbuiltin(obj):
            if not inspect.getdoc(obj):
                yield f"{where}: no docstring"
        elif not inspect.ismodule(obj):
            home = sys.modules.get(getattr(obj, "__module__", "") or "") if callable(obj) else None
            if home is not None and callable(obj) and (getattr(obj, "__doc__", None) or "").strip():
                continue  # a callable object (a partial, a decorator's product) with its own docstring
            paths = [module_path]
            # a re-exported constant is documented where it is assigned: look in the modules the package imports
            paths += [
                m.__file__ or ""
                for m in list(sys.modules.values())
                if getattr(m, "__name__", "").startswith(module_name) and getattr(m, "__file__", None)
            ]
            if not any(_attribute_docs(p).get(("", name), False) for p in paths if p and p.endswith(".py")):
                yield f"{where}: a module attribute with no #: doc comment (autodoc shows its type's docstring)"


@pytest.mark.parametrize("module_name", sorted(PLUGIN_API))
def test_every_public_member_of_the_plugin_api_has_a_docstring(module_name: str) -> None:
    gaps = list(_gaps(module_name, PLUGIN_API[module_name]))
    assert not gaps, f"{len(gaps)} gaps in the API reference of {module_name}:\n" + "\n".join(gaps)


def test_the_checker_finds_an_undocumented_method_and_attribute(tmp_path: Path) -> None:
    source = tmp_path / "sb_undocumented_example.py"
    source.write_text(
        '"""A module."""\n\nLIMIT = 5\n\n#: documented\nOTHER = 6\n\n\nclass Thing:\n    """A thing."""\n\n'
        "    #: documented\n    size: int = 1\n    count: int = 2\n\n    def __init__(self) -> None:\n"
        "        self.open = True\n        self.name = 'x'  #: documented\n\n"
        "    def go(self) -> None:\n        pass\n\n    def stop(self) -> None:\n"
        '        """Documented."""\n'
    )
    sys.path.insert(0, str(tmp_path))
    try:
        gaps = list(_gaps("sb_undocumented_example", None))
    finally:
        sys.path.remove(str(tmp_path))
        sys.modules.pop("sb_undocumented_example", None)
    flagged = sorted(gap.split(":")[0] for gap in gaps)
    assert flagged == [
        "sb_undocumented_example.LIMIT",
        "sb_undocumented_example.Thing.count",
        "sb_undocumented_example.Thing.go",
        "sb_undocumented_example.Thing.open",
    ], gaps


def _referenced_modules() -> set[str]:
    named: set[str] = set()
    for page in DOCS.glob("*.rst"):
        for directive, target in re.findall(
            r"^\.\. (automodule|autoclass|autodata|autofunction):: (\S+)", page.read_text(), re.M
        ):
            named.add(target if directive == "automodule" else target.rsplit(".", 1)[0])
    return named


def _in_reference(module_name: str, referenced: set[str]) -> bool:
    """Whether the module is in a page, itself or through a package that re-exports every public name of it (the
    kit's modules through ``statebackend.kit``)."""
    if module_name in referenced:
        return True
    package = module_name.rpartition(".")[0]
    if package not in referenced:
        return False
    exported = set(getattr(importlib.import_module(package), "__all__", ()))
    return set(_public_names(importlib.import_module(module_name))) <= exported


def test_every_module_of_the_plugin_api_is_in_the_reference() -> None:
    referenced = _referenced_modules()
    missing = sorted(name for name in PLUGIN_API if not _in_reference(name, referenced))
    assert not missing, f"not in any page of docs/api: {missing}"


def _conf():  # type: ignore[no-untyped-def]
    """docs/api/conf.py as a module: its build-finished check is the rendered half of this test."""
    spec = importlib.util.spec_from_file_location("docs_api_conf", DOCS / "conf.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_the_garbled_check_finds_a_type_docstring_and_a_type_field(tmp_path: Path) -> None:
    (tmp_path / "page.html").write_text(
        '<dl class="py data">\n<dt class="sig sig-object py" id="m.LIMIT">LIMIT = 5</dt>\n<dd><p>'
        + html.escape(int.__doc__ or "")
        + '</p></dd>\n</dl>\n<dl class="py attribute">\n<dt class="sig sig-object py" id="m.C.a">a</dt>\n'
        '<dd><p>the store started empty).</p>\n<dl class="field-list simple">\n'
        '<dt class="field-odd">Type<span class="colon">:</span></dt>\n<dd class="field-odd"><p>for backup managers</p>'
        "</dd>\n</dl>\n</dd>\n</dl>\n"
        '<dl class="py attribute">\n<dt class="sig sig-object py" id="m.C.b">b</dt>\n<dd><p>fine: Type is ok</p></dd>'
        "\n</dl>\n"
    )
    problems = _conf().garbled_entries(tmp_path)
    assert [problem.split(" ")[1] for problem in problems] == ["m.LIMIT", "m.C.a"], problems


@pytest.fixture(scope="module")
def built_reference(tmp_path_factory: pytest.TempPathFactory) -> Path:
    # Sphinx is in the test extra (pinned as in the docs extra)
    out = tmp_path_factory.mktemp("api")
    done = subprocess.run(
        [sys.executable, "-m", "sphinx", "-q", "-b", "html", str(DOCS), str(out)],
        capture_output=True,
        text=True,
        check=False,
        cwd=ROOT,
    )
    assert done.returncode == 0, done.stdout + done.stderr
    return out


def test_no_attribute_of_the_rendered_reference_is_garbled(built_reference: Path) -> None:
    problems = _conf().garbled_entries(built_reference)
    assert not problems, "\n".join(problems)
