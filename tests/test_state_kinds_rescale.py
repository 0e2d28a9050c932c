"""List and map stores under the micro-batch driver's tasks, run in this process without a SparkSession: a rescale
2 -> 3 tasks moves each key's whole list and map to the task owning its key group, a replayed batch gives the same
state, and ``read_state``'s reader gives a list as a list and a map as (sub-key, value) pairs."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from pyspark.sql import Row

from statebackend.config import Settings
from statebackend.microbatch.keygroups import key_group, task_of_group
from statebackend.spark import TaskRunner
from statebackend.spark.read import _StateReader
from statebackend.spark.stats import is_output
from statebackend.task import TaskStorage
from tests.test_state_kinds import make_config

K = 8
WORDS = [f"w{i}" for i in range(40)]


def keep_last_two(stores: Any, rows: Any) -> list[tuple[str, int]]:
    """Per word: the last two batch ids it was seen in (a list), and a map of batch id -> times seen."""
    events, counters = stores["events"], stores["counters"]
    out = []
    for row in rows:
        events.append(row.word, stores.batch_id)
        events.trim(row.word, keep_last=2)
        sub = f"b{stores.batch_id:03d}"
        counters.put(row.word, sub, (counters.get(row.word, sub) or 0) + 1)
        out.append((row.word, events.len(row.word)))
    return sorted(out)


def owner(word: str, num_tasks: int) -> int:
    return task_of_group(key_group([word], ["string"], K), num_tasks, K)


def run_batch(config: dict[str, object], batch_id: int, num_tasks: int, words: list[str]) -> dict[str, int]:
    out: dict[str, int] = {}
    for task in range(num_tasks):
        runner = TaskRunner.of(
            fn=keep_last_two,
            config=config,
            batch_id=batch_id,
            num_tasks=num_tasks,
            on_replay="redo",
            input_columns=("word",),
            key_groups=K,
            key_types=("string",),
        )
        rows = iter([Row(word=w) for w in words if owner(w, num_tasks) == task])
        out.update(dict(item for item in runner.run_rows(task, rows) if is_output(item)))
    return out


def read(config: dict[str, object], store: str, num_tasks: int) -> list[tuple[str, str, Any]]:
    reader = _StateReader(Settings.from_config(config), store, "latest", num_tasks, None)
    return list(reader.read(range(num_tasks)))


def test_a_rescale_2_to_3_moves_each_keys_whole_list_and_map_to_its_key_groups_task(tmp_path: Path) -> None:
    config = make_config(tmp_path, **{"task.checkpoint.retained": 4})
    expected_lists: dict[str, list[int]] = {}
    expected_maps: dict[str, dict[str, int]] = {}
    batches = [(0, 2, WORDS), (1, 2, WORDS[::2]), (2, 3, WORDS[::3]), (3, 3, WORDS[1::2])]
    for batch_id, num_tasks, words in batches:
        out = run_batch(config, batch_id, num_tasks, words)
        for word in words:
            expected_lists[word] = (expected_lists.get(word, []) + [batch_id])[-2:]
            expected_maps.setdefault(word, {})[f"b{batch_id:03d}"] = 1
        assert out == {w: len(expected_lists[w]) for w in words}
    events = read(config, "events", 3)
    counters = read(config, "counters", 3)
    assert {key: [json.loads(v) for v in value] for _, key, value in events} == expected_lists  # json: text
    assert {key: dict(value) for _, key, value in counters} == expected_maps
    assert len(events) == len(WORDS) and len(counters) == len(WORDS)  # each key in one task only
    for task, key, _ in events + counters:
        assert task == f"task-{owner(key, 3)}", (task, key)
    assert all(list(value) == sorted(value) for _, _, value in counters)  # sub-key byte order
    # the records themselves: every record of task-N's stores belongs to a key it owns
    for index in range(3):
        with TaskStorage.open(config, f"task-{index}") as storage:
            for view in (storage.list_store("events"), storage.map_store("counters")):
                keys = list(view.user_keys())
                assert keys and all(owner(k, 3) == index for k in keys)


def test_a_replayed_batch_appends_to_the_same_seqs(tmp_path: Path) -> None:
    """A batch run again from its base checkpoint (a retry, a restart) writes the same records: the list holds each
    append once, and its records' keys are those of the first run."""
    config = make_config(tmp_path)
    run_batch(config, 0, 1, WORDS[:5])
    run_batch(config, 1, 1, WORDS[:5])
    with TaskStorage.open(config, "task-0") as storage:
        first = list(storage.stores["events"].items())
    run_batch(config, 1, 1, WORDS[:5])  # the replay
    with TaskStorage.open(config, "task-0") as storage:
        assert list(storage.stores["events"].items()) == first
        assert dict(storage.list_store("events").lists()) == {w: [0, 1] for w in WORDS[:5]}
