"""Everything a marker names is bound to its name and checked (both backends).

A checksum proves that a blob is intact, not that it is the blob the marker named. For every blob kind of both
backends (changelog: delta, snapshot; blob-snapshot: index, run) and every damage (a flipped byte, a cut, a
deletion, an older blob of the same kind over the name, another task's or another store's blob of the same kind over
the name), restoring the newest checkpoint must raise :class:`CorruptDataError` or :class:`NotFoundError` naming the
damaged blob, never load a different state.

One scenario per backend is committed once per module (two tasks, two stores, every blob ever written recorded), and
each case restores from a fresh copy of its blob store into an empty local dir (the full-restore path). A second
matrix keeps the local store one commit behind, so the changelog backend catches up by deltas and the blob-snapshot
backend catches up by the runs after its local version.
"""

from __future__ import annotations

import shutil
import uuid
from collections.abc import Callable, Mapping
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import attrs
import pytest
from statebackend.backends.blobsnapshot.format import RunIndex, parse_index_name, run_name
from statebackend.backends.changelog.backup import ChangelogBackupManager
from statebackend.backends.changelog.marker import Recipe

from statebackend.blobstores.base import BlobStore
from statebackend.blobstores.memory import MemoryBlobStore
from statebackend.errors import CorruptDataError, NotFoundError
from statebackend.task import TaskStorage
from statebackend.testing.backend_contract import write_round
from statebackend.testing.controlled import ControlledBlobStore
from tests.blobsnapshot_legacy import as_index_blob_markers

JOB = "job"
ROUNDS = 11

CONFIGS: dict[str, dict[str, object]] = {
    "changelog": {
        "stores.counts.backup.factories": "changelog",
        "stores.counts.restore.factory": "changelog",
        "stores.other.backup.factories": "changelog",
        "stores.other.restore.factory": "changelog",
        "changelog.snapshot.interval.commits": 3,
    },
    "blobsnapshot": {
        "stores.counts.backup.factories": "blobsnapshot",
        "stores.counts.restore.factory": "blobsnapshot",
        "stores.other.backup.factories": "blobsnapshot",
        "stores.other.restore.factory": "blobsnapshot",
        "blobsnapshot.gc.on.init": "false",
    },
}

#: (backend, blob kind, the folder of that kind under a store's prefix)
KINDS = [
    ("changelog", "delta", "delta/"),
    ("changelog", "snapshot", "snapshot/"),
    ("blobsnapshot", "index", "index/"),
    ("blobsnapshot", "run", "runs/"),
]


class RecordingBlobStore(ControlledBlobStore):
    """Keeps the first bytes written under every name, so a test can later put an older blob over a newer name."""

    def __init__(self, inner: BlobStore) -> None:
        super().__init__(inner)
        self.written: dict[str, bytes] = {}

    def put(
        self, name: str, data: bytes, *, create_only: bool = False, metadata: Mapping[str, str] | None = None
    ) -> None:
        super().put(name, data, create_only=create_only, metadata=metadata)
        self.written.setdefault(name, data)

    def put_file(self, name, path, *, create_only=False, metadata=None) -> None:  # type: ignore[no-untyped-def]
        data = Path(path).read_bytes()
        super().put_file(name, path, create_only=create_only, metadata=metadata)
        self.written.setdefault(name, data)


@attrs.frozen
class Scenario:
    backend: str
    #: every blob of the blob store after the last commit: name -> (bytes, metadata)
    final: Mapping[str, tuple[bytes, Mapping[str, str]]]
    #: every blob ever written, also the ones retention deleted since
    written: Mapping[str, bytes]
    #: the blob names the newest checkpoint of task-0 needs for store ``counts``, by kind
    needed: Mapping[str, list[str]]
    #: the local dir of task-0 one commit before the newest checkpoint
    older_local: Path
    #: task-0's ``counts`` content at the newest checkpoint
    model: Mapping[bytes, bytes]

    def prefix(self, task: str = "task-0", store: str = "counts") -> str:
        return f"{JOB}/{task}/{store}/{self.backend}/"

    def fresh_blob_store(self) -> MemoryBlobStore:
        blobs = MemoryBlobStore()
        for name, (data, metadata) in self.final.items():
            blobs.put(name, data, metadata=metadata or None)
        return blobs


def make_config(backend: str, local: Path, url: str) -> dict[str, object]:
    config: dict[str, object] = {
        "job.name": JOB,
        "state.local.dir": str(local),
        "blob.store.url": url,
        "task.checkpoint.retained": 2,
    }
    config.update(CONFIGS[backend])
    return config


def _wait_for_background_snapshots(task: TaskStorage) -> None:
    """Changelog only: wait until the background snapshots started by the last commit are uploaded, so the next
    commit adopts them (deterministic: the scenario always has snapshots and deltas after them)."""
    for binding in task.commit_manager.backups:
        manager = binding.manager
        if isinstance(manager, ChangelogBackupManager):
            for lineage in manager.shared.stores.values():  # the test waits on the backend's own future
                if lineage.background is not None:
                    lineage.background.exception(timeout=60)


def _run_task(
    task_name: str, backend: str, local: Path, blobs: BlobStore, url: str, shift: int, older_local: Path | None = None
) -> tuple[dict[bytes, bytes], Any]:
    """Commit ``ROUNDS`` rounds to both stores; the last one in a second open of the task, after copying the closed
    local dir to ``older_local`` (a local store one commit behind)."""
    model: dict[bytes, bytes] = {}
    checkpoint = None
    config = make_config(backend, local, url)
    for rounds in (range(ROUNDS - 1), range(ROUNDS - 1, ROUNDS)):
        if older_local is not None and rounds.start > 0:
            shutil.copytree(local, older_local)
        with (
            ThreadPoolExecutor(2) as pool,
            TaskStorage.open(config, task_name, blob_store=blobs, executor=pool) as task,
        ):
            for round_no in rounds:
                if round_no == 0:  # bulk that later rounds leave alone: the first run is big, later ones small
                    for i in range(4000):
                        key, value = f"b{i:05d}".encode(), f"bulk-{shift}-{i}-".encode() * 4
                        task.store("counts").put(key, value)
                        model[key] = value
                write_round(task, round_no + shift, model)
                store = task.store("other")
                for i in range(40):  # other data than ``counts``: its blobs differ from counts' blobs of one seq
                    store.put(f"o{(i + round_no) % 60:03d}".encode(), f"other-{shift}-{round_no}-{i}".encode())
                checkpoint = task.commit_durably({"input": str(round_no)})
                _wait_for_background_snapshots(task)
    return model, checkpoint


def _needed(backend: str, blobs: BlobStore, checkpoint: Any) -> dict[str, list[str]]:
    marker = checkpoint.markers_for(backend)["counts"]
    if backend == "changelog":
        recipe = Recipe.decode(marker, prefix=f"{JOB}/task-0/counts/changelog/")
        assert recipe.snapshot is not None and recipe.snapshot.name is not None, "the scenario needs a snapshot"
        deltas = [d.name for d in recipe.deltas if d.name is not None]
        assert deltas, "the scenario needs deltas after the snapshot"
        return {"snapshot": [recipe.snapshot.name], "delta": deltas}
    index = RunIndex.decode(blobs.get(marker), name=marker)
    prefix = f"{JOB}/task-0/counts/blobsnapshot/"
    assert len(index.runs) > 1, "the scenario needs several runs"
    # oldest first: the last one is the newest commit's run, the only one a store one commit behind downloads
    return {"index": [marker], "run": [run_name(prefix, run.hash) for run in index.runs]}


@pytest.fixture(scope="module")
def scenarios(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Scenario]:
    built: dict[str, Scenario] = {}
    for backend in CONFIGS:
        root = tmp_path_factory.mktemp(f"binding-{backend}")
        url = f"memory://{uuid.uuid4().hex}"
        blobs = RecordingBlobStore(MemoryBlobStore())
        model, checkpoint = _run_task(
            "task-0", backend, root / "local", blobs, url, shift=0, older_local=root / "older-local"
        )
        _run_task("task-1", backend, root / "local-1", blobs, url, shift=100)
        if backend == "blobsnapshot":
            # the index blob's matrix runs on checkpoints as releases before inline markers wrote them (a damaged
            # inline marker: tests/test_blobsnapshot_marker.py)
            as_index_blob_markers(blobs, JOB, "task-1")
            rewritten = as_index_blob_markers(blobs, JOB, "task-0")
            markers = {**checkpoint.state_checkpoint_markers, backend: rewritten[max(rewritten)]}
            checkpoint = attrs.evolve(checkpoint, state_checkpoint_markers=markers)
        final = {name: (blobs.get(name), dict(blobs.head(name).metadata)) for name in blobs.list("")}
        built[backend] = Scenario(
            backend=backend,
            final=final,
            written=dict(blobs.written),
            needed=_needed(backend, blobs, checkpoint),
            older_local=root / "older-local",
            model=model,
        )
    return built


# -- the damages ----------------------------------------------------------------------------------------------------


def _seq(name: str) -> int | None:
    stem = name.rsplit("/", 1)[-1]
    digits, sep, _ = stem.partition("-")
    return int(digits) if sep and digits.isdigit() else None


def _substitute(scenario: Scenario, victim: str, folder: str, *, task: str, store: str, older: bool) -> bytes:
    """Bytes of another blob of the same kind: from ``task``/``store`` (the same seq when there is one), or, with
    ``older``, the newest blob of the victim's own store written before it. Never the victim's own bytes."""
    own = scenario.written.get(victim) or scenario.final[victim][0]
    prefix = scenario.prefix(task, store) + folder
    candidates = [
        (name, data)
        for name, data in scenario.written.items()
        if name.startswith(prefix) and name != victim and data != own
    ]
    victim_seq = _seq(victim)
    if older:
        names = list(scenario.written)
        position = names.index(victim) if victim in names else len(names)
        candidates = [
            (n, d)
            for n, d in candidates
            if names.index(n) < position and (victim_seq is None or (_seq(n) or 0) < victim_seq)
        ]
        assert candidates, f"no older blob of the kind of {victim} was written"
        return candidates[-1][1]
    same_seq = [(n, d) for n, d in candidates if victim_seq is not None and _seq(n) == victim_seq]
    chosen = same_seq or candidates
    assert chosen, f"no blob under {prefix} to put over {victim}"
    return chosen[-1][1]


def flip_a_byte(scenario: Scenario, blobs: BlobStore, victim: str, folder: str) -> None:
    data = bytearray(blobs.get(victim))
    data[len(data) // 2] ^= 0x01
    blobs.put(victim, bytes(data))


def cut_short(scenario: Scenario, blobs: BlobStore, victim: str, folder: str) -> None:
    data = blobs.get(victim)
    blobs.put(victim, data[: len(data) * 2 // 3])


def delete(scenario: Scenario, blobs: BlobStore, victim: str, folder: str) -> None:
    blobs.delete(victim)


def older_blob_of_the_same_store(scenario: Scenario, blobs: BlobStore, victim: str, folder: str) -> None:
    blobs.put(victim, _substitute(scenario, victim, folder, task="task-0", store="counts", older=True))


def another_tasks_blob(scenario: Scenario, blobs: BlobStore, victim: str, folder: str) -> None:
    blobs.put(victim, _substitute(scenario, victim, folder, task="task-1", store="counts", older=False))


def another_stores_blob(scenario: Scenario, blobs: BlobStore, victim: str, folder: str) -> None:
    blobs.put(victim, _substitute(scenario, victim, folder, task="task-0", store="other", older=False))


Damage = Callable[[Scenario, BlobStore, str, str], None]
DAMAGES: list[Damage] = [
    flip_a_byte,
    cut_short,
    delete,
    older_blob_of_the_same_store,
    another_tasks_blob,
    another_stores_blob,
]


def _restore_fails_naming(scenario: Scenario, blobs: BlobStore, local: Path, victim: str) -> None:
    config = make_config(scenario.backend, local, f"memory://{uuid.uuid4().hex}")
    with pytest.raises((CorruptDataError, NotFoundError)) as excinfo:
        task = TaskStorage.open(config, "task-0", blob_store=blobs)
        try:  # only reached when the damage went unnoticed: show which state it loaded instead
            state = dict(task.store("counts").items())
            same = state == dict(scenario.model)
        finally:
            task.close()
        pytest.fail(f"restore with {victim} damaged succeeded; it loaded {'the' if same else 'a different'} state")
    assert victim in str(excinfo.value), f"the error does not name {victim}: {excinfo.value}"


CATCH_UP_KINDS = [
    ("changelog", "delta", "delta/"),
    ("blobsnapshot", "index", "index/"),
    ("blobsnapshot", "run", "runs/"),
]
#: (where the restore starts, backend, kind, folder): from an empty local dir, every kind; from a local store one
#: commit behind, the kinds such a catch-up downloads
RESTORES = [("full", *kind) for kind in KINDS] + [("one-behind", *kind) for kind in CATCH_UP_KINDS]


@pytest.mark.parametrize("damage", DAMAGES, ids=lambda d: d.__name__)
@pytest.mark.parametrize(
    ("start", "backend", "kind", "folder"), RESTORES, ids=[f"{s}-{b}-{k}" for s, b, k, _ in RESTORES]
)
def test_damaged_blob_is_refused_naming_it(
    scenarios: dict[str, Scenario],
    tmp_path: Path,
    start: str,
    backend: str,
    kind: str,
    folder: str,
    damage: Damage,
) -> None:
    """A full restore, and a local store one commit behind catching up, refuse the newest blob of each kind the
    checkpoint needs once it is damaged, naming it (behind: the newest delta or run is the only one downloaded)."""
    scenario = scenarios[backend]
    victim = scenario.needed[kind][-1]  # the newest blob of this kind that the checkpoint needs
    if start == "one-behind" and kind == "run":
        assert victim not in _runs_of_the_older_index(scenario), "the last commit added no run"
    blobs = scenario.fresh_blob_store()
    damage(scenario, blobs, victim, folder)
    local = tmp_path / "local"
    if start == "one-behind":
        shutil.copytree(scenario.older_local, local)
    _restore_fails_naming(scenario, blobs, local, victim)


def _runs_of_the_older_index(scenario: Scenario) -> set[str]:
    """The runs the index one commit before the newest lists (what the local copy one commit behind holds)."""
    marker = scenario.needed["index"][0]
    index = RunIndex.decode(scenario.final[marker][0], name=marker)
    assert index.previous_index is not None  # the previous index was inline: its <seq>-<token>, its blob's name now
    older_name = f"{scenario.prefix()}index/{index.previous_index}.json"
    older = RunIndex.decode(scenario.final[older_name][0], name=older_name)
    return {run_name(scenario.prefix(), run.hash) for run in older.runs}


def test_scenarios_hold_what_the_matrix_needs(scenarios: dict[str, Scenario]) -> None:
    """Guards the matrix against a vacuous pass: undamaged, every scenario restores exactly, and every substitute
    exists and differs from the blob it replaces."""
    for backend, scenario in scenarios.items():
        for _, kind, folder in (k for k in KINDS if k[0] == backend):
            victim = scenario.needed[kind][-1]
            for task, store, older in (
                ("task-0", "counts", True),
                ("task-1", "counts", False),
                ("task-0", "other", False),
            ):
                assert (
                    _substitute(scenario, victim, folder, task=task, store=store, older=older)
                    != scenario.final[victim][0]
                )
        if backend == "blobsnapshot":
            parsed = parse_index_name(scenario.needed["index"][0])
            assert parsed is not None and parsed[0] == ROUNDS


@pytest.mark.parametrize("backend", list(CONFIGS))
def test_undamaged_blobs_restore_exactly(scenarios: dict[str, Scenario], tmp_path: Path, backend: str) -> None:
    scenario = scenarios[backend]
    config = make_config(backend, tmp_path / "local", f"memory://{uuid.uuid4().hex}")
    with TaskStorage.open(config, "task-0", blob_store=scenario.fresh_blob_store()) as task:
        assert dict(task.store("counts").items()) == dict(scenario.model)
        assert task.restored is not None and task.restored.input_offsets == {"input": str(ROUNDS - 1)}
    shutil.copytree(scenario.older_local, tmp_path / "older")
    config = make_config(backend, tmp_path / "older", f"memory://{uuid.uuid4().hex}")
    with TaskStorage.open(config, "task-0", blob_store=scenario.fresh_blob_store()) as task:
        assert dict(task.store("counts").items()) == dict(scenario.model)
        # the second matrix exercises the partial paths: catch-up by deltas, catch-up by runs
        assert task.metrics.counter("restore.stores.caught.up") == 2
        assert task.metrics.counter("restore.stores.full") == 0
        if backend == "blobsnapshot":
            assert task.metrics.counter("restore.runs.applied") == 2  # the newest run of each of the two stores
