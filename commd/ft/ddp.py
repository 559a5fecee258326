"""``Guard``: a DDP training loop that goes on when a rank dies, and takes a replacement back in.

The survivors wrap the same module in a new DDP on their group and check that their parameters and
optimizer states agree.  A replacement gets the
parameters, buffers and optimizer state of the lowest running rank, broadcast through the daemons.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel

from commd.ft.seats import (
    JOIN_TIMEOUT_S,
    RECOVER_TIMEOUT_S,
    Seats,
    agree_equal,
    broadcast_bytes,
    from_bytes,
    tensor_digest,
    to_bytes,
)


class Guard(Seats):
    """Runs training steps of a DDP model so that the survivors go on when a rank dies, and a
    replacement of a lost rank rejoins.

    ``model``: a module (the guard wraps it in DDP on the default group, or joins it to the running
    job if this process replaces a lost rank) or a ``DistributedDataParallel`` on a ``commd`` group
    (no rejoining then: its constructor already needed every rank); ``ddp_kwargs``: the DDP options;
    ``min_ranks``: fewer survivors than this is unrecoverable.
    """

    def __init__(self, model: torch.nn.Module, optimizer: torch.optim.Optimizer, *,
                 ddp_kwargs: dict[str, Any] | None = None, min_ranks: int = 1,
                 recover_timeout: float = RECOVER_TIMEOUT_S, join_timeout: float = JOIN_TIMEOUT_S) -> None:
        if isinstance(model, DistributedDataParallel):
            group, module = model.process_group, model.module
        elif isinstance(model, torch.nn.Module):
            group, module = dist.group.WORLD, model
        else:
            raise TypeError(f"commd.ft.Guard needs a torch module or a DistributedDataParallel, not {type(model).__name__}")
        if dist.get_backend(group) != "commd":
            raise ValueError(f"commd.ft.Guard needs a model on a 'commd' group, not {dist.get_backend(group)!r}")
        super().__init__(tuple(dist.get_process_group_ranks(group)), group, min_ranks=min_ranks,
                         recover_timeout=recover_timeout, join_timeout=join_timeout)
        self.optimizer = optimizer
        self.ddp_kwargs = dict(ddp_kwargs or {})
        self._module = module
        if isinstance(model, DistributedDataParallel):
            self.model = model
            return
        admission = self._replacement()
        if admission is None:
            self.model = DistributedDataParallel(module, process_group=group, **self.ddp_kwargs)
        else:
            self._join(admission)

    def _rebuild(self, group: Any, members: list[int], joining: list[int], tag: str) -> tuple[Any, int]:
        moved = self._send_state(group, min(r for r in members if r not in joining), joining) if joining else 0
        # the members hold the same parameters already (the commit; the state sent), which
        # _check_states confirms: DDP's own broadcast of them would only lengthen the stall
        options = {"init_sync": False, **self.ddp_kwargs}
        return DistributedDataParallel(self._module, process_group=group, **options), moved

    def _install(self, built: Any) -> None:
        old = getattr(self, "model", None)  # (a replacement has none yet)
        if isinstance(old, DistributedDataParallel) and old is not built:
            # Its reducer's hooks stay on the parameters while anything holds it (the user's
            # own reference does), and a backward that failed midway leaves it expecting the
            # rest: the redone backward would reach it ("mark a variable ready only once").
            old._remove_autograd_hooks()
        self.model = built

    def _check_states(self, built: Any, group: Any, members: list[int]) -> None:
        """The members' parameters, buffers and optimizer states must be equal: a survivor that had
        stepped where another had not would diverge silently."""
        states = [value for state in self.optimizer.state.values() for value in state.values()
                  if isinstance(value, torch.Tensor)]
        agree_equal(tensor_digest([*self._module.state_dict().values(), *states]), group, members,
                    "parameters or optimizer states")

    def _send_state(self, group: Any, source: int, joining: list[int]) -> int:
        """``source``'s parameters, buffers and optimizer state, broadcast to the group and taken by
        the ``joining`` ranks; returns the bytes sent.  The other running ranks keep their own state,
        so ``_check_states`` then compares it with the source's (instead of overwriting a difference)."""
        moved = 0
        me = dist.get_rank()
        with torch.no_grad():
            by_dtype: dict[torch.dtype, list[torch.Tensor]] = {}
            for tensor in self._module.state_dict().values():
                by_dtype.setdefault(tensor.dtype, []).append(tensor)
            for tensors in by_dtype.values():
                if me == source:
                    flat = torch.cat([t.reshape(-1) for t in tensors])
                else:
                    flat = torch.empty(sum(t.numel() for t in tensors), dtype=tensors[0].dtype)
                dist.broadcast(flat, src=source, group=group)
                if me in joining:
                    offset = 0
                    for tensor in tensors:
                        tensor.copy_(flat[offset:offset + tensor.numel()].view_as(tensor))
                        offset += tensor.numel()
                moved += flat.nbytes
        state = broadcast_bytes(to_bytes(self.optimizer.state_dict()) if me == source else b"", source, group)
        if me in joining:
            self.optimizer.load_state_dict(from_bytes(state))
        return moved + len(state)
