"""The compressed chunked-chain broadcast (commd/lanes/tcp/compressed.py), on real tcp lanes and on the
in-memory transport: every codec, every root, 2-4 nodes, against the root's data (lossless: every
bit) or torch's rounding of it (lossy: the same bits on every node); disagreements and corrupt
frames fail naming the node they came from.
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Iterator

import numpy as np
import pytest
import torch
from test_lane_tcp import OP_S, connect_all, each, new_lanes, outcomes
from test_lane_transport import network, on_nodes

from commd.codecs import CODECS, get
from commd.lanes.base import LaneError, TransportError
from commd.lanes.tcp import TcpLane
from commd.lanes.tcp.compressed import FRAME, MIN_CHUNK_BYTES, chunk_elements, compressed_chain_broadcast

TORCH_ROUNDING = {"bf16": torch.bfloat16, "bf16-cast": torch.bfloat16, "fp16": torch.float16}
#: Several chunks (256 KiB each at this size) and a short last one.
COUNT = 3 * MIN_CHUNK_BYTES // 4 + 1001


def model_like(count: int, seed: int) -> torch.Tensor:
    rng = np.random.default_rng(seed)
    values = (rng.standard_normal(count) * 0.02).astype(np.float32)
    values[::101] = rng.standard_normal(values[::101].size).astype(np.float32) * 50
    return torch.from_numpy(values)


def decoded(name: str, data: torch.Tensor) -> torch.Tensor:
    """What a receiver must hold: the root's data, or torch's rounding of it for a lossy codec."""
    kind = TORCH_ROUNDING.get(name)
    return data.clone() if kind is None else data.to(kind).to(torch.float32)


@pytest.fixture(scope="module")
def lanes() -> Iterator[Callable[[int], list[TcpLane]]]:
    made: dict[int, list[TcpLane]] = {}

    def get_lanes(k: int) -> list[TcpLane]:
        if k not in made:
            made[k] = new_lanes(k, chunk_bytes=1 << 20)
            connect_all(made[k])
        return made[k]
    yield get_lanes
    for group in made.values():
        for lane in group:
            lane.close()


def test_chunks_are_a_sixteenth_of_the_message_within_bounds() -> None:
    assert chunk_elements(100, 4) == MIN_CHUNK_BYTES // 4
    assert chunk_elements(64 << 20, 4) == (1 << 20) // 4
    assert chunk_elements(8 << 20, 4) == (512 << 10) // 4


@pytest.mark.parametrize("k", [2, 3, 4])
@pytest.mark.parametrize("name", [c.name for c in CODECS])
def test_every_node_gets_the_roots_data_or_its_rounding_from_every_root(lanes: Callable[[int], list[TcpLane]],
                                                                       k: int, name: str) -> None:
    codec, nodes = get(name), tuple(range(k))
    for root in nodes:
        original = model_like(COUNT, seed=10 * k + root)
        bufs = [original.clone() if i == root else torch.full((COUNT,), -1.0) for i in nodes]
        each(lanes(k), lambda i, lane, bufs=bufs, root=root: lane.broadcast(nodes, bufs[i], root, OP_S, codec=codec))
        want = decoded(name, original)
        for i in nodes:  # the root too: a lossy root rounds its own copy (replicas never drift)
            assert bufs[i].numpy().tobytes() == want.numpy().tobytes(), f"{name}, root {root}: node {i} differs"


def test_an_exact_root_keeps_its_values_and_incompressible_chunks_travel_raw(
        lanes: Callable[[int], list[TcpLane]]) -> None:
    nodes = (0, 1, 2)
    original = model_like(COUNT, seed=3)
    bufs = [original.clone() if i == 0 else torch.zeros(COUNT) for i in nodes]
    each(lanes(3), lambda i, lane: lane.broadcast(nodes, bufs[i], 0, OP_S, codec=get("bf16"), exact_root=True))
    assert torch.equal(bufs[0], original)
    assert all(torch.equal(bufs[i], decoded("bf16", original)) for i in (1, 2))
    noise = torch.from_numpy(np.random.default_rng(4).integers(0, 2**32, COUNT, dtype=np.uint32).view(np.float32))
    bufs = [noise.clone() if i == 0 else torch.zeros(COUNT) for i in nodes]  # random bits: LZ4 cannot shrink them
    each(lanes(3), lambda i, lane: lane.broadcast(nodes, bufs[i], 0, OP_S, codec=get("lossless")))
    assert all(bufs[i].numpy().tobytes() == noise.numpy().tobytes() for i in nodes)


@pytest.mark.parametrize("name", ["bf16", "lossless"])
def test_the_per_hop_baseline_gives_the_same_bits(lanes: Callable[[int], list[TcpLane]], name: str) -> None:
    """The benchmark's baseline (decode and code again at every hop) ends where the chain does: the
    codecs are idempotent, so each hop's coding of the decoded chunk is the root's."""
    nodes = (0, 1, 2, 3)
    original = model_like(COUNT, seed=7)
    bufs = [original.clone() if i == 0 else torch.zeros(COUNT) for i in nodes]
    each(lanes(4), lambda i, lane: lane.broadcast(nodes, bufs[i], 0, OP_S, codec=get(name), per_hop=True))
    want = decoded(name, original)
    assert all(b.numpy().tobytes() == want.numpy().tobytes() for b in bufs)


def test_a_codec_the_dtype_does_not_take_is_refused_before_anything_moves(
        lanes: Callable[[int], list[TcpLane]]) -> None:
    with pytest.raises(LaneError, match="codec 'bf16' does not take int32"):
        lanes(2)[0].broadcast((0, 1), torch.zeros(10, dtype=torch.int32), 0, OP_S, codec=get("bf16"))
    nodes = (0, 1)  # the lanes still work
    bufs = [torch.arange(5000, dtype=torch.int64) * (i + 1) for i in nodes]
    each(lanes(2), lambda i, lane: lane.broadcast(nodes, bufs[i], 1, OP_S, codec=get("lossless")))
    assert all(torch.equal(b, torch.arange(5000) * 2) for b in bufs)


def test_nodes_that_disagree_on_the_codec_fail_naming_the_node_and_the_codecs() -> None:
    lanes = new_lanes(3, chunk_bytes=1 << 20)
    try:
        connect_all(lanes)
        nodes = (0, 1, 2)
        bufs = [model_like(COUNT, i) for i in nodes]
        codecs = [get("bf16"), get("lossless"), get("lossless")]
        results = outcomes([functools.partial(lane.broadcast, nodes, bufs[i], 0, 5.0, codec=codecs[i])
                            for i, lane in enumerate(lanes)])
        assert isinstance(results[1], LaneError), results
        assert "from node 0" in str(results[1]) and "wire id 1, this node expects 3 (lossless)" in str(results[1])
        assert isinstance(results[2], LaneError), results  # its predecessor broke the chain
    finally:
        for lane in lanes:
            lane.close()


def corrupt(tp: object, frames: bool, flip: Callable[[bytearray], None]) -> None:
    """Make ``tp``'s frames (or payloads) carry ``flip``ped bytes: a broken root."""
    post = tp.post_send  # type: ignore[attr-defined]

    def post_send(peer: int, view: memoryview, done: object = None) -> None:
        data = bytearray(view)
        if (len(data) == FRAME.size) == frames:
            flip(data)
        post(peer, memoryview(data), done)
    tp.post_send = post_send  # type: ignore[attr-defined]


@pytest.mark.parametrize(("frames", "flip", "words"), [
    (True, lambda d: d.__setitem__(slice(4, 8), (10**9).to_bytes(4, "big")), "frame says 1000000000 bytes"),
    (True, lambda d: d.__setitem__(0, 9), "wire id 9"),
    (True, lambda d: d.__setitem__(1, 0x80), "flags 0x80"),
    (False, lambda d: d.__setitem__(slice(0, 16), bytes(16)), "does not decode"),
])
def test_a_corrupt_frame_or_payload_is_a_transport_error_naming_the_sender(frames: bool,
                                                                          flip: Callable[[bytearray], None],
                                                                          words: str) -> None:
    tps = network(3, wait_s=2.0)
    corrupt(tps[0], frames, flip)
    arrs = [model_like(COUNT, i).numpy() for i in range(3)]
    results = on_nodes([functools.partial(compressed_chain_broadcast, tps[i], (0, 1, 2), i, 0, arrs[i], get("bf16"))
                        for i in range(3)])
    assert isinstance(results[1], TransportError), results
    assert results[1].peer == 0 and "from node 0 is corrupt" in results[1].message, results[1].message
    assert words in results[1].message, results[1].message
    assert isinstance(results[2], TransportError)  # nothing more comes to it: the fake's deadline, never a hang


@pytest.mark.parametrize("k", [2, 3, 4])
@pytest.mark.parametrize("name", ["bf16", "lossless", "bf16-cast"])
def test_compressed_ring_allgather_gives_every_node_every_block(lanes: Callable[[int], list[TcpLane]], k: int,
                                                                name: str) -> None:
    """Blocks of different sizes (one empty, one spanning several chunks): every node's output holds
    every node's block, coded once by its owner — the owner's own copy rounded like everyone's."""
    codec, nodes = get(name), tuple(range(k))
    counts = [COUNT if i == 0 else 0 if i == 1 else 1000 * i + 1 for i in nodes]
    blocks = [model_like(c, seed=i) for i, c in enumerate(counts)]
    outs = [torch.full((sum(counts),), -1.0) for _ in nodes]
    sizes = [c * 4 for c in counts]

    def call(i: int, lane: TcpLane) -> None:
        as_bytes = [torch.from_numpy(t.numpy().view(np.uint8)) for t in (blocks[i], outs[i])]
        lane.allgatherv(nodes, as_bytes[0], as_bytes[1], sizes, OP_S, codec=codec, dtype="float32")

    each(lanes(k), call)
    want = torch.cat([decoded(name, b) for b in blocks])
    for i in nodes:
        assert outs[i].numpy().tobytes() == want.numpy().tobytes(), f"{name}: node {i} differs"
    assert all(torch.equal(blocks[i], model_like(c, seed=i)) for i, c in enumerate(counts)), "an input changed"


@pytest.mark.parametrize("k", [2, 3, 4])
@pytest.mark.parametrize(("name", "op"), [("bf16", "sum"), ("lossless", "sum"), ("bf16", "max")])
def test_compressed_ring_allreduce_is_the_same_on_every_node_and_near_the_exact_sum(
        lanes: Callable[[int], list[TcpLane]], k: int, name: str, op: str) -> None:
    """Partial results travel coded and are reduced in float32; every node ends with the same bits:
    the native ring's for a lossless codec, within the rounding of each hop (k roundings of 2^-8)
    of the exact result for bf16."""
    nodes, count = tuple(range(k)), COUNT + 7
    inputs = [model_like(count, seed=100 + i) for i in nodes]
    bufs = [t.clone() for t in inputs]
    each(lanes(k), lambda i, lane: lane.allreduce(nodes, bufs[i], op, OP_S, codec=get(name)))
    assert all(b.numpy().tobytes() == bufs[0].numpy().tobytes() for b in bufs), "nodes differ"
    stack = np.stack([t.numpy().astype(np.float64) for t in inputs])
    exact = stack.sum(0) if op == "sum" else stack.max(0)
    if name == "lossless":  # the native ring's reduction order, so its bits
        native = [t.clone() for t in inputs]
        each(lanes(k), lambda i, lane: lane.allreduce(nodes, native[i], op, OP_S))
        assert bufs[0].numpy().tobytes() == native[0].numpy().tobytes()
    else:
        bound = k * 2.0 ** -8 * np.abs(stack).sum(0) + 1e-30
        assert (np.abs(bufs[0].numpy() - exact) <= bound).all(), name
        assert np.isfinite(bufs[0].numpy()).all()
