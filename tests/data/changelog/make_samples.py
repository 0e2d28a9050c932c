"""Write the stored sample files of the changelog format, once per format version.

Run from the repository root: ``python -m tests.data.changelog.make_samples``. Existing samples are
never overwritten: they are the record of what an older release wrote, and tests/test_changelog_format.py checks that
this release still reads them. When FORMAT_VERSION changes, run this again to add the new version's samples.
expected-v<N>.json holds, per sample, the header fields and the records (hex; null for a delete).

Marker samples (the changelog backend's recipe, inside each checkpoint): ``marker-v1.json`` was written by the release
before marker format 2, with its own encoder; ``marker-v<MARKER_FORMAT>.json`` holds the same recipes as the current
format writes them, added by this script when the marker format changes. Each lists the steps the markers decode to.

The "fixed" samples (added with version 3) hold keys of one length and 8-byte values, which version 3 stores as byte
planes. The "blocks" sample is written with a block budget of a few dozen bytes (the writer's own logic, with a
smaller ``BLOCK_BYTES``), so a small file holds many blocks: some with deletes (op bytes), some without. The format
allows any block size up to BLOCK_MAX_RECORDS records; readers must not depend on the default.
"""

from __future__ import annotations

import json
import pathlib
from typing import Any

import attrs
from statebackend.backends.changelog.marker import MARKER_FORMAT, Recipe, Step

from statebackend.recordfile import FORMAT_VERSION, FileHeader, encode
from tests.recordfile_helpers import encode_small_blocks

HERE = pathlib.Path(__file__).resolve().parent

DELTA_RECORDS: list[tuple[bytes, bytes | None]] = [
    (b"", b"the empty key sorts first"),
    (b"apple", b"1"),
    (b"apple\x00", None),
    (b"banana", b""),
    (b"cherry", b"x" * 5000),  # bigger than the writer's packed-struct path
    (b"gone", None),
    (b"\xff\xfe", bytes(range(256))),
]
SNAPSHOT_RECORDS: list[tuple[bytes, bytes | None]] = [(b"key-%04d" % i, b"value-%d" % (i * i)) for i in range(300)]
#: deletes in runs (records 10-14, 33) and alone, values of varied length, so small blocks come with and without ops
BLOCKS_RECORDS: list[tuple[bytes, bytes | None]] = [
    (b"k%03d" % i, None if 10 <= i < 15 or i == 33 else b"v" * (i % 9)) for i in range(40)
]
#: block budget (key+value bytes) of the blocks sample
SMALL_BLOCK_BYTES = 24
#: keys of one length and 8-byte big-endian counters, as a store of string keys and integer values holds them (from
#: version 3 on, both columns are byte planes), with deletes, whose values are not in the value column
FIXED_RECORDS: list[tuple[bytes, bytes | None]] = [
    (b"k%08d" % (i * 4), None if i % 11 == 5 else (i * i % 1000).to_bytes(8, "big")) for i in range(200)
]


def samples() -> dict[str, tuple[FileHeader, list[tuple[bytes, bytes | None]], str]]:
    delta = FileHeader(
        kind="delta",
        job="sample-job",
        task="task-0",
        store="counts",
        checkpoint_id="1700000000000-123456",
        token="tok-1",
        seq=7,
        base_seq=6,
    )
    snapshot = FileHeader(
        kind="snapshot",
        job="sample-job",
        task="task-0",
        store="counts",
        checkpoint_id="1700000000000-123456",
        token="tok-1",
        seq=7,
        base_seq=7,
    )
    return {
        "delta-none": (delta, DELTA_RECORDS, "none"),
        "delta-zstd": (delta, DELTA_RECORDS, "zstd"),
        "snapshot-none": (snapshot, SNAPSHOT_RECORDS, "none"),
        "snapshot-zstd": (snapshot, SNAPSHOT_RECORDS, "zstd"),
        "delta-empty-zstd": (delta, [], "zstd"),
        "delta-blocks-zstd": (delta, BLOCKS_RECORDS, "zstd"),
        "delta-fixed-none": (delta, FIXED_RECORDS, "none"),
        "delta-fixed-zstd": (delta, FIXED_RECORDS, "zstd"),
        "snapshot-fixed-zstd": (snapshot, [(k, v) for k, v in FIXED_RECORDS if v is not None], "zstd"),
    }


def encode_sample(label: str, header: FileHeader, records: list[tuple[bytes, bytes | None]], compression: str) -> bytes:
    if not label.startswith("delta-blocks"):
        return encode(header, records, compression=compression)
    return encode_small_blocks(header, records, budget=SMALL_BLOCK_BYTES, compression=compression)


def recipe_from_steps(steps: list[list[Any]]) -> Recipe:
    """A recipe from the ``expected`` steps of a marker sample: ``[kind, seq, checkpoint id, token, blob name]``."""
    made = [(kind, Step(seq, checkpoint_id, token, name)) for kind, seq, checkpoint_id, token, name in steps]
    snapshot = next((step for kind, step in made if kind == "snapshot"), None)
    return Recipe(snapshot=snapshot, deltas=tuple(step for kind, step in made if kind == "delta"))


def write_marker_samples() -> None:
    """``marker-v<MARKER_FORMAT>.json``: the recipes of marker-v1.json (written by the release before marker format
    2, with that release's encoder) as this release encodes them, unless the file exists."""
    path = HERE / f"marker-v{MARKER_FORMAT}.json"
    if path.exists():
        print(f"kept {path.name}")
        return
    first = json.loads((HERE / "marker-v1.json").read_text())
    markers = {
        label: recipe_from_steps(steps).encode(prefix=first["prefix"]) for label, steps in first["expected"].items()
    }
    document = {
        "prefix": first["prefix"],
        "markers": markers,
        "expected": first["expected"],
        "written_by": f"make_samples.py, marker format {MARKER_FORMAT}",
    }
    path.write_text(json.dumps(document, indent=1, sort_keys=True) + "\n")
    print(f"wrote {path.name}")


def main() -> None:
    write_marker_samples()
    version = FORMAT_VERSION
    expected_path = HERE / f"expected-v{version}.json"
    expected = json.loads(expected_path.read_text()) if expected_path.exists() else {}
    for label, (header, records, compression) in samples().items():
        path = HERE / f"v{version}-{label}.sbchlog"
        if path.exists():
            print(f"kept {path.name}")
            continue
        path.write_bytes(encode_sample(label, header, records, compression))
        expected[path.name] = {
            "header": attrs.asdict(header),
            "compression": compression,
            "records": [[key.hex(), None if value is None else value.hex()] for key, value in records],
        }
        print(f"wrote {path.name}")
    expected_path.write_text(json.dumps(expected, indent=1, sort_keys=True) + "\n")


if __name__ == "__main__":
    main()
