"""TcpLane: K lanes in threads of one process on 127.0.0.1, checked against NumPy references.

Each node's calls run in their own thread (as in the daemon's lane thread);
every join is bounded and names the node that hung.  Healthy-path tests share
one connected set of lanes per K (small ``chunk_bytes`` so that moderate sizes
already take several chunks); failure tests build their own.
"""

from __future__ import annotations

import functools
import logging
import os
import socket
import threading
import time
from collections.abc import Callable, Iterator, Sequence
from typing import Any

import numpy as np
import pytest
import torch

from commd.lanes.base import LaneError
from commd.lanes.tcp import SMALL_ALLREDUCE_BYTES, SMALL_BROADCAST_BYTES, TcpLane

SECRET = "job-secret-for-tests"
CHUNK = 16 * 1024  # several chunks per segment already just above the small threshold
OP_S = 20.0  # per-call timeout of healthy calls
JOIN_S = 40.0  # bound on every thread join
KS = (2, 3, 4)


# ---- helpers ----------------------------------------------------------------------------------


def outcomes(fns: Sequence[Callable[[], Any]], join_s: float = JOIN_S) -> list[Any]:
    """Run ``fns[i]`` in thread i; each entry is the return value or the exception raised."""
    results: list[Any] = [None] * len(fns)

    def work(i: int) -> None:
        try:
            results[i] = fns[i]()
        except BaseException as exc:  # noqa: BLE001 - handed to the test
            results[i] = exc

    threads = [threading.Thread(target=work, args=(i,), name=f"node-{i}", daemon=True)
               for i in range(len(fns))]
    for thread in threads:
        thread.start()
    deadline = time.monotonic() + join_s
    for thread in threads:
        thread.join(max(0.0, deadline - time.monotonic()))
    stuck = [i for i, thread in enumerate(threads) if thread.is_alive()]
    if stuck:
        pytest.fail(f"node thread(s) {stuck} still running after {join_s} s: a lane call hung")
    return results


def run_nodes(fns: Sequence[Callable[[], Any]], join_s: float = JOIN_S) -> list[Any]:
    """Like ``outcomes`` but re-raise the first exception, naming its node."""
    results = outcomes(fns, join_s)
    for i, result in enumerate(results):
        if isinstance(result, BaseException):
            raise AssertionError(f"node {i} raised {result!r}") from result
    return results


def each(lanes: Sequence[TcpLane], fn: Callable[[int, TcpLane], Any]) -> list[Any]:
    """``fn(i, lanes[i])`` on every node at once."""
    return run_nodes([functools.partial(fn, i, lane) for i, lane in enumerate(lanes)])


def connect_all(lanes: Sequence[TcpLane], timeout: float = 10.0) -> None:
    endpoints = [lane.endpoint for lane in lanes]
    each(lanes, lambda i, lane: lane.connect(endpoints, timeout))


def new_lanes(k: int, chunk_bytes: int = CHUNK, secret: str = SECRET) -> list[TcpLane]:
    return [TcpLane(i, k, secret, "127.0.0.1", chunk_bytes=chunk_bytes) for i in range(k)]


@pytest.fixture
def make_lanes() -> Iterator[Callable[..., list[TcpLane]]]:
    """Factory for a test's own lanes (connected unless told otherwise); all closed at teardown."""
    made: list[TcpLane] = []

    def make(k: int, chunk_bytes: int = CHUNK, connect: bool = True) -> list[TcpLane]:
        lanes = new_lanes(k, chunk_bytes)
        made.extend(lanes)
        if connect:
            connect_all(lanes)
        return lanes

    yield make
    for lane in made:
        lane.close()


@pytest.fixture(scope="module")
def shared() -> Iterator[Callable[[int], list[TcpLane]]]:
    """Connected lanes per K, reused by the healthy-path tests (rebuilt if a barrier fails)."""
    clusters: dict[int, list[TcpLane]] = {}

    def get(k: int) -> list[TcpLane]:
        lanes = clusters.get(k)
        if lanes is not None:
            nodes = tuple(range(k))
            health = outcomes([functools.partial(lane.barrier, nodes, 2.0) for lane in lanes])
            if all(r is None for r in health):
                return lanes
            for lane in lanes:
                lane.close()
        lanes = new_lanes(k)
        connect_all(lanes)
        clusters[k] = lanes
        return lanes

    yield get
    for lanes in clusters.values():
        for lane in lanes:
            lane.close()


def raw_bytes(tensor: torch.Tensor) -> bytes:
    """The tensor's memory, for bit-for-bit comparisons of any dtype."""
    return tensor.reshape(-1).clone().view(torch.int16 if tensor.dtype == torch.bfloat16 else tensor.dtype) \
        .numpy().tobytes() if tensor.numel() else b""


def random_bytes(n: int, seed: int) -> torch.Tensor:
    return torch.from_numpy(np.random.default_rng(seed).integers(0, 256, n, dtype=np.uint8))


# ---- allreduce ----------------------------------------------------------------------------------

DTYPES = ("float32", "float64", "int32", "int64", "uint8", "bool", "bfloat16", "complex64")
INTS = ("int32", "int64", "uint8")
OPS = ("sum", "product", "min", "max", "band", "bor", "bxor")
COMBOS = [
    (dtype, op)
    for dtype in DTYPES
    for op in OPS
    if not (op in ("band", "bor", "bxor") and dtype not in INTS + ("bool",))
    and not (op in ("min", "max") and dtype == "complex64")
]
#: NumPy reference of each op (on bool arrays add/multiply/minimum/maximum are or/and/and/or).
UFUNCS = {"sum": np.add, "product": np.multiply, "min": np.minimum, "max": np.maximum,
          "band": np.bitwise_and, "bor": np.bitwise_or, "bxor": np.bitwise_xor}
ELEMENT = {"float32": 4, "float64": 8, "int32": 4, "int64": 8, "uint8": 1, "bool": 1, "bfloat16": 2,
           "complex64": 8}


def make_input(dtype: str, op: str, n: int, seed: int) -> np.ndarray:
    """Values whose reductions stay in range (products near 1, exact bfloat16 values)."""
    rng = np.random.default_rng(seed)
    if dtype == "bool":
        return rng.random(n) < 0.5
    if dtype == "bfloat16":  # exactly representable, and so are their sums/products over <= 4 nodes
        if op == "product":
            return rng.choice([-2.0, -1.0, -0.5, 0.5, 1.0, 2.0], n).astype(np.float32)
        return rng.integers(-8, 9, n).astype(np.float32)
    if dtype in ("float32", "float64"):
        values = rng.uniform(0.5, 1.5, n) if op == "product" else rng.standard_normal(n)
        return values.astype(dtype)
    if dtype == "complex64":
        if op == "product":
            return (rng.uniform(0.5, 1.5, n) + 1j * rng.uniform(-0.5, 0.5, n)).astype(np.complex64)
        return (rng.standard_normal(n) + 1j * rng.standard_normal(n)).astype(np.complex64)
    info = np.iinfo(dtype)
    if op == "product":
        return rng.integers(max(info.min, -3), 4, n).astype(dtype)
    return rng.integers(info.min, info.max, n, endpoint=True, dtype=dtype)


def to_tensor(array: np.ndarray, dtype: str) -> torch.Tensor:
    tensor = torch.from_numpy(array.copy())
    return tensor.to(torch.bfloat16) if dtype == "bfloat16" else tensor


def check_allreduce(lanes: Sequence[TcpLane], nodes: tuple[int, ...], dtype: str, op: str,
                    sizes: Sequence[int], seed: int = 0) -> None:
    """Run allreduce on ``nodes`` for each size and compare every member with NumPy (and each other)."""
    inputs = {(node, n): make_input(dtype, op, n, seed + 1000 * node + n) for node in nodes for n in sizes}
    bufs = {key: to_tensor(array, dtype) for key, array in inputs.items()}

    def node_fn(i: int, lane: TcpLane) -> None:
        if i in nodes:
            for n in sizes:
                lane.allreduce(nodes, bufs[(i, n)], op, OP_S)

    each(lanes, node_fn)
    for n in sizes:
        expected = functools.reduce(UFUNCS[op], [inputs[(node, n)] for node in nodes])
        first = bufs[(nodes[0], n)]
        for node in nodes:
            got = bufs[(node, n)]
            assert raw_bytes(got) == raw_bytes(first), \
                f"{dtype} {op} n={n}: node {node} differs from node {nodes[0]} (must be bit-identical)"
            where = f"{dtype} {op} n={n} node {node}"
            if dtype == "bfloat16":
                assert torch.equal(got, torch.from_numpy(expected).to(torch.bfloat16)), where
            elif dtype in ("float32", "complex64") and op in ("sum", "product"):
                np.testing.assert_allclose(got.numpy(), expected, rtol=1e-5, atol=1e-5, err_msg=where)
            elif dtype == "float64" and op in ("sum", "product"):
                np.testing.assert_allclose(got.numpy(), expected, rtol=1e-12, atol=1e-12, err_msg=where)
            else:
                np.testing.assert_array_equal(got.numpy(), expected, err_msg=where)


def sizes_for(dtype: str, k: int) -> list[int]:
    """0, 1, 7, exactly the small threshold, just above it, and a larger size not divisible by k."""
    at = SMALL_ALLREDUCE_BYTES // ELEMENT[dtype]
    odd = 3 * at + 1
    while odd % k == 0:
        odd += 1
    return [0, 1, 7, at, at + 1, odd]


@pytest.mark.parametrize("k", KS)
@pytest.mark.parametrize(("dtype", "op"), COMBOS)
def test_allreduce_matches_numpy(shared: Callable[[int], list[TcpLane]], k: int, dtype: str, op: str) -> None:
    check_allreduce(shared(k), tuple(range(k)), dtype, op, sizes_for(dtype, k))


@pytest.mark.parametrize("k", KS)
def test_allreduce_few_mib(shared: Callable[[int], list[TcpLane]], k: int) -> None:
    n = (3 << 20) // 4 + 1  # 3 MiB of float32 and one element: uneven segments, ~200 chunks each
    check_allreduce(shared(k), tuple(range(k)), "float32", "sum", [n], seed=7)
    check_allreduce(shared(k), tuple(range(k)), "int64", "bxor", [(1 << 20) // 8 + 3], seed=8)


def test_allreduce_default_chunks_bit_identical(make_lanes: Callable[..., list[TcpLane]]) -> None:
    """Default 1 MiB chunks, 4 MiB of random float32: every node must hold exactly the same bits."""
    lanes = make_lanes(3, chunk_bytes=1 << 20)
    check_allreduce(lanes, (0, 1, 2), "float32", "sum", [(4 << 20) // 4 + 5, 1000], seed=3)


# ---- broadcast, allgatherv, alltoallv -----------------------------------------------------------


@pytest.mark.parametrize("k", KS)
def test_broadcast_every_root(shared: Callable[[int], list[TcpLane]], k: int) -> None:
    lanes, nodes = shared(k), tuple(range(k))
    sizes = [0, 1, 1000, SMALL_BROADCAST_BYTES, SMALL_BROADCAST_BYTES + 1, 200_003]  # the last: ~13 chunks
    for root in nodes:
        bufs = {(i, n): random_bytes(n, 100 * root + 10 * i + n) for i in nodes for n in sizes}
        floats = {i: torch.randn(70_001) for i in nodes}  # any dtype moves as bytes
        expected = {n: bufs[(root, n)].clone() for n in sizes}
        expected_floats = floats[root].clone()

        def node_fn(i: int, lane: TcpLane, root: int = root, bufs: dict = bufs,
                    floats: dict = floats) -> None:
            for n in sizes:
                lane.broadcast(nodes, bufs[(i, n)], root, OP_S)
            lane.broadcast(nodes, floats[i], root, OP_S)

        each(lanes, node_fn)
        for i in nodes:
            for n in sizes:
                assert torch.equal(bufs[(i, n)], expected[n]), f"root {root}, {n} bytes: node {i} differs"
            assert torch.equal(floats[i], expected_floats), f"root {root}, float32: node {i} differs"


def size_patterns(k: int) -> list[list[int]]:
    return [
        [0] * k,
        [1] * k,
        [7 * i for i in range(k)],  # node 0 contributes nothing
        [(i % 2) * 70_001 + 3 * i for i in range(k)],  # large and tiny, multi-chunk
        [100_000] + [0] * (k - 1),
    ]


@pytest.mark.parametrize("k", KS)
def test_allgatherv_unequal_sizes(shared: Callable[[int], list[TcpLane]], k: int) -> None:
    lanes, nodes = shared(k), tuple(range(k))
    for p, sizes in enumerate(size_patterns(k)):
        inputs = [random_bytes(sizes[i], 10 * p + i) for i in nodes]
        outs = [torch.full((sum(sizes),), 0xEE, dtype=torch.uint8) for _ in nodes]
        each(lanes, lambda i, lane, sizes=sizes, inputs=inputs, outs=outs:
             lane.allgatherv(nodes, inputs[i], outs[i], sizes, OP_S))
        expected = torch.cat(inputs)
        for i in nodes:
            assert torch.equal(outs[i], expected), f"sizes {sizes}: node {i} differs"


@pytest.mark.parametrize("k", KS)
def test_alltoallv_unequal_matrix(shared: Callable[[int], list[TcpLane]], k: int) -> None:
    lanes, nodes = shared(k), tuple(range(k))
    # matrix[i][j]: bytes node i sends to node j; zeros, tiny and multi-chunk blocks mixed
    matrix = [[((3 * i + 5 * j) % 4) * 25_013 + (i == j) for j in nodes] for i in nodes]
    blocks = [[random_bytes(matrix[i][j], 100 * i + j) for j in nodes] for i in nodes]
    inputs = [torch.cat(blocks[i]) for i in nodes]
    outs = [torch.zeros(sum(matrix[j][i] for j in nodes), dtype=torch.uint8) for i in nodes]
    each(lanes, lambda i, lane: lane.alltoallv(nodes, inputs[i], matrix[i], outs[i],
                                               [matrix[j][i] for j in nodes], OP_S))
    for i in nodes:
        assert torch.equal(outs[i], torch.cat([blocks[j][i] for j in nodes])), f"node {i} got wrong blocks"


# ---- point to point, barrier ----------------------------------------------------------------------


def test_send_recv_both_directions_in_order(shared: Callable[[int], list[TcpLane]]) -> None:
    lanes = shared(2)
    sizes = [0, 1, 5, 4096, 100_000, 300_001] * 6  # 36 messages each way
    to_one = [random_bytes(n, s) for s, n in enumerate(sizes)]
    to_zero = [random_bytes(n, 1000 + s) for s, n in enumerate(sizes)]
    got_one = [torch.zeros(n, dtype=torch.uint8) for n in sizes]
    got_zero = [torch.zeros(n, dtype=torch.uint8) for n in sizes]

    def node_fn(i: int, lane: TcpLane) -> None:
        peer = 1 - i
        outgoing, incoming = (to_one, got_zero) if i == 0 else (to_zero, got_one)
        if i == 0:  # a stream 0 -> 1, a stream 1 -> 0, then ping-pong
            for buf in outgoing:
                lane.send(peer, buf, OP_S)
            for buf in incoming:
                lane.recv(peer, buf, OP_S)
        else:
            for buf in incoming:
                lane.recv(peer, buf, OP_S)
            for buf in outgoing:
                lane.send(peer, buf, OP_S)
        for a, b in zip(outgoing, incoming, strict=True):
            if i == 0:
                lane.send(peer, a, OP_S)
                lane.recv(peer, b, OP_S)
            else:
                lane.recv(peer, b, OP_S)
                lane.send(peer, a, OP_S)

    each(lanes, node_fn)
    for s in range(len(sizes)):
        assert torch.equal(got_one[s], to_one[s]), f"message {s} to node 1 differs"
        assert torch.equal(got_zero[s], to_zero[s]), f"message {s} to node 0 differs"


@pytest.mark.parametrize("k", KS)
def test_barrier_waits_for_the_last_node(shared: Callable[[int], list[TcpLane]], k: int) -> None:
    lanes, nodes = shared(k), tuple(range(k))
    entered: dict[int, float] = {}

    def node_fn(i: int, lane: TcpLane) -> float:
        if i == k - 1:
            time.sleep(0.3)
        entered[i] = time.monotonic()
        lane.barrier(nodes, OP_S)
        left = time.monotonic()
        for _ in range(20):
            lane.barrier(nodes, OP_S)
        return left

    left = each(lanes, node_fn)
    for i in nodes:
        assert left[i] >= entered[k - 1], f"node {i} left the barrier before node {k - 1} entered it"


def test_node_subsets_then_full_set(shared: Callable[[int], list[TcpLane]]) -> None:
    """Nodes (0, 2) of 3 while node 1 idles, then (1, 2), then everyone, on the same lanes."""
    lanes = shared(3)
    check_allreduce(lanes, (0, 2), "float32", "sum", [7, 50_001], seed=11)
    check_allreduce(lanes, (0, 2), "int32", "max", [3, 40_000], seed=12)
    big = {i: random_bytes(150_001, 50 + i) for i in (0, 2)}
    expected_big = big[2].clone()
    gathered = {i: torch.zeros(10 + 70_000, dtype=torch.uint8) for i in (0, 2)}
    parts = {0: random_bytes(10, 1), 2: random_bytes(70_000, 2)}
    a2a_in = {0: random_bytes(30 + 40_000, 3), 2: random_bytes(5 + 9, 4)}  # 0: [own 30, to-2 40000]
    a2a_out = {0: torch.zeros(30 + 9, dtype=torch.uint8), 2: torch.zeros(40_000 + 5, dtype=torch.uint8)}
    p2p = {0: random_bytes(123_457, 5), 2: torch.zeros(123_457, dtype=torch.uint8)}

    def node_fn(i: int, lane: TcpLane) -> None:
        if i == 1:
            return
        nodes = (0, 2)
        lane.broadcast(nodes, big[i], 2, OP_S)
        lane.allgatherv(nodes, parts[i], gathered[i], [10, 70_000], OP_S)
        sizes = {0: ([30, 40_000], [30, 9]), 2: ([9, 5], [40_000, 5])}[i]
        lane.alltoallv(nodes, a2a_in[i], sizes[0], a2a_out[i], sizes[1], OP_S)
        lane.barrier(nodes, OP_S)
        if i == 0:
            lane.send(2, p2p[0], OP_S)
        else:
            lane.recv(0, p2p[2], OP_S)

    each(lanes, node_fn)
    for i in (0, 2):
        assert torch.equal(big[i], expected_big)
        assert torch.equal(gathered[i], torch.cat([parts[0], parts[2]]))
    assert torch.equal(a2a_out[0], torch.cat([a2a_in[0][:30], a2a_in[2][:9]]))
    assert torch.equal(a2a_out[2], torch.cat([a2a_in[0][30:], a2a_in[2][9:]]))
    assert torch.equal(p2p[2], p2p[0])
    check_allreduce(lanes, (1, 2), "float64", "sum", [5, 20_000], seed=13)
    check_allreduce(lanes, (0, 1, 2), "float32", "sum", [7, 50_001], seed=14)
    each(lanes, lambda i, lane: lane.barrier((0, 1, 2), OP_S))


def test_single_node_and_zero_bytes_move_nothing(shared: Callable[[int], list[TcpLane]]) -> None:
    lanes = shared(2)

    def node_fn(i: int, lane: TcpLane) -> None:
        me = (i,)
        buf = torch.arange(5, dtype=torch.float32)
        lane.allreduce(me, buf, "sum", OP_S)
        assert torch.equal(buf, torch.arange(5, dtype=torch.float32))
        lane.broadcast(me, buf, i, OP_S)
        data = random_bytes(9, i)
        out = torch.zeros(9, dtype=torch.uint8)
        lane.allgatherv(me, data, out, [9], OP_S)
        assert torch.equal(out, data)
        out.zero_()
        lane.alltoallv(me, data, [9], out, [9], OP_S)
        assert torch.equal(out, data)
        lane.barrier(me, OP_S)
        # zero bytes: no traffic, so one side alone returns at once
        empty = torch.zeros(0, dtype=torch.uint8)
        (lane.send if i == 0 else lane.recv)(1 - i, empty, 0.5)
        lane.allreduce((0, 1), torch.zeros(0), "sum", OP_S)

    each(lanes, node_fn)
    solo = TcpLane(0, 1, SECRET, "127.0.0.1")
    try:
        solo.connect([solo.endpoint], 1.0)
        buf = torch.ones(3)
        solo.allreduce((0,), buf, "max", 1.0)
        solo.barrier((0,), 1.0)
        assert torch.equal(buf, torch.ones(3))
    finally:
        solo.close()


# ---- arguments and capability ---------------------------------------------------------------------


def test_constructor_validates_arguments() -> None:
    for kwargs, words in [
        (dict(node_rank=2, nnodes=2), "node_rank"),
        (dict(node_rank=0, nnodes=0), "nnodes"),
        (dict(secret=""), "secret"),
        (dict(chunk_bytes=10), "chunk_bytes"),
        (dict(port=70_000), "port"),
        (dict(host=""), "host"),
    ]:
        args = dict(node_rank=0, nnodes=2, secret=SECRET, host="127.0.0.1") | kwargs
        with pytest.raises(ValueError, match=words):
            TcpLane(**args)
    lane = TcpLane(0, 2, SECRET, "127.0.0.1")
    try:
        host, port = lane.endpoint
        assert host == "127.0.0.1" and port > 0
        assert lane.name == "tcp"
    finally:
        lane.close()


def test_can_run_is_pure_capability() -> None:
    lane = TcpLane(0, 3, SECRET, "127.0.0.1")
    try:
        assert lane.can_run("allreduce", "bfloat16", "sum", (0, 1, 2)) is None
        assert lane.can_run("allreduce", "int8", "bxor", (1, 2)) is None  # this node need not be in it
        assert lane.can_run("broadcast", "uint8", None, (0, 2)) is None
        assert "BAND" in (lane.can_run("allreduce", "float32", "band", (0, 1)) or "")
        assert "complex" in (lane.can_run("allreduce", "complex64", "max", (0, 1)) or "")
        assert lane.can_run("allreduce", "float32", "avg", (0, 1)) is not None
        assert lane.can_run("reduce_scatter", "float32", "sum", (0, 1)) is not None
        assert lane.can_run("barrier", "uint8", None, (0, 3)) is not None
        assert lane.can_run("allreduce", "float8", "sum", (0, 1)) is not None
    finally:
        lane.close()


def test_bad_call_arguments_raise_without_breaking_the_lane(shared: Callable[[int], list[TcpLane]]) -> None:
    lanes = shared(2)
    lane = lanes[0]
    with pytest.raises(LaneError, match="contain this node"):
        lane.barrier((1,), 1.0)
    with pytest.raises(LaneError, match="sizes"):
        lane.allgatherv((0, 1), torch.zeros(3, dtype=torch.uint8), torch.zeros(5, dtype=torch.uint8),
                        [3, 3], 1.0)
    with pytest.raises(LaneError, match="root"):
        lane.broadcast((0, 1), torch.zeros(3), 5, 1.0)
    with pytest.raises(LaneError, match="BAND"):
        lane.allreduce((0, 1), torch.zeros(3), "band", 1.0)
    with pytest.raises(LaneError, match="already"):
        lane.connect([lanes[0].endpoint, lanes[1].endpoint], 1.0)
    check_allreduce(lanes, (0, 1), "float32", "sum", [10], seed=5)


# ---- connecting -----------------------------------------------------------------------------------


def test_wrong_secret_and_garbage_rejected_right_peer_connects(caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level(logging.WARNING, logger="commd.lanes.tcp")
    lanes = new_lanes(2)
    impostor = TcpLane(1, 2, "not-the-secret", "127.0.0.1")
    raw: list[socket.socket] = []
    try:
        endpoints = [lane.endpoint for lane in lanes]
        results: list[list[Any]] = []
        acceptor = threading.Thread(
            target=lambda: results.append(outcomes([lambda: lanes[0].connect(endpoints, 15.0)])), daemon=True)
        acceptor.start()
        with pytest.raises(LaneError, match="node.* 0") as info:
            impostor.connect(endpoints, 1.0)  # refused again and again until its own deadline
        assert info.value.code == "timeout"
        for payload in (os.urandom(72), b"hello", b""):  # garbage, short garbage, silence
            sock = socket.create_connection(lanes[0].endpoint, timeout=5.0)
            sock.sendall(payload)
            raw.append(sock)
        raw[1].close()
        lanes[1].connect(endpoints, 10.0)
        acceptor.join(JOIN_S)
        assert not acceptor.is_alive(), "node 0's connect hung"
        assert results == [[None]], f"node 0's connect failed: {results}"
        text = caplog.text
        assert "wrong secret" in text, text
        assert text.count("rejected a connection") >= 3, text
        check_allreduce(lanes, (0, 1), "int64", "sum", [3, 20_000], seed=2)
    finally:
        for sock in raw:
            sock.close()
        impostor.close()
        for lane in lanes:
            lane.close()


@pytest.mark.parametrize("missing", [0, 2])
def test_connect_timeout_names_missing_node(missing: int) -> None:
    lanes = new_lanes(3)
    try:
        endpoints = [lane.endpoint for lane in lanes]
        present = [lane for lane in lanes if lane.node_rank != missing]
        start = time.monotonic()
        results = outcomes([functools.partial(lane.connect, endpoints, 0.5) for lane in present])
        elapsed = time.monotonic() - start
        assert elapsed < 5.0, f"connect took {elapsed:.1f} s with a 0.5 s timeout"
        for lane, result in zip(present, results, strict=True):
            assert isinstance(result, LaneError), f"node {lane.node_rank}: {result!r}"
            assert result.code == "timeout"
            assert f"node(s) {missing} " in str(result), str(result)
        with pytest.raises(LaneError, match="connect failed"):
            present[0].barrier((0, 1, 2), 1.0)
    finally:
        for lane in lanes:
            lane.close()


# ---- failures -------------------------------------------------------------------------------------


@pytest.mark.parametrize("op", ["allreduce", "broadcast", "alltoallv"])
def test_peer_closing_mid_op_is_peer_died(make_lanes: Callable[..., list[TcpLane]], op: str) -> None:
    lanes, nodes = make_lanes(3), (0, 1, 2)
    n = 1 << 20
    bufs = [torch.randn(n // 4) for _ in nodes]
    sizes = [n // 3] * 3

    def call(i: int, lane: TcpLane, timeout: float) -> None:
        if op == "allreduce":
            lane.allreduce(nodes, bufs[i], "sum", timeout)
        elif op == "broadcast":
            lane.broadcast(nodes, bufs[i].view(torch.uint8), 2, timeout)
        else:
            lane.alltoallv(nodes, torch.zeros(n // 3 * 3, dtype=torch.uint8), sizes,
                           torch.zeros(n // 3 * 3, dtype=torch.uint8), sizes, timeout)

    def node_fn(i: int, lane: TcpLane) -> float:
        start = time.monotonic()
        if i == 2:
            time.sleep(0.3)
            lane.close()
            return 0.0
        call(i, lane, OP_S)
        return time.monotonic() - start

    results = outcomes([functools.partial(node_fn, i, lane) for i, lane in enumerate(lanes)])
    for i in (0, 1):
        error = results[i]
        assert isinstance(error, LaneError), f"node {i}: {error!r}"
        assert error.code == "peer_died", f"node {i}: {error}"
    assert any("node 2" in str(results[i]) for i in (0, 1)), [str(r) for r in results]
    for i in (0, 1):  # refused at once afterwards, naming the first failure
        again_fns = [functools.partial(call, i, lanes[i], 5.0),
                     functools.partial(lanes[i].barrier, (0, 1), 5.0)]
        for again in again_fns:
            start = time.monotonic()
            with pytest.raises(LaneError, match="earlier failure") as info:
                again()
            assert time.monotonic() - start < 0.5
            assert info.value.code == "peer_died"


def test_peer_never_calling_is_timeout(make_lanes: Callable[..., list[TcpLane]]) -> None:
    lanes, nodes = make_lanes(3), (0, 1, 2)
    bufs = [torch.ones(100) for _ in nodes]

    def node_fn(i: int, lane: TcpLane) -> float:
        start = time.monotonic()
        lane.allreduce(nodes, bufs[i], "sum", 0.5)
        return time.monotonic() - start

    start = time.monotonic()
    results = outcomes([functools.partial(node_fn, i, lanes[i]) for i in (0, 1)])
    assert time.monotonic() - start < 5.0
    for i in (0, 1):
        error = results[i]
        assert isinstance(error, LaneError) and error.code == "timeout", f"node {i}: {error!r}"
        assert "waiting for node 2 (" in str(error), str(error)
        assert f"node {1 - i} (" not in str(error), f"node {i} names a peer it had finished with: {error}"
    start = time.monotonic()
    with pytest.raises(LaneError, match="earlier failure") as info:
        lanes[0].allreduce(nodes, bufs[0], "sum", 5.0)
    assert info.value.code == "timeout" and time.monotonic() - start < 0.5
    # the late node finds its connections closed instead of waiting out its own timeout
    start = time.monotonic()
    with pytest.raises(LaneError):
        lanes[2].barrier(nodes, 10.0)
    assert time.monotonic() - start < 3.0


def test_close_interrupts_a_pending_call(make_lanes: Callable[..., list[TcpLane]]) -> None:
    lanes = make_lanes(2)
    timer = threading.Timer(0.3, lanes[0].close)
    timer.start()
    start = time.monotonic()
    try:
        results = outcomes([lambda: lanes[0].recv(1, torch.zeros(10, dtype=torch.uint8), 30.0)])
    finally:
        timer.join(10.0)
    assert isinstance(results[0], LaneError) and "closed" in str(results[0]), repr(results[0])
    assert time.monotonic() - start < 5.0
    with pytest.raises(LaneError, match="closed"):
        lanes[0].barrier((0,), 1.0)
    start = time.monotonic()
    with pytest.raises(LaneError) as info:  # the other side sees the connection go
        lanes[1].recv(0, torch.zeros(10, dtype=torch.uint8), 10.0)
    assert info.value.code == "peer_died" and time.monotonic() - start < 3.0


def test_a_peer_declared_lost_fails_a_call_blocked_on_it_at_once_naming_the_verdict(
        make_lanes: Callable[..., list[TcpLane]]) -> None:
    """A silent node never closes its stream: the fabric's verdict (peer_lost, from another thread)
    must end a call waiting on it, as a death and not at the call's timeout."""
    lanes, nodes = make_lanes(3), (0, 1, 2)
    verdict = "node 2 (n2) has not been heard from for 2s"
    timers = [threading.Timer(0.3, lanes[i].peer_lost, (2, verdict)) for i in (0, 1)]  # every node's verdict
    for timer in timers:
        timer.start()
    start = time.monotonic()
    try:  # node 2 never calls: nodes 0 and 1 wait for it
        results = outcomes([lambda i=i: lanes[i].allreduce(nodes, torch.ones(100), "sum", 30.0) for i in (0, 1)])
    finally:
        for timer in timers:
            timer.join(10.0)
    assert time.monotonic() - start < 5.0, f"a call waited for its timeout: {results}"
    for error in results:
        assert isinstance(error, LaneError) and error.code == "peer_died", repr(error)
    assert verdict in str(results[0]) or verdict in str(results[1]), results
    with pytest.raises(LaneError, match="earlier failure") as info:  # and the stream stays refused
        lanes[0].allreduce((0, 2), torch.ones(4), "sum", 5.0)
    assert info.value.code == "peer_died" and verdict in str(info.value)


def test_desynchronised_streams_are_detected(make_lanes: Callable[..., list[TcpLane]]) -> None:
    lanes = make_lanes(2)
    results = outcomes([lambda: lanes[0].send(1, torch.zeros(10, dtype=torch.uint8), 5.0),
                        lambda: lanes[1].recv(0, torch.zeros(20, dtype=torch.uint8), 5.0)])
    assert results[0] is None
    error = results[1]
    assert isinstance(error, LaneError) and error.code == "internal", repr(error)
    assert "10 bytes" in str(error) and "expects 20" in str(error), str(error)
    with pytest.raises(LaneError, match="earlier failure"):
        lanes[1].send(0, torch.zeros(1, dtype=torch.uint8), 5.0)

    lanes = make_lanes(2)  # different ops on the two ends
    results = outcomes([lambda: lanes[0].barrier((0, 1), 5.0),
                        lambda: lanes[1].recv(0, torch.zeros(8, dtype=torch.uint8), 5.0)])
    assert isinstance(results[1], LaneError) and "'barrier'" in str(results[1]), repr(results[1])
    assert isinstance(results[0], LaneError), repr(results[0])
