"""Write the stored environment-file base sample (format version 1) that tests/test_envbase.py reads back: 200 keys
``>Q`` 0..199, values ``b"v" + key``, version ``1-1``/``aaaa``, lineage job ``j``, task ``t``, store ``s``, seq 5,
zstd frames. Run from the repository root: ``python -m tests.data.envbase.make_samples``. Never rewrite a sample a
release has read: add one for a new version instead."""

from __future__ import annotations

import tempfile
from pathlib import Path

from tests.test_envbase import filled_store, write_base

HERE = Path(__file__).resolve().parent


def main() -> None:
    with tempfile.TemporaryDirectory() as tmp, filled_store(Path(tmp) / "a", 200) as local:
        data = write_base(local, Path(tmp) / "base")
    (HERE / "base-v1-zstd.sbenvbs").write_bytes(data)
    print(f"wrote {len(data)} bytes")


if __name__ == "__main__":
    main()
