"""What the commd.ft tests' ranks run, and the single-process model they are checked against."""

from __future__ import annotations

import os
import signal
from typing import Any

import torch

LR = 0.1
MOMENTUM = 0.9
#: DDP's bucket limit in the tests: the 64x64 layer has a bucket of its own (two all-reduces per step).
DDP_KWARGS = {"bucket_cap_mb": 0.01}


def mlp() -> torch.nn.Module:
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(16, 64), torch.nn.Tanh(), torch.nn.Linear(64, 64), torch.nn.Tanh(),
                               torch.nn.Linear(64, 4))


def batch(step: int, rank: int) -> torch.Tensor:
    return torch.randn(8, 16, generator=torch.Generator().manual_seed(step * 100 + rank))


def loss_of(model: Any, x: torch.Tensor) -> torch.Tensor:
    return model(x).pow(2).mean()


def reference(steps: int, world: int, redone_step: int, survivors: list[int]) -> list[torch.Tensor]:
    """One process: each step's gradient is the mean over the participants' batches, as DDP's; every
    rank takes part before ``redone_step``, the survivors from it on."""
    model = mlp()
    optimizer = torch.optim.SGD(model.parameters(), lr=LR, momentum=MOMENTUM)
    for step in range(steps):
        ranks = list(range(world)) if step < redone_step else survivors
        grads = [torch.zeros_like(p) for p in model.parameters()]
        for rank in ranks:
            model.zero_grad()
            loss_of(model, batch(step, rank)).backward()
            for total, p in zip(grads, model.parameters(), strict=True):
                total += p.grad / len(ranks)
        for p, g in zip(model.parameters(), grads, strict=True):
            p.grad = g
        optimizer.step()
    return [p.detach().clone() for p in model.parameters()]


def guarded_training(rank: int, world: int, init_method: str, steps: int, kill: Any = None,
                     min_ranks: int = 1, recover_timeout: float = 60.0) -> dict[str, Any]:
    """``steps`` guarded DDP steps of ``mlp``; ``kill(step, where)`` is called at the start of each
    step's forward ("forward") and when the first layer's gradient is computed ("backward"), after
    the later layers' bucket went out.  Returns the parameters and the recoveries."""
    from datetime import timedelta

    import torch.distributed as dist
    from torch.nn.parallel import DistributedDataParallel

    import commd.ft

    dist.init_process_group("commd", init_method=init_method, rank=rank, world_size=world,
                            timeout=timedelta(seconds=min(60.0, recover_timeout)))
    model = DistributedDataParallel(mlp(), **DDP_KWARGS)
    optimizer = torch.optim.SGD(model.parameters(), lr=LR, momentum=MOMENTUM)
    guard = commd.ft.Guard(model, optimizer, ddp_kwargs=DDP_KWARGS, min_ranks=min_ranks,
                           recover_timeout=recover_timeout)
    first_layer = model.module[0].weight

    def train_step(ddp: Any, step: int) -> float:
        if kill is not None:
            kill(step, "forward")
            handle = first_layer.register_hook(lambda grad: kill(step, "backward"))
        loss = loss_of(ddp, batch(step, rank))
        loss.backward()
        if kill is not None:
            handle.remove()
        return float(loss)

    for step in range(steps):
        guard.step(train_step, step)
    return {"params": [p.detach().clone() for p in guard.model.module.parameters()],
            "recoveries": [(r.step, r.gone, r.survivors, r.seconds) for r in guard.recoveries]}


def sigkill_self() -> None:
    os.kill(os.getpid(), signal.SIGKILL)


def ft_on_nodes(ctx: Any, port: int, steps: int, fail_step: int, victims: list[int]) -> dict[str, Any]:
    """Guarded training on the test's simulated nodes: the ranks in ``victims`` stop at ``fail_step``
    and wait to be killed by the test (with their daemon, or alone)."""

    def kill(step: int, where: str) -> None:
        if ctx.rank in victims and step == fail_step and where == "forward":
            ctx.event("at fail step")
            ctx.command()  # the test kills this rank here

    os.environ["COMMD_JOB"] = ctx.job  # the test's daemons
    out = guarded_training(ctx.rank, ctx.world_size, f"tcp://127.0.0.1:{port}", steps, kill)
    out["params"] = [p.tolist() for p in out["params"]]
    return out
