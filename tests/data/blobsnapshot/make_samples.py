"""Write the stored sample of the blob-snapshot format, schema version 2: an index and the runs it lists.

Run from the repository root: ``python -m tests.data.blobsnapshot.make_samples``. Existing samples
are never overwritten: they are the record of what an older release wrote, and tests/test_blobsnapshot.py checks that
this release still reads and restores them. When the schema version changes, add the new version's samples here.

The sample is a chain of three runs under ``sample-job/task-0/counts/blobsnapshot/``: a base run (versions 1..3),
a level-0 run (version 4: an update, an empty value, a new key and tombstones, one of them for a key no run holds)
and a level-1 run (versions 5..6), listed by the index of version 7 (a commit that changed nothing adds no run). Files:

- ``index-v2.json``: the index blob, named in the blob store as ``INDEX_NAME`` below;
- ``runs-v2/<hash>``: each run, its name the blake2b-256 of its bytes;
- ``expected-v2.json``: the index's name and the store's contents after a restore (hex keys and values).
"""

from __future__ import annotations

import json
import pathlib

from statebackend.backends.blobsnapshot.format import RunEntry, RunIndex, content_hash, index_name

from statebackend.recordfile import KIND_RUN, FileHeader, encode

HERE = pathlib.Path(__file__).resolve().parent

JOB, TASK, STORE = "sample-job", "task-0", "counts"
PREFIX = f"{JOB}/{TASK}/{STORE}/blobsnapshot/"
INDEX_NAME = index_name(PREFIX, 7, "tok-7")
BASE_LEVEL = 1 << 16

Records = list[tuple[bytes, bytes | None]]

BASE: Records = [*((b"key-%04d" % i, b"value-%d" % (i * i)) for i in range(200)), (b"\xff\xfe", bytes(range(256)))]
LEVEL0: Records = [
    (b"\x00", b"sorts first"),
    (b"key-0003", b"updated"),
    (b"key-0004", None),
    (b"key-0100", b""),
    (b"never-written", None),
]
LEVEL1: Records = [(b"key-0005", None), (b"key-0150", b"x" * 5000), (b"new", b"in a merged run")]

#: (records, first_seq, last_seq, checkpoint id and token of last_seq, level, base)
RUNS = [
    (BASE, 1, 3, "1700000000000-000003", "tok-3", BASE_LEVEL, True),
    (LEVEL0, 4, 4, "1700000000000-000004", "tok-4", 0, False),
    (LEVEL1, 5, 6, "1700000000000-000006", "tok-6", 1, False),
]


def build() -> tuple[RunIndex, dict[str, bytes], dict[bytes, bytes]]:
    runs: list[RunEntry] = []
    blobs: dict[str, bytes] = {}
    state: dict[bytes, bytes] = {}
    for records, first, last, checkpoint_id, token, level, base in RUNS:
        header = FileHeader(
            kind=KIND_RUN,
            job=JOB,
            task=TASK,
            store=STORE,
            checkpoint_id=checkpoint_id,
            token=token,
            seq=last,
            base_seq=first - 1,
        )
        data = encode(header, sorted(records), compression="zstd", level=3)
        digest = content_hash(data)
        blobs[digest] = data
        runs.append(
            RunEntry(
                hash=digest,
                size=len(data),
                records=len(records),
                level=level,
                base=base,
                first_seq=first,
                last_seq=last,
                checkpoint_id=checkpoint_id,
                token=token,
            )
        )
        for key, value in records:
            if value is None:
                state.pop(key, None)
            else:
                state[key] = value
    index = RunIndex(
        job=JOB,
        task=TASK,
        store=STORE,
        checkpoint_id="1700000000000-000007",
        token="tok-7",
        seq=7,
        runs=tuple(runs),
        key_count=len(state),
        previous_index=index_name(PREFIX, 6, "tok-6"),
    )
    return index, blobs, state


def main() -> None:
    index, blobs, state = build()
    targets = {HERE / "index-v2.json": index.encode()}
    targets.update({HERE / "runs-v2" / digest: data for digest, data in blobs.items()})
    expected = {"index_name": INDEX_NAME, "contents": {key.hex(): value.hex() for key, value in sorted(state.items())}}
    targets[HERE / "expected-v2.json"] = (json.dumps(expected, indent=1, sort_keys=True) + "\n").encode()
    for path, data in targets.items():
        if path.exists():
            print(f"kept {path.relative_to(HERE)} (samples are never overwritten)")
            continue
        path.parent.mkdir(exist_ok=True)
        path.write_bytes(data)
        print(f"wrote {path.relative_to(HERE)} ({len(data)} bytes)")


if __name__ == "__main__":
    main()
