"""Tiny all-reduces that travel with the fabric's negotiation: the three reductions of their bytes.

A node reduces its local ranks into its *contribution* (sent with its report), the
coordinator *combines* the nodes' contributions in node order (the result rides the
release), and every node *writes the result* into its ranks' buffers.  All three run
on the event loops of the daemons, on every such op, and the buffers are at most a
few KiB: per-call overhead is the whole cost.  NumPy (about a microsecond per call)
does them for every dtype it has; torch (several microseconds per call) only for the
others (bfloat16).  The arithmetic is the one of ``commd.kernels.reduce`` (same
operation per element pair, same order), so the bits do not depend on which ran.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import numpy as np

from commd.kernels import small
from commd.kernels.split import split_reduce

#: All-reduces up to this size travel with the negotiation (reduced by the coordinator), or with a
#: schedule's agreement (reduced by every node).
MAX_BYTES = 4096
#: On more than 2 nodes, a scheduled tiny all-reduce rides its slot's agreement only while every
#: node's contribution together is at most this: each node receives all of them (an all-gather).
MAX_GATHERED_BYTES = 64 << 10


def on_numpy(dtype: str, reduce_op: str) -> bool:
    """Whether NumPy runs an eager all-reduce of ``dtype``/``reduce_op`` (else torch).

    ``avg`` of an integer dtype stays on torch, whose in-place division refuses it:
    the op fails the same way whichever path it takes."""
    np_dtype = small.NUMPY_DTYPES.get(dtype)
    if np_dtype is None:
        return False
    return not (split_reduce(reduce_op).divide_by_n and np_dtype.kind in "biu")


def contribution(bufs: Sequence[Any], reduce_op: str, scale: float) -> bytes:
    """This node's ranks' buffers (NumPy arrays or torch tensors, all of one kind) reduced
    with the local part of ``reduce_op``, as bytes."""
    if isinstance(bufs[0], np.ndarray):
        return contribution_view(bufs, reduce_op, scale).tobytes()
    local_op = split_reduce(reduce_op).local_op
    import torch

    from commd.kernels.reduce import reduce_into

    out_t = torch.empty_like(bufs[0])
    reduce_into(out_t, list(bufs), local_op, scale)
    return out_t.view(torch.uint8).numpy().tobytes()


def contribution_view(bufs: Sequence[np.ndarray], reduce_op: str, scale: float = 1.0) -> memoryview:
    """``contribution`` of NumPy buffers (``on_numpy``), as a view of the reduced array: a large
    op's part is sent from it without a copy into bytes."""
    out = np.empty_like(bufs[0])
    small.reduce_into(out, list(bufs), split_reduce(reduce_op).local_op, scale)
    return memoryview(out).cast("B")


def combine_into(parts: Sequence[Any], dtype: str, reduce_op: str, group_size: int, out: np.ndarray) -> None:
    """``combine`` then ``write_result`` into the one NumPy array ``out`` (``on_numpy``), with the
    same bits, reduced straight into it."""
    split = split_reduce(reduce_op)
    small.reduce_into(out, [np.frombuffer(p, dtype=out.dtype) for p in parts], split.lane_op)
    if split.divide_by_n:
        np.divide(out, group_size, out=out, casting="unsafe")


def combine(parts: Sequence[bytes], dtype: str, reduce_op: str) -> bytes:
    """The nodes' contributions (in node order) reduced with the cross-node part of ``reduce_op``."""
    lane_op = split_reduce(reduce_op).lane_op
    if on_numpy(dtype, reduce_op):
        arrays = [np.frombuffer(p, dtype=small.NUMPY_DTYPES[dtype]) for p in parts]
        out = np.empty_like(arrays[0])
        small.reduce_into(out, arrays, lane_op)
        return out.tobytes()
    import torch

    from commd.kernels.reduce import TORCH_DTYPES, reduce_into

    tensors = [torch.frombuffer(bytearray(p), dtype=TORCH_DTYPES[dtype]) for p in parts]
    out_t = torch.empty_like(tensors[0])
    reduce_into(out_t, tensors, lane_op, 1.0)
    return out_t.view(torch.uint8).numpy().tobytes()


def write_result(result: bytes, dtype: str, reduce_op: str, group_size: int, bufs: Sequence[Any]) -> None:
    """The combined ``result`` finished (``avg``: divided by the group size) into every buffer
    (NumPy arrays when ``on_numpy(dtype, reduce_op)``, else torch tensors)."""
    split = split_reduce(reduce_op)
    if isinstance(bufs[0], np.ndarray):
        acc = np.frombuffer(result, dtype=bufs[0].dtype)
        if split.divide_by_n:
            acc = acc.copy()
            np.divide(acc, group_size, out=acc, casting="unsafe")
        for buf in bufs:
            np.copyto(buf, acc)
        return
    import torch

    from commd.kernels.reduce import TORCH_DTYPES

    acc_t = torch.frombuffer(bytearray(result), dtype=TORCH_DTYPES[dtype])
    split.finish(acc_t, group_size)
    for buf in bufs:
        buf.copy_(acc_t)
