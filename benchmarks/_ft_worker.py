"""One rank of benchmarks/ft.py: guarded (or plain) DDP steps of the model `commd demo` trains, under
``commd launch`` (one launcher per node, ``--keep-going`` or ``--max-restarts 1``) or under
``torchrun --max-restarts 1`` (plain DDP with a checkpoint every N steps); in an injection run one
rank SIGKILLs itself at a given point of a step (``fsdp``: the model is HSDP under
``commd.ft.ShardedGuard``, ``shards`` ranks per replica; ``node``: it SIGKILLs its node's daemon first;
``stop``: it SIGSTOPs its node's daemon for ``outage_s`` and goes on; ``link``: it asks the benchmark,
through kill.json, to pull its node's cable for ``outage_s``, and goes on).

    python _ft_worker.py CONFIG_JSON OUT_DIR

Each rank writes OUT_DIR/rank<R>.json (rank<R>.restart<K>.json for a restarted process) with its wall
times (time.time(): process start, torch imported, process group up, module built, optimizer built,
guard ready (a replacement: taken in), end),
its step times, its parameters' digest and what its guard did; the victim writes OUT_DIR/kill.json
just before the kill.
"""

from __future__ import annotations

import time

T_START = time.time()  # before torch is imported: a replacement's start-up is part of what it costs

import json  # noqa: E402
import os  # noqa: E402
import signal  # noqa: E402
import subprocess  # noqa: E402
import sys  # noqa: E402
import zlib  # noqa: E402
from pathlib import Path  # noqa: E402
from typing import Any  # noqa: E402

import torch  # noqa: E402

T_TORCH = time.time()

import torch.distributed as dist  # noqa: E402
from _ddp_worker import LEARNING_RATE, build_model, make_batches  # noqa: E402
from torch.nn.parallel import DistributedDataParallel  # noqa: E402


def digest(model: torch.nn.Module) -> int:
    """CRC32 of the whole parameters (an FSDP2 model's gathered: a collective over its mesh)."""
    value = 0
    for p in model.parameters():
        whole = p.full_tensor() if hasattr(p, "full_tensor") else p
        value = zlib.crc32(whole.detach().contiguous().numpy().tobytes(), value)
    return value


def sharded_guard(cfg: dict[str, Any]) -> Any:
    """``commd.ft.ShardedGuard`` on the demo model as HSDP: ``cfg["shards"]`` ranks per replica."""
    from torch.distributed.fsdp import fully_shard

    import commd.ft

    def build(mesh: Any) -> torch.nn.Module:
        model = build_model(cfg["model"], 0)
        for layer in model:
            if isinstance(layer, torch.nn.Linear):
                fully_shard(layer, mesh=mesh)
        return fully_shard(model, mesh=mesh)

    return commd.ft.ShardedGuard(build, lambda params: torch.optim.SGD(params, lr=LEARNING_RATE),
                                 shards=cfg["shards"])


def daemon_pid() -> int:
    """This node's commd daemon (the launcher's), from the job's pid file."""
    from commd.runtime import JobPaths

    pid = JobPaths.for_job(os.environ["COMMD_JOB"]).daemon_pid()
    if pid is None:
        raise RuntimeError(f"no live daemon for job {os.environ['COMMD_JOB']!r}")
    return pid


def main() -> None:
    cfg: dict[str, Any] = json.loads(sys.argv[1])
    out_dir = Path(sys.argv[2])
    # commd launch sets both; torchrun only its own
    restarts = int(os.environ.get("TORCHELASTIC_RESTART_COUNT") or 0)
    (out_dir / f"pid.{os.getpid()}").write_text("")  # for the benchmark's clean-up after a timeout
    dist.init_process_group(cfg.get("backend", "commd"))
    t_init = time.time()
    rank = dist.get_rank()
    steps = cfg["steps"]
    batches = make_batches(cfg["model"], cfg["batch"], steps, 0, rank)
    module = build_model(cfg["model"], 0)
    t_module = time.time()
    optimizer = torch.optim.SGD(module.parameters(), lr=LEARNING_RATE)  # (its first use imports torch._dynamo)
    t_model = time.time()
    where, kill_step = cfg.get("where"), cfg.get("kill_step", -1)
    is_victim = rank == cfg.get("victim") and restarts == 0
    state = {"step": -1}
    target = daemon_pid() if is_victim and where in ("node", "stop") else None

    def die() -> None:
        if where == "stop":  # the node's daemon hangs for the outage; a helper outside the job resumes it
            subprocess.Popen(["sh", "-c", f"sleep {cfg['outage_s']}; kill -CONT {target}"], start_new_session=True)
        (out_dir / "kill.json").write_text(json.dumps({"rank": rank, "time": time.time(), "where": where,
                                                       "step": state["step"], "daemon_pid": target}))
        if where == "link":  # the benchmark pulls this node's cable when it sees kill.json; this rank goes on
            return
        if where == "stop":
            os.kill(target, signal.SIGSTOP)
            return
        if target is not None:  # the whole node goes: its daemon, then this rank
            os.kill(target, signal.SIGKILL)
        os.kill(os.getpid(), signal.SIGKILL)

    def train_step(ddp: Any, x: torch.Tensor, y: torch.Tensor) -> float:
        if is_victim and state["step"] == kill_step:
            if where in ("forward", "node", "stop", "link"):
                die()
            if where == "backward" and cfg.get("fsdp"):  # the later layers' reduce-scatters are out
                ddp[0].register_full_backward_pre_hook(lambda *_: die())
            elif where == "backward":  # once the last layer's gradient is out: its bucket's all-reduce in flight
                ddp.module[0].weight.register_hook(lambda grad: die())
        loss = torch.nn.functional.mse_loss(ddp(x), y)
        loss.backward()
        return float(loss.detach())

    if is_victim and where == "optimizer" and not cfg.get("fsdp"):
        optimizer.register_step_pre_hook(lambda *_: die() if state["step"] == kill_step else None)
    times: list[float] = []

    def plain_step(model: Any, step: int) -> None:
        """One unguarded DDP step, timed."""
        state["step"] = step
        started = time.perf_counter()
        optimizer.zero_grad(set_to_none=True)
        train_step(model, *batches[step])
        optimizer.step()
        times.append(time.perf_counter() - started)

    result: dict[str, Any] = {"rank": rank, "restarts": restarts, "node": int(os.environ.get("GROUP_RANK") or 0)}
    after_failure: float | None = None
    if cfg.get("launcher", "commd") == "torchrun":
        first = 0
        checkpoint = out_dir / "checkpoint.pt"
        if checkpoint.exists():  # a restarted job: the last checkpoint rank 0 wrote
            saved = torch.load(checkpoint, weights_only=True)
            module.load_state_dict(saved["model"])
            optimizer.load_state_dict(saved["optimizer"])
            first = int(saved["step"])
        model = DistributedDataParallel(module)
        t_guard = time.time()
        every = cfg["checkpoint_every"]
        saved_s = 0.0
        for step in range(first, steps):
            plain_step(model, step)
            if (step + 1) % every == 0 and rank == 0:
                started = time.perf_counter()
                torch.save({"model": module.state_dict(), "optimizer": optimizer.state_dict(), "step": step + 1},
                           out_dir / "checkpoint.part")
                os.replace(out_dir / "checkpoint.part", checkpoint)
                saved_s += time.perf_counter() - started
        result.update(first_step=first, checkpoint_s=saved_s)
    elif cfg["guard"]:
        import commd.ft

        if cfg.get("fsdp"):  # the guard builds the model and its optimizer (a replacement: on joining)
            t_module = t_model = time.time()
            guard = sharded_guard(cfg)
            if is_victim and where == "optimizer":
                guard.optimizer.register_step_pre_hook(lambda *_: die() if state["step"] == kill_step else None)
        else:  # the plain module: the guard wraps it (or, in a replacement, joins the running ranks)
            guard = commd.ft.Guard(module if cfg.get("rejoin") else DistributedDataParallel(module), optimizer)
        t_guard = time.time()
        first = guard.steps
        take_back_step = cfg.get("take_back_step")
        join_done: list[float] = []
        take_back: dict[str, Any] | None = None
        for step in range(first, steps):
            state["step"] = step
            if step == take_back_step and first < step:  # the running ranks wait here for the replacement
                joins, started = len(guard.joins), time.time()
                got = guard.take_back(timeout=cfg.get("take_back_timeout", 120.0))
                take_back = {"step": step, "returned": got, "started": started, "seconds": time.time() - started,
                             "joined_here": len(guard.joins) > joins}
                if len(guard.joins) > joins:
                    join_done.append(time.time())
            joins = len(guard.joins)
            started = time.perf_counter()
            guard.step(train_step, *batches[step])
            times.append(time.perf_counter() - started)
            if len(guard.joins) > joins:  # taken in at the end of this step
                join_done.append(time.time())
            if guard.recoveries and after_failure is None:
                after_failure = time.time()
        module = guard.model if cfg.get("fsdp") else guard.model.module
        result.update(commit_s=guard.commit_seconds / max(1, guard.steps - first), first_step=first, ranks=list(guard.ranks), membership_epoch=guard.membership_epoch,
                      recoveries=[r.__dict__ for r in guard.recoveries], joins=[j.__dict__ for j in guard.joins],
                      join_done=join_done, take_back=take_back)
    else:
        model = DistributedDataParallel(module)
        t_guard = time.time()
        for step in range(steps):
            plain_step(model, step)
    result.update(digest=digest(module), step_times=times, first_step_after_failure=after_failure,
                  wall={"start": T_START, "torch": T_TORCH, "init": t_init, "module": t_module, "model": t_model,
                        "guard": t_guard, "end": time.time()})
    name = f"rank{rank}" + (f".restart{restarts}" if restarts else "")
    (out_dir / f"{name}.part").write_text(json.dumps(result))
    os.replace(out_dir / f"{name}.part", out_dir / f"{name}.json")
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
