"""The `commd` command: daemon, launch, status, trace, demo, bench, tune."""

from __future__ import annotations

import argparse
import sys


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="commd", description="per-node communication daemon for distributed training")
    sub = parser.add_subparsers(dest="command", required=True)

    from commd.daemon import main as daemon_main

    p = sub.add_parser("daemon", help="run the node daemon for a job (foreground)")
    daemon_main.add_arguments(p)
    p.set_defaults(run=daemon_main.run)

    from commd.cli import launch, status

    p = sub.add_parser("launch", help="start the node daemon and N training processes")
    launch.add_arguments(p)
    p.set_defaults(run=launch.run)

    p = sub.add_parser("status", help="show a job daemon's clients, queues and latencies")
    status.add_arguments(p)
    p.set_defaults(run=status.run)

    p = sub.add_parser("demo", help="train a small DDP model through commd and through Gloo")
    from commd.cli import demo

    demo.add_arguments(p)
    p.set_defaults(run=demo.run)

    from commd.observe import cli as observe_cli

    p = sub.add_parser("trace", help="turn a running job's per-op trace on or off; merge per-node traces")
    observe_cli.add_trace_arguments(p)
    p.set_defaults(run=observe_cli.run_trace)

    from commd.bench import cli as bench_cli

    p = sub.add_parser("bench", help="measure commd's collectives per lane (busbw, latency), optionally beside "
                                     "Gloo and MPI")
    bench_cli.add_bench_arguments(p)
    p.set_defaults(run=bench_cli.run_bench)

    p = sub.add_parser("tune", help="measure every lane per op and size and save the winners as a tuning table")
    bench_cli.add_tune_arguments(p)
    p.set_defaults(run=bench_cli.run_tune)

    from commd.deploy import slurm

    p = sub.add_parser("slurm-plan", help="for the Slurm prolog: this node's rank and the job's rendezvous")
    slurm.add_arguments(p)
    p.set_defaults(run=slurm.run)

    args = parser.parse_args(argv)
    return int(args.run(args) or 0)


if __name__ == "__main__":
    sys.exit(main())
