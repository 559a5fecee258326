"""all_reduce of CUDA tensors: the commd backend against NCCL and Gloo, N ranks on this node's GPUs.

Every rank holds an ordinary CUDA tensor (what DDP hands a backend) on GPU
``rank % device_count``. Paths, one after another in the same run:

  commd  torch.distributed "commd": the tensor goes to the node daemon as a CUDA IPC handle;
  nccl   torch.distributed "nccl" directly (NCCL refuses two ranks on one GPU: with fewer
         GPUs than ranks its refusal is printed instead of figures);
  gloo   torch.distributed "gloo" on the same CUDA tensors (Gloo stages through host memory).

Per size: the median over timed iterations of the slowest rank's time, algbw and
busbw = algbw * 2(n-1)/n, and commd's ratio to each peer. Each result is checked
(sum of rank+1 everywhere) before timing.

    python benchmarks/gpu_allreduce.py --nproc 2 --max-bytes 64M --json out.json
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
import time
import traceback
from datetime import timedelta

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

ELEMENT = 4  # float32


def parse_size(text: str) -> int:
    units = {"K": 1 << 10, "M": 1 << 20, "G": 1 << 30}
    text = text.strip().upper().rstrip("B") or "0"
    if text[-1] in units:
        return int(float(text[:-1]) * units[text[-1]])
    return int(text)


def sizes_between(low: int, high: int) -> list[int]:
    sizes, size = [], max(low, ELEMENT)
    while size <= high:
        sizes.append(size)
        size *= 8
    if sizes and sizes[-1] < high:
        sizes.append(high)
    return sizes


def _worker(rank: int, nproc: int, backend: str, port: int, sizes: list[int], iters: int, queue: mp.Queue) -> None:
    try:
        if backend == "commd":
            import commd  # noqa: F401  (registers the backend)
        device = torch.device("cuda", rank % torch.cuda.device_count())
        torch.cuda.set_device(device)
        dist.init_process_group(backend, init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=nproc,
                                timeout=timedelta(seconds=120))
        rows = []
        for nbytes in sizes:
            t = torch.full((nbytes // ELEMENT,), float(rank + 1), device=device)
            dist.all_reduce(t)
            torch.cuda.synchronize(device)
            want = nproc * (nproc + 1) / 2
            if not bool((t == want).all()):
                raise RuntimeError(f"{backend}: wrong result on rank {rank} at {nbytes} B: {t[:4].tolist()}")
            t.zero_()
            steps = max(5, min(iters, (256 << 20) // max(nbytes, 1)))
            for _ in range(3):
                dist.all_reduce(t)
            torch.cuda.synchronize(device)
            dist.barrier()
            times = []
            for _ in range(steps):
                t0 = time.perf_counter()
                dist.all_reduce(t)
                torch.cuda.synchronize(device)
                times.append(time.perf_counter() - t0)
            rows.append({"bytes": nbytes, "times": times})
        dist.destroy_process_group()
        queue.put((rank, rows, None))
    except Exception:  # the parent prints the failure instead of figures
        queue.put((rank, None, traceback.format_exc(limit=4)))


def run_backend(backend: str, nproc: int, sizes: list[int], iters: int) -> dict:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    ctx = mp.get_context("spawn")
    queue = ctx.Queue()
    procs = [ctx.Process(target=_worker, args=(r, nproc, backend, port, sizes, iters, queue)) for r in range(nproc)]
    for p in procs:
        p.start()
    got = {}
    try:
        for _ in procs:
            rank, rows, error = queue.get(timeout=600)
            got[rank] = (rows, error)
    except Exception as exc:
        got[-1] = (None, f"no result: {exc!r}")
    for p in procs:
        p.join(timeout=30)
        if p.is_alive():
            p.kill()
    errors = [e for _, e in got.values() if e]
    if errors:
        return {"error": errors[0]}
    out = {}
    for i, nbytes in enumerate(sizes):
        per_iter = [max(got[r][0][i]["times"][k] for r in range(nproc)) for k in range(len(got[0][0][i]["times"]))]
        med = statistics.median(per_iter)
        algbw = nbytes / med / 1e9
        out[nbytes] = {"median_us": med * 1e6, "algbw_GBps": algbw, "busbw_GBps": algbw * 2 * (nproc - 1) / nproc}
    return {"rows": out}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--nproc", type=int, default=2)
    parser.add_argument("--min-bytes", default="8")
    parser.add_argument("--max-bytes", default="64M")
    parser.add_argument("--iters", type=int, default=50)
    parser.add_argument("--paths", default="commd,nccl,gloo")
    parser.add_argument("--json")
    args = parser.parse_args(argv)
    if not torch.cuda.is_available():
        print("no CUDA GPU: nothing to measure")
        return 0
    os.environ.setdefault("COMMD_RUNTIME_DIR", tempfile.mkdtemp(prefix="commd-gpu-bench-"))
    sizes = sizes_between(parse_size(args.min_bytes), parse_size(args.max_bytes))
    results = {}
    for backend in args.paths.split(","):
        print(f"running {backend} ...", flush=True)
        results[backend] = run_backend(backend, args.nproc, sizes, args.iters)
        if "error" in results[backend]:
            print(f"{backend}: {results[backend]['error'].strip().splitlines()[-1]}", flush=True)
    print(f"\n{args.nproc} ranks on {torch.cuda.device_count()} x {torch.cuda.get_device_name(0)}; float32 all_reduce; "
          "median of the slowest rank per iteration; busbw in GB/s")
    names = [b for b in results if "rows" in results[b]]
    header = f"{'size':>10} " + " ".join(f"{b + ' us':>12} {b + ' busbw':>12}" for b in names)
    print(header + ("  commd/" + "  commd/".join(n for n in names if n != "commd") if "commd" in names else ""))
    for nbytes in sizes:
        line = f"{nbytes:>10} "
        for b in names:
            row = results[b]["rows"][nbytes]
            line += f"{row['median_us']:>12.1f} {row['busbw_GBps']:>12.3f}"
        if "commd" in names:
            c = results["commd"]["rows"][nbytes]["median_us"]
            for b in names:
                if b != "commd":
                    line += f"  {results[b]['rows'][nbytes]['median_us'] / c:>6.2f}x"
        print(line)
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"nproc": args.nproc, "results": results}, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
