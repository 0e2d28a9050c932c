"""Spill runs: a write batch that outgrew its bound, written sorted to a file until the next flush reads it back.

Contract:

- A run file is the magic ``SBSPILL1``, then records "key length u32, value length u32 (0xFFFFFFFF = delete), key,
  value", in the order written (the writer gives them sorted by key, one record per key).
- Runs are private and short-lived (read back by the next flush's change set only), so they carry no checksum and are
  not fsynced. A run with a bad magic or cut short reads as ``CorruptDataError``; a run that is gone (its change set
  was closed, or the store reopened) as ``StateBackendError``.
- Runs live in ``spill/`` of the store dir. ``reset_spill_dir`` empties it at open: runs only matter until the flush
  that reads them, and the store's lock proves no one else uses any left there.
"""

from __future__ import annotations

import shutil
import struct
from collections.abc import Iterable, Iterator
from pathlib import Path
from typing import BinaryIO

from statebackend.errors import ClosedError, CorruptDataError

SPILL_DIR = "spill"

_RUN_MAGIC = b"SBSPILL1"
_RUN_HEADER = struct.Struct(">II")
_RUN_DELETE = 0xFFFFFFFF


def reset_spill_dir(store_dir: Path) -> None:
    """An empty ``spill/`` in ``store_dir`` (runs left by a process that died are deleted)."""
    spill = store_dir / SPILL_DIR
    shutil.rmtree(spill, ignore_errors=True)
    spill.mkdir()


def run_path(store_dir: Path, prefix: str, index: int) -> Path:
    """Where run number ``index`` of the batch named by ``prefix`` goes."""
    return store_dir / SPILL_DIR / f"{prefix}-{index:06d}.run"


def write_run(path: Path, records: Iterable[tuple[bytes, bytes | None]]) -> None:
    pack = _RUN_HEADER.pack
    with open(path, "wb", buffering=1 << 20) as f:
        f.write(_RUN_MAGIC)
        for key, value in records:
            if value is None:
                f.write(pack(len(key), _RUN_DELETE))
                f.write(key)
            else:
                f.write(pack(len(key), len(value)))
                f.write(key)
                f.write(value)


def read_run(path: Path) -> Iterator[tuple[bytes, bytes | None]]:
    try:
        f: BinaryIO = open(path, "rb", buffering=1 << 20)  # noqa: SIM115 - entered below; only open() is translated
    except FileNotFoundError as exc:
        raise ClosedError(f"spill run {path} is gone; its change set was closed or the store reopened") from exc
    with f:
        if f.read(len(_RUN_MAGIC)) != _RUN_MAGIC:
            raise CorruptDataError(f"spill run {path} has a bad magic number")
        unpack = _RUN_HEADER.unpack
        size = _RUN_HEADER.size
        while True:
            header = f.read(size)
            if not header:
                return
            if len(header) != size:
                raise CorruptDataError(f"spill run {path} is cut short")
            key_len, value_len = unpack(header)
            key = f.read(key_len)
            if value_len == _RUN_DELETE:
                yield key, None
            else:
                yield key, f.read(value_len)


def unlink_all(paths: Iterable[Path]) -> None:
    """Delete the runs ``paths`` (those already gone are no error)."""
    for path in paths:
        path.unlink(missing_ok=True)
