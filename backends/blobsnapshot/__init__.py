"""blob-snapshot: an LSM tree on the blob store: immutable, content-addressed sorted runs (one per commit, merged in the
background) and an index per commit listing the live runs, carried by the checkpoint's marker
(docs/formats-blobsnapshot.md, seed 002).

Mirrors the contracts: backup.py (TaskBackupManager), restore.py (TaskRestoreManager), admin.py (StateBackendAdmin),
factory.py (StateBackendFactory), format.py (blob names, run entries, the index and the marker that carries it).
"""
