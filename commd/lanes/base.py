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

#: Reduce ops a lane must implement (after the daemon's rewriting of avg/premul_sum).
LANE_REDUCE_OPS = frozenset({"sum", "product", "min", "max", "band", "bor", "bxor"})

#: Lane methods, which are also the names used by ``Lane.can_run``.
PRIMITIVES = ("allreduce", "broadcast", "allgatherv", "alltoallv", "send", "recv", "barrier")


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
