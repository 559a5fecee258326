"""Command-line side of observability: the daemon's metrics/trace flags and `commd trace`.

``commd trace start FILE`` / ``commd trace stop`` turn the per-op trace of a
running job on and off (a ``trace`` control message, authenticated with the
job secret like ``commd status``); ``commd trace merge OUT IN...`` joins the
per-node files of a fabric into one Chrome / Perfetto trace.
"""

from __future__ import annotations

import argparse
import os
import sys
from pathlib import Path
from typing import Any

from commd.cli.status import StatusError, control_request, resolve_job
from commd.observe import settings
from commd.observe.trace import TraceError, check_trace_path, merge
from commd.protocol import schema as s
from commd.runtime import ConfigError, JobPaths

DEFAULT_TIMEOUT_S = 10.0


# ---- the daemon's flags -------------------------------------------------------------
def add_arguments(parser: argparse.ArgumentParser) -> None:
    group = parser.add_argument_group("metrics and tracing (off by default)")
    group.add_argument("--metrics-port", type=int, default=None, metavar="PORT",
                       help="serve Prometheus metrics on this port, 0: any free port (default: "
                            "$COMMD_METRICS_PORT, else the config's [metrics] port, else no endpoint)")
    group.add_argument("--metrics-addr", default=None, metavar="IP",
                       help="address the metrics endpoint binds to (default: $COMMD_METRICS_ADDR, else "
                            "[metrics] addr, else 127.0.0.1)")
    group.add_argument("--metrics-textfile", default=None, metavar="PATH",
                       help="also write the metrics to PATH (atomically, for node_exporter's textfile "
                            "collector) every --metrics-interval seconds and at exit (default: "
                            "$COMMD_METRICS_TEXTFILE, else [metrics] textfile)")
    group.add_argument("--metrics-interval", type=float, default=None, metavar="SECONDS",
                       help="textfile refresh period (default: $COMMD_METRICS_INTERVAL, else "
                            f"[metrics] interval_s, else {settings.DEFAULT_TEXTFILE_INTERVAL_S:g})")
    group.add_argument("--trace", default=None, metavar="FILE",
                       help="write every op's phases to FILE as Chrome/Perfetto trace JSON from the start "
                            "(in a fabric node k writes FILE's stem + '.node<k>'; default: $COMMD_TRACE)")


def daemon_settings(args: argparse.Namespace, config_path: str | None
                    ) -> tuple[settings.MetricsSettings, str | None]:
    """The metrics settings and the trace file for ``commd daemon`` (raises ConfigError)."""
    metrics = settings.resolve(args.metrics_port, args.metrics_addr, args.metrics_textfile,
                               args.metrics_interval, config_path)
    trace = args.trace if args.trace is not None else (os.environ.get("COMMD_TRACE") or None)
    if trace is not None:
        try:
            trace = check_trace_path(str(Path(trace).expanduser().absolute()),
                                     "--trace" if args.trace is not None else "COMMD_TRACE")
        except TraceError as exc:
            raise ConfigError(str(exc)) from None
    return metrics, trace


# ---- commd trace ----------------------------------------------------------------------
def add_trace_arguments(parser: argparse.ArgumentParser) -> None:
    sub = parser.add_subparsers(dest="action", required=True)
    start = sub.add_parser("start", help="trace every op of a running job into FILE (in a fabric: ask node 0; "
                                          "every node writes FILE's stem + '.node<k>')")
    start.add_argument("file", help="trace file (Chrome/Perfetto JSON)")
    stop = sub.add_parser("stop", help="finish the running trace (the file is valid JSON from then on)")
    for p in (start, stop):
        p.add_argument("--job", help="job name (default: $COMMD_JOB, else the only job with a live daemon)")
        p.add_argument("--timeout", type=float, default=DEFAULT_TIMEOUT_S,
                       help=f"seconds to wait for the daemon (default {DEFAULT_TIMEOUT_S:g})")
    joined = sub.add_parser("merge", help="join per-node trace files into one")
    joined.add_argument("output", help="merged trace file to write")
    joined.add_argument("inputs", nargs="+", help="per-node trace files")


def send_trace_control(paths: JobPaths, action: str, path: str | None,
                       timeout: float = DEFAULT_TIMEOUT_S) -> dict[str, Any]:
    """Ask the job's daemon to start or stop tracing; its answer (raises StatusError)."""
    reply = control_request(paths, {"t": s.TRACE, "action": action, "path": path}, timeout)
    if reply.get("t") != s.ACK:
        raise StatusError(f"unexpected reply from the daemon of job {paths.job!r}: {reply.get('t')!r}")
    return reply


def run_trace(args: argparse.Namespace) -> int:
    if args.action == "merge":
        try:
            count = merge(args.inputs, args.output)
        except (TraceError, OSError) as exc:
            print(f"commd trace merge: {exc}", file=sys.stderr)
            return 1
        print(f"{count} events from {len(args.inputs)} files written to {args.output}")
        return 0
    if args.timeout <= 0:
        print(f"commd trace {args.action}: --timeout must be positive", file=sys.stderr)
        return 2
    path = None
    try:
        if args.action == "start":
            path = check_trace_path(str(Path(args.file).expanduser().absolute()), "FILE")
        paths = resolve_job(args.job, os.environ.get("COMMD_JOB"))
        reply = send_trace_control(paths, args.action, path, args.timeout)
    except (StatusError, ConfigError, TraceError) as exc:
        print(f"commd trace {args.action}: {exc}", file=sys.stderr)
        return 1
    others = reply.get("forwarded_to") or 0
    where = f" (and forwarded to {others} other node{'s' if others != 1 else ''})" if others else ""
    if args.action == "start":
        print(f"tracing into {reply.get('file')}{where}")
    elif reply.get("file"):
        print(f"trace finished: {reply.get('file')}{where}")
    else:
        print(f"no trace was running on this node{where}")
    return 0
