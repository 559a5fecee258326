"""Worker programs for the all-gather-by-program and AllToNext fabric tests (spawned processes import it).

Every rank computes the NumPy reference of every rank's data itself (the data is a function
of rank, count and salt), so each check is independent of commd.
"""

from __future__ import annotations

from typing import Any

import numpy as np
import torch

from commd.client import ops

DTYPES = {"float32": np.float32, "int64": np.int64, "int32": np.int32, "uint8": np.uint8, "float64": np.float64}


def data(rank: int, n: int, dtype: str, salt: int) -> np.ndarray:
    rng = np.random.default_rng(rank * 7919 + n * 31 + salt)
    return rng.integers(0, 100, n).astype(DTYPES[dtype])


def allgathers(ctx: Any, algos: list[str | None], counts: list[int], dtypes: list[str]) -> str:
    """all_gather with each algorithm, count per rank and dtype equals NumPy's concatenation."""
    client = ctx.connect()
    world, salt = ctx.world_size, 0
    for algo in algos:
        for n in counts:
            for dtype in dtypes:
                salt += 1
                inp = torch.from_numpy(data(ctx.rank, n, dtype, salt))
                out = torch.full((world * n,), 7, dtype=inp.dtype)
                ops.all_gather(client, out, inp, algo=algo).wait(60)
                want = np.concatenate([data(r, n, dtype, salt) for r in range(world)])
                if not np.array_equal(out.numpy(), want):
                    raise AssertionError(f"algo {algo} n={n} {dtype}: got {out.numpy()[:8]} want {want[:8]}")
    client.close()
    return "ok"


def failing_allgather(ctx: Any, algo: str, counts: list[int]) -> str:
    """An all_gather of unequal counts (``counts[r]`` per rank) hinted with ``algo``: its error message."""
    client = ctx.connect()
    inp = torch.ones(counts[ctx.rank], dtype=torch.int32)
    out = torch.zeros(sum(counts), dtype=torch.int32)
    try:
        ops.all_gather(client, out, inp, counts, algo=algo).wait(60)
        message = "no error"
    except Exception as exc:  # noqa: BLE001 - the message is the result
        message = f"{type(exc).__name__}: {exc}"
    t = torch.ones(4)
    ops.all_reduce(client, t).wait(60)  # the fabric goes on
    assert t.tolist() == [float(ctx.world_size)] * 4, t
    client.close()
    return message


def alltonexts(ctx: Any, algos: list[str | None], counts: list[int], dtypes: list[str]) -> str:
    """commd's alltonext with each algorithm, count and dtype: rank r's output is rank r - 1's input
    (NumPy's shift), rank 0's output keeps what it held."""
    client = ctx.connect()
    salt = 0
    for algo in algos:
        for n in counts:
            for dtype in dtypes:
                salt += 1
                inp = torch.from_numpy(data(ctx.rank, n, dtype, salt))
                before = data(ctx.rank + 1000, n, dtype, salt)
                out = torch.from_numpy(before.copy())
                ops.alltonext(client, out, inp, algo=algo).wait(60)
                want = before if ctx.rank == 0 else data(ctx.rank - 1, n, dtype, salt)
                if not np.array_equal(out.numpy(), want):
                    raise AssertionError(f"rank {ctx.rank} algo {algo} n={n} {dtype}: got {out.numpy()[:8]} "
                                         f"want {want[:8]}")
    client.close()
    return "ok"


def alltonext_mismatch(ctx: Any, counts: list[int]) -> str:
    """alltonext with ``counts[r]`` elements on rank r: the error each rank gets (then a good one works)."""
    client = ctx.connect()
    n = counts[ctx.rank]
    try:
        ops.alltonext(client, torch.zeros(n), torch.ones(n)).wait(60)
        message = "no error"
    except Exception as exc:  # noqa: BLE001 - the message is the result
        message = f"{type(exc).__name__}: {exc}"
    out = torch.zeros(3)
    ops.alltonext(client, out, torch.full((3,), float(ctx.rank))).wait(60)
    assert out.tolist() == [float(max(ctx.rank - 1, 0))] * 3, out
    client.close()
    return message


def torch_alltonext(ctx: Any, port: int, algo: str | None, n: int, gather_algo: str | None = None) -> str:
    """``commd.alltonext`` from a torch program: on the default group and on a new group whose
    Options name the program (``algo``), with a torch group and with async_op; then, on that
    group, torch's all_gather and all_gather_into_tensor (run by ``gather_algo``) against NumPy."""
    import os
    from datetime import timedelta

    import torch.distributed as dist

    import commd

    os.environ["COMMD_JOB"] = ctx.job
    dist.init_process_group("commd", init_method=f"tcp://127.0.0.1:{port}", rank=ctx.rank,
                            world_size=ctx.world_size, timeout=timedelta(seconds=60))
    try:
        rank = dist.get_rank()
        send = torch.arange(n, dtype=torch.float32) + 1000 * rank
        recv = torch.full((n,), -1.0)
        assert commd.alltonext(send, recv) is None
        want = torch.full((n,), -1.0) if rank == 0 else torch.arange(n, dtype=torch.float32) + 1000 * (rank - 1)
        assert torch.equal(recv, want), (rank, recv[:4], want[:4])
        algos = {"alltonext": algo} if algo else {}
        if gather_algo:
            algos["all_gather"] = gather_algo
        options = commd.Options(algo=algos) if algos else None
        group = dist.new_group(list(range(ctx.world_size)), pg_options=options)
        recv2 = torch.zeros(n, dtype=torch.int64)
        work = commd.alltonext(send.to(torch.int64), recv2, group=group, async_op=True)
        work.wait()
        want2 = torch.zeros(n, dtype=torch.int64) if rank == 0 else want.to(torch.int64)
        assert torch.equal(recv2, want2), (rank, recv2[:4], want2[:4])
        world = ctx.world_size
        mine = torch.arange(n, dtype=torch.int32) * (rank + 1)
        flat = torch.zeros(world * n, dtype=torch.int32)
        dist.all_gather_into_tensor(flat, mine, group=group)
        parts = [torch.zeros(n, dtype=torch.int32) for _ in range(world)]
        dist.all_gather(parts, mine, group=group)
        want3 = np.concatenate([np.arange(n, dtype=np.int32) * (r + 1) for r in range(world)])
        assert np.array_equal(flat.numpy(), want3) and np.array_equal(torch.cat(parts).numpy(), want3)
    finally:
        dist.destroy_process_group()
    return "ok"


def programs(ctx: Any, plan: list[tuple[str, str]], sizes: list[int]) -> str:
    """Each (program, collective) of ``plan`` by hint, on every size: all-reduce (int64 sum, float32
    sum of integer-valued data, so exact, and float32 max), all-gather and all-to-all (int64 and
    float32; ``sizes`` elements per rank, or per block), each equal to NumPy."""
    client = ctx.connect()
    world, salt = ctx.world_size, 0
    for name, coll in plan:
        for n in sizes:
            for dtype, op in (("int64", "sum"), ("float32", "sum"), ("float32", "max")):
                salt += 1
                if coll == "allreduce":
                    t = torch.from_numpy(data(ctx.rank, n, dtype, salt))
                    ops.all_reduce(client, t, op, algo=name).wait(60)
                    stack = np.stack([data(r, n, dtype, salt) for r in range(world)])
                    want = (stack.sum(0) if op == "sum" else stack.max(0)).astype(DTYPES[dtype])
                    got = t.numpy()
                elif op == "max":
                    continue
                elif coll == "allgather":
                    inp = torch.from_numpy(data(ctx.rank, n, dtype, salt))
                    out = torch.zeros(world * n, dtype=inp.dtype)
                    ops.all_gather(client, out, inp, algo=name).wait(60)
                    want, got = np.concatenate([data(r, n, dtype, salt) for r in range(world)]), out.numpy()
                elif coll == "alltoall":
                    inp = torch.from_numpy(data(ctx.rank, world * n, dtype, salt))
                    out = torch.zeros(world * n, dtype=inp.dtype)
                    ops.all_to_all(client, out, inp, [n] * world, [n] * world, algo=name).wait(60)
                    want = np.concatenate([data(r, world * n, dtype, salt)[ctx.rank * n:(ctx.rank + 1) * n]
                                           for r in range(world)])
                    got = out.numpy()
                else:
                    raise AssertionError(f"{name}: no op runs a {coll} program")
                if not np.array_equal(got, want):
                    raise AssertionError(f"{name} ({coll}) n={n} {dtype} {op} on rank {ctx.rank}: got {got[:8]} "
                                         f"want {want[:8]}")
    client.close()
    return "ok"


def alltonext_crossed(ctx: Any, members: list[int], n: int) -> list[str]:
    """alltonext on group ``members`` (group rank i = world rank members[i]), whose ranks alternate
    between nodes: the native path equals NumPy's shift by group rank; the library program is
    refused on every rank, naming why.  Returns [result, refusal message]."""
    client = ctx.connect(groups={"g": members})
    me = members.index(ctx.rank)
    inp = torch.from_numpy(data(me, n, "int64", 5))
    out = torch.full((n,), -1, dtype=torch.int64)
    ops.alltonext(client, out, inp, group="g").wait(60)
    want = np.full(n, -1, np.int64) if me == 0 else data(me - 1, n, "int64", 5)
    result = "ok" if np.array_equal(out.numpy(), want) else f"got {out.numpy()[:4]} want {want[:4]}"
    try:
        ops.alltonext(client, out, inp, group="g", algo="alltonext").wait(60)
        message = "no error"
    except Exception as exc:  # noqa: BLE001 - the message is the result
        message = f"{type(exc).__name__}: {exc}"
    client.close()
    return [result, message]


def torch_compressed_broadcast(ctx: Any, port: int) -> str:
    """``dist.broadcast`` on a group whose Options name a codec: float32 tensors arrive as torch's
    bfloat16 rounding of the root's (the root's too: replicas identical), synchronously, async and
    through the future; an int64 tensor (a dtype bf16 does not take) and the default group's
    broadcasts arrive exact; the group's all-gathers (FSDP's shards) arrive rounded, inputs untouched;
    its all-reduces (DDP's buckets) within the codec's bound of the exact sum."""
    import os
    from datetime import timedelta

    import torch.distributed as dist

    import commd

    os.environ["COMMD_JOB"] = ctx.job
    dist.init_process_group("commd", init_method=f"tcp://127.0.0.1:{port}", rank=ctx.rank,
                            world_size=ctx.world_size, timeout=timedelta(seconds=60))
    try:
        rank, world = dist.get_rank(), ctx.world_size
        root = world // 2
        source = torch.from_numpy((np.random.default_rng(5).standard_normal(400_003) * 0.02).astype(np.float32))
        rounded = source.to(torch.bfloat16).to(torch.float32)
        group = dist.new_group(list(range(world)), pg_options=commd.Options(compression="bf16"))
        t = source.clone() if rank == root else torch.zeros_like(source)
        dist.broadcast(t, root, group=group)
        assert torch.equal(t, rounded), (rank, "sync")
        t = source.clone() if rank == root else torch.zeros_like(source)
        dist.broadcast(t, root, group=group, async_op=True).wait()
        assert torch.equal(t, rounded), (rank, "async")
        t = source.clone() if rank == root else torch.zeros_like(source)
        dist.broadcast(t, root, group=group, async_op=True).get_future().wait()
        assert torch.equal(t, rounded), (rank, "future")
        ints = torch.arange(400_003, dtype=torch.int64) * 3 if rank == root else torch.zeros(400_003, dtype=torch.int64)
        dist.broadcast(ints, root, group=group)
        assert torch.equal(ints, torch.arange(400_003, dtype=torch.int64) * 3), (rank, "int64")
        t = source.clone() if rank == root else torch.zeros_like(source)
        dist.broadcast(t, root)  # the default group: no codec
        assert torch.equal(t, source), (rank, "default group")
        shard = source[rank * 100_000:(rank + 1) * 100_000].clone()  # FSDP's all-gather of parameter shards
        flat = torch.zeros(world * 100_000)
        dist.all_gather_into_tensor(flat, shard, group=group)
        assert torch.equal(flat, rounded[:world * 100_000]), (rank, "all_gather_into_tensor")
        assert torch.equal(shard, source[rank * 100_000:(rank + 1) * 100_000]), (rank, "the shard changed")
        grads = [source[:300_001] * (r + 1) for r in range(world)]  # DDP's buckets: a bf16 wire, float32 sums
        t = grads[rank].clone()
        dist.all_reduce(t, group=group)
        exact = torch.stack([g.double() for g in grads]).sum(0)
        bound = world * 2.0 ** -8 * torch.stack([g.double().abs() for g in grads]).sum(0)
        assert ((t.double() - exact).abs() <= bound).all(), (rank, "all_reduce")
        # groups whose ranks name different codecs: every rank's op fails, through wait() and the future
        split = dist.new_group(list(range(world)),
                               pg_options=commd.Options(compression="bf16" if rank < world // 2 else "lossless"))
        for through in ("wait", "future"):
            t = source.clone()
            work = dist.broadcast(t, root, group=split, async_op=True)
            try:
                work.wait() if through == "wait" else work.get_future().wait()
            except Exception as exc:  # noqa: BLE001 - what torch hands on is checked by name
                assert "'codec' differs" in str(exc), (rank, through, exc)
            else:
                raise AssertionError(f"rank {rank}: a broadcast the nodes disagree on succeeded ({through})")
    finally:
        dist.destroy_process_group()
    return "ok"
