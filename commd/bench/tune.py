"""`commd tune`: measure every lane (and tcp program) per op kind and size; save the winners as a tuning table.

The sweep is a `commd bench` run over the representative op kinds
(``TUNED_KINDS``) with one commd path per lane of the fabric (never "auto":
the table must compare lanes, not the daemons' current choice), on daemons
started with ``COMMD_TUNING=off`` so an existing table does not colour what
is measured.  ``TuningTable.from_measurements`` picks the lane with the
lowest median per (kind, group size class, size), near ties (< 3%) going to
the preferred lane; node 0's daemon loads the table from the default path at
its next start.  Beside the lanes the sweep runs the ops programs can run
(all-reduce, all-to-all) with every library program of the op on the tcp
lane (``--algorithms``, default ``all``); the table keeps the tcp lane's best
algorithm per cell, which the coordinator then chooses when no hint or rule
decides.  A program that cannot run an op on this fabric is listed as skipped
with its reason.  ``--compression lossless,bf16`` adds the tcp lane's compressed
broadcasts and all-gathers (``commd-tcp+CODEC``, model-like float32 data); the
table keeps each codec's figures and the best lossless codec and the best codec
of all where they beat the plain tcp path (per-hop baselines are not kept).

The table keys its cells by the number of nodes an op's group spans (its
class: 2, 3-4, 5-8, ...), and a job's expert-, tensor- and data-parallel groups
span fewer nodes than the job.  So the sweep measures the whole job and, by
default, groups of the first 2, 4, 8, ... nodes below it (``--group-nodes``
overrides that): the table then has a cell for each class a job's groups look
up, where the whole job alone gives one class only.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path
from typing import Any

from commd.bench import orchestrate
from commd.bench.spec import LOCAL, SpecError, check_group_nodes, spec_from_args, sweep_group_nodes


def table_from_rows(meta: dict[str, Any], rows: list[dict[str, Any]]) -> Any:
    """A TuningTable from the lane rows of a sweep (auto, local and direct-peer rows are not lanes),
    the codec rows among them (per-hop baselines are no choice the daemons make), each keyed by the
    nodes its op spans (``nodes``: its group's, a send's 2).

    Two groups can measure one cell: a send joins 2 nodes in every group.  The largest group's row
    is kept, the one whose ping-pong joins node 0 and the job's last node."""
    from commd.scheduler.tuning import TUNED_KINDS, TuningTable, group_class

    lane_rows = [
        r for r in rows
        if r["via"] == "commd" and r["lane"] not in ("auto", LOCAL) and r["op"] in TUNED_KINDS and r["bytes"] > 0
        and r.get("check") != "skipped" and "/" not in (r.get("codec") or "")
    ]
    kept: dict[tuple[Any, ...], dict[str, Any]] = {}
    for r in sorted(lane_rows, key=lambda r: r.get("group_nodes") or meta["nnodes"]):  # (stable: run order)
        kept[(r["op"], group_class(r["nodes"]), r["bytes"], r["lane"], r.get("algorithm"), r.get("codec"))] = r
    measured = [
        {"kind": r["op"], "nodes": r["nodes"], "bytes": r["bytes"], "lane": r["lane"], "median_us": r["median_us"],
         "p95_us": r["p95_us"], "busbw_gbs": r["busbw_gbs"], "algorithm": r.get("algorithm"),
         **({"codec": r["codec"]} if r.get("codec") else {})}
        for r in kept.values()
    ]
    if not measured:
        raise orchestrate.BenchError("the sweep measured no lane (a single node has none: use --hosts H or "
                                     "several nodes)")
    fabric = {"nodes": meta["nnodes"], "lanes": sorted(meta["fabric_lanes"]),
              "ranks_per_node": meta["ranks_per_node"], "node_names": meta["node_names"]}
    return TuningTable.from_measurements(fabric, measured)


def show(target: str | None) -> int:
    """Print the table at ``target``, or every table in the default directory."""
    from commd.scheduler.tuning import TuningTable, default_table_dir

    if target:
        paths = [Path(target)]
    else:
        directory = default_table_dir()
        paths = sorted(directory.glob("*.json")) if directory.is_dir() else []
        if not paths:
            print(f"commd tune: no tuning tables in {directory} (run `commd tune --hosts H` to make one)",
                  file=sys.stderr)
            return 1
    code = 0
    for i, path in enumerate(paths):
        try:
            table = TuningTable.load(path)
        except ValueError as exc:
            print(f"commd tune: {exc}", file=sys.stderr)
            code = 1
            continue
        if i:
            print()
        print(f"{path}:")
        print(table.grid())
    return code


def run(args: argparse.Namespace) -> int:
    if args.show is not None:
        return show(args.show or None)
    from commd.scheduler.tuning import TUNED_KINDS, default_table_path

    try:
        spec = spec_from_args(args)
        bad = [op for op in spec.ops if op not in TUNED_KINDS]
        if bad:
            raise SpecError(f"--ops: commd tune measures the tuned kinds {','.join(TUNED_KINDS)}; not {','.join(bad)}")
        layout = orchestrate.layout_from_args(args)
        layout.env["COMMD_TUNING"] = "off"  # measure the lanes, not an older table's choices
        if not layout.hosts:
            raise orchestrate.BenchError(
                "commd tune compares the lanes between nodes, and one host has none: use --hosts H (simulated "
                "hosts, root), or on a cluster run `commd launch --nnodes ... -m commd.bench.worker --lanes all "
                "--ops allreduce,broadcast,allgather,alltoall,alltoallv,sendrecv --tune-out FILE` on every node")
        spec.group_nodes = spec.group_nodes or sweep_group_nodes(layout.hosts)  # a cell per group-size class
        check_group_nodes(spec.group_nodes, layout.hosts)
        meta, rows = orchestrate.run(layout, spec, desc="commd tune")
        table = table_from_rows(meta, rows)
        out = Path(args.out) if args.out else default_table_path(meta["node_names"][0], meta["nnodes"])
        table.save(out)
    except (SpecError, orchestrate.BenchError, ValueError) as exc:
        print(f"commd tune: {exc}", file=sys.stderr)
        return 2
    if args.json:
        from commd.bench import report

        report.write_json(args.json, meta, rows, {"table": table.to_json(), "arguments": report.arguments_json(args)})
    print(table.grid())
    for line in skipped_lines(rows):
        print(line)
    print(f"\nsaved {out}")
    return 0


def skipped_lines(rows: list[dict[str, Any]]) -> list[str]:
    """The programs the sweep could not run, each with the daemons' reason (not in the table)."""
    return [f"skipped {r['op']} {r['path']}: {r.get('reason', '?')}" for r in rows if r.get("check") == "skipped"]
