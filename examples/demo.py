"""The README's demo (``./dev demo``): a stateful word count on PySpark Structured Streaming ``foreachBatch`` with
the embedded defaults (LMDB on local disk, a ``file://`` blob store in a temp dir), checked against a batch
computation. See examples/wordcount.py; examples/crash_restore.py shows a SIGKILL and an exact restore without Spark.
Arguments are passed to the word count (``./dev demo --batches 20``). Its temp dir is removed at the end, also when
the run fails, unless ``./dev demo --keep-state``."""

from __future__ import annotations

import runpy
import sys
from pathlib import Path

if __name__ == "__main__":
    # run as __main__ (not imported), so Spark ships the job's functions to its Python workers by value
    wordcount = Path(__file__).resolve().parent / "wordcount.py"
    sys.argv = [str(wordcount), *sys.argv[1:]]
    runpy.run_path(str(wordcount), run_name="__main__")
