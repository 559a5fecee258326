"""The benchmark program of one rank, run under `commd launch` (by `commd bench`, or by a user).

    commd launch --nproc-per-node 2 -m commd.bench.worker --ops allreduce,allgather --compare gloo

Every rank joins a Gloo process group (env://: the launcher's variables and,
across nodes, its store), which serves three purposes: the placement (every
rank's node name, needed by commd's client in a multi-node job), agreement
between ranks outside the measured path (iteration counts, slowest-rank
times, check results), and the Gloo-direct comparison.  Then each rank
connects to its node's daemon and measures every (op, commd lane / Gloo,
size) cell.  Rank 0 appends each row to ``--rows-out`` as one JSON line as
soon as it is measured (the orchestrator's progress and results); run by a
user, rank 0 prints the table instead.
"""

from __future__ import annotations

import argparse
import json
import os
import socket
import sys
from datetime import timedelta
from pathlib import Path
from typing import Any, TextIO

from commd.bench import report
from commd.bench.cases import CheckError, make_case
from commd.bench.measure import measure_cell, measure_interleaved
from commd.bench.paths import BenchPath, CommdPath, GlooPath, GlooSync
from commd.bench.spec import (
    ALGORITHM_OPS,
    COMPRESSED_OPS,
    LOCAL,
    NATIVE,
    ROOT,
    BenchSpec,
    SpecError,
    add_measure_arguments,
    spec_from_args,
)
from commd.client.errors import CommdError

#: Exit codes: a wrong result, a setup problem (bad options, no daemon, unknown lane).
EXIT_CHECK = 3
EXIT_SETUP = 2


class SetupError(Exception):
    """The run cannot start (bad lane for this fabric, no commd job); the message says why."""


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="python -m commd.bench.worker",
                                     description="one rank of `commd bench`; run it under `commd launch`")
    add_measure_arguments(parser)
    parser.add_argument("--json", metavar="FILE", help="rank 0 writes every row (and the run's layout) to FILE")
    parser.add_argument("--plot", metavar="FILE.png", help="rank 0 plots busbw against size to FILE.png")
    parser.add_argument("--tune-out", metavar="FILE",
                        help="rank 0 also builds a tuning table from the lane rows and saves it to FILE")
    parser.add_argument("--rows-out", help=argparse.SUPPRESS)  # the orchestrator's JSON-lines file
    parser.add_argument("--corrupt", default=None, help=argparse.SUPPRESS)  # op whose check must fail (tests)
    return parser


def node_name() -> str:
    return os.environ.get("COMMD_NODE") or socket.gethostname()


def _env_int(name: str) -> int:
    value = os.environ.get(name)
    if value is None or not value.isdigit():
        raise SetupError(f"${name} is not set: run this under `commd launch` (or use `commd bench`)")
    return int(value)


def resolve_lanes(spec: BenchSpec, multi_node: bool, fabric_lanes: list[str]) -> list[str]:
    """The commd paths to measure: one per lane label ("local" on one node)."""
    wanted = spec.lanes if spec.lanes is not None else ["auto", "all"]
    if not multi_node:
        named = [lane for lane in wanted if lane not in ("auto", "all", LOCAL)]
        if named:
            raise SetupError(f"--lanes {','.join(named)}: a single node has no inter-node lanes (its rows say "
                             "'local'); run across nodes, e.g. `commd bench --hosts 2`")
        return [LOCAL]
    out: list[str] = []
    for lane in wanted:
        if lane == LOCAL:
            raise SetupError("--lanes local: this job spans several nodes; choose auto or a lane name")
        for name in fabric_lanes if lane == "all" else [lane]:
            if name != "auto" and name not in fabric_lanes:
                hint = " (the MPI lane needs daemons started under mpiexec)" if name == "mpi" else ""
                raise SetupError(f"--lanes: this fabric has no lane {name!r}; it has {','.join(fabric_lanes)}{hint}")
            if name not in out:
                out.append(name)
    return out


def _fabric_lanes(job: str) -> list[str]:
    from commd.client.status import StatusError, query_status
    from commd.runtime import JobPaths

    try:
        fabric = query_status(JobPaths.for_job(job), timeout=20.0).get("fabric") or {}
    except StatusError as exc:
        raise SetupError(f"cannot ask the node daemon for its lanes: {exc}") from None
    return sorted(fabric.get("lanes") or [])


def resolve_algorithms(spec: BenchSpec, multi_node: bool, fabric_lanes: list[str],
                       lanes: list[str] | None = None) -> dict[str, list[str]]:
    """Per op that programs can run, the algorithm paths to measure (``all``: every library program
    of the op's collective, and native unless the plain tcp lane path in ``lanes`` already measures
    it).  A named program is kept even if it cannot run the op: its row then says why (the
    daemons' own reason), never silently dropped."""
    if not spec.algorithms:
        return {}
    if not multi_node:
        raise SetupError("--algorithms: programs run between nodes, and this job has one; run across nodes, "
                         "e.g. `commd bench --hosts 4`")
    if "tcp" not in fabric_lanes:
        raise SetupError(f"--algorithms: programs run on the tcp lane, which this fabric lacks (it has "
                         f"{','.join(fabric_lanes)})")
    from commd.algorithms import library
    from commd.algorithms.catalog import COLL_FOR_KIND

    out: dict[str, list[str]] = {}
    for op in spec.ops:
        if op not in ALGORITHM_OPS:
            continue
        names: list[str] = []
        for name in spec.algorithms:
            if name == "all":
                names += [] if "tcp" in (lanes or []) else [NATIVE]
                names += [n for n in library.names() if library.describe(n).coll == COLL_FOR_KIND[op]]
            else:
                names.append(name)
        out[op] = list(dict.fromkeys(names))
    return out


def plan_cells(spec: BenchSpec, paths: list[BenchPath],
               algorithms: dict[str, list[str]] | None = None) -> list[tuple[str, BenchPath, int]]:
    """(op, path, requested size) in measuring order: op by op, sizes growing, at each size every path
    (timed in alternation, or back to back with --blocks: a machine whose load drifts then affects
    the compared paths alike).  An algorithm path measures only the ops ``algorithms`` gives it."""
    cells = []
    for op in spec.ops:
        mine = [p for p in paths if (getattr(p, "algorithm", None) is None
                                     or p.algorithm in (algorithms or {}).get(op, ()))  # type: ignore[attr-defined]
                and _compresses(getattr(p, "compression", None), op)]
        for size in [0] if op == "barrier" else spec.sizes:
            for path in mine:
                cells.append((op, path, size))
    return cells


def _compresses(choice: str | None, op: str) -> bool:
    """Whether a path with codec ``choice`` measures ``op`` (the per-hop baseline is a broadcast's)."""
    return choice is None or (op in COMPRESSED_OPS and (op == "broadcast" or not choice.endswith("/per-hop")))


def nodes_in(op: str, nodes: list[str]) -> int:
    """Nodes taking part in one op of the world group (sendrecv: rank 0's and the last rank's)."""
    return len({nodes[ROOT], nodes[-1]}) if op == "sendrecv" else len(set(nodes))


class RowSink:
    """Rank 0's output: rows kept in memory and, for the orchestrator, appended to a JSON-lines file."""

    def __init__(self, path: str | None) -> None:
        self.rows: list[dict[str, Any]] = []
        self.file: TextIO | None = open(path, "a") if path else None  # noqa: SIM115 - closed in close()

    def emit(self, record: dict[str, Any]) -> None:
        if self.file is not None:
            self.file.write(json.dumps(record) + "\n")
            self.file.flush()

    def row(self, row: dict[str, Any]) -> None:
        self.rows.append(row)
        self.emit(row)

    def close(self) -> None:
        if self.file is not None:
            self.file.close()


def run(args: argparse.Namespace, spec: BenchSpec) -> int:
    import torch
    import torch.distributed as dist

    from commd.client import Client

    rank, world = _env_int("RANK"), _env_int("WORLD_SIZE")
    local_rank = _env_int("LOCAL_RANK")
    job = os.environ.get("COMMD_JOB")
    if not job:
        raise SetupError("$COMMD_JOB is not set: run this under `commd launch` (or use `commd bench`)")
    if world < 2:
        raise SetupError("a communication benchmark needs at least 2 ranks (--nproc-per-node 2 or more nodes)")
    dtype = getattr(torch, spec.dtype)
    itemsize = torch.empty((), dtype=dtype).element_size()
    dist.init_process_group("gloo", init_method="env://", rank=rank, world_size=world,
                            timeout=timedelta(seconds=spec.op_timeout))
    sink = RowSink(args.rows_out if rank == 0 else None)
    try:
        names: list[str | None] = [None] * world
        dist.all_gather_object(names, node_name())
        nodes = [str(n) for n in names]
        multi = len(set(nodes)) > 1
        decided: list[Any] = [None]
        if rank == 0:
            try:
                fabric_lanes = _fabric_lanes(job) if multi else []
                lanes = resolve_lanes(spec, multi, fabric_lanes)
                decided[0] = {"lanes": lanes, "fabric_lanes": fabric_lanes,
                              "algorithms": resolve_algorithms(spec, multi, fabric_lanes, lanes)}
            except SetupError as exc:
                decided[0] = {"error": str(exc)}
        dist.broadcast_object_list(decided, src=0)
        if "error" in decided[0]:
            if rank == 0:
                sink.emit({"error": decided[0]["error"]})
            raise SetupError(decided[0]["error"])
        lanes, fabric_lanes = decided[0]["lanes"], decided[0]["fabric_lanes"]
        algorithms: dict[str, list[str]] = decided[0]["algorithms"]
        if args.tune_out and not multi:
            raise SetupError("--tune-out: a single node has no inter-node lanes to tune; run it across nodes")
        biggest = max(spec.sizes)
        client = Client(rank, world, local_rank=local_rank, job=job, op_timeout=spec.op_timeout,
                        arena_bytes=max(64 << 20, 2 * biggest + (4 << 20)), nodes=nodes if multi else None)
        try:
            client.register_group("world", list(range(world)))
            paths: list[BenchPath] = [CommdPath(client, lane, dtype, spec.op_timeout) for lane in lanes]
            for name in dict.fromkeys(n for names in algorithms.values() for n in names):
                paths.append(CommdPath(client, "tcp", dtype, spec.op_timeout, algorithm=name))
            for choice in spec.compression or []:
                if not multi or "tcp" not in fabric_lanes:
                    raise SetupError("--compression: broadcasts compress between nodes, on the tcp lane; run "
                                     "across nodes whose fabric has it, e.g. `commd bench --hosts 4`")
                paths.append(CommdPath(client, "tcp", dtype, spec.op_timeout, compression=choice))
            if "gloo" in spec.compare:
                paths.append(GlooPath(dtype))
            cells = plan_cells(spec, paths, algorithms)
            distinct = list(dict.fromkeys(nodes))
            meta = {"world": world, "nnodes": len(distinct), "node_names": distinct,
                    "ranks_per_node": [nodes.count(n) for n in distinct], "nodes": nodes,
                    "fabric_lanes": fabric_lanes, "lanes": lanes, "algorithms": algorithms,
                    "paths": [p.label for p in paths],
                    "total": len(cells), "spec": spec.to_json()}
            sink.emit({"meta": meta})
            _measure_all(args, spec, cells, nodes, itemsize, sink, rank)
        finally:
            client.close()
        if rank == 0 and not args.rows_out:
            if "mpi" in spec.compare:
                print("commd bench worker: --compare mpi needs `commd bench` (MPI runs under mpiexec in its own "
                      "phase); skipped", file=sys.stderr)
            report.finish(meta, sink.rows, json_path=args.json, plot_path=args.plot)
        if rank == 0 and args.tune_out:
            from commd.bench.tune import skipped_lines, table_from_rows

            table = table_from_rows(meta, sink.rows)
            table.save(Path(args.tune_out))
            print(table.grid())
            for line in skipped_lines(sink.rows):
                print(line)
            print(f"saved {args.tune_out}", file=sys.stderr)
    except CheckError as exc:
        if rank == 0:
            sink.emit({"error": str(exc)})
            print(f"commd bench: {exc}", file=sys.stderr)
        return EXIT_CHECK
    except CommdError as exc:
        # A peer vanished or an op timed out: every wait is bounded, so it ends here with the reason.
        sink.emit({"error": f"rank {rank}: {type(exc).__name__}: {exc}"})
        print(f"commd bench: rank {rank}: {type(exc).__name__}: {exc}", file=sys.stderr)
        return 1
    finally:
        sink.close()
        dist.destroy_process_group()
    return 0


def _measure_all(args: argparse.Namespace, spec: BenchSpec, cells: list[tuple[str, BenchPath, int]],
                 nodes: list[str], itemsize: int, sink: RowSink, rank: int) -> None:
    sync = GlooSync()
    bar = report.progress(len(cells), enabled=rank == 0 and not args.rows_out)
    groups: dict[tuple[str, int], list[BenchPath]] = {}
    for op, path, size in cells:
        groups.setdefault((op, size), []).append(path)
    skipped: dict[tuple[str, str], str] = {}  # (op, path label) -> why its program cannot run the op
    probed: set[tuple[str, str]] = set()
    try:
        for (op, size), paths in groups.items():
            for path in paths:
                if getattr(path, "algo", None) and (op, path.label) not in probed:
                    probed.add((op, path.label))
                    reason = probe(path, op, size, itemsize, sync)
                    if reason is not None:
                        skipped[(op, path.label)] = reason
                        if rank == 0:
                            sink.row(skipped_row(op, path, reason, nodes_in(op, nodes)))
            skipped_here = [p for p in paths if (op, p.label) in skipped]
            bar.update(len(skipped_here))
            paths = [p for p in paths if (op, p.label) not in skipped]
            if not paths:
                continue
            model = bool(spec.compression) and op in COMPRESSED_OPS  # every commd path moves the same data
            cases = [(path, make_case(op, size, path.rank, path.world, itemsize, path.alloc,
                                      getattr(path, "codec", None), model)) for path in paths]
            if any(case is None for _, case in cases):  # fewer bytes than one element per rank: skipped alike
                bar.update(len(paths))
                continue
            if not spec.blocks:
                rows = measure_interleaved(cases, sync, spec, corrupt=lambda p, op=op: (
                    args.corrupt == op and p.rank == p.world - 1))
            else:
                rows = [measure_cell(path, sync, case, spec, corrupt=args.corrupt == op and path.rank == path.world - 1)
                        for path, case in cases]
            for row in rows:
                row.update(dtype=spec.dtype, nodes=nodes_in(op, nodes))
                if rank == 0:
                    sink.row(row)
            bar.update(len(paths))
            del cases
    finally:
        bar.close()


def probe(path: BenchPath, op: str, size: int, itemsize: int, sync: GlooSync) -> str | None:
    """Run one op of ``path`` (an algorithm path) before measuring it: None if it ran on every rank,
    else the reason it failed (the coordinator's: the program cannot run this op, and why)."""
    error: str | None = None
    try:
        case = make_case(op, size, path.rank, path.world, itemsize, path.alloc)
        if case is not None:
            case.fill()
            path.run(case)
            del case
    except CommdError as exc:
        error = str(exc)
    errors = sync.gather_errors(error)
    return errors[0] if errors else None


def skipped_row(op: str, path: BenchPath, reason: str, nnodes: int) -> dict[str, Any]:
    """The row of a path that was not measured for ``op``, with the reason (bytes 0: every size)."""
    return {"op": op, "bytes": 0, "via": path.via, "lane": path.lane, "path": path.label,
            "algorithm": getattr(path, "algorithm", None), "world": path.world, "nodes": nnodes,
            "check": "skipped", "reason": reason}


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    first = os.environ.get("RANK", "0") == "0"
    try:
        spec = spec_from_args(args)
        return run(args, spec)
    except (SpecError, SetupError) as exc:
        if first:
            print(f"commd bench: {exc}", file=sys.stderr)
        return EXIT_SETUP


if __name__ == "__main__":
    sys.exit(main())
