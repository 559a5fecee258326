"""Worker programs for tests/test_observe.py (spawned processes: importable by name)."""

from __future__ import annotations

from typing import Any

import numpy as np
import torch

from commd.client import ops
from commd.client.errors import MismatchError

#: What ``known_ops`` runs on group "world": (kind, element count of float32, how many).
KNOWN_OPS = [("allreduce", 100, 7), ("broadcast", 1000, 3), ("allreduce", 70_000, 2)]


def known_ops(ctx: Any, rounds: int = 1) -> str:
    """Runs KNOWN_OPS ``rounds`` times, checking results; between rounds waits for the test's "go"."""
    client = ctx.connect()
    me, world = ctx.rank, ctx.world_size
    for round_ in range(rounds):
        for kind, n, count in KNOWN_OPS:
            for i in range(count):
                values = [np.arange(n, dtype=np.float32) * (r + 1) + i for r in range(world)]
                t = torch.from_numpy(values[me].copy())
                if kind == "allreduce":
                    ops.all_reduce(client, t).wait(60)
                    want = np.sum(values, axis=0)
                else:
                    ops.broadcast(client, t, 0).wait(60)
                    want = values[0]
                if not np.allclose(t.numpy(), want):
                    raise AssertionError(f"{kind} #{i} of {n}: got {t.numpy()[:4]} want {want[:4]}")
        ctx.event(f"round{round_}")
        if ctx.command() != "go":
            raise AssertionError("expected 'go' from the test")
    # One op the ranks disagree on: every rank gets a 'mismatch' error.
    t = torch.zeros(10 + me, dtype=torch.float32)
    try:
        ops.all_reduce(client, t).wait(60)
    except MismatchError:
        pass
    else:
        raise AssertionError("a mismatched all_reduce succeeded")
    ctx.event("mismatched")
    if ctx.command() != "go":
        raise AssertionError("expected 'go' from the test")
    client.close()
    return "ok"


def profiled_all_reduce(ctx: Any, port: int) -> list[str]:
    """dist.all_reduce and dist.broadcast over backend commd under torch.profiler; the event names."""
    import torch.distributed as dist
    from torch.profiler import ProfilerActivity, profile

    dist.init_process_group("commd", init_method=f"tcp://127.0.0.1:{port}", rank=ctx.rank,
                            world_size=ctx.world_size)
    try:
        t = torch.ones(16) * (ctx.rank + 1)
        with profile(activities=[ProfilerActivity.CPU]) as prof:
            dist.all_reduce(t)
            dist.broadcast(t, 0)
        if not torch.equal(t, torch.full((16,), float(sum(range(1, ctx.world_size + 1))))):
            raise AssertionError(f"wrong all_reduce result {t}")
        return sorted({e.name for e in prof.events()})
    finally:
        dist.destroy_process_group()
