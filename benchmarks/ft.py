"""commd.ft: what a rank's death costs a guarded DDP job, and what the guard costs one that never fails.

Every run is `commd launch --keep-going --nproc-per-node N benchmarks/_ft_worker.py` training the
model `commd demo` trains, on one node (the simulated-hosts variant is not built yet).

* **Injections.** For each point of a step (``forward``: before the forward; ``backward``: when the
  first layer's gradient is computed, the later layers' bucket already in flight; ``optimizer``: in
  the victim's optimizer step, after the commit) and each of --injections runs, a random rank
  SIGKILLs itself at a random step.  Per run: the time from the kill to the error on the last
  survivor to see it, to the last survivor's rebuilt group, and to the last survivor's first
  completed step after it; the survivors' parameter digests must be equal, or the benchmark
  names the run and exits 1.
* **Overhead.** --repeats interleaved runs of --steps plain DDP steps and as many guarded ones
  (the commit: one tiny all-reduce per step); the median step time of each and their ratio.

    python benchmarks/ft.py                       # 3 points x 5 injections, 3 x 2 overhead runs (~4 min)
    python benchmarks/ft.py --injections 20 --json ft.json
"""

from __future__ import annotations

import argparse
import json
import os
import random
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from ddp import demo_model

HERE = Path(__file__).resolve().parent
WORKER = HERE / "_ft_worker.py"
POINTS = ("forward", "backward", "optimizer")
#: Bound on one launch (its ranks start torch, train, and maybe recover).
RUN_TIMEOUT_S = 300.0


def launch(cfg: dict[str, Any], nproc: int) -> tuple[dict[int, dict[str, Any]], dict[str, Any] | None, float]:
    """One `commd launch --keep-going` run: each survivor's result, the victim's kill record, the load."""
    with tempfile.TemporaryDirectory(prefix="commd-ft-") as tmp:
        out = Path(tmp)
        argv = [sys.executable, "-m", "commd", "launch", "--keep-going", "--no-prefix", "--nproc-per-node",
                str(nproc), str(WORKER), json.dumps(cfg), str(out)]
        env = dict(os.environ, PYTHONPATH=os.pathsep.join(filter(None, [str(HERE), os.environ.get("PYTHONPATH")])))
        proc = subprocess.run(argv, env=env, capture_output=True, text=True, timeout=RUN_TIMEOUT_S)
        if proc.returncode != 0:
            raise SystemExit(f"commd launch exited {proc.returncode}:\n{proc.stderr[-3000:]}")
        results = {int(p.stem[4:]): json.loads(p.read_text()) for p in out.glob("rank*.json")}
        kill = json.loads((out / "kill.json").read_text()) if (out / "kill.json").exists() else None
        return results, kill, os.getloadavg()[0]


def percentile(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(round(q * (len(ordered) - 1))))]


def injections(args: argparse.Namespace, model: dict[str, int], batch: int) -> dict[str, list[dict[str, float]]]:
    rng = random.Random(args.seed)
    rows: dict[str, list[dict[str, float]]] = {point: [] for point in args.point_list}
    for run in range(args.injections):
        for point in args.point_list:
            victim, step = rng.randrange(args.nproc), rng.randrange(3, args.inject_steps - 3)
            cfg = {"model": model, "batch": batch, "steps": args.inject_steps, "guard": True, "victim": victim,
                   "where": point, "kill_step": step}
            results, kill, load = launch(cfg, args.nproc)
            if kill is None or sorted(results) != [r for r in range(args.nproc) if r != victim]:
                raise SystemExit(f"{point} run {run}: victim {victim} at step {step}: expected the other ranks' "
                                 f"results and the kill, got ranks {sorted(results)}, kill {kill}")
            digests = {r["digest"] for r in results.values()}
            if len(digests) != 1:
                raise SystemExit(f"{point} run {run}: the survivors' parameters differ: {digests}")
            recoveries = [r["recoveries"] for r in results.values()]
            if any(len(rec) != 1 for rec in recoveries):
                raise SystemExit(f"{point} run {run}: expected one recovery per survivor, got {recoveries}")
            error = max(rec[0]["failed_at"] for rec in recoveries) - kill["time"]
            rebuilt = max(rec[0]["failed_at"] + rec[0]["seconds"] for rec in recoveries) - kill["time"]
            first = max(r["first_step_after_failure"] for r in results.values()) - kill["time"]
            redone = {rec[0]["step"] for rec in recoveries}
            rows[point].append({"error_s": error, "rebuilt_s": rebuilt, "first_step_s": first, "load": load,
                                "redone": sorted(redone), "kill_step": step, "victim": victim})
            print(f"  {point:9s} run {run}: rank {victim} killed at step {step}; redone {sorted(redone)}; error "
                  f"{error * 1e3:7.1f} ms, rebuilt {rebuilt * 1e3:7.1f} ms, first step {first * 1e3:7.1f} ms "
                  f"(load {load:.1f})", flush=True)
    return rows


def overhead(args: argparse.Namespace, model: dict[str, int], batch: int) -> dict[str, list[float]]:
    medians: dict[str, list[float]] = {"plain": [], "guard": []}
    for repeat in range(args.repeats):
        order = ("plain", "guard") if repeat % 2 == 0 else ("guard", "plain")
        for name in order:
            cfg = {"model": model, "batch": batch, "steps": args.steps, "guard": name == "guard"}
            results, _, load = launch(cfg, args.nproc)
            per_step = [max(r["step_times"][i] for r in results.values()) for i in range(args.warmup, args.steps)]
            medians[name].append(statistics.median(per_step))
            print(f"  overhead run {repeat} {name:5s}: median step {medians[name][-1] * 1e3:.3f} ms (load {load:.1f})",
                  flush=True)
    return medians


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--nproc", type=int, default=4)
    parser.add_argument("--injections", type=int, default=5, help="runs per point of a step (default 5)")
    parser.add_argument("--points", default=",".join(POINTS), help=f"comma-separated, of {', '.join(POINTS)}")
    parser.add_argument("--inject-steps", type=int, default=20, help="steps of an injection run (default 20)")
    parser.add_argument("--steps", type=int, default=300, help="steps of an overhead run (default 300)")
    parser.add_argument("--warmup", type=int, default=30)
    parser.add_argument("--repeats", type=int, default=3, help="overhead runs of each kind (default 3)")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--json", default=None, help="write every figure here")
    args = parser.parse_args()
    args.point_list = [p for p in args.points.split(",") if p]
    if not set(args.point_list) <= set(POINTS) or args.nproc < 2 or args.inject_steps < 8 or args.warmup >= args.steps:
        parser.error(f"--points from {POINTS}, --nproc >= 2, --inject-steps >= 8, --warmup < --steps")
    model, batch = demo_model()
    print(f"commd.ft on 1 node x {args.nproc} ranks, the demo model ({model}, batch {batch}); "
          f"load {os.getloadavg()[0]:.1f}", flush=True)
    started = time.monotonic()
    rows = injections(args, model, batch) if args.injections else {}
    medians = overhead(args, model, batch) if args.repeats else {}
    print()
    if rows:
        print("| point | runs | error after the kill, median / p99 | rebuilt, median / p99 | first step after, "
              "median / p99 |")
        print("|---|---|---|---|---|")
        for point, runs in rows.items():
            cells = []
            for key in ("error_s", "rebuilt_s", "first_step_s"):
                values = [r[key] * 1e3 for r in runs]
                cells.append(f"{statistics.median(values):.0f} / {percentile(values, 0.99):.0f} ms")
            print(f"| {point} | {len(runs)} | " + " | ".join(cells) + " |")
    if medians:
        plain, guard = statistics.median(medians["plain"]), statistics.median(medians["guard"])
        print(f"\nfailure-free step: plain DDP {plain * 1e3:.3f} ms, guarded {guard * 1e3:.3f} ms "
              f"(medians of {args.repeats} runs' medians): guard / plain = {guard / plain:.3f}")
    print(f"({time.monotonic() - started:.0f} s; load {os.getloadavg()[0]:.1f} at the end)")
    if args.json:
        Path(args.json).write_text(json.dumps({"injections": rows, "overhead": medians}, indent=1))


if __name__ == "__main__":
    main()
