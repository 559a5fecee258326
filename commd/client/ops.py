"""Every op as a call on flat tensors: what the torch backend and direct users submit.

Each function returns a Handle (wait / is_completed / get_future).  ``lane``
asks for one inter-node lane ("tcp", "gloo", "mpi", "nccl") for an op whose
group spans nodes; by default the daemons' rules and defaults choose.  Sizes are
counted in elements; tensors may live in the client's arena (zero-copy) or
anywhere else (staged or inlined by the client transparently).
"""

from __future__ import annotations

import torch

from commd.client.connection import Client
from commd.client.handle import Handle

WORLD = "world"


def all_reduce(client: Client, tensor: torch.Tensor, op: str = "sum", group: str = WORLD,
               scale: float | None = None, timeout: float | None = None, lane: str | None = None,
               algo: str | None = None, compression: str | None = None) -> Handle:
    """``algo``: run the inter-node phase with this program (a library name or a file of the
    daemons' algorithms directory) on the tcp lane; the op fails on every rank if it cannot.
    ``compression``: a codec for the inter-node phase (partial results travel coded, reductions
    stay in the tensor's precision), from 1 MiB up; not with ``algo``.  Without one the daemons may
    choose a lossless codec (config rules, tuning table); "auto": any codec, lossy ones too;
    "none": never compressed."""
    return client.submit("allreduce", group, {"buf": (tensor, "inout")}, tensor.dtype,
                         result=tensor, count=tensor.numel(), op=op, scale=scale, timeout=timeout, lane=lane,
                         algo=algo, codec=compression)


def reduce(client: Client, tensor: torch.Tensor, root: int, op: str = "sum", group: str = WORLD,
           scale: float | None = None, timeout: float | None = None, lane: str | None = None) -> Handle:
    return client.submit("reduce", group, {"buf": (tensor, "inout")}, tensor.dtype, result=tensor,
                         count=tensor.numel(), op=op, root=root, scale=scale, timeout=timeout, lane=lane)


def broadcast(client: Client, tensor: torch.Tensor, root: int, group: str = WORLD,
              timeout: float | None = None, lane: str | None = None, compression: str | None = None) -> Handle:
    """``root``'s tensor into every rank's.  ``compression``: a codec (``commd.codecs``: "bf16",
    "lossless", ...) for the inter-node phase, from 1 MiB up; every rank names the same one.  Without
    one the daemons may choose a lossless codec; "auto": any codec (a lossy one rounds the root's
    tensor too); "none": never compressed."""
    role = "in" if client.group_rank(group) == root else "out"
    if role == "in" and compression and _lossy(compression):
        role = "inout"  # the root's copy is rounded as the receivers decode it: replicas never drift
    return client.submit("broadcast", group, {"buf": (tensor, role)},
                         tensor.dtype, result=tensor, count=tensor.numel(), root=root, timeout=timeout, lane=lane,
                         codec=compression)


def _lossy(codec: str) -> bool:
    """Whether ``codec`` may lose precision ("auto": the daemons may choose a lossy codec; an unknown
    name: False, the daemon refuses it, naming the codecs)."""
    from commd.codecs import CodecError, parse_choice
    from commd.protocol.schema import CODEC_AUTO

    if codec == CODEC_AUTO:
        return True
    try:
        return parse_choice(codec)[0].lossy
    except CodecError:
        return False


def all_gather(client: Client, output: torch.Tensor, input: torch.Tensor, counts: list[int] | None = None,
               group: str = WORLD, timeout: float | None = None, lane: str | None = None,
               algo: str | None = None, compression: str | None = None) -> Handle:
    """output = concatenation of every rank's input (``counts``: elements per rank).  ``algo``: an
    all-gather program for the inter-node phase (every node then gives the same number of bytes);
    ``compression``: a codec for the inter-node phase (a lossy one rounds every block, this rank's
    own in ``output`` too; ``input`` is left as it was), from 1 MiB of output up; none: the daemons
    may choose a lossless codec; "auto": any codec; "none": never compressed."""
    counts = counts or [input.numel()] * client.group_size(group)
    return client.submit("allgather", group, {"in": (input, "in"), "out": (output, "out")}, input.dtype,
                         result=output, counts=counts, timeout=timeout, lane=lane, algo=algo, codec=compression)


def gather(client: Client, output: torch.Tensor | None, input: torch.Tensor, root: int,
           counts: list[int] | None = None, group: str = WORLD, timeout: float | None = None, lane: str | None = None) -> Handle:
    counts = counts or [input.numel()] * client.group_size(group)
    buffers = {"in": (input, "in")}
    if output is not None:
        buffers["out"] = (output, "out")
    return client.submit("gather", group, buffers, input.dtype, result=output, counts=counts,
                         root=root, timeout=timeout, lane=lane)


def scatter(client: Client, output: torch.Tensor, input: torch.Tensor | None, root: int,
            counts: list[int] | None = None, group: str = WORLD, timeout: float | None = None, lane: str | None = None) -> Handle:
    counts = counts or [output.numel()] * client.group_size(group)
    buffers = {"out": (output, "out")}
    if input is not None:
        buffers["in"] = (input, "in")
    return client.submit("scatter", group, buffers, output.dtype, result=output, counts=counts,
                         root=root, timeout=timeout, lane=lane)


def reduce_scatter(client: Client, output: torch.Tensor, input: torch.Tensor, op: str = "sum",
                   counts: list[int] | None = None, group: str = WORLD, scale: float | None = None,
                   timeout: float | None = None, lane: str | None = None) -> Handle:
    counts = counts or [output.numel()] * client.group_size(group)
    return client.submit("reduce_scatter", group, {"in": (input, "in"), "out": (output, "out")},
                         input.dtype, result=output, counts=counts, op=op, scale=scale, timeout=timeout, lane=lane)


def all_to_all(client: Client, output: torch.Tensor, input: torch.Tensor, splits_in: list[int],
               splits_out: list[int], group: str = WORLD, timeout: float | None = None, lane: str | None = None,
               algo: str | None = None) -> Handle:
    """Rank r sends input[offsets_in[j] : +splits_in[j]] to rank j (elements).  ``algo``: an
    all-to-all program for the inter-node phase (every node then sends every node equal bytes)."""
    return client.submit("alltoall", group, {"in": (input, "in"), "out": (output, "out")}, input.dtype,
                         result=output, splits_in=list(splits_in), splits_out=list(splits_out),
                         timeout=timeout, lane=lane, algo=algo)


def alltonext(client: Client, output: torch.Tensor, input: torch.Tensor, group: str = WORLD,
              timeout: float | None = None, lane: str | None = None, algo: str | None = None) -> Handle:
    """AllToNext: rank r's ``output`` = rank r - 1's ``input`` (rank 0's ``output`` is left as it
    was; the last rank's ``input`` goes nowhere).  Every rank gives the same count and dtype.
    ``algo``: an AllToNext program (e.g. the library's ``alltonext``) for the transfers between
    nodes; without one they are plain sends to the next node."""
    if input.numel() != output.numel():
        raise ValueError(f"alltonext: input has {input.numel()} elements, output {output.numel()}; they must match")
    if input.dtype != output.dtype:
        raise ValueError(f"alltonext: input is {input.dtype}, output {output.dtype}; they must match")
    # rank 0's output is kept: a staged copy of it must go in as well as come back
    role = "inout" if client.group_rank(group) == 0 else "out"
    return client.submit("alltonext", group, {"in": (input, "in"), "out": (output, role)}, input.dtype,
                         result=output, count=input.numel(), timeout=timeout, lane=lane, algo=algo)


def send(client: Client, tensor: torch.Tensor, dst: int, tag: int = 0, group: str = WORLD,
         timeout: float | None = None, lane: str | None = None) -> Handle:
    return client.submit("send", group, {"in": (tensor, "in")}, tensor.dtype, count=tensor.numel(),
                         peer=dst, tag=tag, timeout=timeout, lane=lane)


def recv(client: Client, tensor: torch.Tensor, src: int = -1, tag: int = 0, group: str = WORLD,
         timeout: float | None = None, lane: str | None = None) -> Handle:
    """Receive into ``tensor``; ``src=-1`` takes any source (``handle.src`` tells which)."""
    return client.submit("recv", group, {"out": (tensor, "out")}, tensor.dtype, result=tensor,
                         count=tensor.numel(), peer=src, tag=tag, timeout=timeout, lane=lane)


def barrier(client: Client, group: str = WORLD, timeout: float | None = None, lane: str | None = None) -> Handle:
    return client.submit("barrier", group, timeout=timeout, lane=lane)
