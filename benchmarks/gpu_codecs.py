"""The bf16 codecs on CUDA tensors: rounding on the GPU against coding on the CPU, stage by stage,
and compressed broadcasts of CUDA tensors between two in-process tcp lanes.

A node whose buffers are CUDA tensors can code them two ways:

  host     copy the float32 to host memory, then the codec rounds and packs on the CPU
           (what a node without the GPU narrowing does);
  gpu      round on the GPU (``commd.kernels.narrow``: one fused CuPy kernel, or torch's ops), copy
           only the 16-bit patterns to host memory, then the CPU packs them (``codec.narrowed()``).

Stages timed per 64 MiB of model-like float32 (median of --rounds): GPU rounding (fused, torch ops),
device-to-host copies of float32 and of the bits (pageable, and page-locked as the daemon stages them), and the CPU's coding of 1 MiB chunks one thread
(whole codec on float32; pack alone on bits).  A sender's pipeline runs at its slowest stage, so
per path the printed "codec-bound link" is the link rate (Gbit/s of float32 payload) above which the
codec, not the wire, limits a compressed chain on this machine.

Then whole broadcasts: ``hierarchy.run`` of a broadcast between two tcp lanes over loopback in
this process, root and receiver both on the GPU (median ms of --rounds): uncompressed, bf16 and
bf16-cast with GPU rounding, and the same codecs on host tensors (CPU coding).  Loopback is not a
link: these say what the codec costs, not what compression gains.

    python benchmarks/gpu_codecs.py --size 64M --rounds 5 --json out.json

Needs a CUDA GPU.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import threading
import time
from collections.abc import Callable
from pathlib import Path

import numpy as np
import torch

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from commd.bench.spec import parse_size  # noqa: E402
from commd.codecs import get  # noqa: E402
from commd.core.ops import ReadyOp, Submission  # noqa: E402
from commd.core.placement import GroupPlacement  # noqa: E402
from commd.execution import hierarchy  # noqa: E402
from commd.kernels import narrow  # noqa: E402
from commd.lanes.tcp import TcpLane  # noqa: E402

CHUNK = 1 << 20


def model_like(count: int) -> np.ndarray:
    rng = np.random.default_rng(0)
    values = (rng.standard_normal(count) * 0.02).astype(np.float32)
    values[::97] *= 100
    return values


def median_s(fn: Callable[[], object], rounds: int, sync: bool = True) -> float:
    fn()
    times = []
    for _ in range(rounds):
        if sync:
            torch.cuda.synchronize()
        began = time.perf_counter()
        fn()
        if sync:
            torch.cuda.synchronize()
        times.append(time.perf_counter() - began)
    return statistics.median(times)


def chunked(fn: Callable[[np.ndarray, np.ndarray], int], data: np.ndarray, room: int) -> Callable[[], None]:
    """``fn`` over the chunks a lane would cut: 1 MiB of float32 (as many elements of bits)."""
    step = CHUNK // 4
    pieces = [data[i:i + step] for i in range(0, data.size, step)]
    out = np.empty(room, np.uint8)
    return lambda: [fn(p, out) for p in pieces]


def stages(size: int, rounds: int) -> dict[str, float]:
    """Seconds per ``size`` bytes of float32 for each stage."""
    host = model_like(size // 4)
    dev = torch.from_numpy(host).cuda()
    bits = narrow.bf16_bits(dev)
    host_bits = bits.cpu().numpy()
    pinned = torch.empty(size // 4, dtype=torch.float32).pin_memory()
    pinned_bits = torch.empty(size // 4, dtype=torch.int16).pin_memory()
    out: dict[str, float] = {
        "gpu round": median_s(lambda: narrow.bf16_bits(dev), rounds),
        "gpu round, torch ops": median_s(lambda: narrow.bf16_bits(dev, fused=False), rounds),
        "d2h float32 (pageable)": median_s(lambda: dev.cpu(), rounds),
        "d2h bits (pageable)": median_s(lambda: bits.cpu(), rounds),
        "d2h float32 (pinned)": median_s(lambda: pinned.copy_(dev), rounds),
        "d2h bits (pinned)": median_s(lambda: pinned_bits.copy_(bits), rounds),
    }
    for name in ("bf16", "bf16-cast"):
        codec = get(name)
        narrowed = codec.narrowed()
        out[f"cpu {name} encode float32"] = median_s(chunked(codec.encode, host, codec.max_encoded(CHUNK)), rounds,
                                                     sync=False)
        out[f"cpu {name} pack bits"] = median_s(chunked(narrowed.encode, host_bits, narrowed.max_encoded(CHUNK // 2)),
                                                rounds, sync=False)
    return out


def paths(st: dict[str, float], size: int) -> dict[str, float]:
    """Per path, the codec-bound link in Gbit/s of float32 payload: the slowest stage's rate."""
    rate = {}
    for name in ("bf16", "bf16-cast"):
        host = max(st["d2h float32 (pinned)"], st[f"cpu {name} encode float32"])
        gpu = max(st["gpu round"], st["d2h bits (pinned)"], st[f"cpu {name} pack bits"])
        rate[f"{name}: host coding"] = size * 8 / host / 1e9
        rate[f"{name}: gpu rounding"] = size * 8 / gpu / 1e9
    return rate


def broadcasts(size: int, rounds: int, devices: tuple[str, ...] = ("cuda", "cpu")) -> dict[str, float]:
    """Median seconds of a 2-node broadcast through hierarchy.run, per (codec, device)."""
    lanes = [TcpLane(i, 2, "gpu-codecs-bench", "127.0.0.1", chunk_bytes=1 << 20) for i in range(2)]
    endpoints = [lane.endpoint for lane in lanes]
    _both(lanes, lambda i, lane: lane.connect(endpoints, 10.0))
    count = size // 4
    data = torch.from_numpy(model_like(count))
    out = {}
    try:
        for codec in ("", "bf16", "bf16-cast"):
            for device in devices:
                bufs = [data.to(device), torch.zeros(count, device=device)]

                def once(codec: str = codec, bufs: list[torch.Tensor] = bufs) -> None:
                    subs = [Submission(client_id=g, op_id=1, group="g", group_rank=g, group_size=2, seq=1,
                                       kind="broadcast", dtype="float32", count=count, codec=codec, nbytes=size)
                            for g in range(2)]

                    def node(i: int, lane: TcpLane) -> None:
                        placement = GroupPlacement("g", (0, 1), (0, 1), i)
                        op = ReadyOp("broadcast", "g", 1, [subs[i]], first_at=0.0, codec=codec)
                        hierarchy.run(op, placement, lane, lambda s, name: bufs[s.group_rank], 60.0)
                    _both(lanes, node)
                out[f"{codec or 'uncompressed'} {device}"] = median_s(once, rounds)
                want = data if not codec else data.to(torch.bfloat16).float()
                assert torch.equal(bufs[1].cpu(), want), f"{codec} {device}: the receiver's data is wrong"
    finally:
        for lane in lanes:
            lane.close()
    return out


def _both(lanes: list[TcpLane], fn: Callable[[int, TcpLane], None]) -> None:
    errors: list[BaseException] = []

    def run(i: int) -> None:
        try:
            fn(i, lanes[i])
        except BaseException as exc:  # reported below
            errors.append(exc)
    threads = [threading.Thread(target=run, args=(i,)) for i in range(len(lanes))]
    for t in threads:
        t.start()
    for t in threads:
        t.join(120)
    if errors:
        raise errors[0]


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--size", default="64M")
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--json", metavar="FILE")
    args = parser.parse_args(argv)
    if not torch.cuda.is_available():
        print("needs a CUDA GPU")
        return 2
    size = parse_size(args.size)
    fused = narrow.uses_cupy(torch.zeros(1, device="cuda"))
    print(f"{torch.cuda.get_device_name()}, torch {torch.__version__}, {os.cpu_count()} CPUs, load "
          f"{os.getloadavg()[0]:.2f}; {args.size} of float32, median of {args.rounds}; GPU rounding: "
          f"{'one fused CuPy kernel' if fused else 'torch ops (no CuPy)'}")
    st = stages(size, args.rounds)
    print(f"{'stage':<32} {'ms':>8} {'GB/s of its input':>18}")
    for name, sec in st.items():
        print(f"{name:<32} {sec * 1e3:8.2f} {size / sec / 1e9:18.1f}")
    rate = paths(st, size)
    print(f"{'path (sender pipeline)':<32} {'codec-bound link Gbit/s':>24}")
    for name, gbit in rate.items():
        print(f"{name:<32} {gbit:24.1f}")
    bc = broadcasts(size, args.rounds)
    print(f"{'broadcast, 2 lanes, loopback':<32} {'ms':>8}")
    for name, sec in bc.items():
        print(f"{name:<32} {sec * 1e3:8.1f}")
    if args.json:
        Path(args.json).write_text(json.dumps({"size": size, "stages_s": st, "codec_bound_gbit": rate,
                                               "broadcast_s": bc, "device": torch.cuda.get_device_name()}, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
