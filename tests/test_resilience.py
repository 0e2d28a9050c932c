"""ResilientBlobStore: retries with full jitter on transient errors only, per-request timeouts, hedged requests,
create-only writes that meet their own earlier attempt; and, against the real servers behind a fault-injecting
proxy, exact content under 10% injected failures and a lower tail with hedging under 10% slow requests."""

from __future__ import annotations

import threading
import time
import uuid
from collections.abc import Callable, Iterator

import pytest

from statebackend.blobstores.base import BlobStore, open_blob_store
from statebackend.blobstores.memory import MemoryBlobStore
from statebackend.blobstores.resilience import (
    METRIC_ATTEMPTS,
    METRIC_HEDGES,
    METRIC_RETRIES,
    METRIC_TIMEOUTS,
    Resilience,
    ResilienceSettings,
    ResilientBlobStore,
)
from statebackend.errors import AlreadyExistsError, NotFoundError, StorageError, TransientStorageError
from statebackend.metrics import Metrics
from tests.faults import FaultProxy, ScriptedBlobStore
from tests.servers import ServerProcess, azurite_connection_string


@pytest.fixture
def scripted() -> ScriptedBlobStore:
    return ScriptedBlobStore(MemoryBlobStore())


@pytest.fixture
def release() -> Iterator[threading.Event]:
    """Set at teardown so no attempt a test held back outlives it."""
    event = threading.Event()
    yield event
    event.set()


def _resilient(inner: BlobStore, **kwargs: object) -> tuple[ResilientBlobStore, list[float], Metrics]:
    sleeps: list[float] = []
    metrics = Metrics()
    defaults: dict[str, object] = {"base_delay_s": 0.1, "max_delay_s": 0.4, "metrics": metrics}
    store = ResilientBlobStore(inner, sleep=sleeps.append, **{**defaults, **kwargs})  # type: ignore[arg-type]
    return store, sleeps, metrics


def test_transient_errors_are_retried_with_full_jitter_until_success(scripted: ScriptedBlobStore) -> None:
    failures = iter([TransientStorageError("503"), TransientStorageError("reset"), TransientStorageError("503")])

    def before(operation: str, name: str) -> None:
        if operation == "put":
            failure = next(failures, None)
            if failure is not None:
                raise failure

    scripted.before = before
    store, sleeps, metrics = _resilient(scripted, max_attempts=5)
    store.put("blob", b"data")
    assert scripted.calls["put"] == 4
    assert store.get("blob") == b"data"
    assert len(sleeps) == 3
    assert all(0 <= delay <= cap for delay, cap in zip(sleeps, [0.1, 0.2, 0.4], strict=True))
    assert metrics.counter(METRIC_RETRIES) == 3
    assert metrics.samples(METRIC_ATTEMPTS)[0] == 4


def test_retries_stop_at_max_attempts_and_raise_the_last_error(scripted: ScriptedBlobStore) -> None:
    def before(operation: str, name: str) -> None:
        raise TransientStorageError(f"throttled {operation}")

    scripted.before = before
    store, sleeps, _ = _resilient(scripted, max_attempts=3, max_delay_s=0.15)
    with pytest.raises(TransientStorageError, match="throttled get"):
        store.get("blob")
    assert scripted.calls["get"] == 3
    assert len(sleeps) == 2 and max(sleeps) <= 0.15


@pytest.mark.parametrize("error", [NotFoundError("absent"), StorageError("403"), AlreadyExistsError("taken")])
def test_errors_that_are_not_transient_are_not_retried(scripted: ScriptedBlobStore, error: Exception) -> None:
    def before(operation: str, name: str) -> None:
        raise error

    scripted.before = before
    store, sleeps, _ = _resilient(scripted, max_attempts=5)
    with pytest.raises(type(error)):
        store.get("blob")
    assert scripted.calls["get"] == 1
    assert sleeps == []


def test_an_attempt_that_overruns_the_request_timeout_is_retried(
    scripted: ScriptedBlobStore, release: threading.Event
) -> None:
    scripted.inner.put("blob", b"data")
    first = threading.Event()

    def before(operation: str, name: str) -> None:
        if not first.is_set():
            first.set()
            release.wait(30)  # a request that never answers (until teardown)

    scripted.before = before
    store, sleeps, metrics = _resilient(scripted, request_timeout_s=0.05, max_attempts=20)
    assert store.get("blob") == b"data"
    # the first attempt never answers, so a later one did; on a loaded machine a later attempt may overrun the
    # short timeout too (and be retried in turn): counts are "at least", each retry after one sleep
    assert not release.is_set() and scripted.calls["get"] >= 2
    assert metrics.counter(METRIC_TIMEOUTS) >= 1
    assert len(sleeps) == scripted.calls["get"] - 1


def test_a_slow_read_is_hedged_and_the_first_answer_wins(scripted: ScriptedBlobStore, release: threading.Event) -> None:
    scripted.inner.put("blob", b"data")
    calls = iter(range(100))

    def before(operation: str, name: str) -> None:
        if next(calls) == 0:
            release.wait(30)  # the first attempt is stuck; only a hedge can answer

    scripted.before = before
    store, sleeps, metrics = _resilient(scripted, hedge_after_s=0.02, request_timeout_s=60)
    assert store.get("blob") == b"data"
    # the stuck first attempt cannot answer: a hedge did (a second hedge may start when the first one is slow to be
    # scheduled on a loaded machine; at most hedge.max = 2)
    assert 1 <= metrics.counter(METRIC_HEDGES) <= 2
    assert sleeps == []  # a hedge is not a retry


def test_create_only_hedge_that_meets_its_own_write_succeeds(
    scripted: ScriptedBlobStore, release: threading.Event
) -> None:
    """The first attempt writes and then its answer is slow; the hedge sees the name taken with our bytes."""
    written = threading.Event()

    def after_put(name: str) -> None:
        if not written.is_set():
            written.set()
            release.wait(30)

    def before(operation: str, name: str) -> None:
        if operation == "put" and scripted.calls["put"] == 2:
            written.wait(30)  # the hedge runs after the first attempt's write landed

    scripted.after_put = after_put
    scripted.before = before
    store, _, metrics = _resilient(scripted, hedge_after_s=0.02, request_timeout_s=60)
    store.put("blob", b"ours", create_only=True, metadata={"kind": "delta"})
    assert scripted.inner.get("blob") == b"ours"
    assert not release.is_set()  # the first attempt is still held: a hedge met its write and took it for ours
    assert 1 <= metrics.counter(METRIC_HEDGES) <= 2


def test_create_only_retry_that_finds_other_bytes_raises_already_exists(scripted: ScriptedBlobStore) -> None:
    """A dropped answer, then a retry that finds the name taken by someone else's bytes: not ours, so an error."""
    attempts = iter(range(100))

    def before(operation: str, name: str) -> None:
        if operation == "put" and next(attempts) == 0:
            scripted.inner.put("blob", b"theirs")
            raise TransientStorageError("connection reset")

    scripted.before = before
    store, _, _ = _resilient(scripted)
    with pytest.raises(AlreadyExistsError):
        store.put("blob", b"ours", create_only=True)
    assert scripted.inner.get("blob") == b"theirs"


def test_create_only_on_a_taken_name_without_a_second_attempt_is_refused(scripted: ScriptedBlobStore) -> None:
    scripted.inner.put("blob", b"ours")
    store, _, _ = _resilient(scripted)
    with pytest.raises(AlreadyExistsError):
        store.put("blob", b"ours", create_only=True)  # even equal bytes: nothing says we wrote them


# -- against the real servers, through the fault-injecting proxy ------------------------------------------------


def _open_through(kind: str, server: ServerProcess, proxy: FaultProxy, **options: object) -> BlobStore:
    base: dict[str, object] = {
        "create.if.missing": True,
        "retry.base.delay.ms": 5,
        "retry.max.delay.ms": 50,
        "retry.max.attempts": 8,
        # no fault here waits on a timeout (resets; holds far shorter than this): it only guards a hang, and a slow
        # server on a loaded machine is not taken for a fault
        "request.timeout.ms": 120_000,
        **options,
    }
    if kind == "s3":
        return open_blob_store(f"s3://t-{uuid.uuid4().hex[:16]}/p", {**base, "endpoint.url": proxy.endpoint})
    return open_blob_store(
        f"az://t{uuid.uuid4().hex[:16]}/p", {**base, "connection.string": azurite_connection_string(proxy.port)}
    )


@pytest.fixture(params=[pytest.param("s3", marks=pytest.mark.s3), pytest.param("azure", marks=pytest.mark.azure)])
def server(request: pytest.FixtureRequest) -> tuple[str, ServerProcess]:
    fixture = "s3_server" if request.param == "s3" else "azurite"
    return request.param, request.getfixturevalue(fixture)


def test_puts_and_gets_survive_ten_percent_injected_failures_with_exact_content(
    server: tuple[str, ServerProcess],
) -> None:
    kind, process = server
    with FaultProxy(process.host, process.port, failure_rate=0.10, seed=7) as proxy:
        store = _open_through(kind, process, proxy)
        store.create_resources()  # type: ignore[attr-defined]
        metrics = Metrics()
        store.metrics = metrics  # type: ignore[attr-defined]
        expected = {f"blob/{i:03d}": f"payload {i} ".encode() * (i + 1) for i in range(100)}
        for i, (name, data) in enumerate(expected.items()):
            store.put(name, data, create_only=i % 2 == 0)
        for name, data in expected.items():
            assert store.get(name) == data
        assert sorted(store.list("blob/")) == sorted(expected)
        store.close()
    assert proxy.stats["reset_before"] > 0 and proxy.stats["reset_after"] > 0
    assert metrics.counter(METRIC_RETRIES) > 0


def test_hedging_cuts_the_tail_under_ten_percent_slow_requests(server: tuple[str, ServerProcess]) -> None:
    """Without hedging, a held request is waited out; with it, no get waits for one. The hold is many times the
    slowest plain get measured first on this machine, under its current load, so "waited out" and "answered by a
    hedge" cannot be confused however slow the machine is."""
    kind, process = server
    with FaultProxy(process.host, process.port) as proxy:
        store = _open_through(kind, process, proxy)
        store.create_resources()  # type: ignore[attr-defined]
        store.put("blob", b"x" * 1000)
        plain = max(_timed_get(store) for _ in range(20))
        store.close()
    delay_s = max(1.0, 10 * plain)
    worst: dict[bool, float] = {}
    for hedged in (False, True):
        with FaultProxy(process.host, process.port, delay_rate=0.10, delay_s=delay_s, seed=11) as proxy:
            options = {"hedge.after.ms": 100, "hedge.max": 3} if hedged else {}
            store = _open_through(kind, process, proxy, **options)
            store.create_resources()  # type: ignore[attr-defined]
            store.put("blob", b"x" * 1000)
            worst[hedged] = max(_timed_get(store) for _ in range(30))
            store.close()
        assert proxy.stats["delay"] > 0
    assert worst[False] >= delay_s, worst  # the slow requests were really slow without hedging
    assert worst[True] < delay_s, worst  # with hedging, no get waited a held request out


def _timed_get(store: BlobStore) -> float:
    """Seconds one get of ``blob`` took (its answer checked)."""
    started = time.perf_counter()
    assert store.get("blob") == b"x" * 1000
    return time.perf_counter() - started


# -- create-only read-back on every path (scripted) ------------------------------------------------------------


def _lose_reply_after_write(scripted: ScriptedBlobStore, times: int) -> None:
    """The first ``times`` puts write and then lose their reply (a reset after the server acted)."""
    left = iter(range(times))

    def after_put(name: str) -> None:
        if next(left, None) is not None:
            raise TransientStorageError("connection reset after the write")

    scripted.after_put = after_put


@pytest.mark.parametrize("max_attempts", [1, 3])
def test_create_only_whose_last_attempt_lost_its_reply_reads_back_and_succeeds(
    scripted: ScriptedBlobStore, max_attempts: int
) -> None:
    """Every attempt wrote (or found its own write) and the last one's reply was lost: the blob is ours."""
    _lose_reply_after_write(scripted, times=1)

    def before(operation: str, name: str) -> None:
        if operation == "put" and scripted.calls["put"] > 1:
            raise TransientStorageError("503")  # the retries never get an answer either

    scripted.before = before
    store, _, _ = _resilient(scripted, max_attempts=max_attempts)
    store.put("cp/1", b"ours", create_only=True, metadata={"kind": "checkpoint"})
    assert scripted.inner.get("cp/1") == b"ours"
    assert scripted.calls["put"] == max_attempts


def test_create_only_whose_last_attempt_failed_finds_other_bytes_is_already_exists(
    scripted: ScriptedBlobStore,
) -> None:
    def before(operation: str, name: str) -> None:
        if operation == "put":
            if not scripted.inner.exists(name):
                scripted.inner.put(name, b"theirs")
            raise TransientStorageError("reset")

    scripted.before = before
    store, _, _ = _resilient(scripted, max_attempts=2)
    with pytest.raises(AlreadyExistsError, match="other bytes"):
        store.put("cp/1", b"ours", create_only=True)


def test_create_only_whose_attempts_all_failed_before_the_server_stays_transient(
    scripted: ScriptedBlobStore,
) -> None:
    def before(operation: str, name: str) -> None:
        if operation == "put":
            raise TransientStorageError("reset before the server")

    scripted.before = before
    store, _, _ = _resilient(scripted, max_attempts=2)
    with pytest.raises(TransientStorageError, match="reset before"):
        store.put("cp/1", b"ours", create_only=True)
    assert not scripted.inner.exists("cp/1")


def test_create_only_read_back_compares_metadata_even_when_we_wrote_none(scripted: ScriptedBlobStore) -> None:
    """A retry finds equal bytes with metadata we never wrote: not ours."""
    attempts = iter(range(100))

    def before(operation: str, name: str) -> None:
        if operation == "put" and next(attempts) == 0:
            scripted.inner.put(name, b"same", metadata={"kind": "someone else"})
            raise TransientStorageError("connection reset")

    scripted.before = before
    store, _, _ = _resilient(scripted)
    with pytest.raises(AlreadyExistsError):
        store.put("cp/1", b"same", create_only=True)


def test_create_only_read_back_that_fails_is_undecided_not_taken(scripted: ScriptedBlobStore) -> None:
    """The name is taken after a lost reply and the read-back cannot be made: a transient error (retry later), never
    AlreadyExistsError, which would fence a task that may well own the blob."""
    _lose_reply_after_write(scripted, times=1)

    def before(operation: str, name: str) -> None:
        if operation == "get":
            raise StorageError("403 on the read-back")

    scripted.before = before
    store, _, _ = _resilient(scripted)
    with pytest.raises(TransientStorageError, match="could not read the blob back"):
        store.put("cp/1", b"ours", create_only=True)


def test_create_resources_is_retried_like_an_idempotent_request() -> None:
    """Seen under 30% faults: one cut reply to the container creation at open failed the whole open."""

    class FlakyCreate(MemoryBlobStore):
        calls = 0

        def create_resources(self) -> None:
            FlakyCreate.calls += 1
            if FlakyCreate.calls < 3:
                raise TransientStorageError("the reply to the container creation was cut")

    store, sleeps, _ = _resilient(FlakyCreate())
    store.create_resources()
    assert FlakyCreate.calls == 3 and len(sleeps) == 2


def test_a_request_queued_when_the_store_closes_fails_at_once_not_after_the_request_timeout() -> None:
    """close() drops the attempts that have not started: one such attempt never runs, so its caller must be told
    at once. Waiting for it cost the request timeout (30 s by default), and whatever queued behind the caller (a
    backend's background work on a shared pool) waited with it."""
    resilience = Resilience(ResilienceSettings(max_threads=1, request_timeout_s=3_600, hedge_after_s=0))
    release = threading.Event()
    running = threading.Event()

    def blocking() -> str:
        running.set()
        release.wait()
        return "first"

    outcomes: dict[str, object] = {}

    def call(name: str, attempt: Callable[[], str]) -> None:
        try:
            outcomes[name] = resilience.call("head", attempt, hedge=True)
        except StorageError as exc:
            outcomes[name] = exc

    first = threading.Thread(target=call, args=("first", blocking))
    first.start()
    assert running.wait(60)
    queued = threading.Thread(target=call, args=("queued", lambda: "queued"))
    queued.start()
    while resilience._attempt_pool.get()._work_queue.qsize() == 0:  # the second attempt waits for the one thread
        time.sleep(0.001)
    resilience.close()
    queued.join(600)  # a bound on a hang only: with the bug it would wait the hour of request_timeout_s
    try:
        assert not queued.is_alive(), "the queued request still waits for an attempt that will never run"
        error = outcomes["queued"]
        assert isinstance(error, StorageError) and not isinstance(error, TransientStorageError)
        assert "closed" in str(error)
        assert "first" not in outcomes, "the running attempt is not cut short by close()"
    finally:
        release.set()
        first.join(60)
    assert outcomes["first"] == "first"
