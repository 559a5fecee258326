"""Counters behind `commd status`: per-group stages, bytes, latencies, errors, departures.

Latency percentiles cover a sliding window (the last ``LATENCY_WINDOW`` ops of
each kind: recent behaviour, bounded memory); the op count beside them is the
total since the daemon started, and the window's size is reported with it.
Ranks that leave normally are departures, not errors.
"""

from __future__ import annotations

import collections
import time
from dataclasses import dataclass, field

import numpy as np

#: Latency percentiles cover this many of the most recent ops of each kind.
LATENCY_WINDOW = 2048


@dataclass
class GroupStats:
    size: int
    next_seq: int = 0
    queued: int = 0
    executing: int = 0
    done: int = 0
    failed: int = 0
    bytes: int = 0


@dataclass
class Stats:
    started_at: float = field(default_factory=time.time)
    groups: dict[str, GroupStats] = field(default_factory=dict)
    latencies: dict[str, collections.deque] = field(default_factory=dict)
    errors: collections.deque = field(default_factory=lambda: collections.deque(maxlen=20))
    departures: collections.deque = field(default_factory=lambda: collections.deque(maxlen=20))
    latency_counts: dict[str, int] = field(default_factory=dict)  # op kind -> ops completed, all time
    ops_done: int = 0
    bytes_moved: int = 0
    #: op kind -> lane ("local": no lane, the node's ranks only) -> [ops, bytes]
    by_lane: dict[str, dict[str, list[int]]] = field(default_factory=dict)

    def group_added(self, name: str, size: int) -> None:
        self.groups.setdefault(name, GroupStats(size))

    def group_removed(self, name: str) -> None:
        self.groups.pop(name, None)

    def submitted(self, group: str, seq: int) -> None:
        stats = self.groups.get(group)
        if stats is not None and seq >= stats.next_seq:
            stats.next_seq = seq + 1

    def queued(self, group: str) -> None:
        if group in self.groups:
            self.groups[group].queued += 1

    def started(self, group: str, queued: bool = True) -> None:
        stats = self.groups.get(group)
        if stats is not None:
            if queued:
                stats.queued -= 1
            stats.executing += 1

    def finished(self, group: str, kind: str, nbytes: int, seconds: float, ok: bool, lane: str = "local") -> None:
        stats = self.groups.get(group)
        if stats is not None:
            stats.executing -= 1
            if ok:
                stats.done += 1
                stats.bytes += nbytes
            else:
                stats.failed += 1
        if ok:
            self.ops_done += 1
            self.bytes_moved += nbytes
            row = self.by_lane.setdefault(kind, {}).setdefault(lane, [0, 0])
            row[0] += 1
            row[1] += nbytes
            window = self.latencies.get(kind)
            if window is None:
                window = self.latencies[kind] = collections.deque(maxlen=LATENCY_WINDOW)
            window.append(seconds)
            self.latency_counts[kind] = self.latency_counts.get(kind, 0) + 1

    def per_kind(self) -> dict[str, dict[str, dict[str, int]]]:
        """Ops and bytes completed per op kind and lane (``commd status``)."""
        return {kind: {lane: {"ops": row[0], "bytes": row[1]} for lane, row in lanes.items()}
                for kind, lanes in self.by_lane.items()}

    def per_lane(self) -> dict[str, dict[str, int]]:
        """Ops and bytes completed per lane, all kinds together."""
        out: dict[str, dict[str, int]] = {}
        for lanes in self.by_lane.values():
            for lane, (ops, nbytes) in lanes.items():
                total = out.setdefault(lane, {"ops": 0, "bytes": 0})
                total["ops"] += ops
                total["bytes"] += nbytes
        return out

    def error(self, message: str) -> None:
        self.errors.append({"time": time.time(), "message": message})

    def departed(self, message: str) -> None:
        """A rank left normally (bye): shown apart from the errors."""
        self.departures.append({"time": time.time(), "message": message})

    def latency_table(self) -> dict[str, dict[str, float]]:
        table = {}
        for kind, samples in self.latencies.items():
            if not samples:
                continue
            arr = np.fromiter(samples, dtype=np.float64) * 1e6
            p50, p90, p99 = np.percentile(arr, [50, 90, 99])
            table[kind] = {
                "count": self.latency_counts.get(kind, len(arr)),
                "window": len(arr),
                "p50_us": round(float(p50), 1),
                "p90_us": round(float(p90), 1),
                "p99_us": round(float(p99), 1),
            }
        return table
