"""Pauses of Python's cyclic garbage collector in this process, and the heap frozen out of them.

A full collection (generation 2) walks every container object the process holds, with the
GIL held.  Once torch is imported that is about 170,000 objects, and a full collection takes
90-180 ms on the 2-core development machine: the daemon's event loop, its lane threads and,
through them, the ops of every node of the job wait for it.  The objects that exist once the
daemon is set up (torch, NumPy, commd's own modules) live as long as the process, so
:func:`freeze_heap` moves them to the collector's permanent generation (``gc.freeze``) and
later full collections walk only what came after.  Garbage among the frozen objects is never
collected; what is frozen is module state loaded once, so that costs nothing that grows.

:class:`GcPauses` counts collections and their duration per generation (``gc.callbacks``),
for ``commd status`` and the metrics: an operator sees whether the collector stalls a daemon.
"""

from __future__ import annotations

import gc
import threading
import time
from dataclasses import dataclass
from typing import Any


@dataclass
class GenerationPauses:
    """The collections of one generation: how many, their total and longest duration."""

    collections: int = 0
    seconds: float = 0.0
    longest: float = 0.0


class GcPauses:
    """Collector pauses of this process, per generation (installed once per process)."""

    def __init__(self) -> None:
        self.generations = [GenerationPauses() for _ in range(3)]
        self._began: float | None = None
        self._lock = threading.Lock()
        self._installed = False

    def install(self) -> None:
        """Start counting (idempotent)."""
        with self._lock:
            if not self._installed:
                gc.callbacks.append(self._callback)
                self._installed = True

    def uninstall(self) -> None:
        """Stop counting (idempotent)."""
        with self._lock:
            if self._installed:
                gc.callbacks.remove(self._callback)
                self._installed = False

    def _callback(self, phase: str, info: dict[str, Any]) -> None:
        # The collector runs one collection at a time, holding the GIL: one start slot is enough.
        if phase == "start":
            self._began = time.perf_counter()
            return
        began, self._began = self._began, None
        generation = info.get("generation")
        if began is None or not isinstance(generation, int) or not 0 <= generation < len(self.generations):
            return
        took = time.perf_counter() - began
        counts = self.generations[generation]
        counts.collections += 1
        counts.seconds += took
        counts.longest = max(counts.longest, took)

    def status(self) -> dict[str, Any]:
        """``{"frozen_objects": n, "generations": [{collections, seconds, longest_ms}, ...]}``."""
        return {
            "frozen_objects": gc.get_freeze_count(),
            "generations": [{"collections": g.collections, "seconds": round(g.seconds, 6),
                             "longest_ms": round(g.longest * 1e3, 3)} for g in self.generations],
        }


#: This process's counts (the daemon installs it at start).
PAUSES = GcPauses()


_freeze = True


def configure(freeze: bool) -> None:
    """Whether :func:`freeze_heap` freezes ($COMMD_GC_FREEZE=0 turns it off, to compare)."""
    global _freeze
    _freeze = freeze


def freeze_heap() -> int:
    """Move every object alive now out of the collector's reach (see the module's docstring),
    unless configured off; the number of objects frozen in all."""
    if _freeze:
        gc.freeze()
    return gc.get_freeze_count()
