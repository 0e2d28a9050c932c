"""The changelog backend's marker (the recipe): stored samples of every format, the compact format 2 round trip, its
size inside a checkpoint, and every malformed format 2 marker refused; a job restores from a format 1 checkpoint an
older release wrote and continues its chain."""

from __future__ import annotations

import json
import pathlib
import shutil
from typing import Any

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from statebackend.backends.changelog.marker import (
    MARKER_FORMAT,
    READ_MARKER_FORMATS,
    Recipe,
    Step,
    delta_name,
    snapshot_name,
)
from statebackend.checkpoint import CheckpointLog, CheckpointV2

from statebackend.blobstores.memory import MemoryBlobStore
from statebackend.errors import CorruptDataError, IncompatibleFormatError, StateBackendError
from statebackend.task import TaskStorage
from statebackend.testing.backend_contract import contents
from statebackend.testing.deadline import scaled
from tests.backend_helpers import commit_round, restored_after_wipe
from tests.data.changelog.make_samples import recipe_from_steps
from tests.test_backend_changelog import config_for

SAMPLES = pathlib.Path(__file__).parent / "data" / "changelog"
PREFIX = "job/task-0/counts/changelog/"


def sample(version: int) -> dict[str, Any]:
    return json.loads((SAMPLES / f"marker-v{version}.json").read_text())  # type: ignore[no-any-return]


def format_1(recipe: Recipe) -> str:
    """The recipe as the release before format 2 wrote it (every step an object, its blob name spelled out)."""

    def step(s: Step) -> dict[str, object]:
        return {"seq": s.seq, "checkpoint_id": s.checkpoint_id, "token": s.token, "name": s.name}

    return json.dumps(
        {
            "format": 1,
            "snapshot": None if recipe.snapshot is None else step(recipe.snapshot),
            "deltas": [step(d) for d in recipe.deltas],
        },
        separators=(",", ":"),
    )


# ------------------------------------------------------------------------------------------------ stored samples


def test_there_is_a_stored_sample_of_every_marker_format_read() -> None:
    assert (
        sorted(int(path.stem.split("-v")[1]) for path in SAMPLES.glob("marker-v*.json"))
        == list(READ_MARKER_FORMATS)
        == [1, MARKER_FORMAT]
    )


@pytest.mark.parametrize("version", READ_MARKER_FORMATS)
def test_stored_marker_samples_decode_to_the_recipes_they_list(version: int) -> None:
    stored = sample(version)
    assert set(stored["markers"]) == {"with-snapshot", "no-snapshot", "snapshot-only", "empty"}
    for label, marker in stored["markers"].items():
        recipe = Recipe.decode(marker, prefix=stored["prefix"], source=label)
        assert recipe == recipe_from_steps(stored["expected"][label]), label
        assert json.loads(marker)["format"] == version


def test_the_format_1_sample_names_the_blobs_format_2_derives() -> None:
    """Format 1 spelled the names out; format 2 drops them because they were always derived this way."""
    stored = sample(1)
    recipe = Recipe.decode(stored["markers"]["with-snapshot"], prefix=stored["prefix"])
    assert recipe.snapshot is not None
    assert recipe.snapshot.name == snapshot_name(stored["prefix"], 40, recipe.snapshot.token)
    assert [d.name for d in recipe.deltas] == [
        None if d.seq == 43 else delta_name(stored["prefix"], d.seq, d.token) for d in recipe.deltas
    ]
    assert list(recipe.blob_names()) == [recipe.snapshot.name] + [d.name for d in recipe.deltas if d.seq != 43]


def test_the_encoder_writes_the_stored_format_2_sample_byte_for_byte() -> None:
    stored = sample(MARKER_FORMAT)
    for label, steps in stored["expected"].items():
        assert recipe_from_steps(steps).encode(prefix=stored["prefix"]) == stored["markers"][label], label


def test_format_2_spells_out_steps_compactly_and_an_empty_delta_by_a_flag() -> None:
    stored = sample(2)
    assert json.loads(stored["markers"]["with-snapshot"]) == {
        "format": 2,
        "snapshot": [40, "1700000000000-000040", "0123456789abcdef"],
        "seq": 41,
        "deltas": [
            ["1700000000041-000287", "0000000000000029"],
            ["1700000000042-000294", "000000000000002a"],
            ["1700000000043-000301", "000000000000002b", 0],
            ["1700000000044-000308", "000000000000002c"],
            ["1700000000045-000315", "000000000000002d"],
        ],
    }
    assert json.loads(stored["markers"]["empty"]) == {"format": 2, "snapshot": None, "deltas": []}


def test_a_step_costs_under_a_third_of_the_checkpoint_bytes_it_cost_in_format_1() -> None:
    """The marker is a JSON string inside the checkpoint: its quotes are escaped there, so measure it escaped."""

    def recipe(deltas: int) -> Recipe:
        tokens = [f"{seq:016x}" for seq in range(41 + deltas)]
        return Recipe(
            Step(40, "1732500000000-000040", tokens[40], snapshot_name(PREFIX, 40, tokens[40])),
            tuple(
                Step(seq, f"1732500000{seq:03d}-{seq:06d}", tokens[seq], delta_name(PREFIX, seq, tokens[seq]))
                for seq in range(41, 41 + deltas)
            ),
        )

    def per_step(encode: Any) -> float:
        return (len(json.dumps(encode(recipe(20)))) - len(json.dumps(encode(recipe(0))))) / 20

    old = per_step(format_1)
    new = per_step(lambda r: r.encode(prefix=PREFIX))
    assert old > 165  # the prefix of this test's store is 28 characters; a longer one costs more in format 1 only
    assert new < 50
    assert new < old / 3.5


# ------------------------------------------------------------------------------------------------ round trips


@st.composite
def recipes(draw: st.DrawFn) -> Recipe:
    tokens = st.text(alphabet="0123456789abcdef", min_size=1, max_size=16)
    ids = st.text(alphabet="0123456789-", min_size=1, max_size=20)
    snapshot = None
    if draw(st.booleans()):
        seq = draw(st.integers(min_value=1, max_value=10**12))
        token = draw(tokens)
        snapshot = Step(seq, draw(ids), token, snapshot_name(PREFIX, seq, token))
        first = seq + 1
    else:
        first = draw(st.integers(min_value=1, max_value=10**12))
    deltas = []
    for seq in range(first, first + draw(st.integers(min_value=0, max_value=25))):
        token = draw(tokens)
        deltas.append(Step(seq, draw(ids), token, None if draw(st.booleans()) else delta_name(PREFIX, seq, token)))
    return Recipe(snapshot, tuple(deltas))


@settings(max_examples=200, deadline=None)
@given(recipes())
def test_format_2_round_trips_every_recipe_and_format_1_reads_the_same(recipe: Recipe) -> None:
    marker = recipe.encode(prefix=PREFIX)
    assert json.loads(marker)["format"] == 2
    assert Recipe.decode(marker, prefix=PREFIX) == recipe
    assert Recipe.decode(format_1(recipe), prefix=PREFIX) == recipe


def test_a_format_2_marker_names_the_blobs_under_the_prefix_it_is_decoded_with() -> None:
    recipe = Recipe(
        Step(3, "c3", "t3", snapshot_name(PREFIX, 3, "t3")), (Step(4, "c4", "t4", delta_name(PREFIX, 4, "t4")),)
    )
    other = "job/task-1/counts/changelog/"
    assert list(Recipe.decode(recipe.encode(prefix=PREFIX), prefix=other).blob_names()) == [
        f"{other}snapshot/000000000003-t3.snap",
        f"{other}delta/000000000004-t4.delta",
    ]


@pytest.mark.parametrize(
    ("recipe", "message"),
    [
        pytest.param(
            Recipe(Step(3, "c", "t", "elsewhere/3.snap")),
            "snapshot 'elsewhere/3.snap' at seq 3 is not",
            id="snapshot-name",
        ),
        pytest.param(Recipe(Step(3, "c", "t", None)), "snapshot None at seq 3 is not", id="snapshot-without-blob"),
        pytest.param(
            Recipe(None, (Step(4, "c", "t", delta_name(PREFIX, 4, "other-token")),)),
            "delta '.*other-token.delta' at seq 4 is not",
            id="delta-name",
        ),
        pytest.param(
            Recipe(None, (Step(4, "c", "t", None), Step(6, "c", "t", None))), "delta seq 6 follows 4", id="gap"
        ),
        pytest.param(
            Recipe(Step(3, "c", "t", snapshot_name(PREFIX, 3, "t")), (Step(5, "c", "t", None),)),
            "first delta has seq 5, the snapshot 3",
            id="gap-after-snapshot",
        ),
    ],
)
def test_a_recipe_format_2_cannot_name_exactly_is_refused_by_the_encoder(recipe: Recipe, message: str) -> None:
    with pytest.raises(StateBackendError, match=message):
        recipe.encode(prefix=PREFIX)


@pytest.mark.parametrize(
    ("marker", "message"),
    [
        pytest.param({"snapshot": None, "deltas": {}}, "'deltas' is not a list", id="deltas-object"),
        pytest.param({"deltas": []}, "the snapshot .* is not \\[seq, checkpoint id, token\\]", id="no-snapshot-key"),
        pytest.param({"snapshot": [0, "c", "t"], "deltas": []}, "snapshot \\[0, 'c', 't'\\]", id="snapshot-seq-0"),
        pytest.param({"snapshot": [True, "c", "t"], "deltas": []}, "snapshot \\[True", id="snapshot-seq-bool"),
        pytest.param({"snapshot": [3, "c"], "deltas": []}, "snapshot \\[3, 'c'\\]", id="snapshot-short"),
        pytest.param({"snapshot": [3, "c", ""], "deltas": []}, "snapshot \\[3, 'c', ''\\]", id="snapshot-empty-token"),
        pytest.param({"snapshot": {"seq": 3}, "deltas": []}, "snapshot \\{'seq': 3\\}", id="snapshot-object"),
        pytest.param(
            {"snapshot": None, "deltas": [["c", "t"]]},
            "first delta's 'seq' is None, not a seq",
            id="deltas-without-seq",
        ),
        pytest.param({"snapshot": None, "seq": 0, "deltas": [["c", "t"]]}, "'seq' is 0", id="seq-0"),
        pytest.param({"snapshot": None, "seq": "4", "deltas": [["c", "t"]]}, "'seq' is '4'", id="seq-string"),
        pytest.param(
            {"snapshot": [3, "c", "t"], "seq": 5, "deltas": [["c", "t"]]},
            "'seq' is 5, not the snapshot's seq \\+ 1 \\(4\\)",
            id="seq-after-a-gap",
        ),
        pytest.param({"snapshot": None, "seq": 4, "deltas": []}, "'seq' 4 without deltas", id="seq-without-deltas"),
        pytest.param(
            {"snapshot": None, "seq": 4, "deltas": [["c", "t", 1]]}, "delta 0 \\['c', 't', 1\\]", id="no-blob-flag-1"
        ),
        pytest.param({"snapshot": None, "seq": 4, "deltas": [["c", "t", None]]}, "delta 0", id="no-blob-flag-null"),
        pytest.param(
            {"snapshot": None, "seq": 4, "deltas": [["c", "t"], ["c"]]}, "delta 1 \\['c'\\]", id="delta-short"
        ),
        pytest.param({"snapshot": None, "seq": 4, "deltas": [["c", 7]]}, "delta 0 \\['c', 7\\]", id="token-number"),
        pytest.param({"snapshot": None, "seq": 4, "deltas": [{"seq": 4}]}, "delta 0 \\{'seq': 4\\}", id="delta-object"),
    ],
)
def test_every_malformed_format_2_marker_is_corrupt(marker: dict[str, object], message: str) -> None:
    with pytest.raises(CorruptDataError, match=message):
        Recipe.decode(json.dumps({"format": 2, **marker}), prefix=PREFIX, source="store counts")


@pytest.mark.parametrize("marker", ['{"format": 3, "steps": []}', '{"deltas": []}', '{"format": "2"}'])
def test_an_unknown_marker_format_is_incompatible_and_names_the_formats_read(marker: str) -> None:
    with pytest.raises(IncompatibleFormatError, match=r"this release reads formats \[1, 2\]"):
        Recipe.decode(marker, prefix=PREFIX)


@pytest.mark.parametrize("marker", ["", "[1, 2]", "{not json"])
def test_a_marker_that_is_no_json_object_is_corrupt(marker: str) -> None:
    with pytest.raises(CorruptDataError, match="changelog marker"):
        Recipe.decode(marker, prefix=PREFIX)


# ------------------------------------------------------------------------------------------------- a real job


def test_a_checkpoint_with_a_format_1_marker_restores_and_the_chain_continues_in_format_2(
    tmp_path: pathlib.Path,
) -> None:
    """As after an upgrade: the head checkpoint was written by a release that wrote format 1."""
    blobs = MemoryBlobStore()
    config = config_for(tmp_path, **{"changelog.snapshot.interval.commits": 4})
    model: dict[bytes, bytes] = {}
    rounds = 0
    with TaskStorage.open(config, "task-0", blob_store=blobs) as task:
        # commits until the head names a snapshot with deltas above it: a background snapshot is adopted by the
        # commit after it finished, which a loaded machine may delay by commits; waiting for it makes that the next
        while True:
            checkpoint = commit_round(task, rounds, model)
            rounds += 1
            shape = Recipe.decode(checkpoint.markers_for("changelog")["counts"], prefix=PREFIX)
            if shape.snapshot is not None and shape.deltas:
                break
            assert rounds < 40, "no snapshot with deltas above it after 40 commits at a snapshot interval of 4"
            for binding in task.commit_manager.backups:
                background = binding.manager.shared.stores["counts"].background  # type: ignore[attr-defined]
                if background is not None:
                    background.exception(timeout=scaled(120))
    log = CheckpointLog(blobs, "job", "task-0")
    head = log.latest()
    assert head is not None and isinstance(head.checkpoint, CheckpointV2)
    marker = head.checkpoint.markers_for("changelog")["counts"]
    recipe = Recipe.decode(marker, prefix=PREFIX)
    assert json.loads(marker)["format"] == 2 and recipe.snapshot is not None and recipe.deltas
    old = head.checkpoint
    # the same checkpoint as an older release wrote it: its recipe ends at its own version, as every commit's does
    log.write(
        head.seq + 1,
        CheckpointV2(old.checkpoint_id, old.input_offsets, {"changelog": {"counts": format_1(recipe)}}, old.serdes),
    )
    shutil.rmtree(tmp_path / "local")
    with TaskStorage.open(config, "task-0", blob_store=blobs) as task:
        assert contents(task) == model
        assert task.restored is not None and json.loads(task.restored.markers_for("changelog")["counts"])["format"] == 1
        checkpoint = commit_round(task, rounds, model)
    continued = Recipe.decode(checkpoint.markers_for("changelog")["counts"], prefix=PREFIX)
    assert json.loads(checkpoint.markers_for("changelog")["counts"])["format"] == 2
    # continued, not re-based: the versions up to the old head are the old recipe's (a snapshot finished meanwhile
    # may have been adopted in place of deltas: same versions), and the blobs it still names are the same blobs
    assert continued.seq == recipe.seq + 1 and continued.snapshot is not None
    assert continued.snapshot.seq <= recipe.seq
    kept = [step for step in continued.steps() if step.seq <= recipe.seq]
    assert {(s.seq, s.version) for s in kept} <= {(s.seq, s.version) for s in recipe.steps()}
    assert {s.name for s in kept if s.name and "/delta/" in s.name} <= set(recipe.blob_names())
    assert restored_after_wipe(config, blobs) == model
