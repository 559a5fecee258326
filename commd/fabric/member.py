"""A daemon's part in the fabric: the control link to the coordinator and the parts it feeds.

The parts, one role each (see docs/architecture/fabric.md):

* ``collectives.Collectives`` — report matched ops to the coordinator, run its releases;
* ``p2p.PointToPoint`` — send/recv between ranks on different nodes;
* ``liveness.Liveness`` — heartbeats, peer timeouts, dead nodes, a lost coordinator;
* ``runner.LaneRunner`` — released work on its lane's worker thread, then its completion.

``FabricMember`` builds them, sends what they queue for the coordinator, decodes what
arrives on the control links and hands each message to its part.  On node 0 it also
hosts the coordinator (``scheduler.coordinator``) and delivers what it decides.

Reports and releases are coalesced per event-loop turn, so a burst of ops
costs one control message each way.
"""

from __future__ import annotations

import logging
import time
from typing import TYPE_CHECKING, Any

from commd.execution.workers import WorkerPool
from commd.fabric.bridge import RingBridges
from commd.fabric.collectives import Collectives
from commd.fabric.liveness import Liveness
from commd.fabric.p2p import PointToPoint
from commd.fabric.rendezvous import Fabric
from commd.fabric.runner import LaneRunner
from commd.memory.ringbridge import group_token
from commd.observe.stats import FabricStats
from commd.protocol import fabric as wire
from commd.scheduler.config import DEFAULT_CONTROL_FANOUT
from commd.scheduler.coordinator import Coordinator, Outbox
from commd.scheduler.tree import ControlTree, TreeRouter, contains

if TYPE_CHECKING:
    from commd.core.ops import Submission
    from commd.execution.hierarchy import GroupPlacement
    from commd.fabric.services import NodeServices

log = logging.getLogger("commd.fabric")


class FabricMember:
    def __init__(self, node: NodeServices, fabric: Fabric, peer_timeout: float) -> None:
        self.node = node
        self.fabric = fabric
        self.me = fabric.node_rank
        self.peer_timeout = peer_timeout
        self.stats = FabricStats()  # every counter of the fabric, this member's and its coordinator's
        self.coordinator = (
            Coordinator(fabric.nnodes, fabric.config, fabric.lanes, [n.name for n in fabric.nodes], self.stats,
                        fabric.catalog)
            if fabric.is_coordinator else None
        )
        self.links = fabric.links
        #: The control tree (scheduler/tree.py); a star (every node a child of node 0) needs no router.
        self.tree = ControlTree(fabric.nnodes, fabric.config.control_fanout if fabric.config else DEFAULT_CONTROL_FANOUT)
        self.router = TreeRouter(self.tree, self.me) if not self.tree.is_star else None
        parent = self.tree.parent[self.me]
        #: Where this node's reports go (node 0's link in a star, or its parent's), and its children's links.
        self.up_link = (fabric.tree_links.get(parent) or fabric.links.get(parent)) if parent is not None else None
        self.child_links = {child: fabric.tree_links.get(child) or fabric.links[child]
                            for child in self.tree.children[self.me]} if self.router is not None else {}
        self._up: list[wire.ToCoordinator] = []
        self._relayed: list[Any] = []  # what this relay passes up for its subtree (merged, or Via)
        self._flush_scheduled = False
        #: One thread per lane (GPU-exclusive lanes share one); program order per group.
        self.workers = WorkerPool()
        self.liveness = Liveness(node, fabric, peer_timeout, self.coordinator, self._up_send, self._dispatch)
        self.runner = LaneRunner(node, self.workers, peer_timeout, self.liveness.unreachable)
        self.collectives = Collectives(node, fabric, self.stats, self.runner, self._up_send,
                                       self.liveness.unreachable)
        self.p2p = PointToPoint(node, fabric, self.runner, self._up_send, self.liveness.unreachable)
        #: Bridged exchange rings (small all-reduces of groups that span nodes, fabric/bridge.py).
        self.bridges = RingBridges(self.me, self._send_ring_part, node.fail_seq)
        self.liveness.casualties = (self.collectives, self.p2p, self.bridges)
        # The daemon's entry points, bound to the parts that serve them (no extra call per op).
        self.negotiate = self.collectives.negotiate
        self.matched = self.p2p.matched
        self.fail_remote = self.p2p.fail_remote
        self.group_registered = self.p2p.group_registered

    def rank_died(self, rank: int, why: str) -> None:
        """A rank of this node is gone: tell the coordinator; the schedule's ops with it fail here."""
        self.liveness.rank_died(rank, why)
        self.collectives.scheduled.rank_died(rank, why)

    def forward_send(self, sub: Submission, placement: GroupPlacement) -> None:
        """A send to another node: a transfer to order, so a running schedule ends first."""
        self.collectives.scheduled.stop()
        self.p2p.forward_send(sub, placement)

    # What the daemon's status and the tests read.
    @property
    def dead(self) -> dict[int, str]:
        return self.liveness.dead

    @property
    def broken(self) -> str | None:
        return self.liveness.broken

    @property
    def fabric_stalls(self) -> list[dict[str, Any]]:
        return self.liveness.fabric_stalls

    @property
    def early_sends(self) -> dict[str, list[tuple[float, wire.RemoteSend]]]:
        return self.p2p.early_sends

    # ---- plumbing -------------------------------------------------------------
    def start(self, loop: Any) -> None:
        self.loop = loop
        self.workers.start(loop)
        for node, conn in self.links.items():
            conn.attach(loop, lambda msg, node=node: self._on_message(node, msg),
                        lambda why, node=node: self._on_link_closed(node, why))
        for node, conn in self.fabric.tree_links.items():
            conn.attach(loop, lambda msg, node=node: self._on_tree_message(node, msg),
                        lambda why, node=node: self._on_tree_link_closed(node, why))

    def close(self, why: str = "shut down") -> None:
        log.info("fabric: %d ops released, %d of them in %d fused sets; %d reports on the cached fast path",
                 self.stats.released, self.stats.fused_ops, self.stats.fused_sets, self.stats.reported_cached)
        # Tell the others at once rather than letting them wait out the peer timeout.
        for node, conn in (*self.links.items(), *self.fabric.tree_links.items()):
            if node not in self.liveness.dead:
                conn.send(wire.batch([wire.Leaving(why)]))
            conn.close()
        self.workers.close(timeout=5)
        for lane in self.fabric.lanes.values():
            try:
                lane.close()
            except Exception:
                log.exception("closing a lane failed")

    def _up_send(self, message: wire.ToCoordinator) -> None:
        """Queue a message for the coordinator; one control frame per loop turn."""
        self._up.append(message)
        if not self._flush_scheduled:
            self._flush_scheduled = True
            cycle_s = self.fabric.config.fusion_cycle_ms / 1000 if self.fabric.config else 0.0
            if cycle_s and type(message) is wire.Ready:  # let more ready ops join this report (fusion cycle)
                self.loop.call_later(cycle_s, self._flush_up)
            else:
                self.loop.call_soon(self._flush_up)

    def _send_ring_part(self, part: wire.RingPart) -> None:
        """A bridged ring's part for the group's other nodes: straight to them from node 0, else
        through the coordinator, which relays it."""
        if self.coordinator is not None:
            self._relay_ring_part(part)
        else:
            self._up_send(part)

    def _relay_ring_part(self, part: wire.RingPart) -> None:
        out = Outbox()
        for node in part.to:
            if 0 <= node < self.fabric.nnodes and node != part.node:
                out.add(node, part)
        self._dispatch(out)

    def _flush_up(self) -> None:
        self._flush_scheduled = False
        items, self._up = self._up, []
        relayed, self._relayed = self._relayed, []
        if self.router is not None and self.coordinator is None:
            relayed += self.router.up([(self.me, m) for m in items], time.monotonic())
            items = relayed
        if not items:
            return
        if self.coordinator is not None and self.router is not None:
            self._coordinate_tree(self.router.own_at_root(items))
        elif self.coordinator is not None:
            self._coordinate(self.me, items)
        elif self.liveness.broken is None and self.up_link is not None:
            self.stats.control_sent += _op_items(items)
            self.up_link.send(wire.batch(items))

    def _relay_up(self, items: list[Any]) -> None:
        """A relay's subtree items for its parent, in the next frame."""
        if items:
            self._relayed.extend(items)
            if not self._flush_scheduled:
                self._flush_scheduled = True
                self.loop.call_soon(self._flush_up)

    def _on_message(self, node: int, msg: dict[str, Any]) -> None:
        """A frame on a star link: node 0's from a member (its parent's, when node 0's child), a
        member's from node 0."""
        if self.router is not None and (node in self.child_links or self.tree.parent[self.me] == node):
            self._on_tree_message(node, msg)
            return
        self.liveness.last_heard[node] = time.monotonic()
        try:
            vocabulary = wire.TO_COORDINATOR if self.coordinator is not None else wire.TO_MEMBER
            messages, problems = wire.decode_batch(msg, vocabulary)
            self.stats.control_received += _op_items(messages)
            for problem in problems:
                log.error("control channel: bad item from node %d dropped: %s", node, problem)
            if self.coordinator is not None:
                self._coordinate(node, messages)
            else:
                self._on_down(messages)
        except Exception:
            log.exception("control channel: bad message from node %d dropped", node)
        self.node.flush()

    def _on_tree_message(self, node: int, msg: dict[str, Any]) -> None:
        """A frame on a control tree link: from a child (its subtree's items, going up) or from the
        parent (items for this subtree, going down)."""
        now = time.monotonic()
        heard = self.liveness.last_heard
        heard[node] = now
        router = self.router
        try:
            if node in self.child_links:
                messages, problems = wire.decode_batch(msg, wire.TO_COORDINATOR)
                entries = router.from_child(node, messages)
                for entry in entries:
                    if type(entry) is tuple:
                        heard[entry[0]] = now
                for m in messages:
                    if type(m) is wire.Via:
                        problems += m.problems
                self.stats.control_received += len(entries)
                if self.coordinator is not None:
                    self._coordinate_tree(entries)
                else:
                    self._relay_up(router.up(entries, now))
            else:
                heard[0] = now  # the parent passes on what node 0 sends: it is alive
                messages, problems = wire.decode_batch(msg, wire.TO_MEMBER)
                mine, per_child = router.route_entries(router.from_parent(messages))
                self._send_children(per_child)
                own = []
                for m in mine:  # (a relay's are wire maps from Routed items, a leaf's decoded already)
                    if type(m) is not dict:
                        own.append(m)
                        continue
                    try:
                        own.append(wire.decode(m, wire.TO_MEMBER))
                    except wire.FabricMessageError as exc:
                        problems.append(str(exc))
                self.stats.control_received += _op_items(own)
                self._on_down(own)
            for problem in problems:
                log.error("control channel: bad item from node %d dropped: %s", node, problem)
        except Exception:
            log.exception("control channel: bad message from node %d dropped", node)
        self.node.flush()

    def _send_children(self, per_child: dict[int, list[Any]]) -> None:
        dead = self.liveness.dead
        for child, items in per_child.items():
            if child not in dead:
                self.child_links[child].send({"t": wire.BATCH,
                                              "items": [m if type(m) is dict else m.to_wire() for m in items]})

    def _on_tree_link_closed(self, node: int, why: str) -> None:
        """A tree link that is not a star link closed: the parent's cuts this node off from node 0;
        a child's death is seen by node 0 on that child's own link, and merges waiting for it go up
        partial when they have waited ``tree.HOLD_S``."""
        if node == self.tree.parent[self.me]:
            name = self.fabric.nodes[node].name
            self.liveness.coordinator_lost(f"can no longer be reached: node {node} ({name}), this node's parent in "
                                           f"the control tree, closed its link ({why}){self.liveness.freeze_note()}")
            self.node.flush()

    def _on_link_closed(self, node: int, why: str) -> None:
        self.liveness.link_closed(node, why)
        lo, hi = self.tree.subtree(node)
        if self.coordinator is not None and hi - lo > 1:  # a relay: its subtree is cut off from node 0
            out = Outbox()
            relay = f"node {node} ({self.fabric.nodes[node].name}), its relay in the control tree"
            for below in range(lo + 1, hi):
                self.coordinator.node_dead(below, f"is cut off from the coordinator: {relay}, lost its control "
                                                  f"connection ({why})", out)
            self._dispatch(out)
        self.node.flush()

    # ---- coordinator side -------------------------------------------------------
    def _coordinate_tree(self, entries: list[Any]) -> None:
        """Node 0: a child's frame of its subtree's items, as (origin, item) runs and merged sets."""
        run: list[Any] = []
        origin = -1
        for entry in entries:
            if type(entry) is tuple and entry[0] == origin:
                run.append(entry[1])
                continue
            if run:
                self._coordinate(origin, run)
            run, origin = [], -1
            if type(entry) is tuple:
                origin, run = entry[0], [entry[1]]
            else:
                out = Outbox()
                started = time.thread_time_ns()
                self.coordinator.report_set(entry, out)
                self.stats.coord_ns += time.thread_time_ns() - started
                self.stats.coord_items += 1
                self._dispatch(out)
        if run:
            self._coordinate(origin, run)

    def _coordinate(self, node: int, messages: list[wire.ToCoordinator]) -> None:
        coord = self.coordinator
        out = Outbox()
        for m in messages:  # (a node sends it before the reports that follow the schedule's end)
            if type(m) is wire.ScheduleEnded:
                coord.schedule_end(node, m, out)
        ready = [m for m in messages if type(m) is wire.Ready]
        if ready:
            started = time.thread_time_ns()
            coord.report(node, ready, out)
            self.stats.coord_ns += time.thread_time_ns() - started
            self.stats.coord_items += len(ready)
        for m in messages:
            if type(m) is wire.P2pSend:
                coord.p2p_send(node, m, out)
            elif type(m) is wire.P2pMatch:
                coord.p2p_match(node, m, out)
            elif type(m) is wire.SendFailed:
                coord.p2p_fail(node, m, out)
            elif type(m) is wire.RankDied:
                coord.rank_died(node, m.rank, m.why, out)
            elif type(m) is wire.Heartbeat:
                coord.partial[node] = {(g, q): missing for g, q, missing in m.stalled}
            elif type(m) is wire.Leaving:
                coord.node_dead(node, f"left the fabric ({m.why})", out)
            elif type(m) is wire.StopSchedule:
                coord.stop_requested(node, m, out)
        self._dispatch(out)
        for m in messages:
            if type(m) is wire.RingPart and m.node == node:
                self._relay_ring_part(m)

    def _dispatch(self, out: Outbox) -> None:
        # Other nodes first: our own part may run inline and wait for theirs.
        dead = self.liveness.dead
        if self.router is not None:
            _, per_child = self.router.route_entries([(ranges, m.to_wire()) for ranges, m in out.entries])
            for items in per_child.values():
                self.stats.control_sent += len(items)
            self._send_children(per_child)
            mine = [m for ranges, m in out.entries if contains(ranges, self.me)]
            if mine:
                self._on_down(mine)
            return
        for node, messages in out.messages.items():
            if node != self.me and node in self.links and node not in dead:
                self.stats.control_sent += _op_items(messages)
                self.links[node].send(wire.batch(messages))
        if self.me in out.messages:
            self._on_down(out.messages[self.me])

    # ---- member side: what the coordinator tells us -------------------------------
    def _on_down(self, messages: list[wire.ToMember]) -> None:
        run_released = self.collectives.run_released
        fused: list[wire.Go] = []  # the open fused set (releases with fused_with join their first op)
        for m in messages:
            if type(m) is wire.Go:
                if fused and m.fused_with == fused[0].order:
                    fused.append(m)
                    continue
                if m.fused_with is not None:
                    log.error("release #%s of group '%s' names fused set %s, which is not open: run alone",
                              m.seq, m.group, m.fused_with)
                run_released(fused)
                fused = [m]
                continue
            run_released(fused)
            fused = []
            if type(m) is wire.Fail:
                self.collectives.failed(m)
            elif type(m) is wire.Early:
                self.collectives.early(m)
            elif type(m) is wire.RemoteSend:
                self.collectives.scheduled.stop()  # a transfer to order: no schedule meanwhile
                self.p2p.remote_send(m)
            elif type(m) is wire.P2pGo:
                if not self.collectives.scheduled.after_schedule(lambda m=m: self.p2p.released(m)):
                    self.p2p.released(m)
            elif type(m) is wire.P2pFail:
                self.p2p.failed(m)
            elif type(m) is wire.NodeDead:
                self.collectives.scheduled.stop()
                if m.node == self.me:  # the coordinator gave this node up (it was stopped, or cut off)
                    self.liveness.coordinator_lost(f"declared this node dead: it {m.why}{self.liveness.freeze_note()}")
                else:
                    self.liveness.node_dead(m.node, m.why)
            elif type(m) is wire.RankDied:
                self.node.fail_ops_waiting_on(m.rank, m.why)
                self.collectives.fail_rank(m.rank, m.why)
                self.collectives.scheduled.rank_died(m.rank, m.why)
            elif type(m) is wire.CoordinatorHeartbeat:
                self.liveness.fabric_stalls = m.stalls
            elif type(m) is wire.Shutdown:
                self.node.shutdown(m.why if m.why is not None else "the coordinator shut the fabric down")
            elif type(m) is wire.Leaving:
                self.liveness.coordinator_lost(f"left the fabric ({m.why})")
            elif type(m) is wire.Trace:
                self.node.apply_trace(m.action, m.path)
            elif type(m) is wire.RingPart:
                self.bridges.on_part(m)
            elif type(m) is wire.Schedule:
                self.collectives.start_schedule(m)
            elif type(m) is wire.StopSchedule:
                sched = self.collectives.scheduled.schedule
                if sched is not None and sched.epoch == m.epoch:
                    self.collectives.scheduled.stop()
        run_released(fused)

    def forward_trace(self, action: str, path: str | None) -> int:
        """The coordinator passes a trace start/stop on to every live node; returns how many."""
        if self.coordinator is None:
            return 0
        out = Outbox()
        for node in range(1, self.fabric.nnodes):
            if node not in self.liveness.dead:
                out.add(node, wire.Trace(action, path))
        self._dispatch(out)
        return len(out.messages)

    # ---- periodic ---------------------------------------------------------------
    def tick(self, now: float) -> None:
        self.liveness.check_frozen(now)
        if self.router is not None and self.coordinator is None:
            self._relay_up(self.router.expire(now))
        self.collectives.scheduled.tick(now)
        self.p2p.expire_early(now)
        self.liveness.tick(now)

    # ---- status -----------------------------------------------------------------
    def _compression(self) -> dict[str, Any]:
        """The tcp lane's compressed ops per codec (the only lane that compresses)."""
        report = getattr(self.fabric.lanes.get("tcp"), "compression_status", None)
        return report() if report is not None else {}

    def bridge_host_grant(self, group: str) -> dict[str, Any]:
        """What the rank that plays ``group``'s bridge line here needs: this node, the address its
        listener binds, and the token the group's first ranks prove to each other."""
        return {"node": self.me, "ip": self.fabric.nodes[self.me].ip,
                "token": group_token(self.fabric.secret, group)}

    def status(self) -> dict[str, Any]:
        now = time.monotonic()
        stats = self.stats
        liveness = self.liveness
        return {
            "node": self.me,
            "nodes": [
                {"rank": n.rank, "name": n.name, "ip": n.ip, "alive": n.rank not in liveness.dead,
                 "heard_s_ago": round(now - liveness.last_heard[n.rank], 1) if n.rank != self.me else 0.0}
                for n in self.fabric.nodes
            ],
            "coordinator": self.coordinator is not None,
            "lanes": sorted(self.fabric.lanes),
            "broken": liveness.broken,
            "negotiating": len(self.collectives.negotiating),
            # Cross-node collectives per path: released on a schedule here, released by the
            # coordinator, handed back from a schedule to negotiation.
            "paths": {"scheduled": stats.scheduled, "negotiated": stats.released, "fallback": stats.schedule_fallback},
            "schedule": self.collectives.scheduled.status(),
            "schedules": {"started": stats.schedules_started, "ended": stats.schedules_ended,
                          "published": stats.coord_schedules, "stale_reports": stats.coord_stale_reports},
            # Control items (heartbeats aside) this node sent to and received from the coordinator
            # (node 0: from and to every member).
            "control_items": {"sent": stats.control_sent, "received": stats.control_received},
            # Where this node's reports go and its releases come from (scheduler/tree.py).
            "control_tree": {
                "fanout": self.tree.fanout, "depth": self.tree.depth(), "parent": self.tree.parent[self.me],
                "children": list(self.tree.children[self.me]),
                "merged_reports": self.router.merger.merged if self.router and self.router.merger else 0,
            },
            "reported": stats.reported,
            "fast_path": stats.reported_cached,
            "completed_early": stats.completed_early,
            "early_too_late": stats.early_too_late,
            "negotiation_us_median": stats.negotiation_median_us(),
            "scheduling_us_per_op": stats.scheduling_us_per_op(),
            "coordinator_us_per_report": stats.coordinator_us_per_report(),
            "lane_ops": self.node.stats.per_lane(),
            "algorithm_ops": dict(self.node.stats.by_algorithm),
            "compression": self._compression(),
            "algorithms": self.fabric.catalog.status() if self.fabric.catalog is not None else None,
            "fusion": {
                "threshold_bytes": self.fabric.config.fusion_threshold_bytes if self.fabric.config else None,
                "cycle_ms": self.fabric.config.fusion_cycle_ms if self.fabric.config else None,
                "sets": stats.fused_sets, "ops": stats.fused_ops,
            },
            "tuning": self.fabric.config.tuning_note if self.fabric.config else None,
            "stalls": liveness.fabric_stalls,
            "bridged_rings": self.bridges.status(),
        }


def _op_items(items: list[Any]) -> int:
    """How many of a frame's items concern ops (heartbeats are periodic, not per op)."""
    return sum(1 for m in items if type(m) is not wire.Heartbeat and type(m) is not wire.CoordinatorHeartbeat)
