"""One rank of the compressed-broadcast DDP benchmark (started by benchmarks/ddp_broadcast.py under `commd launch`).

Usage: python _ddp_broadcast_worker.py CONFIG.json

Trains an MLP student onto a fixed random teacher network with DistributedDataParallel
over the `commd` backend.  The model's parameters live in one flat float32 buffer (each
parameter a view into it), so after every optimizer step the whole model is pushed from
rank 0 with ONE broadcast of that buffer, in place, through a group made with
``commd.Options(compression=CODEC)`` (``none``: a group with no codec).  With a lossy
codec every rank's copy, the root's included, becomes the codec's rounding of the root's
weights: the next step trains from those, and the optimizer updates them.  With
``master_weights`` every rank's optimizer updates a float32 copy instead (all ranks' copies
agree: DDP's gradients are the same everywhere), the root copies its one into the buffer
before the push, and the model computes with what the push leaves (mixed precision's
float32 master weights).

Every rank records per step its wall time (forward, backward with DDP's all-reduces,
optimizer step, broadcast), the broadcast's own time and its training loss; rank 0 writes
them for all ranks, the held-out loss before and after training, and the checks:
after the final broadcast every rank's parameters are bit-identical to rank 0's (a digest
all-gathered over the default group, which has no codec), and rank 0's own buffer is its
pre-broadcast copy rounded as the codec rounds (unchanged for ``none``/lossless codecs).

The pure parts (teacher, data, model, digest) are importable without a process group.
"""

from __future__ import annotations

import hashlib
import json
import os
import sys
import time
from typing import Any

import torch
import torch.nn as nn

#: Teacher network: inputs -> TEACHER_HIDDEN (tanh) -> outputs; its own seed offset.
TEACHER_HIDDEN = 128
#: Held-out evaluation samples (one fixed set, the same for every run and setting).
EVAL_SAMPLES = 2048


def teacher(cfg: dict[str, Any]) -> nn.Module:
    """The fixed random network the student learns to imitate (seeded by ``cfg['seed']``)."""
    torch.manual_seed(cfg["seed"] * 7919 + 1)
    net = nn.Sequential(nn.Linear(cfg["inputs"], TEACHER_HIDDEN), nn.Tanh(),
                        nn.Linear(TEACHER_HIDDEN, cfg["outputs"]))
    for p in net.parameters():
        p.requires_grad_(False)
    return net


def batch(cfg: dict[str, Any], net: nn.Module, step: int, rank: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Rank ``rank``'s batch of step ``step``: inputs ~ N(0, 1) and the teacher's outputs (deterministic)."""
    g = torch.Generator().manual_seed(((cfg["seed"] * 1_000_003 + step) * 64 + rank) & 0x7FFF_FFFF_FFFF)
    x = torch.randn(cfg["batch"], cfg["inputs"], generator=g)
    with torch.no_grad():
        return x, net(x)


def eval_set(cfg: dict[str, Any], net: nn.Module) -> tuple[torch.Tensor, torch.Tensor]:
    """The held-out samples (their own generator: never a training batch)."""
    g = torch.Generator().manual_seed(cfg["seed"] * 31 + 999_983)
    x = torch.randn(EVAL_SAMPLES, cfg["inputs"], generator=g)
    with torch.no_grad():
        return x, net(x)


def build_model(cfg: dict[str, Any]) -> nn.Sequential:
    """The student: inputs -> width x layers (ReLU) -> outputs, seeded (the same on every rank and run)."""
    torch.manual_seed(cfg["seed"])
    mods: list[nn.Module] = [nn.Linear(cfg["inputs"], cfg["width"]), nn.ReLU()]
    for _ in range(cfg["layers"] - 1):
        mods += [nn.Linear(cfg["width"], cfg["width"]), nn.ReLU()]
    mods.append(nn.Linear(cfg["width"], cfg["outputs"]))
    return nn.Sequential(*mods)


def param_count(cfg: dict[str, Any]) -> int:
    i, w, n, o = cfg["inputs"], cfg["width"], cfg["layers"], cfg["outputs"]
    return (i + 1) * w + (n - 1) * (w + 1) * w + (w + 1) * o


def flatten_into_views(model: nn.Module) -> torch.Tensor:
    """One float32 buffer holding every parameter, each parameter now a view into it (in place)."""
    params = list(model.parameters())
    flat = torch.empty(sum(p.numel() for p in params), dtype=torch.float32)
    offset = 0
    for p in params:
        n = p.numel()
        flat[offset:offset + n].copy_(p.detach().reshape(-1))
        p.data = flat[offset:offset + n].view_as(p)
        offset += n
    return flat


def master_copy(flat: torch.Tensor, model: nn.Module) -> tuple[torch.Tensor, list[nn.Parameter]]:
    """A float32 copy of ``flat`` and parameters viewing it, shaped as ``model``'s: the weights the
    optimizer updates when the pushed ones (the model's) are the codec's rounding of them."""
    master = flat.clone()
    params, offset = [], 0
    for p in model.parameters():
        n = p.numel()
        params.append(nn.Parameter(master[offset:offset + n].view_as(p)))
        offset += n
    return master, params


def digest(t: torch.Tensor) -> int:
    """A 62-bit digest of the tensor's bytes (equal digests: bit-identical, for any practical purpose)."""
    return int(hashlib.sha256(t.detach().contiguous().numpy().tobytes()).hexdigest()[:15], 16)


def codec_rounding(codec: str, t: torch.Tensor) -> torch.Tensor:
    """What a broadcast with ``codec`` leaves of the root's float32 ``t`` (every rank, the root too):
    ops under COMPRESS_MIN_BYTES travel uncompressed."""
    from commd.execution.hierarchy import COMPRESS_MIN_BYTES

    if t.numel() * t.element_size() < COMPRESS_MIN_BYTES:
        return t.clone()
    if codec in ("bf16", "bf16-cast"):
        return t.to(torch.bfloat16).to(torch.float32)
    if codec == "fp16":
        return t.to(torch.float16).to(torch.float32)
    return t.clone()  # none and the lossless codecs


def eval_loss(model: nn.Module, data: tuple[torch.Tensor, torch.Tensor]) -> float:
    with torch.no_grad():
        return float(nn.functional.mse_loss(model(data[0]), data[1]))


def main() -> int:
    import torch.distributed as dist

    import commd

    cfg = json.loads(open(sys.argv[1]).read())
    torch.set_num_threads(1)
    dist.init_process_group("commd")
    rank, world = dist.get_rank(), dist.get_world_size()
    codec = cfg["codec"]
    group = dist.new_group(list(range(world)),
                           pg_options=commd.Options(compression=None if codec == "none" else codec))
    net = teacher(cfg)
    model = build_model(cfg)
    flat = flatten_into_views(model)
    ddp = nn.parallel.DistributedDataParallel(model, bucket_cap_mb=cfg["bucket_mb"])
    master_flat, master = (master_copy(flat, model) if cfg["master_weights"]
                           else (flat, list(model.parameters())))
    opt = (torch.optim.Adam(master, lr=cfg["lr"]) if cfg["optimizer"] == "adam"
           else torch.optim.SGD(master, lr=cfg["lr"], momentum=0.9))
    held_out = eval_set(cfg, net)
    loss_before = eval_loss(model, held_out)
    times, bcast, losses = [], [], []
    before = flat
    for step in range(cfg["steps"]):
        x, y = batch(cfg, net, step, rank)
        started = time.perf_counter()
        opt.zero_grad(set_to_none=False)
        loss = nn.functional.mse_loss(ddp(x), y)
        loss.backward()
        if cfg["master_weights"]:
            for q, p in zip(master, model.parameters(), strict=True):
                q.grad = p.grad  # the all-reduced gradient, applied to the float32 weights
        opt.step()
        if cfg["master_weights"] and rank == 0:
            flat.copy_(master_flat)  # the root pushes its float32 weights
        if step == cfg["steps"] - 1 and rank == 0:
            before = flat.clone()  # the root's weights as the last push sends them
        pushed = time.perf_counter()
        dist.broadcast(flat, 0, group=group)
        done = time.perf_counter()
        times.append(done - started)
        bcast.append(done - pushed)
        losses.append(float(loss))
    digests = torch.tensor([digest(flat)], dtype=torch.int64)
    every = [torch.zeros_like(digests) for _ in range(world)]
    dist.all_gather(every, digests)  # the default group: no codec
    per_rank = torch.tensor([times, bcast, losses], dtype=torch.float64)
    gathered = [torch.zeros_like(per_rank) for _ in range(world)]
    dist.all_gather(gathered, per_rank)
    if rank == 0:
        from commd.client.status import query_status
        from commd.runtime import JobPaths

        status = query_status(JobPaths.for_job(os.environ["COMMD_JOB"]), timeout=10.0)
        fabric = status.get("fabric") or {}
        result = {
            "codec": codec, "world": world, "params": flat.numel(), "loss_before": loss_before,
            "loss_after": eval_loss(model, held_out),
            "losses": [g[2].tolist() for g in gathered],
            "step_times": [g[0].tolist() for g in gathered], "bcast_times": [g[1].tolist() for g in gathered],
            "digests": [int(d.item()) for d in every],
            "identical": len({int(d.item()) for d in every}) == 1,
            "root_rounded_as_codec": bool(torch.equal(flat, codec_rounding(codec, before))),
            "compression": fabric.get("compression"),
            "broadcast_lanes": (status.get("ops_by_lane") or {}).get("broadcast"),
        }
        with open(cfg["out"], "w") as f:
            json.dump(result, f)
    dist.barrier()
    dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    sys.exit(main())
