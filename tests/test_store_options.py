"""Per-store backend options: ``stores.<name>.<backend>.<option>`` overrides ``<backend>.<option>`` for one store.

Config reads the key by the store's own backends (dotted store names stay unambiguous), validates it with the
backend's schema as the job-wide key is, and gives the store's effective options through
``Settings.backend_options_for(backend, store=...)``. The framework gives a backend one manager per group of stores
with equal options, on backup and on restore, so a built-in or third-party backend honours them with no code of its
own: checked here through the changelog backend's snapshot interval, a recording backend, and the example
third-party backend ``fullcopy``.
"""

from __future__ import annotations

import importlib.metadata
import pickle
import shutil
import uuid
from collections.abc import Iterator, Mapping
from pathlib import Path
from typing import Any, ClassVar

import pytest
from statebackend.backends.changelog.backup import ChangelogBackupManager
from statebackend.backends.changelog.factory import ChangelogStateBackendFactory
from statebackend.backends.changelog.marker import Recipe
from statebackend.backends.changelog.restore import ChangelogRestoreManager
from statebackend.checkpoint import CheckpointV2

from statebackend import registry
from statebackend.blobstores.memory import MemoryBlobStore
from statebackend.config import OptionSpec, Settings, parse_int, parse_str
from statebackend.contracts import BackendContext
from statebackend.errors import ConfigError, UsageError
from statebackend.restore import group_by_options, options_of_group, restored_stores
from statebackend.task import TaskStorage

URL = "memory://store-options"


class RecordingFactory(ChangelogStateBackendFactory):
    """The changelog backend under another name, with two more options, recording every context it is given."""

    options: ClassVar[Mapping[str, Any]] = {  # type: ignore[misc]
        **ChangelogStateBackendFactory.options,
        "keep": OptionSpec(parse_int(min=0), 1, "copies kept"),
        "token": OptionSpec(parse_str(), None, "an access token", secret=True),
    }
    #: ("backup" | "restore", the context's stores, its options), in the order they were given
    contexts: ClassVar[list[tuple[str, tuple[str, ...], dict[str, Any]]]] = []

    def backup_manager(self, context: BackendContext) -> ChangelogBackupManager:
        self.contexts.append(("backup", tuple(context.stores), dict(context.options)))
        return super().backup_manager(context)

    def restore_manager(self, context: BackendContext) -> ChangelogRestoreManager:
        self.contexts.append(("restore", tuple(context.stores), dict(context.options)))
        return super().restore_manager(context)


@pytest.fixture(autouse=True)
def tarsnap(monkeypatch: pytest.MonkeyPatch) -> Iterator[type[RecordingFactory]]:
    """A third-party backend registered under the short name ``tarsnap`` (the registry is restored afterwards)."""
    monkeypatch.setattr(registry, "_REGISTRY", dict(registry._REGISTRY))
    monkeypatch.setattr(registry, "_INSTANCES", {})
    registry.register_factory("tarsnap", f"{__name__}:RecordingFactory")
    RecordingFactory.contexts = []
    yield RecordingFactory
    RecordingFactory.contexts = []


def settings(**config: Any) -> Settings:
    return Settings.from_config({"blob.store.url": URL, **config})


def error_of(**config: Any) -> str:
    with pytest.raises(ConfigError) as info:
        settings(**config)
    return str(info.value)


def declared(*names: str, backends: str = "changelog", restores: str | None = None) -> dict[str, str]:
    """Stores ``names`` backed up by ``backends`` and, when given, restored by ``restores``."""
    config = {f"stores.{name}.backup.factories": backends for name in names}
    if restores is not None:
        config.update({f"stores.{name}.restore.factories": restores for name in names})
    return config


# -- config -----------------------------------------------------------------------------------------------------


def test_a_store_option_overrides_the_job_wide_one_for_that_store_only() -> None:
    s = settings(
        **declared("counts", "other"),
        **{
            "changelog.compression": "none",
            "stores.counts.changelog.snapshot.interval.commits": "5",
        },
    )
    counts = s.backend_options_for("changelog", store="counts")
    assert counts["snapshot.interval.commits"] == 5
    assert counts["compression"] == "none"  # the job-wide value under the store's own
    assert s.backend_options_for("changelog", store="other")["snapshot.interval.commits"] == 100
    assert s.backend_options_for("changelog")["snapshot.interval.commits"] == 100
    assert s.backend_options_for("changelog", store="other") is s.backend_options["changelog"]
    assert s.store_backend_options == {"counts": {"changelog": counts}}


def test_the_store_option_is_read_by_the_backends_short_name_or_dotted_path_spelling_gives_the_canonical() -> None:
    target = "statebackend.backends.changelog.factory:ChangelogStateBackendFactory"
    s = settings(**{"stores.counts.backup.factories": target, "stores.counts.changelog.compression": "none"})
    assert s.backend_options_for(target, store="counts")["compression"] == "none"
    message = error_of(**declared("counts"), **{f"stores.counts.{target}.compression": "none"})
    assert message == (
        f"stores.counts.{target}.compression: options of backend {target!r} are read under its "
        "canonical name; write it as stores.counts.changelog.compression"
    )


def test_a_dotted_path_backend_takes_store_options_under_its_path() -> None:
    path = f"{__name__}:RecordingFactory"
    registry._REGISTRY.pop("tarsnap")
    s = settings(**{"stores.a.b.backup.factories": path, f"stores.a.b.{path}.keep": "3"})
    assert s.backend_options_for(path, store="a.b")["keep"] == 3


def test_a_bad_store_option_value_names_the_key_and_what_is_allowed() -> None:
    message = error_of(**declared("counts"), **{"stores.counts.changelog.snapshot.interval.commits": "0"})
    assert message == (
        "stores.counts.changelog.snapshot.interval.commits='0' is not valid: out of range; "
        "allowed: an integer (at least 1)"
    )
    message = error_of(**declared("counts"), **{"stores.counts.changelog.compression": "bzip2"})
    assert message.startswith("stores.counts.changelog.compression='bzip2' is not valid")
    assert message.endswith("allowed: one of zstd, none")


def test_the_same_bad_value_gets_the_same_message_job_wide_and_per_store() -> None:
    job_wide = error_of(**declared("counts"), **{"changelog.compression.level": "23"})
    per_store = error_of(**declared("counts"), **{"stores.counts.changelog.compression.level": "23"})
    assert per_store == "stores.counts." + job_wide


def test_a_misspelled_store_option_gets_did_you_mean_with_the_right_key() -> None:
    message = error_of(**declared("counts"), **{"stores.counts.changelog.snapshot.interval.comits": "5"})
    assert message == (
        "stores.counts.changelog.snapshot.interval.comits: unknown key; did you mean "
        "stores.counts.changelog.snapshot.interval.commits?"
    )


def test_a_misspelled_backend_in_a_store_option_gets_did_you_mean() -> None:
    message = error_of(**declared("counts"), **{"stores.counts.changelgo.snapshot.interval.commits": "5"})
    assert message == (
        "stores.counts.changelgo.snapshot.interval.commits: unknown key; did you mean "
        "stores.counts.changelog.snapshot.interval.commits?"
    )


def test_an_unknown_store_option_with_no_near_miss_lists_the_backends_keys_for_that_store() -> None:
    message = error_of(**declared("counts", backends="tarsnap"), **{"stores.counts.tarsnap.retention": "5"})
    assert message.startswith("stores.counts.tarsnap.retention: unknown key; known keys of backend 'tarsnap': ")
    assert "stores.counts.tarsnap.keep, stores.counts.tarsnap.token" in message


def test_a_third_party_backends_store_option_is_accepted() -> None:
    # was refused as "did you mean stores.counts.tarsnap.key.serde?", the store name read as counts.tarsnap
    s = settings(**declared("counts", "other", backends="tarsnap"), **{"stores.counts.tarsnap.keep": "5"})
    assert s.backend_options_for("tarsnap", store="counts")["keep"] == 5
    assert s.backend_options_for("tarsnap", store="other")["keep"] == 1


def test_a_store_option_whose_name_ends_like_a_store_option_is_read_as_the_backends() -> None:
    registered = {**RecordingFactory.options, "ttl.ms": OptionSpec(parse_int(min=1), None, "its own ttl")}
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(RecordingFactory, "options", registered)
        s = settings(**declared("counts", backends="tarsnap"), **{"stores.counts.tarsnap.ttl.ms": "7"})
    assert s.backend_options_for("tarsnap", store="counts")["ttl.ms"] == 7
    assert s.stores["counts"].ttl_ms is None  # the store's own ttl.ms is untouched
    assert set(s.stores) == {"counts"}  # and no store counts.tarsnap was made of it


def test_a_store_option_of_a_backend_the_store_does_not_use_is_an_error() -> None:
    message = error_of(**declared("counts"), **{"stores.counts.blobsnapshot.gc.on.init": "true"})
    assert message.startswith(
        "stores.counts.blobsnapshot.gc.on.init: store 'counts' is not backed up or restored by "
        "backend 'blobsnapshot' (its backends: changelog)"
    )


def test_a_store_option_of_a_restore_only_backend_is_accepted() -> None:
    s = settings(
        **declared("counts", backends="blobsnapshot", restores="changelog,blobsnapshot"),
        **{"stores.counts.changelog.restore.download.concurrency": "2"},
    )
    assert s.backend_options_for("changelog", store="counts")["restore.download.concurrency"] == 2


def test_dotted_store_names_take_store_options() -> None:
    s = settings(
        **declared("orders", "orders.by.id"),
        **{
            "stores.orders.by.id.changelog.snapshot.interval.commits": "3",
            "stores.orders.by.id.key.serde": "string",
            "stores.orders.changelog.snapshot.interval.commits": "4",
        },
    )
    assert s.backend_options_for("changelog", store="orders.by.id")["snapshot.interval.commits"] == 3
    assert s.backend_options_for("changelog", store="orders")["snapshot.interval.commits"] == 4
    assert s.stores["orders.by.id"].key_serde == "string"
    assert set(s.stores) == {"orders", "orders.by.id"}


def test_a_key_that_reads_as_options_of_two_stores_is_an_error_naming_both() -> None:
    # store "a" backs up to tarsnap, whose options include ttl.ms; store "a.tarsnap" exists too
    registered = {**RecordingFactory.options, "ttl.ms": OptionSpec(parse_int(min=1), None, "its own ttl")}
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(RecordingFactory, "options", registered)
        message = error_of(**declared("a", "a.tarsnap", backends="tarsnap"), **{"stores.a.tarsnap.ttl.ms": "5s"})
    assert message == (
        "stores.a.tarsnap.ttl.ms: reads two ways: option ttl.ms of store 'a.tarsnap', or option "
        "ttl.ms of backend 'tarsnap' of store 'a'; rename one of the stores"
    )


def test_a_key_of_a_store_named_like_another_stores_backend_stays_that_stores_when_the_backend_lacks_the_option() -> (
    None
):
    s = settings(**declared("a", "a.changelog"), **{"stores.a.changelog.key.serde": "string"})
    assert s.stores["a.changelog"].key_serde == "string"
    assert s.store_backend_options == {}


def test_keys_of_an_undeclared_store_are_still_reported_as_such() -> None:
    message = error_of(**declared("counts"), **{"stores.countz.key.serde": "string"})
    assert message.startswith("stores.countz.key.serde: store 'countz' is not declared")
    assert message.endswith("did you mean stores.counts.key.serde?")


def test_an_unknown_key_of_a_declared_store_says_what_the_store_takes() -> None:
    message = error_of(**declared("counts"), **{"stores.counts.retention": "5"})
    assert message.startswith(
        "stores.counts.retention: unknown key; allowed: stores.counts.<option> with <option> one of backup.factories"
    )
    assert message.endswith(
        "or stores.counts.<backend>.<option> with <backend> one of the store's backends "
        "(changelog) and <option> one of its options (see docs/configuration.md)"
    )


def test_a_none_store_option_counts_as_unset() -> None:
    s = settings(**declared("counts"), **{"stores.counts.changelog.compression": None})
    assert s.backend_options_for("changelog", store="counts") is s.backend_options["changelog"]


def test_backend_options_for_an_unknown_store_is_an_error() -> None:
    with pytest.raises(ConfigError, match="no store 'nope' in the config; configured stores: counts"):
        settings(**declared("counts")).backend_options_for("changelog", store="nope")


def test_store_options_survive_pickling_and_their_secrets_stay_out_of_the_repr() -> None:
    s = settings(
        **declared("counts", backends="tarsnap"),
        **{"stores.counts.tarsnap.token": "sekrit-value", "stores.counts.tarsnap.keep": "4"},
    )
    again = pickle.loads(pickle.dumps(s))
    assert again == s
    assert again.backend_options_for("tarsnap", store="counts")["token"] == "sekrit-value"
    assert "sekrit-value" not in repr(s) and "<redacted>" in repr(s)


# -- grouping ---------------------------------------------------------------------------------------------------


def test_stores_are_grouped_by_their_backends_options() -> None:
    s = settings(
        **declared("a", "b", "c", "d"),
        **{
            "stores.b.changelog.compression": "none",
            "stores.c.changelog.compression": "zstd",  # the job-wide value: c goes with a and d
            "stores.d.changelog.compression.level": "3",
        },
    )
    assert group_by_options(s, "changelog", ["a", "b", "c", "d"]) == [["a", "c", "d"], ["b"]]
    assert options_of_group(s, "changelog", ["a", "c"]) == s.backend_options["changelog"]
    with pytest.raises(UsageError, match="backend changelog: stores a and b have different options"):
        options_of_group(s, "changelog", ["a", "b"])


# -- through TaskStorage ----------------------------------------------------------------------------------------


def task_config(tmp_path: Path, *names: str, backends: str = "changelog", **extra: Any) -> dict[str, Any]:
    return {
        "job.name": "job",
        "state.local.dir": str(tmp_path / "local"),
        "blob.store.url": f"memory://{uuid.uuid4().hex}",
        "task.checkpoint.retained": 2,
        **declared(*names, backends=backends),
        **extra,
    }


def write(task: TaskStorage, names: tuple[str, ...], round_no: int, model: dict[str, dict[bytes, bytes]]) -> None:
    for name in names:
        for i in range(20):
            key, value = f"k{(i + round_no * 7) % 40:03d}".encode(), f"{name}-{round_no}-{i}".encode()
            task.store(name, typed=False).put(key, value)
            model.setdefault(name, {})[key] = value


def commit_writes(
    config: dict[str, Any], blobs: MemoryBlobStore, names: tuple[str, ...], rounds: int
) -> dict[str, dict[bytes, bytes]]:
    """Opens task-0, writes (``write``) and durably commits ``rounds`` rounds into stores ``names``, closes it; what
    it wrote, by store."""
    model: dict[str, dict[bytes, bytes]] = {}
    with TaskStorage.open(config, "task-0", blob_store=blobs) as task:
        for round_no in range(rounds):
            write(task, names, round_no, model)
            task.commit_durably({"input": str(round_no)})
    return model


def contents(task: TaskStorage, names: tuple[str, ...]) -> dict[str, dict[bytes, bytes]]:
    return {name: dict(task.store(name, typed=False).items()) for name in names}


def recipe(checkpoint: CheckpointV2, store: str) -> Recipe:
    return Recipe.decode(checkpoint.markers_for("changelog")[store], prefix=f"job/task-0/{store}/changelog/")


def test_a_store_changelog_snapshot_interval_applies_to_that_store_only(tmp_path: Path) -> None:
    names = ("fast", "slow")
    config = {
        **task_config(tmp_path, *names),
        "changelog.snapshot.interval.commits": 1000,
        "changelog.snapshot.interval.ratio": 0,
        "changelog.snapshot.interval.bytes": "1GiB",
        "stores.fast.changelog.snapshot.interval.commits": 2,
    }
    blobs = MemoryBlobStore()
    model: dict[str, dict[bytes, bytes]] = {}
    with TaskStorage.open(config, "task-0", blob_store=blobs) as task:
        bindings = {binding.store_names: binding for binding in task.commit_manager.backups}
        assert set(bindings) == {("fast",), ("slow",)}  # one changelog manager per group of equal options
        assert all(binding.factory_name == "changelog" for binding in bindings.values())
        commits = 0
        checkpoint = None
        while checkpoint is None or recipe(checkpoint, "fast").snapshot is None:
            assert commits < 200, "the fast store never took a snapshot"
            write(task, names, commits, model)
            checkpoint = task.commit_durably({"input": str(commits)})
            commits += 1
        slow = recipe(checkpoint, "slow")
        assert slow.snapshot is None and len(slow.deltas) == commits  # every commit a delta, never a snapshot
        assert recipe(checkpoint, "fast").snapshot is not None
        assert task.metrics.counter("changelog.snapshot.uploads") >= 1
        # both stores' markers are under the one backend's name in each checkpoint
        assert set(checkpoint.markers_for("changelog")) == {"fast", "slow"}
        assert list(blobs.list("job/task-0/slow/changelog/snapshot/")) == []
        assert list(blobs.list("job/task-0/fast/changelog/snapshot/")) != []
    shutil.rmtree(tmp_path / "local")
    with TaskStorage.open(config, "task-0", blob_store=blobs) as task:
        assert contents(task, names) == model


def test_backup_and_restore_managers_get_their_groups_options(tmp_path: Path) -> None:
    names = ("a", "b", "c")
    config = task_config(
        tmp_path,
        *names,
        backends="tarsnap",
        **{
            "tarsnap.keep": 2,
            "stores.b.tarsnap.keep": 5,
            "stores.c.tarsnap.restore.download.concurrency": 3,
        },
    )
    blobs = MemoryBlobStore()
    model = commit_writes(config, blobs, names, 3)
    backups = {stores: options for kind, stores, options in RecordingFactory.contexts if kind == "backup"}
    assert set(backups) == {("a",), ("b",), ("c",)}
    assert (backups[("a",)]["keep"], backups[("b",)]["keep"], backups[("c",)]["keep"]) == (2, 5, 2)
    assert backups[("c",)]["restore.download.concurrency"] == 3
    assert backups[("a",)]["restore.download.concurrency"] == 8
    RecordingFactory.contexts.clear()
    shutil.rmtree(tmp_path / "local")
    with TaskStorage.open(config, "task-0", blob_store=blobs) as task:
        assert contents(task, names) == model
    restores = {stores: options for kind, stores, options in RecordingFactory.contexts if kind == "restore"}
    assert set(restores) == {("a",), ("b",), ("c",)}
    assert [restores[(name,)]["keep"] for name in names] == [2, 5, 2]
    assert restores[("c",)]["restore.download.concurrency"] == 3


def test_stores_with_equal_options_share_one_manager_on_backup_and_restore(tmp_path: Path) -> None:
    names = ("a", "b", "c")
    config = task_config(
        tmp_path,
        *names,
        backends="tarsnap",
        **{
            "stores.b.tarsnap.keep": 1,  # the default
            "stores.c.tarsnap.keep": 9,
        },
    )
    blobs = MemoryBlobStore()
    model = commit_writes(config, blobs, names, 1)
    shutil.rmtree(tmp_path / "local")
    with restored_stores(config, "task-0", blob_store=blobs) as restored:
        assert {name: dict(store.items()) for name, store in restored.stores.items()} == model
    kinds = [(kind, stores, options["keep"]) for kind, stores, options in RecordingFactory.contexts]
    assert kinds == [
        ("backup", ("a", "b"), 1),
        ("backup", ("c",), 9),
        ("restore", ("a", "b"), 1),
        ("restore", ("c",), 9),
    ]


# -- the example third-party backend ----------------------------------------------------------------------------


@pytest.fixture
def fullcopy_installed() -> None:
    try:
        importlib.metadata.distribution("statebackend-fullcopy")
    except importlib.metadata.PackageNotFoundError:
        pytest.fail(
            "the example backend is not installed: pip install -e examples/thirdparty_backend (./dev test does it)"
        )


@pytest.mark.usefixtures("fullcopy_installed")
def test_the_example_third_party_backend_keeps_copies_of_one_store_by_its_store_option(tmp_path: Path) -> None:
    names = ("counts", "other")
    # one commit thread: each cleanup runs before the log's retention, so it sees the three newest checkpoints
    config = task_config(
        tmp_path, *names, backends="fullcopy", **{"stores.counts.fullcopy.keep": 2, "task.commit.pool.size": 1}
    )
    settings = Settings.from_config(config)
    assert settings.backend_options_for("fullcopy", store="counts") == {"keep": 2}
    assert settings.backend_options_for("fullcopy", store="other") == {"keep": 0}
    blobs = MemoryBlobStore()
    model = commit_writes(config, blobs, names, 6)
    # closing trimmed the log to the retained two and ran the cleanups again: they kept the copies of those two
    # checkpoints, and for counts the two newest copies before them
    kept = {name: [blob.rsplit("/", 1)[1] for blob in blobs.list(f"job/task-0/{name}/fullcopy/")] for name in names}
    assert len(kept["other"]) == 2
    assert len(kept["counts"]) == 4
    assert kept["counts"][2:] == kept["other"]  # one flush version per commit names both stores' copies
    shutil.rmtree(tmp_path / "local")
    with TaskStorage.open(config, "task-0", blob_store=blobs) as task:
        assert contents(task, names) == model
