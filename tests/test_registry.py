"""The state backend registry: short names, dotted paths, entry points, canonical names and its errors."""

from __future__ import annotations

import sys
import textwrap
from collections.abc import Iterator
from pathlib import Path

import pytest

from statebackend import registry
from statebackend.contracts import StateBackendFactory
from statebackend.errors import ConfigError
from statebackend.registry import ResolvedFactory, known_factories, register_factory, resolve_factory
from tests.backend_helpers import StubFactory


class GoodFactory(StubFactory):
    """A factory with every method of the contract (none is called here)."""


class OtherFactory(GoodFactory):
    pass


class NotAFactory:
    pass


class AbstractFactory(StateBackendFactory):
    """Leaves the contract's methods unimplemented, so it cannot be instantiated."""


NOT_A_CLASS = 42
GOOD = f"{__name__}:GoodFactory"


@pytest.fixture(autouse=True)
def isolated_registry(monkeypatch: pytest.MonkeyPatch) -> None:
    """Each test sees the built-in registry and an empty instance cache, and leaves them as they were."""
    monkeypatch.setattr(registry, "_REGISTRY", dict(registry._REGISTRY))
    monkeypatch.setattr(registry, "_INSTANCES", {})


@pytest.fixture
def plugin_dist(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Iterator[str]:
    """An installed distribution (a dist-info on sys.path) declaring entry point ``plugged`` in our group."""
    module = "sb_test_plugin_module"
    (tmp_path / f"{module}.py").write_text(
        textwrap.dedent(
            """
            from statebackend.contracts import StateBackendFactory

            class PluginFactory(StateBackendFactory):
                def backup_manager(self, context): raise NotImplementedError
                def restore_manager(self, context): raise NotImplementedError
                def admin(self, context): raise NotImplementedError
            """
        )
    )
    dist_info = tmp_path / "sb_test_plugin-1.0.dist-info"
    dist_info.mkdir()
    (dist_info / "METADATA").write_text("Metadata-Version: 2.1\nName: sb-test-plugin\nVersion: 1.0\n")
    (dist_info / "entry_points.txt").write_text(
        f"[statebackend.backends]\nplugged = {module}:PluginFactory\nbroken = sb_test_absent_module:Nothing\n"
    )
    monkeypatch.syspath_prepend(str(tmp_path))
    yield module
    sys.modules.pop(module, None)


def test_builtin_short_names_map_to_the_backends_packages() -> None:
    known = known_factories()
    assert known["changelog"] == "statebackend.backends.changelog.factory:ChangelogStateBackendFactory"
    assert known["blobsnapshot"] == "statebackend.backends.blobsnapshot.factory:BlobSnapshotStateBackendFactory"


def test_known_factories_is_read_only() -> None:
    known = known_factories()
    with pytest.raises(TypeError):
        known["x"] = GOOD  # type: ignore[index]
    assert "x" not in known_factories()


def test_registered_short_name_resolves_to_an_instance_under_the_short_name() -> None:
    register_factory("mine", GOOD)
    resolved = resolve_factory("mine")
    assert resolved == ResolvedFactory("mine", resolved.factory)
    assert type(resolved.factory) is GoodFactory
    assert known_factories()["mine"] == GOOD


def test_factory_instance_is_cached_per_canonical_name() -> None:
    register_factory("mine", GOOD)
    assert resolve_factory("mine").factory is resolve_factory("mine").factory
    assert resolve_factory(GOOD).factory is resolve_factory("mine").factory


def test_registering_a_taken_name_needs_replace() -> None:
    register_factory("mine", GOOD)
    with pytest.raises(ConfigError, match="already registered"):
        register_factory("mine", f"{__name__}:OtherFactory")
    first = resolve_factory("mine").factory
    register_factory("mine", f"{__name__}:OtherFactory", replace=True)
    second = resolve_factory("mine").factory
    assert type(second) is OtherFactory and second is not first


@pytest.mark.parametrize("bad_name", ["", "1abc", "has.dot", "has:colon", "sp ace"])
def test_register_rejects_a_short_name_unusable_as_a_config_prefix(bad_name: str) -> None:
    with pytest.raises(ConfigError, match="not valid"):
        register_factory(bad_name, GOOD)


@pytest.mark.parametrize("reserved", ["job", "state", "blob", "stores", "task"])
def test_register_rejects_a_short_name_taken_by_framework_keys(reserved: str) -> None:
    with pytest.raises(ConfigError, match="taken by statebackend's own config keys"):
        register_factory(reserved, GOOD)


@pytest.mark.parametrize("bad_target", ["no_colon_path", "pkg.mod:", ":Cls", "pkg..mod:Cls"])
def test_register_rejects_a_target_that_is_not_a_dotted_path(bad_target: str) -> None:
    with pytest.raises(ConfigError, match="not a dotted path"):
        register_factory("mine", bad_target)


def test_dotted_path_resolves_with_the_dotted_path_as_canonical_name() -> None:
    resolved = resolve_factory(GOOD)
    assert resolved.canonical_name == GOOD
    assert type(resolved.factory) is GoodFactory


def test_dotted_path_of_a_registered_backend_canonicalizes_to_its_short_name() -> None:
    register_factory("mine", GOOD)
    assert resolve_factory(GOOD).canonical_name == "mine"


def test_nested_class_path_resolves() -> None:
    resolved = resolve_factory(f"{__name__}:Holder.Inner")
    assert type(resolved.factory) is Holder.Inner


def test_entry_point_resolves_under_its_name(plugin_dist: str) -> None:
    resolved = resolve_factory("plugged")
    assert resolved.canonical_name == "plugged"
    assert type(resolved.factory).__module__ == plugin_dist
    assert known_factories()["plugged"] == f"{plugin_dist}:PluginFactory"


def test_dotted_path_of_an_entry_point_canonicalizes_to_the_entry_point_name(plugin_dist: str) -> None:
    assert resolve_factory(f"{plugin_dist}:PluginFactory").canonical_name == "plugged"


def test_entry_point_that_cannot_be_imported_names_its_distribution(plugin_dist: str) -> None:
    with pytest.raises(ConfigError) as info:
        resolve_factory("broken")
    message = str(info.value)
    assert "No module named 'sb_test_absent_module'" in message
    assert "sb-test-plugin" in message


def test_registered_short_name_shadows_an_entry_point_of_the_same_name(plugin_dist: str) -> None:
    register_factory("plugged", GOOD)
    assert type(resolve_factory("plugged").factory) is GoodFactory


def test_unknown_name_lists_builtins_and_entry_points(plugin_dist: str) -> None:
    with pytest.raises(ConfigError) as info:
        resolve_factory("changelgo")
    message = str(info.value)
    assert "unknown state backend 'changelgo'" in message
    for name in ("changelog", "blobsnapshot", "plugged"):
        assert name in message


def test_missing_module_is_a_config_error_with_the_cause_and_a_hint() -> None:
    with pytest.raises(ConfigError) as info:
        resolve_factory("sb_no_such_package.factory:Factory")
    message = str(info.value)
    assert "No module named 'sb_no_such_package'" in message
    assert "make sure the package that provides 'sb_no_such_package.factory' is installed" in message
    assert isinstance(info.value.__cause__, ModuleNotFoundError)


def test_builtin_whose_module_is_missing_says_to_reinstall() -> None:
    registry._REGISTRY["ghost"] = ("sb_no_such_package:Factory", registry._REINSTALL_HINT)
    with pytest.raises(ConfigError, match="reinstall statebackend"):
        resolve_factory("ghost")


def test_missing_class_in_an_existing_module_is_a_config_error() -> None:
    with pytest.raises(ConfigError, match="has no attribute 'NoSuchFactory'"):
        resolve_factory(f"{__name__}:NoSuchFactory")


@pytest.mark.parametrize("target", ["NotAFactory", "NOT_A_CLASS"])
def test_object_that_is_not_a_factory_subclass_is_rejected(target: str) -> None:
    with pytest.raises(ConfigError, match="not a subclass of statebackend.contracts.StateBackendFactory"):
        resolve_factory(f"{__name__}:{target}")


def test_factory_that_cannot_be_instantiated_is_a_config_error() -> None:
    with pytest.raises(ConfigError, match="could not be instantiated with no arguments"):
        resolve_factory(f"{__name__}:AbstractFactory")


@pytest.mark.parametrize("name", ["", "   ", "pkg.mod:", "a b:C"])
def test_empty_or_malformed_names_are_config_errors(name: str) -> None:
    with pytest.raises(ConfigError):
        resolve_factory(name)


def test_module_that_fails_while_importing_is_a_config_error(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    (tmp_path / "sb_test_exploding.py").write_text("raise RuntimeError('boom at import')\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    with pytest.raises(ConfigError, match="RuntimeError: boom at import"):
        resolve_factory("sb_test_exploding:Factory")
    sys.modules.pop("sb_test_exploding", None)


class Holder:
    class Inner(GoodFactory):
        pass
