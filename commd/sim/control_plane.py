"""N daemons' control plane in one process: the coordinator, a control tree, frames through msgpack.

The same code the daemons run decides (``scheduler/coordinator.py``) and routes
(``scheduler/tree.py``); here a queue of frames stands for the control links, so the
control plane of thousands of nodes can be driven, counted and checked without a socket.
Each frame is encoded and decoded with msgpack as ``fabric/channel.py`` would, and the CPU
time each node spends on its frames is measured on its own.

Used by ``benchmarks/control_plane.py`` (CPU and messages per op at N = 16 ... 8,192) and by
the tests, which compare what every node receives through a tree with what a star delivers.
"""

from __future__ import annotations

import collections
import time
from dataclasses import dataclass, field
from typing import Any

import msgpack

from commd.protocol import fabric as wire
from commd.scheduler.config import SchedulerConfig
from commd.scheduler.coordinator import Coordinator, Outbox
from commd.scheduler.tree import ControlTree, TreeRouter, contains


class AnyLane:
    """A lane that can run every op (lane selection is not what a control-plane model exercises)."""

    def can_run(self, *args: Any) -> None:
        return None


@dataclass
class NodeCounts:
    """What one node's control plane did."""

    frames_in: int = 0
    frames_out: int = 0
    items_in: int = 0
    cpu_ns: int = 0


@dataclass
class ControlPlaneModel:
    """The coordinator at node 0 and a ``TreeRouter`` per node, exchanging real frames in memory.

    ``fanout >= nnodes - 1`` is the star.  ``report`` queues a node's own items for its parent (or
    node 0's coordinator), ``run`` delivers frames until none is left, and ``received[n]`` holds
    every message node ``n`` was sent, decoded, in arrival order.
    """

    nnodes: int
    fanout: int
    config: SchedulerConfig = field(default_factory=SchedulerConfig)
    now: float = field(default_factory=time.monotonic)  # the relays' and the coordinator's clock
    #: False: count what each node receives (``releases``) instead of keeping it (a benchmark of
    #: thousands of nodes would otherwise measure its own heap growing).
    keep_received: bool = True

    def __post_init__(self) -> None:
        self.tree = ControlTree(self.nnodes, self.fanout)
        self.coordinator = Coordinator(self.nnodes, self.config, {"tcp": AnyLane()})
        self.routers = [TreeRouter(self.tree, node) for node in range(self.nnodes)]
        self.counts = [NodeCounts() for _ in range(self.nnodes)]
        self.received: list[list[Any]] = [[] for _ in range(self.nnodes)]
        self.releases = [0] * self.nnodes  # releases (go) each node received
        self.frames: collections.deque[tuple[int, int, bytes]] = collections.deque()  # (to, from, frame)
        self._packer = msgpack.Packer(use_bin_type=True)

    # ---- driving it -------------------------------------------------------------------
    def report(self, node: int, items: list[Any]) -> None:
        """Node ``node``'s own items for the coordinator (its reports of one loop turn)."""
        started = time.thread_time_ns()
        if node == 0:
            self._coordinate(self.routers[0].own_at_root(items) if not self.tree.is_star else [(0, m) for m in items])
        else:
            self._send_up(node, self.routers[node].up([(node, item) for item in items], self.now))
        self.counts[node].cpu_ns += time.thread_time_ns() - started

    def report_unencoded(self, node: int, ready: wire.Ready) -> None:
        """A full report handed to the coordinator as it is, and to the relays on its way as they
        would see it: N-long lists through msgpack N times per op would cost N^2, which a
        model of thousands of nodes cannot afford for its warm-up (the releases still travel)."""
        if ready.pattern is not None:
            for relay in [node, *self.tree.relay_of(node)]:
                merger = self.routers[relay].merger
                if merger is not None:
                    merger.remember(ready.group, ready.seq, ready.pattern.nodes)
        out = Outbox()
        self.coordinator.report(node, [ready], out)
        self._dispatch(out)

    def expire(self) -> None:
        """The relays' hold timers and the coordinator's op timeouts, at ``self.now``."""
        for node in range(1, self.nnodes):
            started = time.thread_time_ns()
            self._send_up(node, self.routers[node].expire(self.now))
            self.counts[node].cpu_ns += time.thread_time_ns() - started
        out = Outbox()
        self.coordinator.expire(self.now, out)
        self._dispatch(out)

    def run(self) -> None:
        """Deliver frames, in the order they were sent, until there are none."""
        while self.frames:
            to, sender, frame = self.frames.popleft()
            counts = self.counts[to]
            started = time.thread_time_ns()
            counts.frames_in += 1
            envelope = msgpack.unpackb(frame, raw=False)
            if self.tree.parent[sender] == to:  # going up
                messages, problems = wire.decode_batch(envelope, wire.TO_COORDINATOR)
                entries = self.routers[to].from_child(sender, messages)
                counts.items_in += len(entries)
                if to == 0:
                    self._coordinate(entries)
                else:
                    self._send_up(to, self.routers[to].up(entries, self.now))
            else:
                messages, problems = wire.decode_batch(envelope, wire.TO_MEMBER)
                router = self.routers[to]
                mine, per_child = router.route_entries(router.from_parent(messages))
                self._send_children(to, per_child)
                self._deliver(to, [wire.decode(m, wire.TO_MEMBER) if type(m) is dict else m for m in mine])
                counts.items_in += len(mine)
            if problems:
                raise AssertionError(f"node {to} dropped bad items from node {sender}: {problems}")
            counts.cpu_ns += time.thread_time_ns() - started

    # ---- what each node does ---------------------------------------------------------------
    def _frame(self, sender: int, to: int, items: list[Any]) -> None:
        frame = self._packer.pack({"t": wire.BATCH, "items": [m if type(m) is dict else m.to_wire() for m in items]})
        self.counts[sender].frames_out += 1
        self.frames.append((to, sender, frame))

    def _send_up(self, node: int, items: list[Any]) -> None:
        if items:
            self._frame(node, self.tree.parent[node], items)

    def _send_children(self, node: int, per_child: dict[int, list[Any]]) -> None:
        for child, items in per_child.items():
            self._frame(node, child, items)

    def _coordinate(self, entries: list[Any]) -> None:
        """Node 0: its own items and its children's, as ``FabricMember`` hands them to the coordinator."""
        out = Outbox()
        for entry in entries:
            if type(entry) is wire.ReadySet:
                self.coordinator.report_set(entry, out)
                continue
            origin, item = entry
            if type(item) is wire.Ready:
                self.coordinator.report(origin, [item], out)
            elif type(item) is wire.ScheduleEnded:
                self.coordinator.schedule_end(origin, item, out)
        self._dispatch(out)

    def _dispatch(self, out: Outbox) -> None:
        _, per_child = self.routers[0].route_entries([(ranges, m.to_wire()) for ranges, m in out.entries])
        self._send_children(0, per_child)
        self._deliver(0, [m for ranges, m in out.entries if contains(ranges, 0)])

    def _deliver(self, node: int, messages: list[Any]) -> None:
        self.releases[node] += sum(1 for m in messages if type(m) is wire.Go)
        if self.keep_received or node == 0:
            self.received[node].extend(messages)
