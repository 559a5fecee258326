"""The NCCL lane: torch's ProcessGroupNCCL between the daemons' GPUs.

Same scheme as the Gloo lane (one process group per node subset, created
lazily under a PrefixStore named after it, see :mod:`commd.lanes.torch_group`), but
the tensors are CUDA tensors on the lane's device and completion is polled:

* NCCL's communicator init blocks without a timeout until every member
  arrives, so a new group first meets its members through the store with a
  bounded wait, and then connects eagerly while everyone is known present;
* a call polls ``Work.is_completed()`` until its deadline, then aborts the
  group (``ncclCommAbort``) so the kernel stops touching the buffer;
* torch's NCCL watchdog (which by default tears the process down on a
  timeout) is given the call's time plus a grace, so the lane's own deadline
  always comes first.

The caller hands over buffers that are ready on the device's current stream
(ProcessGroupNCCL orders its stream after it); on return the work is complete.
"""

from __future__ import annotations

import time
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist

from commd.lanes.base import (
    BITWISE_OPS,
    COMPLEX_DTYPES,
    LANE_REDUCE_OPS,
    LaneError,
    check_contiguous,
    refusal,
)
from commd.lanes.torch_group import TORCH_REDUCE_OPS, TorchGroupLane

#: Seconds torch's NCCL watchdog waits beyond a call's own deadline.
WATCHDOG_GRACE_S = 60.0

#: NCCL reduces uint8-coded bools: OR is MAX and AND is MIN on 0/1 bytes (there is no XOR).
_BOOL_OPS = {"sum": "max", "max": "max", "bor": "max", "product": "min", "min": "min", "band": "min"}

MIN_SLEEP_S = 20e-6
MAX_SLEEP_S = 1e-3


def nccl_unavailable(device: int | None = None) -> str | None:
    """Why this process cannot run the NCCL lane (on ``device``), or None if it can."""
    if not dist.is_available():
        return "this torch build has no torch.distributed"
    if torch.version.cuda is None:
        return f"torch {torch.__version__} is a CPU-only build (no CUDA, no NCCL)"
    if not dist.is_nccl_available():
        return f"torch {torch.__version__} was built without NCCL"
    if not torch.cuda.is_available():
        return f"torch (CUDA {torch.version.cuda}) sees no usable CUDA device"
    count = torch.cuda.device_count()
    if device is not None and not 0 <= device < count:
        return f"no CUDA device {device}: this process sees {count}"
    return None


def nccl_can_run(primitive: str, dtype: str, reduce_op: str | None, nodes: tuple[int, ...], nnodes: int) -> str | None:
    """``NcclLane.can_run`` without a lane or a GPU (a pure function of names).

    What torch's ProcessGroupNCCL runs: no int16 datatype, no bitwise reductions
    (bool AND/OR become MIN/MAX), complex through SUM only (as real pairs).
    """
    reason = refusal("nccl", primitive, dtype, reduce_op, nodes, nnodes)
    if reason is not None or primitive != "allreduce":
        return reason
    if reduce_op not in LANE_REDUCE_OPS:
        return f"lane 'nccl' cannot reduce with {reduce_op!r} (lane ops: {sorted(LANE_REDUCE_OPS)})"
    if dtype == "int16":
        return "NCCL has no int16 datatype"
    if dtype == "bool":
        return None if reduce_op in _BOOL_OPS else "NCCL has no XOR reduction (bool BXOR)"
    if reduce_op in BITWISE_OPS:
        if dtype in COMPLEX_DTYPES or dtype.startswith(("float", "bfloat")):
            return f"reduce op {reduce_op.upper()} needs an integer or bool dtype, got {dtype}"
        return f"NCCL has no bitwise reductions ({reduce_op.upper()} on {dtype})"
    if dtype in COMPLEX_DTYPES and reduce_op != "sum":
        if reduce_op in ("min", "max"):
            return f"reduce op {reduce_op.upper()} is undefined for complex dtype {dtype}"
        return f"NCCL reduces complex tensors with SUM only, not {reduce_op.upper()}"
    return None


class NcclLane(TorchGroupLane):
    """Inter-node lane over NCCL on CUDA device ``device``; every tensor must live there.

    ``timeout`` is the default for torch's NCCL watchdog; each call's own
    timeout bounds its wait (group creation included).
    """

    name = "nccl"

    def __init__(
        self,
        store: dist.Store,
        node_rank: int,
        nnodes: int,
        device: int,
        timeout: float,
        prefix: str = "nccl/",
    ) -> None:
        reason = nccl_unavailable(device)
        if reason is not None:
            raise LaneError(f"nccl lane unavailable: {reason}")
        super().__init__(store, node_rank, nnodes, timeout, prefix)
        self.device = torch.device("cuda", device)

    def can_run(self, primitive: str, dtype: str, reduce_op: str | None, nodes: tuple[int, ...]) -> str | None:
        """None if NCCL runs it (see ``nccl_can_run``); else why not."""
        return nccl_can_run(primitive, dtype, reduce_op, nodes, self.nnodes)

    def _check_tensor(self, what: str, tensor: torch.Tensor) -> None:
        if tensor.device != self.device:
            raise LaneError(f"nccl {what}: tensors must be on {self.device}, got {tensor.device}")
        check_contiguous(self.name, what, tensor)

    def _create_group(self, store: dist.Store, rank: int, size: int, timeout: float) -> Any:
        # Meet through the store first (bounded), because ncclCommInitRank waits for
        # every member without any timeout.
        store.set(f"arrived/{rank}", b"1")
        store.wait([f"arrived/{r}" for r in range(size)], timedelta(seconds=timeout))
        options = dist.ProcessGroupNCCL.Options()
        options.is_high_priority_stream = False
        options._timeout = timedelta(seconds=max(self.timeout, timeout) + WATCHDOG_GRACE_S)
        group = dist.ProcessGroupNCCL(store, rank, size, options)
        with torch.cuda.device(self.device):
            group.eager_connect_single_device(self.device)
        return group

    def _op_timeout(self, left: float) -> timedelta:
        return timedelta(seconds=left + WATCHDOG_GRACE_S)

    def _wait(self, work: Any, timeout: float, sliced: bool) -> None:
        """Poll the work's CUDA events until done or the deadline (work.wait would block unbounded)."""
        deadline = time.monotonic() + timeout
        delay = MIN_SLEEP_S
        while not work.is_completed():
            if self._closed:
                raise RuntimeError("nccl lane closed")
            left = deadline - time.monotonic()
            if left <= 0:
                raise TimeoutError(f"NCCL work timed out after {timeout:.3g}s")
            time.sleep(min(delay, left))
            delay = min(delay * 2, MAX_SLEEP_S)
        work.wait()  # raises the work's error if it failed; orders the current stream after it

    def _run(self, what: str, nodes: tuple[int, ...], timeout: float, start: Any, sliced: bool = True) -> None:
        with torch.cuda.device(self.device):
            super()._run(what, nodes, timeout, start, sliced)

    def _reduce_refusal(self, dtype: str, op: str) -> str | None:
        return nccl_can_run("allreduce", dtype, op, (), self.nnodes)

    def _torch_reduce_op(self, dtype: str, op: str) -> dist.ReduceOp:
        return TORCH_REDUCE_OPS[_BOOL_OPS[op] if dtype == "bool" else op]

    def barrier(self, nodes: tuple[int, ...], timeout: float) -> None:
        """A one-byte MAX allreduce on the device (ProcessGroupNCCL's barrier guesses its device)."""
        nodes = self._check_nodes("barrier", nodes)
        if len(nodes) == 1:
            return
        token = torch.zeros(1, dtype=torch.uint8, device=self.device)
        opts = dist.AllreduceOptions()
        opts.reduceOp = dist.ReduceOp.MAX

        def start(group: Any, left: float) -> Any:
            opts.timeout = self._op_timeout(left)
            return group.allreduce([token], opts)

        self._run("barrier", nodes, timeout, start)
