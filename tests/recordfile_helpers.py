"""Helpers shared by the record file tests and the scripts that write its stored samples."""

from __future__ import annotations

import statebackend.recordfile.format as recordformat
from statebackend.recordfile import FileHeader, encode


def encode_small_blocks(
    header: FileHeader, records: list[tuple[bytes, bytes | None]], *, budget: int, compression: str
) -> bytes:
    """The file the writer makes with blocks of about ``budget`` bytes (its own logic, a smaller ``BLOCK_BYTES``),
    so a small file has many blocks: boundaries to damage, blocks with deletes and without."""
    default = recordformat.BLOCK_BYTES
    recordformat.BLOCK_BYTES = budget
    try:
        return encode(header, records, compression=compression)
    finally:
        recordformat.BLOCK_BYTES = default
