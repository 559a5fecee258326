"""Argument parsers and entry points of `commd bench` and `commd tune` (commd/cli/main.py calls these)."""

from __future__ import annotations

import argparse
import sys

from commd.bench import orchestrate
from commd.bench.orchestrate import add_layout_arguments, layout_from_args
from commd.bench.spec import SpecError, add_measure_arguments, check_group_nodes, spec_from_args

#: The tune sweep's defaults: every tuned kind, 1 KiB..16 MiB in steps of 4, a time budget per cell
#: (2 hosts x 2 ranks on 2 cores stays under 3 minutes).
TUNE_OPS = "allreduce,broadcast,allgather,alltoall,alltoallv,sendrecv"
TUNE_TIME_PER_SIZE = 1.0
TUNE_WARMUP = 2
TUNE_ITERS = 60


def add_bench_arguments(parser: argparse.ArgumentParser) -> None:
    add_measure_arguments(parser)
    add_layout_arguments(parser)
    parser.add_argument("--json", metavar="FILE", help="write every row, the layout and the ratios to FILE")
    parser.add_argument("--plot", metavar="FILE.png", help="plot busbw against size (one panel per op) to FILE.png")


def run_bench(args: argparse.Namespace) -> int:
    from commd.bench import report

    try:
        spec = spec_from_args(args)
        layout = layout_from_args(args)
        if spec.group_nodes:  # before anything starts (the worker checks again, against the nodes it finds)
            check_group_nodes(spec.group_nodes, max(1, layout.hosts))
        if args.plot:
            if not args.plot.lower().endswith(".png"):
                raise SpecError(f"--plot {args.plot!r}: give a .png file name")
            try:
                import matplotlib  # noqa: F401  (fail before measuring, not after)
            except ImportError:
                raise SpecError("--plot needs matplotlib (pip install matplotlib)") from None
        meta, rows = orchestrate.run(layout, spec)
        report.finish(meta, rows, json_path=args.json, plot_path=args.plot,
                      extra={"arguments": report.arguments_json(args)})
    except (SpecError, orchestrate.BenchError) as exc:
        print(f"commd bench: {exc}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print("commd bench: interrupted; stopped every process and removed the simulated hosts", file=sys.stderr)
        return 130
    return 0


def add_tune_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--show", nargs="?", const="", default=None, metavar="FILE",
                        help="print the tuning table at FILE (default: every table in the default directory) "
                             "as a size x op grid of winning lanes, and exit")
    add_measure_arguments(parser, ops_default=TUNE_OPS, lanes_default="all", algorithms_default="all")
    parser.set_defaults(time_per_size=TUNE_TIME_PER_SIZE, warmup=TUNE_WARMUP, iters=TUNE_ITERS)
    add_layout_arguments(parser)
    parser.add_argument("--out", metavar="FILE",
                        help="where to save the table (default: commd's tuning directory, named after node 0 "
                             "and the node count, where node 0's daemon finds it)")
    parser.add_argument("--json", metavar="FILE", help="also write every measured row and the table to FILE")


def run_tune(args: argparse.Namespace) -> int:
    from commd.bench import tune

    try:
        return tune.run(args)
    except KeyboardInterrupt:
        print("commd tune: interrupted; stopped every process and removed the simulated hosts", file=sys.stderr)
        return 130
