"""The schedule path: a group's ops that follow the published cycle run without the coordinator.

When the coordinator has released the same cycle of op patterns of a group twice
(``scheduler/cycles.py``), it publishes a :class:`~commd.protocol.fabric.Schedule`:
the group's i-th op from sequence number ``start_seq`` on that reaches the fabric (its
ops on an exchange ring leave gaps, the same on every node) takes place ``order + i`` of
the global order and should match slot ``i % len(slots)``.  From then on each node releases those ops
itself, in that order, without a report or a release:

1. the op's local ranks are ready → it is queued at its place, on the tcp lane's
   worker, or, when the lane is idle and the agreement can wait for its peers on the
   event loop (2 nodes, or a tiny all-reduce's gathered agreement), on the loop;
2. the op's nodes first *agree* (``TcpLane.agree``: a dissemination maximum, log2 N
   rounds of 32 bytes; ``offer``/``accept`` on 2 nodes; ``agree_gather`` for a tiny
   all-reduce on more) on (place, cache id, sequence number); a node whose op does not
   match its slot sends cache id -1;
3. all equal → the op runs like a released one; anything else → every node of the
   op sees the same disagreement at the same place, the schedule ends there on every
   node, and the op and every later one are reported to the coordinator again
   (``ScheduleEnded`` first), which compares them as always: a mismatch fails every
   rank with the same ``MismatchError`` as on negotiation, a pattern that merely is not
   the slot's is released.

Anything else that needs ordering while a schedule runs (an op of another group, a
transfer between nodes, a dead node or rank) ends it at the next slot not yet
released: the node that sees it, and every node told by the coordinator
(``StopSchedule``), queues a slot with cache id -1, so the agreement fails there on
every node.  Every node's slots are a prefix of the same sequence, so the argument of
ARCHITECTURE.md (one global order on every lane of every node) holds unchanged.
"""

from __future__ import annotations

import collections
import logging
import time
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

from commd.algorithms.catalog import Chosen
from commd.core.ops import ReadyOp
from commd.execution.hierarchy import GroupPlacement, apply_result, run
from commd.execution.workers import worker_key
from commd.kernels import eager
from commd.lanes.base import LaneError
from commd.lanes.tcp.algorithms import gather_rounds, in_node_order
from commd.lanes.tcp.lane import gather_head, gathered_agreement
from commd.protocol import fabric as wire
from commd.protocol import schema as s

if TYPE_CHECKING:
    from commd.fabric.rendezvous import Fabric
    from commd.fabric.runner import LaneRunner
    from commd.fabric.services import NodeServices
    from commd.observe.stats import FabricStats

log = logging.getLogger("commd.fabric")

#: The completion code of a scheduled op whose slot did not agree: it goes back to negotiation
#: (internal to this module; never sent to a client).
DEVIATED = "schedule_deviated"
#: The only lane a schedule runs on (the agreement uses its mesh, in the same worker's order).
LANE = "tcp"
#: Never run on the event loop: a scheduled op waits in its agreement for the other nodes.
NEVER_INLINE = -1
#: The worker that runs the schedule's slots (the tcp lane's, CPU ops).
WORKER_KEY = worker_key(LANE, False)

Entry = tuple[ReadyOp, GroupPlacement, tuple]


class ScheduleDeviated(LaneError):
    """The slot's agreement failed: the schedule ended here on every node of the op."""

    def __init__(self) -> None:
        super().__init__("the op left the schedule", DEVIATED)


class ScheduledPath:
    """This node's side of the current schedule (at most one at a time)."""

    def __init__(self, node: NodeServices, fabric: Fabric, stats: FabricStats, runner: LaneRunner,
                 send_up: Callable[[wire.ToCoordinator], None], cache: dict[tuple, int],
                 renegotiate: Callable[[ReadyOp, GroupPlacement, float], None], peer_timeout: float,
                 solo_inline_bytes: int, eager_bytes: int) -> None:
        self.node = node
        self.fabric = fabric
        self.stats = stats
        self.runner = runner
        self.send_up = send_up
        self.cache = cache  # pattern key -> cache id (the releases' ids, kept by Collectives)
        self.renegotiate = renegotiate
        self.peer_timeout = peer_timeout
        #: The most bytes a slot runs on the event loop when its peer is already waiting, and the largest
        #: all-reduce whose contribution rides a 2-node agreement (Collectives' own limits).
        self.solo_inline_bytes = solo_inline_bytes
        self.eager_bytes = eager_bytes
        self.schedule: wire.Schedule | None = None
        self.active = False  # taking the group's ready ops
        self.stopping = False  # no more slots released here; ends once the queued ones are back
        self.next_slot = 0
        self.last_seq = -1  # the sequence number of the op in the latest slot
        #: The first slot that did not agree (written on the lane worker, which runs the slots in order).
        self.ended_at: int | None = None
        self.inflight = 0
        self.held: list[Entry] = []  # ready, waiting for the schedule to end
        self.returned: list[tuple[ReadyOp, GroupPlacement]] = []  # slots that did not agree
        #: Queued slots' ops: slot -> (ready since, timeout); and whether this node asked to end the
        #: schedule because one of them waited its timeout (a late rank elsewhere).
        self.waiting: dict[int, tuple[float, float]] = {}
        self.asked_stop = False
        self.dead_ranks: dict[int, str] = {}  # global rank -> why, for this schedule's ops
        #: Slots released here and not yet started (each starts after the one before it).
        self._queued: collections.deque[tuple] = collections.deque()
        #: A slot whose part was sent, waiting on the event loop for a peer's: (slot, deadline,
        #: give up (why, error code)).  Later slots wait in ``_queued`` meanwhile: the lane's stream
        #: is between two halves.
        self._armed: tuple[int, float, Callable[[str, str], None]] | None = None
        #: How the slots ran: on the lane's worker, on the event loop at once (the peer's part was
        #: there), or split (this node's part sent, the rest on the loop when the peer's came).
        self.modes = {"worker": 0, "inline": 0, "split": 0}
        #: Tiny all-reduces done in their slot's agreement (the contributions rode it: no lane call).
        self.reduced_in_agreement = 0
        #: Releases that came while this node's slots still ran (``after_schedule``), in arrival order.
        self._after: list[Callable[[], None]] = []

    # ---- start and end -------------------------------------------------------------
    def start(self, schedule: wire.Schedule, reported: list[Entry], others_waiting: bool) -> None:
        """A schedule arrived; ``reported``: the group's ops this node reported and still holds
        (the coordinator drops those reports), in sequence order."""
        if self.active:
            log.error("schedule %d arrived while schedule %d still runs here: ignored", schedule.epoch,
                      self.schedule.epoch if self.schedule else -1)
            return
        self.schedule = schedule
        self.active, self.stopping = True, False
        self.next_slot, self.ended_at, self.inflight = 0, None, 0
        self.last_seq = schedule.start_seq - 1
        self.held, self.returned = [], []
        self.waiting, self.asked_stop = {}, False
        self.dead_ranks = {}
        self.stats.schedules_started += 1
        log.info("fabric: group '%s' follows schedule %d (%d slots) from op #%d", schedule.group, schedule.epoch,
                 len(schedule.slots), schedule.start_seq)
        for op, placement, key in reported:
            self._take(op, placement, key)
        if others_waiting:
            self.stop()

    def stop(self) -> None:
        """End the schedule at the next slot not yet released here (a slot that cannot agree)."""
        if not self.active or self.stopping:
            return
        self.stopping = True
        self._release(self.next_slot, None, None, -1)
        self.next_slot += 1

    def after_schedule(self, release: Callable[[], None]) -> bool:
        """Hold ``release`` (a release: it takes the tcp lane's stream) until this node's schedule has
        ended, and say so (True); False: no schedule runs here, run it now.

        The coordinator numbers what it held back after the slots of the first node that ends the
        schedule, so a release can reach this node while its own last slots (the agreement that
        ends it) still wait to run, queued or half done on the event loop: started now, it would
        take the stream out of step with the nodes that run that agreement first."""
        if not self.active:
            return False
        self._after.append(release)
        return True

    def tick(self, now: float) -> None:
        """An op that waited its timeout in its slot's agreement: some rank elsewhere is late.  Ask
        the coordinator to end the schedule; the op then goes back to negotiation with the time it
        waited, where it times out (naming the late ranks) or meets them, as if it had never left.
        A split agreement whose peer never answered within its deadline gives up (a lane timeout)."""
        armed = self._armed
        if armed is not None and now >= armed[1]:
            armed[2]("the other node never sent its part of the schedule's agreement", s.E_TIMEOUT)
        if not self.active or self.asked_stop or self.schedule is None:
            return
        if any(now - since >= timeout for since, timeout in self.waiting.values()):
            self.asked_stop = True
            self.send_up(wire.StopSchedule(self.schedule.epoch))

    def offer(self, op: ReadyOp, placement: GroupPlacement, key: tuple) -> bool:
        """Take a ready op onto the schedule (True), or leave it to negotiation (False; an op of
        another group, which ends the schedule so that it can be ordered)."""
        if not self.active:
            return False
        if op.group != self.schedule.group:  # type: ignore[union-attr]
            self.stop()
            return False
        self._take(op, placement, key)
        return True

    def rank_died(self, rank: int, why: str) -> None:
        """A rank is gone: the schedule ends (the coordinator stops it too), and the ops held here or
        handed back that involve it fail instead of being negotiated again (the coordinator has already
        failed what it held of them)."""
        self.dead_ranks[rank] = why
        self.stop()
        keep = []
        for entry in self.held:
            if not self._fail_if_dead(entry[0], entry[1]):
                keep.append(entry)
        self.held = keep
        self.returned = [(op, p) for op, p in self.returned if not self._fail_if_dead(op, p)]

    def node_dead(self, node: int, message: str) -> None:
        """Node ``node`` was declared dead (``message`` names it and why).  A split agreement of this
        schedule waiting on the event loop for a part gives up now, as the node's death: a silent
        node would never send it, and past its deadline (the op's timeout and a peer timeout more)
        it would fail as a timeout.  (A slot blocked in the lane's worker fails with the stream,
        which ``Liveness`` marks lost.)"""
        armed = self._armed
        if armed is not None and self.schedule is not None and node in self.schedule.nodes:
            armed[2](message, s.E_PEER_DIED)

    def _fail_if_dead(self, op: ReadyOp, placement: GroupPlacement) -> bool:
        for rank in placement.ranks:
            if rank in self.dead_ranks:
                self.node.fail_op(op.subs, s.E_PEER_DIED,
                                  f"{op.describe()} cannot run: rank {rank} {self.dead_ranks[rank]}")
                return True
        return False

    def lost(self) -> list[ReadyOp]:
        """The coordinator is gone: the ops held here, to fail; the slots queued fail on their own."""
        ops = [op for op, _, _ in self.held] + [op for op, _ in self.returned]
        self.held, self.returned = [], []
        self.active = False
        self._after = []  # releases of ops that fail with the coordinator
        return ops

    # ---- slots -------------------------------------------------------------------------
    def _take(self, op: ReadyOp, placement: GroupPlacement, key: tuple) -> None:
        if self.stopping:
            self.held.append((op, placement, key))
            return
        sched = self.schedule
        assert sched is not None
        index = self.next_slot
        slot = sched.slots[index % len(sched.slots)]
        cid = self.cache.get(key)
        # the group's ops that reach the fabric, in order (those an exchange ring runs leave gaps in
        # the sequence numbers, the same on every node); the agreement compares the numbers too
        matches = op.seq > self.last_seq and cid == slot.cache_id
        self.last_seq = max(self.last_seq, op.seq)
        self.next_slot += 1
        if not matches:
            self.stopping = True
        self._release(index, op, placement, slot.cache_id if matches else -1, slot)

    def _release(self, index: int, op: ReadyOp | None, placement: GroupPlacement | None, stamp: int,
                 slot: wire.ScheduleSlot | None = None) -> None:
        """Slot ``index``: agree, then run ``op`` (None: agree only), after every earlier slot."""
        self.inflight += 1
        if op is not None:
            self.waiting[index] = (op.ready_at, max(x.timeout for x in op.subs))
        self._queued.append((index, op, placement, stamp, slot))
        self._launch_queued()

    def _launch_queued(self) -> None:
        """Start the queued slots in order; a split agreement holds the lane until its peer answers."""
        while self._queued and self._armed is None:
            self._launch(*self._queued.popleft())

    def _launch(self, index: int, op: ReadyOp | None, placement: GroupPlacement | None, stamp: int,
                slot: wire.ScheduleSlot | None) -> None:
        sched = self.schedule
        assert sched is not None
        order = sched.order + index
        seq = op.seq if op is not None else -1
        nodes = tuple(sched.nodes)
        lane = self.fabric.lanes[LANE]
        tracer = self.node.tracer
        program = None
        if op is not None and slot is not None and stamp >= 0:
            op.lane = slot.lane
            op.codec = slot.codec or ""
            if slot.algo is not None and slot.algo_hash is not None:
                program = Chosen.lookup(self.fabric.catalog, slot.algo, slot.algo_hash, len(nodes))
                op.algo = slot.algo
            if tracer.on:
                tracer.mark(op, "scheduled")
        timeout = max(x.timeout for x in op.subs) if op is not None else self.peer_timeout
        # the agreement waits a peer timeout longer than the op: a late rank's node joins it with
        # -1 once the schedule is stopped (``tick``), well before
        agree_timeout = timeout + self.peer_timeout
        resolve = self.runner.resolver()
        peer = (nodes[0] if nodes[1] == self.fabric.node_rank else nodes[1]) if len(nodes) == 2 else None

        # a tiny all-reduce's contribution rides the agreement: always on 2 nodes, on more when the slot
        # says its agreement gathers (every node takes the same kind of agreement for a slot)
        gathers = peer is None and sched.slots[index % len(sched.slots)].gather
        tiny = (op is not None and stamp >= 0 and (peer is not None or gathers) and op.kind == "allreduce"
                and not op.on_gpu and 0 < op.nbytes <= self.eager_bytes)
        offered: list[bytes] = []  # this node's payload, once its part of a 2-node agreement is sent
        gathered: list[list[bytes]] = []  # every node's block, once the event loop ran a gather's rounds

        def payload() -> bytes:
            """What this node's part of the agreement carries: a tiny all-reduce's contribution, read
            when the part is sent (every earlier op of the group is done by then), else nothing."""
            return self._contribution(op) if tiny and op is not None else b""

        def offer(cap: float) -> None:
            """Send this node's part of a 2-node agreement: the values, and its payload."""
            assert peer is not None
            mine = payload()
            lane.offer(peer, (order, stamp, seq), min(agree_timeout, cap), mine)
            offered.append(mine)

        def agreed(cap: float) -> None:
            """The agreement (its second half, when this node's part went out already), then the op:
            on 2 nodes a tiny all-reduce is done then (both contributions combined in node order,
            the bits the coordinator's release would carry)."""
            if self.ended_at is not None and index >= self.ended_at:
                raise ScheduleDeviated()
            parts: list[bytes] = []  # every node's contribution, in node order
            try:
                if peer is None and gathers and gathered:
                    same, parts = gathered_agreement((order, stamp, seq), gathered[0])
                elif peer is None and gathers:
                    same, parts = lane.agree_gather(nodes, (order, stamp, seq), min(agree_timeout, cap), payload())
                elif peer is None:
                    same = lane.agree(nodes, (order, stamp, seq), min(agree_timeout, cap))
                else:
                    if not offered:
                        offer(cap)
                    same, theirs = lane.accept(peer, (order, stamp, seq), min(agree_timeout, cap))
                    parts = [offered[0], theirs] if self.fabric.node_rank < peer else [theirs, offered[0]]
            except LaneError:
                self._ended(index)
                raise
            if not same or stamp < 0 or op is None or placement is None:
                self._ended(index)
                raise ScheduleDeviated()
            if tracer.on:
                tracer.mark(op, "agreed")
            # every node sees the same parts: all of them whole, or every node runs the op on the lane
            if tiny and parts and all(len(part) == op.nbytes for part in parts):
                first = op.subs[0]
                result = eager.combine(parts, first.dtype, first.reduce_op)
                self.reduced_in_agreement += 1
                apply_result(op, placement, result,
                             self.runner.resolver(as_array=eager.on_numpy(first.dtype, first.reduce_op)))
                return
            run(op, placement, lane, resolve, min(timeout, cap), program, tracer.marker(op))

        def done(error: str | None, code: str) -> None:
            self.inflight -= 1
            self.waiting.pop(index, None)
            if error is not None and code == DEVIATED:
                if op is not None and placement is not None:
                    self.returned.append((op, placement))
                    self.stats.schedule_fallback += 1
            elif op is not None:
                self.stats.scheduled += 1
                self.runner.done(op, error, code, nodes)
            self._maybe_end()

        def enqueue(inline_bytes: int) -> None:
            def work(cap: float) -> None:
                agreed(cap)

            run_now = self.runner.enqueue(LANE, False, sched.group, tracer.wrap((op,), work) if op is not None else work, done,
                                          op.nbytes if op is not None else 0, inline_bytes)
            if run_now is not None:
                run_now()

        workers = self.runner.workers
        late = self.ended_at is not None and index >= self.ended_at
        if (peer is None and not gathers) or late or workers.key_busy(WORKER_KEY) or not workers.group_done(sched.group):
            self.modes["worker"] += 1
            enqueue(NEVER_INLINE)  # on the worker, in its order
            return
        if peer is None:
            # A gathered agreement on more than 2 nodes, the lane idle: its rounds run on the event
            # loop, each as soon as the peer's part is there (no thread hop, no blocked loop).
            self.modes["split"] += 1
            me = nodes.index(self.fabric.node_rank)
            held = [gather_head((order, stamp, seq)) + payload()]
            rounds = collections.deque(gather_rounds(len(nodes), me))
            sent = False  # this round's part is out
            woken = False  # the loop saw the round's peer readable: its part, or its end (EOF)
            deadline = time.monotonic() + agree_timeout

            def advance() -> str:
                """Run the rounds whose peer's part has arrived: 'done', 'armed' (waiting for a
                peer's part on the loop) or 'failed' (the slot is done, with the lane's error)."""
                nonlocal sent, woken
                try:
                    while rounds:
                        count, to, frm = rounds[0]
                        if not sent:
                            lane.gather_send(nodes, nodes[to], held[:count], agree_timeout)
                            sent = True
                        if not woken and not lane.peer_waiting(nodes[frm]):
                            fd = lane.peer_fileno(nodes[frm])
                            if fd is None:
                                raise LaneError(f"tcp agree: node {nodes[frm]}'s stream is closed", s.E_PEER_DIED)
                            self._wait_for_part(index, deadline, fd, nodes[frm], resume, done)
                            return "armed"
                        held.extend(lane.gather_recv(nodes, nodes[frm], count, max(0.0, deadline - time.monotonic())))
                        rounds.popleft()
                        sent = woken = False
                except LaneError as exc:
                    self._ended(index)
                    done(str(exc), exc.code)
                    return "failed"
                gathered.append(in_node_order(held, me))
                enqueue(self.solo_inline_bytes)
                return "done"

            def resume() -> None:
                nonlocal woken
                woken = True  # read now: the part, or the lane's error for a closed stream
                if advance() != "armed":
                    self._launch_queued()

            advance()
            return
        if lane.peer_waiting(peer):
            self.modes["inline"] += 1
            enqueue(self.solo_inline_bytes)  # the peer's part is here: nothing to wait for
            return
        fd = lane.peer_fileno(peer)
        if fd is None:
            self.modes["worker"] += 1
            enqueue(NEVER_INLINE)
            return
        self.modes["split"] += 1
        # Two nodes, the lane idle, the peer not there yet: send this node's part now, and run the
        # rest on the event loop when the peer's part arrives (no thread, no blocked loop).
        try:
            offer(float("inf"))
        except LaneError as exc:
            self._ended(index)
            done(str(exc), exc.code)
            return

        def answered() -> None:
            enqueue(self.solo_inline_bytes)
            self._launch_queued()

        self._wait_for_part(index, time.monotonic() + agree_timeout, fd, peer, answered, done)

    def _wait_for_part(self, index: int, deadline: float, fd: int, peer: int, resume: Callable[[], None],
                       done: Callable[[str | None, str], None]) -> None:
        """Slot ``index`` waits on the event loop for ``peer``'s part of its agreement (its socket
        ``fd`` readable: ``resume``); later slots wait behind it.  Past ``deadline`` (``tick``) it
        gives up: the stream is out of step, the slot fails with a timeout, the schedule ends."""
        loop = self.runner.workers.loop

        def readable() -> None:
            if self._armed is None or self._armed[0] != index:
                return
            loop.remove_reader(fd)
            self._armed = None
            resume()

        def give_up(why: str, code: str) -> None:
            loop.remove_reader(fd)
            self._armed = None
            self._ended(index)
            self.fabric.lanes[LANE].abandon(peer, why)
            done(f"tcp agree with node {peer}: {why}", code)
            self._launch_queued()

        self._armed = (index, deadline, give_up)
        loop.add_reader(fd, readable)

    def _contribution(self, op: ReadyOp) -> bytes:
        """This node's ranks of a tiny all-reduce reduced locally (``kernels.eager``), as bytes."""
        first = op.subs[0]
        resolve = self.runner.resolver(as_array=eager.on_numpy(first.dtype, first.reduce_op))
        return eager.contribution([resolve(x, "buf") for x in op.subs], first.reduce_op, first.scale)

    def _ended(self, index: int) -> None:
        """On the lane worker: slot ``index`` did not agree; no later slot runs."""
        if self.ended_at is None or index < self.ended_at:
            self.ended_at = index

    def _maybe_end(self) -> None:
        """Once every queued slot is back and one of them ended the schedule: tell the
        coordinator where, then report every op not run on it, in sequence order."""
        if not self.active or self.inflight or (self.ended_at is None and not self.stopping):
            return
        sched = self.schedule
        assert sched is not None
        end = self.ended_at if self.ended_at is not None else self.next_slot
        self.active = False
        self.stats.schedules_ended += 1
        log.info("fabric: schedule %d of group '%s' ended at its slot %d (order %d)", sched.epoch, sched.group, end,
                 sched.order + end)
        self.send_up(wire.ScheduleEnded(sched.epoch, sched.order + end))
        waiting = self.returned + [(op, placement) for op, placement, _ in self.held]
        self.held, self.returned = [], []
        now = time.monotonic()
        for op, placement in sorted(waiting, key=lambda entry: entry[0].seq):
            if not self._fail_if_dead(op, placement):
                self.renegotiate(op, placement, now - op.ready_at)
        after, self._after = self._after, []
        for release in after:  # numbered after every slot: their turn now
            release()

    # ---- status ------------------------------------------------------------------------
    def status(self) -> dict[str, Any] | None:
        sched = self.schedule
        if sched is None:
            return None
        return {"epoch": sched.epoch, "group": sched.group, "slots": len(sched.slots), "active": self.active,
                "next_slot": self.next_slot, "ended_at_slot": self.ended_at, "slots_run": dict(self.modes),
                "reduced_in_agreement": self.reduced_in_agreement}
