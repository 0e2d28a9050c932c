"""Decoding a record file's body: the records of the uncompressed body, every one checked on the way.

:func:`parse_records` decodes version 1 (a 9-byte prefix per record, a record may straddle the blocks it is read
in); :func:`parse_blocks` decodes versions 2 and 3 (columnar blocks, one ``zip(keys, values)`` per block, C doing
the per-record work). Both check the key order, the ops a kind allows and every length, raise
:class:`CorruptDataError` naming the blob, the record and the body byte, and return the record count when done, for
the caller to compare with the footer's. A block or record that declares more than
:data:`~statebackend.recordfile.format.MAX_BLOCK_BYTES` is refused before a byte of it is read (or decompressed).
"""

from __future__ import annotations

from array import array
from collections.abc import Callable, Generator, Iterable, Iterator, Sequence
from itertools import islice
from operator import lt

import statebackend.recordfile.format as fileformat
from statebackend.errors import CorruptDataError
from statebackend.recordfile.columns import block_struct, column_struct, from_planes, u32_array
from statebackend.recordfile.format import (
    BLOCK_HEADER,
    BLOCK_HEADER_SIZE,
    BLOCK_MAX_RECORDS,
    FLAG_KEYS_FIXED,
    FLAG_OPS,
    FLAG_VALUES_FIXED,
    OP_DELETE,
    OP_PUT,
    RECORD_PREFIX,
    RECORD_PREFIX_SIZE,
    VALID_FLAGS,
    Record,
)

__all__ = ["parse_blocks", "parse_records"]

_unpack_record_prefix = RECORD_PREFIX.unpack_from
_unpack_block_header = BLOCK_HEADER.unpack_from
#: a reader asks its source for at most this many bytes per call, so a corrupt block size costs no big allocation
_READ_MAX = 16 << 20


def parse_records(
    blocks: Iterable[bytes], *, name: str, allow_delete: bool, emit: bool = True
) -> Generator[Record, None, int]:
    """Records from uncompressed body blocks (a record may straddle blocks); returns the count when done.

    ``emit=False`` checks every record without yielding any (what verify needs): about a third cheaper.
    """
    unpack = _unpack_record_prefix
    prefix_size = RECORD_PREFIX_SIZE
    limit = fileformat.MAX_BLOCK_BYTES
    count = 0
    prev = b""
    base = 0  # body offset of buf[0], for messages
    tail = b""  # the unread end of the previous block
    big: bytearray | None = None  # collects a record much larger than a block, copying each byte once
    need = 0
    for chunk in blocks:
        if big is not None:
            big += chunk
            if len(big) < need:
                continue
            buf = bytes(big)
            big = None
        elif tail:
            buf = tail + chunk
        else:
            buf = chunk
        pos = 0
        end = len(buf)
        while pos + prefix_size <= end:
            op, klen, vlen = unpack(buf, pos)
            key_start = pos + prefix_size
            value_start = key_start + klen
            record_end = value_start + vlen
            if record_end > end:
                break
            key = buf[key_start:value_start]
            # prev starts as b"": only an empty first key compares <= it, and count is 0 then
            if key <= prev and count:
                raise CorruptDataError(
                    f"{name}: record {count} at body byte {base + pos} has key {key[:64]!r}, "
                    f"not after {prev[:64]!r}; keys must strictly increase"
                )
            if op == OP_PUT:
                if emit:
                    yield key, buf[value_start:record_end]
            elif op == OP_DELETE and allow_delete and vlen == 0:
                if emit:
                    yield key, None
            else:
                raise CorruptDataError(
                    f"{name}: record {count} at body byte {base + pos} has op {op} and value "
                    f"length {vlen}, not a valid {'delta' if allow_delete else 'snapshot'} record"
                )
            prev = key
            pos = record_end
            count += 1
        base += pos
        tail = buf[pos:]
        if len(tail) >= prefix_size:
            _, klen, vlen = unpack(tail, 0)
            if klen + vlen > limit:  # checked before the record is collected: its bytes are not read
                raise CorruptDataError(
                    f"{name}: record {count} at body byte {base} declares {klen} key and {vlen} "
                    f"value bytes, more than the {limit} a record may hold (MAX_BLOCK_BYTES); "
                    "the file is corrupt"
                )
            need = prefix_size + klen + vlen
            if need > 2 * fileformat.BLOCK_BYTES:
                big = bytearray(tail)
                tail = b""
    left = len(big) if big is not None else len(tail)
    if left:
        raise CorruptDataError(
            f"{name}: the body ends inside record {count} at body byte {base} "
            f"({left} bytes left over); the file is truncated or corrupt"
        )
    return count


def parse_blocks(
    read: Callable[[int], bytes], *, name: str, allow_delete: bool, version: int, emit: bool = True
) -> Generator[Iterator[Record], None, int]:
    """Versions 2 and 3: one ``zip(keys, values)`` per block of the uncompressed body (read with ``read(size)``),
    every block checked before it is yielded; returns the record count when done.

    Per block, the lengths are read as u32 arrays, and the keys and values are cut by one ``struct`` call whose
    format (``"5s3s..."``) is built from the lengths: C does the per-record work. A version 3 column of one length
    is put back from its byte planes by one slice assignment per plane, then cut by one cached struct. ``emit=False``
    builds no values and yields nothing (what verify needs).
    """
    valid_flags = VALID_FLAGS[version]
    limit = fileformat.MAX_BLOCK_BYTES
    count = 0
    offset = 0  # body offset of the current block, for messages
    previous: bytes | None = None  # the last key of the previous block
    while True:
        head = _read_exactly(read, BLOCK_HEADER_SIZE)
        if not head:
            return count
        if len(head) < BLOCK_HEADER_SIZE:
            raise CorruptDataError(
                f"{name}: the body ends inside the header of the block at body byte {offset} "
                f"(record {count}); the file is truncated or corrupt"
            )
        n, flags, key_bytes, value_bytes = _unpack_block_header(head)
        if not 0 < n <= BLOCK_MAX_RECORDS or flags & ~valid_flags:
            raise CorruptDataError(
                f"{name}: the block at body byte {offset} (record {count}) has record count {n} "
                f"and flags {flags}; a valid version {version} block has 1..{BLOCK_MAX_RECORDS} "
                f"records and flags within {valid_flags}; the file is corrupt"
            )
        if key_bytes + value_bytes > limit:  # checked before any of the block is read (or decompressed)
            raise CorruptDataError(
                f"{name}: the block at body byte {offset} (record {count}) declares {key_bytes} "
                f"key and {value_bytes} value bytes, more than the {limit} a block may hold "
                "(MAX_BLOCK_BYTES); the file is corrupt"
            )
        has_ops = flags & FLAG_OPS
        if has_ops and not allow_delete:
            raise CorruptDataError(
                f"{name}: the block at body byte {offset} (record {count}) has op bytes, not a "
                "valid snapshot record block (a snapshot holds puts only)"
            )
        keys_fixed = flags & FLAG_KEYS_FIXED
        values_fixed = flags & FLAG_VALUES_FIXED
        ops_size = n if has_ops else 0
        key_lengths_size = 4 if keys_fixed else 4 * n
        value_lengths_size = 4 if values_fixed else 4 * n
        data_start = ops_size + key_lengths_size + value_lengths_size
        size = data_start + key_bytes + value_bytes
        block = _read_exactly(read, size)
        if len(block) < size:
            raise CorruptDataError(
                f"{name}: the body ends inside the block at body byte {offset} (records {count} "
                f"to {count + n - 1}: {len(block)} of {size} bytes); the file is truncated or "
                "corrupt"
            )
        deletes = _delete_positions(block[:ops_size], offset, count, name=name) if has_ops else []
        if not (keys_fixed or values_fixed):  # version 2's layout: one struct cuts keys and values
            key_lengths = u32_array(block, ops_size, n)
            value_lengths = u32_array(block, ops_size + 4 * n, n)
            cut = block_struct(key_lengths, value_lengths, n, emit)
            # the struct's size is the sum of the lengths it cuts: compare it (free) rather than summing the arrays
            if cut.size != (key_bytes + value_bytes if emit else key_bytes) or (
                not emit and sum(value_lengths) != value_bytes
            ):
                _raise_bad_lengths(offset, count, key_bytes, value_bytes, name=name)
            _check_deletes_have_no_value(deletes, value_lengths, offset, count, name=name)
            unpacked = cut.unpack_from(block, data_start)
            keys: Sequence[bytes] = unpacked[:n] if emit else unpacked
            values: Sequence[bytes | None] = unpacked[n:]
        else:
            puts = n - len(deletes)
            if keys_fixed:
                (key_length,) = u32_array(block, ops_size, 1)
                if key_length * n != key_bytes:
                    _raise_bad_lengths(
                        offset, count, key_bytes, value_bytes, name=name, detail=f"{n} keys of length {key_length}"
                    )
                keys = from_planes(block, data_start, n, key_length)
            else:
                key_cut = column_struct(u32_array(block, ops_size, n), n)
                if key_cut.size != key_bytes:
                    _raise_bad_lengths(offset, count, key_bytes, value_bytes, name=name)
                keys = key_cut.unpack_from(block, data_start)
            value_start = data_start + key_bytes
            if values_fixed:
                (value_length,) = u32_array(block, ops_size + key_lengths_size, 1)
                if value_length * puts != value_bytes:
                    _raise_bad_lengths(
                        offset,
                        count,
                        key_bytes,
                        value_bytes,
                        name=name,
                        detail=f"{puts} values of length {value_length}",
                    )
                if emit:
                    values = from_planes(block, value_start, puts, value_length)
                    if deletes:
                        values = _with_deletes(values, deletes)
            else:
                value_lengths = u32_array(block, ops_size + key_lengths_size, n)
                _check_deletes_have_no_value(deletes, value_lengths, offset, count, name=name)
                if emit:
                    value_cut = column_struct(value_lengths, n)
                    if value_cut.size != value_bytes:
                        _raise_bad_lengths(offset, count, key_bytes, value_bytes, name=name)
                    values = value_cut.unpack_from(block, value_start)
                elif sum(value_lengths) != value_bytes:
                    _raise_bad_lengths(offset, count, key_bytes, value_bytes, name=name)
            deletes = deletes if not values_fixed else []  # the Nones are in place already
        if not (all(map(lt, keys, islice(keys, 1, None))) and (previous is None or previous < keys[0])):
            _raise_out_of_order(keys, previous, offset, count, name=name)
        if emit:
            if deletes:
                values = list(values)
                for index in deletes:  # a Python step per delete only, never per put
                    values[index] = None
            yield zip(keys, values, strict=True)
        previous = keys[-1]
        count += n
        offset += BLOCK_HEADER_SIZE + size


def _read_exactly(read: Callable[[int], bytes], size: int) -> bytes:
    """``size`` bytes from ``read``, fewer only at the end of the body; at most _READ_MAX bytes asked per call, so a
    corrupt size allocates no more than the body holds."""
    data = read(min(size, _READ_MAX))
    if len(data) >= size or not data:
        return data
    parts = [data]
    have = len(data)
    while have < size:
        chunk = read(min(size - have, _READ_MAX))
        if not chunk:
            break
        parts.append(chunk)
        have += len(chunk)
    return b"".join(parts)


def _with_deletes(puts: Sequence[bytes], deletes: list[int]) -> list[bytes | None]:
    """The values of a block whose column holds the puts' values only: ``None`` at each delete's position (in
    increasing order), the puts' values in order around them. A Python step per delete; runs of puts are copied
    by slices."""
    values: list[bytes | None] = []
    taken = 0  # puts' values placed so far
    position = 0  # the record the next value is for
    for index in deletes:
        run = index - position
        values += puts[taken : taken + run]
        values.append(None)
        taken += run
        position = index + 1
    values += puts[taken:]
    return values


def _raise_bad_lengths(
    offset: int, first_index: int, key_bytes: int, value_bytes: int, *, name: str, detail: str = "key and value lengths"
) -> None:
    raise CorruptDataError(
        f"{name}: the block at body byte {offset} (record {first_index}) has {detail} that do "
        f"not add up to its {key_bytes} key and {value_bytes} value bytes; the file is corrupt"
    )


def _delete_positions(ops: bytes, offset: int, first_index: int, *, name: str) -> list[int]:
    """Check a block's op bytes (puts and deletes only); the positions of its deletes, in increasing order."""
    if ops.count(OP_PUT) + ops.count(OP_DELETE) != len(ops):
        index = next(i for i, op in enumerate(ops) if op not in (OP_PUT, OP_DELETE))
        raise CorruptDataError(
            f"{name}: record {first_index + index} in the block at body byte {offset} has op "
            f"{ops[index]}, not a valid delta record"
        )
    deletes = []
    find = ops.find
    index = find(OP_DELETE)
    while index >= 0:  # bytes.find in C: a Python step per delete, none per put
        deletes.append(index)
        index = find(OP_DELETE, index + 1)
    return deletes


def _check_deletes_have_no_value(
    deletes: list[int], value_lengths: array[int], offset: int, first_index: int, *, name: str
) -> None:
    for index in deletes:
        if value_lengths[index]:
            raise CorruptDataError(
                f"{name}: record {first_index + index} in the block at body byte {offset} is a "
                f"delete with value length {value_lengths[index]}, not a valid delta record"
            )


def _raise_out_of_order(
    keys: Sequence[bytes], previous: bytes | None, offset: int, first_index: int, *, name: str
) -> None:
    before = previous
    for index, key in enumerate(keys):
        if before is not None and not before < key:
            raise CorruptDataError(
                f"{name}: record {first_index + index} in the block at body byte {offset} has "
                f"key {key[:64]!r}, not after {before[:64]!r}; keys must strictly increase"
            )
        before = key
    raise AssertionError("unreachable: the keys were out of order")  # pragma: no cover
