"""A task's output held until its commit is durable, in bounded memory.

A task hands its output to Spark only after its commit is durable (no output of state that is not durable), so the
whole output of a task waits somewhere. :class:`HeldOutput` keeps it in memory up to a byte bound and spills the rest
to a file in the task's local state directory (``<state.local.dir>/.spill/``), in order; iterating gives every item
back in the order it came (a file cut short or damaged is a ``StateBackendError``, never fewer items), and the
file is deleted when the iteration ends or the holder is closed.

Sizes: an Arrow batch counts its buffers (``nbytes``), a pandas frame its memory (``memory_usage(deep=True)``), a row
an estimate from a sample (every 64th row's ``sys.getsizeof`` with its fields'), so holding rows costs no pickling
until they spill.
"""

from __future__ import annotations

import os
import pickle
import sys
import tempfile
from collections.abc import Iterable, Iterator
from pathlib import Path
from typing import IO, Any

from statebackend.errors import CorruptDataError

__all__ = ["DEFAULT_BOUND", "SPILL_DIR", "HeldOutput"]

#: bytes of output a task holds in memory before it spills the rest to disk
DEFAULT_BOUND = 256 << 20
#: under ``state.local.dir``: spill files of held output
SPILL_DIR = ".spill"
_SAMPLE_EVERY = 64
_SPILL_CHUNK = 1024  # rows pickled together once spilling


class HeldOutput:
    """Output items (rows, Arrow batches or pandas frames) held in memory up to ``bound`` bytes, the rest spilled."""

    def __init__(self, bound: int, directory: str | os.PathLike[str]) -> None:
        self.bound = bound
        self.directory = Path(directory)
        self.rows = 0
        self.spilled_items = 0
        self._memory: list[Any] = []
        self._bytes = 0
        self._row_estimate = 0.0
        self._file: IO[bytes] | None = None
        self._path: Path | None = None
        self._chunk: list[Any] = []

    def extend(self, items: Iterable[Any]) -> HeldOutput:
        try:
            for item in items:
                self.append(item)
        except BaseException:
            self.close()  # the output goes with the failed attempt, and so does its spill file
            raise
        return self

    def append(self, item: Any) -> None:
        rows, size = self._measure(item)
        self.rows += rows
        if self._file is None and self._bytes + size <= self.bound:
            self._memory.append(item)
            self._bytes += size
            return
        self._spill(item)

    @property
    def spilled(self) -> bool:
        return self._path is not None

    def __iter__(self) -> Iterator[Any]:
        try:
            yield from self._memory
            if self._path is not None:
                self._flush_chunk()
                assert self._file is not None
                self._file.close()
                read = 0
                with open(self._path, "rb") as source:
                    while True:
                        try:
                            chunk = pickle.load(source)
                        except EOFError:
                            break
                        except pickle.UnpicklingError as exc:
                            raise CorruptDataError(
                                f"the task's output spill file {self._path} is damaged ({exc}): its output is lost "
                                "with it; the task fails (its retry redoes the batch)"
                            ) from exc
                        read += len(chunk)
                        yield from chunk
                if read != self.spilled_items:  # cut where a chunk ends: never hand on a shorter output
                    raise CorruptDataError(
                        f"the task's output spill file {self._path} holds {read} of the {self.spilled_items} items "
                        "written to it (cut short): its output is lost with it; the task fails (its retry redoes the "
                        "batch)"
                    )
        finally:
            self.close()

    def close(self) -> None:
        self._memory = []
        if self._file is not None:
            self._file.close()
        if self._path is not None:
            self._path.unlink(missing_ok=True)

    def _spill(self, item: Any) -> None:
        if self._file is None:
            self.directory.mkdir(parents=True, exist_ok=True)
            fd, name = tempfile.mkstemp(dir=self.directory, prefix="output-", suffix=".pickle")
            self._file = os.fdopen(fd, "wb")
            self._path = Path(name)
        self._chunk.append(item)
        self.spilled_items += 1
        if len(self._chunk) >= _SPILL_CHUNK or not _is_row(item):
            self._flush_chunk()

    def _flush_chunk(self) -> None:
        if self._chunk and self._file is not None:
            pickle.dump(self._chunk, self._file, protocol=pickle.HIGHEST_PROTOCOL)
            self._chunk = []

    def _measure(self, item: Any) -> tuple[int, int]:
        """(rows, bytes) of one item."""
        if hasattr(item, "nbytes") and hasattr(item, "num_rows"):  # an Arrow batch or table
            return int(item.num_rows), int(item.nbytes)
        if hasattr(item, "memory_usage") and hasattr(item, "shape"):  # a pandas frame
            return int(item.shape[0]), int(item.memory_usage(deep=True).sum())
        if self.rows % _SAMPLE_EVERY == 0 or not self._row_estimate:
            fields = item.values() if isinstance(item, dict) else item if isinstance(item, tuple) else ()
            size = sys.getsizeof(item) + sum(sys.getsizeof(field) for field in fields)
            self._row_estimate = size if not self._row_estimate else 0.9 * self._row_estimate + 0.1 * size
        return 1, int(self._row_estimate)


def _is_row(item: Any) -> bool:
    return not (hasattr(item, "num_rows") or hasattr(item, "shape"))
