"""The backend kit: the GC age rule and mark-and-sweep, the in-flight registry, cancellation and close-when-ready,
the restore interrupt flag, and the contract's optional ``interrupt`` hook."""

from __future__ import annotations

import threading
from collections.abc import Iterator
from concurrent.futures import CancelledError, Future
from pathlib import Path
from typing import Any

import pytest

from statebackend.blobstores.base import BlobInfo
from statebackend.blobstores.memory import MemoryBlobStore
from statebackend.concurrency import CANCEL_CHUNK, gather
from statebackend.contracts import StateBackendAdmin, TaskRestoreManager
from statebackend.errors import (
    BackgroundWorkCancelled,
    CorruptDataError,
    IncompatibleFormatError,
    NotFoundError,
    RestoreInterrupted,
    StateBackendError,
)
from statebackend.kit import (
    CREATED_AT,
    IN_FLIGHT,
    Cancellation,
    FirstSeen,
    GraceRule,
    InFlightRegistry,
    InterruptFlag,
    Mark,
    close_when_ready,
    created_at_metadata,
    mark_referenced,
    puts_only,
    read_created_at,
    referenced_by_admin,
    sweep_unreferenced,
)

HOUR_MS = 3_600_000
NOW = 1_800_000_000.0


def aged(seconds: float) -> dict[str, str]:
    """Metadata of a blob whose upload started ``seconds`` before NOW."""
    return created_at_metadata(NOW - seconds)


# -- the age rule --------------------------------------------------------------------------------------------------


def test_created_at_is_written_and_read_back_as_unix_seconds() -> None:
    assert created_at_metadata(1234.5678) == {CREATED_AT: "1234.568"}
    assert read_created_at(created_at_metadata(1234.5678)) == pytest.approx(1234.568)
    assert read_created_at({}) is None
    assert read_created_at({CREATED_AT: "yesterday"}) is None


def test_a_blob_of_known_age_is_old_enough_exactly_from_the_grace_period_on() -> None:
    rule = GraceRule(HOUR_MS, FirstSeen())
    assert rule.age("b", aged(7200), NOW) == pytest.approx(7200)
    assert rule.old_enough("b", aged(7200), NOW)
    assert rule.old_enough("b", aged(3600), NOW)
    assert not rule.old_enough("b", aged(3599), NOW)
    assert not rule.old_enough("b", aged(0), NOW)


def test_a_created_at_in_the_future_counts_as_just_made() -> None:
    """Clock skew (the writer's clock ahead): the blob looks young, never older than it is."""
    rule = GraceRule(HOUR_MS, FirstSeen())
    assert rule.age("b", aged(-5000), NOW) == 0.0
    assert not rule.old_enough("b", aged(-5000), NOW)
    # once the collector's clock passes created_at by the grace period, it goes
    assert rule.old_enough("b", aged(-5000), NOW + 5000 + 3600)
    assert not rule.old_enough("b", aged(-5000), NOW + 5000 + 3599)


def test_an_unknown_age_is_counted_from_the_collectors_first_sighting() -> None:
    first_seen = FirstSeen()
    rule = GraceRule(HOUR_MS, first_seen)
    for metadata in ({}, {CREATED_AT: "not a time"}, None):  # no created_at, unreadable, store without metadata
        name = f"blob-{metadata!r}"
        assert rule.age(name, metadata, NOW) == 0.0  # first seen now: as young as can be
        assert not rule.old_enough(name, metadata, NOW + 3599)
        assert rule.old_enough(name, metadata, NOW + 3600)
        assert first_seen.since(name, NOW + 9999) == NOW  # the first sighting is remembered, not moved
    # a first sighting only ever under-estimates: a blob seen later than it was made is kept longer, never less
    assert not rule.old_enough("made-long-ago", None, NOW + 10 * 3600)


def test_a_collector_without_memory_keeps_a_blob_of_unknown_age_whatever_the_grace_period() -> None:
    for grace_ms in (HOUR_MS, 0):
        rule = GraceRule(grace_ms)
        assert rule.age("b", {}, NOW) is None
        assert not rule.old_enough("b", {}, NOW)
        assert not rule.old_enough("b", None, NOW + 10**9)
        assert rule.old_enough("b", aged(0), NOW) is (grace_ms == 0)  # a known age still decides


def test_no_grace_period_turns_the_guard_off_for_a_collector_with_memory() -> None:
    rule = GraceRule(0, FirstSeen())
    assert rule.old_enough("young", aged(0), NOW)
    assert rule.old_enough("future", aged(-60), NOW)
    assert rule.old_enough("unknown", {}, NOW)
    assert rule.sweep_deadline(NOW) is None
    assert rule.may_name(None, NOW) and rule.may_name(NOW - 10**6, NOW)


def test_a_writer_may_name_an_unreferenced_blob_only_below_half_the_grace_period() -> None:
    rule = GraceRule(HOUR_MS)
    assert rule.may_name(NOW - 1799, NOW)
    assert not rule.may_name(NOW - 1800, NOW)
    assert not rule.may_name(None, NOW)  # unknown age: never
    assert rule.may_name(NOW + 100, NOW)  # from the future: just made
    assert rule.sweep_deadline(NOW) == NOW + 900  # a sweep stops a quarter of the grace period after its mark


def test_first_seen_forgets_only_what_a_listing_of_its_prefix_no_longer_shows() -> None:
    first_seen = FirstSeen()
    for name in ("a/1", "a/2", "b/1"):
        first_seen.since(name, NOW)
    first_seen.forget_missing("a/", {"a/2"})
    assert len(first_seen) == 2
    assert first_seen.since("a/1", NOW + 10) == NOW + 10  # forgotten: counted anew
    assert first_seen.since("a/2", NOW + 10) == NOW and first_seen.since("b/1", NOW + 10) == NOW
    first_seen.forget("b/1")
    assert first_seen.since("b/1", NOW + 20) == NOW + 20


# -- the mark ------------------------------------------------------------------------------------------------------


def test_a_mark_is_the_union_of_what_the_markers_reference_plus_what_the_collector_holds() -> None:
    mark = mark_referenced(["m1", "m2"], lambda marker: {f"{marker}/x", "shared"}, at=NOW, also={"own"})
    assert mark == Mark(frozenset({"m1/x", "m2/x", "shared", "own"}), at=NOW)
    assert mark.complete
    assert mark.plus({"more"}).blobs == mark.blobs | {"more"}


def test_a_marker_whose_blobs_cannot_be_told_makes_the_mark_incomplete_and_stops_reading() -> None:
    read: list[str] = []

    def referenced(marker: str) -> set[str] | None:
        read.append(marker)
        return None if marker == "unknown" else {marker}

    mark = mark_referenced(["m1", "unknown", "m3"], referenced, at=NOW)
    assert not mark.complete
    assert read == ["m1", "unknown"]


def test_a_marker_that_does_not_decode_is_an_error_of_the_mark() -> None:
    def referenced(marker: str) -> set[str]:
        raise CorruptDataError(f"marker {marker} does not decode")

    with pytest.raises(CorruptDataError, match="m1"):
        mark_referenced(["m1"], referenced, at=NOW)


class _Admin(StateBackendAdmin):
    def create_resources(self) -> None:
        pass

    def validate_resources(self) -> None:
        pass

    def referenced_blobs(self, store: str, marker: str) -> set[str] | None:
        if marker == "corrupt":
            raise CorruptDataError("bad marker")
        if marker == "future":
            raise IncompatibleFormatError("format 99")
        if marker == "missing":
            raise NotFoundError("index gone")
        return None if marker == "silent" else {f"{store}/{marker}"}


def test_referenced_by_admin_marks_through_the_backends_referenced_blobs() -> None:
    referenced = referenced_by_admin(_Admin(), "counts")
    assert referenced("m1") == {"counts/m1"}
    assert referenced("silent") is None
    assert referenced("corrupt") is None and referenced("future") is None
    with pytest.raises(NotFoundError):  # a missing blob is not "the backend does not say"
        referenced("missing")
    assert referenced_by_admin(None, "counts")("m1") is None  # the backend is not installed


# -- the sweep -----------------------------------------------------------------------------------------------------


class _Clock:
    def __init__(self, now: float = NOW) -> None:
        self.now = now

    def __call__(self) -> float:
        return self.now


def _store(**blobs: dict[str, str]) -> MemoryBlobStore:
    store = MemoryBlobStore()
    for name, metadata in blobs.items():
        store.put(f"p/{name}", b"x", metadata=metadata)
    return store


def test_the_sweep_deletes_exactly_the_unmarked_blobs_that_are_old_enough() -> None:
    store = _store(marked=aged(7200), old=aged(7200), young=aged(60), future=aged(-60), ageless={})
    store.put("q/old", b"x", metadata=aged(7200))  # outside the prefix
    rule = GraceRule(HOUR_MS, FirstSeen())
    deleted: list[str] = []
    swept = sweep_unreferenced(
        store, "p/", Mark(frozenset({"p/marked"}), at=NOW), rule, clock=_Clock(), on_deleted=deleted.append
    )
    assert swept.deleted == ("p/old",) and not swept.stopped
    assert deleted == ["p/old"]
    assert sorted(store.list("")) == ["p/ageless", "p/future", "p/marked", "p/young", "q/old"]
    # an hour later the ageless blob (first seen by the sweep above) and the young one go; the marked one stays
    later = sweep_unreferenced(
        store, "p/", Mark(frozenset({"p/marked"}), at=NOW + 3600), rule, clock=_Clock(NOW + 3600)
    )
    assert sorted(later.deleted) == ["p/ageless", "p/young"]
    assert sorted(store.list("p/")) == ["p/future", "p/marked"]


def test_an_incomplete_mark_sweeps_nothing_not_even_a_listing() -> None:
    class NoListing(MemoryBlobStore):
        def list(self, prefix: str = "") -> Iterator[str]:
            raise AssertionError("an incomplete mark must not list")

    store = NoListing()
    store.put("p/old", b"x", metadata=aged(7200))
    swept = sweep_unreferenced(
        store, "p/", Mark(frozenset(), at=NOW, complete=False), GraceRule(0, FirstSeen()), clock=_Clock()
    )
    assert swept.deleted == () and store.exists("p/old")


def test_spare_expired_and_confirm_let_the_backend_decide_more() -> None:
    store = _store(
        spared=aged(7200),
        expired={**aged(60), "expires_at": str(NOW - 1)},
        unexpired={**aged(60), "expires_at": str(NOW + 100)},
        adopted=aged(7200),
        old=aged(7200),
    )
    swept = sweep_unreferenced(
        store,
        "p/",
        Mark(frozenset(), at=NOW),
        GraceRule(HOUR_MS, FirstSeen()),
        clock=_Clock(),
        now=NOW,
        spare=lambda name: name == "p/spared",
        expired=lambda metadata, now: float(metadata.get("expires_at", "inf")) <= now,
        confirm=lambda name: name != "p/adopted",
    )
    assert sorted(swept.deleted) == ["p/expired", "p/old"]
    assert sorted(store.list("p/")) == ["p/adopted", "p/spared", "p/unexpired"]


def test_the_sweep_stops_a_quarter_of_the_grace_period_after_its_mark() -> None:
    clock = _Clock()
    store = _store(a=aged(7200), b=aged(7200), c=aged(7200))

    class Slow(MemoryBlobStore):
        supports_conditional_delete = False  # the sweep takes its delete_many path, which this test watches

        def delete_many(self, names: list[str]) -> None:
            store.delete_many(names)
            clock.now += 1000  # each delete request takes 1000 s: past NOW + 900 after the first

    slow = Slow()
    slow.head = store.head  # type: ignore[method-assign]
    slow.list = store.list  # type: ignore[method-assign]
    swept = sweep_unreferenced(
        slow, "p/", Mark(frozenset(), at=NOW), GraceRule(HOUR_MS, FirstSeen()), clock=clock, batch=1
    )
    assert swept.stopped and len(swept.deleted) == 1
    assert len(list(store.list("p/"))) == 2
    # with no grace period there is no deadline
    clock.now = NOW + 10**6
    rest = sweep_unreferenced(slow, "p/", Mark(frozenset(), at=NOW), GraceRule(0, FirstSeen()), clock=clock)
    assert not rest.stopped and len(rest.deleted) == 2


def test_a_batch_whose_deadline_passed_while_it_was_gathered_is_not_deleted() -> None:
    """The deletes go in batches (one request each): the deadline is checked again just before a batch goes, so
    heads slow enough to take the sweep past it delete nothing of what they found."""
    clock = _Clock()
    store = _store(a=aged(7200), b=aged(7200))
    requests: list[list[str]] = []

    class SlowHeads(MemoryBlobStore):
        supports_conditional_delete = False  # the sweep takes its delete_many path, which this test watches

        def head(self, name: str) -> BlobInfo:
            clock.now += 500  # the second head ends past NOW + 900
            return store.head(name)

        def delete_many(self, names: list[str]) -> None:
            requests.append(list(names))
            store.delete_many(names)

    slow = SlowHeads()
    slow.list = store.list  # type: ignore[method-assign]
    swept = sweep_unreferenced(slow, "p/", Mark(frozenset(), at=NOW), GraceRule(HOUR_MS, FirstSeen()), clock=clock)
    assert swept.stopped and swept.deleted == () and requests == []
    assert sorted(store.list("p/")) == ["p/a", "p/b"]
    # in time, both go in one request
    clock.now = NOW
    fast = sweep_unreferenced(store, "p/", Mark(frozenset(), at=NOW), GraceRule(HOUR_MS, FirstSeen()), clock=clock)
    assert fast.deleted == ("p/a", "p/b") and not fast.stopped


def test_a_blob_gone_between_the_listing_and_its_head_is_not_deleted_again() -> None:
    store = _store(gone=aged(7200), old=aged(7200))
    deletes: list[str] = []

    class Racing(MemoryBlobStore):
        supports_conditional_delete = False  # the sweep takes its delete_many path, which this test watches

        def head(self, name: str) -> BlobInfo:
            if name == "p/gone":
                raise NotFoundError(name)
            return store.head(name)

        def delete(self, name: str) -> None:
            deletes.append(name)
            store.delete(name)

        def delete_many(self, names: list[str]) -> None:
            deletes.extend(names)
            store.delete_many(names)

    racing = Racing()
    racing.list = store.list  # type: ignore[method-assign]
    swept = sweep_unreferenced(racing, "p/", Mark(frozenset(), at=NOW), GraceRule(0, FirstSeen()), clock=_Clock())
    assert swept.deleted == ("p/old",) and deletes == ["p/old"]


def test_on_a_store_without_metadata_the_sweep_ages_from_the_first_sighting_and_forgets_what_is_gone() -> None:
    class NoMetadata(MemoryBlobStore):
        supports_metadata = False

        def head(self, name: str) -> BlobInfo:
            raise AssertionError("a store without metadata is never asked for it")

    store = NoMetadata()
    store.put("p/a", b"x")
    store.put("p/b", b"x")
    first_seen = FirstSeen()
    rule = GraceRule(HOUR_MS, first_seen)
    mark = Mark(frozenset(), at=NOW)
    assert sweep_unreferenced(store, "p/", mark, rule, clock=_Clock()).deleted == ()
    assert len(first_seen) == 2
    store.delete("p/b")  # gone meanwhile: forgotten by the next whole pass
    assert sweep_unreferenced(store, "p/", mark, rule, clock=_Clock(NOW + 100)).deleted == ()
    assert len(first_seen) == 1
    late = Mark(frozenset(), at=NOW + 3600)
    assert sweep_unreferenced(store, "p/", late, rule, clock=_Clock(NOW + 3600)).deleted == ("p/a",)
    assert len(first_seen) == 0


# -- in flight -----------------------------------------------------------------------------------------------------


def test_a_held_file_is_not_removed_until_every_holder_let_go(tmp_path: Path) -> None:
    registry = InFlightRegistry()
    staged = tmp_path / "000000000001-aa.delta"
    with registry.hold([staged]):  # held before the file exists
        staged.write_bytes(b"delta")
        with registry.hold([staged]):
            assert not registry.remove_unless_held(staged)
        assert registry.is_held(staged)
        assert not registry.remove_unless_held(staged) and staged.exists()
    assert not registry.is_held(staged)
    assert registry.remove_unless_held(staged) and not staged.exists()
    assert registry.remove_unless_held(staged)  # absent is fine


def test_a_held_dir_keeps_everything_under_it(tmp_path: Path) -> None:
    registry = InFlightRegistry()
    staging = tmp_path / "staging"
    (staging / "sub").mkdir(parents=True)
    (staging / "run.partial").write_bytes(b"half")
    (staging / "sub" / "x").write_bytes(b"x")
    other = tmp_path / "other.partial"
    other.write_bytes(b"x")
    with registry.hold([staging]):
        assert not registry.remove_unless_held(staging / "run.partial")
        assert not registry.remove_unless_held(staging / "sub")
        assert registry.remove_unless_held(other) and not other.exists()  # a sibling is not held
    assert registry.remove_unless_held(staging / "sub") and not (staging / "sub").exists()
    assert registry.remove_unless_held(staging / "run.partial") and not (staging / "run.partial").exists()


def test_the_process_registry_is_one_object_shared_by_every_backend() -> None:
    from statebackend.kit.inflight import IN_FLIGHT as again

    assert isinstance(IN_FLIGHT, InFlightRegistry) and again is IN_FLIGHT


# -- background work -----------------------------------------------------------------------------------------------


class _View:
    def __init__(self) -> None:
        self.closed = 0

    def close(self) -> None:
        self.closed += 1


def test_close_when_ready_closes_a_view_now_or_once_it_opens() -> None:
    ready: Future[_View] = Future()
    view = _View()
    ready.set_result(view)
    close_when_ready(ready)
    assert view.closed == 1
    pending: Future[_View] = Future()
    later = _View()
    close_when_ready(pending)
    assert later.closed == 0
    pending.set_result(later)
    assert later.closed == 1
    failed: Future[_View] = Future()
    close_when_ready(failed)
    failed.set_exception(OSError("the flush failed"))  # nothing to close, nothing raised
    cancelled: Future[_View] = Future()
    close_when_ready(cancelled)
    assert cancelled.cancel()


def test_cancelled_background_work_stops_at_the_next_chunk() -> None:
    cancellation = Cancellation()
    seen = 0

    def records() -> Iterator[int]:
        nonlocal seen
        for i in range(10 * CANCEL_CHUNK):
            seen += 1
            if i == CANCEL_CHUNK + 5:
                cancellation.cancel()
            yield i

    read = 0
    with pytest.raises(BackgroundWorkCancelled, match="background snapshot s1 stopped: the task was handed"):
        for _ in cancellation.records(records(), "background snapshot s1"):
            read += 1
    assert read == 2 * CANCEL_CHUNK and seen == 2 * CANCEL_CHUNK  # the chunk under way ends, no more is read
    with pytest.raises(BackgroundWorkCancelled):
        cancellation.check("store s: compaction")
    assert isinstance(cancellation.error("x"), StateBackendError)


def test_work_not_cancelled_reads_everything() -> None:
    cancellation = Cancellation()
    assert list(cancellation.records(range(3 * CANCEL_CHUNK + 1), "x")) == list(range(3 * CANCEL_CHUNK + 1))
    cancellation.check("x")
    assert not cancellation.cancelled


# -- restore -------------------------------------------------------------------------------------------------------


def test_the_interrupt_flag_raises_restore_interrupted_once_set_from_any_thread() -> None:
    flag = InterruptFlag()
    flag.check("counts")
    thread = threading.Thread(target=flag.set)
    thread.start()
    thread.join()
    assert flag.is_set
    with pytest.raises(RestoreInterrupted, match="restore of store counts interrupted before run r1; the next"):
        flag.check("counts", before="run r1")
    with pytest.raises(InterruptedError):
        flag.check("counts")
    assert issubclass(RestoreInterrupted, StateBackendError)


def test_puts_only_drops_the_deletes_of_a_bulk_load() -> None:
    records: list[tuple[bytes, bytes | None]] = [(b"a", b"1"), (b"b", None), (b"c", b"")]
    assert list(puts_only(records)) == [(b"a", b"1"), (b"c", b"")]


def test_interrupt_is_an_optional_hook_of_the_restore_contract() -> None:
    class Minimal(TaskRestoreManager):
        def __init__(self) -> None:
            self.restored = False

        def init(self, checkpoint: Any) -> None:
            pass

        def restore(self) -> None:
            self.restored = True

    manager = Minimal()
    manager.interrupt()  # the default does nothing: the restore runs to its end
    manager.restore()
    assert manager.restored


# -- gather --------------------------------------------------------------------------------------------------------


def test_gather_resolves_once_every_future_is_done_with_results_by_key() -> None:
    a: Future[str] = Future()
    b: Future[str] = Future()
    both = gather({"a": a, "b": b})
    b.set_result("B")
    assert not both.done()
    a.set_result("A")
    assert both.result(timeout=0) == {"a": "A", "b": "B"}
    assert gather({}).result(timeout=0) == {}


def test_gather_raises_the_first_failure_in_the_dicts_order_once_all_are_done() -> None:
    a: Future[str] = Future()
    b: Future[str] = Future()
    c: Future[str] = Future()
    all_three = gather({"a": a, "b": b, "c": c})
    c.set_exception(ValueError("c failed"))
    b.set_exception(OSError("b failed"))
    assert not all_three.done()
    a.set_result("A")
    with pytest.raises(OSError, match="b failed"):
        all_three.result(timeout=0)
    d: Future[str] = Future()
    cancelled = gather({"d": d})
    d.cancel()
    with pytest.raises(CancelledError):
        cancelled.result(timeout=0)
