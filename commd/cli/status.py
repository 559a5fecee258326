"""`commd status`: show a job daemon's clients, queues, latencies and errors.

Asks the daemon over its control socket through ``commd.client.status`` (a
STATUS request carrying the job secret, read from the private job directory,
so only the job's owner can look) and prints either a table for people or
stable JSON for scripts.  ``format_status`` is shared with ``commd demo``.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from typing import Any

from commd.client.status import DEFAULT_TIMEOUT_S, StatusError, query_status, resolve_job
from commd.runtime import ConfigError

__all__ = ["DEFAULT_TIMEOUT_S", "StatusError", "add_arguments", "format_status", "human_bytes", "query_status",
           "run"]


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--job", help="job name (default: $COMMD_JOB, else the only job with a live daemon)")
    parser.add_argument("--json", action="store_true", help="print the status map as JSON (sorted keys)")
    parser.add_argument(
        "--watch", nargs="?", type=float, const=1.0, default=None, metavar="SECONDS",
        help="refresh every SECONDS (default 1) until Ctrl-C",
    )
    parser.add_argument("--timeout", type=float, default=DEFAULT_TIMEOUT_S,
                        help=f"seconds to wait for the daemon's answer (default {DEFAULT_TIMEOUT_S:g})")


# ---- formatting ---------------------------------------------------------------
def human_bytes(n: float) -> str:
    """1536 -> '1.5 KiB' (binary units, as memory sizes are)."""
    value = float(n)
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if abs(value) < 1024 or unit == "TiB":
            return f"{int(value)} B" if unit == "B" else f"{value:.1f} {unit}"
        value /= 1024
    raise AssertionError("unreachable")


def human_seconds(seconds: float) -> str:
    """Short durations in s, longer ones as 1h02m03s."""
    if seconds < 60:
        return f"{seconds:.1f}s"
    total = int(seconds)
    hours, rest = divmod(total, 3600)
    minutes, secs = divmod(rest, 60)
    return f"{hours}h{minutes:02d}m{secs:02d}s" if hours else f"{minutes}m{secs:02d}s"


def human_us(us: float) -> str:
    if us < 1000:
        return f"{us:.0f}us"
    if us < 1_000_000:
        return f"{us / 1000:.2f}ms"
    return f"{us / 1e6:.2f}s"


def _table(headers: list[str], rows: list[list[str]], left: int = 1) -> list[str]:
    """Columns padded to width; the first ``left`` columns left-aligned, numbers right-aligned."""
    widths = [max(len(str(x)) for x in col) for col in zip(headers, *rows, strict=True)]

    def line(cells: list[str]) -> str:
        return "  ".join(
            str(c).ljust(w) if i < left else str(c).rjust(w) for i, (c, w) in enumerate(zip(cells, widths, strict=True))
        ).rstrip()

    return ["  " + line(headers)] + ["  " + line(r) for r in rows]


def format_status(status: dict[str, Any]) -> str:
    """The status map as a table for people (what `commd status` prints)."""
    out: list[str] = []
    head = (
        f"job {status.get('job')}   daemon pid {status.get('pid')}   "
        f"uptime {human_seconds(float(status.get('uptime_s', 0)))}   "
        f"ops done {status.get('ops_done', 0):,}   moved {human_bytes(status.get('bytes_moved', 0))}"
    )
    if status.get("closing"):
        head += "   [SHUTTING DOWN]"
    out.append(head)
    observe = status.get("observe") or {}
    shown = [f"{label} {observe[key]}" for key, label in
             (("metrics_url", "metrics"), ("metrics_textfile", "metrics textfile"), ("trace", "tracing to"))
             if observe.get(key)]
    if shown:
        out.append("   ".join(shown))
    collector = status.get("gc") or {}
    full = (collector.get("generations") or [{}] * 3)[-1]
    if collector:
        out.append(f"garbage collector: {collector.get('frozen_objects', 0):,} objects frozen; "
                   f"{full.get('collections', 0):,} full collections, longest {full.get('longest_ms', 0):g} ms")

    fabric = status.get("fabric")
    if fabric:
        out.append("")
        role = "coordinator" if fabric.get("coordinator") else "member"
        median = fabric.get("negotiation_us_median")
        out.append(
            f"fabric: node {fabric.get('node')} ({status.get('node')}, {role}) of {len(fabric.get('nodes') or [])}; "
            f"lanes {', '.join(fabric.get('lanes') or [])}; reported {fabric.get('reported', 0):,} ops "
            f"({fabric.get('fast_path', 0):,} on the cached fast path); negotiation median "
            f"{human_us(median) if median is not None else '-'}"
        )
        if fabric.get("broken"):
            out.append(f"  BROKEN: {fabric['broken']}")
        out += _table(
            ["node", "name", "address", "state", "heard"],
            [[str(n.get("rank")), n.get("name", ""), n.get("ip", ""), "up" if n.get("alive") else "DEAD",
              f"{n.get('heard_s_ago', 0):.1f}s ago"] for n in fabric.get("nodes") or []],
            left=4,
        )
        if fabric.get("tuning"):
            out.append(f"  lane choice: {fabric['tuning']}")
        fusion = fabric.get("fusion") or {}
        if fusion:
            threshold = fusion.get("threshold_bytes") or 0
            out.append(
                f"  fusion: {'up to ' + human_bytes(threshold) if threshold else 'off'}, cycle "
                f"{fusion.get('cycle_ms') or 0:g} ms; {fusion.get('ops', 0):,} ops ran in "
                f"{fusion.get('sets', 0):,} fused sets"
            )
        for name, row in sorted((fabric.get("compression") or {}).items()):
            out.append(f"  compressed ops, {name}: {row.get('ops', 0):,} (broadcasts, all-gathers, all-reduces), "
                       f"{human_bytes(row.get('raw_bytes', 0))} as {human_bytes(row.get('wire_bytes', 0))} "
                       f"(ratio {row.get('ratio') if row.get('ratio') is not None else '-'}), "
                       f"{row.get('raw_chunks', 0):,} chunks sent raw, coding {row.get('codec_s', 0):.3f} s")
        algo_ops = fabric.get("algorithm_ops") or {}
        if algo_ops:
            out.append("  inter-node ops per algorithm ('native': the lane's own): " + ", ".join(
                f"{name} {row['ops']:,} ({human_bytes(row['bytes'])})" for name, row in sorted(algo_ops.items())))
        catalog = fabric.get("algorithms") or {}
        if catalog.get("files"):
            out.append(f"  programs from {catalog.get('directory')}: " + ", ".join(
                f"{name} (sha256 {row['sha256'][:16]})" for name, row in sorted(catalog["files"].items())))
        for refused in catalog.get("refused") or []:
            out.append(f"  REFUSED program {refused['name']}: {refused['reason']}")

    by_kind = status.get("ops_by_lane") or {}
    if by_kind:
        lanes = sorted({lane for row in by_kind.values() for lane in row}, key=lambda x: (x != "local", x))
        out.append("")
        out.append("ops per kind and lane ('local': no lane, the node's own ranks)")
        # One column for ops and one for bytes per lane, so every number lines up.
        out += _table(
            ["kind"] + [f"{lane} {what}" for lane in lanes for what in ("ops", "bytes")],
            [[kind] + [cell for lane in lanes for cell in (
                (f"{row[lane]['ops']:,}", human_bytes(row[lane]["bytes"])) if lane in row else ("-", "-"))]
             for kind, row in sorted(by_kind.items())],
        )

    mix = status.get("mix") or []
    if mix:
        out.append("")
        out.append("the mix: inter-node ops per kind and size class, by lane, program ('native': the lane's own) "
                   "and codec")
        out += _table(["kind", "size", "lane", "program", "codec", "ops", "bytes"],
                      [[row["kind"], row["size"], row["lane"], row["algorithm"], row["codec"], f"{row['ops']:,}",
                        human_bytes(row["bytes"])] for row in mix], left=5)

    clients = status.get("clients") or []
    out.append("")
    out.append(f"clients ({len(clients)})")
    if clients:
        out += _table(
            ["rank", "local", "pid", "arena", "registered"],
            [[str(c.get("rank")), str(c.get("local_rank")), str(c.get("pid")), human_bytes(c.get("arena_bytes", 0)),
              f"{c.get('registered_segments', 0)} / {human_bytes(c.get('registered_bytes', 0))}"]
             for c in clients],
            left=0,
        )
    else:
        out.append("  (none connected)")
    paths = status.get("bytes_by_path") or {}
    if any(paths.values()):  # how ops' buffers reached the daemon: staged ones cost a copy in and out
        out.append("buffers by path: " + ", ".join(f"{name} {human_bytes(n)}" for name, n in paths.items()))

    groups = status.get("groups") or {}
    out.append("")
    out.append(f"groups ({len(groups)})")
    if groups:
        keys = ["size", "next_seq", "waiting", "queued", "executing", "done", "failed"]
        out += _table(
            ["group", "size", "next seq", "waiting", "queued", "executing", "done", "failed", "bytes"],
            [[name] + [f"{g.get(k, 0):,}" for k in keys] + [human_bytes(g.get("bytes", 0))]
             for name, g in sorted(groups.items())],
        )
    else:
        out.append("  (none registered)")
    rings = status.get("rings") or {}
    if rings:  # all-reduces of local groups the ranks exchanged among themselves: never in the rows above
        out.append("exchange rings (all-reduces the ranks of a local group ran without the daemon): " + ", ".join(
            f"{name} {r.get('ops', 0):,}" for name, r in sorted(rings.items())))
    batches = status.get("op_batches") or {}
    if batches.get("batches"):  # coalesced ops that arrived together, one message each batch
        out.append(f"op batches (ops submitted together): {batches['batches']:,} holding {batches.get('ops', 0):,} ops")

    latency = status.get("latency_us") or {}
    out.append("")
    out.append("op latency (submit of the first rank to completion; percentiles over the 'window' most recent ops)")
    if latency:
        out += _table(
            ["op", "count", "window", "p50", "p90", "p99"],
            [[kind, f"{row.get('count', 0):,}", f"last {row.get('window', row.get('count', 0)):,}",
              human_us(row.get("p50_us", 0)), human_us(row.get("p90_us", 0)), human_us(row.get("p99_us", 0))]
             for kind, row in sorted(latency.items())],
        )
    else:
        out.append("  (no op completed yet)")

    oldest = status.get("oldest_waiting")
    out.append("")
    if oldest:
        seq = "" if oldest.get("seq") is None else f" seq {oldest['seq']}"
        missing = ", ".join(str(r) for r in oldest.get("missing_ranks") or []) or "none"
        out.append(
            f"oldest waiting op: {oldest.get('kind')} in group {oldest.get('group')}{seq}, waiting "
            f"{human_seconds(float(oldest.get('waiting_s', 0)))}; ranks not submitted yet: {missing}"
        )
    else:
        out.append("oldest waiting op: none")

    stalls = status.get("stalls") or []
    out.append("")
    out.append(f"stalled ops ({len(stalls)})")
    if stalls:
        out += _table(
            ["group", "seq", "op", "waiting", "ranks not submitted", "nodes"],
            [[str(r.get("group")), str(r.get("seq")), str(r.get("kind")), human_seconds(float(r.get("waiting_s", 0))),
              ", ".join(str(x) for x in r.get("missing_ranks") or []) or "-",
              ", ".join(str(x) for x in r.get("missing_nodes") or []) or "local"] for r in stalls],
            left=3,
        )
    else:
        out.append("  (none)")

    hits = status.get("limits_hit") or {}
    if hits:  # per-client limits the daemon enforced (ops refused, timeouts capped, clients dropped)
        out.append("")
        out.append("limits hit: " + ", ".join(f"{name} {count:,}" for name, count in sorted(hits.items())))

    errors = status.get("last_errors") or []
    out.append("")
    out.append(f"last errors ({len(errors)})")
    if errors:
        for err in errors[-10:]:
            stamp = time.strftime("%H:%M:%S", time.localtime(float(err.get("time", 0))))
            out.append(f"  {stamp}  {err.get('message')}")
    else:
        out.append("  (none)")

    out += _membership(status.get("membership") or {})

    departures = status.get("departures") or []
    if departures:
        out.append("")
        out.append(f"recent departures ({len(departures)})")
        for dep in departures[-10:]:
            stamp = time.strftime("%H:%M:%S", time.localtime(float(dep.get("time", 0))))
            out.append(f"  {stamp}  {dep.get('message')}")
    return "\n".join(out)


def _membership(membership: dict[str, Any]) -> list[str]:
    """The ranks gone (what commd.ft reads to agree on the survivors) and the recoveries its guards reported."""
    out: list[str] = []
    gone = membership.get("gone_ranks") or {}
    if gone:
        out += ["", f"membership epoch {membership.get('epoch', 0)}: ranks gone ({len(gone)})"]
        for rank, info in sorted(gone.items(), key=lambda item: int(item[0])):
            stamp = time.strftime("%H:%M:%S", time.localtime(float(info.get("time", 0))))
            out.append(f"  {stamp}  rank {rank} {info.get('why')}")
    recoveries = membership.get("recoveries") or []
    if recoveries:
        counts = membership.get("recovery_counts") or {}
        last = membership.get("last_recovery_s")
        out += ["", f"commd.ft: {counts.get('recovered', 0)} recovered, {counts.get('joined', 0)} joined, "
                    f"{counts.get('gave_up', 0)} gave up" + (f"; last recovery {last:.2f} s" if last is not None else "")]
        for entry in recoveries[-10:]:
            out.append(f"  {time.strftime('%H:%M:%S', time.localtime(float(entry.get('time', 0))))}  "
                       f"{format_ft_event(entry)}")
    return out


def format_ft_event(entry: dict[str, Any]) -> str:
    """One reported recovery as a line: "recovery epoch 1 at step 3: ranks [3] gone, 3 ranks go on, 0.21 s
    (reported by ranks 0,1,2)"."""
    event = entry.get("event")
    what = {"recovered": "recovery", "joined": "rejoin", "gave_up": "GAVE UP"}.get(str(event), str(event))
    group = f" of group {entry['group']}" if entry.get("group") else ""
    members = len(entry.get("members") or [])
    body = f"ranks {entry.get('gone')} gone, {members} ranks go on"
    if event == "joined":
        body = f"{members} ranks again"
    elif event == "gave_up":
        body = f"ranks {entry.get('gone')} gone, {members} left"
    why = f": {entry['why']}" if entry.get("why") else ""
    reporters = ",".join(str(r) for r in entry.get("ranks") or [])
    return (f"{what} epoch {entry.get('epoch')}{group} at step {entry.get('step')}: {body}, "
            f"{float(entry.get('seconds', 0)):.2f} s{why} (reported by ranks {reporters})")


def to_json(status: dict[str, Any], indent: int | None = 2) -> str:
    """Stable JSON: sorted keys, so diffs and scripts see a fixed order."""
    return json.dumps(status, sort_keys=True, indent=indent)


# ---- command --------------------------------------------------------------------
def run(args: argparse.Namespace) -> int:
    if args.timeout <= 0:
        print("commd status: --timeout must be positive", file=sys.stderr)
        return 2
    if args.watch is not None and args.watch <= 0:
        print("commd status: --watch needs a positive number of seconds", file=sys.stderr)
        return 2
    try:
        paths = resolve_job(args.job, os.environ.get("COMMD_JOB"))
    except (StatusError, ConfigError) as exc:
        print(f"commd status: {exc}", file=sys.stderr)
        return 1
    clear = args.watch is not None and not args.json and sys.stdout.isatty()
    try:
        while True:
            try:
                status = query_status(paths, args.timeout)
            except StatusError as exc:
                print(f"commd status: {exc}", file=sys.stderr)
                return 1
            if args.json:
                # Under --watch, one JSON document per line (JSON Lines).
                text = to_json(status, None if args.watch is not None else 2)
            else:
                text = format_status(status)
            if clear:
                sys.stdout.write("\x1b[H\x1b[2J")
            print(text, flush=True)
            if args.watch is None:
                return 0
            if not args.json and not clear:
                print(flush=True)
            time.sleep(args.watch)
    except KeyboardInterrupt:
        return 0
