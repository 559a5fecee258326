"""Bridged exchange rings: small all-reduces of torch groups that span nodes (fabric/bridge.py).

Nodes are daemons on loopback with their own runtime dirs (tests/cluster.py); the ranks
use the torch backend on ordinary tensors.  Every result is checked against NumPy.
"""

from __future__ import annotations

import os
import time
from datetime import timedelta
from typing import Any

import numpy as np
import pytest
import torch
import torch.distributed as dist
from cluster import free_port

from commd.client.errors import CommdError, MismatchError
from commd.client.fastring import RingHandle, available
from commd.protocol import fastring as fr

pytestmark = pytest.mark.skipif(not available(), reason="exchange rings need x86-64 Linux")

OPS = {"sum": dist.ReduceOp.SUM, "avg": dist.ReduceOp.AVG, "max": dist.ReduceOp.MAX, "min": dist.ReduceOp.MIN,
       "product": dist.ReduceOp.PRODUCT, "band": dist.ReduceOp.BAND}


def _init(ctx: Any, port: int, timeout_s: float = 30.0) -> None:
    import commd  # noqa: F401 - registers the backend

    os.environ["COMMD_JOB"] = ctx.job
    dist.init_process_group("commd", init_method=f"tcp://127.0.0.1:{port}", rank=ctx.rank,
                            world_size=ctx.world_size, timeout=timedelta(seconds=timeout_s))


def _data(rank: int, count: int, dtype: np.dtype, salt: int) -> np.ndarray:
    rng = np.random.default_rng(1000 * salt + rank)
    if dtype.kind == "f":
        return rng.uniform(0.5, 1.5, count).astype(dtype)
    return rng.integers(1, 7, count).astype(dtype)


def _reference(ranks: list[int], count: int, dtype: np.dtype, op: str, salt: int) -> np.ndarray:
    """The group's all-reduce as NumPy computes it: each node's ranks first, then the nodes in order
    (the bits the fabric's tiny all-reduce and the bridge compute)."""
    parts = [_data(r, count, dtype, salt) for r in ranks]
    reduce = {"sum": np.add, "avg": np.add, "max": np.maximum, "min": np.minimum, "product": np.multiply,
              "band": np.bitwise_and}[op]
    nodes = sorted({r // 2 for r in ranks})
    per_node = []
    for node in nodes:
        mine = [p for r, p in zip(ranks, parts, strict=True) if r // 2 == node]
        acc = mine[0].copy()
        for p in mine[1:]:
            acc = reduce(acc, p)
        per_node.append(acc)
    out = per_node[0].copy()
    for p in per_node[1:]:
        out = reduce(out, p)
    if op == "avg":
        out = (out / len(ranks)).astype(dtype)
    return out


CASES = [("float32", "sum", 1), ("float32", "avg", 1000), ("float64", "max", 300), ("int64", "sum", 5),
         ("int32", "band", 64), ("float64", "product", 7), ("float32", "sum", fr.SLOT_BYTES // 4),
         ("float32", "min", fr.SLOT_BYTES // 4 + 1)]


def bridged_ops(ctx: Any, port: int) -> str:
    """Every case on the world (2 nodes x 2 ranks) and on subgroups, in flight together and between
    daemon collectives; each result equal to NumPy's."""
    _init(ctx, port)
    rank, world = ctx.rank, ctx.world_size
    groups = {"world": (None, list(range(world)))}
    for ranks in ([0, 2], [1, 2, 3], [0, 3]):  # one rank per node; 1 + 2; every group spans both nodes
        group = dist.new_group(ranks)
        if rank in ranks:
            groups[str(ranks)] = (group, ranks)
    for name, (group, ranks) in groups.items():
        pending = []
        for salt, (dtype_name, op, count) in enumerate(CASES * 3):
            dtype = np.dtype(dtype_name)
            x = torch.from_numpy(_data(rank, count, dtype, salt).copy())
            work = dist.all_reduce(x, op=OPS[op], group=group, async_op=True)
            bridged = count * dtype.itemsize <= fr.SLOT_BYTES
            assert isinstance(work.handles[0], RingHandle) == bridged, (name, dtype_name, op, count)
            pending.append((work, x, _reference(ranks, count, dtype, op, salt), (dtype_name, op, count)))
            if salt % 5 == 4:  # a daemon collective between ring ops: program order on both paths
                y = torch.full((3,), float(rank))
                dist.broadcast(y, src=ranks[1], group=group)
                assert y.tolist() == [float(ranks[1])] * 3, name
        for work, x, want, what in pending:
            work.wait()
            got = x.numpy()
            if want.dtype.kind == "f":
                assert np.allclose(got, want, rtol=1e-6), (name, what, got[:4], want[:4])
            else:
                assert np.array_equal(got, want), (name, what, got[:4], want[:4])
        # every rank of a node got the same bits; and a non-contiguous tensor
        z = torch.arange(12, dtype=torch.float32).reshape(3, 4).t() * (rank + 1)
        dist.all_reduce(z, group=group)
        assert torch.equal(z, torch.arange(12, dtype=torch.float32).reshape(3, 4).t() * sum(r + 1 for r in ranks))
    dist.destroy_process_group()
    return "ok"


def test_bridged_all_reduces_match_numpy(cluster: Any) -> None:
    c = cluster(2, 2)
    results = c.join(c.start_workers(bridged_ops, free_port()), timeout=110)
    assert results == {r: "ok" for r in range(4)}, results
    for i in range(2):  # the ops went through the bridges, and none failed
        rings = c.status(i)["fabric"]["bridged_rings"]
        assert len(rings) == 4 and min(row["ops"] for row in rings.values()) >= 3 * 7, rings
        # (the ranks' departures at the end leave the rings: nothing else did)
        assert all(row["failed"] is None or row["failed"].endswith("left the job") for row in rings.values()), rings


def disagreements(ctx: Any, port: int) -> dict[str, str]:
    """Ranks that disagree across nodes, on the count and on the path, fail on every rank, fast."""
    _init(ctx, port, timeout_s=60.0)
    rank = ctx.rank
    out = {}
    # the count differs between the nodes: both nodes' bridges see both parts and fail alike
    g1 = dist.new_group([0, 1, 2, 3])
    started = time.monotonic()
    try:
        dist.all_reduce(torch.ones(10 if rank < 2 else 11), group=g1)
        out["count"] = "no error"
    except CommdError as exc:
        out["count"] = f"{type(exc).__name__}: {exc}"
    # the path differs: node 0 all-reduces 1 KiB (the ring), node 1 128 KiB (the daemon)
    g2 = dist.new_group([0, 1, 2, 3])
    try:
        dist.all_reduce(torch.ones(256 if rank < 2 else 32768), group=g2)
        out["path"] = "no error"
    except CommdError as exc:
        out["path"] = f"{type(exc).__name__}: {exc}"
    out["seconds"] = f"{time.monotonic() - started:.1f}"
    # the group still works afterwards, through the daemon, on every rank
    x = torch.full((4,), float(rank + 1))
    dist.all_reduce(x, group=g2)
    assert x.tolist() == [10.0] * 4, x
    dist.destroy_process_group()
    return out


def test_bridged_disagreements_fail_every_rank(cluster: Any) -> None:
    c = cluster(2, 2, op_timeout=60.0)
    results = c.join(c.start_workers(disagreements, free_port()), timeout=110)
    assert sorted(results) == [0, 1, 2, 3], results
    for rank, out in results.items():
        assert out["count"].startswith(MismatchError.__name__) and "count" in out["count"], (rank, out)
        assert out["path"].startswith(MismatchError.__name__), (rank, out)
        assert float(out["seconds"]) < 30, (rank, out)  # not the 60 s op timeout


def dies_mid_ring(ctx: Any, port: int) -> str:
    _init(ctx, port, timeout_s=60.0)
    x = torch.ones(8)
    dist.all_reduce(x)
    assert x.tolist() == [4.0] * 8
    if ctx.rank == 3:
        os._exit(3)  # a rank of node 1 dies between ops
    started = time.monotonic()
    try:
        for _ in range(100):
            dist.all_reduce(x)
        return "no error"
    except CommdError as exc:
        return f"{type(exc).__name__} after {time.monotonic() - started:.1f}s: {exc}"


def test_a_dead_rank_fails_the_bridged_ops_of_every_node(cluster: Any) -> None:
    c = cluster(2, 2, op_timeout=60.0)
    workers = c.start_workers(dies_mid_ring, free_port())
    results: dict[int, Any] = {}
    for w in workers:  # rank 3 has no result: it died
        results.update(w.join(110, ranks=[r for r in w.procs if r != 3]))
    for rank in (0, 1, 2):
        value = results[rank]
        assert value.startswith(("PeerDiedError", "CommdError")), (rank, value)
        assert float(value.split(" after ")[1].split("s:")[0]) < 30, (rank, value)
