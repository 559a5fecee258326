"""Compiler stage 1: the trace becomes per-rank instructions with read/write dependencies per chunk slot.

A copy between ranks becomes a send on the source rank matched with a receive on the
destination; a reduce between ranks becomes a send matched with a receive-reduce-copy;
local copies and reduces become ``cpy`` and ``re``.  Each instruction depends on the
instructions of its rank that must come first for the program's meaning to hold: the
last writer of every slot it reads or writes (read-after-write, write-after-write) and
every reader since (write-after-read).  Later stages may reorder anything these edges
and the matching of transfers allow.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from commd.algorithms.ir import StepType
from commd.algorithms.trace import Operation, Slots


@dataclass(eq=False)
class Instruction:
    """One step-to-be on one rank.  Fusion may merge a receive and the send that forwards it."""

    rank: int
    type: StepType
    src: Slots | None  # what it reads locally (a plain receive: the sender's slots, for the IR's src fields)
    dst: Slots | None  # what it writes locally (a plain send: the receiver's slots)
    order: float  # position in the trace: a topological order of the whole program
    channel: int = 0
    sendtb: int = -1
    recvtb: int = -1
    send_to: int = -1
    recv_from: int = -1
    sends_to: Instruction | None = None  # the matched receive on the peer
    receives_from: Instruction | None = None  # the matched send on the peer
    deps: set[Instruction] = field(default_factory=set)
    readers: set[Instruction] = field(default_factory=set)  # who reads what this one wrote
    overwriters: set[Instruction] = field(default_factory=set)  # who writes over what this one wrote
    send_order: float = -1.0  # for a fused step: the trace position of its send part
    tb: int = -1  # assigned by the schedule
    where: str = ""

    @property
    def cnt(self) -> int:
        slots = self.dst if self.dst is not None else self.src
        assert slots is not None
        return slots.size

    def reads(self) -> list[Slots]:
        """Local slots whose values this instruction uses."""
        t, out = self.type, []
        if t in (StepType.SEND, StepType.COPY, StepType.REDUCE) and self.src is not None:
            out.append(self.src)
        if t.reduces and self.dst is not None:
            out.append(self.dst)
        return out

    def writes(self) -> list[Slots]:
        return [self.dst] if self.type.writes_dst and self.dst is not None else []

    def __repr__(self) -> str:
        return f"<{self.type.value} rank {self.rank} src {self.src} dst {self.dst} @{self.order}>"


@dataclass
class Dag:
    """Every rank's instructions, in trace order."""

    num_ranks: int
    ranks: list[list[Instruction]]

    def all(self) -> list[Instruction]:
        return [ins for rank in self.ranks for ins in rank]


def build(trace: list[Operation], num_ranks: int) -> Dag:
    """Instructions and their dependencies for ``trace``."""
    ranks: list[list[Instruction]] = [[] for _ in range(num_ranks)]
    for t, op in enumerate(trace):
        common = {"channel": max(op.ch, 0), "where": op.where}
        src, dst = op.src, op.dst
        if src.rank == dst.rank:
            kind = StepType.COPY if op.kind == "copy" else StepType.REDUCE
            ranks[src.rank].append(Instruction(src.rank, kind, src, dst, float(t), sendtb=op.sendtb, **common))
            continue
        send = Instruction(src.rank, StepType.SEND, src, dst, float(t), sendtb=op.sendtb, send_to=dst.rank, **common)
        kind = StepType.RECV if op.kind == "copy" else StepType.RECV_REDUCE_COPY
        recv_src = src if kind is StepType.RECV else dst  # rrc: dst ← local(dst) ⊕ received
        recv = Instruction(dst.rank, kind, recv_src, dst, t + 0.5, recvtb=op.recvtb, recv_from=src.rank, **common)
        send.sends_to, recv.receives_from = recv, send
        ranks[src.rank].append(send)
        ranks[dst.rank].append(recv)
    for rank in ranks:
        _depend(rank)
    return Dag(num_ranks, ranks)


def _depend(instructions: list[Instruction]) -> None:
    """Fill deps/readers/overwriters from the slots each instruction reads and writes, chunk by chunk."""
    last_writer: dict[tuple[str, int], Instruction] = {}
    readers_since: dict[tuple[str, int], list[Instruction]] = {}
    for ins in instructions:
        for s in ins.reads():
            for i in range(s.index, s.end):
                writer = last_writer.get((s.buffer, i))
                if writer is not None and writer is not ins:
                    ins.deps.add(writer)
                    writer.readers.add(ins)
        for s in ins.writes():
            for i in range(s.index, s.end):
                key = (s.buffer, i)
                writer = last_writer.get(key)
                if writer is not None and writer is not ins:
                    ins.deps.add(writer)
                    writer.overwriters.add(ins)
                ins.deps.update(r for r in readers_since.get(key, ()) if r is not ins)
        for s in ins.reads():
            for i in range(s.index, s.end):
                readers_since.setdefault((s.buffer, i), []).append(ins)
        for s in ins.writes():
            for i in range(s.index, s.end):
                last_writer[(s.buffer, i)] = ins
                readers_since[(s.buffer, i)] = []
