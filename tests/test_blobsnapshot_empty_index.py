"""An index without runs (a store that was empty at its commit) restores as the empty store, whatever was local."""

from __future__ import annotations

from pathlib import Path

from statebackend import TaskStorage


def test_index_without_runs_clears_unrelated_local_data(tmp_path: Path) -> None:
    config = {
        "job.name": "j",
        "state.local.dir": str(tmp_path / "local"),
        "blob.store.url": f"file://{tmp_path / 'blobs'}",
        "stores.s.backup.factories": "blobsnapshot",
    }
    with TaskStorage.open(config, "t0") as task:
        task.commit_durably({"p": "1"})  # the store is empty: its index lists no run
    other = dict(config, **{"state.local.dir": str(tmp_path / "other-local")})
    # the same task name in another local dir, holding data of another blob store (another lineage)
    with TaskStorage.open(dict(other, **{"blob.store.url": f"file://{tmp_path / 'other-blobs'}"}), "t0") as task:
        task.store("s").put(b"stale", b"1")
        task.commit_durably({"p": "1"})
    with TaskStorage.open(other, "t0") as task:
        assert dict(task.store("s").items()) == {}
        assert task.metrics.snapshot()["restore.stores.full"] == 1
