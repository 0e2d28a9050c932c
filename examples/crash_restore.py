"""Crash and restore, in plain Python: the library without Spark.

The parent starts a child process that streams generated keyed events through one task (counting events per key in
an LMDB store), commits every 1,000 events through the changelog-delta backend to a file:// blob store, and kills
itself with SIGKILL in the middle of the stream (mid-batch, with uncommitted writes). The parent then restores the
task in a fresh process, from the blob store alone (the local state directory is wiped), reads the input offset of
the last durable checkpoint, and checks the restored counts against a recomputation of the events up to that offset.

    python examples/crash_restore.py            # exits 0 and prints OK when the restored state is exact
"""

from __future__ import annotations

import os
import shutil
import signal
import subprocess
import sys
import tempfile
from collections import Counter
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from statebackend.task import TaskStorage

EVENTS = 25_000
COMMIT_EVERY = 1_000
KILL_AT = 17_345  # mid-batch: 345 events after the last commit are lost with the process and replayed by the source


def event_key(offset: int) -> str:
    """A deterministic keyed event stream: 500 keys, skewed."""
    return f"user-{(offset * 7919 + offset // 3) % 500:03d}"


def config(root: Path) -> dict[str, str]:
    return {
        "job.name": "crash-demo",
        "state.local.dir": str(root / "local"),
        "blob.store.url": f"file://{root / 'blobs'}",
        "stores.counts.backup.factories": "changelog",
        "stores.counts.key.serde": "string",
        "stores.counts.msg.serde": "integer",
        "changelog.snapshot.interval.commits": "5",
    }


def child(root: Path) -> None:
    with TaskStorage.open(config(root), "task-0") as task:
        counts = task.store("counts")
        start = int(task.restored.input_offsets["events"]) if task.restored else 0
        for offset in range(start, EVENTS):
            if offset == KILL_AT:
                print(f"child: SIGKILL at offset {offset}", flush=True)
                os.kill(os.getpid(), signal.SIGKILL)
            key = event_key(offset)
            counts.put(key, (counts.get(key) or 0) + 1)
            if (offset + 1) % COMMIT_EVERY == 0:
                task.commit_durably({"events": str(offset + 1)})


def main() -> int:
    root = Path(tempfile.mkdtemp(prefix="statebackend-crash-demo-"))
    try:
        print(f"child: streaming {EVENTS} events, committing every {COMMIT_EVERY}, blob store {root / 'blobs'}")
        proc = subprocess.run([sys.executable, __file__, "--child", str(root)], check=False)
        print(f"child exited with {proc.returncode} (SIGKILL is {-signal.SIGKILL})")
        shutil.rmtree(root / "local")  # a move to another machine: nothing local survives
        with TaskStorage.open(config(root), "task-0") as task:
            assert task.restored is not None, "no durable checkpoint"
            durable = int(task.restored.input_offsets["events"])
            restored = dict(task.store("counts").items())
            restore_ms = task.metrics.samples("restore.ms")[0]
        expected = Counter(event_key(offset) for offset in range(durable))
        print(f"restored checkpoint {task.restored.checkpoint_id} at input offset {durable} in {restore_ms:.1f} ms")
        print(f"restored {len(restored)} keys, {sum(restored.values())} events counted")
        ok = restored == dict(expected)
        print("OK: restored counts equal the recomputation up to the durable offset" if ok else "FAIL: mismatch")
        return 0 if ok else 1
    finally:
        shutil.rmtree(root, ignore_errors=True)


if __name__ == "__main__":
    if len(sys.argv) == 3 and sys.argv[1] == "--child":
        child(Path(sys.argv[2]))
    else:
        sys.exit(main())
