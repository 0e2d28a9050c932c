"""The record file format (statebackend.recordfile, the changelog's and blob-snapshot's blobs): round trips, bad
input, stored samples of every version, and loading inside a transaction. Corruption: test_recordfile_corruption.py;
adversarial files: test_recordfile_damage.py."""

from __future__ import annotations

import hashlib
import io
import json
import pathlib
import struct
import zlib
from collections.abc import Sequence
from typing import BinaryIO, cast

import attrs
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

import statebackend.recordfile.format as recordformat
from statebackend import recordfile as fmt
from statebackend.errors import CorruptDataError, IncompatibleFormatError, StateBackendError
from statebackend.recordfile import (
    FileHeader,
    check_digest,
    encode,
    iter_records,
    read_header,
    verify,
    write_file,
)
from statebackend.recordfile.nonce import content_of, new_trailer
from statebackend.store import LocalStore, LocalVersion

SAMPLES = pathlib.Path(__file__).parent / "data" / "changelog"

DELTA = FileHeader(
    kind="delta",
    job="job",
    task="task-3",
    store="counts",
    checkpoint_id="1700000000000-1",
    token="tok",
    seq=5,
    base_seq=4,
)
SNAPSHOT = attrs.evolve(DELTA, kind="snapshot", base_seq=5)
SMALL_DELTA = [(b"a", b"1"), (b"b", None), (b"c", b""), (b"d\xff", b"value-d")]
#: keys of one length, puts' values of one length: both columns are byte planes in version 3
FIXED_DELTA = [(b"k01", b"\x00\x00\x00\x07"), (b"k02", None), (b"k05", b"\x00\x00\x01\x00")]
VERSIONS = [1, 2, 3, 4]


def in_version(header: FileHeader, version: int) -> FileHeader:
    return attrs.evolve(header, format_version=version)


def trickle(data: bytes, step: int) -> BinaryIO:
    """A :class:`TrickleReader` over ``data``, typed as the stream ``iter_records`` takes (it reads with ``read``)."""
    return cast(BinaryIO, TrickleReader(data, step))


class TrickleReader(io.RawIOBase):
    """A real unseekable stream that returns at most ``step`` bytes per read, like a socket or a pipe."""

    def __init__(self, data: bytes, step: int) -> None:
        self._data = memoryview(data)
        self._pos = 0
        self._step = step

    def readable(self) -> bool:
        return True

    def readinto(self, buffer: bytearray) -> int:  # type: ignore[override]
        n = min(len(buffer), self._step, len(self._data) - self._pos)
        buffer[:n] = self._data[self._pos : self._pos + n]
        self._pos += n
        return n


class UnseekableWriter(io.RawIOBase):
    """A real write-only stream that cannot seek, collecting what is written."""

    def __init__(self) -> None:
        self.chunks: list[bytes] = []

    def writable(self) -> bool:
        return True

    def seekable(self) -> bool:
        return False

    def write(self, data: bytes) -> int:  # type: ignore[override]
        self.chunks.append(bytes(data))
        return len(data)


def assemble(prefix_and_metadata: bytes, body: bytes, count: int) -> bytes:
    """A file built by hand (bypassing write_file) with a valid header CRC, footer and digest (and from version 4 a
    nonce trailer)."""
    head = prefix_and_metadata + struct.pack("<I", zlib.crc32(prefix_and_metadata))
    covered = struct.pack("<QQ", count, len(body))
    digest = hashlib.blake2b(head + body + covered, digest_size=16).digest()
    footer = covered + digest + fmt.MAGIC_END
    (version,) = struct.unpack_from("<H", prefix_and_metadata, 8)
    return head + body + footer + (new_trailer(footer) if fmt.trailer_size(version) else b"")


def without_trailer(data: bytes) -> bytes:
    """A file's bytes without its nonce trailer (version 4): what two writes of the same records have in common."""
    return bytes(content_of(data))


def header_prefix(data: bytes) -> bytes:
    """The prefix and metadata of an encoded file (everything before the header CRC)."""
    return data[: fmt.header_size(data[:16], name="x") - 4]


def body_of(records: list[tuple[bytes, bytes | None]]) -> bytes:
    """A version 1 body."""
    out = b""
    for key, value in records:
        op, value_bytes = (2, b"") if value is None else (1, value)
        out += struct.pack("<BII", op, len(key), len(value_bytes)) + key + value_bytes
    return out


def block_of(
    records: list[tuple[bytes, bytes | None]],
    *,
    ops: bytes | None = None,
    count: int | None = None,
    flags: int | None = None,
    key_bytes: int | None = None,
    value_lengths: list[int] | None = None,
) -> bytes:
    """A version 2 block built by hand; the keyword arguments override what a correct writer would put there."""
    keys = [key for key, _ in records]
    values = [value or b"" for _, value in records]
    if ops is None and any(value is None for _, value in records):
        ops = bytes(2 if value is None else 1 for _, value in records)
    lengths = value_lengths if value_lengths is not None else [len(value) for value in values]
    head = struct.pack(
        "<IBII",
        len(records) if count is None else count,
        (0 if ops is None else 1) if flags is None else flags,
        sum(map(len, keys)) if key_bytes is None else key_bytes,
        sum(lengths),
    )
    return (
        head
        + (ops or b"")
        + struct.pack(f"<{len(keys)}I", *map(len, keys))
        + struct.pack(f"<{len(keys)}I", *lengths)
        + b"".join(keys)
        + b"".join(values)
    )


def planes(column: list[bytes]) -> bytes:
    """Records of one length as byte planes, written out byte by byte (independently of the writer's slicing)."""
    return bytes(record[i] for i in range(len(column[0]) if column else 0) for record in column)


def fixed_block_of(
    records: Sequence[tuple[bytes, bytes | None]],
    *,
    keys_fixed: bool = True,
    values_fixed: bool = True,
    count: int | None = None,
    key_length: int | None = None,
    value_length: int | None = None,
    key_bytes: int | None = None,
    value_bytes: int | None = None,
) -> bytes:
    """A version 3 block built by hand, a column of one length as byte planes; the keyword arguments override what a
    correct writer would put there."""
    keys = [key for key, _ in records]
    puts = [value for _, value in records if value is not None]
    has_deletes = len(puts) < len(records)
    flags = (1 if has_deletes else 0) | (2 if keys_fixed else 0) | (4 if values_fixed else 0)
    parts = [b""]
    if has_deletes:
        parts.append(bytes(2 if value is None else 1 for _, value in records))
    if keys_fixed:
        parts.append(struct.pack("<I", len(keys[0]) if key_length is None else key_length))
    else:
        parts.append(struct.pack(f"<{len(keys)}I", *map(len, keys)))
    if values_fixed:
        parts.append(struct.pack("<I", len(puts[0]) if value_length is None else value_length))
    else:
        parts.append(struct.pack(f"<{len(keys)}I", *(len(value or b"") for _, value in records)))
    parts.append(planes(keys) if keys_fixed else b"".join(keys))
    parts.append(planes(puts) if values_fixed else b"".join(puts))
    parts[0] = struct.pack(
        "<IBII",
        len(records) if count is None else count,
        flags,
        sum(map(len, keys)) if key_bytes is None else key_bytes,
        sum(map(len, puts)) if value_bytes is None else value_bytes,
    )
    return b"".join(parts)


def body_in(version: int, records: list[tuple[bytes, bytes | None]]) -> bytes:
    if version == 1:
        return body_of(records)
    if version == 2:
        return block_of(records)
    return fixed_block_of(
        records,
        keys_fixed=len({len(key) for key, _ in records}) == 1,
        values_fixed=len({len(value) for _, value in records if value is not None}) == 1,
    )


# ------------------------------------------------------------------------------------------------------- round trips


def hand_built(header: FileHeader, body: bytes, count: int) -> bytes:
    """A file with the header's version and a body built by hand, under a valid CRC, footer and digest."""
    return assemble(header_prefix(encode(header, [], compression="none")), body, count)


@st.composite
def files(draw: st.DrawFn) -> tuple[FileHeader, list[tuple[bytes, bytes | None]], str]:
    header = in_version(draw(st.sampled_from([DELTA, SNAPSHOT])), draw(st.sampled_from(VERSIONS)))
    # keys and values of one length (fixed-length columns, byte planes in version 3), of a few lengths, or of any
    key_size = draw(st.integers(min_value=0, max_value=24))
    value_size = draw(st.integers(min_value=0, max_value=12))
    key_lengths = draw(st.sampled_from([[key_size], [key_size, key_size + 1], None]))
    value_lengths = draw(st.sampled_from([[value_size], [0, value_size], None]))
    keys = (
        st.binary(max_size=24)
        if key_lengths is None
        else st.sampled_from(key_lengths).flatmap(lambda n: st.binary(min_size=n, max_size=n))
    )
    puts = (
        st.binary(max_size=40)
        if value_lengths is None
        else st.sampled_from(value_lengths).flatmap(lambda n: st.binary(min_size=n, max_size=n))
    )
    values = puts if header.kind == "snapshot" else st.one_of(st.none(), puts)
    records = sorted(draw(st.dictionaries(keys, values, max_size=60)).items())
    return header, records, draw(st.sampled_from(["none", "zstd"]))


@settings(max_examples=400, deadline=None)
@given(files())
def test_round_trip_returns_the_records_and_header_from_bytes_and_stream(
    case: tuple[FileHeader, list[tuple[bytes, bytes | None]], str],
) -> None:
    header, records, compression = case
    data = encode(header, records, compression=compression)
    assert verify(data, name="f") == header
    assert read_header(data, name="f") == header
    from_bytes = iter_records(data, name="f")
    assert from_bytes.header == header
    assert list(from_bytes) == records
    from_stream = iter_records(trickle(data, 7), name="f")
    assert from_stream.header == header
    assert list(from_stream) == records


@pytest.mark.parametrize("compression", ["none", "zstd"])
@pytest.mark.parametrize("header", [DELTA, SNAPSHOT])
def test_empty_file_round_trips(header: FileHeader, compression: str) -> None:
    data = encode(header, [], compression=compression)
    assert verify(data, name="empty") == header
    assert list(iter_records(data, name="empty")) == []
    assert list(iter_records(io.BytesIO(data), name="empty")) == []


@pytest.mark.parametrize("version", VERSIONS)
@pytest.mark.parametrize("compression", ["none", "zstd"])
def test_records_straddling_blocks_and_a_record_bigger_than_blocks_round_trip(compression: str, version: int) -> None:
    records: list[tuple[bytes, bytes | None]] = [(b"k%07d" % i, b"v" * (i % 97)) for i in range(60_000)]
    records.insert(30_000, (b"k0029999~huge", bytes(range(256)) * (3 * 4096 + 7)))  # ~3 MiB, > 2 blocks
    records[40_000] = (records[40_000][0], None)
    data = encode(in_version(DELTA, version), records, compression=compression)
    assert list(iter_records(data, name="big")) == records
    assert list(iter_records(trickle(data, 100_003), name="big")) == records


def uncompressed_blocks(data: bytes) -> list[tuple[int, int, int]]:
    """(record count, flags, key+value bytes) of each block of an uncompressed version 2, 3 or 4 file."""
    version = fmt.read_header(data, name="x").format_version
    body = data[fmt.header_size(data[:16], name="x") : -(fmt.FOOTER_SIZE + fmt.trailer_size(version))]
    blocks = []
    position = 0
    while position < len(body):
        count, flags, key_bytes, value_bytes = struct.unpack_from("<IBII", body, position)
        blocks.append((count, flags, key_bytes + value_bytes))
        lengths = (4 if flags & 2 else 4 * count) + (4 if flags & 4 else 4 * count)
        position += 13 + (count if flags & 1 else 0) + lengths + key_bytes + value_bytes
    return blocks


def test_version_2_cuts_blocks_at_the_record_cap_and_at_about_a_mebibyte() -> None:
    """Small records fill blocks of BLOCK_MAX_RECORDS; big ones close a block at about 1 MiB (bounded memory)."""
    small = [(b"%08d" % i, b"") for i in range(fmt.BLOCK_MAX_RECORDS + 5)]
    assert [count for count, _, _ in uncompressed_blocks(encode(SNAPSHOT, small, compression="none"))] == [
        fmt.BLOCK_MAX_RECORDS,
        5,
    ]
    big: list[tuple[bytes, bytes | None]] = [(b"%08d" % i, b"x" * 30_000 if i % 3 else None) for i in range(300)]
    blocks = uncompressed_blocks(encode(DELTA, big, compression="none"))
    assert sum(count for count, _, _ in blocks) == 300
    assert len(blocks) >= 4
    assert all(size <= 2 * (1 << 20) for _, _, size in blocks)
    # every block holds a delete, so every block has op bytes; keys of one length, values longer than planes take
    assert {flags for _, flags, _ in blocks} == {1 | 2}


@pytest.mark.parametrize("version", [2, 3])
def test_a_block_without_deletes_has_no_op_bytes(version: int) -> None:
    data = encode(in_version(DELTA, version), [(b"a", b"1"), (b"bb", b"2")], compression="none")
    assert uncompressed_blocks(data) == [(2, 0 if version == 2 else 4, 5)]


def test_version_3_stores_a_column_of_one_length_once_and_as_byte_planes() -> None:
    records: list[tuple[bytes, bytes | None]] = [(b"k%04d" % i, b"%08d" % (i * i)) for i in range(300)]
    data = encode(SNAPSHOT, records, compression="none")
    assert uncompressed_blocks(data) == [(300, 2 | 4, 300 * 13)]
    body = data[fmt.header_size(data[:16], name="x") : -fmt.FOOTER_SIZE - fmt.TRAILER_SIZE]
    assert body == fixed_block_of(records)  # the layout as docs/formats-changelog.md describes it, built by hand
    keys_start = 13 + 4 + 4
    assert body[keys_start : keys_start + 600] == b"k" * 300 + b"0" * 300  # every key's first byte, then second byte
    values_start = keys_start + 300 * 5
    assert body[values_start : values_start + 900] == b"0" * 900  # the first three value planes (i * i < 10 ** 5)


def test_version_3_value_planes_hold_the_puts_only_and_deletes_keep_their_place() -> None:
    records: list[tuple[bytes, bytes | None]] = [
        (b"k%03d" % i, None if i % 7 in (0, 3) else b"v%03d" % i) for i in range(100)
    ]
    data = encode(DELTA, records, compression="none")
    assert uncompressed_blocks(data) == [(100, 1 | 2 | 4, 400 + 4 * sum(v is not None for _, v in records))]
    body = data[fmt.header_size(data[:16], name="x") : -fmt.FOOTER_SIZE - fmt.TRAILER_SIZE]
    assert body == fixed_block_of(records)
    assert list(iter_records(data, name="f")) == records
    assert list(iter_records(io.BytesIO(data), name="f")) == records


@pytest.mark.parametrize(
    ("records", "flags"),
    [
        pytest.param(
            [(b"a", b"x" * (fmt.PLANES_MAX_LENGTH + 1)), (b"b", b"y" * (fmt.PLANES_MAX_LENGTH + 1))],
            2,
            id="values-longer-than-planes-take",
        ),
        pytest.param([(b"a", b"1"), (b"bb", b"2")], 4, id="keys-of-two-lengths"),
        pytest.param([(b"a", b"1"), (b"b", b"22"), (b"c", None)], 1 | 2, id="values-of-two-lengths"),
        pytest.param([(b"a", None), (b"b", None)], 1 | 2, id="deletes-only"),
        pytest.param([(b"a", b""), (b"b", b""), (b"c", None)], 1 | 2 | 4, id="empty-values"),
        pytest.param([(b"", b"v")], 2 | 4, id="one-empty-key"),
    ],
)
def test_version_3_uses_planes_only_for_a_column_of_one_short_length(
    records: list[tuple[bytes, bytes | None]], flags: int
) -> None:
    data = encode(DELTA, records, compression="none")
    assert [block_flags for _, block_flags, _ in uncompressed_blocks(data)] == [flags]
    assert list(iter_records(data, name="f")) == records
    assert list(iter_records(io.BytesIO(data), name="f")) == records


@settings(max_examples=150, deadline=None)
@given(st.data())
def test_small_blocks_of_fixed_and_varied_columns_round_trip(data: st.DataObject) -> None:
    """Many blocks per file (a block budget of a few bytes): blocks with one key length or several, one value length
    or several, empty values and deletes follow each other in one file, in every columnar version."""
    version = data.draw(st.sampled_from([2, 3]))
    key_size = data.draw(st.integers(min_value=1, max_value=6))
    keys = st.one_of(st.binary(min_size=key_size, max_size=key_size), st.binary(max_size=8))
    values = st.one_of(st.none(), st.just(b""), st.binary(min_size=8, max_size=8), st.binary(max_size=12))
    records = sorted(data.draw(st.dictionaries(keys, values, max_size=80)).items())
    budget = data.draw(st.integers(min_value=1, max_value=64))
    default = recordformat.BLOCK_BYTES
    recordformat.BLOCK_BYTES = budget
    try:
        encoded = encode(in_version(DELTA, version), records, compression=data.draw(st.sampled_from(["none", "zstd"])))
    finally:
        recordformat.BLOCK_BYTES = default
    assert verify(encoded, name="f") == in_version(DELTA, version)
    assert list(iter_records(encoded, name="f")) == records
    assert list(iter_records(trickle(encoded, 5), name="f")) == records


def test_version_2_records_come_from_c_iterators_chained_per_block() -> None:
    """No Python frame per record: a consumer such as LMDB's putmulti pulls from a chain of zip objects."""
    data = encode(SNAPSHOT, [(b"%05d" % i, b"v") for i in range(100)])
    for reader in (iter_records(data, name="f"), iter_records(io.BytesIO(data), name="f")):
        records = iter(reader)
        assert type(records).__name__ == "chain"
        first = next(records)
        assert first == (b"00000", b"v")
        assert len(list(records)) == 99


@pytest.mark.parametrize("version", VERSIONS)
def test_write_file_streams_to_an_unseekable_output_and_reports_stats(version: int) -> None:
    out = UnseekableWriter()
    stats = write_file(out, in_version(DELTA, version), SMALL_DELTA)  # type: ignore[arg-type]
    data = b"".join(out.chunks)
    assert stats == fmt.FileStats(
        record_count=4, raw_bytes=sum(len(k) + len(v or b"") for k, v in SMALL_DELTA), file_bytes=len(data)
    )
    assert list(iter_records(data, name="f")) == SMALL_DELTA


def test_stream_reading_equals_bytes_reading_and_leaves_the_stream_at_its_end() -> None:
    data = encode(SNAPSHOT, [(b"%05d" % i, b"x%d" % i) for i in range(5000)])
    stream = io.BytesIO(data)
    assert list(iter_records(stream, name="s")) == list(iter_records(data, name="s"))
    assert stream.tell() == len(data)


def test_read_header_needs_only_the_header_bytes() -> None:
    data = encode(DELTA, SMALL_DELTA)
    size = fmt.header_size(data[: fmt.HEADER_PREFIX_SIZE], name="f")
    assert read_header(data[:size], name="f") == DELTA
    with pytest.raises(CorruptDataError, match=f"truncated at byte {size - 1}"):
        read_header(data[: size - 1], name="f")


# ----------------------------------------------------------------------------------------------------- bad input


@pytest.mark.parametrize("version", VERSIONS)
def test_unsorted_keys_are_rejected_and_no_footer_is_written(version: int) -> None:
    out = io.BytesIO()
    with pytest.raises(StateBackendError, match="record 1 has key b'a' after b'b'"):
        write_file(out, in_version(DELTA, version), [(b"b", b"1"), (b"a", b"2")])
    with pytest.raises(CorruptDataError):
        verify(out.getvalue(), name="partial")


@pytest.mark.parametrize("version", VERSIONS)
def test_duplicate_keys_are_rejected(version: int) -> None:
    with pytest.raises(StateBackendError, match="strictly increasing"):
        encode(in_version(DELTA, version), [(b"a", b"1"), (b"a", None)])


def test_keys_out_of_order_across_a_block_boundary_are_rejected_with_their_index() -> None:
    records = [(b"%08d" % i, b"") for i in range(fmt.BLOCK_MAX_RECORDS)] + [(b"0", b"")]
    with pytest.raises(StateBackendError, match=f"record {fmt.BLOCK_MAX_RECORDS} has key b'0' after b'00065535'"):
        encode(SNAPSHOT, records)


@pytest.mark.parametrize("version", VERSIONS)
def test_a_delete_in_a_snapshot_is_rejected(version: int) -> None:
    with pytest.raises(StateBackendError, match=r"snapshot holds puts only, record 1 \(key b'b'\)"):
        encode(in_version(SNAPSHOT, version), [(b"a", b"1"), (b"b", None)])


def test_a_format_version_this_release_does_not_write_is_refused() -> None:
    with pytest.raises(StateBackendError, match=r"writes format versions \[1, 2, 3, 4\], the header asks for 5"):
        encode(in_version(DELTA, 5), SMALL_DELTA)


def test_unknown_compression_lists_the_allowed_ones() -> None:
    with pytest.raises(StateBackendError, match=r"\['none', 'zstd'\]"):
        encode(DELTA, [], compression="gzip")


def test_file_header_rejects_a_delta_whose_base_is_not_the_previous_version() -> None:
    with pytest.raises(StateBackendError, match="base_seq == seq - 1"):
        FileHeader(kind="delta", job="j", task="t", store="s", checkpoint_id="c", token="t", seq=5, base_seq=5)
    with pytest.raises(StateBackendError, match="base_seq == seq"):
        attrs.evolve(SNAPSHOT, base_seq=4)


# ---------------------------------------------------------------------------------------------------- corruption


@pytest.mark.parametrize("records", [SMALL_DELTA, FIXED_DELTA], ids=["varied", "fixed"])
@pytest.mark.parametrize("version", VERSIONS)
@pytest.mark.parametrize("compression", ["none", "zstd"])
@pytest.mark.parametrize("mask", [0x01, 0x80, 0xFF])
def test_every_flipped_byte_is_detected(
    compression: str, mask: int, version: int, records: list[tuple[bytes, bytes | None]]
) -> None:
    data = encode(in_version(DELTA, version), records, compression=compression)
    for position in range(len(data)):
        corrupt = bytearray(data)
        corrupt[position] ^= mask
        corrupt_bytes = bytes(corrupt)
        with pytest.raises((CorruptDataError, IncompatibleFormatError)):
            verify(corrupt_bytes, name="flipped")
        with pytest.raises((CorruptDataError, IncompatibleFormatError)):
            list(iter_records(corrupt_bytes, name="flipped"))
        with pytest.raises((CorruptDataError, IncompatibleFormatError)):
            list(iter_records(io.BytesIO(corrupt_bytes), name="flipped"))


@pytest.mark.parametrize("version", VERSIONS)
def test_a_flipped_body_byte_yields_nothing_from_bytes(version: int) -> None:
    data = bytearray(encode(in_version(DELTA, version), SMALL_DELTA, compression="none"))
    data[len(data) - fmt.FOOTER_SIZE - fmt.trailer_size(version) - 3] ^= 0x20  # inside the last value: still valid
    yielded = []
    with pytest.raises(CorruptDataError, match="checksum mismatch"):
        for record in iter_records(bytes(data), name="flipped"):
            yielded.append(record)  # noqa: PERF402 - a loop keeps what was yielded before the error
    assert yielded == []


@pytest.mark.parametrize("records", [SMALL_DELTA, FIXED_DELTA], ids=["varied", "fixed"])
@pytest.mark.parametrize("version", VERSIONS)
@pytest.mark.parametrize("compression", ["none", "zstd"])
def test_every_truncation_is_detected(
    compression: str, version: int, records: list[tuple[bytes, bytes | None]]
) -> None:
    data = encode(in_version(DELTA, version), records, compression=compression)
    for length in range(len(data)):
        cut = data[:length]
        with pytest.raises(CorruptDataError, match="truncated|bad magic|end marker|footer") as info:
            verify(cut, name="cut")
        assert "cut" in str(info.value)
        with pytest.raises(CorruptDataError):
            list(iter_records(io.BytesIO(cut), name="cut"))


def test_bad_magic_is_named() -> None:
    data = b"PK\x03\x04" + encode(DELTA, [])[4:]
    with pytest.raises(CorruptDataError, match=r"zip-blob: not a changelog file \(bad magic"):
        verify(data, name="zip-blob")


def test_a_newer_format_version_is_incompatible_and_names_the_versions() -> None:
    data = bytearray(encode(DELTA, SMALL_DELTA))
    struct.pack_into("<H", data, 8, 5)
    with pytest.raises(
        IncompatibleFormatError, match=r"future: changelog format version 5 .*supported: \[1, 2, 3, 4\]"
    ):
        read_header(bytes(data), name="future")
    with pytest.raises(IncompatibleFormatError):
        list(iter_records(io.BytesIO(bytes(data)), name="future"))


# ------------------------------------------------------------------------------------------------ stored samples


def stored_samples() -> list[str]:
    names = sorted(path.name for path in SAMPLES.glob("v*.sbchlog"))
    versions = {int(name[1:].split("-")[0]) for name in names}
    assert versions == set(fmt.SUPPORTED_FORMAT_VERSIONS), "a stored sample of every supported version"
    return names


@pytest.mark.parametrize("name", stored_samples())
def test_stored_sample_decodes_to_the_expected_records(name: str) -> None:
    version = name[1:].split("-")[0]
    expected = json.loads((SAMPLES / f"expected-v{version}.json").read_text())[name]
    data = (SAMPLES / name).read_bytes()
    header = FileHeader(**expected["header"])
    records = [(bytes.fromhex(k), None if v is None else bytes.fromhex(v)) for k, v in expected["records"]]
    assert verify(data, name=name) == header
    assert list(iter_records(data, name=name)) == records
    assert list(iter_records(io.BytesIO(data), name=name)) == records


@pytest.mark.parametrize("name", [n for n in stored_samples() if n.endswith("-none.sbchlog")])
def test_writer_still_writes_every_version_byte_for_byte(name: str) -> None:
    """The writer must not drift from the stored uncompressed samples of any version it writes."""
    version = name[1:].split("-")[0]
    expected = json.loads((SAMPLES / f"expected-v{version}.json").read_text())[name]
    records = [(bytes.fromhex(k), None if v is None else bytes.fromhex(v)) for k, v in expected["records"]]
    data = encode(FileHeader(**expected["header"]), records, compression="none")
    stored = (SAMPLES / name).read_bytes()
    # from version 4 every write ends in a nonce trailer of its own: the same bytes up to it, never the same nonce
    assert without_trailer(data) == without_trailer(stored)
    assert (data == stored) == (int(version) < 4)


def test_the_default_is_the_newest_version() -> None:
    assert fmt.FORMAT_VERSION == max(fmt.SUPPORTED_FORMAT_VERSIONS) == 4
    assert read_header(encode(attrs.evolve(DELTA), []), name="f").format_version == 4


# ------------------------------------------------------------------------------------------- inside a transaction


def loaded_store(tmp_path: pathlib.Path) -> LocalStore:
    store = LocalStore.open(tmp_path / "store", name="counts")
    store.replace_contents(iter([(b"old", b"1")]), LocalVersion("1-1", "aa"))
    return store


@pytest.mark.parametrize("version", VERSIONS)
def test_a_stream_whose_checksum_fails_at_the_end_loads_nothing_into_the_store(
    tmp_path: pathlib.Path, version: int
) -> None:
    """The footer checks run inside putmulti's loop, so they abort replace_contents' transaction."""
    records = [(b"%06d" % i, b"v%d" % i) for i in range(70_000)]
    data = bytearray(encode(in_version(SNAPSHOT, version), records, compression="none"))
    data[-fmt.FOOTER_SIZE - fmt.trailer_size(version) - 2] ^= 0x01  # the last value: the digest does not match
    with loaded_store(tmp_path) as store:
        with pytest.raises(CorruptDataError, match="checksum mismatch"):
            snapshot = iter_records(io.BytesIO(bytes(data)), name="snap")
            store.replace_contents(snapshot, LocalVersion("2-1", "bb"))  # type: ignore[arg-type]  # a snapshot: no deletes
        assert list(store.items()) == [(b"old", b"1")]
        assert store.version == LocalVersion("1-1", "aa")


def test_a_delta_with_a_wrong_count_applies_nothing(tmp_path: pathlib.Path) -> None:
    data = hand_built(DELTA, block_of([(b"new", b"2"), (b"old", None)]), count=3)
    check_digest(data, name="delta")  # the digest is right; the count is not
    with loaded_store(tmp_path) as store:
        with pytest.raises(CorruptDataError, match="record count mismatch"):
            store.apply_changes(iter_records(data, name="delta", verified=True), LocalVersion("2-1", "bb"))
        assert list(store.items()) == [(b"old", b"1")]


def test_the_stored_version_3_samples_hold_blocks_of_every_column_layout() -> None:
    """The samples stand for what version 3 writes: planes for both columns (with deletes), for keys only, neither."""
    assert [flags for _, flags, _ in uncompressed_blocks((SAMPLES / "v3-delta-fixed-none.sbchlog").read_bytes())] == [7]
    assert [flags for _, flags, _ in uncompressed_blocks((SAMPLES / "v3-snapshot-none.sbchlog").read_bytes())] == [2]
    assert [flags for _, flags, _ in uncompressed_blocks((SAMPLES / "v3-delta-none.sbchlog").read_bytes())] == [1]


@settings(max_examples=60, deadline=None)
@given(data=st.data())
def test_records_given_as_columns_make_the_same_file_as_the_same_records_given_as_pairs(data: st.DataObject) -> None:
    """What a flushed batch hands the delta's encoder (two sorted columns) writes byte for byte the file its records as
    pairs write, in every version, with and without compression, deletes and empty values included."""
    keys = sorted(data.draw(st.sets(st.binary(min_size=1, max_size=12), max_size=300)))
    values = [data.draw(st.one_of(st.none(), st.binary(max_size=40))) for _ in keys]
    version = data.draw(st.sampled_from(VERSIONS))
    compression = data.draw(st.sampled_from(["none", "zstd"]))
    header = in_version(DELTA, version)
    pairs = list(zip(keys, values, strict=True))
    columns = fmt.RecordColumns(keys, values)
    assert without_trailer(encode(header, columns, compression=compression)) == without_trailer(
        encode(header, pairs, compression=compression)
    )
    assert list(iter_records(encode(header, columns, compression=compression), name="columns")) == pairs


def test_columns_out_of_order_or_with_a_delete_in_a_snapshot_are_refused_as_pairs_are() -> None:
    with pytest.raises(StateBackendError, match="increasing"):
        encode(DELTA, fmt.RecordColumns([b"b", b"a"], [b"1", b"2"]))
    with pytest.raises(StateBackendError, match="a snapshot holds puts only"):
        encode(SNAPSHOT, fmt.RecordColumns([b"a", b"b"], [b"1", None]))
    with pytest.raises(StateBackendError, match="2 keys and 1 values"):
        fmt.RecordColumns([b"a", b"b"], [b"1"])


def test_a_flushed_change_set_hands_out_its_records_as_sorted_columns(tmp_path: pathlib.Path) -> None:
    store = LocalStore.open(tmp_path / "store", name="s")
    try:
        store.put(b"b", b"2")
        store.put(b"a", b"1")
        store.put(b"c", b"3")
        store.delete(b"c")
        change = store.flush(LocalVersion("1", "v1"))
        columns = change.columns()
        assert columns is not None
        assert (list(columns.keys), list(columns.values)) == ([b"a", b"b", b"c"], [b"1", b"2", None])
        assert list(columns) == list(change) == [(b"a", b"1"), (b"b", b"2"), (b"c", None)]
        change.close()
        with pytest.raises(StateBackendError, match="closed"):
            change.columns()
    finally:
        store.close()
