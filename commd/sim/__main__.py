"""`python -m commd.sim`: simulated hosts for trying multi-node commd by hand.

Instances made by `up` stay until `down` (their state lives in
/run/commd-sim), so one terminal can start a daemon in host0 and another one in
host1 with `exec`.
"""

from __future__ import annotations

import argparse
import os
import shlex
import sys
from collections.abc import Sequence

from commd.sim.hosts import (
    DEFAULT_PREFIX,
    DELAY_BACKENDS,
    MAX_HOSTS,
    InstanceState,
    SimHostsError,
    SimulatedHosts,
    cleanup_stale,
    list_instances,
    netns_unavailable,
    parse_rate,
    remove_instance,
)

_SELF = f"{shlex.quote(sys.executable)} -m commd.sim"

_EPILOG = f"""\
examples:
  {_SELF} up 2 --delay-ms 0.1 --rate 10gbit
  {_SELF} exec host0 -- commd daemon --job demo
  {_SELF} exec host1 -- bash
  {_SELF} list
  {_SELF} down

Needs root (network namespaces, veth, bridges, tc). A delay uses netem, or a
userspace delay line where the kernel has no netem (--delay-backend).
"""


def _rate(text: str) -> str:
    try:
        parse_rate(text)
    except ValueError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None
    return text


def _delay(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a number of milliseconds") from None
    if not 0 <= value <= 10_000:
        raise argparse.ArgumentTypeError(f"delay {text} ms must lie in [0, 10000]")
    return value


def _count(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a whole number of hosts") from None
    if not 1 <= value <= MAX_HOSTS:
        raise argparse.ArgumentTypeError(f"host count must lie in 1..{MAX_HOSTS}, not {value}")
    return value


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="python -m commd.sim",
        description="Simulated hosts on one machine: each a network namespace with its own IP, "
        "COMMD_NODE and COMMD_RUNTIME_DIR, all on one bridge, links optionally shaped with tc.",
        epilog=_EPILOG,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")

    up = sub.add_parser("up", help="create K hosts; they stay until `down`",
                        description="Create K simulated hosts and print how to run commands inside them.")
    up.set_defaults(subparser=up)
    up.add_argument("count", type=_count, metavar="K", help=f"number of hosts (1..{MAX_HOSTS})")
    up.add_argument("--delay-ms", type=_delay, default=None, metavar="D",
                    help="added one-way latency per packet, on its sender's link (a round trip gains 2*D)")
    up.add_argument("--rate", type=_rate, default=None, metavar="R",
                    help="link rate per host and direction, tc syntax: 10gbit, 500mbit, ...")
    up.add_argument("--prefix", default=DEFAULT_PREFIX, metavar="P",
                    help=f"name prefix of namespaces and links, 1-8 of [a-z0-9] (default {DEFAULT_PREFIX})")
    up.add_argument("--delay-backend", choices=DELAY_BACKENDS, default="auto",
                    help="how to delay: netem qdisc, userspace delay line, or auto (netem if the kernel has it)")

    sub.add_parser("list", help="show recorded instances", description="Show recorded instances and their owners.")

    down = sub.add_parser(
        "down", help="remove instances",
        description="Remove instances: by default those made by `up` and those whose owner process is gone. "
        "Instances of programs still running (e.g. a test run) are kept unless --all.",
    )
    which = down.add_mutually_exclusive_group()
    which.add_argument("--prefix", metavar="P", help="only instances with this prefix")
    which.add_argument("--tag", metavar="TAG", help="only this instance (as shown by `list`), whoever owns it")
    which.add_argument("--all", action="store_true",
                       help="every instance, including those of running programs (they will break)")

    run = sub.add_parser(
        "exec", help="run a command inside a host",
        description="Run CMD in HOST's namespace with its COMMD_NODE and COMMD_RUNTIME_DIR added to the "
        "environment (replaces this process; the exit status is CMD's).",
    )
    run.add_argument("--instance", metavar="TAG", help="which instance, when more than one has HOST")
    run.add_argument("host", metavar="HOST", help="host name (host0, ...) or namespace name")
    run.add_argument("cmd", nargs=argparse.REMAINDER, metavar="-- CMD ...", help="the command and its arguments")
    return parser


def _owner(state: InstanceState) -> str:
    if state.persistent:
        return "up (persistent)"
    return f"pid {state.owner_pid} ({'alive' if state.owner_alive() else 'gone: stale'})"


def _shaping(state: InstanceState) -> str:
    parts = []
    if state.delay_ms:
        parts.append(f"delay {state.delay_ms:g} ms ({state.delay_backend})")
    if state.rate:
        parts.append(f"rate {state.rate}")
    return ", ".join(parts) or "unshaped"


def _table(rows: Sequence[Sequence[str]]) -> str:
    widths = [max(len(row[i]) for row in rows) for i in range(len(rows[0]))]
    return "\n".join("  ".join(cell.ljust(w) for cell, w in zip(row, widths, strict=True)).rstrip() for row in rows)


def _cmd_up(args: argparse.Namespace) -> int:
    try:
        sim = SimulatedHosts(args.count, delay_ms=args.delay_ms, rate=args.rate, prefix=args.prefix,
                             delay_backend=args.delay_backend)
    except ValueError as exc:
        args.subparser.error(str(exc))
    reason = netns_unavailable()
    if reason:
        print(f"error: {reason}", file=sys.stderr)
        return 1
    sim.up(persistent=True)
    assert sim.state is not None
    state = sim.state
    print(f"instance {state.tag}: {state.count} hosts on bridge {state.bridge} {state.bridge_ip} "
          f"({state.subnet}), {_shaping(state)}")
    rows = [["HOST", "NETNS", "IP", "COMMD_NODE", "COMMD_RUNTIME_DIR"]]
    rows += [[h.name, h.netns, h.ip, h.env["COMMD_NODE"], h.env["COMMD_RUNTIME_DIR"]] for h in sim]
    print(_table(rows))
    first = sim[0]
    env = " ".join(f"{k}={shlex.quote(v)}" for k, v in first.env.items())
    print("\nRun something inside a host:")
    print(f"  {_SELF} exec --instance {state.tag} {first.name} -- bash")
    print(f"  ip netns exec {first.netns} env {env} bash")
    print(f"The root namespace reaches the hosts through the bridge at {state.bridge_ip}.")
    print(f"Remove it:\n  {_SELF} down --tag {state.tag}")
    return 0


def _cmd_list() -> int:
    states = list_instances()
    if not states:
        print("no instances")
        return 0
    rows = [["TAG", "HOSTS", "SUBNET", "SHAPING", "OWNER"]]
    rows += [[s.tag, str(s.count), s.subnet, _shaping(s), _owner(s)] for s in states]
    print(_table(rows))
    return 0


def _cmd_down(args: argparse.Namespace) -> int:
    if args.tag:
        targets = [s for s in list_instances() if s.tag == args.tag]
        if not targets:
            print(f"error: no instance {args.tag!r} (see `{_SELF} list`)", file=sys.stderr)
            return 2
    elif args.all:
        targets = list_instances()
    else:
        targets = [s for s in list_instances(args.prefix) if s.persistent or not s.owner_alive()]
    removed = []
    for state in targets:
        remove_instance(state)
        removed.append(state.tag)
    if not args.tag:
        # Leftovers without a state file (state dir wiped): only recognisable by their prefix.
        removed += [t for t in cleanup_stale(args.prefix or DEFAULT_PREFIX) if t not in removed]
    print(f"removed {', '.join(removed)}" if removed else "nothing to remove")
    kept = [] if args.tag or args.all else [s.tag for s in list_instances(args.prefix)]
    if kept:
        print(f"kept (owner still running): {', '.join(kept)}; --all removes them too")
    return 0


def _cmd_exec(args: argparse.Namespace) -> int:
    cmd = list(args.cmd)
    if cmd[:1] == ["--"]:
        cmd = cmd[1:]
    if not cmd:
        print("error: exec needs a command after --", file=sys.stderr)
        return 2
    states = [s for s in list_instances() if args.instance in (None, s.tag)]
    matches = [(s, i) for s in states for i, h in enumerate(s.hosts) if args.host in (h["name"], h["netns"])]
    if not matches:
        known = ", ".join(f"{s.tag}:{h['name']}" for s in states for h in s.hosts) or "none"
        print(f"error: no host {args.host!r}{' in ' + args.instance if args.instance else ''} (known: {known})",
              file=sys.stderr)
        return 2
    if len(matches) > 1:
        tags = ", ".join(s.tag for s, _ in matches)
        print(f"error: {args.host!r} exists in instances {tags}: choose one with --instance TAG", file=sys.stderr)
        return 2
    state, index = matches[0]
    argv = state.argv(index, cmd)
    env = {**os.environ, **state.env(index)}
    sys.stdout.flush()
    os.execvpe(argv[0], argv, env)
    return 127  # not reached


def main(argv: Sequence[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    try:
        if args.command == "up":
            return _cmd_up(args)
        if args.command == "list":
            return _cmd_list()
        if args.command == "down":
            return _cmd_down(args)
        return _cmd_exec(args)
    except SimHostsError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 1


if __name__ == "__main__":
    sys.exit(main())
