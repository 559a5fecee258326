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

With ``--group-nodes`` the cells are measured on groups of the first g nodes
too (``BenchGroup``), as a job's expert-, tensor- and data-parallel groups span
only some of its nodes: the tuning table has a cell per group-size class.  At
each (op, size) the groups take turns; a subgroup's members agree through the
subgroup's own Gloo group, and every rank then meets at a barrier of the whole
job (``_wait_for``), so the ranks outside wait there and the next cell starts
on every rank together.
"""

from __future__ import annotations

import argparse
import json
import os
import socket
import sys
from dataclasses import dataclass, field
from datetime import timedelta
from pathlib import Path
from typing import Any, TextIO

from commd.bench import report
from commd.bench.cases import CheckError, make_case
from commd.bench.measure import measure_cell, measure_interleaved
from commd.bench.paths import BenchPath, CommdPath, GlooPath, GlooSync, Sync
from commd.bench.spec import (
    ALGORITHM_OPS,
    COMPRESSED_OPS,
    LOCAL,
    NATIVE,
    ROOT,
    BenchSpec,
    SpecError,
    add_measure_arguments,
    check_group_nodes,
    spec_from_args,
    sweep_group_nodes,
)
from commd.client.errors import CommdError

#: Exit codes: a wrong result, a setup problem (bad options, no daemon, unknown lane).
EXIT_CHECK = 3
EXIT_SETUP = 2


class SetupError(Exception):
    """The run cannot start (bad lane for this fabric, no commd job); the message says why."""


class GroupWaitError(Exception):
    """A rank waiting outside a subgroup lost the job (a member failed or left); the message says so."""


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
        mine = [p for p in paths if _measures(p, op, algorithms)]
        for size in op_sizes(spec, op):
            for path in mine:
                cells.append((op, path, size))
    return cells


def op_sizes(spec: BenchSpec, op: str) -> list[int]:
    """The requested sizes of ``op`` (a barrier has none: one cell of size 0)."""
    return [0] if op == "barrier" else list(spec.sizes)


def _measures(path: BenchPath, op: str, algorithms: dict[str, list[str]] | None) -> bool:
    """Whether ``path`` measures ``op``: an algorithm path only the ops ``algorithms`` gives it, a codec
    path only the ops its codec compresses."""
    algorithm = getattr(path, "algorithm", None)
    return ((algorithm is None or algorithm in (algorithms or {}).get(op, ()))
            and _compresses(getattr(path, "compression", None), op))


def _compresses(choice: str | None, op: str) -> bool:
    """Whether a path with codec ``choice`` measures ``op`` (the per-hop baseline is a broadcast's)."""
    return choice is None or (op in COMPRESSED_OPS and (op == "broadcast" or not choice.endswith("/per-hop")))


def nodes_in(op: str, nodes: list[str]) -> int:
    """Nodes taking part in one op of a group whose rank i runs on ``nodes[i]`` (sendrecv: the group's
    rank 0's and last rank's, as the daemons look a send up by the 2 nodes it joins)."""
    return len({nodes[ROOT], nodes[-1]}) if op == "sendrecv" else len(set(nodes))


def group_ranks(nodes: list[str], count: int) -> list[int]:
    """The job ranks of the first ``count`` nodes (in the order of their first rank), all of each
    node's ranks: a group of ``count`` nodes, as a job's parallel groups take whole nodes."""
    first = set(list(dict.fromkeys(nodes))[:count])
    return [r for r, name in enumerate(nodes) if name in first]


def group_label(count: int, nnodes: int) -> str:
    """A row's ``group``: "world" for the whole job, else the nodes it spans ("nodes 0-1")."""
    return "world" if count >= nnodes else f"nodes 0-{count - 1}"


def resolve_group_nodes(spec: BenchSpec, nnodes: int, sweep: bool = False) -> list[int]:
    """The node counts of the groups to measure: ``--group-nodes``, else the whole job (``sweep``, a
    tuning run: the whole job and every power of two below it); SpecError if one does not fit."""
    counts = spec.group_nodes or (sweep_group_nodes(nnodes) if sweep else [nnodes])
    check_group_nodes(counts, nnodes)
    return counts


@dataclass
class BenchGroup:
    """One group the cells are measured on: the first ``count`` nodes of the job with all their ranks.

    The whole job is commd's "world" group and the default Gloo group; a subgroup is registered with
    the members' clients and has its own Gloo group (``sync``), so the ranks outside it take part
    in nothing but the barrier after each of its cells."""

    count: int  # nodes it spans
    ranks: list[int]  # its job ranks (group rank i = ranks[i])
    whole: bool  # the whole job
    member: bool  # this rank is one of ``ranks``
    name: str  # commd's group name
    label: str  # the rows' "group"
    node_names: list[str]  # the node of each group rank
    sync: Sync | None = None  # members only: how its cells agree (iteration counts, times, checks)
    pg: Any = None  # a subgroup's Gloo group (None: the default group, every rank)
    paths: list[BenchPath] = field(default_factory=list)  # members only


def _wait_for(group: BenchGroup, waiter: Any, error: str | None) -> None:
    """Every rank meets here after each cell of ``group`` (a subgroup): its members when done, with
    their check's failure if any (``error``), the others at once; a failure then stops every rank.
    ``waiter``: a Gloo group of the whole job whose timeout is the longest the members may take
    (``wait_bound``), so a rank outside never waits forever; a member that failed or left ends
    the wait sooner (its connections close)."""
    import torch.distributed as dist

    errors: list[str | None] = [None] * dist.get_world_size()
    try:
        dist.all_gather_object(errors, error, group=waiter)
    except RuntimeError as exc:
        why = "the group's cell" if group.member else "the group's members"
        raise GroupWaitError(f"waiting for {why} on group {group.label} failed: {exc}") from None
    failed = [e for e in errors if e]
    if failed:
        raise CheckError(failed[0])


def wait_bound(spec: BenchSpec, npaths: int) -> float:
    """Seconds the ranks outside a subgroup may wait for one (op, size) of it: each path's checked op,
    its probe, its first timed op, its warm-ups and its iterations, each bounded by --op-timeout."""
    return spec.op_timeout * max(1, npaths) * (4 + spec.warmup + spec.iters) + 60.0


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
                              "algorithms": resolve_algorithms(spec, multi, fabric_lanes, lanes),
                              "groups": resolve_group_nodes(spec, len(set(nodes)), sweep=bool(args.tune_out))}
            except (SetupError, SpecError) as exc:
                decided[0] = {"error": str(exc)}
        dist.broadcast_object_list(decided, src=0)
        if "error" in decided[0]:
            if rank == 0:
                sink.emit({"error": decided[0]["error"]})
            raise SetupError(decided[0]["error"])
        lanes, fabric_lanes = decided[0]["lanes"], decided[0]["fabric_lanes"]
        algorithms: dict[str, list[str]] = decided[0]["algorithms"]
        counts: list[int] = decided[0]["groups"]
        if args.tune_out and not multi:
            raise SetupError("--tune-out: a single node has no inter-node lanes to tune; run it across nodes")
        biggest = max(spec.sizes)
        client = Client(rank, world, local_rank=local_rank, job=job, op_timeout=spec.op_timeout,
                        arena_bytes=max(64 << 20, 2 * biggest + (4 << 20)), nodes=nodes if multi else None)
        try:
            client.register_group("world", list(range(world)))
            if spec.compression and (not multi or "tcp" not in fabric_lanes):
                raise SetupError("--compression: broadcasts compress between nodes, on the tcp lane; run "
                                 "across nodes whose fabric has it, e.g. `commd bench --hosts 4`")
            groups = make_groups(counts, nodes, rank, client, spec)
            for group in groups:
                if group.member:
                    group.paths = make_paths(client, group, lanes, algorithms, spec, dtype)
            npaths = path_count(lanes, algorithms, spec)
            total = sum(len(plan_cells(spec, group.paths, algorithms)) for group in groups)
            distinct = list(dict.fromkeys(nodes))
            meta = {"world": world, "nnodes": len(distinct), "node_names": distinct,
                    "ranks_per_node": [nodes.count(n) for n in distinct], "nodes": nodes,
                    "fabric_lanes": fabric_lanes, "lanes": lanes, "algorithms": algorithms,
                    "paths": [p.label for p in groups[0].paths],
                    "groups": [{"group": g.label, "nodes": g.count, "ranks": g.ranks} for g in groups],
                    "total": total, "spec": spec.to_json()}
            sink.emit({"meta": meta})
            _measure_all(args, spec, groups, algorithms, itemsize, sink, rank, total, wait_bound(spec, npaths))
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
    except (CommdError, GroupWaitError) as exc:
        # A peer vanished or an op timed out: every wait is bounded, so it ends here with the reason.
        sink.emit({"error": f"rank {rank}: {type(exc).__name__}: {exc}"})
        print(f"commd bench: rank {rank}: {type(exc).__name__}: {exc}", file=sys.stderr)
        return 1
    finally:
        sink.close()
        dist.destroy_process_group()
    return 0


def make_groups(counts: list[int], nodes: list[str], rank: int, client: Any, spec: BenchSpec) -> list[BenchGroup]:
    """The groups of ``counts`` nodes, ascending.  Every rank creates every subgroup's Gloo group (torch
    needs all of them to), only the members register it with their client."""
    import torch.distributed as dist

    nnodes, groups = len(set(nodes)), []
    for count in counts:
        ranks = group_ranks(nodes, count)
        whole = len(ranks) == len(nodes)
        member = rank in ranks
        name = "world" if whole else f"bench-nodes{count}"
        pg = None if whole else dist.new_group(ranks, timeout=timedelta(seconds=spec.op_timeout))
        group = BenchGroup(count, ranks, whole, member, name, group_label(count, nnodes),
                           [nodes[r] for r in ranks], pg=pg)
        if member:
            if not whole:
                client.register_group(name, ranks)
            group.sync = GlooSync(pg)
        groups.append(group)
    return groups


def path_count(lanes: list[str], algorithms: dict[str, list[str]], spec: BenchSpec) -> int:
    """How many paths ``make_paths`` makes per group (known to the ranks outside a group too)."""
    programs = dict.fromkeys(n for names in algorithms.values() for n in names)
    return len(lanes) + len(programs) + len(spec.compression or []) + ("gloo" in spec.compare)


def make_paths(client: Any, group: BenchGroup, lanes: list[str], algorithms: dict[str, list[str]],
               spec: BenchSpec, dtype: Any) -> list[BenchPath]:
    """``group``'s paths (on its members): one per lane, per algorithm, per codec, and Gloo directly
    if compared."""
    name = group.name
    paths: list[BenchPath] = [CommdPath(client, lane, dtype, spec.op_timeout, group=name) for lane in lanes]
    for algo in dict.fromkeys(n for names in algorithms.values() for n in names):
        paths.append(CommdPath(client, "tcp", dtype, spec.op_timeout, algorithm=algo, group=name))
    for choice in spec.compression or []:
        paths.append(CommdPath(client, "tcp", dtype, spec.op_timeout, compression=choice, group=name))
    if "gloo" in spec.compare:
        paths.append(GlooPath(dtype, group.pg))
    return paths


def _measure_all(args: argparse.Namespace, spec: BenchSpec, groups: list[BenchGroup],
                 algorithms: dict[str, list[str]], itemsize: int, sink: RowSink, rank: int, total: int,
                 bound: float) -> None:
    """Op by op, sizes growing, at each size every group in turn (its paths timed together); after a
    subgroup's cell every rank meets in ``_wait_for``."""
    import torch.distributed as dist

    # every rank creates it (or none does): whether a subgroup exists is the same everywhere
    waiter = (dist.new_group(list(range(dist.get_world_size())), timeout=timedelta(seconds=bound))
              if not all(g.whole for g in groups) else None)
    bar = report.progress(total, enabled=rank == 0 and not args.rows_out)
    skipped: dict[tuple[str, str, str], str] = {}  # (group, op, path label) -> why its program cannot run the op
    probed: set[tuple[str, str, str]] = set()
    try:
        for op in spec.ops:
            for size in op_sizes(spec, op):
                for group in groups:
                    paths = [p for p in group.paths if _measures(p, op, algorithms)]
                    block = (args, spec, group, op, size, paths, itemsize, sink, rank, bar, skipped, probed)
                    if group.whole:
                        measure_block(*block)
                        continue
                    error = None
                    if group.member:
                        try:
                            measure_block(*block)
                        except CheckError as exc:  # every member has it; the others learn it next
                            error = str(exc)
                    _wait_for(group, waiter, error)
    finally:
        bar.close()


def measure_block(args: argparse.Namespace, spec: BenchSpec, group: BenchGroup, op: str, size: int,
                   paths: list[BenchPath], itemsize: int, sink: RowSink, rank: int, bar: Any,
                   skipped: dict[tuple[str, str, str], str], probed: set[tuple[str, str, str]]) -> None:
    """One (op, size) of one group's paths, on its members: probe algorithm paths, check, time, rows."""
    sync = group.sync
    assert sync is not None
    nnodes = nodes_in(op, group.node_names)
    for path in paths:
        key = (group.label, op, path.label)
        if getattr(path, "algo", None) and key not in probed:
            probed.add(key)
            reason = probe(path, op, size, itemsize, sync)
            if reason is not None:
                skipped[key] = reason
                if rank == 0:
                    sink.row(skipped_row(op, path, reason, nnodes) | _group_fields(group))
    skipped_here = [p for p in paths if (group.label, op, p.label) in skipped]
    bar.update(len(skipped_here))
    paths = [p for p in paths if (group.label, op, p.label) not in skipped]
    if not paths:
        return
    model = bool(spec.compression) and op in COMPRESSED_OPS  # every commd path moves the same data
    cases = [(path, make_case(op, size, path.rank, path.world, itemsize, path.alloc,
                              getattr(path, "codec", None), model)) for path in paths]
    if any(case is None for _, case in cases):  # fewer bytes than one element per rank: skipped alike
        bar.update(len(paths))
        return
    if not spec.blocks:
        rows = measure_interleaved(cases, sync, spec, corrupt=lambda p, op=op: (
            args.corrupt == op and p.rank == p.world - 1))
    else:
        rows = [measure_cell(path, sync, case, spec, corrupt=args.corrupt == op and path.rank == path.world - 1)
                for path, case in cases]
    for row in rows:
        row.update(dtype=spec.dtype, nodes=nnodes, **_group_fields(group))
        if rank == 0:
            sink.row(row)
    bar.update(len(paths))
    del cases


def _group_fields(group: BenchGroup) -> dict[str, Any]:
    """What a row says of its group: its label and the nodes it spans (``nodes`` is the op's own count,
    which a send's 2 nodes make smaller than the group's)."""
    return {"group": group.label, "group_nodes": group.count}


def probe(path: BenchPath, op: str, size: int, itemsize: int, sync: Sync) -> str | None:
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
