"""Compiler stage 4: the scheduled program replicated ``instances`` times, one copy per set of channels.

As MSCCL does: instance i of threadblock t is threadblock ``t·instances + i`` on channel
``max_channel·i + c``; input and output chunk j of a ref of size k becomes
``j·instances + i·k`` (interleaved: each original chunk is cut into ``instances`` pieces
that sit side by side), scratch chunks are batched (instance i's scratch follows
instance i − 1's).  Instances run in parallel on separate channels, so a program written
for one chunk per rank keeps more connections busy.
"""

from __future__ import annotations

import dataclasses

from commd.algorithms.dag import Instruction
from commd.algorithms.schedule import Block, Schedule
from commd.algorithms.trace import Slots


def scratch_extents(schedule: Schedule) -> dict[tuple[int, str], int]:
    """(rank, scratch buffer name) → chunks it needs for one instance."""
    extents: dict[tuple[int, str], int] = {}
    for blocks in schedule.ranks:
        for block in blocks.values():
            for ins in block.steps:
                for s in (ins.src, ins.dst):
                    if s is not None and s.buffer not in ("i", "o"):
                        key = (s.rank, s.buffer)
                        extents[key] = max(extents.get(key, 0), s.end)
    return extents


def replicate(schedule: Schedule, instances: int, buffer_sizes: dict[tuple[int, str], int],
              interleaved: bool = True) -> Schedule:
    """The schedule with every threadblock repeated ``instances`` times (the same one when 1)."""
    if instances == 1:
        return schedule
    extents = scratch_extents(schedule)
    channels = 1 + max((b.chan for blocks in schedule.ranks for b in blocks.values()), default=0)

    def move(s: Slots | None, i: int) -> Slots | None:
        if s is None:
            return None
        if s.buffer not in ("i", "o"):
            index = extents[(s.rank, s.buffer)] * i + s.index
        elif interleaved:
            index = s.index * instances + i * s.size
        else:
            index = buffer_sizes[(s.rank, s.buffer)] * i + s.index
        return Slots(s.rank, s.buffer, index, s.size)

    out: list[dict[int, Block]] = [{} for _ in schedule.ranks]
    for i in range(instances):
        clones: dict[Instruction, Instruction] = {}
        originals = [ins for blocks in schedule.ranks for b in blocks.values() for ins in b.steps]
        for ins in originals:
            clones[ins] = dataclasses.replace(
                ins, src=move(ins.src, i), dst=move(ins.dst, i), channel=channels * i + ins.channel,
                tb=ins.tb * instances + i, deps=set(), readers=set(), overwriters=set())
        for ins in originals:
            clone = clones[ins]
            clone.deps = {clones[d] for d in ins.deps}
            clone.sends_to = clones[ins.sends_to] if ins.sends_to is not None else None
            clone.receives_from = clones[ins.receives_from] if ins.receives_from is not None else None
        for r, blocks in enumerate(schedule.ranks):
            for b in blocks.values():
                tb = b.id * instances + i
                out[r][tb] = Block(tb, b.send, b.recv, channels * i + b.chan, [clones[x] for x in b.steps])
    return Schedule(out)
