"""How a reduce op splits across the two phases of a multi-node reduction (no torch needed).

A node first reduces its own ranks' buffers (the local op), then the lanes combine the
nodes' partial results (the lane op, which every lane implements), then the result may
be divided by the group size.  ``avg`` and ``premul_sum`` are not lane ops: ``avg`` is a
sum divided at the end, ``premul_sum`` scales each local partial and sums across nodes.
This is the one place that rule is written.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any


@dataclass(frozen=True, slots=True)
class ReduceSplit:
    local_op: str  # reduces a node's own contributions (premul_sum keeps its scaling here)
    lane_op: str  # combines the nodes' partial results, on the lane
    divide_by_n: bool  # divide the combined result by the group size (avg)

    def finish(self, result: Any, group_size: int) -> None:
        """The last step on the combined result (a torch tensor, in place): divide by n for avg."""
        if self.divide_by_n:
            result.div_(group_size)


_SPLITS = {
    "avg": ReduceSplit("sum", "sum", True),
    "premul_sum": ReduceSplit("premul_sum", "sum", False),
}


def split_reduce(op: str) -> ReduceSplit:
    """The local op, the lane op and whether to divide by n, for the client's reduce op ``op``."""
    split = _SPLITS.get(op)
    return split if split is not None else ReduceSplit(op, op, False)
