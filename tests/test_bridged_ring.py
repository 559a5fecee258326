"""Bridged exchange rings: small all-reduces of torch groups that span nodes (fabric/bridge.py).

Nodes are daemons on loopback with their own runtime dirs (tests/cluster.py); the ranks
use the torch backend on ordinary tensors.  Every result is checked against NumPy.
"""

from __future__ import annotations

import os
import time
from datetime import timedelta
from typing import Any

import numpy as np
import pytest
import torch
import torch.distributed as dist
from cluster import free_port

from commd.client.errors import CommdError, MismatchError
from commd.client.fastring import RingHandle, available
from commd.protocol import fastring as fr

pytestmark = pytest.mark.skipif(not available(), reason="exchange rings need x86-64 Linux")

OPS = {"sum": dist.ReduceOp.SUM, "avg": dist.ReduceOp.AVG, "max": dist.ReduceOp.MAX, "min": dist.ReduceOp.MIN,
       "product": dist.ReduceOp.PRODUCT, "band": dist.ReduceOp.BAND}


def _init(ctx: Any, port: int, timeout_s: float = 30.0) -> None:
    import commd  # noqa: F401 - registers the backend

    os.environ["COMMD_JOB"] = ctx.job
    dist.init_process_group("commd", init_method=f"tcp://127.0.0.1:{port}", rank=ctx.rank,
                            world_size=ctx.world_size, timeout=timedelta(seconds=timeout_s))


def _data(rank: int, count: int, dtype: np.dtype, salt: int) -> np.ndarray:
    rng = np.random.default_rng(1000 * salt + rank)
    if dtype.kind == "f":
        return rng.uniform(0.5, 1.5, count).astype(dtype)
    return rng.integers(1, 7, count).astype(dtype)


def _reference(ranks: list[int], count: int, dtype: np.dtype, op: str, salt: int) -> np.ndarray:
    """The group's all-reduce as NumPy computes it: each node's ranks first, then the nodes in order
    (the bits the fabric's tiny all-reduce and the bridge compute)."""
    parts = [_data(r, count, dtype, salt) for r in ranks]
    reduce = {"sum": np.add, "avg": np.add, "max": np.maximum, "min": np.minimum, "product": np.multiply,
              "band": np.bitwise_and}[op]
    nodes = sorted({r // 2 for r in ranks})
    per_node = []
    for node in nodes:
        mine = [p for r, p in zip(ranks, parts, strict=True) if r // 2 == node]
        acc = mine[0].copy()
        for p in mine[1:]:
            acc = reduce(acc, p)
        per_node.append(acc)
    out = per_node[0].copy()
    for p in per_node[1:]:
        out = reduce(out, p)
    if op == "avg":
        out = (out / len(ranks)).astype(dtype)
    return out


CASES = [("float32", "sum", 1), ("float32", "avg", 1000), ("float64", "max", 300), ("int64", "sum", 5),
         ("int32", "band", 64), ("float64", "product", 7), ("float32", "sum", fr.SLOT_BYTES // 4),
         ("float32", "min", fr.SLOT_BYTES // 4 + 1), ("float32", "sum", 100_000),
         ("int32", "max", fr.BRIDGED_MAX_BYTES // 4), ("float64", "max", fr.BRIDGED_MAX_BYTES // 8 + 1)]


def _ring_takes(bridge: str, ranks: list[int], nbytes: int, nodes: int = 2, per_node: int = 2) -> bool:
    """Whether a group's bridged ring takes an all-reduce of ``nbytes``: one entry when the daemons
    bridge; when the ranks do, a large slot sized by the group's most crowded node (``per_node``
    ranks of the job on each)."""
    if bridge == "daemon":
        return nbytes <= fr.SLOT_BYTES
    crowd = max(sum(r // per_node == node for r in ranks) for node in range(nodes))
    return nbytes <= fr.bridged_max_bytes(fr.SLOT_BYTES, fr.bridged_large_bytes(crowd, nodes))


def bridged_ops(ctx: Any, port: int, bridge: str, dies: int) -> str:
    """Every case on the world (2 nodes x 2 ranks) and on subgroups, in flight together and between
    daemon collectives; each result equal to NumPy's.  Then ranks that disagree, then rank ``dies``
    dies (one fabric start for all three).  ``bridge``: who bridges the rings (COMMD_RING_BRIDGE)."""
    os.environ["COMMD_RING_BRIDGE"] = bridge
    _init(ctx, port, timeout_s=60.0)
    rank, world = ctx.rank, ctx.world_size
    groups = {"world": (None, list(range(world)))}
    for ranks in ([0, 2], [1, 2, 3], [0, 3]):  # one rank per node; 1 + 2; every group spans both nodes
        group = dist.new_group(ranks)
        if rank in ranks:
            groups[str(ranks)] = (group, ranks)
    for name, (group, ranks) in groups.items():
        pending = []
        for salt, (dtype_name, op, count) in enumerate(CASES * 3):
            dtype = np.dtype(dtype_name)
            x = torch.from_numpy(_data(rank, count, dtype, salt).copy())
            work = dist.all_reduce(x, op=OPS[op], group=group, async_op=True)
            bridged = _ring_takes(bridge, ranks, count * dtype.itemsize)
            assert isinstance(work.handles[0], RingHandle) == bridged, (name, dtype_name, op, count)
            pending.append((work, x, _reference(ranks, count, dtype, op, salt), (dtype_name, op, count)))
            if salt % 5 == 4:  # a daemon collective between ring ops: program order on both paths
                y = torch.full((3,), float(rank))
                dist.broadcast(y, src=ranks[1], group=group)
                assert y.tolist() == [float(ranks[1])] * 3, name
        for work, x, want, what in pending:
            work.wait()
            got = x.numpy()
            if want.dtype.kind == "f":
                assert np.allclose(got, want, rtol=1e-6), (name, what, got[:4], want[:4])
            else:
                assert np.array_equal(got, want), (name, what, got[:4], want[:4])
        # every rank of a node got the same bits; and a non-contiguous tensor
        z = torch.arange(12, dtype=torch.float32).reshape(3, 4).t() * (rank + 1)
        dist.all_reduce(z, group=group)
        assert torch.equal(z, torch.arange(12, dtype=torch.float32).reshape(3, 4).t() * sum(r + 1 for r in ranks))
    ctx.event("disagreements", disagreements(rank))
    ctx.command()  # the test has read the daemons' status
    return dies_mid_ring(ctx, dies)


#: (who bridges, the rank that dies): rank 2 is node 1's first rank, which bridges its ring there
#: (its group ranks' ring, for every group it is in) when the ranks bridge.  ``make test`` runs the
#: default (the daemons' bridge); ``make test-extended`` the ranks' bridge, with either rank dying.
BRIDGES = [("daemon", 3), pytest.param("rank", 3, marks=pytest.mark.extended),
           pytest.param("rank", 2, marks=pytest.mark.extended)]


@pytest.mark.parametrize(("bridge", "dies"), BRIDGES)
def test_bridged_all_reduces_match_numpy_disagreements_and_deaths_fail_every_rank(cluster: Any, bridge: str,
                                                                                  dies: int) -> None:
    c = cluster(2, 2, op_timeout=60.0)
    workers = c.start_workers(bridged_ops, free_port(), bridge, dies)
    results = {r: w.wait_event(r, "disagreements", 110) for w in workers for r in w.procs}
    for rank, out in results.items():
        assert out["count"].startswith(MismatchError.__name__) and "count" in out["count"], (rank, out)
        assert out["path"].startswith(MismatchError.__name__), (rank, out)
        assert "'count' differs" in out["future"], (rank, out)
        assert float(out["seconds"]) < 30, (rank, out)  # not the 60 s op timeout
    for i in range(2):  # the ops went through the bridges; only the disagreements failed them
        rings = c.status(i)["fabric"]["bridged_rings"]
        assert {row["host"] for row in rings.values()} == {bridge}, rings
        used = [row for row in rings.values() if row["ops"] >= 3 * 7]
        assert len(rings) == 7 and len(used) == 4, rings
        # (the ranks' departures at the end leave the rings: nothing else did)
        assert all(row["failed"] is None or row["failed"].endswith("left the job") for row in used), rings
        assert all("mismatched" in (row["failed"] or "") for row in rings.values() if row not in used), rings
    # a rank of node 1 dies between ops: every other rank's next bridged op fails, well before its timeout
    for w in workers:
        for r in w.procs:
            w.send(r, "go on")
    died: dict[int, Any] = {}
    for w in workers:  # the rank that died has no result
        died.update(w.join(110, ranks=[r for r in w.procs if r != dies]))
    for rank in sorted(set(range(4)) - {dies}):
        assert died[rank].startswith(("PeerDiedError", "CommdError")), (rank, died[rank])
        assert float(died[rank].split(" after ")[1].split("s:")[0]) < 30, (rank, died[rank])


def disagreements(rank: int) -> dict[str, str]:
    """Ranks that disagree across nodes, on the count and on the path, fail on every rank, fast."""
    out = {}
    # the count differs between the nodes: both nodes' bridges see both parts and fail alike
    g1 = dist.new_group([0, 1, 2, 3])
    started = time.monotonic()
    try:
        dist.all_reduce(torch.ones(10 if rank < 2 else 11), group=g1)
        out["count"] = "no error"
    except CommdError as exc:
        out["count"] = f"{type(exc).__name__}: {exc}"
    # the path differs: node 0 all-reduces 1 KiB (the ring), node 1 128 KiB (the daemon)
    g2 = dist.new_group([0, 1, 2, 3])
    try:
        dist.all_reduce(torch.ones(256 if rank < 2 else 32768), group=g2)
        out["path"] = "no error"
    except CommdError as exc:
        out["path"] = f"{type(exc).__name__}: {exc}"
    # through get_future() (what DDP waits on), on every rank: the nodes' counts differ
    g3 = dist.new_group([0, 1, 2, 3])
    fut = dist.all_reduce(torch.ones(20 if rank < 2 else 21), group=g3, async_op=True).get_future()
    try:
        fut.wait()
        out["future"] = "no error"
    except Exception as exc:  # torch reports a failed future as an error carrying the commd message
        out["future"] = str(exc)
    out["seconds"] = f"{time.monotonic() - started:.1f}"
    # the group still works afterwards, through the daemon, on every rank
    x = torch.full((4,), float(rank + 1))
    dist.all_reduce(x, group=g2)
    assert x.tolist() == [10.0] * 4, x
    return out


def dies_mid_ring(ctx: Any, dies: int) -> str:
    x = torch.ones(8)
    dist.all_reduce(x)
    assert x.tolist() == [4.0] * 8
    if ctx.rank == dies:
        os._exit(3)  # a rank of node 1 dies between ops
    started = time.monotonic()
    try:
        for _ in range(100):
            dist.all_reduce(x)
        return "no error"
    except CommdError as exc:
        return f"{type(exc).__name__} after {time.monotonic() - started:.1f}s: {exc}"


def relayed(ctx: Any, port: int) -> str:
    """A group of nodes 1 and 2 of a 3-node fabric: its parts go through node 0, which relays them."""
    _init(ctx, port)
    group = dist.new_group([1, 2])
    if ctx.rank in (1, 2):
        for salt in range(12):  # more than the ring's depth, in flight together
            x = torch.from_numpy(_data(ctx.rank, 100, np.dtype("float64"), salt).copy())
            work = dist.all_reduce(x, group=group, async_op=True)
            assert isinstance(work.handles[0], RingHandle)
            work.wait()
            want = _data(1, 100, np.dtype("float64"), salt) + _data(2, 100, np.dtype("float64"), salt)
            assert np.array_equal(x.numpy(), want), salt
    dist.barrier()
    return "ok"


@pytest.mark.slow  # a 3-node fabric: make test-all
def test_parts_of_a_group_without_node_0_are_relayed_by_it(cluster: Any) -> None:
    c = cluster(3, 1)
    assert c.join(c.start_workers(relayed, free_port()), timeout=110) == {0: "ok", 1: "ok", 2: "ok"}
    assert [len(c.status(i)["fabric"]["bridged_rings"]) for i in (1, 2)] == [2, 2]


# ---- the daemon's side alone (no fabric): what the bridge accepts from ranks and nodes ----------------
class _Sent(list):
    def __call__(self, part: Any) -> None:
        self.append(part)


def _bridge(node: int = 1, large: int = fr.SLOT_BYTES) -> tuple[Any, Any, _Sent]:
    """A bridged ring of group ranks [2, 3] on node 1 of a group [0, 1 | 2, 3], as the daemon makes it
    (``large``: its large slots; the daemon's bridge has one entry's, a rank's bridge more)."""
    from commd.core.placement import GroupPlacement
    from commd.memory.arena import Segment
    from commd.memory.ringbridge import RingBridge

    nlines = 3
    size = fr.region_bytes(nlines, fr.DEPTH, fr.SLOT_BYTES, fr.LARGE_DEPTH, large)
    region = Segment.create(0, "commd-ring-test", size)
    region.array[:8].view("u8")[0] = fr.MAGIC
    region.array[8:36].view("u4")[:] = (fr.VERSION, nlines, fr.DEPTH, fr.SLOT_BYTES, fr.LARGE_DEPTH, large, 1)
    placement = GroupPlacement("g", (0, 1, 2, 3), (0, 0, 1, 1), node)
    sent = _Sent()
    return RingBridge("g", region, placement, node, sent), region, sent


def _post(region: Any, line: int, k: int, values: np.ndarray, index: int, count: int | None = None,
          large: tuple[int, int] | None = None) -> None:
    """What a rank writes for ring op k (protocol/fastring.py), then its ``posted``; ``large``: (the
    ring's large slot bytes, the slot j the input goes in)."""
    words = region.array.view("i8")
    h = fr.entry_offset(3, fr.DEPTH, fr.SLOT_BYTES, k, line) // 8
    at = (h * 8 + fr.ENTRY_HEADER_BYTES if large is None
          else fr.large_slot_offset(3, fr.DEPTH, fr.SLOT_BYTES, large[0], large[1], line))
    region.array[at: at + values.nbytes] = values.view(np.uint8)
    words[h: h + 6] = (k, fr.DTYPES.index(values.dtype.name), fr.REDUCE_OPS.index("sum"),
                       values.size if count is None else count, 0 if large is None else large[1] + 1, index)
    words[(fr.CONTROL_OFFSET + line * fr.CONTROL_BYTES) // 8 + fr.POSTED] = k


def _failure(region: Any, large: int = fr.SLOT_BYTES) -> tuple[str, str]:
    """The bridge's published failure: (code, reason)."""
    line = (fr.CONTROL_OFFSET + 2 * fr.CONTROL_BYTES) // 8
    code = int(region.array.view("i8")[line + fr.ABANDONED])
    at = fr.reason_offset(3, fr.DEPTH, fr.SLOT_BYTES, large)
    length = int(region.array[at: at + 4].view("u4")[0])
    return fr.BRIDGE_ERRORS[code - 1] if code else "", bytes(region.array[at + 4: at + 4 + length]).decode()


def test_the_bridge_combines_in_node_order_and_publishes_in_order() -> None:
    from commd.protocol.fabric import RingPart

    bridge, region, sent = _bridge()
    a = [np.array([1.5, 2.0], np.float32), np.array([0.25, 4.0], np.float32)]
    other = np.array([10.0, 20.0], np.float32)  # node 0's part of op 2 comes before op 1's
    bridge.on_part(RingPart("g", 2, 8, 0, [1], 1, 0, 2, (other * 2).tobytes()))
    for k in (1, 2):
        for line in (0, 1):
            _post(region, line, k, a[line] * k, index=6 + k)
        bridge.local_ready()
    assert [p.seq for p in sent] == [1, 2] and sent[0].to == [0]
    assert np.frombuffer(sent[0].contribution, np.float32).tolist() == (a[0] + a[1]).tolist()
    posted = (fr.CONTROL_OFFSET + 2 * fr.CONTROL_BYTES) // 8 + fr.POSTED
    assert region.array.view("i8")[posted] == 0  # op 1 waits for node 0: op 2 must not be published before it
    bridge.on_part(RingPart("g", 1, 7, 0, [1], 1, 0, 2, other.tobytes()))
    assert region.array.view("i8")[posted] == 2
    for k in (1, 2):
        out = fr.entry_offset(3, fr.DEPTH, fr.SLOT_BYTES, k, 2) + fr.ENTRY_HEADER_BYTES
        want = other * k + (a[0] * k + a[1] * k)  # node 0 first, then this node's ranks reduced in order
        assert region.array[out: out + 8].view(np.float32).tolist() == want.tolist()
    assert _failure(region) == ("", "")


def test_a_large_op_is_reduced_from_the_large_slots_and_published_in_the_bridges_own() -> None:
    """A rank's bridge takes ops past one entry: inputs and result in large slot j (both j), and a
    later failure's reason never lands on a result the ranks may still be copying."""
    from commd.protocol.fabric import RingPart

    large = fr.bridged_large_bytes(2, 2)
    bridge, region, sent = _bridge(large=large)
    count = fr.bridged_max_bytes(fr.SLOT_BYTES, large) // 4
    rng = np.random.default_rng(5)
    a = [rng.uniform(0.5, 1.5, count).astype(np.float32) for _ in range(2)]
    other = rng.uniform(0.5, 1.5, count).astype(np.float32)
    for k, j in ((1, 0), (2, 1)):
        for line in (0, 1):
            _post(region, line, k, a[line] * k, index=k, large=(large, j))
        bridge.local_ready()
        assert np.array_equal(np.frombuffer(sent[-1].contribution, np.float32), a[0] * k + a[1] * k)
        bridge.on_part(RingPart("g", k, k, 0, [1], 1, 0, count, (other * k).tobytes()))
        h = fr.entry_offset(3, fr.DEPTH, fr.SLOT_BYTES, k, 2) // 8
        assert region.array.view("i8")[h + fr.WHERE] == j + 1
        out = fr.large_slot_offset(3, fr.DEPTH, fr.SLOT_BYTES, large, j, 2)
        got = region.array[out: out + 4 * count].view(np.float32)
        assert np.array_equal(got, other * k + (a[0] * k + a[1] * k)), k  # node 0 first, then ours in order
    first = region.array[fr.large_slot_offset(3, fr.DEPTH, fr.SLOT_BYTES, large, 0, 2):][: 4 * count].copy()
    _post(region, 0, 3, np.ones(count + 1, np.float32), index=3, large=(large, 0))
    _post(region, 1, 3, np.ones(count + 1, np.float32), index=3, large=(large, 0))
    bridge.local_ready()  # one element too many for the slot: failed, its reason past the data
    code, reason = _failure(region, large)
    assert code == "internal" and "do not fit" in reason, (code, reason)
    assert np.array_equal(region.array[fr.large_slot_offset(3, fr.DEPTH, fr.SLOT_BYTES, large, 0, 2):][: 4 * count],
                          first)


@pytest.mark.parametrize("case", ["local count", "node count", "short part", "bad dtype", "diverged"])
def test_the_bridge_fails_what_it_cannot_reduce(case: str) -> None:
    from commd.protocol.fabric import RingPart

    bridge, region, sent = _bridge()
    x = np.ones(4, np.float32)
    part = RingPart("g", 1, 3, 0, [1], 1, 0, 4, (x * 2).tobytes())
    if case == "diverged":  # node 0 published op 1 (collective #3) while our rank 3 sent #3 to its daemon
        words = region.array.view("i8")
        words[(fr.CONTROL_OFFSET + fr.CONTROL_BYTES) // 8 + fr.SUBMITTED] = 3
        bridge.on_part(part)
        code, reason = _failure(region)
        assert code == "diverged" and "group ranks [3]" in reason, reason
        assert sent[-1].error == "diverged" and sent[-1].to == [0]
        return
    _post(region, 0, 1, x, index=3)
    _post(region, 1, 1, x, index=3, count=5 if case == "local count" else None)
    if case == "bad dtype":
        h = fr.entry_offset(3, fr.DEPTH, fr.SLOT_BYTES, 1, 0) // 8
        for line in (0, 1):
            region.array.view("i8")[h + fr.DTYPE + line * (fr.ENTRY_HEADER_BYTES + fr.SLOT_BYTES) // 8] = 99
    bridge.local_ready()
    if case == "node count":
        part = RingPart("g", 1, 3, 0, [1], 1, 0, 5, (np.ones(5, np.float32)).tobytes())
    elif case == "short part":
        part = RingPart("g", 1, 3, 0, [1], 1, 0, 4, b"\0" * 3)
    bridge.on_part(part)
    code, reason = _failure(region)
    expected = {"local count": ("mismatch", "'count' differs: ranks [2] 4, ranks [3] 5"),
                "node count": ("mismatch", "'count' differs: ranks [0, 1] 5, ranks [2, 3] 4"),
                "short part": ("internal", "the parts of nodes [0] are not 16 bytes long"),
                "bad dtype": ("internal", "unknown dtype code 99")}[case]
    assert code == expected[0] and expected[1] in reason, (code, reason)
    posted = (fr.CONTROL_OFFSET + 2 * fr.CONTROL_BYTES) // 8 + fr.POSTED
    assert region.array.view("i8")[posted] == 0  # nothing published as a result


def gathered(ctx: Any, port: int) -> str:
    """4 nodes x 1 rank: the ranks' bridges gather the parts in 2 rounds.  Every case against NumPy
    (the nodes' parts combined in node order), many ops in flight; then node 2's rank dies."""
    os.environ["COMMD_RING_BRIDGE"] = "rank"
    _init(ctx, port, timeout_s=60.0)
    rank, world = ctx.rank, ctx.world_size
    pending = []
    for salt, (dtype_name, op, count) in enumerate(CASES * 2):
        dtype = np.dtype(dtype_name)
        x = torch.from_numpy(_data(rank, count, dtype, salt).copy())
        work = dist.all_reduce(x, op=OPS[op], async_op=True)
        bridged = _ring_takes("rank", list(range(world)), count * dtype.itemsize, nodes=4, per_node=1)
        assert isinstance(work.handles[0], RingHandle) == bridged
        parts = [_data(r, count, dtype, salt) for r in range(world)]
        want = parts[0].copy()
        reduce = {"sum": np.add, "avg": np.add, "max": np.maximum, "min": np.minimum, "product": np.multiply,
                  "band": np.bitwise_and}[op]
        for p in parts[1:]:
            want = reduce(want, p)
        if op == "avg":
            want = (want / world).astype(dtype)
        pending.append((work, x, want, (dtype_name, op, count)))
    for work, x, want, what in pending:
        work.wait()
        same = np.allclose(x.numpy(), want, rtol=1e-6) if want.dtype.kind == "f" else np.array_equal(x.numpy(), want)
        assert same, (what, x.numpy()[:4], want[:4])
    return dies_mid_ring(ctx, 2)


@pytest.mark.extended  # 4 daemons and 4 ranks: make test-extended
def test_four_nodes_gather_their_parts_in_rounds_and_a_death_fails_every_rank(cluster: Any) -> None:
    c = cluster(4, 1, op_timeout=60.0)
    workers = c.start_workers(gathered, free_port())
    died: dict[int, Any] = {}
    for w in workers:
        died.update(w.join(110, ranks=[r for r in w.procs if r != 2]))
    for rank in (0, 1, 3):
        assert died[rank].startswith("PeerDiedError"), (rank, died[rank])
        assert float(died[rank].split(" after ")[1].split("s:")[0]) < 30, (rank, died[rank])
