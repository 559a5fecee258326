"""``commd plan calibrate``: measure what the tuning table cannot say — collectives among the ranks of
one node, and the compute rate — and write them as a costs file for ``commd plan --costs``.

The collectives are timed by ``commd bench`` on this node (every kind the planner prices, groups of
2, 4, ... up to ``--nproc-per-node`` ranks, the daemon's own choice of path); the compute rate is
the median of float32 matrix products of the given size on the threads one rank gets when that
many ranks share the machine's cores.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from commd.planner.costs import COSTS_FORMAT, COSTS_VERSION, CollectiveCosts, group_key

#: The bench's op names for the kinds the planner prices.
BENCH_OPS = ("allreduce", "allgather", "reduce_scatter", "alltoall", "broadcast")


def group_sizes(nproc: int) -> list[int]:
    """2, 4, 8, ... up to ``nproc``, and ``nproc`` itself."""
    sizes, k = [], 2
    while k < nproc:
        sizes.append(k)
        k *= 2
    return sizes + [nproc] if nproc >= 2 else []


def points_from_rows(rows: list[dict[str, Any]], nodes: int = 1) -> dict[str, dict[str, list[list[float]]]]:
    """``commd bench`` rows → costs-file groups: per group key and kind, [bytes, seconds] (checked rows only)."""
    groups: dict[str, dict[str, list[list[float]]]] = {}
    for row in rows:
        if row.get("via") != "commd" or row.get("check") != "ok" or row.get("op") not in BENCH_OPS:
            continue
        if not row.get("median_us") or not row.get("bytes"):
            continue
        key = group_key(int(row.get("nodes", nodes)), int(row["world"]))
        groups.setdefault(key, {}).setdefault(row["op"], []).append([int(row["bytes"]), row["median_us"] / 1e6])
    return groups


def flops_rate(matrix: int, threads: int, repeats: int = 5) -> float:
    """Median float32 FLOP/s of ``matrix``-square products on ``threads`` threads."""
    import torch

    saved = torch.get_num_threads()
    torch.set_num_threads(max(1, threads))
    try:
        a, b = torch.randn(matrix, matrix), torch.randn(matrix, matrix)
        torch.mm(a, b)
        times = []
        for _ in range(repeats):
            began = time.perf_counter()
            torch.mm(a, b)
            times.append(time.perf_counter() - began)
    finally:
        torch.set_num_threads(saved)
    return 2.0 * matrix ** 3 / statistics.median(times)


def run(args: argparse.Namespace) -> int:
    if args.nproc_per_node < 1 or args.iters < 1 or args.matrix < 16:
        print("commd plan calibrate: --nproc-per-node and --iters must be positive, --matrix at least 16",
              file=sys.stderr)
        return 2
    groups: dict[str, dict[str, list[list[float]]]] = {}
    for k in group_sizes(args.nproc_per_node):
        with tempfile.TemporaryDirectory() as tmp:
            out = Path(tmp) / "bench.json"
            cmd = [sys.executable, "-m", "commd", "bench", "--nproc-per-node", str(k), "--ops", ",".join(BENCH_OPS),
                   "--min-bytes", "4K", "--max-bytes", args.max_bytes, "--iters", str(args.iters), "--warmup", "2",
                   "--lanes", "auto", "--json", str(out)]
            print(f"timing collectives among {k} ranks of this node: {' '.join(cmd[1:])}", flush=True)
            done = subprocess.run(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
            if done.returncode != 0:
                print(f"commd plan calibrate: commd bench failed ({done.returncode}): {done.stderr[-2000:]}",
                      file=sys.stderr)
                return 1
            for key, kinds in points_from_rows(json.loads(out.read_text())["rows"]).items():
                groups.setdefault(key, {}).update(kinds)
    rate = flops_rate(args.matrix, (os.cpu_count() or 1) // max(1, args.nproc_per_node))
    raw = {"format": COSTS_FORMAT, "version": COSTS_VERSION, "created": time.strftime("%Y-%m-%dT%H:%M:%S"),
           "host": os.uname().nodename, "nproc_per_node": args.nproc_per_node, "flops_per_s": rate, "groups": groups}
    CollectiveCosts.from_json(raw, "the measurements")  # every curve fits, or say so now
    args.out.write_text(json.dumps(raw, indent=1) + "\n")
    print(f"compute: {rate / 1e9:.1f} GFLOP/s per rank; groups: {', '.join(sorted(groups)) or 'none'}; wrote {args.out}")
    return 0
