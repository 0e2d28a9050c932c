"""The commit/restore fault matrix (bench/faults.py) as a test: on file://, Azurite and moto's S3 server, for each
backend, at 10% and 30% injected faults (every kind the fault proxy knows on the wire), no acknowledged commit is
lost, no raw exception reaches the caller, no false conflict is reported, and every cold restore through the faults
is exact or a clear error; a restore without faults is exact."""

from __future__ import annotations

from pathlib import Path

import pytest

from bench.faults import run_cell
from tests.servers import ServerProcess

STORES = ["file", pytest.param("az", marks=pytest.mark.azure), pytest.param("s3", marks=pytest.mark.s3)]


@pytest.mark.slow
@pytest.mark.parametrize("rate", [0.1, 0.3])
@pytest.mark.parametrize("backend", ["changelog", "blobsnapshot", "dual"])
@pytest.mark.parametrize("store", STORES)
def test_faults_lose_nothing_and_restores_are_exact(
    store: str, backend: str, rate: float, request: pytest.FixtureRequest, tmp_path: Path
) -> None:
    servers: dict[str, ServerProcess] = {}
    if store == "az":
        servers["az"] = request.getfixturevalue("azurite")
    if store == "s3":
        servers["s3"] = request.getfixturevalue("s3_server")
    cell = run_cell(store, backend, rate, servers, commits=10, restores=1, seed=int(rate * 1000), work=tmp_path)
    assert cell.injected > 0, "no fault was injected: the test would prove nothing"
    assert (cell.lost, cell.raw, cell.false_conflicts, cell.restore_wrong) == (0, 0, 0, 0), cell.first_errors
    assert cell.acknowledged > 0, cell.first_errors
    assert cell.restored >= 1  # the restore without faults at least
    assert cell.restored + cell.restore_failed == 2
