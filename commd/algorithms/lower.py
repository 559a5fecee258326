"""Compiler stage 5: the ordered threadblocks become an :class:`~commd.algorithms.ir.Algorithm`.

Named scratch buffers are laid out one after another in the IR's single scratch buffer
``s``.  Dependencies become ``depid``/``deps``: a step needs only the latest step it waits
for in each other threadblock (its own threadblock runs in order anyway); the IR carries
one dependency per step, so a step that waits on several threadblocks is preceded by
``nop`` steps carrying the others, as MSCCL does.  ``hasdep`` marks every step waited for.
Threadblock ids are renumbered densely per rank.
"""

from __future__ import annotations

from commd.algorithms.dag import Instruction
from commd.algorithms.ir import Algorithm, Rank, Step, StepType, Threadblock
from commd.algorithms.schedule import Schedule
from commd.algorithms.trace import Slots


def scratch_offsets(extents: dict[tuple[int, str], int], instances: int) -> dict[tuple[int, str], int]:
    """(rank, scratch buffer name) → its first chunk in ``s`` (each name holds all its instances)."""
    offsets: dict[tuple[int, str], int] = {}
    used: dict[int, int] = {}
    for rank, name in sorted(extents):
        offsets[(rank, name)] = used.get(rank, 0)
        used[rank] = used.get(rank, 0) + extents[(rank, name)] * instances
    return offsets


def lower(schedule: Schedule, *, name: str, coll: str, inplace: bool, proto: str, io_chunks: list[tuple[int, int]],
          extents: dict[tuple[int, str], int], instances: int) -> Algorithm:
    """The IR of ``schedule``; ``io_chunks[r]`` is rank r's (input, output) chunk counts, instances included."""
    offsets = scratch_offsets(extents, instances)

    def place(s: Slots) -> tuple[str, int]:
        if s.buffer in ("i", "o"):
            return s.buffer, s.index
        return "s", offsets[(s.rank, s.buffer)] + s.index

    ranks = []
    for r, blocks in enumerate(schedule.ranks):
        renumber = {old: new for new, old in enumerate(sorted(blocks))}
        position = {ins: (renumber[b.id], k) for b in blocks.values() for k, ins in enumerate(b.steps)}
        waits: dict[Instruction, list[tuple[int, int]]] = {}
        for b in blocks.values():
            for ins in b.steps:
                latest: dict[int, int] = {}
                for d in ins.deps:
                    tb, k = position[d]
                    if tb != renumber[b.id]:
                        latest[tb] = max(latest.get(tb, -1), k)
                waits[ins] = sorted(latest.items())
        final: dict[tuple[int, int], int] = {}  # (tb, original index) → index with nops
        for b in blocks.values():
            k = 0
            for j, ins in enumerate(b.steps):
                k += max(len(waits[ins]) - 1, 0)
                final[(renumber[b.id], j)] = k
                k += 1
        waited = {(tb, final[(tb, k)]) for deps in waits.values() for tb, k in deps}
        threadblocks = []
        for b in sorted(blocks.values(), key=lambda b: b.id):
            tb = renumber[b.id]
            steps: list[Step] = []
            for ins in b.steps:
                deps = [(d_tb, final[(d_tb, k)]) for d_tb, k in waits[ins]]
                for d_tb, d_k in deps[:-1]:
                    s = len(steps)
                    steps.append(Step(s, StepType.NOP, "i", -1, "o", -1, 0, d_tb, d_k, (tb, s) in waited))
                depid, dep_s = deps[-1] if deps else (-1, -1)
                s = len(steps)
                src, dst = _fields(ins)
                steps.append(Step(s, ins.type, *place(src), *place(dst), ins.cnt, depid, dep_s, (tb, s) in waited))
            threadblocks.append(Threadblock(tb, b.send, b.recv, b.chan, tuple(steps)))
        s_chunks = sum(extents[key] * instances for key in extents if key[0] == r)
        i_chunks, o_chunks = io_chunks[r]
        ranks.append(Rank(r, i_chunks, o_chunks, s_chunks, tuple(threadblocks)))
    nchannels = 1 + max((tb.chan for rank in ranks for tb in rank.threadblocks), default=0)
    nchunks = max((max(rank.i_chunks, rank.o_chunks) for rank in ranks), default=0)
    return Algorithm(name=name, coll=coll, ngpus=len(ranks), nchunksperloop=nchunks, nchannels=nchannels,
                     inplace=inplace, ranks=tuple(ranks), proto=proto)


def _fields(ins: Instruction) -> tuple[Slots, Slots]:
    """The IR's (src, dst) of an instruction, as MSCCL writes them.

    A send names the receiver's slots as dst; a plain receive (``r``, ``rcs``) the sender's
    as src; a receive that reduces names its local operand, which is also where it stores.
    """
    assert ins.src is not None and ins.dst is not None
    if ins.type.receives and ins.type.reduces:
        return ins.dst, ins.dst
    return ins.src, ins.dst
