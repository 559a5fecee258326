"""The daemon's bridged exchange rings: small all-reduces of groups that span nodes, without the
op channel.

Through the daemon's op path, a 1 KiB all-reduce of 2 hosts x 2 ranks cost ~1.8 ms on
the 2-core machine: every rank's submission and reply (a socket message and a process
wake-up each), local matching, a report, a release.  A bridged ring keeps the ranks'
side in shared memory (``protocol/fastring.py``), and its bridge line
(``memory/ringbridge.py``) does each node's part.  Here the daemon plays it, on its event
loop, with the parts carried over the fabric's control links (``RingPart``, relayed by the
coordinator); a group whose ranks asked for it has the line played by its first rank on
each node instead (``client/ringbridge.py``), and the daemon only tells that rank what the
fabric learns about dead ranks and nodes.

Nothing here waits: every step is a callback on the loop, run when its input arrived.
An op waits only for the same op on the group's other nodes, and a node's ranks publish
a group's ring ops in order without waiting on anything else, so no cycle can form
(docs/architecture/exchange-rings.md).
"""

from __future__ import annotations

import logging
import socket
from collections.abc import Callable
from typing import Any

from commd.core.placement import GroupPlacement
from commd.memory.arena import Segment
from commd.memory.ringbridge import RingBridge, bridge_state, host_notice, left_message, notice_address
from commd.protocol import fabric as wire

log = logging.getLogger("commd.fabric")


class RingBridges:
    """This node's bridged rings, by group; fed by the op channel (``local_ready``, ``left``) and the
    fabric (``on_part``, failures)."""

    def __init__(self, node: int, send: Callable[[wire.RingPart], None],
                 on_failed: Callable[[str, int, str, str], None] | None = None) -> None:
        self.node = node
        self.send = send
        self.on_failed = on_failed
        self.bridges: dict[str, RingBridge] = {}
        #: groups whose bridge line a rank plays: their placement and where that rank hears notices
        self.hosted: dict[str, tuple[GroupPlacement, bytes, Segment]] = {}
        self._notices: socket.socket | None = None

    def attach(self, group: str, region: Segment, placement: GroupPlacement) -> None:
        if group not in self.bridges:
            self.bridges[group] = RingBridge(group, region, placement, self.node, self.send, self.on_failed)

    def attach_hosted(self, group: str, region: Segment, placement: GroupPlacement, daemon_pid: int) -> None:
        """``group``'s bridge line is played by its first rank here: the daemon only forwards failures."""
        self.hosted.setdefault(group, (placement, notice_address(daemon_pid, group), region))

    def _tell_host(self, group: str, message: str) -> None:
        """A hosted bridge learns a failure the fabric saw (a datagram; nobody listening: dropped)."""
        _, address, _ = self.hosted[group]
        if self._notices is None:
            self._notices = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
            self._notices.setblocking(False)
        try:
            self._notices.sendto(host_notice(fail=message), address)
        except OSError as exc:
            log.debug("group %s: no bridge host to tell (%s)", group, exc)

    def local_ready(self, group: str) -> None:
        bridge = self.bridges.get(group)
        if bridge is not None:
            bridge.local_ready()

    def left(self, group: str, rank: int, code: str, why: str, number: int | None = None) -> None:
        """A local rank left the group's ring (its own op failed, ``number`` when it says which): the
        other nodes' ranks follow.  A timeout's message is the rank's own: the daemon path's words."""
        bridge = self.bridges.get(group)
        if bridge is not None:
            bridge.fail(code, left_message(group, rank, code, why), index=0 if number is None else number + 1)

    def daemon_op(self, group: str) -> None:
        """A local rank sent a collective of ``group`` to the daemon: a peer node's ring op may sit there."""
        bridge = self.bridges.get(group)
        if bridge is not None and bridge.parts:
            bridge.check_diverged()

    def on_part(self, part: wire.RingPart) -> None:
        bridge = self.bridges.get(part.group)
        if bridge is not None:
            bridge.on_part(part)
        elif part.error is None:
            log.warning("ring part for group %r, which has no bridged ring on this node: dropped", part.group)

    # ---- failures the fabric reports ---------------------------------------------------
    def rank_died(self, rank: int, why: str) -> None:
        for bridge in self.bridges.values():
            if rank in bridge.placement.ranks:
                bridge.fail("peer_died", f"rank {rank} {why}", tell=False)
        for group, (placement, _, _) in self.hosted.items():
            if rank in placement.ranks:
                self._tell_host(group, f"rank {rank} {why}")

    def fail_node(self, node: int, message: str) -> None:
        for bridge in self.bridges.values():
            if node in bridge.placement.nodes:
                bridge.fail("peer_died", message, tell=False)
        for group, (placement, _, _) in self.hosted.items():
            if node in placement.nodes:
                self._tell_host(group, message)

    def fail_all(self, broken: str) -> None:
        for bridge in self.bridges.values():
            bridge.fail("peer_died", broken, tell=False)
        for group in self.hosted:
            self._tell_host(group, broken)

    def status(self) -> dict[str, Any]:
        rows: dict[str, Any] = {g: {"ops": b.ops, "failed": b.failed, "host": "daemon"} for g, b in self.bridges.items()}
        for group, (_, _, region) in self.hosted.items():
            ops, failed = bridge_state(region)
            rows[group] = {"ops": ops, "failed": failed, "host": "rank"}
        return rows
