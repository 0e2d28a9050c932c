"""The README's demo: see examples/crash_restore.py."""

from __future__ import annotations

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

import crash_restore  # noqa: E402

if __name__ == "__main__":
    sys.exit(crash_restore.main())
