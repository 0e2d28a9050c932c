"""Benchmarks. Run from the repository root, e.g. ``python bench/commit.py`` or
``python -m bench.commit``; results land in ``bench/results/``."""
