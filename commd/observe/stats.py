"""Every counter of the daemon: per-group stages, bytes, latencies, errors, departures, limits hit.

The one home for them: ``commd status`` and the Prometheus metrics
(``commd.observe.metrics``) both read these, so the two never disagree.
Latency percentiles cover a sliding window (the last ``LATENCY_WINDOW`` ops of
each kind: recent behaviour, bounded memory); the op count beside them is the
total since the daemon started, and the window's size is reported with it.
Ranks that leave normally are departures, not errors.
"""

from __future__ import annotations

import bisect
import collections
import statistics
import time
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from commd.protocol.schema import FT_EVENTS

#: Latency percentiles cover this many of the most recent ops of each kind.
LATENCY_WINDOW = 2048
#: Upper bounds (seconds) of the op latency histogram: 10 us to 100 s.
LATENCY_BUCKETS: tuple[float, ...] = (
    1e-5, 2.5e-5, 5e-5, 1e-4, 2.5e-4, 5e-4, 1e-3, 2.5e-3, 5e-3, 1e-2, 2.5e-2, 5e-2, 0.1, 0.25, 0.5,
    1.0, 2.5, 5.0, 10.0, 30.0, 100.0,
)


#: ``commd status`` keeps this many of the most recent events ``commd.ft`` reported.
FT_WINDOW = 32


#: Upper bounds of the size classes the mix is shown in (bytes per node's buffer), ×8 apart.
SIZE_CLASSES: tuple[int, ...] = (1 << 10, 8 << 10, 64 << 10, 512 << 10, 4 << 20, 32 << 20)


def size_class(nbytes: int) -> str:
    """The class ``nbytes`` falls in: "<=1K", "1K-8K", ..., ">32M" (what the mix is counted by)."""
    low = 0
    for high in SIZE_CLASSES:
        if nbytes <= high:
            return f"<={_short(high)}" if not low else f"{_short(low)}-{_short(high)}"
        low = high
    return f">{_short(low)}"


def _short(nbytes: int) -> str:
    return f"{nbytes >> 20}M" if nbytes >= 1 << 20 else f"{nbytes >> 10}K"


@dataclass
class OpTotals:
    """Completed ops of one (kind, lane, group): counts, bytes and a latency histogram."""

    ops: int = 0
    bytes: int = 0
    latency_sum: float = 0.0
    #: non-cumulative counts per LATENCY_BUCKETS bound, plus one for +Inf
    buckets: list[int] = field(default_factory=lambda: [0] * (len(LATENCY_BUCKETS) + 1))


@dataclass
class GroupStats:
    size: int
    next_seq: int = 0
    queued: int = 0
    executing: int = 0
    done: int = 0
    failed: int = 0
    bytes: int = 0


#: How an op's buffer reached the daemon: a registered storage (zero-copy), the user's own arena tensor
#: (zero-copy), a client staging block (one copy in, one out), inline in the message, a CUDA IPC handle.
BUFFER_PATHS = ("registered", "arena", "staged", "inline", "cuda")


@dataclass
class Stats:
    started_at: float = field(default_factory=time.time)
    groups: dict[str, GroupStats] = field(default_factory=dict)
    latencies: dict[str, collections.deque] = field(default_factory=dict)
    errors: collections.deque = field(default_factory=lambda: collections.deque(maxlen=20))
    departures: collections.deque = field(default_factory=lambda: collections.deque(maxlen=20))
    #: global rank -> {time, why, epoch}: the ranks known to be gone (``rank_gone``).
    gone_ranks: dict[int, dict[str, Any]] = field(default_factory=dict)
    membership_epoch: int = 0
    #: the last FT_WINDOW events ``commd.ft`` reported (``ft_event``), oldest first, one per recovery
    ft_events: collections.deque = field(default_factory=lambda: collections.deque(maxlen=FT_WINDOW))
    #: recoveries reported per event kind (FT_EVENTS), all time
    ft_counts: dict[str, int] = field(default_factory=lambda: dict.fromkeys(FT_EVENTS, 0))
    #: the newest recovery ("recovered" or "joined") entry of ``ft_events``
    last_recovery: dict[str, Any] | None = None
    latency_counts: dict[str, int] = field(default_factory=dict)  # op kind -> ops completed, all time
    ops_done: int = 0
    bytes_moved: int = 0
    #: (op kind, lane, group) -> totals; lane "local": no lane, the node's ranks only
    by_op: dict[tuple[str, str, str], OpTotals] = field(default_factory=dict)
    #: inter-node ops completed per algorithm: a program's name, or "native" (the lane's own)
    by_algorithm: dict[str, dict[str, int]] = field(default_factory=dict)
    #: the mix: (op kind, size class, lane, algorithm, codec) -> [ops, bytes], inter-node ops only
    mix: dict[tuple[str, str, str, str, str], list[int]] = field(default_factory=dict)
    #: error replies sent to ranks, per error code (timeout, peer_died, mismatch, ...)
    error_replies: dict[str, int] = field(default_factory=dict)
    #: requests refused because a configured limit was reached, per limit name
    limits_hit: dict[str, int] = field(default_factory=dict)
    #: bytes of accepted ops' buffers by how they reached the daemon (``BUFFER_PATHS``), all clients
    bytes_by_path: dict[str, int] = field(default_factory=lambda: dict.fromkeys(BUFFER_PATHS, 0))
    #: op batches accepted (``ops`` messages: coalesced ops submitted together) and the ops they held
    op_batches: int = 0
    batched_ops: int = 0

    def group_added(self, name: str, size: int) -> None:
        self.groups.setdefault(name, GroupStats(size))

    def group_removed(self, name: str) -> None:
        self.groups.pop(name, None)

    def submitted(self, group: str, seq: int) -> None:
        stats = self.groups.get(group)
        if stats is not None and seq >= stats.next_seq:
            stats.next_seq = seq + 1

    def op_batch(self, ops: int) -> None:
        """A batch of ``ops`` ops submitted together was accepted."""
        self.op_batches += 1
        self.batched_ops += ops

    def queued(self, group: str) -> None:
        if group in self.groups:
            self.groups[group].queued += 1

    def started(self, group: str, queued: bool = True) -> None:
        stats = self.groups.get(group)
        if stats is not None:
            if queued:
                stats.queued -= 1
            stats.executing += 1

    def finished(self, group: str, kind: str, nbytes: int, seconds: float, ok: bool, lane: str = "local",
                 algo: str = "", codec: str = "") -> None:
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
            window = self.latencies.get(kind)
            if window is None:
                window = self.latencies[kind] = collections.deque(maxlen=LATENCY_WINDOW)
            window.append(seconds)
            self.latency_counts[kind] = self.latency_counts.get(kind, 0) + 1
            totals = self.by_op.get((kind, lane, group))
            if totals is None:
                totals = self.by_op[(kind, lane, group)] = OpTotals()
            totals.ops += 1
            totals.bytes += nbytes
            totals.latency_sum += seconds
            totals.buckets[bisect.bisect_left(LATENCY_BUCKETS, seconds)] += 1
            if lane != "local":
                row = self.by_algorithm.get(algo or "native")
                if row is None:
                    row = self.by_algorithm[algo or "native"] = {"ops": 0, "bytes": 0}
                row["ops"] += 1
                row["bytes"] += nbytes
                key = (kind, size_class(nbytes), lane, algo or "native", codec or "none")
                cell = self.mix.get(key)
                if cell is None:
                    cell = self.mix[key] = [0, 0]
                cell[0] += 1
                cell[1] += nbytes

    def mix_rows(self) -> list[dict[str, object]]:
        """The mix (``commd status``): per op kind and size class, the lane, program and codec that ran
        its inter-node ops, and how many ops and bytes each took."""
        order = {name: i for i, name in enumerate(size_class(high) for high in (*SIZE_CLASSES, 1 << 62))}
        return [{"kind": kind, "size": size, "lane": lane, "algorithm": algo, "codec": codec, "ops": ops,
                 "bytes": nbytes}
                for (kind, size, lane, algo, codec), (ops, nbytes) in sorted(
                    self.mix.items(), key=lambda item: (item[0][0], order.get(item[0][1], 99), item[0][2:]))]

    def per_kind(self) -> dict[str, dict[str, dict[str, int]]]:
        """Ops and bytes completed per op kind and lane (``commd status``), all groups together."""
        out: dict[str, dict[str, dict[str, int]]] = {}
        for (kind, lane, _group), totals in self.by_op.items():
            row = out.setdefault(kind, {}).setdefault(lane, {"ops": 0, "bytes": 0})
            row["ops"] += totals.ops
            row["bytes"] += totals.bytes
        return out

    def per_lane(self) -> dict[str, dict[str, int]]:
        """Ops and bytes completed per lane, all kinds and groups together."""
        out: dict[str, dict[str, int]] = {}
        for (_kind, lane, _group), totals in self.by_op.items():
            row = out.setdefault(lane, {"ops": 0, "bytes": 0})
            row["ops"] += totals.ops
            row["bytes"] += totals.bytes
        return out

    def error(self, message: str) -> None:
        self.errors.append({"time": time.time(), "message": message})

    def departed(self, message: str) -> None:
        """A rank left normally (bye): shown apart from the errors."""
        self.departures.append({"time": time.time(), "message": message})

    def rank_gone(self, rank: int, why: str) -> None:
        """A rank of the job (this node's or another's) died or left: ``commd.ft`` reads these to agree
        on the survivors.  Each new loss starts a membership epoch."""
        if rank not in self.gone_ranks:
            self.membership_epoch += 1
            self.gone_ranks[rank] = {"time": time.time(), "why": why, "epoch": self.membership_epoch}

    def rank_back(self, rank: int) -> None:
        """A process connected as ``rank`` again (a later job on the same daemon, or a replacement)."""
        self.gone_ranks.pop(rank, None)

    def ft_event(self, rank: int, report: dict[str, Any]) -> tuple[dict[str, Any], bool]:
        """``rank`` reported what ``commd.ft`` did (``schema.check_membership_report``'s fields).  Every survivor
        reports the same recovery: one entry per (event, group, epoch) holds them all (the reporting ranks,
        the slowest one's seconds, the gone ranks united), so the counts count recoveries, not reports.  A rank
        reporting a key it already reported starts a new entry (a later job on this daemon).  Returns the
        entry and whether it is new."""
        key = (report["event"], report.get("group"), report["epoch"])
        for entry in reversed(self.ft_events):
            if (entry["event"], entry.get("group"), entry["epoch"]) != key:
                continue
            if rank not in entry["ranks"]:
                entry["ranks"] = sorted([*entry["ranks"], rank])
                entry["seconds"] = max(entry["seconds"], report["seconds"])
                entry["gone"] = sorted(set(entry["gone"]) | set(report["gone"]))
                if "why" in report:
                    entry.setdefault("why", report["why"])
                return entry, False
            break
        entry = {**report, "ranks": [rank], "time": time.time()}
        self.ft_events.append(entry)
        self.ft_counts[report["event"]] = self.ft_counts.get(report["event"], 0) + 1
        if report["event"] != "gave_up":
            self.last_recovery = entry
        return entry, True

    def ft_status(self) -> dict[str, Any]:
        """The reported recoveries for ``commd status`` (copied: the metrics read them off the loop)."""
        return {"recoveries": [dict(e, ranks=list(e["ranks"]), gone=list(e["gone"]), members=list(e["members"]))
                               for e in self.ft_events],
                "recovery_counts": dict(self.ft_counts),
                "last_recovery_s": None if self.last_recovery is None else self.last_recovery["seconds"]}

    def error_reply(self, code: str) -> None:
        """An ERROR reply with ``code`` went to a rank (one per rank and failed op)."""
        self.error_replies[code] = self.error_replies.get(code, 0) + 1

    def limit_hit(self, limit: str) -> None:
        """A request was refused because the limit named ``limit`` was reached."""
        self.limits_hit[limit] = self.limits_hit.get(limit, 0) + 1

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


@dataclass
class FabricStats:
    """A fabric member's counters: reports, releases, fusion, and the CPU time scheduling costs."""

    reported: int = 0  # ops reported to the coordinator
    reported_cached: int = 0  # of them, reported by cache id (the fast path)
    completed_early: int = 0  # tiny all-reduces completed on node 0's early contribution
    early_too_late: int = 0  # node 0's early contribution came too long before this node's op: the coordinator decided
    released: int = 0
    fused_sets: int = 0  # fused sets run, and the ops in them
    fused_ops: int = 0
    sched_ns: int = 0  # CPU time in negotiate + release on this node
    coord_ns: int = 0  # CPU time the coordinator spent on reports (node 0)
    coord_items: int = 0
    coord_released: int = 0  # ops and transfers the coordinator released (node 0)
    coord_fast_path: int = 0  # of the reports it took, those by cache id (node 0)
    # The schedule path (fabric/scheduled.py): ops this node released itself, ops it handed back
    # to negotiation when a schedule ended, schedules started and ended here.
    scheduled: int = 0
    schedule_fallback: int = 0
    schedules_started: int = 0
    schedules_ended: int = 0
    coord_schedules: int = 0  # schedules the coordinator published (node 0)
    coord_stale_reports: int = 0  # reports of ops a schedule covers, dropped (node 0)
    # Control items on the links to and from the coordinator (a member's; node 0: every member's).
    control_sent: int = 0
    control_received: int = 0
    #: Report-to-release times of the most recent ops (microseconds).
    negotiation_us: collections.deque = field(default_factory=lambda: collections.deque(maxlen=4096))

    def negotiation_median_us(self) -> float | None:
        timings = list(self.negotiation_us)
        return round(statistics.median(timings), 1) if timings else None

    def scheduling_us_per_op(self) -> float | None:
        return round(self.sched_ns / 1000 / self.released, 1) if self.released else None

    def coordinator_us_per_report(self) -> float | None:
        return round(self.coord_ns / 1000 / self.coord_items, 1) if self.coord_items else None
