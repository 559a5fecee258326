"""The MPI lane: mpi4py non-blocking collectives on one communicator per node subset.

Daemons started by ``mpiexec -n K commd daemon`` share COMM_WORLD, where a
daemon's rank is its node rank.  Every call is non-blocking and polled with
``Test()`` against the call's deadline, because a blocking MPI call cannot be
bounded.  MPI cannot cancel a collective either, so the first failure
(a timeout, an MPI error, ``close``) breaks the lane for good: a pending
collective still owns the communicator and the buffer, and every later call
is refused with a LaneError naming that first failure.

mpi4py is imported lazily: importing this module, ``mpi_world_size_from_env``
and ``MpiLane.can_run`` never initialise MPI (which would claim the process
for an MPI job, or hang a singleton init in some launchers).
"""

from __future__ import annotations

import threading
import time
from typing import Any

import numpy as np
import torch

from commd.kernels.layout import block_offsets, byte_view
from commd.lanes.base import (
    BITWISE_DTYPES,
    BITWISE_OPS,
    COMPLEX_DTYPES,
    LaneError,
    allreduce_dtype,
    check_allgatherv_sizes,
    check_alltoallv_sizes,
    check_cpu_tensors,
    check_nodes,
    node_index,
    pair_nodes,
    refusal,
    refuse_program,
)
from commd.lanes.mpi_env import WORLD_SIZE_ENV, mpi_world_size_from_env

__all__ = ["WORLD_SIZE_ENV", "MpiLane", "init_mpi", "mpi_can_run", "mpi_world_size_from_env"]

#: MPI datatypes (attribute names of mpi4py.MPI) for reductions; float16/bfloat16 have none
#: that is portable (MPIX_C_FLOAT16 is an MPICH extension without bfloat16).
MPI_TYPES = {
    "float32": "FLOAT",
    "float64": "DOUBLE",
    "int8": "INT8_T",
    "uint8": "UINT8_T",
    "int16": "INT16_T",
    "int32": "INT32_T",
    "int64": "INT64_T",
    "bool": "C_BOOL",
    "complex64": "C_FLOAT_COMPLEX",
    "complex128": "C_DOUBLE_COMPLEX",
}

#: MPI ops for lane ops on numbers.
MPI_OPS = {"sum": "SUM", "product": "PROD", "min": "MIN", "max": "MAX", "band": "BAND", "bor": "BOR",
           "bxor": "BXOR"}

#: MPI_C_BOOL only takes logical ops; commd's bool semantics (commd.kernels.reduce):
#: sum/max/bor are OR, product/min/band are AND, bxor is XOR.
MPI_BOOL_OPS = {"sum": "LOR", "max": "LOR", "bor": "LOR", "product": "LAND", "min": "LAND", "band": "LAND",
                "bxor": "LXOR"}

#: Tags the lane uses on the parent communicator (the subset communicators are private).
HANDSHAKE_TAG = 0x6D70
CREATE_TAG = 0x6D71
P2P_TAG = 0x6D72

#: Back-off between Test() polls.  MPI moves data only inside MPI calls (no progress
#: thread), so while an op's data is expected to be moving the sleeps stay at most
#: FAST_MAX_SLEEP_S: with 1 ms sleeps a 64 MiB allreduce over MPICH's network path took
#: 4x longer.  After that window (a peer is late) they grow to MAX_SLEEP_S, which costs
#: about 2% of a core while idle (50 us sleeps: about 9%; a blocking MPI wait spins: 100%).
MIN_SLEEP_S = 20e-6
FAST_MAX_SLEEP_S = 50e-6
MAX_SLEEP_S = 1e-3
#: The fast window: this long, plus the op's bytes at this rate.
FAST_WINDOW_S = 5e-3
FAST_WINDOW_BYTES_PER_S = 500e6


def init_mpi() -> Any:
    """Initialise MPI with thread level MULTIPLE and return COMM_WORLD.

    The lane runs on the daemon's lane thread, not the main thread, so FUNNELED is
    not enough; SERIALIZED would do for one lane thread, MULTIPLE also covers the
    daemon's own thread calling ``close``.  Raises RuntimeError if the library gives
    less than SERIALIZED (or MPI was initialised before with less).
    """
    import mpi4py

    mpi4py.rc.thread_level = "multiple"
    from mpi4py import MPI

    provided = MPI.Query_thread()
    if provided < MPI.THREAD_SERIALIZED:
        raise RuntimeError(
            f"MPI provides thread level {provided}, the MPI lane needs at least THREAD_SERIALIZED "
            f"({MPI.THREAD_SERIALIZED}); was MPI initialised before init_mpi()?"
        )
    return MPI.COMM_WORLD


def _mpi() -> Any:
    from mpi4py import MPI

    return MPI


def _bytes(buf: torch.Tensor) -> np.ndarray:
    """A NumPy uint8 view of ``buf`` (the non-reducing primitives move bytes: every dtype works)."""
    return byte_view(buf).numpy()


def _mpi_error(what: str, exc: BaseException) -> LaneError:
    """A LaneError for an MPI exception: peer_died when the library reports a failed process."""
    text = str(exc).strip()
    low = text.lower()
    died = any(hint in low for hint in ("proc_failed", "process failed", "terminated", "connection", "broken pipe"))
    return LaneError(f"mpi {what} failed: {text.splitlines()[0] if text else type(exc).__name__}",
                     "peer_died" if died else "internal")


def mpi_can_run(primitive: str, dtype: str, reduce_op: str | None, nodes: tuple[int, ...], nnodes: int) -> str | None:
    """``MpiLane.can_run`` without a lane (a pure function of names: MPI is not touched)."""
    reason = refusal("mpi", primitive, dtype, reduce_op, nodes, nnodes)
    if reason is not None or primitive != "allreduce":
        return reason  # everything but allreduce moves as MPI_BYTE
    if dtype not in MPI_TYPES:
        return f"MPI has no portable datatype for {dtype} reductions (use the gloo or tcp lane)"
    if reduce_op in BITWISE_OPS and dtype not in BITWISE_DTYPES:
        return f"reduce op {reduce_op.upper()} needs an integer or bool dtype, got {dtype}"
    if dtype in COMPLEX_DTYPES and reduce_op not in ("sum", "product"):
        return f"MPI reduces complex {dtype} with SUM and PROD only, not {reduce_op.upper()}"
    return None


class MpiLane:
    """Inter-node lane over an mpi4py communicator whose rank is the node rank.

    Subset communicators come from ``Create_group`` (collective over the members
    only), after a bounded point-to-point handshake among the members, so that a
    member that never comes makes a timeout instead of a hang.
    """

    name = "mpi"

    def __init__(self, comm: Any) -> None:
        self._comm = comm
        self.node_rank: int = comm.Get_rank()
        self.nnodes: int = comm.Get_size()
        self._comms: dict[tuple[int, ...], Any] = {}
        self._failure: LaneError | None = None
        self._stuck: list[Any] = []  # requests (and their buffers) MPI may still complete
        self._closed = False
        self._lock = threading.Lock()

    # ---- capability ---------------------------------------------------------------
    def can_run(self, primitive: str, dtype: str, reduce_op: str | None, nodes: tuple[int, ...]) -> str | None:
        """None if MPI can run it; float16/bfloat16 reductions are refused (no portable MPI type)."""
        return mpi_can_run(primitive, dtype, reduce_op, nodes, self.nnodes)

    # ---- plumbing -------------------------------------------------------------------
    def _usable(self, what: str, nodes: tuple[int, ...]) -> tuple[int, ...]:
        nodes = tuple(int(n) for n in nodes)
        if self._failure is not None:
            raise LaneError(f"mpi lane refuses {what}: broken since an earlier failure: {self._failure}",
                            self._failure.code)
        if self._closed:
            raise LaneError(f"mpi lane is closed ({what})")
        return check_nodes("mpi", what, nodes, self.node_rank, self.nnodes)

    def _break(self, error: LaneError) -> LaneError:
        with self._lock:
            if self._failure is None:
                self._failure = error
        return error

    def _wait(
        self, requests: list[Any], keep: list[Any], deadline: float, what: str, timeout: float, nbytes: int = 0
    ) -> None:
        """Poll ``requests`` with Test until done or the deadline; on failure break the lane."""
        MPI = _mpi()
        delay = MIN_SLEEP_S
        fast_until = time.monotonic() + FAST_WINDOW_S + nbytes / FAST_WINDOW_BYTES_PER_S
        try:
            while not MPI.Request.Testall(requests):
                if self._closed:
                    raise LaneError(f"mpi lane closed during {what}")
                now = time.monotonic()
                if now >= deadline:
                    raise LaneError(f"mpi {what} timed out after {timeout:.3g}s (MPI cannot cancel it: "
                                    f"the lane is now broken)", "timeout")
                time.sleep(min(delay, deadline - now))
                delay = min(delay * 2, FAST_MAX_SLEEP_S if now < fast_until else MAX_SLEEP_S)
        except LaneError as exc:
            self._stuck.append((requests, keep))  # MPI may still touch these buffers
            raise self._break(exc) from None
        except Exception as exc:
            self._stuck.append((requests, keep))
            raise self._break(_mpi_error(what, exc)) from exc

    def _start(self, what: str, begin: Any) -> Any:
        """Call an MPI start function; an MPI error there also breaks the lane."""
        try:
            return begin()
        except Exception as exc:
            raise self._break(_mpi_error(what, exc)) from exc

    def _subcomm(self, nodes: tuple[int, ...], deadline: float, timeout: float) -> Any:
        comm = self._comms.get(nodes)
        if comm is not None:
            return comm
        MPI = _mpi()
        what = f"communicator creation for nodes {nodes}"
        peers = [p for p in nodes if p != self.node_rank]
        out_token = np.zeros(1, dtype=np.uint8)
        in_tokens = np.zeros(len(peers), dtype=np.uint8)

        def post() -> list[Any]:
            reqs = [self._comm.Isend([out_token, MPI.BYTE], dest=p, tag=HANDSHAKE_TAG) for p in peers]
            reqs += [self._comm.Irecv([in_tokens[i:i + 1], MPI.BYTE], source=p, tag=HANDSHAKE_TAG)
                     for i, p in enumerate(peers)]
            return reqs

        requests = self._start(what, post)
        self._wait(requests, [out_token, in_tokens], deadline, what, timeout)
        # Every member is here now, so the (blocking) Create_group completes promptly.
        group = self._comm.Get_group()
        try:
            sub_group = group.Incl(list(nodes))
            comm = self._start(what, lambda: self._comm.Create_group(sub_group, CREATE_TAG))
            sub_group.Free()
        finally:
            group.Free()
        self._comms[nodes] = comm
        return comm

    def _collective(self, what: str, nodes: tuple[int, ...], timeout: float, begin: Any, keep: list[Any]) -> None:
        deadline = time.monotonic() + timeout
        comm = self._subcomm(nodes, deadline, timeout)
        request = self._start(what, lambda: begin(comm))
        self._wait([request], keep, deadline, what, timeout, sum(a.nbytes for a in keep))

    # ---- primitives ---------------------------------------------------------------
    def allreduce(self, nodes: tuple[int, ...], buf: torch.Tensor, op: str, timeout: float,
                  program: Any = None) -> None:
        """In place Iallreduce with the dtype's MPI type (bool as C_BOOL with LOR/LAND/LXOR)."""
        refuse_program("mpi", program)
        nodes = self._usable("allreduce", nodes)
        check_cpu_tensors("mpi", "allreduce", buf)
        dtype = allreduce_dtype(self, nodes, buf, op)
        if len(nodes) == 1 or buf.numel() == 0:
            return
        MPI = _mpi()
        array = buf.detach().reshape(-1).numpy()
        mpi_type = getattr(MPI, MPI_TYPES[dtype])
        mpi_op = getattr(MPI, MPI_BOOL_OPS[op] if dtype == "bool" else MPI_OPS[op])
        self._collective(f"allreduce({dtype}, {op})", nodes, timeout,
                         lambda comm: comm.Iallreduce(MPI.IN_PLACE, [array, mpi_type], mpi_op), [array])

    def broadcast(self, nodes: tuple[int, ...], buf: torch.Tensor, root: int, timeout: float) -> None:
        """Ibcast of ``buf``'s bytes from ``root``."""
        nodes = self._usable("broadcast", nodes)
        check_cpu_tensors("mpi", "broadcast", buf)
        index = node_index("mpi", "broadcast", nodes, root)
        array = _bytes(buf)
        if len(nodes) == 1 or array.size == 0:
            return
        MPI = _mpi()
        self._collective(f"broadcast(root {root})", nodes, timeout,
                         lambda comm: comm.Ibcast([array, MPI.BYTE], root=index), [array])

    def allgatherv(
        self, nodes: tuple[int, ...], inp: torch.Tensor, out: torch.Tensor, sizes: list[int], timeout: float
    ) -> None:
        """Iallgatherv of bytes straight into ``out``."""
        nodes = self._usable("allgatherv", nodes)
        check_cpu_tensors("mpi", "allgatherv", inp, out)
        sizes = [int(s) for s in sizes]
        src, dst = _bytes(inp), _bytes(out)
        me = nodes.index(self.node_rank)
        check_allgatherv_sizes("mpi", nodes, me, sizes, src.size, dst.size)
        if len(nodes) == 1:
            dst[:] = src
            return
        if sum(sizes) == 0:
            return
        MPI = _mpi()
        displs = block_offsets(sizes)
        self._collective("allgatherv", nodes, timeout,
                         lambda comm: comm.Iallgatherv([src, MPI.BYTE], [dst, (sizes, displs), MPI.BYTE]),
                         [src, dst])

    def alltoallv(
        self,
        nodes: tuple[int, ...],
        inp: torch.Tensor,
        in_sizes: list[int],
        out: torch.Tensor,
        out_sizes: list[int],
        timeout: float,
        program: Any = None,
    ) -> None:
        """Ialltoallv of byte blocks."""
        refuse_program("mpi", program, "alltoallv")
        nodes = self._usable("alltoallv", nodes)
        check_cpu_tensors("mpi", "alltoallv", inp, out)
        in_sizes, out_sizes = [int(s) for s in in_sizes], [int(s) for s in out_sizes]
        src, dst = _bytes(inp), _bytes(out)
        check_alltoallv_sizes("mpi", nodes, in_sizes, out_sizes, src.size, dst.size)
        if len(nodes) == 1:
            dst[:] = src
            return
        MPI = _mpi()
        send = [src, (in_sizes, block_offsets(in_sizes)), MPI.BYTE]
        recv = [dst, (out_sizes, block_offsets(out_sizes)), MPI.BYTE]
        self._collective("alltoallv", nodes, timeout, lambda comm: comm.Ialltoallv(send, recv), [src, dst])

    def _p2p(self, what: str, peer: int, buf: torch.Tensor, timeout: float, sending: bool) -> None:
        self._usable(what, pair_nodes("mpi", what, self.node_rank, peer))
        check_cpu_tensors("mpi", what, buf)
        array = _bytes(buf)
        if array.size == 0:
            return
        MPI = _mpi()
        deadline = time.monotonic() + timeout
        # Point-to-point on the parent communicator: MPI keeps messages between two ranks with
        # one tag in order, and the lane's calls come in the global order.
        if sending:
            request = self._start(what, lambda: self._comm.Isend([array, MPI.BYTE], dest=peer, tag=P2P_TAG))
        else:
            request = self._start(what, lambda: self._comm.Irecv([array, MPI.BYTE], source=peer, tag=P2P_TAG))
        self._wait([request], [array], deadline, what, timeout, array.nbytes)

    def send(self, dst: int, buf: torch.Tensor, timeout: float) -> None:
        """Isend of ``buf``'s bytes to ``dst``."""
        self._p2p(f"send to {dst}", dst, buf, timeout, sending=True)

    def recv(self, src: int, buf: torch.Tensor, timeout: float) -> None:
        """Irecv of ``buf``'s bytes from ``src``."""
        self._p2p(f"recv from {src}", src, buf, timeout, sending=False)

    def barrier(self, nodes: tuple[int, ...], timeout: float) -> None:
        """Ibarrier among ``nodes``."""
        nodes = self._usable("barrier", nodes)
        if len(nodes) == 1:
            return
        self._collective("barrier", nodes, timeout, lambda comm: comm.Ibarrier(), [])

    def close(self) -> None:
        """Refuse later calls and make a pending one fail.

        Communicators are left to MPI_Finalize: freeing is collective, and a close
        after a failure must not block on peers that are gone.
        """
        self._closed = True

    def __repr__(self) -> str:
        state = "broken" if self._failure else "closed" if self._closed else "ok"
        return f"<MpiLane node {self.node_rank}/{self.nnodes}, {len(self._comms)} communicators, {state}>"
