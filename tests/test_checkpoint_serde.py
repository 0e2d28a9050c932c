"""Checkpoint values and their JSON serde: round trips, stored samples of every version, clear rejections."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from hypothesis import given
from hypothesis import strategies as st
from statebackend.checkpoint import (
    Binding,
    CheckpointId,
    CheckpointV1,
    CheckpointV2,
    decode_bound_checkpoint,
    decode_checkpoint,
    encode_checkpoint,
)

from statebackend.errors import CorruptDataError, IncompatibleFormatError

SAMPLES = Path(__file__).parent / "data" / "checkpoints"

text = st.text(max_size=20)
offsets = st.dictionaries(text, text, max_size=5)
markers = st.dictionaries(text, st.dictionaries(text, text, max_size=3), max_size=3)
ids = st.builds(CheckpointId, st.integers(0, 10**15), st.integers(0, 999_999))
v1s = st.builds(CheckpointV1, offsets)
v2s = st.builds(CheckpointV2, ids, offsets, markers)

SAMPLE_V2 = CheckpointV2(
    CheckpointId(1700000000123, 456789),
    {"batch": "7", "events-0": "42"},
    {
        "blobsnapshot": {"counts": "job/task/counts/index-0001.json"},
        "changelog": {"counts": '{"snapshot":3,"deltas":[4,5]}'},
    },
)


@given(st.one_of(v1s, v2s))
def test_encode_then_decode_gives_an_equal_checkpoint(checkpoint: CheckpointV1 | CheckpointV2) -> None:
    decoded = decode_checkpoint(encode_checkpoint(checkpoint))
    assert decoded == checkpoint
    assert type(decoded) is type(checkpoint)
    assert hash(decoded) == hash(checkpoint)


@given(v2s)
def test_encoding_is_canonical_sorted_compact_and_versioned(checkpoint: CheckpointV2) -> None:
    data = encode_checkpoint(checkpoint)
    document = json.loads(data)
    assert document["version"] == 2
    assert document["checkpoint_id"] == str(checkpoint.checkpoint_id)
    assert data == json.dumps(document, sort_keys=True, separators=(",", ":"), ensure_ascii=False).encode()


@pytest.mark.parametrize(
    ("name", "expected"),
    [("v1.json", SAMPLE_V2.to_v1()), ("v2.json", SAMPLE_V2)],
)
def test_stored_sample_of_every_version_decodes_and_encodes_byte_for_byte(
    name: str, expected: CheckpointV1 | CheckpointV2
) -> None:
    stored = (SAMPLES / name).read_bytes()
    assert decode_checkpoint(stored, source=name) == expected
    assert encode_checkpoint(expected) == stored.rstrip(b"\n")


def test_values_compare_by_value_with_plain_dicts_and_are_immutable() -> None:
    source = {"p0": "1"}
    checkpoint = CheckpointV2(CheckpointId(1, 2), source, {"changelog": {"s": "m"}})
    source["p0"] = "2"  # the value copied its input
    assert checkpoint.input_offsets == {"p0": "1"}
    assert checkpoint == CheckpointV2(CheckpointId(1, 2), {"p0": "1"}, {"changelog": {"s": "m"}})
    assert checkpoint != CheckpointV2(CheckpointId(1, 3), {"p0": "1"}, {"changelog": {"s": "m"}})
    assert checkpoint.markers_for("changelog") == {"s": "m"}
    assert checkpoint.markers_for("blobsnapshot") == {}
    with pytest.raises(TypeError):
        checkpoint.input_offsets["p0"] = "3"  # type: ignore[index]
    assert CheckpointV1.version == 1 and CheckpointV2.version == 2 and checkpoint.version == 2


@pytest.mark.parametrize(
    "bad",
    [{"p": 1}, {1: "x"}, ["p"]],
)
def test_values_reject_non_string_offsets(bad: object) -> None:
    with pytest.raises(TypeError, match="input_offsets"):
        CheckpointV1(bad)  # type: ignore[arg-type]


def test_decode_ignores_unknown_fields_of_a_known_version() -> None:
    document = json.loads(encode_checkpoint(SAMPLE_V2))
    document["added_by_a_later_release"] = {"anything": [1, 2]}
    assert decode_checkpoint(json.dumps(document).encode()) == SAMPLE_V2


@pytest.mark.parametrize("version", [0, 3, 99, -1])
def test_unknown_version_is_incompatible_and_says_which_versions_are_read(version: int) -> None:
    data = json.dumps({"version": version, "input_offsets": {}}).encode()
    with pytest.raises(IncompatibleFormatError) as info:
        decode_checkpoint(data, source="job/task/checkpoints/000000000001.v9.json")
    message = str(info.value)
    assert f"version {version}" in message
    assert "job/task/checkpoints/000000000001.v9.json" in message
    assert "reads versions 1, 2" in message


@pytest.mark.parametrize(
    ("data", "says"),
    [
        (b"", "not valid UTF-8 JSON"),
        (b"\xff\xfe", "not valid UTF-8 JSON"),
        (b'{"version":2', "not valid UTF-8 JSON"),
        (b'{"version":1,"version":2,"input_offsets":{}}', "duplicate key 'version'"),
        (b'{"version":1,"input_offsets":{"p":NaN}}', "NaN"),
        (b"[1,2]", "expected an object"),
        (b'{"input_offsets":{}}', "no 'version' field"),
        (b'{"version":"2","input_offsets":{}}', "expected an integer"),
        (b'{"version":true,"input_offsets":{}}', "expected an integer"),
        (b'{"version":1}', "'input_offsets' must be an object of strings"),
        (b'{"version":1,"input_offsets":{"p":5}}', "'input_offsets' must be an object of strings"),
        (b'{"version":2,"input_offsets":{},"state_checkpoint_markers":{}}', "'checkpoint_id' must be a string"),
        (b'{"version":2,"checkpoint_id":"x","input_offsets":{},"state_checkpoint_markers":{}}', "'x'"),
        (b'{"version":2,"checkpoint_id":"1-2","input_offsets":{}}', "'state_checkpoint_markers' must be an object"),
        (
            b'{"version":2,"checkpoint_id":"1-2","input_offsets":{},"state_checkpoint_markers":{"f":{"s":1}}}',
            "'state_checkpoint_markers.f' must be an object of strings",
        ),
        (
            b'{"version":2,"checkpoint_id":"1-2","input_offsets":{},"state_checkpoint_markers":{"f":"s"}}',
            "'state_checkpoint_markers.f' must be an object of strings",
        ),
    ],
)
def test_damaged_checkpoint_is_corrupt_data_naming_the_source(data: bytes, says: str) -> None:
    with pytest.raises(CorruptDataError) as info:
        decode_checkpoint(data, source="store-dir/CHECKPOINT-V2")
    assert "store-dir/CHECKPOINT-V2" in str(info.value)
    assert says in str(info.value)


def test_encode_rejects_what_is_not_a_checkpoint() -> None:
    with pytest.raises(TypeError, match="CheckpointV1 or CheckpointV2"):
        encode_checkpoint({"version": 2})  # type: ignore[arg-type]


@pytest.mark.parametrize("name", ["v1-format2.json", "v2-format2.json"])
def test_stored_samples_of_blob_format_2_decode_with_their_binding_and_encode_byte_for_byte(name: str) -> None:
    stored = (SAMPLES / name).read_bytes()
    checkpoint, binding = decode_bound_checkpoint(stored, source=name)
    assert binding == Binding("job", "task-0", 42)
    expected = CheckpointV2(
        SAMPLE_V2.checkpoint_id,
        SAMPLE_V2.input_offsets,
        SAMPLE_V2.state_checkpoint_markers,
        {"counts": {"key": "string", "msg": "integer"}},
    )
    assert checkpoint == (expected.to_v1() if name.startswith("v1") else expected)
    assert encode_checkpoint(checkpoint, binding) == stored.rstrip(b"\n")
