"""The measured paths: commd (one lane hint each), Gloo directly, MPI directly.

A path allocates its buffers the way its users would (commd: tensors in the
client's shared-memory arena, zero copy; Gloo: ordinary tensors; MPI: NumPy
arrays) and runs one op blocking.  Ranks agree on iteration counts, times and
check results through a *sync* channel outside the measured path: the Gloo
process group for commd and Gloo, the MPI communicator for MPI.  A path of a
subgroup (``commd bench --group-nodes``) runs its ops in that group, its rank
and world being the group's, and agrees through the group's own Gloo group or
MPI communicator, so the ranks outside it never take part.
"""

from __future__ import annotations

from typing import Any, Protocol

import numpy as np

from commd.bench.cases import Case
from commd.bench.spec import NATIVE, ROOT


class Sync(Protocol):
    """Cross-rank agreement outside the measured path."""

    def max_each(self, values: list[float]) -> list[float]: ...
    def gather_errors(self, error: str | None) -> list[str]: ...
    def barrier(self) -> None: ...


class GlooSync:
    """Agreement through one of the worker's Gloo process groups (``group``: None, the default group
    of every rank; a subgroup's own, so that its cells agree among its members only)."""

    def __init__(self, group: Any = None) -> None:
        import torch.distributed as dist

        self.dist, self.group = dist, group

    def max_each(self, values: list[float]) -> list[float]:
        import torch

        t = torch.tensor(values, dtype=torch.float64)
        self.dist.all_reduce(t, op=self.dist.ReduceOp.MAX, group=self.group)
        return t.tolist()

    def gather_errors(self, error: str | None) -> list[str]:
        out: list[str | None] = [None] * self.dist.get_world_size(self.group)
        self.dist.all_gather_object(out, error, group=self.group)
        return [e for e in out if e]

    def barrier(self) -> None:
        self.dist.barrier(group=self.group)


class MpiSync:
    """Agreement through the MPI communicator (the MPI-direct phase)."""

    def __init__(self, comm: Any) -> None:
        self.comm = comm

    def max_each(self, values: list[float]) -> list[float]:
        from mpi4py import MPI

        buf = np.array(values, dtype=np.float64)
        self.comm.Allreduce(MPI.IN_PLACE, buf, op=MPI.MAX)
        return buf.tolist()

    def gather_errors(self, error: str | None) -> list[str]:
        return [e for e in self.comm.allgather(error) if e]

    def barrier(self) -> None:
        self.comm.Barrier()


class BenchPath(Protocol):
    via: str  # "commd", "gloo", "mpi"
    lane: str  # commd: "auto", "local" or a lane name; direct paths: "-"
    rank: int
    world: int

    @property
    def label(self) -> str: ...
    def alloc(self, count: int) -> tuple[Any, np.ndarray]: ...
    def run(self, case: Case) -> None: ...
    def barrier(self) -> None: ...


def _label(via: str, lane: str) -> str:
    return f"commd/{lane}" if via == "commd" else via


class CommdPath:
    """commd's client library on arena tensors, with a lane hint (none for auto/local) and, on the
    tcp lane, an algorithm hint (``algorithm``: a program's name; "native": the lane's own, no hint).
    ``group``: the registered group its ops run in (the job's, "world", by default)."""

    via = "commd"

    def __init__(self, client: Any, lane: str, dtype: Any, timeout: float, algorithm: str | None = None,
                 compression: str | None = None, group: str = "world") -> None:
        self.client, self.lane, self.dtype, self.timeout = client, lane, dtype, timeout
        self.group = group
        self.hint = lane if lane not in ("auto", "local") else None
        self.algorithm = algorithm
        self.algo = algorithm if algorithm not in (None, NATIVE) else None
        #: ``CODEC`` or ``CODEC/per-hop`` (broadcasts only); ``codec``: its codec's name
        self.compression = compression
        self.codec = compression.partition("/")[0] if compression else None
        #: The ops' codec field: a lane's plain path is never compressed ("none"), so compressed paths
        #: and the tuning table compare against plain transfers; "auto" sends none (the daemons choose).
        self.asked = compression or ("none" if self.hint else None)
        if group == "world":
            self.rank, self.world = client.rank, client.world_size
        else:
            self.rank, self.world = client.group_rank(group), client.group_size(group)

    @property
    def label(self) -> str:
        if self.algorithm is not None:
            return f"commd-{self.lane}/{self.algorithm}"
        if self.compression is not None:
            return f"commd-{self.lane}+{self.compression}"
        return _label(self.via, self.lane)

    def alloc(self, count: int) -> tuple[Any, np.ndarray]:
        t = self.client.empty(count, self.dtype)
        return t, t.numpy()

    def barrier(self) -> None:
        from commd.client import ops

        ops.barrier(self.client, group=self.group, lane=self.hint).wait(self.timeout)

    def run(self, case: Case) -> None:
        from commd.client import ops

        c, b, h, n, g = self.client, case.native, self.hint, self.world, self.group
        w = self.timeout
        op = case.op
        if op == "allreduce":
            ops.all_reduce(c, b["buf"], group=g, lane=h, algo=self.algo, compression=self.asked).wait(w)
        elif op == "reduce":
            ops.reduce(c, b["buf"], ROOT, group=g, lane=h).wait(w)
        elif op == "broadcast":
            ops.broadcast(c, b["buf"], ROOT, group=g, lane=h, compression=self.asked).wait(w)
        elif op == "allgather":
            ops.all_gather(c, b["out"], b["in"], group=g, lane=h, algo=self.algo, compression=self.asked).wait(w)
        elif op == "reduce_scatter":
            ops.reduce_scatter(c, b["out"], b["in"], group=g, lane=h).wait(w)
        elif op == "alltoall":
            splits = [case.count] * n
            ops.all_to_all(c, b["out"], b["in"], splits, splits, group=g, lane=h, algo=self.algo).wait(w)
        elif op == "alltoallv":  # (no algo: programs run equal blocks only, and no path offers one here)
            ops.all_to_all(c, b["out"], b["in"], case.splits_in, case.splits_out, group=g, lane=h).wait(w)
        elif op == "alltonext":
            ops.alltonext(c, b["out"], b["in"], group=g, lane=h, algo=self.algo).wait(w)
        elif op == "sendrecv":
            last = n - 1
            if self.rank == ROOT:
                back = ops.recv(c, b["recv"], last, group=g, lane=h)
                ops.send(c, b["send"], last, group=g, lane=h).wait(w)
                back.wait(w)
            elif self.rank == last:
                ops.recv(c, b["recv"], ROOT, group=g, lane=h).wait(w)
                ops.send(c, b["recv"], ROOT, group=g, lane=h).wait(w)  # echo what arrived
        elif op == "barrier":
            ops.barrier(c, group=g, lane=h).wait(w)
        else:  # pragma: no cover - spec validated the op
            raise ValueError(op)


class GlooPath:
    """torch.distributed with the Gloo backend on ordinary tensors, in the same worker processes;
    ``group``: the subgroup's Gloo group (None: every rank), its roots and peers named by group rank."""

    via = "gloo"
    lane = "-"

    def __init__(self, dtype: Any, group: Any = None) -> None:
        import torch.distributed as dist

        self.dist, self.dtype, self.group = dist, dtype, group
        self.rank, self.world = dist.get_rank(group), dist.get_world_size(group)

    @property
    def label(self) -> str:
        return self.via

    def alloc(self, count: int) -> tuple[Any, np.ndarray]:
        import torch

        t = torch.empty(count, dtype=self.dtype)
        return t, t.numpy()

    def barrier(self) -> None:
        self.dist.barrier(group=self.group)

    def run(self, case: Case) -> None:
        d, b, op, g = self.dist, case.native, case.op, self.group
        if op == "allreduce":
            d.all_reduce(b["buf"], group=g)
        elif op == "reduce":
            d.reduce(b["buf"], group=g, group_dst=ROOT)
        elif op == "broadcast":
            d.broadcast(b["buf"], group=g, group_src=ROOT)
        elif op == "allgather":
            getattr(d, "all_gather_single", d.all_gather_into_tensor)(b["out"], b["in"], group=g)
        elif op == "reduce_scatter":
            getattr(d, "reduce_scatter_single", d.reduce_scatter_tensor)(b["out"], b["in"], group=g)
        elif op == "alltoall":
            d.all_to_all_single(b["out"], b["in"], group=g)
        elif op == "alltoallv":
            d.all_to_all_single(b["out"], b["in"], output_split_sizes=case.splits_out,
                                input_split_sizes=case.splits_in, group=g)
        elif op == "alltonext":  # the same transfer as send/recv pairs
            reqs = [d.isend(b["in"], group=g, group_dst=self.rank + 1)] if self.rank + 1 < self.world else []
            reqs += [d.irecv(b["out"], group=g, group_src=self.rank - 1)] if self.rank else []
            for req in reqs:
                req.wait()
        elif op == "sendrecv":
            last = self.world - 1
            if self.rank == ROOT:
                back = d.irecv(b["recv"], group=g, group_src=last)
                d.send(b["send"], group=g, group_dst=last)
                back.wait()
            elif self.rank == last:
                d.recv(b["recv"], group=g, group_src=ROOT)
                d.send(b["recv"], group=g, group_dst=ROOT)
        elif op == "barrier":
            d.barrier(group=g)
        else:  # pragma: no cover
            raise ValueError(op)


class MpiPath:
    """mpi4py on NumPy arrays (buffer interface, no pickling), under mpiexec."""

    via = "mpi"
    lane = "-"

    def __init__(self, comm: Any, dtype: str) -> None:
        self.comm, self.dtype = comm, np.dtype(dtype)
        self.rank, self.world = comm.Get_rank(), comm.Get_size()

    @property
    def label(self) -> str:
        return self.via

    def alloc(self, count: int) -> tuple[Any, np.ndarray]:
        a = np.empty(count, dtype=self.dtype)
        return a, a

    def barrier(self) -> None:
        self.comm.Barrier()

    def run(self, case: Case) -> None:
        from mpi4py import MPI

        comm, b, op = self.comm, case.native, case.op
        if op == "allreduce":
            comm.Allreduce(MPI.IN_PLACE, b["buf"], op=MPI.SUM)
        elif op == "reduce":
            if self.rank == ROOT:
                comm.Reduce(MPI.IN_PLACE, b["buf"], op=MPI.SUM, root=ROOT)
            else:
                comm.Reduce(b["buf"], None, op=MPI.SUM, root=ROOT)
        elif op == "broadcast":
            comm.Bcast(b["buf"], root=ROOT)
        elif op == "allgather":
            comm.Allgather(b["in"], b["out"])
        elif op == "reduce_scatter":
            comm.Reduce_scatter_block(b["in"], b["out"], op=MPI.SUM)
        elif op == "alltoall":
            comm.Alltoall(b["in"], b["out"])
        elif op == "alltoallv":  # [buffer, counts]: mpi4py places the blocks back to back
            comm.Alltoallv([b["in"], case.splits_in], [b["out"], case.splits_out])
        elif op == "alltonext":  # the same transfer as send/recv pairs
            nxt = self.rank + 1 if self.rank + 1 < self.world else MPI.PROC_NULL
            prv = self.rank - 1 if self.rank else MPI.PROC_NULL
            comm.Sendrecv(b["in"], nxt, 0, b["out"], prv, 0)
        elif op == "sendrecv":
            last = self.world - 1
            if self.rank == ROOT:
                comm.Sendrecv(b["send"], last, 0, b["recv"], last, 0)
            elif self.rank == last:
                comm.Recv(b["recv"], ROOT, 0)
                comm.Send(b["recv"], ROOT, 0)
        elif op == "barrier":
            comm.Barrier()
        else:  # pragma: no cover
            raise ValueError(op)
