"""CheckpointId: Samza string form, parse, total order; the generator's strict increase under a clock stepping back."""

from __future__ import annotations

import itertools
import threading

import pytest
from hypothesis import given
from hypothesis import strategies as st
from statebackend.checkpoint import CheckpointId, CheckpointIdGenerator

from statebackend.errors import ConfigError

millis = st.integers(min_value=0, max_value=10**15 - 1)
nanos = st.integers(min_value=0, max_value=999_999)
ids = st.builds(CheckpointId, millis, nanos)


@given(ids)
def test_string_form_parses_back_to_the_same_id(cid: CheckpointId) -> None:
    assert CheckpointId.parse(str(cid)) == cid
    assert str(cid) == f"{cid.millis}-{cid.nanos}"


@given(ids, ids)
def test_order_is_millis_then_nanos_and_sortable_form_orders_the_same(a: CheckpointId, b: CheckpointId) -> None:
    assert (a < b) == ((a.millis, a.nanos) < (b.millis, b.nanos))
    assert (a.sortable() < b.sortable()) == (a < b)
    assert CheckpointId.parse(a.sortable()) == a


def test_string_form_is_samza_form_without_padding() -> None:
    assert str(CheckpointId(1700000000123, 45)) == "1700000000123-45"
    assert CheckpointId(1700000000123, 45).sortable() == "001700000000123-000045"


@pytest.mark.parametrize("text", ["", "12", "12-", "-5", "a-1", "1-b", "1-1000000", "-1-2", "1 -2", "1-2-3", "+1-2"])
def test_parse_rejects_malformed_strings_and_names_them(text: str) -> None:
    with pytest.raises(ConfigError) as info:
        CheckpointId.parse(text)
    assert repr(text) in str(info.value)


@pytest.mark.parametrize("args", [(-1, 0), (0, -1), (0, 1_000_000), (True, 0), (1.0, 0)])
def test_constructor_rejects_out_of_range_parts(args: tuple[object, object]) -> None:
    with pytest.raises(ConfigError):
        CheckpointId(*args)  # type: ignore[arg-type]


def test_successor_carries_into_millis() -> None:
    assert CheckpointId(5, 999_999).successor() == CheckpointId(6, 0)
    assert CheckpointId(5, 7).successor() == CheckpointId(5, 8)


class FakeClock:
    """A clock that returns the given nanosecond readings in turn."""

    def __init__(self, readings: list[int]) -> None:
        self.readings = list(readings)

    def __call__(self) -> int:
        return self.readings.pop(0)


def test_generator_takes_millis_and_nanos_from_the_clock() -> None:
    generator = CheckpointIdGenerator(FakeClock([1_700_000_000_123_456_789]))
    assert generator.next() == CheckpointId(1_700_000_000_123, 456_789)


def test_generator_stays_strictly_increasing_when_the_clock_steps_back() -> None:
    clock = FakeClock([5_000_000_000, 4_000_000_000, 4_000_000_000, 5_000_000_000, 6_000_000_000])
    generator = CheckpointIdGenerator(clock)
    issued = [generator.next() for _ in range(5)]
    assert issued == [
        CheckpointId(5000, 0),
        CheckpointId(5000, 1),
        CheckpointId(5000, 2),
        CheckpointId(5000, 3),
        CheckpointId(6000, 0),
    ]


def test_generator_carries_into_millis_when_stepping_past_the_last_nano_unit() -> None:
    generator = CheckpointIdGenerator(FakeClock([7_999_999, 1, 1]))
    assert [generator.next() for _ in range(3)] == [CheckpointId(7, 999_999), CheckpointId(8, 0), CheckpointId(8, 1)]


@given(st.lists(st.integers(min_value=0, max_value=10**18), min_size=1, max_size=50))
def test_generator_is_strictly_increasing_for_any_clock(readings: list[int]) -> None:
    generator = CheckpointIdGenerator(FakeClock(readings))
    issued = [generator.next() for _ in readings]
    assert all(a < b for a, b in itertools.pairwise(issued))
    assert all(cid >= CheckpointId.from_ns(ns) for cid, ns in zip(issued, readings, strict=True))


def test_observed_id_is_exceeded_by_the_next_id() -> None:
    restored = CheckpointId(9_000, 500)
    generator = CheckpointIdGenerator(FakeClock([1_000_000_000, 9_500_000_000]))
    generator.observe(restored)
    assert generator.next() == CheckpointId(9_000, 501)
    generator.observe(CheckpointId(1, 0))  # an older id changes nothing
    assert generator.next() == CheckpointId(9_500, 0)


def test_generator_is_strictly_increasing_across_threads() -> None:
    generator = CheckpointIdGenerator(lambda: 42_000_000)  # a stuck clock: every id comes from the successor rule
    start = threading.Event()
    results: list[list[CheckpointId]] = [[] for _ in range(4)]

    def issue(out: list[CheckpointId]) -> None:
        start.wait()
        out.extend(generator.next() for _ in range(2_000))

    threads = [threading.Thread(target=issue, args=(out,)) for out in results]
    for thread in threads:
        thread.start()
    start.set()
    for thread in threads:
        thread.join()
    everything = [cid for out in results for cid in out]
    assert len(set(everything)) == len(everything) == 8_000
    assert all(a < b for out in results for a, b in itertools.pairwise(out))
    assert max(everything) == CheckpointId(42, 7_999)
