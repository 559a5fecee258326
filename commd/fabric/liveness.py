"""Who in the fabric is alive: heartbeats, peer timeouts, dead nodes, a lost coordinator.

Every member beats to the coordinator (with its locally stalled ops); the coordinator
beats back with the fabric's stall rows and declares a node dead after the peer
timeout of silence, a closed link, or its leaving.  A member that loses the
coordinator is *broken*: its multi-node ops fail from then on.  A daemon whose own
event loop did not run for a while (stopped, suspended, starved) notices it, gives
its peers a fresh timeout, and says so in the verdicts that follow.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING, Any, Protocol

from commd.observe.stalls import StallInspector
from commd.protocol import fabric as wire
from commd.scheduler.coordinator import Coordinator, Outbox

if TYPE_CHECKING:
    from commd.fabric.rendezvous import Fabric
    from commd.fabric.services import NodeServices

log = logging.getLogger("commd.fabric")

HEARTBEAT_S = 0.5
#: A gap between two watchdog ticks of at least this (and of half the peer timeout) means this
#: daemon's own loop did not run (stopped, suspended, starved): peers' silence in it is not theirs.
FROZEN_MIN_S = 1.0


class Casualty(Protocol):
    """A part holding ops that fail when a node dies or the coordinator is lost."""

    def fail_node(self, node: int, message: str) -> None: ...

    def fail_all(self, broken: str) -> None: ...


class Liveness:
    def __init__(self, node: NodeServices, fabric: Fabric, peer_timeout: float, coordinator: Coordinator | None,
                 send_up: Callable[[wire.ToCoordinator], None], dispatch: Callable[[Outbox], None]) -> None:
        self.node = node
        self.fabric = fabric
        self.me = fabric.node_rank
        self.peer_timeout = peer_timeout
        self.coordinator = coordinator
        self.send_up = send_up
        self.dispatch = dispatch
        #: The parts whose ops fail when a node dies or the coordinator is lost, in that order.
        self.casualties: Sequence[Casualty] = ()
        self.dead: dict[int, str] = {}
        self.broken: str | None = None
        now = time.monotonic()
        self.last_heard = {n.rank: now for n in fabric.nodes}
        self._last_beat = 0.0
        self._last_tick = now
        self._frozen: tuple[float, float] | None = None  # (noticed at, seconds) of this daemon's last freeze
        self.fabric_stalls: list[dict[str, Any]] = []
        config = fabric.config
        self.stalls = StallInspector(config.stall_warning_s if config else 0.0,
                                     config.stall_shutdown_s if config else 0.0, log, name_nodes=True)

    # ---- verdicts ---------------------------------------------------------------
    def unreachable(self, nodes: Sequence[int]) -> str | None:
        """Why an op on ``nodes`` cannot run (a dead node, no coordinator), or None."""
        if self.broken is not None:
            return self.broken
        for node in nodes:
            if node in self.dead:
                return f"node {node} ({self.fabric.nodes[node].name}) {self.dead[node]}"
        return None

    def node_dead(self, node: int, why: str) -> None:
        if node in self.dead:
            return
        self.dead[node] = why
        message = f"node {node} ({self.fabric.nodes[node].name}) {why}"
        log.error("fabric: %s", message)
        self._lose_stream(node, message)
        for part in self.casualties:
            part.fail_node(node, message)
        self.node.fail_ops_of_node(node, message)

    def coordinator_lost(self, why: str) -> None:
        if self.broken is not None:
            return
        self.broken = f"the coordinator (node 0, {self.fabric.nodes[0].name}) {why}"
        log.error("fabric: %s; multi-node ops fail from now on", self.broken)
        self._lose_stream(0, self.broken)
        for part in self.casualties:
            part.fail_all(self.broken)

    def _lose_stream(self, node: int, why: str) -> None:
        """A node given up may be silent, and a silent node never closes its stream: the tcp lane marks
        it lost, so a call blocked on it (a negotiated op, a send, a schedule slot) fails now, naming
        ``why``, not at its timeout.  Gloo and MPI cannot be told (``LaneRunner.done``)."""
        lane = self.fabric.lanes.get("tcp")
        if lane is not None:
            lane.peer_lost(node, why)

    def link_closed(self, node: int, why: str) -> None:
        """A control link closed: on the coordinator that node is dead; on a member the coordinator is lost."""
        if self.coordinator is not None:
            out = Outbox()
            self.coordinator.node_dead(node, f"lost its control connection ({why}){self.freeze_note()}", out)
            self.dispatch(out)
        else:
            self.coordinator_lost(f"closed the control connection ({why}){self.freeze_note()}")

    def rank_died(self, rank: int, why: str) -> None:
        self.send_up(wire.RankDied(rank, why))

    # ---- this daemon frozen -----------------------------------------------------
    def _frozen_threshold(self) -> float:
        return max(FROZEN_MIN_S, self.peer_timeout / 2)

    def check_frozen(self, now: float) -> None:
        """Notice that this daemon's own loop did not run for a while (SIGSTOP, a suspended VM, CPU
        starvation): the silence of the other nodes over that gap is this daemon's, not theirs, so
        they get a fresh peer timeout, and verdicts soon after say that this daemon was frozen."""
        gap = now - self._last_tick
        self._last_tick = now
        if gap < self._frozen_threshold():
            return
        self._frozen = (now, gap)
        log.warning("fabric: this daemon (node %d, %s) was not scheduled for %.1fs (its event loop did not run: "
                    "the process was stopped, suspended or starved of CPU)%s", self.me, self.fabric.nodes[self.me].name,
                    gap, "; longer than the peer timeout, so the other nodes have probably given it up"
                    if gap > self.peer_timeout else "")
        for node in self.last_heard:
            self.last_heard[node] = max(self.last_heard[node], now)

    def freeze_note(self) -> str:
        """What to add to a verdict about a silent or vanished peer when this daemon itself was frozen
        just before (its own silence is the likelier cause); '' otherwise."""
        now = time.monotonic()
        gap = now - self._last_tick
        if gap >= self._frozen_threshold():  # frozen right now, the watchdog has not run yet
            seconds = gap
        elif self._frozen is not None and now - self._frozen[0] <= 2 * self.peer_timeout + 1:
            seconds = self._frozen[1]
        else:
            return ""
        longer = f", longer than the peer timeout of {self.peer_timeout:g}s" if seconds > self.peer_timeout else ""
        return (f"; but this daemon (node {self.me}, {self.fabric.nodes[self.me].name}) was itself not scheduled "
                f"for {seconds:.1f}s just before (stopped, suspended or starved of CPU){longer}, so the silence "
                f"was most likely its own")

    # ---- periodic ---------------------------------------------------------------
    def tick(self, now: float) -> None:
        """Peer timeouts (the coordinator's op timeouts too), then a heartbeat every ``HEARTBEAT_S``."""
        if self.coordinator is not None:
            out = Outbox()
            self.coordinator.expire(now, out)
            for node in range(1, self.fabric.nnodes):
                if node not in self.dead and now - self.last_heard[node] > self.peer_timeout:
                    self.coordinator.node_dead(
                        node, f"has not been heard from for {self.peer_timeout:g}s{self.freeze_note()}", out)
            self.dispatch(out)
        elif self.broken is None and now - self.last_heard[0] > self.peer_timeout:
            self.coordinator_lost(f"has not been heard from for {self.peer_timeout:g}s{self.freeze_note()}")
        if now - self._last_beat < HEARTBEAT_S:
            return
        self._last_beat = now
        if self.coordinator is not None:
            self._coordinator_beat(now)
        else:
            stalled = [(r["group"], r["seq"], r["missing_ranks"]) for r in self.node.waiting_summary()
                       if r["seq"] is not None and r["waiting_s"] >= 1.0]
            self.send_up(wire.Heartbeat(stalled))

    def _coordinator_beat(self, now: float) -> None:
        """The fabric's stall rows to every member (warned once each; a stall too long shuts the fabric down)."""
        rows = self.coordinator.stalls(now, self.stalls.warning_s)
        self.fabric_stalls = rows
        why = self.stalls.inspect(rows)
        out = Outbox()
        if why is not None:
            for node in range(self.fabric.nnodes):
                out.add(node, wire.Shutdown(why))
        else:
            for node in range(1, self.fabric.nnodes):
                out.add(node, wire.CoordinatorHeartbeat(rows))
        self.dispatch(out)
