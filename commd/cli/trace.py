"""`commd trace`: turn a running job's per-op trace on or off; merge per-node traces.

``commd trace start FILE`` / ``commd trace stop`` send a ``trace`` control
message to the job's daemon (authenticated with the job secret like ``commd
status``, through ``commd.client.status``); ``commd trace merge OUT IN...``
joins the per-node files of a fabric into one Chrome / Perfetto trace.
"""

from __future__ import annotations

import argparse
import os
import sys
from pathlib import Path

from commd.client.status import TRACE_TIMEOUT_S, StatusError, resolve_job, send_trace_control
from commd.observe.trace import TraceError, check_trace_path, merge
from commd.runtime import ConfigError

DEFAULT_TIMEOUT_S = TRACE_TIMEOUT_S


def add_arguments(parser: argparse.ArgumentParser) -> None:
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


def run(args: argparse.Namespace) -> int:
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
