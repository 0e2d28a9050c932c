"""Compaction of the blob-snapshot backend (:class:`Compactor`, held by the backup manager; one at a time per store, on
the process-wide compaction thread; never on the task thread, never awaited by a commit): size-tiered merges of the
runs above the bottom run, and full compactions that write a new base run from an LMDB read view. The result is
uploaded in the background by the manager's uploader, recorded in the store dir, and adopted by a later commit's index
in place of its inputs (by the next open's, when the open that made it closed first)."""

from __future__ import annotations

import heapq
import json
import logging
import os
from collections.abc import Iterable, Iterator
from concurrent.futures import Future
from operator import itemgetter
from pathlib import Path

import attrs
from statebackend.backends.blobsnapshot.blobs import read_run
from statebackend.backends.blobsnapshot.format import RunEntry, replace_runs, run_name
from statebackend.backends.blobsnapshot.state import COMPACTED_FILE, BlobSnapshotShared, Compacted, StoreState
from statebackend.backends.blobsnapshot.upload import RunUpload

from statebackend.concurrency import SharedPools
from statebackend.crashpoints import crashpoint
from statebackend.errors import StateBackendError
from statebackend.kit import IN_FLIGHT, log_extra
from statebackend.recordfile import iter_records, renew_nonce
from statebackend.store import ReadView

__all__ = ["Compactor"]

log = logging.getLogger(__name__)

#: merges of up to this many records run in a dict (C speed); bigger ones stream through a heap (bounded memory)
_DICT_MERGE_MAX_RECORDS = 2_000_000

_compaction_pools = SharedPools("blobsnapshot-compaction")


@attrs.define(eq=False)
class Compactor:
    """Starting, writing and adopting compactions, on the manager's :class:`BlobSnapshotShared`; the runs they write go
    up through the manager's ``uploader``."""

    shared: BlobSnapshotShared
    uploader: RunUpload

    def adopt(self, state: StoreState, runs: tuple[RunEntry, ...]) -> tuple[RunEntry, ...]:
        """``runs`` with a finished compaction's output in place of its inputs (unchanged when none finished, or it
        no longer fits the chain or is too old to name)."""
        with state.state_lock:
            compaction = state.compaction
            if compaction is None or not compaction.done():
                return runs
            state.compaction = None
            state.compaction_inputs = ()
            state.compaction_output = None
        record = Path(state.store.path) / COMPACTED_FILE
        record.unlink(missing_ok=True)
        exc = compaction.exception()
        if exc is not None:
            self.shared.context.metrics.increment("blobsnapshot.compaction.failures")
            log.warning(
                "store %s: compaction failed (tried again later): %s",
                state.name,
                exc,
                extra=log_extra(self.shared.context, state.name),
            )
            return runs
        compacted = compaction.result()
        if compacted is None or compacted.generation != state.generation:
            return runs
        replaced = replace_runs(runs, compacted.inputs, compacted.output)
        if replaced is None:
            return runs
        if not self.shared.young_enough(compacted.uploaded_at) and compacted.output.hash not in state.durable_runs:
            # a sweep may take it (with gc.grace.period.ms 0 at once, so it could otherwise never be adopted): write
            # it again from its local copy, same content under the same name with a fresh age and a fresh nonce, as
            # for a chain's run
            path = state.cached(compacted.output)
            if not path.exists():
                self.shared.context.metrics.increment("blobsnapshot.compaction.too.old")
                log.warning(
                    "store %s: not adopting compacted run %s: uploaded more than half of "
                    "blobsnapshot.gc.grace.period.ms ago",
                    state.name,
                    compacted.output.hash,
                    extra=log_extra(self.shared.context, state.name),
                )
                return runs
            now = self.shared.clock()
            try:
                # bytes of its own for the rewrite (a fresh nonce): a sweep that judged the first write by its
                # version (on S3 the MD5 of the bytes) cannot take this one
                # (a copy an older release wrote has no trailer: written again as is, as that release did)
                renew_nonce(path, aside=state.staging)
                self.shared.context.blob_store.put_file(
                    run_name(state.prefix, compacted.output.hash), path, metadata=self.shared.new_metadata(now)
                )
            except StateBackendError as exc:
                self.shared.context.metrics.increment("blobsnapshot.compaction.failures")
                log.warning(
                    "store %s: could not write compacted run %s again (compacting later): %s",
                    state.name,
                    compacted.output.hash,
                    exc,
                    extra=log_extra(self.shared.context, state.name),
                )
                return runs
            compacted = attrs.evolve(compacted, uploaded_at=now)
            self.shared.context.metrics.increment("blobsnapshot.compaction.refreshed")
        state.uploaded.add(compacted.output.hash)
        if compacted.uploaded_at is not None:
            state.uploaded_at[compacted.output.hash] = compacted.uploaded_at
        self.shared.context.metrics.increment("blobsnapshot.compaction.adopted")
        return replaced

    def adopt_recorded(self, state: StoreState) -> None:
        """A compaction an earlier open finished but could not list in an index: adopt it at the next upload if its
        inputs are still a stretch of the chain and its output is in the blob store."""
        record = Path(state.store.path) / COMPACTED_FILE
        try:
            document = json.loads(record.read_text())
            compacted = Compacted.from_json(document, state.generation)
        except FileNotFoundError:
            return
        except (ValueError, KeyError, TypeError, AttributeError, OSError) as exc:
            log.warning(
                "store %s: ignoring unreadable compaction record %s (%s)",
                state.name,
                record,
                exc,
                extra=log_extra(self.shared.context, state.name),
            )
            record.unlink(missing_ok=True)
            return
        if replace_runs(state.runs, compacted.inputs, compacted.output) is None:
            record.unlink(missing_ok=True)
            return
        done: Future[Compacted | None] = Future()
        done.set_result(compacted)
        state.compaction = done
        state.compaction_inputs = compacted.inputs
        state.compaction_output = compacted.output.hash

    def maybe_start(self, state: StoreState, view: ReadView) -> bool:
        """Start a compaction when one is due and none runs; whether ``view`` was handed to it."""
        if self.shared.closed or self.shared.cancellation.cancelled:
            return False
        with state.state_lock:
            if state.compaction is not None:
                return False
            runs = tuple(state.runs)
            # the bottom run (a base run, or the first run of a chain that started on the empty store) is only ever
            # replaced by a full compaction; the runs above it are merged by tiers
            upper = list(runs[1:])
            base_bytes = runs[0].size if runs else 0
            upper_bytes = sum(run.size for run in upper)
            pool = _compaction_pools.get(1)
            if (
                upper
                and view.version == upper[-1].version
                and upper_bytes
                >= max(
                    self.shared.settings.compaction_full_ratio * base_bytes,
                    self.shared.settings.compaction_full_min_bytes,
                )
            ):
                state.compaction_inputs = runs
                state.compaction = pool.submit(self._compact_full, state, view, runs, state.generation)
                return True
            inputs = _tier_to_merge(upper, self.shared.settings.compaction_fanout)
            if inputs:
                state.compaction_inputs = inputs
                state.compaction = pool.submit(self._compact_merge, state, inputs, state.generation)
        return False

    def _compact_full(
        self, state: StoreState, view: ReadView, inputs: tuple[RunEntry, ...], generation: int
    ) -> Compacted:
        """A new base run: the whole store at the last input's version, from an LMDB read view of it."""
        last = inputs[-1]
        try:
            with IN_FLIGHT.hold([state.staging, state.cache]):
                what = _what(state)
                output = self.uploader.write_base(
                    state,
                    view,
                    last_seq=last.last_seq,
                    version=last.version,
                    check=lambda: self.shared.cancellation.check(what),
                )
        finally:
            view.close()
        return self._publish_compaction(state, inputs, output, generation)

    def _compact_merge(self, state: StoreState, inputs: tuple[RunEntry, ...], generation: int) -> Compacted:
        """Merge contiguous runs above the bottom run into one of the next level: the newest value of each key, and
        the tombstones (the bottom run below may hold the keys they delete)."""
        context = self.shared.context
        with IN_FLIGHT.hold([state.staging, state.cache]):
            sources = [
                read_run(
                    context.blob_store,
                    state.prefix,
                    run,
                    index="(compaction)",
                    job=context.job_name,
                    task=context.task_name,
                    store=state.name,
                    local=state.cached(run),
                )
                for run in inputs
            ]
            records = _merge(
                [
                    iter_records(data, name=run_name(state.prefix, run.hash), verified=True)
                    for run, data in zip(inputs, sources, strict=True)
                ],
                total=sum(run.records for run in inputs),
                drop_tombstones=inputs[0].first_seq == 1,
            )
            del sources
            last = inputs[-1]
            output = self.uploader.write_run(
                state,
                self.shared.cancellation.records(records, _what(state)),
                first_seq=inputs[0].first_seq,
                last_seq=last.last_seq,
                version=last.version,
                level=max(run.level for run in inputs) + 1,
                base=False,
            )
        return self._publish_compaction(state, inputs, output, generation)

    def _publish_compaction(
        self, state: StoreState, inputs: tuple[RunEntry, ...], output: RunEntry, generation: int
    ) -> Compacted:
        # written, not uploaded: the cached file goes with the next cleanup of the cache
        self.shared.cancellation.check(_what(state))
        with state.state_lock:
            state.compaction_output = output.hash
        crashpoint("blobsnapshot.compaction.written")
        path = state.cached(output)
        written = self.uploader.put_run(state, output, path)
        metrics = self.shared.context.metrics
        if written:
            metrics.increment("blobsnapshot.compaction.bytes", output.size)
            metrics.increment("blobsnapshot.compaction.runs")
        metrics.increment("blobsnapshot.compactions.full" if output.base else "blobsnapshot.compactions.merge")
        crashpoint("blobsnapshot.compaction.uploaded")
        compacted = Compacted(inputs, output, generation, state.uploaded_at.get(output.hash))
        record = Path(state.store.path) / COMPACTED_FILE
        partial = record.with_name(record.name + ".partial")
        partial.write_text(json.dumps(compacted.to_json()))
        os.replace(partial, record)
        return compacted


def _tier_to_merge(upper: list[RunEntry], fanout: int) -> tuple[RunEntry, ...]:
    """The oldest ``fanout`` runs of the lowest level that has that many (runs are ordered by level, highest and
    oldest first, so they are contiguous), or nothing."""
    by_level: dict[int, list[RunEntry]] = {}
    for run in upper:
        by_level.setdefault(run.level, []).append(run)
    for level in sorted(by_level):
        runs = by_level[level]
        if len(runs) >= fanout:
            start = upper.index(runs[0])
            candidate = tuple(upper[start : start + fanout])
            if all(run.level == level for run in candidate):
                return candidate
    return ()


def _merge(
    sources: list[Iterable[tuple[bytes, bytes | None]]], *, total: int, drop_tombstones: bool
) -> Iterator[tuple[bytes, bytes | None]]:
    """The records of ``sources`` (oldest first, each sorted) as one sorted stream, newest value per key."""
    if total <= _DICT_MERGE_MAX_RECORDS:
        merged: dict[bytes, bytes | None] = {}
        for source in sources:
            merged.update(source)  # newer sources overwrite: C speed, no Python frame per record
        items = sorted(merged.items(), key=itemgetter(0))
        if drop_tombstones:
            return (item for item in items if item[1] is not None)
        return iter(items)
    return _heap_merge(sources, drop_tombstones=drop_tombstones)


def _heap_merge(
    sources: list[Iterable[tuple[bytes, bytes | None]]], *, drop_tombstones: bool
) -> Iterator[tuple[bytes, bytes | None]]:
    ranked = [((key, -rank, value) for key, value in source) for rank, source in enumerate(sources)]
    previous: bytes | None = None
    for key, _rank, value in heapq.merge(*ranked):
        if key == previous:
            continue
        previous = key
        if value is None and drop_tombstones:
            continue
        yield key, value


def _what(state: StoreState) -> str:
    """A compaction of ``state``'s store, in a cancellation's message."""
    return f"store {state.name}: compaction"
