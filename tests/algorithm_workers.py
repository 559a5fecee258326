"""Worker programs for the wire tests' fabrics (spawned processes import this module).

Every rank computes the NumPy reference of every rank's data itself (the data is a function
of rank, size and salt), so each check is independent of commd.
"""

from __future__ import annotations

from typing import Any

import numpy as np
import torch

from commd.client import ops

DTYPES = {"float32": np.float32, "int64": np.int64, "float64": np.float64, "int32": np.int32}


def data(rank: int, n: int, dtype: str, salt: int) -> np.ndarray:
    rng = np.random.default_rng(rank * 7919 + n * 31 + salt)
    return rng.integers(-50, 50, n).astype(DTYPES[dtype])


def allreduces(ctx: Any, algos: list[str | None], sizes: list[int], cases: list[tuple[str, str]],
               client: Any = None) -> str:
    """For each algorithm (None: no hint), size and (dtype, op): all_reduce equals NumPy on every rank."""
    own = client is None
    client = client or ctx.connect()
    salt = 0
    for algo in algos:
        for n in sizes:
            for dtype, op in cases:
                salt += 1
                t = torch.from_numpy(data(ctx.rank, n, dtype, salt))
                ops.all_reduce(client, t, op, algo=algo).wait(60)
                stack = np.stack([data(r, n, dtype, salt) for r in range(ctx.world_size)])
                want = {"sum": stack.sum(0), "max": stack.max(0), "min": stack.min(0)}[op].astype(DTYPES[dtype])
                if not np.array_equal(t.numpy(), want):
                    raise AssertionError(f"algo {algo} n={n} {dtype} {op}: got {t.numpy()[:6]} want {want[:6]}")
    if own:
        client.close()
    return "ok"


def failing_hints(ctx: Any, names: list[str]) -> list[str]:
    """An all_reduce hinted with each name must fail: the message of each (after each, a plain op works)."""
    client = ctx.connect()
    messages = []
    for name in names:
        t = torch.ones(5)
        try:
            ops.all_reduce(client, t, algo=name).wait(60)
            messages.append("no error")
        except Exception as exc:  # noqa: BLE001 - the message is the result
            messages.append(f"{type(exc).__name__}: {exc}")
        t = torch.ones(6)
        ops.all_reduce(client, t).wait(60)
        assert t.tolist() == [float(ctx.world_size)] * 6, t
    client.close()
    return messages


def alltoalls(ctx: Any, algos: list[str | None], blocks: list[int], client: Any = None) -> str:
    """All-to-all of equal int64 blocks with each algorithm: block j of rank i lands at block i of rank j."""
    own = client is None
    client = client or ctx.connect()
    world = ctx.world_size
    for salt, (algo, block) in enumerate((a, b) for a in algos for b in blocks):
        inp = torch.from_numpy(data(ctx.rank, world * block, "int64", salt))
        out = torch.zeros(world * block, dtype=torch.int64)
        ops.all_to_all(client, out, inp, [block] * world, [block] * world, algo=algo).wait(60)
        want = np.concatenate([data(r, world * block, "int64", salt)[ctx.rank * block:(ctx.rank + 1) * block]
                               for r in range(world)])
        if not np.array_equal(out.numpy(), want):
            raise AssertionError(f"algo {algo} block {block}: got {out.numpy()[:6]} want {want[:6]}")
    if own:
        client.close()
    return "ok"


def allreduces_and_alltoalls(ctx: Any, algos: list[str | None], sizes: list[int], cases: list[tuple[str, str]],
                             a2a_algos: list[str | None], blocks: list[int]) -> str:
    """``allreduces`` then ``alltoalls`` in one worker (one process start-up for both)."""
    client = ctx.connect()
    allreduces(ctx, algos, sizes, cases, client)
    alltoalls(ctx, a2a_algos, blocks, client)
    client.close()
    return "ok"
