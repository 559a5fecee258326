"""Small all-reduce / reduce / broadcast among the local ranks with NumPy kernels.

Per call NumPy costs about a microsecond where torch costs several, and a
daemon that only runs these never has to import torch (see torch_loader).
"""

from __future__ import annotations

from collections.abc import Callable

import numpy as np

from commd.core.ops import ReadyOp, Submission
from commd.kernels import small

ResolveArray = Callable[[Submission, str], np.ndarray]
#: Ops up to this size run with NumPy kernels (cheaper per call than torch).
SMALL_BYTES = 64 * 1024


def runs_on_numpy(op: ReadyOp) -> bool:
    """Whether ``execute_small`` runs ``op`` (then torch is not needed): barriers, and small
    all-reduce/reduce/broadcast of a dtype NumPy has."""
    if op.kind == "barrier":
        return True
    return (op.kind in ("allreduce", "reduce", "broadcast") and op.subs[0].dtype in small.NUMPY_DTYPES
            and op.nbytes <= SMALL_BYTES)


def execute_small(op: ReadyOp, resolve: ResolveArray) -> bool:
    """Run ``op`` with NumPy if ``runs_on_numpy``; False if not applicable."""
    if not runs_on_numpy(op):
        return False
    if op.kind == "barrier":
        return True
    first = op.subs[0]
    bufs = [resolve(s, "buf") for s in op.subs]
    if op.kind == "allreduce":
        small.reduce_into(bufs[0], bufs, first.reduce_op, first.scale)
        for other in bufs[1:]:
            np.copyto(other, bufs[0])
    elif op.kind == "reduce":
        root = first.root
        ordered = [bufs[root]] + [b for i, b in enumerate(bufs) if i != root]
        small.reduce_into(bufs[root], ordered, first.reduce_op, first.scale)
    else:
        for i, buf in enumerate(bufs):
            if i != first.root:
                np.copyto(buf, bufs[first.root])
    return True
