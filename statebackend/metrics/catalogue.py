"""Every metric statebackend emits, declared once: its kind, unit, Prometheus name, meaning and histogram buckets.

The name in code (``metrics.increment("commit.skips")``) is the key; the OpenTelemetry instrument is
``statebackend.<name>`` with the unit below (UCUM: ``ms``, ``s``, ``By``, ``1``); the Prometheus family is
``prometheus`` (histograms in milliseconds are exported in seconds, Prometheus's base unit). docs/operations.md lists
this table; tests/test_metrics.py checks that both agree and that every name here is emitted somewhere in the code.

A name that is not declared here (a third-party backend's own metric) is still exported: as a counter or a
histogram with :data:`GENERIC_BUCKETS`, named ``statebackend_<name with dots as underscores>``.
"""

from __future__ import annotations

import re
from collections.abc import Mapping

import attrs

__all__ = [
    "BYTES_BUCKETS",
    "CATALOGUE",
    "COUNT_BUCKETS",
    "GENERIC_BUCKETS",
    "MS_BUCKETS",
    "RUN_BUCKETS",
    "SECONDS_BUCKETS",
    "TIMER_BUCKETS",
    "MetricSpec",
    "spec_for",
]

#: histogram bucket upper bounds (the +Inf bucket is implied); fixed per metric, so histograms of many tasks, many
#: processes or many batches merge by adding bucket counts
MS_BUCKETS = (
    1.0,
    2.0,
    5.0,
    10.0,
    25.0,
    50.0,
    100.0,
    250.0,
    500.0,
    1000.0,
    2500.0,
    5000.0,
    10000.0,
    30000.0,
    60000.0,
    300000.0,
)
SECONDS_BUCKETS = tuple(b / 1000.0 for b in MS_BUCKETS)
BYTES_BUCKETS = tuple(float(1 << shift) for shift in range(10, 32, 2))  # 1 KiB, 4 KiB, ... 1 GiB
COUNT_BUCKETS = (1.0, 2.0, 3.0, 4.0, 5.0, 8.0, 12.0)
RUN_BUCKETS = (1.0, 2.0, 4.0, 8.0, 16.0, 32.0, 64.0, 128.0)
TIMER_BUCKETS = (0.0, 10.0, 100.0, 1000.0, 10000.0, 100000.0, 1000000.0, 10000000.0)
GENERIC_BUCKETS = (0.001, 0.01, 0.1, 1.0, 10.0, 100.0, 1000.0, 10000.0, 100000.0, 1000000.0)

COUNTER, HISTOGRAM = "counter", "histogram"


@attrs.frozen
class MetricSpec:
    """One metric: ``kind`` is ``counter`` or ``histogram``; ``unit`` as OpenTelemetry takes it; ``prometheus`` the
    family name in the exposition format; ``labels`` the label names the code adds besides ``job_name`` and
    ``task``."""

    name: str
    kind: str
    unit: str
    prometheus: str
    help: str
    buckets: tuple[float, ...] = ()
    labels: tuple[str, ...] = ()

    @property
    def prometheus_scale(self) -> float:
        """The factor from the recorded value to the exported one (milliseconds are exported as seconds)."""
        return 0.001 if self.unit == "ms" else 1.0


def _counter(name: str, prometheus: str, help: str, unit: str = "1", labels: tuple[str, ...] = ()) -> MetricSpec:
    return MetricSpec(name, COUNTER, unit, prometheus, help, (), labels)


def _histogram(
    name: str, prometheus: str, help: str, unit: str, buckets: tuple[float, ...], labels: tuple[str, ...] = ()
) -> MetricSpec:
    return MetricSpec(name, HISTOGRAM, unit, prometheus, help, buckets, labels)


_OP = ("operation",)
#: what one store's backend sent or read: the store's name and the backend's (``changelog``, ``blobsnapshot``, ...)
_STORE = ("store", "backend")

_SPECS = [
    # -- commits (statebackend/commit.py) --------------------------------------------------------------------------
    _counter("commit.count", "statebackend_commits_total", "commits started (their sync part ran)"),
    _counter("commit.failures", "statebackend_commit_failures_total", "commits whose async part failed"),
    _counter(
        "commit.conflicts",
        "statebackend_commit_conflicts_total",
        "commits that lost the checkpoint write to another attempt of the task (fenced)",
    ),
    _counter(
        "commit.skips",
        "statebackend_commit_skips_total",
        "commits skipped: the previous upload started less than task.commit.max.delay.ms ago",
    ),
    _counter(
        "commit.blocks",
        "statebackend_commit_blocks_total",
        "commits that blocked on the previous upload (after task.commit.max.delay.ms)",
    ),
    _counter(
        "commit.timeouts",
        "statebackend_commit_timeouts_total",
        "commits that failed after blocking task.commit.timeout.ms",
    ),
    _counter(
        "ttl.keys.expired",
        "statebackend_ttl_expired_keys_total",
        "expired keys the TTL sweep deleted before a commit (stores with stores.<name>.ttl.ms)",
    ),
    _histogram(
        "commit.sync.ms",
        "statebackend_commit_sync_seconds",
        "the part of a commit that stops processing (flush and snapshot)",
        "ms",
        MS_BUCKETS,
    ),
    _histogram(
        "commit.total.ms",
        "statebackend_commit_duration_seconds",
        "from the start of a commit until its checkpoint is durable",
        "ms",
        MS_BUCKETS,
    ),
    _histogram(
        "commit.upload.ms",
        "statebackend_commit_upload_seconds",
        "from the start of a commit until the backends' uploads ended (the part before the checkpoint write)",
        "ms",
        MS_BUCKETS,
    ),
    _histogram(
        "commit.checkpoint.ms",
        "statebackend_commit_checkpoint_seconds",
        "the checkpoint write of a commit: the create-only write, the fencing listing, the local file",
        "ms",
        MS_BUCKETS,
    ),
    _histogram(
        "commit.block.ms",
        "statebackend_commit_block_seconds",
        "time a commit spent blocked on the previous upload",
        "ms",
        MS_BUCKETS,
    ),
    _counter(
        "commit.bytes.uploaded",
        "statebackend_commit_uploaded_bytes_total",
        "bytes the backends uploaded for commits",
        "By",
        labels=_STORE,
    ),
    _counter(
        "commit.files.uploaded",
        "statebackend_commit_uploaded_files_total",
        "blobs the backends uploaded for commits",
        labels=_STORE,
    ),
    _counter(
        "commit.bytes.reused",
        "statebackend_commit_reused_bytes_total",
        "bytes a commit did not upload because the blob store already had them (blob-snapshot runs)",
        "By",
        labels=_STORE,
    ),
    _counter(
        "commit.cleanup.failures",
        "statebackend_commit_cleanup_failures_total",
        "cleanups after a durable commit that failed; their garbage is tried again at the next cleanup",
    ),
    _counter(
        "commit.landed.after.failure",
        "statebackend_commit_landed_after_failure_total",
        "checkpoint writes reported failed (reply lost) that had landed, found by reading back",
    ),
    _counter(
        "commit.local.checkpoint.failures",
        "statebackend_commit_local_checkpoint_failures_total",
        "durable commits whose local CHECKPOINT-V2 file could not be written",
    ),
    # -- restores (statebackend/task.py, the backends' restore managers) --------------------------------------------
    _histogram("restore.ms", "statebackend_restore_seconds", "restore of a task's stores at open", "ms", MS_BUCKETS),
    _histogram(
        "restore.store.ms",
        "statebackend_restore_store_seconds",
        "restore of one store by one backend",
        "ms",
        MS_BUCKETS,
        labels=_STORE,
    ),
    _counter(
        "restore.bytes",
        "statebackend_restore_downloaded_bytes_total",
        "bytes downloaded by restores",
        "By",
        labels=_STORE,
    ),
    _counter(
        "restore.stores.reused",
        "statebackend_restore_stores_reused_total",
        "stores whose local data already was the checkpoint's state",
    ),
    _counter(
        "restore.stores.caught.up",
        "statebackend_restore_stores_caught_up_total",
        "stores brought to the checkpoint by applying only what they missed (changelog deltas, blob-snapshot runs)",
    ),
    _counter(
        "restore.stores.full", "statebackend_restore_stores_full_total", "stores restored in full from the blob store"
    ),
    _counter(
        "restore.deltas.replayed", "statebackend_restore_deltas_replayed_total", "changelog deltas applied by restores"
    ),
    _counter(
        "restore.runs.applied", "statebackend_restore_runs_applied_total", "blob-snapshot runs applied by restores"
    ),
    # -- changelog backend (backends/changelog) ----------------------------------------------------------------------
    _counter("changelog.delta.uploads", "statebackend_changelog_delta_uploads_total", "changelog deltas uploaded"),
    _counter(
        "changelog.snapshot.uploads", "statebackend_changelog_snapshot_uploads_total", "changelog snapshots uploaded"
    ),
    _histogram(
        "changelog.delta.bytes",
        "statebackend_changelog_delta_bytes",
        "size of an uploaded changelog delta",
        "By",
        BYTES_BUCKETS,
    ),
    _histogram(
        "changelog.snapshot.bytes",
        "statebackend_changelog_snapshot_bytes",
        "size of an uploaded changelog snapshot",
        "By",
        BYTES_BUCKETS,
    ),
    _counter(
        "changelog.blobs.refreshed",
        "statebackend_changelog_blobs_refreshed_total",
        "deltas and snapshots an earlier try had written too long ago to name: written again with a fresh age",
    ),
    _counter(
        "changelog.delta.reuploads",
        "statebackend_changelog_delta_reuploads_total",
        "deltas uploaded again after their first upload's outcome was unknown",
    ),
    _counter(
        "changelog.snapshot.adopted",
        "statebackend_changelog_snapshot_adopted_total",
        "background snapshots a commit's recipe started from",
    ),
    _counter(
        "changelog.snapshot.rejected",
        "statebackend_changelog_snapshot_rejected_total",
        "finished snapshots not adopted after a restart (missing, damaged or of another chain)",
    ),
    _counter(
        "changelog.snapshot.failures",
        "statebackend_changelog_snapshot_failures_total",
        "background snapshots that failed",
    ),
    _counter(
        "changelog.snapshot.too.old",
        "statebackend_changelog_snapshot_too_old_total",
        "background snapshots too old to adopt under the garbage-collection grace period",
    ),
    _counter(
        "changelog.rebase.after.fallback",
        "statebackend_changelog_rebase_after_fallback_total",
        "fresh chains started because another backend restored the store",
    ),
    _counter(
        "changelog.rebase.old.blobs",
        "statebackend_changelog_rebase_old_blobs_total",
        "fresh chains started because the chain named blobs older than half the grace period",
    ),
    _counter(
        "changelog.blobs.deleted", "statebackend_changelog_blobs_deleted_total", "changelog blobs deleted by cleanup"
    ),
    _counter("changelog.sweeps", "statebackend_changelog_sweeps_total", "changelog mark-and-sweep runs"),
    _counter(
        "changelog.sweep.deleted",
        "statebackend_changelog_sweep_deleted_total",
        "unreferenced changelog blobs deleted by sweeps",
    ),
    _counter(
        "changelog.sweep.kept",
        "statebackend_changelog_sweep_kept_total",
        "blobs a sweep judged unreferenced and old but kept: written again since (conditional deletes)",
    ),
    _counter(
        "changelog.sweep.stopped",
        "statebackend_changelog_sweep_stopped_total",
        "sweeps stopped early (they ran longer than a quarter of the grace period)",
    ),
    # -- blob-snapshot backend (backends/blobsnapshot) ---------------------------------------------------------------
    _counter(
        "blobsnapshot.runs.uploaded",
        "statebackend_blobsnapshot_runs_uploaded_total",
        "sorted runs uploaded (one per commit with a change, plus base runs)",
    ),
    _counter(
        "blobsnapshot.runs.reused",
        "statebackend_blobsnapshot_runs_reused_total",
        "runs not uploaded because the blob store already had them",
    ),
    _counter(
        "blobsnapshot.base.runs",
        "statebackend_blobsnapshot_base_runs_total",
        "base runs (the whole state) written to start a chain or for a bulk commit",
    ),
    _histogram(
        "blobsnapshot.runs.live",
        "statebackend_blobsnapshot_runs_live",
        "runs an index names when a commit writes it",
        "1",
        RUN_BUCKETS,
    ),
    _counter(
        "blobsnapshot.runs.missing",
        "statebackend_blobsnapshot_runs_missing_total",
        "runs of a durable index found missing when marking them durable",
    ),
    _counter("blobsnapshot.runs.deleted", "statebackend_blobsnapshot_runs_deleted_total", "runs deleted by cleanup"),
    _counter(
        "blobsnapshot.compactions.merge",
        "statebackend_blobsnapshot_compactions_merge_total",
        "size-tiered compactions written (runs above the bottom run merged)",
    ),
    _counter(
        "blobsnapshot.compactions.full",
        "statebackend_blobsnapshot_compactions_full_total",
        "full compactions written (every run merged into a new base run)",
    ),
    _counter(
        "blobsnapshot.compaction.runs", "statebackend_blobsnapshot_compaction_runs_total", "compacted runs uploaded"
    ),
    _counter(
        "blobsnapshot.compaction.bytes",
        "statebackend_blobsnapshot_compaction_bytes_total",
        "bytes of compacted runs uploaded",
        "By",
    ),
    _counter(
        "blobsnapshot.compaction.adopted",
        "statebackend_blobsnapshot_compaction_adopted_total",
        "compactions a commit's index took in place of their input runs",
    ),
    _counter(
        "blobsnapshot.compaction.refreshed",
        "statebackend_blobsnapshot_compaction_refreshed_total",
        "compacted runs written again from their local copy before adoption (older than half the grace)",
    ),
    _counter(
        "blobsnapshot.compaction.too.old",
        "statebackend_blobsnapshot_compaction_too_old_total",
        "compactions not adopted: older than half the grace period and no local copy left",
    ),
    _counter(
        "blobsnapshot.compaction.failures",
        "statebackend_blobsnapshot_compaction_failures_total",
        "compactions that failed (tried again later)",
    ),
    _counter(
        "blobsnapshot.rebase.after.fallback",
        "statebackend_blobsnapshot_rebase_after_fallback_total",
        "chains restarted with a base run because another backend restored the store or its data differs",
    ),
    _counter(
        "blobsnapshot.indexes.uploaded",
        "statebackend_blobsnapshot_indexes_uploaded_total",
        "blob-snapshot indexes written (inline in the checkpoint's marker; index blobs before)",
    ),
    _counter(
        "blobsnapshot.indexes.deleted",
        "statebackend_blobsnapshot_indexes_deleted_total",
        "blob-snapshot indexes deleted by cleanup",
    ),
    _counter(
        "blobsnapshot.indexes.landed.after.failure",
        "statebackend_blobsnapshot_indexes_landed_after_failure_total",
        "index writes reported failed that had landed, found by reading back",
    ),
    _counter("blobsnapshot.sweeps", "statebackend_blobsnapshot_sweeps_total", "blob-snapshot mark-and-sweep runs"),
    _counter(
        "blobsnapshot.sweep.runs.deleted",
        "statebackend_blobsnapshot_sweep_runs_deleted_total",
        "unreferenced runs deleted by sweeps",
    ),
    _counter(
        "blobsnapshot.sweep.kept",
        "statebackend_blobsnapshot_sweep_kept_total",
        "runs and indexes a sweep judged unreferenced and old but kept: written again since (conditional deletes)",
    ),
    _counter(
        "blobsnapshot.sweep.indexes.deleted",
        "statebackend_blobsnapshot_sweep_indexes_deleted_total",
        "unreferenced indexes deleted by sweeps",
    ),
    # -- the Spark driver (statebackend/spark/driver.py) ----------------------------------------------------------
    _counter(
        "spark.batch.reruns",
        "statebackend_spark_batch_reruns_total",
        "batches the driver ran again, every task waiting for its checkpoint, because a checkpoint a task did "
        "not wait for was not in its log (statebackend.microbatch.confirm), or a task reported no statistics",
    ),
    _counter(
        "spark.task.stats.missing",
        "statebackend_spark_task_stats_missing_total",
        "tasks whose statistics did not come back: Spark read their output from a block a failed attempt "
        "stored (classic Spark, where stats travel in an accumulator)",
    ),
    _histogram(
        "spark.confirm.ms",
        "statebackend_spark_confirm_seconds",
        "time the driver spent confirming the checkpoints tasks did not wait for, per batch",
        "ms",
        MS_BUCKETS,
    ),
    _histogram(
        "spark.batch.ms",
        "statebackend_spark_batch_seconds",
        "wall time of a batch on the driver: its tasks, the confirmation of their checkpoints, a run again",
        "ms",
        MS_BUCKETS,
    ),
    # -- timers of the Spark driver's tasks (statebackend/microbatch/timers.py, executor.py) ---------------------------
    _counter(
        "timers.registered",
        "statebackend_timers_registered_total",
        "timers the tasks' code registered (registering a timer that exists is not counted), per task attempt",
    ),
    _counter(
        "timers.deleted",
        "statebackend_timers_deleted_total",
        "timers the tasks' code deleted before they fired (delete, delete_all), per task attempt",
    ),
    _counter(
        "timers.fired",
        "statebackend_timers_fired_total",
        "timers fired: handed to on_timers and deleted, per task attempt (a replayed batch fires its timers "
        "again and counts them again; its commit lands once)",
    ),
    _histogram(
        "timers.pending",
        "statebackend_timers_pending",
        "timers a task holds after a batch, one sample per task and batch (a batch's sum: the job's pending timers)",
        "1",
        TIMER_BUCKETS,
    ),
    # -- evolving values (statebackend/values.py) -------------------------------------------------------------------
    _counter(
        "migration.runs",
        "statebackend_migration_runs_total",
        "migrations an open ran over a store's values (one that runs again after a crash before its commit "
        "landed counts again)",
    ),
    _counter(
        "migration.values.rewritten",
        "statebackend_migration_values_rewritten_total",
        "values a migration's function rewrote",
    ),
    _counter(
        "migration.values.deleted",
        "statebackend_migration_values_deleted_total",
        "keys a migration's function deleted (it returned None)",
    ),
    # -- blob stores: each request of az:// and s3:// (statebackend/blobstores/resilience.py) --------------------------
    _counter(
        "blob_store.requests",
        "statebackend_blob_store_requests_total",
        "requests to the blob store (a part of a large transfer is one request), by operation and outcome",
        labels=("operation", "outcome"),
    ),
    _counter(
        "blob_store.failed_requests",
        "statebackend_blob_store_failed_requests_total",
        "requests that failed for good (after their retries)",
        labels=_OP,
    ),
    _counter(
        "blob_store.retries", "statebackend_blob_store_retries_total", "retries after a transient failure", labels=_OP
    ),
    _counter(
        "blob_store.hedges",
        "statebackend_blob_store_hedges_total",
        "hedged attempts started because an attempt was slower than blob.store.hedge.after.ms",
        labels=_OP,
    ),
    _counter(
        "blob_store.attempt_timeouts",
        "statebackend_blob_store_attempt_timeouts_total",
        "attempts abandoned after blob.store.request.timeout.ms",
        labels=_OP,
    ),
    _counter(
        "blob_store.create_only_read_backs",
        "statebackend_blob_store_create_only_read_backs_total",
        "create-only writes resolved by reading the blob back (a lost reply)",
    ),
    _histogram(
        "blob_store.attempts_per_request",
        "statebackend_blob_store_attempts_per_request",
        "attempts one request took (retries and hedges included)",
        "1",
        COUNT_BUCKETS,
        labels=_OP,
    ),
    _histogram(
        "blob_store.latency_s",
        "statebackend_blob_store_request_seconds",
        "time of one request, its retries and hedges included",
        "s",
        SECONDS_BUCKETS,
        labels=_OP,
    ),
    _counter(
        "blob_store.bytes.sent",
        "statebackend_blob_store_sent_bytes_total",
        "payload bytes of successful writes",
        "By",
        labels=_OP,
    ),
    _counter(
        "blob_store.bytes.received",
        "statebackend_blob_store_received_bytes_total",
        "payload bytes of successful reads",
        "By",
        labels=_OP,
    ),
]

CATALOGUE: Mapping[str, MetricSpec] = {spec.name: spec for spec in _SPECS}

_UNSAFE = re.compile(r"[^a-zA-Z0-9_]")
_generic: dict[tuple[str, str], MetricSpec] = {}


def spec_for(name: str, kind: str) -> MetricSpec:
    """The declared spec of ``name``, or a generic one for an undeclared name (a third-party backend's metric)."""
    spec = CATALOGUE.get(name)
    if spec is not None:
        return spec
    key = (name, kind)
    found = _generic.get(key)
    if found is None:
        base = "statebackend_" + _UNSAFE.sub("_", name)
        prometheus = base + "_total" if kind == COUNTER and not base.endswith("_total") else base
        found = MetricSpec(
            name, kind, "1", prometheus, f"{name} (not in the catalogue)", GENERIC_BUCKETS if kind == HISTOGRAM else ()
        )
        _generic[key] = found  # a benign race: two threads build equal specs
    return found
