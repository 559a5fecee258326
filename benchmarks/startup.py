"""Start-up costs: `commd --help`, `commd status`, an auto-started daemon, init_process_group vs Gloo.

Every measurement runs in fresh processes (a warm start would hide the import
cost being measured); the kinds are interleaved round by round so they see the
same machine load, and medians are printed beside the minimum and maximum.

    .venv/bin/python benchmarks/startup.py --rounds 10
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import statistics
import subprocess
import sys
import tempfile
import time
import uuid
from pathlib import Path

PY = sys.executable
RANK_PROGRAM = """
import json, os, sys, time
backend, rank, world, store, barrier = sys.argv[1], int(sys.argv[2]), int(sys.argv[3]), sys.argv[4], sys.argv[5]
import torch
import torch.distributed as dist
if backend == "commd":
    import commd  # noqa: F401
open(os.path.join(barrier, f"ready{rank}"), "w").close()
while not all(os.path.exists(os.path.join(barrier, f"ready{r}")) for r in range(world)):
    time.sleep(0.001)
start = time.perf_counter()
dist.init_process_group(backend, init_method=f"file://{store}", rank=rank, world_size=world)
took = time.perf_counter() - start
t = torch.ones(4)
dist.all_reduce(t)
assert t[0].item() == world, t
dist.destroy_process_group()
print(json.dumps({"init_s": took}))
"""
DAEMON_PROGRAM = """
import signal, sys, time, uuid
from commd.client.spawn import start_daemon
from commd.runtime import JobPaths
paths = JobPaths.for_job("startup-" + uuid.uuid4().hex[:8])
start = time.perf_counter()
daemon = start_daemon(paths, exit_when_idle=False)
print(time.perf_counter() - start)
daemon.send_signal(signal.SIGTERM)
daemon.wait(30)
"""


def _run(cmd: list[str], env: dict[str, str], timeout: float = 120.0) -> subprocess.CompletedProcess:
    done = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=timeout)
    if done.returncode != 0:
        raise SystemExit(f"{' '.join(cmd[:4])} failed ({done.returncode}):\n{done.stderr[-2000:]}")
    return done


def _wall(cmd: list[str], env: dict[str, str]) -> float:
    start = time.perf_counter()
    _run(cmd, env)
    return time.perf_counter() - start


def _init(backend: str, env: dict[str, str], scratch: Path) -> float:
    """init_process_group of 2 fresh ranks (file:// store); the slower rank's time."""
    work = Path(tempfile.mkdtemp(dir=scratch))
    program = work / "rank.py"
    program.write_text(RANK_PROGRAM)
    procs = [subprocess.Popen([PY, str(program), backend, str(r), "2", str(work / "store"), str(work)], env=env,
                              stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True) for r in range(2)]
    outs = [p.communicate(timeout=180) for p in procs]
    for proc, (_out, err) in zip(procs, outs, strict=True):
        if proc.returncode != 0:
            raise SystemExit(f"{backend} rank failed:\n{err[-2000:]}")
    return max(json.loads(out.strip().splitlines()[-1])["init_s"] for out, _ in outs)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=10, help="measurements of each kind (default 10)")
    args = parser.parse_args()
    if not 1 <= args.rounds <= 1000:
        parser.error("--rounds must lie in [1, 1000]")
    scratch = Path(tempfile.mkdtemp(prefix="cm-startup-", dir="/tmp"))
    env = dict(os.environ, COMMD_RUNTIME_DIR=str(scratch))
    for name in ("COMMD_JOB", "COMMD_SECRET", "COMMD_SECRET_FILE"):
        env.pop(name, None)
    job = "startup-status-" + uuid.uuid4().hex[:8]
    daemon = subprocess.Popen([PY, "-m", "commd", "daemon", "--job", job], env=env,
                              stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    results: dict[str, list[float]] = {}
    try:
        deadline = time.monotonic() + 60
        while subprocess.run([PY, "-m", "commd", "status", "--job", job], env=env,
                             capture_output=True).returncode != 0:
            if time.monotonic() > deadline or daemon.poll() is not None:
                raise SystemExit("the status daemon did not come up")
            time.sleep(0.2)
        for i in range(args.rounds):
            results.setdefault("commd --help", []).append(_wall([PY, "-m", "commd", "--help"], env))
            results.setdefault("commd status (running daemon)", []).append(
                _wall([PY, "-m", "commd", "status", "--job", job], env))
            results.setdefault("auto-started daemon answers", []).append(
                float(_run([PY, "-c", DAEMON_PROGRAM], env).stdout.split()[-1]))
            results.setdefault("init_process_group commd, 2 ranks", []).append(_init("commd", env, scratch))
            results.setdefault("init_process_group gloo, 2 ranks", []).append(_init("gloo", env, scratch))
            print(f"round {i + 1}/{args.rounds}", file=sys.stderr, flush=True)
    finally:
        daemon.send_signal(signal.SIGTERM)
        daemon.wait(30)
    print(f"load average at the end (1 min): {os.getloadavg()[0]:.2f}")
    for name, values in results.items():
        print(f"{name:38s} median {statistics.median(values) * 1000:7.0f} ms   "
              f"min {min(values) * 1000:6.0f}   max {max(values) * 1000:6.0f}   n={len(values)}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
