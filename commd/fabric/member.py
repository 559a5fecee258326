"""A daemon's part in the fabric: negotiation, release, lanes, cross-node send/recv.

Flow of a collective whose group spans nodes (see ARCHITECTURE.md):

1. the local scheduler matched it among this node's ranks → ``negotiate``
   reports it to the coordinator (full, or only its cache id on the fast path);
2. the coordinator's release (``go``) arrives in global order and the op is
   queued on its lane's worker thread (``execution.workers.WorkerPool``), in that order;
3. the worker waits for the group's previous released op (program order, as
   on a CUDA stream), runs local phase → lane → local phase, and posts the
   completion back to the loop, which answers the local ranks.

A send to a rank on another node is forwarded (through the coordinator) to
the receiver's daemon, matched there FIFO like a local send, then ordered by
the coordinator like a collective of two nodes.

Reports and releases are coalesced per event-loop turn, so a burst of ops
costs one control message each way.
"""

from __future__ import annotations

import collections
import logging
import random
import threading
import time
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

import torch

from commd.core.ops import COUNTED, ReadyOp, Submission
from commd.execution.hierarchy import (
    GroupPlacement,
    apply_result,
    run,
    run_fused_allreduce,
    run_p2p,
    scratch_like,
)
from commd.execution.workers import WorkerPool, worker_key
from commd.fabric.rendezvous import Fabric
from commd.kernels.reduce import reduce_into
from commd.kernels.split import split_reduce
from commd.lanes.base import LaneError
from commd.observe.stalls import StallInspector
from commd.observe.stats import FabricStats
from commd.protocol import fabric as wire
from commd.protocol import schema as s
from commd.runtime import env_float, env_int
from commd.scheduler.agreement import agreed_values
from commd.scheduler.coordinator import Coordinator, Outbox
from commd.scheduler.overlap import PendingRanges

if TYPE_CHECKING:
    from commd.fabric.services import NodeServices

log = logging.getLogger("commd.fabric")

HEARTBEAT_S = 0.5
#: A gap between two watchdog ticks of at least this (and of half the peer timeout) means this
#: daemon's own loop did not run (stopped, suspended, starved): peers' silence in it is not theirs.
FROZEN_MIN_S = 1.0
#: All-reduces up to this size travel with the negotiation (reduced by the coordinator).
EAGER_BYTES = 4096


def _frozen(value: Any) -> Any:
    if isinstance(value, list | tuple):
        return tuple(_frozen(v) for v in value)
    if isinstance(value, dict):
        return tuple(sorted((k, _frozen(v)) for k, v in value.items()))
    return value


class FabricMember:
    def __init__(self, node: NodeServices, fabric: Fabric, peer_timeout: float) -> None:
        self.node = node
        self.fabric = fabric
        self.me = fabric.node_rank
        self.peer_timeout = peer_timeout
        self.stats = FabricStats()  # every counter of the fabric, this member's and its coordinator's
        self.coordinator = (
            Coordinator(fabric.nnodes, fabric.config, fabric.lanes, [n.name for n in fabric.nodes], self.stats)
            if fabric.is_coordinator else None
        )
        self.links = fabric.links
        self.negotiating: dict[tuple[str, int], tuple[ReadyOp, GroupPlacement, tuple]] = {}
        self.neg_cache: dict[tuple, int] = {}
        self.remote_sends: dict[int, tuple[Submission, GroupPlacement]] = {}  # our sends waiting at a receiver
        self.remote_matched: dict[tuple[int, int], ReadyOp] = {}  # (src node, key) -> matched send/recv
        # Sends forwarded here before any local rank registered their group: (arrived at, send).
        self.early_sends: dict[str, list[tuple[float, wire.RemoteSend]]] = collections.defaultdict(list)
        self._send_keys = 0
        self._up: list[wire.ToCoordinator] = []
        self._flush_scheduled = False
        #: One thread per lane (GPU-exclusive lanes share one); program order per group.
        self.workers = WorkerPool()
        self._outstanding: dict[str, int] = {}  # group -> ops reported and not yet released or failed
        # Memory of fusion candidates reported and not yet released, per (client, segment): a fused
        # set must not hold two ops on overlapping memory (the later one reads the earlier's result).
        self._fusible_ranges = PendingRanges()
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
        #: Testing knob: random delays before lane ops (the deadlock stress test sets it).
        self.chaos_delay_s = env_float("COMMD_CHAOS_DELAY_MS", 0.0, 0.0, 10_000.0) / 1000
        self.chaos_seed = env_int("COMMD_CHAOS_SEED", 0)
        self._chaos = threading.local()

    # ---- plumbing -------------------------------------------------------------
    def start(self, loop: Any) -> None:
        self.loop = loop
        self.workers.start(loop)
        for node, conn in self.links.items():
            conn.attach(loop, lambda msg, node=node: self._on_message(node, msg),
                        lambda why, node=node: self._on_link_closed(node, why))

    def close(self, why: str = "shut down") -> None:
        log.info("fabric: %d ops released, %d of them in %d fused sets; %d reports on the cached fast path",
                 self.stats.released, self.stats.fused_ops, self.stats.fused_sets, self.stats.reported_cached)
        # Tell the others at once rather than letting them wait out the peer timeout.
        for node, conn in self.links.items():
            if node not in self.dead:
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

    def _flush_up(self) -> None:
        self._flush_scheduled = False
        items, self._up = self._up, []
        if not items:
            return
        if self.coordinator is not None:
            self._coordinate(self.me, items)
        elif self.broken is None:
            self.links[0].send(wire.batch(items))

    def _on_message(self, node: int, msg: dict[str, Any]) -> None:
        self.last_heard[node] = time.monotonic()
        try:
            vocabulary = wire.TO_COORDINATOR if self.coordinator is not None else wire.TO_MEMBER
            messages, problems = wire.decode_batch(msg, vocabulary)
            for problem in problems:
                log.error("control channel: bad item from node %d dropped: %s", node, problem)
            if self.coordinator is not None:
                self._coordinate(node, messages)
            else:
                self._on_down(messages)
        except Exception:
            log.exception("control channel: bad message from node %d dropped", node)
        self.node.flush()

    def _on_link_closed(self, node: int, why: str) -> None:
        if self.coordinator is not None:
            out = Outbox()
            self.coordinator.node_dead(node, f"lost its control connection ({why}){self._freeze_note()}", out)
            self._dispatch(out)
        else:
            self._coordinator_lost(f"closed the control connection ({why}){self._freeze_note()}")
        self.node.flush()

    # ---- coordinator side -------------------------------------------------------
    def _coordinate(self, node: int, messages: list[wire.ToCoordinator]) -> None:
        coord = self.coordinator
        out = Outbox()
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
        self._dispatch(out)

    def _dispatch(self, out: Outbox) -> None:
        # Other nodes first: our own part may run inline and wait for theirs.
        for node, messages in out.messages.items():
            if node != self.me and node in self.links and node not in self.dead:
                self.links[node].send(wire.batch(messages))
        if self.me in out.messages:
            self._on_down(out.messages[self.me])

    # ---- member side: what the coordinator tells us -------------------------------
    def _on_down(self, messages: list[wire.ToMember]) -> None:
        fused: list[wire.Go] = []  # the open fused set (releases with fused_with join their first op)
        for m in messages:
            if type(m) is wire.Go:
                if fused and m.fused_with == fused[0].order:
                    fused.append(m)
                    continue
                if m.fused_with is not None:
                    log.error("release #%s of group '%s' names fused set %s, which is not open: run alone",
                              m.seq, m.group, m.fused_with)
                self._run_released(fused)
                fused = [m]
                continue
            self._run_released(fused)
            fused = []
            if type(m) is wire.Fail:
                entry = self.negotiating.pop((m.group, m.seq), None)
                if entry is not None:
                    self._outstanding[entry[0].group] -= 1
                    self._fail_op(entry[0], m.code, m.message)
            elif type(m) is wire.RemoteSend:
                self._remote_send(m)
            elif type(m) is wire.P2pGo:
                self._p2p_released(m)
            elif type(m) is wire.P2pFail:
                self._p2p_failed(m)
            elif type(m) is wire.NodeDead:
                self._node_dead(m.node, m.why)
            elif type(m) is wire.RankDied:
                self.node.fail_ops_waiting_on(m.rank, m.why)
            elif type(m) is wire.CoordinatorHeartbeat:
                self.fabric_stalls = m.stalls
            elif type(m) is wire.Shutdown:
                self.node.shutdown(m.why if m.why is not None else "the coordinator shut the fabric down")
            elif type(m) is wire.Leaving:
                self._coordinator_lost(f"left the fabric ({m.why})")
            elif type(m) is wire.Trace:
                self.node.apply_trace(m.action, m.path)
        self._run_released(fused)

    def _run_released(self, items: list[wire.Go]) -> None:
        if len(items) == 1:
            self._released(items[0])
        elif items:
            started = time.thread_time_ns()
            run_now = self._release_fused(items)
            self.stats.sched_ns += time.thread_time_ns() - started
            if run_now is not None:
                run_now()

    # ---- collectives -----------------------------------------------------------
    def negotiate(self, op: ReadyOp, placement: GroupPlacement) -> None:
        started = time.thread_time_ns()
        self._negotiate(op, placement)
        self.stats.sched_ns += time.thread_time_ns() - started

    def _negotiate(self, op: ReadyOp, placement: GroupPlacement) -> None:
        problem = self._unreachable(placement.nodes)
        if problem is not None:
            self._fail_op(op, s.E_PEER_DIED, f"{op.describe()} cannot run: {problem}")
            return
        first = op.subs[0]
        timeout = max(x.timeout for x in op.subs)
        # The pattern: everything the report says except the sequence number.  The group's
        # placement is fixed per group name, so the name stands for members and placement.
        key: tuple = (op.group, first.signature, tuple(x.group_rank for x in op.subs), op.nbytes, timeout)
        if op.kind == "alltoall" or op.kind in COUNTED:
            key = _frozen([key, [[x.splits_in, x.splits_out] for x in op.subs]])
        self.negotiating[(op.group, op.seq)] = (op, placement, key)
        self.stats.reported += 1
        contribution = self._eager_contribution(op)
        self._outstanding[op.group] = self._outstanding.get(op.group, 0) + 1
        cid = self.neg_cache.get(key)
        if cid is not None:
            self.stats.reported_cached += 1
            # (positional on this per-op path: pattern, cache id, contribution, no fusion)
            self._up_send(wire.Ready(op.group, op.seq, None, cid, contribution, not self._may_fuse(op)))
            return
        pattern = wire.OpPattern(
            kind=op.kind, signature=agreed_values(first), ranks=list(placement.ranks),
            placement=list(placement.node_of), nodes=list(placement.nodes), mine=[x.group_rank for x in op.subs],
            nbytes=op.nbytes, timeout=timeout,
            alltoall_splits=([[x.group_rank, x.splits_in, x.splits_out] for x in op.subs]
                             if op.kind == "alltoall" else None),
        )
        self._up_send(wire.Ready(op.group, op.seq, pattern=pattern, contribution=contribution,
                                 no_fusion=not self._may_fuse(op)))

    def _may_fuse(self, op: ReadyOp) -> bool:
        """False if the coordinator must not fuse ``op`` with the ops before it (its memory overlaps
        an earlier reported all-reduce of this node, or it lives on a GPU)."""
        config = self.fabric.config
        if op.kind != "allreduce" or config is None or op.nbytes > config.fusion_threshold_bytes:
            return True  # never a fusion candidate anyway
        if op.on_gpu:
            return False
        ok = True
        tag = (op.group, op.seq)
        for sub in op.subs:
            ref = sub.buffers.get("buf")
            if ref is None or ref.inline is not None or ref.cuda is not None or ref.nbytes == 0:
                continue  # inline buffers are private copies
            if self._fusible_ranges.add((sub.client_id, ref.segment), ref.offset, ref.offset + ref.nbytes, tag,
                                        self.negotiating.__contains__):
                ok = False
        return ok

    def _eager_contribution(self, op: ReadyOp) -> bytes | None:
        """For a tiny all-reduce: this node's reduced contribution, sent with the report.

        Only when nothing earlier of the group is outstanding (reported, released or
        running), so the buffers read now are what program order says they hold.
        """
        if op.kind != "allreduce" or op.nbytes > EAGER_BYTES or op.on_gpu or self._outstanding.get(op.group):
            return None
        if not self.workers.group_done(op.group):
            return None
        first = op.subs[0]
        try:
            bufs = [self.node.resolve(x, "buf") for x in op.subs]
        except KeyError:  # a rank left meanwhile: take the lane path, which copes with that
            return None
        local_op = split_reduce(first.reduce_op).local_op
        contribution = torch.empty_like(bufs[0])
        reduce_into(contribution, bufs, local_op, first.scale)
        return contribution.view(torch.uint8).numpy().tobytes()

    def _released(self, go: wire.Go) -> None:
        started = time.thread_time_ns()
        run_now = self._release(go)
        self.stats.sched_ns += time.thread_time_ns() - started  # the op's own execution is not scheduling
        if run_now is not None:
            run_now()

    def _take_released(self, go: wire.Go) -> tuple[ReadyOp, GroupPlacement] | None:
        """The op a release names, no longer negotiating (None: not one of ours)."""
        entry = self.negotiating.pop((go.group, go.seq), None)
        if entry is None:
            log.warning("release of unknown op #%s on group '%s' ignored", go.seq, go.group)
            return None
        op, placement, key = entry
        self._outstanding[op.group] -= 1
        if go.cache_id is not None:
            self.neg_cache[key] = go.cache_id
        self.stats.negotiation_us.append((time.monotonic() - op.ready_at) * 1e6)
        self.stats.released += 1
        op.lane = go.lane
        if self.node.tracer.on:
            self.node.tracer.mark(op, "released")
        return op, placement

    def _release(self, go: wire.Go) -> Callable[[], None] | None:
        taken = self._take_released(go)
        if taken is None:
            return None
        op, placement = taken
        lane_name = go.lane
        timeout = max(x.timeout for x in op.subs)
        resolve = self._resolver()

        result = go.result
        if result is not None:  # a tiny all-reduce the coordinator already reduced

            def work(cap: float) -> None:
                apply_result(op, placement, result, resolve)
        else:

            def work(cap: float) -> None:
                run(op, placement, self.fabric.lanes[lane_name], resolve, min(timeout, cap))

        work = self.node.tracer.wrap((op,), work)
        return self._enqueue(lane_name, op.on_gpu, op.group, work,
                             lambda error, code: self._done(op, error, code), op.nbytes)

    def _release_fused(self, gos: list[wire.Go]) -> Callable[[], None] | None:
        """A fused set of small all-reduces: one buffer, one lane call, at its first op's place."""
        taken = [x for x in map(self._take_released, gos) if x is not None]
        if not taken:
            return None
        ops = [op for op, _ in taken]
        placement = taken[0][1]
        lane_name = gos[0].lane
        timeout = max(x.timeout for op in ops for x in op.subs)
        resolve = self._resolver()
        self.stats.fused_sets += 1
        self.stats.fused_ops += len(ops)

        resolve_array = self._resolver(as_array=True)

        def work(cap: float) -> None:
            run_fused_allreduce(ops, placement, self.fabric.lanes[lane_name], resolve, min(timeout, cap),
                                resolve_array)

        work = self.node.tracer.wrap(ops, work)

        def done(error: str | None, code: str) -> None:
            for op in ops:
                self._done(op, error, code)

        return self._enqueue(lane_name, any(op.on_gpu for op in ops), placement.name, work, done,
                             sum(op.nbytes for op in ops))

    def _enqueue(self, lane_name: str, on_gpu: bool, group: str, work: Callable[[float], None],
                 done: Callable[[str | None, str], None], nbytes: int) -> Callable[[], None] | None:
        """Queue the op on its lane's worker, or return it to be run right now on the loop."""

        def job(inline: bool) -> tuple[str | None, str]:
            # On the loop, a peer that stopped answering may hold it for at most the peer
            # timeout (after which that peer counts as dead anyway), not the op timeout.
            return self._run_work(work, self.peer_timeout if inline else float("inf"))

        return self.workers.submit(worker_key(lane_name, on_gpu), group, nbytes, job,
                                   lambda result: done(*result), may_inline=not on_gpu)

    def _run_work(self, work: Callable[[float], None], cap: float) -> tuple[str | None, str]:
        if self.chaos_delay_s:
            chaos = getattr(self._chaos, "rng", None)
            if chaos is None:
                chaos = self._chaos.rng = random.Random(self.chaos_seed + threading.get_ident())
            if chaos.random() < 0.3:
                time.sleep(chaos.random() * self.chaos_delay_s)
        try:
            if self.node.closing:
                return "daemon shutting down before the op could run", s.E_SHUTDOWN
            work(cap)
            return None, s.E_INTERNAL
        except LaneError as exc:
            return str(exc), exc.code
        except Exception as exc:
            log.exception("inter-node op failed")
            return f"inter-node phase failed: {exc}", s.E_INTERNAL

    def _resolver(self, as_array: bool = False) -> Callable[[Submission, str], Any]:
        """Buffers of released ops (torch tensors, or NumPy arrays), with a stand-in for a rank that died."""
        find = self.node.resolve_array if as_array else self.node.resolve

        def resolve(sub: Submission, name: str) -> Any:
            try:
                return find(sub, name)
            except KeyError:  # the rank died after release: keep the lanes in step
                scratch = scratch_like(sub, name)
                return scratch.numpy() if as_array else scratch

        return resolve

    def _done(self, op: ReadyOp, error: str | None, code: str) -> None:
        if error is not None:
            error = f"{op.describe()} failed between nodes: {error}"
        self.node.complete(op, error, code)
        self.node.flush()

    def _fail_op(self, op: ReadyOp, code: str, message: str) -> None:
        self.node.fail_op(op.subs, code, message)

    # ---- point to point ---------------------------------------------------------
    def forward_send(self, sub: Submission, placement: GroupPlacement) -> None:
        dst_node = placement.node_of[sub.peer]
        problem = self._unreachable((self.me, dst_node))
        if problem is not None:
            self.node.fail_op([sub], s.E_PEER_DIED, f"send to group rank {sub.peer} cannot run: {problem}")
            return
        self._send_keys += 1
        key = self._send_keys
        self.remote_sends[key] = (sub, placement)
        self._up_send(wire.P2pSend(
            key=key, dst_node=dst_node, group=sub.group, src=sub.group_rank, dst=sub.peer, tag=sub.tag,
            dtype=sub.dtype, count=sub.count, nbytes=sub.nbytes, timeout=sub.timeout, lane_hint=sub.lane or None,
        ))

    def _remote_send(self, forwarded: wire.RemoteSend) -> None:
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
            self._remote_send(forwarded)

    def matched(self, op: ReadyOp) -> None:
        """A forwarded send met its local recv: ask the coordinator to order the transfer."""
        send = op.subs[0]
        self.remote_matched[(send.origin, send.op_id)] = op
        self._up_send(wire.P2pMatch(send.origin, send.op_id))

    def fail_remote(self, sub: Submission, code: str, message: str) -> None:
        """An error for a forwarded send: goes back to the sender's node."""
        self._up_send(wire.SendFailed(sub.origin, sub.op_id, code, message))

    def _p2p_released(self, go: wire.P2pGo) -> None:
        lane_name, peer = go.lane, go.peer
        resolve = self._resolver()
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
        run_now = self._enqueue(lane_name, op.on_gpu, op.group, work,
                                lambda error, code: self._done(op, error, code), op.nbytes)
        if run_now is not None:
            run_now()

    def _p2p_failed(self, failed: wire.P2pFail) -> None:
        if failed.sender_node is not None and (failed.sender_node, failed.key) in self.remote_matched:
            self._fail_op(self.remote_matched.pop((failed.sender_node, failed.key)), failed.code, failed.message)
            return
        entry = self.remote_sends.pop(failed.key, None)
        if entry is not None:
            self.node.fail_op([entry[0]], failed.code, failed.message)

    # ---- failures ---------------------------------------------------------------
    def _unreachable(self, nodes: tuple[int, ...]) -> str | None:
        if self.broken is not None:
            return self.broken
        for node in nodes:
            if node in self.dead:
                return f"node {node} ({self.fabric.nodes[node].name}) {self.dead[node]}"
        return None

    def _node_dead(self, node: int, why: str) -> None:
        if node in self.dead:
            return
        self.dead[node] = why
        message = f"node {node} ({self.fabric.nodes[node].name}) {why}"
        log.error("fabric: %s", message)
        for key, (op, placement, _) in list(self.negotiating.items()):
            if node in placement.nodes:
                del self.negotiating[key]
                self._outstanding[op.group] -= 1
                self._fail_op(op, s.E_PEER_DIED, f"{op.describe()} cannot run: {message}")
        for key, (sub, placement) in list(self.remote_sends.items()):
            if placement.node_of[sub.peer] == node:
                del self.remote_sends[key]
                self.node.fail_op([sub], s.E_PEER_DIED, f"send to group rank {sub.peer}: {message}")

    def _coordinator_lost(self, why: str) -> None:
        if self.broken is not None:
            return
        self.broken = f"the coordinator (node 0, {self.fabric.nodes[0].name}) {why}"
        log.error("fabric: %s; multi-node ops fail from now on", self.broken)
        for _key, (op, _placement, _) in list(self.negotiating.items()):
            self._fail_op(op, s.E_PEER_DIED, f"{op.describe()} cannot run: {self.broken}")
        self.negotiating.clear()
        self._outstanding.clear()
        for sub, _placement in self.remote_sends.values():
            self.node.fail_op([sub], s.E_PEER_DIED, f"send cannot run: {self.broken}")
        self.remote_sends.clear()

    def forward_trace(self, action: str, path: str | None) -> int:
        """The coordinator passes a trace start/stop on to every live node; returns how many."""
        if self.coordinator is None:
            return 0
        out = Outbox()
        for node in range(1, self.fabric.nnodes):
            if node not in self.dead:
                out.add(node, wire.Trace(action, path))
        self._dispatch(out)
        return len(out.messages)

    def rank_died(self, rank: int, why: str) -> None:
        self._up_send(wire.RankDied(rank, why))

    def _frozen_threshold(self) -> float:
        return max(FROZEN_MIN_S, self.peer_timeout / 2)

    def _check_frozen(self, now: float) -> None:
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

    def _freeze_note(self) -> str:
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
        self._check_frozen(now)
        for name, early in list(self.early_sends.items()):
            keep = []
            for arrived, forwarded in early:
                if now - arrived >= forwarded.send.timeout:
                    self._up_send(wire.SendFailed(
                        forwarded.sender_node, forwarded.send.key, s.E_TIMEOUT,
                        f"send to group rank {forwarded.send.dst} on group '{name}' timed out: no rank "
                        f"on node {self.me} registered the group"))
                else:
                    keep.append((arrived, forwarded))
            if keep:
                self.early_sends[name] = keep
            else:
                del self.early_sends[name]
        config = self.fabric.config
        if self.coordinator is not None:
            out = Outbox()
            self.coordinator.expire(now, out)
            for node in range(1, self.fabric.nnodes):
                if node not in self.dead and now - self.last_heard[node] > self.peer_timeout:
                    self.coordinator.node_dead(
                        node, f"has not been heard from for {self.peer_timeout:g}s{self._freeze_note()}", out)
            self._dispatch(out)
        elif self.broken is None and now - self.last_heard[0] > self.peer_timeout:
            self._coordinator_lost(f"has not been heard from for {self.peer_timeout:g}s{self._freeze_note()}")
        if now - self._last_beat < HEARTBEAT_S:
            return
        self._last_beat = now
        if self.coordinator is not None:
            rows = self.coordinator.stalls(now, config.stall_warning_s)
            self.fabric_stalls = rows
            for row in rows:
                key = (row["group"], row["seq"])
                if key not in self._warned:
                    self._warned.add(key)
                    log.warning("stalled: %s #%s on group '%s' has waited %.0fs for ranks %s (nodes %s)",
                                row["kind"], row["seq"], row["group"], row["waiting_s"], row["missing_ranks"],
                                row["missing_nodes"])
                if config.stall_shutdown_s and row["waiting_s"] >= config.stall_shutdown_s:
                    why = (f"{row['kind']} #{row['seq']} on group '{row['group']}' stalled for "
                           f"{row['waiting_s']:.0f}s waiting for ranks {row['missing_ranks']}")
                    out = Outbox()
                    for node in range(self.fabric.nnodes):
                        out.add(node, wire.Shutdown(why))
                    self._dispatch(out)
                    return
            out = Outbox()
            for node in range(1, self.fabric.nnodes):
                out.add(node, wire.CoordinatorHeartbeat(rows))
            self._dispatch(out)
        else:
            stalled = [(r["group"], r["seq"], r["missing_ranks"]) for r in self.node.waiting_summary()
                       if r["seq"] is not None and r["waiting_s"] >= 1.0]
            self._up_send(wire.Heartbeat(stalled))

    # ---- status -----------------------------------------------------------------
    def status(self) -> dict[str, Any]:
        now = time.monotonic()
        stats = self.stats
        return {
            "node": self.me,
            "nodes": [
                {"rank": n.rank, "name": n.name, "ip": n.ip, "alive": n.rank not in self.dead,
                 "heard_s_ago": round(now - self.last_heard[n.rank], 1) if n.rank != self.me else 0.0}
                for n in self.fabric.nodes
            ],
            "coordinator": self.coordinator is not None,
            "lanes": sorted(self.fabric.lanes),
            "broken": self.broken,
            "negotiating": len(self.negotiating),
            "reported": stats.reported,
            "fast_path": stats.reported_cached,
            "negotiation_us_median": stats.negotiation_median_us(),
            "scheduling_us_per_op": stats.scheduling_us_per_op(),
            "coordinator_us_per_report": stats.coordinator_us_per_report(),
            "lane_ops": self.node.stats.per_lane(),
            "fusion": {
                "threshold_bytes": self.fabric.config.fusion_threshold_bytes if self.fabric.config else None,
                "cycle_ms": self.fabric.config.fusion_cycle_ms if self.fabric.config else None,
                "sets": stats.fused_sets, "ops": stats.fused_ops,
            },
            "tuning": self.fabric.config.tuning_note if self.fabric.config else None,
            "stalls": self.fabric_stalls,
        }
