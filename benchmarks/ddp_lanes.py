"""DDP training step time across 2 simulated hosts x 2 ranks: tuned lane choice against fixed lanes.

Settings, run interleaved ``--repeats`` times (medians of interleaved runs
compare fairly on a machine whose load drifts):

  tuned       the daemons use the tuning table given with --table (made by
              `commd tune --hosts 2 --nproc-per-node 2 --out FILE`);
  fixed tcp   no table, every op on the tcp lane;
  fixed gloo  no table, a config whose default lane is gloo.

Each run trains the same MLP with DistributedDataParallel over the `commd`
backend; the step time is the median over the steps after the first few.
Needs root (network namespaces).

    sudo .venv/bin/python benchmarks/ddp_lanes.py --table ~/.cache/commd/tuning/t.json
"""

from __future__ import annotations

import argparse
import json
import signal
import statistics
import sys
import tempfile
from pathlib import Path
from typing import Any

from _launch import run_job

WORKER = Path(__file__).with_name("_ddp_lanes_worker.py")
WARMUP_STEPS = 5


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--table", required=True, help="tuning table for the 'tuned' setting")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--steps", type=int, default=25)
    parser.add_argument("--width", type=int, default=1024)
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--bucket-mb", type=float, default=1.0,
                        help="DDP bucket_cap_mb (default 1: a spread of all-reduce sizes)")
    parser.add_argument("--timeout", type=float, default=300.0)
    parser.add_argument("--json", default=None)
    args = parser.parse_args()
    if not Path(args.table).is_file():
        parser.error(f"--table {args.table}: no such file (make one with `commd tune ... --out FILE`)")
    signal.signal(signal.SIGTERM, lambda *_: sys.exit("ddp_lanes: terminated"))
    cfg = {"seed": 3, "inputs": 256, "width": args.width, "layers": args.layers, "batch": 64,
           "steps": args.steps, "bucket_mb": args.bucket_mb}
    with tempfile.TemporaryDirectory(prefix="commd-ddp-") as tmp:
        work = Path(tmp)
        gloo_cfg = work / "gloo.toml"
        gloo_cfg.write_text('[scheduler]\ndefault_lane = "gloo"\n')
        settings = {
            "tuned": {"COMMD_TUNING": str(Path(args.table).resolve())},
            "fixed tcp": {"COMMD_TUNING": "off"},
            "fixed gloo": {"COMMD_TUNING": "off", "COMMD_CONFIG": str(gloo_cfg)},
        }
        from commd.sim.hosts import SimulatedHosts

        results: dict[str, list[dict[str, Any]]] = {name: [] for name in settings}
        with SimulatedHosts(2) as sim:
            names = list(settings)
            for rep in range(args.repeats):
                for name in names[rep % len(names):] + names[:rep % len(names)]:  # each setting leads once
                    extra = settings[name]
                    print(f"[{rep + 1}/{args.repeats}] {name} ...", file=sys.stderr, flush=True)
                    results[name].append(run_job(WORKER, cfg, extra, work, name, args.timeout, sim))
    summary = {}
    print(f"\nDDP step time, 2 simulated hosts x 2 ranks, MLP {args.layers}x{args.width}, bucket_cap_mb "
          f"{args.bucket_mb}; median step (after {WARMUP_STEPS}) per run, median over {args.repeats} runs\n")
    print(f"  {'setting':<12}{'step ms':>9}{'loss':>10}   all-reduces per lane")
    for name, runs in results.items():
        step = statistics.median(statistics.median(r["times"][WARMUP_STEPS:]) for r in runs) * 1e3
        lanes = (runs[-1].get("ops_by_lane") or {}).get("allreduce", {})
        summary[name] = {"step_ms": step, "loss": runs[-1]["loss"], "allreduce_lanes": lanes}
        lane_text = ", ".join(f"{lane} {row['ops']}" for lane, row in sorted(lanes.items()))
        print(f"  {name:<12}{step:>9.1f}{runs[-1]['loss']:>10.4f}   {lane_text}")
    best_fixed = min(summary["fixed tcp"]["step_ms"], summary["fixed gloo"]["step_ms"])
    print(f"\n  tuned / best fixed lane step time: {summary['tuned']['step_ms'] / best_fixed:.2f}")
    print(f"  tuning: {results['tuned'][-1].get('tuning')}")
    if args.json:
        Path(args.json).write_text(json.dumps({"runs": results, "summary": summary}, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
