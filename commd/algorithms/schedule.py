"""Compiler stage 3: channels and threadblocks, and the order of the steps in each threadblock.

Threadblocks (MSCCL's automatic policy): on each rank, one threadblock owns each
connection — sending to peer P on channel c, receiving from peer Q on channel c — and a
threadblock has at most one of each, so a forwarding step (recv from Q, send to P) lives
in the threadblock (send P, recv Q, c).  Hints given to ``copy``/``reduce`` (``sendtb``,
``recvtb``, ``ch``) are honoured, and under the manual policy required.

Order: the steps are issued one by one in a single global sequence — a step is issued
once its dependencies are, a receive once its matched send is and every earlier send of
its connection has met its receive — preferring the step with the lowest level (its
distance from the start in the dependency graph) so that independent chains interleave
as they would run.  Each threadblock runs its steps in issue order.  Sends never wait
for the receiver (commd's transports land early data), so that sequence is itself an
execution of the program: the schedule is free of deadlock by construction, and the
k-th send of a connection meets the k-th receive.  When the sequence stalls (a receiver
needs a connection's transfers in another order than the sender issued them, or a fused
step waits on itself), the connections involved are made to carry their transfers in
program order, or the fused step is split back into its receive and its send, and the
ordering starts again; with every connection in program order and nothing fused, the
program order itself is a valid sequence, so this ends.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from commd.algorithms.dag import Dag, Instruction
from commd.algorithms.errors import ProgramError
from commd.algorithms.fusion import unfuse


@dataclass
class Block:
    """A threadblock being built: its peers, channel and (once ordered) its instructions."""

    id: int
    send: int
    recv: int
    chan: int
    steps: list[Instruction] = field(default_factory=list)


@dataclass
class Schedule:
    """Per rank, its threadblocks by id."""

    ranks: list[dict[int, Block]]


def levels(dag: Dag) -> dict[Instruction, int]:
    """Each instruction's distance from the start (dependencies and transfers each count one)."""
    level: dict[Instruction, int] = {}
    for ins in sorted(dag.all(), key=lambda x: x.order):
        before = [level[d] + 1 for d in ins.deps]
        if ins.receives_from is not None:
            before.append(level[ins.receives_from] + 1)
        level[ins] = max(before, default=0)
    return level


class _Assigner:
    """Threadblock assignment on one rank."""

    def __init__(self, dag: Dag, rank: int, source: str, manual: bool) -> None:
        self.dag, self.rank, self.source, self.manual = dag, rank, source, manual
        self.blocks: dict[int, Block] = {}
        self.send_owner: dict[tuple[int, int], Block] = {}
        self.recv_owner: dict[tuple[int, int], Block] = {}

    def fail(self, reason: str, ins: Instruction, tb: int | None = None) -> None:
        raise ProgramError(f"{reason} (at {ins.where})", source=self.source, rank=self.rank, threadblock=tb)

    def new_block(self, send: int, recv: int, chan: int, tb: int | None = None) -> Block:
        if tb is None:
            tb = max(self.blocks, default=-1) + 1
        block = self.blocks[tb] = Block(tb, send, recv, chan)
        return block

    def claim(self, block: Block, ins: Instruction) -> None:
        """Put ``ins`` in ``block``, which takes the connections it needs (or refuse, naming the clash)."""
        if block.chan != ins.channel:
            self.fail(f"threadblock {block.id} is on channel {block.chan}, a step asks for channel {ins.channel}",
                      ins, block.id)
        if ins.send_to >= 0:
            owner = self.send_owner.get((ins.send_to, ins.channel))
            if block.send not in (-1, ins.send_to) or (owner is not None and owner is not block):
                self.fail(f"threadblock {block.id} cannot send to rank {ins.send_to} on channel {ins.channel}: "
                          f"it sends to {block.send}" if block.send >= 0 else
                          f"two threadblocks would send to rank {ins.send_to} on channel {ins.channel}", ins, block.id)
            block.send = ins.send_to
            self.send_owner[(ins.send_to, ins.channel)] = block
        if ins.recv_from >= 0:
            owner = self.recv_owner.get((ins.recv_from, ins.channel))
            if block.recv not in (-1, ins.recv_from) or (owner is not None and owner is not block):
                self.fail(f"threadblock {block.id} cannot receive from rank {ins.recv_from} on channel {ins.channel}: "
                          f"it receives from {block.recv}" if block.recv >= 0 else
                          f"two threadblocks would receive from rank {ins.recv_from} on channel {ins.channel}",
                          ins, block.id)
            block.recv = ins.recv_from
            self.recv_owner[(ins.recv_from, ins.channel)] = block
        ins.tb = block.id

    def hinted(self, ins: Instruction) -> int:
        """The threadblock a hint names for ``ins`` (-1: none); splits a fused step whose two hints differ."""
        hints = {h for h in ((ins.sendtb if ins.send_to >= 0 or ins.recv_from < 0 else -1),
                             (ins.recvtb if ins.recv_from >= 0 else -1)) if h >= 0}
        if len(hints) > 1:
            return -2
        return hints.pop() if hints else -1

    def place_hinted(self, ins: Instruction) -> None:
        tb = self.hinted(ins)
        if tb == -2:
            self.place_hinted(unfuse(self.dag, ins))
            tb = self.hinted(ins)
        if tb < 0:
            return
        block = self.blocks.get(tb) or self.new_block(-1, -1, ins.channel, tb)
        self.claim(block, ins)

    def place_auto(self, ins: Instruction) -> None:
        if ins.tb >= 0:
            return
        if self.manual:
            self.fail("the manual threadblock policy needs sendtb/recvtb on every transfer and local step", ins)
        if ins.send_to < 0 and ins.recv_from < 0:  # a local step: beside what it waits for
            placed = [d for d in ins.deps if d.tb >= 0]
            if placed:
                ins.tb = max(placed, key=lambda d: d.order).tb
            elif self.blocks:
                ins.tb = min(self.blocks)
            else:
                ins.tb = self.new_block(-1, -1, ins.channel).id
            return
        chan = ins.channel
        sender = self.send_owner.get((ins.send_to, chan)) if ins.send_to >= 0 else None
        receiver = self.recv_owner.get((ins.recv_from, chan)) if ins.recv_from >= 0 else None
        if ins.send_to >= 0 and ins.recv_from >= 0:
            if sender is not None and receiver is not None and sender is not receiver:
                self.split(ins)
                return
            block = sender or receiver
            if block is not None and ((block is sender and block.recv >= 0 and receiver is None)
                                      or (block is receiver and block.send >= 0 and sender is None)):
                self.split(ins)
                return
            self.claim(block or self.new_block(ins.send_to, ins.recv_from, chan), ins)
            return
        block = sender or receiver
        if block is None:
            for candidate in self.blocks.values():
                if candidate.chan == chan and (
                        (ins.send_to >= 0 and candidate.send == -1 and candidate.recv == ins.send_to
                         and (ins.send_to, chan) not in self.send_owner)
                        or (ins.recv_from >= 0 and candidate.recv == -1 and candidate.send == ins.recv_from
                            and (ins.recv_from, chan) not in self.recv_owner)):
                    block = candidate
                    break
        self.claim(block or self.new_block(max(ins.send_to, -1), max(ins.recv_from, -1), chan), ins)

    def split(self, ins: Instruction) -> None:
        send = unfuse(self.dag, ins)
        self.place_auto(ins)
        self.place_auto(send)


def assign(dag: Dag, source: str, manual: bool) -> Schedule:
    """Threadblocks for every instruction (may split fused steps whose connections clash)."""
    assigners = [_Assigner(dag, rank, source, manual) for rank in range(dag.num_ranks)]
    for local_last in (None, True):  # hinted steps first; then the rest, transfers before local steps
        level = levels(dag)  # a split's new send is placed at once, on its own rank: no need to redo this
        for rank, assigner in enumerate(assigners):
            if local_last is None:
                for ins in sorted(dag.ranks[rank], key=lambda x: (level[x], x.order)):
                    assigner.place_hinted(ins)
            else:  # local steps then join the threadblock of what they wait for
                for ins in sorted(dag.ranks[rank],
                                  key=lambda x: (x.send_to < 0 and x.recv_from < 0, level[x], x.order)):
                    assigner.place_auto(ins)
    return Schedule([a.blocks for a in assigners])


def order(dag: Dag, schedule: Schedule, source: str) -> None:
    """Fill each threadblock's steps in one global issue order (see the module docstring)."""
    strict: set[tuple[int, int, int]] = set()
    while True:
        stuck = _issue(dag, schedule, strict)
        if stuck is None:
            return
        blocked = {(x.recv_from, x.rank, x.channel) for x in stuck if x.receives_from is not None} - strict
        fused = [x for x in stuck if x.sends_to is not None and x.recv_from >= 0]
        if blocked:  # a receive met its connection's sends in another order than its rank needs them
            strict |= blocked
        elif fused:
            unfuse(dag, fused[0])
        elif any(_conn(x) not in strict for x in dag.all() if x.sends_to is not None):
            strict |= {_conn(x) for x in dag.all() if x.sends_to is not None}
        else:
            x = stuck[0]
            raise ProgramError(f"no order of the steps lets {x!r} run (at {x.where})", source=source, rank=x.rank,
                               threadblock=x.tb)


def _conn(ins: Instruction) -> tuple[int, int, int]:
    return (ins.rank, ins.send_to, ins.channel)


def _send_position(ins: Instruction) -> float:
    """Where the send (or a fused step's send part) stands in the program's order."""
    return ins.send_order if ins.send_order >= 0 else ins.order


def _issue(dag: Dag, schedule: Schedule, strict: set[tuple[int, int, int]]) -> list[Instruction] | None:
    """One attempt at the global order; the instructions left when it stalls, or None when done.

    A ``strict`` connection carries its transfers in program order (and its receives meet
    them in turn).  Were every connection strict and no step fused, the earliest unissued
    step of the program would always be ready: so a stall is mended by making the
    connections it involves strict, or by splitting a fused step that waits.
    """
    for blocks in schedule.ranks:
        for block in blocks.values():
            block.steps = []
    level = levels(dag)
    pending = sorted(dag.all(), key=lambda x: (level[x], x.order))
    in_order: dict[tuple[int, int, int], list[Instruction]] = {}
    for ins in dag.all():
        if ins.sends_to is not None and _conn(ins) in strict:
            in_order.setdefault(_conn(ins), []).append(ins)
    for queue in in_order.values():
        queue.sort(key=_send_position)
    issued: set[Instruction] = set()
    sent: dict[tuple[int, int, int], list[Instruction]] = {}
    received: dict[tuple[int, int, int], int] = {}
    while pending:
        left = []
        for ins in pending:
            ready = all(d in issued for d in ins.deps)
            if ready and ins.receives_from is not None:
                conn = (ins.recv_from, ins.rank, ins.channel)
                queue, k = sent.get(conn, []), received.get(conn, 0)
                ready = k < len(queue) and queue[k] is ins.receives_from
            if ready and ins.sends_to is not None and _conn(ins) in strict:
                ready = in_order[_conn(ins)][len(sent.get(_conn(ins), []))] is ins
            if not ready:
                left.append(ins)
                continue
            issued.add(ins)
            if ins.receives_from is not None:
                conn = (ins.recv_from, ins.rank, ins.channel)
                received[conn] = received.get(conn, 0) + 1
            if ins.sends_to is not None:
                sent.setdefault(_conn(ins), []).append(ins)
            schedule.ranks[ins.rank][ins.tb].steps.append(ins)
        if len(left) == len(pending):
            return left
        pending = left
    return None
