"""The process groups each workload communicates over, derived from the default group.

torch requires every rank to call ``new_group`` for every group, in the same order, even
for groups it is not in; ``make_groups`` does exactly that and keeps the ones this rank
belongs to.  Groups of one rank are left out (None): they would only copy a tensor onto
itself.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch.distributed as dist

WORKLOADS = ("moe", "dlrm", "megatron")


@dataclass
class Groups:
    """This rank's groups.  ``all``: every rank (data parallelism of replicated parameters).

    MoE: ``ep`` holds the ranks that share one copy of all experts (ep_size consecutive ranks);
    ``expert_dp`` the ranks holding the same experts (same ep_rank in every EP group).
    Megatron: ``tp`` holds tp_size consecutive ranks that share one layer; ``dp`` the ranks
    holding the same shard (same tp_rank).
    """

    backend: str
    rank: int
    world: int
    all: Any
    ep: Any = None
    ep_size: int = 1
    ep_rank: int = 0
    expert_dp: Any = None
    tp: Any = None
    tp_size: int = 1
    tp_rank: int = 0
    dp: Any = None
    dp_size: int = 1
    dp_rank: int = 0


def _mine(groups: list[list[int]], rank: int, backend: str, pg_options: Any) -> Any:
    """``dist.new_group`` for each of ``groups`` (every rank calls it for all of them, in order);
    the one this rank is in.  None when the groups are single ranks (nothing to communicate)."""
    if len(groups[0]) < 2:
        return None
    mine = None
    for ranks in groups:
        group = dist.new_group(ranks, backend=backend, pg_options=pg_options)
        if rank in ranks:
            mine = group
    return mine


def _blocks(world: int, size: int) -> tuple[list[list[int]], list[list[int]]]:
    """Consecutive blocks of ``size`` ranks, and the strided groups across them (same position)."""
    if size < 1 or world % size:
        raise ValueError(f"group size {size} does not divide the world size {world}")
    blocks = [list(range(start, start + size)) for start in range(0, world, size)]
    strided = [list(range(pos, world, size)) for pos in range(size)]
    return blocks, strided


def make_groups(workload: str, world: int, backend: str, pg_options: Any = None, *,
                ep: int = 2, tp: int = 2) -> Groups:
    """Create ``workload``'s groups over ranks 0..world-1 with ``backend`` and ``pg_options``
    (passed to every ``new_group`` unchanged).  Every rank must call this with the same arguments.

    MoE: EP groups {0,1},{2,3}, expert-DP groups {0,2},{1,3} at world 4 with ep=2.  Megatron: TP
    groups {0,1},{2,3}, DP groups {0,2},{1,3} at world 4 with tp=2.  DLRM: only ``all``.
    """
    if workload not in WORKLOADS:
        raise ValueError(f"unknown workload {workload!r}; known: {list(WORKLOADS)}")
    if world != dist.get_world_size():
        raise ValueError(f"world {world} is not the default group's size {dist.get_world_size()}")
    rank = dist.get_rank()
    everyone = dist.new_group(list(range(world)), backend=backend, pg_options=pg_options)
    groups = Groups(backend, rank, world, everyone)
    if workload == "moe":
        blocks, strided = _blocks(world, min(ep, world))
        groups.ep_size, groups.ep_rank = len(blocks[0]), rank % len(blocks[0])
        groups.ep = _mine(blocks, rank, backend, pg_options)
        groups.expert_dp = _mine(strided, rank, backend, pg_options)
    elif workload == "megatron":
        blocks, strided = _blocks(world, min(tp, world))
        groups.tp_size, groups.tp_rank = len(blocks[0]), rank % len(blocks[0])
        groups.dp_size, groups.dp_rank = len(strided[0]), rank // len(blocks[0])
        groups.tp = _mine(blocks, rank, backend, pg_options)
        groups.dp = _mine(strided, rank, backend, pg_options)
    return groups
