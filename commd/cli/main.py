"""The `commd` command: daemon, launch, status, trace, demo, bench, tune, replay, algo, slurm-plan.

Only the module of the subcommand being run is imported (the others only
lend their one-line help), so that ``commd status`` or ``commd --help`` never
imports torch or the daemon.
"""

from __future__ import annotations

import argparse
import importlib
import os
import sys
from typing import NamedTuple


class Command(NamedTuple):
    """A subcommand: its help line, and where its argument definitions and entry point live."""

    help: str
    module: str
    add_arguments: str
    run: str


COMMANDS: dict[str, Command] = {
    "daemon": Command("run the node daemon for a job (foreground)", "commd.daemon.main", "add_arguments", "run"),
    "launch": Command("start the node daemon and N training processes", "commd.cli.launch", "add_arguments", "run"),
    "status": Command("show a job daemon's clients, queues and latencies", "commd.cli.status", "add_arguments",
                      "run"),
    "demo": Command("train a small DDP model through commd and through Gloo", "commd.cli.demo", "add_arguments",
                    "run"),
    "bench": Command("measure commd's collectives per lane (busbw, latency), optionally beside Gloo and MPI",
                     "commd.bench.cli", "add_bench_arguments", "run_bench"),
    "tune": Command("measure every lane per op and size and save the winners as a tuning table",
                    "commd.bench.cli", "add_tune_arguments", "run_tune"),
    "replay": Command("replay a recorded job's communication through commd's lanes, Gloo and MPI; compare step "
                      "times", "commd.bench.replay", "add_arguments", "run"),
    "trace": Command("turn a running job's per-op trace on or off; merge per-node traces", "commd.cli.trace",
                     "add_arguments", "run"),
    "algo": Command("check, simulate and list collective programs (MSCCL XML files, the library)",
                    "commd.cli.algo", "add_arguments", "run"),
    "plan": Command("plan a model's parallelization (data, tensor, sequence, sharded) from measured costs",
                    "commd.planner.cli", "add_arguments", "run"),
    "slurm-plan": Command("for the Slurm prolog: this node's rank and the job's rendezvous", "commd.deploy.slurm",
                          "add_arguments", "run"),
}


def _chosen(argv: list[str]) -> str | None:
    """The subcommand named in ``argv`` (the first word that is one; the top level has no valued options)."""
    for word in argv:
        if word in COMMANDS:
            return word
        if not word.startswith("-"):
            return None
    return None


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else list(argv)
    parser = argparse.ArgumentParser(prog="commd", description="per-node communication daemon for distributed training")
    sub = parser.add_subparsers(dest="command", required=True)
    chosen = _chosen(argv)
    subparser = parser
    for name, command in COMMANDS.items():
        p = sub.add_parser(name, help=command.help)
        if name == chosen:
            module = importlib.import_module(command.module)
            getattr(module, command.add_arguments)(p)
            p.set_defaults(run=getattr(module, command.run))
            subparser = p
    args, unknown = parser.parse_known_args(argv)
    if unknown:  # argparse would show the top-level usage; the subcommand's is the useful one
        subparser.error(f"unrecognized arguments: {' '.join(unknown)}")
    try:
        return int(args.run(args) or 0)
    except BrokenPipeError:  # `commd … | head`: the reader left; say nothing more
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        return 0


if __name__ == "__main__":
    sys.exit(main())
