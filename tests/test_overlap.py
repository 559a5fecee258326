"""The in-flight range index that keeps overlapping all-reduces out of one fused set (vs brute force)."""

from __future__ import annotations

import random

from commd.scheduler.overlap import PendingRanges


def test_matches_a_brute_force_check_on_random_ranges() -> None:
    rng = random.Random(7)
    index = PendingRanges()
    alive: set[int] = set()
    live: dict[int, tuple[int, int, int]] = {}  # tag -> (segment, lo, hi)
    for tag in range(3000):
        if live and rng.random() < 0.45:  # some ops complete
            done = rng.choice(list(live))
            alive.discard(done)
            del live[done]
        segment = rng.randrange(3)
        lo = rng.randrange(0, 5000)
        hi = lo + rng.choice([1, 4, 16, 64, 700])
        want = any(s == segment and a < hi and lo < b for s, a, b in live.values())
        assert index.add(segment, lo, hi, tag, alive.__contains__) == want, (tag, segment, lo, hi)
        alive.add(tag)
        live[tag] = (segment, lo, hi)


def test_identical_and_touching_ranges() -> None:
    index = PendingRanges()
    alive = {1, 2, 3}
    assert not index.add("s", 0, 16, 1, alive.__contains__)
    assert not index.add("s", 16, 32, 2, alive.__contains__)  # touching is not overlapping
    assert index.add("s", 0, 16, 3, alive.__contains__)  # the same tensor again
    alive.clear()
    assert not index.add("s", 8, 24, 4, alive.__contains__)  # earlier ops done: no conflict
