"""One rank of the DDP benchmark (started by benchmarks/ddp.py), and the model and data every path shares.

Usage: ``python benchmarks/_ddp_worker.py CONFIG.json RANK`` for the ``commd`` and ``gloo`` paths;
``mpiexec -n N python benchmarks/_ddp_worker.py CONFIG.json`` for ``mpi`` (the rank comes from MPI).

Every path trains the same MLP on the same batches with DistributedDataParallel:

  commd  ``init_process_group("commd")``, DDP's own all-reduce on its gradient buckets
         (ordinary tensors: what a user's training script does);
  gloo   the same with Gloo;
  mpi    a Gloo process group for DDP's set-up (the parameter broadcast) and a comm hook that
         all-reduces each bucket with mpi4py (torch's pip wheel has no MPI backend).

After each timed DDP step every rank trains a plain copy of the model without DDP on the same
batch, all ranks at once: the step time without communication under the same CPU contention,
which ``ddp.py`` subtracts to get the communication DDP could not hide.  The mpi hook, and with
``hook_timing`` a timing copy of torch's default all-reduce hook on commd and Gloo, also note
how long an all-reduce was in flight in each step.
Each rank writes its times, losses and final parameters; rank 0 of ``commd`` also writes the
daemon's status after the first steps and at the end (its buffer counters).
"""

from __future__ import annotations

import copy
import json
import os
import sys
import time
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist
import torch.nn as nn

#: Every path and the single-process reference start from this seed and use plain SGD at this rate.
LEARNING_RATE = 0.01


def build_model(model: dict[str, int], seed: int) -> nn.Sequential:
    """inputs -> width x layers (ReLU) -> 1; the same parameters for the same seed."""
    torch.manual_seed(seed)
    mods: list[nn.Module] = [nn.Linear(model["inputs"], model["width"]), nn.ReLU()]
    for _ in range(model["layers"] - 1):
        mods += [nn.Linear(model["width"], model["width"]), nn.ReLU()]
    mods.append(nn.Linear(model["width"], 1))
    return nn.Sequential(*mods)


def make_batches(model: dict[str, int], batch: int, steps: int, seed: int, rank: int) -> list[tuple[Any, Any]]:
    """Rank ``rank``'s batch of each step: a fixed regression target, the same on every path."""
    teacher = torch.Generator().manual_seed(seed + 12345)
    w = torch.randn(model["inputs"], 16, generator=teacher) / model["inputs"] ** 0.5
    g = torch.Generator().manual_seed(seed * 1000 + rank)
    out = []
    for _ in range(steps):
        x = torch.randn(batch, model["inputs"], generator=g)
        out.append((x, torch.tanh(x @ w).sum(dim=1, keepdim=True) / 4))
    return out


def train_step(model: nn.Module, opt: torch.optim.Optimizer, x: torch.Tensor, y: torch.Tensor) -> float:
    opt.zero_grad(set_to_none=True)
    loss = nn.functional.mse_loss(model(x), y)
    loss.backward()  # DDP's bucketed all-reduces run during this and finish inside it
    opt.step()
    return float(loss.detach())


def _mpi_hook(comm: Any, world: int, spans: list[tuple[float, float]]) -> Any:
    """A DDP comm hook: average each gradient bucket with mpi4py's in-place Allreduce (blocking)."""

    # No annotations: DDP compares them with dist.GradBucket, and this module's are strings.
    def hook(_state, bucket):  # noqa: ANN001, ANN202
        from mpi4py import MPI

        buf = bucket.buffer()
        buf.div_(world)  # as torch's default hook: divide, then sum
        started = time.perf_counter()
        comm.Allreduce(MPI.IN_PLACE, buf.numpy(), op=MPI.SUM)
        spans.append((started, time.perf_counter()))
        fut: torch.futures.Future[torch.Tensor] = torch.futures.Future()
        fut.set_result(buf)
        return fut

    return hook


def _timed_allreduce_hook(world: int, spans: list[tuple[float, float]]) -> Any:
    """torch's default all-reduce hook (divide, all_reduce on the process group), noting when each bucket's ends."""

    def hook(_state, bucket):  # noqa: ANN001, ANN202 - see _mpi_hook
        buf = bucket.buffer()
        buf.div_(world)
        started = time.perf_counter()

        def finished(fut: torch.futures.Future[Any]) -> torch.Tensor:
            spans.append((started, time.perf_counter()))
            value = fut.value()
            return value[0] if isinstance(value, list) else value

        return dist.all_reduce(buf, async_op=True).get_future().then(finished)

    return hook


def in_flight(spans: list[tuple[float, float]]) -> float:
    """Seconds during which at least one of the spans was open (their union's length)."""
    total, end = 0.0, float("-inf")
    for start, stop in sorted(spans):
        if stop > end:
            total += stop - max(start, end)
            end = stop
    return total


def _status(job: str) -> dict[str, Any]:
    from commd.client.status import StatusError, query_status
    from commd.runtime import JobPaths

    try:
        return query_status(JobPaths.for_job(job), timeout=10.0)
    except StatusError as exc:
        return {"error": str(exc)}


def run(cfg: dict[str, Any], rank: int) -> dict[str, Any]:
    path, world = cfg["path"], cfg["nproc"]
    torch.set_num_threads(cfg["threads"])
    comm = None
    if path == "mpi":
        from mpi4py import MPI

        comm = MPI.COMM_WORLD
    backend = "commd" if path == "commd" else "gloo"
    if backend == "commd":
        os.environ["COMMD_JOB"] = cfg["job"]  # the daemon the benchmark started
        import commd  # noqa: F401  (registers the backend)
    dist.init_process_group(backend, init_method=f"tcp://127.0.0.1:{cfg['port']}", rank=rank, world_size=world,
                            timeout=timedelta(seconds=cfg["op_timeout"]))
    model = build_model(cfg["model"], cfg["seed"])
    # The same steps without DDP: the compute time under the same contention (copied before DDP hooks the model).
    local = copy.deepcopy(model)
    ddp = nn.parallel.DistributedDataParallel(model, bucket_cap_mb=cfg["bucket_mb"])
    spans: list[tuple[float, float]] = []
    timed = comm is not None or cfg["hook_timing"]
    if comm is not None:
        ddp.register_comm_hook(None, _mpi_hook(comm, world, spans))
    elif cfg["hook_timing"]:
        ddp.register_comm_hook(None, _timed_allreduce_hook(world, spans))
    opt = torch.optim.SGD(ddp.parameters(), lr=LEARNING_RATE)
    local_opt = torch.optim.SGD(local.parameters(), lr=LEARNING_RATE)
    total = cfg["warmup"] + cfg["steps"]
    batches = make_batches(cfg["model"], cfg["batch"], total, cfg["seed"], rank)
    step_times, compute_times, losses, in_flight_s, statuses = [], [], [], [], {}
    dist.barrier()
    for step, (x, y) in enumerate(batches, start=1):
        spans.clear()
        started = time.perf_counter()
        losses.append(train_step(ddp, opt, x, y))
        step_times.append(time.perf_counter() - started)
        in_flight_s.append(in_flight(spans))
        if path == "commd" and rank == 0 and step <= cfg["status_steps"]:
            statuses[str(step)] = _status(cfg["job"])
        if step >= cfg["warmup"]:
            # Right after each DDP step (the ranks leave it together), the same step without DDP:
            # paired steps see the same load, however the machine's load drifts during the run.
            started = time.perf_counter()
            train_step(local, local_opt, x, y)
            compute_times.append(time.perf_counter() - started)
    dist.barrier()
    if path == "commd" and rank == 0:
        statuses["end"] = _status(cfg["job"])
    params = [p.detach().clone() for p in model.parameters()]
    torch.save(params, cfg["params_out"].format(rank=rank))
    dist.destroy_process_group()
    if backend == "commd":
        from commd.torch_backend.process_group import current_client

        current_client().close()
    return {"rank": rank, "step_times": step_times, "losses": losses, "compute_times": compute_times[1:],
            "in_flight_s": in_flight_s if timed else None, "status": statuses}


def main() -> None:
    with open(sys.argv[1]) as f:
        cfg = json.load(f)
    if cfg["path"] == "mpi":
        from mpi4py import MPI

        rank = MPI.COMM_WORLD.Get_rank()
        if MPI.COMM_WORLD.Get_size() != cfg["nproc"]:
            raise SystemExit(f"mpiexec started {MPI.COMM_WORLD.Get_size()} ranks, the plan wants {cfg['nproc']}")
    else:
        rank = int(sys.argv[2])
    result = run(cfg, rank)
    out = cfg["out"].format(rank=rank)
    tmp = f"{out}.tmp{os.getpid()}"
    with open(tmp, "w") as f:
        json.dump(result, f)
    os.replace(tmp, out)
    if cfg["path"] == "mpi":
        # Every rank's file is written before any rank leaves: mpiexec may kill the others
        # as soon as one process exits, and os._exit below skips mpi4py's own MPI_Finalize.
        from mpi4py import MPI

        MPI.COMM_WORLD.Barrier()
        MPI.Finalize()
    # Skip the interpreter's teardown: a torch C++ destructor at exit sometimes aborts
    # a finished Gloo process (see commd/cli/demo.py).
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)


if __name__ == "__main__":
    main()
