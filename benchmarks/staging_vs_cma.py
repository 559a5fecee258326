"""Which CPU data path is faster for tensors outside the arena: staging or CMA?

A tensor that does not live in a client's shared arena reaches the daemon in
one of two ways:

* staged: the client copies it into its arena (and back out after the op);
  the copies run in the clients, in parallel with each other;
* cross-memory attach: the daemon reads it with ``process_vm_readv`` and writes
  the result back with ``process_vm_writev``; every copy runs in the daemon,
  one after the other.

This script times both for a 2-rank all-reduce (sum, float32) of each size,
with the reduction itself done the same way, and prints the medians and the
ratio.  commd's default is whichever this shows to be faster on the machine.

    .venv/bin/python benchmarks/staging_vs_cma.py [--sizes-mib 1 16 64] [--iters 7]
"""

from __future__ import annotations

import argparse
import ctypes
import mmap
import multiprocessing as mp
import os
import statistics
import time

import numpy as np

_libc = ctypes.CDLL(None, use_errno=True)


class _IoVec(ctypes.Structure):
    _fields_ = [("iov_base", ctypes.c_void_p), ("iov_len", ctypes.c_size_t)]


def _vm_copy(fn_name: str, pid: int, local: np.ndarray, remote_address: int) -> None:
    fn = getattr(_libc, fn_name)
    fn.restype = ctypes.c_ssize_t
    local_iov = _IoVec(local.ctypes.data, local.nbytes)
    remote_iov = _IoVec(remote_address, local.nbytes)
    done = fn(pid, ctypes.byref(local_iov), 1, ctypes.byref(remote_iov), 1, 0)
    if done != local.nbytes:
        raise OSError(ctypes.get_errno(), f"{fn_name} copied {done} of {local.nbytes} bytes")


def _client(rank: int, n: int, iters: int, shm: mmap.mmap, addr_q: mp.Queue, go: mp.Barrier,
            mode_q: mp.Queue) -> None:
    data = np.full(n, rank + 1, dtype=np.float32)
    addr_q.put((rank, os.getpid(), data.ctypes.data))
    stage = np.frombuffer(shm, dtype=np.float32, count=n, offset=rank * n * 4)
    while True:
        mode = mode_q.get()
        if mode is None:
            return
        for _ in range(iters):
            go.wait()  # start
            if mode == "staged":
                np.copyto(stage, data)
                go.wait()  # staged in
                go.wait()  # daemon reduced
                np.copyto(data, stage)
            go.wait()  # done


def measure(n: int, iters: int) -> dict[str, float]:
    ctx = mp.get_context("fork")
    shm = mmap.mmap(-1, 2 * n * 4)
    addr_q, go = ctx.Queue(), ctx.Barrier(3)
    mode_qs = [ctx.Queue(), ctx.Queue()]
    procs = [ctx.Process(target=_client, args=(r, n, iters, shm, addr_q, go, mode_qs[r])) for r in range(2)]
    for p in procs:
        p.start()
    peers = dict((r, (pid, addr)) for r, pid, addr in (addr_q.get(timeout=30) for _ in procs))
    stages = [np.frombuffer(shm, dtype=np.float32, count=n, offset=r * n * 4) for r in range(2)]
    local = [np.empty(n, dtype=np.float32) for _ in range(2)]
    results: dict[str, float] = {}
    for mode in ("staged", "cma"):
        for q in mode_qs:
            q.put(mode)
        times = []
        for _ in range(iters):
            go.wait()
            start = time.perf_counter()
            if mode == "staged":
                go.wait()
                np.add(stages[0], stages[1], out=stages[0])
                np.copyto(stages[1], stages[0])
                go.wait()
            else:
                for r in range(2):
                    _vm_copy("process_vm_readv", peers[r][0], local[r], peers[r][1])
                np.add(local[0], local[1], out=local[0])
                for r in range(2):
                    _vm_copy("process_vm_writev", peers[r][0], local[0], peers[r][1])
            go.wait()
            times.append(time.perf_counter() - start)
        results[mode] = statistics.median(times[1:])
    for q in mode_qs:
        q.put(None)
    for p in procs:
        p.join(timeout=30)
    return results


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--sizes-mib", type=float, nargs="+", default=[1, 16, 64])
    parser.add_argument("--iters", type=int, default=7)
    args = parser.parse_args()
    if args.iters < 2 or any(s <= 0 for s in args.sizes_mib):
        parser.error("--iters must be >= 2 and sizes positive")
    print(f"{'size':>10} {'staged ms':>10} {'cma ms':>10} {'cma/staged':>11}")
    for mib in args.sizes_mib:
        n = int(mib * (1 << 20)) // 4
        r = measure(n, args.iters)
        print(f"{mib:>8.1f}Mi {r['staged'] * 1e3:>10.2f} {r['cma'] * 1e3:>10.2f} {r['cma'] / r['staged']:>11.2f}")


if __name__ == "__main__":
    main()
