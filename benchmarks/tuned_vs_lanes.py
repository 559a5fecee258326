"""Tuned lane selection against every single lane, on 2 simulated hosts x 2 ranks, shaped and unshaped.

Per link setting:
  1. `commd tune --hosts 2 --nproc-per-node 2` measures every lane and writes a table;
  2. `commd bench` with the daemons using that table runs each op and size through
     "auto" (no hint: the table decides) and through each lane with a hint, the
     paths measured back to back per size.
Then, per op and size, auto's median time against the best single lane's
(target: >= 0.95x, i.e. auto's time <= best / 0.95), and over the sweep auto's
total time against the best single lane's total (target: no more), per op and
over all ops; and where the table's winners change.  Needs root.

    sudo .venv/bin/python benchmarks/tuned_vs_lanes.py [--links unshaped,shaped] [--json out.json]
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Any

from commd.scheduler.tuning import TuningTable, format_bytes

PY = sys.executable
OPS = "allreduce,broadcast,allgather,alltoall,sendrecv"
SHAPED = ["--rate", "10gbit", "--delay-ms", "0.1"]


def _commd(argv: list[str], env: dict[str, str], timeout: float) -> None:
    proc = subprocess.run([PY, "-m", "commd", *argv], env=env, timeout=timeout, capture_output=True, text=True)
    if proc.returncode != 0:
        raise SystemExit(f"commd {' '.join(argv)} failed ({proc.returncode}):\n{proc.stderr[-3000:]}")


def measure(link: str, args: argparse.Namespace, work: Path) -> dict[str, Any]:
    shaping = SHAPED if link == "shaped" else []
    table_path = work / f"{link}-table.json"
    bench_path = work / f"{link}-bench.json"
    env = {**os.environ, "COMMD_TUNING_DIR": str(work / "tuning")}
    print(f"[{link}] commd tune ...", file=sys.stderr, flush=True)
    _commd(["tune", "--hosts", "2", "--nproc-per-node", "2", *shaping, "--out", str(table_path)], env, args.timeout)
    print(f"[{link}] commd bench auto vs lanes ...", file=sys.stderr, flush=True)
    _commd(["bench", "--hosts", "2", "--nproc-per-node", "2", *shaping, "--ops", args.ops, "--lanes", "auto,all",
            "--min-bytes", args.min_bytes, "--max-bytes", args.max_bytes, "--iters", str(args.iters),
            "--json", str(bench_path)], {**env, "COMMD_TUNING": str(table_path)}, args.timeout)
    return {"table": json.loads(table_path.read_text()), "bench": json.loads(bench_path.read_text())}


def analyse(data: dict[str, Any]) -> dict[str, Any]:
    rows = data["bench"]["rows"]
    times: dict[str, dict[int, dict[str, float]]] = {}
    for row in rows:
        if row["via"] == "commd":
            times.setdefault(row["op"], {}).setdefault(row["bytes"], {})[row["lane"]] = row["median_us"]
    per_op: dict[str, Any] = {}
    all_auto = 0.0
    all_lane: dict[str, float] = {}
    for op, by_size in times.items():
        lanes = sorted({lane for cells in by_size.values() for lane in cells if lane != "auto"})
        cells = []
        for size, t in sorted(by_size.items()):
            best_lane = min(lanes, key=lambda lane: t[lane])
            cells.append({"bytes": size, "auto_us": t["auto"], "best_lane": best_lane, "best_us": t[best_lane],
                          "ratio": t[best_lane] / t["auto"]})
        totals = {lane: sum(t[lane] for t in by_size.values()) for lane in lanes}
        auto_total = sum(t["auto"] for t in by_size.values())
        best_total_lane = min(totals, key=totals.__getitem__)
        per_op[op] = {"cells": cells, "auto_total_us": auto_total, "lane_totals_us": totals,
                      "best_single_lane": best_total_lane}
        all_auto += auto_total
        for lane, total in totals.items():
            all_lane[lane] = all_lane.get(lane, 0.0) + total
    table = TuningTable.from_json(data["table"])
    return {"per_op": per_op, "auto_total_us": all_auto, "lane_totals_us": all_lane,
            "winner_changes": table.winner_changes("2"), "grid": table.grid()}


def report(link: str, result: dict[str, Any]) -> None:
    print(f"\n=== {link} links (2 hosts x 2 ranks) ===\n")
    print(result["grid"])
    print("\nper op and size: auto (tuned) median vs the best single lane (ratio = best time / auto time, "
          "target >= 0.95)")
    misses = 0
    for op, info in result["per_op"].items():
        cells = info["cells"]
        print(f"  {op:<10}" + "".join(f"{format_bytes(c['bytes']):>9}" for c in cells))
        print(f"  {'best':<10}" + "".join(f"{c['best_lane']:>9}" for c in cells))
        print(f"  {'ratio':<10}" + "".join(f"{c['ratio']:>9.2f}" for c in cells))
        misses += sum(c["ratio"] < 0.95 for c in cells)
        totals = ", ".join(f"{lane} {t / 1e3:.1f} ms" for lane, t in sorted(info["lane_totals_us"].items()))
        best = info["lane_totals_us"][info["best_single_lane"]]
        print(f"  {'total':<10}auto {info['auto_total_us'] / 1e3:.1f} ms; {totals}; auto / best single lane "
              f"({info['best_single_lane']}) = {info['auto_total_us'] / best:.3f}")
    best_lane = min(result["lane_totals_us"], key=result["lane_totals_us"].__getitem__)
    best = result["lane_totals_us"][best_lane]
    cells = sum(len(i["cells"]) for i in result["per_op"].values())
    print(f"\n  all ops: auto {result['auto_total_us'] / 1e3:.1f} ms vs best single lane {best_lane} "
          f"{best / 1e3:.1f} ms -> {result['auto_total_us'] / best:.3f}; cells below 0.95: {misses} of {cells}")


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--links", default="unshaped,shaped")
    parser.add_argument("--ops", default=OPS)
    parser.add_argument("--min-bytes", default="1K")
    parser.add_argument("--max-bytes", default="16M")
    parser.add_argument("--iters", type=int, default=30)
    parser.add_argument("--timeout", type=float, default=900.0)
    parser.add_argument("--json", default=None)
    args = parser.parse_args()
    out: dict[str, Any] = {}
    with tempfile.TemporaryDirectory(prefix="commd-tuned-") as tmp:
        for link in args.links.split(","):
            data = measure(link, args, Path(tmp))
            result = analyse(data)
            report(link, result)
            out[link] = {"raw": data, "analysis": {k: v for k, v in result.items() if k != "grid"}}
    if args.json:
        Path(args.json).write_text(json.dumps(out, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
