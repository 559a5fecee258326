"""The MPI-direct phase of `commd bench --compare mpi`: the same cells through mpi4py, under mpiexec.

    mpiexec -n 2 python -m commd.bench.mpi_worker --ops allreduce --rows-out rows.jsonl

It runs the same cases and timing loop as the commd worker (``measure``), on
NumPy arrays, agreeing through the MPI communicator itself; rank 0 appends
each row to ``--rows-out`` (JSON lines), which the orchestrator merges with
the commd rows.
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
from commd.bench.worker import EXIT_CHECK, EXIT_SETUP, RowSink, nodes_in


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
    path, sync = MpiPath(comm, spec.dtype), MpiSync(comm)
    itemsize = np.dtype(spec.dtype).itemsize
    sink = RowSink(args.rows_out if rank == 0 else None)
    try:
        for op in spec.ops:
            for size in [0] if op == "barrier" else spec.sizes:
                case = make_case(op, size, rank, world, itemsize, path.alloc)
                if case is None:
                    continue
                row = measure_cell(path, sync, case, spec)
                row.update(dtype=spec.dtype, nodes=nodes_in(op, nodes))
                if rank == 0:
                    sink.row(row)
    except CheckError as exc:
        if rank == 0:
            sink.emit({"error": str(exc)})
            print(f"commd bench (mpi): {exc}", file=sys.stderr)
        return EXIT_CHECK
    finally:
        sink.close()
    return 0


if __name__ == "__main__":
    sys.exit(main())
