"""The MPI-direct phase of `commd bench --compare mpi`: the same cells through mpi4py, under mpiexec.

    mpiexec -n 2 python -m commd.bench.mpi_worker --ops allreduce --rows-out rows.jsonl

It runs the same cases and timing loop as the commd worker (``measure``), on
NumPy arrays, agreeing through the MPI communicator itself; rank 0 appends
each row to ``--rows-out`` (JSON lines), which the orchestrator merges with
the commd rows.  With ``--group-nodes`` each group of the first g nodes gets
its own communicator (``Split``, on every rank); its cells agree through it,
and every rank meets at a barrier of the whole job after each of them, as in
the commd worker.
"""

from __future__ import annotations

import argparse
import os
import socket
import sys

from commd.bench.cases import CheckError, make_case
from commd.bench.measure import measure_cell
from commd.bench.paths import MpiPath, MpiSync
from commd.bench.spec import SpecError, add_measure_arguments, spec_from_args
from commd.bench.worker import (
    EXIT_CHECK,
    EXIT_SETUP,
    RowSink,
    group_label,
    group_ranks,
    nodes_in,
    op_sizes,
    resolve_group_nodes,
)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m commd.bench.mpi_worker",
                                     description="MPI-direct phase of `commd bench`; run it under mpiexec")
    add_measure_arguments(parser)
    parser.add_argument("--rows-out", required=True, help="rank 0 appends the rows here (JSON lines)")
    args = parser.parse_args(argv)
    try:
        spec = spec_from_args(args)
    except SpecError as exc:
        print(f"commd bench (mpi): {exc}", file=sys.stderr)
        return EXIT_SETUP
    import numpy as np
    from mpi4py import MPI

    comm = MPI.COMM_WORLD
    rank, world = comm.Get_rank(), comm.Get_size()
    if world < 2:
        print("commd bench (mpi): needs at least 2 MPI ranks", file=sys.stderr)
        return EXIT_SETUP
    nodes = comm.allgather(os.environ.get("COMMD_NODE") or socket.gethostname())
    nnodes = len(set(nodes))
    try:
        counts = resolve_group_nodes(spec, nnodes)
    except SpecError as exc:
        if rank == 0:
            print(f"commd bench (mpi): {exc}", file=sys.stderr)
        return EXIT_SETUP
    # (count, its node names, path and sync or None outside it, whole job); Split is collective: every rank
    groups = []
    for count in counts:
        ranks = group_ranks(nodes, count)
        whole = len(ranks) == world
        sub = comm if whole else comm.Split(0 if rank in ranks else MPI.UNDEFINED, rank)
        member = sub != MPI.COMM_NULL
        groups.append((count, [nodes[r] for r in ranks], MpiPath(sub, spec.dtype) if member else None,
                       MpiSync(sub) if member else None, whole))
    itemsize = np.dtype(spec.dtype).itemsize
    sink = RowSink(args.rows_out if rank == 0 else None)
    try:
        for op in spec.ops:
            for size in op_sizes(spec, op):
                for count, names, path, sync, whole in groups:
                    error = None
                    if path is not None and sync is not None:
                        case = make_case(op, size, path.rank, path.world, itemsize, path.alloc)
                        try:
                            row = measure_cell(path, sync, case, spec) if case is not None else None
                        except CheckError as exc:
                            if whole:
                                raise
                            error = str(exc)  # every member has it; the ranks outside learn it below
                            row = None
                        if row is not None:
                            row.update(dtype=spec.dtype, nodes=nodes_in(op, names), group=group_label(count, nnodes),
                                       group_nodes=count)
                            if rank == 0:
                                sink.row(row)
                    if not whole:  # the ranks outside the group wait for its members here
                        failed = [e for e in comm.allgather(error) if e]
                        if failed:
                            raise CheckError(failed[0])
    except CheckError as exc:
        if rank == 0:
            sink.emit({"error": str(exc)})
            print(f"commd bench (mpi): {exc}", file=sys.stderr)
        return EXIT_CHECK
    finally:
        sink.close()
        for _, _, path, _, whole in groups:
            if path is not None and not whole:
                path.comm.Free()
    return 0


if __name__ == "__main__":
    sys.exit(main())
