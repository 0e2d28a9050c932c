"""Configuration: defaults, typed parsing, typo detection, store and backend settings, and the reference docs."""

from __future__ import annotations

import importlib.metadata
import pickle
import re
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import pytest

from statebackend import registry
from statebackend.blobstores.base import ENTRY_POINT_GROUP, blob_store_option_schemas
from statebackend.config import (
    GLOBAL_OPTIONS,
    STORE_OPTIONS,
    OptionSpec,
    Settings,
    StoreSettings,
    parse_bool,
    parse_bytes,
    parse_choice,
    parse_duration_ms,
    parse_int,
    parse_list,
    parse_str,
)
from statebackend.errors import ConfigError
from tests.backend_helpers import StubFactory

URL = "file:///tmp/statebackend-test"
S3_URL = "s3://bucket/prefix"  # takes the resilience and part options file:// does not
AZ_URL = "az://container/prefix"


class PlainFactory(StubFactory):
    """A backend without options."""


class OptionsFactory(StubFactory):
    options: Mapping[str, Any] = {
        "chunk.size.bytes": OptionSpec(parse_bytes(min=1), "4MiB", "chunk size"),
        "mode": OptionSpec(parse_choice("fast", "safe"), "safe", "how careful"),
        "token": OptionSpec(parse_str(), None, "an access token", secret=True),
    }


class OtherPlainFactory(StubFactory):
    """A second backend without options, named by dotted path only."""


class BadSchemaFactory(StubFactory):
    options: Mapping[str, Any] = {"size": 5}


PLAIN = f"{__name__}:PlainFactory"
WITH_OPTIONS = f"{__name__}:OptionsFactory"


@pytest.fixture(autouse=True)
def test_backends(monkeypatch: pytest.MonkeyPatch) -> None:
    """The built-in short names point at this module's factories, so these tests need no real backend."""
    monkeypatch.setattr(registry, "_INSTANCES", {})
    monkeypatch.setattr(
        registry,
        "_REGISTRY",
        {"changelog": (PLAIN, None), "blobsnapshot": (PLAIN.replace("Plain", "Options"), None)},
    )


def settings(**keys: Any) -> Settings:
    """Settings from keyword keys (``task__commit__ms`` -> ``task.commit.ms``) plus a valid blob store URL."""
    config = {"blob.store.url": URL}
    config.update({key.replace("__", "."): value for key, value in keys.items()})
    return Settings.from_config(config)


def error_of(config: dict[str, Any]) -> str:
    with pytest.raises(ConfigError) as info:
        Settings.from_config(config)
    return str(info.value)


# -- defaults ---------------------------------------------------------------------------------------------------


def test_only_the_blob_store_url_is_required_and_everything_else_has_its_default() -> None:
    s = Settings.from_config({"blob.store.url": URL})
    assert s.job_name == "job"
    assert s.local_dir == Path("./state")
    assert s.blob_store_url == URL
    assert s.stores == {}
    assert (s.commit_ms, s.commit_max_delay_ms, s.commit_timeout_ms) == (60000, 60000, 1800000)
    assert s.commit_async_failures_tolerated == 0
    assert 1 <= s.commit_pool_size <= 32
    assert s.checkpoint_write_versions == (2,)
    assert s.checkpoint_read_versions == (2, 1)
    assert s.checkpoint_retained == 10
    assert s.thread_switch_interval_us == 200
    assert s.backend_options == {}
    assert s.raw == {"blob.store.url": URL}


def test_blob_store_options_are_those_of_the_url_scheme_with_their_defaults() -> None:
    assert settings().blob_store_options == {"create.if.missing": True}  # file:// creates its directory by default
    assert settings(blob__store__url="memory://t").blob_store_options == {}


def test_blob_store_options_have_their_defaults_and_leave_out_unset_credentials() -> None:
    assert settings(blob__store__url="s3://bucket/prefix").blob_store_options == {
        "max.concurrency": 8,
        "request.timeout.ms": 30000,
        "retry.max.attempts": 5,
        "retry.base.delay.ms": 100,
        "retry.max.delay.ms": 5000,
        "hedge.after.ms": 0,
        "hedge.max": 2,
        "part.size.bytes": 8 * 1024 * 1024,
        "create.if.missing": False,
    }


def test_blob_store_options_are_parsed_without_their_prefix() -> None:
    s = settings(
        blob__store__url="s3://bucket/prefix",
        blob__store__endpoint__url="http://127.0.0.1:9000",
        blob__store__region="eu-west-1",
        blob__store__max__concurrency="16",
        blob__store__create__if__missing="true",
        blob__store__part__size__bytes="16MiB",
    )
    options = s.blob_store_options
    assert options["endpoint.url"] == "http://127.0.0.1:9000"
    assert options["region"] == "eu-west-1"
    assert options["max.concurrency"] == 16
    assert options["create.if.missing"] is True
    assert options["part.size.bytes"] == 16 * 1024 * 1024


def test_credential_may_be_an_sdk_object() -> None:
    credential = object()
    options = settings(blob__store__url="az://container/prefix", blob__store__credential=credential).blob_store_options
    assert options["credential"] is credential


def test_task_keys_accept_strings_and_typed_values() -> None:
    s = settings(
        task__commit__ms="1000",
        task__commit__max__delay__ms=500,
        task__commit__timeout__ms="2min",
        task__commit__async__failures__tolerated=" 3 ",
        task__commit__pool__size=4,
        task__checkpoint__write__versions="1, 2",
        task__checkpoint__read__versions=[1],
        task__checkpoint__retained="3",
    )
    assert (s.commit_ms, s.commit_max_delay_ms, s.commit_timeout_ms) == (1000, 500, 120000)
    assert s.commit_async_failures_tolerated == 3
    assert s.commit_pool_size == 4
    assert s.checkpoint_write_versions == (1, 2)
    assert s.checkpoint_read_versions == (1,)
    assert s.checkpoint_retained == 3


def test_job_name_and_local_dir_are_parsed() -> None:
    s = settings(job__name="orders-v2.eu", state__local__dir="~/sb-state")
    assert s.job_name == "orders-v2.eu"
    assert s.local_dir == Path("~/sb-state").expanduser()


def test_none_values_count_as_unset() -> None:
    assert settings(task__commit__ms=None).commit_ms == 60000


# -- parsers ----------------------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("raw", "expected"),
    [
        ("100", 100),
        (100, 100),
        ("512KiB", 512 * 1024),
        ("64MiB", 64 << 20),
        ("1GiB", 1 << 30),
        ("1TiB", 1 << 40),
        ("64 mib", 64 << 20),
        ("1.5GiB", 3 << 29),
        ("10MB", 10_000_000),
        ("7B", 7),
    ],
)
def test_parse_bytes_accepts_plain_counts_and_units(raw: Any, expected: int) -> None:
    assert parse_bytes()("k", raw) == expected


@pytest.mark.parametrize("raw", [True, "abc", "64XB", "-1", -1, "1.5.2MiB", 1.5, ""])
def test_parse_bytes_rejects_what_is_not_a_byte_count(raw: Any) -> None:
    with pytest.raises(ConfigError, match=r"^k=.* is not valid: .*allowed: a byte count"):
        parse_bytes()("k", raw)


@pytest.mark.parametrize(
    ("raw", "expected"),
    [
        ("1500", 1500),
        (1500, 1500),
        ("250ms", 250),
        ("30s", 30000),
        ("5m", 300000),
        ("5min", 300000),
        ("1h", 3600000),
        ("1.5s", 1500),
    ],
)
def test_parse_duration_ms_accepts_milliseconds_and_units(raw: Any, expected: int) -> None:
    assert parse_duration_ms()("k", raw) == expected


@pytest.mark.parametrize("raw", [True, "soon", "5d", "-5", 2.5])
def test_parse_duration_ms_rejects_what_is_not_a_duration(raw: Any) -> None:
    with pytest.raises(ConfigError, match=r"^k=.* is not valid"):
        parse_duration_ms()("k", raw)


def test_parse_int_checks_type_and_range() -> None:
    parse = parse_int(min=1, max=10)
    assert parse("k", "7") == 7 and parse("k", 10) == 10
    with pytest.raises(ConfigError, match=r"k=True is not valid: a boolean is not an integer"):
        parse("k", True)
    allowed = r"allowed: an integer \(from 1 to 10\)"
    with pytest.raises(ConfigError, match=r"k='abc' is not valid: not an integer; " + allowed):
        parse("k", "abc")
    with pytest.raises(ConfigError, match=r"k=11 is not valid: out of range"):
        parse("k", 11)
    with pytest.raises(ConfigError, match=r"k=2.0 is not valid"):
        parse("k", 2.0)


@pytest.mark.parametrize(
    ("raw", "expected"),
    [
        ("true", True),
        ("FALSE", False),
        (" yes ", True),
        ("off", False),
        ("1", True),
        ("0", False),
        (True, True),
        (False, False),
    ],
)
def test_parse_bool_accepts_the_usual_spellings(raw: Any, expected: bool) -> None:
    assert parse_bool()("k", raw) is expected


@pytest.mark.parametrize("raw", ["maybe", 1, 0, "", None])
def test_parse_bool_rejects_other_values(raw: Any) -> None:
    with pytest.raises(ConfigError, match="allowed: true or false"):
        parse_bool()("k", raw)


def test_parse_choice_suggests_the_closest_allowed_value() -> None:
    parse = parse_choice("bytes", "string", "json")
    assert parse("k", " json ") == "json"
    with pytest.raises(ConfigError, match=r"k='jsn' is not valid: .*did you mean json\?.*allowed: one of bytes, str"):
        parse("k", "jsn")


def test_parse_list_trims_items_and_parses_each() -> None:
    assert parse_list()("k", " a , b,c ") == ("a", "b", "c")
    assert parse_list()("k", ["a", "b"]) == ("a", "b")
    assert parse_list(parse_int())("k", "1,2") == (1, 2)
    assert parse_list(parse_int())("k", [3, "4"]) == (3, 4)


@pytest.mark.parametrize(
    ("raw", "problem"),
    [
        ("a,,b", "item 2 is empty"),
        ("a,", "item 2 is empty"),
        ("", "the list is empty"),
        ([], "the list is empty"),
        (5, "a int is not a list"),
    ],
)
def test_parse_list_rejects_empty_items_and_non_lists(raw: Any, problem: str) -> None:
    with pytest.raises(ConfigError, match=re.escape(problem)):
        parse_list()("k", raw)


def test_parse_str_applies_the_pattern_in_full() -> None:
    parse = parse_str(r"[a-z]+")
    assert parse("k", " abc ") == "abc"
    with pytest.raises(ConfigError, match=r"k='abc1' is not valid: it does not match"):
        parse("k", "abc1")
    with pytest.raises(ConfigError, match="the value is empty"):
        parse_str()("k", "  ")
    with pytest.raises(ConfigError, match="a bool is not a string"):
        parse_str()("k", True)


# -- wrong values and unknown keys ------------------------------------------------------------------------------


def test_missing_blob_store_url_says_how_to_set_it() -> None:
    message = error_of({})
    assert message.splitlines()[0] == (
        "blob.store.url is missing: set it to file:///path, az://container/prefix or s3://bucket/prefix"
    )


def test_empty_blob_store_url_counts_as_missing() -> None:
    assert error_of({"blob.store.url": " "}).startswith("blob.store.url is missing")


def test_misspelled_blob_store_url_is_pointed_at() -> None:
    assert "is blob.store.ulr a misspelling of it?" in error_of({"blob.store.ulr": URL})


def test_blob_store_url_with_an_unknown_scheme_lists_the_known_ones() -> None:
    message = error_of({"blob.store.url": "gs://bucket/prefix"})
    assert "blob.store.url='gs://bucket/prefix' is not valid: unknown scheme 'gs'" in message
    assert "file://" in message and "s3://" in message and "az://" in message


@pytest.mark.parametrize(
    ("key", "raw", "expected"),
    [
        ("task.commit.ms", True, "task.commit.ms=True is not valid: a boolean is not a duration"),
        ("task.commit.ms", "abc", "task.commit.ms='abc' is not valid"),
        ("task.commit.ms", "-5", "task.commit.ms='-5' is not valid: out of range"),
        ("task.checkpoint.retained", 0, "task.checkpoint.retained=0 is not valid: out of range; allowed: an integer"),
        ("task.commit.pool.size", False, "task.commit.pool.size=False is not valid: a boolean is not an integer"),
        ("task.checkpoint.write.versions", "3", "task.checkpoint.write.versions='3' is not valid: out of range"),
        ("task.checkpoint.read.versions", "2,2", "a version is listed twice"),
        ("job.name", "my job", "job.name='my job' is not valid: it does not match"),
        ("job.name", "../escape", "job.name='../escape' is not valid"),
        ("blob.store.create.if.missing", "sure", "blob.store.create.if.missing='sure' is not valid: not a boolean"),
        ("blob.store.max.concurrency", 0, "blob.store.max.concurrency=0 is not valid: out of range"),
    ],
)
def test_wrong_value_names_the_key_the_value_and_what_is_allowed(key: str, raw: Any, expected: str) -> None:
    message = error_of({"blob.store.url": S3_URL if key.startswith("blob.store.") else URL, key: raw})
    assert expected in message
    assert "allowed:" in message


@pytest.mark.parametrize(
    ("key", "suggestion"),
    [
        ("task.comit.ms", "task.commit.ms"),
        ("job.nmae", "job.name"),
        ("state.local.dri", "state.local.dir"),
        ("blob.store.max.concurency", "blob.store.max.concurrency"),
        ("task.checkpoint.retain", "task.checkpoint.retained"),
        ("stores.counts.key.serd", "stores.counts.key.serde"),
        ("stores.counts.backup.factory", "stores.counts.backup.factories"),
        ("tsak.commit.ms", "task.commit.ms"),
        ("store.counts.key.serde", "stores.counts.key.serde"),
    ],
)
def test_misspelled_key_is_an_error_with_the_closest_known_key(key: str, suggestion: str) -> None:
    message = error_of({"blob.store.url": S3_URL if key.startswith("blob.store.") else URL, key: "1"})
    assert f"{key}: unknown key; did you mean {suggestion}?" in message


def test_unknown_key_under_a_store_without_a_close_match_lists_the_store_options() -> None:
    message = error_of({"blob.store.url": URL, "stores.x.flavour": "vanilla"})
    assert "stores.x.flavour: unknown key; allowed: stores.<name>.<option> with <option> one of" in message
    assert "backup.factories" in message and "lmdb.map.size" in message


def test_unknown_key_under_task_without_a_close_match_lists_the_task_keys() -> None:
    message = error_of({"blob.store.url": URL, "task.inputs": "kafka.orders"})
    assert "task.inputs: unknown key; known keys: task.commit.ms" in message


def test_keys_of_other_systems_are_kept_and_ignored() -> None:
    s = settings(spark__sql__shuffle__partitions="4", **{"systems.kafka.bootstrap": "x"})
    assert s.raw["spark.sql.shuffle.partitions"] == "4"
    assert s.raw["systems.kafka.bootstrap"] == "x"


def test_every_problem_is_reported_at_once_first_problem_on_the_first_line() -> None:
    message = error_of(
        {
            "task.commit.ms": "abc",
            "job.nmae": "x",
            "stores.s.key.serde": "jsn",
            "stores.s.backup.factories": "changelog",
        }
    )
    lines = message.splitlines()
    assert lines[0].startswith("blob.store.url is missing")
    assert len(lines) == 4
    assert any(line.startswith("task.commit.ms='abc'") for line in lines)
    assert any(line.startswith("job.nmae: unknown key") for line in lines)
    assert any(line.startswith("stores.s.key.serde='jsn'") for line in lines)


def test_non_string_key_is_an_error() -> None:
    assert "configuration key 5 is a int" in error_of({"blob.store.url": URL, 5: "x"})  # type: ignore[dict-item]  # on purpose


def test_config_that_is_not_a_mapping_is_an_error() -> None:
    with pytest.raises(ConfigError, match="must be a mapping"):
        Settings.from_config([("blob.store.url", URL)])  # type: ignore[arg-type]


# -- stores -----------------------------------------------------------------------------------------------------


def test_store_defaults_back_up_to_changelog_and_restore_from_it() -> None:
    s = settings(stores__counts__key__serde="string", stores__counts__backup__factories="changelog")
    assert s.stores["counts"] == StoreSettings(
        name="counts",
        backup_factories=("changelog",),
        restore_factories=("changelog",),
        key_serde="string",
        msg_serde="bytes",
        write_batch_max_bytes=64 << 20,
        map_size=1 << 40,
    )


def test_store_keys_are_parsed() -> None:
    s = settings(
        stores__a__backup__factories="changelog, blobsnapshot",
        stores__a__msg__serde="json",
        stores__a__write__batch__max__bytes="1MiB",
        stores__a__lmdb__map__size="10GiB",
    )
    store = s.stores["a"]
    assert store.backup_factories == ("changelog", "blobsnapshot")
    assert store.restore_factory == "changelog"
    assert (store.msg_serde, store.write_batch_max_bytes, store.map_size) == ("json", 1 << 20, 10 << 30)


def test_restore_factory_may_be_one_the_store_no_longer_backs_up_to() -> None:
    s = settings(stores__a__backup__factories="blobsnapshot", stores__a__restore__factory="changelog")
    assert s.stores["a"].backup_factories == ("blobsnapshot",)
    assert s.stores["a"].restore_factory == "changelog"


def test_factories_are_recorded_by_canonical_name() -> None:
    s = settings(stores__a__backup__factories=f"{PLAIN.replace('Plain', 'Options')}, {__name__}:OtherPlainFactory")
    assert s.stores["a"].backup_factories == ("blobsnapshot", f"{__name__}:OtherPlainFactory")
    assert set(s.backend_options) == {"blobsnapshot", f"{__name__}:OtherPlainFactory"}


def test_store_names_may_contain_dots() -> None:
    s = settings(**{"stores.orders.by.id.key.serde": "string", "stores.orders.by.id.backup.factories": "changelog"})
    assert s.stores["orders.by.id"].key_serde == "string"


def test_invalid_store_name_is_an_error() -> None:
    message = error_of({"blob.store.url": URL, "stores.-bad.key.serde": "string"})
    assert "stores.-bad.key.serde: store name '-bad' is not valid" in message


def test_unknown_backend_names_the_key_and_lists_the_known_backends() -> None:
    message = error_of({"blob.store.url": URL, "stores.a.backup.factories": "changelgo"})
    assert message.startswith("stores.a.backup.factories: unknown state backend 'changelgo'; known backends:")
    assert "blobsnapshot, changelog" in message


def test_backend_listed_twice_is_an_error() -> None:
    message = error_of({"blob.store.url": URL, "stores.a.backup.factories": f"changelog,{PLAIN}"})
    assert "'changelog' is listed twice" in message


def test_unknown_serde_is_an_error_listing_the_serdes() -> None:
    message = error_of({"blob.store.url": URL, "stores.a.msg.serde": "avro", "stores.a.backup.factories": "changelog"})
    assert "stores.a.msg.serde='avro' is not valid" in message
    assert "allowed: one of bytes, string, integer, json, pickle" in message


def test_only_backends_some_store_names_are_resolved() -> None:
    registry._REGISTRY["changelog"] = ("sb_no_such_module:Factory", None)
    assert settings().stores == {}
    assert "could not be imported" in error_of({"blob.store.url": URL, "stores.a.backup.factories": "changelog"})


# -- backend options --------------------------------------------------------------------------------------------


def test_backend_options_are_filled_with_defaults() -> None:
    s = settings(stores__a__backup__factories="blobsnapshot")
    assert s.backend_options["blobsnapshot"] == {"chunk.size.bytes": 4 << 20, "mode": "safe"}
    assert s.backend_options_for("blobsnapshot") is s.backend_options["blobsnapshot"]


def test_backend_options_are_parsed_under_the_canonical_name() -> None:
    s = settings(
        stores__a__backup__factories="blobsnapshot",
        **{"blobsnapshot.chunk.size.bytes": "1MiB", "blobsnapshot.mode": "fast", "blobsnapshot.token": "t0k"},
    )
    assert s.backend_options_for("blobsnapshot") == {"chunk.size.bytes": 1 << 20, "mode": "fast", "token": "t0k"}


def test_backend_options_of_a_dotted_path_backend_use_the_path_as_prefix() -> None:
    registry._REGISTRY.pop("blobsnapshot")
    s = settings(stores__a__backup__factories=WITH_OPTIONS, **{f"{WITH_OPTIONS}.mode": "fast"})
    assert s.backend_options_for(WITH_OPTIONS)["mode"] == "fast"


def test_backend_options_for_an_alias_returns_the_canonical_options() -> None:
    s = settings(stores__a__backup__factories="blobsnapshot")
    assert s.backend_options_for(WITH_OPTIONS) is s.backend_options["blobsnapshot"]


def test_backend_options_for_an_unused_backend_are_validated_on_request() -> None:
    s = settings(**{"blobsnapshot.mode": "fast"})
    assert s.backend_options == {}
    assert s.backend_options_for("blobsnapshot")["mode"] == "fast"
    bad = settings(**{"blobsnapshot.mode": "reckless"})
    with pytest.raises(ConfigError, match="blobsnapshot.mode='reckless' is not valid"):
        bad.backend_options_for("blobsnapshot")


def test_wrong_backend_option_value_names_the_key() -> None:
    message = error_of(
        {"blob.store.url": URL, "stores.a.backup.factories": "blobsnapshot", "blobsnapshot.chunk.size.bytes": "big"}
    )
    assert "blobsnapshot.chunk.size.bytes='big' is not valid" in message


def test_misspelled_backend_option_suggests_the_closest() -> None:
    message = error_of({"blob.store.url": URL, "stores.a.backup.factories": "blobsnapshot", "blobsnapshot.mdoe": "x"})
    assert "blobsnapshot.mdoe: unknown key; did you mean blobsnapshot.mode?" in message


def test_option_of_a_backend_without_options_is_an_error() -> None:
    message = error_of({"blob.store.url": URL, "stores.a.backup.factories": "changelog", "changelog.anything": "1"})
    assert "changelog.anything: unknown key; known keys of backend 'changelog': none" in message


def test_option_written_under_a_non_canonical_spelling_is_an_error() -> None:
    message = error_of(
        {"blob.store.url": URL, "stores.a.backup.factories": WITH_OPTIONS, f"{WITH_OPTIONS}.mode": "fast"}
    )
    assert "write it as blobsnapshot.mode" in message


def test_secret_backend_option_value_is_not_echoed_in_errors() -> None:
    message = error_of({"blob.store.url": URL, "stores.a.backup.factories": "blobsnapshot", "blobsnapshot.token": 1.5})
    assert "blobsnapshot.token=<redacted> is not valid" in message
    assert "1.5" not in message


def test_backend_whose_options_are_not_option_specs_is_an_error() -> None:
    message = error_of({"blob.store.url": URL, "stores.a.backup.factories": f"{__name__}:BadSchemaFactory"})
    assert "declares option 'size' as 5, not a statebackend.config.OptionSpec" in message


def test_keys_of_a_backend_no_store_uses_are_ignored() -> None:
    assert settings(**{"blobsnapshot.whatever": "1"}).raw["blobsnapshot.whatever"] == "1"


# -- settings as a value ----------------------------------------------------------------------------------------


def test_settings_pickle_round_trip() -> None:
    s = settings(stores__a__backup__factories="changelog,blobsnapshot", blobsnapshot__mode="fast")
    copy = pickle.loads(pickle.dumps(s))
    assert copy == s
    assert copy.backend_options_for("blobsnapshot")["mode"] == "fast"


def test_settings_mappings_are_read_only() -> None:
    s = settings(stores__a__key__serde="string", stores__a__backup__factories="changelog")
    with pytest.raises(TypeError):
        s.stores["b"] = s.stores["a"]  # type: ignore[index]
    with pytest.raises(TypeError):
        s.raw["job.name"] = "x"  # type: ignore[index]


def test_repr_hides_credentials() -> None:
    s = settings(
        blob__store__url=AZ_URL,
        blob__store__connection__string="AccountKey=sekrit",
        blob__store__credential="sekrit2",
        stores__a__backup__factories="blobsnapshot",
        blobsnapshot__token="sekrit3",
    )
    text = repr(s)
    assert "sekrit" not in text
    assert "<redacted>" in text


def test_secret_blob_store_value_is_not_echoed_in_errors() -> None:
    message = error_of({"blob.store.url": AZ_URL, "blob.store.connection.string": 12.5})
    assert "blob.store.connection.string=<redacted> is not valid" in message
    assert "12.5" not in message


# -- the reference ----------------------------------------------------------------------------------------------


def test_reference_docs_list_every_key() -> None:
    reference = (Path(__file__).parent.parent / "docs" / "configuration.md").read_text()
    keys = [*GLOBAL_OPTIONS, *("stores.<name>." + option for option in STORE_OPTIONS)]
    for key in keys:
        assert f"`{key}`" in reference, f"docs/configuration.md does not document {key}"


def test_reference_docs_list_every_blob_store_option_with_the_schemes_that_take_it() -> None:
    reference = (Path(__file__).parent.parent / "docs" / "configuration.md").read_text()
    rows = {line.split("|")[1].strip(): line for line in reference.splitlines() if line.startswith("| `blob.store.")}
    schemas = own_blob_store_option_schemas()
    assert set(schemas) == {"file", "memory", "az", "s3"}  # the SDKs are installed where the tests run
    for option in {o for schema in schemas.values() for o in schema}:
        key = f"`blob.store.{option}`"
        assert key in rows, f"docs/configuration.md does not document blob.store.{option}"
        schemes_cell = rows[key].split("|")[2]
        for scheme, schema in schemas.items():
            takes = f"`{scheme}://`" in schemes_cell
            assert takes == (option in schema), f"docs/configuration.md: scheme {scheme}:// of blob.store.{option}"


def own_blob_store_option_schemas() -> dict[str, Mapping[str, OptionSpec]]:
    """The option schemas of statebackend's own schemes (the reference documents those, not the ones an installed
    third-party package adds, such as the example mem2://)."""
    own = {
        ep.name
        for ep in importlib.metadata.entry_points(group=ENTRY_POINT_GROUP)
        if ep.dist is not None and ep.dist.name == "statebackend"
    }
    return {scheme: schema for scheme, schema in blob_store_option_schemas().items() if scheme in own}


def test_a_store_exists_only_when_its_backup_factories_are_set() -> None:
    # seen: a typo in a store's name silently created a second store with default settings
    message = error_of(
        {
            "blob.store.url": URL,
            "stores.counts.backup.factories": "changelog",
            "stores.counts.key.serde": "string",
            "stores.count.msg.serde": "integer",
        }
    )
    assert message.startswith("stores.count.msg.serde: store 'count' is not declared")
    assert "did you mean stores.counts.msg.serde?" in message
    alone = error_of({"blob.store.url": URL, "stores.sessions.key.serde": "string"})
    assert "declare it with stores.sessions.backup.factories=changelog" in alone
    assert settings(stores__counts__backup__factories="changelog").stores["counts"].key_serde == "bytes"


@pytest.mark.parametrize(
    ("raw", "message"), [(10, "too short"), (-1, "out of range"), (100_001, "out of range"), ("fast", "not an integer")]
)
def test_a_bad_thread_switch_interval_names_the_key_and_what_is_allowed(raw: object, message: str) -> None:
    with pytest.raises(ConfigError, match=rf"task\.thread\.switch\.interval\.us.*{message}.*allowed"):
        Settings.from_config({"blob.store.url": URL, "task.thread.switch.interval.us": raw})


def test_opening_a_task_lowers_the_thread_switch_interval_and_never_raises_it(tmp_path: Path) -> None:
    import sys

    from statebackend.task import TaskStorage

    before = sys.getswitchinterval()  # the test process's own, restored at the end
    try:
        config = {
            "blob.store.url": (tmp_path / "blobs").as_uri(),
            "blob.store.create.if.missing": True,
            "state.local.dir": str(tmp_path / "local"),
        }
        sys.setswitchinterval(0.005)
        with TaskStorage.open({**config, "task.thread.switch.interval.us": 0}, "t"):
            assert sys.getswitchinterval() == pytest.approx(0.005)
        with TaskStorage.open(config, "t"):
            assert sys.getswitchinterval() == pytest.approx(0.0002)
        with TaskStorage.open({**config, "task.thread.switch.interval.us": 2000}, "t"):
            assert sys.getswitchinterval() == pytest.approx(0.0002)  # only ever lowered
    finally:
        sys.setswitchinterval(before)


def test_a_bad_gc_freeze_value_names_the_key() -> None:
    with pytest.raises(ConfigError, match=r"task\.gc\.freeze"):
        Settings.from_config({"blob.store.url": URL, "task.gc.freeze": "sometimes"})
