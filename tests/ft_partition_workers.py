"""What the ranks of tests/test_ft_partition.py run: guarded training on the test's simulated nodes."""

from __future__ import annotations

import os
from typing import Any


def train_through_a_pause(ctx: Any, port: int, steps: int, pause_step: int, paused: list[int],
                          store_host: str = "127.0.0.1") -> dict[str, Any]:
    """Guarded training; the ranks in ``paused`` tell the test when they reach ``pause_step`` (and their
    pid) and wait for its go (the test stops their node, or cuts its link, meanwhile).  Rank 0 hosts
    the job's store at ``store_host``.  Returns the parameters and what the guard did, or the error
    that ended the training."""
    from ft_workers import guarded_training

    def hold(step: int, where: str) -> None:
        if ctx.rank in paused and step == pause_step and where == "forward":
            ctx.event("at pause step", os.getpid())
            ctx.command()

    os.environ["COMMD_JOB"] = ctx.job
    try:
        out = guarded_training(ctx.rank, ctx.world_size, f"tcp://{store_host}:{port}", steps, hold)
    except Exception as exc:  # the test judges it
        return {"error": f"{type(exc).__name__}: {exc}"}
    out["params"] = [p.tolist() for p in out["params"]]
    return out
