"""The process tests/test_blobsnapshot_bulk_base.py kills: a blob-snapshot task whose first commit is a bulk load
(uploaded as an environment-file base), then small update commits, and at :data:`REBULK` a second bulk commit
over the chain, all durable, on a ``file://`` blob store.

Usage (from the repository root)::

    python -m tests.bulk_base_child <workdir> <report.json> <commits>

It opens ``task-0`` under ``<workdir>``, which restores the newest durable checkpoint, writes what it restored
(the commit number and the contents) to ``<report.json>``, then runs ``<commits>`` more commits ``n = restored + 1,
...`` of :func:`operations` ``(n)``, appending ``n`` to ``<workdir>/durable.log`` after each. With
``STATEBACKEND_CRASH_AT`` set it dies at that crash point (statebackend/crashpoints.py). The data is a function of
the commit number alone (:func:`expected_state`).
"""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path

from statebackend.task import TaskStorage
from statebackend.testing.deadline import scaled

TASK = "task-0"
STORE = "counts"
#: keys of the bulk load; a commit of at least BULK_MIN changes (and half the store) is uploaded as a base
KEYS = 3_000
BULK_MIN = 1_000
#: the commit that rewrites every key again: a bulk commit over a chain of runs
REBULK = 4
UPDATES = 40


def config(workdir: Path) -> dict[str, object]:
    return {
        "job.name": "job",
        "state.local.dir": str(workdir / "local"),
        "blob.store.url": f"file://{workdir / 'blobs'}",
        "stores.counts.backup.factories": "blobsnapshot",
        "stores.counts.lmdb.map.size": "64MiB",
        "task.checkpoint.retained": 2,
        "blobsnapshot.upload.base.min.records": BULK_MIN,
        # no grace period and a sweep every 2 commits and at start: the run a bulk base replaces is collected (and a
        # crash can hit that) within the child's commits
        "blobsnapshot.gc.grace.period.ms": 0,
        "blobsnapshot.gc.interval.commits": 2,
        "blobsnapshot.gc.on.init": True,
    }


def _key(i: int) -> bytes:
    return f"key{i:06d}".encode()


def operations(n: int) -> list[tuple[bytes, bytes | None]]:
    """The writes of commit ``n``: every key at commit 1 and :data:`REBULK`, else :data:`UPDATES` keys (1 in 5 of
    them a delete)."""
    if n in (1, REBULK):
        return [(_key(i), f"bulk-{n}-{i}".encode()) for i in range(KEYS)]
    keys = sorted({(n * 97 + j * 31) % KEYS for j in range(UPDATES)})
    return [(_key(k), None if (k + n) % 5 == 0 else f"update-{n}-{k}".encode()) for k in keys]


def expected_state(n: int) -> dict[bytes, bytes]:
    """The store's contents at checkpoint ``n`` (0: empty)."""
    state: dict[bytes, bytes] = {}
    for commit in range(1, n + 1):
        for key, value in operations(commit):
            if value is None:
                state.pop(key, None)
            else:
                state[key] = value
    return state


def run(workdir: Path, report: Path, commits: int) -> None:
    with TaskStorage.open(config(workdir), TASK) as task:
        task.checkpoint_log.retention_interval = 2
        store = task.store(STORE)
        restored = 0 if task.restored is None else int(task.restored.input_offsets["input"])
        contents = {key.hex(): value.hex() for key, value in store.items()}
        partial = report.with_name(report.name + ".partial")
        partial.write_text(json.dumps({"restored": restored, "contents": contents}))
        os.replace(partial, report)
        durable_log = os.open(workdir / "durable.log", os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o644)
        try:
            for n in range(restored + 1, restored + commits + 1):
                for key, value in operations(n):
                    if value is None:
                        store.delete(key)
                    else:
                        store.put(key, value)
                task.commit_durably({"input": str(n)}, timeout=scaled(60))
                os.write(durable_log, f"{n}\n".encode())
        finally:
            os.close(durable_log)


if __name__ == "__main__":
    if len(sys.argv) != 4:
        print(__doc__, file=sys.stderr)
        sys.exit(2)
    run(Path(sys.argv[1]), Path(sys.argv[2]), int(sys.argv[3]))
