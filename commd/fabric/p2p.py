"""Send/recv between ranks on different nodes.

A send to a rank on another node is forwarded (through the coordinator) to the
receiver's daemon, matched there FIFO like a local send, then ordered by the
coordinator like a collective of two nodes: both sides get a ``p2p_go`` and run
their half on the lane it names.  A send forwarded before any local rank
registered its group waits in ``early_sends`` until one does, or its timeout.
"""

from __future__ import annotations

import collections
import time
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING

from commd.core.ops import ReadyOp, Submission
from commd.execution.hierarchy import GroupPlacement, run_p2p
from commd.protocol import fabric as wire
from commd.protocol import schema as s

if TYPE_CHECKING:
    from commd.fabric.rendezvous import Fabric
    from commd.fabric.runner import LaneRunner
    from commd.fabric.services import NodeServices


class PointToPoint:
    """This node's sends waiting at a receiver, and forwarded sends matched here."""

    def __init__(self, node: NodeServices, fabric: Fabric, runner: LaneRunner,
                 send_up: Callable[[wire.ToCoordinator], None],
                 unreachable: Callable[[Sequence[int]], str | None]) -> None:
        self.node = node
        self.fabric = fabric
        self.me = fabric.node_rank
        self.runner = runner
        self.send_up = send_up
        self.unreachable = unreachable
        self.remote_sends: dict[int, tuple[Submission, GroupPlacement]] = {}  # our sends waiting at a receiver
        self.remote_matched: dict[tuple[int, int], ReadyOp] = {}  # (src node, key) -> matched send/recv
        # Sends forwarded here before any local rank registered their group: (arrived at, send).
        self.early_sends: dict[str, list[tuple[float, wire.RemoteSend]]] = collections.defaultdict(list)
        self._send_keys = 0

    # ---- the sender's side --------------------------------------------------------
    def forward_send(self, sub: Submission, placement: GroupPlacement) -> None:
        dst_node = placement.node_of[sub.peer]
        problem = self.unreachable((self.me, dst_node))
        if problem is not None:
            self.node.fail_op([sub], s.E_PEER_DIED, f"send to group rank {sub.peer} cannot run: {problem}")
            return
        self._send_keys += 1
        key = self._send_keys
        self.remote_sends[key] = (sub, placement)
        self.send_up(wire.P2pSend(
            key=key, dst_node=dst_node, group=sub.group, src=sub.group_rank, dst=sub.peer, tag=sub.tag,
            dtype=sub.dtype, count=sub.count, nbytes=sub.nbytes, timeout=sub.timeout, lane_hint=sub.lane or None,
        ))

    # ---- the receiver's side ------------------------------------------------------
    def remote_send(self, forwarded: wire.RemoteSend) -> None:
        """A send forwarded to this node: match it against the local recvs."""
        send = forwarded.send
        group_size = self.node.group_size(send.group)
        if group_size is None:  # no local rank registered the group yet
            self.early_sends[send.group].append((time.monotonic(), forwarded))
            return
        sub = Submission(
            client_id=-1, op_id=send.key, group=send.group, group_rank=send.src, group_size=group_size,
            seq=0, kind="send", dtype=send.dtype, count=send.count, peer=send.dst, tag=send.tag,
            timeout=send.timeout, nbytes=send.nbytes, origin=forwarded.sender_node, lane=send.lane_hint or "",
        )
        ready = self.node.match(sub)  # a mismatch is failed by the node (OpRouter.match)
        if ready is not None:
            self.matched(ready)

    def group_registered(self, name: str) -> None:
        for _arrived, forwarded in self.early_sends.pop(name, []):
            self.remote_send(forwarded)

    def matched(self, op: ReadyOp) -> None:
        """A forwarded send met its local recv: ask the coordinator to order the transfer."""
        send = op.subs[0]
        self.remote_matched[(send.origin, send.op_id)] = op
        self.send_up(wire.P2pMatch(send.origin, send.op_id))

    def fail_remote(self, sub: Submission, code: str, message: str) -> None:
        """An error for a forwarded send: goes back to the sender's node."""
        self.send_up(wire.SendFailed(sub.origin, sub.op_id, code, message))

    def expire_early(self, now: float) -> None:
        """Fail (back to the sender) early sends whose group no local rank registered in time."""
        for name, early in list(self.early_sends.items()):
            keep = []
            for arrived, forwarded in early:
                if now - arrived >= forwarded.send.timeout:
                    self.send_up(wire.SendFailed(
                        forwarded.sender_node, forwarded.send.key, s.E_TIMEOUT,
                        f"send to group rank {forwarded.send.dst} on group '{name}' timed out: no rank "
                        f"on node {self.me} registered the group"))
                else:
                    keep.append((arrived, forwarded))
            if keep:
                self.early_sends[name] = keep
            else:
                del self.early_sends[name]

    # ---- both sides: the coordinator's word ----------------------------------------
    def released(self, go: wire.P2pGo) -> None:
        lane_name, peer = go.lane, go.peer
        resolve = self.runner.resolver()
        if go.role == "send":
            entry = self.remote_sends.pop(go.key, None)
            if entry is None:
                return
            sub, _placement = entry
            op = ReadyOp("sendrecv", sub.group, 0, [sub], sub.submitted_at)
            timeout = sub.timeout

            def work(cap: float) -> None:
                run_p2p("send", sub, peer, self.fabric.lanes[lane_name], resolve, min(timeout, cap))
        else:
            matched = self.remote_matched.pop((go.sender_node, go.key), None)
            if matched is None:
                return
            op = matched
            recv = op.subs[1]
            timeout = recv.timeout

            def work(cap: float) -> None:
                run_p2p("recv", recv, peer, self.fabric.lanes[lane_name], resolve, min(timeout, cap))

        work = self.node.tracer.wrap((op,), work)
        done = self.runner.done
        run_now = self.runner.enqueue(lane_name, op.on_gpu, op.group, work,
                                      lambda error, code: done(op, error, code, (peer,)), op.nbytes)
        if run_now is not None:
            run_now()

    def failed(self, failed: wire.P2pFail) -> None:
        if failed.sender_node is not None and (failed.sender_node, failed.key) in self.remote_matched:
            self.node.fail_op(self.remote_matched.pop((failed.sender_node, failed.key)).subs, failed.code,
                              failed.message)
            return
        entry = self.remote_sends.pop(failed.key, None)
        if entry is not None:
            self.node.fail_op([entry[0]], failed.code, failed.message)

    # ---- failure ----------------------------------------------------------------
    def fail_node(self, node: int, message: str) -> None:
        """A node died: fail our sends waiting at a receiver on it."""
        for key, (sub, placement) in list(self.remote_sends.items()):
            if placement.node_of[sub.peer] == node:
                del self.remote_sends[key]
                self.node.fail_op([sub], s.E_PEER_DIED, f"send to group rank {sub.peer}: {message}")

    def fail_all(self, broken: str) -> None:
        """The coordinator is lost: fail every send waiting at a receiver."""
        for sub, _placement in self.remote_sends.values():
            self.node.fail_op([sub], s.E_PEER_DIED, f"send cannot run: {broken}")
        self.remote_sends.clear()
