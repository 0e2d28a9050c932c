"""The backend contract suite with the dedup backend's settings: small chunks (so the suite's few hundred keys
make many chunks, and a commit touches several), a sweep after every checkpoint (so the framework's collector runs
in every test), and its manifests as the index blobs of the write-fault tests. Subclass :class:`DedupSuite` to run
the suite on another blob store or beside another backend."""

from __future__ import annotations

from typing import ClassVar

from statebackend.testing.backend_contract import BackendContract

__all__ = ["SUITE_SETTINGS", "DedupSuite"]

#: the dedup options the suite runs with (under the backend's name)
SUITE_SETTINGS: dict[str, object] = {"chunk.records": 8, "sweep.interval.commits": 1}


class DedupSuite(BackendContract):
    """The suite on the dedup backend (or a variant of it named in ``backup_factories``)."""

    backup_factories: ClassVar[str] = "dedup"

    def backend_settings(self, test: str) -> dict[str, object]:
        if test.startswith("test_commit_uploads_the_change_not_the_state"):
            return {}  # a manifest lists every chunk: at 8 records a chunk, 20,000 keys make a manifest of 230 KB
        settings = {f"{self.backend}.{key}": value for key, value in SUITE_SETTINGS.items()}
        if test.startswith("test_snapshot_costs_the_change_not_the_state"):
            # at 8 records a chunk its 41,000 keys make 5,125 chunk writes (half a minute on files or S3), all on the
            # commit pool, which the test does not count: the default chunk size (160 chunks) checks the same
            # task-thread cost, the sweep after every checkpoint still runs
            del settings[f"{self.backend}.chunk.records"]
        return settings

    def is_index_blob(self, name: str) -> bool:
        return "/manifests/" in name
