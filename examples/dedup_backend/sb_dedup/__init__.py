"""sb_dedup: an example third-party state backend for statebackend, content-addressed ("dedup").

Each store's state is cut into chunks of at most ``dedup.chunk.records`` records (by key range); a chunk's blob is
named by the digest of its content, so a chunk that did not change is never written again and is shared by every
checkpoint that holds it. Each checkpoint writes one manifest (the chunks, in key order, bound to the job, task,
store and version); the marker is the manifest's name. A commit rewrites only the chunks whose key range the change
touched: its upload is O(change) in bytes.

It writes no garbage collection: it states, in a :class:`~statebackend.contracts.BlobLifetime`, that a marker
references its manifest and the manifest's chunks, and which blobs its running upload holds; the framework keeps
what any retained checkpoint names and deletes the rest (docs/architecture.md, "Blob lifetime").

It is found by the entry point ``dedup`` in group ``statebackend.backends`` (see pyproject.toml): configure
``stores.<name>.backup.factories=dedup``. statebackend itself never names it. It holds a store's state in memory
while it restores it: an example, not a backend for large state.
"""

from sb_dedup.factory import DedupStateBackendFactory

__all__ = ["DedupStateBackendFactory"]
