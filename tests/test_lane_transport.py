"""The lanes' Transport seam: the tcp lane's algorithms run over an in-memory fake transport.

The fake (threads and queues, no sockets) keeps only the contract written in
``commd.lanes.base.Transport``: FIFO per peer and direction, ``done`` called
from inside ``wait`` and free to post more, TransportError on a deadline.  If
the algorithms needed anything of the tcp transport beyond that contract,
these tests could not pass.  Results are checked against NumPy references.
"""

from __future__ import annotations

import collections
import concurrent.futures
import queue
import socket
import time
from collections.abc import Callable, Sequence
from typing import Any

import numpy as np
import pytest
import torch

from commd.lanes.base import Done, Transport, TransportError, memory_view
from commd.lanes.tcp import Exchange, Mesh
from commd.lanes.tcp.algorithms import (
    chain_broadcast,
    direct_allreduce,
    direct_broadcast,
    dissemination_barrier,
    dissemination_gather,
    pairwise_alltoallv,
    recv_from,
    ring_allgatherv,
    ring_allreduce,
    send_to,
)

JOIN_S = 30.0  # bound on every node thread
WAIT_S = 10.0  # the fake transport's deadline per wait


class FakeTransport:
    """One node's end of an in-memory network: sends are copied into the receiver's inbox at once."""

    def __init__(self, inboxes: list[queue.Queue], me: int, chunk_bytes: int, wait_s: float = WAIT_S) -> None:
        self.chunk_bytes = chunk_bytes
        self._inboxes = inboxes
        self._me = me
        self._wait_s = wait_s
        self._sends: collections.deque[tuple[int, memoryview, Done | None]] = collections.deque()
        self._recvs = {p: collections.deque() for p in range(len(inboxes))}
        self._arrived: dict[int, collections.deque[bytes]] = {p: collections.deque() for p in range(len(inboxes))}
        self.posted = 0  # transfers posted, including by completions

    def post_send(self, peer: int, view: memoryview, done: Done | None = None) -> None:
        self.posted += 1
        self._sends.append((peer, view, done))

    def post_recv(self, peer: int, view: memoryview, done: Done | None = None) -> None:
        self.posted += 1
        self._recvs[peer].append((view, done))

    def wait(self) -> None:
        deadline = time.monotonic() + self._wait_s
        while True:
            while self._sends:
                peer, view, done = self._sends.popleft()
                self._inboxes[peer].put((self._me, bytes(view)))
                if done is not None:
                    done()
            for peer, posted in self._recvs.items():
                arrived = self._arrived[peer]
                while posted and arrived:
                    data = arrived.popleft()
                    view, done = posted.popleft()
                    if len(data) != len(view):
                        raise TransportError(peer, "internal", f"node {peer} sent {len(data)} bytes, "
                                             f"node {self._me} posted {len(view)}")
                    view[:] = data
                    if done is not None:
                        done()
            if self._sends:
                continue
            if not any(self._recvs.values()):
                return
            try:
                src, data = self._inboxes[self._me].get(timeout=max(0.0, deadline - time.monotonic()))
            except queue.Empty:
                waiting = sorted(p for p, posted in self._recvs.items() if posted)
                raise TransportError(None, "timeout", f"node {self._me} still waiting for {waiting}") from None
            self._arrived[src].append(data)


def network(n: int, chunk_bytes: int = 256, wait_s: float = WAIT_S) -> list[FakeTransport]:
    inboxes: list[queue.Queue] = [queue.Queue() for _ in range(n)]
    return [FakeTransport(inboxes, i, chunk_bytes, wait_s) for i in range(n)]


def on_nodes(fns: Sequence[Callable[[], Any]]) -> list[Any]:
    """``fns[i]`` on a thread of its own; the results, or each exception raised; fails if one hangs."""
    pool = concurrent.futures.ThreadPoolExecutor(len(fns))
    futures = [pool.submit(fn) for fn in fns]
    _, stuck = concurrent.futures.wait(futures, timeout=JOIN_S)
    pool.shutdown(wait=False)
    assert not stuck, f"node thread(s) {[futures.index(f) for f in stuck]} still running after {JOIN_S} s"
    return [f.exception() or f.result() for f in futures]


def run_ok(fns: Sequence[Callable[[], Any]]) -> list[Any]:
    results = on_nodes(fns)
    for i, result in enumerate(results):
        if isinstance(result, BaseException):
            raise AssertionError(f"node {i} raised {result!r}") from result
    return results


def test_the_fake_and_the_tcp_exchange_are_transports() -> None:
    wake_r, wake_w = socket.socketpair()
    try:
        mesh = Mesh(0, 1024, wake_r)
        assert isinstance(Exchange(mesh, "allreduce", time.monotonic() + 1, 1.0, 1024), Transport)
        mesh.close()
    finally:
        wake_r.close()
        wake_w.close()
    assert isinstance(network(1)[0], Transport)


@pytest.mark.parametrize("algorithm", [ring_allreduce, direct_allreduce])
@pytest.mark.parametrize(("dtype", "op"), [("int32", "sum"), ("int64", "max"), ("float64", "sum")])
def test_allreduce_on_three_fake_nodes_matches_numpy(algorithm: Callable[..., None], dtype: str, op: str) -> None:
    n, numel = 3, 1001  # not a multiple of n: unequal ring blocks; 256-byte chunks: many per block
    rng = np.random.default_rng(7)
    inputs = [rng.integers(-1000, 1000, numel).astype(dtype) for _ in range(n)]
    bufs = [torch.from_numpy(a.copy()) for a in inputs]
    transports = network(n)
    nodes = (0, 1, 2)
    run_ok([lambda i=i: algorithm(transports[i], nodes, i, bufs[i], op) for i in range(n)])
    expected = np.sum(inputs, axis=0) if op == "sum" else np.max(inputs, axis=0)
    for i in range(n):
        np.testing.assert_allclose(bufs[i].numpy(), expected, rtol=1e-12, err_msg=f"node {i}")
        assert torch.equal(bufs[i], bufs[0]), f"node {i} differs from node 0 (results must be bit-identical)"
    if algorithm is ring_allreduce:  # chunked: whole blocks would be 1 send + 4 receives + 3 forwards
        assert transports[0].posted > 8, transports[0].posted


@pytest.mark.parametrize("algorithm", [chain_broadcast, direct_broadcast])
@pytest.mark.parametrize("root", [0, 1, 2])
def test_broadcast_on_three_fake_nodes(algorithm: Callable[..., None], root: int) -> None:
    payload = np.arange(3000, dtype=np.uint8) * 7
    bufs = [torch.from_numpy(payload.copy() if i == root else np.zeros_like(payload)) for i in range(3)]
    transports = network(3)
    run_ok([lambda i=i: algorithm(transports[i], (0, 1, 2), i, root, memory_view(bufs[i])) for i in range(3)])
    for i in range(3):
        np.testing.assert_array_equal(bufs[i].numpy(), payload, err_msg=f"node {i}")


def test_allgatherv_and_alltoallv_on_three_fake_nodes() -> None:
    sizes = [700, 0, 1300]
    blocks = [np.full(s, 10 + i, dtype=np.uint8) for i, s in enumerate(sizes)]
    outs = [np.zeros(sum(sizes), dtype=np.uint8) for _ in range(3)]
    transports = network(3)
    run_ok([lambda i=i: ring_allgatherv(transports[i], (0, 1, 2), i, memoryview(blocks[i]), memoryview(outs[i]),
                                        sizes) for i in range(3)])
    for i in range(3):
        np.testing.assert_array_equal(outs[i], np.concatenate(blocks), err_msg=f"allgatherv node {i}")

    # matrix[s][d]: bytes node s sends node d; the byte value names the pair
    matrix = [[3, 500, 0], [260, 1, 999], [0, 17, 300]]
    inps = [np.concatenate([np.full(matrix[s][d], 16 * s + d, dtype=np.uint8) for d in range(3)]) for s in range(3)]
    outs = [np.zeros(sum(matrix[s][d] for s in range(3)), dtype=np.uint8) for d in range(3)]
    transports = network(3)
    run_ok([lambda i=i: pairwise_alltoallv(transports[i], (0, 1, 2), i, memoryview(inps[i]), matrix[i],
                                           memoryview(outs[i]), [matrix[s][i] for s in range(3)])
            for i in range(3)])
    for d in range(3):
        expected = np.concatenate([np.full(matrix[s][d], 16 * s + d, dtype=np.uint8) for s in range(3)])
        np.testing.assert_array_equal(outs[d], expected, err_msg=f"alltoallv node {d}")


def test_point_to_point_and_barrier_on_fake_nodes() -> None:
    transports = network(2)
    data = np.arange(1000, dtype=np.int32)
    got = np.zeros_like(data)
    run_ok([lambda: send_to(transports[0], 1, memoryview(data).cast("B")),
            lambda: recv_from(transports[1], 0, memoryview(got).cast("B"))])
    np.testing.assert_array_equal(got, data)

    transports = network(5)
    run_ok([lambda i=i: dissemination_barrier(transports[i], (0, 1, 2, 3, 4), i) for i in range(5)])


@pytest.mark.parametrize("n", [1, 2, 3, 5, 8, 13])
def test_the_gathered_agreement_gives_every_node_every_block_in_node_order(n: int) -> None:
    """Blocks of different lengths (empty ones too: a node off its schedule sends no payload)
    reach every node, in the order of ``nodes``, in ceil(log2 n) rounds of one send each way."""
    nodes = tuple(range(n))
    blocks = [bytes([i]) * (0 if i % 3 == 1 else 7 * i + 1) for i in range(n)]
    transports = network(n)
    results = run_ok([lambda i=i: dissemination_gather(transports[i], nodes, i, blocks[i], 1 << 10)
                      for i in range(n)])
    for i, gathered in enumerate(results):
        assert gathered == blocks, f"node {i}"
    rounds = (n - 1).bit_length()
    # per round: the lengths out, the blocks out (when any) and the lengths in, the blocks in
    assert all(t.posted <= 4 * rounds for t in transports), [t.posted for t in transports]


def test_a_gathered_block_longer_than_the_limit_is_refused() -> None:
    transports = network(3, wait_s=1.0)
    results = on_nodes([lambda i=i: dissemination_gather(transports[i], (0, 1, 2), i, b"x" * (100 if i == 1 else 4), 16)
                        for i in range(3)])
    assert all(isinstance(r, TransportError) for r in results), results  # no node goes on, none hangs
    assert results[0].code == results[2].code == "protocol", results  # both received node 1's block
    assert "node 1 sent blocks of [100] bytes" in results[0].message, results


def test_a_node_that_never_comes_is_a_transport_error_not_a_hang() -> None:
    transports = network(3, wait_s=0.5)
    bufs = [torch.ones(1000, dtype=torch.float32) for _ in range(3)]
    results = on_nodes([lambda i=i: ring_allreduce(transports[i], (0, 1, 2), i, bufs[i], "sum") for i in range(2)])
    for i, result in enumerate(results):
        assert isinstance(result, TransportError), f"node {i}: {result!r}"
        assert result.code == "timeout"
