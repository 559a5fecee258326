"""Small-op throughput: asynchronous 8 B - 1 KiB all-reduces from 2 ranks per node, with and without fusion.

Two layouts, each run ``--repeats`` times with the settings interleaved (the
machine's load drifts; medians of interleaved runs compare fairly):

  1 node  x 2 ranks   `commd launch` on this host (no fabric: fusion does not apply,
                      the row shows the daemon's per-op cost);
  2 hosts x 2 ranks   simulated hosts (network namespaces, root), one launcher each:
                      fusion on (defaults) against fusion off (COMMD_FUSION_THRESHOLD=0),
                      and a fusion cycle time if --cycles is given.

Reports collective ops completed per second per node (each op involves every
rank), the median over repeats, and the ratio fused / unfused.

    sudo .venv/bin/python benchmarks/small_ops.py            # ~2 min
    python benchmarks/small_ops.py --layouts 1x2 --json out.json
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

WORKER = Path(__file__).with_name("_small_ops_worker.py")


def run_once(layout: str, setting: dict[str, str], args: argparse.Namespace, work: Path, sim: Any) -> dict[str, Any]:
    nnodes = 1 if layout == "1x2" else 2
    names = [f"host{r // 2}" for r in range(2 * nnodes)] if nnodes > 1 else ["local"] * 2
    cfg = {"sizes": args.sizes, "ops": args.ops, "warmup_ops": max(args.window * 2, args.ops // 10),
           "window": args.window, "timeout": 60.0, "nodes": names}
    return run_job(WORKER, cfg, {**setting, "COMMD_TUNING": "off"}, work, f"{layout} {sorted(setting.items())}",
                   args.timeout, sim if nnodes > 1 else None)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--layouts", default="1x2,2x2", help="1x2 (one node), 2x2 (two simulated hosts)")
    parser.add_argument("--sizes", default="8,64,1024", help="bytes per all-reduce (comma list)")
    parser.add_argument("--ops", type=int, default=4000, help="all-reduces per size and run")
    parser.add_argument("--window", type=int, default=256, help="ops in flight per rank at most")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--cycles", default="", help="fusion cycle times in ms to try too (comma list)")
    parser.add_argument("--timeout", type=float, default=300.0)
    parser.add_argument("--json", default=None)
    args = parser.parse_args()
    args.sizes = [int(x) for x in args.sizes.split(",")]
    # SIGTERM unwinds like Ctrl-C, so the simulated hosts are always removed
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(f"small_ops: terminated; logs were in {tempfile.gettempdir()}"))
    layouts = args.layouts.split(",")
    settings = {"fusion on": {}, "fusion off": {"COMMD_FUSION_THRESHOLD": "0"}}
    for cycle in filter(None, args.cycles.split(",")):
        settings[f"fusion on, cycle {cycle} ms"] = {"COMMD_FUSION_CYCLE_MS": cycle}
    results: dict[str, dict[str, list[dict[str, Any]]]] = {}
    sim = None
    with tempfile.TemporaryDirectory(prefix="commd-smallops-") as tmp:
        work = Path(tmp)
        try:
            if "2x2" in layouts:
                from commd.sim.hosts import SimulatedHosts

                sim = SimulatedHosts(2).up()
            for rep in range(args.repeats):
                for layout in layouts:
                    for name, setting in settings.items():
                        if layout == "1x2" and name != "fusion on":
                            continue  # one node: no fabric, nothing to fuse
                        print(f"[{rep + 1}/{args.repeats}] {layout} {name} ...", file=sys.stderr, flush=True)
                        run = run_once(layout, setting, args, work, sim)
                        results.setdefault(layout, {}).setdefault(name, []).append(run)
        finally:
            if sim is not None:
                sim.down()
    summary = report(results, args)
    if args.json:
        Path(args.json).write_text(json.dumps({"runs": results, "summary": summary}, indent=1))
    return 0


def report(results: dict[str, dict[str, list[dict[str, Any]]]], args: argparse.Namespace) -> dict[str, Any]:
    summary: dict[str, Any] = {}
    print(f"\nsmall-op throughput: collective all-reduces completed per second per node, 2 ranks per node, "
          f"{args.ops} async ops per size, window {args.window}; median of {args.repeats} interleaved runs\n")
    for layout, by_setting in results.items():
        print(f"{layout}:")
        header = f"  {'setting':<26}" + "".join(f"{b:>10} B" for b in args.sizes) + "   fused sets / ops"
        print(header)
        for name, runs in by_setting.items():
            medians = [statistics.median(run["rows"][i]["ops_per_s"] for run in runs) for i in range(len(args.sizes))]
            fusion = runs[-1].get("fusion") or {}
            summary.setdefault(layout, {})[name] = dict(zip(map(str, args.sizes), medians, strict=True))
            extra = f"   {fusion.get('sets', 0):,} / {fusion.get('ops', 0):,}" if fusion else ""
            print(f"  {name:<26}" + "".join(f"{m:>12,.0f}" for m in medians) + extra)
        if "fusion on" in by_setting and "fusion off" in by_setting:
            on, off = summary[layout]["fusion on"], summary[layout]["fusion off"]
            print(f"  {'ratio on/off':<26}" + "".join(f"{on[str(b)] / off[str(b)]:>12.2f}" for b in args.sizes))
        print()
    return summary


if __name__ == "__main__":
    sys.exit(main())
