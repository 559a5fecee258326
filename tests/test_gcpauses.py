"""The collector's pauses counted per generation, and what freezing the heap does (commd/observe/gcpauses.py)."""

from __future__ import annotations

import gc
import time
import weakref

from commd.observe.gcpauses import GcPauses, freeze_heap


class Node:
    """A reference cycle: only the cyclic collector frees it."""

    def __init__(self) -> None:
        self.me = self


def test_each_collection_is_counted_under_its_generation_with_its_duration() -> None:
    pauses = GcPauses()
    pauses.install()
    pauses.install()  # idempotent: one callback
    try:
        for _ in range(3):
            counted = pauses.generations[2].seconds
            t0 = time.perf_counter()
            gc.collect(2)
            wall = time.perf_counter() - t0
            assert 0 < pauses.generations[2].seconds - counted <= wall  # the collection, within the call
        gc.collect(1)
    finally:
        pauses.uninstall()
    status = pauses.status()
    full = status["generations"][2]
    assert full["collections"] == 3
    assert full["seconds"] > 0 and 0 < full["longest_ms"] <= full["seconds"] * 1e3 + 1e-6
    assert status["generations"][1]["collections"] >= 1
    gc.collect(2)  # after uninstall: not counted
    assert pauses.status()["generations"][2]["collections"] == 3


def test_a_frozen_cycle_outlives_full_collections_until_unfrozen() -> None:
    """What freeze_heap trades: everything alive at the freeze is out of the collector's walks —
    its garbage cycles too (the daemon freezes only state loaded once: modules, torch)."""
    gc.collect()
    cycle = Node()
    alive = weakref.ref(cycle)
    before = gc.get_freeze_count()
    try:
        frozen = freeze_heap()
        assert frozen > before
        del cycle
        gc.collect()
        assert alive() is not None, "a frozen cycle was collected"
    finally:
        gc.unfreeze()
    gc.collect()
    assert alive() is None, "the cycle outlived an unfreeze and a full collection"
