"""What the commd.ft tests' ranks run, and the single-process model they are checked against."""

from __future__ import annotations

import os
import signal
from typing import Any

import torch

LR = 0.1
MOMENTUM = 0.9
#: DDP's bucket limit in the tests: the 64x64 layer has a bucket of its own (two all-reduces per step).
DDP_KWARGS = {"bucket_cap_mb": 0.01}


def mlp() -> torch.nn.Module:
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(16, 64), torch.nn.Tanh(), torch.nn.Linear(64, 64), torch.nn.Tanh(),
                               torch.nn.Linear(64, 4))


def batch(step: int, rank: int) -> torch.Tensor:
    return torch.randn(8, 16, generator=torch.Generator().manual_seed(step * 100 + rank))


def loss_of(model: Any, x: torch.Tensor) -> torch.Tensor:
    return model(x).pow(2).mean()


def reference_with_members(steps: int, members_at: dict[int, list[int]]) -> list[torch.Tensor]:
    """One process: each step's gradient is the mean over the participants' batches, as DDP's (and
    HSDP's); step s's participants are ``members_at``'s for the latest step at or before s."""
    model = mlp()
    optimizer = torch.optim.SGD(model.parameters(), lr=LR, momentum=MOMENTUM)
    for step in range(steps):
        ranks = members_at[max(s for s in members_at if s <= step)]
        grads = [torch.zeros_like(p) for p in model.parameters()]
        for rank in ranks:
            model.zero_grad()
            loss_of(model, batch(step, rank)).backward()
            for total, p in zip(grads, model.parameters(), strict=True):
                total += p.grad / len(ranks)
        for p, g in zip(model.parameters(), grads, strict=True):
            p.grad = g
        optimizer.step()
    return [p.detach().clone() for p in model.parameters()]


def reference(steps: int, world: int, redone_step: int, survivors: list[int]) -> list[torch.Tensor]:
    """Every rank takes part before ``redone_step``, the survivors from it on."""
    return reference_with_members(steps, {0: list(range(world)), redone_step: list(survivors)})


def guarded_training(rank: int, world: int, init_method: str, steps: int, kill: Any = None,
                     min_ranks: int = 1, recover_timeout: float = 60.0, count_on: str | None = None) -> dict[str, Any]:
    """``steps`` guarded DDP steps of ``mlp``; ``kill(step, where)`` is called at the start of each
    step's forward ("forward") and when the first layer's gradient is computed ("backward"), after
    the later layers' bucket went out.  Returns the parameters and the recoveries."""
    from datetime import timedelta

    import torch.distributed as dist
    from torch.nn.parallel import DistributedDataParallel

    import commd.ft

    dist.init_process_group("commd", init_method=init_method, rank=rank, world_size=world,
                            timeout=timedelta(seconds=min(60.0, recover_timeout)))
    model = DistributedDataParallel(mlp(), **DDP_KWARGS)
    optimizer = torch.optim.SGD(model.parameters(), lr=LR, momentum=MOMENTUM)
    guard = commd.ft.Guard(model, optimizer, ddp_kwargs=DDP_KWARGS, min_ranks=min_ranks,
                           recover_timeout=recover_timeout)
    first_layer = model.module[0].weight

    def count() -> None:  # the user's own collective in the step: count the ranks
        ones = torch.ones(1)
        dist.all_reduce(ones, group=None if count_on == "world" else guard.group)
        counts.append(int(ones.item()))

    def in_backward(step: int) -> None:
        if kill is not None:
            kill(step, "backward")
        if count_on == "guard-in-backward":  # fails mid-backward, the later layers marked ready
            count()

    def train_step(ddp: Any, step: int) -> float:
        if kill is not None:
            kill(step, "forward")
        handle = first_layer.register_hook(lambda grad: in_backward(step))
        try:
            loss = loss_of(ddp, batch(step, rank))
            loss.backward()
        finally:  # (a failed step's hook must not fire in the redone one)
            handle.remove()
        if count_on in ("guard", "world"):
            count()
        return float(loss)

    counts: list[int] = []
    for step in range(steps):
        guard.step(train_step, step)
    return {"params": [p.detach().clone() for p in guard.model.module.parameters()],
            "recoveries": [(r.step, r.gone, r.survivors, r.seconds) for r in guard.recoveries],
            "op_timeout": guard.model.process_group.op_timeout, "counts": counts}


def run_bounded(procs: list[Any], bound_s: float) -> None:
    """Start ``procs`` and wait for all of them, at most ``bound_s`` together; a rank still running
    then is killed, and the test fails naming it."""
    import time

    for proc in procs:
        proc.start()
    deadline = time.monotonic() + bound_s
    for proc in procs:
        proc.join(timeout=max(0.0, deadline - time.monotonic()))
    hung = [rank for rank, proc in enumerate(procs) if proc.is_alive()]
    for proc in procs:
        if proc.is_alive():
            proc.kill()
            proc.join(timeout=5)
    assert not hung, f"ranks {hung} did not finish within {bound_s:.0f}s"


def sigkill_self() -> None:
    os.kill(os.getpid(), signal.SIGKILL)


def ft_on_nodes(ctx: Any, port: int, steps: int, fail_step: int, victims: list[int]) -> dict[str, Any]:
    """Guarded training on the test's simulated nodes: the ranks in ``victims`` stop at ``fail_step``
    and wait to be killed by the test (with their daemon, or alone)."""

    def kill(step: int, where: str) -> None:
        if ctx.rank in victims and step == fail_step and where == "forward":
            ctx.event("at fail step")
            ctx.command()  # the test kills this rank here

    os.environ["COMMD_JOB"] = ctx.job  # the test's daemons
    out = guarded_training(ctx.rank, ctx.world_size, f"tcp://127.0.0.1:{port}", steps, kill)
    out["params"] = [p.tolist() for p in out["params"]]
    return out


# ---- the bitwise criterion (tests/test_ft_bitwise.py) -------------------------------------
#: Two DDP buckets for the tiny model once DDP rebuilt them after its first step: the last layer's
#: with the first bias (336 bytes), and the first weight's.
TINY_DDP_KWARGS = {"bucket_cap_mb": 0.0003}


def tiny_mlp(inputs: int = 32) -> torch.nn.Module:
    """Linear(inputs, 16), ReLU, Linear(16, 4); ``inputs`` 65536 makes the first layer's gradient 4 MiB,
    past the largest op of a 3- or 4-rank exchange ring: its all-reduce goes through the daemon."""
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(inputs, 16), torch.nn.ReLU(), torch.nn.Linear(16, 4))


def tiny_batch(step: int, rank: int, inputs: int = 32) -> torch.Tensor:
    """Scaled so that a sample's squared norm stays about 32 whatever ``inputs`` (training stays stable)."""
    x = torch.randn(8, inputs, generator=torch.Generator().manual_seed(step * 100 + rank))
    return x if inputs == 32 else x * (32 / inputs) ** 0.5


def guarded_with_snapshot(rank: int, world: int, init_method: str, steps: int, fail_step: int,
                          victim: int, inputs: int = 32) -> dict[str, Any]:
    """``steps`` guarded DDP steps of ``tiny_mlp``; ``victim`` SIGKILLs itself before its forward of
    ``fail_step``.  Returns the model and optimizer state at the start of the redone step (after the
    recovery, before its forward), the final parameters and the recoveries."""
    import copy
    from datetime import timedelta

    import torch.distributed as dist
    from torch.nn.parallel import DistributedDataParallel

    import commd.ft

    dist.init_process_group("commd", init_method=init_method, rank=rank, world_size=world,
                            timeout=timedelta(seconds=60))
    model = DistributedDataParallel(tiny_mlp(inputs), **TINY_DDP_KWARGS)
    optimizer = torch.optim.SGD(model.parameters(), lr=LR, momentum=MOMENTUM)
    guard = commd.ft.Guard(model, optimizer, ddp_kwargs=TINY_DDP_KWARGS)
    snapshot: dict[str, Any] = {}

    def train_step(ddp: Any, step: int) -> float:
        if rank == victim and step == fail_step:
            sigkill_self()
        if guard.epoch == 1 and not snapshot:
            snapshot.update(step=step, model=copy.deepcopy(ddp.module.state_dict()),
                            optimizer=copy.deepcopy(optimizer.state_dict()))
        loss = loss_of(ddp, tiny_batch(step, rank, inputs))
        loss.backward()
        return float(loss)

    for step in range(steps):
        guard.step(train_step, step)
    return {"snapshot": snapshot, "params": [p.detach().clone() for p in guard.model.module.parameters()],
            "recoveries": [(r.step, r.gone, r.survivors, r.seconds) for r in guard.recoveries],
            "buckets": guard.model._get_ddp_logging_data().get("num_buckets_reduced"), "paths": _paths_taken()}


def _paths_taken() -> dict[str, Any]:
    """What this node's daemon says the job's ops went through: bytes by path and ops by lane (its
    own), and the all-reduces of each group's exchange ring (shared memory, never through it)."""
    from commd.client.status import query_status
    from commd.torch_backend.process_group import current_client

    status = query_status(current_client().paths, timeout=10.0)
    return {"bytes_by_path": status.get("bytes_by_path"), "ops_by_lane": status.get("ops_by_lane"),
            "ring_allreduces": {group: row["ops"] for group, row in (status.get("rings") or {}).items()}}


def plain_ddp_from(rank: int, world: int, init_method: str, snapshot: dict[str, Any], steps: int,
                   data_rank: int, inputs: int = 32) -> dict[str, Any]:
    """A fault-free DDP job of ``world`` ranks started from ``snapshot`` (as ``guarded_with_snapshot``
    took it): steps ``snapshot["step"]`` to ``steps - 1`` on ``data_rank``'s batches."""
    from datetime import timedelta

    import torch.distributed as dist
    from torch.nn.parallel import DistributedDataParallel

    dist.init_process_group("commd", init_method=init_method, rank=rank, world_size=world,
                            timeout=timedelta(seconds=60))
    module = tiny_mlp(inputs)
    module.load_state_dict(snapshot["model"])
    model = DistributedDataParallel(module, **TINY_DDP_KWARGS)
    optimizer = torch.optim.SGD(model.parameters(), lr=LR, momentum=MOMENTUM)
    optimizer.load_state_dict(snapshot["optimizer"])
    for step in range(snapshot["step"], steps):
        optimizer.zero_grad(set_to_none=True)
        loss_of(model, tiny_batch(step, data_rank, inputs)).backward()
        optimizer.step()
    return {"params": [p.detach().clone() for p in model.module.parameters()],
            "buckets": model._get_ddp_logging_data().get("num_buckets_reduced"), "paths": _paths_taken()}


# ---- randomized fault injection (tests/test_ft_random.py) ---------------------------------
#: Where a victim of the randomized test dies: before its forward, in its backward (the later
#: layers' bucket submitted), after the commit (before its optimizer step), after its optimizer
#: step, or during a recovery (in or around the guard's agreement all-reduce or optimizer check).
KILL_POINTS = ("forward", "backward", "commit", "optimizer", "recovery")


def reference_of(steps: int, world: int, recoveries: list[tuple[int, list[int]]]) -> list[torch.Tensor]:
    """``reference`` for any membership schedule: ``recoveries`` lists (step redone, survivors from
    it on) in order; every rank takes part before the first."""
    members_at = {0: list(range(world))}
    for redone, survivors in recoveries:
        members_at[redone] = list(survivors)
    return reference_with_members(steps, members_at)


def faulted_training(rank: int, world: int, store: tuple[str, int], steps: int, plan: dict[str, Any] | None,
                     recover_timeout: float) -> dict[str, Any]:
    """``steps`` guarded DDP steps of ``mlp``; with a ``plan`` (``{"point", "step"}``, and for the
    point "recovery" ``{"hook": "_union_of_views" | "_check_states", "nth", "when":
    "before" | "after"}``) this rank SIGKILLs itself there.  ``store``: ("tcp", port) for a
    ``tcp://`` init (rank 0 hosts the store) or ("client", port) for a store the test hosts."""
    import logging
    from datetime import timedelta

    import torch.distributed as dist
    from torch.nn.parallel import DistributedDataParallel

    import commd.ft

    logging.basicConfig(level=logging.WARNING, format=f"%(asctime)s rank {rank} %(name)s: %(message)s")
    timeout = timedelta(seconds=min(60.0, recover_timeout))
    kind, port = store
    if kind == "tcp":
        dist.init_process_group("commd", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world,
                                timeout=timeout)
    else:
        client = dist.TCPStore("127.0.0.1", port, world, is_master=False, timeout=timeout)
        dist.init_process_group("commd", store=client, rank=rank, world_size=world, timeout=timeout)
    model = DistributedDataParallel(mlp(), **DDP_KWARGS)
    optimizer = torch.optim.SGD(model.parameters(), lr=LR, momentum=MOMENTUM)
    guard = commd.ft.Guard(model, optimizer, ddp_kwargs=DDP_KWARGS, recover_timeout=recover_timeout)
    first_layer = model.module[0].weight
    now = {"step": -1}
    point = plan["point"] if plan else None

    def kill(step: int, where: str) -> None:
        if point == where and step == plan["step"]:
            logging.getLogger("ft-random").warning("SIGKILL self at step %d, %s", step, where)
            sigkill_self()

    if point == "commit":
        optimizer.register_step_pre_hook(lambda *_: kill(now["step"], "commit"))
    elif point == "optimizer":
        optimizer.register_step_post_hook(lambda *_: kill(now["step"], "optimizer"))
    elif point == "recovery":
        real = getattr(guard, plan["hook"])
        calls = [0]

        def hooked(*args: Any) -> Any:
            calls[0] += 1
            dies = calls[0] == plan["nth"]
            if dies and plan["when"] == "before":
                logging.getLogger("ft-random").warning("SIGKILL self before %s call %d", plan["hook"], calls[0])
                sigkill_self()
            out = real(*args)
            if dies:
                logging.getLogger("ft-random").warning("SIGKILL self after %s call %d", plan["hook"], calls[0])
                sigkill_self()
            return out

        setattr(guard, plan["hook"], hooked)

    real_recover = guard._recover

    def recover(error: BaseException, *args: Any, **kwargs: Any) -> Any:  # the log says what each recovery began with
        logging.getLogger("ft-random").warning("step %d failed, recovering: %s: %s", now["step"],
                                               type(error).__name__, str(error)[:500])
        return real_recover(error, *args, **kwargs)

    guard._recover = recover

    def train_step(ddp: Any, step: int) -> float:
        kill(step, "forward")
        handle = first_layer.register_hook(lambda grad: kill(step, "backward"))
        try:
            loss = loss_of(ddp, batch(step, rank))
            loss.backward()
        finally:
            handle.remove()
        return float(loss)

    for step in range(steps):
        now["step"] = step
        guard.step(train_step, step)
    return {"params": [p.detach().clone() for p in guard.model.module.parameters()],
            "recoveries": [(r.step, list(r.gone), list(r.survivors), r.seconds, r.error) for r in guard.recoveries]}


# ---- the coordinator's death (tests/test_ft_coordinator.py) -------------------------------
def ft_coordinator_death(ctx: Any, store_port: int, steps: int, pause_step: int, pausers: list[int],
                         dump_after: float) -> dict[str, Any]:
    """Guarded training on the test's simulated nodes, the job's store hosted by the test; at
    ``pause_step`` every rank says so, and the ranks in ``pausers`` then wait for the test's word
    before their forward (so the others are in that step's all-reduces when the test strikes).
    Returns how it ended: the error (and when, time.time()) or the steps done, and the recoveries;
    a rank still running ``dump_after`` seconds after its start prints its threads' stacks."""
    import faulthandler
    import logging
    import time
    from datetime import timedelta

    import torch.distributed as dist
    from torch.nn.parallel import DistributedDataParallel

    import commd.ft

    logging.basicConfig(level=logging.WARNING, format=f"%(asctime)s rank {ctx.rank} %(name)s: %(message)s")
    faulthandler.dump_traceback_later(dump_after, exit=False)  # where a rank that hangs is stuck
    os.environ["COMMD_JOB"] = ctx.job  # the test's daemons
    timeout = timedelta(seconds=60)
    store = dist.TCPStore("127.0.0.1", store_port, ctx.world_size, is_master=False, timeout=timeout)
    dist.init_process_group("commd", store=store, rank=ctx.rank, world_size=ctx.world_size, timeout=timeout)
    model = DistributedDataParallel(mlp(), **DDP_KWARGS)
    optimizer = torch.optim.SGD(model.parameters(), lr=LR, momentum=MOMENTUM)
    guard = commd.ft.Guard(model, optimizer, ddp_kwargs=DDP_KWARGS)
    paused = []

    def train_step(ddp: Any, step: int) -> float:
        if step == pause_step and not paused:
            paused.append(step)
            ctx.event("at pause step")
            if ctx.rank in pausers:
                ctx.command()
        loss = loss_of(ddp, batch(step, ctx.rank))
        loss.backward()
        return float(loss)

    out: dict[str, Any] = {}
    try:
        for step in range(steps):
            guard.step(train_step, step)
    except BaseException as exc:  # the test judges it
        out["error"] = f"{type(exc).__name__}: {exc}"
    faulthandler.cancel_dump_traceback_later()
    out.update(at=time.time(), steps=guard.steps,
               recoveries=[(r.step, list(r.gone), list(r.survivors), r.seconds) for r in guard.recoveries])
    return out
