"""Coalesced ops on the commd backend: batched point-to-point and coalesced collectives.

torch batches ops two ways.  ``_coalescing_manager(group, device)`` calls the group's
``_start_coalescing`` / ``_end_coalescing`` around them (NCCL's way; torch's own
``batch_isend_irecv`` takes it only on a group whose type is exactly ``ProcessGroup``, so on
commd it sends op by op, and ``commd.batch_isend_irecv`` takes it instead).
``_coalescing_manager(group)`` collects all_reduce / all_gather_into_tensor /
reduce_scatter_tensor and hands them to the group's ``*_coalesced`` methods.  On commd a
batch leaves as one message to the daemon: the client's count of op messages shows it, so
the tests below fail if ops go one by one.  Every result is checked against a value each
rank computes, against the same ops unbatched on commd and against Gloo in the same ranks.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from datetime import timedelta
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.distributed as dist
from test_torch_backend import spawn

from commd.cli.status import format_status
from commd.client import ops
from commd.client.status import query_status
from commd.client.writebacks import PendingWrites, span
from commd.observe.metrics import DaemonCollector
from commd.protocol import schema as s

CPU = torch.device("cpu")
#: The commd op timeout of the error test's groups: a batch one rank never completes fails in this.
SHORT_TIMEOUT = timedelta(seconds=6)
#: How long past its op timeout a failure may take to reach a rank (the client's grace is 10 s).
FAILURE_GRACE_S = 10.0
#: (dtype, elements) of the k-th tensor a rank sends each peer: inline, staged (over the 4 KiB
#: inline limit) and arena-backed sizes, four dtypes.
P2P_TENSORS = [(torch.float32, 1500), (torch.int64, 3), (torch.bfloat16, 40), (torch.float64, 700)]


def _payload(src: int, dst: int, k: int) -> torch.Tensor:
    """The k-th tensor rank ``src`` sends rank ``dst``: every rank can compute it."""
    dtype, n = P2P_TENSORS[k % len(P2P_TENSORS)]
    return (torch.arange(n, dtype=torch.float64) % 97 + 1000 * src + 100 * dst + 10 * k).to(dtype)


def _init(rank: int, world: int, timeout: timedelta = timedelta(seconds=30)) -> Any:
    """The commd default group and a Gloo group over the same store (the reference)."""
    import commd  # noqa: F401 - registers the backend

    dist.init_process_group("commd", init_method="env://", rank=rank, world_size=world, timeout=timeout)
    return dist.new_group(backend="gloo")


def _messages() -> int:
    from commd.torch_backend.process_group import current_client

    return current_client().op_messages


# ---- point to point ---------------------------------------------------------
def _p2p_plan(rank: int, world: int, shape: str) -> tuple[list[tuple[Any, int, int]], int]:
    """(isend or irecv, peer, k) in the order the batch lists them, and how many float32 receives
    share one buffer.  Receives come first on every rank: ops run one at a time in list order
    would deadlock.  "pairwise": several tensors to and from every other rank; "ring": to the
    next rank, from the previous one."""
    if shape == "ring":
        nxt, prv = (rank + 1) % world, (rank - 1) % world
        recvs = [(dist.irecv, prv, k) for k in range(len(P2P_TENSORS))]
        sends = [(dist.isend, nxt, k) for k in range(len(P2P_TENSORS))]
    else:
        peers = [p for p in range(world) if p != rank]
        recvs = [(dist.irecv, p, k) for p in peers for k in range(len(P2P_TENSORS))]
        sends = [(dist.isend, p, k) for p in peers for k in range(len(P2P_TENSORS))]
    return recvs + sends, sum(1 for op, _, k in recvs if k == 0)


def _run_p2p(rank: int, world: int, shape: str, how: str, group: Any) -> tuple[dict[tuple[int, int], torch.Tensor], int]:
    """Run the plan ``how``; every received tensor by (peer, k), and the op messages this rank sent.

    The float32 receives land in slices of one buffer (receives into one storage must not wait
    for each other)."""
    plan, shared = _p2p_plan(rank, world, shape)
    n32 = P2P_TENSORS[0][1]
    flat32 = torch.full((shared * n32,), -1.0)
    received: dict[tuple[int, int], torch.Tensor] = {}
    p2p = []
    for op, peer, k in plan:
        if op is dist.isend:
            tensor = _payload(rank, peer, k)
        elif k == 0:
            index = sum(1 for key in received if key[1] == 0)
            tensor = received[(peer, k)] = flat32[index * n32:(index + 1) * n32]
        else:
            dtype, n = P2P_TENSORS[k]
            tensor = received[(peer, k)] = torch.full((n,), -1, dtype=dtype)
        p2p.append(dist.P2POp(op, tensor, peer, group=group))
    before = _messages()
    if how == "commd.batch_isend_irecv":
        import commd

        works = commd.batch_isend_irecv(p2p)
        assert len(works) == 1, f"commd.batch_isend_irecv gave {len(works)} works, want one for the batch"
    elif how == "coalescing_manager":
        with dist.distributed_c10d._coalescing_manager(group, CPU, async_ops=True) as manager:
            for op in p2p:
                peer = {"dst": op.peer} if op.op is dist.isend else {"src": op.peer}
                op.op(op.tensor, group=group, tag=op.tag, **peer)
        works = manager.works
    else:  # torch's own, on commd or on Gloo
        works = dist.batch_isend_irecv(p2p)
    for work in works:
        work.wait()
    return received, _messages() - before


def p2p_rank_main(rank: int, world: int) -> None:
    gloo = _init(rank, world)
    try:
        commd_group = dist.group.WORLD
        for shape in ("pairwise", "ring"):
            plan, _ = _p2p_plan(rank, world, shape)
            results = {how: _run_p2p(rank, world, shape, how, gloo if how == "gloo" else commd_group)
                       for how in ("commd.batch_isend_irecv", "coalescing_manager", "torch on commd", "gloo")}
            for how, (received, _) in results.items():
                for (peer, k), tensor in received.items():
                    want = _payload(peer, rank, k)
                    assert torch.equal(tensor, want), (
                        f"rank {rank}, {shape}, {how}: tensor {k} from rank {peer} is {tensor[:4].tolist()}..., "
                        f"want {want[:4].tolist()}...")
                    assert torch.equal(tensor, results["gloo"][0][(peer, k)]), f"{how} differs from Gloo"
            for how in ("commd.batch_isend_irecv", "coalescing_manager"):
                sent = results[how][1]
                assert sent == 1, f"rank {rank}, {shape}: {how} sent its {len(plan)} ops in {sent} messages, want 1"
            one_by_one = results["torch on commd"][1]
            assert one_by_one == len(plan), (
                f"rank {rank}: torch's batch_isend_irecv on commd sent {one_by_one} messages for {len(plan)} ops "
                "(it sends op by op on a Python process group; if torch now batches there, "
                "commd.batch_isend_irecv is no longer needed)")
    finally:
        dist.destroy_process_group()


@pytest.mark.timeout(200)
@pytest.mark.parametrize("world", [2, pytest.param(3, marks=pytest.mark.extended)])  # (3: make test-extended)
def test_batched_point_to_point_is_one_message_and_matches_gloo(backend_env: Path, world: int) -> None:
    spawn(p2p_rank_main, (world,), nprocs=world, timeout=150)


# ---- collectives -------------------------------------------------------------
ALL_REDUCE = [(torch.float32, 1500), (torch.float32, 7), (torch.int64, 33), (torch.float64, 900)]
GATHER = [(torch.float32, 1200), (torch.int64, 3), (torch.bfloat16, 40)]
SCATTER = [(torch.float32, 600), (torch.int64, 5), (torch.float64, 300)]


def _value(rank: int, i: int, dtype: torch.dtype, n: int) -> torch.Tensor:
    return ((torch.arange(n, dtype=torch.float64) * (i + 1)) % 13 - 6 + rank * 3).to(dtype)


def _collective_calls(rank: int, world: int, kind: str) -> tuple[list[torch.Tensor], list[Callable[[Any], None]]]:
    """Fresh outputs and one call per op of ``kind`` (each takes the group)."""
    outputs: list[torch.Tensor] = []
    calls: list[Callable[[Any], None]] = []
    if kind == "all_reduce":
        for i, (dtype, n) in enumerate(ALL_REDUCE):
            t = _value(rank, i, dtype, n)
            outputs.append(t)
            calls.append(lambda g, t=t: dist.all_reduce(t, group=g))
    elif kind == "all_gather_into_tensor":
        for i, (dtype, n) in enumerate(GATHER):
            out, x = torch.empty(world * n, dtype=dtype), _value(rank, i, dtype, n)
            outputs.append(out)
            calls.append(lambda g, out=out, x=x: dist.all_gather_into_tensor(out, x, group=g))
    else:
        for i, (dtype, n) in enumerate(SCATTER):
            out, x = torch.empty(n, dtype=dtype), _value(rank, i, dtype, world * n)
            outputs.append(out)
            calls.append(lambda g, out=out, x=x: dist.reduce_scatter_tensor(out, x, group=g))
    return outputs, calls


def _same(a: torch.Tensor, b: torch.Tensor, what: str) -> None:
    if a.dtype.is_floating_point:
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-5, msg=lambda m: f"{what}: {m}")
    else:
        assert torch.equal(a, b), f"{what}: {a[:6].tolist()}... != {b[:6].tolist()}..."


def collectives_rank_main(rank: int, world: int) -> None:
    gloo = _init(rank, world)
    try:
        commd_group = dist.group.WORLD
        for kind in ("all_reduce", "all_gather_into_tensor", "reduce_scatter_tensor"):
            want, calls = _collective_calls(rank, world, kind)
            for call in calls:
                call(gloo)
            unbatched, calls = _collective_calls(rank, world, kind)
            for call in calls:
                call(commd_group)
            ways: list[tuple[str, dict[str, Any]]] = [
                ("manager, async", {"async_ops": True}),  # torch's fast path: the group's *_coalesced
                ("manager on the device, async", {"device": CPU, "async_ops": True}),  # start/end coalescing
                ("manager on the device", {"device": CPU}),
            ]
            for how, kwargs in ways:
                outputs, calls = _collective_calls(rank, world, kind)
                before = _messages()
                with dist.distributed_c10d._coalescing_manager(commd_group, **kwargs) as manager:
                    for call in calls:
                        call(commd_group)
                if kwargs.get("async_ops"):
                    assert len(manager.works) == 1, f"{how}: {len(manager.works)} works"
                    manager.wait()
                sent = _messages() - before
                assert sent == 1, f"rank {rank}: {kind} x {len(calls)} by {how} went in {sent} messages, want 1"
                for i, (got, ref, gloo_ref) in enumerate(zip(outputs, unbatched, want, strict=True)):
                    _same(got, ref, f"rank {rank}: {kind} {i} by {how} vs unbatched commd")
                    _same(got, gloo_ref, f"rank {rank}: {kind} {i} by {how} vs Gloo")
    finally:
        dist.destroy_process_group()


@pytest.mark.timeout(200)
@pytest.mark.parametrize("world", [2, pytest.param(3, marks=pytest.mark.slow)])
def test_coalesced_collectives_are_one_message_and_match(backend_env: Path, world: int) -> None:
    spawn(collectives_rank_main, (world,), nprocs=world, timeout=150)


# ---- failures ------------------------------------------------------------------
def _batch(group: Any, ops_of_batch: Callable[[], None]) -> Any:
    """The one work of a batch run through torch's coalescing manager."""
    with dist.distributed_c10d._coalescing_manager(group, CPU, async_ops=True) as manager:
        ops_of_batch()
    return manager.works[0]


def _error_of(work: Any, api: str) -> str:
    """How ``api`` reports the batch's failure ("" if it does not)."""
    try:
        if api == "future":
            work.get_future().wait()
        else:
            work.wait()
    except Exception as exc:
        if api != "exception":
            return f"{type(exc).__name__}: {exc}"
    error = work.exception()
    return "" if error is None else f"{type(error).__name__}: {error}"


def failures_rank_main(rank: int) -> None:
    gloo = _init(rank, 2, SHORT_TIMEOUT)
    try:
        group = dist.group.WORLD
        for api in ("wait", "exception", "future"):
            # the ranks' batches disagree on every all-gather's size
            sizes = [8, 4] if rank == 0 else [4, 8]
            outs = [torch.empty(2 * n) for n in sizes]
            work = _batch(group, lambda outs=outs, sizes=sizes: [
                dist.all_gather_into_tensor(o, torch.ones(n), group=group) for o, n in zip(outs, sizes, strict=True)])
            seen = _error_of(work, api)
            assert "MismatchError" in seen, f"rank {rank}: mismatched all-gather batch through {api}: {seen!r}"
        # point to point: the float tensors disagree, the int tensors agree and still arrive
        got = torch.zeros(3, dtype=torch.int64)
        floats = torch.ones(8 if rank == 0 else 4)
        ints = torch.arange(3, dtype=torch.int64) + 10

        def p2p() -> None:
            if rank == 0:
                dist.isend(floats, 1, group=group)
                dist.isend(ints, 1, group=group)
            else:
                dist.irecv(floats, 0, group=group)
                dist.irecv(got, 0, group=group)

        work = _batch(group, p2p)
        seen = _error_of(work, "wait")
        assert "MismatchError" in seen and "does not match" in seen, f"rank {rank}: p2p mismatch: {seen!r}"
        if rank == 1:
            assert torch.equal(got, ints), f"the matching op of the failed batch: {got.tolist()}"
        # the daemon and the group still serve a good batch
        x = torch.full((5,), float(rank + 1))
        _batch(group, lambda: dist.all_reduce(x, group=group)).wait()
        assert torch.equal(x, torch.full((5,), 3.0)), x.tolist()
        # rank 1's batch holds a receive rank 0 never sends: it fails on its own, bounded
        sent = [torch.ones(4), torch.ones(4)]
        kept = [torch.zeros(4) for _ in range(3)]
        started = time.monotonic()
        work = _batch(group, lambda: [dist.isend(t, 1, group=group) for t in sent] if rank == 0
                      else [dist.irecv(t, 0, group=group) for t in kept])
        seen = _error_of(work, "wait")
        took = time.monotonic() - started
        if rank == 0:
            assert seen == "", f"rank 0's complete batch failed: {seen}"
        else:
            assert "CommTimeoutError" in seen and "never posted" in seen, f"rank 1's short batch: {seen!r}"
            assert took < SHORT_TIMEOUT.total_seconds() + FAILURE_GRACE_S, f"the failure took {took:.1f}s"
            assert all(torch.equal(t, torch.ones(4)) for t in kept[:2]), "the matched receives of the batch"
        dist.barrier(group=gloo)  # rank 0 leaving earlier would fail rank 1's receive as a departure instead
    finally:
        dist.destroy_process_group()


@pytest.mark.timeout(200)
@pytest.mark.extended
def test_mismatched_batches_fail_on_every_rank_through_every_api(backend_env: Path) -> None:
    spawn(failures_rank_main, (), nprocs=2, timeout=150)


# ---- the client's batches ------------------------------------------------------------
def test_a_batch_past_one_messages_limits_is_split(daemon: Any, connect: Callable[..., Any]) -> None:
    """More ops than one message may hold, or more bytes: the batch leaves in as few messages as fit,
    every op runs, and the daemon counts what it received as batches."""
    client = connect(0, 1)
    count = s.MAX_BATCH_OPS + 100
    tensors = [torch.full((1,), float(i)) for i in range(count)]
    before = client.op_messages
    client.hold("world")
    for t in tensors:
        ops.all_reduce(client, t, group="world")
    handles = client.release("world")
    assert client.op_messages - before == 2, f"{count} ops went in {client.op_messages - before} messages, want 2"
    assert len(handles) == count
    for h in handles:
        h.wait(30)
    assert [t.item() for t in tensors] == [float(i) for i in range(count)]

    big = [torch.full((s.INLINE_MAX_BYTES // 4,), float(i)) for i in range(300)]  # 300 inline tensors of 4 KiB
    before = client.op_messages
    client.hold("world")
    handles = [ops.broadcast(client, t, 0, group="world") for t in big]
    client.release("world")
    assert client.op_messages - before == 2, f"1.2 MiB of inline ops went in {client.op_messages - before} messages"
    for h in handles:
        h.wait(30)
    status = query_status(daemon.paths)
    assert status["op_batches"] == {"batches": 4, "ops": count + 300}, status["op_batches"]
    # ... as `commd status` and the Prometheus metrics show them (both read the status document)
    assert f"op batches (ops submitted together): 4 holding {count + 300:,} ops" in format_status(status)
    families = {m.name: m for m in DaemonCollector(lambda: {"status": status, "by_op": {}, "error_replies": {},
                                                            "limits_hit": {}}).collect()}
    assert [x.value for x in families["commd_op_batches"].samples if x.name.endswith("_total")] == [4]
    assert [x.value for x in families["commd_batched_ops"].samples if x.name.endswith("_total")] == [count + 300]


def test_waiting_on_a_held_op_sends_the_batch_so_far(daemon: Any, connect: Callable[..., Any]) -> None:
    """Nothing a rank waits on stays held: a wait inside a batch sends what it holds, and the
    batch's end sends only what came after."""
    client = connect(0, 1)
    x, y = torch.ones(3), torch.ones(3)
    before = client.op_messages
    client.hold("world")
    first = ops.all_reduce(client, x, group="world")
    first.wait(10)  # would hang until the op timeout if the held op were not sent
    assert client.op_messages - before == 1
    second = ops.all_reduce(client, y, group="world")
    assert client.release("world") == [first, second]
    second.wait(10)
    assert client.op_messages - before == 2


class _Op:
    """A stand-in for an op handle: completed or not."""

    def __init__(self, done: bool = False) -> None:
        self.done = done

    def is_completed(self) -> bool:
        return self.done


def test_pending_writes_wait_only_where_bytes_overlap() -> None:
    """Receives into slices of one buffer do not wait for each other; an overlapping read does;
    moving a whole storage waits for every write into it."""
    buffer = torch.zeros(100)
    writes = PendingWrites()
    low, high = _Op(), _Op()
    writes.note(span(buffer[:50]), low)
    writes.note(span(buffer[50:]), high)
    assert writes.writers(buffer[10:20]) == [low]
    assert writes.writers(buffer[49:51]) == [low, high]
    assert writes.writers(buffer[60:]) == [high]
    assert writes.writers(buffer[::2]) == [low, high]  # strided: every byte from first to last element
    assert writes.writers(buffer[60:], whole_storage=True) == [low, high]
    assert writes.writers(torch.zeros(100)) == []  # another storage
    low.done = True
    assert writes.writers(buffer) == [high]
    high.done = True
    assert writes.writers(buffer) == [] and not writes


# ---- across nodes ------------------------------------------------------------------
def batch_across_nodes(ctx: Any) -> dict[str, Any]:
    """One batch per rank: two all-reduces and a send to and a receive from every other rank
    (receives first), on a job whose ranks sit on two nodes."""
    client = ctx.connect()
    rank, world = ctx.rank, ctx.world_size
    floats = torch.full((300,), float(rank + 1))
    ints = torch.arange(5, dtype=torch.int64) * (rank + 1)
    peers = [p for p in range(world) if p != rank]
    got = {p: torch.zeros(70, dtype=torch.float64) for p in peers}
    before = client.op_messages
    client.hold("world")
    ops.all_reduce(client, floats)
    for p in peers:
        ops.recv(client, got[p], p)
    ops.all_reduce(client, ints)
    for p in peers:
        ops.send(client, torch.full((70,), 100.0 * rank + p, dtype=torch.float64), p)
    handles = client.release("world")
    sent = client.op_messages - before
    for handle in handles:
        handle.wait(60)
    total = sum(range(1, world + 1))
    assert torch.equal(floats, torch.full((300,), float(total))), floats[:4]
    assert torch.equal(ints, torch.arange(5, dtype=torch.int64) * total), ints
    for p in peers:
        assert torch.equal(got[p], torch.full((70,), 100.0 * p + rank, dtype=torch.float64)), (p, got[p][:4])
    client.close()
    return {"ops": len(handles), "messages": sent}


@pytest.mark.extended  # 2 daemons, ~20 s: make test-extended
@pytest.mark.timeout(240)
def test_a_batch_across_nodes_runs_in_one_message(cluster: Any) -> None:
    c = cluster(2, 2)
    results = c.join(c.start_workers(batch_across_nodes), timeout=180)
    assert results == {r: {"ops": 2 + 2 * 3, "messages": 1} for r in range(4)}, results
    assert sum(c.status(i)["op_batches"]["batches"] for i in range(2)) == 4
