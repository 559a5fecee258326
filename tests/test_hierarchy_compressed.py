"""Compressed broadcasts and all-gathers through the daemon's execution of a multi-node op
(commd/execution/hierarchy.py) on real tcp lanes, 2 nodes x 2 ranks: host tensors, CUDA tensors
(rounded on the GPU, only the 16-bit patterns cross to host memory) and a node of each in one op
(the same bytes on the wire).  Every rank must hold torch's bfloat16 rounding of the data, bit for
bit.  The CUDA cases skip without a GPU.
"""

from __future__ import annotations

from collections.abc import Iterator

import numpy as np
import pytest
import torch
from test_lane_tcp import OP_S, connect_all, each, new_lanes

from commd.codecs import CodecError, get
from commd.core.ops import ReadyOp, Submission
from commd.core.placement import GroupPlacement
from commd.execution import hierarchy
from commd.kernels import narrow
from commd.lanes.tcp import TcpLane

COUNT = (1 << 20) // 4 * 3 + 77  # 3 MiB of float32 and a ragged end: above the compression threshold
GPU = torch.cuda.is_available()
needs_gpu = pytest.mark.skipif(not GPU, reason="needs a CUDA GPU (the GPU narrowing path)")
#: Where each node's tensors live: both on the host, both on the GPU, one of each.
DEVICES = {"host": ("cpu", "cpu"), "gpu": ("cuda", "cuda"), "mixed": ("cuda", "cpu")}
PLACEMENTS = {"node-major": (0, 0, 1, 1), "interleaved": (0, 1, 0, 1)}


@pytest.fixture(scope="module")
def lanes() -> Iterator[list[TcpLane]]:
    made = new_lanes(2, chunk_bytes=1 << 20)
    connect_all(made)
    yield made
    for lane in made:
        lane.close()


def model_like(count: int, seed: int) -> torch.Tensor:
    """Weights-like float32 (small, a few large), with zeros, subnormals and infinities among them."""
    rng = np.random.default_rng(seed)
    values = (rng.standard_normal(count) * 0.02).astype(np.float32)
    values[::101] = rng.standard_normal(values[::101].size).astype(np.float32) * 50
    values[:6] = [0.0, -0.0, np.inf, -np.inf, 1e-40, 3.4e38]
    return torch.from_numpy(values)


def rounded(t: torch.Tensor) -> torch.Tensor:
    return t.to(torch.bfloat16).to(torch.float32)


def device_param(kind: str) -> object:
    return pytest.param(kind, marks=needs_gpu) if "cuda" in DEVICES[kind] else kind


def sub(g: int, kind: str, count: int, codec: str, **extra: object) -> Submission:
    return Submission(client_id=g, op_id=1, group="g", group_rank=g, group_size=4, seq=1, kind=kind,
                      dtype="float32", count=count, codec=codec, nbytes=count * 4, **extra)


def run_on_both(lanes: list[TcpLane], node_of: tuple[int, ...], kind: str, subs: list[Submission],
                tensors: dict[str, list[torch.Tensor]]) -> None:
    """Each node runs its ranks' part of the op, as its daemon would once the op is released."""
    def node(i: int, lane: TcpLane) -> None:
        placement = GroupPlacement("g", (0, 1, 2, 3), node_of, i)
        op = ReadyOp(kind, "g", 1, [subs[g] for g in placement.local], first_at=0.0, codec=subs[0].codec)
        hierarchy.run(op, placement, lane, lambda s, name: tensors[name][s.group_rank], OP_S)
    each(lanes, node)


@pytest.mark.parametrize("devices", [device_param(k) for k in DEVICES])
@pytest.mark.parametrize("codec", ["bf16", "bf16-cast"])
@pytest.mark.parametrize("root", [0, 3])
def test_a_compressed_broadcast_leaves_every_rank_the_roots_rounding(lanes: list[TcpLane], devices: str,
                                                                     codec: str, root: int) -> None:
    node_of = PLACEMENTS["node-major"]
    original = model_like(COUNT, seed=root)
    bufs = [(original.clone() if g == root else torch.full((COUNT,), -7.0)).to(DEVICES[devices][node_of[g]])
            for g in range(4)]
    run_on_both(lanes, node_of, "broadcast", [sub(g, "broadcast", COUNT, codec, root=root) for g in range(4)],
                {"buf": bufs})
    want = rounded(original).numpy().view(np.uint32)
    for g, buf in enumerate(bufs):  # the root too: every replica holds the same bits
        assert np.array_equal(buf.cpu().numpy().view(np.uint32), want), f"{codec} ({devices}): rank {g} differs"


@pytest.mark.parametrize("devices", [device_param(k) for k in DEVICES])
@pytest.mark.parametrize("placement", list(PLACEMENTS))
def test_a_compressed_all_gather_leaves_every_rank_every_block_rounded(lanes: list[TcpLane], devices: str,
                                                                       placement: str) -> None:
    node_of = PLACEMENTS[placement]
    count = COUNT // 4
    inputs = [model_like(count, seed=10 + g) for g in range(4)]
    ins = [t.to(DEVICES[devices][node_of[g]]) for g, t in enumerate(inputs)]
    outs = [torch.zeros(4 * count, device=DEVICES[devices][node_of[g]]) for g in range(4)]
    run_on_both(lanes, node_of, "allgather", [sub(g, "allgather", count, "bf16", counts=[count] * 4) for g in range(4)],
                {"in": ins, "out": outs})
    want = rounded(torch.cat(inputs)).numpy().view(np.uint32)
    for g, out in enumerate(outs):
        assert np.array_equal(out.cpu().numpy().view(np.uint32), want), f"{placement} ({devices}): rank {g} differs"
    for g, t in enumerate(ins):  # the inputs stay as they were
        assert torch.equal(t.cpu(), inputs[g])


def test_the_narrowed_codec_puts_the_whole_codecs_bytes_on_the_wire() -> None:
    """A node coding bits its GPU rounded and one coding float32 on its CPU send the same bytes."""
    from commd.codecs.rounding import to_bf16_bits

    data = model_like(50_000, seed=5).numpy()
    bits = np.empty(data.size, np.uint16)
    to_bf16_bits(data, bits)
    for name in ("bf16", "bf16-cast"):
        codec = get(name)
        narrowed = codec.narrowed()
        assert (narrowed.name, narrowed.wire_id, narrowed.lossy) == (name, codec.wire_id, False)
        wide_out = np.empty(codec.max_encoded(data.nbytes), np.uint8)
        narrow_out = np.empty(narrowed.max_encoded(bits.nbytes), np.uint8)
        n = codec.encode(data, wide_out)
        assert narrowed.encode(bits.view(np.int16), narrow_out) == n
        assert np.array_equal(wide_out[:n], narrow_out[:n])
        back = np.empty(data.size, np.int16)
        narrowed.decode(wide_out[:n], back)
        assert np.array_equal(back.view(np.uint16), bits)
        with pytest.raises(CodecError):
            narrowed.decode(wide_out[:n - 1] if name == "bf16-cast" else wide_out[1:n], back)


@pytest.mark.parametrize("device", ["cpu", pytest.param("cuda", marks=needs_gpu)])
def test_narrowing_tensors_gives_the_codecs_numpy_bits(device: str) -> None:
    """kernels.narrow on a device, the fused CuPy kernel and torch's ops alike, is codecs' NumPy rounding,
    NaN payloads and signs, subnormals, overflow to infinity and ties included."""
    from commd.codecs.rounding import to_bf16_bits

    rng = np.random.default_rng(0)
    data = np.concatenate([rng.integers(0, 2**32, 1 << 20, dtype=np.uint32).view(np.float32),
                           np.array([0, -0.0, np.inf, -np.inf, np.nan, -np.nan, 1e-45, -1e-45, 1.17e-38,
                                     3.4028235e38, -3.4028235e38, 1.0 + 2**-8, 1.0 + 3 * 2**-8], np.float32)])
    want = np.empty(data.size, np.uint16)
    to_bf16_bits(data, want)
    src = torch.from_numpy(data).to(device)
    for fused in (True, False):
        got = narrow.bf16_bits(src, fused=fused).cpu().numpy().view(np.uint16)
        assert np.array_equal(got, want), f"{device}, fused={fused}: {(got != want).sum()} elements differ"
    back = torch.empty(data.size, device=device)
    narrow.from_bf16_bits(torch.from_numpy(want.view(np.int16)).to(device), back)
    assert np.array_equal(back.cpu().numpy().view(np.uint32), want.astype(np.uint32) << 16)


@needs_gpu
def test_the_pinned_arena_hands_out_separate_page_locked_slices_and_grows(monkeypatch: pytest.MonkeyPatch) -> None:
    from commd.execution import pinned

    arena = pinned.PinnedArena()
    arena.start()
    a, b = arena.take(torch.empty(1000)), arena.take(torch.empty((3, 5), dtype=torch.int16))
    assert a.is_pinned() and b.is_pinned() and b.shape == (3, 5) and b.dtype == torch.int16
    a.fill_(1.0)
    b.fill_(-1)
    assert torch.all(a == 1.0)  # no overlap
    big = arena.take(torch.empty(1 << 20))  # more than the first buffer held: it grows, a and b stay valid
    big.fill_(2.0)
    assert big.is_pinned() and torch.all(a == 1.0) and torch.all(b == -1)
    monkeypatch.setattr(pinned, "MAX_ARENA_BYTES", 1 << 20)
    capped = pinned.PinnedArena()
    capped.start()
    assert not capped.take(torch.empty(1 << 19)).is_pinned()  # beyond the cap: pageable memory
