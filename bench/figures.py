"""What the benchmarks share to draw their figures: matplotlib, headless, from the ``bench`` extra.

The figures go under docs/img/ and are shown by docs/benchmarks*.md and docs/cost.md; each benchmark that draws one
takes ``--figure PATH``. matplotlib is needed only there: ``pip install -e ".[bench]"``.
"""

from __future__ import annotations

from typing import Any

__all__ = ["pyplot"]


def pyplot() -> Any:
    """``matplotlib.pyplot`` on the file-only Agg backend (no display needed), or a clear error naming the extra."""
    try:
        import matplotlib
    except ImportError as error:  # pragma: no cover - depends on the environment
        raise SystemExit('drawing a figure needs matplotlib: pip install -e ".[bench]"') from error
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt
