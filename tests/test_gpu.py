"""GPU data path: CUDA IPC handles into the daemon (skipped without a CUDA GPU)."""

from __future__ import annotations

import multiprocessing as mp
import os
import subprocess
import sys
import time

import numpy as np
import pytest
import torch

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU (CUDA IPC data path)"),
]


def _worker(rank: int, world: int, job: str, runtime: str, results: mp.Queue) -> None:
    try:
        _work(rank, world, job, runtime, results)
    except BaseException:  # the test fails at once with this rank's traceback, not after its timeout
        results.put((rank, {"error": __import__("traceback").format_exc()}))
        raise


def _work(rank: int, world: int, job: str, runtime: str, results: mp.Queue) -> None:
    os.environ["COMMD_RUNTIME_DIR"] = runtime
    from commd.client import Client, ops

    client = Client(rank, world, job=job)
    client.register_group("world", list(range(world)))
    assert client._cuda is not None, "daemon did not offer the CUDA IPC path"
    device = torch.device("cuda", rank % torch.cuda.device_count())
    out = {}
    for dtype in (torch.float32, torch.float16, torch.bfloat16):
        for n in (7, 1 << 20):
            t = (torch.arange(n, device=device) % 97).to(dtype) * (rank + 1)
            ops.all_reduce(client, t).wait(timeout=60)
            out[(str(dtype), n)] = t.float().cpu().numpy()
    big = torch.full((1 << 22,), float(rank), device=device)
    ops.broadcast(client, big, root=1).wait(timeout=60)
    out["bcast"] = big[:4].cpu().numpy()
    # 16 MiB: above the size where host buffers are reduced by several daemon threads
    large = torch.full((1 << 22,), float(rank + 1), device=device)
    ops.all_reduce(client, large).wait(timeout=60)
    out["large"] = float(large.min()), float(large.max())
    # A fresh tensor every step (what a training loop's temporaries are): each is exported once and
    # dropped when it dies, so the blocks the daemon holds open, and this process's reserved
    # memory, stay bounded instead of growing by one block per step.
    torch.cuda.synchronize(device)
    reserved_before = torch.cuda.memory_reserved(device)
    for step in range(64):
        fresh = torch.full((1 << 18,), float(step + rank), device=device)
        ops.all_reduce(client, fresh).wait(timeout=60)
        assert float(fresh[0]) == 2 * step + 1, (step, float(fresh[0]))
        del fresh
    out["reserved_growth"] = torch.cuda.memory_reserved(device) - reserved_before
    client.close()
    results.put((rank, out))


def test_cuda_ipc_allreduce_matches_numpy(tmp_path) -> None:
    runtime, job, world = str(tmp_path), "gpu", 2
    env = dict(os.environ, COMMD_RUNTIME_DIR=runtime)
    daemon = subprocess.Popen([sys.executable, "-m", "commd", "daemon", "--job", job], env=env)
    try:
        deadline = time.monotonic() + 60
        while not (tmp_path / job / "control.sock").exists():
            assert time.monotonic() < deadline, "daemon did not start"
            time.sleep(0.05)
        ctx = mp.get_context("spawn")
        results = ctx.Queue()
        procs = [ctx.Process(target=_worker, args=(r, world, job, runtime, results)) for r in range(world)]
        for p in procs:
            p.start()
        got = {}
        for _ in procs:
            rank, out = results.get(timeout=120)
            assert "error" not in out, f"rank {rank} failed:\n{out['error']}"
            got[rank] = out
        for p in procs:
            p.join(timeout=30)
            assert p.exitcode == 0
        for rank in range(world):
            assert got[rank]["large"] == (3.0, 3.0), got[rank]["large"]
            # 64 fresh 1 MiB tensors: growth of a few blocks at most, not 64 MiB
            assert got[rank].pop("reserved_growth") < 16 << 20
            del got[rank]["large"]
        for key, value in got[0].items():
            if key == "bcast":
                np.testing.assert_array_equal(value, np.ones(4))
                continue
            n = key[1]
            base = (np.arange(n) % 97).astype(np.float64)
            np.testing.assert_allclose(value, base * 3, rtol=1e-2)
            np.testing.assert_array_equal(value, got[1][key])
    finally:
        daemon.terminate()
        daemon.wait(timeout=30)
