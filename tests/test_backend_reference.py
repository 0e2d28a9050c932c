"""The reference backend (statebackend.testing.reference), the base of the suite's backend mutants, passes the
backend contract suite alone and in dual commits with each built-in backend."""

from __future__ import annotations

from typing import ClassVar

from statebackend.testing.backend_contract import BackendContract
from statebackend.testing.reference import REFERENCE_BACKEND


class TestReferenceBackend(BackendContract):
    backup_factories: ClassVar[str] = REFERENCE_BACKEND


class TestReferenceBackendDualWithChangelog(BackendContract):
    backup_factories: ClassVar[str] = REFERENCE_BACKEND
    dual_with: ClassVar[str | None] = "changelog"


class TestReferenceBackendDualWithBlobSnapshot(BackendContract):
    backup_factories: ClassVar[str] = REFERENCE_BACKEND
    dual_with: ClassVar[str | None] = "blobsnapshot"
