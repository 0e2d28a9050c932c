"""Why a commit still lists the checkpoint log once after its create-only write (docs/cost.md, "Fencing"), and that
it still catches every zombie now that retention runs in batches.

A zombie restored seq ``n``; a new owner committed ``n+1 ... n+k`` and its retention deleted ``n+1`` (and more).
The zombie's create-only write of ``n+1`` then succeeds: nothing of the write tells a freed name from a fresh one.
These tests hold the zombie at that point, for several ``k``, and check:

- the listing after the write refuses the zombie's commit and removes what it wrote, however far ahead the owner is
  and whichever seqs retention's batches freed (the case the protocol relies on);
- a HEAD of ``n+2`` (a cheaper check than a listing) would have found nothing there and let the zombie's commit
  stand: retention frees whole batches, so the seq after the zombie's is freed too;
- the zombie's own retention deleted nothing since its open (``CheckpointLog.trims`` is 0), yet its seq was freed:
  the owner's retention did it, which the zombie cannot see without reading the log, so "skip the listing when this
  task's retention deleted nothing" would let the commit stand too.
"""

from __future__ import annotations

import uuid
from concurrent.futures import wait
from pathlib import Path
from typing import Any

import pytest
from statebackend.checkpoint import CheckpointLog

from statebackend.blobstores.memory import MemoryBlobStore
from statebackend.blobstores.resilience import ResilientBlobStore
from statebackend.errors import CommitConflictError, CommitError
from statebackend.metrics import Metrics
from statebackend.task import TaskStorage
from statebackend.testing.backend_contract import contents, write_round
from statebackend.testing.conditional_put_contract import PerSeqMemoryBlobStore

CHECKPOINTS = "job/task-0/checkpoints/"
RETAINED = 3


def config_for(local: Path, url: str) -> dict[str, Any]:
    return {
        "job.name": "job",
        "state.local.dir": str(local),
        "blob.store.url": url,
        "stores.counts.backup.factories": "changelog",
        "task.checkpoint.retained": RETAINED,
    }


def names_of(blobs: MemoryBlobStore, seq: int) -> list[str]:
    return [name for name in blobs.list(CHECKPOINTS) if name.startswith(f"{CHECKPOINTS}{seq:012d}.")]


#: just past the first retention batch, between two batches, past several
@pytest.mark.parametrize("ahead", [RETAINED + 21, RETAINED + 30, 3 * (RETAINED + 20)])
def test_the_listing_after_the_write_refuses_a_zombie_however_far_ahead_the_owner_is(
    tmp_path: Path, ahead: int
) -> None:
    inner = PerSeqMemoryBlobStore()
    blobs = ResilientBlobStore(inner)
    url = f"memory://{uuid.uuid4().hex}"
    model: dict[bytes, bytes] = {}
    with TaskStorage.open(config_for(tmp_path / "first", url), "task-0", blob_store=blobs) as task:
        write_round(task, 0, model)
        task.commit_durably({"input": "0"})
    n = 1
    zombie_metrics = Metrics()
    zombie_blobs = ResilientBlobStore(inner)
    zombie_blobs.use_metrics(zombie_metrics)
    zombie = TaskStorage.open(
        config_for(tmp_path / "zombie", url), "task-0", blob_store=zombie_blobs, metrics=zombie_metrics
    )
    assert zombie.committed_seq == n
    # the owner is still running: its retention freed old seqs in batches, the last ones it holds are not freed yet
    with TaskStorage.open(config_for(tmp_path / "owner", url), "task-0", blob_store=blobs) as owner:
        for round_no in range(1, ahead + 1):
            write_round(owner, round_no, model)
            last = owner.commit_durably({"input": str(round_no)})
            wait(list(owner.commit_manager._cleanups), timeout=30)  # its retention batch, if one was due
        head = n + ahead
        assert n + 1 not in owner.checkpoint_log.seqs(), "the owner's retention freed the zombie's seq"
        assert len(owner.checkpoint_log.seqs()) > RETAINED, "a batch's worth of old checkpoints is still there"
        # the cheaper checks a commit could make instead of a listing, and what they would have concluded:
        assert not inner.exists(f"{CHECKPOINTS}{n + 2:012d}.v2.json"), "a HEAD of n+2 finds nothing: freed as well"
        assert zombie.checkpoint_log.trims == 0, "the zombie's own retention never ran"
        with zombie:
            write_round(zombie, 99, {})
            before = zombie_metrics.counter("blob_store.requests", operation="list")
            with pytest.raises(CommitError, match="another attempt") as refused:
                zombie.commit_durably({"input": "zombie"})
            assert isinstance(refused.value, CommitConflictError)
            assert zombie_metrics.counter("blob_store.requests", operation="list") == before + 1, (
                "one listing after the write is what caught it"
            )
        assert names_of(inner, n + 1) == [], "the zombie's write of its freed seq was removed again"
    with TaskStorage.open(config_for(tmp_path / "check", url), "task-0", blob_store=inner) as check:
        assert check.committed_seq == head
        assert check.restored == last
        assert contents(check) == model


def test_a_write_that_landed_in_a_freed_seq_is_taken_by_create_only_alone(tmp_path: Path) -> None:
    """The premise of the tests above, at the log's own level: after retention freed seq 2 (the log moved on to
    seq 30), a create-only write of seq 2 succeeds like a write of a fresh seq; only reading the log tells them
    apart, and :meth:`CheckpointLog.write` (its :meth:`~CheckpointLog.fence`) does."""
    from statebackend.checkpoint import CheckpointIdGenerator, CheckpointV2

    blobs = PerSeqMemoryBlobStore()
    owner = CheckpointLog(blobs, "job", "task-0", retained=RETAINED)
    ids = CheckpointIdGenerator()

    def checkpoint(offset: str) -> CheckpointV2:
        return CheckpointV2(checkpoint_id=ids.next(), input_offsets={"input": offset}, state_checkpoint_markers={})

    for seq in range(1, 31):
        listing = owner.write(seq, checkpoint(str(seq)))
        if owner.retention_due(listing):
            owner.retain(listing)
    assert 2 not in owner.seqs()
    zombie = CheckpointLog(blobs, "job", "task-0", retained=RETAINED)
    blobs.put(zombie.blob_name(2, 2), b"x", create_only=True)  # nothing refuses it
    blobs.delete(zombie.blob_name(2, 2))
    with pytest.raises(Exception, match="already holds newer checkpoints"):
        zombie.write(2, checkpoint("zombie"))
    assert 2 not in zombie.seqs() and max(zombie.seqs()) == 30
