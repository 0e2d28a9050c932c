"""blob-snapshot: whole LMDB environment snapshots in content-addressed chunks plus an index blob (docs/architecture.md,
seed 002).

Mirrors the contracts: backup.py (TaskBackupManager), restore.py (TaskRestoreManager), admin.py (StateBackendAdmin),
factory.py (StateBackendFactory), format.py (blob names and the index blob written into checkpoints as the marker).
"""
