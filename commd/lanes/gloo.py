"""The Gloo lane: torch's ProcessGroupGloo built directly on the job's store.

One process group per node subset, created lazily (see :mod:`commd.lanes.torch_group`,
which holds everything this lane shares with the NCCL lane); this module says how a
Gloo group is built and which dtype/op combinations Gloo really runs.
"""

from __future__ import annotations

from datetime import timedelta
from typing import Any

import torch.distributed as dist

from commd.lanes.base import COMPLEX_DTYPES
from commd.lanes.torch_group import TORCH_REDUCE_OPS, TorchGroupLane

#: Gloo sums bool tensors as bytes (three True give the byte 3, 256 wrap to 0), so bool
#: sum/product go as BOR/BAND, which are commd's OR/AND and keep every byte 0 or 1.
_BOOL_OPS = {"sum": "bor", "max": "bor", "bor": "bor", "product": "band", "min": "band", "band": "band",
             "bxor": "bxor"}


class GlooLane(TorchGroupLane):
    """Inter-node lane over Gloo (TCP), bound to the daemon's own interface address ``ip``.

    ``timeout`` is Gloo's default op timeout for the groups; every call's own
    timeout bounds its wait, the creation of a new subset group included.
    ``prefix`` separates several lanes sharing one store.
    """

    name = "gloo"

    def __init__(
        self,
        store: dist.Store,
        node_rank: int,
        nnodes: int,
        ip: str,
        timeout: float,
        prefix: str = "gloo/",
    ) -> None:
        super().__init__(store, node_rank, nnodes, timeout, prefix)
        self.ip = ip
        # One device (listening socket + event loop) serves every subset group.
        self._device = dist.ProcessGroupGloo.create_device(hostname=ip)

    def _create_group(self, store: dist.Store, rank: int, size: int, timeout: float) -> Any:
        options = dist.ProcessGroupGloo._Options()
        options._devices = [self._device]
        # Gloo uses this timeout for the rendezvous through the store and the full-mesh
        # connect, which is what bounds creating a group whose members do not all come.
        options._timeout = timedelta(seconds=timeout)
        group = dist.ProcessGroupGloo(store, rank, size, options)
        group._set_default_timeout(timedelta(seconds=self.timeout))
        return group

    def _reduce_refusal(self, dtype: str, op: str) -> str | None:
        # Probed on torch 2.13's Gloo: no int16 kernels at all ("Invalid scalar type"),
        # complex only through SUM (reduced as real pairs).  float16/bfloat16 and bool do all
        # arithmetic ops; bool goes through BOR/BAND (see _BOOL_OPS).
        if dtype == "int16":
            return "Gloo has no int16 reductions (torch's Gloo fails with 'Invalid scalar type')"
        if dtype in COMPLEX_DTYPES and op != "sum":
            return f"Gloo reduces complex tensors with SUM only, not {op.upper()}"
        return None

    def _torch_reduce_op(self, dtype: str, op: str) -> dist.ReduceOp:
        return TORCH_REDUCE_OPS[_BOOL_OPS[op] if dtype == "bool" else op]
