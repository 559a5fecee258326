"""The single-process model the commd.ft tests compare against, for any membership over time."""

from __future__ import annotations

import torch
from ft_workers import LR, MOMENTUM, batch, loss_of, mlp


def reference_with_members(steps: int, members_at: dict[int, list[int]]) -> list[torch.Tensor]:
    """One process; step s averages the gradients of the ranks ``members_at`` gives for the latest
    step at or before s, as DDP (and HSDP) does over its group."""
    model = mlp()
    optimizer = torch.optim.SGD(model.parameters(), lr=LR, momentum=MOMENTUM)
    for step in range(steps):
        ranks = members_at[max(s for s in members_at if s <= step)]
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
