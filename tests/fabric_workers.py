"""Worker programs for the multi-node tests (spawned processes import this module).

Every rank computes the NumPy reference for every other rank's data itself
(the data is a function of rank and op), so each check is independent of
commd.
"""

from __future__ import annotations

from typing import Any

import numpy as np
import torch

from commd.client import ops

GROUPS_OF_4 = {"pair": [1, 2], "local1": [2, 3], "mixed": [3, 0, 2]}


def data(rank: int, n: int, dtype: Any, salt: int) -> np.ndarray:
    rng = np.random.default_rng(rank * 7919 + salt)
    return rng.integers(-20, 20, n).astype(dtype)


def _t(a: np.ndarray) -> torch.Tensor:
    return torch.from_numpy(np.ascontiguousarray(a).copy())


def _check(name: str, got: torch.Tensor, want: np.ndarray) -> None:
    got_np = got.numpy()
    if got_np.shape != want.shape or not np.array_equal(got_np, want):
        raise AssertionError(f"{name}: got {got_np[:8]}... want {want[:8]}...")


def every_op(ctx: Any, lanes: list[str], sizes: list[int]) -> str:
    """All op kinds across nodes on each lane, checked against NumPy."""
    client = ctx.connect(groups=GROUPS_OF_4 if ctx.world_size == 4 else None)
    me, world = ctx.rank, ctx.world_size
    all_ranks = list(range(world))
    salt = 0
    for lane in lanes:
        for n in sizes:
            salt += 1
            # all_reduce: sum (float32), max (int32), avg (float64)
            for op, dtype in (("sum", np.float32), ("max", np.int32), ("avg", np.float64)):
                t = _t(data(me, n, dtype, salt))
                ops.all_reduce(client, t, op, lane=lane).wait(60)
                stack = np.stack([data(r, n, dtype, salt) for r in all_ranks])
                want = {"sum": stack.sum(0), "max": stack.max(0), "avg": stack.mean(0)}[op].astype(dtype)
                _check(f"{lane} all_reduce {op} n={n}", t, want)
            # reduce to a root on the other node; other ranks' buffers untouched
            root = world - 1
            t = _t(data(me, n, np.float32, salt + 1))
            ops.reduce(client, t, root, "sum", lane=lane).wait(60)
            want = np.sum([data(r, n, np.float32, salt + 1) for r in all_ranks], 0).astype(np.float32)
            _check(f"{lane} reduce n={n}", t, want if me == root else data(me, n, np.float32, salt + 1))
            # broadcast from a rank on node 1
            t = _t(data(me, n, np.int64, salt + 2))
            ops.broadcast(client, t, world // 2, lane=lane).wait(60)
            _check(f"{lane} broadcast n={n}", t, data(world // 2, n, np.int64, salt + 2))
            # all_gather / gather / scatter / reduce_scatter with unequal counts
            counts = [(n // 3) + r for r in all_ranks]
            inp = _t(data(me, counts[me], np.float32, salt + 3))
            out = torch.empty(sum(counts), dtype=torch.float32)
            ops.all_gather(client, out, inp, counts, lane=lane).wait(60)
            want = np.concatenate([data(r, counts[r], np.float32, salt + 3) for r in all_ranks])
            _check(f"{lane} all_gather n={n}", out, want)
            gout = torch.empty(sum(counts), dtype=torch.float32) if me == 1 else None
            ops.gather(client, gout, inp, 1, counts, lane=lane).wait(60)
            if me == 1:
                _check(f"{lane} gather n={n}", gout, want)
            sin = _t(data(2, sum(counts), np.int32, salt + 4)) if me == 2 else None
            sout = torch.empty(counts[me], dtype=torch.int32)
            ops.scatter(client, sout, sin, 2, counts, lane=lane).wait(60)
            full = data(2, sum(counts), np.int32, salt + 4)
            start = sum(counts[:me])
            _check(f"{lane} scatter n={n}", sout, full[start : start + counts[me]])
            rin = _t(data(me, sum(counts), np.float64, salt + 5))
            rout = torch.empty(counts[me], dtype=torch.float64)
            ops.reduce_scatter(client, rout, rin, "sum", counts, lane=lane).wait(60)
            total = np.sum([data(r, sum(counts), np.float64, salt + 5) for r in all_ranks], 0)
            _check(f"{lane} reduce_scatter n={n}", rout, total[start : start + counts[me]])
            # all_to_all with an unequal split matrix
            split = [[(i + j + n) % 4 + 1 for j in all_ranks] for i in all_ranks]
            ain = _t(data(me, sum(split[me]), np.int16, salt + 6))
            splits_out = [split[j][me] for j in all_ranks]
            aout = torch.empty(sum(splits_out), dtype=torch.int16)
            ops.all_to_all(client, aout, ain, split[me], splits_out, lane=lane).wait(60)
            pieces = []
            for j in all_ranks:
                src = data(j, sum(split[j]), np.int16, salt + 6)
                off = sum(split[j][:me])
                pieces.append(src[off : off + split[j][me]])
            _check(f"{lane} all_to_all n={n}", aout, np.concatenate(pieces))
            ops.barrier(client, lane=lane).wait(60)
            # send/recv across nodes, then any-source
            if world == 4:
                buf = _t(data(me, n, np.float32, salt + 7))
                if me == 0:
                    ops.send(client, buf, 3, tag=5, lane=lane).wait(60)
                elif me == 3:
                    ops.recv(client, buf, 0, tag=5, lane=lane).wait(60)
                    _check(f"{lane} recv n={n}", buf, data(0, n, np.float32, salt + 7))
                if me == 2:
                    ops.send(client, _t(data(2, n, np.float32, salt + 8)), 1, tag=9, lane=lane).wait(60)
                elif me == 1:
                    got = torch.empty(n, dtype=torch.float32)
                    handle = ops.recv(client, got, -1, tag=9, lane=lane)
                    handle.wait(60)
                    _check(f"{lane} any-source recv n={n}", got, data(2, n, np.float32, salt + 8))
                    assert handle.src == 2, handle.src
                # subgroups: one spanning both nodes, one local to node 1, one with mixed order
                if me in (1, 2):
                    t = _t(data(me, n, np.float32, salt + 9))
                    ops.all_reduce(client, t, "sum", group="pair", lane=lane).wait(60)
                    _check(f"{lane} pair all_reduce", t, (data(1, n, np.float32, salt + 9)
                                                          + data(2, n, np.float32, salt + 9)))
                if me in (2, 3):
                    t = _t(data(me, n, np.float32, salt + 10))
                    ops.all_reduce(client, t, "sum", group="local1").wait(60)
                    _check("local1 all_reduce", t, data(2, n, np.float32, salt + 10) + data(3, n, np.float32, salt + 10))
                if me in (3, 0, 2):
                    members = GROUPS_OF_4["mixed"]
                    mine = _t(data(me, n, np.float32, salt + 11))
                    out = torch.empty(3 * n, dtype=torch.float32)
                    ops.all_gather(client, out, mine, group="mixed", lane=lane).wait(60)
                    _check(f"{lane} mixed all_gather", out,
                           np.concatenate([data(r, n, np.float32, salt + 11) for r in members]))
    client.close()
    return "ok"


def mismatch(ctx: Any) -> dict[str, str]:
    """Ranks 2 and up submit a different count: every rank gets an error naming the field and ranks;
    the group keeps working afterwards."""
    from commd.client.errors import MismatchError

    client = ctx.connect()
    n = 8 if ctx.rank < 2 else 9
    t = torch.ones(n)
    try:
        ops.all_reduce(client, t).wait(60)
        message = "no error"
    except MismatchError as exc:
        message = str(exc)
    t = torch.ones(4)
    ops.all_reduce(client, t).wait(60)
    assert t.tolist() == [float(ctx.world_size)] * 4, t
    client.close()
    return {"message": message}


def stall(ctx: Any) -> str:
    """Rank 3 withholds its all_reduce until the test says go; the others submit and wait."""
    client = ctx.connect()
    t = torch.full((4,), float(ctx.rank))
    if ctx.rank == 3:
        ctx.event("ready")
        ctx.command()
    handle = ops.all_reduce(client, t)
    ctx.event("submitted")
    handle.wait(60)
    assert t.tolist() == [6.0] * 4, t
    client.close()
    return "ok"


def hang_on_dead_node(ctx: Any) -> str:
    """Node 1's daemon is killed while node 0's ranks wait: they get an error, not a hang."""
    from commd.client.errors import CommdError

    client = ctx.connect()
    t = torch.ones(4)
    ops.all_reduce(client, t).wait(60)
    ctx.event("first-done")
    if ctx.rank >= 2:
        ctx.command()  # node 1's ranks wait here until killed
        return "unreachable"
    ctx.command()  # proceed once node 1's daemon is gone
    try:
        ops.all_reduce(client, t, timeout=60).wait(60)
        return "no error"
    except CommdError as exc:
        return f"{type(exc).__name__}: {exc}"


def reduce_ops_and_dtypes(ctx: Any, lane: str) -> str:
    """all_reduce across nodes for every reduce op on the dtypes it applies to (NumPy reference;
    bfloat16 via exactly representable integers compared in float32)."""
    client = ctx.connect()
    me, world = ctx.rank, ctx.world_size
    n = 33
    cases = [
        ("sum", "float16"), ("sum", "bfloat16"), ("sum", "complex64"), ("product", "float64"),
        ("product", "int64"), ("min", "int8"), ("max", "uint8"), ("band", "int32"), ("bor", "int64"),
        ("bxor", "uint8"), ("sum", "bool"), ("product", "bool"), ("avg", "float32"), ("premul_sum", "float64"),
    ]
    for salt, (op, dtype) in enumerate(cases):
        np_dtype = {"bfloat16": np.float32, "bool": np.bool_}.get(dtype) or np.dtype(dtype)
        rng_all = [np.random.default_rng(1000 * salt + r) for r in range(world)]
        if dtype == "bool":
            arrays = [g.integers(0, 2, n).astype(np.bool_) for g in rng_all]
        elif op == "product":
            arrays = [g.integers(1, 3, n).astype(np_dtype) for g in rng_all]
        elif dtype == "uint8" or op in ("band", "bor", "bxor"):
            arrays = [g.integers(0, 100, n).astype(np_dtype) for g in rng_all]
        elif dtype == "complex64":
            arrays = [(g.integers(-5, 5, n) + 1j * g.integers(-5, 5, n)).astype(np.complex64) for g in rng_all]
        else:
            arrays = [g.integers(-8, 8, n).astype(np_dtype) for g in rng_all]
        stack = np.stack(arrays)
        scale = 0.5 if op == "premul_sum" else None
        if dtype == "bool":
            want = stack.any(0) if op == "sum" else stack.all(0)
        else:
            want = {"sum": lambda a: a.sum(0), "product": lambda a: a.prod(0), "min": lambda a: a.min(0),
                    "max": lambda a: a.max(0), "band": np.bitwise_and.reduce, "bor": np.bitwise_or.reduce,
                    "bxor": np.bitwise_xor.reduce, "avg": lambda a: a.mean(0),
                    "premul_sum": lambda a: a.sum(0) * 0.5}[op](stack).astype(np_dtype)
        t = torch.from_numpy(arrays[me].copy())
        if dtype == "bfloat16":
            t = t.to(torch.bfloat16)
        ops.all_reduce(client, t, op, scale=scale, lane=lane).wait(60)
        got = t.float().numpy() if dtype == "bfloat16" else t.numpy()
        if not np.array_equal(got, want):
            raise AssertionError(f"{lane} {op} {dtype}: got {got[:6]} want {want[:6]}")
    client.close()
    return "ok"


def large_ops(ctx: Any, lane: str) -> str:
    """Buffers above the parallel-kernel threshold (4 MiB): blockwise local phases across threads."""
    client = ctx.connect()
    me, world = ctx.rank, ctx.world_size
    n = (6 << 20) // 4 + 3
    t = client.empty(n, torch.float32)
    t.copy_(torch.from_numpy(data(me, n, np.float32, 1)))
    ops.all_reduce(client, t, "sum", lane=lane).wait(120)
    _check("large all_reduce", t, np.sum([data(r, n, np.float32, 1) for r in range(world)], 0).astype(np.float32))
    t.copy_(torch.from_numpy(data(me, n, np.float32, 2)))
    ops.broadcast(client, t, 1, lane=lane).wait(120)
    _check("large broadcast", t, data(1, n, np.float32, 2))
    client.close()
    return "ok"


def fused_burst(ctx: Any, lane: str, seed: int, count: int) -> dict[str, Any]:
    """A burst of async small all-reduces (mixed dtypes, reduce ops, sizes; some on one tensor twice
    in a row), all in flight at once so the coordinator can fuse them.  Checked against NumPy here;
    returns each result's bytes so the test can compare fused and unfused runs bit for bit."""
    client = ctx.connect()
    me, world = ctx.rank, ctx.world_size
    plan_rng = np.random.default_rng(seed)  # the same op list on every rank
    dtypes = [np.float32, np.float64, np.int32, np.float16]
    cases = []
    for i in range(count):
        dtype = dtypes[plan_rng.integers(len(dtypes))]
        op = ["sum", "sum", "max", "avg", "premul_sum"][plan_rng.integers(5)]
        if op in ("avg", "premul_sum") and dtype == np.int32:
            op = "sum"
        n = int(plan_rng.integers(1, 300))
        arrays = []
        for r in range(world):
            g = np.random.default_rng(seed * 100_003 + i * 97 + r)
            arrays.append(g.integers(-50, 50, n).astype(dtype) if dtype == np.int32
                          else (g.standard_normal(n) * 3).astype(dtype))
        twice = bool(plan_rng.integers(4) == 0) and op in ("sum", "max")
        cases.append((dtype, op, arrays, twice))
    handles, tensors = [], []
    for i, (_dtype, op, arrays, twice) in enumerate(cases):
        if i % 2:
            t = client.empty(len(arrays[me]), torch.from_numpy(arrays[me]).dtype)
            t.copy_(torch.from_numpy(arrays[me]))
        else:
            t = torch.from_numpy(arrays[me].copy())
        scale = 0.25 if op == "premul_sum" else None
        handles.append(ops.all_reduce(client, t, op, scale=scale, lane=lane))
        if twice:  # the second op must see the first one's result (program order)
            handles.append(ops.all_reduce(client, t, op, scale=scale, lane=lane))
        tensors.append(t)
    for h in handles:
        h.wait(60)
    out = []
    for i, ((dtype, op, arrays, twice), t) in enumerate(zip(cases, tensors, strict=True)):
        stack = np.stack(arrays).astype(np.float64)
        reduce = {"sum": lambda a: a.sum(0), "max": lambda a: a.max(0), "avg": lambda a: a.mean(0),
                  "premul_sum": lambda a: (a * 0.25).sum(0)}[op]
        want = reduce(stack)
        if twice:
            want = reduce(np.stack([want] * world)) if op == "sum" else want
        got = t.numpy()
        tol = 2e-2 if dtype == np.float16 else 1e-4
        if not np.allclose(got.astype(np.float64), want, rtol=tol, atol=tol * 4):
            raise AssertionError(f"op {i} ({op} {np.dtype(dtype).name} x{len(got)}{' twice' if twice else ''}): "
                                 f"got {got[:4]} want {want[:4]}")
        out.append(got.tobytes().hex())
    client.close()
    return {"results": out}


def unhinted_allreduces(ctx: Any, counts: list[int]) -> str:
    """float32 all-reduces of each count with no lane hint (the scheduler's own choice), checked."""
    client = ctx.connect()
    for salt, n in enumerate(counts):
        arrays = [data(r, n, np.float32, salt) for r in range(ctx.world_size)]
        t = _t(arrays[ctx.rank])
        ops.all_reduce(client, t).wait(60)
        _check(f"all_reduce of {n}", t, np.sum(arrays, axis=0))
    client.close()
    return "ok"


def early_tiny_allreduces(ctx: Any, rounds: int) -> str:
    """Tiny all-reduces (sum, max, avg) whose node-1 ranks submit late, so node 0 reports first
    and sends its contribution early; every result against NumPy.  One round in the middle has
    node 1 submit another count: a mismatch on every rank, after which the group keeps working."""
    import time

    from commd.client.errors import MismatchError

    client = ctx.connect()
    me, world, n = ctx.rank, ctx.world_size, 64
    late = me >= world // 2  # node 1's ranks
    reference = {"sum": lambda a: a.sum(0), "max": lambda a: a.max(0), "avg": lambda a: a.mean(0)}
    for i in range(rounds):
        for k, (op, want_of) in enumerate(reference.items()):
            arrays = [data(r, n, np.float32, 3 * i + k) for r in range(world)]
            count = n + 1 if (late and i == rounds // 2 and op == "sum") else n
            t = _t(arrays[me][:count] if count == n else np.zeros(count, np.float32))
            if late:
                time.sleep(0.02)
            try:
                ops.all_reduce(client, t, op).wait(60)
            except MismatchError as exc:
                if i != rounds // 2 or op != "sum" or "'count' differs" not in str(exc):
                    raise
                continue
            if i == rounds // 2 and op == "sum":
                raise AssertionError(f"rank {me}: the mismatched all-reduce of round {i} succeeded")
            _check(f"{op} round {i}", t, want_of(np.stack(arrays)).astype(np.float32))
    client.close()
    return "ok"


def chosen_codecs(ctx: Any) -> dict[str, Any]:
    """Broadcasts from a rank on node 1 that name no codec, under node 0's rules bf16 then lossless
    (broadcasts from 1 MiB): "" gives the root's bits (lossless: bf16 is not allowed), "auto" torch's
    bfloat16 rounding on every rank (the root's too), "auto" on int64 (which bf16 does not take) and
    "none" the root's bits; a broadcast below 1 MiB runs plain.  The test counts the codecs in status
    and compares the ranks' bits."""
    client = ctx.connect()
    me, world = ctx.rank, ctx.world_size
    root = world // 2
    n = 400_003  # 1.6 MB

    def weights(salt: int, count: int = n) -> np.ndarray:
        rng = np.random.default_rng(salt)
        values = (rng.standard_normal(count) * 0.02).astype(np.float32)
        values[::97] *= 100
        return values

    outcome: dict[str, Any] = {}
    cases = [("default", weights(1), None), ("auto", weights(2), "auto"),
             ("int64", np.arange(n, dtype=np.int64) * 7919, "auto"), ("none", weights(3), "none"),
             ("small", weights(4, 1000), None)]
    for name, source, compression in cases:
        t = _t(source if me == root else np.zeros_like(source))
        ops.broadcast(client, t, root, compression=compression).wait(60)
        if name == "auto":
            want = torch.from_numpy(source).to(torch.bfloat16).to(torch.float32).numpy()
            bound = 2.0 ** -8 * np.abs(source) + 1e-30  # bf16's: half a step of an 8-bit significand
            if not (np.abs(t.numpy() - source) <= bound).all():
                raise AssertionError(f"auto: rank {me} is farther from the root's data than bf16 allows")
        else:
            want = source
        _check(f"broadcast {name}", t, want)
        outcome[name] = t.numpy().tobytes().hex()[:8192]  # the test compares ranks
    client.close()
    return outcome


def compressed_broadcasts(ctx: Any) -> dict[str, Any]:
    """Broadcasts from a rank on node 1 with each codec across 2 nodes x 2 ranks: lossless ones give
    the root's bits, lossy ones torch's rounding of them on every rank (the root's too); below
    1 MiB the op runs uncompressed (exact); nodes that disagree on the codec, and a codec that does
    not take the dtype, fail on every rank; the group works afterwards."""
    from commd.client.errors import MismatchError, RequestError

    client = ctx.connect()
    me, world = ctx.rank, ctx.world_size
    root = world // 2
    n = 400_003  # 1.6 MB: 2 chunks

    def weights(salt: int, count: int = n) -> np.ndarray:
        rng = np.random.default_rng(salt)
        values = (rng.standard_normal(count) * 0.02).astype(np.float32)
        values[::97] *= 100
        return values

    rounding = {"bf16": torch.bfloat16, "bf16-cast": torch.bfloat16, "fp16": torch.float16}
    for salt, codec in enumerate(("bf16", "lossless", "bf16-cast", "lossless-zstd", "fp16")):
        source = weights(salt)
        t = _t(source if me == root else np.zeros(n, np.float32))
        ops.broadcast(client, t, root, compression=codec).wait(60)
        kind = rounding.get(codec)
        want = torch.from_numpy(source).to(kind).to(torch.float32).numpy() if kind is not None else source
        if t.numpy().tobytes() != want.tobytes():
            raise AssertionError(f"{codec}: rank {me} differs from the root's data (or its rounding)")
    small = weights(99, 1000)
    t = _t(small if me == root else np.zeros(1000, np.float32))
    ops.broadcast(client, t, root, compression="bf16").wait(60)
    _check("a small bf16 broadcast (uncompressed)", t, small)
    outcome: dict[str, Any] = {}
    try:  # node 0's ranks ask for bf16, node 1's for lossless: the nodes disagree
        ops.broadcast(client, _t(weights(7)), root, compression="bf16" if me < world // 2 else "lossless").wait(60)
        outcome["disagree"] = "no error"
    except MismatchError as exc:
        outcome["disagree"] = str(exc)
    try:
        ops.broadcast(client, _t(np.arange(n, dtype=np.int64)), root, compression="bf16").wait(60)
        outcome["dtype"] = "no error"
    except RequestError as exc:
        outcome["dtype"] = str(exc)
    t = _t(weights(8))
    ops.broadcast(client, t, root).wait(60)
    _check("a plain broadcast afterwards", t, weights(8))
    for salt, codec in enumerate(("bf16", "lossless"), start=20):  # all-gathers: every block coded once
        blocks = [weights(salt + r, 100_003 + r) for r in range(world)]
        mine = _t(blocks[me])
        out = torch.full((sum(b.size for b in blocks),), -1.0)
        ops.all_gather(client, out, mine, [b.size for b in blocks], compression=codec).wait(60)
        kind = rounding.get(codec)
        want = np.concatenate([torch.from_numpy(b).to(kind).to(torch.float32).numpy() if kind is not None else b
                               for b in blocks])
        if out.numpy().tobytes() != want.tobytes() or not np.array_equal(mine.numpy(), blocks[me]):
            raise AssertionError(f"all_gather {codec}: rank {me} differs (or its input changed)")
    for codec in ("lossless", "bf16"):  # all-reduces: partial results coded, sums in float32
        inputs = [weights(40 + r, 300_001) for r in range(world)]
        t = _t(inputs[me])
        ops.all_reduce(client, t, compression=codec).wait(60)
        plain = _t(inputs[me])
        ops.all_reduce(client, plain).wait(60)
        if codec == "lossless" and t.numpy().tobytes() != plain.numpy().tobytes():
            raise AssertionError(f"all_reduce lossless: rank {me} differs from the plain all-reduce's bits")
        exact = np.sum([a.astype(np.float64) for a in inputs], 0)
        bound = world * 2.0 ** -8 * np.sum([np.abs(a) for a in inputs], 0) + 1e-30
        if not (np.abs(t.numpy() - exact) <= bound).all():
            raise AssertionError(f"all_reduce {codec}: rank {me} is farther from the exact sum than the codec allows")
        outcome[f"allreduce-{codec}"] = t.numpy().tobytes()[:4096].hex()  # the test compares ranks
    client.close()
    return outcome


def _fabric_counters(ctx: Any) -> dict[str, Any]:
    """This rank's daemon's fabric counters: ops per path and control items to/from the coordinator."""
    from pathlib import Path

    from helpers import job_paths

    from commd.client.status import query_status

    fabric = query_status(job_paths(Path(ctx.runtime_dir), ctx.job), timeout=10.0)["fabric"]
    return {"paths": fabric["paths"], "control": fabric["control_items"]}


def ddp_fault_on_schedule(ctx: Any, port: int, fail_step: int, hold: bool = False) -> dict[str, Any]:
    """DDP through the torch backend, every all-reduce through the daemons: once the steps run on
    the schedule, rank 1 dies at ``fail_step``.  The others record what DDP raised, then what an
    all-reduce's ``get_future()`` and ``wait()`` raise after it; with ``hold``, they stay in the job
    until the test says go (so that no rank's leaving is what a slower rank's error names)."""
    import os
    from datetime import timedelta

    import torch.distributed as dist

    import commd  # noqa: F401 - registers the backend

    os.environ["COMMD_LOCAL_RING"] = "0"
    os.environ["COMMD_JOB"] = ctx.job
    dist.init_process_group("commd", init_method=f"tcp://127.0.0.1:{port}", rank=ctx.rank,
                            world_size=ctx.world_size, timeout=timedelta(seconds=30))
    torch.manual_seed(0)
    model = torch.nn.parallel.DistributedDataParallel(torch.nn.Linear(64, 64))
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    out: dict[str, Any] = {"steps": []}
    try:
        for step in range(fail_step + 5):
            if step == fail_step:
                out["paths"] = _fabric_counters(ctx)["paths"]
                ctx.event("on schedule", out["paths"])
                if ctx.rank == 1:
                    ctx.command()  # the test kills this rank here
            x = torch.randn(8, 64, generator=torch.Generator().manual_seed(step * ctx.world_size + ctx.rank))
            optimizer.zero_grad()
            model(x).sum().backward()
            optimizer.step()
            out["steps"].append(step)
        out["ddp"] = "no error"
    except Exception as exc:
        out["ddp"] = f"{type(exc).__name__}: {exc}"
    for api in ("future", "wait"):
        work = dist.all_reduce(torch.ones(16), async_op=True)
        try:
            work.get_future().wait() if api == "future" else work.wait()
            out[api] = "no error"
        except Exception as exc:
            out[api] = f"{type(exc).__name__}: {exc}"
    if hold:
        ctx.event("done")
        ctx.command()
    return out


def schedule_gather(ctx: Any, steps: int) -> dict[str, Any]:
    """A loop of a tiny float32 sum, a tiny int64 max and a 64 KiB sum, repeated on the same data,
    goes onto the schedule: every tiny sum's bits equal the first one's (negotiated: the coordinator
    combined the contributions in node order), the others exact against NumPy."""
    from pathlib import Path

    from helpers import job_paths

    from commd.client.status import query_status

    client = ctx.connect()
    me, world = ctx.rank, ctx.world_size
    mine = np.random.default_rng(100 + me).standard_normal(256).astype(np.float32)  # 1 KiB
    stack = np.stack([np.random.default_rng(100 + r).standard_normal(256).astype(np.float32) for r in range(world)])
    sums = []
    for i in range(steps):
        t = _t(mine)
        ops.all_reduce(client, t, "sum").wait(60)
        sums.append(t.numpy().tobytes())
        np.testing.assert_allclose(t.numpy(), stack.sum(0), rtol=1e-5, atol=1e-5)
        u = _t(data(me, 100, np.int64, i % 3))
        ops.all_reduce(client, u, "max").wait(60)
        _check(f"step {i} max", u, np.stack([data(r, 100, np.int64, i % 3) for r in range(world)]).max(0))
        v = _t(data(me, 16384, np.float32, 7))
        ops.all_reduce(client, v, "sum").wait(60)
        _check(f"step {i} 64 KiB", v, np.stack([data(r, 16384, np.float32, 7) for r in range(world)]).sum(0))
    fabric = query_status(job_paths(Path(ctx.runtime_dir), ctx.job), timeout=10.0)["fabric"]
    client.close()
    return {"bitwise_equal_steps": sum(s == sums[0] for s in sums), "paths": fabric["paths"],
            "schedule": fabric["schedule"]}


def schedule_path(ctx: Any, warm: int, steady: int) -> dict[str, Any]:
    """A loop that repeats itself (two all-reduces and a broadcast per step) goes onto the schedule
    path; then it deviates from it in every way a program can — a mismatch, another pattern, an op
    of another group, a send/recv across nodes — and every result is checked against NumPy."""
    from commd.client.errors import MismatchError

    client = ctx.connect(groups=GROUPS_OF_4)
    me, world, n = ctx.rank, ctx.world_size, 1000
    everyone = list(range(world))

    def step(salt: int) -> None:
        for k, (op, dtype) in enumerate((("sum", np.float32), ("max", np.int64))):
            t = _t(data(me, n, dtype, salt + k))
            ops.all_reduce(client, t, op).wait(60)
            stack = np.stack([data(r, n, dtype, salt + k) for r in everyone])
            _check(f"step {salt} {op}", t, (stack.sum(0) if op == "sum" else stack.max(0)).astype(dtype))
        t = _t(data(me, 300, np.int32, salt + 2))
        ops.broadcast(client, t, 1).wait(60)
        _check(f"step {salt} broadcast", t, data(1, 300, np.int32, salt + 2))

    def mismatched() -> str:
        count = n + 1 if me >= world // 2 else n  # node 1's ranks
        try:
            ops.all_reduce(client, torch.ones(count), "sum").wait(60)
        except MismatchError as exc:
            return str(exc)
        raise AssertionError(f"rank {me}: a mismatched all-reduce succeeded")

    negotiated_mismatch = mismatched()  # before any schedule
    for i in range(warm):
        step(10 * i)
    before = _fabric_counters(ctx)
    for i in range(steady):
        step(10 * (warm + i))
    after = _fabric_counters(ctx)
    scheduled_mismatch = mismatched()  # on the schedule
    # deviations: a new pattern, another group across nodes, a send/recv across nodes, then the loop again
    for i in range(2 * warm):
        step(1000 + 10 * i)
    t = _t(data(me, 77, np.float64, 5))
    ops.all_reduce(client, t, "sum").wait(60)
    _check("another pattern", t, np.stack([data(r, 77, np.float64, 5) for r in everyone]).sum(0))
    for i in range(2 * warm):
        step(2000 + 10 * i)
    if me in GROUPS_OF_4["pair"]:
        t = _t(data(me, 50, np.float32, 6))
        ops.all_reduce(client, t, "sum", group="pair").wait(60)
        _check("pair", t, np.stack([data(r, 50, np.float32, 6) for r in GROUPS_OF_4["pair"]]).sum(0))
    for i in range(2 * warm):
        step(3000 + 10 * i)
    if me in (0, world - 1):
        t = _t(data(0, 40, np.int64, 7)) if me == 0 else torch.zeros(40, dtype=torch.int64)
        (ops.send(client, t, world - 1) if me == 0 else ops.recv(client, t, 0)).wait(60)
        _check("send/recv", t, data(0, 40, np.int64, 7))
    for i in range(2 * warm):
        step(4000 + 10 * i)
    final = _fabric_counters(ctx)
    client.close()
    return {"negotiated_mismatch": negotiated_mismatch, "scheduled_mismatch": scheduled_mismatch,
            "before": before, "after": after, "final": final}


def late_on_schedule(ctx: Any, warm: int, late_s: float) -> dict[str, Any]:
    """A repeating all-reduce goes onto the schedule; then node 1's ranks come ``late_s`` late to
    one op: every rank's op times out naming node 1's ranks, the late ones fail on arrival, and the
    loop goes on (and back onto a schedule) with right results."""
    import time

    from commd.client.errors import CommTimeoutError

    client = ctx.connect()
    me, world, n = ctx.rank, ctx.world_size, 256
    everyone = list(range(world))

    def step(salt: int) -> None:
        t = _t(data(me, n, np.float32, salt))
        ops.all_reduce(client, t, "sum").wait(60)
        _check(f"step {salt}", t, np.stack([data(r, n, np.float32, salt) for r in everyone]).sum(0))

    for i in range(warm):
        step(i)
    if me >= world // 2:
        time.sleep(late_s)
    started = time.monotonic()
    try:
        ops.all_reduce(client, torch.ones(n), "sum").wait(60)
        raise AssertionError(f"rank {me}: the op with late ranks succeeded")
    except CommTimeoutError as exc:
        message, waited = str(exc), time.monotonic() - started
    ops.barrier(client).wait(60)
    for i in range(warm):
        step(100 + i)
    return {"message": message, "waited": waited, "counters": _fabric_counters(ctx)}


def fault_on_schedule(ctx: Any, warm: int, victims: int | list[int] = 0) -> str:
    """A repeating all-reduce goes onto the schedule; then the test kills the last node's daemon or
    one of its ranks (``victims`` of them, default half the world; or the ranks listed) while the
    other ranks wait in the next op: they get an error naming what died, not a hang."""
    from commd.client.errors import CommdError

    client = ctx.connect()
    t = torch.ones(64)
    for _ in range(warm):
        t.fill_(1.0)
        ops.all_reduce(client, t).wait(60)
    counters = _fabric_counters(ctx)
    ctx.event("warm", counters["paths"])
    waiting = victims if isinstance(victims, list) else range(ctx.world_size - (victims or ctx.world_size // 2),
                                                                  ctx.world_size)
    if ctx.rank in waiting:
        ctx.command()  # the victim node's ranks wait here until killed
        return "unreachable"
    handle = ops.all_reduce(client, t, timeout=60)
    ctx.event("submitted")
    try:
        handle.wait(90)
        return "no error"
    except CommdError as exc:
        return f"{type(exc).__name__}: {exc}"


def control_tree_loop(ctx: Any, steps: int) -> dict[str, Any]:
    """``steps`` steps of the same three all-reduces (64 KiB and up: no contribution rides the report),
    each checked against NumPy; then this daemon's fabric counters and control tree."""
    from pathlib import Path

    from helpers import job_paths

    from commd.client.status import query_status

    client = ctx.connect()
    world = range(ctx.world_size)
    for step in range(steps):
        for index, (n, dtype) in enumerate(((16_384, np.float32), (20_000, np.int64), (70_000, np.float64))):
            salt = step * 3 + index
            t = _t(data(ctx.rank, n, dtype, salt))
            ops.all_reduce(client, t).wait(60)
            _check(f"step {step} all_reduce {index}", t, np.sum([data(r, n, dtype, salt) for r in world], 0))
    fabric = query_status(job_paths(Path(ctx.runtime_dir), ctx.job), timeout=10.0)["fabric"]
    client.close()
    return {"paths": fabric["paths"], "control": fabric["control_items"], "tree": fabric["control_tree"]}



def uneven_all_to_all(ctx: Any, rows: list[list[list[int]]]) -> str:
    """One all-to-all per entry of ``rows`` (``rows[op][rank]``: the elements rank sends each rank), with
    different bytes on different ranks; each result checked against the senders' data."""
    client = ctx.connect()
    me, world = ctx.rank, ctx.world_size
    for op, per_rank in enumerate(rows):
        send = per_rank[me]
        recv = [per_rank[src][me] for src in range(world)]
        mine = data(me, sum(send), np.float32, op)
        out = torch.empty(sum(recv), dtype=torch.float32)
        ops.all_to_all(client, out, _t(mine), send, recv).wait(60)
        want = []
        for src in range(world):
            theirs = data(src, sum(per_rank[src]), np.float32, op)
            start = sum(per_rank[src][:me])
            want.append(theirs[start : start + per_rank[src][me]])
        _check(f"all-to-all {op}", out, np.concatenate(want))
    return "ok"
