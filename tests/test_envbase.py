"""Environment-file bases (statebackend/envbase.py): written from exactly a read view's version, restored streamed and
verified before they replace anything, in both backends; old record-file bases still restore, and a mixed history
works; a damaged, cut or foreign base is refused before it is opened; a restore killed mid-way leaves nothing that
could be taken for data; reads stay bounded whatever the base's size."""

from __future__ import annotations

import os
import shutil
import signal
import struct
import tracemalloc
import uuid
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any, ClassVar

import attrs
import pytest
from statebackend.backends.blobsnapshot.backup import BlobSnapshotBackupManager
from statebackend.backends.blobsnapshot.blobs import read_marker
from statebackend.backends.blobsnapshot.format import run_name
from statebackend.backends.blobsnapshot.state import BASE_LEVEL
from statebackend.backends.blobsnapshot.upload import RunUpload
from statebackend.backends.changelog.marker import Recipe
from statebackend.backends.changelog.upload import ChangelogUpload

from statebackend import envbase
from statebackend.blobstores.memory import MemoryBlobStore
from statebackend.envbase import BlobSource, FileSource, is_env_base, load_env_base, restore_env_base, write_env_base
from statebackend.errors import CorruptDataError, IncompatibleFormatError, NotFoundError, UsageError
from statebackend.recordfile import FileHeader
from statebackend.recordfile.nonce import TRAILER_SIZE
from statebackend.store import LocalStore, LocalVersion
from statebackend.task import TaskStorage
from tests.backend_helpers import churn
from tests.crash_child import (
    BACKUP_FACTORIES_ENV,
    CRASH_AT_ENV,
    PRELOAD,
    STORE,
    TASK,
    expected_state,
    read_report,
    report_contents,
    run_child,
)
from tests.fork_server import ForkServer

REPO = Path(__file__).resolve().parent.parent
KEY = struct.Struct(">Q")
V1 = LocalVersion("1-1", "aaaa")


def lineage(version: LocalVersion = V1, *, store: str = "s", seq: int = 5) -> FileHeader:
    return FileHeader(
        kind="snapshot",
        job="j",
        task="t",
        store=store,
        checkpoint_id=version.checkpoint_id,
        token=version.token,
        seq=seq,
        base_seq=seq,
    )


def filled_store(path: Path, keys: int, version: LocalVersion = V1, *, value: bytes = b"v") -> LocalStore:
    store = LocalStore.open(path, name="s")
    store.replace_contents(((KEY.pack(i), value + KEY.pack(i)) for i in range(keys)), version)
    return store


def write_base(local: LocalStore, path: Path, **kwargs: Any) -> bytes:
    with local.read_view() as view, open(path, "wb") as out:
        write_env_base(view, out, lineage(**kwargs), scratch=path.parent)
    return path.read_bytes()


def check_binding(store: str = "s", seq: int = 5) -> Any:
    def check(header: envbase.EnvBaseHeader) -> None:
        if (header.lineage.store, header.lineage.seq) != (store, seq):
            raise CorruptDataError(f"base of {header.lineage.store}/{header.lineage.seq}, wanted {store}/{seq}")

    return check


# -- the format ---------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("compression", ["zstd", "none"])
def test_a_base_restores_exactly_the_version_it_was_written_from(
    tmp_path: Path, compression: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(envbase, "FRAME_RAW_BYTES", 64 << 10)  # many frames
    monkeypatch.setattr(envbase, "SEGMENT_BYTES", 100 << 10)  # frames straddle reads
    with filled_store(tmp_path / "a", 20_000) as source:
        with source.read_view() as view, open(tmp_path / "base", "wb") as out:
            stats = write_env_base(view, out, lineage(), scratch=tmp_path, compression=compression)
        source.put(b"later", b"not in the base")  # the base is the view's version, nothing after it
        source.flush(LocalVersion("2-2", "bbbb")).close()
        assert source.get(b"later") is not None
    assert stats.records == 20_000 and stats.file_bytes == (tmp_path / "base").stat().st_size
    blobs = MemoryBlobStore()
    blobs.put("b", (tmp_path / "base").read_bytes())
    with filled_store(tmp_path / "b", 10, LocalVersion("0-0", "cccc")) as target, ThreadPoolExecutor(2) as pool:
        header = load_env_base(
            target, BlobSource(blobs, "b", blobs.head("b").size), V1, check=check_binding(), pool=pool
        )
        assert header.records == 20_000 and header.compression == compression
        assert target.version == V1
        assert dict(target.items()) == {KEY.pack(i): b"v" + KEY.pack(i) for i in range(20_000)}
        assert not list(tmp_path.glob("b/.envbase-*"))


@pytest.mark.parametrize(
    ("version", "record_file_version", "trailer"), [(1, 3, 0), (2, 4, TRAILER_SIZE)], ids=["v1", "v2"]
)
def test_each_stored_sample_still_restores(
    tmp_path: Path, version: int, record_file_version: int, trailer: int
) -> None:
    """A base written by each format version (tests/data/envbase/make_samples.py, kept as written) restores exactly:
    a later change to the format must keep reading them. Version 2 ends in a nonce trailer; version 1 has none."""
    data = (REPO / "tests" / "data" / "envbase" / f"base-v{version}-zstd.sbenvbs").read_bytes()
    assert is_env_base(data[:8])
    blobs = MemoryBlobStore()
    blobs.put("b", data)
    with filled_store(tmp_path / "b", 3, LocalVersion("0-0", "cccc")) as target, ThreadPoolExecutor(2) as pool:
        header = load_env_base(target, BlobSource(blobs, "b", len(data)), V1, check=check_binding(), pool=pool)
        # the release that wrote it wrote record files of that version: its lineage says so
        assert (header.records, header.compression, header.lineage) == (
            200,
            "zstd",
            attrs.evolve(lineage(), format_version=record_file_version),
        )
        assert header.format_version == version and header.trailer_size == trailer
        assert target.version == V1
        assert dict(target.items()) == {KEY.pack(i): b"v" + KEY.pack(i) for i in range(200)}


def test_the_current_format_version_has_a_stored_sample() -> None:
    """A format change adds its sample (``python -m tests.data.envbase.make_samples``) before it ships."""
    assert (REPO / "tests" / "data" / "envbase" / f"base-v{envbase.FORMAT_VERSION}-zstd.sbenvbs").is_file()


def test_a_view_of_another_version_is_refused(tmp_path: Path) -> None:
    with (
        filled_store(tmp_path / "a", 10) as store,
        store.read_view() as view,
        open(tmp_path / "base", "wb") as out,
        pytest.raises(UsageError, match="only ever the copy of the version"),
    ):
        write_env_base(view, out, lineage(LocalVersion("1-1", "other")), scratch=tmp_path)


def _flip(data: bytes, at: int) -> bytes:
    return data[:at] + bytes([data[at] ^ 0x40]) + data[at + 1 :]


DAMAGES = {
    "header byte": lambda d: _flip(d, 20),
    "magic": lambda d: _flip(d, 0),
    "first frame length": lambda d: _flip(d, _header_end(d) + 2),
    "body byte": lambda d: _flip(d, len(d) // 2),
    "last body byte": lambda d: _flip(d, len(d) - envbase.FOOTER_SIZE - 1),
    "footer count": lambda d: _flip(d, len(d) - envbase.FOOTER_SIZE),
    "digest": lambda d: _flip(d, len(d) - 20),
    "end marker": lambda d: _flip(d, len(d) - 1),
    "cut in the body": lambda d: d[: len(d) // 2],
    "cut in the footer": lambda d: d[:-10],
    "cut in the header": lambda d: d[:30],
    "empty": lambda d: b"",
    "a frame dropped": lambda d: _drop_second_frame(d),
    "bytes appended": lambda d: d + b"\0" * 100,
}


def _header_end(data: bytes) -> int:
    """Where the header ends: its 16-byte prefix (the metadata length at byte 12), the metadata, its CRC-32."""
    return 16 + struct.unpack_from("<I", data, 12)[0] + 4


def _drop_second_frame(data: bytes) -> bytes:
    """The base without its second frame, with a footer whose body length is fixed to match (digest left)."""
    start = _header_end(data)
    stored, _ = struct.unpack_from("<II", data, start)
    second = start + 8 + stored
    stored2, _ = struct.unpack_from("<II", data, second)
    cut = data[:second] + data[second + 8 + stored2 :]
    footer = bytearray(cut[-envbase.FOOTER_SIZE :])
    body = len(cut) - envbase.FOOTER_SIZE - start
    footer[16:24] = struct.pack("<Q", body)
    return cut[: -envbase.FOOTER_SIZE] + bytes(footer)


@pytest.mark.parametrize("damage", list(DAMAGES))
def test_a_damaged_base_is_refused_before_anything_is_replaced(
    tmp_path: Path, damage: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(envbase, "FRAME_RAW_BYTES", 64 << 10)
    with filled_store(tmp_path / "a", 20_000) as source:
        data = write_base(source, tmp_path / "base")
    blobs = MemoryBlobStore()
    blobs.put("b", DAMAGES[damage](data))
    old = LocalVersion("0-0", "cccc")
    with filled_store(tmp_path / "b", 10, old) as target:
        with pytest.raises(CorruptDataError, match="b"):
            load_env_base(target, BlobSource(blobs, "b", blobs.head("b").size), V1, check=check_binding())
        assert target.version == old and target.count() == 10  # the store kept what it held
        assert not list((tmp_path / "b").glob(".envbase-*"))


@pytest.mark.parametrize(("store", "seq"), [("other", 5), ("s", 4)])
def test_a_base_of_another_store_or_seq_is_refused_before_a_byte_is_written(
    tmp_path: Path, store: str, seq: int
) -> None:
    with filled_store(tmp_path / "a", 1000) as source:
        write_base(source, tmp_path / "base", store=store, seq=seq)
    target = tmp_path / "target"
    with pytest.raises(CorruptDataError, match="wanted s/5"):
        restore_env_base(FileSource(tmp_path / "base", "base"), target, check=check_binding())
    assert not target.exists()


def test_a_base_written_on_another_kind_of_machine_is_refused_before_a_byte_is_written(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """An LMDB file holds native integers: a base from a machine of another byte order or word size is refused as
    incompatible (restore falls back), never opened."""
    with filled_store(tmp_path / "a", 100) as source:
        monkeypatch.setattr(envbase, "PLATFORM", "big-64")
        write_base(source, tmp_path / "base")
        monkeypatch.undo()
    target = tmp_path / "target"
    with pytest.raises(IncompatibleFormatError, match="big-64"):
        restore_env_base(FileSource(tmp_path / "base", "base"), target, check=check_binding())
    assert not target.exists()


def test_a_missing_base_is_not_found(tmp_path: Path) -> None:
    with filled_store(tmp_path / "b", 10) as target, pytest.raises(NotFoundError):
        load_env_base(target, BlobSource(MemoryBlobStore(), "gone", 1000), V1, check=check_binding())


def test_a_restore_reads_in_bounded_ranged_reads_and_holds_a_few_frames(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Memory is bounded by design: ranged reads of at most SEGMENT_BYTES (never the whole blob), at most READ_AHEAD
    reads and decoded frames in flight; measured here against a base many times that size."""
    monkeypatch.setattr(envbase, "FRAME_RAW_BYTES", 128 << 10)
    monkeypatch.setattr(envbase, "SEGMENT_BYTES", 128 << 10)
    with filled_store(tmp_path / "a", 150_000, value=os.urandom(16)) as source:
        with source.read_view() as view, open(tmp_path / "base", "wb") as out:
            write_env_base(view, out, lineage(), scratch=tmp_path, compression="none")  # as big as the file
        data = (tmp_path / "base").read_bytes()
    assert len(data) > 20 * envbase.SEGMENT_BYTES

    class CountingStore(MemoryBlobStore):
        reads: ClassVar[list[tuple[int | None, int | None]]] = []

        def get(self, name: str, *, start: int | None = None, end: int | None = None) -> bytes:
            self.reads.append((start, end))
            return super().get(name, start=start, end=end)

    blobs = CountingStore()
    blobs.put("b", data)
    with filled_store(tmp_path / "b", 1) as target, ThreadPoolExecutor(2) as pool:
        tracemalloc.start()
        try:
            load_env_base(target, BlobSource(blobs, "b", len(data)), V1, check=check_binding(), pool=pool)
            _, peak = tracemalloc.get_traced_memory()
        finally:
            tracemalloc.stop()
        assert target.count() == 150_000
    ranges = [(start, end) for start, end in blobs.reads if start is not None and end is not None]
    assert len(ranges) == len(blobs.reads), "a whole-blob read"
    assert max(end - start for start, end in ranges) <= max(envbase.SEGMENT_BYTES, envbase.HEAD_BYTES)
    raw = os.path.getsize(tmp_path / "b" / "data" / "data.mdb")
    assert peak < 3 * (envbase.READ_AHEAD + 2) * envbase.SEGMENT_BYTES < raw / 2, (peak, raw)


# -- both backends ------------------------------------------------------------------------------------------------


def backend_config(tmp_path: Path, backend: str) -> dict[str, object]:
    config: dict[str, object] = {
        "job.name": "job",
        "state.local.dir": str(tmp_path / "local"),
        "blob.store.url": f"memory://{uuid.uuid4().hex}",
        "stores.counts.backup.factories": backend,
        "task.checkpoint.retained": 2,
    }
    if backend == "changelog":
        config["changelog.snapshot.interval.commits"] = 3
    else:
        config.update(
            {
                "blobsnapshot.compaction.fanout": 2,
                "blobsnapshot.compaction.full.ratio": 0.5,
                "blobsnapshot.compaction.full.min.bytes": 0,
                "blobsnapshot.gc.on.init": "false",
            }
        )
    return config


def commit_rounds(task: TaskStorage, model: dict[bytes, bytes], start: int, count: int) -> None:
    """Rounds ``start`` to ``start + count``: each 300 writes (a fifth of them deletes) over 900 keys, committed
    durably at its round number, then settled (``settle``)."""
    for round_no in range(start, start + count):
        churn(task, model, round_no, writes=300, keys=900)
        task.commit_durably({"input": str(round_no)})
        settle(task)


def settle(task: TaskStorage) -> None:
    """Wait for background snapshots and compactions, so the next commit adopts them."""
    from statebackend.backends.changelog.backup import maintenance_pool

    maintenance_pool().submit(lambda: None).result(60)
    for binding in task.commit_manager.backups:
        if isinstance(binding.manager, BlobSnapshotBackupManager):
            for state in binding.manager.shared.stores.values():
                if state.compaction is not None:
                    state.compaction.exception(timeout=60)


def newest_base(blobs: Any, task: TaskStorage, backend: str) -> str | None:
    checkpoint = task.commit_manager.last_checkpoint
    assert checkpoint is not None
    marker = checkpoint.markers_for(backend)["counts"]
    if backend == "changelog":
        recipe = Recipe.decode(marker, prefix="job/task-0/counts/changelog/")
        return recipe.snapshot.name if recipe.snapshot is not None else None
    index = read_marker(blobs, marker, job="job", task="task-0", store="counts")
    first = index.runs[0] if index.runs else None
    return run_name("job/task-0/counts/blobsnapshot/", first.hash) if first is not None and first.base else None


def old_writers(monkeypatch: pytest.MonkeyPatch) -> None:
    """Bases written as the releases before environment files wrote them: sorted records."""

    def old_base_run(
        self: Any, state: Any, view: Any, *, last_seq: int, version: LocalVersion, check: Any = None
    ) -> Any:
        return self.write_run(
            state, view.items(), first_seq=1, last_seq=last_seq, version=version, level=BASE_LEVEL, base=True
        )

    def old_snapshot(self: Any, lineage: Any, step: Any, view: Any, name: str, check: Any = None) -> Path:
        return self.stage(lineage, step, "snapshot", view.items(), name)

    monkeypatch.setattr(RunUpload, "write_base", old_base_run)
    monkeypatch.setattr(ChangelogUpload, "stage_base", old_snapshot)


@pytest.mark.parametrize("backend", ["changelog", "blobsnapshot"])
def test_old_record_bases_restore_and_a_mixed_history_works(
    tmp_path: Path, backend: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    config = backend_config(tmp_path, backend)
    blobs = MemoryBlobStore()
    model: dict[bytes, bytes] = {}
    old_writers(monkeypatch)
    with TaskStorage.open(config, "task-0", blob_store=blobs) as task:
        commit_rounds(task, model, 0, 8)
        old_base = newest_base(blobs, task, backend)
    assert old_base is not None and not is_env_base(blobs.get(old_base, start=0, end=8)), "no old-format base"
    shutil.rmtree(tmp_path / "local")
    with TaskStorage.open(config, "task-0", blob_store=blobs) as task:
        assert dict(task.store("counts").items()) == model  # an old base restores
        monkeypatch.undo()  # this release's writer from here on: the history mixes both kinds
        commit_rounds(task, model, 8, 10)
        new_base = newest_base(blobs, task, backend)
    assert new_base is not None and new_base != old_base and is_env_base(blobs.get(new_base, start=0, end=8))
    for wipe in (True, False):
        if wipe:
            shutil.rmtree(tmp_path / "local")
        with TaskStorage.open(config, "task-0", blob_store=blobs) as task:
            assert dict(task.store("counts").items()) == model
            assert task.store("counts").count() == len(model)


@pytest.mark.parametrize("backend", ["changelog", "blobsnapshot"])
@pytest.mark.parametrize("damage", ["body byte", "cut in the body", "digest", "bytes appended"])
def test_a_damaged_env_base_fails_the_restore_naming_it(tmp_path: Path, backend: str, damage: str) -> None:
    config = backend_config(tmp_path, backend)
    blobs = MemoryBlobStore()
    model: dict[bytes, bytes] = {}
    with TaskStorage.open(config, "task-0", blob_store=blobs) as task:
        commit_rounds(task, model, 0, 8)
        base = newest_base(blobs, task, backend)
    assert base is not None and is_env_base(blobs.get(base, start=0, end=8))
    blobs.put(base, DAMAGES[damage](blobs.get(base)))
    shutil.rmtree(tmp_path / "local")
    with pytest.raises(CorruptDataError, match=base.rsplit("/", 1)[-1]):
        TaskStorage.open(config, "task-0", blob_store=blobs).close()
    leftovers = list((tmp_path / "local").rglob(".envbase-*"))
    assert not leftovers


# -- a restore killed mid-way -------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def fork_server() -> Iterator[ForkServer]:
    """The crash children's fork server (tests/fork_server.py): they skip the interpreter's start and the imports."""
    with ForkServer(PRELOAD) as server:
        yield server


def _child(server: ForkServer, workdir: Path, commits: int, backend: str, crash_at: str | None = None) -> Any:
    env = {CRASH_AT_ENV: crash_at, BACKUP_FACTORIES_ENV: backend}
    return run_child(workdir, workdir / "report.json", commits, env, timeout=120, server=server)


@pytest.mark.parametrize("backend", ["changelog", "blobsnapshot"])
@pytest.mark.parametrize("crash_at", ["envbase.restore.written:1", "envbase.restore.verified:1"])
def test_a_restore_killed_while_it_loads_a_base_leaves_nothing_taken_for_data(
    tmp_path: Path, backend: str, crash_at: str, fork_server: ForkServer
) -> None:
    commits = 12
    done = _child(fork_server, tmp_path, commits, backend)
    assert done.returncode == 0, done.stderr[-3000:]
    shutil.rmtree(tmp_path / "local")
    killed = _child(fork_server, tmp_path, 0, backend, crash_at=crash_at)
    assert killed.returncode == -signal.SIGKILL, f"no base was loaded: {killed.stderr[-3000:]}"
    store_dir = tmp_path / "local" / "job" / TASK / STORE
    left = list(store_dir.glob(".envbase-*"))
    assert left, "the kill left no partly restored base behind"  # (it did die mid-restore)
    resumed = _child(fork_server, tmp_path, 2, backend)
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    report = read_report(tmp_path / "report.json")
    assert report["restored"] == commits
    assert report_contents(report) == expected_state(commits)
    assert not list(store_dir.glob(".envbase-*")), "the next restore did not remove what the kill left"
