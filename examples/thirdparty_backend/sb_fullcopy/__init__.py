"""sb_fullcopy: an example third-party state backend for statebackend ("full copy").

At each commit it writes each store's whole content as one checksummed, self-describing blob bound to its name (job,
task, store, checkpoint id and flush token), and the checkpoint's marker is that blob's name. Restore downloads the
blob, verifies it and bulk-loads it; cleanup deletes the blobs older than the retained checkpoints.

**It costs O(state) per commit** (every commit uploads everything, and holds one copy in memory while it does): it is
an example of how to write, register and test a backend, not a backend for large state. Use ``changelog`` (deltas)
or ``blobsnapshot`` (content-addressed chunks) for that.

It is found by the entry point ``fullcopy`` in group ``statebackend.backends`` (see pyproject.toml): configure
``stores.<name>.backup.factories=fullcopy``. statebackend itself never names it.
"""

from sb_fullcopy.factory import FullCopyStateBackendFactory

__all__ = ["FullCopyStateBackendFactory"]
