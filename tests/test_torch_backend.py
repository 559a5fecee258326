"""torch.distributed over the "commd" backend, checked against Gloo and NumPy.

Each test spawns real rank processes with torch.multiprocessing and does NOT
start a daemon: the first process of the job must start it (and it must go
away by itself once the job's processes have left).  Inside every rank the
same op runs on the commd default group and on a Gloo group over the same
store, so Gloo is the reference wherever it supports the op, NumPy elsewhere.
"""

from __future__ import annotations

import os
import time
from collections.abc import Callable
from datetime import timedelta
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as tmp
from helpers import wait_until

from commd.runtime import pid_alive

WORLD = 2
INIT_TIMEOUT = timedelta(seconds=30)  # also the commd op timeout of the groups
SPAWN_TIMEOUT_S = 100.0


def spawn(
    fn: Callable[..., None], args: tuple[Any, ...], timeout: float = SPAWN_TIMEOUT_S, nprocs: int = WORLD
) -> None:
    """mp.spawn of ``nprocs`` ranks with a deadline; re-raises a rank's exception, kills stragglers."""
    context = tmp.spawn(fn, args=args, nprocs=nprocs, join=False)
    deadline = time.monotonic() + timeout
    try:
        while not context.join(timeout=1):
            if time.monotonic() > deadline:
                raise AssertionError(f"ranks did not finish within {timeout:.0f}s")
    finally:
        for proc in context.processes:
            if proc.is_alive():
                proc.kill()
            proc.join(timeout=10)


def _daemon_logs(runtime_dir: Path) -> list[Path]:
    return sorted(runtime_dir.glob("*/daemon.log"))


def assert_daemon_came_and_went(runtime_dir: Path) -> None:
    """Exactly one daemon was auto-started for the job, and it exited once the ranks left."""
    logs = _daemon_logs(runtime_dir)
    assert len(logs) == 1, f"expected one auto-started daemon, found logs {logs}"
    wait_until(lambda: "daemon stopped" in logs[0].read_text(), 30, "the idle daemon to exit")
    pid_file = logs[0].parent / "daemon.pid"
    assert not pid_file.exists() or not pid_alive(int(pid_file.read_text() or 0))


# ---- the ranks ----------------------------------------------------------------
def _input(rank: int, n: int, dtype: torch.dtype = torch.float32, salt: int = 0) -> torch.Tensor:
    """Rank ``rank``'s deterministic input: every rank can recompute everyone's."""
    rng = np.random.default_rng(1000 * salt + rank)
    if dtype.is_floating_point:
        return torch.from_numpy(rng.uniform(-2, 2, n)).to(dtype)
    return torch.from_numpy(rng.integers(-1000, 1000, n)).to(dtype)


def _close(a: torch.Tensor, b: torch.Tensor, what: str) -> None:
    torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6, msg=lambda m: f"{what}: {m}")


def check_collectives(rank: int, gloo: Any) -> None:
    """Every op on the commd default group against the same op on Gloo (or NumPy)."""
    ops = [dist.ReduceOp.SUM, dist.ReduceOp.PRODUCT, dist.ReduceOp.MIN, dist.ReduceOp.MAX]
    for op in ops:
        x = _input(rank, 1000)
        a, b = x.clone(), x.clone()
        dist.all_reduce(a, op)
        dist.all_reduce(b, op, group=gloo)
        _close(a, b, f"all_reduce {op}")
    for op in (*ops, dist.ReduceOp.BAND, dist.ReduceOp.BOR, dist.ReduceOp.BXOR):
        x = _input(rank, 300, torch.int64, salt=1)
        a, b = x.clone(), x.clone()
        dist.all_reduce(a, op)
        dist.all_reduce(b, op, group=gloo)
        assert torch.equal(a, b), f"all_reduce int64 {op}"
    avg = _input(rank, 50)
    dist.all_reduce(avg, dist.ReduceOp.AVG)  # Gloo has no AVG: NumPy reference
    want = np.mean([_input(r, 50).numpy() for r in range(WORLD)], axis=0)
    np.testing.assert_allclose(avg.numpy(), want, rtol=1e-6, atol=1e-6)

    # async form and futures
    x = _input(rank, 5000)
    work = dist.all_reduce(x, async_op=True)
    fut = work.get_future()
    assert work.wait()
    _close(fut.wait()[0], sum(_input(r, 5000) for r in range(WORLD)), "async all_reduce future")

    x = _input(rank, 77, salt=2)
    outs_c = [torch.empty(77) for _ in range(WORLD)]
    outs_g = [torch.empty(77) for _ in range(WORLD)]
    dist.all_gather(outs_c, x)
    dist.all_gather(outs_g, x, group=gloo)
    for r in range(WORLD):
        assert torch.equal(outs_c[r], outs_g[r]), f"all_gather part {r}"
        assert torch.equal(outs_c[r], _input(r, 77, salt=2))

    flat = torch.empty(WORLD * 77)
    dist.all_gather_into_tensor(flat, x)
    assert torch.equal(flat, torch.cat([_input(r, 77, salt=2) for r in range(WORLD)]))

    for src in range(WORLD):
        a = _input(rank, 4097, torch.float64, salt=3)  # > 4096 bytes: staged
        b = a.clone()
        dist.broadcast(a, src)
        dist.broadcast(b, src, group=gloo)
        assert torch.equal(a, b) and torch.equal(a, _input(src, 4097, torch.float64, salt=3)), f"broadcast from {src}"

    chunk = 33
    x = _input(rank, WORLD * chunk, salt=4)
    out = torch.empty(chunk)
    dist.reduce_scatter_tensor(out, x)
    want = np.sum([_input(r, WORLD * chunk, salt=4).numpy() for r in range(WORLD)], axis=0)
    np.testing.assert_allclose(out.numpy(), want[rank * chunk : (rank + 1) * chunk], rtol=1e-6, atol=1e-6)

    # uneven all_to_all_single on rows of 3: rank i sends i + j + 1 rows to rank j
    cols = 3
    sends = [[i + j + 1 for j in range(WORLD)] for i in range(WORLD)]
    rows_in, rows_out = sends[rank], [sends[i][rank] for i in range(WORLD)]
    inputs = [_input(i, sum(sends[i]) * cols, salt=5).view(-1, cols) for i in range(WORLD)]
    out_c = torch.empty(sum(rows_out), cols)
    out_g = torch.empty(sum(rows_out), cols)
    dist.all_to_all_single(out_c, inputs[rank], rows_out, rows_in)
    dist.all_to_all_single(out_g, inputs[rank], rows_out, rows_in, group=gloo)
    want = torch.cat([inputs[i][sum(sends[i][:rank]) : sum(sends[i][: rank + 1])] for i in range(WORLD)])
    assert torch.equal(out_c, want), "all_to_all_single (uneven) vs NumPy/slicing"
    assert torch.equal(out_c, out_g), "all_to_all_single (uneven) vs Gloo"

    # list forms, uneven all_to_all: rank i sends i + j + 1 elements to rank j
    outs = [torch.empty(rank + 1 + j) for j in range(WORLD)]
    dist.all_to_all(outs, [torch.full((j + 1 + rank,), float(rank)) for j in range(WORLD)])
    for j in range(WORLD):
        assert torch.equal(outs[j], torch.full((rank + 1 + j,), float(j))), f"all_to_all part from {j}"
    out = torch.empty(3)
    dist.reduce_scatter(out, [torch.full((3,), float(rank + j)) for j in range(WORLD)])
    assert torch.equal(out, torch.full((3,), float(sum(range(WORLD)) + WORLD * rank))), "reduce_scatter (list)"

    # object collectives: pickles through uint8 tensors of uneven sizes
    objects: list[Any] = [None] * WORLD
    dist.all_gather_object(objects, {"rank": rank, "pad": "x" * 5000 * rank})
    assert [o["rank"] for o in objects] == list(range(WORLD)) and len(objects[1]["pad"]) == 5000
    listed: list[Any] = [rank, "abc" * (rank + 1)]
    dist.broadcast_object_list(listed, src=1)
    assert listed == [1, "abcabc"], listed

    root = WORLD - 1
    x = _input(rank, 64, salt=6)
    dist.reduce(x, root, dist.ReduceOp.MAX)
    if rank == root:
        want = np.max([_input(r, 64, salt=6).numpy() for r in range(WORLD)], axis=0)
        np.testing.assert_array_equal(x.numpy(), want)
    gathered = [torch.empty(64) for _ in range(WORLD)] if rank == 0 else None
    dist.gather(_input(rank, 64, salt=7), gathered, dst=0)
    if rank == 0:
        for r in range(WORLD):
            assert torch.equal(gathered[r], _input(r, 64, salt=7)), f"gather part {r}"
    part = torch.empty(64)
    dist.scatter(part, [_input(r, 64, salt=8) for r in range(WORLD)] if rank == 1 else None, src=1)
    assert torch.equal(part, _input(rank, 64, salt=8)), "scatter"
    dist.barrier()


def check_point_to_point(rank: int) -> None:
    peer = 1 - rank
    if rank == 0:
        dist.send(_input(0, 100, salt=10), 1)
        got = torch.empty(100)
        dist.recv(got, 1, tag=4)
        assert torch.equal(got, _input(1, 100, salt=11)), "recv with a tag"
        anysrc = torch.empty(10, dtype=torch.int64)
        sender = dist.recv(anysrc)  # any source
        assert sender == 1 and torch.equal(anysrc, _input(1, 10, torch.int64, salt=12)), sender
    else:
        got = torch.empty(100)
        dist.recv(got, 0)
        assert torch.equal(got, _input(0, 100, salt=10)), "recv"
        dist.send(_input(1, 100, salt=11), 0, tag=4)
        dist.send(_input(1, 10, torch.int64, salt=12), 0)
    # both directions at once
    out = torch.empty(5000)
    requests = dist.batch_isend_irecv([
        dist.P2POp(dist.isend, _input(rank, 5000, salt=13), peer),
        dist.P2POp(dist.irecv, out, peer),
    ])
    for req in requests:
        req.wait()
    assert torch.equal(out, _input(peer, 5000, salt=13)), "batch_isend_irecv"
    dist.barrier()


def check_new_groups(rank: int) -> None:
    both = dist.new_group([0, 1])
    only1 = dist.new_group([1])
    x = _input(rank, 10, salt=20)
    dist.all_reduce(x, group=both)
    _close(x, _input(0, 10, salt=20) + _input(1, 10, salt=20), "all_reduce on new_group([0, 1])")
    if rank == 1:
        y = _input(1, 10, salt=21)
        dist.all_reduce(y, group=only1)
        assert torch.equal(y, _input(1, 10, salt=21)), "all_reduce on a singleton group"
    dist.barrier(group=both)


def train(rank: int, group: Any, steps: int = 6) -> list[torch.Tensor]:
    """A few SGD steps of a small DDP model; every rank starts from different weights."""
    from torch.nn.parallel import DistributedDataParallel

    torch.manual_seed(1 + rank)  # DDP must broadcast rank 0's initial weights
    model = torch.nn.Sequential(torch.nn.Linear(8, 32), torch.nn.Tanh(), torch.nn.Linear(32, 4))
    ddp = DistributedDataParallel(model, process_group=group, bucket_cap_mb=0.001)  # several buckets
    opt = torch.optim.SGD(ddp.parameters(), lr=0.1)
    data = torch.Generator().manual_seed(100 + rank)
    for _ in range(steps):
        x, y = torch.randn(16, 8, generator=data), torch.randn(16, 4, generator=data)
        opt.zero_grad()
        torch.nn.functional.mse_loss(ddp(x), y).backward()
        opt.step()
    return [p.detach().clone() for p in model.parameters()]


def check_ddp(rank: int, gloo: Any) -> None:
    over_commd = train(rank, dist.group.WORLD)
    over_gloo = train(rank, gloo)
    for i, (c, g) in enumerate(zip(over_commd, over_gloo, strict=True)):
        _close(c, g, f"DDP parameter {i}: commd vs gloo")
    flat = torch.cat([p.reshape(-1) for p in over_commd])
    everyone = [torch.empty_like(flat) for _ in range(WORLD)]
    dist.all_gather(everyone, flat, group=gloo)
    assert torch.equal(everyone[0], everyone[1]), "DDP replicas diverged"


def env_rank_main(rank: int) -> None:
    """Rank body of the env:// run: every op, point to point, new groups, DDP."""
    import commd  # noqa: F401 - registers the backend

    dist.init_process_group("commd", init_method="env://", rank=rank, world_size=WORLD, timeout=INIT_TIMEOUT)
    try:
        assert dist.get_backend() == "commd"
        gloo = dist.new_group(backend="gloo")
        check_collectives(rank, gloo)
        check_point_to_point(rank)
        check_new_groups(rank)
        check_ddp(rank, gloo)
    finally:
        dist.destroy_process_group()


def file_rank_main(rank: int, init_file: str) -> None:
    """Rank body of the file:// run: a smaller set of ops."""
    import commd  # noqa: F401 - registers the backend

    dist.init_process_group("commd", init_method=f"file://{init_file}", rank=rank, world_size=WORLD,
                            timeout=INIT_TIMEOUT)
    try:
        x = _input(rank, 300)
        dist.all_reduce(x)
        _close(x, _input(0, 300) + _input(1, 300), "all_reduce (file://)")
        y = _input(rank, 10, torch.int32)
        dist.broadcast(y, 1)
        assert torch.equal(y, _input(1, 10, torch.int32))
        dist.barrier()
    finally:
        dist.destroy_process_group()


# ---- the tests --------------------------------------------------------------------
@pytest.mark.timeout(150)
def test_env_init_ops_and_ddp_match_gloo(backend_env: Path) -> None:
    spawn(env_rank_main, ())
    assert_daemon_came_and_went(backend_env)


@pytest.mark.extended  # several processes, ~10 s: make test-extended (CI runs it too)
@pytest.mark.timeout(120)
def test_file_init(backend_env: Path, tmp_path: Path) -> None:
    spawn(file_rank_main, (str(tmp_path / "init"),))
    assert_daemon_came_and_went(backend_env)
    assert os.environ["COMMD_RUNTIME_DIR"] == str(backend_env)


def parameter_rank_main(rank: int) -> None:
    """Broadcast and all-reduce nn.Parameters directly (a common way to sync weights)."""
    import commd  # noqa: F401 - registers the backend

    dist.init_process_group("commd", init_method="env://", rank=rank, world_size=WORLD, timeout=INIT_TIMEOUT)
    try:
        gloo = dist.new_group(backend="gloo")
        for n in (4, 3000):  # inline and staged
            torch.manual_seed(rank)
            over_commd = torch.nn.Parameter(torch.randn(n))
            over_gloo = torch.nn.Parameter(over_commd.detach().clone())
            dist.broadcast(over_commd, 0)
            dist.broadcast(over_gloo, 0, group=gloo)
            assert torch.equal(over_commd, over_gloo), f"broadcast of a Parameter of {n}"
            dist.all_reduce(over_commd)
            dist.all_reduce(over_gloo, group=gloo)
            assert torch.equal(over_commd, over_gloo), f"all_reduce of a Parameter of {n}"
    finally:
        dist.destroy_process_group()


@pytest.mark.extended  # several processes, ~10 s: make test-extended (CI runs it too)
@pytest.mark.timeout(120)
def test_collectives_on_parameters(backend_env: Path) -> None:
    """Copy-out into leaves that require grad must work, as on Gloo (autograd refuses tensor.copy_)."""
    spawn(parameter_rank_main, ())
