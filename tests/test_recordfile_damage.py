"""Adversarial record files (version 3 above all): a damaged, cut, extended or re-sealed file is refused with a
CorruptDataError-family error or decodes to what was written, never to anything else; adversarial lengths and
decompression bombs cost no big allocation."""

from __future__ import annotations

import hashlib
import io
import itertools
import re
import struct
import tracemalloc
import zlib
from collections.abc import Callable
from typing import Any, Self

import attrs
import pytest
import zstandard
from hypothesis import HealthCheck, assume, given, settings
from hypothesis import strategies as st

import statebackend.recordfile.format as recordformat
from statebackend import recordfile as fmt
from statebackend.errors import CorruptDataError, IncompatibleFormatError, StateBackendError
from statebackend.recordfile import FileHeader, encode, iter_records, verify
from statebackend.recordfile.nonce import new_trailer
from tests.recordfile_helpers import encode_small_blocks
from tests.test_recordfile import DELTA as RECORDFILE_DELTA
from tests.test_recordfile import trickle, uncompressed_blocks

#: the record file tests' delta header with a full-length token, one seq on
DELTA = attrs.evolve(RECORDFILE_DELTA, token="0123456789abcdef", seq=7, base_seq=6)
SNAPSHOT = attrs.evolve(DELTA, kind="snapshot", base_seq=7)
RUN = attrs.evolve(DELTA, kind="run", base_seq=0)
BAD = (CorruptDataError, IncompatibleFormatError)

Records = list[tuple[bytes, "bytes | None"]]


def outcome(read: Callable[[], list[Any]]) -> tuple[str, object]:
    """("ok", records) or ("error", the error's class), any other exception propagating (a test failure)."""
    try:
        return "ok", read()
    except BAD as exc:
        assert str(exc), "an error must say what is wrong"
        return "error", type(exc)


def every_reading(data: bytes, name: str = "blob-under-test") -> list[tuple[str, object]]:
    """The outcome of verify + every reader (bytes, bytes already verified by digest, streams of two read sizes)."""

    def verified() -> list[Any]:
        verify(data, name=name)
        return list(iter_records(data, name=name, verified=True))

    return [
        outcome(verified),
        outcome(lambda: list(iter_records(data, name=name))),
        outcome(lambda: list(iter_records(io.BytesIO(data), name=name))),
        outcome(lambda: list(iter_records(trickle(data, 7), name=name))),
    ]


def assert_refused_everywhere(data: bytes, name: str = "blob-under-test") -> None:
    for result in every_reading(data, name):
        assert result[0] == "error", f"a damaged file decoded: {result}"


def trailer_of(data: bytes) -> int:
    """How many bytes of nonce trailer a file of ``data``'s version ends in (its header's version)."""
    return fmt.trailer_size(struct.unpack_from("<H", data, 8)[0])


def sections(data: bytes) -> tuple[int, int]:
    """(header end, body end) of a well-formed file."""
    header_end = fmt.header_size(data[: fmt.HEADER_PREFIX_SIZE], name="f")
    return header_end, len(data) - fmt.FOOTER_SIZE - trailer_of(data)


def with_footer(data: bytes, footer: bytes) -> bytes:
    """``data`` (header and body) with ``footer`` and, where its version has one, a nonce trailer (resealed later)."""
    return data + footer + bytes(trailer_of(data))


def reseal(data: bytes, *, body_length: int | None = None) -> bytes:
    """``data`` with its header CRC, footer body length and digest (and nonce trailer) made right again, as a writer
    that meant to write these bytes would have: whatever it then decodes to, the checksums cannot tell."""
    header_end = fmt.header_size(data[: fmt.HEADER_PREFIX_SIZE], name="f")
    metadata_end = header_end - 4
    trailer = trailer_of(data)
    out = bytearray(data[: len(data) - trailer])
    out[metadata_end:header_end] = struct.pack("<I", zlib.crc32(bytes(out[:metadata_end])))
    body_end = len(out) - fmt.FOOTER_SIZE
    count, _, _, _ = struct.unpack_from("<QQ16s8s", out, body_end)
    covered = struct.pack("<QQ", count, body_end - header_end if body_length is None else body_length)
    out[body_end : body_end + 16] = covered
    digest = hashlib.blake2b(bytes(out[: body_end + 16]), digest_size=16).digest()
    out[body_end + 16 : body_end + 32] = digest
    if trailer:
        out += new_trailer(bytes(out[-fmt.FOOTER_SIZE :]))
    return bytes(out)


def uncompressed_body(records: Records, header: FileHeader = DELTA, budget: int = 24) -> bytes:
    data = encode_small_blocks(header, records, budget=budget, compression="none")
    header_end, body_end = sections(data)
    return data[header_end:body_end]


def file_with_body(body: bytes, count: int, header: FileHeader = DELTA) -> bytes:
    """A whole uncompressed file around ``body`` (any bytes), checksums right."""
    shell = encode(header, [], compression="none")
    header_end, _ = sections(shell)
    footer = struct.pack("<QQ16s8s", count, len(body), b"\x00" * 16, fmt.MAGIC_END)
    return reseal(with_footer(shell[:header_end] + body, footer))


# ------------------------------------------------------------------------------------------------------ records

KEY_LENGTHS = st.integers(min_value=0, max_value=70)  # around PLANES_MAX_LENGTH (64) too


@st.composite
def record_lists(draw: st.DrawFn, *, deletes: bool = True) -> Records:
    """Sorted unique records, often with a column of one length (byte planes), sometimes differing in one record."""
    n = draw(st.integers(min_value=0, max_value=40))
    key_length = draw(st.one_of(st.none(), KEY_LENGTHS))
    value_length = draw(st.one_of(st.none(), st.integers(min_value=0, max_value=70)))
    key = st.binary(min_size=key_length, max_size=key_length) if key_length is not None else st.binary(max_size=12)
    value = (
        st.binary(min_size=value_length, max_size=value_length) if value_length is not None else st.binary(max_size=80)
    )
    if deletes:
        value = st.one_of(value, st.none())
    records: Records = sorted(draw(st.dictionaries(key, value, max_size=n)).items())
    if records and bool(draw(st.booleans())):  # the last record alone of another length
        last_key, last_value = records[-1]
        records[-1] = (last_key, (last_value or b"") + b"\xff")
    return records


def check_round_trip(header: FileHeader, records: Records, *, compression: str, budget: int | None = None) -> None:
    if budget is None:
        data = encode(header, records, compression=compression)
    else:
        data = encode_small_blocks(header, records, budget=budget, compression=compression)
    assert verify(data, name="f") == header
    for result in every_reading(data):
        assert result == ("ok", records)


@pytest.mark.parametrize("compression", ["none", "zstd"])
@pytest.mark.parametrize(
    "records",
    [
        [],
        [(b"", b"")],
        [(b"", None)],
        [(b"only", b"one")],
        [(b"k\x00", b"")] + [(bytes([0x6B, i]), b"") for i in range(1, 5)],  # every value empty
        [(bytes([i]) * 3, bytes([255 - i]) * 8) for i in range(100)],  # every key and value of one length
        [(bytes([i]) * 3, bytes([i]) * 8) for i in range(9)] + [(b"\xff" * 3, b"x" * 9)],  # the last value 1 longer
        [(bytes([i]) * 3, b"v" * 4) for i in range(9)] + [(b"\xff" * 4, b"v" * 4)],  # the last key 1 longer
        [(b"a", b"x" * 64), (b"b", b"y" * 64)],  # at PLANES_MAX_LENGTH
        [(b"a", b"x" * 65), (b"b", b"y" * 65)],  # just over it
        [(b"a" * 64, b"1"), (b"b" * 64, b"2")],
        [(b"a", None), (b"b", None), (b"c", None)],  # deletes only
        [(b"a", None), (b"b", b"1234"), (b"c", None), (b"d", b"5678")],  # planes around deletes
        [("\u00e9t\u00e9".encode(), "\u2603".encode()), (b"\xf0\x9f\x92\xa9", b"\x00\xff\x00")],
        [(b"big", bytes(range(256)) * 1200), (b"bigger", b"\x01" * (3 << 20))],  # values above the block size
    ],
    ids=lambda records: f"{len(records)}-records",
)
def test_version_3_round_trips_the_edge_cases(records: Records, compression: str) -> None:
    check_round_trip(DELTA, records, compression=compression)


@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    records=record_lists(),
    compression=st.sampled_from(["none", "zstd"]),
    budget=st.sampled_from([None, 1, 16, 200]),
    kind=st.sampled_from(["delta", "run", "snapshot"]),
)
def test_version_3_round_trips_any_records_in_any_blocks(
    records: Records, compression: str, budget: int | None, kind: str
) -> None:
    header = {"delta": DELTA, "run": RUN, "snapshot": SNAPSHOT}[kind]
    if kind == "snapshot":
        records = [(key, b"" if value is None else value) for key, value in records]
    check_round_trip(header, records, compression=compression, budget=budget)


# ------------------------------------------------------------------------------------ damage without re-sealing

#: several blocks of every layout: fixed keys and values, fixed keys with deletes, varied, one of a kind
MULTI_BLOCK = sorted(
    [(b"a%03d" % i, b"%08d" % i) for i in range(6)]
    + [(b"b%03d" % i, None if i % 2 else b"%04d" % i) for i in range(5)]
    + [(b"c" * (i + 1), b"v" * i) for i in range(5)]
    + [(b"d", None)]
)


@pytest.mark.parametrize("compression", ["none", "zstd"])
def test_every_cut_and_every_flip_of_a_many_block_version_3_file_is_refused(compression: str) -> None:
    """Every offset, the block, plane and section boundaries among them: a cut, a flip of each bit pattern, a
    byte dropped or doubled there."""
    data = encode_small_blocks(DELTA, MULTI_BLOCK, budget=24, compression=compression)
    assert every_reading(data) == [("ok", MULTI_BLOCK)] * 4
    for position in range(len(data)):
        assert_refused_everywhere(data[:position])
        assert_refused_everywhere(data[:position] + data[position + 1 :])
        assert_refused_everywhere(data[:position] + data[position : position + 1] * 2 + data[position + 1 :])
        for mask in (0x01, 0x80):
            damaged = bytearray(data)
            damaged[position] ^= mask
            assert_refused_everywhere(bytes(damaged))


@pytest.mark.parametrize("compression", ["none", "zstd"])
@pytest.mark.parametrize("garbage", [b"\x00", b"\x00" * fmt.FOOTER_SIZE, fmt.MAGIC_END, b"x" * 1000])
def test_appended_garbage_is_refused(compression: str, garbage: bytes) -> None:
    data = encode_small_blocks(DELTA, MULTI_BLOCK, budget=24, compression=compression)
    assert_refused_everywhere(data + garbage)
    assert_refused_everywhere(data + data[-fmt.FOOTER_SIZE :])  # a second copy of the footer
    assert_refused_everywhere(data + data)  # the file twice


@settings(max_examples=150, deadline=None)
@given(records=record_lists(), compression=st.sampled_from(["none", "zstd"]), data=st.data())
def test_any_damage_to_a_version_3_file_is_refused_never_decoded_otherwise(
    records: Records, compression: str, data: st.DataObject
) -> None:
    original = encode_small_blocks(DELTA, records, budget=20, compression=compression)
    damaged = bytearray(original)
    for _ in range(data.draw(st.integers(min_value=1, max_value=4))):
        position = data.draw(st.integers(min_value=0, max_value=len(damaged) - 1))
        how = data.draw(st.sampled_from(["set", "xor", "insert", "delete"]))
        if how == "set":
            damaged[position] = data.draw(st.integers(0, 255))
        elif how == "xor":
            damaged[position] ^= data.draw(st.integers(1, 255))
        elif how == "insert":
            damaged[position:position] = data.draw(st.binary(min_size=1, max_size=8))
        else:
            del damaged[position : position + data.draw(st.integers(1, 8))]
    assume(bytes(damaged) != original)
    assert_refused_everywhere(bytes(damaged))


@pytest.mark.parametrize(
    "field,value",
    [
        ("job", "jab"),
        ("task", "task-4"),
        ("store", "cownts"),
        ("seq", 8),
        ("token", "fedcba9876543210"),
        ("checkpoint_id", "1700000000000-2"),
    ],
)
def test_a_header_field_changed_and_its_crc_made_right_still_fails_the_digest(field: str, value: object) -> None:
    data = encode(DELTA, MULTI_BLOCK, compression="zstd")
    header_end, _ = sections(data)
    changes: dict[str, Any] = {field: value, **({"base_seq": 7} if field == "seq" else {})}  # a field each
    other = attrs.evolve(DELTA, **changes)
    other_header = encode(other, [], compression="zstd")[: sections(encode(other, [], compression="zstd"))[0]]
    assert len(other_header) == header_end  # same length: only the digest can tell
    assert_refused_everywhere(other_header + data[header_end:])


# --------------------------------------------------------------------------- re-sealed: structure alone decides


def check_consistent_or_refused(data: bytes, header: FileHeader = DELTA) -> None:
    """Every reader agrees; what is accepted is a well-formed record list whose count the footer states."""
    results = every_reading(data)
    assert all(result == results[0] for result in results), results
    if results[0][0] == "ok":
        records = results[0][1]
        assert isinstance(records, list)
        keys = [key for key, _ in records]
        assert all(a < b for a, b in itertools.pairwise(keys))
        if header.kind == "snapshot":
            assert all(value is not None for _, value in records)
        count = struct.unpack_from("<Q", data, len(data) - fmt.FOOTER_SIZE - trailer_of(data))[0]
        assert len(records) == count


@settings(max_examples=200, deadline=None)
@given(records=record_lists(), data=st.data(), kind=st.sampled_from(["delta", "snapshot"]))
def test_a_re_sealed_version_3_body_is_refused_or_read_alike_by_every_reader(
    records: Records, data: st.DataObject, kind: str
) -> None:
    """Damage a checksum cannot see (the file re-sealed after it): the block structure alone must refuse it or read
    it the same way everywhere, never crash, hang or allocate by a corrupt length."""
    header = SNAPSHOT if kind == "snapshot" else DELTA
    if kind == "snapshot":
        records = [(key, b"" if value is None else value) for key, value in records]
    original = encode_small_blocks(header, records, budget=20, compression="none")
    header_end, body_end = sections(original)
    assume(body_end > header_end)
    body = bytearray(original[header_end:body_end])
    for _ in range(data.draw(st.integers(min_value=1, max_value=3))):
        position = data.draw(st.integers(min_value=0, max_value=len(body) - 1))
        body[position] = data.draw(st.integers(0, 255))
    check_consistent_or_refused(reseal(original[:header_end] + bytes(body) + original[body_end:]), header)


def block(n: int, flags: int, key_bytes: int, value_bytes: int, rest: bytes) -> bytes:
    return struct.pack("<IBII", n, flags, key_bytes, value_bytes) + rest


@pytest.mark.parametrize(
    "body,message",
    [
        # huge lengths: refused by the sizes the block declares, before any of it is read
        (block(1 << 16, 2 | 4, 0xFFFFFFFF, 0xFFFFFFFF, b"\x01\x00\x00\x00" * 2), "more than the 1074790400 a block"),
        (block(1, 0, 0xFFFFFFFF, 0, b"\xff\xff\xff\xff\x00\x00\x00\x00"), "more than the 1074790400 a block"),
        # within the cap: reading no more than the body holds
        (block(1, 0, 1 << 30, 0, b"\x00\x00\x00\x40\x00\x00\x00\x00"), "ends inside the block"),
        (block((1 << 16) + 1, 0, 1, 1, b""), "record count"),
        (block(0, 0, 0, 0, b""), "record count"),
        (block(1, 8, 0, 0, b"\x00" * 8), "flags"),
        # a fixed key length that does not add up (a product that would overflow 32 bits)
        (block(1 << 16, 2, 1 << 16, 0, struct.pack("<I", 1 << 16) + b"\x00" * 4 * (1 << 16)), "ends inside|add up"),
        (block(2, 2, 4, 0, struct.pack("<I", 0x80000002) + b"\x00" * 8 + b"abcd"), "add up"),
        (
            block(2, 4, 2, 6, b"\x01\x00\x00\x00\x01\x00\x00\x00" + struct.pack("<I", 0x80000003) + b"abxyzxyz"),
            "add up",
        ),
        # fixed values with deletes: the column holds the puts' values only
        (
            block(
                2, 1 | 4, 2, 4, b"\x02\x01" + b"\x01\x00\x00\x00" * 2 + b"\x04\x00\x00\x00" + b"ab" + b"wxyz" + b"\x00"
            ),
            "ends inside|add up|left over|block",
        ),
        (
            block(2, 1 | 4, 2, 8, b"\x02\x01" + b"\x01\x00\x00\x00" * 2 + b"\x04\x00\x00\x00" + b"ab" + b"wxyzwxyz"),
            "add up",
        ),
        # zero-length fixed keys: two empty keys are not increasing
        (block(2, 2 | 4, 0, 2, b"\x00\x00\x00\x00\x01\x00\x00\x00" + b"xy"), "strictly increase|not after"),
        (block(1, 1, 1, 1, b"\x03" + b"\x01\x00\x00\x00\x01\x00\x00\x00" + b"kv"), "op 3"),
        (block(1, 1, 1, 1, b"\x02" + b"\x01\x00\x00\x00\x01\x00\x00\x00" + b"kv"), "delete with value length"),
    ],
)
def test_adversarial_version_3_blocks_are_refused_cheaply_and_named(body: bytes, message: str) -> None:
    data = file_with_body(body, count=2)
    tracemalloc.start()
    try:
        for reading in (
            lambda: verify(data, name="blob-x"),
            lambda: list(iter_records(data, name="blob-x")),
            lambda: list(iter_records(io.BytesIO(data), name="blob-x")),
        ):
            with pytest.raises(CorruptDataError, match=message) as info:
                reading()
            assert "blob-x" in str(info.value)
        _, peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    assert peak < 16 << 20, f"refusing a {len(data)}-byte file allocated {peak} bytes"


def test_a_non_canonical_but_unambiguous_block_reads_as_what_it_says() -> None:
    """A fixed value column of a block of deletes only holds no value: whatever length it states, the block is the
    deletes (nothing else can be read from it), so accepting it loads nothing wrong."""
    body = block(2, 1 | 4, 2, 0, b"\x02\x02" + b"\x01\x00\x00\x00" * 2 + b"\x09\x00\x00\x00" + b"ab")
    assert every_reading(file_with_body(body, count=2)) == [("ok", [(b"a", None), (b"b", None)])] * 4


# ----------------------------------------------------------------------- sizes: decompression bombs, huge records

#: what a forged body really decompresses to, in zeros (the sizes it declares are far larger): enough that reading it
#: would show in the peak, little enough to compress in milliseconds
BOMB_BYTES = 64 << 20


def zstd_file_with_body(prefix: bytes, header: FileHeader, count: int, zeros: int = BOMB_BYTES) -> bytes:
    """A zstd file whose body decompresses to ``prefix`` and then ``zeros`` zero bytes (a few KiB compressed), its
    checksums right: what a forger who recomputes the digest can make."""
    compressor = zstandard.ZstdCompressor(level=3).compressobj()
    parts = [compressor.compress(prefix)]
    chunk = bytes(1 << 20)
    for _ in range(zeros // len(chunk)):
        parts.append(compressor.compress(chunk))
    parts.append(compressor.flush())
    body = b"".join(parts)
    shell = encode(header, [], compression="zstd")
    header_end, _ = sections(shell)
    footer = struct.pack("<QQ16s8s", count, len(body), b"\x00" * 16, fmt.MAGIC_END)
    return reseal(with_footer(shell[:header_end] + body, footer))


def peak_while_refused(data: bytes, message: str, name: str = "blob-bomb") -> int:
    """The peak of Python allocations while verify and every reader (bytes, a seekable and an unseekable stream)
    refuse ``data`` with a CorruptDataError naming ``name`` and matching ``message``."""
    tracemalloc.start()
    try:
        for reading in (
            lambda: verify(data, name=name),
            lambda: list(iter_records(data, name=name, verified=True)),
            lambda: list(iter_records(io.BytesIO(data), name=name)),
            lambda: list(iter_records(trickle(data, 1 << 16), name=name)),
        ):
            with pytest.raises(CorruptDataError, match=message) as info:
                reading()
            assert name in str(info.value)
        return tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()


@pytest.mark.parametrize(
    ("version", "prefix", "message"),
    [
        # a block declaring u32-max key bytes, and a block declaring one byte more than a block may hold
        pytest.param(
            3,
            block(1, 0, 0xFFFFFFFF, 0, struct.pack("<II", 0xFFFFFFFF, 0)),
            "block at body byte 0 .* declares 4294967295 key and 0 value bytes, more than the 1074790400 a "
            "block may hold",
            id="v3-u32-max",
        ),
        pytest.param(
            3,
            block(1, 4, 1, fmt.MAX_BLOCK_BYTES, struct.pack("<II", 1, fmt.MAX_BLOCK_BYTES)),
            "declares 1 key and 1074790400 value bytes, more than the 1074790400",
            id="v3-one-byte-over",
        ),
        pytest.param(
            2,
            block(1, 0, 1 << 31, 1 << 31, struct.pack("<II", 1 << 31, 1 << 31)),
            "more than the 1074790400 a block",
            id="v2-2GiB-and-2GiB",
        ),
        # version 1: one record's prefix
        pytest.param(
            1,
            struct.pack("<BII", 1, 0xFFFFFFFF, 0),
            "record 0 at body byte 0 declares 4294967295 key and 0 value bytes",
            id="v1-u32-max",
        ),
        pytest.param(
            1,
            struct.pack("<BII", 1, 1, fmt.MAX_BLOCK_BYTES),
            "more than the 1074790400 a record may hold",
            id="v1-one-byte-over",
        ),
    ],
)
def test_a_forged_body_that_decompresses_to_more_than_a_block_may_hold_is_refused_before_it_is_read(
    version: int, prefix: bytes, message: str
) -> None:
    """The digest is no secret: a few KiB of zstd that decompress to gigabytes pass every checksum. Each reader
    refuses the block (or version 1 record) by the size it declares, before decompressing any of it: the peak stays
    far below the 64 MiB the body really holds (reading them took twice that before the bound)."""
    data = zstd_file_with_body(prefix, attrs.evolve(DELTA, format_version=version), count=1)
    assert len(data) < 16 << 10
    peak = peak_while_refused(data, message)
    assert peak < 8 << 20, f"refusing a {len(data)}-byte forged file allocated {peak} bytes"


def test_a_zstd_frame_asking_for_a_window_above_what_the_backends_write_is_refused() -> None:
    """The window is what decompression holds besides its output: a frame may ask for at most the 128 MiB that
    level 22, the highest level the backends allow, uses."""
    body = uncompressed_body(MULTI_BLOCK)
    written = encode(DELTA, MULTI_BLOCK, compression="zstd", level=22)
    header_end, body_end = sections(written)
    assert zstandard.get_frame_parameters(written[header_end:body_end]).window_size == 1 << 27
    assert every_reading(written) == [("ok", MULTI_BLOCK)] * 4
    for window_log, accepted in ((27, True), (28, False)):
        params = zstandard.ZstdCompressionParameters.from_level(3, window_log=window_log)
        compressor = zstandard.ZstdCompressor(compression_params=params).compressobj()
        frame = compressor.compress(body) + compressor.flush()
        assert zstandard.get_frame_parameters(frame).window_size == 1 << window_log
        footer = struct.pack("<QQ16s8s", len(MULTI_BLOCK), len(frame), b"\x00" * 16, fmt.MAGIC_END)
        data = reseal(with_footer(written[:header_end] + frame, footer))
        if accepted:
            assert every_reading(data) == [("ok", MULTI_BLOCK)] * 4
        else:
            peak_while_refused(data, "does not decompress")


class Claimed(bytes):
    """Bytes that claim a length they do not hold: what the writer sees of a value of gigabytes (it takes lengths
    by ``len``), without allocating one."""

    claimed: int

    def __new__(cls, data: bytes, claimed: int) -> Self:
        made = super().__new__(cls, data)
        made.claimed = claimed
        return made

    def __len__(self) -> int:
        return self.claimed


@pytest.mark.parametrize("version", [1, 2, 3])
@pytest.mark.parametrize(
    ("records", "index", "sizes"),
    [
        # a value past a u32 length, a key past it, and two values each within u32 whose block is not
        pytest.param(
            [(b"a", b"1"), (b"b", b"2"), (b"c", Claimed(b"x", 5 << 30))],
            2,
            "1 key and 5368709120 value bytes",
            id="value-past-u32",
        ),
        pytest.param(
            [(b"a", b"1"), (Claimed(b"b", 5 << 30), b"2")], 1, "5368709120 key and 1 value bytes", id="key-past-u32"
        ),
        pytest.param(
            [(b"a", Claimed(b"x", 3 << 30)), (b"b", Claimed(b"y", 3 << 30))],
            0,
            "1 key and 3221225472 value bytes",
            id="block-past-u32",
        ),
        pytest.param(
            [(b"a", b"1"), (b"b", Claimed(b"y", fmt.MAX_BLOCK_BYTES))],
            1,
            "1 key and 1074790400 value bytes",
            id="one-byte-over",
        ),
    ],
)
def test_a_record_bigger_than_a_block_may_hold_is_refused_up_front_naming_it_and_the_limit(
    version: int, records: Records, index: int, sizes: str
) -> None:
    """Not a struct or overflow error from packing a u32 field: the limit, below 4 GiB, is checked on the lengths
    first, and every u32 field of a block is within it."""
    assert fmt.MAX_BLOCK_BYTES < 1 << 32
    key = records[index][0]
    with pytest.raises(
        StateBackendError,
        match=re.escape(
            f"record {index} (key {bytes(key)[:64]!r}) has {sizes}, more than the {fmt.MAX_BLOCK_BYTES} bytes"
        ),
    ):
        encode(attrs.evolve(DELTA, format_version=version), records, compression="none")


def walk_blocks(data: bytes) -> list[tuple[int, int]]:
    """(record count, key and value bytes) of each block of an uncompressed version 2 or 3 file."""
    return [(count, size) for count, _, size in uncompressed_blocks(data)]


@pytest.mark.parametrize("version", [2, 3])
@pytest.mark.parametrize("shape", ["planes", "varied"])
def test_records_bigger_than_the_chunk_was_sized_for_are_carried_to_the_next_block_within_the_limit(
    monkeypatch: pytest.MonkeyPatch, version: int, shape: str
) -> None:
    """With the limit lowered to 1000 bytes: a chunk of records far bigger than the ones before it is cut into
    blocks of at most the limit, in order, across several blocks from one chunk; a record of exactly the limit is one
    block; one byte more is refused, naming the record."""
    monkeypatch.setattr(recordformat, "MAX_BLOCK_BYTES", 1000)
    if shape == "planes":  # keys and values of one length (planes), deletes among them
        records: Records = [(b"k%03d" % i, None if i % 7 == 3 else b"%060d" % i) for i in range(60)]
    else:
        records = [(b"k%03d" % i, b"v" * (i * 37 % 400)) for i in range(60)]
    records += [(b"x" * 10, b"y" * 990), (b"z", b"")]  # exactly the limit, then a small one
    header = attrs.evolve(DELTA, format_version=version)
    data = encode(header, records, compression="none")
    blocks = walk_blocks(data)
    assert len(blocks) >= 4 and all(size <= 1000 for _, size in blocks)
    assert (1, 1000) in blocks and sum(count for count, _ in blocks) == len(records)
    assert every_reading(data) == [("ok", records)] * 4
    assert every_reading(encode(header, records, compression="zstd")) == [("ok", records)] * 4
    # the same records given as columns take the same cuts, carried records included: the very same bytes
    columns = fmt.RecordColumns([key for key, _ in records], [value for _, value in records])
    assert encode(header, columns, compression="none") == data
    too_big = [*records[:-1], (b"x" * 10 + b"!", b"y" * 990)]
    with pytest.raises(
        StateBackendError,
        match=re.escape(
            f"record {len(records) - 1} (key {b'x' * 10 + b'!'!r}) has 11 key and 990 value bytes, more than the "
            "1000 bytes"
        ),
    ):
        encode(header, too_big, compression="zstd")
