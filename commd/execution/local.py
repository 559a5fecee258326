"""Runs matched ops among the local ranks, directly on their shared memory.

Every client buffer is a flat torch view of its arena (or of inline bytes),
so a collective is a handful of kernel calls: an all-reduce of n ranks reduces
into rank 0's buffer and copies the result into the others; an all-gather is
n*n slice copies.  Large buffers are cut into cache-sized blocks so that the
reduce-then-broadcast of a block reads it from cache, not from memory, twice.
"""

from __future__ import annotations

import concurrent.futures
import os
from collections.abc import Callable

import torch

from commd.core.ops import ReadyOp, Submission
from commd.execution.small import SMALL_BYTES, execute_small
from commd.kernels.layout import block_offsets
from commd.kernels.reduce import TORCH_DTYPES, reduce_into
from commd.runtime import env_int

#: Elements per block in blocked kernels: 1 MiB of float32, which keeps a
#: block of every rank in L2/L3 while it is reduced and copied back out.
BLOCK_BYTES = 1 << 20

Resolve = Callable[[Submission, str], torch.Tensor]

__all__ = ["SMALL_BYTES", "execute", "execute_small", "kernel_pool_size", "parallel_copy",
           "parallel_reduce_into", "torch_dtype"]


def _overlaps(a: torch.Tensor, b: torch.Tensor) -> bool:
    a0, b0 = a.data_ptr(), b.data_ptr()
    return a0 < b0 + b.numel() * b.element_size() and b0 < a0 + a.numel() * a.element_size()


def execute(op: ReadyOp, resolve: Resolve) -> None:
    """Run ``op`` to completion (raises on failure)."""
    kind = op.kind
    subs = op.subs
    first = subs[0]
    if kind == "barrier":
        return
    if kind == "sendrecv":
        send, recv = subs
        resolve(recv, "out").copy_(resolve(send, "in"))
        return
    if kind == "allreduce":
        _allreduce([resolve(s, "buf") for s in subs], first.reduce_op, first.scale)
    elif kind == "reduce":
        bufs = [resolve(s, "buf") for s in subs]
        root = first.root
        ordered = [bufs[root]] + [b for i, b in enumerate(bufs) if i != root]
        reduce_into(bufs[root], ordered, first.reduce_op, first.scale)
    elif kind == "broadcast":
        bufs = [resolve(s, "buf") for s in subs]
        src = bufs[first.root]
        for i, buf in enumerate(bufs):
            if i != first.root and buf.data_ptr() != src.data_ptr():
                buf.copy_(src)
    elif kind == "allgather":
        _allgather(subs, resolve)
    elif kind == "gather":
        counts = first.counts
        offsets = block_offsets(counts)
        out = resolve(subs[first.root], "out")
        inputs = _inputs_safe_from(subs, resolve, [out])
        for j, src in enumerate(inputs):
            out[offsets[j] : offsets[j] + counts[j]].copy_(src)
    elif kind == "scatter":
        counts = first.counts
        offsets = block_offsets(counts)
        src = resolve(subs[first.root], "in")
        outs = [resolve(s, "out") for s in subs]
        if any(_overlaps(o, src) for o in outs):
            src = src.clone()
        for j, out in enumerate(outs):
            out.copy_(src[offsets[j] : offsets[j] + counts[j]])
    elif kind == "reduce_scatter":
        counts = first.counts
        offsets = block_offsets(counts)
        inputs = [resolve(s, "in") for s in subs]
        outs = [resolve(s, "out") for s in subs]
        for j, out in enumerate(outs):
            parts = [x[offsets[j] : offsets[j] + counts[j]] for x in inputs]
            if any(_overlaps(out, x) for x in inputs):
                tmp = torch.empty_like(out)
                reduce_into(tmp, parts, first.reduce_op, first.scale)
                out.copy_(tmp)
            else:
                reduce_into(out, parts, first.reduce_op, first.scale)
    elif kind == "alltoall":
        _alltoall(subs, resolve)
    elif kind == "alltonext":
        _alltonext(subs, resolve)
    else:  # pragma: no cover - kinds are validated on submission
        raise ValueError(f"no executor for op kind {kind!r}")


def _inputs_safe_from(
    subs: list[Submission], resolve: Resolve, outputs: list[torch.Tensor]
) -> list[torch.Tensor]:
    """Inputs, cloned where they alias an output that is about to be written."""
    inputs = [resolve(s, "in") for s in subs]
    return [x.clone() if any(_overlaps(x, o) for o in outputs) else x for x in inputs]


def _allreduce(bufs: list[torch.Tensor], op: str, scale: float) -> None:
    """Reduce each block into rank 0's buffer and copy it out to the others while it is in cache."""

    def block(lo: int, hi: int) -> None:
        parts = [b[lo:hi] for b in bufs]
        reduce_into(parts[0], parts, op, scale)
        for other in parts[1:]:
            other.copy_(parts[0])

    _over_blocks(bufs[0], block)


def parallel_reduce_into(out: torch.Tensor, parts: list[torch.Tensor], op: str, scale: float) -> None:
    """``reduce_into`` over cache-sized blocks, shared among the kernel threads when large."""
    _over_blocks(out, lambda lo, hi: reduce_into(out[lo:hi], [p[lo:hi] for p in parts], op, scale))


def parallel_copy(dsts: list[torch.Tensor], src: torch.Tensor) -> None:
    """Copy ``src`` into every tensor of ``dsts`` (same shape), blockwise and in parallel when large."""
    dsts = [d for d in dsts if d.data_ptr() != src.data_ptr()]
    if dsts:
        _over_blocks(src, lambda lo, hi: [d[lo:hi].copy_(src[lo:hi]) for d in dsts])


def _over_blocks(ref: torch.Tensor, fn: Callable[[int, int], object]) -> None:
    """Call ``fn(lo, hi)`` on cache-sized blocks of ``ref``'s length.

    While a large op runs, its ranks only wait: their cores are free for the
    daemon, so from PARALLEL_MIN_BYTES each kernel thread takes a share of the
    blocks (torch kernels release the GIL; one intra-op thread each).
    """
    n = ref.numel()
    if n == 0:
        return
    if ref.is_cuda:  # one kernel over the whole buffer, on the daemon's stream (pool threads have their own)
        fn(0, n)
        return
    block = max(1, BLOCK_BYTES // ref.element_size())
    starts = range(0, n, block)
    workers = kernel_pool_size()
    if workers > 1 and n * ref.element_size() >= PARALLEL_MIN_BYTES:
        shares = [starts[i::workers] for i in range(workers)]
        list(_kernel_pool().map(lambda share: [fn(s, min(n, s + block)) for s in share], shares))
    else:
        for s in starts:
            fn(s, min(n, s + block))


#: Buffers at least this large are reduced by several daemon threads.
PARALLEL_MIN_BYTES = 4 << 20
_pool: concurrent.futures.ThreadPoolExecutor | None = None


def kernel_pool_size() -> int:
    """Daemon threads for large kernels: $COMMD_KERNEL_WORKERS, default the core count (max 4)."""
    return env_int("COMMD_KERNEL_WORKERS", min(4, os.cpu_count() or 1), 1, 64)


def _kernel_pool() -> concurrent.futures.ThreadPoolExecutor:
    global _pool
    if _pool is None:
        _pool = concurrent.futures.ThreadPoolExecutor(kernel_pool_size(), thread_name_prefix="commd-kernel")
    return _pool


def _allgather(subs: list[Submission], resolve: Resolve) -> None:
    counts = subs[0].counts
    offsets = block_offsets(counts)
    outs = [resolve(s, "out") for s in subs]
    inputs = _inputs_safe_from(subs, resolve, outs)
    for j, src in enumerate(inputs):
        for out in outs:
            dst = out[offsets[j] : offsets[j] + counts[j]]
            if dst.data_ptr() != src.data_ptr():
                dst.copy_(src)


def _alltoall(subs: list[Submission], resolve: Resolve) -> None:
    outs = [resolve(s, "out") for s in subs]
    inputs = _inputs_safe_from(subs, resolve, outs)
    for j, src in enumerate(inputs):
        send_offsets = block_offsets(subs[j].splits_in)
        for r, out in enumerate(outs):
            n = subs[j].splits_in[r]
            recv_at = block_offsets(subs[r].splits_out)[j]
            out[recv_at : recv_at + n].copy_(src[send_offsets[r] : send_offsets[r] + n])


def _alltonext(subs: list[Submission], resolve: Resolve) -> None:
    """Rank r's output = rank r - 1's input; rank 0's output is left as it was."""
    outs = [resolve(s, "out") for s in subs]
    inputs = _inputs_safe_from(subs, resolve, outs[1:])
    for r in range(1, len(subs)):
        outs[r].copy_(inputs[r - 1])


def torch_dtype(name: str) -> torch.dtype:
    return TORCH_DTYPES[name]
