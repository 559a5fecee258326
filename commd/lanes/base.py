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
"""

from __future__ import annotations

from typing import Protocol

import torch

from commd.kernels.reduce import DTYPE_NAMES

#: Reduce ops a lane must implement (after the daemon's rewriting of avg/premul_sum).
LANE_REDUCE_OPS = frozenset({"sum", "product", "min", "max", "band", "bor", "bxor"})

#: Lane methods, which are also the names used by ``Lane.can_run``.
PRIMITIVES = ("allreduce", "broadcast", "allgatherv", "alltoallv", "send", "recv", "barrier")


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
    """One backend's inter-node executor.  All tensors are flat, contiguous, on the CPU."""

    name: str

    def can_run(self, primitive: str, dtype: str, reduce_op: str | None, nodes: tuple[int, ...]) -> str | None:
        """None if this lane can run ``primitive`` for ``dtype`` (and ``reduce_op``) on ``nodes``; else why not."""

    def allreduce(self, nodes: tuple[int, ...], buf: torch.Tensor, op: str, timeout: float) -> None:
        """In place: every node's ``buf`` becomes the element-wise reduction of all nodes' ``buf``."""

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
    ) -> None:
        """uint8 tensors: ``inp`` is split into consecutive blocks of ``in_sizes[i]`` bytes for node
        ``nodes[i]``; ``out`` receives consecutive blocks of ``out_sizes[i]`` bytes from ``nodes[i]``.
        The block for this node itself is copied locally."""

    def send(self, dst: int, buf: torch.Tensor, timeout: float) -> None:
        """Send ``buf`` (uint8) to node ``dst``, which calls ``recv`` with the same byte length."""

    def recv(self, src: int, buf: torch.Tensor, timeout: float) -> None:
        """Receive into ``buf`` (uint8) from node ``src``."""

    def barrier(self, nodes: tuple[int, ...], timeout: float) -> None:
        """Return once every node of ``nodes`` has entered the barrier."""

    def close(self) -> None:
        """Release sockets/communicators; pending and later calls raise LaneError."""
