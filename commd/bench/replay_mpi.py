"""The MPI path of `commd replay`: a recorded job's ops through mpi4py, under mpiexec.

    mpiexec -n 2 python -m commd.bench.replay_mpi --trace DIR --out 'result-{rank}.json'

The same plan and timing loop as the torch executor (``replay_worker``), on NumPy
buffers: one communicator per group of the trace (``Create_group`` in pg_id order;
the whole job's groups are COMM_WORLD), blocking calls for ops that block, the
non-blocking variants (``Iallreduce``, ``Ialltoallv``...) for ops waited later.
MPI has no 16-bit float types and no average: float16 and bfloat16 buffers move as
int16 (reductions then add integers, the same bytes and about the same work), and
averages run as sums; the result file's notes say so.  Iterations are aligned
through a duplicate of COMM_WORLD, outside the replayed ops.
"""

from __future__ import annotations

import argparse
import sys
from typing import Any

import numpy as np

from commd.bench.replay_worker import (
    EXIT_CHECK,
    EXIT_FAILED,
    EXIT_SETUP,
    Action,
    CheckError,
    Plan,
    Replayer,
    ReplayError,
    add_replay_arguments,
    check_replay_arguments,
    load_plan,
    result_record,
    run_iterations,
    write_result,
)
from commd.protocol.param_trace import DTYPES, GroupKey, splits_of

#: What a PARAM dtype is stored as in NumPy for MPI (MPI has no float16 or bfloat16 type).
MPI_STORAGE = {**DTYPES, "half": "int16", "bfloat16": "int16"}
#: MPI's reductions by the trace's names (no average: a sum).
MPI_OPS = {"sum": "SUM", "avg": "SUM", "product": "PROD", "min": "MIN", "max": "MAX", "band": "BAND",
           "bor": "BOR", "bxor": "BXOR"}
#: Booleans reduce with MPI's logical ops.
BOOL_OPS = {"sum": "LOR", "avg": "LOR", "max": "LOR", "bor": "LOR", "product": "LAND", "min": "LAND",
            "band": "LAND", "bxor": "LXOR"}


class MpiExecutor:
    """mpi4py on NumPy arrays: one communicator per group, non-blocking calls where the trace waits later."""

    def __init__(self, plan: Plan) -> None:
        from mpi4py import MPI

        self.MPI, self.plan = MPI, plan
        self.world = MPI.COMM_WORLD
        self.sync = self.world.Dup()  # the side channel: never the replayed communicators
        self.comms: dict[GroupKey, Any] = {}
        self.arrays: list[np.ndarray] = []
        self.notes: list[str] = []
        used = {a.entry.dtype for a in plan.actions if a.mode != "wait"}
        halves = sorted(d for d in used if d in ("half", "bfloat16"))
        if halves:
            self.notes.append(f"mpi: {', '.join(halves)} moved as int16 (MPI has no 16-bit float type); their "
                              "reductions added integers")
        if any(a.entry.reduce_op == "avg" for a in plan.actions):
            self.notes.append("mpi: MPI has no average: all-reduces with reduce_op avg ran as sums")

    def setup(self) -> None:
        """Every group's communicator (members only, in order: no two ranks wait on each other out of
        order), then the buffers."""
        rank = self.world.Get_rank()
        for tag, key in enumerate(self.plan.groups):
            if rank in key[1]:
                group = self.world.group.Incl(list(key[1]))
                self.comms[key] = self.world.Create_group(group, tag)
                group.Free()
        for dtype, count in self.plan.buffers:
            self.arrays.append(np.zeros(count, dtype=MPI_STORAGE[dtype]))

    def comm(self, key: GroupKey | None) -> Any:
        return self.world if key is None or key[0] is None and len(key[1]) == self.plan.world else self.comms[key]

    def storage(self, dtype: str) -> str:
        return MPI_STORAGE[dtype]

    def reduce_name(self, op: str) -> str:
        return "sum" if op == "avg" else op

    def _op(self, action: Action) -> Any:
        names = BOOL_OPS if action.entry.dtype == "bool" else MPI_OPS
        return getattr(self.MPI, names[action.entry.reduce_op or "sum"])

    def issue(self, position: int, action: Action, nonblocking: bool) -> Any:
        MPI, e, b, a = self.MPI, action.entry, action.buffers, self.arrays
        comm = self.comm(action.group)
        ranks = self.plan.group_ranks(action.group)
        c = e.comms
        if c == "all_reduce":
            f = comm.Iallreduce if nonblocking else comm.Allreduce
            return f(MPI.IN_PLACE, a[b["buf"]], op=self._op(action))
        if c == "reduce":
            root = ranks.index(e.root)  # type: ignore[arg-type]
            f = comm.Ireduce if nonblocking else comm.Reduce
            if comm.Get_rank() == root:
                return f(MPI.IN_PLACE, a[b["buf"]], op=self._op(action), root=root)
            return f(a[b["buf"]], None, op=self._op(action), root=root)
        if c == "broadcast":
            f = comm.Ibcast if nonblocking else comm.Bcast
            return f(a[b["buf"]], root=ranks.index(e.root))  # type: ignore[arg-type]
        if c in ("all_to_allv", "all_to_all"):
            ins, outs = splits_of(e, len(ranks))
            send = [a[b["in"]], (list(ins), _displacements(ins))]
            recv = [a[b["out"]], (list(outs), _displacements(outs))]
            f = comm.Ialltoallv if nonblocking else comm.Alltoallv
            return f(send, recv)
        if c in ("all_gather", "all_gather_base"):
            f = comm.Iallgather if nonblocking else comm.Allgather
            return f(a[b["in"]], a[b["out"]])
        if c in ("reduce_scatter", "reduce_scatter_base"):
            f = comm.Ireduce_scatter_block if nonblocking else comm.Reduce_scatter_block
            return f(a[b["in"]], a[b["out"]], op=self._op(action))
        if c == "gather":
            f = comm.Igather if nonblocking else comm.Gather
            return f(a[b["in"]], a[b["out"]] if "out" in b else None, root=ranks.index(e.root))  # type: ignore[arg-type]
        if c == "scatter":
            f = comm.Iscatter if nonblocking else comm.Scatter
            return f(a[b["in"]] if "in" in b else None, a[b["out"]], root=ranks.index(e.root))  # type: ignore[arg-type]
        if c == "barrier":
            return comm.Ibarrier() if nonblocking else comm.Barrier()
        if c == "send":
            f = comm.Isend if nonblocking else comm.Send
            return f(a[b["buf"]], dest=ranks.index(e.dst_rank), tag=0)  # type: ignore[arg-type]
        if c == "recv":
            f = comm.Irecv if nonblocking else comm.Recv
            return f(a[b["buf"]], source=ranks.index(e.src_rank), tag=0)  # type: ignore[arg-type]
        raise ValueError(f"cannot replay {c!r}")  # pragma: no cover - the trace was validated

    def wait(self, handle: Any) -> None:
        if handle is not None:
            handle.Wait()

    def fill(self, buffer: int, values: np.ndarray) -> None:
        self.arrays[buffer][...] = values

    def read(self, buffer: int) -> np.ndarray:
        array = self.arrays[buffer]
        return array.astype(np.float64 if array.dtype.kind == "f" else np.int64)

    def barrier(self) -> None:
        self.sync.Barrier()

    def close(self) -> None:
        for comm in self.comms.values():
            comm.Free()
        self.comms.clear()
        self.sync.Free()


def _displacements(counts: tuple[int, ...]) -> list[int]:
    out, at = [], 0
    for n in counts:
        out.append(at)
        at += n
    return out


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m commd.bench.replay_mpi",
                                     description="the MPI path of `commd replay`; run it under mpiexec")
    add_replay_arguments(parser)
    args = parser.parse_args(argv)
    try:
        check_replay_arguments(args)
    except ReplayError as exc:
        print(f"commd replay (mpi): {exc}", file=sys.stderr)
        return EXIT_SETUP
    from mpi4py import MPI

    rank, world = MPI.COMM_WORLD.Get_rank(), MPI.COMM_WORLD.Get_size()
    try:
        plan = load_plan(args.trace, rank, world)
    except ReplayError as exc:
        if rank == 0:
            print(f"commd replay (mpi): {exc}", file=sys.stderr)
        return EXIT_SETUP
    executor = MpiExecutor(plan)
    try:
        executor.setup()
        replayer = Replayer(plan, executor, args.compute == "recorded")
        timed = run_iterations(replayer, executor, args.warmup, args.iters)
        write_result(args.out, rank, result_record(plan, "mpi", None, args, timed, replayer.checked, executor.notes))
        executor.barrier()
    except CheckError as exc:
        write_result(args.out, rank, {"rank": rank, "error": str(exc)})
        print(f"commd replay (mpi): {exc}", file=sys.stderr)
        return EXIT_CHECK
    except Exception as exc:  # an MPI error: name it (mpiexec then ends the other ranks)
        message = f"rank {rank}: {type(exc).__name__}: {exc}"
        write_result(args.out, rank, {"rank": rank, "error": message})
        print(f"commd replay (mpi): {message}", file=sys.stderr)
        return EXIT_FAILED
    executor.close()
    return 0


if __name__ == "__main__":
    sys.exit(main())
