"""The per-key session logic bench/spark_tws.py runs on both sides, and the check that fails the bench when the two
sides' sessions differ (no Spark: the end-to-end run is the bench itself)."""

from __future__ import annotations

import random

from bench.spark_tws import advance, batch_sessions, compare_sessions

GAP = 100


def test_advance_closes_a_session_only_after_a_gap_longer_than_the_gap() -> None:
    closed, session = advance(None, [30, 10, 20 + GAP], GAP)  # out of order within the batch: sorted first
    assert closed == []
    assert session == (10, 20 + GAP, 3)
    closed, session = advance(session, [20 + 2 * GAP + 1, 20 + 2 * GAP + 5], GAP)
    assert closed == [(10, 20 + GAP, 3)]
    assert session == (20 + 2 * GAP + 1, 20 + 2 * GAP + 5, 2)


def test_sessions_built_batch_by_batch_equal_the_batch_sessionization() -> None:
    """What both streaming sides do (the open session carried from batch to batch, each closed once) gives the
    sessions of all events at once, when no event is late (as in the bench: each batch's events, in any order, come
    after the batches before)."""
    rng = random.Random(5)
    batches = [
        [(f"u{rng.randrange(20)}", rng.randrange(60 * b, 60 * (b + 1))) for _ in range(rng.randrange(0, 25))]
        for b in range(40)
    ]
    events = [event for batch in batches for event in batch]
    open_sessions: dict[str, tuple[int, int, int]] = {}
    closed: list[tuple[str, int, int, int]] = []
    for batch in batches:
        times: dict[str, list[int]] = {}
        for key, ts in batch:
            times.setdefault(key, []).append(ts)
        for key, values in times.items():
            done, open_sessions[key] = advance(open_sessions.get(key), values, GAP)
            closed.extend((key, *s) for s in done)
    closed.extend((key, *s) for key, s in open_sessions.items())
    assert sorted(closed) == batch_sessions(events, GAP)
    assert len(batch_sessions(events, GAP)) > len(open_sessions)  # some sessions did close on a gap


def test_compare_sessions_fails_on_a_missing_an_extra_or_a_doubled_session() -> None:
    expected = [("a", 1, 5, 2), ("b", 3, 3, 1)]
    assert compare_sessions(list(expected), list(expected), expected)[0]
    for ours, theirs in (
        (expected[:1], expected),  # statebackend lost one
        (expected, [*expected, ("c", 9, 9, 1)]),  # transformWithStateInPandas made one up
        (expected, sorted([*expected, expected[0]])),  # one emitted twice
        ([("a", 1, 5, 3), expected[1]], expected),  # a count differs
    ):
        ok, text = compare_sessions(ours, theirs, expected)
        assert not ok
        assert "FAIL" in text
    assert not compare_sessions(expected[:1], expected[:1], expected)[0]  # equal to each other, not to the events
