"""Lanes over torch c10d process groups built per node subset: what the Gloo and NCCL lanes share.

No ``init_process_group`` and no global torch.distributed state: the daemon
may run next to anything, and one daemon may hold several lanes.  Every
distinct ``nodes`` subset gets its own process group, created lazily on its
first use under a PrefixStore named after the subset (``gloo/0.2/``).  That
is safe because only the members take part in creating it, and they all
reach that point at the same place of the one global op order.

:class:`TorchGroupLane` holds the subset groups, argument checks, allgatherv
over alltoall and the failure bookkeeping; the subclasses (:mod:`commd.lanes.gloo`,
:mod:`commd.lanes.nccl`) say how to build a group, which dtype/op combinations
the backend really runs, and how to wait for a Work.
"""

from __future__ import annotations

import threading
import time
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist

from commd.kernels.layout import byte_view
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
from commd.runtime import ClosedAtExit

# torch.distributed does not re-export AllgatherOptions (the other *Options it does).
_AllgatherOptions = torch._C._distributed_c10d.AllgatherOptions

#: torch's ReduceOp for each lane op (a lane remaps bool ops first).
TORCH_REDUCE_OPS = {
    "sum": dist.ReduceOp.SUM,
    "product": dist.ReduceOp.PRODUCT,
    "min": dist.ReduceOp.MIN,
    "max": dist.ReduceOp.MAX,
    "band": dist.ReduceOp.BAND,
    "bor": dist.ReduceOp.BOR,
    "bxor": dist.ReduceOp.BXOR,
}

#: Longest a wait goes without looking at ``close`` (see ``TorchGroupLane._wait``).
WAIT_SLICE_S = 0.1

#: Substrings of backend error messages, lower-cased, that mean the peer went away.
_PEER_DIED_HINTS = ("closed by peer", "connection reset", "connection closed", "broken pipe",
                    "connection refused", "remote worker crash", "remote process exited")


def classify_error(text: str) -> str:
    """The LaneError code for a backend exception message (peer_died, timeout or internal)."""
    low = text.lower()
    if any(hint in low for hint in _PEER_DIED_HINTS):
        return "peer_died"
    if "timed out" in low or "timeout" in low:
        return "timeout"
    return "internal"


def _first_line(exc: BaseException) -> str:
    text = str(exc).strip()
    return (text.splitlines()[0] if text else type(exc).__name__)[:500]


#: Lanes not closed yet.  Their groups are closed at interpreter exit, before module
#: teardown: a Gloo group destroyed during finalisation aborted the process ("terminate
#: called without an active exception") in about 1 run in 6.
_OPEN_LANES = ClosedAtExit()


def _own_connection(store: dist.Store) -> dist.Store:
    """A clone of ``store`` for this lane alone.

    A TCPStore client serialises its requests: while one thread blocks in ``wait``
    for a key, another thread's ``set`` on the same client waits behind it, so two
    lanes creating groups at once on one client deadlock until the store times out.
    Stores without ``clone`` are used as they are.
    """
    try:
        return store.clone()
    except (AttributeError, NotImplementedError, RuntimeError):
        return store


class TorchGroupLane:
    """A lane over torch c10d backends built per node subset (shared by Gloo and NCCL).

    Single-threaded by contract (one lane thread per daemon) except ``close``,
    which may come from any thread and makes a pending collective fail within
    ``WAIT_SLICE_S`` (a pending send/recv runs to its deadline, see ``_wait``).
    """

    name = "torch"
    #: Bound on the scratch input of one allgatherv round (see ``allgatherv``).
    tile_bytes = 256 << 20

    def __init__(self, store: dist.Store, node_rank: int, nnodes: int, timeout: float, prefix: str) -> None:
        if not 0 <= node_rank < nnodes:
            raise ValueError(f"node_rank {node_rank} is not in [0, {nnodes})")
        if timeout <= 0:
            raise ValueError(f"timeout must be positive, got {timeout}")
        self.node_rank = node_rank
        self.nnodes = nnodes
        self.timeout = float(timeout)
        self._store = _own_connection(store)
        self._prefix = prefix
        self._groups: dict[tuple[int, ...], Any] = {}
        self._failed: dict[int, LaneError] = {}  # peer node -> the first failure that involved it
        self._send_seq: dict[int, int] = {}  # tags per peer and direction (see _next_tag)
        self._recv_seq: dict[int, int] = {}
        self._closed = False
        self._busy: tuple[int, ...] | None = None  # the subset of the call in flight
        self._retired: list[Any] = []  # groups close() must not destroy yet (see close)
        self._lock = threading.Lock()  # groups vs a close() from another thread
        _OPEN_LANES.add(self)

    # ---- what subclasses provide ------------------------------------------------
    def _create_group(self, store: dist.Store, rank: int, size: int, timeout: float) -> Any:
        raise NotImplementedError

    def _reduce_refusal(self, dtype: str, op: str) -> str | None:
        raise NotImplementedError

    def _torch_reduce_op(self, dtype: str, op: str) -> dist.ReduceOp:
        raise NotImplementedError

    def _op_timeout(self, left: float) -> timedelta:
        """The backend's own timeout for an op that has ``left`` seconds to its deadline."""
        return timedelta(seconds=left)

    def _wait(self, work: Any, timeout: float, sliced: bool) -> None:
        """Block until ``work`` is done; raise the backend's exception on failure or timeout.

        Collectives wait in slices so a ``close`` from another thread ends the wait
        promptly (Gloo's abort does not fail pending work): a collective's wait that runs
        out of its slice raises "Operation timed out!" and leaves the work running.  Not
        so send/recv: their wait drives Gloo's unbound buffer, whose timeout closes the
        group's connections, so they get one wait for the whole time.
        """
        if not sliced:
            work.wait(timedelta(seconds=timeout))
            return
        deadline = time.monotonic() + timeout
        while True:
            try:
                work.wait(timedelta(seconds=min(max(deadline - time.monotonic(), 0.001), WAIT_SLICE_S)))
                return
            except Exception:
                if work.is_completed():
                    work.wait()  # finished meanwhile: returns, or raises the op's own error
                    return
                if self._closed or time.monotonic() >= deadline:
                    raise

    def _check_tensor(self, what: str, tensor: torch.Tensor) -> None:
        check_cpu_tensors(self.name, what, tensor)

    # ---- capability ---------------------------------------------------------------
    def can_run(self, primitive: str, dtype: str, reduce_op: str | None, nodes: tuple[int, ...]) -> str | None:
        """None if this lane runs ``primitive`` on ``dtype``/``reduce_op`` among ``nodes``; else why not."""
        reason = refusal(self.name, primitive, dtype, reduce_op, nodes, self.nnodes)
        if reason is not None or primitive != "allreduce":
            return reason  # everything but allreduce moves bytes
        if reduce_op in BITWISE_OPS and dtype not in BITWISE_DTYPES:
            return f"reduce op {reduce_op.upper()} needs an integer or bool dtype, got {dtype}"
        if reduce_op in ("min", "max") and dtype in COMPLEX_DTYPES:
            return f"reduce op {reduce_op.upper()} is undefined for complex dtype {dtype}"
        return self._reduce_refusal(dtype, reduce_op)

    # ---- plumbing -------------------------------------------------------------------
    def _check_nodes(self, what: str, nodes: tuple[int, ...]) -> tuple[int, ...]:
        nodes = tuple(int(n) for n in nodes)
        if self._closed:
            raise LaneError(f"{self.name} lane is closed ({what} on nodes {nodes})")
        nodes = check_nodes(self.name, what, nodes, self.node_rank, self.nnodes)
        for peer in nodes:
            if peer in self._failed:
                first = self._failed[peer]
                raise LaneError(f"{self.name} lane refuses {what} on nodes {nodes}: node {peer} is out of step "
                                f"since an earlier failure: {first}", first.code)
        return nodes

    def _group(self, nodes: tuple[int, ...], deadline: float, what: str) -> Any:
        group = self._groups.get(nodes)
        if group is not None:
            return group
        store = dist.PrefixStore(f"{self._prefix}{'.'.join(map(str, nodes))}/", self._store)
        try:
            group = self._create_group(store, nodes.index(self.node_rank), len(nodes), self._left(deadline))
        except Exception as exc:
            self._fail(nodes, f"creating the group for {what}", exc)
        with self._lock:
            if self._closed:
                self._abort(group)
                raise LaneError(f"{self.name} lane closed while creating the group for nodes {nodes}")
            self._groups[nodes] = group
        return group

    @staticmethod
    def _left(deadline: float) -> float:
        """Seconds to the deadline, never below a millisecond (backends reject a zero timeout)."""
        return max(deadline - time.monotonic(), 0.001)

    def _run(self, what: str, nodes: tuple[int, ...], timeout: float, start: Any, sliced: bool = True) -> None:
        """Create/fetch the subset's group, start the op on it, wait; failures become LaneError."""
        deadline = time.monotonic() + timeout
        self._busy = nodes
        try:
            group = self._group(nodes, deadline, what)
            work = start(group, self._left(deadline))
            del group  # only self._groups holds it: close() decides when it goes
            self._wait(work, self._left(deadline), sliced)
        except LaneError:
            raise
        except Exception as exc:
            self._fail(nodes, what, exc)
        finally:
            self._busy = None

    def _fail(self, nodes: tuple[int, ...], what: str, exc: BaseException) -> None:
        """Record the failure against the peers of ``nodes``, drop their group, raise LaneError.

        The group is destroyed here, which closes its connections and so tells the
        peers at once.  Its op has ended, or ends within moments: it was started with
        the backend's own timeout set to this call's deadline.
        """
        if self._closed:
            raise LaneError(f"{self.name} lane closed during {what} on nodes {nodes}") from exc
        error = LaneError(f"{self.name} {what} on nodes {nodes} failed: {_first_line(exc)}",
                          classify_error(str(exc)))
        with self._lock:
            for peer in nodes:
                if peer != self.node_rank:
                    self._failed.setdefault(peer, error)
            group = self._groups.pop(nodes, None)
            if group is not None:
                self._abort(group)
        raise error from exc

    @staticmethod
    def _abort(group: Any) -> None:
        """Ask the backend to stop ``group``'s pending work (NCCL aborts its communicator).

        For Gloo this does little: its abort neither fails pending work nor closes the
        sockets; only destroying the group closes them (and blocks until its pending
        work ends), which is what tells the peers that this node left the group.
        """
        try:
            group.abort()
        except Exception:  # best effort: the group is dropped either way
            pass

    # ---- primitives ---------------------------------------------------------------
    def allreduce(self, nodes: tuple[int, ...], buf: torch.Tensor, op: str, timeout: float,
                  program: Any = None) -> None:
        """In place element-wise reduction of ``buf`` over ``nodes`` (the backend's ring: same bits everywhere)."""
        refuse_program(self.name, program)
        nodes = self._check_nodes("allreduce", nodes)
        self._check_tensor("allreduce", buf)
        dtype = allreduce_dtype(self, nodes, buf, op)
        if len(nodes) == 1 or buf.numel() == 0:
            return
        opts = dist.AllreduceOptions()
        opts.reduceOp = self._torch_reduce_op(dtype, op)

        def start(group: Any, left: float) -> Any:
            opts.timeout = self._op_timeout(left)
            return group.allreduce([buf.reshape(-1)], opts)

        self._run(f"allreduce({dtype}, {op})", nodes, timeout, start)

    def broadcast(self, nodes: tuple[int, ...], buf: torch.Tensor, root: int, timeout: float) -> None:
        """``root``'s ``buf`` into everyone's, moved as bytes (Gloo has no int16 broadcast, bytes always work)."""
        nodes = self._check_nodes("broadcast", nodes)
        self._check_tensor("broadcast", buf)
        root_index = node_index(self.name, "broadcast", nodes, root)
        data = byte_view(buf)
        if len(nodes) == 1 or data.numel() == 0:
            return
        opts = dist.BroadcastOptions()
        opts.rootRank = root_index
        opts.rootTensor = 0

        def start(group: Any, left: float) -> Any:
            opts.timeout = self._op_timeout(left)
            return group.broadcast([data], opts)

        self._run(f"broadcast(root {root})", nodes, timeout, start)

    def allgatherv(
        self, nodes: tuple[int, ...], inp: torch.Tensor, out: torch.Tensor, sizes: list[int], timeout: float
    ) -> None:
        """Concatenate every node's bytes, as an alltoallv whose input is this node's bytes once per node.

        The backends' allgather needs equal sizes; padding to the largest and copying
        out costs bandwidth and a copy.  The alltoallv puts every block in place in
        ``out``, and on loopback it beat both Gloo's allgather (equal sizes, ~25%) and the
        padded allgather (1.6x equal-ish, 3x skewed).  The tiled input costs
        ``len(nodes) * max(sizes)`` bytes, so above ``tile_bytes`` equal sizes use the
        allgather straight into ``out`` and unequal ones go in rounds of at most
        ``tile_bytes``.  Every node derives the choice from ``sizes`` alone.
        """
        nodes = self._check_nodes("allgatherv", nodes)
        self._check_tensor("allgatherv", inp)
        self._check_tensor("allgatherv", out)
        sizes = [int(s) for s in sizes]
        me = nodes.index(self.node_rank)
        src, dst = byte_view(inp), byte_view(out)
        check_allgatherv_sizes(self.name, nodes, me, sizes, src.numel(), dst.numel())
        n, top = len(nodes), max(sizes)
        if n == 1:
            dst.copy_(src)
            return
        if top == 0:
            return
        deadline = time.monotonic() + timeout
        if n * top <= self.tile_bytes:
            self._allgather_round(nodes, src, dst, sizes, me, deadline)
        elif all(s == top for s in sizes):

            def start(group: Any, left: float) -> Any:
                opts = _AllgatherOptions()
                opts.timeout = self._op_timeout(left)
                return group._allgather_base(dst, src, opts)

            self._run("allgatherv", nodes, timeout, start)
        else:
            chunk = max(self.tile_bytes // n, 1)
            offsets = [sum(sizes[:i]) for i in range(n)]
            for first in range(0, top, chunk):
                lens = [min(max(s - first, 0), chunk) for s in sizes]
                stage = torch.empty(sum(lens), dtype=torch.uint8, device=dst.device)
                self._allgather_round(nodes, src[first:first + lens[me]], stage, lens, me, deadline)
                at = 0
                for i, length in enumerate(lens):
                    dst[offsets[i] + first:offsets[i] + first + length].copy_(stage[at:at + length])
                    at += length

    def _allgather_round(
        self, nodes: tuple[int, ...], src: torch.Tensor, dst: torch.Tensor, sizes: list[int], me: int,
        deadline: float,
    ) -> None:
        tiled = src.repeat(len(nodes))
        in_sizes = [sizes[me]] * len(nodes)

        def start(group: Any, left: float) -> Any:
            opts = dist.AllToAllOptions()
            opts.timeout = self._op_timeout(left)
            return group.alltoall_base(dst, tiled, sizes, in_sizes, opts)

        self._run("allgatherv", nodes, self._left(deadline), start)

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
        """Personalised exchange of byte blocks (the backend copies this node's own block locally)."""
        refuse_program(self.name, program, "alltoallv")
        nodes = self._check_nodes("alltoallv", nodes)
        self._check_tensor("alltoallv", inp)
        self._check_tensor("alltoallv", out)
        in_sizes, out_sizes = [int(s) for s in in_sizes], [int(s) for s in out_sizes]
        src, dst = byte_view(inp), byte_view(out)
        check_alltoallv_sizes(self.name, nodes, in_sizes, out_sizes, src.numel(), dst.numel())
        if len(nodes) == 1:
            dst.copy_(src)
            return

        def start(group: Any, left: float) -> Any:
            opts = dist.AllToAllOptions()
            opts.timeout = self._op_timeout(left)
            return group.alltoall_base(dst, src, out_sizes, in_sizes, opts)

        self._run("alltoallv", nodes, timeout, start)

    def _pair(self, peer: int, what: str) -> tuple[int, ...]:
        return self._check_nodes(what, pair_nodes(self.name, what, self.node_rank, peer))

    @staticmethod
    def _next_tag(seqs: dict[int, int], peer: int) -> int:
        """Tags count the messages in one direction of a pair, so both ends pick the same one."""
        tag = seqs.get(peer, 0)
        seqs[peer] = (tag + 1) % (1 << 30)
        return tag

    def send(self, dst: int, buf: torch.Tensor, timeout: float) -> None:
        """Send ``buf``'s bytes to ``dst`` over the pair's group."""
        nodes = self._pair(dst, f"send to {dst}")
        self._check_tensor("send", buf)
        data = byte_view(buf)
        if data.numel() == 0:
            return
        tag = self._next_tag(self._send_seq, dst)
        peer = nodes.index(dst)
        self._run(f"send to {dst}", nodes, timeout, lambda group, left: group.send([data], peer, tag),
                  sliced=False)

    def recv(self, src: int, buf: torch.Tensor, timeout: float) -> None:
        """Receive ``buf``'s bytes from ``src`` over the pair's group."""
        nodes = self._pair(src, f"recv from {src}")
        self._check_tensor("recv", buf)
        data = byte_view(buf)
        if data.numel() == 0:
            return
        tag = self._next_tag(self._recv_seq, src)
        peer = nodes.index(src)
        self._run(f"recv from {src}", nodes, timeout, lambda group, left: group.recv([data], peer, tag),
                  sliced=False)

    def barrier(self, nodes: tuple[int, ...], timeout: float) -> None:
        """Return once every node of ``nodes`` has entered."""
        nodes = self._check_nodes("barrier", nodes)
        if len(nodes) == 1:
            return

        def start(group: Any, left: float) -> Any:
            opts = dist.BarrierOptions()
            opts.timeout = self._op_timeout(left)
            return group.barrier(opts)

        self._run("barrier", nodes, timeout, start)

    def close(self) -> None:
        """Close the groups: a pending call fails with LaneError, later calls are refused.

        Idle groups are destroyed now (their connections close).  The group of a call
        in flight is kept: destroying it would block this thread, holding the GIL,
        until the backend's own timeout of that op; it goes with the lane.  A pending
        send/recv is not interrupted (see ``_wait``): it ends at its deadline.
        """
        _OPEN_LANES.discard(self)
        with self._lock:
            self._closed = True
            groups, self._groups = self._groups, {}
            for nodes, group in groups.items():
                self._abort(group)
                if nodes == self._busy:
                    self._retired.append(group)
        groups.clear()

    def __repr__(self) -> str:
        return f"<{type(self).__name__} node {self.node_rank}/{self.nnodes}, {len(self._groups)} groups>"
