"""Collectives across nodes: report each matched op to the coordinator, run its release.

1. the local scheduler matched it among this node's ranks → ``negotiate`` reports it
   (full, or only its cache id on the fast path; a tiny all-reduce carries this
   node's contribution, an all-reduce that may join a fused set says so);
2. the coordinator's release (``go``) arrives in global order → ``run_released``
   queues it on its lane's worker (``LaneRunner``), in that order, alone or as one
   fused set.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING, Any

from commd.algorithms.catalog import Chosen
from commd.core.ops import COUNTED, ReadyOp
from commd.execution.hierarchy import GroupPlacement, apply_result, run, run_fused_allreduce
from commd.execution.workers import INLINE_BYTES
from commd.fabric.scheduled import ScheduledPath
from commd.kernels import eager
from commd.protocol import fabric as wire
from commd.protocol import schema as s
from commd.scheduler.agreement import agreed_values, frozen
from commd.scheduler.coordinator import HOME_NODE
from commd.scheduler.overlap import PendingRanges

if TYPE_CHECKING:
    from commd.fabric.rendezvous import Fabric
    from commd.fabric.runner import LaneRunner
    from commd.fabric.services import NodeServices
    from commd.observe.stats import FabricStats

log = logging.getLogger("commd.fabric")

#: All-reduces up to this size travel with the negotiation (reduced by the coordinator).
EAGER_BYTES = eager.MAX_BYTES
#: A released op this large at most runs on the event loop when no other op of this node is
#: being negotiated (a program waiting for each op in turn): a medium op's fixed cost is then
#: one thread hop to the lane worker and one back fewer.  In a burst the lane worker keeps
#: them, so the loop goes on negotiating the next ops while data moves (``INLINE_BYTES``).
SOLO_INLINE_BYTES = 4 << 20
#: This node completes a tiny all-reduce with node 0's early contribution only while its own report
#: is sure to reach the coordinator before the op's timeout there: within this fraction of the
#: timeout from the contribution's arrival.  Later, the coordinator decides (the op may have timed
#: out on node 0: it is then failed here too, never completed on one node and failed on the other).
EARLY_WINDOW = 0.5


class Collectives:
    """This node's collectives between report and release (``negotiating``), and their release."""

    def __init__(self, node: NodeServices, fabric: Fabric, stats: FabricStats, runner: LaneRunner,
                 send_up: Callable[[wire.ToCoordinator], None],
                 unreachable: Callable[[Sequence[int]], str | None]) -> None:
        self.node = node
        self.fabric = fabric
        self.stats = stats
        self.runner = runner
        self.send_up = send_up
        self.unreachable = unreachable
        self.negotiating: dict[tuple[str, int], tuple[ReadyOp, GroupPlacement, tuple]] = {}
        self.neg_cache: dict[tuple, int] = {}
        self._outstanding: dict[str, int] = {}  # group -> ops reported and not yet released or failed
        # Memory of fusion candidates reported and not yet released, per (client, segment): a fused
        # set must not hold two ops on overlapping memory (the later one reads the earlier's result).
        self._fusible_ranges = PendingRanges()
        # Tiny all-reduces of 2-node groups (see ``early``): node 0's contributions that came before
        # this node reported the op, this node's own (cache id, contribution) while it waits, and
        # the ops completed without waiting, whose release or failure is then only acknowledged.
        self._early: dict[tuple[str, int], tuple[wire.Early, float]] = {}  # (contribution, when it came)
        self._mine: dict[tuple[str, int], tuple[int, bytes, tuple[int, ...]]] = {}
        self._completed_early: set[tuple[str, int]] = set()
        #: Ops that follow a published schedule run without a report (fabric/scheduled.py).
        self.scheduled = ScheduledPath(node, fabric, stats, runner, send_up, self.neg_cache, self._negotiate,
                                       runner.peer_timeout, SOLO_INLINE_BYTES, EAGER_BYTES)

    # ---- report -----------------------------------------------------------------
    def negotiate(self, op: ReadyOp, placement: GroupPlacement) -> None:
        started = time.thread_time_ns()
        self._negotiate(op, placement)
        self.stats.sched_ns += time.thread_time_ns() - started

    def _negotiate(self, op: ReadyOp, placement: GroupPlacement, waited: float = 0.0) -> None:
        problem = self.unreachable(placement.nodes)
        if problem is not None:
            self._fail_op(op, s.E_PEER_DIED, f"{op.describe()} cannot run: {problem}")
            return
        first = op.subs[0]
        timeout = max(x.timeout for x in op.subs)
        # The pattern: everything the report says except the sequence number.  The group's
        # placement is fixed per group name, so the name stands for members and placement.
        key: tuple = (op.group, first.signature, tuple(x.group_rank for x in op.subs), op.nbytes, timeout)
        if op.kind == "alltoall" or op.kind in COUNTED:
            key = frozen([key, [[x.splits_in, x.splits_out] for x in op.subs]])
        if self.scheduled.active and self.scheduled.offer(op, placement, key):
            return
        self.negotiating[(op.group, op.seq)] = (op, placement, key)
        self.stats.reported += 1
        contribution = self._eager_contribution(op)
        self._outstanding[op.group] = self._outstanding.get(op.group, 0) + 1
        cid = self.neg_cache.get(key)
        if cid is not None:
            self.stats.reported_cached += 1
            # (positional on this per-op path: pattern, cache id, contribution, no fusion)
            self.send_up(wire.Ready(op.group, op.seq, None, cid, contribution, not self._may_fuse(op), waited))
            if contribution and len(placement.nodes) == 2 and self.fabric.node_rank != HOME_NODE:
                self._mine[(op.group, op.seq)] = (cid, contribution, tuple(placement.nodes))
                early = self._early.pop((op.group, op.seq), None)
                if early is not None:
                    self.early(*early)
            return
        pattern = wire.OpPattern(
            kind=op.kind, signature=agreed_values(first), ranks=list(placement.ranks),
            placement=list(placement.node_of), nodes=list(placement.nodes), mine=[x.group_rank for x in op.subs],
            nbytes=op.nbytes, timeout=timeout,
            alltoall_splits=([[x.group_rank, x.splits_in, x.splits_out] for x in op.subs]
                             if op.kind == "alltoall" else None),
        )
        self.send_up(wire.Ready(op.group, op.seq, pattern=pattern, contribution=contribution,
                                no_fusion=not self._may_fuse(op), waited=waited))

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
        if not self.runner.workers.group_done(op.group):
            return None
        first = op.subs[0]
        resolve = self.node.resolve_array if eager.on_numpy(first.dtype, first.reduce_op) else self.node.resolve
        try:
            bufs = [resolve(x, "buf") for x in op.subs]
        except KeyError:  # a rank left meanwhile: take the lane path, which copes with that
            return None
        return eager.contribution(bufs, first.reduce_op, first.scale)

    # ---- the schedule path ----------------------------------------------------------
    def start_schedule(self, schedule: wire.Schedule) -> None:
        """The coordinator published a schedule: the group's ops reported and not yet released
        move onto it (the coordinator drops their reports), in sequence order."""
        moved = []
        for key in sorted((k for k in self.negotiating if k[0] == schedule.group), key=lambda k: k[1]):
            entry = self._end_negotiation(key)
            self._outstanding[schedule.group] -= 1
            moved.append(entry)
        self.scheduled.start(schedule, moved, others_waiting=bool(self.negotiating))

    # ---- node 0 reported first (tiny all-reduce of a 2-node group) ------------------
    def early(self, early: wire.Early, came_at: float | None = None) -> None:
        """Node 0's contribution to an op of a 2-node group: if this node reported the op with
        the same cache id (so the coordinator will not compare the reports either) and a
        contribution of the same size, within ``EARLY_WINDOW`` of the op's timeout since the
        contribution came (``came_at``), combine both in node order — the bits the coordinator's
        release would carry — and complete now; otherwise keep it until this node reports the
        op, or its release or failure comes."""
        key = (early.group, early.seq)
        came_at = time.monotonic() if came_at is None else came_at
        mine = self._mine.get(key)
        if mine is None:
            if key in self.negotiating or key in self._completed_early:
                return  # reported without a contribution: the release decides
            self._early[key] = (early, came_at)
            return
        cid, contribution, nodes = mine
        if cid != early.cache_id or len(contribution) != len(early.contribution):
            return  # the coordinator compares the reports and decides
        del self._mine[key]
        entry = self.negotiating.get(key)
        if entry is None:  # (every path that ends a negotiation drops its entry in _mine too)
            return
        op = entry[0]
        if time.monotonic() - came_at >= EARLY_WINDOW * min(x.timeout for x in op.subs):
            self.stats.early_too_late += 1
            return  # node 0's op may time out before our report reaches the coordinator: it decides
        data = {HOME_NODE: early.contribution, self.fabric.node_rank: contribution}
        result = eager.combine([data[n] for n in nodes], op.subs[0].dtype, op.subs[0].reduce_op)
        self.stats.completed_early += 1
        self._released(wire.Go(early.group, early.seq, -1, "tcp", None, result))
        self._completed_early.add(key)

    # ---- release ----------------------------------------------------------------
    def run_released(self, items: list[wire.Go]) -> None:
        """Run one release, or one fused set of releases (the coordinator's ``go`` items), after
        this node's schedule if one still runs (``ScheduledPath.after_schedule``)."""
        if items and self.scheduled.after_schedule(lambda: self.run_released(items)):
            return
        if len(items) == 1:
            self._released(items[0])
        elif items:
            started = time.thread_time_ns()
            run_now = self._release_fused(items)
            self.stats.sched_ns += time.thread_time_ns() - started
            if run_now is not None:
                run_now()

    def _released(self, go: wire.Go) -> None:
        started = time.thread_time_ns()
        run_now = self._release(go)
        self.stats.sched_ns += time.thread_time_ns() - started  # the op's own execution is not scheduling
        if run_now is not None:
            run_now()

    def _take_released(self, go: wire.Go) -> tuple[ReadyOp, GroupPlacement] | None:
        """The op a release names, no longer negotiating (None: not one of ours)."""
        key = (go.group, go.seq)
        entry = self._end_negotiation(key)
        if entry is None:
            if key in self._completed_early:
                self._completed_early.discard(key)
                if go.cache_id is not None:
                    log.warning("release of #%s on group '%s' carries a new cache id after it completed early",
                                go.seq, go.group)
                return None  # completed when node 0's contribution came
            log.warning("release of unknown op #%s on group '%s' ignored", go.seq, go.group)
            return None
        op, placement, key = entry
        self._outstanding[op.group] -= 1
        if go.cache_id is not None:
            self.neg_cache[key] = go.cache_id
        self.stats.negotiation_us.append((time.monotonic() - op.ready_at) * 1e6)
        self.stats.released += 1
        op.lane = go.lane
        op.codec = go.codec or ""  # (what every node runs: named by the op or chosen by the coordinator)
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
        result = go.result
        if result is not None:  # a tiny all-reduce the coordinator already reduced
            first = op.subs[0]
            resolve = self.runner.resolver(as_array=eager.on_numpy(first.dtype, first.reduce_op))

            def work(cap: float) -> None:
                apply_result(op, placement, result, resolve)
        else:
            resolve = self.runner.resolver()
            program = None
            if go.algo is not None and go.algo_hash is not None:  # this node's copy; the lane checks it
                program = Chosen.lookup(self.fabric.catalog, go.algo, go.algo_hash, len(placement.nodes))
                op.algo = go.algo
            mark = self.node.tracer.marker(op)

            def work(cap: float) -> None:
                run(op, placement, self.fabric.lanes[lane_name], resolve, min(timeout, cap), program, mark)

        work = self.node.tracer.wrap((op,), work)
        done = self.runner.done
        # The only op between report and release on this node: nothing else would wait behind it
        # on the loop, so up to SOLO_INLINE_BYTES it runs there (two thread wake-ups fewer).
        inline_bytes = SOLO_INLINE_BYTES if not self.negotiating else INLINE_BYTES
        return self.runner.enqueue(lane_name, op.on_gpu, op.group, work,
                                   lambda error, code: done(op, error, code, placement.nodes), op.nbytes,
                                   inline_bytes)

    def _release_fused(self, gos: list[wire.Go]) -> Callable[[], None] | None:
        """A fused set of small all-reduces: one buffer, one lane call, at its first op's place."""
        taken = [x for x in map(self._take_released, gos) if x is not None]
        if not taken:
            return None
        ops = [op for op, _ in taken]
        placement = taken[0][1]
        lane_name = gos[0].lane
        timeout = max(x.timeout for op in ops for x in op.subs)
        resolve = self.runner.resolver()
        self.stats.fused_sets += 1
        self.stats.fused_ops += len(ops)

        resolve_array = self.runner.resolver(as_array=True)

        def work(cap: float) -> None:
            run_fused_allreduce(ops, placement, self.fabric.lanes[lane_name], resolve, min(timeout, cap),
                                resolve_array)

        work = self.node.tracer.wrap(ops, work)

        def done(error: str | None, code: str) -> None:
            for op in ops:
                self.runner.done(op, error, code, placement.nodes)

        return self.runner.enqueue(lane_name, any(op.on_gpu for op in ops), placement.name, work, done,
                                   sum(op.nbytes for op in ops))

    def _end_negotiation(self, key: tuple[str, int]) -> Any:
        """Drop an op's negotiation entry and its early-contribution state; the entry, or None.

        Every path that ends a negotiation (release, failure, a dead node) goes through here."""
        self._mine.pop(key, None)
        self._early.pop(key, None)
        return self.negotiating.pop(key, None)

    # ---- failure ----------------------------------------------------------------
    def failed(self, fail: wire.Fail) -> None:
        """The coordinator failed a reported op (a mismatch across nodes, a timeout, a dead node)."""
        key = (fail.group, fail.seq)
        entry = self._end_negotiation(key)
        if entry is not None:
            self._outstanding[entry[0].group] -= 1
            self._fail_op(entry[0], fail.code, fail.message)
        elif key in self._completed_early:
            self._completed_early.discard(key)
            log.error("the coordinator failed #%s on group '%s' after this node completed it early: %s",
                      fail.seq, fail.group, fail.message)

    def fail_node(self, node: int, message: str) -> None:
        """A node died: fail every reported op that spans it, and a schedule slot waiting for its part."""
        self._fail_reported(lambda placement: node in placement.nodes, message)
        self.scheduled.node_dead(node, message)

    def fail_rank(self, rank: int, why: str) -> None:
        """A rank of another node died: fail every reported op of a group with it.  The coordinator
        failed those it held when it heard of the death; these are the reports that crossed it on
        the way (an op handed back by the schedule path just then), which no node will complete."""
        self._fail_reported(lambda placement: rank in placement.ranks, f"rank {rank} {why}")

    def _fail_reported(self, affected: Callable[[GroupPlacement], bool], why: str) -> None:
        for key, (op, placement, _) in list(self.negotiating.items()):
            if affected(placement):
                self._end_negotiation(key)
                if self._outstanding.get(op.group):
                    self._outstanding[op.group] -= 1
                self._fail_op(op, s.E_PEER_DIED, f"{op.describe()} cannot run: {why}")

    def fail_all(self, broken: str) -> None:
        """The coordinator is lost: fail every reported op, and a schedule slot waiting for node 0's
        part (a coordinator gone silent never sends it)."""
        for _key, (op, _placement, _) in list(self.negotiating.items()):
            self._fail_op(op, s.E_PEER_DIED, f"{op.describe()} cannot run: {broken}")
        self.negotiating.clear()
        self.scheduled.node_dead(0, broken)
        for op in self.scheduled.lost():
            self._fail_op(op, s.E_PEER_DIED, f"{op.describe()} cannot run: {broken}")
        self._mine.clear()
        self._early.clear()
        self._completed_early.clear()
        self._outstanding.clear()

    def _fail_op(self, op: ReadyOp, code: str, message: str) -> None:
        self.node.fail_op(op.subs, code, message)
