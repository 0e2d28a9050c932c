"""sb_mem2: an example third-party blob store for statebackend (``mem2://``).

Blobs live in this process's memory, in named buckets; ``blob.store.max.bytes`` bounds a bucket. It is found by the
entry point ``mem2`` in group ``statebackend.blobstores`` (see pyproject.toml): configure
``blob.store.url=mem2://<name>``. statebackend itself never names it.
"""

from sb_mem2.store import Mem2BlobStore

__all__ = ["Mem2BlobStore"]
