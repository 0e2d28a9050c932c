"""Admin of the blob-snapshot backend: the blob store must exist and accept create-only writes, reads and deletes; a
marker (an inline index, or an index blob's name from older releases) is described, its blobs named and verified for the
``statebackend`` command (``inspect``, ``verify``, ``gc``)."""

from __future__ import annotations

from typing import Any

import attrs
from statebackend.backends.blobsnapshot.blobs import read_marker, read_run, verify_env_base_run
from statebackend.backends.blobsnapshot.format import RunIndex, chain_problem, is_inline_marker, marker_label, run_name

from statebackend.blobstores.admin import BlobStoreBackendAdmin
from statebackend.contracts import BackendContext, StateBackendAdmin
from statebackend.errors import NotFoundError, StateBackendError
from statebackend.recordfile import iter_records

__all__ = ["BlobSnapshotAdmin"]


@attrs.define
class BlobSnapshotAdmin(BlobStoreBackendAdmin, StateBackendAdmin):
    context: BackendContext

    def describe_marker(self, store: str, marker: str) -> dict[str, Any]:
        """The index: its runs (level, versions, records) with each blob's size (``None``: missing), the key count
        and the total bytes a full restore downloads. Reads the index and the runs' sizes; never writes."""
        index = self._index(store, marker)
        blob_store = self.context.blob_store
        total = 0
        missing = 0
        runs = []
        for run in index.runs:
            name = run_name(self.context.blob_prefix(store), run.hash)
            size: int | None
            try:
                size = blob_store.head(name).size
                total += size
            except NotFoundError:
                size = None
                missing += 1
            runs.append(
                {
                    "blob": name,
                    "bytes": size,
                    "level": "base" if run.base else run.level,
                    "first_seq": run.first_seq,
                    "last_seq": run.last_seq,
                    "records": run.records,
                }
            )
        inline = is_inline_marker(marker)
        index_bytes = 0 if inline else blob_store.head(marker).size
        return {
            "kind": "blobsnapshot index",
            "index": marker_label(marker),
            "inline": inline,
            "marker_bytes": len(marker.encode()),
            "seq": index.seq,
            "checkpoint_id": index.checkpoint_id,
            "keys": index.key_count,
            "runs": len(index.runs),
            "blobs": len(index.runs) + (0 if inline else 1),
            "missing": missing,
            "bytes": total + index_bytes,
            "run_list": runs,
        }

    def referenced_blobs(self, store: str, marker: str) -> set[str]:
        """Every run the index lists, and the index blob when the marker names one (an older release's)."""
        index = self._index(store, marker)
        runs = index.blob_names(self.context.blob_prefix(store))
        return runs if is_inline_marker(marker) else {marker, *runs}

    def verify_marker(self, store: str, marker: str) -> list[str]:
        """The index (checksum, binding to its marker, chain shape) and every run it lists, downloaded and checked as
        restore checks them (size, content hash, header lineage, digest, record order and count). Nothing is
        applied or written."""
        try:
            index = self._index(store, marker)
        except StateBackendError as exc:
            return [str(exc)]
        problems = []
        label = marker_label(marker)
        shape = chain_problem(index.runs, index.seq)
        if shape is not None:
            problems.append(f"index {label}: {shape}")
        context = self.context
        prefix = context.blob_prefix(store)
        for run in index.runs:
            name = run_name(prefix, run.hash)
            try:
                count = verify_env_base_run(
                    context.blob_store,
                    prefix,
                    run,
                    index=label,
                    job=context.job_name,
                    task=context.task_name,
                    store=store,
                )
                if count is None:
                    data = read_run(
                        context.blob_store,
                        prefix,
                        run,
                        index=label,
                        job=context.job_name,
                        task=context.task_name,
                        store=store,
                    )
                    count = sum(1 for _ in iter_records(data, name=name, verified=True))
            except StateBackendError as exc:
                problems.append(f"store {store}: {exc}")
                continue
            if count != run.records:
                problems.append(
                    f"store {store}: run {name} holds {count} records where index {label} lists {run.records}"
                )
        return problems

    def _index(self, store: str, marker: str) -> RunIndex:
        context = self.context
        return read_marker(context.blob_store, marker, job=context.job_name, task=context.task_name, store=store)
