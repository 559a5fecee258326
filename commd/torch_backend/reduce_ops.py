"""torch's reduce ops and commd's names for them (the backend submits by name; the recorder writes it)."""

from __future__ import annotations

from typing import Any

import torch.distributed as dist

REDUCE_OPS = [
    (dist.ReduceOp.SUM, "sum"),
    (dist.ReduceOp.AVG, "avg"),
    (dist.ReduceOp.PRODUCT, "product"),
    (dist.ReduceOp.MIN, "min"),
    (dist.ReduceOp.MAX, "max"),
    (dist.ReduceOp.BAND, "band"),
    (dist.ReduceOp.BOR, "bor"),
    (dist.ReduceOp.BXOR, "bxor"),
]


def reduce_op(op: Any) -> str:
    """``op``'s commd name; ValueError for an op commd cannot run."""
    for torch_op, name in REDUCE_OPS:
        if op == torch_op:
            return name
    raise ValueError(f"reduce op {op} is not supported by the commd backend")


def reduce_op_name(op: Any) -> str:
    """``op``'s commd name, or its torch name when commd has none (the sparse path reports it)."""
    for torch_op, name in REDUCE_OPS:
        if op == torch_op:
            return name
    return str(op)
