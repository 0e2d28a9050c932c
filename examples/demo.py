"""The README's demo (``./dev demo``): a stateful word count on PySpark Structured Streaming ``foreachBatch`` with
the embedded defaults (LMDB on local disk, a ``file://`` blob store in a temp dir), checked against a batch
computation. See examples/wordcount.py; examples/crash_restore.py shows a SIGKILL and an exact restore without Spark.
Arguments are passed to the word count (``./dev demo --batches 20``)."""

from __future__ import annotations

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

import wordcount

if __name__ == "__main__":
    sys.exit(wordcount.main(sys.argv[1:]))
