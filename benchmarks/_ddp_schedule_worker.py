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

import torch.distributed as dist
import torch.nn as nn

import commd  # noqa: F401  (registers the backend)

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from _ddp_lanes_worker import setup  # noqa: E402


def main() -> int:
    cfg = json.loads(open(sys.argv[1]).read())
    rank, model, opt, x, y = setup(cfg)  # (the lane benchmark's model, batch and optimizer)
    local_first = int(os.environ.get("LOCAL_RANK", "0")) == 0
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
