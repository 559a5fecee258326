"""One rank of the MpiLane check, run as ``mpiexec -n 3 python tests/scripts/mpi_lane_worker.py``.

Every rank derives every rank's inputs from a seed, so each checks its own
results against a NumPy reference without extra communication; float sums
are also compared bit for bit across ranks (the contract wants the same
bits on every node).  Exits 1 with a message naming the first mismatch.
The last phase times out on purpose, then drains the stuck collective so
every rank finalises MPI cleanly.
"""

from __future__ import annotations

import faulthandler
import sys
import time
import traceback
from pathlib import Path

import numpy as np
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from commd.kernels.reduce import TORCH_DTYPES  # noqa: E402
from commd.lanes.base import LaneError  # noqa: E402
from commd.lanes.mpi import MpiLane, init_mpi  # noqa: E402

T = 20.0  # per-call timeout of the checks that must pass
HANG_S = 60.0  # the whole run takes a few seconds

_NP_REDUCE = {
    "sum": np.add, "product": np.multiply, "min": np.minimum, "max": np.maximum,
    "band": np.bitwise_and, "bor": np.bitwise_or, "bxor": np.bitwise_xor,
}
_NP_BOOL = {
    "sum": np.logical_or, "max": np.logical_or, "bor": np.logical_or,
    "product": np.logical_and, "min": np.logical_and, "band": np.logical_and, "bxor": np.logical_xor,
}


class Check:
    """Counts checks; the first failure raises with a message naming the case."""

    def __init__(self, rank: int) -> None:
        self.rank = rank
        self.count = 0

    def equal(self, what: str, got: np.ndarray, want: np.ndarray, exact: bool = True) -> None:
        self.count += 1
        same = np.array_equal(got, want) if exact else np.allclose(got, want, rtol=1e-5, atol=1e-5)
        if not same:
            raise AssertionError(f"rank {self.rank}: {what}: got {got[:8]}... want {want[:8]}...")


def data(dtype: str, rank: int, n: int, salt: int = 0) -> np.ndarray:
    """Rank ``rank``'s input: reproducible on every rank, small enough that products stay exact-ish."""
    rng = np.random.default_rng(1000 * rank + salt)
    if dtype == "bool":
        return rng.random(n) < 0.5
    if dtype.startswith("complex"):
        return (rng.uniform(-2, 2, n) + 1j * rng.uniform(-2, 2, n)).astype(dtype)
    if dtype.startswith("float"):
        return rng.uniform(-2, 2, n).astype(dtype)
    info = np.iinfo(dtype)
    return rng.integers(max(info.min, -100), min(info.max, 100), n, endpoint=True).astype(dtype)


def reference(dtype: str, op: str, inputs: list[np.ndarray]) -> np.ndarray:
    """Reduce in node order (the order commd.kernels.reduce uses)."""
    fn = _NP_BOOL[op] if dtype == "bool" else _NP_REDUCE[op]
    acc = inputs[0].copy()
    for other in inputs[1:]:
        acc = fn(acc, other).astype(acc.dtype)
    return acc


def check_allreduce(lane: MpiLane, comm, chk: Check, nodes: tuple[int, ...]) -> None:
    cases = [
        ("float32", ["sum", "product", "min", "max"]),
        ("float64", ["sum", "max"]),
        ("int8", ["sum", "product", "min", "max", "band", "bor", "bxor"]),
        ("uint8", ["sum", "bxor"]),
        ("int16", ["sum", "product", "band"]),
        ("int32", ["sum", "min", "bor"]),
        ("int64", ["sum", "product", "max", "bxor"]),
        ("bool", ["sum", "product", "min", "max", "band", "bor", "bxor"]),
        ("complex64", ["sum", "product"]),
        ("complex128", ["sum"]),
    ]
    n = 1003
    for salt, (dtype, ops) in enumerate(cases):
        for op in ops:
            what = f"allreduce {dtype} {op} on {nodes}"
            mine = data(dtype, lane.node_rank, n, salt)
            buf = torch.from_numpy(mine.copy())
            assert buf.dtype == TORCH_DTYPES[dtype]
            lane.allreduce(nodes, buf, op, T)
            want = reference(dtype, op, [data(dtype, r, n, salt) for r in nodes])
            exact = not (dtype.startswith("float") or dtype.startswith("complex")) or op in ("min", "max")
            chk.equal(what, buf.numpy(), want, exact=exact)
            if not exact:  # same bits on every member
                got = np.ascontiguousarray(buf.numpy()).view(np.uint8)
                everyone = comm.allgather(got.tobytes())
                chk.count += 1
                if len({everyone[r] for r in nodes}) != 1:
                    raise AssertionError(f"rank {lane.node_rank}: {what}: results differ between nodes")


def check_bytes_primitives(lane: MpiLane, chk: Check, nodes: tuple[int, ...]) -> None:
    me = lane.node_rank
    pos = nodes.index(me)
    # broadcast: every member as root, a dtype MPI could not reduce (moved as bytes)
    for root in nodes:
        buf = torch.full((77,), float(me), dtype=torch.bfloat16)
        lane.broadcast(nodes, buf, root, T)
        chk.equal(f"broadcast root {root} on {nodes}", buf.float().numpy(), np.full(77, float(root), np.float32))
    # allgatherv: unequal sizes, one of them zero
    sizes = [(5 * i + 3) % 7 for i in range(len(nodes))]  # 3, 1, 6 -> with a zero below
    sizes[-1] = 0
    mine = np.full(sizes[pos], me + 1, dtype=np.uint8)
    out = torch.zeros(sum(sizes), dtype=torch.uint8)
    lane.allgatherv(nodes, torch.from_numpy(mine), out, sizes, T)
    want = np.concatenate([np.full(s, r + 1, np.uint8) for r, s in zip(nodes, sizes, strict=True)])
    chk.equal(f"allgatherv {sizes} on {nodes}", out.numpy(), want)
    # alltoallv: block (src -> dst) has (src + 2 * dst) % 4 bytes, each byte 16 * src + dst
    def block(src: int, dst: int) -> np.ndarray:
        return np.full((src + 2 * dst) % 4, 16 * src + dst, dtype=np.uint8)

    in_sizes = [block(me, d).size for d in nodes]
    out_sizes = [block(s, me).size for s in nodes]
    inp = torch.from_numpy(np.concatenate([block(me, d) for d in nodes]))
    out = torch.full((sum(out_sizes),), 255, dtype=torch.uint8)
    lane.alltoallv(nodes, inp, in_sizes, out, out_sizes, T)
    chk.equal(f"alltoallv on {nodes}", out.numpy(), np.concatenate([block(s, me) for s in nodes]))
    lane.barrier(nodes, T)
    chk.count += 1


def check_send_recv(lane: MpiLane, chk: Check) -> None:
    """0 -> 2 then 2 -> 0 (both ways), with a large message (rendezvous protocol) and a small one."""
    me = lane.node_rank
    for n in (3, 3 << 20):
        for src, dst in ((0, 2), (2, 0)):
            payload = (np.arange(n) * (src + 1)).astype(np.uint8)
            if me == src:
                lane.send(dst, torch.from_numpy(payload), T)
            elif me == dst:
                buf = torch.zeros(n, dtype=torch.uint8)
                lane.recv(src, buf, T)
                chk.equal(f"send {src}->{dst} {n} bytes", buf.numpy(), payload)


def check_refusals(lane: MpiLane, chk: Check) -> None:
    for dtype in ("float16", "bfloat16"):
        chk.count += 1
        if lane.can_run("allreduce", dtype, "sum", (0, 1, 2)) is None:
            raise AssertionError(f"can_run accepted a {dtype} reduction")
    buf = torch.zeros(4, dtype=torch.float16)
    try:
        lane.allreduce((0, 1, 2), buf, "sum", T)
    except LaneError as exc:
        chk.count += 1
        assert "float16" in str(exc), exc
    else:
        raise AssertionError("float16 allreduce did not raise")


def check_timeout(lane: MpiLane, comm, chk: Check) -> None:
    """Rank 2 skips an allreduce: 0 and 1 time out, are refused after, then 2 drains it."""
    from mpi4py import MPI

    nodes = (0, 1, 2)
    buf = torch.ones(16, dtype=torch.float32)
    if lane.node_rank != 2:
        started = time.monotonic()
        try:
            lane.allreduce(nodes, buf, "sum", 0.5)
        except LaneError as exc:
            took = time.monotonic() - started
            chk.count += 1
            if exc.code != "timeout" or "allreduce" not in str(exc) or not 0.45 <= took < 3.0:
                raise AssertionError(f"timeout case: {exc.code} {exc} after {took:.2f}s") from None
        else:
            raise AssertionError("allreduce without rank 2 did not time out")
        try:
            lane.barrier(nodes, T)
        except LaneError as exc:
            chk.count += 1
            if "earlier failure" not in str(exc) or "timed out" not in str(exc) or exc.code != "timeout":
                raise AssertionError(f"refusal after the timeout does not name it: {exc}") from None
        else:
            raise AssertionError("broken lane accepted a barrier")
    comm.Barrier()  # 0 and 1 have given up; now 2 enters the same collective (test-only internals)
    if lane.node_rank == 2:
        lane._comms[nodes].Iallreduce(MPI.IN_PLACE, [buf.numpy(), MPI.FLOAT], MPI.SUM).Wait()
        chk.equal("drained allreduce", buf.numpy(), np.full(16, 3.0, np.float32))
    else:
        for requests, _ in lane._stuck:
            MPI.Request.Waitall(requests)
        chk.equal("drained allreduce", buf.numpy(), np.full(16, 3.0, np.float32))


def main() -> int:
    faulthandler.dump_traceback_later(HANG_S, exit=True)  # a hang prints where, then exits non-zero
    comm = init_mpi()
    from mpi4py import MPI

    rank, size = comm.Get_rank(), comm.Get_size()
    chk = Check(rank)
    try:
        if size != 3:
            raise AssertionError(f"run with mpiexec -n 3, got {size} ranks")
        if MPI.Query_thread() != MPI.THREAD_MULTIPLE:
            raise AssertionError(f"thread level {MPI.Query_thread()}, wanted MULTIPLE")
        lane = MpiLane(comm)
        started = time.monotonic()
        if rank in (0, 2):  # a subset first, before the full set exists
            check_allreduce(lane, comm_subset_view(comm, (0, 2)), chk, (0, 2))
            check_bytes_primitives(lane, chk, (0, 2))
        comm.Barrier()
        check_allreduce(lane, comm, chk, (0, 1, 2))
        check_bytes_primitives(lane, chk, (0, 1, 2))
        check_send_recv(lane, chk)
        check_refusals(lane, chk)
        if rank in (1, 2):  # the single-member path
            lane.barrier((rank,), T)
        check_timeout(lane, comm, chk)
        lane.close()
        comm.Barrier()
        print(f"rank {rank}: {chk.count} checks passed in {time.monotonic() - started:.2f}s", flush=True)
        return 0
    except BaseException:
        print(f"rank {rank}: FAILED\n{traceback.format_exc()}", file=sys.stderr, flush=True)
        comm.Abort(1)
        return 1


def comm_subset_view(comm, nodes: tuple[int, ...]):
    """Something with ``allgather`` among ``nodes`` only, to compare bits inside a subset."""

    class _View:
        def allgather(self, value: bytes) -> list[bytes | None]:
            got = {r: comm.sendrecv(value, dest=r, sendtag=77, source=r, recvtag=77)
                   for r in nodes if r != comm.Get_rank()}  # two members: one exchange each
            got[comm.Get_rank()] = value
            return [got.get(r) for r in range(comm.Get_size())]

    return _View()


if __name__ == "__main__":
    sys.exit(main())
