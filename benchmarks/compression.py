"""Compressed broadcasts, all-gathers and all-reduces against MPI, Gloo, commd's plain forms and the
per-hop baseline.

Four simulated hosts x 1 rank, per link setting one ``commd bench`` (the paths of a size timed
in alternation): broadcast from rank 0 of 1..256 MiB through

  commd/auto                  the daemons' own choice (no codec asked for: a lossless one where
                              --table, measured by `commd tune --compression`, says it pays)
  commd/tcp                   the plain chain
  commd-tcp+bf16, +lossless, +bf16-cast   the compressed chain per codec (model-like float32)
  commd-tcp+bf16/per-hop      the baseline: every middle node decodes and codes again
  mpi, gloo                   mpi4py Bcast (under mpiexec, its own phase) and torch's Gloo, directly

All-gathers (S: the whole output) and all-reduces run the same paths but the per-hop one, beside
their plain forms.  Every commd path moves model-like float32 data, and every row is checked
(broadcasts and all-gathers: the data or a lossy codec's rounding of it, on every rank;
all-reduces: within the codec's bound per hop of the exact sum).  Targets, printed as met / NOT met:

  C1  1 Gbit/s, 64 MiB: the bf16 chain's latency at least 65% below MPI's broadcast;
  C2  10 Gbit/s + 0.1 ms, 64 MiB: the bf16 chain at least 1.3x the per-hop chain;
  C3  links unshaped: commd's own choice at least 0.95x commd's best uncompressed path at every size
      (it never compresses where that costs); beside it, the same ratio against Gloo and MPI directly.
      Without --table the daemons have no measured codec figures and their choice is uncompressed.

    python benchmarks/compression.py                  # 3 settings, 1..256 MiB (tens of minutes on 2 cores)
    python benchmarks/compression.py --quick          # 4..64 MiB, 1 Gbit/s and 10 Gbit/s only
    python benchmarks/compression.py --settings 1gbit --json out.json
    python benchmarks/compression.py --settings unshaped --table t.json   # C3 with a tuned choice

Needs root (network namespaces) and mpiexec (the mpich wheel; --no-mpi leaves MPI out).
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))

from algorithms import HOSTS, ROOT, SETTINGS, commd, human, loadavg, missing_prerequisite  # noqa: E402

CODECS = "bf16,lossless,bf16-cast,bf16/per-hop"
MiB = 1 << 20


def run_setting(setting: str, args: argparse.Namespace, work: Path) -> dict[str, Any]:
    rate, delay = SETTINGS[setting]
    argv = ["bench", "--hosts", str(HOSTS), "--nproc-per-node", "1", "--timeout", str(args.timeout),
            "--ops", args.ops, "--lanes", "auto,tcp", "--compression", CODECS,
            "--min-bytes", args.min_bytes, "--max-bytes", args.max_bytes, "--step-factor", "4",
            "--iters", str(args.iters), "--warmup", "1", "--json", str(work / f"bench-{setting}.json")]
    if rate:
        argv += ["--rate", rate]
    if delay is not None:
        argv += ["--delay-ms", str(delay)]
    argv += ["--compare", "gloo" if args.no_mpi else "gloo,mpi"]
    env = {**os.environ, "PYTHONPATH": f"{ROOT}{os.pathsep}{os.environ.get('PYTHONPATH', '')}",
           "COMMD_TUNING": str(Path(args.table).resolve()) if args.table and setting == "unshaped" else "off"}
    env.pop("COMMD_COMPRESSION", None)
    started, before = time.monotonic(), loadavg()
    commd(argv, env, args.timeout + 60, work / f"bench-{setting}.log")
    rows = json.loads((work / f"bench-{setting}.json").read_text())["rows"]
    return {"setting": setting, "rate": rate, "delay_ms": delay, "rows": rows, "load_before": before,
            "load_after": loadavg(), "wall_s": round(time.monotonic() - started, 1)}


def medians(rows: list[dict[str, Any]], op: str = "broadcast") -> dict[str, dict[int, float]]:
    """path -> size -> median µs of the checked rows of ``op``."""
    out: dict[str, dict[int, float]] = {}
    for r in rows:
        if r.get("op") == op and r.get("check") == "ok":
            out.setdefault(r["path"], {})[r["bytes"]] = r["median_us"]
    return out


def targets(data: dict[str, dict[str, Any]]) -> list[tuple[str, bool | None, str]]:
    out: list[tuple[str, bool | None, str]] = []
    one = medians(data["1gbit"]["rows"]) if "1gbit" in data else {}
    bf16, mpi = one.get("commd-tcp+bf16", {}).get(64 * MiB), one.get("mpi", {}).get(64 * MiB)
    if bf16 and mpi:
        below = 1 - bf16 / mpi
        out.append(("C1 bf16 chain >= 65% below MPI, 1 Gbit/s 64 MiB", below >= 0.65,
                    f"{bf16 / 1e3:.0f} ms vs MPI {mpi / 1e3:.0f} ms: {below:.0%} below"))
    else:
        out.append(("C1 bf16 chain >= 65% below MPI, 1 Gbit/s 64 MiB", None, "not measured"))
    ten = medians(data["10gbit"]["rows"]) if "10gbit" in data else {}
    bf16, hop = ten.get("commd-tcp+bf16", {}).get(64 * MiB), ten.get("commd-tcp+bf16/per-hop", {}).get(64 * MiB)
    if bf16 and hop:
        out.append(("C2 bf16 chain >= 1.3x per-hop, 10 Gbit/s 64 MiB", hop / bf16 >= 1.3, f"{hop / bf16:.2f}x"))
    else:
        out.append(("C2 bf16 chain >= 1.3x per-hop, 10 Gbit/s 64 MiB", None, "not measured"))
    bare = medians(data["unshaped"]["rows"]) if "unshaped" in data else {}
    auto = bare.get("commd/auto", {})

    def worst_against(paths: tuple[str, ...]) -> tuple[float, int] | None:
        found = [p for p in paths if p in bare]
        return min(((min(bare[p][s] for p in found if s in bare[p]) / auto[s], s) for s in auto
                    if any(s in bare[p] for p in found)), default=None)

    own = worst_against(("commd/auto", "commd/tcp"))  # does the own choice ever compress where it costs?
    direct = worst_against(("mpi", "gloo"))
    if own is None:
        out.append(("C3 own choice >= 0.95x best uncompressed, unshaped", None, "not measured"))
    else:
        beside = f"; against Gloo/MPI directly: worst {direct[0]:.2f}x at {human(direct[1])}" if direct else ""
        out.append(("C3 own choice >= 0.95x best uncompressed, unshaped", own[0] >= 0.95,
                    f"worst {own[0]:.2f}x at {human(own[1])} (commd's plain paths){beside}"))
    return out


def print_setting(data: dict[str, Any]) -> None:
    print(f"\n=== {data['setting']}: load {data['load_before']} -> {data['load_after']}, {data['wall_s']} s")
    for op in ("broadcast", "allgather", "allreduce"):
        by = medians(data["rows"], op)
        if not by:
            continue
        sizes = sorted({s for v in by.values() for s in v})
        paths = list(by)
        print(f"{op} median ms [x mpi: mpi's median over the row's]")
        print(f"{'size':>6}  " + "".join(f"{p:>28}" for p in paths))
        for s in sizes:
            mpi = by.get("mpi", {}).get(s)
            cells = []
            for p in paths:
                t = by[p].get(s)
                cells.append("-" if t is None else f"{t / 1e3:9.1f}" + (f" [{mpi / t:5.2f}]" if mpi else ""))
            print(f"{human(s):>6}  " + "".join(f"{c:>28}" for c in cells))


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--settings", default="1gbit,10gbit,unshaped")
    parser.add_argument("--min-bytes", default="1M")
    parser.add_argument("--max-bytes", default="256M")
    parser.add_argument("--iters", type=int, default=5)
    parser.add_argument("--timeout", type=float, default=3600.0)
    parser.add_argument("--no-mpi", action="store_true")
    parser.add_argument("--ops", default="broadcast,allgather,allreduce")
    parser.add_argument("--table", help="the daemons' tuning table for the unshaped setting (commd tune --compression)")
    parser.add_argument("--quick", action="store_true", help="4..64 MiB, 1gbit and 10gbit (about 10 minutes)")
    parser.add_argument("--json", metavar="FILE")
    args = parser.parse_args(argv)
    if args.quick:
        args.settings, args.min_bytes, args.max_bytes, args.iters = "1gbit,10gbit", "4M", "64M", 3
    settings = [s.strip() for s in args.settings.split(",") if s.strip()]
    if not settings or set(settings) - set(SETTINGS):
        parser.error(f"--settings: choose from {','.join(SETTINGS)}")
    missing = missing_prerequisite("compression.py", not args.no_mpi)
    if missing:
        print(missing, file=sys.stderr)
        return 2
    work = Path(tempfile.mkdtemp(prefix="commd-compressbench-"))
    data = {}
    for setting in settings:
        data[setting] = run_setting(setting, args, work)
        print_setting(data[setting])
    verdicts = targets(data)
    print("\ntargets:")
    for name, met, evidence in verdicts:
        print(f"  {name:<52} {'met' if met else 'not measured' if met is None else 'NOT met':<13} {evidence}")
    if args.json:
        Path(args.json).write_text(json.dumps({"settings": data, "targets": verdicts}, indent=1))
    shutil.rmtree(work, ignore_errors=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
