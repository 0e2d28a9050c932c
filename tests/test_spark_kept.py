"""Tasks kept open between batches in a reused Python worker (statebackend.microbatch.kept), run in this process without
a SparkSession: a kept task is taken back only while the checkpoint log confirms it is current; when another attempt
committed meanwhile, on a replay, or with its local directory wiped, it is closed and the batch restores; a parked task
is handed over to another process that needs it; exactly-once and fencing hold throughout."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from statebackend.errors import CommitConflictError
from statebackend.microbatch import kept
from statebackend.spark.stats import is_output, is_stats
from tests.test_spark import make_config
from tests.test_spark_tasks import rows, runner, task_state

pytestmark = [pytest.mark.spark_matrix]

REPO = Path(__file__).resolve().parent.parent


@pytest.fixture(autouse=True)
def _release_parked() -> Iterator[None]:
    yield
    kept.release_all()


def run_kept(config: dict[str, object], batch_id: int, *words: str, keep_open: bool = True) -> tuple[list[Any], Any]:
    items = list(runner(config, batch_id, keep_open=keep_open).run_rows(0, iter(rows(*words))))
    stats = [item.stats for item in items if is_stats(item)]
    assert len(stats) == 1
    return [item for item in items if is_output(item)], stats[0]


def state_now(config: dict[str, object]) -> tuple[dict[str, int], int]:
    kept.release_all()  # the test opens the task itself, in this process
    return task_state(config)


def test_a_kept_task_is_taken_back_by_the_next_batch_and_the_state_is_exact(tmp_path: Path) -> None:
    config = make_config(tmp_path)
    _, first = run_kept(config, 0, "a", "b")
    assert not first.kept_open
    for batch in range(1, 4):
        output, stats = run_kept(config, batch, "a")
        assert stats.kept_open and stats.committed_seq == batch + 1 and stats.base_seq == batch
        assert output == [("a", batch + 1)]
    assert state_now(config) == ({"a": 4, "b": 1}, 4)


def test_a_kept_task_whose_log_moved_on_restores_and_never_commits_on_top(tmp_path: Path) -> None:
    config = make_config(tmp_path)
    run_kept(config, 0, "a")
    run_kept(config, 1, "a")  # parked at checkpoint #2
    # Another attempt (here: in this process, without keeping open; the parked task holds the lock, so it works in a
    # private copy restored from the blob store) commits batch 2 as #3.
    output, other = run_kept(config, 2, "a", "b", keep_open=False)
    assert other.private_dir and other.committed_seq == 3 and output == [("a", 3), ("b", 1)]
    # The next batch finds the parked task stale (the log's head is #3, not its #2): it closes it and restores #3.
    output, stats = run_kept(config, 3, "b")
    assert not stats.kept_open and stats.base_seq == 3 and stats.committed_seq == 4
    assert output == [("b", 2)]
    assert state_now(config) == ({"a": 3, "b": 2}, 4)


def test_a_stale_kept_task_that_commits_anyway_is_fenced(tmp_path: Path) -> None:
    """The check before a take-back is not what keeps exactly-once: a kept task whose log moved on is fenced by the
    commit protocol itself (its next seq is taken)."""
    config = make_config(tmp_path)
    run_kept(config, 0, "a")
    parked = kept.take(next(iter(kept._parked)))
    assert parked is not None
    try:
        run_kept(config, 1, "a", keep_open=False)  # another attempt: private copy, commits #2
        parked.storage.store("counts").put("a", 100)
        with pytest.raises(CommitConflictError):
            parked.storage.commit_durably({"batch": "1", "tasks": "2"})
    finally:
        parked.close()
    assert state_now(config) == ({"a": 2}, 2)


def test_a_replayed_batch_does_not_take_back_the_kept_task(tmp_path: Path) -> None:
    config = make_config(tmp_path)
    run_kept(config, 0, "a")
    run_kept(config, 1, "a", "b")
    output, stats = run_kept(config, 1, "a", "b")  # Spark replays batch 1
    assert not stats.kept_open and stats.base_seq == 1 and stats.committed_seq == 3
    assert output == [("a", 2), ("b", 1)]
    _, stats = run_kept(config, 2, "b")
    assert stats.kept_open
    assert state_now(config) == ({"a": 2, "b": 2}, 4)


def test_a_kept_task_whose_local_dir_was_wiped_restores_from_the_blob_store(tmp_path: Path) -> None:
    import shutil

    config = make_config(tmp_path)
    run_kept(config, 0, "a", "b")
    shutil.rmtree(tmp_path / "local")
    output, stats = run_kept(config, 1, "a")
    assert not stats.kept_open and stats.base_seq == 1 and output == [("a", 2)]
    assert state_now(config) == ({"a": 2, "b": 1}, 2)


def test_a_failing_batch_closes_the_kept_task_and_its_retry_redoes_it(tmp_path: Path) -> None:
    config = make_config(tmp_path)
    run_kept(config, 0, "a")

    def fail(stores: Any, input_rows: Any) -> None:
        stores["counts"].put("a", 99)
        raise RuntimeError("boom")

    with pytest.raises(RuntimeError, match="boom"):
        list(runner(config, 1, fail, keep_open=True).run_rows(0, iter(rows("a"))))
    assert kept._parked == {}
    output, stats = run_kept(config, 1, "a")
    assert output == [("a", 2)] and stats.base_seq == 1
    assert state_now(config) == ({"a": 2}, 2)


def test_a_task_parked_in_another_process_is_handed_over(tmp_path: Path) -> None:
    config = make_config(tmp_path)
    run_kept(config, 0, "a")  # parked here, holding the stores' locks
    assert (tmp_path / "local" / "wordcount" / "task-0" / kept.PARKED_FILE).read_text() == str(os.getpid())
    child = textwrap.dedent(f"""
        import json
        from statebackend.microbatch import kept
        from tests.test_spark_tasks import runner, rows
        from statebackend.spark.stats import is_output, is_stats
        items = list(runner({config!r}, 1, keep_open=True).run_rows(0, iter(rows("a", "c"))))
        out = [item for item in items if is_output(item)]
        stats = [item.stats for item in items if is_stats(item)][0]
        kept.release_all()
        print(json.dumps([out, stats.private_dir, stats.base_seq, stats.committed_seq]))
    """)
    env = dict(os.environ, PYTHONPATH=str(REPO))
    done = subprocess.run(
        [sys.executable, "-c", child], check=False, cwd=REPO, env=env, capture_output=True, text=True, timeout=120
    )
    assert done.returncode == 0, done.stderr
    import json

    out, private_dir, base_seq, committed_seq = json.loads(done.stdout.strip().splitlines()[-1])
    assert out == [["a", 2], ["c", 1]]
    assert not private_dir and (base_seq, committed_seq) == (1, 2)  # handed over: it used the local stores
    assert kept._parked == {}  # this process let it go
    assert state_now(config) == ({"a": 2, "c": 1}, 2)


def test_parking_more_than_the_bound_closes_the_task_parked_longest_ago(tmp_path: Path, monkeypatch: Any) -> None:
    monkeypatch.setattr(kept, "MAX_PARKED", 2)
    configs = [make_config(tmp_path / f"job{i}") for i in range(3)]
    for config in configs:
        run_kept(config, 0, "a")
    assert len(kept._parked) == 2
    assert {key[0] for key in kept._parked} == {str((tmp_path / f"job{i}" / "local").resolve()) for i in (1, 2)}
    # the evicted task was closed: its stores open in this process again, and its state is whole
    assert task_state(configs[0]) == ({"a": 1}, 1)


def test_a_kept_task_hands_the_driver_only_what_happened_in_each_batch(tmp_path: Path) -> None:
    """The driver adds the tasks' metrics up batch by batch: a task kept open hands on what happened since its last
    batch, not its whole life (one commit per batch, every batch)."""
    config = make_config(tmp_path)
    commits = []
    for batch in range(4):
        _, stats = run_kept(config, batch, "a")
        assert stats.metrics is not None
        commits.append((stats.kept_open, stats.metrics.counter("commit.count")))
    assert commits == [(False, 1), (True, 1), (True, 1), (True, 1)]
