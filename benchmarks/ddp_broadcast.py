"""DDP on 2 simulated hosts with the parameters broadcast from rank 0 every step: bf16 against uncompressed (issue 13).

The paper's setting (HiPC 2022, "Accelerating Broadcast Communication with GPU
Compression"): after each optimizer step the root's weights are pushed to the replicas.
Each run trains an MLP (default 256 -> 1024 x 6 -> 16, 5.5 M parameters, 21 MiB of
float32) with DistributedDataParallel over the `commd` backend on a deterministic task
(regression onto a fixed random teacher network; every run sees the same batches), and
after every step broadcasts ALL parameters from rank 0 as ONE flat float32 buffer (the
parameters are views into it, so the push is in place, no copies) through a group made
with ``commd.Options(compression=CODEC)``.  One buffer is what a weight push does, and
it is what compresses: ops under 1 MiB travel uncompressed (COMPRESS_MIN_BYTES).  DDP's
gradient all-reduces run on the default group, uncompressed, in every setting: only the
broadcast differs.  With a lossy codec the root's copy is rounded too (replicas stay
identical), so by default the next step trains from, and the optimizer updates, the
rounded weights (what ``dist.broadcast(param, 0)`` in a user's loop does);
``--master-weights`` keeps float32 copies for the optimizers and pushes the root's
(mixed precision's master weights).  Adam, constant lr 3e-4, 300 steps by default: by then
the loss has settled, and the loss comparison is not one point of a steep descent.

Settings (``--codecs``, default none,bf16; ``none`` is a group with no codec, the daemons'
own choice of lane) run interleaved ``--repeats`` times, the leading setting rotating, so
load drift is shared.  Per setting: the median step time (per step the slowest rank's;
after ``--warmup`` steps; median over the runs), the broadcast's median time and share of
the step, the held-out loss after training (a fixed evaluation set, computed the same way
for every setting; runs are deterministic, so repeats agree), the mean training loss of
the last ``--loss-window`` steps over all ranks (fresh batches: an estimate of the same),
and the codec's coded/raw bytes from rank 0's node's `commd status`.  Then the targets:

  step time bf16 vs none: X.XXx      (none's step time / bf16's: > 1, bf16 faster)
  loss within 1%: met / NOT met      (|loss_bf16 - loss_none| / loss_none <= 0.01, held-out loss)

Every run is checked: after the final broadcast every rank's parameters are bit-identical
to rank 0's (a digest all-gathered over the default group), and rank 0's own copy is its
weights rounded as the codec rounds.  No figures are printed when a check fails (exit 1).

    sudo .venv/bin/python benchmarks/ddp_broadcast.py                    # 1 Gbit/s, ~10 min on 2 cores
    sudo .venv/bin/python benchmarks/ddp_broadcast.py --quick            # tiny model, few steps
    sudo .venv/bin/python benchmarks/ddp_broadcast.py --codecs none,bf16,lossless --json out.json

Needs root (network namespaces).
"""

from __future__ import annotations

import argparse
import json
import os
import secrets
import signal
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))

from _launch import run_job  # noqa: E402

WORKER = HERE / "_ddp_broadcast_worker.py"
#: The loss target: the compressed run's held-out loss within this fraction of the uncompressed run's.
LOSS_TOLERANCE = 0.01
MiB = 1 << 20


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--codecs", default="none,bf16", help="settings, comma-separated: none and codec names")
    parser.add_argument("--repeats", type=int, default=2)
    parser.add_argument("--steps", type=int, default=300, help="training steps per run (300: the loss has settled)")
    parser.add_argument("--warmup", type=int, default=5, help="steps left out of the step time")
    parser.add_argument("--width", type=int, default=1024)
    parser.add_argument("--layers", type=int, default=6, help="hidden Linear layers of the student")
    parser.add_argument("--inputs", type=int, default=256)
    parser.add_argument("--outputs", type=int, default=16)
    parser.add_argument("--batch", type=int, default=32, help="samples per rank and step")
    parser.add_argument("--optimizer", choices=("adam", "sgd"), default="adam")
    parser.add_argument("--lr", type=float, default=None, help="default: 3e-4 for adam, 0.02 for sgd")
    parser.add_argument("--master-weights", action="store_true",
                        help="the optimizers update float32 copies; the root pushes its copy (rounded by the codec)")
    parser.add_argument("--loss-window", type=int, default=50,
                        help="steps whose training loss (all ranks, fresh batches) is averaged for 'train loss'")
    parser.add_argument("--seed", type=int, default=3)
    parser.add_argument("--bucket-mb", type=float, default=25.0, help="DDP bucket_cap_mb")
    parser.add_argument("--nproc-per-node", type=int, default=1)
    parser.add_argument("--rate", default="1gbit", help="per-host link rate (tc); 'none': unshaped")
    parser.add_argument("--delay-ms", type=float, default=None, help="one-way delay added per link")
    parser.add_argument("--timeout", type=float, default=600.0, help="seconds per run")
    parser.add_argument("--quick", action="store_true", help="a tiny model, 8 steps, 1 repeat")
    parser.add_argument("--json", metavar="FILE")
    args = parser.parse_args(argv)
    if args.quick:
        args.width, args.layers, args.steps, args.warmup, args.repeats = 512, 2, 8, 2, 1  # 1.5 MiB: compressed
        args.loss_window = min(args.loss_window, 4)
    args.codecs = [c.strip() for c in args.codecs.split(",") if c.strip()]
    if not args.codecs or len(set(args.codecs)) != len(args.codecs):
        parser.error("--codecs: give each setting once, e.g. none,bf16")
    from commd.codecs import CodecError, get

    for c in args.codecs:
        if c != "none":
            try:
                get(c)
            except CodecError as exc:
                parser.error(f"--codecs: {exc}")
    if args.repeats < 1 or args.steps < 1:
        parser.error("--repeats and --steps must be at least 1")
    if not 0 <= args.warmup < args.steps:
        parser.error("--warmup must be at least 0 and below --steps")
    if not 1 <= args.loss_window <= args.steps:
        parser.error("--loss-window must be between 1 and --steps")
    if args.lr is None:
        args.lr = 3e-4 if args.optimizer == "adam" else 0.02
    if args.rate.lower() in ("none", "unshaped", ""):
        args.rate = None
    return args


def worker_config(args: argparse.Namespace, codec: str) -> dict[str, Any]:
    return {"codec": codec, "seed": args.seed, "inputs": args.inputs, "outputs": args.outputs, "width": args.width,
            "layers": args.layers, "batch": args.batch, "steps": args.steps, "optimizer": args.optimizer,
            "lr": args.lr, "bucket_mb": args.bucket_mb, "master_weights": args.master_weights}


def interleaved(names: list[str], repeats: int) -> list[tuple[int, str]]:
    """(repeat, setting) in run order: every repeat runs every setting, the leading one rotating."""
    return [(rep, name) for rep in range(repeats)
            for name in names[rep % len(names):] + names[:rep % len(names)]]


def slowest_per_step(per_rank: list[list[float]], warmup: int) -> list[float]:
    """Per step after ``warmup``: the slowest rank's time."""
    return [max(step) for step in zip(*per_rank, strict=True)][warmup:]


def check_run(run: dict[str, Any]) -> str | None:
    """Why a run's parameters are wrong, or None."""
    if not run["identical"]:
        return f"ranks' parameters differ after the final broadcast (digests {run['digests']})"
    if not run["root_rounded_as_codec"]:
        return "rank 0's parameters are not its weights rounded as the codec rounds"
    return None


def window_loss(per_rank: list[list[float]], window: int) -> float:
    """The mean training loss of the last ``window`` steps over every rank (each on a fresh batch)."""
    return statistics.fmean(x for losses in per_rank for x in losses[-window:])


def setting_figures(runs: list[dict[str, Any]], warmup: int, window: int) -> dict[str, Any]:
    """One setting's figures from its runs (medians over runs of per-run medians)."""
    step = statistics.median(statistics.median(slowest_per_step(r["step_times"], warmup)) for r in runs)
    bcast = statistics.median(statistics.median(slowest_per_step(r["bcast_times"], warmup)) for r in runs)
    losses = [r["loss_after"] for r in runs]
    last = [window_loss(r["losses"], window) for r in runs]
    comp = runs[-1].get("compression") or {}
    ratio = next((row["ratio"] for row in comp.values() if row.get("ratio") is not None), None)
    return {"step_s": step, "bcast_s": bcast, "bcast_share": bcast / step, "loss": statistics.median(losses),
            "losses": losses, "train_loss_last": statistics.median(last), "loss_before": runs[-1]["loss_before"],
            "ratio": ratio, "compression": comp, "broadcast_lanes": runs[-1].get("broadcast_lanes"),
            "runs": len(runs)}


def loss_gap(loss: float, reference: float) -> float:
    """|loss - reference| / reference."""
    return abs(loss - reference) / reference


def target_lines(summary: dict[str, dict[str, Any]], baseline: str = "none") -> list[str]:
    """The step-time ratio and the loss target of every compressed setting against ``baseline``."""
    if baseline not in summary:
        return [f"  (no '{baseline}' setting: no ratios)"]
    ref = summary[baseline]
    out = []
    for name, fig in summary.items():
        if name == baseline:
            continue
        gap = loss_gap(fig["loss"], ref["loss"])
        out.append(f"  step time {name} vs {baseline}: {ref['step_s'] / fig['step_s']:.2f}x "
                   f"({ref['step_s'] * 1e3:.0f} -> {fig['step_s'] * 1e3:.0f} ms; broadcast "
                   f"{ref['bcast_s'] * 1e3:.0f} -> {fig['bcast_s'] * 1e3:.0f} ms)")
        out.append(f"  loss within 1%: {'met' if gap <= LOSS_TOLERANCE else 'NOT met'} "
                   f"({name} {fig['loss']:.5g} vs {baseline} {ref['loss']:.5g}: {gap:.2%}, held-out loss after "
                   f"the run; training loss of the last steps: "
                   f"{loss_gap(fig['train_loss_last'], ref['train_loss_last']):.2%})")
    return out


def loadavg() -> list[float] | None:
    try:
        return [round(x, 2) for x in os.getloadavg()]
    except OSError:
        return None


def print_log_tails(work: Path, since: float, lines: int = 25) -> None:
    for log in sorted(work.glob("*.log")):
        if log.stat().st_mtime >= since:
            tail = log.read_text(errors="replace").splitlines()[-lines:]
            print(f"--- {log.name} (last {len(tail)} lines)", *tail, sep="\n", file=sys.stderr)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    if os.geteuid() != 0:
        print("benchmarks/ddp_broadcast.py: simulated hosts need root (network namespaces)", file=sys.stderr)
        return 2
    from commd.sim.hosts import SimulatedHosts, netns_unavailable, shaping_unavailable

    reason = netns_unavailable() or shaping_unavailable(args.delay_ms, args.rate)
    if reason:
        print(f"benchmarks/ddp_broadcast.py: {reason}", file=sys.stderr)
        return 2
    signal.signal(signal.SIGTERM, lambda *_: sys.exit("ddp_broadcast: terminated"))
    from _ddp_broadcast_worker import param_count

    params = param_count(worker_config(args, "none"))
    env = {"COMMD_TUNING": "off", "PYTHONPATH": f"{HERE.parent}{os.pathsep}{os.environ.get('PYTHONPATH', '')}"}
    os.environ.pop("COMMD_COMPRESSION", None)  # "none" means no codec, whatever the caller's environment says
    results: dict[str, list[dict[str, Any]]] = {c: [] for c in args.codecs}
    started, load_before = time.monotonic(), loadavg()
    with tempfile.TemporaryDirectory(prefix="commd-ddp-bcast-") as tmp:
        work = Path(tmp)
        with SimulatedHosts(2, delay_ms=args.delay_ms, rate=args.rate) as sim:
            for rep, codec in interleaved(args.codecs, args.repeats):
                print(f"[{rep + 1}/{args.repeats}] {codec} ...", file=sys.stderr, flush=True)
                begun, secret = time.time(), secrets.token_hex(32)  # the job's secret, the same on both hosts
                try:
                    run = run_job(WORKER, worker_config(args, codec), {**env, "COMMD_SECRET": secret}, work, codec,
                                  args.timeout, sim, nproc=args.nproc_per_node)
                except SystemExit:
                    print_log_tails(work, begun)  # the folder goes with the simulated hosts
                    raise
                problem = check_run(run)
                if problem:
                    print(f"NO FIGURES: {codec} run {rep + 1}: {problem}", file=sys.stderr)
                    return 1
                results[codec].append(run)
    load_after = loadavg()
    summary = {c: setting_figures(runs, args.warmup, args.loss_window) for c, runs in results.items()}
    link = (args.rate or "unshaped") + (f" + {args.delay_ms:g} ms" if args.delay_ms else "")
    print(f"\nDDP + per-step broadcast of all parameters from rank 0: 2 simulated hosts x {args.nproc_per_node} "
          f"rank(s), {link}; MLP {args.inputs} -> {args.width} x {args.layers} -> {args.outputs}, "
          f"{params / 1e6:.2f} M parameters ({params * 4 / MiB:.1f} MiB float32, one flat broadcast); "
          f"batch {args.batch}/rank, {args.optimizer} lr {args.lr:g}"
          f"{' (float32 master weights)' if args.master_weights else ''}, {args.steps} steps; step time: median after "
          f"{args.warmup} (slowest rank per step), median of {args.repeats} interleaved runs; "
          f"load {load_before} -> {load_after}, {time.monotonic() - started:.0f} s\n")
    print(f"  {'setting':<12}{'step ms':>9}{'bcast ms':>10}{'bcast %':>9}{'coded/raw':>11}"
          f"{'held-out loss':>15}{'train loss':>12}   (train loss: last {args.loss_window} steps, all ranks; "
          f"held-out loss before training: "
          f"{next(iter(summary.values()))['loss_before']:.5g})")
    for name, fig in summary.items():
        ratio = "-" if fig["ratio"] is None else f"{fig['ratio']:.2f}"
        print(f"  {name:<12}{fig['step_s'] * 1e3:>9.1f}{fig['bcast_s'] * 1e3:>10.1f}{fig['bcast_share']:>9.0%}"
              f"{ratio:>11}{fig['loss']:>15.5g}{fig['train_loss_last']:>12.5g}")
    print("\n  every run: after the final broadcast all ranks' parameters bit-identical to rank 0's\n")
    for line in target_lines(summary):
        print(line)
    if args.json:
        Path(args.json).write_text(json.dumps({"args": {k: v for k, v in vars(args).items()}, "params": params,
                                               "load_before": load_before, "load_after": load_after,
                                               "summary": summary, "runs": results}, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
