"""The changelog marker (format 2, and format 1 as still read) edited inside a checkpoint: a seq shifted, a step
dropped, duplicated or moved, tokens or checkpoint ids swapped between steps, is refused or restores exactly the state
of the checkpoint: never another state."""

from __future__ import annotations

import copy
import json
import shutil
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import attrs
import pytest
from hypothesis import HealthCheck, assume, given, settings
from hypothesis import strategies as st
from statebackend.backends.changelog.marker import Recipe, Step
from statebackend.checkpoint import CheckpointLog, CheckpointV2

from statebackend.blobstores.memory import MemoryBlobStore
from statebackend.errors import StateBackendError
from statebackend.task import TaskStorage
from statebackend.testing.backend_contract import contents, write_round
from tests.test_backend_changelog import PREFIX, config_for

# ------------------------------------------------------------------------------------------ the marker, edited


def steps_of(document: dict[str, Any]) -> list[list[Any]]:
    return document["deltas"]  # type: ignore[no-any-return]


def swap(steps: list[list[Any]], i: int, field: int | None) -> None:
    """Steps ``i`` and ``i + 1`` swapped whole (``field`` None) or one field of theirs swapped."""
    if field is None:
        steps[i], steps[i + 1] = steps[i + 1], steps[i]
    else:
        steps[i][field], steps[i + 1][field] = steps[i + 1][field], steps[i][field]


def format_2_edits(marker: str) -> Iterator[tuple[str, str]]:
    """(what, edited marker) for every edit of the recipe the trust rules list."""
    original = json.loads(marker)
    deltas = steps_of(original)

    def edited(change: Callable[..., object], *args: int) -> str:
        """The marker with ``change(document, *args)`` made to its document (what the change returns is ignored)."""
        document = copy.deepcopy(original)
        change(document, *args)
        return json.dumps(document, separators=(",", ":"))

    def shift(by: int) -> Callable[[dict[str, Any]], None]:
        def change(document: dict[str, Any]) -> None:
            document["seq"] += by
            if document["snapshot"] is not None:
                document["snapshot"][0] += by

        return change

    def set_seq(by: int) -> Callable[[dict[str, Any]], None]:
        return lambda document: document.__setitem__("seq", document["seq"] + by)

    yield "every seq shifted up", edited(shift(1))
    yield "every seq shifted down", edited(shift(-1))
    yield "the deltas' seq shifted up", edited(set_seq(1))
    for index in range(len(deltas)):
        yield f"delta {index} dropped", edited(lambda d, i: steps_of(d).pop(i), index)
        yield f"delta {index} twice", edited(lambda d, i: steps_of(d).insert(i, list(steps_of(d)[i])), index)
    for index in range(len(deltas) - 1):
        yield f"deltas {index} and {index + 1} swapped", edited(lambda d, i: swap(steps_of(d), i, None), index)
        yield f"tokens of deltas {index} and {index + 1} swapped", edited(lambda d, i: swap(steps_of(d), i, 1), index)
        yield (
            f"checkpoint ids of deltas {index} and {index + 1} swapped",
            edited(lambda d, i: swap(steps_of(d), i, 0), index),
        )
    if original["snapshot"] is not None and deltas:

        def snapshot_token_swap(document: dict[str, Any]) -> None:
            document["snapshot"][2], steps_of(document)[0][1] = steps_of(document)[0][1], document["snapshot"][2]

        yield "tokens of the snapshot and delta 0 swapped", edited(snapshot_token_swap)
        yield (
            "the snapshot's checkpoint id swapped with delta 0's",
            edited(
                lambda d: (
                    d["snapshot"].__setitem__(1, steps_of(d)[0][0]),
                    steps_of(d)[0].__setitem__(0, original["snapshot"][1]),
                )
            ),
        )


def format_1(recipe: Recipe) -> dict[str, Any]:
    def step(s: Step) -> dict[str, object]:
        return {"seq": s.seq, "checkpoint_id": s.checkpoint_id, "token": s.token, "name": s.name}

    return {
        "format": 1,
        "snapshot": None if recipe.snapshot is None else step(recipe.snapshot),
        "deltas": [step(d) for d in recipe.deltas],
    }


def format_1_edits(recipe: Recipe) -> Iterator[tuple[str, str]]:
    """Edits of the recipe as a format 1 marker (every step's seq and blob name spelled out, as an older release
    wrote them): whole steps dropped, doubled or moved."""
    original = format_1(recipe)
    deltas = original["deltas"]
    for index in range(len(deltas)):
        document = copy.deepcopy(original)
        document["deltas"].pop(index)
        yield f"format 1: delta {index} dropped", json.dumps(document)
        document = copy.deepcopy(original)
        document["deltas"].insert(index, dict(deltas[index]))
        yield f"format 1: delta {index} twice", json.dumps(document)
    for index in range(len(deltas) - 1):
        document = copy.deepcopy(original)
        document["deltas"][index], document["deltas"][index + 1] = deltas[index + 1], deltas[index]
        yield f"format 1: deltas {index} and {index + 1} swapped", json.dumps(document)
    if original["snapshot"] is not None:
        document = copy.deepcopy(original)
        document["snapshot"] = dict(deltas[0]) | {"name": original["snapshot"]["name"]}
        yield "format 1: the snapshot claims delta 0's version", json.dumps(document)


@attrs.frozen
class Chain:
    blobs: MemoryBlobStore
    config: dict[str, object]
    model: dict[bytes, bytes]
    head: Any  # the head LogEntry
    behind: Path  # a copy of the local state dir a few commits behind the head


@pytest.fixture(scope="module")
def chain(tmp_path_factory: pytest.TempPathFactory) -> Chain:
    """A store's chain: a snapshot, deltas after it, one of them a commit that changed nothing."""
    tmp_path = tmp_path_factory.mktemp("chain")
    blobs = MemoryBlobStore()
    config = config_for(tmp_path, **{"changelog.snapshot.interval.commits": 3, "changelog.snapshot.interval.ratio": 0})
    model: dict[bytes, bytes] = {}
    behind = tmp_path / "behind"
    for round_no in range(9):
        with TaskStorage.open(config, "task-0", blob_store=blobs) as task:
            if round_no != 7:  # round 7 commits no change: a step without a blob
                write_round(task, round_no, model, keys=20)
            task.commit_durably({"input": str(round_no)})
            head = task.checkpoint_log.latest()
        if round_no == 5:
            shutil.copytree(tmp_path / "local", behind)
    assert head is not None and isinstance(head.checkpoint, CheckpointV2)
    recipe = Recipe.decode(head.checkpoint.markers_for("changelog")["counts"], prefix=PREFIX)
    assert recipe.snapshot is not None and len(recipe.deltas) >= 3
    assert any(step.name is None for step in recipe.deltas) and any(step.name for step in recipe.deltas)
    return Chain(blobs, config, model, head, behind)


def restore_with_marker(
    chain: Chain, tmp_path: Path, marker: str, *, local: Path | None, errors: list[str] | None = None
) -> dict[bytes, bytes] | None:
    """Write the head checkpoint again with ``marker`` (its checksum made right: only the recipe decides), restore
    into a fresh local dir (or a copy of ``local``); the store's contents, or None when the restore refused (its
    message appended to ``errors``)."""
    blobs = MemoryBlobStore()
    for name in chain.blobs.list(""):
        blobs.put(name, chain.blobs.get(name))
    old = chain.head.checkpoint
    CheckpointLog(blobs, "job", "task-0").write(
        chain.head.seq + 1,
        CheckpointV2(old.checkpoint_id, old.input_offsets, {"changelog": {"counts": marker}}, old.serdes),
    )
    config = dict(chain.config, **{"state.local.dir": str(tmp_path / "local")})
    shutil.rmtree(tmp_path / "local", ignore_errors=True)
    if local is not None:
        shutil.copytree(local, tmp_path / "local")
    try:
        with TaskStorage.open(config, "task-0", blob_store=blobs) as task:
            return contents(task)
    except StateBackendError as exc:
        assert str(exc)
        if errors is not None:
            errors.append(str(exc))
        return None


def test_the_chain_restores_exactly_with_its_own_marker(chain: Chain, tmp_path: Path) -> None:
    marker = chain.head.checkpoint.markers_for("changelog")["counts"]
    assert restore_with_marker(chain, tmp_path, marker, local=None) == chain.model
    assert restore_with_marker(chain, tmp_path, marker, local=chain.behind) == chain.model


def all_edits(chain: Chain) -> list[tuple[str, str]]:
    marker = chain.head.checkpoint.markers_for("changelog")["counts"]
    recipe = Recipe.decode(marker, prefix=PREFIX)
    return [*format_2_edits(marker), *format_1_edits(recipe)]


def test_an_edited_marker_is_refused_or_restores_exactly_never_another_state(chain: Chain, tmp_path: Path) -> None:
    wrong = []
    refused = 0
    for what, marker in all_edits(chain):
        for local in (None, chain.behind):
            restored = restore_with_marker(chain, tmp_path, marker, local=local)
            if restored is None:
                refused += 1
            elif restored != chain.model:
                wrong.append(f"{what} ({'caught up' if local else 'full'} restore)")
    assert wrong == [], f"edited markers restored another state: {wrong}"
    assert refused > 0


def test_a_recipe_cut_short_at_its_end_is_refused_naming_the_store_and_both_versions(
    chain: Chain, tmp_path: Path
) -> None:
    """Each blob of the shorter recipe is intact and bound to its step: only the checkpoint's own version, which the
    last step of every recipe a commit writes is, tells that the last commit's changes would be missing."""
    marker = json.loads(chain.head.checkpoint.markers_for("changelog")["counts"])
    marker["deltas"].pop()
    errors: list[str] = []
    assert restore_with_marker(chain, tmp_path, json.dumps(marker), local=None, errors=errors) is None
    assert len(errors) == 1 and "store counts" in errors[0] and "not at the checkpoint's own version" in errors[0]
    assert str(chain.head.checkpoint.checkpoint_id) in errors[0]
    errors.clear()
    empty = '{"format":2,"snapshot":null,"deltas":[]}'
    assert restore_with_marker(chain, tmp_path, empty, local=chain.behind, errors=errors) is None
    assert "has no step" in errors[0]


def test_a_format_1_recipe_with_a_gap_is_refused_naming_the_seqs(chain: Chain, tmp_path: Path) -> None:
    """Format 1 spells each step's seq and blob out: a step left out of the middle leaves every other blob bound to
    its own step; the gap in the seqs is what tells."""
    recipe = Recipe.decode(chain.head.checkpoint.markers_for("changelog")["counts"], prefix=PREFIX)
    document = format_1(recipe)
    gone = document["deltas"].pop(0)
    errors: list[str] = []
    assert restore_with_marker(chain, tmp_path, json.dumps(document), local=None, errors=errors) is None
    assert f"jumps from seq {gone['seq'] - 1} to seq {gone['seq'] + 1}" in errors[0] and "store counts" in errors[0]


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(data=st.data())
def test_a_marker_changed_in_one_character_is_refused_or_restores_exactly(
    chain: Chain, tmp_path: Path, data: st.DataObject
) -> None:
    """As in a checkpoint without a checksum (blob format 1, still read): one character of the marker changed to one
    that keeps it likely to parse (a digit, a hex digit, JSON punctuation)."""
    marker = chain.head.checkpoint.markers_for("changelog")["counts"]
    position = data.draw(st.integers(min_value=0, max_value=len(marker) - 1))
    character = data.draw(st.sampled_from('0123456789abcdef,[]"-'))
    changed = marker[:position] + character + marker[position + 1 :]
    assume(changed != marker)
    local = data.draw(st.sampled_from([None, chain.behind]))
    assert restore_with_marker(chain, tmp_path, changed, local=local) in (None, chain.model)


def test_a_recipe_whose_snapshot_was_removed_is_refused_not_replayed_on_the_empty_store(
    chain: Chain, tmp_path: Path
) -> None:
    """``"snapshot": null`` with the deltas' seqs kept: each delta is intact and bound to its step, but the first
    applies on the version before it (the snapshot's), not on the empty store; replaying them on an empty store
    would restore a state without everything the snapshot held."""
    marker = json.loads(chain.head.checkpoint.markers_for("changelog")["counts"])
    snapshot_seq = marker["snapshot"][0]
    assert snapshot_seq >= 1 and marker["seq"] == snapshot_seq + 1
    marker["snapshot"] = None
    for local in (None, chain.behind):
        errors: list[str] = []
        assert restore_with_marker(chain, tmp_path, json.dumps(marker), local=local, errors=errors) is None
        assert "store counts" in errors[0] and f"starts at seq {snapshot_seq + 1} without a snapshot" in errors[0]


def test_a_format_1_recipe_without_the_snapshot_or_its_blob_is_refused(chain: Chain, tmp_path: Path) -> None:
    """Format 1 spells each step out: the snapshot left out, or kept without its blob (which no release wrote: a
    snapshot step always names its file), would load the empty store under the deltas that follow it."""
    recipe = Recipe.decode(chain.head.checkpoint.markers_for("changelog")["counts"], prefix=PREFIX)
    assert recipe.snapshot is not None
    without = format_1(recipe)
    without["snapshot"] = None
    no_blob = format_1(recipe)
    no_blob["snapshot"]["name"] = None
    for document, message in (
        (without, f"starts at seq {recipe.snapshot.seq + 1} without a snapshot"),
        (no_blob, f"a snapshot at seq {recipe.snapshot.seq} that names no blob"),
    ):
        for local in (None, chain.behind):
            errors: list[str] = []
            assert restore_with_marker(chain, tmp_path, json.dumps(document), local=local, errors=errors) is None
            assert "store counts" in errors[0] and message in errors[0], errors
