"""Blob stores plug in by URL scheme through the entry-point group ``statebackend.blobstores``.

The example third-party store (examples/thirdparty_blobstore, scheme ``mem2``, installed by ``./dev test``) is found
through the entry point of its installed distribution, passes the shipped contract suite as ``open_blob_store``
opens it, gets its ``blob.store.*`` options parsed by config, and holds a task's state through a commit and a
restore. statebackend's own four schemes are entry points of its own distribution. The registry's refusals (an
unknown scheme, two distributions declaring one scheme, a package that is missing, a target that is no blob store)
name what to fix.
"""

from __future__ import annotations

import importlib.metadata
import random
import shutil
import sys
import textwrap
import uuid
from collections.abc import Iterator
from pathlib import Path

import pytest

from statebackend import plugins
from statebackend.blobstores import registry  # the registry: its table and entry points are patched
from statebackend.blobstores.base import (
    ENTRY_POINT_GROUP,
    BlobStore,
    blob_store_class,
    known_blob_store_schemes,
    open_blob_store,
    register_blob_store,
)
from statebackend.blobstores.memory import MemoryBlobStore
from statebackend.config import ParsedOptions, Settings
from statebackend.errors import CommitError, ConfigError, StorageError
from statebackend.task import TaskStorage
from statebackend.testing.blobstore_contract import BlobStoreContract

ROOT = Path(__file__).resolve().parent.parent
TARGET = "sb_mem2.store:Mem2BlobStore"
OWN = {
    "file": "statebackend.blobstores.file:FileBlobStore",
    "memory": "statebackend.blobstores.memory:MemoryBlobStore",
    "az": "statebackend.blobstores.azure:AzureBlobStore",
    "s3": "statebackend.blobstores.s3:S3BlobStore",
}


@pytest.fixture(scope="module", autouse=True)
def example_installed() -> None:
    try:
        importlib.metadata.distribution("statebackend-mem2")
    except importlib.metadata.PackageNotFoundError:
        pytest.fail(
            "the example blob store is not installed: pip install -e examples/thirdparty_blobstore (./dev test does it)"
        )


@pytest.fixture(autouse=True)
def isolated_registrations(monkeypatch: pytest.MonkeyPatch) -> None:
    """Registrations a test makes at run time are dropped after it."""
    monkeypatch.setattr(registry, "_SCHEMES", dict(registry._SCHEMES))


def url() -> str:
    return f"mem2://{uuid.uuid4().hex}"


# -- found through the installed package's entry point ------------------------------------------------------------


def test_the_scheme_is_declared_by_the_installed_package_and_nothing_in_statebackend_names_it() -> None:
    (entry_point,) = [ep for ep in importlib.metadata.entry_points(group=ENTRY_POINT_GROUP) if ep.name == "mem2"]
    assert entry_point.value == TARGET
    assert entry_point.dist is not None and entry_point.dist.name == "statebackend-mem2"
    assert "mem2" not in registry._SCHEMES  # not registered at run time: only the entry point knows it
    assert known_blob_store_schemes()["mem2"] == TARGET
    for folder in ("statebackend", "backends", "checkpoint"):
        for path in (ROOT / folder).rglob("*.py"):
            assert "mem2" not in path.read_text(), path
    assert "mem2" not in (ROOT / "pyproject.toml").read_text()


def test_statebackends_own_schemes_are_entry_points_of_its_own_distribution() -> None:
    own = {
        ep.name: ep.value
        for ep in importlib.metadata.entry_points(group=ENTRY_POINT_GROUP)
        if ep.dist is not None and ep.dist.name == "statebackend"
    }
    assert own == OWN
    assert {scheme: known_blob_store_schemes()[scheme] for scheme in OWN} == OWN
    assert registry._SCHEMES == {}  # nothing is registered by hand


def test_the_registry_is_a_read_only_view() -> None:
    known = known_blob_store_schemes()
    with pytest.raises(TypeError):
        known["x"] = TARGET  # type: ignore[index]
    assert "x" not in known_blob_store_schemes()


class TestMem2AsOpenedByUrl(BlobStoreContract):
    """The shipped contract suite, unchanged, on the store ``open_blob_store`` opens for a ``mem2://`` URL."""

    @pytest.fixture
    def store(self) -> Iterator[BlobStore]:
        with open_blob_store(url()) as store:
            assert type(store).__module__ == "sb_mem2.store"
            yield store

    def raw_get(self, store: BlobStore, name: str) -> bytes | None:
        entry = store._bucket.blobs.get(name)  # type: ignore[attr-defined]
        return None if entry is None else entry[0]


def test_two_opens_of_one_url_share_the_bucket() -> None:
    where = url()
    with open_blob_store(where) as first, open_blob_store(where) as second:
        first.put("a/b", b"x")
        assert second.get("a/b") == b"x"
        assert first.describe() == f"Mem2BlobStore({where})"


# -- its options ----------------------------------------------------------------------------------------------


def test_config_parses_the_stores_own_option_by_its_schema_and_the_store_gets_it() -> None:
    settings = Settings.from_config({"blob.store.url": url(), "blob.store.max.bytes": "64KiB"})
    assert isinstance(settings.blob_store_options, ParsedOptions)
    assert settings.blob_store_options == {"max.bytes": 64 << 10}
    assert settings.blob_store_options.schema_name == "sb_mem2.store:Mem2BlobStore.options"
    with open_blob_store(settings.blob_store_url, settings.blob_store_options) as store:
        assert store.max_bytes == 64 << 10  # type: ignore[attr-defined]
    default = Settings.from_config({"blob.store.url": url()})
    assert default.blob_store_options == {"max.bytes": 1 << 30}


def test_a_bad_value_of_the_stores_option_names_the_key_and_what_is_allowed() -> None:
    with pytest.raises(ConfigError) as info:
        Settings.from_config({"blob.store.url": url(), "blob.store.max.bytes": "lots"})
    assert str(info.value).startswith("blob.store.max.bytes='lots' is not valid")


def test_an_option_of_another_scheme_is_refused_naming_the_scheme_that_takes_it() -> None:
    with pytest.raises(ConfigError) as info:
        Settings.from_config({"blob.store.url": url(), "blob.store.region": "eu-west-1"})
    message = str(info.value)
    assert message.startswith("blob.store.region: not an option of mem2:// blob stores")
    assert "taken by s3:// only" in message


def test_a_misspelled_option_of_the_store_gets_did_you_mean() -> None:
    with pytest.raises(ConfigError, match=r"blob.store.max.byte: unknown key; did you mean blob.store.max.bytes\?"):
        Settings.from_config({"blob.store.url": url(), "blob.store.max.byte": "1MiB"})


def test_the_option_bounds_what_the_store_holds() -> None:
    with open_blob_store(url(), {"max.bytes": 10}) as store:
        store.put("a", b"12345678")
        store.put("a", b"1234567890")  # replacing counts the new size only
        with pytest.raises(StorageError, match=r"over blob.store.max.bytes=10"):
            store.put("b", b"1")
        store.delete("a")
        store.put("b", b"1")


# -- a task's state in it ---------------------------------------------------------------------------------------


def task_config(tmp_path: Path, **extra: object) -> dict[str, object]:
    return {
        "job.name": "job",
        "state.local.dir": str(tmp_path / "local"),
        "blob.store.url": url(),
        "stores.counts.backup.factories": "changelog,blobsnapshot",
        "task.checkpoint.retained": 2,
        **extra,
    }


def test_a_task_commits_to_it_and_restores_from_it(tmp_path: Path) -> None:
    config = task_config(tmp_path)
    model: dict[bytes, bytes] = {}
    with TaskStorage.open(config, "task-0") as task:
        assert type(task.blob_store).__module__ == "sb_mem2.store"
        for round_no in range(4):
            for i in range(30):
                key, value = f"k{(i + round_no * 11) % 50:03d}".encode(), f"{round_no}-{i}".encode()
                task.store("counts", typed=False).put(key, value)
                model[key] = value
            checkpoint = task.commit_durably({"input": str(round_no)})
        assert set(checkpoint.markers_for("changelog")) == {"counts"}
    with open_blob_store(str(config["blob.store.url"])) as store:
        assert list(store.list("job/task-0/checkpoints/"))  # the checkpoints went into the mem2:// bucket
    shutil.rmtree(tmp_path / "local")
    with TaskStorage.open(config, "task-0") as task:
        assert dict(task.store("counts", typed=False).items()) == model
        assert task.restored is not None and task.restored.input_offsets == {"input": "3"}
        assert task.metrics.counter("restore.bytes") > 0  # downloaded, not reused


def test_a_commit_beyond_the_stores_bound_fails_naming_the_option(tmp_path: Path) -> None:
    config = task_config(tmp_path, **{"blob.store.max.bytes": 2048})
    noise = random.Random(0)
    with TaskStorage.open(config, "task-0") as task:
        for i in range(200):  # 12,800 bytes that do not compress
            task.store("counts", typed=False).put(f"k{i:04d}".encode(), noise.randbytes(64))
        with pytest.raises(CommitError, match="blob.store.max.bytes=2048"):
            task.commit_durably({"input": "0"})


# -- the registry's refusals and run-time registrations ------------------------------------------------------------


class NotAStore:
    """Not a BlobStore."""


class StoreWithoutFromUrl(MemoryBlobStore):
    from_url = None  # type: ignore[assignment]


def test_an_unknown_scheme_is_an_error_listing_the_known_ones() -> None:
    with pytest.raises(ConfigError) as info:
        open_blob_store("nope://bucket")
    message = str(info.value)
    assert message == (
        "blob.store.url 'nope://bucket' has an unknown scheme 'nope'; known: az://, file://, mem2://, memory://, s3://, sqlite://"
    )
    with pytest.raises(
        ConfigError,
        match="blob.store.url='nope://bucket' is not valid: unknown scheme 'nope'; "
        "allowed: a URL starting with az://, file://, mem2://, memory://, s3://, sqlite://",
    ):
        Settings.from_config({"blob.store.url": "nope://bucket"})


def test_without_its_own_metadata_the_error_says_to_reinstall_statebackend(monkeypatch: pytest.MonkeyPatch) -> None:
    found = plugins.entry_points(ENTRY_POINT_GROUP)
    monkeypatch.setattr(registry, "entry_points", lambda group: {"mem2": found["mem2"]})
    with pytest.raises(ConfigError) as info:
        open_blob_store("file:///tmp/x")
    message = str(info.value)
    assert "unknown scheme 'file'; known: mem2://. statebackend's own schemes" in message
    assert "reinstall it (pip install --force-reinstall statebackend, or pip install -e . in a checkout)" in message


def test_a_scheme_registered_at_run_time_needs_replace_to_shadow_a_known_one() -> None:
    with pytest.raises(ConfigError, match="blob store scheme 'mem2' is already registered to sb_mem2.store"):
        register_blob_store("mem2", "statebackend.blobstores.memory:MemoryBlobStore")
    register_blob_store("mem2", "statebackend.blobstores.memory:MemoryBlobStore", replace=True)
    with open_blob_store("mem2://shadowed") as store:
        assert type(store) is MemoryBlobStore
    register_blob_store("mine", "statebackend.blobstores.memory:MemoryBlobStore")
    assert known_blob_store_schemes()["mine"] == "statebackend.blobstores.memory:MemoryBlobStore"


@pytest.mark.parametrize(
    ("scheme", "target", "problem"),
    [
        ("Bad_Scheme", "statebackend.blobstores.memory:MemoryBlobStore", "is not a valid URL scheme"),
        ("fine", "statebackend.blobstores.memory.MemoryBlobStore", "is not a dotted path 'package.module:Class'"),
    ],
)
def test_a_bad_registration_is_refused(scheme: str, target: str, problem: str) -> None:
    with pytest.raises(ConfigError, match=problem):
        register_blob_store(scheme, target)
    assert scheme not in known_blob_store_schemes()


def test_a_target_that_is_no_blob_store_is_refused_when_opened() -> None:
    register_blob_store("notastore", f"{__name__}:NotAStore")
    with pytest.raises(
        ConfigError,
        match=r"is <class '.*NotAStore'>, not a subclass of "
        r"statebackend.blobstores.base.BlobStore \(registered by register_blob_store",
    ):
        open_blob_store("notastore://x")
    register_blob_store("nofromurl", f"{__name__}:StoreWithoutFromUrl")
    with pytest.raises(ConfigError, match=r"has no from_url\(url, options\) classmethod"):
        blob_store_class("nofromurl")


def test_a_missing_package_gives_the_registered_install_hint() -> None:
    register_blob_store("gone", "sb_no_such_package.store:Store", "pip install sb-no-such-package")
    with pytest.raises(ConfigError) as info:
        open_blob_store("gone://x")
    message = str(info.value)
    assert message.startswith("blob store gone:// needs a package that is not installed (")
    assert "; install it with: pip install sb-no-such-package (registered by register_blob_store)" in message


def test_the_built_in_stores_keep_their_install_hint(monkeypatch: pytest.MonkeyPatch) -> None:
    # as if azure-storage-blob were not installed: the store module's ImportError says what to install
    monkeypatch.delitem(sys.modules, "statebackend.blobstores.azure", raising=False)
    monkeypatch.setitem(sys.modules, "azure.storage.blob", None)
    with pytest.raises(ConfigError) as info:
        open_blob_store("az://container/prefix")
    message = str(info.value)
    assert "blob store az:// needs a package that is not installed" in message
    assert "pip install 'statebackend[azure]'" in message
    assert "entry point 'az' of distribution 'statebackend'" in message
    schemas = registry.blob_store_option_schemas()  # a scheme whose package is missing is left out; the others stay
    assert "az" not in schemas and {"file", "memory", "s3", "mem2"} <= set(schemas)


@pytest.fixture
def other_distributions(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Iterator[None]:
    """Two more installed distributions (dist-infos on sys.path): one declares mem2 too, with another class, and a
    scheme whose package needs an extra; the other declares a scheme whose module is broken."""
    module = "sb_test_store_module"
    (tmp_path / f"{module}.py").write_text(
        textwrap.dedent(
            """
        from statebackend.blobstores.memory import MemoryBlobStore

        class OtherStore(MemoryBlobStore):
            pass
        """
        )
    )
    (tmp_path / "sb_test_broken_store.py").write_text("raise RuntimeError('this module is broken')\n")
    for dist, entry_points in {
        "sb_test_stores": f"mem2 = {module}:OtherStore\nfast = sb_test_absent_sdk_store:Store [fast]\n",
        "sb_test_broken": "broken = sb_test_broken_store:Store\n",
    }.items():
        dist_info = tmp_path / f"{dist}-1.0.dist-info"
        dist_info.mkdir()
        (dist_info / "METADATA").write_text(f"Metadata-Version: 2.1\nName: {dist.replace('_', '-')}\nVersion: 1.0\n")
        (dist_info / "entry_points.txt").write_text(f"[{ENTRY_POINT_GROUP}]\n{entry_points}")
    monkeypatch.syspath_prepend(str(tmp_path))
    yield
    sys.modules.pop(module, None)
    sys.modules.pop("sb_test_broken_store", None)


@pytest.mark.usefixtures("other_distributions")
def test_a_scheme_two_distributions_declare_differently_is_refused_naming_both() -> None:
    with pytest.raises(ConfigError) as info:
        open_blob_store("mem2://x")
    message = str(info.value)
    assert message.startswith("blob store scheme 'mem2' is declared by more than one installed distribution (")
    assert "statebackend-mem2 -> sb_mem2.store:Mem2BlobStore" in message
    assert "sb-test-stores -> sb_test_store_module:OtherStore" in message
    assert "register_blob_store('mem2', target, replace=True)" in message
    register_blob_store("mem2", TARGET, replace=True)  # the way out the message names
    with open_blob_store("mem2://x") as store:
        assert type(store).__module__ == "sb_mem2.store"


@pytest.mark.usefixtures("other_distributions")
def test_an_entry_point_whose_package_needs_an_extra_says_which_to_install() -> None:
    with pytest.raises(ConfigError) as info:
        open_blob_store("fast://x")
    message = str(info.value)
    assert "install it with: pip install 'sb-test-stores[fast]'" in message
    assert "entry point 'fast' of distribution 'sb-test-stores'" in message


@pytest.mark.usefixtures("other_distributions")
def test_a_module_that_fails_to_import_is_a_config_error_naming_the_scheme() -> None:
    with pytest.raises(
        ConfigError,
        match=r"blob store broken:// could not be loaded from 'sb_test_broken_store:Store':"
        r" RuntimeError: this module is broken",
    ):
        open_blob_store("broken://x")
    # the scheme whose package is broken is left out of the option schemas; the others are there
    assert "mem2" not in registry.blob_store_option_schemas()  # declared twice: refused
    assert {"file", "memory"} <= set(registry.blob_store_option_schemas())
