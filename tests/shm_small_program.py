"""A daemon and two ranks under a small /dev/shm: a 40 MiB all-reduce and a staged all-gather.

Run by tests/test_shm_safety.py inside a private mount namespace whose /dev/shm
is a 64 MiB tmpfs (a container's default).  ``main`` starts the daemon (its
stderr is the job's daemon.log, as when a client starts it) and the ranks (this
file with ``--rank``), then writes what happened to each process as JSON: exit
codes (negative: killed by that signal), each rank's report, the daemon log.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from pathlib import Path

WORLD = 2
ALLREDUCE_ELEMENTS = 10 << 20  # 40 MiB of float32
ALLGATHER_ELEMENTS = 3 << 20  # 12 MiB of float32 per rank, 24 MiB gathered
RANK_TIMEOUT_S = 90.0


def rank_main(rank: int, job: str) -> int:
    """One rank: both ops on tensors outside the arena (staged), each result checked against NumPy."""
    import numpy as np
    import torch

    from commd.client import Client, CommdError, ops

    report: dict = {"rank": rank}
    try:
        client = Client(rank, WORLD, job=job, connect_timeout=30)
        client.register_group("world", list(range(WORLD)))
        base = np.arange(ALLREDUCE_ELEMENTS, dtype=np.float32) % 1000
        tensor = torch.from_numpy(base * (rank + 1))
        ops.all_reduce(client, tensor, timeout=60).wait(70)
        report["allreduce_ok"] = bool(np.array_equal(tensor.numpy(), base * sum(r + 1 for r in range(WORLD))))
        part = torch.from_numpy(np.full(ALLGATHER_ELEMENTS, rank + 1, dtype=np.float32))
        out = torch.zeros(WORLD * ALLGATHER_ELEMENTS, dtype=torch.float32)
        ops.all_gather(client, out, part, timeout=60).wait(70)
        want = np.repeat(np.arange(1, WORLD + 1, dtype=np.float32), ALLGATHER_ELEMENTS)
        report["allgather_ok"] = bool(np.array_equal(out.numpy(), want))
        client.close()
    except (CommdError, MemoryError) as exc:
        report["error"] = f"{type(exc).__name__}: {exc}"
    print(json.dumps(report), flush=True)
    return 0


def main(runtime_dir: str, job: str, result_path: str) -> int:
    os.environ["COMMD_RUNTIME_DIR"] = runtime_dir
    from commd.client.spawn import ping
    from commd.runtime import JobPaths

    paths = JobPaths(job, Path(runtime_dir) / job).ensure()
    with open(paths.log_file, "ab") as log:
        daemon = subprocess.Popen([sys.executable, "-m", "commd", "daemon", "--job", job], stdin=subprocess.DEVNULL,
                                  stdout=log, stderr=log)
    result: dict = {"shm": os.statvfs("/dev/shm").f_blocks * os.statvfs("/dev/shm").f_frsize, "ranks": {}}
    try:
        deadline = time.monotonic() + 60
        while ping(paths, 0.2) != daemon.pid:
            if daemon.poll() is not None or time.monotonic() > deadline:
                raise RuntimeError(f"the daemon did not start (exit code {daemon.poll()})")
            time.sleep(0.05)
        ranks = [subprocess.Popen([sys.executable, __file__, "--rank", str(r), "--job", job],
                                  stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
                 for r in range(WORLD)]
        for r, proc in enumerate(ranks):
            try:
                output, _ = proc.communicate(timeout=RANK_TIMEOUT_S)
            except subprocess.TimeoutExpired:
                proc.kill()
                output, _ = proc.communicate()
            result["ranks"][r] = {"rc": proc.returncode, "output": output[-4000:]}
        result["daemon_alive"] = daemon.poll() is None
    except RuntimeError as exc:
        result["error"] = str(exc)
    finally:
        if daemon.poll() is None:
            daemon.terminate()
            try:
                daemon.wait(20)
            except subprocess.TimeoutExpired:
                daemon.kill()
                daemon.wait()
        result["daemon_rc"] = daemon.returncode
        result["daemon_log"] = paths.log_file.read_text(errors="replace")[-8000:]
        Path(result_path).write_text(json.dumps(result))
    return 0


if __name__ == "__main__":
    parser = argparse.ArgumentParser()
    parser.add_argument("--rank", type=int)
    parser.add_argument("--job", required=True)
    parser.add_argument("--runtime-dir")
    parser.add_argument("--result")
    args = parser.parse_args()
    if args.rank is not None:
        sys.exit(rank_main(args.rank, args.job))
    sys.exit(main(args.runtime_dir, args.job, args.result))
