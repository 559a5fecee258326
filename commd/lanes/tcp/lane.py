"""commd's own TCP lane: a full mesh of authenticated connections between the daemons.

:class:`TcpLane` implements the :class:`~commd.lanes.base.Lane` contract in
three parts kept apart: the byte transport (:mod:`.transport`: ``Mesh``,
``Peer``, ``Exchange``), the connection set-up and mutual authentication
(:mod:`.handshake`), and the collective algorithms (:mod:`.algorithms`, written
against the public :class:`~commd.lanes.base.Transport`).  This module picks an
algorithm by size, checks the arguments, and keeps the failure bookkeeping the
Lane contract asks for (a failed call makes the streams to its peers unusable).
"""

from __future__ import annotations

import functools
import logging
import socket
import threading
import time
from collections import OrderedDict
from collections.abc import Callable
from typing import Any

import numpy as np
import torch

from commd.algorithms.catalog import NO_NUMPY_DTYPES, Chosen, Program, short
from commd.codecs import Codec, CodecError
from commd.kernels.reduce import DTYPE_NAMES, UnsupportedReduction, check_supported
from commd.lanes.base import (
    LaneError,
    Transport,
    TransportError,
    allreduce_dtype,
    check_allgatherv_sizes,
    check_alltoallv_sizes,
    check_nodes,
    memory_view,
    pair_nodes,
    refusal,
)
from commd.lanes.tcp import algorithms
from commd.lanes.tcp.compressed import (
    ChainCounts,
    CodedTransport,
    compressed_chain_broadcast,
    compressed_ring_allgather,
    compressed_ring_allreduce,
)
from commd.lanes.tcp.handshake import MeshConnector, listen
from commd.lanes.tcp.transport import Exchange, Mesh

log = logging.getLogger("commd.lanes.tcp")

#: All-reduces of at most this many bytes exchange whole buffers (one round trip, every node
#: reduces all contributions in node order); larger ones use the ring (bandwidth-optimal).
SMALL_ALLREDUCE_BYTES = 64 * 1024
#: Broadcasts of at most this many bytes go from the root to each node directly; larger ones
#: take the pipelined chain.
SMALL_BROADCAST_BYTES = 64 * 1024
#: Smallest accepted ``chunk_bytes`` (below this the per-chunk overhead dominates everything).
MIN_CHUNK_BYTES = 256
#: Compiled program plans kept per lane (one per program, count, dtype and rank in use).
MAX_PLANS = 64

#: Runs one node's part of a program: (transport, program, nodes, this node's index, input and
#: output as NumPy arrays (the same array for an all-reduce), lane op, deadline, the lane's plan cache).
ProgramRunner = Callable[[Transport, Program, tuple[int, ...], int, np.ndarray, np.ndarray, str, float,
                          "OrderedDict[tuple, Any]"], None]


@functools.cache
def _interpreter() -> Any:
    """``commd.algorithms.interpreter``, imported on the first program run (not at the lane's import)."""
    from commd.algorithms import interpreter

    return interpreter


def interpret(tp: Transport, program: Program, nodes: tuple[int, ...], me: int, inp: np.ndarray, out: np.ndarray,
              op: str, deadline: float, plans: OrderedDict[tuple, Any]) -> None:
    """Run ``program`` as DSL rank ``me`` through the interpreter: ``out`` gets this node's result.

    Plans are built once per (program, rank, count, dtype) and kept (least recently used out)."""
    interpreter = _interpreter()

    key = (program.digest, me, inp.size, inp.dtype.str)
    plan = plans.get(key)
    if plan is None:
        # tiles of the lane's own pieces: the native algorithms' pipelining grain, and no more steps than theirs
        plan = plans[key] = interpreter.Plan.build(program.algo, me, inp.size, inp.dtype, tile_bytes=tp.chunk_bytes,
                                                   source=program.source)
        while len(plans) > MAX_PLANS:
            plans.popitem(last=False)
    else:
        plans.move_to_end(key)
    if program.algo.inplace and inp is not out and inp.size == out.size:
        out[:] = inp  # an in-place program reads its input where it writes (an all-gather's: its block of out)
        inp = out
    elif not program.algo.inplace and inp is out:  # an out-of-place one must not see its output change
        inp = inp.copy()
    interpreter.run(plan, tp, nodes, inp, out, op, deadline)


def _program_codec(what: str, program: Chosen, codec: Codec | None) -> None:
    """LaneError unless ``codec`` may code a program's transfers (none, or a lossless one)."""
    if codec is not None and codec.lossy:
        raise LaneError(f"tcp {what}: codec {codec.name!r} is lossy; algorithm {program.name!r} runs compressed "
                        "with lossless codecs only (its partial results would be rounded at every hop)")


def _codec_takes(what: str, codec: Codec, dtype: str) -> None:
    """LaneError, in the codec's own words, unless ``codec`` takes ``dtype`` (NumPy dtypes only)."""
    try:
        codec.check_dtype(dtype)
    except CodecError as exc:
        raise LaneError(f"tcp {what}: {exc}") from None


def _packed(values: tuple[int, ...]) -> memoryview:
    """An agreement's bytes: each value and its negation, as int64 (the maximum of both is the
    maximum and the minus minimum)."""
    packed = memoryview(bytearray(16 * len(values))).cast("q")
    for i, value in enumerate(values):
        packed[2 * i], packed[2 * i + 1] = value, -value
    return packed


def _send_only(ex: Exchange, peer: int, packed: memoryview, payload: bytes) -> None:
    ex.post_send(peer, packed.cast("B"))
    ex.post_send(peer, memoryview(payload))
    ex.wait()


def _recv_only(ex: Exchange, peer: int, theirs: memoryview) -> bytes:
    """The peer's values, then its payload, whose length is the last value (checked: at most 16 MiB)."""
    ex.post_recv(peer, theirs.cast("B"))
    ex.wait()
    length = theirs[-2]
    if not 0 <= length <= MAX_AGREE_PAYLOAD or theirs[-1] != -length:
        raise TransportError(peer, "protocol", f"node {peer} sent an agreement with a payload of {length} bytes")
    payload = bytearray(length)
    ex.post_recv(peer, memoryview(payload))
    ex.wait()
    return bytes(payload)


#: The largest payload a two-node agreement carries (a tiny all-reduce's contribution, 4 KiB, in practice).
MAX_AGREE_PAYLOAD = 16 << 20
#: The longest block of a gathered agreement: its values (at most 8) and a payload.
GATHER_LIMIT = 64 + MAX_AGREE_PAYLOAD


def gather_head(values: tuple[int, ...]) -> bytes:
    """The values that open each node's block of a gathered agreement."""
    return b"".join(value.to_bytes(8, "little", signed=True) for value in values)


def gathered_agreement(values: tuple[int, ...], blocks: list[bytes]) -> tuple[bool, list[bytes]]:
    """From every node's block (in node order): whether all opened with ``values``, and their payloads."""
    head = gather_head(values)
    return all(block[:len(head)] == head for block in blocks), [block[len(head):] for block in blocks]


class TcpLane:
    """commd's own inter-node lane: point-to-point TCP between the job's daemons.

    Single-threaded by contract (the daemon's tcp lane thread), except
    ``close``, which may come from any thread and makes a pending call fail.
    """

    name = "tcp"

    def __init__(self, node_rank: int, nnodes: int, secret: str, host: str, port: int = 0,
                 chunk_bytes: int = 1 << 20) -> None:
        for what, value in (("node_rank", node_rank), ("nnodes", nnodes), ("port", port),
                            ("chunk_bytes", chunk_bytes)):
            if not isinstance(value, int) or isinstance(value, bool):
                raise ValueError(f"{what} must be an int, got {value!r}")
        if nnodes < 1:
            raise ValueError(f"nnodes must be at least 1, got {nnodes}")
        if not 0 <= node_rank < nnodes:
            raise ValueError(f"node_rank {node_rank} is not in [0, {nnodes})")
        if not isinstance(secret, str) or not secret:
            raise ValueError("secret must be a non-empty string (the job secret)")
        if not isinstance(host, str) or not host:
            raise ValueError(f"host must be a non-empty string, got {host!r}")
        if not 0 <= port <= 65535:
            raise ValueError(f"port {port} is not in [0, 65535]")
        if chunk_bytes < MIN_CHUNK_BYTES:
            raise ValueError(f"chunk_bytes must be at least {MIN_CHUNK_BYTES}, got {chunk_bytes}")
        self.node_rank = node_rank
        self.nnodes = nnodes
        self.chunk_bytes = chunk_bytes
        self._key = secret.encode()
        self._listener = listen(host, port, nnodes)
        name = self._listener.getsockname()
        self._endpoint: tuple[str, int] = (str(name[0]), int(name[1]))
        self._wake_r, self._wake_w = socket.socketpair()
        self._wake_r.setblocking(False)
        self._wake_w.setblocking(False)
        self._mesh = Mesh(node_rank, chunk_bytes, self._wake_r)
        self._connected = False
        self._connect_error: LaneError | None = None
        self._closed = False
        self._op_lock = threading.Lock()  # one call at a time; close() waits for it to let go
        #: How a program runs (the interpreter; tests substitute their own).
        self.program_runner: ProgramRunner = interpret
        self._plans: OrderedDict[tuple, Any] = OrderedDict()
        self._compression: dict[str, dict[str, Any]] = {}  # per codec: what compression_status reports
        self._compression_lock = threading.Lock()
        #: (name, hash, nodes) whose every node was seen to hold that program (checked once).
        self._agreed: set[tuple[str, str, tuple[int, ...]]] = set()

    @property
    def endpoint(self) -> tuple[str, int]:
        """The (host, port) the listening socket is bound to (the real port when 0 was asked)."""
        return self._endpoint

    def __repr__(self) -> str:
        state = "closed" if self._closed else "connected" if self._connected else "unconnected"
        host, port = self._endpoint
        return f"<TcpLane node {self.node_rank}/{self.nnodes} at {host}:{port}, {state}>"

    # ---- connecting ---------------------------------------------------------------------
    def connect(self, endpoints: list[tuple[str, int]], timeout: float) -> None:
        """Connect to every other node (dial the lower ranks, accept the higher) within ``timeout`` s.

        Raises LaneError("timeout") naming the nodes still missing; a failed
        connect leaves the lane unusable.
        """
        if len(endpoints) != self.nnodes:
            raise LaneError(f"tcp connect: {len(endpoints)} endpoints given for {self.nnodes} nodes")
        if timeout <= 0:
            raise LaneError(f"tcp connect: timeout must be positive, got {timeout}")
        with self._op_lock:
            if self._closed:
                raise LaneError("tcp lane is closed")
            if self._connected or self._connect_error is not None:
                raise LaneError("tcp connect: already called on this lane")
            try:
                MeshConnector(self.node_rank, self.nnodes, self._key, self._listener, self._wake_r,
                              self._mesh).run(endpoints, time.monotonic() + timeout, timeout)
            except LaneError as exc:
                self._connect_error = exc
                self._mesh.close()
                raise
            finally:
                self._listener.close()
            self._connected = True

    # ---- capability and plumbing ----------------------------------------------------------
    def can_run(
        self, primitive: str, dtype: str, reduce_op: str | None, nodes: tuple[int, ...]
    ) -> str | None:
        """None if this lane runs ``primitive`` on ``dtype``/``reduce_op`` among ``nodes``; else why not.

        A pure function of its arguments (the coordinator asks it for every
        daemon), so it says nothing about the state of connections.
        """
        reason = refusal("tcp", primitive, dtype, reduce_op, nodes, self.nnodes)
        if reason is not None or primitive != "allreduce":
            return reason
        try:
            check_supported(reduce_op, dtype)
        except UnsupportedReduction as exc:
            return str(exc)
        return None

    def _check_nodes(self, what: str, nodes: tuple[int, ...]) -> tuple[tuple[int, ...], int]:
        """Normalised ``nodes`` and this node's index in it; LaneError if they make no sense."""
        nodes = check_nodes("tcp", what, nodes, self.node_rank, self.nnodes)
        return nodes, nodes.index(self.node_rank)

    @staticmethod
    def _check_tensor(what: str, tensor: torch.Tensor, uint8: bool = False) -> None:
        if tensor.device.type != "cpu" or not tensor.is_contiguous():
            raise LaneError(f"tcp {what}: tensors must be contiguous and on the CPU, got {tensor.device}")
        if uint8 and tensor.dtype != torch.uint8:
            raise LaneError(f"tcp {what}: expected a uint8 tensor, got {tensor.dtype}")

    def _usable(self, what: str, nodes: tuple[int, ...]) -> None:
        """Refuse at once when closed, unconnected, or a peer's stream broke earlier."""
        if self._closed:
            raise LaneError(f"tcp lane is closed ({what} on nodes {nodes})")
        if self._connect_error is not None:
            raise LaneError(f"tcp lane unusable ({what}): connect failed: {self._connect_error}",
                            self._connect_error.code)
        if not self._connected and len(nodes) > 1:
            raise LaneError(f"tcp {what}: the lane is not connected yet")
        for rank in nodes:
            peer = self._mesh.peers.get(rank)
            if peer is not None and peer.failure is not None:
                raise LaneError(f"tcp lane refuses {what} on nodes {nodes}: the stream to node {rank} is "
                                f"unusable since an earlier failure: {peer.failure}", peer.failure.code)

    def _run(self, what: str, kind: str, nodes: tuple[int, ...], timeout: float,
             body: Callable[[Exchange], None]) -> None:
        """Run one call's transfers under its deadline; on failure mark the call's peers unusable.

        Every peer of the call is marked, not only the one at fault: the others
        may be part-way through a transfer, so their streams are out of step too.
        """
        deadline = time.monotonic() + timeout
        if not self._op_lock.acquire(timeout=max(0.0, timeout)):
            raise LaneError(f"tcp {what}: another call on this lane did not finish in time", "timeout")
        try:
            self._usable(what, nodes)
            try:
                body(Exchange(self._mesh, kind, deadline, timeout, self.chunk_bytes))
            except TransportError as failure:
                self._failed(what, nodes, failure.code, failure.message)
            except LaneError:
                raise
            except Exception as exc:
                self._failed(what, nodes, "internal", f"{type(exc).__name__}: {exc}", exc)
        finally:
            self._op_lock.release()

    def _failed(self, what: str, nodes: tuple[int, ...], code: str, message: str,
                cause: BaseException | None = None) -> None:
        if self._closed:
            self._mesh.drop_queues()
            raise LaneError(f"tcp lane closed during {what} on nodes {nodes}") from cause
        error = LaneError(f"tcp {what} on nodes {nodes} failed: {message}", code)
        self._mesh.break_peers([n for n in nodes if n != self.node_rank], error)
        log.debug("tcp lane node %d: %s", self.node_rank, error)
        raise error from cause

    # ---- primitives -----------------------------------------------------------------------
    def allreduce(self, nodes: tuple[int, ...], buf: torch.Tensor, op: str, timeout: float,
                  program: Chosen | None = None, codec: Codec | None = None) -> None:
        """In-place reduction over ``nodes``: whole-buffer exchange when small, ring when large;
        ``program``: the released program instead (DSL rank = this node's index in ``nodes``);
        ``codec``: the ring with coded bytes on the wire, reduced in ``buf``'s own precision."""
        nodes, me = self._check_nodes("allreduce", nodes)
        self._check_tensor("allreduce", buf)
        dtype = allreduce_dtype(self, nodes, buf, op)
        flat = buf.detach().reshape(-1)
        if len(nodes) == 1 or flat.numel() == 0:
            self._usable("allreduce", nodes)
            return
        nbytes = flat.numel() * flat.element_size()
        if codec is not None and program is None:
            _codec_takes("allreduce", codec, dtype)
            arr = flat.numpy()
            self._run(f"allreduce({dtype}, {op}, {nbytes} bytes, codec {codec.name!r})", "allreduce", nodes,
                      timeout, lambda ex: self._count(codec.name, compressed_ring_allreduce(ex, nodes, me, arr, op,
                                                                                            codec)))
            return
        if program is not None:
            if dtype in NO_NUMPY_DTYPES:
                raise LaneError(f"tcp allreduce: algorithm {program.name!r} cannot run {dtype} (no NumPy dtype)")
            _program_codec("allreduce", program, codec)
            deadline = time.monotonic() + timeout
            arr = flat.numpy()
            coded = f", codec {codec.name!r}" if codec is not None else ""
            self._run(f"allreduce({dtype}, {op}, {nbytes} bytes, algorithm {program.name!r}{coded})", "allreduce",
                      nodes, timeout, lambda ex: self._run_program(ex, "allreduce", program, nodes, me, arr, arr, op,
                                                                   deadline, codec))
            return
        algo = algorithms.direct_allreduce if nbytes <= SMALL_ALLREDUCE_BYTES else algorithms.ring_allreduce
        self._run(f"allreduce({dtype}, {op}, {nbytes} bytes)", "allreduce", nodes, timeout,
                  lambda ex: algo(ex, nodes, me, flat, op))

    def _run_program(self, tp: Transport, what: str, chosen: Chosen, nodes: tuple[int, ...], me: int,
                     inp: np.ndarray, out: np.ndarray, op: str, deadline: float, codec: Codec | None = None,
                     dtype: np.dtype | None = None) -> None:
        """Check that every node holds the released program, then run this node's part of it (its
        transfers coded by ``codec``, a lossless one, read as ``dtype`` elements, when given)."""
        self._agree_on_program(tp, what, chosen, nodes)
        assert chosen.program is not None  # (agreement fails the call on every node otherwise)
        if codec is None:
            self.program_runner(tp, chosen.program, nodes, me, inp, out, op, deadline, self._plans)
            return
        counts = ChainCounts()
        coded = CodedTransport(tp, codec, dtype if dtype is not None else inp.dtype, counts)
        self.program_runner(coded, chosen.program, nodes, me, inp, out, op, deadline, self._plans)
        self._count(codec.name, counts)

    def _agree_on_program(self, tp: Transport, what: str, chosen: Chosen, nodes: tuple[int, ...]) -> None:
        """Every node sends every other its own hash for the released name (zeros: none); each
        compares them all with the release's.  All nodes see the same hashes, so all fail alike,
        and the streams stay in step (the exchange completes before the error).  Done once per
        (program, nodes): every node of ``nodes`` makes the same calls in the same order."""
        key = (chosen.name, chosen.digest, nodes)
        if key in self._agreed:
            return
        mine = bytes.fromhex(chosen.local_digest) if chosen.local_digest else bytes(32)
        theirs = {node: bytearray(32) for node in nodes if node != self.node_rank}
        for node, into in theirs.items():
            tp.post_send(node, memoryview(mine))
            tp.post_recv(node, memoryview(into))
        tp.wait()
        hashes = {**{node: bytes(d) for node, d in theirs.items()}, self.node_rank: mine}
        wrong = {node: d for node, d in sorted(hashes.items()) if d.hex() != chosen.digest}
        if wrong:
            held = "; ".join(f"node {node} has " + (f"sha256 {short(d.hex())}" if any(d) else "no such program")
                             for node, d in wrong.items())
            local = f" (here: {chosen.missing})" if chosen.program is None and chosen.missing else ""
            raise LaneError(f"tcp {what}: algorithm {chosen.name!r} differs between nodes: the release names "
                            f"sha256 {short(chosen.digest)}; {held}{local}", "mismatch")
        self._agreed.add(key)

    def broadcast(self, nodes: tuple[int, ...], buf: torch.Tensor, root: int, timeout: float,
                  codec: Codec | None = None, exact_root: bool = False, per_hop: bool = False) -> None:
        """``root``'s bytes into everyone's ``buf``: direct when small, pipelined chain when large;
        ``codec``: the compressed chain instead (every node must name the same codec; a lossy one
        leaves the root with the values the others decode, unless ``exact_root``; ``per_hop``: the
        baseline that decodes and codes again at every hop, for benchmarks)."""
        nodes, me = self._check_nodes("broadcast", nodes)
        self._check_tensor("broadcast", buf)
        if root not in nodes:
            raise LaneError(f"tcp broadcast: root {root} is not in {nodes}")
        view = memory_view(buf)
        if len(nodes) == 1 or len(view) == 0:
            self._usable("broadcast", nodes)
            return
        if codec is not None:
            _codec_takes("broadcast", codec, DTYPE_NAMES.get(buf.dtype, str(buf.dtype)))
            arr = buf.detach().reshape(-1).numpy()
            self._run(f"broadcast(root {root}, {len(view)} bytes, codec {codec.name!r})", "broadcast", nodes,
                      timeout, lambda ex: self._count(codec.name, compressed_chain_broadcast(
                          ex, nodes, me, root, arr, codec, exact_root, per_hop)))
            return
        algo = (algorithms.direct_broadcast if len(view) <= SMALL_BROADCAST_BYTES
                else algorithms.chain_broadcast)
        self._run(f"broadcast(root {root}, {len(view)} bytes)", "broadcast", nodes, timeout,
                  lambda ex: algo(ex, nodes, me, root, view))

    def _count(self, codec: str, counts: ChainCounts) -> None:
        with self._compression_lock:
            row = self._compression.setdefault(codec, {"ops": 0, "raw_bytes": 0, "wire_bytes": 0, "raw_chunks": 0,
                                                       "codec_s": 0.0})
            row["ops"] += 1
            row["raw_bytes"] += counts.raw_bytes
            row["wire_bytes"] += counts.wire_bytes
            row["raw_chunks"] += counts.raw_chunks
            row["codec_s"] += counts.codec_seconds

    def compression_status(self) -> dict[str, dict[str, Any]]:
        """Per codec, this node's compressed broadcasts, all-gathers and all-reduces: ops, bytes (sent
        and received) uncoded and on the wire, their ratio, chunks sent raw, seconds of coding (any
        thread may ask)."""
        with self._compression_lock:
            return {name: {**row, "codec_s": round(row["codec_s"], 6),
                           "ratio": round(row["wire_bytes"] / row["raw_bytes"], 4) if row["raw_bytes"] else None}
                    for name, row in sorted(self._compression.items())}

    def allgatherv(
        self, nodes: tuple[int, ...], inp: torch.Tensor, out: torch.Tensor, sizes: list[int], timeout: float,
        program: Chosen | None = None, codec: Codec | None = None, dtype: str | None = None,
    ) -> None:
        """Every node's ``inp`` bytes, in node order, into everyone's ``out`` (pipelined ring);
        ``program``: the released all-gather program instead (every node then gives one size);
        ``codec``: the compressed ring instead, on the bytes read as ``dtype`` elements."""
        nodes, me = self._check_nodes("allgatherv", nodes)
        self._check_tensor("allgatherv", inp, uint8=True)
        self._check_tensor("allgatherv", out, uint8=True)
        sizes = [int(s) for s in sizes]
        src, dst = memory_view(inp), memory_view(out)
        check_allgatherv_sizes("tcp", nodes, me, sizes, len(src), len(dst))
        if program is not None and len(set(sizes)) != 1:
            raise LaneError(f"tcp allgatherv: algorithm {program.name!r} needs one size from every node, "
                            f"got sizes {sizes}")
        if len(nodes) == 1 or sum(sizes) == 0:
            self._usable("allgatherv", nodes)
            dst[:] = src
            return
        if codec is not None and program is None:
            _codec_takes("allgatherv", codec, str(dtype))
            itemsize = np.dtype(dtype).itemsize
            if any(size % itemsize for size in sizes):
                raise LaneError(f"tcp allgatherv: blocks of {sizes} bytes are not whole {dtype} elements")
            src_arr, dst_arr = inp.reshape(-1).numpy().view(dtype), out.reshape(-1).numpy().view(dtype)
            elements = [size // itemsize for size in sizes]
            self._run(f"allgatherv({sum(sizes)} bytes, codec {codec.name!r})", "allgatherv", nodes, timeout,
                      lambda ex: self._count(codec.name, compressed_ring_allgather(ex, nodes, me, src_arr, dst_arr,
                                                                                   elements, codec)))
            return
        if program is not None:
            _program_codec("allgatherv", program, codec)
            deadline = time.monotonic() + timeout
            src_arr, dst_arr = inp.reshape(-1).numpy(), out.reshape(-1).numpy()
            elements = np.dtype(dtype) if codec is not None and dtype is not None else None
            coded = f", codec {codec.name!r}" if codec is not None else ""
            self._run(f"allgatherv({sum(sizes)} bytes, algorithm {program.name!r}{coded})", "allgatherv", nodes,
                      timeout, lambda ex: self._run_program(ex, "allgatherv", program, nodes, me, src_arr, dst_arr,
                                                            "sum", deadline, codec, elements))
            return
        self._run(f"allgatherv({sum(sizes)} bytes)", "allgatherv", nodes, timeout,
                  lambda ex: algorithms.ring_allgatherv(ex, nodes, me, src, dst, sizes))

    def alltoallv(
        self,
        nodes: tuple[int, ...],
        inp: torch.Tensor,
        in_sizes: list[int],
        out: torch.Tensor,
        out_sizes: list[int],
        timeout: float,
        program: Chosen | None = None,
    ) -> None:
        """Personalised exchange of byte blocks, pairwise (step s: to me + s, from me - s);
        ``program``: the released all-to-all program instead (every block then has one size)."""
        nodes, me = self._check_nodes("alltoallv", nodes)
        self._check_tensor("alltoallv", inp, uint8=True)
        self._check_tensor("alltoallv", out, uint8=True)
        in_sizes, out_sizes = [int(s) for s in in_sizes], [int(s) for s in out_sizes]
        src, dst = memory_view(inp), memory_view(out)
        check_alltoallv_sizes("tcp", nodes, in_sizes, out_sizes, len(src), len(dst))
        if len(nodes) == 1:
            self._usable("alltoallv", nodes)
            dst[:] = src
            return
        if program is not None:
            if len(set(in_sizes + out_sizes)) != 1:
                raise LaneError(f"tcp alltoallv: algorithm {program.name!r} needs one block size to and from every "
                                f"node, got in_sizes {in_sizes} and out_sizes {out_sizes}")
            if len(src) == 0:
                self._usable("alltoallv", nodes)
                return
            self._move_by_program("alltoallv", nodes, me, inp, out, timeout, program)
            return
        self._run(f"alltoallv({len(src)} bytes out, {len(dst)} in)", "alltoallv", nodes, timeout,
                  lambda ex: algorithms.pairwise_alltoallv(ex, nodes, me, src, in_sizes, dst, out_sizes))

    def alltonext(self, nodes: tuple[int, ...], inp: torch.Tensor, out: torch.Tensor, timeout: float,
                  program: Chosen) -> None:
        """AllToNext by ``program``: node ``nodes[i]``'s ``inp`` bytes into node ``nodes[i + 1]``'s
        ``out`` (the first node's ``out`` untouched, the last node's ``inp`` unused).  (Without a
        program the op runs as an ``alltoallv`` whose only blocks go to the next node.)"""
        nodes, me = self._check_nodes("alltonext", nodes)
        self._check_tensor("alltonext", inp, uint8=True)
        self._check_tensor("alltonext", out, uint8=True)
        if inp.numel() != out.numel():
            raise LaneError(f"tcp alltonext: input of {inp.numel()} bytes, output of {out.numel()}: they must be equal")
        if len(nodes) == 1 or inp.numel() == 0:
            self._usable("alltonext", nodes)
            return
        self._move_by_program("alltonext", nodes, me, inp, out, timeout, program)

    def _move_by_program(self, what: str, nodes: tuple[int, ...], me: int, inp: torch.Tensor, out: torch.Tensor,
                         timeout: float, program: Chosen) -> None:
        """A program that moves bytes (no reduction) from ``inp`` into ``out``, as one lane call."""
        deadline = time.monotonic() + timeout
        src_arr, dst_arr = inp.reshape(-1).numpy(), out.reshape(-1).numpy()
        self._run(f"{what}({inp.numel()} bytes, algorithm {program.name!r})", "alltoallv", nodes, timeout,
                  lambda ex: self._run_program(ex, what, program, nodes, me, src_arr, dst_arr, "sum", deadline))

    def send(self, dst: int, buf: torch.Tensor, timeout: float) -> None:
        """``buf``'s bytes to ``dst`` (returns once they are handed to the kernel)."""
        self._p2p("send", f"send to {dst}", dst, buf, timeout, algorithms.send_to)

    def recv(self, src: int, buf: torch.Tensor, timeout: float) -> None:
        """Exactly ``buf``'s size in bytes from ``src``, straight into ``buf``."""
        self._p2p("recv", f"recv from {src}", src, buf, timeout, algorithms.recv_from)

    def _p2p(self, primitive: str, what: str, peer: int, buf: torch.Tensor, timeout: float,
             move: Callable[[Transport, int, memoryview], None]) -> None:
        """One direct transfer with ``peer``; ``move`` is the algorithm (send_to or recv_from)."""
        nodes = self._check_nodes(what, pair_nodes("tcp", what, self.node_rank, peer))[0]
        self._check_tensor(primitive, buf)
        view = memory_view(buf)
        if len(view) == 0:
            self._usable(what, nodes)
            return
        self._run(f"{what} ({len(view)} bytes)", "p2p", nodes, timeout, lambda ex: move(ex, peer, view))

    def barrier(self, nodes: tuple[int, ...], timeout: float) -> None:
        """Return once every node of ``nodes`` has entered (dissemination: log2 rounds of headers)."""
        nodes, me = self._check_nodes("barrier", nodes)
        if len(nodes) == 1:
            self._usable("barrier", nodes)
            return
        self._run("barrier", "barrier", nodes, timeout, lambda ex: algorithms.dissemination_barrier(ex, nodes, me))

    def peer_waiting(self, peer: int) -> bool:
        """True if ``peer`` has already sent this node bytes that no call has read: with nothing
        else outstanding between the two, it has entered the next call they share.  The schedule
        path runs a 2-node slot on the event loop then (its agreement will not wait); a peek, safe
        only while no call runs on this lane."""
        return self._connected and not self._closed and self._mesh.readable(peer)

    def peer_fileno(self, peer: int) -> int | None:
        """The socket of ``peer``'s stream, for an event loop to watch while a split agreement waits."""
        found = self._mesh.peers.get(peer)
        return found.sock.fileno() if found is not None and found.sock is not None else None

    def offer(self, peer: int, values: tuple[int, ...], timeout: float, payload: bytes = b"") -> None:
        """A two-node agreement's first half: send this node's values, then ``payload`` (its length
        rides with the values, so the peer reads it whatever it expected), and return at once."""
        nodes = (min(peer, self.node_rank), max(peer, self.node_rank))
        self._check_nodes("agree", nodes)
        packed = _packed((*values, len(payload)))
        self._run(f"agree({len(values)} values)", "agree", nodes, timeout,
                  lambda ex: _send_only(ex, peer, packed, payload))

    def accept(self, peer: int, values: tuple[int, ...], timeout: float) -> tuple[bool, bytes]:
        """The second half: read the peer's values and payload (sent by its ``offer``); whether its
        values are this node's, and its payload."""
        nodes = (min(peer, self.node_rank), max(peer, self.node_rank))
        self._check_nodes("agree", nodes)
        theirs = memoryview(bytearray(16 * (len(values) + 1))).cast("q")
        box: list[bytes] = []
        self._run(f"agree({len(values)} values)", "agree", nodes, timeout,
                  lambda ex: box.append(_recv_only(ex, peer, theirs)))
        same = all(theirs[2 * i] == value and theirs[2 * i + 1] == -value for i, value in enumerate(values))
        return same, box[0]

    def peer_lost(self, peer: int, why: str) -> None:
        """Thread-safe: node ``peer`` was declared dead (``why``: the fabric's verdict).  A silent
        node never closes its stream, so a call waiting on it would wait out its whole timeout: it
        fails now, naming the verdict, and later calls on that stream are refused."""
        self._mesh.lose(peer, LaneError(f"tcp lane: node {peer} is lost: {why}", "peer_died"))

    def abandon(self, peer: int, why: str) -> None:
        """A split agreement gives up (its peer never answered): the stream is out of step from now on."""
        with self._op_lock:
            self._mesh.break_peers([peer], LaneError(f"tcp lane: {why}", "timeout"))

    def agree(self, nodes: tuple[int, ...], values: tuple[int, ...], timeout: float) -> bool:
        """True if every node of ``nodes`` called this with the same ``values`` (ints), else False.

        The schedule path's check before it runs an op (``fabric/scheduled.py``): the maximum
        of each value and of its negation, by dissemination (log2 rounds), is the same on every
        node, so every node draws the same conclusion; a disagreement moves the same bytes as an
        agreement, so the streams stay in step either way."""
        nodes, me = self._check_nodes("agree", nodes)
        packed = _packed(values)
        if len(nodes) > 1:
            self._run(f"agree({len(values)} values)", "agree", nodes, timeout,
                      lambda ex: algorithms.dissemination_max(ex, nodes, me, packed))
        else:
            self._usable("agree", nodes)
        return all(packed[2 * i] == -packed[2 * i + 1] for i in range(len(values)))

    def agree_gather(self, nodes: tuple[int, ...], values: tuple[int, ...], timeout: float,
                     payload: bytes = b"") -> tuple[bool, list[bytes]]:
        """``agree`` that also gathers every node's ``payload`` (in the order of ``nodes``), in the
        same ceil(log2 N) rounds: whether every node gave the same values, and the payloads.

        The schedule path's tiny all-reduce on more than 2 nodes: the contributions ride the
        agreement, and every node combines all of them in node order (``dissemination_gather``)."""
        nodes, me = self._check_nodes("agree", nodes)
        head = gather_head(values)
        gathered = [head + payload]
        if len(nodes) > 1:
            self._run(f"agree({len(values)} values, gathered)", "agree", nodes, timeout,
                      lambda ex: gathered.__setitem__(
                          slice(None), algorithms.dissemination_gather(ex, nodes, me, head + payload, GATHER_LIMIT)))
        else:
            self._usable("agree", nodes)
        return gathered_agreement(values, gathered)

    def gather_send(self, nodes: tuple[int, ...], to: int, blocks: list[bytes], timeout: float) -> None:
        """One round's send of ``agree_gather``, for an event loop that runs its rounds one at a time
        (``algorithms.gather_rounds``); the blocks are small, so the socket takes them at once."""
        self._check_nodes("agree", nodes)
        self._run("agree (gathered: a round's send)", "agree", nodes, timeout,
                  lambda ex: (algorithms.gather_send(ex, to, blocks), ex.wait()))

    def gather_recv(self, nodes: tuple[int, ...], frm: int, count: int, timeout: float) -> list[bytes]:
        """One round's receive of ``agree_gather``: the ``count`` blocks ``frm`` sent (call it once
        ``peer_waiting(frm)``, and it does not wait)."""
        self._check_nodes("agree", nodes)
        box: list[list[bytes]] = []

        def body(ex: Exchange) -> None:
            finish = algorithms.gather_recv(ex, frm, count, GATHER_LIMIT)
            ex.wait()
            box.append(finish())

        self._run("agree (gathered: a round's receive)", "agree", nodes, timeout, body)
        return box[0]

    def close(self) -> None:
        """Close every socket; a pending call fails with LaneError, later calls are refused.  Idempotent."""
        if self._closed:
            return
        self._closed = True
        try:
            self._wake_w.send(b"x")
        except OSError:
            pass
        self._mesh.shutdown()  # a call stuck anywhere in a socket operation fails now
        if self._op_lock.acquire(timeout=10.0):
            try:
                self._mesh.close()
                self._listener.close()
                self._wake_r.close()
                self._wake_w.close()
            finally:
                self._op_lock.release()
        else:  # a call is still in progress and did not notice: leave the fds to the GC
            log.warning("tcp lane node %d: closed while a call was still running", self.node_rank)
