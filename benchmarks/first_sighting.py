"""A temporary's all-reduce: staged at its first sighting, or registered at once?

An ordinary CPU tensor the torch backend has never seen can take two paths:

* staged: copied into the client's arena, reduced there, copied back (two copies,
  no fixed cost beyond the op's own);
* registered at first sighting: its storage is moved into a fresh sealed memfd
  (one copy, plus memfd_create / reserving its pages / mmap and the page faults of
  fresh shared memory), the memfd is passed to the daemon (a short connection; the
  daemon maps it), the op runs in place, and when the tensor dies the registration is
  dropped on both sides (unregister, munmap).

Every timed iteration all-reduces a FRESH tensor (allocated and filled outside the
timing, then dropped: its death and the unregister it causes are timed) through
``torch.distributed`` with the ``commd`` backend, 2 local ranks.  The two policies run
in alternating rounds of fresh processes (``COMMD_REGISTER_FIRST_BYTES`` unset-large vs
0); per size: the median over iterations of the slowest rank, the ratio registered /
staged, and the load average.  ``COMMD_REGISTER_FIRST_BYTES``'s default (64 MiB) is the
smallest size from which registering a temporary cost no more than staging it here; on a
machine where this shows another size, set it to that size.

    python benchmarks/first_sighting.py [--sizes 256K,1M,4M,16M] [--iters 30] [--rounds 2] [--parts]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
import time
from collections.abc import Callable
from datetime import timedelta
from pathlib import Path

from allreduce import _stop_daemons, free_port, human, parse_size, run_group

#: The two policies: the value of COMMD_REGISTER_FIRST_BYTES each runs with.
POLICIES = {"staged": str(1 << 50), "registered": "0"}
ELEMENT = 4  # float32


# ---- one rank -------------------------------------------------------------------
def worker(cfg: dict, rank: int) -> None:
    import torch
    import torch.distributed as dist
    from _allreduce_worker import buffer_path

    import commd  # noqa: F401  (registers the backend)

    torch.set_num_threads(1)  # torch's pool would spin after each fill, stealing the cores the op needs
    n = cfg["nproc"]
    dist.init_process_group("commd", init_method=f"tcp://127.0.0.1:{cfg['port']}", rank=rank, world_size=n,
                            timeout=timedelta(seconds=60))
    want = float(n * (n + 1) // 2)
    results = []
    try:
        warm = torch.zeros(max(cfg["sizes"]) // ELEMENT)
        for _ in range(4):  # the daemon's torch is loaded and both paths' memory is touched before any timing
            dist.all_reduce(warm)
        del warm
        for nbytes in cfg["sizes"]:
            times, memory = [], set()
            for i in range(cfg["warmup"] + cfg["iters"]):
                tensor = torch.empty(nbytes // ELEMENT)
                tensor.fill_(rank + 1)
                dist.barrier()
                t0 = time.perf_counter()
                dist.all_reduce(tensor)
                t1 = time.perf_counter()
                if tensor[0].item() != want or tensor[-1].item() != want:
                    raise SystemExit(f"rank {rank}, {nbytes} bytes: wrong result {tensor[0].item()} != {want}")
                memory.add(buffer_path(tensor))
                t2 = time.perf_counter()
                del tensor  # its death (and, registered, its munmap) is part of the path's cost
                t3 = time.perf_counter()
                if i >= cfg["warmup"]:
                    times.append(t1 - t0 + t3 - t2)
            results.append({"bytes": nbytes, "times": times, "memory": sorted(memory)})
        dist.barrier()  # the last tensor's unregister goes out with this op
    finally:
        dist.destroy_process_group()
    Path(cfg["out"].format(rank=rank)).write_text(json.dumps({"rank": rank, "results": results}))


# ---- where registering's time goes (one process, no daemon) -----------------------
def _new_memfd(nbytes: int, _src: object) -> None:
    from commd.memory.arena import sealed_memfd

    os.close(sealed_memfd("commd-bench", nbytes, "benchmark"))


def _new_memfd_moved(nbytes: int, src: object) -> None:
    import ctypes
    import mmap

    import torch

    from commd.memory.arena import sealed_memfd

    fd = sealed_memfd("commd-bench", nbytes, "benchmark")
    try:
        mapping = mmap.mmap(fd, nbytes, mmap.MAP_SHARED, mmap.PROT_READ | mmap.PROT_WRITE)
        target = torch.frombuffer(mapping, dtype=torch.uint8)
        ctypes.memmove(target.data_ptr(), src.data_ptr(), nbytes)  # type: ignore[attr-defined]
        del target
        mapping.close()
    finally:
        os.close(fd)


def _median_us(run: Callable[[int, object], None], nbytes: int, src: object, iters: int) -> float:
    times = []
    for _ in range(iters):
        t0 = time.perf_counter()
        run(nbytes, src)
        times.append(time.perf_counter() - t0)
    return statistics.median(times) * 1e6


def parts(sizes: list[int], iters: int) -> None:
    """Client-side fixed costs of registering, against the warm copy staging does twice."""
    import ctypes

    import torch

    print(f"\nclient-side parts (median of {iters}, us): a new sealed memfd (create, size, reserve every page, seal);"
          "\nthe same, mapped and the tensor moved in (page faults of fresh shared memory); one warm copy")
    print(f"{'size':>8} {'memfd':>9} {'memfd+move':>11} {'warm copy':>10}")
    for nbytes in sizes:
        src, dst = torch.ones(nbytes // ELEMENT), torch.empty(nbytes // ELEMENT)

        def copy(n: int, s: object, dst: torch.Tensor = dst) -> None:
            ctypes.memmove(dst.data_ptr(), s.data_ptr(), n)  # type: ignore[attr-defined]

        print(f"{human(nbytes):>8} {_median_us(_new_memfd, nbytes, src, iters):>9.0f} "
              f"{_median_us(_new_memfd_moved, nbytes, src, iters):>11.0f} {_median_us(copy, nbytes, src, iters):>10.0f}")


# ---- orchestration --------------------------------------------------------------
def run_policy(policy: str, sizes: list[int], args: argparse.Namespace, work: Path, tag: str) -> list[dict]:
    runtime = work / f"runtime-{tag}"
    runtime.mkdir(mode=0o700)
    out = str(work / f"{tag}-r{{rank}}.json")
    cfg = {"nproc": 2, "sizes": sizes, "iters": args.iters, "warmup": args.warmup, "port": free_port(), "out": out}
    cfg_file = work / f"{tag}.json"
    cfg_file.write_text(json.dumps(cfg))
    env = dict(os.environ, COMMD_RUNTIME_DIR=str(runtime), COMMD_REGISTER="1",
               COMMD_REGISTER_FIRST_BYTES=POLICIES[policy], COMMD_ARENA_BYTES=str(max(sizes) * 4 + (16 << 20)),
               PYTHONUNBUFFERED="1")
    env.pop("COMMD_JOB", None)
    try:
        run_group([[sys.executable, __file__, "--worker", str(cfg_file), str(r)] for r in range(2)], env,
                  args.timeout, work / f"{tag}.log")
    except RuntimeError as exc:
        raise SystemExit(f"{tag} failed: {exc}\n{(work / f'{tag}.log').read_text(errors='replace')[-3000:]}") \
            from None
    finally:
        _stop_daemons(runtime)
    return [json.loads(Path(out.format(rank=r)).read_text()) for r in range(2)]


def main(argv: list[str] | None = None) -> int:
    if argv is None and len(sys.argv) == 4 and sys.argv[1] == "--worker":
        worker(json.loads(Path(sys.argv[2]).read_text()), int(sys.argv[3]))
        return 0
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--sizes", default="256K,1M,4M,16M", help="comma-separated sizes (default 256K,1M,4M,16M)")
    parser.add_argument("--iters", type=int, default=30, help="timed iterations per size and round (default 30)")
    parser.add_argument("--warmup", type=int, default=3, help="untimed iterations first (default 3)")
    parser.add_argument("--rounds", type=int, default=2, help="alternating rounds of both policies (default 2)")
    parser.add_argument("--timeout", type=float, default=300.0, help="seconds allowed per run (default 300)")
    parser.add_argument("--json", metavar="FILE", help="write the medians and raw times to FILE")
    parser.add_argument("--parts", action="store_true",
                        help="also time registering's client-side parts in this process (memfd, faults, copy)")
    args = parser.parse_args(argv)
    sizes = [parse_size(x) for x in args.sizes.split(",") if x.strip()]
    if not sizes or any(size < 64 << 10 or size % ELEMENT for size in sizes):
        parser.error("sizes must be multiples of 4 bytes, at least 64 KiB (smaller ones take the exchange ring)")
    if args.iters < 1 or args.rounds < 1 or args.warmup < 0:
        parser.error("--iters and --rounds must be at least 1, --warmup at least 0")

    load_before = os.getloadavg()
    per_iteration: dict[str, dict[int, list[float]]] = {p: {size: [] for size in sizes} for p in POLICIES}
    memory: dict[str, dict[int, set[str]]] = {p: {size: set() for size in sizes} for p in POLICIES}
    with tempfile.TemporaryDirectory(prefix="commd-first-") as tmp:
        for round_no in range(args.rounds):
            for policy in POLICIES:
                print(f"round {round_no + 1}: {policy} ...", file=sys.stderr, flush=True)
                ranks = run_policy(policy, sizes, args, Path(tmp), f"{policy}-{round_no}")
                for i, size in enumerate(sizes):
                    rows = [r["results"][i] for r in ranks]
                    per_iteration[policy][size] += [max(ts) for ts in zip(*(row["times"] for row in rows), strict=True)]
                    for row in rows:
                        memory[policy][size].update(row["memory"])
    load_after = os.getloadavg()

    medians = {p: {size: statistics.median(ts) * 1e6 for size, ts in by_size.items()}
               for p, by_size in per_iteration.items()}
    print("\nall_reduce of a fresh float32 tensor per iteration, torch backend 'commd', 2 local ranks;")
    print(f"median over {args.rounds} x {args.iters} iterations of the slowest rank (us)\n")
    print(f"{'size':>8} {'staged':>10} {'registered':>11} {'reg/staged':>11}   memory after the op")
    crossover = None
    for size in sizes:
        ratio = medians["registered"][size] / medians["staged"][size]
        if ratio <= 1.0 and crossover is None:
            crossover = size
        elif ratio > 1.0:
            crossover = None
        print(f"{human(size):>8} {medians['staged'][size]:>10.0f} {medians['registered'][size]:>11.0f} "
              f"{ratio:>11.2f}   staged {'/'.join(sorted(memory['staged'][size]))}, "
              f"registered {'/'.join(sorted(memory['registered'][size]))}")
    print(f"\nregistering costs no more than staging from: {human(crossover) if crossover else 'no size measured'}")
    print(f"(load average before/after: {[round(x, 2) for x in load_before]} / {[round(x, 2) for x in load_after]}"
          f" on {os.cpu_count()} cpus)")
    if args.parts:
        parts(sizes, max(5, args.iters // 2))
    if args.json:
        Path(args.json).write_text(json.dumps({
            "sizes": sizes, "medians_us": {p: {str(k): v for k, v in m.items()} for p, m in medians.items()},
            "times_s": {p: {str(k): v for k, v in m.items()} for p, m in per_iteration.items()},
            "loadavg": [load_before, load_after]}, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
