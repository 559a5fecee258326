"""Byte ranges of ops in flight, per memory segment: does a new op touch memory an earlier one will write?

Fusion runs several all-reduces as one: every op's input is read before any
result is written.  That is only right when no op of a fused set reads memory
an earlier op of the set writes (program order), so the daemon asks this
index for each fusion candidate.  A check costs two bisections plus the ranges
that start within one maximal range length of the new one (usually none or
one), not a scan of everything in flight.  Ranges whose op is no longer in
flight are dropped when met, and all at once when a segment grows large.
"""

from __future__ import annotations

import bisect
from collections.abc import Callable, Hashable

PRUNE_AT = 4096


class _Segment:
    __slots__ = ("starts", "rows", "max_len")

    def __init__(self) -> None:
        self.starts: list[int] = []  # sorted, one per distinct start
        self.rows: dict[int, list[tuple[int, Hashable]]] = {}  # start -> [(end, op tag)]
        self.max_len = 0


class PendingRanges:
    def __init__(self) -> None:
        self._segments: dict[Hashable, _Segment] = {}

    def add(self, segment: Hashable, lo: int, hi: int, tag: Hashable, alive: Callable[[Hashable], bool]) -> bool:
        """Record [lo, hi) for op ``tag``; True if it overlaps a range of an op still ``alive``."""
        seg = self._segments.get(segment)
        if seg is None:
            seg = self._segments[segment] = _Segment()
        overlap = False
        if seg.starts:
            first = bisect.bisect_left(seg.starts, lo - seg.max_len + 1)
            last = bisect.bisect_left(seg.starts, hi)
            for start in seg.starts[first:last]:
                rows = [r for r in seg.rows[start] if alive(r[1])]
                if rows:
                    seg.rows[start] = rows
                    overlap = overlap or any(end > lo for end, _ in rows)
                else:
                    self._drop(seg, start)
        if lo not in seg.rows:
            bisect.insort(seg.starts, lo)
            seg.rows[lo] = []
        seg.rows[lo].append((hi, tag))
        seg.max_len = max(seg.max_len, hi - lo)
        if len(seg.rows) > PRUNE_AT:
            self._prune(seg, alive)
        return overlap

    @staticmethod
    def _drop(seg: _Segment, start: int) -> None:
        del seg.rows[start]
        del seg.starts[bisect.bisect_left(seg.starts, start)]

    def _prune(self, seg: _Segment, alive: Callable[[Hashable], bool]) -> None:
        for start in list(seg.starts):
            rows = [r for r in seg.rows[start] if alive(r[1])]
            if rows:
                seg.rows[start] = rows
            else:
                self._drop(seg, start)
        if not seg.rows:
            seg.max_len = 0
