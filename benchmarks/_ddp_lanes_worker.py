"""One rank of the DDP lane benchmark (started by benchmarks/ddp_lanes.py under `commd launch`).

Usage: python _ddp_lanes_worker.py CONFIG.json

Trains a small MLP with DistributedDataParallel over the `commd` backend and
records each step's wall time (forward, backward with DDP's bucketed
all-reduces, optimizer step); rank 0 writes the times, the final loss and the
daemon's per-lane op counts.
"""

from __future__ import annotations

import json
import os
import sys
import time

import torch
import torch.distributed as dist
import torch.nn as nn

import commd  # noqa: F401  (registers the backend)


def setup(cfg: dict) -> tuple[int, nn.Module, torch.optim.Optimizer, torch.Tensor, torch.Tensor]:
    """Join the job (backend commd) and build the DDP-wrapped MLP, its optimizer and this rank's batch."""
    torch.manual_seed(cfg["seed"])
    torch.set_num_threads(1)
    dist.init_process_group("commd")
    rank = dist.get_rank()
    layers: list[nn.Module] = [nn.Linear(cfg["inputs"], cfg["width"]), nn.ReLU()]
    for _ in range(cfg["layers"] - 1):
        layers += [nn.Linear(cfg["width"], cfg["width"]), nn.ReLU()]
    layers.append(nn.Linear(cfg["width"], 1))
    model = nn.parallel.DistributedDataParallel(nn.Sequential(*layers), bucket_cap_mb=cfg["bucket_mb"])
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    g = torch.Generator().manual_seed(cfg["seed"] * 100 + rank)
    x = torch.randn(cfg["batch"], cfg["inputs"], generator=g)
    return rank, model, opt, x, x[:, :4].sum(1, keepdim=True)


def main() -> int:
    cfg = json.loads(open(sys.argv[1]).read())
    rank, model, opt, x, y = setup(cfg)
    times, loss = [], None
    for _ in range(cfg["steps"]):
        started = time.perf_counter()
        opt.zero_grad()
        loss = nn.functional.mse_loss(model(x), y)
        loss.backward()
        opt.step()
        times.append(time.perf_counter() - started)
    dist.barrier()
    if rank == 0:
        from commd.client.status import query_status
        from commd.runtime import JobPaths

        status = query_status(JobPaths.for_job(os.environ["COMMD_JOB"]), timeout=10.0)
        with open(cfg["out"], "w") as f:
            json.dump({"times": times, "loss": float(loss), "ops_by_lane": status.get("ops_by_lane"),
                       "tuning": (status.get("fabric") or {}).get("tuning")}, f)
    dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    sys.exit(main())
