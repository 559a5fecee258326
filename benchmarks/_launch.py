"""Run one worker script under `commd launch`, on this host or one launcher per simulated host, and wait.

Shared by the benchmarks that start whole jobs per setting (small_ops.py,
ddp_lanes.py): the worker gets a JSON config file whose ``out`` names the file
rank 0 writes; every launcher is bounded by ``timeout`` and killed after it.
"""

from __future__ import annotations

import json
import os
import random
import subprocess
import sys
from pathlib import Path
from typing import Any

PY = sys.executable


def run_job(worker: Path, cfg: dict[str, Any], env_extra: dict[str, str], work: Path, what: str,
            timeout: float, sim: Any = None, nproc: int = 2) -> dict[str, Any]:
    """Rank 0's result of one run of ``worker`` (2 ranks per node; nodes = the simulated hosts, or this one)."""
    tag = f"{what.replace(' ', '-').replace(',', '')}-{len(list(work.iterdir()))}"
    out = work / f"{tag}.json"
    cfg_path = work / f"{tag}-cfg.json"
    cfg_path.write_text(json.dumps(dict(cfg, out=str(out))))
    env = {**os.environ, **env_extra}
    env.pop("COMMD_JOB", None)
    launch = [PY, "-m", "commd", "launch", "--nproc-per-node", str(nproc)]
    procs = []
    if sim is None:
        procs.append(subprocess.Popen([*launch, str(worker), str(cfg_path)], env=env, stdout=subprocess.DEVNULL,
                                      stderr=open(work / f"{tag}.log", "w")))  # noqa: SIM115 - the child owns it
    else:
        master = f"{sim.hosts[0].ip}:{random.randint(20000, 40000)}"
        for i, host in enumerate(sim.hosts):
            argv = [*launch, "--nnodes", str(len(sim.hosts)), "--node-rank", str(i), "--master", master,
                    "--node-name", host.name, str(worker), str(cfg_path)]
            # the host's own COMMD_NODE and COMMD_RUNTIME_DIR win over the caller's environment: with
            # one COMMD_RUNTIME_DIR for both, the hosts' daemons of one job would share a socket path
            procs.append(host.popen(argv, env={**env, **host.env}, stdout=subprocess.DEVNULL,
                                    stderr=open(work / f"{tag}-n{i}.log", "w")))  # noqa: SIM115
    for proc in procs:
        try:
            code = proc.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            for p in procs:
                p.kill()
            raise SystemExit(f"{what}: no result within {timeout:.0f}s; logs in {work}/{tag}*.log") from None
        if code != 0:
            raise SystemExit(f"{what}: a launcher exited with {code}; logs in {work}/{tag}*.log")
    return json.loads(out.read_text())
