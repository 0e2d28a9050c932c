"""Background snapshots of the changelog backend: when one is due (the deltas after the base hold
``snapshot.interval.ratio`` times its bytes, or the commit or byte caps are reached), a snapshot of a committed
version is written from an LMDB read view on the process's maintenance thread and uploaded while processing goes
on; a later commit adopts it as the base of its recipe, which lets older deltas go. At open, a snapshot an earlier
manager finished but could not adopt is adopted, and the sizes the ratio weighs are looked up in the background.
:class:`BackgroundSnapshots` is the helper the backup manager holds for this; it stages and sends its snapshots
through the manager's uploader."""

from __future__ import annotations

import logging
from concurrent.futures import Future, ThreadPoolExecutor
from pathlib import Path

import attrs
from statebackend.backends.changelog.lineage import ChangelogShared, Lineage
from statebackend.backends.changelog.marker import Step, check_blob_binding, snapshot_name
from statebackend.backends.changelog.upload import ChangelogUpload

from statebackend.concurrency import SharedPools
from statebackend.crashpoints import crashpoint
from statebackend.envbase import FRAME_TAIL_SIZE as ENV_FRAME_TAIL_SIZE
from statebackend.envbase import HEAD_BYTES, is_env_base, read_env_base_frame
from statebackend.errors import BackgroundWorkCancelled, CorruptDataError, IncompatibleFormatError, NotFoundError
from statebackend.kit import IN_FLIGHT, log_extra, read_created_at
from statebackend.recordfile import FRAME_TAIL_SIZE, HEADER_PREFIX_SIZE, KIND_SNAPSHOT, header_size, read_frame
from statebackend.store import ChangeSet, ReadView

__all__ = ["UNKNOWN_SIZES_INTERVAL_COMMITS", "BackgroundSnapshots", "maintenance_pool"]

log = logging.getLogger(__name__)

#: the snapshot interval in commits while the sizes the ratio weighs are unknown
UNKNOWN_SIZES_INTERVAL_COMMITS = 20

_maintenance_pools = SharedPools("statebackend-maintenance")


def maintenance_pool() -> ThreadPoolExecutor:
    """The process-wide maintenance thread for background snapshots (kept apart from the commit pool so a long
    snapshot never delays a commit)."""
    return _maintenance_pools.get(1)


@attrs.define(eq=False)
class BackgroundSnapshots:
    """Starting, writing and adopting snapshots, on the manager's :class:`ChangelogShared` (they are staged and
    uploaded like deltas, by the manager's ``uploader``)."""

    shared: ChangelogShared
    uploader: ChangelogUpload

    def adopt_at_open(self, lineage: Lineage) -> None:
        """Start the chain from a background snapshot an earlier manager finished but could not adopt (it closed
        first: a job that opens its task for each batch, like the Spark driver, closes after every commit). Its
        name is deterministic (the step's seq and token), and a create-only upload is whole or absent."""
        if not lineage.deltas:
            return
        finished = set(self.shared.context.blob_store.list(lineage.prefix + "snapshot/"))
        for step in reversed(lineage.deltas):
            name = snapshot_name(lineage.prefix, step.seq, step.token)
            if name in finished:
                snapshot = Step(step.seq, step.checkpoint_id, step.token, name)
                created_at = self._whole_and_bound(lineage, snapshot)
                if created_at is False:
                    continue
                if not self.shared.young_enough(created_at):
                    # a sweep of another attempt may delete it any time now: naming it in a checkpoint is unsafe
                    self.shared.context.metrics.increment("changelog.snapshot.too.old")
                    log.info(
                        "store %s: not adopting finished snapshot %s: older than half the gc grace period "
                        "(or its age is unknown)",
                        lineage.name,
                        name,
                        extra=log_extra(self.shared.context, lineage.name),
                    )
                    continue
                lineage.base = snapshot
                lineage.deltas = [d for d in lineage.deltas if d.seq > step.seq]
                lineage.uploaded.add(name)
                if created_at is not None:
                    lineage.uploaded_at[name] = created_at
                lineage.commits_since_snapshot = len(lineage.deltas)
                lineage.bytes_since_snapshot = 0
                self.shared.context.metrics.increment("changelog.snapshot.adopted")
                return

    def look_up_sizes(self, lineage: Lineage) -> None:
        """In the background, the sizes the snapshot interval ratio needs of a chain this manager did not write: the
        base's (a snapshot, or the first delta on the empty store) and the newest delta's, which stands for the
        deltas of unknown size. Until they are known, the chain is bounded by UNKNOWN_SIZES_INTERVAL_COMMITS."""
        if self.shared.settings.snapshot_interval_ratio <= 0:
            return
        names = [step.name for step in lineage.recipe().steps() if step.name is not None]
        wanted = [name for name in dict.fromkeys(names[:1] + names[-1:]) if name not in lineage.blob_bytes]
        if not wanted or self.shared.closed:
            return

        def look_up() -> None:
            for name in wanted:
                try:
                    size = self.shared.context.blob_store.head(name).size
                except Exception as exc:  # noqa: BLE001 - only an estimate is lost; restore checks every blob
                    log.debug(
                        "store %s: size of %s unknown: %s",
                        lineage.name,
                        name,
                        exc,
                        extra=log_extra(self.shared.context, lineage.name),
                    )
                    return
                with lineage.lock:
                    lineage.blob_bytes.setdefault(name, size)

        maintenance_pool().submit(look_up)

    def _whole_and_bound(self, lineage: Lineage, snapshot: Step) -> float | None | bool:
        """Whether the blob ``snapshot`` names is whole (header, end marker, body length: a few ranged reads) and is
        that snapshot (its header's lineage). Adopting a blob that is not would make every later checkpoint name it;
        restore would then refuse them all. ``False`` when it is not; else its ``created_at`` (None: unknown)."""
        blob_store = self.shared.context.blob_store
        name = snapshot.name
        assert name is not None
        try:
            info = blob_store.head(name)
            size = info.size
            prefix = blob_store.get(name, start=0, end=HEADER_PREFIX_SIZE)
            if is_env_base(prefix):  # an environment-file base (this release's snapshots)
                head = blob_store.get(name, start=0, end=min(size, HEAD_BYTES))
                tail = blob_store.get(name, start=max(0, size - ENV_FRAME_TAIL_SIZE), end=size)
                header = read_env_base_frame(head, tail, size, name=name).lineage
            else:
                head = blob_store.get(name, start=0, end=header_size(prefix, name=name))
                tail = blob_store.get(name, start=max(0, size - FRAME_TAIL_SIZE), end=size)
                header = read_frame(head, tail, size, name=name)
            check_blob_binding(
                header,
                snapshot,
                kind=KIND_SNAPSHOT,
                job=self.shared.context.job_name,
                task=self.shared.context.task_name,
                store=lineage.name,
            )
        except (NotFoundError, CorruptDataError, IncompatibleFormatError) as exc:
            self.shared.context.metrics.increment("changelog.snapshot.rejected")
            log.warning(
                "store %s: not adopting finished snapshot %s: %s",
                lineage.name,
                name,
                exc,
                extra=log_extra(self.shared.context, lineage.name),
            )
            return False
        return read_created_at(info.metadata)

    def _ratio_due(self, lineage: Lineage) -> bool | None:
        """Whether the delta files after the base (estimated where their sizes are unknown) hold
        ``snapshot.interval.ratio`` times the base's bytes; None when no estimate can be made yet (the base's size,
        or every delta's, unknown: a manager that inherited the chain before its look-up at open answered).
        Without a snapshot, the chain's first delta (loaded in bulk onto the empty store at restore, as a snapshot
        is) is the base. A restore downloads and applies at most the base plus that ratio of it, and the snapshots'
        bytes, amortized, follow the change: about the deltas' bytes over the ratio per commit, where a fixed commit
        interval costs the whole state's. Deltas under ``snapshot.ratio.min.bytes`` in all never make one due: a
        snapshot is a PUT, and a small state would pay one every few commits to save a restore a few KiB."""
        ratio = self.shared.settings.snapshot_interval_ratio
        if ratio <= 0:
            return False
        names = [step.name for step in lineage.deltas if step.name is not None]
        if lineage.base is not None:
            base, chain = lineage.base.name, names
        elif names:
            base, chain = names[0], names[1:]
        else:
            return False
        if not chain:
            return False
        base_bytes = lineage.blob_bytes.get(base) if base is not None else None
        known = [lineage.blob_bytes[name] for name in chain if name in lineage.blob_bytes]
        if base_bytes is None or not known:
            return None
        estimate = sum(known) + sum(known) / len(known) * (len(chain) - len(known))
        return estimate >= max(ratio * base_bytes, self.shared.settings.snapshot_ratio_min_bytes)

    def start_if_due(self, lineage: Lineage, change: ChangeSet) -> None:
        """Start a background snapshot of ``change``'s version when one is due and none runs (see the module
        docstring)."""
        by_ratio = self._ratio_due(lineage)
        due = (
            lineage.commits_since_snapshot >= self.shared.settings.snapshot_interval_commits
            or lineage.bytes_since_snapshot >= self.shared.settings.snapshot_interval_bytes
            or by_ratio is True
            # sizes unknown (a task opened for each batch whose look-up has not answered yet): the fixed
            # interval of the first releases, not the cap, bounds the chain
            or (by_ratio is None and lineage.commits_since_snapshot >= UNKNOWN_SIZES_INTERVAL_COMMITS)
        )
        if not due or lineage.background is not None or self.shared.closed or self.shared.cancellation.cancelled:
            return
        view = change.read_view()  # a future: an LMDB read transaction on this version, once it is applied
        step = lineage.deltas[-1]
        name = snapshot_name(lineage.prefix, step.seq, step.token)
        lineage.background_name = name
        lineage.background = maintenance_pool().submit(self._background_snapshot, lineage, view, step, name)

    def _background_snapshot(self, lineage: Lineage, view_future: Future[ReadView], step: Step, name: str) -> Step:
        """Write and upload a snapshot of ``step``'s version from a read view. It stops
        (:class:`~statebackend.errors.BackgroundWorkCancelled`) once ``cancel_background`` was called: a parked task
        handed to another process that waits for it then waits for at most a chunk of records, not the whole
        snapshot (the next owner of the chain snapshots when due)."""
        what = f"background snapshot {name}"
        self.shared.cancellation.check(what)  # queued behind another task's snapshot while this one closed
        view = view_future.result()
        try:
            # in flight while it is written and uploaded: on a slow network, commits past its seq become durable
            # meanwhile, and their cleanups must not take it for a file a re-base left behind
            with IN_FLIGHT.hold([lineage.staging / Path(name).name]):
                staged = self.uploader.stage_base(
                    lineage, step, view, name, check=lambda: self.shared.cancellation.check(what)
                )
                with lineage.lock:
                    lineage.fresh.discard(name)
                view.close()  # the LMDB read transaction ends here, not after the upload
                try:
                    self.shared.cancellation.check(what)
                except BackgroundWorkCancelled:
                    staged.unlink(missing_ok=True)
                    raise
                self.uploader.upload_staged_file(lineage, staged, name, "snapshot")
            crashpoint("changelog.background_snapshot.uploaded")
        finally:
            view.close()
        with lineage.lock:
            lineage.uploaded.add(name)
        return Step(step.seq, step.checkpoint_id, step.token, name)

    def adopt(self, lineage: Lineage) -> None:
        """Make the background snapshot that finished the base of the chain (called under the lineage's lock, by the
        commit's ``snapshot()``), unless it failed, is too old to name, or belongs to a chain re-based since."""
        background = lineage.background
        if background is None or not background.done():
            return
        lineage.background = None
        lineage.background_name = None  # adopted below (then in the recipe) or dropped (then garbage)
        exc = background.exception()
        if exc is not None:
            self.shared.context.metrics.increment("changelog.snapshot.failures")
            log.warning(
                "store %s: background snapshot failed (retried later): %s",
                lineage.name,
                exc,
                extra=log_extra(self.shared.context, lineage.name),
            )
            return
        snapshot = background.result()
        assert snapshot.name is not None
        if not self.shared.young_enough(lineage.uploaded_at.get(snapshot.name)):
            self.shared.context.metrics.increment("changelog.snapshot.too.old")
            log.warning(
                "store %s: not adopting background snapshot %s: it was uploaded more than half of "
                "changelog.gc.grace.period.ms ago (raise it above twice the longest snapshot upload)",
                lineage.name,
                snapshot.name,
                extra=log_extra(self.shared.context, lineage.name),
            )
            return
        if lineage.commits_since_snapshot < 0:
            return  # the chain broke after this snapshot started: the pending re-base replaces it (keep the flag)
        if lineage.base is not None and snapshot.seq <= lineage.base.seq:
            return
        if not any(d.seq == snapshot.seq and d.token == snapshot.token for d in lineage.deltas):
            return  # the chain was re-based meanwhile; this snapshot belongs to an abandoned one
        lineage.base = snapshot
        lineage.deltas = [d for d in lineage.deltas if d.seq > snapshot.seq]
        lineage.commits_since_snapshot = len(lineage.deltas)
        lineage.bytes_since_snapshot = 0
        self.shared.context.metrics.increment("changelog.snapshot.adopted")
