"""Admin of the changelog-delta backend: the blob store must exist and accept writes; a marker (a recipe) is
described, its blobs named and verified for the ``statebackend`` command (``inspect``, ``verify``, ``gc``)."""

from __future__ import annotations

import itertools
import tempfile
from pathlib import Path
from typing import Any

import attrs
from statebackend.backends.changelog.marker import Recipe, Step, check_blob_binding

from statebackend.blobstores.admin import BlobStoreBackendAdmin
from statebackend.contracts import BackendContext, StateBackendAdmin
from statebackend.envbase import HEAD_BYTES, BlobSource, is_env_base, restore_env_base
from statebackend.errors import CorruptDataError, IncompatibleFormatError, NotFoundError, StateBackendError
from statebackend.recordfile import KIND_DELTA, KIND_SNAPSHOT, iter_records, verify

__all__ = ["ChangelogAdmin"]


@attrs.define
class ChangelogAdmin(BlobStoreBackendAdmin, StateBackendAdmin):
    context: BackendContext

    def describe_marker(self, store: str, marker: str) -> dict[str, Any]:
        """The recipe: the snapshot it starts from and the deltas after it, each with its blob's size (``None``:
        the blob is missing; an empty commit has no blob), and the total bytes a full restore downloads."""
        recipe = Recipe.decode(marker, prefix=self.context.blob_prefix(store), source=f"store {store}")
        blob_store = self.context.blob_store
        total = 0
        missing = 0

        def step(s: Step, kind: str) -> dict[str, Any]:
            nonlocal total, missing
            size: int | None = None
            if s.name is not None:
                try:
                    size = blob_store.head(s.name).size
                    total += size
                except NotFoundError:
                    missing += 1
            return {"kind": kind, "seq": s.seq, "checkpoint_id": s.checkpoint_id, "blob": s.name, "bytes": size}

        steps = []
        if recipe.snapshot is not None:
            steps.append(step(recipe.snapshot, KIND_SNAPSHOT))
        steps.extend(step(d, KIND_DELTA) for d in recipe.deltas)
        return {
            "kind": "changelog recipe",
            "seq": recipe.seq,
            "snapshot": recipe.snapshot is not None,
            "deltas": len(recipe.deltas),
            "blobs": sum(1 for _ in recipe.blob_names()),
            "missing": missing,
            "bytes": total,
            "steps": steps,
        }

    def referenced_blobs(self, store: str, marker: str) -> set[str]:
        return set(Recipe.decode(marker, prefix=self.context.blob_prefix(store), source=f"store {store}").blob_names())

    def verify_marker(self, store: str, marker: str) -> list[str]:
        """Every blob of the recipe downloaded and checked as restore checks it (magic, header CRC, digest, record
        order and count, and that its header names this job, task, store, seq and version), and the chain of steps
        checked for gaps. Nothing is applied; a snapshot goes through a temp file, so memory stays bounded."""
        try:
            recipe = Recipe.decode(marker, prefix=self.context.blob_prefix(store), source=f"store {store}")
        except (CorruptDataError, IncompatibleFormatError) as exc:
            return [str(exc)]
        problems: list[str] = []
        steps = list(recipe.steps())
        for before, after in itertools.pairwise(steps):
            if after.seq != before.seq + 1:
                problems.append(
                    f"store {store}: the recipe jumps from seq {before.seq} to seq {after.seq}; a delta "
                    f"of the chain is missing from the marker"
                )
        with tempfile.TemporaryDirectory(prefix="statebackend-verify-") as tmp:
            for s in steps:
                if s.name is None:
                    continue
                kind = KIND_SNAPSHOT if s is recipe.snapshot else KIND_DELTA
                try:
                    self._verify_blob(store, s, kind, Path(tmp))
                except NotFoundError:
                    problems.append(
                        f"store {store}: {kind} {s.name} (seq {s.seq}) is missing from "
                        f"{self.context.blob_store.describe()}"
                    )
                except StateBackendError as exc:
                    named = "" if s.name in str(exc) else f" {s.name}"  # the format's errors name the blob already
                    problems.append(f"store {store}: {kind}{named} (seq {s.seq}): {exc}")
        return problems

    def _verify_blob(self, store: str, step: Step, kind: str, tmp: Path) -> None:
        assert step.name is not None
        blob_store = self.context.blob_store
        binding = {"kind": kind, "job": self.context.job_name, "task": self.context.task_name, "store": store}
        if kind == KIND_DELTA:
            header = verify(blob_store.get(step.name), name=step.name)
            check_blob_binding(header, step, **binding)
            return
        base = BlobSource(blob_store, step.name, blob_store.head(step.name).size)
        if is_env_base(base.read(0, min(base.size, HEAD_BYTES))):
            # an environment-file base: every byte read and checked in ranged reads, nothing written
            restore_env_base(base, None, check=lambda header: check_blob_binding(header.lineage, step, **binding))
            return
        local = tmp / "snapshot"
        blob_store.get_file(step.name, local)
        try:
            with open(local, "rb") as source:
                reader = iter_records(source, name=step.name)
                check_blob_binding(reader.header, step, **binding)
                for _ in reader:  # the stream reader checks order, digest and count as it goes
                    pass
        finally:
            local.unlink(missing_ok=True)
