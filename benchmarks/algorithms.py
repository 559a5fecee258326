"""Collective algorithms benchmark: the library's programs against the tcp lane's native algorithms and MPI.

Four simulated hosts (network namespaces on one bridge, ``commd bench --hosts 4``), with
1 and with 2 ranks per host, in three link settings, each measured in one run:

  unshaped   the bare veth/bridge path (bounded by the CPU copying bytes);
  10gbit     tc: 10 Gbit/s per host and direction and 0.1 ms one-way delay;
  1gbit      tc: 1 Gbit/s per host and direction.

In each (setting, ranks per host), first ``commd tune`` on the same hosts sweeps the tcp
lane's algorithms (native and every library program of the op) and writes a tuning table;
then one ``commd bench`` times, in alternation at each size (the same machine load for all):

  all-reduce (float32, sum), 16 KiB..64 MiB:
    commd/auto                no hint: the tuned choice (the table's algorithm per size)
    commd-tcp/native          the tcp lane's own ring (no algo= hint)
    commd-tcp/oneshot, twoshot, halving_doubling   library programs (algo= hint)
    commd-tcp/ring            the ring written in the DSL, run by the interpreter
    mpi                       mpi4py Allreduce directly (its own phase, under mpiexec)
  all-to-all: commd-tcp/native (pairwise) vs commd-tcp/alltoall (direct program), and MPI;
  AllToNext: commd-tcp/native (plain sends to the next node) vs commd-tcp/alltonext (the program),
    and MPI (Sendrecv pairs).

Every commd row's result is checked against NumPy before it is timed (``commd bench``
does).  Per size and path: the median of the slowest rank's time, busbw, the ratio to native
(native median / path median: > 1 is faster) and to MPI, the machine's load average before
and after.  Targets, printed as met / NOT met:

  T1  some library program >= 1.3x native somewhere in 64 KiB..4 MiB (4 nodes);
  T2  the DSL ring >= 0.9x native at every size >= 1 MiB (the interpreter's own overhead <= 10%);
  T3  the tuned choice (commd/auto) >= 0.95x the best single algorithm at every size.

    python benchmarks/algorithms.py                 # the full run (tens of minutes on 2 cores)
    python benchmarks/algorithms.py --quick         # 4 hosts x 1 rank, two settings, three sizes (minutes)
    python benchmarks/algorithms.py --settings 10gbit --ranks 2 --json out.json

Needs root (network namespaces); MPI needs mpiexec (--no-mpi leaves it out).  On a machine
shared with other work the figures are noisy: the load averages say how busy it was.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent
ROOT = HERE.parent
sys.path.insert(0, str(ROOT))

PY = sys.executable
HOSTS = 4
#: Link settings: name -> (rate per host and direction, one-way delay ms); None: unshaped.
SETTINGS: dict[str, tuple[str | None, float | None]] = {
    "unshaped": (None, None),
    "10gbit": ("10gbit", 0.1),
    "1gbit": ("1gbit", None),
}
#: The programs compared per op (native: the tcp lane's own algorithm, no hint).
ALLREDUCE_PROGRAMS = ("native", "oneshot", "twoshot", "halving_doubling", "ring")
ALLTOALL_PROGRAMS = ("native", "alltoall")
#: AllToNext: native = the same transfer as plain sends between neighbouring nodes; the program.
ALLTONEXT_PROGRAMS = ("native", "alltonext")
#: The ops measured, with their programs.
OPS: dict[str, tuple[str, ...]] = {"allreduce": ALLREDUCE_PROGRAMS, "alltoall": ALLTOALL_PROGRAMS,
                                   "alltonext": ALLTONEXT_PROGRAMS}
DSL_RING = "ring"
AUTO = "commd/auto"
KiB, MiB = 1 << 10, 1 << 20
T1_RANGE, T1_RATIO = (64 * KiB, 4 * MiB), 1.3
T2_FROM, T2_RATIO = 1 * MiB, 0.9
T3_RATIO = 0.95


def missing_prerequisite(script: str, mpi: bool) -> str | None:
    """Why ``benchmarks/SCRIPT`` cannot run here (simulated hosts need root; MPI needs mpiexec), or None."""
    if os.geteuid() != 0:
        return f"benchmarks/{script}: simulated hosts need root (network namespaces)"
    if mpi and not (Path(PY).with_name("mpiexec").exists() or shutil.which("mpiexec")):
        return f"benchmarks/{script}: no mpiexec (pip install mpich), or pass --no-mpi"
    return None


def path_of(program: str) -> str:
    return f"commd-tcp/{program}"


def loadavg() -> list[float] | None:
    try:
        return [round(x, 2) for x in os.getloadavg()]
    except OSError:
        return None


def commd(argv: list[str], env: dict[str, str], timeout: float, log: Path) -> None:
    """Run one `python -m commd ...`; on failure raise with the tail of its output."""
    with open(log, "w") as out:
        proc = subprocess.run([PY, "-m", "commd", *argv], env=env, stdout=out, stderr=subprocess.STDOUT,
                              timeout=timeout, cwd=ROOT)
    if proc.returncode != 0:
        tail = "\n".join(log.read_text().splitlines()[-25:])
        raise RuntimeError(f"`commd {' '.join(argv[:1])}` exited {proc.returncode}:\n{tail}")


def run_one(setting: str, nproc: int, args: argparse.Namespace, work: Path) -> dict[str, Any]:
    """Tune, then bench, on 4 simulated hosts x ``nproc`` ranks in one link setting."""
    rate, delay = SETTINGS[setting]
    layout = ["--hosts", str(HOSTS), "--nproc-per-node", str(nproc), "--timeout", str(args.timeout)]
    if rate:
        layout += ["--rate", rate]
    if delay is not None:
        layout += ["--delay-ms", str(delay)]
    sizes = ["--min-bytes", args.min_bytes, "--max-bytes", args.max_bytes, "--step-factor", str(args.factor)]
    timing = ["--warmup", str(args.warmup), "--iters", str(args.iters), "--time-per-size", str(args.time_per_size)]
    tag = f"{setting}-{nproc}"
    table = work / f"table-{tag}.json"
    env = {**os.environ, "PYTHONPATH": f"{ROOT}{os.pathsep}{os.environ.get('PYTHONPATH', '')}"}
    data: dict[str, Any] = {"setting": setting, "ranks_per_host": nproc, "rate": rate, "delay_ms": delay,
                            "load_before": loadavg()}
    started = time.monotonic()
    ops = ",".join(OPS)
    if not args.no_tune:
        # The tcp lane only: the table then decides among algorithms (the lane choice is another benchmark's).
        tuned = ",".join(op for op in OPS if op != "alltonext")  # (a kind the tuning table does not hold)
        commd(["tune", *layout, *sizes, *timing, "--ops", tuned, "--lanes", "tcp", "--algorithms", "all",
               "--out", str(table), "--json", str(work / f"tune-{tag}.json")], env, args.timeout + 60,
              work / f"tune-{tag}.log")
        data["table"] = json.loads(table.read_text())
    programs = list(dict.fromkeys(p for names in OPS.values() for p in names))
    bench = ["bench", *layout, *sizes, *timing, "--ops", ops, "--lanes", "auto", "--algorithms", ",".join(programs),
             "--json", str(work / f"bench-{tag}.json")]
    if not args.no_mpi:
        bench += ["--compare", "mpi"]
    bench_env = {**env, "COMMD_TUNING": str(table) if not args.no_tune else "off"}
    commd(bench, bench_env, args.timeout + 60, work / f"bench-{tag}.log")
    data["rows"] = json.loads((work / f"bench-{tag}.json").read_text())["rows"]
    data["load_after"] = loadavg()
    data["wall_s"] = round(time.monotonic() - started, 1)
    return data


# ---- analysis -------------------------------------------------------------------------------
def by_path(rows: list[dict[str, Any]], op: str) -> dict[str, dict[int, dict[str, Any]]]:
    """path label -> size -> row, for the measured rows of ``op``."""
    out: dict[str, dict[int, dict[str, Any]]] = {}
    for r in rows:
        if r["op"] == op and r.get("check") == "ok":
            out.setdefault(r["path"], {})[r["bytes"]] = r
    return out


def ratio(base: dict[str, Any] | None, row: dict[str, Any] | None) -> float | None:
    """How much faster ``row`` is than ``base`` (base median / row median)."""
    if not base or not row or not row["median_us"]:
        return None
    return base["median_us"] / row["median_us"]


def targets(data: dict[str, Any]) -> list[tuple[str, bool | None, str]]:
    """(target, met: True/False/None = not measurable here, the evidence)."""
    paths = by_path(data["rows"], "allreduce")
    native = paths.get(path_of("native"), {})
    sizes = sorted(native)
    out: list[tuple[str, bool | None, str]] = []
    # T1: some library program >= 1.3x native in 64 KiB..4 MiB
    best: tuple[float, str, int] | None = None
    for program in ALLREDUCE_PROGRAMS[1:]:
        for size in sizes:
            if T1_RANGE[0] <= size <= T1_RANGE[1]:
                x = ratio(native.get(size), paths.get(path_of(program), {}).get(size))
                if x is not None and (best is None or x > best[0]):
                    best = (x, program, size)
    if best is None:
        out.append(("T1 program >= 1.3x native, 64K-4M", None, "no size in 64 KiB..4 MiB measured"))
    else:
        out.append(("T1 program >= 1.3x native, 64K-4M", best[0] >= T1_RATIO,
                    f"best {best[1]} at {human(best[2])}: {best[0]:.2f}x"))
    # T2: DSL ring >= 0.9x native at >= 1 MiB
    ring = paths.get(path_of(DSL_RING), {})
    xs = [(size, ratio(native.get(size), ring.get(size))) for size in sizes if size >= T2_FROM]
    xs = [(s, x) for s, x in xs if x is not None]
    if not xs:
        out.append(("T2 DSL ring >= 0.9x native, >= 1M", None, "no size >= 1 MiB measured"))
    else:
        worst = min(xs, key=lambda sx: sx[1])
        out.append(("T2 DSL ring >= 0.9x native, >= 1M", worst[1] >= T2_RATIO,
                    f"worst {worst[1]:.2f}x at {human(worst[0])}"))
    # T3: the tuned choice >= 0.95x the best single algorithm, every size (the tuned kinds: all-reduce, all-to-all)
    for op, programs in OPS.items():
        if op == "alltonext":  # not a tuned kind: its rows compare the program with plain sends only
            continue
        mine = by_path(data["rows"], op)
        auto = mine.get(AUTO, {})
        worst3: tuple[float, int, str] | None = None
        for size in sorted(auto):
            singles = [(mine[path_of(p)][size], p) for p in programs if size in mine.get(path_of(p), {})]
            if not singles:
                continue
            fastest, name = min(singles, key=lambda rp: rp[0]["median_us"])
            x = ratio(fastest, auto[size])
            if x is not None and (worst3 is None or x < worst3[0]):
                worst3 = (x, size, name)
        label = f"T3 tuned >= 0.95x best single, {op}"
        if worst3 is None:
            out.append((label, None, "no tuned (commd/auto) row measured"))
        else:
            out.append((label, worst3[0] >= T3_RATIO,
                        f"worst {worst3[0]:.2f}x at {human(worst3[1])} (best there: {worst3[2]})"))
    return out


def human(n: int) -> str:
    for unit, shift in (("G", 30), ("M", 20), ("K", 10)):
        if n >= 1 << shift and n % (1 << shift) == 0:
            return f"{n >> shift}{unit}"
    return str(n)


def print_run(data: dict[str, Any]) -> None:
    rate = f"{data['rate']}" + (f" + {data['delay_ms']:g} ms" if data["delay_ms"] is not None else "")
    print(f"\n=== {data['setting']} ({rate if data['rate'] else 'links unshaped'}), {HOSTS} hosts x "
          f"{data['ranks_per_host']} rank(s); load average before/after {data['load_before']} / "
          f"{data['load_after']}; {data['wall_s']} s")
    for op in OPS:
        paths = by_path(data["rows"], op)
        if not paths:
            continue
        native = paths.get(path_of("native"), {})
        mpi = paths.get("mpi", {})
        sizes = sorted({s for p in paths.values() for s in p})
        print(f"\n{op}: median us (busbw GB/s) [x native] [x mpi]")
        labels = [p for p in [AUTO, *(path_of(n) for n in OPS[op]), "mpi"] if p in paths]
        width = max(30, *(len(label) for label in labels))
        print(f"{'size':>6}  " + "  ".join(f"{label:>{width}}" for label in labels))
        for size in sizes:
            cells = []
            for label in labels:
                row = paths[label].get(size)
                if row is None:
                    cells.append(f"{'-':>{width}}")
                    continue
                xn, xm = ratio(native.get(size), row), ratio(mpi.get(size), row)
                text = f"{row['median_us']:.0f} ({row['busbw_gbs']:.3f})"
                text += f" [{xn:.2f}]" if xn is not None and label != path_of("native") else ""
                text += f" [{xm:.2f}]" if xm is not None and label != "mpi" else ""
                cells.append(f"{text:>{width}}")
            print(f"{human(size):>6}  " + "  ".join(cells))
    # (one bench run passes every program to both ops: only a skip of a program meant for the op is news)
    for r in data["rows"]:
        if r.get("check") == "skipped" and r.get("algorithm") in OPS.get(r["op"], ()):
            print(f"skipped {r['op']} {r['path']}: {r['reason']}")
    table = data.get("table")
    if table:
        chosen = [f"{human(e['size'])}:{e.get('algorithm') or 'native'}" for e in table["entries"]
                  if e["kind"] == "allreduce"]
        print("tuned all-reduce algorithm per size: " + ", ".join(chosen))
    print("targets:")
    for name, met, evidence in targets(data):
        verdict = "met" if met else ("NOT met" if met is False else "not measured")
        print(f"  {name:<44} {verdict:<13} {evidence}")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--settings", default=",".join(SETTINGS), help=f"subset of {','.join(SETTINGS)}")
    parser.add_argument("--ranks", default="1,2", help="ranks per host, comma-separated (default 1,2)")
    parser.add_argument("--min-bytes", default="16K", help="smallest message (default 16K)")
    parser.add_argument("--max-bytes", default="64M", help="largest message (default 64M)")
    parser.add_argument("--factor", type=int, default=4, help="each size is the previous times this (default 4)")
    parser.add_argument("--iters", type=int, default=40, help="timed iterations at most per size and path")
    parser.add_argument("--warmup", type=int, default=3, help="warm-up iterations per size and path")
    parser.add_argument("--time-per-size", type=float, default=1.5, help="seconds of timed iterations per cell")
    parser.add_argument("--timeout", type=float, default=3600.0, help="seconds one tune or bench run may take")
    parser.add_argument("--no-tune", action="store_true", help="skip `commd tune` (no tuned row: T3 not measured)")
    parser.add_argument("--no-mpi", action="store_true", help="leave MPI directly out")
    parser.add_argument("--quick", action="store_true",
                        help="4 hosts x 1 rank, unshaped and 10gbit, 64K..1M, short budgets (a few minutes)")
    parser.add_argument("--json", metavar="FILE", help="write every row, table and verdict to FILE")
    parser.add_argument("--keep", action="store_true", help="keep the work directory (logs, tables, rows)")
    args = parser.parse_args(argv)
    if args.quick:
        args.settings, args.ranks = "unshaped,10gbit", "1"
        args.min_bytes, args.max_bytes = "64K", "1M"
        args.iters, args.warmup, args.time_per_size = 8, 1, 0.4
        args.timeout = min(args.timeout, 600.0)
    settings = [s.strip() for s in args.settings.split(",") if s.strip()]
    if not settings or set(settings) - set(SETTINGS):
        parser.error(f"--settings: choose from {','.join(SETTINGS)}")
    try:
        ranks = [int(r) for r in args.ranks.split(",") if r.strip()]
    except ValueError:
        parser.error("--ranks: comma-separated whole numbers")
    if not ranks or min(ranks) < 1:
        parser.error("--ranks: at least one, each >= 1")
    missing = missing_prerequisite("algorithms.py", not args.no_mpi)
    if missing:
        print(missing, file=sys.stderr)
        return 2

    work = Path(tempfile.mkdtemp(prefix="commd-algobench-"))
    results: list[dict[str, Any]] = []
    failures: list[str] = []
    try:
        for setting in settings:
            for nproc in ranks:
                try:
                    data = run_one(setting, nproc, args, work)
                except (RuntimeError, subprocess.TimeoutExpired) as exc:
                    failures.append(f"{setting} x{nproc}: {exc}")
                    print(f"\n=== {setting}, {HOSTS} hosts x {nproc}: FAILED: {exc}", file=sys.stderr)
                    continue
                results.append(data)
                print_run(data)
                sys.stdout.flush()
    finally:
        if args.json:
            verdicts = [{"setting": d["setting"], "ranks_per_host": d["ranks_per_host"],
                         "targets": [{"target": t, "met": m, "evidence": e} for t, m, e in targets(d)]}
                        for d in results]
            Path(args.json).write_text(json.dumps({"runs": results, "verdicts": verdicts, "failures": failures},
                                                  indent=1) + "\n")
            print(f"wrote {args.json}", file=sys.stderr)
        if args.keep:
            print(f"kept {work}", file=sys.stderr)
        else:
            shutil.rmtree(work, ignore_errors=True)
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())
