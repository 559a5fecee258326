"""One rank of benchmarks/ft.py, under ``commd launch --keep-going``: guarded (or plain) DDP steps of
the model `commd demo` trains; in an injection run one rank SIGKILLs itself at a given point of a step.

    python _ft_worker.py CONFIG_JSON OUT_DIR
"""

from __future__ import annotations

import json
import os
import signal
import sys
import time
import zlib
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from _ddp_worker import LEARNING_RATE, build_model, make_batches
from torch.nn.parallel import DistributedDataParallel

import commd.ft


def digest(model: torch.nn.Module) -> int:
    value = 0
    for p in model.parameters():
        value = zlib.crc32(p.detach().contiguous().numpy().tobytes(), value)
    return value


def main() -> None:
    cfg: dict[str, Any] = json.loads(sys.argv[1])
    out_dir = Path(sys.argv[2])
    dist.init_process_group("commd")
    rank = dist.get_rank()
    batches = make_batches(cfg["model"], cfg["batch"], cfg["steps"], 0, rank)
    model = DistributedDataParallel(build_model(cfg["model"], 0))
    optimizer = torch.optim.SGD(model.parameters(), lr=LEARNING_RATE)
    victim = cfg.get("victim")
    where, kill_step = cfg.get("where"), cfg.get("kill_step", -1)
    state = {"step": 0}

    def die() -> None:
        (out_dir / "kill.json").write_text(json.dumps({"rank": rank, "time": time.time(), "where": where}))
        os.kill(os.getpid(), signal.SIGKILL)

    def train_step(ddp: Any, x: torch.Tensor, y: torch.Tensor) -> float:
        if rank == victim and state["step"] == kill_step:
            if where == "forward":
                die()
            if where == "backward":  # once the last layer's gradient is out: its bucket's all-reduce in flight
                ddp.module[0].weight.register_hook(lambda grad: die())
        loss = torch.nn.functional.mse_loss(ddp(x), y)
        loss.backward()
        return float(loss.detach())

    if rank == victim and where == "optimizer":
        optimizer.register_step_pre_hook(lambda *_: die() if state["step"] == kill_step else None)
    times: list[float] = []
    after_failure: float | None = None
    if cfg["guard"]:
        guard = commd.ft.Guard(model, optimizer)
        for step, (x, y) in enumerate(batches):
            state["step"] = step
            started = time.perf_counter()
            guard.step(train_step, x, y)
            times.append(time.perf_counter() - started)
            if guard.recoveries and after_failure is None:
                after_failure = time.time()
        result: dict[str, Any] = {"digest": digest(guard.model.module), "ranks": list(guard.ranks),
                                  "recoveries": [r.__dict__ for r in guard.recoveries]}
    else:
        for step, (x, y) in enumerate(batches):
            state["step"] = step
            started = time.perf_counter()
            optimizer.zero_grad(set_to_none=True)
            train_step(model, x, y)
            optimizer.step()
            times.append(time.perf_counter() - started)
        result = {"digest": digest(model.module)}
    result.update(rank=rank, step_times=times, first_step_after_failure=after_failure)
    (out_dir / f"rank{rank}.json").write_text(json.dumps(result))
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
