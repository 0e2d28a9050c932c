"""changelog-delta: per-commit delta files and background materialized snapshots.

Mirrors the contracts: backup.py (TaskBackupManager), restore.py (TaskRestoreManager), admin.py
(StateBackendAdmin), factory.py (StateBackendFactory), format.py (the delta/snapshot file format), marker.py (the
recipe written into checkpoints).
"""
