"""The record file format detects every corruption: a flipped byte, a cut, an extension, a wrong count or length,
in every version and compression, whichever way a caller reads the file."""

from __future__ import annotations

import io
import struct

import pytest

from statebackend import recordfile as fmt
from statebackend.errors import CorruptDataError
from statebackend.recordfile import (
    iter_records,
    verify,
)
from tests.test_recordfile import (
    DELTA,
    SMALL_DELTA,
    SNAPSHOT,
    VERSIONS,
    block_of,
    body_in,
    fixed_block_of,
    hand_built,
    in_version,
    trickle,
)


def every_reading(data: bytes) -> list[object]:
    """The ways a caller reads a file; each must raise for a bad one."""
    return [
        lambda: verify(data, name="f"),
        lambda: list(iter_records(data, name="f")),
        lambda: list(iter_records(data, name="f", verified=True)),
        lambda: list(iter_records(io.BytesIO(data), name="f")),
    ]


def _every_reading_gives(data: bytes, message: str | None) -> None:
    """Every way of reading ``data`` gives a result (``message`` None) or a CorruptDataError matching ``message``."""
    for read in every_reading(data):
        if message is None:
            assert read() is not None  # type: ignore[operator]
            continue
        with pytest.raises(CorruptDataError, match=message):
            read()  # type: ignore[operator]


@pytest.mark.parametrize("version", VERSIONS)
def test_a_count_that_disagrees_with_the_body_is_a_count_mismatch(version: int) -> None:
    data = hand_built(in_version(DELTA, version), body_in(version, SMALL_DELTA), count=len(SMALL_DELTA) + 1)
    for read in every_reading(data):
        with pytest.raises(CorruptDataError, match="record count mismatch: the footer says 5, the body holds 4"):
            read()  # type: ignore[operator]


@pytest.mark.parametrize("version", VERSIONS)
def test_unsorted_records_in_a_file_with_a_valid_checksum_are_rejected_by_the_reader(version: int) -> None:
    data = hand_built(in_version(DELTA, version), body_in(version, [(b"b", b"1"), (b"a", b"2")]), count=2)
    for read in every_reading(data):
        with pytest.raises(CorruptDataError, match="record 1 .*keys must strictly increase"):
            read()  # type: ignore[operator]


def test_version_2_keys_out_of_order_across_blocks_are_rejected_by_the_reader() -> None:
    body = block_of([(b"a", b"1"), (b"c", b"2")]) + block_of([(b"c", b"3")])
    data = hand_built(DELTA, body, count=3)
    for read in every_reading(data):
        with pytest.raises(
            CorruptDataError,
            match="record 2 in the block at body byte 33 has key b'c', not after b'c'; keys must strictly increase",
        ):
            read()  # type: ignore[operator]


@pytest.mark.parametrize("version", VERSIONS)
def test_a_delete_in_a_snapshot_file_is_rejected_by_the_reader(version: int) -> None:
    data = hand_built(in_version(SNAPSHOT, version), body_in(version, [(b"a", b"1"), (b"b", None)]), count=2)
    for read in every_reading(data):
        with pytest.raises(CorruptDataError, match="not a valid snapshot record"):
            read()  # type: ignore[operator]


@pytest.mark.parametrize(
    ("block", "message"),
    [
        pytest.param(
            block_of([(b"a", b"1")], count=0),
            f"record count 0 and flags 0; a valid version {fmt.FORMAT_VERSION} block has 1..65536 records",
            id="no-records",
        ),
        pytest.param(block_of([(b"a", b"1")], count=fmt.BLOCK_MAX_RECORDS + 1), "record count 65537", id="too-many"),
        pytest.param(block_of([(b"a", b"1")], flags=8), "flags 8; .* flags within 7", id="unknown-flag"),
        pytest.param(
            block_of([(b"a", b"1"), (b"b", b"2")], key_bytes=1),
            "lengths that do not add up to its 1 key and 2 value bytes",
            id="key-bytes-too-small",
        ),
        pytest.param(
            block_of([(b"a", b"1"), (b"b", b"22")], value_lengths=[3, 1]),
            r"ends inside the block at body byte 0 \(records 0 to 1: 21 of 22 bytes\)",
            id="lengths-past-end",
        ),
        pytest.param(
            block_of([(b"a", b"1"), (b"b", None)], ops=b"\x01\x03"),
            "record 1 in the block at body byte 0 has op 3",
            id="bad-op",
        ),
        pytest.param(
            block_of([(b"a", b"1"), (b"b", b"2")], ops=b"\x01\x02"),
            "record 1 .* is a delete with value length 1",
            id="delete-with-value",
        ),
        pytest.param(
            block_of([(b"a", b"1")])[:10], "ends inside the header of the block at body byte 0", id="cut-header"
        ),
        pytest.param(
            block_of([(b"a", b"1")]) + b"\x00",
            "ends inside the header of the block at body byte 23",
            id="trailing-byte",
        ),
        # lengths moved between records of a block still cut the block's bytes exactly: a valid file, other records
        pytest.param(block_of([(b"a", b"1"), (b"b", b"22")], value_lengths=[2, 1]), None, id="valid-other-split"),
    ],
)
def test_every_inconsistent_version_2_block_is_named_by_the_reader(block: bytes, message: str | None) -> None:
    """Checked even under a valid digest: a writer bug must not reach the store."""
    data = hand_built(DELTA, block, count=2 if message is None else 1)
    _every_reading_gives(data, message)


@pytest.mark.parametrize("flags", [2, 4, 6])
def test_a_version_2_block_with_a_version_3_flag_is_refused(flags: int) -> None:
    data = hand_built(in_version(DELTA, 2), block_of([(b"a", b"1")], flags=flags), count=1)
    for read in every_reading(data):
        with pytest.raises(CorruptDataError, match=f"flags {flags}; a valid version 2 block .* flags within 1"):
            read()  # type: ignore[operator]


TWO_FIXED = [(b"ab", b"12345678"), (b"cd", b"87654321")]


@pytest.mark.parametrize(
    ("block", "message"),
    [
        pytest.param(
            fixed_block_of(TWO_FIXED, key_length=3),
            "2 keys of length 3 that do not add up to its 4 key and 16 value bytes",
            id="key-length",
        ),
        pytest.param(
            fixed_block_of(TWO_FIXED, value_length=7),
            "2 values of length 7 that do not add up to its 4 key and 16 value bytes",
            id="value-length",
        ),
        pytest.param(
            fixed_block_of(TWO_FIXED, key_length=0xFFFF_FFFF), "2 keys of length 4294967295", id="huge-key-length"
        ),
        pytest.param(
            fixed_block_of(TWO_FIXED, values_fixed=False, key_bytes=3, value_bytes=17),
            "keys of length 2 that do not add up to its 3 key",
            id="key-bytes-with-value-lengths",
        ),
        pytest.param(
            fixed_block_of(TWO_FIXED, keys_fixed=False, value_bytes=15, key_bytes=5),
            "key and value lengths that do not add up to its 5 key",
            id="key-lengths-with-fixed-values",
        ),
        pytest.param(
            fixed_block_of([(b"ab", b"12345678"), (b"cd", None)], value_length=4),
            "1 values of length 4 that do not add up to its 4 key and 8 value bytes",
            id="puts-only-length",
        ),
        # keys as planes, value lengths per record: a valid block (the delete's length 0), whatever the value bytes
        pytest.param(
            fixed_block_of([(b"ab", b"12"), (b"cd", None)], values_fixed=False)[:-2] + b"\x00\x00",
            None,
            id="fixed-keys-varied-values-valid",
        ),
        pytest.param(
            fixed_block_of([(b"cd", b"1"), (b"ab", b"2")]),
            "record 1 .*keys must strictly increase",
            id="planes-out-of-order",
        ),
        pytest.param(
            fixed_block_of(TWO_FIXED)[:-1], r"ends inside the block at body byte 0 \(records 0 to 1", id="cut-planes"
        ),
    ],
)
def test_every_inconsistent_version_3_block_is_named_by_the_reader(block: bytes, message: str | None) -> None:
    """A corrupt single length is caught against the block's byte counts before anything is allocated for it."""
    data = hand_built(DELTA, block, count=2)
    _every_reading_gives(data, message)


def test_a_version_3_file_built_by_hand_reads_back() -> None:
    """The reader follows the documented layout, not only the writer: planes built byte by byte, mixed blocks."""
    first: list[tuple[bytes, bytes | None]] = [(b"a%02d" % i, b"%04d" % i) for i in range(30)]
    second: list[tuple[bytes, bytes | None]] = [(b"b%02d" % i, None if i % 4 == 0 else b"%d" % i) for i in range(30)]
    third: list[tuple[bytes, bytes | None]] = [(b"c" * i, None if i == 3 else b"xyz") for i in range(1, 9)]
    body = fixed_block_of(first) + fixed_block_of(second, values_fixed=False) + fixed_block_of(third, keys_fixed=False)
    data = hand_built(DELTA, body, count=68)
    for read in every_reading(data)[1:]:
        assert read() == first + second + third  # type: ignore[operator]


@pytest.mark.parametrize(
    ("value_bytes", "message"),
    [
        (0xFFFF_FFF0, "declares 1 key and 4294967280 value bytes, more than the 1074790400 a block may hold"),  # ~4 GiB
        (fmt.MAX_BLOCK_BYTES - 1, "ends inside the block at body byte 0"),  # within the cap: what the body holds
    ],
)
def test_a_huge_corrupt_block_size_in_a_stream_is_refused_or_a_truncation_not_a_huge_allocation(
    value_bytes: int, message: str
) -> None:
    block = block_of([(b"a", b"1")])
    block = block[:9] + struct.pack("<I", value_bytes) + block[13:]
    data = hand_built(DELTA, block, count=1)
    with pytest.raises(CorruptDataError, match=message):
        list(iter_records(trickle(data, 4096), name="f"))
