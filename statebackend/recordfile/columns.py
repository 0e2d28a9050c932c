"""Records as columns: how the writer takes its input, and the column codings writer and readers share.

A block of a version 2 or 3 body stores its records as columns (docs/formats-changelog.md): the lengths as u32
columns (:func:`u32_bytes`, :func:`u32_array`), the keys and the values concatenated, and in version 3 a column of
one length as byte planes (:func:`to_planes`, :func:`from_planes`). Readers cut a column by one ``struct`` call
whose format is built from its lengths (:func:`block_struct`, :func:`column_struct`), so C does the per-record work;
the compiled structs of the common shapes are cached. The writer takes records a chunk at a time, from tuples
(:func:`record_chunks`) or from :class:`RecordColumns` as they are (:func:`column_chunks`).
"""

from __future__ import annotations

import struct
import sys
from array import array
from collections.abc import Callable, Iterator, Sequence
from itertools import islice

import attrs

from statebackend.errors import UsageError

__all__ = [
    "RecordColumns",
    "block_struct",
    "column_chunks",
    "column_struct",
    "fixed_struct",
    "from_planes",
    "record_chunks",
    "to_planes",
    "u32_array",
    "u32_bytes",
]

_U32 = "I" if array("I").itemsize == 4 else "L"
_BIG_ENDIAN = sys.byteorder == "big"


@attrs.frozen
class RecordColumns:
    """Records given as two columns: ``keys[i]`` with ``values[i]`` (None: a delete), the keys strictly increasing.
    :func:`write_file` takes them as they are, slice by slice, without a tuple per record (what a sorted write batch
    already holds: building 12,500 tuples and splitting them again took about a third of a delta's encoding)."""

    keys: Sequence[bytes]
    values: Sequence[bytes | None]

    def __attrs_post_init__(self) -> None:
        if len(self.keys) != len(self.values):
            raise UsageError(f"record columns of {len(self.keys)} keys and {len(self.values)} values")

    def __iter__(self) -> Iterator[tuple[bytes, bytes | None]]:
        return zip(self.keys, self.values, strict=True)


def record_chunks(
    source: Iterator[tuple[bytes, bytes | None]],
) -> Callable[[int], tuple[Sequence[bytes], Sequence[bytes | None]]]:
    """The next (up to) ``take`` records of ``source`` as (keys, values): split by one ``zip`` in C."""

    def take_next(take: int) -> tuple[Sequence[bytes], Sequence[bytes | None]]:
        chunk = list(islice(source, take))
        if not chunk:
            return (), ()
        keys, values = zip(*chunk, strict=True)
        return keys, values

    return take_next


def column_chunks(columns: RecordColumns) -> Callable[[int], tuple[Sequence[bytes], Sequence[bytes | None]]]:
    """The next (up to) ``take`` records of ``columns``: two slices."""
    keys, values = columns.keys, columns.values
    position = 0

    def take_next(take: int) -> tuple[Sequence[bytes], Sequence[bytes | None]]:
        nonlocal position
        start, position = position, min(position + take, len(keys))
        return keys[start:position], values[start:position]

    return take_next


def u32_bytes(numbers: list[int]) -> bytes:
    """``numbers`` as little-endian u32s: a column of lengths, packed by one C call."""
    packed = array(_U32, numbers)
    if _BIG_ENDIAN:
        packed.byteswap()
    return packed.tobytes()


def u32_array(block: bytes, start: int, n: int) -> array[int]:
    """The ``n`` little-endian u32s at ``block[start:]``: a column of lengths, read by one C call."""
    numbers = array(_U32)
    numbers.frombytes(memoryview(block)[start : start + 4 * n])
    if _BIG_ENDIAN:
        numbers.byteswap()
    return numbers


def to_planes(data: bytes, n: int, length: int) -> bytes:
    """``n`` records of ``length`` bytes each (``data``, concatenated) as byte planes: the first byte of every record,
    then the second byte of every record, and so on. Records of one length in key order share bytes at the same
    position (a key's prefix, a small number's high bytes), which planes put next to each other for zstd.

    One C slice per plane, or per record when there are fewer records than bytes per record."""
    if n <= 1 or length <= 1:
        return data  # one record, or one plane: the planes are the data itself
    if length <= n:
        return b"".join([data[i::length] for i in range(length)])
    out = bytearray(len(data))
    for j in range(n):
        out[j::n] = data[j * length : (j + 1) * length]
    return bytes(out)


def from_planes(data: bytes, start: int, n: int, length: int) -> Sequence[bytes]:
    """The ``n`` records of ``length`` bytes each stored as byte planes in ``data[start:start + n * length]``
    (the inverse of :func:`to_planes`): one C slice assignment per plane, then one struct call cuts the records;
    one slice per record when there are fewer records than bytes per record."""
    view = memoryview(data)[start : start + n * length]
    if length <= n:
        out = bytearray(n * length)
        for i in range(length):
            out[i::length] = view[i * n : (i + 1) * n]
        return fixed_struct(n, length).unpack_from(out)
    return [bytes(view[j::n]) for j in range(n)]


def block_struct(key_lengths: array[int], value_lengths: array[int], n: int, emit: bool) -> struct.Struct:
    """The struct that cuts a block's keys (and with ``emit`` its values, after them) from its data."""
    key_length = key_lengths[0]
    keys_uniform = key_lengths.count(key_length) == n
    value_length = value_lengths[0] if emit else -1
    values_uniform = not emit or value_lengths.count(value_length) == n
    uniform = keys_uniform and values_uniform
    if uniform:
        cached = _UNIFORM_STRUCTS.get((n, key_length, value_length))
        if cached is not None:
            return cached
    formats = _LENGTH_FORMATS.__getitem__
    # a column of one length is one string repetition; otherwise one dict lookup per record, in C
    layout = "<" + (f"{key_length}s" * n if keys_uniform else "".join(map(formats, key_lengths)))
    if emit:
        layout += f"{value_length}s" * n if values_uniform else "".join(map(formats, value_lengths))
    compiled = struct.Struct(layout)
    if uniform:
        if len(_UNIFORM_STRUCTS) >= 16:
            _UNIFORM_STRUCTS.clear()
        _UNIFORM_STRUCTS[(n, key_length, value_length)] = compiled
    return compiled


def column_struct(lengths: array[int], n: int) -> struct.Struct:
    """The struct that cuts one column of ``n`` records of the given lengths (a version 3 block whose other column
    is stored as planes)."""
    length = lengths[0]
    if lengths.count(length) == n:
        return fixed_struct(n, length)
    return struct.Struct("<" + "".join(map(_LENGTH_FORMATS.__getitem__, lengths)))


def fixed_struct(n: int, length: int) -> struct.Struct:
    """The struct that cuts ``n`` records of ``length`` bytes each, compiled once per shape."""
    compiled = _FIXED_STRUCTS.get((n, length))
    if compiled is None:
        if len(_FIXED_STRUCTS) >= 16:
            _FIXED_STRUCTS.clear()
        compiled = _FIXED_STRUCTS[(n, length)] = struct.Struct("<" + f"{length}s" * n)
    return compiled


#: compiled structs cutting n records of one length, by (n, length): most blocks of a store share one
_FIXED_STRUCTS: dict[tuple[int, int], struct.Struct] = {}


class _LengthFormats(dict[int, str]):
    """length -> its struct code (``5 -> "5s"``), made on first use; lookups by ``map`` stay in C."""

    def __missing__(self, length: int) -> str:
        code = f"{length}s"
        if len(self) < 1 << 16:  # corrupt lengths must not grow it without bound
            self[length] = code
        return code


_LENGTH_FORMATS = _LengthFormats((length, f"{length}s") for length in range(1024))
#: compiled block structs of uniform lengths, by (n, key length, value length or -1): most blocks of a store share one
_UNIFORM_STRUCTS: dict[tuple[int, int, int], struct.Struct] = {}
