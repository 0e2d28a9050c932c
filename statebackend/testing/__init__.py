"""What a third-party blob store or state backend reuses to prove it keeps the contracts, as the built-in ones do.

- :mod:`statebackend.testing.blobstore_contract`: ``BlobStoreContract``, subclass it with a ``store`` fixture.
- :mod:`statebackend.testing.backend_contract`: ``BackendContract``, the backup/restore contract of a state backend.
- :mod:`statebackend.testing.store_contract`: the local store's contract.
- :mod:`statebackend.testing.controlled`: ``ControlledBlobStore``, a wrapper that holds back or fails chosen writes
  (and fails chosen reads) and counts the bytes written; ``GatedExecutor``, a pool whose tasks wait at a gate the
  test opens.
- :mod:`statebackend.testing.backend_support`: the backend suite's helpers (``write_round``, ``flood``, ...);
  :mod:`statebackend.testing.backend_base` and :mod:`statebackend.testing.backend_faults`: the suite's settings and
  fixtures, and its fault tests (part of ``BackendContract``).
- :mod:`statebackend.testing.kills`: random SIGKILLs of a committing child process and the checks after each
  (``kill_rounds``), with the deterministic data it commits (``operations``, ``expected_state``).
- :mod:`statebackend.testing.deadline`: ``deadline``, the suites' per-test timeout that needs no plugin.
- :mod:`statebackend.testing.reference`: the reference backend, a compact correct backend that passes the backend
  suite, and the base of the backend mutants.
- :mod:`statebackend.testing.mutants`: broken backends and blob stores that the suites must fail
  (docs/contract-suites.md).
- :mod:`statebackend.testing.clock`: ``ManualClock``, the batch clock a test sets
  (``StatefulForeachBatch(clock=...)``): TTL and processing-time timer tests move time without sleeping or patching.
- ``crashpoint`` and ``CRASH_ENV_VAR`` (from :mod:`statebackend.crashpoints`, where the code under test calls them):
  the crash points a crash test kills a process at (``STATEBACKEND_CRASH_AT``); a backend marks its own steps with
  ``crashpoint("mybackend.step")``.

These modules import pytest and hypothesis (the ``testing`` extra); nothing else in statebackend does. The clock
imports neither.
"""

from __future__ import annotations

from statebackend.crashpoints import ENV_VAR as CRASH_ENV_VAR
from statebackend.crashpoints import crashpoint
from statebackend.testing.clock import ManualClock

__all__ = ["CRASH_ENV_VAR", "ManualClock", "crashpoint"]
