"""Hierarchical execution of an op that spans nodes: local phase, lane phase, local phase.

The daemon holds every local rank's buffer (shared memory), so each op is:
the node's ranks → one buffer (a reduction or a packing copy), one call on
the chosen lane among the daemons of the op's nodes, then that buffer →
every local rank's buffer.  Only the nodes that host members of the group
take part; ranks keep their group-rank order whatever the placement.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import numpy as np
import torch

from commd import codecs
from commd.core.ops import COMPRESS_MIN_BYTES, ReadyOp, Submission
from commd.core.placement import GroupPlacement
from commd.execution import pinned
from commd.execution.local import parallel_copy, parallel_reduce_into
from commd.kernels import eager, narrow
from commd.kernels.layout import block_offsets, byte_view
from commd.kernels.reduce import TORCH_DTYPES, reduce_into
from commd.kernels.small import NUMPY_DTYPES
from commd.kernels.small import reduce_into as small_reduce_into
from commd.kernels.split import split_reduce
from commd.lanes.base import Lane, LaneError
from commd.protocol import schema as s

__all__ = ["GroupPlacement", "apply_result", "run", "run_fused_allreduce", "run_p2p", "scratch_like"]

Resolve = Callable[[Submission, str], torch.Tensor]


class _Staging:
    """GPU buffers go through host copies (page-locked: ``pinned``): lanes move host memory."""

    def __init__(self, resolve: Resolve, mark: Callable[[str], None] | None = None) -> None:
        self.resolve = resolve
        #: The tracer's hook for this op (None: not traced): where its lane phase is (``reached``).
        self.mark = mark
        self.writeback: list[tuple[torch.Tensor, torch.Tensor]] = []
        self.arena = pinned.arena()
        self.arena.start()

    def __call__(self, sub: Submission, name: str) -> torch.Tensor:
        t = self.resolve(sub, name)
        if t.is_cuda:
            host = self.arena.take(t)
            host.copy_(t)
            if name in ("buf", "out"):
                self.writeback.append((t, host))
            return host
        return t

    def reached(self, what: str) -> None:
        """The op got through a step of its lane phase (``reduced``: the node's part is in one buffer;
        ``exchanged``: the lane's call returned): the trace splits the phase there."""
        if self.mark is not None:
            self.mark(what)

    def finish(self) -> None:
        for device_tensor, host in self.writeback:
            device_tensor.copy_(host)
        if self.writeback:
            torch.cuda.synchronize()


def run(op: ReadyOp, placement: GroupPlacement, lane: Lane, resolve: Resolve, timeout: float,
        program: Any = None, mark: Callable[[str], None] | None = None) -> None:
    """Execute one released multi-node collective; ``op.subs`` are the local ranks', in group-rank order.

    ``program`` (``commd.algorithms.catalog.Chosen``): the released program that runs the lane
    phase of an all-reduce, an all-gather, an all-to-all or an AllToNext (the kinds the
    coordinator gives one).  ``mark(what)``: the tracer's hook, told where an all-reduce's lane
    phase is (``_Staging.reached``)."""
    staging = _Staging(resolve, mark)
    if program is not None:
        if op.kind not in _PROGRAM_RUNNERS:
            raise LaneError(f"{op.describe()}: algorithm {program.name!r} was released for a {op.kind}; "
                            f"programs run {', '.join(sorted(_PROGRAM_RUNNERS))} only")
        _PROGRAM_RUNNERS[op.kind](op, placement, lane, staging, timeout, program)
    else:
        _RUNNERS[op.kind](op, placement, lane, staging, timeout)
    staging.finish()


def _allreduce(op: ReadyOp, placement: GroupPlacement, lane: Lane, resolve: Resolve, timeout: float,
               program: Any = None) -> None:
    first = op.subs[0]
    bufs = [resolve(x, "buf") for x in op.subs]
    split = split_reduce(first.reduce_op)
    acc = bufs[0]
    if len(bufs) > 1 or first.reduce_op == "premul_sum":
        parallel_reduce_into(acc, bufs, split.local_op, first.scale)
    if isinstance(resolve, _Staging):
        resolve.reached("reduced")
    codec = codecs.parse_choice(op.codec)[0] if op.codec and op.nbytes >= COMPRESS_MIN_BYTES else None
    if program is not None:  # (with a codec: a lossless one, coding the program's transfers)
        lane.allreduce(placement.nodes, acc, split.lane_op, timeout, program=program, codec=codec)
    elif codec is not None:  # (released on the tcp lane)
        lane.allreduce(placement.nodes, acc, split.lane_op, timeout, codec=codec)
    else:
        lane.allreduce(placement.nodes, acc, split.lane_op, timeout)
    if isinstance(resolve, _Staging):
        resolve.reached("exchanged")
    split.finish(acc, len(placement.ranks))
    parallel_copy(bufs[1:], acc)


def run_fused_allreduce(ops: list[ReadyOp], placement: GroupPlacement, lane: Lane, resolve: Resolve, timeout: float,
                        resolve_array: Callable[[Submission, str], np.ndarray] | None = None) -> None:
    """Several small all-reduces of one group, dtype and reduce op as one lane call on one buffer.

    Each op's local ranks are reduced into its slice of the fused buffer, in the
    same rank order as ``_allreduce`` does in place, so every element sees the
    same operations in the same order as unfused: results are identical.  On
    the CPU, for NumPy's dtypes, the local phases are NumPy calls over the
    whole set (one concatenation per rank, one reduction) instead of torch
    calls per op: per-call overhead is the whole cost of tiny ops.
    """
    first = ops[0].subs[0]
    if resolve_array is not None and first.dtype in NUMPY_DTYPES and not any(op.on_gpu for op in ops):
        _fused_allreduce_numpy(ops, placement, lane, resolve_array, timeout)
        return
    staging = _Staging(resolve)
    split = split_reduce(first.reduce_op)
    per_op = [[staging(x, "buf") for x in op.subs] for op in ops]
    fused = torch.empty(sum(bufs[0].numel() for bufs in per_op), dtype=per_op[0][0].dtype)
    offset = 0
    for op, bufs in zip(ops, per_op, strict=True):
        n = bufs[0].numel()
        reduce_into(fused[offset:offset + n], bufs, split.local_op, op.subs[0].scale)
        offset += n
    lane.allreduce(placement.nodes, fused, split.lane_op, timeout)
    split.finish(fused, len(placement.ranks))
    offset = 0
    for bufs in per_op:
        n = bufs[0].numel()
        for buf in bufs:
            buf.copy_(fused[offset:offset + n])
        offset += n
    staging.finish()


def _fused_allreduce_numpy(ops: list[ReadyOp], placement: GroupPlacement, lane: Lane,
                           resolve_array: Callable[[Submission, str], np.ndarray], timeout: float) -> None:
    first = ops[0].subs[0]
    split = split_reduce(first.reduce_op)
    per_op = [[resolve_array(x, "buf") for x in op.subs] for op in ops]
    # one input per local rank, the ops side by side (every op has the same local ranks)
    per_rank = [np.concatenate([bufs[r] for bufs in per_op]) for r in range(len(per_op[0]))]
    fused = per_rank[0]
    small_reduce_into(fused, per_rank, split.local_op, first.scale)
    acc = torch.from_numpy(fused)
    lane.allreduce(placement.nodes, acc, split.lane_op, timeout)
    split.finish(acc, len(placement.ranks))
    offset = 0
    for bufs in per_op:
        n = len(bufs[0])
        part = fused[offset:offset + n]
        for buf in bufs:
            np.copyto(buf, part)
        offset += n


def _reduced_copy(op: ReadyOp, placement: GroupPlacement, lane: Lane, inputs: list[torch.Tensor], timeout: float) -> torch.Tensor:
    """The reduction over every rank of the group, in a scratch buffer (the ranks' buffers untouched)."""
    first = op.subs[0]
    scratch = torch.empty_like(inputs[0])
    split = split_reduce(first.reduce_op)
    parallel_reduce_into(scratch, inputs, split.local_op, first.scale)
    lane.allreduce(placement.nodes, scratch, split.lane_op, timeout)
    split.finish(scratch, len(placement.ranks))
    return scratch


def _reduce(op: ReadyOp, placement: GroupPlacement, lane: Lane, resolve: Resolve, timeout: float) -> None:
    first = op.subs[0]
    bufs = [resolve(x, "buf") for x in op.subs]
    scratch = _reduced_copy(op, placement, lane, bufs, timeout)
    for sub, buf in zip(op.subs, bufs, strict=True):
        if sub.group_rank == first.root:
            buf.copy_(scratch)


def _broadcast(op: ReadyOp, placement: GroupPlacement, lane: Lane, resolve: Resolve, timeout: float) -> None:
    first = op.subs[0]
    narrowing = _gpu_narrowing(op, resolve, "buf", op.nbytes)
    if narrowing is not None:
        _narrowed_broadcast(op, placement, lane, narrowing, timeout)
        return
    bufs = [resolve(x, "buf") for x in op.subs]
    root_node = placement.node_of[first.root]
    if root_node == placement.me:
        src = next(b for x, b in zip(op.subs, bufs, strict=True) if x.group_rank == first.root)
    else:
        src = bufs[0]
    if op.codec and op.nbytes >= COMPRESS_MIN_BYTES:  # (the coordinator released it on the tcp lane)
        codec, per_hop = codecs.parse_choice(op.codec)
        lane.broadcast(placement.nodes, src.reshape(-1), root_node, timeout, codec=codec, per_hop=per_hop)
    else:
        lane.broadcast(placement.nodes, byte_view(src), root_node, timeout)
    parallel_copy(bufs, src)


class _Narrowing:
    """A compressed op whose float32 buffers are CUDA tensors and whose codec rounds to bfloat16:
    the GPU rounds them (``kernels.narrow``), only the 16-bit patterns cross to host memory, and the
    lane runs the codec's second stage on them (``codec.narrowed()``: the same bytes on the wire as a
    node coding float32 on its CPU)."""

    def __init__(self, codec: codecs.HalfCast, per_hop: bool, tensors: list[torch.Tensor], staging: _Staging) -> None:
        self.codec, self.per_hop, self.tensors = codec, per_hop, tensors
        self.resolve, self.arena = staging.resolve, staging.arena


def _gpu_narrowing(op: ReadyOp, resolve: Resolve, name: str, nbytes: int) -> _Narrowing | None:
    """The narrowing of a compressed op of ``nbytes`` whose local ``name`` buffers are all CUDA float32
    tensors and whose codec is a bfloat16 cast, or None (it runs through host memory as it is)."""
    if not op.codec or nbytes < COMPRESS_MIN_BYTES or op.subs[0].dtype != "float32" or not isinstance(resolve, _Staging):
        return None
    codec, per_hop = codecs.parse_choice(op.codec)
    if not (isinstance(codec, codecs.HalfCast) and codec.half_dtype == "bfloat16"):
        return None
    tensors = [resolve.resolve(x, name) for x in op.subs]
    if not all(t.is_cuda and t.is_contiguous() for t in tensors):
        return None
    return _Narrowing(codec, per_hop, tensors, resolve)


def _narrowed_broadcast(op: ReadyOp, placement: GroupPlacement, lane: Lane, narrowing: _Narrowing,
                        timeout: float) -> None:
    """A compressed broadcast of CUDA buffers: the root's GPU rounds its buffer (and keeps the
    rounding, as every replica will hold it), the bits travel, receivers' GPUs widen them."""
    first = op.subs[0]
    bufs = narrowing.tensors
    root_node = placement.node_of[first.root]
    if root_node == placement.me:
        src = next(b for x, b in zip(op.subs, bufs, strict=True) if x.group_rank == first.root)
        bits = narrow.bf16_bits(src)
        narrow.from_bf16_bits(bits, src)
        host = narrowing.arena.take(bits)
        host.copy_(bits)
    else:
        src = bufs[0]
        host = narrowing.arena.take(torch.empty(src.numel(), dtype=torch.int16, device="meta"))
    lane.broadcast(placement.nodes, host, root_node, timeout, codec=narrowing.codec.narrowed(),
                   per_hop=narrowing.per_hop)
    if root_node != placement.me:
        narrow.from_bf16_bits(host.to(src.device), src)
    for buf in bufs:
        if buf.data_ptr() != src.data_ptr():
            buf.copy_(src.view_as(buf))
    torch.cuda.synchronize(src.device)  # (nothing is staged: the results are written on the device)


def _node_bytes(placement: GroupPlacement, counts: list[int], itemsize: int) -> list[int]:
    return [sum(counts[g] for g in placement.members(n)) * itemsize for n in placement.nodes]


def _allgather(op: ReadyOp, placement: GroupPlacement, lane: Lane, resolve: Resolve, timeout: float,
               program: Any = None) -> None:
    first = op.subs[0]
    itemsize = s.ITEMSIZE[first.dtype]
    counts = first.counts
    narrowing = None if program is not None else _gpu_narrowing(op, resolve, "out", sum(counts) * itemsize)
    if narrowing is not None:
        _narrowed_allgather(op, placement, lane, narrowing, timeout)
        return
    offsets = block_offsets([c * itemsize for c in counts])
    mine = torch.cat([byte_view(resolve(x, "in")) for x in op.subs]) if op.subs else torch.empty(0, dtype=torch.uint8)
    outs = [byte_view(resolve(x, "out")) for x in op.subs]
    sizes = _node_bytes(placement, counts, itemsize)
    order = [g for n in placement.nodes for g in placement.members(n)]
    extra: dict[str, Any] = {} if program is None else {"program": program}
    if op.codec and sum(sizes) >= COMPRESS_MIN_BYTES:  # (released on the tcp lane; with a program: lossless)
        extra |= {"codec": codecs.parse_choice(op.codec)[0], "dtype": first.dtype}
    if order == list(range(len(counts))):  # node-major placement: the gathered layout is the output
        lane.allgatherv(placement.nodes, mine, outs[0], sizes, timeout, **extra)
    else:
        gathered = torch.empty(sum(sizes), dtype=torch.uint8)
        lane.allgatherv(placement.nodes, mine, gathered, sizes, timeout, **extra)
        at = 0
        for g in order:
            n = counts[g] * itemsize
            outs[0][offsets[g] : offsets[g] + n].copy_(gathered[at : at + n])
            at += n
    for out in outs[1:]:
        out.copy_(outs[0])


def _narrowed_allgather(op: ReadyOp, placement: GroupPlacement, lane: Lane, narrowing: _Narrowing,
                        timeout: float) -> None:
    """A compressed all-gather of CUDA buffers: each node's GPU rounds its ranks' blocks, the bits
    travel round the ring, every GPU widens the gathered bits into its ranks' outputs (the node's
    own blocks too: every replica holds the same rounding)."""
    first = op.subs[0]
    counts = first.counts
    device = narrowing.tensors[0].device
    inputs = [narrowing.resolve(x, "in").reshape(-1) for x in op.subs]
    if not all(t.is_cuda and t.device == device for t in inputs):
        raise LaneError(f"{op.describe()}: the inputs of a compressed all-gather of CUDA outputs must be on {device}")
    mine = narrow.bf16_bits(torch.cat(inputs)) if inputs else torch.empty(0, dtype=torch.int16, device=device)
    sizes = _node_bytes(placement, counts, 2)
    host_mine = narrowing.arena.take(mine)
    host_mine.copy_(mine)
    gathered = narrowing.arena.take(torch.empty(sum(sizes) // 2, dtype=torch.int16, device="meta"))
    lane.allgatherv(placement.nodes, byte_view(host_mine), byte_view(gathered), sizes, timeout,
                    codec=narrowing.codec.narrowed(), dtype="int16")
    order = [g for n in placement.nodes for g in placement.members(n)]
    outs = [t.reshape(-1) for t in narrowing.tensors]
    wide = outs[0] if order == list(range(len(counts))) else torch.empty(sum(counts), device=device)
    narrow.from_bf16_bits(gathered.to(device), wide)
    if wide is not outs[0]:
        starts = block_offsets(counts)
        at = 0
        for g in order:
            outs[0][starts[g]:starts[g] + counts[g]].copy_(wide[at:at + counts[g]])
            at += counts[g]
    for out in outs[1:]:
        out.copy_(outs[0])
    torch.cuda.synchronize(device)  # (nothing is staged: the results are written on the device)


def _gather(op: ReadyOp, placement: GroupPlacement, lane: Lane, resolve: Resolve, timeout: float) -> None:
    first = op.subs[0]
    itemsize = s.ITEMSIZE[first.dtype]
    counts = first.counts
    root_node = placement.node_of[first.root]
    root_at = placement.nodes.index(root_node)
    mine = torch.cat([byte_view(resolve(x, "in")) for x in op.subs])
    in_sizes = [0] * len(placement.nodes)
    in_sizes[root_at] = mine.numel()
    out_sizes = _node_bytes(placement, counts, itemsize) if root_node == placement.me else [0] * len(placement.nodes)
    gathered = torch.empty(sum(out_sizes), dtype=torch.uint8)
    lane.alltoallv(placement.nodes, mine, in_sizes, gathered, out_sizes, timeout)
    if root_node != placement.me:
        return
    root = next(x for x in op.subs if x.group_rank == first.root)
    out = byte_view(resolve(root, "out"))
    offsets = block_offsets([c * itemsize for c in counts])
    at = 0
    for n in placement.nodes:
        for g in placement.members(n):
            size = counts[g] * itemsize
            out[offsets[g] : offsets[g] + size].copy_(gathered[at : at + size])
            at += size


def _scatter(op: ReadyOp, placement: GroupPlacement, lane: Lane, resolve: Resolve, timeout: float) -> None:
    first = op.subs[0]
    itemsize = s.ITEMSIZE[first.dtype]
    counts = first.counts
    offsets = block_offsets([c * itemsize for c in counts])
    root_node = placement.node_of[first.root]
    root_at = placement.nodes.index(root_node)
    if root_node == placement.me:
        root = next(x for x in op.subs if x.group_rank == first.root)
        src = byte_view(resolve(root, "in"))
        packed = torch.cat([src[offsets[g] : offsets[g] + counts[g] * itemsize]
                            for n in placement.nodes for g in placement.members(n)])
        in_sizes = _node_bytes(placement, counts, itemsize)
    else:
        packed = torch.empty(0, dtype=torch.uint8)
        in_sizes = [0] * len(placement.nodes)
    out_sizes = [0] * len(placement.nodes)
    out_sizes[root_at] = sum(counts[g] for g in placement.local) * itemsize
    received = torch.empty(out_sizes[root_at], dtype=torch.uint8)
    lane.alltoallv(placement.nodes, packed, in_sizes, received, out_sizes, timeout)
    at = 0
    for sub in op.subs:
        size = counts[sub.group_rank] * itemsize
        byte_view(resolve(sub, "out")).copy_(received[at : at + size])
        at += size


def _reduce_scatter(op: ReadyOp, placement: GroupPlacement, lane: Lane, resolve: Resolve, timeout: float) -> None:
    first = op.subs[0]
    counts = first.counts
    offsets = block_offsets(counts)
    scratch = _reduced_copy(op, placement, lane, [resolve(x, "in") for x in op.subs], timeout)
    for sub in op.subs:
        g = sub.group_rank
        resolve(sub, "out").copy_(scratch[offsets[g] : offsets[g] + counts[g]])


def _alltoall(op: ReadyOp, placement: GroupPlacement, lane: Lane, resolve: Resolve, timeout: float,
              program: Any = None) -> None:
    itemsize = s.ITEMSIZE[op.subs[0].dtype]
    inputs = [byte_view(resolve(x, "in")) for x in op.subs]
    outs = [byte_view(resolve(x, "out")) for x in op.subs]
    send_off = [block_offsets(x.splits_in) for x in op.subs]
    recv_off = [block_offsets(x.splits_out) for x in op.subs]
    blocks: list[torch.Tensor] = []
    in_sizes = []
    for n in placement.nodes:
        size = 0
        for i, sub in enumerate(op.subs):
            for j in placement.members(n):
                start, length = send_off[i][j] * itemsize, sub.splits_in[j] * itemsize
                blocks.append(inputs[i][start : start + length])
                size += length
        in_sizes.append(size)
    packed = torch.cat(blocks) if blocks else torch.empty(0, dtype=torch.uint8)
    out_sizes = [
        sum(sub.splits_out[j] for j in placement.members(n) for sub in op.subs) * itemsize for n in placement.nodes
    ]
    received = torch.empty(sum(out_sizes), dtype=torch.uint8)
    if program is None:
        lane.alltoallv(placement.nodes, packed, in_sizes, received, out_sizes, timeout)
    else:
        lane.alltoallv(placement.nodes, packed, in_sizes, received, out_sizes, timeout, program=program)
    at = 0
    for n in placement.nodes:
        for j in placement.members(n):
            for i, sub in enumerate(op.subs):
                length = sub.splits_out[j] * itemsize
                start = recv_off[i][j] * itemsize
                outs[i][start : start + length].copy_(received[at : at + length])
                at += length


def _alltonext(op: ReadyOp, placement: GroupPlacement, lane: Lane, resolve: Resolve, timeout: float,
               program: Any = None) -> None:
    """Rank r's output = rank r - 1's input: the shift among this node's ranks is a local copy;
    each rank whose predecessor lives on another node gets its block over the lane.

    With a program (the coordinator gives one only when every node holds a contiguous range of
    group ranks, in node order) the lane phase is the program's AllToNext between the nodes:
    each node's last rank's input to the next node's first rank.  Without one it is an
    ``alltoallv`` whose only blocks are those boundary transfers (any placement): on the tcp
    lane, one send to and one receive from each neighbour."""
    first = op.subs[0]
    nbytes = first.count * s.ITEMSIZE[first.dtype]
    by_rank = {sub.group_rank: sub for sub in op.subs}
    inputs = {g: byte_view(resolve(sub, "in")) for g, sub in by_rank.items()}
    outs = {g: byte_view(resolve(sub, "out")) for g, sub in by_rank.items()}
    me = placement.me
    node_of = placement.node_of
    # the boundary blocks this node sends (ranks whose successor is elsewhere) and receives
    sends = [g for g in sorted(by_rank) if g + 1 < len(node_of) and node_of[g + 1] != me]
    recvs = [g for g in sorted(by_rank) if g > 0 and node_of[g - 1] != me]
    # the lane call reads the boundary inputs before any output is written; the local shift's
    # sources are taken first, as the received blocks land before it (an output may alias an input)
    boundary = {g: inputs[g] for g in sends}
    local = [(g, inputs[g - 1].clone()) for g in sorted(by_rank) if g > 0 and node_of[g - 1] == me]
    if program is not None:
        index = placement.nodes.index(me)
        src = boundary[sends[0]] if sends else torch.zeros(nbytes, dtype=torch.uint8)
        dst = torch.empty(nbytes, dtype=torch.uint8)
        lane.alltonext(placement.nodes, src, dst, timeout, program=program)
        if index > 0 and recvs:
            outs[recvs[0]].copy_(dst)
    else:
        in_sizes = [0] * len(placement.nodes)
        out_sizes = [0] * len(placement.nodes)
        for g in sends:
            in_sizes[placement.nodes.index(node_of[g + 1])] += nbytes
        for g in recvs:
            out_sizes[placement.nodes.index(node_of[g - 1])] += nbytes
        # blocks to (and from) one node travel in group-rank order: the receiver unpacks them so
        packed = torch.cat([boundary[g] for g in sorted(sends, key=lambda g: (node_of[g + 1], g))]) \
            if sends else torch.empty(0, dtype=torch.uint8)
        received = torch.empty(sum(out_sizes), dtype=torch.uint8)
        lane.alltoallv(placement.nodes, packed, in_sizes, received, out_sizes, timeout)
        at = 0
        for g in sorted(recvs, key=lambda g: (node_of[g - 1], g - 1)):
            outs[g].copy_(received[at:at + nbytes])
            at += nbytes
    for g, data in local:
        outs[g].copy_(data)


def _barrier(op: ReadyOp, placement: GroupPlacement, lane: Lane, resolve: Resolve, timeout: float) -> None:
    lane.barrier(placement.nodes, timeout)


_RUNNERS = {
    "allreduce": _allreduce,
    "reduce": _reduce,
    "broadcast": _broadcast,
    "allgather": _allgather,
    "gather": _gather,
    "scatter": _scatter,
    "reduce_scatter": _reduce_scatter,
    "alltoall": _alltoall,
    "alltonext": _alltonext,
    "barrier": _barrier,
}

#: The kinds whose lane phase a released program can run.
_PROGRAM_RUNNERS = {"allreduce": _allreduce, "allgather": _allgather, "alltoall": _alltoall,
                    "alltonext": _alltonext}


def apply_result(op: ReadyOp, placement: GroupPlacement, result: bytes, resolve: Resolve) -> None:
    """Write an all-reduce result the coordinator computed into every local rank's buffer
    (``resolve`` gives NumPy arrays or torch tensors, see ``kernels.eager.on_numpy``)."""
    first = op.subs[0]
    eager.write_result(result, first.dtype, first.reduce_op, len(placement.ranks),
                       [resolve(sub, "buf") for sub in op.subs])


def run_p2p(role: str, sub: Submission, peer: int, lane: Lane, resolve: Resolve, timeout: float) -> None:
    """One side of a send/recv between ranks on different nodes."""
    staging = _Staging(resolve)
    if role == "send":
        lane.send(peer, byte_view(staging(sub, "in")), timeout)
    else:
        lane.recv(peer, byte_view(staging(sub, "out")), timeout)
    staging.finish()


def scratch_like(sub: Submission, name: str) -> torch.Tensor:
    """A stand-in buffer for a rank that died after its op was released (lanes must stay in step)."""
    ref = sub.buffers.get(name)
    nbytes = ref.nbytes if ref is not None else 0
    itemsize = s.ITEMSIZE[sub.dtype]
    return torch.zeros(nbytes // itemsize, dtype=TORCH_DTYPES[sub.dtype])
