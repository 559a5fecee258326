"""A rank of the rejoin test, run by `commd launch --max-restarts 1`: rank VICTIM SIGKILLs itself
at step FAIL_STEP; the launcher starts it again and its guard rejoins the running job.

Usage: ft_rejoin_worker.py OUT_DIR VICTIM FAIL_STEP STEPS [DIVERGER].  Each rank writes OUT_DIR/rank<R>.pt
(OUT_DIR/rank<R>.restart<K>.pt for a replacement) with its parameters and what its guard did.
With DIVERGER, that running rank changes one of its parameters by a little right after the
recovery, as a silent fault would: the replacement's admission must find it, not overwrite it.
"""

from __future__ import annotations

import os
import sys
from pathlib import Path

import torch
import torch.distributed as dist

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))  # tests/: ft_workers
import ft_workers as fw  # noqa: E402
from ft_launched import guard_record, save_result  # noqa: E402

import commd.ft  # noqa: E402

#: Bound on how long the running ranks wait for the replacement to ask to come back (it starts
#: a Python process and imports torch first).
WAIT_FOR_REPLACEMENT_S = 120.0


def main() -> None:
    out_dir, victim, fail_step, steps = Path(sys.argv[1]), *map(int, sys.argv[2:5])
    diverger = int(sys.argv[5]) if len(sys.argv) > 5 else None
    restarts = int(os.environ["COMMD_RESTART_COUNT"])
    dist.init_process_group("commd")
    rank = dist.get_rank()
    model = fw.mlp()
    optimizer = torch.optim.SGD(model.parameters(), lr=fw.LR, momentum=fw.MOMENTUM)
    guard = commd.ft.Guard(model, optimizer, ddp_kwargs=fw.DDP_KWARGS)
    first = guard.steps

    def train_step(ddp: torch.nn.Module, step: int) -> float:
        loss = fw.loss_of(ddp, fw.batch(step, rank))
        loss.backward()
        return float(loss)

    for step in range(first, steps):
        if rank == victim and restarts == 0 and step == fail_step:
            fw.sigkill_self()
        if rank == diverger and guard.recoveries and step == guard.recoveries[0].step + 1:
            with torch.no_grad():
                next(guard.model.module.parameters()).view(-1)[0] += 1e-3
        if step == steps - 3:  # the running ranks do not finish without the replacement
            guard.take_back(timeout=WAIT_FOR_REPLACEMENT_S)
        guard.step(train_step, step)
    params = [p.detach().clone() for p in guard.model.module.parameters()]
    save_result(out_dir, rank, restarts, {"params": params, "first_step": first, **guard_record(guard)})
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
