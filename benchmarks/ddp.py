"""DDP training through commd against Gloo and MPI: step time and the all-reduce bandwidth DDP achieved.

N local ranks (--nproc, default 2) train the same MLP on the same batches with
DistributedDataParallel over three paths, interleaved --repeats times (each
repeat in a fresh set of processes; the path that leads rotates):

  commd  ``init_process_group("commd")``, DDP's own all-reduce on ordinary tensors
         (what a user's script does), against a daemon started for a fresh job;
  gloo   the same with torch's Gloo;
  mpi    Gloo for DDP's set-up and a comm hook that all-reduces each gradient bucket
         with mpi4py ``Allreduce(IN_PLACE)`` under mpiexec (torch's pip wheel has no
         MPI backend).

Two configurations (--configs):

  demo   the model `commd demo` trains (its default width, depth and batch);
  heavy  a wide MLP with ~50 MB of gradients and a small batch, so the all-reduce
         dominates the step.

Per path: the median step time after --warmup steps (per step the slowest rank),
the compute-only step time (after each DDP step every rank trains a plain copy of the
model on the same batch, all at once, no DDP: same CPU contention, no communication),
the communication DDP could not hide = median of (step - its paired compute step), and
the all-reduce bandwidth DDP achieved = gradient bytes per step / that time (algbw;
busbw = algbw * 2(n-1)/n).  Why step - compute and not a timing comm hook: a hook
replaces DDP's built-in all-reduce, the path users take, with a Python one on commd
and Gloo; the difference is what communication costs a training step.  The time an
all-reduce was in flight per step is printed as well for mpi (its hook) and, with
--hook-timing, for commd and gloo (a timing copy of torch's default hook).

Before any figure is printed, every run's final parameters (every rank) must agree
with a single-process reference trained on the concatenated batches; otherwise the
benchmark names the mismatch and exits 1.  After the commd runs it prints the
daemon's buffer counters (`commd status`) after the first steps and at the end.

    python benchmarks/ddp.py                      # both configurations, 3 repeats (~3 min on 2 cores)
    python benchmarks/ddp.py --quick              # tiny model, 1 repeat (smoke test)
    python benchmarks/ddp.py --configs heavy --repeats 5 --json out.json
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import sys
import tempfile
import time
import uuid
from pathlib import Path
from typing import Any

import torch
from _ddp_worker import LEARNING_RATE, build_model, make_batches, train_step
from allreduce import free_port, run_group

HERE = Path(__file__).resolve().parent
WORKER = HERE / "_ddp_worker.py"
PATHS = ("commd", "gloo", "mpi")
#: Final parameters of every path agree with the reference within these (float32, different summation orders).
RTOL, ATOL = 1e-4, 1e-5
#: Below this share of the step, the exposed communication is noise: no bandwidth is derived from it.
HIDDEN_SHARE = 0.02
#: Status snapshots of the commd runs after these many first steps (at most the warm-up).
STATUS_STEPS = 3
#: Status keys whose path contains one of these are the daemon's buffer counters.
COUNTER_WORDS = ("staged", "registered")


def demo_model() -> tuple[dict[str, int], int]:
    """The model and per-rank batch `commd demo` trains by default (read from its own arguments)."""
    from commd.cli import demo

    parser = argparse.ArgumentParser()
    demo.add_arguments(parser)
    defaults = parser.parse_args([])
    return {"inputs": demo.IN_FEATURES, "width": defaults.size, "layers": defaults.layers}, defaults.batch


def configurations(quick: bool, bucket_mb: float | None) -> dict[str, dict[str, Any]]:
    model, batch = demo_model()
    configs = {
        "demo": {"model": model, "batch": batch, "bucket_mb": 25.0},
        # 256*2048 + 3*2048^2 + ... = 13.1 M parameters, 52 MB of gradients: three 25 MB buckets.
        "heavy": {"model": {"inputs": 256, "width": 2048, "layers": 4}, "batch": 8, "bucket_mb": 25.0},
    }
    if quick:
        configs = {
            "demo": {"model": {"inputs": 32, "width": 64, "layers": 2}, "batch": 8, "bucket_mb": 25.0},
            "heavy": {"model": {"inputs": 32, "width": 256, "layers": 2}, "batch": 2, "bucket_mb": 0.1},
        }
    for spec in configs.values():
        if bucket_mb is not None:
            spec["bucket_mb"] = bucket_mb
        spec["params"] = sum(p.numel() for p in build_model(spec["model"], 0).parameters())
        spec["grad_bytes"] = spec["params"] * 4
    return configs


# ---- running -------------------------------------------------------------------------
def run_once(path: str, spec: dict[str, Any], args: argparse.Namespace, work: Path, tag: str) -> dict[str, Any]:
    """One run of one path in fresh processes: every rank's result and the files of its final parameters."""
    out, params_out = str(work / f"{tag}-r{{rank}}.json"), str(work / f"{tag}-r{{rank}}.pt")
    log = work / f"{tag}.log"
    cfg = {
        "path": path, "nproc": args.nproc, "port": free_port(), "job": None, "op_timeout": args.timeout,
        "model": spec["model"], "batch": spec["batch"], "bucket_mb": spec["bucket_mb"], "seed": args.seed,
        "warmup": args.warmup, "steps": args.steps, "hook_timing": args.hook_timing,
        "status_steps": min(STATUS_STEPS, args.warmup), "threads": args.threads,
        "out": out, "params_out": params_out,
    }
    env = dict(os.environ)
    env.pop("COMMD_JOB", None)
    env.setdefault("PYTHONUNBUFFERED", "1")
    daemon = None
    try:
        if path == "commd":
            from commd.client.spawn import start_daemon
            from commd.runtime import JobPaths, new_secret

            cfg["job"] = f"ddp-{uuid.uuid4().hex[:10]}"
            daemon = start_daemon(JobPaths.for_job(cfg["job"]), new_secret(), exit_when_idle=False,
                                  extra_args=["--owner-pid", str(os.getpid())], timeout=min(60.0, args.timeout))
        cfg_file = work / f"{tag}-cfg.json"
        cfg_file.write_text(json.dumps(cfg))
        if path == "mpi":
            commands = [[args.mpiexec, "-n", str(args.nproc), sys.executable, str(WORKER), str(cfg_file)]]
        else:
            commands = [[sys.executable, str(WORKER), str(cfg_file), str(r)] for r in range(args.nproc)]
        try:
            run_group(commands, env, args.timeout, log)
        except RuntimeError as exc:
            tail = "\n".join(log.read_text(errors="replace").splitlines()[-25:]) if log.exists() else ""
            raise SystemExit(f"ddp: {path} run {tag} failed: {exc}; log {log}:\n{tail}") from None
        missing = [r for r in range(args.nproc) if not Path(out.format(rank=r)).is_file()]
        if missing:
            raise SystemExit(f"ddp: {path} run {tag}: ranks {missing} wrote no result; log {log}")
        ranks = [json.loads(Path(out.format(rank=r)).read_text()) for r in range(args.nproc)]
        return {"ranks": ranks, "params": [params_out.format(rank=r) for r in range(args.nproc)]}
    finally:
        if daemon is not None:
            from commd.cli.launch import stop_daemon

            stop_daemon(daemon)


def reference_params(spec: dict[str, Any], args: argparse.Namespace) -> list[torch.Tensor]:
    """One process trained on every rank's batch of each step at once: what DDP must compute."""
    model = build_model(spec["model"], args.seed)
    opt = torch.optim.SGD(model.parameters(), lr=LEARNING_RATE)
    total = args.warmup + args.steps
    per_rank = [make_batches(spec["model"], spec["batch"], total, args.seed, r) for r in range(args.nproc)]
    for step in range(total):
        x = torch.cat([per_rank[r][step][0] for r in range(args.nproc)])
        y = torch.cat([per_rank[r][step][1] for r in range(args.nproc)])
        train_step(model, opt, x, y)
    return [p.detach().clone() for p in model.parameters()]


def compare_params(got: list[torch.Tensor], want: list[torch.Tensor], what: str) -> tuple[str | None, float]:
    """None (and the largest difference) when every parameter is allclose, else what differs."""
    if len(got) != len(want):
        return f"{what}: {len(got)} parameter tensors, the reference has {len(want)}", float("inf")
    worst = 0.0
    for i, (a, b) in enumerate(zip(got, want, strict=True)):
        if a.shape != b.shape:
            return f"{what}: parameter {i} has shape {tuple(a.shape)}, the reference {tuple(b.shape)}", float("inf")
        diff = float((a - b).abs().max()) if a.numel() else 0.0
        worst = max(worst, diff)
        if not torch.allclose(a, b, rtol=RTOL, atol=ATOL):
            return (f"{what}: parameter {i} differs from the reference by up to {diff:.3g} "
                    f"(rtol {RTOL:g}, atol {ATOL:g})"), worst
    return None, worst


# ---- figures ---------------------------------------------------------------------------
def slowest(per_rank: list[list[float]]) -> list[float]:
    """Per step, the slowest rank's time (a collective step is as slow as its slowest rank)."""
    return [max(ts) for ts in zip(*per_rank, strict=True)]


def run_figures(run: dict[str, Any], warmup: int) -> dict[str, float]:
    """One run's medians over its timed steps; comm is the median of each step minus its paired compute step."""
    ranks = run["ranks"]
    steps = slowest([r["step_times"] for r in ranks])[warmup:]
    compute = slowest([r["compute_times"] for r in ranks])
    row = {"step_s": statistics.median(steps), "compute_s": statistics.median(compute),
           "comm_s": statistics.median(s - c for s, c in zip(steps, compute, strict=True))}
    if ranks[0].get("in_flight_s") is not None:
        row["in_flight_s"] = statistics.median(slowest([r["in_flight_s"] for r in ranks])[warmup:])
    return row


def path_figures(runs: list[dict[str, float]], grad_bytes: int, nproc: int) -> dict[str, Any]:
    """Medians over the repeats; bandwidth from the exposed communication time."""
    keys = runs[0].keys()
    row: dict[str, Any] = {k: statistics.median(r[k] for r in runs) for k in keys}
    factor = 2 * (nproc - 1) / nproc if nproc > 1 else 1.0
    hidden = row["comm_s"] <= HIDDEN_SHARE * row["step_s"]
    row["algbw_gbps"] = None if hidden else grad_bytes / row["comm_s"] / 1e9
    row["busbw_gbps"] = None if hidden else row["algbw_gbps"] * factor
    if row.get("in_flight_s"):
        row["in_flight_busbw_gbps"] = grad_bytes / row["in_flight_s"] / 1e9 * factor
    return row


def buffer_counters(status: Any, prefix: str = "") -> dict[str, Any]:
    """Every number in a status map whose key path names staged or registered buffers.

    A map with a ``staged`` key is a table of counters per buffer kind: all its entries count.
    """
    found: dict[str, Any] = {}
    if isinstance(status, dict):
        items = status.items()
    elif isinstance(status, list):
        items = ((str(i), v) for i, v in enumerate(status))
    else:
        return found
    per_kind = isinstance(status, dict) and "staged" in status
    for key, value in items:
        name = f"{prefix}.{key}" if prefix else str(key)
        if isinstance(value, (dict, list)):
            found.update(buffer_counters(value, name))
        elif isinstance(value, (int, float)) and not isinstance(value, bool) \
                and (per_kind or any(word in name.lower() for word in COUNTER_WORDS)):
            found[name] = value
    return found


def _node_wide(counters: dict[str, Any]) -> dict[str, Any]:
    """The node's totals when the status has them; per-client rows (``clients.N...``) otherwise."""
    totals = {k: v for k, v in counters.items() if not k.startswith("clients.")}
    return totals or counters


def counters_report(statuses: dict[str, Any]) -> list[str]:
    """The commd daemon's buffer counters after the first steps and at the end, and how much was staged after each.

    The verdict names the first step after which nothing more was staged: DDP rebuilds its
    buckets after step 1, so step 2's buckets are new storages.
    """
    lines = []
    snapshots = {when: buffer_counters(st) for when, st in statuses.items() if isinstance(st, dict)}
    for when, st in statuses.items():
        label = "at the end" if when == "end" else f"after step {when}"
        if isinstance(st, dict) and "error" in st:
            lines.append(f"    {label:<14} status not available: {st['error']}")
            continue
        counters = _node_wide(snapshots.get(when) or {})
        text = ", ".join(f"{k}={v}" for k, v in sorted(counters.items())) or "n/a (no staged/registered counters)"
        lines.append(f"    {label:<14} {text}")
    end = snapshots.get("end") or {}
    clients = {k: v for k, v in end.items() if k.startswith("clients.")}
    if clients and len(clients) != len(end):
        lines.append("    per client at the end: " + ", ".join(f"{k}={v}" for k, v in sorted(clients.items())))
    staged = sorted(k for k in _node_wide(end) if "staged" in k.lower())
    steps = [w for w in snapshots if w != "end" and all(k in snapshots[w] for k in staged)]
    if not staged or not steps:
        lines.append("    staged after step 1: n/a")
        return lines
    growth = {w: sum(end[k] - snapshots[w][k] for k in staged) for w in steps}
    clean = [w for w in steps if growth[w] == 0]
    verdict = ("nothing staged after step 1" if "1" in clean else
               f"STAGED after step 1; nothing staged after step {clean[0]}" if clean else
               "STAGED after every snapshot")
    lines.append(f"    staged bytes ({', '.join(staged)}) from then to the end: "
                 + ", ".join(f"after step {w} +{growth[w]}" for w in steps) + f"  ({verdict})")
    return lines


def _mib(nbytes: int) -> str:
    return f"{nbytes / 2**20:.1f} MiB" if nbytes >= 2**20 else f"{nbytes / 2**10:.1f} KiB"


def _ms(seconds: float | None) -> str:
    return "-" if seconds is None else f"{seconds * 1e3:.1f}"


def _bw(value: float | None) -> str:
    if value is None:
        return "hidden"
    return f"{value:.3f}" if value >= 0.01 else f"{value:.2e}"


def _ratio(a: float | None, b: float | None) -> str:
    return "-" if not a or not b else f"{a / b:.2f}"


def print_config(name: str, spec: dict[str, Any], figures: dict[str, dict[str, Any]], args: argparse.Namespace,
                 worst: float, load: tuple[str, str]) -> None:
    m = spec["model"]
    print(f"\n== {name}: MLP {m['inputs']} -> {m['width']} x {m['layers']} -> 1, {spec['params']:,} parameters "
          f"({_mib(spec['grad_bytes'])} of gradients per step), batch {spec['batch']} per rank, "
          f"bucket_cap_mb {spec['bucket_mb']:g}, {args.nproc} ranks")
    print(f"   median over {args.repeats} repeat(s) of the median step after {args.warmup} warm-up "
          f"({args.steps} timed); parameters match the single-process reference (largest difference {worst:.2g})")
    print(f"   {'path':<7}{'step ms':>9}{'compute ms':>12}{'comm ms':>9}{'algbw GB/s':>12}{'busbw GB/s':>12}")
    for path, row in figures.items():
        print(f"   {path:<7}{_ms(row['step_s']):>9}{_ms(row['compute_s']):>12}{_ms(row['comm_s']):>9}"
              f"{_bw(row['algbw_gbps']):>12}{_bw(row['busbw_gbps']):>12}")
    for path, row in figures.items():
        if row.get("in_flight_s") is not None:
            how = "mpi4py Allreduce inside the comm hook" if path == "mpi" else "timing comm hook (torch's default)"
            print(f"   {path}: an all-reduce in flight {_ms(row['in_flight_s'])} ms per step, {how} "
                  f"(busbw {_bw(row.get('in_flight_busbw_gbps'))} GB/s)")
    if "commd" in figures:
        mine = figures["commd"]
        for other in ("gloo", "mpi"):
            if other in figures:
                theirs = figures[other]
                print(f"   commd/{other}: step time {_ratio(mine['step_s'], theirs['step_s'])} (<1: commd faster), "
                      f"all-reduce bandwidth {_ratio(mine['busbw_gbps'], theirs['busbw_gbps'])} (>1: commd faster)")
    print(f"   load average before / after: {load[0]} / {load[1]}")


def _loadavg() -> str:
    try:
        return " ".join(Path("/proc/loadavg").read_text().split()[:3])
    except OSError:
        return "?"


# ---- main ------------------------------------------------------------------------------
def parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--nproc", type=int, default=2, help="local ranks (default 2)")
    parser.add_argument("--configs", default="demo,heavy", help="comma-separated subset of demo,heavy")
    parser.add_argument("--paths", default=",".join(PATHS), help=f"comma-separated subset of {','.join(PATHS)}")
    parser.add_argument("--repeats", type=int, default=3, help="interleaved runs per path (default 3)")
    parser.add_argument("--warmup", type=int, default=3, help="untimed first steps (default 3)")
    parser.add_argument("--steps", type=int, default=12, help="timed steps (default 12)")
    parser.add_argument("--hook-timing", action="store_true",
                        help="commd and gloo through a timing copy of torch's default comm hook instead of DDP's "
                             "built-in all-reduce: adds the time an all-reduce was in flight per step")
    parser.add_argument("--bucket-mb", type=float, default=None, help="DDP bucket_cap_mb (default 25)")
    parser.add_argument("--threads", type=int, default=None,
                        help="torch threads per rank (default: cpus / nproc, at least 1)")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--timeout", type=float, default=180.0, help="seconds allowed per run (default 180)")
    parser.add_argument("--mpiexec", help="mpiexec to use (default: the one next to this python, else PATH)")
    parser.add_argument("--quick", action="store_true", help="tiny models, 1 repeat, few steps (smoke test)")
    parser.add_argument("--json", metavar="FILE", help="write every figure and raw time to FILE")
    parser.add_argument("--keep", action="store_true", help="keep the temp directory (logs, parameters)")
    args = parser.parse_args(argv)
    args.path_list = [p.strip() for p in args.paths.split(",") if p.strip()]
    args.config_list = [c.strip() for c in args.configs.split(",") if c.strip()]
    problems = [
        (set(args.path_list) - set(PATHS), f"--paths: unknown {sorted(set(args.path_list) - set(PATHS))}; "
                                           f"choose from {','.join(PATHS)}"),
        (set(args.config_list) - {"demo", "heavy"}, f"--configs: unknown {sorted(set(args.config_list) - {'demo', 'heavy'})}"),
        (not args.path_list or not args.config_list, "--paths and --configs must name at least one"),
        (args.nproc < 1 or args.nproc > 64, "--nproc must be in 1..64"),
        (args.repeats < 1, "--repeats must be at least 1"),
        (args.warmup < 1, "--warmup must be at least 1 (DDP rebuilds its buckets after the first step)"),
        (args.steps < 1, "--steps must be at least 1"),
        (args.bucket_mb is not None and not args.bucket_mb > 0, "--bucket-mb must be positive"),
        (args.threads is not None and args.threads < 1, "--threads must be at least 1"),
        (not args.timeout > 0, "--timeout must be positive"),
    ]
    for bad, message in problems:
        if bad:
            parser.error(message)
    if args.quick:
        args.repeats, args.warmup, args.steps = 1, 2, 3
        args.timeout = min(args.timeout, 60.0)
    args.threads = args.threads or max(1, (os.cpu_count() or 1) // args.nproc)
    if "mpi" in args.path_list:
        args.mpiexec = args.mpiexec or shutil.which("mpiexec", path=str(Path(sys.executable).parent)) \
            or shutil.which("mpiexec")
        if not args.mpiexec:
            parser.error("mpiexec not found (install the `mpich` wheel, or pass --mpiexec, or leave out the mpi path)")
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    configs = configurations(args.quick, args.bucket_mb)
    work = Path(tempfile.mkdtemp(prefix="commd-ddp-"))
    runtime = work / "runtime"
    runtime.mkdir(mode=0o700)
    os.environ["COMMD_RUNTIME_DIR"] = str(runtime)  # the daemons and workers of this run only
    report: dict[str, Any] = {"nproc": args.nproc, "threads": args.threads, "configs": {}}
    failures: list[str] = []
    try:
        for name in args.config_list:
            spec = configs[name]
            load_before = _loadavg()
            runs: dict[str, list[dict[str, Any]]] = {p: [] for p in args.path_list}
            want = reference_params(spec, args)
            worst = 0.0
            for rep in range(args.repeats):
                order = args.path_list[rep % len(args.path_list):] + args.path_list[:rep % len(args.path_list)]
                for path in order:
                    print(f"[{name} {rep + 1}/{args.repeats}] {path} ...", file=sys.stderr, flush=True)
                    started = time.monotonic()
                    run = run_once(path, spec, args, work, f"{name}-{path}-{rep}")
                    run["wall_s"] = round(time.monotonic() - started, 2)
                    for rank, file in enumerate(run.pop("params")):
                        problem, diff = compare_params(torch.load(file), want, f"{name}/{path} run {rep + 1} rank {rank}")
                        worst = max(worst, diff)
                        Path(file).unlink()
                        if problem:
                            failures.append(problem)
                    runs[path].append(run)
            load = (load_before, _loadavg())
            entry: dict[str, Any] = {"spec": spec, "load": load, "largest_param_diff": worst, "runs": runs}
            report["configs"][name] = entry
            if failures:
                continue
            figures = {p: path_figures([run_figures(r, args.warmup) for r in runs[p]], spec["grad_bytes"], args.nproc)
                       for p in args.path_list}
            entry["figures"] = figures
            print_config(name, spec, figures, args, worst, load)
            if "commd" in runs:
                print("   commd daemon buffer counters (`commd status`), last commd run:")
                print("\n".join(counters_report(runs["commd"][-1]["ranks"][0]["status"])))
    finally:
        if args.json:
            Path(args.json).write_text(json.dumps(report, indent=1, default=str))
        if args.keep:
            print(f"work files kept in {work}", file=sys.stderr)
        else:
            shutil.rmtree(work, ignore_errors=True)
    if failures:
        print("\nddp: NO FIGURES: the training results disagree:", file=sys.stderr)
        for problem in failures:
            print(f"  {problem}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
