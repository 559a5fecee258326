"""One rank of a workload run: ``python benchmarks/workloads/worker.py CONFIG.json``.

Started by a launcher that sets torch's env:// variables (RANK, WORLD_SIZE, MASTER_ADDR,
MASTER_PORT): ``python -m commd launch --nproc-per-node N`` for backend "commd", torchrun or
any equivalent for "gloo".  Config keys:

* ``workload``: "moe", "dlrm" or "megatron"; ``routing``: "capacity" or "dropless" (MoE);
* ``backend``: "commd" or "gloo"; ``lane``: null or "tcp"/"gloo"/"mpi" (commd: the lane of the
  default group and of every subgroup, ``Options(lane=...)``);
* ``steps`` timed steps after ``warmup`` untimed ones; ``seed``; ``preset``: "tiny" or "bench"
  (any size of ``models.PRESETS`` may be overridden too); ``ep`` / ``tp``: group sizes (2);
* ``threads``: torch's intra-op threads per rank (1); ``out``: the output path, "{rank}" in it
  replaced by the rank.

Each rank writes JSON: ``rank``, ``world``, ``config``, ``losses`` (every step, warm-up ones
first), ``step_times`` (seconds, time.perf_counter around each timed step, no barrier),
``params_digest`` (sha256 of the rank's parameters after the last step), ``description``
(``Workload.describe()``: the ops one step issues and their bytes), ``max_loads`` (MoE:
the busiest expert's tokens per layer in the last step) and, on rank 0 of a commd job, ``mix``
(its daemon's inter-node ops per kind, size class, lane, program and codec: ``commd status``).
"""

from __future__ import annotations

import json
import sys
import time
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))  # benchmarks/: the workloads package
from workloads.groups import make_groups  # noqa: E402
from workloads.models import MoEWorkload, build  # noqa: E402


def init(cfg: dict[str, Any]) -> Any:
    """Join the job on the configured backend; the pg_options every subgroup gets too."""
    backend = cfg.get("backend", "commd")
    if backend == "commd":
        import commd  # noqa: F401  (registers the backend)
        from commd.torch_backend.process_group import Options

        options = Options(lane=cfg.get("lane"))
        dist.init_process_group("commd", pg_options=options)
        return options
    if backend != "gloo":
        raise ValueError(f"backend must be commd or gloo, not {backend!r}")
    dist.init_process_group("gloo")
    return None


def run(cfg: dict[str, Any]) -> dict[str, Any]:
    """Build the workload, train warmup + steps steps and collect what the output file holds."""
    torch.set_num_threads(int(cfg.get("threads", 1)))
    options = init(cfg)
    rank, world = dist.get_rank(), dist.get_world_size()
    groups = make_groups(cfg["workload"], world, cfg.get("backend", "commd"), options,
                         ep=int(cfg.get("ep", 2)), tp=int(cfg.get("tp", 2)))
    workload = build(cfg["workload"], {k: v for k, v in cfg.items() if k != "out"}, groups)
    warmup, steps = int(cfg.get("warmup", 0)), int(cfg["steps"])
    losses, times = [], []
    for step in range(warmup + steps):
        started = time.perf_counter()
        losses.append(workload.step(step))
        if step >= warmup:
            times.append(time.perf_counter() - started)
    result = {"rank": rank, "world": world, "config": cfg, "losses": losses, "step_times": times,
              "params_digest": workload.params_digest(), "description": workload.describe()}
    if isinstance(workload, MoEWorkload):
        result["max_loads"] = workload.max_loads()
    if cfg.get("backend", "commd") == "commd" and rank == 0:
        result["mix"] = node_mix()
    return result


def node_mix() -> list[dict[str, Any]]:
    """What this node's daemon ran its inter-node ops with, per op kind and size class (``commd status``'s
    mix): which lanes, programs and codecs the job actually took."""
    from commd.client.status import query_status
    from commd.torch_backend.process_group import current_client

    return query_status(current_client().paths, timeout=20.0).get("mix") or []


def main() -> int:
    cfg = json.loads(Path(sys.argv[1]).read_text())
    result = run(cfg)
    Path(cfg["out"].replace("{rank}", str(result["rank"]))).write_text(json.dumps(result, indent=1))
    dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    sys.exit(main())
