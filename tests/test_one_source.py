"""Each default, name rule and option parse is said in one place: these tests fail when two places disagree.

- every attribute of Settings and StoreSettings read from a key takes its default from the schema (keys.py), and so
  do the defaults the blob stores and the resilience layer keep outside their schemas;
- docs/configuration.md and docs/blobstores.md give the schema's default of every key;
- the serde names config accepts are the serdes statebackend.serdes defines;
- job, store and task names follow one rule (statebackend.config.names);
- ``blob.store.*`` options are parsed once, by the store's schema, and used as they are from then on.
"""

from __future__ import annotations

import importlib.metadata
import inspect
import os
import pickle
import re
from collections import Counter
from collections.abc import Mapping
from pathlib import Path
from typing import Any, ClassVar

import attrs
import pytest
from statebackend.backends.blobsnapshot.factory import BlobSnapshotStateBackendFactory
from statebackend.backends.changelog.factory import ChangelogStateBackendFactory

from statebackend import options as options_module
from statebackend.blobstores import registry  # the registry: its table and entry points are patched
from statebackend.blobstores.azure import AzureBlobStore
from statebackend.blobstores.file import FileBlobStore
from statebackend.blobstores.memory import MemoryBlobStore
from statebackend.blobstores.parted import PartedBlobStore
from statebackend.blobstores.resilience import RESILIENCE_OPTIONS, ResilienceSettings, ResilientBlobStore
from statebackend.blobstores.s3 import S3BlobStore
from statebackend.config import (
    GLOBAL_OPTIONS,
    NAME_MAX_LENGTH,
    SERDES,
    STORE_OPTIONS,
    OptionSpec,
    ParsedOptions,
    Settings,
    StoreSettings,
    check_name,
    config_keys,
    default_of,
    parse_int,
)
from statebackend.errors import ConfigError
from statebackend.serdes import SERDE_NAMES, get_serde

URL = "file:///tmp/statebackend-one-source"
REFERENCE = Path(__file__).resolve().parent.parent / "docs" / "configuration.md"

# -- defaults ---------------------------------------------------------------------------------------------------


def test_every_global_key_is_read_into_exactly_one_settings_attribute() -> None:
    keys = list(config_keys(Settings).values())
    assert sorted(keys) == sorted(GLOBAL_OPTIONS)


def test_no_settings_attribute_has_a_default_of_its_own() -> None:
    # seen: Settings said 0 for task.thread.switch.interval.us and False for task.gc.freeze, the schema 200 and True
    assert [field.name for field in attrs.fields(Settings) if field.default is not attrs.NOTHING] == []


def test_settings_of_a_minimal_config_hold_the_schema_default_of_every_key() -> None:
    settings = Settings.from_config({"blob.store.url": URL})
    for attribute, key in config_keys(Settings).items():
        if key == "blob.store.url":
            continue  # the one required key: it has no default
        assert getattr(settings, attribute) == GLOBAL_OPTIONS[key].default_value(key), key


def test_store_settings_defaults_are_the_schema_defaults() -> None:
    read = config_keys(StoreSettings)
    # the factories are resolved to canonical names by hand; every other store option is one attribute
    assert set(STORE_OPTIONS) - set(read.values()) == {"backup.factories", "restore.factories", "restore.factory"}
    fields = attrs.fields_dict(StoreSettings)
    store = Settings.from_config({"blob.store.url": URL, "stores.s.backup.factories": "changelog"}).stores["s"]
    for attribute, option in read.items():
        default = default_of(STORE_OPTIONS, option)
        assert fields[attribute].default == default, option
        assert getattr(store, attribute) == default, option


def test_the_resilience_defaults_are_the_schema_defaults() -> None:
    assert ResilienceSettings() == ResilienceSettings.from_options({})
    assert ResilientBlobStore(MemoryBlobStore()).resilience.settings == ResilienceSettings()
    parameters = inspect.signature(ResilientBlobStore.__init__).parameters
    for name, field in attrs.fields_dict(ResilienceSettings).items():
        assert parameters[name].default == field.default, name


@pytest.mark.parametrize("store_class", [AzureBlobStore, S3BlobStore])
def test_the_remote_stores_defaults_are_their_schema_defaults(store_class: type[PartedBlobStore]) -> None:
    parameters = inspect.signature(store_class.__init__).parameters
    for parameter, option in {
        "part_size": "part.size.bytes",
        "max_concurrency": "max.concurrency",
        "create_if_missing": "create.if.missing",
    }.items():
        assert parameters[parameter].default == default_of(store_class.options, option), parameter


def test_the_file_store_creates_its_directory_by_the_schema_default(tmp_path: Path) -> None:
    assert FileBlobStore(tmp_path).create is default_of(FileBlobStore.options, "create.if.missing") is True


def _reference_rows() -> dict[str, dict[str, str]]:
    """key -> column name -> cell, for every row of a key table of docs/configuration.md."""
    rows: dict[str, dict[str, str]] = {}
    columns: list[str] = []
    for line in REFERENCE.read_text().splitlines():
        cells = [cell.strip() for cell in line.strip().strip("|").split("|")]
        if line.startswith("| key |"):
            columns = cells
        elif line.startswith("| `") and columns:
            rows[cells[0].strip("`")] = dict(zip(columns, cells, strict=True))
        elif not line.startswith("|"):
            columns = []
    return rows


def _check_documented_default(key: str, spec: OptionSpec, cell: str) -> None:
    default = spec.default_value(key)
    if default is None:
        assert cell in {"unset", "required", "**required**", "", "the backup factories"}, (key, cell)
        return
    token = re.match(r"`([^`]+)`", cell)
    assert token is not None, f"docs/configuration.md gives no default for {key}: {cell!r}"
    assert spec.parse(key, token.group(1)) == default, f"docs/configuration.md: the default of {key}"


def test_the_reference_gives_the_schema_default_of_every_key() -> None:
    rows = _reference_rows()
    for key, spec in GLOBAL_OPTIONS.items():
        if key == "task.commit.pool.size":  # depends on the machine: documented as its formula
            assert rows[key]["default"] == "`min(32, 4 x CPUs)`"
            assert spec.default_value(key) == min(32, 4 * (os.cpu_count() or 1))
            continue
        _check_documented_default(key, spec, rows[key]["default"])
    for option, spec in STORE_OPTIONS.items():
        _check_documented_default(option, spec, rows[f"stores.<name>.{option}"]["default"])


@pytest.mark.parametrize("factory", [ChangelogStateBackendFactory, BlobSnapshotStateBackendFactory])
def test_the_reference_gives_every_built_in_backend_option_and_its_default(factory: type[Any]) -> None:
    # seen: the blob-snapshot options were documented only beside its format, not in the reference
    rows = _reference_rows()
    name = "changelog" if factory is ChangelogStateBackendFactory else "blobsnapshot"
    assert factory.options
    for option, spec in factory.options.items():
        key = f"{name}.{option}"
        assert key in rows, f"docs/configuration.md does not document {key}"
        _check_documented_default(key, spec, rows[key]["default"])
    assert {key for key in rows if key.startswith(name + ".")} == {f"{name}.{o}" for o in factory.options}


def test_the_reference_gives_each_schemes_default_of_every_blob_store_option() -> None:
    rows = _reference_rows()
    schemas = own_blob_store_option_schemas()
    for option in {o for schema in schemas.values() for o in schema}:
        cell = rows[f"blob.store.{option}"]["default"]
        tokens = re.findall(r"`([^`]+)`", cell)
        per_scheme: dict[str, str] = {}
        value = None
        for token in tokens:  # "`true` for `file://`, `false` for `az://` and `s3://`", or one value for all
            if token.endswith("://"):
                assert value is not None, cell
                per_scheme[token[: -len("://")]] = value
            else:
                value = token
        for scheme, schema in schemas.items():
            if option in schema:
                _check_documented_default(
                    f"blob.store.{option}", schema[option], f"`{per_scheme.get(scheme, value)}`" if tokens else cell
                )


def test_the_blob_store_guide_gives_each_schemes_default_of_every_option() -> None:
    text = (REFERENCE.parent / "blobstores.md").read_text()
    section = text.split("## Options", 1)[1].split("\n## ", 1)[0]
    schemas = own_blob_store_option_schemas()
    checked = set()
    for line in section.splitlines():
        if not line.startswith("| `"):
            continue
        key_cell, default_cell = [cell.strip() for cell in line.strip().strip("|").split("|")][:2]
        keys = re.findall(r"`([^`]+)`", key_cell)  # "`retry.base.delay.ms` / `retry.max.delay.ms`" | "100 / 5000"
        cells = [cell.strip() for cell in default_cell.split(" / ")] if len(keys) > 1 else [default_cell]
        for key, cell in zip(keys, cells, strict=True):
            per_scheme = dict(re.findall(r"`([a-z0-9]+)://`: (\w+)", cell))  # "false (`file://`: true)"
            written = re.sub(r"\s*\(.*\)$", "", cell)  # "0 (off)", "boto3 chain (`AWS_PROFILE`)"
            for scheme, schema in schemas.items():
                if key not in schema:
                    continue
                default = schema[key].default_value(f"blob.store.{key}")
                value = per_scheme.get(scheme, written)
                if default is None:
                    assert value == "–" or value.startswith("boto3 chain"), f"docs/blobstores.md: {key} has no default"
                else:
                    assert schema[key].parse(key, value) == default, f"docs/blobstores.md: {scheme}:// default of {key}"
                checked.add(key)
    assert checked == {option for schema in schemas.values() for option in schema}


def own_blob_store_option_schemas() -> dict[str, Mapping[str, OptionSpec]]:
    """The option schemas of statebackend's own schemes (the docs give those, not the ones an installed third-party
    package adds, such as the example mem2://)."""
    own = {
        ep.name
        for ep in importlib.metadata.entry_points(group=registry.ENTRY_POINT_GROUP)
        if ep.dist is not None and ep.dist.name == "statebackend"
    }
    assert own == {"file", "memory", "az", "s3"}
    return {scheme: schema for scheme, schema in registry.blob_store_option_schemas().items() if scheme in own}


# -- serde names ------------------------------------------------------------------------------------------------


def test_config_takes_exactly_the_serdes_statebackend_defines() -> None:
    assert SERDES is SERDE_NAMES
    rows = _reference_rows()
    for option in ("key.serde", "msg.serde"):
        spec = STORE_OPTIONS[option]
        for name in SERDE_NAMES:
            assert spec.parse(option, name) == name
            assert get_serde(name).name == name
        with pytest.raises(ConfigError, match="allowed: one of " + ", ".join(SERDE_NAMES)):
            spec.parse(option, "msgpack")
        # values may also be records of a class (statebackend.serdes.record), named by it, not from a list
        record = ["record:<module>:<Class>"] if option == "msg.serde" else []
        assert re.findall(r"`([^`]+)`", rows[f"stores.<name>.{option}"]["allowed"]) == [*SERDE_NAMES, *record]


# -- names ------------------------------------------------------------------------------------------------------

VALID_NAMES = ["a", "7", "task-0", "orders.by.id", "A_b-C.9", "x" * NAME_MAX_LENGTH, "a..b"]
INVALID_NAMES = [
    "",
    ".",
    "..",
    ".hidden",
    "-rf",
    "_x",
    "a/b",
    "a\\b",
    "a b",
    "tâche",
    "x" * (NAME_MAX_LENGTH + 1),
    "a\x00b",
    "a\nb",
    "t:0",
]


@pytest.mark.parametrize("name", VALID_NAMES)
def test_a_name_the_rule_accepts(name: str) -> None:
    check_name("task name", name)


@pytest.mark.parametrize("name", [*INVALID_NAMES, None, 5])
def test_a_name_the_rule_refuses_names_what_is_wrong_and_what_is_allowed(name: Any) -> None:
    with pytest.raises(ConfigError) as info:
        check_name("task name", name)
    message = str(info.value)
    assert message.startswith(f"task name {name!r} is not valid: ")
    assert message.endswith(
        f"allowed: 1 to {NAME_MAX_LENGTH} ASCII letters, digits, '.', '_' or '-', starting with a letter or digit"
    )


@pytest.mark.parametrize("name", [*VALID_NAMES, *INVALID_NAMES])
def test_store_and_job_names_follow_the_one_rule(name: str) -> None:
    try:
        check_name("name", name)
        valid = True
    except ConfigError:
        valid = False
    store = {"blob.store.url": URL, f"stores.{name}.backup.factories": "changelog"}
    job = {"blob.store.url": URL, "job.name": name}
    for config in (store, job):
        try:
            Settings.from_config(config)
            accepted = True
        except ConfigError as exc:
            accepted = False
            assert "is not valid" in str(exc)
        assert accepted is valid, config


def test_a_dotted_store_name_leaves_every_store_key_unambiguous() -> None:
    # config reads stores.<name>.<option> by the option at the key's end, so no option may end another
    for option in STORE_OPTIONS:
        for other in STORE_OPTIONS:
            assert not option.endswith("." + other), f"stores.<name>.{option} could be read as option {other}"
    settings = Settings.from_config(
        {
            "blob.store.url": URL,
            "stores.a.backup.factories": "changelog",
            "stores.a.ttl.backup.factories": "changelog",
            "stores.a.ttl.ttl.ms": "5s",
        }
    )
    assert (settings.stores["a"].ttl_ms, settings.stores["a.ttl"].ttl_ms) == (None, 5000)


# -- blob store options are parsed once ---------------------------------------------------------------------------

_PARSES: Counter[str] = Counter()


def _counted(spec: OptionSpec) -> OptionSpec:
    parse = spec.parse

    def counting(key: str, raw: Any) -> Any:
        _PARSES[key] += 1
        return parse(key, raw)

    return attrs.evolve(spec, parse=counting)


class CountingStore(MemoryBlobStore):
    """A memory store whose every option counts its parses and which, like the remote stores, goes through the
    resilience layer."""

    options: ClassVar[Mapping[str, OptionSpec]] = {
        **{key: _counted(spec) for key, spec in RESILIENCE_OPTIONS.items()},
        "knob": _counted(OptionSpec(parse_int(min=1), 1, "a knob")),
    }
    knob: int = 0

    @classmethod
    def from_url(cls, url: str, options: Mapping[str, Any]) -> ResilientBlobStore:  # type: ignore[override]
        inner = MemoryBlobStore.from_url.__func__(cls, url, options)  # type: ignore[attr-defined]
        inner.knob = options["knob"]
        return ResilientBlobStore.wrap(inner, options)


@pytest.fixture
def counting_scheme(monkeypatch: pytest.MonkeyPatch) -> Counter[str]:
    monkeypatch.setattr(registry, "_SCHEMES", dict(registry._SCHEMES))
    registry.register_blob_store("counting", f"{__name__}:CountingStore")
    _PARSES.clear()
    return _PARSES


def test_each_blob_store_option_is_parsed_once_from_config_to_the_open_store(counting_scheme: Counter[str]) -> None:
    settings = Settings.from_config(
        {"blob.store.url": "counting://once", "blob.store.knob": "3", "blob.store.retry.max.attempts": "7"}
    )
    on_an_executor = pickle.loads(pickle.dumps(settings))  # Settings travel to Spark executors
    with registry.open_blob_store(on_an_executor.blob_store_url, on_an_executor.blob_store_options) as store:
        assert isinstance(store, ResilientBlobStore)
        assert store.inner.knob == 3  # type: ignore[attr-defined]
        assert store.resilience.settings.max_attempts == 7
    assert counting_scheme == {f"blob.store.{key}": 1 for key in CountingStore.options}


def test_raw_options_are_parsed_once_when_a_store_is_opened_without_settings(counting_scheme: Counter[str]) -> None:
    with registry.open_blob_store("counting://raw", {"knob": 2, "hedge.max": "3"}) as store:
        assert store.inner.knob == 2  # type: ignore[attr-defined]
        assert store.resilience.settings.max_hedges == 3  # type: ignore[attr-defined]
    assert counting_scheme == {f"blob.store.{key}": 1 for key in CountingStore.options}


def test_the_stores_use_the_values_config_parsed_without_parsing_again(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("AWS_ACCESS_KEY_ID", "testing")  # boto3 would otherwise look for credentials on the network
    monkeypatch.setenv("AWS_SECRET_ACCESS_KEY", "testing")
    account_key = "Eby8vdM02xNOcqFlqUwJPLlmEtlCDXJ1OUzFT50uSRZ6IFsuFq2UVErCz4I6tq/K1SZFPTOtr/KBHBeksoGMGw=="
    tuned = {
        "blob.store.max.concurrency": "16",
        "blob.store.retry.max.attempts": "7",
        "blob.store.part.size.bytes": "16MiB",
        "blob.store.hedge.after.ms": "2s",
    }
    configs = {
        "s3": {
            "blob.store.url": "s3://bucket/prefix",
            "blob.store.endpoint.url": "http://127.0.0.1:9",
            "blob.store.region": "us-east-1",
            **tuned,
        },
        "az": {
            "blob.store.url": "az://container/prefix",
            **tuned,
            "blob.store.connection.string": "DefaultEndpointsProtocol=http;AccountName=devstoreaccount1;"
            f"AccountKey={account_key};"
            "BlobEndpoint=http://127.0.0.1:9/devstoreaccount1;",
        },
    }
    parsed = {scheme: Settings.from_config(config) for scheme, config in configs.items()}

    def parse_again(key: str, spec: OptionSpec, raw: Any) -> Any:
        raise AssertionError(f"{key} parsed again")

    monkeypatch.setattr(options_module, "parse_one", parse_again)
    for settings in parsed.values():
        assert isinstance(settings.blob_store_options, ParsedOptions)
        with registry.open_blob_store(settings.blob_store_url, settings.blob_store_options) as store:
            assert isinstance(store, ResilientBlobStore)
            inner = store.inner
            assert isinstance(inner, PartedBlobStore)
            assert (inner.max_concurrency, inner.part_size) == (16, 16 << 20)
            assert (store.resilience.settings.max_attempts, store.resilience.settings.hedge_after_s) == (7, 2.0)
            assert store.resilience.settings.max_threads == 64


def test_every_store_that_declares_a_resilience_option_declares_them_all_as_the_resilience_layer_does() -> None:
    # the resilience layer takes a store's parsed options as its own: the specs must be the very same
    for scheme, schema in registry.blob_store_option_schemas().items():
        shared = RESILIENCE_OPTIONS.keys() & schema.keys()
        if shared:
            assert all(schema[key] is RESILIENCE_OPTIONS[key] for key in RESILIENCE_OPTIONS), scheme


def test_parsed_options_keep_their_schema_across_pickling_and_hide_secrets() -> None:
    options = AzureBlobStore.parse_options({"connection.string": "AccountKey=sekrit", "hedge.max": "3"})
    again = pickle.loads(pickle.dumps(options))
    assert again == options and again.schema_name == options.schema_name and again.declared == options.declared
    assert AzureBlobStore.parse_options(again) is again
    assert "sekrit" not in repr(again) and "<redacted>" in repr(again)
    with pytest.raises(TypeError):
        again["hedge.max"] = 4  # type: ignore[index]


def test_options_parsed_against_another_schema_are_checked_against_this_one() -> None:
    for_file = FileBlobStore.parse_options({})
    assert for_file == {"create.if.missing": True}
    with pytest.raises(ConfigError, match="blob.store.create.if.missing: unknown key"):
        MemoryBlobStore.parse_options(for_file)
