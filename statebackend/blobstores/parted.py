"""Helpers shared by the remote blob stores (azure, s3): their common base (requests through the resilience layer,
small-file puts, parallel ranged downloads, comparing a stored blob with a local file and metadata), the SDK boundary
that guarantees no SDK or stdlib exception (nor its raw text) reaches a caller, the per-process part pool, part
ranges, and the options both take."""

from __future__ import annotations

import concurrent.futures
import functools
import os
from collections.abc import Callable, Iterable, Iterator, Mapping
from typing import BinaryIO, ClassVar, TypeVar

from statebackend.blobstores.base import BlobStore, translate_errors
from statebackend.blobstores.resilience import RESILIENCE_OPTIONS, Resilience
from statebackend.concurrency import SharedPools
from statebackend.options import OptionSpec, parse_bool, parse_bytes

T = TypeVar("T")

MIN_PART_SIZE = 5 << 20  # S3's smallest part; Azure blocks may be smaller but one rule keeps both simple

_part_pools = SharedPools("blob-part")


def part_pool(max_concurrency: int) -> concurrent.futures.ThreadPoolExecutor:
    """The process-wide pool for parts of large transfers, one per size: it bounds the parallel part requests of
    every store in the process that uses the same ``max.concurrency``. Part tasks never wait on this pool."""
    return _part_pools.get(max_concurrency)


def part_ranges(size: int, part_size: int) -> list[tuple[int, int]]:
    """``[start, end)`` ranges covering ``size`` bytes in parts of ``part_size`` (the last may be shorter)."""
    return [(start, min(size, start + part_size)) for start in range(0, size, part_size)]


def ordered_parallel(pool: concurrent.futures.Executor, tasks: Iterable[Callable[[], T]], window: int) -> Iterator[T]:
    """Run ``tasks`` on ``pool`` with at most ``window`` in flight; yield results in task order (bounded memory)."""
    pending: list[concurrent.futures.Future[T]] = []
    iterator = iter(tasks)
    try:
        for task in iterator:
            pending.append(pool.submit(task))
            if len(pending) >= window:
                yield pending.pop(0).result()
        while pending:
            yield pending.pop(0).result()
    finally:
        for future in pending:
            future.cancel()


def write_ranges(
    out: BinaryIO,
    read_range: Callable[[int, int], bytes],
    size: int,
    part_size: int,
    pool: concurrent.futures.Executor,
    window: int,
) -> int:
    """Download ``size`` bytes in parallel ranged reads and write them to ``out`` in order. Returns the count."""
    written = 0
    tasks = [lambda s=s, e=e: read_range(s, e) for s, e in part_ranges(size, part_size)]
    for chunk in ordered_parallel(pool, tasks, window):
        out.write(chunk)
        written += len(chunk)
    return written


def file_equals(chunks: Iterator[bytes], path: str | os.PathLike[str]) -> bool:
    """Whether the byte stream ``chunks`` equals the file at ``path``, compared as it streams."""
    with open(path, "rb") as f:
        for chunk in chunks:
            if f.read(len(chunk)) != chunk:
                return False
        return f.read(1) == b""


#: the error translation of the built-in ``az://`` and ``s3://`` stores' public methods: the public
#: :func:`~statebackend.blobstores.base.translate_errors` (kept under this name for code that imports it from here)
sdk_boundary = translate_errors


class PartedBlobStore(BlobStore):
    """What the Azure and S3 stores share: every request goes through the resilience layer when one is set, a file
    up to ``part_size`` is put in one request, and larger blobs are read in parallel ranged parts."""

    options: ClassVar[Mapping[str, OptionSpec]] = {
        **RESILIENCE_OPTIONS,
        "part.size.bytes": OptionSpec(parse_bytes(min=1), "8MiB", "part size of parallel uploads and downloads"),
        "create.if.missing": OptionSpec(parse_bool(), False, "create the container or bucket when missing"),
    }

    part_size: int
    max_concurrency: int
    _resilience: Resilience | None

    def use_resilience(self, resilience: Resilience) -> bool:
        """Retry and hedge each request of a large transfer on its own (called by ResilientBlobStore)."""
        self._resilience = resilience
        return True

    def _request(
        self,
        operation: str,
        attempt: Callable[[], T],
        hedge: bool,
        is_own_write: Callable[[], bool] | None = None,
        *,
        sent: int = 0,
    ) -> T:
        if self._resilience is None:
            return attempt()
        return self._resilience.call(operation, attempt, hedge=hedge, is_own_write=is_own_write, sent=sent)

    def _secrets(self) -> tuple[str, ...]:
        """The secrets this store's messages must never show (registered globally too)."""
        return ()

    def redaction_secrets(self) -> tuple[str, ...]:
        """The store's secrets (:meth:`_secrets`), scrubbed from every error by :func:`translate_errors`."""
        return self._secrets()

    def _put_small_file(
        self, name: str, path: str | os.PathLike[str], create_only: bool, metadata: Mapping[str, str] | None
    ) -> bool:
        """Put the file in one request if it is at most ``part_size``; False when it needs parts."""
        if os.path.getsize(path) > self.part_size:
            return False
        with open(path, "rb") as f:
            data = f.read()

        def own() -> bool:
            return self._request("get", lambda: self.get(name), True) == data and self._metadata_equals(name, metadata)

        self._request(
            "put",
            lambda: self.put(name, data, create_only=create_only, metadata=metadata),
            True,
            own if create_only else None,
            sent=len(data),
        )
        return True

    @sdk_boundary
    def get_into(self, name: str, out: BinaryIO) -> int:
        size = self._request("head", lambda: self.head(name), True).size
        if size <= self.part_size:
            data = self._request("get", lambda: self.get(name), True)
            out.write(data)
            return len(data)
        return write_ranges(
            out,
            lambda s, e: self._request("get_range", lambda: self.get(name, start=s, end=e), True),
            size,
            self.part_size,
            part_pool(self.max_concurrency),
            self.max_concurrency,
        )

    def _metadata_equals(self, name: str, metadata: Mapping[str, str] | None) -> bool:
        """Whether the stored blob's user metadata is exactly ``metadata`` (a read-back of a create-only write)."""
        if not self.supports_metadata:
            return True
        return dict(self._request("head", lambda: self.head(name), True).metadata) == dict(metadata or {})

    def _stored_equals_file(
        self, name: str, size: int, path: str | os.PathLike[str], metadata: Mapping[str, str] | None
    ) -> bool:
        """Whether the stored blob is byte for byte the local file, with exactly ``metadata`` (read back in parts,
        each retried)."""
        info = self._request("head", lambda: self.head(name), True)
        if info.size != size or (self.supports_metadata and dict(info.metadata) != dict(metadata or {})):
            return False
        chunks = (
            self._request("get_range", functools.partial(self.get, name, start=s, end=e), True)
            for s, e in part_ranges(size, self.part_size)
        )
        return file_equals(chunks, path)
