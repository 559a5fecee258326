"""A rank of the HSDP test, run by `commd launch --max-restarts 1 --nproc-per-node 4`: FSDP2 over a
2 x 2 (replicate, shard) mesh under commd.ft.ShardedGuard; rank VICTIM SIGKILLs itself at step
FAIL_STEP, its replica's other rank waits, the launcher starts the victim again, and the replica
comes back.

Usage: ft_hsdp_worker.py OUT_DIR VICTIM FAIL_STEP STEPS.  Each rank writes OUT_DIR/rank<R>.pt
(OUT_DIR/rank<R>.restart<K>.pt for a replacement): the full parameters and what its guard did.
"""

from __future__ import annotations

import os
import sys
from pathlib import Path

import torch
import torch.distributed as dist
from torch.distributed.fsdp import fully_shard

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))  # tests/: ft_workers
import ft_workers as fw  # noqa: E402
from ft_launched import guard_record, save_result  # noqa: E402

import commd.ft  # noqa: E402

#: Bound on how long the running replicas wait for the replacement to ask to come back.
WAIT_FOR_REPLACEMENT_S = 120.0


def build(mesh: object) -> torch.nn.Module:
    model = fw.mlp()
    for layer in model:
        if isinstance(layer, torch.nn.Linear):
            fully_shard(layer, mesh=mesh)
    fully_shard(model, mesh=mesh)
    return model


def main() -> None:
    out_dir, victim, fail_step, steps = Path(sys.argv[1]), *map(int, sys.argv[2:5])
    restarts = int(os.environ["COMMD_RESTART_COUNT"])
    dist.init_process_group("commd")
    rank = dist.get_rank()
    guard = commd.ft.ShardedGuard(
        build, lambda params: torch.optim.SGD(params, lr=fw.LR, momentum=fw.MOMENTUM), shards=2)
    first = guard.steps

    def train_step(model: torch.nn.Module, step: int) -> float:
        loss = fw.loss_of(model, fw.batch(step, rank))
        loss.backward()
        return float(loss)

    while guard.steps < steps:
        step = guard.steps
        if rank == victim and restarts == 0 and step == fail_step:
            fw.sigkill_self()
        if step == steps - 3:  # the running replicas do not finish without the broken one
            guard.take_back(timeout=WAIT_FOR_REPLACEMENT_S)
        guard.step(train_step, step)
    full = [p.full_tensor().detach().clone() for p in guard.model.parameters()]
    save_result(out_dir, rank, restarts, {"params": full, "first_step": first, **guard_record(guard)})
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
