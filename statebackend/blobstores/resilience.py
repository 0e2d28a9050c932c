"""Retries, hedged requests and per-request timeouts for any :class:`~statebackend.blobstores.base.BlobStore`.

Contract of :class:`ResilientBlobStore` (wraps an inner store, same API):

- Only :class:`TransientStorageError` is retried, up to ``max_attempts`` attempts per request, after a delay drawn
  with *full jitter* from ``[0, min(max_delay, base_delay * 2**retry)]``. Every other error is raised at once.
- An attempt that runs longer than ``request_timeout_s`` is abandoned (its thread finishes on its own, bounded by the
  SDK's socket timeouts) and counts as a transient failure; a late success from it is still accepted.
- Hedging (``hedge_after_s > 0``) applies to reads and idempotent writes: while the newest attempt has run longer
  than ``hedge_after_s``, one more attempt is started in parallel, at most ``max_hedges`` per request. The first
  success wins; the other attempts' results are discarded.
- A create-only write whose reply may have been lost is resolved by reading the blob back, never by the code of
  the answer: (a) when any answer refuses it (taken, a bare 400, 404, ...: every error but a transient one) after
  more than one of its own attempts was started (a hedge, or a retry after a timeout, a reset or a cut reply: the
  name may hold its own earlier write, and servers answer a retry of a write that landed in various ways), and (b)
  when its last attempt failed with a :class:`TransientStorageError` (the write may have landed before the reply
  was lost). The stored bytes and metadata (where kept) equal to what it wrote: success. Otherwise the answer
  stands (case a), or :class:`AlreadyExistsError` for other bytes and the transient error for an absent blob (case
  b). The read-back itself failing: :class:`TransientStorageError` (undecided; never a false "taken"). Equal bytes
  from another writer are indistinguishable from ours and harmless: names in this project are deterministic or
  content-addressed, so the same name with the same bytes is the same blob. A first and only attempt refused
  stands: nothing of this call could have landed.
- A conditional write (``put_if``) is retried but never hedged, and its lost reply is resolved the same way, by
  what is stored, whatever the answer: when it is refused (any error but a transient one) after more than one of
  its own attempts started, or its last attempt failed with a :class:`TransientStorageError`, the blob is read back
  with its version (``get_versioned``). Our exact bytes: success, with the version read (its user writes a nonce in
  its bytes, so no other writer's are equal). Still the version the write was conditional on (or absent, for a
  create): it did not land, the error stands. Anything else: :class:`PreconditionFailedError` (the refusal of a
  taken version), or the answer itself when it was another refusal.
- Every error leaves with its ``__cause__``/``__context__`` chain scrubbed (statebackend.redact.scrub_chain).
- With a :class:`~statebackend.metrics.Metrics` set (``use_metrics``), each request is counted by operation: its
  outcome, attempts, latency (retries and hedges included), retries, hedges, attempt timeouts, and the payload bytes
  of a success (the ``blob_store.*`` metrics of statebackend/metrics/catalogue.py).
- Hedged or retried *overwrites* may land late (an abandoned attempt can reach the server after the call returned):
  safe because this project never rewrites a name with different bytes; see docs/blobstores.md.

Stores that issue several requests per operation (multipart uploads, ranged downloads) override
``BlobStore.use_resilience(resilience)``; the wrapper hands every store its :class:`Resilience`, and one that takes
it retries and hedges each request on its own instead of the whole operation.

The options that tune it (:data:`RESILIENCE_OPTIONS`) are declared here, once; a store wrapped in it includes them
in its own ``options``.
"""

from __future__ import annotations

import builtins
import logging
import os
import queue
import random
import time
from collections.abc import Callable, Iterator, Mapping
from concurrent.futures import Future
from typing import Any, BinaryIO, TypeVar

import attrs

from statebackend.blobstores.base import AbandonedUpload, BlobInfo, BlobStore
from statebackend.concurrency import LazyPool
from statebackend.errors import (
    AlreadyExistsError,
    NotFoundError,
    PreconditionFailedError,
    StorageError,
    TransientStorageError,
)
from statebackend.metrics import Metrics
from statebackend.options import OptionSpec, ParsedOptions, default_of, parse_duration_ms, parse_int, parse_options
from statebackend.redact import scrub_chain

__all__ = [
    "RESILIENCE_OPTIONS",
    "RESILIENCE_SCHEMA",
    "Resilience",
    "ResilienceSettings",
    "ResilientBlobStore",
]

_log = logging.getLogger(__name__)

T = TypeVar("T")

#: metric names (statebackend/metrics/catalogue.py); all but the read-backs are labelled with the ``operation``
METRIC_REQUESTS = "blob_store.requests"  # also labelled with the ``outcome``: ok or error
METRIC_ATTEMPTS = "blob_store.attempts_per_request"
METRIC_RETRIES = "blob_store.retries"
METRIC_HEDGES = "blob_store.hedges"
METRIC_TIMEOUTS = "blob_store.attempt_timeouts"
METRIC_LATENCY = "blob_store.latency_s"
METRIC_FAILURES = "blob_store.failed_requests"
METRIC_READ_BACKS = "blob_store.create_only_read_backs"
METRIC_BYTES_SENT = "blob_store.bytes.sent"
METRIC_BYTES_RECEIVED = "blob_store.bytes.received"

_OURS, _OTHER, _ABSENT, _UNKNOWN = "ours", "other", "absent", "unknown"


def _answered(error: BaseException) -> bool:
    """Whether ``error`` is a service's answer that refused a write for good (taken, not found, a bare 400, ...), as
    opposed to a transient fault (retried) or a caller's mistake found before anything was sent."""
    return isinstance(error, (AlreadyExistsError, NotFoundError, StorageError)) and not isinstance(
        error, TransientStorageError
    )


#: the ``blob.store.*`` options (without the prefix) of the resilience layer, declared once
RESILIENCE_OPTIONS: Mapping[str, OptionSpec] = {
    "max.concurrency": OptionSpec(
        parse_int(min=1, max=1024), 8, "concurrent requests per blob store (parts of a transfer; attempt threads: 4x)"
    ),
    "request.timeout.ms": OptionSpec(parse_duration_ms(min=1), 30000, "timeout of one request attempt"),
    "retry.max.attempts": OptionSpec(
        parse_int(min=1), 5, "attempts for a request that fails transiently (1: no retry)"
    ),
    "retry.base.delay.ms": OptionSpec(parse_duration_ms(min=0), 100, "first retry backoff; doubles each retry"),
    "retry.max.delay.ms": OptionSpec(parse_duration_ms(min=0), 5000, "upper bound of a retry backoff"),
    "hedge.after.ms": OptionSpec(
        parse_duration_ms(min=0), 0, "start a second attempt when the first is slower than this (0: off)"
    ),
    "hedge.max": OptionSpec(parse_int(min=1, max=8), 2, "most hedged attempts started for one request"),
}


#: the name :class:`~statebackend.options.ParsedOptions` carry when parsed against :data:`RESILIENCE_OPTIONS` alone
RESILIENCE_SCHEMA = f"{__name__}:RESILIENCE_OPTIONS"


def _default(key: str) -> Any:
    """The parsed default of ``blob.store.<key>`` in :data:`RESILIENCE_OPTIONS`, where it is written once."""
    return default_of(RESILIENCE_OPTIONS, key, prefix="blob.store.")


def _attempt_threads(max_concurrency: int) -> int:
    """Threads that run attempts: room for each concurrent request plus its hedges."""
    return max(8, 4 * max_concurrency)


@attrs.frozen
class ResilienceSettings:
    """The retry, timeout and hedging settings (``blob.store.retry.*``, ``request.timeout.ms``, ``hedge.after.ms``,
    ``hedge.max``, ``max.concurrency``), in seconds; the defaults are those of :data:`RESILIENCE_OPTIONS`."""

    max_attempts: int = attrs.field(default=_default("retry.max.attempts"), validator=attrs.validators.ge(1))
    base_delay_s: float = attrs.field(default=_default("retry.base.delay.ms") / 1000, validator=attrs.validators.ge(0))
    max_delay_s: float = attrs.field(default=_default("retry.max.delay.ms") / 1000, validator=attrs.validators.ge(0))
    request_timeout_s: float = attrs.field(
        default=_default("request.timeout.ms") / 1000, validator=attrs.validators.gt(0)
    )
    hedge_after_s: float = attrs.field(default=_default("hedge.after.ms") / 1000, validator=attrs.validators.ge(0))
    max_hedges: int = attrs.field(default=_default("hedge.max"), validator=attrs.validators.ge(0))
    max_threads: int = attrs.field(
        default=_attempt_threads(_default("max.concurrency")), validator=attrs.validators.ge(1)
    )

    @classmethod
    def from_options(cls, options: Mapping[str, Any]) -> ResilienceSettings:
        """The settings of the ``blob.store.*`` options (without the prefix; other keys are the store's).

        Options a store parsed against a schema that includes :data:`RESILIENCE_OPTIONS` (what ``from_url`` gets)
        are used as they are; other options (a raw mapping) are parsed against :data:`RESILIENCE_OPTIONS`, and a bad
        value is a :class:`ConfigError`."""
        if isinstance(options, ParsedOptions) and RESILIENCE_OPTIONS.keys() <= options.declared:
            values: Mapping[str, Any] = options
        else:
            values = parse_options(
                RESILIENCE_OPTIONS, options, name=RESILIENCE_SCHEMA, prefix="blob.store.", strict=False
            )
        return cls(
            max_attempts=values["retry.max.attempts"],
            base_delay_s=values["retry.base.delay.ms"] / 1000,
            max_delay_s=values["retry.max.delay.ms"] / 1000,
            request_timeout_s=values["request.timeout.ms"] / 1000,
            hedge_after_s=values["hedge.after.ms"] / 1000,
            max_hedges=values["hedge.max"],
            max_threads=_attempt_threads(values["max.concurrency"]),
        )


_DEFAULTS = ResilienceSettings()


@attrs.define
class Resilience:
    """Runs one logical request as attempts on worker threads: timeouts, retries with full jitter, hedges.

    ``clock`` and ``sleep`` are injectable (tests); ``rng`` draws the jitter.
    """

    settings: ResilienceSettings = attrs.field(factory=ResilienceSettings)
    metrics: Metrics | None = None
    clock: Callable[[], float] = time.monotonic
    sleep: Callable[[float], None] = time.sleep
    rng: random.Random = attrs.field(factory=random.Random)
    _attempt_pool: LazyPool = attrs.field(init=False)

    @_attempt_pool.default
    def _new_attempt_pool(self) -> LazyPool:
        return LazyPool(self.settings.max_threads, "blob-attempt")

    def backoff_s(self, retry: int) -> float:
        """Full jitter: uniform in ``[0, min(max_delay, base_delay * 2**retry)]`` (``retry`` counts from 0)."""
        cap = min(self.settings.max_delay_s, self.settings.base_delay_s * (2**retry))
        return self.rng.uniform(0, cap)

    def call(
        self,
        operation: str,
        attempt: Callable[[], T],
        *,
        hedge: bool = False,
        is_own_write: Callable[[], bool] | None = None,
        sent: int = 0,
    ) -> T:
        """Run ``attempt()`` until it succeeds, fails for good, or runs out of attempts.

        ``hedge``: the operation is a read or an idempotent write, so parallel attempts are allowed.
        ``is_own_write``: for writes whose lost reply the stored blob decides (create-only, conditional, a
        multipart completion); called when any non-transient error follows more than one attempt of ours, or when
        the last attempt failed with a transient error; returns whether the stored blob is exactly what we wrote
        (then the call succeeds), raises :class:`NotFoundError` when there is none (or it is still the version the
        write replaced: it did not land).
        ``sent``: the payload bytes the request writes (counted once when it succeeds; a read's bytes are counted
        from its result).
        """
        settings = self.settings
        started = self.clock()
        results: queue.Queue[tuple[int, bool, Any]] = queue.Queue()
        attempt_started: dict[int, float] = {}  # attempt number -> when it began running
        in_flight: set[int] = set()
        timed_out: set[int] = set()
        launched = 0
        hedges = 0
        retries = 0
        last_error: BaseException | None = None

        def launch() -> None:
            nonlocal launched
            launched += 1
            number = launched
            in_flight.add(number)
            attempt_started[number] = self.clock()  # queueing time counts: a full pool is a slow request too

            def run() -> None:
                try:
                    results.put((number, True, attempt()))
                except BaseException as exc:  # noqa: BLE001 - handed to the caller's thread
                    results.put((number, False, exc))

            future = self._attempt_pool.get().submit(run)

            def cancelled(done: Future[None]) -> None:
                # the store was closed (close() cancels the attempts not started) with this one still queued: it
                # will never run, so it fails now. Waiting for it instead cost the request timeout (30 s by
                # default), and blocked whatever queued behind its caller (a backend's background work)
                if done.cancelled():
                    _log.debug("%s attempt %d cancelled: the blob store was closed", operation, number)
                    results.put(
                        (number, False, StorageError(f"{operation}: the blob store was closed before the request ran"))
                    )

            future.add_done_callback(cancelled)

        def finish(outcome: str, value: Any = None) -> None:
            metrics = self.metrics
            if metrics is None:
                return
            metrics.increment(METRIC_REQUESTS, 1, operation=operation, outcome=outcome)
            metrics.record(METRIC_ATTEMPTS, launched, operation=operation)
            metrics.record(METRIC_LATENCY, self.clock() - started, operation=operation)
            if outcome != "ok":
                metrics.increment(METRIC_FAILURES, 1, operation=operation)
                return
            if sent:
                metrics.increment(METRIC_BYTES_SENT, sent, operation=operation)
            if isinstance(value, (bytes, bytearray)):
                metrics.increment(METRIC_BYTES_RECEIVED, len(value), operation=operation)

        def hedge_allowed() -> bool:
            return (
                hedge
                and settings.hedge_after_s > 0
                and hedges < settings.max_hedges
                and launched < settings.max_attempts + settings.max_hedges
            )

        launch()
        while True:
            active = in_flight - timed_out
            item: tuple[int, bool, Any] | None = None
            if active:
                deadline = min(attempt_started[n] + settings.request_timeout_s for n in active)
                if hedge_allowed():
                    deadline = min(deadline, attempt_started[max(active)] + settings.hedge_after_s)
                try:
                    item = results.get(timeout=max(0.0, deadline - self.clock()))
                except queue.Empty:
                    item = None
            if item is None:
                now = self.clock()
                for number in active:
                    if now - attempt_started[number] >= settings.request_timeout_s:
                        timed_out.add(number)
                        self._count(METRIC_TIMEOUTS, operation)
                        last_error = TransientStorageError(
                            f"{operation} attempt {number} got no answer within "
                            f"{settings.request_timeout_s:.3g}s (blob.store.request.timeout.ms)"
                        )
                active = in_flight - timed_out
                if active and hedge_allowed() and now - attempt_started[max(active)] >= settings.hedge_after_s:
                    hedges += 1
                    self._count(METRIC_HEDGES, operation)
                    launch()
                    continue
                if active:
                    continue
                # every attempt timed out: retry below (their late answers are still taken)
            else:
                number, ok, value = item
                in_flight.discard(number)
                if ok:
                    finish("ok", value)
                    return value  # type: ignore[no-any-return]  # an attempt() result: a T
                if is_own_write is not None and launched > 1 and _answered(value):
                    # an earlier attempt of ours may have landed before its reply was lost: whatever this answer
                    # says (taken, 400, 404, ...), what is stored decides
                    verdict = self._read_back(is_own_write)
                    if verdict == _OURS:
                        finish("ok")
                        return None  # type: ignore[return-value]  # is_own_write: a write, whose T is None
                    finish("error")
                    if verdict == _UNKNOWN:
                        raise self._undecided(operation, value)
                    raise scrub_chain(value)
                if not isinstance(value, TransientStorageError):
                    finish("error")
                    raise scrub_chain(value)
                last_error = value
                if in_flight - timed_out:
                    continue  # a parallel attempt is still running: let it answer before retrying
            if launched - hedges >= settings.max_attempts:
                assert last_error is not None
                if is_own_write is not None:
                    # the write may have landed before its reply was lost: the stored blob decides
                    verdict = self._read_back(is_own_write)
                    if verdict == _OURS:
                        finish("ok")
                        return None  # type: ignore[return-value]  # is_own_write: a write, whose T is None
                    if verdict == _OTHER:
                        finish("error")
                        taken = AlreadyExistsError(
                            f"{operation}: the name is taken by other bytes (found by reading back after the last "
                            f"attempt failed: {last_error})"
                        )
                        taken.__cause__ = last_error
                        raise scrub_chain(taken)
                finish("error")
                raise scrub_chain(last_error)
            delay = self.backoff_s(retries)
            retries += 1
            self._count(METRIC_RETRIES, operation)
            _log.debug("retrying %s in %.3fs after: %s", operation, delay, last_error)
            self.sleep(delay)
            # an abandoned attempt may have answered meanwhile: take its success, forget its failure
            while True:
                try:
                    number, ok, value = results.get_nowait()
                except queue.Empty:
                    break
                in_flight.discard(number)
                if ok:
                    finish("ok", value)
                    return value  # type: ignore[no-any-return]  # an attempt() result: a T
            launch()

    def _read_back(self, is_own_write: Callable[[], bool]) -> str:
        """Whether the stored blob is ours, another's, absent, or unknown (the read-back failed)."""
        self._count(METRIC_READ_BACKS)
        try:
            return _OURS if is_own_write() else _OTHER
        except NotFoundError:
            return _ABSENT
        except Exception:  # noqa: BLE001 - a failed check decides nothing
            _log.debug("could not read back a create-only blob to compare", exc_info=True)
            return _UNKNOWN

    @staticmethod
    def _undecided(operation: str, answer: BaseException) -> TransientStorageError:
        error = TransientStorageError(
            f"{operation}: the write was refused after a lost reply ({type(answer).__name__}) and could not read the "
            "blob back to tell whether an earlier attempt of it landed; retry it"
        )
        error.__cause__ = answer
        return scrub_chain(error)

    def _count(self, name: str, operation: str | None = None) -> None:
        if self.metrics is not None:
            if operation is None:
                self.metrics.increment(name)
            else:
                self.metrics.increment(name, 1, operation=operation)

    def close(self) -> None:
        # abandoned attempts finish on their own (SDK timeouts bound them); do not block the caller on them
        self._attempt_pool.close(wait=False, cancel_futures=True)


class ResilientBlobStore(BlobStore):
    """Wraps any :class:`BlobStore` with retries, hedged requests and per-request timeouts (module docstring)."""

    def __init__(
        self,
        inner: BlobStore,
        *,
        max_attempts: int = _DEFAULTS.max_attempts,
        base_delay_s: float = _DEFAULTS.base_delay_s,
        max_delay_s: float = _DEFAULTS.max_delay_s,
        request_timeout_s: float = _DEFAULTS.request_timeout_s,
        hedge_after_s: float = _DEFAULTS.hedge_after_s,
        max_hedges: int = _DEFAULTS.max_hedges,
        max_threads: int = _DEFAULTS.max_threads,
        metrics: Metrics | None = None,
        clock: Callable[[], float] = time.monotonic,
        sleep: Callable[[float], None] = time.sleep,
        rng: random.Random | None = None,
    ) -> None:
        settings = ResilienceSettings(
            max_attempts=max_attempts,
            base_delay_s=base_delay_s,
            max_delay_s=max_delay_s,
            request_timeout_s=request_timeout_s,
            hedge_after_s=hedge_after_s,
            max_hedges=max_hedges,
            max_threads=max_threads,
        )
        self.inner = inner
        self.resilience = Resilience(
            settings=settings, metrics=metrics, clock=clock, sleep=sleep, rng=rng or random.Random()
        )
        self.url = inner.url  # a store's URL is set when it is opened and never changes
        self.supports_metadata = inner.supports_metadata
        self.supports_conditional_delete = inner.supports_conditional_delete
        self.supports_conditional_put = inner.supports_conditional_put
        #: whether the inner store's versions are a digest of the bytes (S3's ETag): see statebackend.kit.gc
        self.versions_follow_bytes: bool = inner.versions_follow_bytes
        self._inner_handles_parts = inner.use_resilience(self.resilience)

    @classmethod
    def wrap(
        cls, inner: BlobStore, options: Mapping[str, Any], *, metrics: Metrics | None = None
    ) -> ResilientBlobStore:
        """Wrap ``inner`` with the settings of the ``blob.store.*`` options
        (:meth:`ResilienceSettings.from_options`)."""
        s = ResilienceSettings.from_options(options)
        return cls(
            inner,
            max_attempts=s.max_attempts,
            base_delay_s=s.base_delay_s,
            max_delay_s=s.max_delay_s,
            request_timeout_s=s.request_timeout_s,
            hedge_after_s=s.hedge_after_s,
            max_hedges=s.max_hedges,
            max_threads=s.max_threads,
            metrics=metrics,
        )

    @property
    def metrics(self) -> Metrics | None:
        return self.resilience.metrics

    @metrics.setter
    def metrics(self, value: Metrics | None) -> None:
        self.resilience.metrics = value

    def use_metrics(self, metrics: Metrics | None) -> None:
        self.resilience.metrics = metrics

    def describe(self) -> str:
        return self.inner.describe()

    def __repr__(self) -> str:
        return f"ResilientBlobStore({self.inner!r})"

    # -- the core, each one request ---------------------------------------------------------------------------

    def put(
        self, name: str, data: bytes, *, create_only: bool = False, metadata: Mapping[str, str] | None = None
    ) -> None:
        payload = bytes(data)

        def is_own_write() -> bool:
            # read back through the retries: the check itself may meet the same flaky network
            if self.get(name) != payload:
                return False
            if self.inner.supports_metadata:
                return dict(self.head(name).metadata) == dict(metadata or {})
            return True

        self.resilience.call(
            "put",
            lambda: self.inner.put(name, payload, create_only=create_only, metadata=metadata),
            hedge=True,
            is_own_write=is_own_write if create_only else None,
            sent=len(payload),
        )

    def put_if(self, name: str, data: bytes, *, version: str | None) -> str:
        """One conditional request (operation ``put_if``), retried, never hedged; a lost reply is resolved by reading
        the blob back (module docstring)."""
        payload = bytes(data)
        landed: list[str] = []

        def is_own_write() -> bool:
            stored, stored_version = self.get_versioned(name)  # NotFoundError: absent, so a create did not land
            if stored == payload:
                landed.append(stored_version)
                return True
            if stored_version == version:
                raise NotFoundError(f"blob {name!r}: the conditional write did not land")  # the error stands
            return False

        try:
            written = self.resilience.call(
                "put_if",
                lambda: self.inner.put_if(name, payload, version=version),
                is_own_write=is_own_write,
                sent=len(payload),
            )
        except AlreadyExistsError as exc:
            if isinstance(exc, PreconditionFailedError):
                raise
            refused = PreconditionFailedError(f"blob {name!r} in {self.describe()}: {exc}")
            raise scrub_chain(refused) from None
        if written is None:  # resolved by the read-back: ours
            return landed[-1]
        return written

    def get_versioned(self, name: str) -> tuple[bytes, str]:
        return self.resilience.call("get_versioned", lambda: self.inner.get_versioned(name), hedge=True)

    def get(self, name: str, *, start: int | None = None, end: int | None = None) -> bytes:
        return self.resilience.call("get", lambda: self.inner.get(name, start=start, end=end), hedge=True)

    def delete(self, name: str) -> None:
        self.resilience.call("delete", lambda: self.inner.delete(name), hedge=True)

    def delete_many(self, names: builtins.list[str]) -> None:
        """One request (operation ``delete_many``) retried and hedged as a whole (deleting is idempotent), or, for a
        store that batches its own requests (az://, s3://: at most 256 or 1,000 names each), each batch retried on
        its own. No names: no request."""
        names = builtins.list(dict.fromkeys(names))
        if not names:
            return
        if self._inner_handles_parts:
            self.inner.delete_many(names)
            return
        self.resilience.call("delete_many", lambda: self.inner.delete_many(names), hedge=True)

    def delete_if_unchanged(self, versions: Mapping[str, str]) -> frozenset[str]:
        """Like :meth:`delete_many`: retried and hedged as a whole (operation ``delete_if_unchanged``), or per batch
        by a store that batches its own requests. A retry stays correct: a blob an earlier attempt deleted (its reply
        lost) is absent now, which is success; one written since is kept, whichever attempt saw it."""
        versions = dict(versions)
        if not versions:
            return frozenset()
        if self._inner_handles_parts:
            return self.inner.delete_if_unchanged(versions)
        return self.resilience.call("delete_if_unchanged", lambda: self.inner.delete_if_unchanged(versions), hedge=True)

    def list(self, prefix: str = "") -> Iterator[str]:
        yield from self.resilience.call("list", lambda: list(self.inner.list(prefix)), hedge=True)

    def head(self, name: str) -> BlobInfo:
        return self.resilience.call("head", lambda: self.inner.head(name), hedge=True)

    def set_metadata(self, name: str, metadata: Mapping[str, str]) -> None:
        self.resilience.call("set_metadata", lambda: self.inner.set_metadata(name, metadata), hedge=True)

    # -- whole-object transfers: per request inside the inner store when it can, else whole -------------------

    def put_file(
        self,
        name: str,
        path: str | os.PathLike[str],
        *,
        create_only: bool = False,
        metadata: Mapping[str, str] | None = None,
    ) -> None:
        if self._inner_handles_parts:
            self.inner.put_file(name, path, create_only=create_only, metadata=metadata)
            return
        with open(path, "rb") as f:
            self.put(name, f.read(), create_only=create_only, metadata=metadata)

    def get_file(self, name: str, path: str | os.PathLike[str]) -> int:
        if self._inner_handles_parts:
            return self.inner.get_file(name, path)
        return super().get_file(name, path)

    def get_into(self, name: str, out: BinaryIO) -> int:
        if self._inner_handles_parts:
            return self.inner.get_into(name, out)
        return super().get_into(name, out)

    # -- administration: no retries, so a misconfiguration is reported at once -------------------------------

    def validate(self) -> None:
        """Check the store is usable (container/bucket exists, credentials work); delegates to the inner store."""
        self.inner.validate()

    def create_resources(self) -> None:
        """Create the container/bucket when missing; delegates to the inner store. Retried like any idempotent
        request (an existing container is success), so one cut reply at open does not fail the task."""
        self.resilience.call("create_resources", self.inner.create_resources)

    def abandoned_uploads(self, prefix: str = "") -> builtins.list[AbandonedUpload] | None:
        """Delegates to the inner store, retried like any read."""
        return self.resilience.call("abandoned_uploads", lambda: self.inner.abandoned_uploads(prefix))

    def remove_abandoned_upload(self, upload: AbandonedUpload) -> None:
        """Delegates to the inner store, retried (removal is idempotent)."""
        self.resilience.call("remove_abandoned_upload", lambda: self.inner.remove_abandoned_upload(upload))

    def close(self) -> None:
        try:
            self.inner.close()
        finally:
            self.resilience.close()
