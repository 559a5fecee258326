"""Compiler stage 2: a receive whose result is forwarded becomes one fused step (rcs, rrcs, rrs).

A receive (``r`` or ``rrc``) and the send that reads exactly what it wrote — and needs
nothing else first — run as one step: ``rcs`` (store and forward) or ``rrcs`` (reduce,
store and forward); an ``rrcs`` whose stored value nobody reads before it is overwritten
(or that lands in scratch and is never read) need not store it: ``rrs``.  This saves a
step and a pass over the data per hop of a ring or a tree.  ``unfuse`` undoes one fusion
when the schedule finds that the fused step cannot be placed or ordered.
"""

from __future__ import annotations

from commd.algorithms.dag import Dag, Instruction
from commd.algorithms.ir import StepType

_FUSED = {StepType.RECV: StepType.RECV_COPY_SEND, StepType.RECV_REDUCE_COPY: StepType.RECV_REDUCE_COPY_SEND}


def _dependents(rank: list[Instruction], ins: Instruction) -> list[Instruction]:
    return [x for x in rank if ins in x.deps]


def _fusable(recv: Instruction, send: Instruction) -> bool:
    return (send.type is StepType.SEND and send.sends_to is not None and send.src == recv.dst
            and send.deps == {recv} and send.channel == recv.channel
            and (recv.recvtb < 0 or send.sendtb < 0 or recv.recvtb == send.sendtb))


def fuse(dag: Dag) -> None:
    """Fuse every receive with the first send that only forwards its result (in place)."""
    for rank in dag.ranks:
        for recv in list(rank):
            if recv.type not in _FUSED or recv.send_to >= 0:
                continue
            candidates = sorted((x for x in recv.readers if _fusable(recv, x)), key=lambda x: x.order)
            if not candidates:
                continue
            send = candidates[0]
            for x in _dependents(rank, send):
                x.deps.discard(send)
                x.deps.add(recv)
            recv.type = _FUSED[recv.type]
            recv.send_to, recv.sends_to, recv.send_order = send.send_to, send.sends_to, send.order
            assert send.sends_to is not None
            send.sends_to.receives_from = recv
            recv.sendtb = send.sendtb
            recv.readers.discard(send)
            rank.remove(send)
        for ins in rank:
            if ins.type is StepType.RECV_REDUCE_COPY_SEND and not ins.readers and _dead(ins):
                ins.type = StepType.RECV_REDUCE_SEND


def _dead(ins: Instruction) -> bool:
    """Whether what ``ins`` stores is never used: it lands in scratch, or every chunk of it is overwritten."""
    dst = ins.dst
    assert dst is not None
    if dst.buffer not in ("i", "o"):
        return True
    covered: set[int] = set()
    for writer in ins.overwriters:
        for s in writer.writes():
            if s.buffer == dst.buffer:
                covered.update(range(max(s.index, dst.index), min(s.end, dst.end)))
    return len(covered) == dst.size


def unfuse(dag: Dag, fused: Instruction) -> Instruction:
    """Split a fused step back into its receive and a send that depends on it; returns the send."""
    assert fused.sends_to is not None and fused.dst is not None
    rank = dag.ranks[fused.rank]
    send = Instruction(fused.rank, StepType.SEND, fused.dst, fused.sends_to.dst, fused.send_order,
                       channel=fused.channel, sendtb=fused.sendtb, send_to=fused.send_to, sends_to=fused.sends_to,
                       deps={fused}, tb=fused.tb, where=fused.where)
    fused.sends_to.receives_from = send
    for x in _dependents(rank, fused):
        if x.order > send.order:
            x.deps.add(send)
    fused.type = StepType.RECV if fused.type is StepType.RECV_COPY_SEND else StepType.RECV_REDUCE_COPY
    fused.send_to, fused.sends_to, fused.sendtb, fused.send_order = -1, None, -1, -1.0
    fused.readers.add(send)
    rank.insert(rank.index(fused) + 1, send)
    return send
