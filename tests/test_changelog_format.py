"""The changelog file format: round trips, stored samples of every version, and detection of every corruption."""

from __future__ import annotations

import hashlib
import io
import json
import pathlib
import struct
import zlib

import attrs
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from backends.changelog import format as fmt
from backends.changelog.format import FileHeader, encode, iter_records, read_header, verify, write_file
from statebackend.errors import CorruptDataError, IncompatibleFormatError, StateBackendError

SAMPLES = pathlib.Path(__file__).parent / "data" / "changelog"

DELTA = FileHeader(kind="delta", job="job", task="task-3", store="counts", checkpoint_id="1700000000000-1",
                   token="tok", seq=5, base_seq=4)
SNAPSHOT = FileHeader(kind="snapshot", job="job", task="task-3", store="counts", checkpoint_id="1700000000000-1",
                      token="tok", seq=5, base_seq=5)
SMALL_DELTA = [(b"a", b"1"), (b"b", None), (b"c", b""), (b"d\xff", b"value-d")]


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
        buffer[:n] = self._data[self._pos:self._pos + n]
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
    """A file built by hand (bypassing write_file) with a valid header CRC, footer and digest."""
    head = prefix_and_metadata + struct.pack("<I", zlib.crc32(prefix_and_metadata))
    covered = struct.pack("<QQ", count, len(body))
    digest = hashlib.blake2b(head + body + covered, digest_size=16).digest()
    return head + body + covered + digest + fmt.MAGIC_END


def header_prefix(data: bytes) -> bytes:
    """The prefix and metadata of an encoded file (everything before the header CRC)."""
    return data[: fmt.header_size(data[:16], name="x") - 4]


def body_of(records: list[tuple[bytes, bytes | None]]) -> bytes:
    out = b""
    for key, value in records:
        op, value_bytes = (2, b"") if value is None else (1, value)
        out += struct.pack("<BII", op, len(key), len(value_bytes)) + key + value_bytes
    return out


# ------------------------------------------------------------------------------------------------------- round trips


@st.composite
def files(draw: st.DrawFn) -> tuple[FileHeader, list[tuple[bytes, bytes | None]], str]:
    header = draw(st.sampled_from([DELTA, SNAPSHOT]))
    values = st.binary(max_size=40) if header.kind == "snapshot" else st.one_of(st.none(), st.binary(max_size=40))
    records = sorted(draw(st.dictionaries(st.binary(max_size=24), values, max_size=60)).items())
    return header, records, draw(st.sampled_from(["none", "zstd"]))


@settings(max_examples=150, deadline=None)
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
    from_stream = iter_records(TrickleReader(data, 7), name="f")
    assert from_stream.header == header
    assert list(from_stream) == records


@pytest.mark.parametrize("compression", ["none", "zstd"])
@pytest.mark.parametrize("header", [DELTA, SNAPSHOT])
def test_empty_file_round_trips(header: FileHeader, compression: str) -> None:
    data = encode(header, [], compression=compression)
    assert verify(data, name="empty") == header
    assert list(iter_records(data, name="empty")) == []
    assert list(iter_records(io.BytesIO(data), name="empty")) == []


@pytest.mark.parametrize("compression", ["none", "zstd"])
def test_records_straddling_blocks_and_a_record_bigger_than_blocks_round_trip(compression: str) -> None:
    records: list[tuple[bytes, bytes | None]] = [(b"k%07d" % i, b"v" * (i % 97)) for i in range(60_000)]
    records.insert(30_000, (b"k0029999~huge", bytes(range(256)) * (3 * 4096 + 7)))  # ~3 MiB, > 2 blocks
    data = encode(DELTA, records, compression=compression)
    assert list(iter_records(data, name="big")) == records
    assert list(iter_records(TrickleReader(data, 100_003), name="big")) == records


def test_write_file_streams_to_an_unseekable_output_and_reports_stats() -> None:
    out = UnseekableWriter()
    stats = write_file(out, DELTA, SMALL_DELTA)  # type: ignore[arg-type]
    data = b"".join(out.chunks)
    assert stats == fmt.FileStats(record_count=4, raw_bytes=sum(len(k) + len(v or b"") for k, v in SMALL_DELTA),
                                  file_bytes=len(data))
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


def test_unsorted_keys_are_rejected_and_no_footer_is_written() -> None:
    out = io.BytesIO()
    with pytest.raises(StateBackendError, match="strictly increasing"):
        write_file(out, DELTA, [(b"b", b"1"), (b"a", b"2")])
    with pytest.raises(CorruptDataError):
        verify(out.getvalue(), name="partial")


def test_duplicate_keys_are_rejected() -> None:
    with pytest.raises(StateBackendError, match="strictly increasing"):
        encode(DELTA, [(b"a", b"1"), (b"a", None)])


def test_a_delete_in_a_snapshot_is_rejected() -> None:
    with pytest.raises(StateBackendError, match="snapshot holds puts only"):
        encode(SNAPSHOT, [(b"a", b"1"), (b"b", None)])


def test_unknown_compression_lists_the_allowed_ones() -> None:
    with pytest.raises(StateBackendError, match=r"\['none', 'zstd'\]"):
        encode(DELTA, [], compression="gzip")


def test_file_header_rejects_a_delta_whose_base_is_not_the_previous_version() -> None:
    with pytest.raises(StateBackendError, match="base_seq == seq - 1"):
        FileHeader(kind="delta", job="j", task="t", store="s", checkpoint_id="c", token="t", seq=5, base_seq=5)
    with pytest.raises(StateBackendError, match="base_seq == seq"):
        attrs.evolve(SNAPSHOT, base_seq=4)


# ---------------------------------------------------------------------------------------------------- corruption


@pytest.mark.parametrize("compression", ["none", "zstd"])
@pytest.mark.parametrize("mask", [0x01, 0x80, 0xFF])
def test_every_flipped_byte_is_detected(compression: str, mask: int) -> None:
    data = encode(DELTA, SMALL_DELTA, compression=compression)
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


def test_a_flipped_body_byte_yields_nothing_from_bytes() -> None:
    data = bytearray(encode(DELTA, SMALL_DELTA, compression="none"))
    data[len(data) - fmt.FOOTER_SIZE - 3] ^= 0x20  # inside the last value: structurally still valid
    yielded = []
    with pytest.raises(CorruptDataError, match="checksum mismatch"):
        for record in iter_records(bytes(data), name="flipped"):
            yielded.append(record)
    assert yielded == []


@pytest.mark.parametrize("compression", ["none", "zstd"])
def test_every_truncation_is_detected(compression: str) -> None:
    data = encode(DELTA, SMALL_DELTA, compression=compression)
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
    struct.pack_into("<H", data, 8, 2)
    with pytest.raises(IncompatibleFormatError, match=r"future: changelog format version 2 .*supported: \[1\]"):
        read_header(bytes(data), name="future")
    with pytest.raises(IncompatibleFormatError):
        list(iter_records(io.BytesIO(bytes(data)), name="future"))


def test_a_count_that_disagrees_with_the_body_is_a_count_mismatch() -> None:
    head = header_prefix(encode(DELTA, [], compression="none"))
    data = assemble(head, body_of(SMALL_DELTA), count=len(SMALL_DELTA) + 1)
    with pytest.raises(CorruptDataError, match="record count mismatch: the footer says 5, the body holds 4"):
        verify(data, name="f")
    with pytest.raises(CorruptDataError, match="record count mismatch"):
        list(iter_records(io.BytesIO(data), name="f"))


def test_unsorted_records_in_a_file_with_a_valid_checksum_are_rejected_by_the_reader() -> None:
    head = header_prefix(encode(DELTA, [], compression="none"))
    data = assemble(head, body_of([(b"b", b"1"), (b"a", b"2")]), count=2)
    with pytest.raises(CorruptDataError, match="keys must strictly increase"):
        verify(data, name="f")
    with pytest.raises(CorruptDataError, match="keys must strictly increase"):
        list(iter_records(data, name="f", verified=True))


def test_a_delete_in_a_snapshot_file_is_rejected_by_the_reader() -> None:
    head = header_prefix(encode(SNAPSHOT, [], compression="none"))
    data = assemble(head, body_of([(b"a", b"1"), (b"b", None)]), count=2)
    with pytest.raises(CorruptDataError, match="not a valid snapshot record"):
        verify(data, name="f")


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


@pytest.mark.parametrize("name", [n for n in stored_samples() if n.startswith("v1-") and n.endswith("-none.sbchlog")])
def test_writer_still_writes_version_1_byte_for_byte(name: str) -> None:
    """The writer must not drift from the stored uncompressed samples (retarget when FORMAT_VERSION changes)."""
    expected = json.loads((SAMPLES / "expected-v1.json").read_text())[name]
    records = [(bytes.fromhex(k), None if v is None else bytes.fromhex(v)) for k, v in expected["records"]]
    data = encode(FileHeader(**expected["header"]), records, compression="none")
    assert data == (SAMPLES / name).read_bytes()
