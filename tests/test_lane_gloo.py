"""GlooLane (and NcclLane, where GPUs allow) against NumPy: K lanes in threads of one process.

torch's ProcessGroupGloo works from threads: its waits release the GIL and
each lane clones its store connection (a TCPStore client shared by threads
blocks them behind each other's ``wait``).  The store is hosted here on
127.0.0.1 with port 0; the other nodes connect to the port it reports.
Every thread join and every lane call is bounded.
"""

from __future__ import annotations

import itertools
import threading
import time
from collections.abc import Callable, Iterator
from datetime import timedelta
from typing import Any

import numpy as np
import pytest
import torch
import torch.distributed as dist

from commd.kernels.reduce import TORCH_DTYPES, reduce_into
from commd.lanes.base import LANE_REDUCE_OPS, PRIMITIVES, LaneError
from commd.lanes.gloo import GlooLane
from commd.lanes.nccl import NcclLane, nccl_can_run, nccl_unavailable
from commd.lanes.torch_group import classify_error

JOIN_S = 30.0  # bound on one run of all nodes' threads
T = 10.0  # per-call timeout of calls that must succeed
MAX_K = 3

_NP_REDUCE = {"sum": np.add, "product": np.multiply, "min": np.minimum, "max": np.maximum,
              "band": np.bitwise_and, "bor": np.bitwise_or, "bxor": np.bitwise_xor}
_NP_BOOL = {"sum": np.logical_or, "max": np.logical_or, "bor": np.logical_or, "product": np.logical_and,
            "min": np.logical_and, "band": np.logical_and, "bxor": np.logical_xor}


# ---- harness -----------------------------------------------------------------------
def run_nodes(lanes: list[Any], fn: Callable[[Any, int], Any], join_timeout: float = JOIN_S) -> list[Any]:
    """Run ``fn(lane, node)`` on one thread per node; re-raise a thread's exception, fail on a hang."""
    results: list[Any] = [None] * len(lanes)
    errors: dict[int, BaseException] = {}

    def body(node: int) -> None:
        try:
            results[node] = fn(lanes[node], node)
        except BaseException as exc:  # re-raised below, on the test's thread
            errors[node] = exc

    threads = [threading.Thread(target=body, args=(n,), name=f"node{n}", daemon=True) for n in range(len(lanes))]
    for thread in threads:
        thread.start()
    deadline = time.monotonic() + join_timeout
    for thread in threads:
        thread.join(max(deadline - time.monotonic(), 0.0))
    if errors:
        node = min(errors)
        raise AssertionError(f"node {node} raised {errors[node]!r}") from errors[node]
    hung = [t.name for t in threads if t.is_alive()]
    if hung:
        raise AssertionError(f"{hung} still running after {join_timeout}s")
    return results


class Cluster:
    """K lanes of one backend on the module's stores, under a prefix of their own."""

    _made = itertools.count()

    def __init__(
        self, kind: str, k: int, stores: list[dist.Store], timeout: float = T, share_store: bool = False
    ) -> None:
        self.kind = kind
        prefix = f"c{next(self._made)}/{kind}/"
        stores = [stores[0]] * k if share_store else stores[:k]
        if kind == "gloo":
            self.lanes: list[Any] = [GlooLane(stores[n], n, k, "127.0.0.1", timeout, prefix) for n in range(k)]
        else:
            self.lanes = [NcclLane(stores[n], n, k, n, timeout, prefix) for n in range(k)]

    def device(self, node: int) -> torch.device:
        return torch.device("cpu") if self.kind == "gloo" else torch.device("cuda", node)

    def run(self, fn: Callable[[Any, int], Any], join_timeout: float = JOIN_S) -> list[Any]:
        return run_nodes(self.lanes, fn, join_timeout)

    def close(self) -> None:
        for lane in self.lanes:
            lane.close()


@pytest.fixture(scope="module")
def stores() -> list[dist.Store]:
    """A TCPStore hosted here (port 0, read back) and a client per other node, shared by the module.

    Shared because torch's TCPStore client now and then takes 5 s to connect on this
    kind of machine; every cluster uses a prefix of its own.
    """
    host = dist.TCPStore("127.0.0.1", 0, MAX_K, True, timedelta(seconds=30), wait_for_workers=False)
    return [host] + [dist.TCPStore("127.0.0.1", host.port, MAX_K, False, timedelta(seconds=30))
                     for _ in range(MAX_K - 1)]


@pytest.fixture
def make_cluster(stores: list[dist.Store]) -> Iterator[Callable[..., Cluster]]:
    made: list[Cluster] = []

    def make(kind: str, k: int, **kwargs: Any) -> Cluster:
        if kind == "nccl":
            reason = nccl_unavailable()
            if reason is not None:
                pytest.skip(f"NCCL lane: {reason}")
            if torch.cuda.device_count() < k:
                pytest.skip(f"NCCL lane: {k} nodes need {k} GPUs, this machine has {torch.cuda.device_count()}")
        cluster = Cluster(kind, k, stores, **kwargs)
        made.append(cluster)
        return cluster

    yield make
    for cluster in made:
        cluster.close()


@pytest.fixture(params=["gloo", "nccl"])
def backend(request: pytest.FixtureRequest) -> str:
    return request.param


def node_input(dtype: str, node: int, n: int, salt: int = 0) -> np.ndarray:
    """Node ``node``'s data for a case, reproducible anywhere; small values keep products in range."""
    rng = np.random.default_rng(7919 * node + salt)
    if dtype == "bool":
        return rng.random(n) < 0.5
    if dtype.startswith("complex"):
        return (rng.uniform(-2, 2, n) + 1j * rng.uniform(-2, 2, n)).astype(dtype)
    if dtype in ("float16", "bfloat16", "float32", "float64"):
        return rng.uniform(-2, 2, n).astype("float32" if dtype == "bfloat16" else dtype)
    info = np.iinfo(dtype)
    return rng.integers(max(info.min, -100), min(info.max, 100), n, endpoint=True).astype(dtype)


def as_tensor(array: np.ndarray, dtype: str, device: torch.device) -> torch.Tensor:
    return torch.from_numpy(array.copy()).to(TORCH_DTYPES[dtype]).to(device)


def numpy_reduce(dtype: str, op: str, inputs: list[np.ndarray]) -> np.ndarray:
    """Node-order reduction; float16/bfloat16 are compared in float32 with a loose tolerance."""
    fn = _NP_BOOL[op] if dtype == "bool" else _NP_REDUCE[op]
    acc = inputs[0].copy()
    for other in inputs[1:]:
        acc = fn(acc, other).astype(acc.dtype)
    return acc


def assert_reduced(dtype: str, op: str, got: torch.Tensor, want: np.ndarray, what: str) -> None:
    values = got.cpu().float().numpy() if dtype in ("float16", "bfloat16") else got.cpu().numpy()
    if dtype in ("float16", "bfloat16"):
        np.testing.assert_allclose(values, want, rtol=3e-2, atol=3e-2, err_msg=what)
    elif dtype.startswith(("float", "complex")) and op in ("sum", "product"):
        np.testing.assert_allclose(values, want, rtol=1e-5, atol=1e-5, err_msg=what)
    else:
        np.testing.assert_array_equal(values, want, err_msg=what)


def same_bits(tensors: list[torch.Tensor]) -> bool:
    first = tensors[0].cpu().contiguous().view(torch.uint8)
    return all(torch.equal(first, t.cpu().contiguous().view(torch.uint8)) for t in tensors[1:])


def byte_pattern(node: int, n: int) -> torch.Tensor:
    return torch.from_numpy(((np.arange(n) * 7 + node * 31) % 251).astype(np.uint8))


# ---- primitives vs NumPy -------------------------------------------------------------
ALLREDUCE_CASES = [
    *[("float32", op) for op in ("sum", "product", "min", "max")],
    ("float64", "sum"), ("float16", "sum"), ("bfloat16", "sum"), ("bfloat16", "max"),
    ("int8", "product"), ("uint8", "sum"), ("int32", "band"), ("int32", "bor"), ("int32", "bxor"),
    ("int64", "sum"), ("int64", "min"),
    *[("bool", op) for op in sorted(LANE_REDUCE_OPS)],
    ("complex64", "sum"), ("complex128", "sum"),
]


@pytest.mark.parametrize("k", [2, 3])
def test_allreduce_matches_numpy(backend: str, k: int, make_cluster: Callable[..., Cluster]) -> None:
    cluster = make_cluster(backend, k)
    nodes = tuple(range(k))
    cases = [(d, op) for d, op in ALLREDUCE_CASES if cluster.lanes[0].can_run("allreduce", d, op, nodes) is None]
    assert len(cases) >= 12
    n = 1237

    def work(lane: Any, node: int) -> list[torch.Tensor]:
        out = []
        for salt, (dtype, op) in enumerate(cases):
            buf = as_tensor(node_input(dtype, node, n, salt), dtype, cluster.device(node))
            lane.allreduce(nodes, buf, op, T)
            out.append(buf)
        big = torch.full((1 << 20,), float(node + 1), device=cluster.device(node))  # several ring chunks
        lane.allreduce(nodes, big, "sum", T)
        out.append(big)
        return out

    results = cluster.run(work)
    for i, (dtype, op) in enumerate(cases):
        want = numpy_reduce(dtype, op, [node_input(dtype, node, n, i) for node in nodes])
        assert_reduced(dtype, op, results[0][i], want, f"{dtype} {op}")
        assert same_bits([r[i] for r in results]), f"{dtype} {op}: nodes disagree bitwise"
        if dtype == "bool":  # canonical bools, not byte sums
            assert int(results[0][i].view(torch.uint8).max()) <= 1, f"bool {op} left a byte above 1"
    assert torch.equal(results[0][-1].cpu(), torch.full((1 << 20,), float(k * (k + 1) // 2)))


@pytest.mark.parametrize("k", [2, 3])
def test_broadcast_every_root_and_dtype(backend: str, k: int, make_cluster: Callable[..., Cluster]) -> None:
    cluster = make_cluster(backend, k)
    nodes = tuple(range(k))
    dtypes = ["float32", "int16", "bool", "bfloat16", "complex64", "uint8"]  # int16: Gloo only as bytes

    def work(lane: Any, node: int) -> list[torch.Tensor]:
        out = []
        for root in nodes:
            for salt, dtype in enumerate(dtypes):
                data = node_input(dtype, node, 501, salt) if node == root else np.zeros(501, node_input(dtype, 0, 1).dtype)
                buf = as_tensor(data, dtype, cluster.device(node))
                lane.broadcast(nodes, buf, root, T)
                out.append(buf)
            lane.broadcast(nodes, torch.empty(0, dtype=torch.uint8, device=cluster.device(node)), root, T)
        return out

    results = cluster.run(work)
    i = 0
    for root in nodes:
        for salt, dtype in enumerate(dtypes):
            want = as_tensor(node_input(dtype, root, 501, salt), dtype, torch.device("cpu"))
            for node in nodes:
                assert torch.equal(results[node][i].cpu(), want), f"root {root} {dtype} at node {node}"
            i += 1


def allgather_patterns(k: int) -> list[list[int]]:
    if k == 2:
        return [[5, 0], [0, 0], [3, 3], [0, 9], [1 << 16, 7]]
    return [[5, 0, 9], [0, 4, 0], [6, 6, 6], [0, 0, 0], [1 << 16, 3, 0]]


@pytest.mark.parametrize("k", [2, 3])
@pytest.mark.parametrize("small_tile", [False, True], ids=["one-round", "rounds"])
def test_allgatherv_unequal_and_zero(
    backend: str, k: int, small_tile: bool, make_cluster: Callable[..., Cluster]
) -> None:
    cluster = make_cluster(backend, k)
    nodes = tuple(range(k))
    patterns = allgather_patterns(k)

    def work(lane: Any, node: int) -> list[torch.Tensor]:
        out = []
        for sizes in patterns:
            if small_tile:  # the bounded-scratch paths: allgather (equal) or about 3 rounds (unequal)
                lane.tile_bytes = max(k, k * max(sizes) // 3)
            dst = torch.full((sum(sizes),), 255, dtype=torch.uint8, device=cluster.device(node))
            lane.allgatherv(nodes, byte_pattern(node, sizes[node]).to(cluster.device(node)), dst, sizes, T)
            out.append(dst)
        return out

    results = cluster.run(work)
    for i, sizes in enumerate(patterns):
        want = torch.cat([byte_pattern(n, s) for n, s in zip(nodes, sizes, strict=True)])
        for node in nodes:
            assert torch.equal(results[node][i].cpu(), want), f"sizes {sizes} at node {node}"


def a2a_block(src: int, dst: int, scale: int) -> torch.Tensor:
    size = ((src + 2 * dst) % 4) * scale  # zeros on the diagonal of some pairs, off it for others
    return torch.full((size,), 16 * src + dst, dtype=torch.uint8)


@pytest.mark.parametrize("k", [2, 3])
def test_alltoallv_unequal_and_zero(backend: str, k: int, make_cluster: Callable[..., Cluster]) -> None:
    cluster = make_cluster(backend, k)
    nodes = tuple(range(k))

    def work(lane: Any, node: int) -> list[torch.Tensor]:
        out = []
        for scale in (1, 50_000):
            blocks = [a2a_block(node, d, scale) for d in nodes]
            in_sizes = [b.numel() for b in blocks]
            out_sizes = [a2a_block(s, node, scale).numel() for s in nodes]
            dst = torch.full((sum(out_sizes),), 255, dtype=torch.uint8, device=cluster.device(node))
            lane.alltoallv(nodes, torch.cat(blocks).to(cluster.device(node)), in_sizes, dst, out_sizes, T)
            out.append(dst)
        return out

    results = cluster.run(work)
    for node in nodes:
        for i, scale in enumerate((1, 50_000)):
            want = torch.cat([a2a_block(s, node, scale) for s in nodes])
            assert torch.equal(results[node][i].cpu(), want), f"node {node} scale {scale}"


def test_subset_then_full_set(backend: str, make_cluster: Callable[..., Cluster]) -> None:
    """(0, 2) of 3 works while node 1 stays out, then the full set, then the subset again (cached)."""
    cluster = make_cluster(backend, 3)
    sub, full = (0, 2), (0, 1, 2)

    def work(lane: Any, node: int) -> dict[str, torch.Tensor]:
        dev = cluster.device(node)
        got: dict[str, torch.Tensor] = {}
        if node in sub:
            buf = torch.full((100,), float(node + 1), device=dev)
            lane.allreduce(sub, buf, "sum", T)
            got["sub_sum"] = buf
            gathered = torch.empty(3 + 5, dtype=torch.uint8, device=dev)
            lane.allgatherv(sub, byte_pattern(node, 3 if node == 0 else 5).to(dev), gathered, [3, 5], T)
            got["sub_gather"] = gathered
            lane.barrier(sub, T)
        else:
            alone = torch.ones(4, device=dev)
            lane.allreduce((1,), alone, "sum", T)  # single-member calls need nobody
            lane.barrier((1,), T)
        buf = torch.full((100,), float(node + 1), device=dev)
        lane.allreduce(full, buf, "max", T)
        got["full_max"] = buf
        lane.barrier(full, T)
        if node in sub:
            again = torch.full((10,), float(node), device=dev)
            lane.broadcast(sub, again, 2, T)
            got["sub_again"] = again
        return got

    results = cluster.run(work)
    for node in sub:
        assert torch.equal(results[node]["sub_sum"].cpu(), torch.full((100,), 4.0))
        assert torch.equal(results[node]["sub_gather"].cpu(), torch.cat([byte_pattern(0, 3), byte_pattern(2, 5)]))
        assert torch.equal(results[node]["sub_again"].cpu(), torch.full((10,), 2.0))
    for node in range(3):
        assert torch.equal(results[node]["full_max"].cpu(), torch.full((100,), 3.0))
    assert set(cluster.lanes[0]._groups) == {sub, full}
    assert set(cluster.lanes[1]._groups) == {full}


def test_send_recv_both_ways(backend: str, make_cluster: Callable[..., Cluster]) -> None:
    cluster = make_cluster(backend, 3)
    plan = [(0, 2, 5), (2, 0, 7), (1, 0, 1 << 20), (0, 1, 1 << 20), (0, 1, 0), (2, 1, 33)]

    def work(lane: Any, node: int) -> list[tuple[int, torch.Tensor]]:
        got = []
        for i, (src, dst, n) in enumerate(plan):
            if node == src:
                lane.send(dst, byte_pattern(src + i, n).to(cluster.device(node)), T)
            elif node == dst:
                buf = torch.zeros(n, dtype=torch.uint8, device=cluster.device(node))
                lane.recv(src, buf, T)
                got.append((i, buf))
        return got

    results = cluster.run(work)
    received = 0
    for node in range(3):
        for i, buf in results[node]:
            src, dst, n = plan[i]
            assert dst == node
            assert torch.equal(buf.cpu(), byte_pattern(src + i, n)), f"message {plan[i]}"
            received += 1
    assert received == len(plan)


# ---- capabilities --------------------------------------------------------------------
def test_can_run_answers(make_cluster: Callable[..., Cluster]) -> None:
    lane = make_cluster("gloo", 1).lanes[0]
    nodes = (0,)
    refused = {
        ("allreduce", "int16", "sum"): "int16",
        ("allreduce", "complex64", "product"): "SUM only",
        ("allreduce", "complex128", "min"): "undefined for complex",
        ("allreduce", "float32", "band"): "integer or bool",
        ("allreduce", "bfloat16", "bxor"): "integer or bool",
        ("allreduce", "float32", "avg"): "avg",
        ("allreduce", "float8", "sum"): "float8",
        ("gather", "uint8", None): "no primitive",
    }
    for (primitive, dtype, op), words in refused.items():
        reason = lane.can_run(primitive, dtype, op, nodes)
        assert reason is not None and words in reason, (primitive, dtype, op, reason)
    assert "outside" in (lane.can_run("barrier", "uint8", None, (0, 1)) or "")
    accepted = [("allreduce", "bool", "bxor"), ("allreduce", "bfloat16", "product"), ("allreduce", "float16", "min"),
                ("allreduce", "int8", "band"), ("allreduce", "uint8", "bor"), ("allreduce", "complex64", "sum")]
    accepted += [(p, "int16", None) for p in PRIMITIVES if p != "allreduce"]
    for primitive, dtype, op in accepted:
        assert lane.can_run(primitive, dtype, op, nodes) is None, (primitive, dtype, op)


def test_nccl_can_run_answers_without_a_gpu() -> None:
    nodes = (0, 1)
    assert "int16" in (nccl_can_run("allreduce", "int16", "sum", nodes, 2) or "")
    assert "bitwise" in (nccl_can_run("allreduce", "int32", "band", nodes, 2) or "")
    assert "XOR" in (nccl_can_run("allreduce", "bool", "bxor", nodes, 2) or "")
    assert "SUM only" in (nccl_can_run("allreduce", "complex64", "product", nodes, 2) or "")
    assert "integer or bool" in (nccl_can_run("allreduce", "float16", "bor", nodes, 2) or "")
    for dtype, op in [("bool", "band"), ("bool", "sum"), ("bfloat16", "sum"), ("int8", "product"),
                      ("complex128", "sum"), ("float64", "min")]:
        assert nccl_can_run("allreduce", dtype, op, nodes, 2) is None, (dtype, op)
    assert nccl_can_run("alltoallv", "uint8", None, nodes, 2) is None
    assert nccl_unavailable() is None or "CUDA" in nccl_unavailable() or "NCCL" in nccl_unavailable()


def test_gloo_refusals_are_real_and_acceptances_correct(make_cluster: Callable[..., Cluster]) -> None:
    """Every dtype x op: refused ones really fail in raw torch Gloo; accepted ones match commd's semantics."""
    cluster = make_cluster("gloo", 3)
    nodes = (0, 1, 2)
    combos = [(d, op) for d in TORCH_DTYPES for op in sorted(LANE_REDUCE_OPS)]
    n = 64

    def work(lane: Any, node: int) -> list[Any]:
        lane.barrier(nodes, T)  # creates the group for the raw calls
        group = lane._groups[nodes]
        out: list[Any] = []
        for salt, (dtype, op) in enumerate(combos):
            buf = as_tensor(node_input(dtype, node, n, salt), dtype, torch.device("cpu"))
            if lane.can_run("allreduce", dtype, op, nodes) is None:
                lane.allreduce(nodes, buf, op, T)
                out.append(buf)
                continue
            opts = dist.AllreduceOptions()
            opts.reduceOp = getattr(dist.ReduceOp, {"sum": "SUM", "product": "PRODUCT"}.get(op, op.upper()))
            try:
                group.allreduce([buf], opts).wait(timedelta(seconds=5))
                out.append("ran")
            except RuntimeError as exc:
                out.append(f"failed: {exc}")
        return out

    results = cluster.run(work, join_timeout=60)
    for i, (dtype, op) in enumerate(combos):
        got = results[0][i]
        if isinstance(got, str):
            assert all(r[i].startswith("failed") for r in results), f"Gloo runs {dtype} {op}, can_run refuses it"
            continue
        inputs = [as_tensor(node_input(dtype, node, n, i), dtype, torch.device("cpu")) for node in nodes]
        want = torch.empty_like(inputs[0])
        reduce_into(want, inputs, op)
        if dtype.startswith(("float", "bfloat", "complex")):
            torch.testing.assert_close(got, want, rtol=3e-2, atol=3e-2, msg=f"{dtype} {op}")
        else:  # byte for byte: a bool must come back as 0/1, not as a byte sum
            assert torch.equal(got.view(torch.uint8), want.view(torch.uint8)), f"{dtype} {op}: {got[:8]} != {want[:8]}"
        assert same_bits([r[i] for r in results]), f"{dtype} {op}: nodes disagree bitwise"
    refused = [c for i, c in enumerate(combos) if isinstance(results[0][i], str)]
    assert ("int16", "sum") in refused and ("complex64", "product") in refused and ("bool", "sum") not in refused


# ---- failures --------------------------------------------------------------------------
def test_timeout_when_a_node_does_not_call(make_cluster: Callable[..., Cluster]) -> None:
    cluster = make_cluster("gloo", 2)
    gave_up = threading.Event()
    gloo_deadline: list[float] = []

    def work(lane: Any, node: int) -> Any:
        lane.barrier((0, 1), T)  # the group exists: this is an op timeout, not a creation one
        if node == 1:
            assert gave_up.wait(10), "node 0 never timed out"
            # Node 0's op was started with Gloo's own timeout at its deadline and ends there (the
            # lane's contract); a call before that could still pair with it inside Gloo and succeed.
            time.sleep(max(0.0, gloo_deadline[0] + 1.0 - time.monotonic()))
            started = time.monotonic()
            with pytest.raises(LaneError) as late:  # node 0 aborted the group: no hang here either
                lane.allreduce((0, 1), torch.ones(8), "sum", 5.0)
            return late.value.code, time.monotonic() - started
        started = time.monotonic()
        gloo_deadline.append(started + 0.5)
        with pytest.raises(LaneError) as first:
            lane.allreduce((0, 1), torch.ones(8), "sum", 0.5)
        took = time.monotonic() - started
        gave_up.set()
        with pytest.raises(LaneError) as refused:
            lane.barrier((0, 1), T)
        return first.value, took, refused.value

    results = cluster.run(work)
    first, took, refused = results[0]
    assert first.code == "timeout", first
    assert 0.4 <= took < 3.0, took
    assert "allreduce" in str(first)
    assert "earlier failure" in str(refused) and str(first) in str(refused) and refused.code == "timeout"
    late_code, late_took = results[1]
    assert late_code in ("peer_died", "timeout") and late_took < 5.5


def test_timeout_while_creating_a_group(make_cluster: Callable[..., Cluster]) -> None:
    cluster = make_cluster("gloo", 2)
    lane = cluster.lanes[0]
    started = time.monotonic()
    with pytest.raises(LaneError) as info:
        lane.barrier((0, 1), 0.5)  # node 1 never comes
    assert info.value.code == "timeout", info.value
    assert time.monotonic() - started < 3.0
    assert "creating the group" in str(info.value)


def test_peer_closing_is_peer_died(make_cluster: Callable[..., Cluster]) -> None:
    cluster = make_cluster("gloo", 2)

    def work(lane: Any, node: int) -> Any:
        lane.barrier((0, 1), T)
        if node == 1:
            time.sleep(0.3)
            lane.close()  # what a daemon's death looks like from node 0: its sockets close
            return None
        started = time.monotonic()
        with pytest.raises(LaneError) as info:
            lane.allreduce((0, 1), torch.ones(8), "sum", T)
        return info.value, time.monotonic() - started

    error, took = cluster.run(work)[0]
    assert error.code == "peer_died", error
    assert took < 5.0


def test_close_fails_a_pending_call(make_cluster: Callable[..., Cluster]) -> None:
    cluster = make_cluster("gloo", 2)
    cluster.run(lambda lane, node: lane.barrier((0, 1), T))
    lane = cluster.lanes[0]
    threading.Timer(0.3, lane.close).start()
    started = time.monotonic()
    with pytest.raises(LaneError, match="closed"):
        lane.allreduce((0, 1), torch.ones(8), "sum", 3.0)  # node 1 never calls
    assert time.monotonic() - started < 1.5
    with pytest.raises(LaneError, match="closed"):
        lane.barrier((0, 1), T)


def test_bad_arguments_raise_lane_error(make_cluster: Callable[..., Cluster]) -> None:
    lane = make_cluster("gloo", 2).lanes[0]
    u8 = torch.zeros(4, dtype=torch.uint8)
    calls = [
        lambda: lane.barrier((1,), T),  # without this node
        lambda: lane.barrier((1, 0), T),  # unsorted
        lambda: lane.barrier((0, 2), T),  # outside the job
        lambda: lane.broadcast((0, 1), u8, 5, T),  # root not a member
        lambda: lane.allgatherv((0, 1), u8, torch.zeros(5, dtype=torch.uint8), [4, 2], T),
        lambda: lane.alltoallv((0, 1), u8, [1, 1], u8, [2, 2], T),
        lambda: lane.send(0, u8, T),  # to itself
        lambda: lane.allreduce((0, 1), torch.zeros(4, dtype=torch.int16), "sum", T),  # refused by can_run
        lambda: lane.allreduce((0, 1), torch.zeros(8)[::2], "sum", T),  # not contiguous
    ]
    for call in calls:
        with pytest.raises(LaneError) as info:
            call()
        assert info.value.code == "internal"
    assert lane._groups == {}  # nothing reached the network


def test_single_node_calls_need_no_peer(make_cluster: Callable[..., Cluster]) -> None:
    lane = make_cluster("gloo", 1).lanes[0]
    buf = torch.arange(5.0)
    lane.allreduce((0,), buf, "sum", T)
    lane.broadcast((0,), buf, 0, T)
    lane.barrier((0,), T)
    assert torch.equal(buf, torch.arange(5.0))
    out = torch.zeros(3, dtype=torch.uint8)
    lane.allgatherv((0,), byte_pattern(0, 3), out, [3], T)
    assert torch.equal(out, byte_pattern(0, 3))
    out.zero_()
    lane.alltoallv((0,), byte_pattern(0, 3), [3], out, [3], T)
    assert torch.equal(out, byte_pattern(0, 3))


def test_lanes_sharing_one_store_object(make_cluster: Callable[..., Cluster]) -> None:
    """Each lane clones the store, so lanes given the very same client object still meet."""
    cluster = make_cluster("gloo", 2, share_store=True)
    sums = cluster.run(lambda lane, node: (lambda b: (lane.allreduce((0, 1), b, "sum", T), b)[1])(torch.ones(3)))
    assert all(torch.equal(s, torch.full((3,), 2.0)) for s in sums)


def test_error_classification() -> None:
    assert classify_error("[pair.cc:553] Connection closed by peer [127.0.0.1]:26826") == "peer_died"
    assert classify_error("Connection reset by peer") == "peer_died"
    assert classify_error("Operation timed out!") == "timeout"
    assert classify_error("Timed out waiting 1000ms for send operation to complete") == "timeout"
    assert classify_error("wait timeout after 1000ms, keys: /x//0/1") == "timeout"
    assert classify_error("Invalid scalar type") == "internal"
