"""One rank of the schedule-path DDP benchmark (started by benchmarks/ddp_schedule.py under `commd launch`).

Usage: python _ddp_schedule_worker.py CONFIG.json

Trains a small MLP with DistributedDataParallel over the `commd` backend and records
each step's wall time; each node's first rank also reads its daemon's fabric counters
after every step (outside the timed step): ops per path and control items exchanged with
the coordinator.  Every node's first rank writes its file; rank 0 adds the final loss
and a digest of the parameters.
"""

from __future__ import annotations

import hashlib
import json
import os
import sys
import time

import torch
import torch.distributed as dist
import torch.nn as nn

import commd  # noqa: F401  (registers the backend)


def main() -> int:
    cfg = json.loads(open(sys.argv[1]).read())
    torch.manual_seed(cfg["seed"])
    torch.set_num_threads(1)
    dist.init_process_group("commd")
    rank = dist.get_rank()
    local_first = int(os.environ.get("LOCAL_RANK", "0")) == 0
    layers: list[nn.Module] = [nn.Linear(cfg["inputs"], cfg["width"]), nn.ReLU()]
    for _ in range(cfg["layers"] - 1):
        layers += [nn.Linear(cfg["width"], cfg["width"]), nn.ReLU()]
    layers.append(nn.Linear(cfg["width"], 1))
    model = nn.parallel.DistributedDataParallel(nn.Sequential(*layers), bucket_cap_mb=cfg["bucket_mb"])
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    g = torch.Generator().manual_seed(cfg["seed"] * 100 + rank)
    x = torch.randn(cfg["batch"], cfg["inputs"], generator=g)
    y = x[:, :4].sum(1, keepdim=True)
    paths = None
    if local_first:
        from commd.client.status import query_status
        from commd.runtime import JobPaths

        paths = JobPaths.for_job(os.environ["COMMD_JOB"])

    def counters() -> dict:
        fabric = query_status(paths, timeout=10.0).get("fabric") or {}
        return {"paths": fabric.get("paths"), "control": fabric.get("control_items"),
                "coordinator": fabric.get("coordinator")}

    times, per_step, loss = [], [], None
    for _ in range(cfg["steps"]):
        started = time.perf_counter()
        opt.zero_grad()
        loss = nn.functional.mse_loss(model(x), y)
        loss.backward()
        opt.step()
        times.append(time.perf_counter() - started)
        if local_first:
            per_step.append(counters())
    dist.barrier()
    if local_first:
        digest = hashlib.sha256(b"".join(p.detach().numpy().tobytes() for p in model.parameters())).hexdigest()
        with open(cfg["out"].replace(".json", f"-r{rank}.json"), "w") as f:
            json.dump({"times": times, "loss": float(loss), "digest": digest, "counters": per_step}, f)
        if rank == 0:
            with open(cfg["out"], "w") as f:
                json.dump({"rank0": cfg["out"].replace(".json", "-r0.json")}, f)
    dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    sys.exit(main())
