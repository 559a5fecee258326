"""The contract every inter-node lane implements.

A lane executes one op at a time, called from its own thread, in the one
global order the coordinator released.  ``nodes`` is always the sorted tuple
of node ranks taking part (it contains this node); every member calls the
same method with the same ``nodes`` and matching sizes, in the same order.
A call returns when this node's part is complete, or raises LaneError.

Reductions are done by the lane with ``commd.kernels.reduce.reduce_into``
semantics and must give bit-identical results on every node (reduce in node
order, or reduce each chunk on one node and distribute it).  Only the
element-wise ops ``sum product min max band bor bxor`` reach a lane: the
daemon turns ``avg`` and ``premul_sum`` into ``sum`` plus a local scaling.

:class:`Transport` is the seam below the algorithms: a lane that moves bytes
itself (tcp) runs its algorithms against it, so later algorithms (programmable
or compressed collectives) can be written once and run over any transport.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, Protocol, runtime_checkable

import torch

from commd.kernels.reduce import DTYPE_NAMES

#: Reduce ops a lane must implement (after the daemon's rewriting of avg/premul_sum).
LANE_REDUCE_OPS = frozenset({"sum", "product", "min", "max", "band", "bor", "bxor"})

#: Lane methods, which are also the names used by ``Lane.can_run``.
PRIMITIVES = ("allreduce", "broadcast", "allgatherv", "alltoallv", "send", "recv", "barrier")

#: Dtype families the lanes' reduce refusals speak of (by name, as in ``DTYPE_NAMES``).
COMPLEX_DTYPES = frozenset({"complex64", "complex128"})
BITWISE_OPS = frozenset({"band", "bor", "bxor"})
#: The dtypes bitwise ops are defined on: integers and bool.
BITWISE_DTYPES = frozenset({"int8", "uint8", "int16", "int32", "int64", "bool"})


def refusal(lane: str, primitive: str, dtype: str, reduce_op: str | None, nodes: tuple[int, ...],
            nnodes: int) -> str | None:
    """The part of ``can_run`` every lane shares: a known primitive and dtype, nodes of the
    fabric and, for allreduce, a lane reduce op.  A lane adds its own dtype/op refusals for
    allreduce only (the other primitives move bytes)."""
    if primitive not in PRIMITIVES:
        return f"lane '{lane}' has no primitive {primitive!r}"
    bad = [n for n in nodes if not 0 <= n < nnodes]
    if bad:
        return f"lane '{lane}' spans nodes 0..{nnodes - 1}; {bad} are outside it"
    if dtype not in DTYPE_NAMES.values():
        return f"lane '{lane}' does not know dtype {dtype!r}"
    if primitive == "allreduce" and reduce_op not in LANE_REDUCE_OPS:
        return f"lane '{lane}' cannot reduce with {reduce_op!r} (lane ops: {sorted(LANE_REDUCE_OPS)})"
    return None


def check_nodes(lane: str, what: str, nodes: tuple[int, ...], node_rank: int, nnodes: int) -> tuple[int, ...]:
    """``nodes`` normalised to ints; LaneError unless sorted, distinct, in the fabric and holding this node."""
    nodes = tuple(int(n) for n in nodes)
    if list(nodes) != sorted(set(nodes)) or node_rank not in nodes:
        raise LaneError(f"{lane} {what}: nodes must be sorted, distinct and contain this node "
                        f"{node_rank}, got {nodes}")
    if nodes[0] < 0 or nodes[-1] >= nnodes:
        raise LaneError(f"{lane} {what}: nodes {nodes} outside 0..{nnodes - 1}")
    return nodes


def node_index(lane: str, what: str, nodes: tuple[int, ...], node: int) -> int:
    """Position of ``node`` (a root or peer) in ``nodes``; LaneError if it is not a member."""
    if node not in nodes:
        raise LaneError(f"{lane} {what}: node {node} is not in {nodes}")
    return nodes.index(node)


def check_allgatherv_sizes(lane: str, nodes: tuple[int, ...], me: int, sizes: list[int], inp_bytes: int,
                           out_bytes: int) -> None:
    """LaneError unless ``sizes`` has one non-negative byte count per node, ``sizes[me]`` is this
    node's input length and ``out`` holds them all."""
    if (len(sizes) != len(nodes) or min(sizes, default=0) < 0 or inp_bytes != sizes[me]
            or out_bytes != sum(sizes)):
        raise LaneError(f"{lane} allgatherv: sizes {sizes} do not match nodes {nodes}, "
                        f"inp {inp_bytes} bytes and out {out_bytes} bytes")


def check_alltoallv_sizes(lane: str, nodes: tuple[int, ...], in_sizes: list[int], out_sizes: list[int],
                          inp_bytes: int, out_bytes: int) -> None:
    """LaneError unless both size lists have one non-negative byte count per node and add up to the
    input's and the output's lengths."""
    if (len(in_sizes) != len(nodes) or len(out_sizes) != len(nodes) or min(in_sizes + out_sizes) < 0
            or inp_bytes != sum(in_sizes) or out_bytes != sum(out_sizes)):
        raise LaneError(f"{lane} alltoallv: in_sizes {in_sizes} / out_sizes {out_sizes} do not match "
                        f"nodes {nodes}, inp {inp_bytes} bytes and out {out_bytes} bytes")


def pair_nodes(lane: str, what: str, node_rank: int, peer: int) -> tuple[int, ...]:
    """The sorted (this node, peer) pair of a send/recv; LaneError if ``peer`` is this node."""
    if peer == node_rank:
        raise LaneError(f"{lane} {what}: node {peer} is this node")
    return tuple(sorted((node_rank, int(peer))))


def check_contiguous(lane: str, what: str, tensor: torch.Tensor) -> None:
    """Results land in the caller's memory only if no view below has to copy it."""
    if not tensor.is_contiguous():
        raise LaneError(f"{lane} {what}: tensors must be contiguous, got strides {tensor.stride()}")


def check_cpu_tensors(lane: str, what: str, *tensors: torch.Tensor) -> None:
    """LaneError unless every tensor is on the CPU and contiguous (a view of a copy would lose results)."""
    for tensor in tensors:
        if tensor.device.type != "cpu":
            raise LaneError(f"{lane} {what}: tensors must be on the CPU, got {tensor.device}")
        check_contiguous(lane, what, tensor)


def allreduce_dtype(lane: Lane, nodes: tuple[int, ...], buf: torch.Tensor, op: str) -> str:
    """``buf``'s dtype name; LaneError saying why unless ``lane`` can reduce it with ``op`` on ``nodes``."""
    dtype = DTYPE_NAMES.get(buf.dtype, str(buf.dtype))
    reason = lane.can_run("allreduce", dtype, op, nodes)
    if reason is not None:
        raise LaneError(f"{lane.name} allreduce: {reason}")
    return dtype


def refuse_program(lane: str, program: Any, what: str = "allreduce") -> None:
    """LaneError when a lane that runs no programs is handed one (only the tcp lane runs them)."""
    if program is not None:
        raise LaneError(f"{lane} {what}: lane '{lane}' cannot run algorithm "
                        f"{getattr(program, 'name', program)!r}; programs run on the tcp lane only")


def memory_view(tensor: torch.Tensor) -> memoryview:
    """A writable, zero-copy byte view of a flat contiguous CPU tensor of any dtype (what a
    :class:`Transport` moves)."""
    flat = tensor.detach().reshape(-1)
    if flat.numel() == 0:  # may carry any stride (NumPy's empty arrays give 0), which view() refuses
        return memoryview(bytearray())
    if flat.stride(0) != 1:  # a one-element tensor counts as contiguous whatever its stride
        flat = flat.as_strided((flat.numel(),), (1,))
    if flat.dtype != torch.uint8:
        flat = flat.view(torch.uint8)
    return memoryview(flat.numpy())


class LaneError(Exception):
    """An inter-node phase failed; ``code`` is a protocol error code.

    ``peer_died``: a peer daemon's connection broke; ``timeout``: the call
    exceeded its deadline; ``internal``: anything else.  After a failure the
    lane may refuse further ops with the peers involved (their streams may be
    out of step), always with a LaneError naming the first failure.
    """

    def __init__(self, message: str, code: str = "internal") -> None:
        super().__init__(message)
        self.code = code


class Lane(Protocol):
    """One backend's inter-node lane.  All tensors are flat, contiguous, on the CPU."""

    name: str

    def can_run(self, primitive: str, dtype: str, reduce_op: str | None, nodes: tuple[int, ...]) -> str | None:
        """None if this lane can run ``primitive`` for ``dtype`` (and ``reduce_op``) on ``nodes``; else why not."""

    def allreduce(self, nodes: tuple[int, ...], buf: torch.Tensor, op: str, timeout: float,
                  program: Any = None) -> None:
        """In place: every node's ``buf`` becomes the element-wise reduction of all nodes' ``buf``.

        ``program`` (a ``commd.algorithms.catalog.Chosen``): run that released program instead of
        the lane's own algorithm; a lane that runs no programs refuses it with a LaneError."""

    def broadcast(self, nodes: tuple[int, ...], buf: torch.Tensor, root: int, timeout: float) -> None:
        """``root`` (a node rank in ``nodes``) sends its ``buf`` into every other node's ``buf``."""

    def allgatherv(
        self, nodes: tuple[int, ...], inp: torch.Tensor, out: torch.Tensor, sizes: list[int], timeout: float
    ) -> None:
        """uint8 tensors: ``out`` = concatenation over ``nodes`` (in order) of each node's ``inp``;
        ``sizes[i]`` is the byte length of node ``nodes[i]``'s ``inp``; ``out`` has ``sum(sizes)`` bytes."""

    def alltoallv(
        self,
        nodes: tuple[int, ...],
        inp: torch.Tensor,
        in_sizes: list[int],
        out: torch.Tensor,
        out_sizes: list[int],
        timeout: float,
        program: Any = None,
    ) -> None:
        """uint8 tensors: ``inp`` is split into consecutive blocks of ``in_sizes[i]`` bytes for node
        ``nodes[i]``; ``out`` receives consecutive blocks of ``out_sizes[i]`` bytes from ``nodes[i]``.
        The block for this node itself is copied locally.  ``program``: an all-to-all program
        runs it instead (every block then has one size); refused as by ``allreduce``."""

    def send(self, dst: int, buf: torch.Tensor, timeout: float) -> None:
        """Send ``buf`` (uint8) to node ``dst``, which calls ``recv`` with the same byte length."""

    def recv(self, src: int, buf: torch.Tensor, timeout: float) -> None:
        """Receive into ``buf`` (uint8) from node ``src``."""

    def barrier(self, nodes: tuple[int, ...], timeout: float) -> None:
        """Return once every node of ``nodes`` has entered the barrier."""

    def close(self) -> None:
        """Release sockets/communicators; pending and later calls raise LaneError."""


class TransportError(Exception):
    """A :class:`Transport` failed during ``wait``: ``peer`` is the node at fault (None when no
    single one is, e.g. a timeout over several), ``code`` a LaneError code, ``message`` why.

    The lane that owns the transport turns it into a LaneError for the call and decides which
    streams are now unusable; algorithms let it pass through.
    """

    def __init__(self, peer: int | None, code: str, message: str) -> None:
        super().__init__(message)
        self.peer = peer
        self.code = code
        self.message = message


#: Called with no arguments when a posted transfer is complete (see ``Transport``).
Done = Callable[[], None]


@runtime_checkable
class Transport(Protocol):
    """Byte movement among nodes for one lane call: what collective algorithms are written against.

    Contract:

    * ``post_send(peer, view, done)`` / ``post_recv(peer, view, done)`` queue a transfer of
      exactly ``len(view)`` bytes to / from node ``peer`` and return at once; nothing is
      guaranteed to move before ``wait``.  The caller must not touch ``view`` until the
      transfer is done.  A receive must be posted with the length the sender posted (a
      mismatch is a ``TransportError``, never a partial or merged read).
    * Ordering: transfers to one peer leave in the order they were posted, and receives
      from one peer are filled in the order they were posted, so the k-th send of A to B
      lands in the k-th receive B posted from A.  Different peers are independent.
    * ``done`` (optional) is called with no arguments once its transfer is complete, on
      the thread running ``wait`` and from inside it, in completion order per peer and
      direction.  It may post further transfers; the same ``wait`` completes them too
      (this is how pipelined algorithms forward a chunk as soon as it arrives).
    * ``wait()`` returns when every posted transfer, including those posted by ``done``
      callbacks, is complete.  It raises ``TransportError`` on a broken or closed
      connection, a stream out of step, or when the call's deadline passes (the deadline
      belongs to the lane call, fixed when the transport was handed to the algorithm).
      After an error every posted transfer is abandoned and its buffers are the
      caller's again; the lane, not the algorithm, decides what that means for later calls.
    * ``chunk_bytes`` is the piece size pipelined algorithms cut large transfers into.
    * One thread uses a transport at a time; a transport is not reused across lane calls.
    """

    chunk_bytes: int

    def post_send(self, peer: int, view: memoryview, done: Done | None = None) -> None:
        """Queue ``view``'s bytes for node ``peer`` (after everything queued to it before)."""

    def post_recv(self, peer: int, view: memoryview, done: Done | None = None) -> None:
        """Queue a receive of exactly ``len(view)`` bytes from node ``peer`` into ``view``."""

    def wait(self) -> None:
        """Complete everything posted (and posted by completions); TransportError on failure."""
