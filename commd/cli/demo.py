"""`commd demo`: the same small DDP training run through commd and through Gloo.

Shows in well under a minute that commd is a drop-in backend (the per-step
losses of both runs match), what it costs or saves per step, the all-reduce
bandwidth each backend reaches at DDP's bucket size, and what `commd status`
reports about the run.  Everything is bounded in time: each backend's run has
a deadline after which its workers are killed, and every collective has a
timeout, so the demo cannot hang.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import sys
import tempfile
import time
import uuid
from dataclasses import dataclass
from datetime import timedelta
from pathlib import Path
from typing import Any

from commd.cli.launch import stop_daemon
from commd.cli.status import format_status, human_bytes
from commd.client.status import StatusError, query_status
from commd.runtime import free_port

BACKENDS = ("commd", "gloo")
#: DDP's default bucket_cap_mb: the size of the all-reduces DDP issues.
DDP_BUCKET_BYTES = 25 * 1024 * 1024
IN_FEATURES = 256
#: Losses of the two runs that differ by more than this (relative) are a bug.
LOSS_RTOL = 1e-3
#: How long finished commd workers stay connected for the status snapshot.
STATUS_WAIT_S = 15.0


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--nproc", type=int, default=2, help="worker processes (default 2)")
    parser.add_argument("--steps", type=int, default=20, help="training steps (default 20)")
    parser.add_argument("--backend", choices=("commd", "gloo", "both"), default="both",
                        help="which backend(s) to run (default both)")
    parser.add_argument("--size", type=int, default=1024,
                        help="hidden width of the MLP (default 1024: about 2.4M parameters)")
    parser.add_argument("--layers", type=int, default=3, help="hidden layers (default 3)")
    parser.add_argument("--batch", type=int, default=64, help="samples per rank and step (default 64)")
    parser.add_argument("--bench-iters", type=int, default=5,
                        help="timed all_reduce calls per backend (default 5)")
    parser.add_argument("--timeout", type=float, default=90.0,
                        help="seconds each backend's run may take before it is killed (default 90)")
    parser.add_argument("--seed", type=int, default=0, help="seed of the model's weights and data (default 0)")


@dataclass
class RunConfig:
    backend: str
    nproc: int
    steps: int
    size: int
    layers: int
    batch: int
    bench_iters: int
    seed: int
    port: int
    job: str
    result_dir: str
    op_timeout: float
    threads: int


# ---- worker side (runs in the spawned processes) -------------------------------
def _build_model(size: int, layers: int) -> Any:
    import torch.nn as nn

    mods: list[nn.Module] = [nn.Linear(IN_FEATURES, size), nn.ReLU()]
    for _ in range(layers - 1):
        mods += [nn.Linear(size, size), nn.ReLU()]
    mods.append(nn.Linear(size, 1))
    return nn.Sequential(*mods)


def _make_data(cfg: RunConfig, rank: int) -> list[tuple[Any, Any]]:
    """Synthetic regression, y = sum(tanh(x @ w)) / 4 + noise: the same on every run."""
    import torch

    teacher = torch.Generator().manual_seed(cfg.seed + 12345)
    w = torch.randn(IN_FEATURES, 16, generator=teacher) / IN_FEATURES**0.5
    g = torch.Generator().manual_seed(cfg.seed * 1000 + rank)
    batches = []
    for _ in range(cfg.steps):
        x = torch.randn(cfg.batch, IN_FEATURES, generator=g)
        y = torch.tanh(x @ w).sum(dim=1, keepdim=True) / 4 + 0.01 * torch.randn(cfg.batch, 1, generator=g)
        batches.append((x, y))
    return batches


def _bench_allreduce(nbytes: int, iters: int, arena: bool) -> float:
    """Median seconds of one all_reduce of ``nbytes`` float32 (after warm-up)."""
    import torch
    import torch.distributed as dist

    numel = max(1, nbytes // 4)
    if arena:
        import commd

        tensor = commd.empty(numel)
        tensor.fill_(1.0)
    else:
        tensor = torch.ones(numel)
    for _ in range(2):
        dist.all_reduce(tensor)
    times = []
    for _ in range(iters):
        dist.barrier()
        start = time.perf_counter()
        dist.all_reduce(tensor)
        times.append(time.perf_counter() - start)
    # The slowest rank defines the collective's time.
    t = torch.tensor([statistics.median(times)], dtype=torch.float64)
    dist.all_reduce(t, op=dist.ReduceOp.MAX)
    return float(t.item())


def _worker(rank: int, cfg: RunConfig, ready: Any, release: Any) -> None:
    """One rank of one backend's run; rank 0 writes the results as JSON.

    For commd, once every rank is done rank 0 sets ``ready`` and all ranks
    stay connected until the parent has taken the daemon's status and set
    ``release`` (bounded), so the snapshot shows the clients and no stray op.
    """
    import torch
    import torch.distributed as dist
    from torch.nn.parallel import DistributedDataParallel

    torch.set_num_threads(cfg.threads)
    if cfg.backend == "commd":
        os.environ["COMMD_JOB"] = cfg.job  # use the demo's daemon
        import commd  # noqa: F401  (registers the backend)
    dist.init_process_group(
        cfg.backend, init_method=f"tcp://127.0.0.1:{cfg.port}", rank=rank, world_size=cfg.nproc,
        timeout=timedelta(seconds=cfg.op_timeout),
    )
    try:
        torch.manual_seed(cfg.seed)
        model = _build_model(cfg.size, cfg.layers)
        ddp = DistributedDataParallel(model)
        opt = torch.optim.SGD(ddp.parameters(), lr=0.02, momentum=0.9)
        loss_fn = torch.nn.MSELoss()
        data = _make_data(cfg, rank)
        losses, step_times = [], []
        for x, y in data:
            start = time.perf_counter()
            opt.zero_grad(set_to_none=True)
            loss = loss_fn(ddp(x), y)
            loss.backward()  # DDP's bucketed all-reduces overlap with this and finish inside it
            opt.step()
            step_times.append(time.perf_counter() - start)
            losses.append(loss.item())
        grad_bytes = sum(p.numel() * p.element_size() for p in model.parameters())
        bench_bytes = min(DDP_BUCKET_BYTES, grad_bytes)
        bench = {"regular": _bench_allreduce(bench_bytes, cfg.bench_iters, arena=False)}
        if cfg.backend == "commd":
            bench["arena"] = _bench_allreduce(bench_bytes, cfg.bench_iters, arena=True)
        if rank == 0:
            result = {
                "backend": cfg.backend, "losses": losses, "step_times": step_times,
                "params": sum(p.numel() for p in model.parameters()), "grad_bytes": grad_bytes,
                "bench_bytes": bench_bytes, "bench": bench,
            }
            path = Path(cfg.result_dir) / f"{cfg.backend}.json"
            tmp = path.with_suffix(".tmp")
            tmp.write_text(json.dumps(result))
            tmp.rename(path)
        if ready is not None:
            dist.barrier()  # every rank is done, still connected, nothing in flight
            if rank == 0:
                ready.set()
            release.wait(STATUS_WAIT_S)
    finally:
        dist.destroy_process_group()
    if cfg.backend == "commd":
        from commd.torch_backend.process_group import current_client

        current_client().close()  # what the atexit hook would do
    # Skip the interpreter's teardown: with gloo, a torch C++ destructor at exit
    # sometimes aborts the process ("terminate called without an active
    # exception", about 1 run in 10 on a 2-core machine) after all work is done.
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)


# ---- parent side -------------------------------------------------------------------
def _run_workers(cfg: RunConfig, deadline_s: float, snapshot: dict[str, Any]) -> str | None:
    """Spawn the ranks of one run and wait (bounded); returns an error text or None.

    For commd, ``snapshot["status"]`` receives the daemon's status, taken
    while the finished workers are still connected.
    """
    import torch.multiprocessing as mp

    spawn = mp.get_context("spawn")
    ready, release = (spawn.Event(), spawn.Event()) if cfg.backend == "commd" else (None, None)
    ctx = mp.start_processes(_worker, args=(cfg, ready, release), nprocs=cfg.nproc, join=False,
                             start_method="spawn")
    deadline = time.monotonic() + deadline_s
    try:
        while not ctx.join(timeout=0.1):
            if ready is not None and ready.is_set() and not release.is_set():
                from commd.runtime import JobPaths

                try:
                    snapshot["status"] = query_status(JobPaths.for_job(cfg.job), timeout=5.0)
                except StatusError as exc:
                    snapshot["status"] = {"error": str(exc)}
                release.set()
            if time.monotonic() > deadline:
                return f"{cfg.backend} run did not finish within {deadline_s:g}s; killed its workers"
    except Exception as exc:  # ProcessRaisedException / ProcessExitedException
        return f"{cfg.backend} run failed: {str(exc).strip()}"
    finally:
        for p in ctx.processes:
            if p.is_alive():
                p.terminate()
                p.join(5)
                if p.is_alive():
                    p.kill()
                    p.join(5)
    return None


def _run_backend(cfg: RunConfig, deadline_s: float) -> dict[str, Any] | str:
    """One backend's run; for commd with its own daemon, stopped afterwards."""
    daemon = None
    paths = None
    try:
        if cfg.backend == "commd":
            from commd.client.spawn import start_daemon
            from commd.runtime import JobPaths, new_secret

            paths = JobPaths.for_job(cfg.job)
            daemon = start_daemon(paths, new_secret(), exit_when_idle=False,
                                  extra_args=["--op-timeout", repr(cfg.op_timeout), "--owner-pid", str(os.getpid())],
                                  timeout=min(60.0, deadline_s))
        snapshot: dict[str, Any] = {}
        error = _run_workers(cfg, deadline_s, snapshot)
        if error:
            return error
        path = Path(cfg.result_dir) / f"{cfg.backend}.json"
        if not path.exists():
            return f"{cfg.backend} run wrote no results"
        result = json.loads(path.read_text())
        result["status"] = snapshot.get("status")
        return result
    except Exception as exc:
        return f"{cfg.backend} run failed: {exc}"
    finally:
        if daemon is not None:
            code = stop_daemon(daemon)
            if code == 0 and paths is not None:
                shutil.rmtree(paths.directory, ignore_errors=True)
            elif paths is not None:
                print(f"commd demo: the daemon exited with code {code}; logs in {paths.directory}",
                      file=sys.stderr)


def _steady(times: list[float]) -> list[float]:
    """Step times without the first steps (allocator, DDP bucket rebuild, thread start)."""
    skip = min(2, max(0, len(times) - 1))
    return times[skip:]


def _ms(seconds: float) -> str:
    return f"{seconds * 1e3:.1f} ms"


def _gbps(nbytes: int, seconds: float) -> float:
    return nbytes / seconds / 1e9 if seconds > 0 else float("nan")


def _report(results: dict[str, dict[str, Any]], nproc: int) -> int:
    """Print the comparison; returns 1 if the two runs' losses disagree."""
    names = list(results)
    code = 0
    steps = max(len(r["losses"]) for r in results.values())
    print()
    print("step  " + "".join(f"{n + ' loss':>16}" for n in names) + ("   rel. diff" if len(names) == 2 else "")
          + "".join(f"{n + ' time':>14}" for n in names))
    worst = 0.0
    for i in range(steps):
        vals = [results[n]["losses"][i] for n in names]
        line = f"{i:>4}  " + "".join(f"{v:>16.6f}" for v in vals)
        if len(vals) == 2:
            diff = abs(vals[0] - vals[1]) / max(abs(vals[1]), 1e-12)
            worst = max(worst, diff)
            line += f"   {diff:9.1e}"
        line += "".join(f"{_ms(results[n]['step_times'][i]):>14}" for n in names)
        print(line)
    if len(names) == 2:
        verdict = "match" if worst <= LOSS_RTOL else "DO NOT MATCH"
        print(f"losses {verdict} (largest relative difference {worst:.1e}, tolerance {LOSS_RTOL:.0e})")
        if worst > LOSS_RTOL:
            code = 1

    bench_bytes = next(iter(results.values()))["bench_bytes"]
    factor = 2 * (nproc - 1) / nproc
    print()
    print(f"{'':34}" + "".join(f"{n:>14}" for n in names))
    step_mean = {n: statistics.mean(_steady(results[n]["step_times"])) for n in names}
    step_median = {n: statistics.median(_steady(results[n]["step_times"])) for n in names}
    print(f"{'step time (mean, steady state)':34}" + "".join(f"{_ms(step_mean[n]):>14}" for n in names))
    print(f"{'step time (median)':34}" + "".join(f"{_ms(step_median[n]):>14}" for n in names))
    t_ar = {n: results[n]["bench"]["regular"] for n in names}
    print(f"{'all_reduce ' + human_bytes(bench_bytes) + ' time':34}" + "".join(f"{_ms(t_ar[n]):>14}" for n in names))
    algbw = {n: _gbps(bench_bytes, t_ar[n]) for n in names}
    print(f"{'  algbw':34}" + "".join(f"{algbw[n]:>9.2f} GB/s" for n in names))
    print(f"{'  busbw = algbw * 2(n-1)/n':34}" + "".join(f"{algbw[n] * factor:>9.2f} GB/s" for n in names))
    if "commd" in results and "arena" in results["commd"]["bench"]:
        t = results["commd"]["bench"]["arena"]
        bw = _gbps(bench_bytes, t)
        print(f"commd all_reduce on an arena tensor (commd.empty, zero-copy): {_ms(t)}, "
              f"algbw {bw:.2f} GB/s, busbw {bw * factor:.2f} GB/s")
    if len(names) == 2 and "commd" in results and "gloo" in results:
        print(f"speedup of commd over gloo: step time x{step_mean['gloo'] / step_mean['commd']:.2f}, "
              f"all_reduce bandwidth x{algbw['commd'] / algbw['gloo']:.2f}")
    status = results.get("commd", {}).get("status")
    if status is not None:
        print()
        print("commd daemon status at the end of the commd run (before its workers exited):")
        if "error" in status:
            print(f"  (not available: {status['error']})")
        else:
            print(format_status(status))
    return code


def _validate(args: argparse.Namespace) -> str | None:
    checks = [
        (args.nproc >= 1, "--nproc must be at least 1"),
        (args.nproc <= 64, "--nproc above 64 makes no sense for a local demo"),
        (args.steps >= 1, "--steps must be at least 1"),
        (args.size >= 1, "--size must be at least 1"),
        (args.layers >= 1, "--layers must be at least 1"),
        (args.batch >= 1, "--batch must be at least 1"),
        (args.bench_iters >= 1, "--bench-iters must be at least 1"),
        (args.timeout > 0, "--timeout must be positive"),
    ]
    for ok, message in checks:
        if not ok:
            return message
    return None


def run(args: argparse.Namespace) -> int:
    error = _validate(args)
    if error:
        print(f"commd demo: {error}", file=sys.stderr)
        return 2
    backends = BACKENDS if args.backend == "both" else (args.backend,)
    threads = max(1, (os.cpu_count() or 1) // args.nproc)
    params = sum(
        a * b + b for a, b in
        [(IN_FEATURES, args.size)] + [(args.size, args.size)] * (args.layers - 1) + [(args.size, 1)]
    )
    print(f"commd demo: DDP training of a {params:,}-parameter MLP ({human_bytes(params * 4)} of gradients) "
          f"on {args.nproc} processes, {args.steps} steps, batch {args.batch} per rank, "
          f"{threads} thread(s) per worker; backends: {', '.join(backends)}")
    results: dict[str, dict[str, Any]] = {}
    code = 0
    result_dir = tempfile.mkdtemp(prefix="commd-demo-")
    try:
        for backend in backends:
            cfg = RunConfig(
                backend=backend, nproc=args.nproc, steps=args.steps, size=args.size, layers=args.layers,
                batch=args.batch, bench_iters=args.bench_iters, seed=args.seed, port=free_port("127.0.0.1"),
                job=f"demo-{uuid.uuid4().hex[:12]}", result_dir=result_dir,
                op_timeout=min(30.0, args.timeout), threads=threads,
            )
            start = time.monotonic()
            print(f"running {backend} ...", flush=True)
            outcome = _run_backend(cfg, args.timeout)
            if isinstance(outcome, str) and "in use" in outcome.lower():
                # Another process took the free port we picked (it is only free
                # when picked): once more with a fresh one.
                cfg.port = free_port("127.0.0.1")
                outcome = _run_backend(cfg, args.timeout)
            if isinstance(outcome, str):
                print(f"commd demo: {outcome}", file=sys.stderr)
                code = 1
                continue
            results[backend] = outcome
            print(f"  {backend} done in {time.monotonic() - start:.1f}s", flush=True)
    finally:
        shutil.rmtree(result_dir, ignore_errors=True)
    if results:
        code = max(code, _report(results, args.nproc))
    return code

