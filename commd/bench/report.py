"""What a benchmark run shows: the table (per op, rows by size and path), the JSON file, the plot, progress.

Ratios set each commd row beside the direct peers measured in the same run:
``x gloo`` = commd's busbw / Gloo direct's busbw at the same op, size and
group (above 1: commd is faster).  A run that measured several groups
(``--group-nodes``) shows one block per op and group, each row naming its
group: their busbw factors and rank counts differ.
"""

from __future__ import annotations

import importlib.metadata
import json
import os
import platform
import socket
import sys
import time
from pathlib import Path
from typing import Any

from commd.bench.spec import OPS, human

COLUMNS = ("size", "path", "iters", "median us", "p95 us", "algbw GB/s", "busbw GB/s", "check")


class Progress:
    """A progress bar on stderr (tqdm) when stderr is a terminal; silent otherwise (logs stay clean)."""

    def __init__(self, total: int, enabled: bool, desc: str = "commd bench") -> None:
        self.bar: Any = None
        if enabled and sys.stderr.isatty():
            from tqdm import tqdm

            self.bar = tqdm(total=total, desc=desc, unit="cell", file=sys.stderr, leave=False,
                            dynamic_ncols=True)

    def update(self, n: int = 1, note: str | None = None) -> None:
        if self.bar is not None:
            if note:
                self.bar.set_postfix_str(note, refresh=False)
            self.bar.update(n)

    def set_total(self, total: int) -> None:
        if self.bar is not None:
            self.bar.total = total
            self.bar.refresh()

    def close(self) -> None:
        if self.bar is not None:
            self.bar.close()
            self.bar = None


def progress(total: int, enabled: bool = True, desc: str = "commd bench") -> Progress:
    return Progress(total, enabled, desc)


def _size(nbytes: int) -> str:
    return human(nbytes) if nbytes else "-"


def group_of(row: dict[str, Any]) -> str:
    """The group a row measured ("world": the whole job, as every row before --group-nodes)."""
    return str(row.get("group") or "world")


def _direct(rows: list[dict[str, Any]]) -> dict[tuple[str, int, str, str], dict[str, Any]]:
    return {(r["op"], r["bytes"], r["via"], group_of(r)): r for r in rows if r["via"] != "commd"}


def measured(rows: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """The rows with figures (a skipped path's row has only its reason)."""
    return [r for r in rows if r.get("check") != "skipped"]


def native_ratio(row: dict[str, Any], rows: list[dict[str, Any]]) -> float | None:
    """How much faster an algorithm row (or the daemons' own choice, commd/auto) is than the native
    algorithm (commd-tcp/native) at the same op and size: native median / its median."""
    if row.get("algorithm") == "native" or (row.get("algorithm") is None and row.get("lane") != "auto"):
        return None
    native = next((r for r in rows if r["op"] == row["op"] and r["bytes"] == row["bytes"]
                   and group_of(r) == group_of(row) and r.get("algorithm") == "native"
                   and r.get("check") != "skipped"), None)
    if native is None or not native["median_us"]:
        return None
    return native["median_us"] / row["median_us"]


def ratios(row: dict[str, Any], direct: dict[tuple[str, int, str, str], dict[str, Any]]) -> dict[str, float | None]:
    """commd's speed relative to each direct peer at the same op, size and group (time ratio for barrier)."""
    out: dict[str, float | None] = {}
    if row["via"] != "commd":
        return out
    for peer in ("gloo", "mpi"):
        theirs = direct.get((row["op"], row["bytes"], peer, group_of(row)))
        if theirs is None:
            continue
        if row["op"] == "barrier" or not theirs["busbw_gbs"]:
            out[peer] = theirs["median_us"] / row["median_us"] if row["median_us"] else None
        else:
            out[peer] = row["busbw_gbs"] / theirs["busbw_gbs"]
    return out


def format_table(meta: dict[str, Any], rows: list[dict[str, Any]]) -> str:
    """One block per op (and per group, when several were measured); sizes grow down, paths side by
    side at each size."""
    skipped = [r for r in rows if r.get("check") == "skipped"]
    rows = measured(rows)
    peers = [p for p in ("gloo", "mpi") if any(r["via"] == p for r in rows)]
    direct = _direct(rows)
    natives = any(r.get("algorithm") == "native" for r in rows)
    several = any(group_of(r) != "world" for r in rows + skipped)  # then every row names its group
    header = (["size", "group"] if several else ["size"]) + list(COLUMNS[1:]) + [f"x {p}" for p in peers] \
        + (["x native"] if natives else [])
    lines = [_layout(meta), *_load_lines(meta)]
    for op in OPS:
        labels = list(dict.fromkeys(group_of(r) for r in rows + skipped if r["op"] == op))
        for label in labels:
            lines += _op_block(meta, op, label, several, header, peers, natives, direct,
                               [r for r in rows if r["op"] == op and group_of(r) == label],
                               [r for r in skipped if r["op"] == op and group_of(r) == label])
    warnings = (meta.get("load") or {}).get("warnings") or []
    if warnings:
        lines += ["", *warnings]
    return "\n".join(lines)


def _op_block(meta: dict[str, Any], op: str, label: str, several: bool, header: list[str], peers: list[str],
              natives: bool, direct: dict[tuple[str, int, str, str], dict[str, Any]], mine: list[dict[str, Any]],
              skipped: list[dict[str, Any]]) -> list[str]:
    """The lines of one op on one group: a title naming the group (when several), then the rows."""
    where = f" on group {label}" if several else ""
    if not mine:
        return [line for r in skipped for line in ("", f"{op}{where}: skipped {r['path']}: {r['reason']}")]
    order = {path: i for i, path in enumerate(dict.fromkeys(r["path"] for r in mine))}
    mine.sort(key=lambda r: (r["bytes"], order[r["path"]]))
    factor, ranks = mine[0]["factor"], mine[0].get("world", meta["world"])
    who = f"group {label}: {ranks} ranks on {_group_nodes(mine[0], meta)} nodes" if several else f"{ranks} ranks"
    lines = [""]
    if op == "barrier":
        lines.append(f"barrier  ({who}, latency only)")
    else:
        lines.append(f"{op}  ({who}, busbw = algbw x {factor:.3g}; S = {_S_IS.get(op, 'message size')}"
                     f"{'; one-way time = round trip / 2' if op == 'sendrecv' else ''})")
    table = [header]
    for r in mine:
        cells = [_size(r["bytes"]), *([label] if several else []), r["path"], str(r["iters"]),
                 f"{r['median_us']:.1f}", f"{r['p95_us']:.1f}", f"{r['algbw_gbs']:.3f}", f"{r['busbw_gbs']:.3f}",
                 r["check"]]
        ratio = ratios(r, direct)
        cells += [f"{ratio[p]:.2f}" if ratio.get(p) else "" for p in peers]
        if natives:
            x = native_ratio(r, mine)
            cells.append(f"{x:.2f}" if x else "")
        table.append(cells)
    widths = [max(len(row[i]) for row in table) for i in range(len(header))]
    left = {header.index("path"), *([header.index("group")] if several else [])}
    for row in table:
        lines.append("  ".join(c.ljust(w) if i in left else c.rjust(w) for i, (c, w) in enumerate(
            zip(row, widths, strict=True))).rstrip())
    for r in skipped:
        lines.append(f"skipped {r['path']} (not measured at any size): {r['reason']}")
    return lines


def _group_nodes(row: dict[str, Any], meta: dict[str, Any]) -> int:
    """The nodes a row's group spans (rows from before --group-nodes: the whole job)."""
    return int(row.get("group_nodes") or meta.get("nnodes") or len(meta.get("node_names", [])) or 1)


#: What S is, per op whose S is not the message size (alltoallv's skew: commd/bench/cases.py).
_S_IS = {"allgather": "total buffer size", "reduce_scatter": "total buffer size", "alltoall": "total buffer size",
         "alltoallv": "largest rank's buffer; rank r sends rank j 1 + (r + 2j) mod (n + 1) units"}


def _load_lines(meta: dict[str, Any]) -> list[str]:
    """The load averages around the run and the cores it needed (commd/bench/load.py), when measured."""
    load = meta.get("load")
    if not load:
        return []

    def three(sample: dict[str, float] | None) -> str:
        return " ".join(f"{sample[k]:.2f}" for k in ("1m", "5m", "15m")) if sample else "unknown"

    return [f"load average (1/5/15 min): {three(load['start'])} at the start, {three(load['end'])} at the end; "
            f"{load['cores']} cores, the run needs {load['needed_cores']} ({load['needed']})"]


def _layout(meta: dict[str, Any]) -> str:
    spec = meta.get("spec", {})
    nodes = meta.get("node_names", [])
    where = (f"{len(nodes)} nodes ({', '.join(f'{n} x{k}' for n, k in zip(nodes, meta['ranks_per_node'], strict=True))})"
             if len(nodes) > 1 else f"1 node, {meta['world']} ranks")
    lanes = f"; fabric lanes {','.join(meta['fabric_lanes'])}" if meta.get("fabric_lanes") else ""
    return (f"commd bench: {where}{lanes}; dtype {spec.get('dtype', '?')}; per iteration the slowest rank's "
            "time; median and p95 over the timed iterations")


#: Packages whose versions a result depends on (read from their metadata: nothing is imported).
VERSIONED = ("torch", "numpy", "mpi4py", "pyzmq", "msgpack", "uvloop")


def versions() -> dict[str, str | None]:
    """commd's, Python's and the measured stack's versions (None: not installed)."""
    from commd import __version__

    found: dict[str, str | None] = {"commd": __version__, "python": platform.python_version()}
    for name in VERSIONED:
        try:
            found[name] = importlib.metadata.version(name)
        except importlib.metadata.PackageNotFoundError:
            found[name] = None
    return found


def host() -> dict[str, Any]:
    """The machine the run was made on."""
    return {"hostname": socket.gethostname(), "machine": platform.machine(), "cpus": os.cpu_count(),
            "system": platform.system(), "kernel": platform.release(), "platform": platform.platform(),
            "python": platform.python_version(), "python_implementation": platform.python_implementation()}


def arguments_json(args: Any) -> dict[str, Any]:
    """Every option of a parsed command line, defaults included (callables left out)."""
    return {k: v for k, v in sorted(vars(args).items()) if not callable(v)}


def write_json(path: str, meta: dict[str, Any], rows: list[dict[str, Any]], extra: dict[str, Any] | None = None) -> None:
    """The rows with their ratios, the layout, and what a reader needs to reproduce the run: the
    spec, every argument, the versions and the host."""
    direct = _direct(rows)
    out_rows = []
    for r in rows:
        row = dict(r)
        ratio = ratios(r, direct)
        if ratio:
            row["ratios"] = ratio
        out_rows.append(row)
    layout = {k: v for k, v in meta.items() if k != "load"}
    data = {"format": "commd-bench", "version": 2, "created": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
            "versions": versions(), "host": host(), "spec": meta.get("spec"),
            **({"load": meta["load"]} if meta.get("load") else {}),
            "layout": layout, "rows": out_rows, **(extra or {})}
    Path(path).write_text(json.dumps(data, indent=1) + "\n")


def plot(path: str, meta: dict[str, Any], rows: list[dict[str, Any]]) -> None:
    """Write ``figure``'s plot to ``path`` (PNG through matplotlib's Agg backend)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig = figure(meta, rows)
    fig.savefig(path, dpi=100)
    plt.close(fig)


def figure(meta: dict[str, Any], rows: list[dict[str, Any]]) -> Any:
    """Per op two panels, both log-log: busbw against size, and latency (median and p95) against size.

    Log scales on both axes keep sizes below 64 KiB readable: on a linear axis their busbw
    (and the large sizes' latency) are flattened against zero by the large sizes'.
    """
    import matplotlib.pyplot as plt

    rows = measured(rows)
    ops = [op for op in OPS if op != "barrier" and any(r["op"] == op for r in rows)]  # barrier: in the table
    if not ops:
        raise ValueError("--plot: no sized op was measured (barrier has no bandwidth)")
    cols = min(3, len(ops))
    bands = (len(ops) + cols - 1) // cols  # each band: a busbw row above a latency row
    fig, axes = plt.subplots(2 * bands, cols, figsize=(5.2 * cols, 3.6 * 2 * bands), squeeze=False)
    several = len({group_of(r) for r in rows}) > 1
    for i, op in enumerate(ops):
        bw_ax, lat_ax = axes[2 * (i // cols)][i % cols], axes[2 * (i // cols) + 1][i % cols]
        mine = [r for r in rows if r["op"] == op]
        for path, group in dict.fromkeys((r["path"], group_of(r)) for r in mine):
            label = f"{path} [{group}]" if several else path
            pts = sorted((r["bytes"], r["busbw_gbs"], r["median_us"], r["p95_us"]) for r in mine
                         if r["path"] == path and group_of(r) == group)
            sizes = [p[0] for p in pts]
            line = lat_ax.plot(sizes, [p[2] for p in pts], marker="o", label=f"{label} median")[0]
            lat_ax.plot(sizes, [p[3] for p in pts], linestyle=":", color=line.get_color(), label=f"{label} p95")
            bw_ax.plot(sizes, [p[1] for p in pts], marker="o", label=label, color=line.get_color())
        for ax, what in ((bw_ax, "busbw (GB/s)"), (lat_ax, "latency (us)")):
            ax.set_xscale("log", base=2)
            ax.set_yscale("log")
            ax.set_xlabel("size S (bytes)")
            ax.set_ylabel(what)
            ax.grid(True, which="both", alpha=0.3)
            if ax.lines:
                ax.legend(fontsize="small")
        bw_ax.set_title(f"{op}: bandwidth")
        lat_ax.set_title(f"{op}: latency")
    for i in range(len(ops), bands * cols):
        axes[2 * (i // cols)][i % cols].set_visible(False)
        axes[2 * (i // cols) + 1][i % cols].set_visible(False)
    fig.suptitle(_layout(meta).split(";")[0], fontsize="medium")
    fig.tight_layout()
    return fig


def finish(meta: dict[str, Any], rows: list[dict[str, Any]], json_path: str | None = None,
           plot_path: str | None = None, extra: dict[str, Any] | None = None) -> None:
    """Print the table; write the JSON and the plot when asked."""
    print(format_table(meta, rows), flush=True)
    if json_path:
        write_json(json_path, meta, rows, extra)
        print(f"wrote {json_path}", file=sys.stderr)
    if plot_path:
        plot(plot_path, meta, rows)
        print(f"wrote {plot_path}", file=sys.stderr)
