"""Write the stored environment-file base sample of the current format version that tests/test_envbase.py reads back:
200 keys ``>Q`` 0..199, values ``b"v" + key``, version ``1-1``/``aaaa``, lineage job ``j``, task ``t``, store ``s``,
seq 5, zstd frames, into ``base-v<version>-zstd.sbenvbs``. Run from the repository root:
``python -m tests.data.envbase.make_samples``. Never rewrite a sample a release has read (version 1 and 2 are
stored): a sample that exists is left as it is, so only a new version adds one."""

from __future__ import annotations

import tempfile
from pathlib import Path

from statebackend.envbase import FORMAT_VERSION
from tests.test_envbase import filled_store, write_base

HERE = Path(__file__).resolve().parent


def sample_path(version: int) -> Path:
    return HERE / f"base-v{version}-zstd.sbenvbs"


def main() -> None:
    path = sample_path(FORMAT_VERSION)
    if path.exists():
        print(f"{path.name} exists: kept as written")
        return
    with tempfile.TemporaryDirectory() as tmp, filled_store(Path(tmp) / "a", 200) as local:
        data = write_base(local, Path(tmp) / "base")
    path.write_bytes(data)
    print(f"wrote {path.name}: {len(data)} bytes")


if __name__ == "__main__":
    main()
