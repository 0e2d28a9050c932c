"""A task's output waits for its durable commit in bounded memory: beyond the bound it spills to a file under
``state.local.dir/.spill/`` and comes back complete and in order; the file goes when the output was read or the
commit failed."""

from __future__ import annotations

import pickle
from pathlib import Path
from typing import Any

import pyarrow as pa
import pytest
from pyspark.sql import Row

from statebackend.errors import CommitError, StateBackendError
from statebackend.microbatch.held import _SPILL_CHUNK, SPILL_DIR, HeldOutput
from statebackend.spark.stats import StatsRecord, is_output
from tests.spark_helpers import task_runner
from tests.test_spark import make_config

pytestmark = [pytest.mark.spark_matrix]


def test_rows_over_the_bound_spill_and_come_back_in_order(tmp_path: Path) -> None:
    held = HeldOutput(4096, tmp_path / "spill").extend((f"word-{i}", i) for i in range(10_000))
    assert held.spilled and held.rows == 10_000
    assert 0 < held.spilled_items < 10_000  # the first rows stayed in memory
    assert len(list((tmp_path / "spill").iterdir())) == 1
    assert list(held) == [(f"word-{i}", i) for i in range(10_000)]
    assert list((tmp_path / "spill").iterdir()) == []  # read: the file is gone


def test_arrow_batches_over_the_bound_spill_and_come_back_equal(tmp_path: Path) -> None:
    batches = [pa.record_batch({"k": pa.array(range(i * 1000, i * 1000 + 1000))}) for i in range(20)]
    held = HeldOutput(batches[0].nbytes * 3, tmp_path / "spill").extend(batches)
    assert held.spilled and held.rows == 20_000
    assert [b.equals(c) for b, c in zip(list(held), batches, strict=True)] == [True] * 20


def test_under_the_bound_nothing_touches_the_disk(tmp_path: Path) -> None:
    held = HeldOutput(1 << 20, tmp_path / "spill").extend([("a", 1), ("b", 2)])
    assert not held.spilled and not (tmp_path / "spill").exists()
    assert list(held) == [("a", 1), ("b", 2)]


def many_rows(stores: Any, rows: Any) -> list[tuple[str, int]]:
    counts = stores["counts"]
    for row in rows:
        counts.put(row.word, (counts.get(row.word) or 0) + 1)
    return [(f"out-{i}", i) for i in range(5000)]


def test_a_task_whose_output_spills_returns_it_whole_after_its_commit(tmp_path: Path) -> None:
    runner = task_runner(make_config(tmp_path), many_rows, output_memory_bytes=2048)
    out = list(runner.run_rows(0, iter([Row(word="a"), Row(word="b")])))
    assert [item for item in out if is_output(item)] == [(f"out-{i}", i) for i in range(5000)]
    stats = [item.stats for item in out if isinstance(item, StatsRecord)]
    assert len(stats) == 1 and stats[0].output_rows == 5000 and stats[0].committed_seq == 1
    assert list((tmp_path / "local" / SPILL_DIR).iterdir()) == []


def test_a_failed_commit_leaves_no_spill_file(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    from statebackend.task import TaskStorage

    def fail(self: Any, offsets: Any, timeout: Any = None) -> None:
        raise CommitError("injected: the commit failed")

    monkeypatch.setattr(TaskStorage, "commit_now", fail)
    runner = task_runner(make_config(tmp_path), many_rows, output_memory_bytes=2048)
    with pytest.raises(CommitError, match="injected"):
        list(runner.run_rows(0, iter([Row(word="a")])))
    assert list((tmp_path / "local" / SPILL_DIR).iterdir()) == []


@pytest.mark.parametrize("chunks_kept", [0, 1, 2])
def test_a_spill_file_cut_short_is_an_error_not_fewer_rows(tmp_path: Path, chunks_kept: int) -> None:
    """A spill file that lost its tail where a pickled chunk ends (or all of it) must never read back as a shorter
    output: the task's commit is durable, so its output comes back whole or the task fails."""
    held = HeldOutput(0, tmp_path / "spill").extend((f"word-{i}", i) for i in range(3 * _SPILL_CHUNK))
    assert held.spilled and held.spilled_items == 3 * _SPILL_CHUNK
    assert held._file is not None and held._path is not None
    held._file.flush()  # three whole chunks on disk
    whole = held._path.read_bytes()
    ends = []
    with open(held._path, "rb") as source:
        for _ in range(3):
            pickle.load(source)
            ends.append(source.tell())
    assert ends[-1] == len(whole)
    held._path.write_bytes(whole[: ends[chunks_kept - 1]] if chunks_kept else b"")
    with pytest.raises(StateBackendError, match="spill file"):
        list(held)
    assert list((tmp_path / "spill").iterdir()) == []  # the file goes all the same


def test_a_function_failing_after_its_output_spilled_leaves_no_spill_file(tmp_path: Path) -> None:
    def spill_then_fail(stores: Any, rows: Any) -> Any:
        many_rows(stores, rows)
        for i in range(5000):
            yield (f"out-{i}", i)
        raise RuntimeError("boom after spilling")

    runner = task_runner(make_config(tmp_path), spill_then_fail, output_memory_bytes=2048)
    with pytest.raises(RuntimeError, match="boom after spilling"):
        list(runner.run_rows(0, iter([Row(word="a")])))
    assert list((tmp_path / "local" / SPILL_DIR).iterdir()) == []
